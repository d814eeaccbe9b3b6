"""`LLM`: offline batch generation and chat over one `LLMEngine`."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tqdm.auto import tqdm

from bcg.config import EngineConfig
from bcg.engine.llm_engine import LLMEngine
from bcg.engine.outputs import RequestOutput
from bcg.engine.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]

logger = logging.getLogger(__name__)


class LLM:
    """`LLM(model=..., **engine_args)`; the arguments are the fields of `EngineConfig`."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come in prompt order.
        Every prompt is validated before any runs, so bad input raises and runs nothing."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        ids = self.engine.add_requests(prompts, params)
        finished = self._run(len(ids), use_tqdm)
        return [finished[i] for i in ids]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation or to each of several, each
        a list of {"role", "content"} messages rendered with the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.apply_chat_template(c) for c in conversations],
                             sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        """The token ids of one conversation rendered with the tokenizer's chat template."""
        return self.engine.chat_token_ids(messages)

    def _run(self, num_requests: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=num_requests, desc="Generating", disable=not use_tqdm,
                  dynamic_ncols=True) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step(finished_only=True):
                    finished[output.request_id] = output
                    bar.update(1)
                stats = self.engine.stats
                bar.set_postfix_str(f"prefill {stats.prefill_throughput:.0f} tok/s, "
                                    f"decode {stats.decode_throughput:.0f} tok/s", refresh=False)
        logger.info("forwards so far: %s", dict(self.engine.runner.forward_counts))
        return finished


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    return list(prompts)


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    """One `SamplingParams` (or None, the defaults) for every prompt; a sequence is taken as is
    (`LLMEngine.add_requests` checks that it has one per prompt)."""
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    return list(params)
