"""LLMEngine: requests in, one scheduled model step at a time, outputs out.

`add_request` (or `add_requests`, all or none), `step`, `abort_request` and
`has_unfinished_requests` are the whole API a driver needs (the offline `LLM` loop, the
HTTP server). A request that fails validation raises and leaves every other request
untouched.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Mapping, Sized
from dataclasses import dataclass, replace
from typing import Any

import jinja2
import torch

from bcg.config import EngineConfig, FieldError, require, require_field
from bcg.distributed import rank_loop
from bcg.distributed.launcher import Workers, check_tensor_parallel_size
from bcg.distributed.parallel_state import launched_rank
from bcg.engine.block_manager import BlockManager
from bcg.engine.chat import DEFAULT_CHAT, ChatOptions, template_messages
from bcg.engine.detokenizer import IncrementalDetokenizer, fast_backend
from bcg.engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from bcg.engine.sampling_params import SamplingParams
from bcg.engine.scheduler import Scheduler, SchedulerOutput
from bcg.engine.sequence import Sequence
from bcg.loader.tokenizer import load_tokenizer
from bcg.models.presets import PRESETS
from bcg.runner.model_runner import StepResult
from bcg.runner.startup import resolve_max_model_len, start_runner
from bcg.timing import startup_step, take_startup_steps
from bcg.utils import invalid_unicode, is_token_id

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Token counts and wall time so far; a step's time counts as prefill if it had any."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    num_preemptions: int = 0

    @property
    def prefill_throughput(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_throughput(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


def check_one_per_prompt(prompts: Sized, params: Sized) -> None:
    require(len(prompts) == len(params),
            f"got {len(params)} sampling params for {len(prompts)} prompts: pass one per prompt")


@dataclass
class _IssuedStep:
    """A step the device runs or ran: what was scheduled, the sequences that sample in it
    (in order), and the runner's result, whose tokens arrive when read."""

    scheduled: SchedulerOutput
    sampled: list[Sequence]
    result: StepResult

    def needs_tokens_to_schedule(self) -> bool:
        """Whether the next step must wait for these tokens on the host (penalties read them)."""
        return any(seq.sampling_params.has_penalties for seq in self.sampled)


@dataclass
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None  # None: no tokenizer, no text
    prompt: str | None  # the prompt text, if it came as text
    logprobs: list[PositionLogprobs] | None = None  # per generated token, if asked for
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # per prompt token
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it


def prefix_caching_enabled(config: EngineConfig, num_state_slots: int) -> bool:
    """Prefix caching as `config` asks, but off for a model with recurrent state (state
    slots): a cached prefix's KV blocks do not bring back the state after it (the prefix
    would be skipped, its state never computed)."""
    return config.enable_prefix_caching and num_state_slots == 0


NAME_A_TOKENIZER = "name one (tokenizer=... in Python, --tokenizer on the command line)"


def _tokens(count: int) -> str:
    return f"{count} token" if count == 1 else f"{count} tokens"


class BadPromptError(ValueError):
    """A prompt (or its sampling params) of `add_requests` is refused: `index` names it, and
    `field` the sampling param at fault, if one is."""

    def __init__(self, index: int, reason: str, field: str | None = None) -> None:
        super().__init__(f"prompt {index}: {reason}")
        self.index, self.reason, self.field = index, reason, field


