"""Text in, text out on the built-in SmolLM2: chat, stop strings, detokenization, bad input."""

import jinja2
import pytest

from bcg.engine.chat import ChatOptions
from bcg.engine.detokenizer import IncrementalDetokenizer, fast_backend
from bcg.engine.llm import LLM
from bcg.engine.sampling_params import SamplingParams
from tests.builtin_model import require_builtin_model

GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def llm():
    require_builtin_model()
    return LLM(device="cpu", max_model_len=512)


def test_chat_answers_the_question(llm):
    [out] = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY,
                     use_tqdm=False)
    assert "Paris" in out.outputs[0].text and out.outputs[0].finish_reason == "stop"
    # as in vLLM, the prompt is the rendered conversation, whose tokens the prompt ids are
    assert out.prompt.endswith("What is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert llm.get_tokenizer().encode(out.prompt) == out.prompt_token_ids


QUESTION = "What is the capital of France?"


def test_chat_takes_openai_text_parts_and_refuses_other_content(llm):
    parts = [{"type": "text", "text": "What is the capital"},
             {"type": "text", "text": "of France?"}]
    # joined by newlines, as vLLM joins them
    joined = {"role": "user", "content": QUESTION.replace(" of", "\nof")}
    assert llm.apply_chat_template([{"role": "user", "content": parts}]) == \
        llm.apply_chat_template([joined])
    [answer] = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)
    assert "Paris" in answer.outputs[0].text
    refused = [(5, "message 0: content must be a string or a list of text parts"),
               (["hi"], "text parts .*, got a list holding str"),
               ([{"type": "image_url", "image_url": {}}], "parts of type image_url are not"),
               ([{"type": "text", "text": 3}], "content parts must each have a string 'text'"),
               (None, "a user message needs content")]
    for content, message in refused:
        with pytest.raises(ValueError, match=message):
            llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="message 1: a message is a dict with a 'role'"):
        llm.chat([{"role": "user", "content": "hi"}, {"content": "no role"}], GREEDY)


def test_chat_options_as_vllm_names_them(llm):
    """continue_final_message goes on from an open assistant message, chat_template replaces
    the tokenizer's, chat_template_kwargs reach the template; contradictions are refused."""
    turns = [{"role": "user", "content": QUESTION},
             {"role": "assistant", "content": "The capital of France is"}]
    [continued] = llm.chat(turns, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                           add_generation_prompt=False, continue_final_message=True)
    assert continued.outputs[0].text.strip().startswith("Paris")
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{{ suffix }}"
    ids = llm.apply_chat_template(turns[:1], ChatOptions(chat_template=template,
                                                         chat_template_kwargs={"suffix": "A:"}))
    assert llm.tokenizer.decode(ids) == f"user: {QUESTION}\nA:"
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(turns, GREEDY, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_kwargs must map"):
        llm.chat(turns[:1], GREEDY, chat_template_kwargs=["x"])
    with pytest.raises(ValueError, match="may not set conversation, messages"):
        llm.chat(turns[:1], GREEDY, chat_template_kwargs={"messages": [], "conversation": 1})


def test_a_tokenizer_without_a_chat_template_takes_one_passed(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    chat = [{"role": "user", "content": QUESTION}]
    with pytest.raises(ValueError, match="no chat template: pass one .* or send plain text"):
        llm.chat(chat, GREEDY, use_tqdm=False)
    [out] = llm.chat(chat, GREEDY, use_tqdm=False, chat_template="{{ messages[0].content }}")
    assert out.prompt_token_ids == llm.tokenizer.encode(QUESTION, add_special_tokens=False)


def test_get_tokenizer_is_vllms(llm):
    assert llm.get_tokenizer() is llm.tokenizer is not None


def test_stop_string_ends_the_text_before_it(llm):
    [full] = llm.generate(["The days of the week are Monday,"], GREEDY, use_tqdm=False)
    stop = full.outputs[0].text[10:14]
    params = SamplingParams(temperature=0, max_tokens=16, stop=[stop, "never-appears"])
    [cut] = llm.generate(["The days of the week are Monday,"], params, use_tqdm=False)
    assert cut.outputs[0].finish_reason == "stop"
    assert cut.outputs[0].text == full.outputs[0].text[: full.outputs[0].text.index(stop)]
    assert stop not in cut.outputs[0].text


def test_stop_reason_names_what_ended_the_text_and_the_text_may_keep_it(llm):
    prompt = ["The days of the week are Monday,"]
    [full] = llm.generate(prompt, GREEDY, use_tqdm=False)
    text, token_ids = full.outputs[0].text, full.outputs[0].token_ids
    assert full.outputs[0].stop_reason is None  # max_tokens: finish_reason "length"
    stop = text[10:14]
    kept = SamplingParams(temperature=0, max_tokens=16, stop=["never-appears", stop],
                          include_stop_str_in_output=True)
    [cut] = llm.generate(prompt, kept, use_tqdm=False)
    assert cut.outputs[0].stop_reason == stop
    assert cut.outputs[0].text == text[: text.index(stop) + len(stop)]
    # A stop token: its text is left out unless asked for, as vLLM does.
    stop_token = token_ids[3]
    ends = token_ids.index(stop_token) + 1  # at its first appearance
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_token],
                                include_stop_str_in_output=include)
        [out] = llm.generate(prompt, params, use_tqdm=False)
        assert out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].stop_reason == stop_token
        assert out.outputs[0].token_ids == token_ids[:ends]
        assert out.outputs[0].text == llm.tokenizer.decode(token_ids[: ends - (not include)])