class LLMEngine:
    """Rank 0 of `config.tensor_parallel_size` ranks: the scheduler, the tokenizer and the
    API live here; the other ranks (spawned here, or started by torchrun) follow its steps.
    `close()` (or the engine's collection, or the process's exit) ends them."""

    def __init__(self, config: EngineConfig) -> None:
        if config.tensor_parallel_size > 1 and (launched_rank() or 0) > 0:
            # torchrun started this process as a worker rank: it follows rank 0, then the
            # process ends here. In the constructor, not in each entry point, because a
            # user's own script (`LLM(...)` under torchrun) is an entry point too.
            rank_loop.launched_worker_main(config)
        self.config = config
        start = time.perf_counter()
        take_startup_steps()  # an earlier engine's, or one that failed to start
        source = config.model_source()
        if config.model in PRESETS and config.load_format != "dummy":
            # here, not where every rank resolves the model: one warning, from rank 0
            logger.warning("%s is a preset: random weights, so what it generates is noise. "
                           "Pass --load-format dummy (load_format='dummy') to ask for that, or "
                           "a model folder, .gguf file or Hub id for real weights", config.model)
        self.model_config = source.config
        self.max_model_len = resolve_max_model_len(config, source.config)
        check_tensor_parallel_size(config, source.config)
        with startup_step("tokenizer"):
            self.tokenizer = load_tokenizer(source, config.tokenizer, config.trust_remote_code)
        # Looked up (or refused) once at start-up, not per request.
        self._decoder = fast_backend(self.tokenizer) if self.tokenizer is not None else None
        self.eos_token_ids = set(source.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._workers = workers = Workers(config)
        try:
            with workers.failures_named():
                self.runner = start_runner(workers.config, source,
                                           tuple(sorted(self.eos_token_ids)))
        except BaseException:
            workers.close()
            raise
        workers.runner = self.runner
        self._close = weakref.finalize(self, workers.close)
        self.max_model_len = self.runner.max_model_len  # lowered if the KV cache is smaller
        block_manager = BlockManager(
            self.runner.num_kv_blocks, config.block_size, self._prefix_caching(config),
            num_state_slots=self.runner.num_state_slots,
        )
        self.scheduler = Scheduler(
            block_manager, config.max_num_seqs, config.max_num_batched_tokens
        )
        self.stats = EngineStats()
        self.overlap = config.overlaps_steps
        self._in_flight: _IssuedStep | None = None  # overlapped: the step the device runs
        self._requests: dict[str, _Request] = {}
        self._request_counter = itertools.count()
        self._token_texts: dict[int, str] = {}
        # Seconds of each start-up step on this rank (another rank's work shows as waiting
        # in the steps with collectives), and the whole.
        self.startup_seconds = {**take_startup_steps(), "total": time.perf_counter() - start}
        logger.info("engine ready in %.2f s: %s on %s (%s), max_model_len=%d",
                    self.startup_seconds["total"], source.name, self.runner.device,
                    self.runner.dtype, self.max_model_len)

    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request (text or token ids); return its id. Raises ValueError on bad input."""
        self._require_open()
        sampling_params = sampling_params or SamplingParams()
        require(isinstance(sampling_params, SamplingParams),
                f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        require(sampling_params.n == 1, "LLMEngine runs one sequence per request: add n "
                "requests (LLM.generate and the server do this for SamplingParams.n)")
        if request_id is None:
            request_id = next(i for i in map(str, self._request_counter) if i not in self._requests)
        require(request_id not in self._requests, f"request id {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        if sampling_params.max_tokens is None:
            sampling_params = self._up_to_max_model_len(sampling_params, len(token_ids))
        self._check_prompt(token_ids, sampling_params)
        generator = None
        if sampling_params.seed is not None:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(sampling_params.seed)
        seq = Sequence(request_id, token_ids, sampling_params, generator)
        detokenizer = (
            IncrementalDetokenizer(self._decoder, sampling_params.stop,
                                   sampling_params.skip_special_tokens,
                                   sampling_params.include_stop_str_in_output)
            if self._decoder is not None else None
        )
        text = prompt if isinstance(prompt, str) else None
        self._requests[request_id] = _Request(
            seq, detokenizer, text,
            logprobs=[] if sampling_params.logprobs is not None else None,
            prompt_logprobs=[None] if sampling_params.prompt_logprobs is not None else None)
        self.scheduler.add(seq)
        return request_id

    def add_requests(
        self, prompts: list[str | list[int]], params: list[SamplingParams]
    ) -> list[str]:
        """Queue one request per (prompt, params), all or none: on bad input, drop the ones
        already queued and raise ValueError naming the first bad prompt's index."""
        check_one_per_prompt(prompts, params)
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(self.add_request(prompt, p))
        except BaseException as error:
            for request_id in ids:
                self.abort_request(request_id)
            if isinstance(error, ValueError):
                field = error.field if isinstance(error, FieldError) else None
                raise BadPromptError(len(ids), str(error), field) from error
            raise
        return ids

    def chat_token_ids(self, messages: list[Mapping[str, Any]],
                       options: ChatOptions = DEFAULT_CHAT) -> list[int]:
        """A conversation (`{"role", "content"}` messages, content a string or text parts)
        rendered with the chat template (the tokenizer's, unless `options` gives one) and
        tokenized; by default ready for the assistant's reply."""
        return self.encode_chat(self.chat_text(messages, options), options)

    def encode_chat(self, text: str, options: ChatOptions = DEFAULT_CHAT) -> list[int]:
        """`chat_text`'s text as token ids (special tokens added if `options` asks)."""
        return self.tokenizer.encode(text, add_special_tokens=options.add_special_tokens)

    def chat_text(self, messages: list[Mapping[str, Any]],
                  options: ChatOptions = DEFAULT_CHAT) -> str:
        """The text `chat_token_ids` tokenizes: the conversation through the chat template."""
        require(self.tokenizer is not None,
                f"this model has no tokenizer, which a chat needs: {NAME_A_TOKENIZER}")
        require(options.chat_template is not None or self.tokenizer.chat_template is not None,
                "this model's tokenizer has no chat template: pass one (chat_template; "
                "--chat-template on the command line) or "
                "send plain text prompts")
        conversation = template_messages(messages)
        try:
            text = self.tokenizer.apply_chat_template(conversation,
                                                      **options.template_arguments())
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(f"the chat template is not valid Jinja (line {error.lineno}): "
                             f"{error.message}; fix the template") from error
        except (jinja2.TemplateError, ValueError, TypeError) as error:
            raise ValueError(f"the chat template rejected the messages: {error}") from error
        except RecursionError:  # the template's data is copied recursively
            raise ValueError("the chat template cannot render values nested this deeply: "
                             "send messages and chat_template_kwargs of fewer levels") from None
        return text

    def chat_prompt(self, messages: list[Mapping[str, Any]],
                    options: ChatOptions = DEFAULT_CHAT) -> tuple[str, list[int]]:
        """`chat_text` and its ids, for a prompt to generate from: a template that rendered
        nothing is named (the empty prompt's own error would blame the caller's prompt)."""
        text = self.chat_text(messages, options)
        ids = self.encode_chat(text, options)
        require(ids != [], "the chat template rendered these messages as an empty prompt: "
                "check the template")
        return text, ids

    def abort_request(self, request_id: str) -> None:
        """Drop a request (waiting or running) and free its blocks; unknown ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.scheduler.finish(request.seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one model step; return an output for each request that got a new token, or
        with `finished_only` for each request that finished: a caller that waits for whole
        requests then skips copying every running request's tokens and text each step.

        With overlapped steps the outputs are those of the step before, whose tokens the
        host reads only after it has issued this one: the device never waits for the host."""
        self._require_open()
        start = time.perf_counter()
        outputs: list[RequestOutput] = []
        if self._in_flight is not None and self._in_flight.needs_tokens_to_schedule():
            outputs += self._complete(self._take_in_flight(), finished_only)
        scheduled = self.scheduler.schedule()
        issued = self._issue(scheduled) if scheduled.seqs else None
        if self._in_flight is not None:
            outputs += self._complete(self._take_in_flight(), finished_only)
        if issued is not None:
            self._count(scheduled, time.perf_counter() - start)
            if self.overlap:
                self._in_flight = issued
            else:
                outputs += self._complete(issued, finished_only)
        return outputs

    def _issue(self, scheduled: SchedulerOutput) -> _IssuedStep:
        """Start the step on the device; each sequence that samples gets a pending token
        (the runner feeds the real one to the next step from the device)."""
        result = self._workers.run_step(self.runner.execute, scheduled.seqs,
                                        scheduled.num_new_tokens)
        sampled = self.scheduler.advance(scheduled)
        for row, seq in enumerate(sampled):
            if seq.sampling_params.max_tokens:  # else the prompt was only scored
                seq.append_pending_token(row)
        return _IssuedStep(scheduled, sampled, result)

    def _take_in_flight(self) -> _IssuedStep:
        issued, self._in_flight = self._in_flight, None
        return issued

    def _complete(self, issued: _IssuedStep, finished_only: bool) -> list[RequestOutput]:
        """Take an issued step's tokens (waiting for the device if it is still running):
        put them in place of their stand-ins, then stop checks, logprobs and outputs. A
        sequence that finished or was aborted since the step was issued drops its token."""
        result, live = issued.result, []
        for seq, token_id, logprobs in zip(issued.sampled, result.token_ids.tolist(),
                                           result.logprobs, strict=True):
            if seq.is_finished:
                continue
            if seq.sampling_params.max_tokens:
                seq.resolve_pending_token(token_id)
            live.append((seq, token_id, logprobs))
        for index, (position, scored) in result.prompt_logprobs.items():
            seq = issued.scheduled.seqs[index]
            if not seq.is_finished:
                self._record_prompt_logprobs(seq, position, scored)
        self.scheduler.cache_computed_blocks(issued.scheduled)
        outputs = []
        for seq, token_id, logprobs in live:
            if not seq.sampling_params.max_tokens:  # the prompt was only scored
                self.scheduler.finish(seq, "length")
            else:
                self._accept(seq, token_id, logprobs)
            if seq.is_finished or not finished_only:
                outputs.append(self._output(seq))
            if seq.is_finished:
                del self._requests[seq.request_id]
        return outputs

    def close(self) -> None:
        """End the tensor-parallel workers and leave their group (also done when the engine
        is collected or the process exits); the engine cannot step afterwards."""
        self._close()

    def _require_open(self) -> None:
        if not self._close.alive:
            raise RuntimeError("this engine is closed (close() was called): create a new one "
                               "to generate again")

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids: text is encoded, token ids are checked and copied."""
        if isinstance(prompt, str):
            require(prompt != "", "the prompt is empty")
            require(self.tokenizer is not None, f"this model has no tokenizer, which text "
                    f"needs: send token ids, or {NAME_A_TOKENIZER}")
            invalid = invalid_unicode(prompt)
            require(invalid is None, f"the prompt {invalid}: pass UTF-8 text")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        require(isinstance(prompt, list | tuple) and all(is_token_id(t) for t in prompt),
                "a prompt must be a string or a list of token ids (int)")
        return [int(t) for t in prompt]

    def _accept(self, seq: Sequence, token_id: int, logprobs) -> None:
        """The host has `seq`'s new token (in place): logprobs, detokenising, stop checks."""
        request = self._requests[seq.request_id]
        if request.logprobs is not None:
            request.logprobs.append(self._position_logprobs(token_id, logprobs))
            request.cumulative_logprob += logprobs[0]
        params = seq.sampling_params
        may_stop = seq.num_known_output_tokens >= params.min_tokens
        ends_text, token_stop_reason = self._stop_token(token_id, params)
        # As in vLLM, the EOS or stop token that ends the text is not in it, unless asked.
        stopped_by_text = (request.detokenizer is not None
                           and (not ends_text or params.include_stop_str_in_output)
                           and request.detokenizer.add(token_id, may_stop))
        if stopped_by_text:
            reason, request.stop_reason = "stop", request.detokenizer.stop_string
        elif ends_text:
            reason, request.stop_reason = "stop", token_stop_reason
        elif seq.num_known_output_tokens >= params.max_tokens:  # admission kept max_model_len
            reason = "length"
        else:
            return
        self.scheduler.finish(seq, reason)

    def _record_prompt_logprobs(self, seq: Sequence, position: int, scored: list) -> None:
        """Keep the logprobs of prompt tokens from `position` on, skipping those already kept
        (a preempted sequence computes its prompt again)."""
        recorded = self._requests[seq.request_id].prompt_logprobs
        assert position <= len(recorded), "prompt logprobs must arrive in order"
        for logprobs in scored[len(recorded) - position :]:
            token_id = seq.prompt_token_ids[len(recorded)]
            recorded.append(self._position_logprobs(token_id, logprobs))

    def _position_logprobs(self, token_id: int, scored) -> PositionLogprobs:
        """vLLM's form: the chosen token first, then the top alternatives, by token id."""
        logprob, rank, top = scored
        entries = {token_id: Logprob(logprob, rank, self._decode_token(token_id))}
        for rank_of_top, (top_id, top_logprob) in enumerate(top, start=1):
            entries.setdefault(top_id, Logprob(top_logprob, rank_of_top,
                                               self._decode_token(top_id)))
        return entries

    def _decode_token(self, token_id: int) -> str | None:
        """A token's text, decoded once per engine (logprobs name thousands a step)."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _stop_token(self, token_id: int, params: SamplingParams) -> tuple[bool, int | None]:
        """Whether `token_id` ends the text (EOS or a stop token), and vLLM's stop_reason for
        it: the stop token's id; None for EOS."""
        if token_id in self.eos_token_ids and not params.ignore_eos:
            return True, None
        if token_id in params.stop_token_ids:
            return True, token_id
        return False, None

    def _output(self, seq: Sequence) -> RequestOutput:
        request = self._requests[seq.request_id]
        detokenizer = request.detokenizer
        logprobs = request.logprobs
        completion = CompletionOutput(
            index=0,
            text=detokenizer.visible_text(seq.is_finished) if detokenizer else "",
            token_ids=seq.output_token_ids,
            finish_reason=seq.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=None if logprobs is None else list(logprobs),
            cumulative_logprob=None if logprobs is None else request.cumulative_logprob,
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=request.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion],
            finished=seq.is_finished,
            num_cached_tokens=seq.num_cached_tokens,
            prompt_logprobs=request.prompt_logprobs,
        )

    def _check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        require(len(token_ids) > 0, "the prompt is empty")
        vocab_size = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:  # the hint only then: len() of a tokenizer is not free
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
                             + self._tokenizer_mismatch(vocab_size))
        bad_bias = [t for t in params.logit_bias or {} if t >= vocab_size]
        require_field("logit_bias", not bad_bias, f"logit_bias names token ids {bad_bias[:5]} "
                      f"outside the vocabulary [0, {vocab_size})")
        require(len(token_ids) + params.max_tokens <= self.max_model_len,
                f"the prompt's {_tokens(len(token_ids))} plus max_tokens={params.max_tokens} "
                f"exceed max_model_len={self.max_model_len}: lower max_tokens or shorten the "
                "prompt")

    def _tokenizer_mismatch(self, vocab_size: int) -> str:
        """Why text may encode to ids the model lacks: a tokenizer larger than its vocabulary."""
        size = 0 if self.tokenizer is None else len(self.tokenizer)
        if size <= vocab_size:
            return ""
        return (f"; the tokenizer has {size} tokens, more than the model's {vocab_size}: if the "
                f"ids came from text, pass the model's own tokenizer (tokenizer=..., "
                f"--tokenizer)")

    def _up_to_max_model_len(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """`params` with max_tokens=None made the room max_model_len leaves after the prompt."""
        room = self.max_model_len - prompt_len
        how = ("fill" if room == 0 else "exceed") + ("s" if prompt_len == 1 else "")
        require(room > 0, f"the prompt's {_tokens(prompt_len)} {how} max_model_len="
                f"{self.max_model_len}, which leaves no room to generate: shorten the prompt")
        require_field("min_tokens", params.min_tokens <= room,
                      f"min_tokens={params.min_tokens} is more than the {room} tokens "
                      f"max_model_len={self.max_model_len} leaves after the prompt's "
                      f"{prompt_len}: lower min_tokens or shorten the prompt")
        return replace(params, max_tokens=room)

    def _count(self, scheduled: SchedulerOutput, seconds: float) -> None:
        # Counted once the step is issued: a decode's one token follows its whole prompt.
        decode = sum(n for s, n in zip(scheduled.seqs, scheduled.num_new_tokens, strict=True)
                     if n == 1 and s.num_computed_tokens > s.num_prompt_tokens)
        prefill = scheduled.num_tokens - decode
        self.stats.decode_tokens += decode
        self.stats.prefill_tokens += prefill
        self.stats.num_preemptions += scheduled.num_preempted
        if prefill:
            self.stats.prefill_seconds += seconds
        else:
            self.stats.decode_seconds += seconds

    def _prefix_caching(self, config: EngineConfig) -> bool:
        enabled = prefix_caching_enabled(config, self.runner.num_state_slots)
        if config.enable_prefix_caching and not enabled:
            logger.info("prefix caching is off: %s keeps recurrent (Mamba) state, which "
                        "cached KV blocks cannot restore", self.model_config.architecture)
        return enabled