def test_eos_has_no_stop_reason_and_special_tokens_may_be_kept(llm):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    outputs = [llm.chat(question, SamplingParams(temperature=0, max_tokens=16,
                                                 skip_special_tokens=skip, stop=["Paris"],
                                                 include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0] for skip in (True, False)]
    assert outputs[0].stop_reason == outputs[1].stop_reason == "Paris"
    [answer] = llm.chat(question, GREEDY, use_tqdm=False)
    assert answer.outputs[0].finish_reason == "stop" and answer.outputs[0].stop_reason is None
    special = llm.tokenizer.all_special_ids
    [raw] = llm.generate([llm.tokenizer.decode([special[0]]) + " Hello"],
                         SamplingParams(temperature=0, max_tokens=4, skip_special_tokens=False,
                                        logit_bias={special[0]: 100}), use_tqdm=False)
    assert llm.tokenizer.decode([special[0]]) in raw.outputs[0].text


def test_incremental_text_equals_a_full_decode(llm):
    tokenizer = llm.tokenizer
    text = "Unicode: café, 東京, emoji 😀👍 and   spaces\nnew line."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(fast_backend(tokenizer), stop=[])
    for token_id in ids:
        detokenizer.add(token_id)
        assert "\ufffd" not in detokenizer.text
    assert detokenizer.text == tokenizer.decode(ids, skip_special_tokens=True) == text


def test_stop_string_spanning_tokens_is_found(llm):
    tokenizer = llm.tokenizer
    detokenizer = IncrementalDetokenizer(fast_backend(tokenizer), stop=["lazy dog"])
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog twice",
                           add_special_tokens=False)
    stopped_at = next(i for i, t in enumerate(ids) if detokenizer.add(t))
    assert detokenizer.text == "The quick brown fox jumps over the "
    assert stopped_at < len(ids) - 1


def test_stop_strings_are_not_looked_for_before_min_tokens(llm):
    tokenizer = llm.tokenizer
    detokenizer = IncrementalDetokenizer(fast_backend(tokenizer), stop=["fox"])
    ids = tokenizer.encode("The quick brown fox jumps over the fox", add_special_tokens=False)
    first_fox = next(i for i in range(len(ids)) if "fox" in tokenizer.decode(ids[: i + 1]))
    stops = [detokenizer.add(t, may_stop=i > first_fox) for i, t in enumerate(ids)]
    assert stops.index(True) == len(ids) - 1  # the second fox, not the first
    assert detokenizer.text == "The quick brown fox jumps over the "


def test_running_text_holds_back_a_possible_stop_string(llm):
    detokenizer = IncrementalDetokenizer(fast_backend(llm.tokenizer), stop=["STOP"])
    for token_id in llm.tokenizer.encode("Hello world, ST", add_special_tokens=False):
        detokenizer.add(token_id)
    assert detokenizer.visible_text(finished=False) == "Hello world,"
    assert detokenizer.visible_text(finished=True) == "Hello world, ST"


def test_empty_and_too_long_prompts_are_refused(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["word " * 600], GREEDY, use_tqdm=False)
    [ok] = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == 2


def test_text_that_is_not_valid_unicode_is_refused_by_name(llm):
    with pytest.raises(ValueError, match=r"prompt 1: the prompt holds a lone UTF-16 surrogate "
                                         r"\(\\udcff\) at character 5"):
        llm.generate(["Hello", "Once \udcff"], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="message 1: its content holds a lone UTF-16 surrogate"):
        llm.chat([{"role": "user", "content": "hi"},
                  {"role": "user", "content": [{"type": "text", "text": "caf\udce9"}]}], GREEDY,
                 use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_bytes_that_never_make_a_character_end_the_text_as_replacement_characters(llm):
    """SmolLM2 answers repeated emoji with halves of one (two tokens a character, the pair
    never completed): the text is what a full decode gives, not empty."""
    [out] = llm.generate(["\U0001f642" * 12], SamplingParams(temperature=0, max_tokens=16),
                         use_tqdm=False)
    completion = out.outputs[0]
    assert "\ufffd" in completion.text
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids)


def test_the_detokenizer_ends_unfinished_bytes_as_replacement_characters(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("\U0001f642", add_special_tokens=False)  # 4 bytes, 2 tokens
    assert len(ids) > 1
    detokenizer = IncrementalDetokenizer(fast_backend(tokenizer), stop=["x"])
    for token_id in ids[:-1]:  # the character without its last token
        assert not detokenizer.add(token_id)
    assert detokenizer.visible_text(finished=False) == ""  # maybe the rest comes
    assert detokenizer.visible_text(finished=True) == tokenizer.decode(ids[:-1]) == "\ufffd"
    assert detokenizer.visible_text(finished=True) == "\ufffd"  # once, however often asked


def test_eos_ends_the_request_unless_ignored(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    [stopped] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    stopped = stopped.outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == llm.tokenizer.eos_token_id
    ignoring = SamplingParams(temperature=0, max_tokens=len(stopped.token_ids) + 3,
                              ignore_eos=True)
    [longer] = llm.chat(messages, ignoring, use_tqdm=False)
    assert longer.outputs[0].finish_reason == "length"
    assert longer.outputs[0].token_ids[: len(stopped.token_ids)] == stopped.token_ids


def test_tokenizer_without_a_fast_backend_is_refused():
    class SlowTokenizer:  # what a pure-Python tokenizer looks like to the engine
        pass

    with pytest.raises(ValueError, match="fast"):
        fast_backend(SlowTokenizer())


def test_a_chat_template_error_is_a_value_error(llm, monkeypatch):
    def reject(*args, **kwargs):
        raise jinja2.TemplateError("no system messages here")

    monkeypatch.setattr(llm.engine.tokenizer, "apply_chat_template", reject)
    with pytest.raises(ValueError, match="rejected the messages: no system messages here"):
        llm.chat([{"role": "system", "content": "hi"}], GREEDY, use_tqdm=False)


def test_a_chat_template_that_is_not_jinja_is_named(llm):
    with pytest.raises(ValueError, match=r"not valid Jinja \(line 1\).*fix the template"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False,
                 chat_template="{% if %}")


def test_chat_input_of_the_wrong_shape_is_named(llm, tmp_path):
    """A message not in a list, a bad conversation among several (named by its index),
    options that are not ChatOptions, a template that renders nothing; a chat_template that
    names a file is read as the command line reads it, and text that is neither a file nor a
    template is refused instead of becoming the prompt."""
    message = {"role": "user", "content": QUESTION}
    for bare in (message, QUESTION):
        with pytest.raises(TypeError, match="wrap one message in a list"):
            llm.chat(bare, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="chat_template must be a Jinja template"):
        llm.chat([message], GREEDY, use_tqdm=False, chat_template=5)
    with pytest.raises(ValueError, match="conversation 1: message 0: a user message needs"):
        llm.chat([[message], [{"role": "user"}]], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="options must be a ChatOptions"):
        llm.apply_chat_template([message], {"add_generation_prompt": False})
    with pytest.raises(ValueError, match="rendered these messages as an empty prompt"):
        llm.chat([message], GREEDY, use_tqdm=False, chat_template="{# nothing #}")
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        llm.chat([message], GREEDY, use_tqdm=False, chat_template="chatml")
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    [out] = llm.chat([message], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False,
                     chat_template=template)
    assert out.prompt == QUESTION
