"""ModelRunner: owns the model and its caches (the paged KV cache; a hybrid's recurrent
state cache too); turns scheduled sequences into tokens.

One step is `prepare` (scheduled sequences -> ForwardBatch), `forward` (the transformer
stack under the forward context; graph runners replace this part), then the head on the
rows to sample and the sampler. The runner knows sequences only through `ScheduledSequence`.

Under tensor parallelism every rank holds a runner over its part of the model. Rank 0's
`execute` sends the step's plan (`StepPlan`) to the other ranks, whose `run_plan` runs the
same forward and head (the KV cache is written on every rank); only rank 0 samples.

With overlapped steps a step may compute tokens the host does not have yet: they stay on the
device as the last step's samples (broadcast from rank 0 to every rank), and `run_plan`
writes them into the step's input ids there.
"""

from __future__ import annotations

import gc
import itertools
import logging
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bcg.config import EngineConfig
from bcg.distributed.custom_all_reduce import use_custom_all_reduce
from bcg.distributed.expert_parallel import set_expert_parallel
from bcg.distributed.parallel_state import set_custom_all_reduce, tensor_parallel
from bcg.distributed.step_channel import open_step_channel
from bcg.distributed.symm_mem import use_torch_symm_mem
from bcg.forward import (
    ForwardBatch,
    ForwardContext,
    KVCache,
    MambaStateCache,
    set_forward_context,
)
from bcg.kernels._launch import hash_triton_in_background
from bcg.layers.attention_backend import attention_backend
from bcg.layers.mamba_backend import mamba_backend
from bcg.layers.sampler import MAX_LOGPROBS, Sampler, token_logprobs
from bcg.loader.model_loader import load_model
from bcg.loader.model_source import ModelSource
from bcg.runner import host
from bcg.runner.batch import (
    ScheduledSequence,
    SyntheticSequence,
    build_batch,
    build_host_batch,
    pending_token_rows,
    samples_this_step,
    upload_longs,
)
from bcg.runner.decode_graph import DecodeGraphRunner
from bcg.runner.graph_runner import GraphRunner, StackSpec, frozen_gc
from bcg.runner.host import (
    CPU_KV_CACHE_FRACTION_ASKED,
    cpu_kv_cache_budget,
    warn_if_cores_contended,
)
from bcg.runner.prefill_graph import PrefillGraphRunner
from bcg.runner.sampling import (
    PositionLogprobs,
    SampledTokens,
    SamplingContext,
    build_sampling_batch,
    to_python,
)
from bcg.runner.step_plan import StepPlan
from bcg.timing import startup_step
from bcg.utils import cdiv

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    token_ids: SampledTokens  # the sampled token of each sequence that samples, in order
    logprobs: list[PositionLogprobs | None]  # of each sampled token, where asked for
    # Sequence index -> (position of its first scored prompt token, their logprobs), for the
    # sequences asking for prompt logprobs whose prompt this step computed.
    prompt_logprobs: dict[int, tuple[int, list[PositionLogprobs]]]


@dataclass
class _PromptScoring:
    """The prompt tokens a step scores: hidden-state rows, the token each row predicts,
    alternatives wanted per row, and per sequence index (first scored position, offset into
    the rows, count)."""

    rows: array  # 'q'
    targets: list[int]
    tops: list[int]
    spans: dict[int, tuple[int, int, int]]


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = config.max_num_seqs
        if self.device.type == "cuda":
            hash_triton_in_background()
            # A closed engine's blocks back to the GPU before this one sizes its caches from
            # free memory: unreachable ones may wait for the collector.
            gc.collect()
            torch.cuda.empty_cache()
        with startup_step(f"weights ({config.load_format})"):
            # Before the model is built: its layers take their experts and collectives as set.
            set_expert_parallel(config.enable_expert_parallel, config.ep_dispatch,
                                fixed_block_tokens=config.alltoall_fixed_block_tokens)
            self._custom_all_reduce = (
                use_torch_symm_mem(config.enable_torch_symm_mem, self.dtype, self.device)
                or use_custom_all_reduce(not config.disable_custom_all_reduce, self.dtype,
                                         self.device))
            self.model = load_model(source, self.dtype, self.device, config.seed)
        self.model_config = c = source.config
        tp = tensor_parallel()  # this rank's heads
        self.step_channel = open_step_channel(tp) if tp.size > 1 else None
        self.num_heads = tp.shard(c.num_attention_heads, "num_attention_heads")[1]
        self.num_kv_heads = tp.kv_heads(c.num_key_value_heads)
        self.attention = attention_backend(self.device, self.num_heads, self.num_kv_heads,
                                           c.head_dim)
        # Allocated before anything is measured, so the KV cache is sized around it.
        self.state_cache = self._allocate_state_cache(config, max_model_len)
        self.mamba = mamba_backend(self.device) if self.state_cache is not None else None
        self.sampler = Sampler()
        # Overlapped steps: the last step's sampled ids stay here, on the device, for the
        # next step's tokens the host does not have yet (every rank keeps them).
        self.overlap = config.overlaps_steps
        self._samples: torch.Tensor | None = None
        self.sampling = SamplingContext(self.device, c.vocab_size, tuple(eos_token_ids))
        self.forward_counts: Counter[str] = Counter()
        # Prefill graphs never touch the cache inside a segment, so they are captured against a
        # one-block stand-in before the cache is sized: their pool is then counted as used.
        self.kv_cache = self._new_kv_cache(1)
        self.graph_runners: list[GraphRunner] = []  # tried in order; decode first
        with frozen_gc():  # start-up's collections then scan only the objects it made
            self._capture_graphs_and_size_cache(config, max_model_len)

    def _capture_graphs_and_size_cache(self, config: EngineConfig, max_model_len: int) -> None:
        prefill = self._prefill_graph_runner(config)
        if prefill is not None:
            with startup_step("prefill graphs"):
                prefill.capture_all()
            self.graph_runners.append(prefill)
        decode = self._decode_graph_runner(config, max_model_len, prefill)
        # Decode graphs bake the cache in, so they are captured after it is sized. In the
        # prefill graphs' pool they reuse its scratch and need no room of their own; in a pool
        # of their own, it is measured first (a throw-away capture) and set aside.
        decode_pool_bytes = 0
        if decode is not None and (prefill is None or decode.pool is not prefill.pool):
            with startup_step("decode graph pool measured"):
                decode_pool_bytes = decode.measure_pool_bytes()
        with startup_step("KV cache sized and allocated"):
            self.kv_cache = self._allocate_kv_cache(config, max_model_len, decode_pool_bytes)
        if decode is not None:
            with startup_step("decode graphs"):
                decode.capture_all()
            self.graph_runners.insert(0, decode)

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def num_state_slots(self) -> int:
        """Sequences that can hold recurrent state at once (0: the model has none)."""
        return 0 if self.state_cache is None else self.state_cache.num_slots

    def _allocate_state_cache(self, config: EngineConfig,
                              max_model_len: int) -> MambaStateCache | None:
        """One slot per sequence that may run at once (max_num_seqs), for a hybrid."""
        c, m = self.model_config, self.model_config.mamba
        if c.num_mamba_layers == 0:
            return None
        tp = tensor_parallel()
        shape = dict(num_layers=c.num_mamba_layers, conv_kernel=m.conv_kernel,
                     conv_dim=m.conv_dim // tp.size, num_heads=m.num_heads // tp.size,
                     head_dim=m.head_dim, state_size=m.state_size, dtype=self.dtype)
        self._check_state_slots_fit(config, max_model_len, MambaStateCache.bytes_per_slot(**shape))
        return MambaStateCache(num_slots=config.max_num_seqs, device=self.device, **shape)

    def _check_state_slots_fit(self, config: EngineConfig, max_model_len: int,
                               slot_bytes: int) -> None:
        """The slots come out of the caches' memory budget (gpu_memory_utilization's share
        left after the weights; on the CPU, the KV cache's budget), leaving at least the KV
        cache the engine needs: max_model_len tokens (or the kv_cache_tokens asked for)."""
        kv_tokens = config.kv_cache_tokens or max_model_len
        kv_bytes = cdiv(kv_tokens, self.block_size) * self._kv_block_bytes()
        if self.device.type == "cuda":
            budget, other_hint = self._gpu_budget_left(config), "raise gpu_memory_utilization"
            where = (f"gpu_memory_utilization={config.gpu_memory_utilization} of the GPU, "
                     "less what is in use")
        else:
            budget, where = cpu_kv_cache_budget(
                asked=config.max_model_len is not None or config.kv_cache_tokens is not None)
            other_hint = "lower max_model_len"
        fit = max(0, budget - kv_bytes) // slot_bytes
        if fit >= config.max_num_seqs:
            return
        hint = f"lower max_num_seqs to {fit} or less, or {other_hint}" if fit else other_hint
        raise ValueError(
            f"max_num_seqs={config.max_num_seqs} Mamba state slots ({slot_bytes / 2**20:.1f} MiB "
            f"each, {config.max_num_seqs * slot_bytes / 2**30:.2f} GiB) and {kv_tokens} tokens "
            f"of KV cache ({kv_bytes / 2**30:.2f} GiB) do not fit in the {budget / 2**30:.2f} "
            f"GiB left for the caches ({where}): {hint}")

    @property
    def stack_spec(self) -> StackSpec:
        """What a graph runner captures of this model."""
        return StackSpec(self.model, self.forward_context, self.device,
                         self.model_config.hidden_size, self.dtype, self.block_size,
                         self.state_cache is not None)

    def _prefill_graph_runner(self, config: EngineConfig) -> PrefillGraphRunner | None:
        if self.device.type != "cuda":
            if (config.decode_graph, config.prefill_graph) != ("none", "none"):
                logger.info("CUDA graphs need a CUDA device: every step runs eagerly on %s",
                            self.device)
            return None
        return PrefillGraphRunner.from_config(self.stack_spec, config)

    def _decode_graph_runner(self, config: EngineConfig, max_model_len: int,
                             prefill: PrefillGraphRunner | None) -> DecodeGraphRunner | None:
        if self.device.type != "cuda":
            return None
        # A decode step no larger than the largest prefill bucket fits in the prefill
        # graphs' scratch: the two kinds never replay at once, so they can share a pool.
        shares = prefill is not None and config.max_num_seqs <= prefill.max_size
        return DecodeGraphRunner.from_config(self.stack_spec, config, max_model_len,
                                             pool=prefill.pool if shares else None)

    @torch.inference_mode()
    def execute(self, seqs: list[ScheduledSequence], num_new_tokens: list[int]) -> StepResult:
        """Run one step (on rank 0, the other ranks running its plan): sample a token for each
        sequence whose last known token it computes."""
        scoring = _plan_prompt_scoring(seqs, num_new_tokens)
        batch = build_host_batch(seqs, num_new_tokens, self.block_size,
                                 stateful=self.state_cache is not None)
        pending = pending_token_rows(seqs, num_new_tokens) if self.overlap else array("q")
        plan = StepPlan(batch, scoring.rows, pending)
        if self.step_channel is not None:
            self.step_channel.send(plan.to_bytes())
        targets = torch.tensor(scoring.targets, device=self.device) if scoring.rows else None
        scored: list[PositionLogprobs] = []

        def score_prompt(start: int, logits: torch.Tensor) -> None:
            tops = scoring.tops[start : start + len(logits)]
            wanted = targets[start : start + len(logits)]
            scored.extend(to_python(token_logprobs(logits, wanted, max(tops)), tops))

        logits = self.run_plan(plan, score_prompt)
        prompt_logprobs = {i: (position, scored[offset : offset + count])
                           for i, (position, offset, count) in scoring.spans.items()}
        if logits is None:
            self.keep_samples(0)
            return StepResult(SampledTokens.none(), [], prompt_logprobs)
        sampling = [s for s, n in zip(seqs, num_new_tokens, strict=True) if samples_this_step(s, n)]
        token_ids = self.sampler(logits, build_sampling_batch(sampling, self.sampling))
        self.keep_samples(len(sampling), token_ids)
        return StepResult(SampledTokens(token_ids),
                          self._sample_logprobs(sampling, logits, token_ids), prompt_logprobs)

    def keep_samples(self, num_samples: int, token_ids: torch.Tensor | None = None) -> None:
        """With overlapped steps, keep this step's `num_samples` sampled ids on the device
        for the next step; rank 0 drew them (`token_ids`) and sends them to the other ranks."""
        if not self.overlap:
            return
        if num_samples and tensor_parallel().size > 1:
            if token_ids is None:
                token_ids = torch.empty(num_samples, dtype=torch.int64, device=self.device)
            tensor_parallel().broadcast(token_ids)
        self._samples = token_ids if num_samples else None

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan,
                 score_prompt: Callable[[int, torch.Tensor], None] | None = None
                 ) -> torch.Tensor | None:
        """The step's forward, then the head on its prompt rows (at most `max_num_seqs` at a
        time, as the memory profile covers: `score_prompt(first row, logits)` takes each
        chunk), then on its sampled rows, whose logits it returns (None if none). Every rank
        runs this, in the same order: the head gathers the vocabulary from all of them."""
        batch = plan.batch.upload(self.device)
        if plan.pending_rows:
            self._fill_pending_tokens(batch, plan.pending_rows)
        hidden_states = self.forward(batch)
        if plan.prompt_rows:
            rows = upload_longs(plan.prompt_rows, self.device)
            for start in range(0, len(rows), self.max_num_seqs):
                logits = self.model.compute_logits(
                    hidden_states[rows[start : start + self.max_num_seqs]])
                if score_prompt is not None:
                    score_prompt(start, logits)
        if not plan.batch.num_samples:
            return None
        # A pure decode samples every row: a view then, not a gather (a launch and a copy).
        rows = batch.sample_indices if plan.batch.num_samples < batch.num_tokens else slice(None)
        return self.model.compute_logits(hidden_states[rows])

    def _fill_pending_tokens(self, batch: ForwardBatch, pending_rows: array) -> None:
        """Write the tokens the host does not have yet (overlapped steps) into the batch's
        input ids, from the last step's samples: `pending_rows` pairs (input row, sample row)."""
        assert self._samples is not None, "a pending token but no samples from the last step"
        pairs = upload_longs(pending_rows, self.device).view(-1, 2)
        batch.input_ids[pairs[:, 0]] = self._samples[pairs[:, 1]]

    def _sample_logprobs(self, seqs: list[ScheduledSequence], logits: torch.Tensor,
                         token_ids: torch.Tensor) -> list[PositionLogprobs | None]:
        wanted = [i for i, seq in enumerate(seqs) if seq.sampling_params.logprobs is not None]
        result: list[PositionLogprobs | None] = [None] * len(seqs)
        if wanted:
            tops = [seqs[i].sampling_params.logprobs for i in wanted]
            index = torch.tensor(wanted, device=logits.device)
            scored = token_logprobs(logits[index], token_ids[index], max(tops))
            for i, position in zip(wanted, to_python(scored, tops), strict=True):
                result[i] = position
        return result

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The transformer stack on a forward batch: `[num_tokens, hidden]` hidden states,
        from the first graph runner that has a bucket for it, else eagerly."""
        for runner in self.graph_runners:
            bucket = runner.bucket_for(batch)
            if bucket is not None:
                self.forward_counts[f"{runner.kind} graph"] += 1
                return runner.run(batch, bucket)[: batch.num_tokens]
        self.forward_counts["eager"] += 1
        return self.forward_eager(batch)

    def forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        with set_forward_context(self.forward_context(batch)):
            return self.model(batch.input_ids, batch.positions)

    def forward_context(self, batch: ForwardBatch) -> ForwardContext:
        """What attention reads while the stack runs on `batch` (eagerly or replayed)."""
        return ForwardContext(batch, self.kv_cache, self.attention, self.attention.metadata(batch),
                              self.state_cache, self.mamba)

    def prepare(self, seqs: list[ScheduledSequence], num_new_tokens: list[int]) -> ForwardBatch:
        return build_batch(seqs, num_new_tokens, self.block_size, self.device,
                           stateful=self.state_cache is not None)

    def _allocate_kv_cache(
        self, config: EngineConfig, max_model_len: int, reserved_bytes: int = 0
    ) -> KVCache:
        num_blocks = self._num_kv_blocks(config, max_model_len, reserved_bytes)
        capacity = num_blocks * self.block_size
        gib = num_blocks * self._kv_block_bytes() / 2**30
        if capacity < max_model_len:
            if capacity == 0:
                raise ValueError(f"no memory is left for the KV cache: {self._kv_short_hint()}")
            if config.max_model_len is not None:
                raise ValueError(
                    f"the KV cache holds {capacity} tokens ({gib:.2f} GiB), fewer than "
                    f"max_model_len={max_model_len}: {self._kv_short_hint()}, or lower "
                    f"max_model_len (to {capacity} or less)"
                )
            # max_model_len was the model's context length by default: fit it to the cache.
            logger.warning("max_model_len lowered from the model's context length %d to %d "
                           "tokens, what the KV cache (%.2f GiB) holds: set max_model_len or "
                           "kv_cache_tokens to choose", max_model_len, capacity, gib)
            self.max_model_len = capacity
        state = "" if self.state_cache is None else (
            f"; Mamba state cache: {self.state_cache.num_slots} slots "
            f"({self.state_cache.nbytes / 2**30:.2f} GiB)")
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB)%s", num_blocks,
                    self.block_size, capacity, gib, state)
        return self._new_kv_cache(num_blocks)

    def _new_kv_cache(self, num_blocks: int) -> KVCache:
        c = self.model_config
        return KVCache(c.num_attention_layers, num_blocks, self.block_size, self.num_kv_heads,
                       c.head_dim, self.dtype, self.device)

    def _num_kv_blocks(self, config: EngineConfig, max_model_len: int, reserved_bytes: int) -> int:
        """What this rank's memory holds, or the least any rank's holds: all use one count."""
        local = self._local_num_kv_blocks(config, max_model_len, reserved_bytes)
        if config.kv_cache_tokens is not None and self.device.type != "cuda":
            # Every rank takes the least room: all of them raise, none waits for a peer.
            self._check_cpu_kv_fits(config.kv_cache_tokens, local,
                                    tensor_parallel().min_over_ranks(self._cpu_room_blocks()))
        return tensor_parallel().min_over_ranks(local)

    def _local_num_kv_blocks(self, config: EngineConfig, max_model_len: int,
                             reserved_bytes: int) -> int:
        if self.device.type != "cuda" and tensor_parallel().rank == 0:  # one warning, not N
            warn_if_cores_contended(config.tensor_parallel_size)
        if config.kv_cache_tokens is not None:
            return cdiv(config.kv_cache_tokens, self.block_size)
        if self.device.type != "cuda":
            return self._cpu_kv_blocks(config, max_model_len)
        return max(0, self._free_kv_bytes(config, max_model_len) - reserved_bytes) \
            // self._kv_block_bytes()

    def _cpu_kv_blocks(self, config: EngineConfig, max_model_len: int) -> int:
        """max_model_len tokens, within min(4 GiB, 25% of the available memory); a
        max_model_len the user set gets its tokens while they fit in 90% of it."""
        budget, self._cpu_kv_budget = cpu_kv_cache_budget(
            asked=config.max_model_len is not None, taken=self._state_bytes())
        return min(cdiv(max_model_len, self.block_size), budget // self._kv_block_bytes())

    def _cpu_room_blocks(self) -> int:
        """KV blocks of this rank's share (the ranks of a CPU group share one host) of what a
        max_model_len the user set may take; no limit where the memory is unknown."""
        if host.available_memory_bytes() is None:
            return 2**62
        budget, _ = cpu_kv_cache_budget(asked=True, taken=self._state_bytes())
        return budget // tensor_parallel().size // self._kv_block_bytes()

    def _state_bytes(self) -> int:
        """A hybrid's state slots, allocated before the KV cache and sharing its budget."""
        return 0 if self.state_cache is None else self.state_cache.nbytes

    def _check_cpu_kv_fits(self, tokens: int, blocks: int, room: int) -> None:
        """A CPU cache of `tokens` the user set goes past the default budgets, but not past
        the `room` memory has: there the allocator fails with a bare traceback, or the kernel
        ends the process as the zeros are written."""
        if blocks > room:
            block_bytes = self._kv_block_bytes()
            raise ValueError(
                f"kv_cache_tokens={tokens} needs {blocks * block_bytes / 2**30:.2f} GiB of KV "
                f"cache a rank, more than the {room * block_bytes / 2**30:.2f} GiB its share "
                f"of {CPU_KV_CACHE_FRACTION_ASKED:.0%} of the available memory holds: lower "
                f"kv_cache_tokens (to {room * self.block_size} or less)")

    def _kv_block_bytes(self) -> int:
        c = self.model_config
        return KVCache.bytes_per_block(c.num_attention_layers, self.block_size,
                                       self.num_kv_heads, c.head_dim, self.dtype)

    def _kv_short_hint(self) -> str:
        """How to get a larger cache, for the error when it cannot hold max_model_len."""
        if self.device.type == "cuda":
            hint = "raise gpu_memory_utilization or kv_cache_tokens"
        else:
            budget = getattr(self, "_cpu_kv_budget", None)
            hint = ("raise kv_cache_tokens" if budget is None
                    else f"the CPU cache may take {budget}; raise kv_cache_tokens")
        if self.state_cache is not None:
            hint += (f", or lower max_num_seqs (its {self.state_cache.num_slots} Mamba state "
                     f"slots take {self.state_cache.nbytes / 2**30:.2f} GiB)")
        return hint

    def _free_kv_bytes(self, config: EngineConfig, max_model_len: int) -> int:
        """Memory left for the KV cache: the allowed share of the GPU, minus what is in use now
        (weights, graph pools, other processes), minus the peak activations of the largest
        steps (`profiled_step_tokens`)."""
        with startup_step("activation profile"):
            activation_bytes = max(
                self._profile_activation_bytes(tokens, config.max_num_seqs, max_model_len)
                for tokens in profiled_step_tokens(config))
        return max(0, self._gpu_budget_left(config) - activation_bytes)

    def _gpu_budget_left(self, config: EngineConfig) -> int:
        """The gpu_memory_utilization share of the GPU minus what is in use now."""
        free, total = torch.cuda.mem_get_info(self.device)
        return int(total * config.gpu_memory_utilization) - (total - free)

    @torch.inference_mode()
    def _profile_activation_bytes(self, num_tokens: int, max_num_seqs: int,
                                  max_model_len: int) -> int:
        """Peak extra memory of the largest step: a forward of `num_tokens` prompt tokens in
        sequences as long as allowed (the largest attention), then sampling `max_num_seqs` rows
        the slowest way (penalties, top-p, logprobs)."""
        lengths = [min(max_model_len, num_tokens - start)
                   for start in range(0, num_tokens, max_model_len)]
        blocks_per_seq = cdiv(max_model_len, self.block_size)
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.kv_cache = self._new_kv_cache(blocks_per_seq * len(lengths))
        seqs = [SyntheticSequence([0] * n, list(range(i * blocks_per_seq,
                                                       (i + 1) * blocks_per_seq)))
                for i, n in enumerate(lengths)]
        hidden_states = self.forward(self.prepare(seqs, lengths))  # a graph if captured
        rows = min(max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden_states[:rows])
        sampled = self.sampler(logits, build_sampling_batch([seqs[0]] * rows, self.sampling))
        token_logprobs(logits, sampled, MAX_LOGPROBS)  # logprobs' peak too
        torch.cuda.synchronize(self.device)
        del self.kv_cache, hidden_states, logits
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        return peak - before

    def close(self) -> None:
        """Drop the graphs, the KV cache and the custom all-reduce: graphs that captured
        collectives must be gone before the process group is."""
        for runner in self.graph_runners:
            runner.release()
        self.graph_runners.clear()
        self.kv_cache = None
        mine = self._custom_all_reduce
        if mine is not None and tensor_parallel().custom_all_reduce is mine:
            set_custom_all_reduce(None)  # its buffer, once no graph holds its kernels


def _plan_prompt_scoring(seqs: list[ScheduledSequence],
                         num_new_tokens: list[int]) -> _PromptScoring:
    """Which rows of this step score which prompt tokens, for the sequences asking for
    prompt logprobs: the row of position p scores prompt token p + 1."""
    scoring = _PromptScoring(array("q"), [], [], {})
    if all(seq.sampling_params.prompt_logprobs is None for seq in seqs):
        return scoring  # the usual step: no row offsets to add up
    starts = [0, *itertools.accumulate(num_new_tokens)]
    for i, seq in enumerate(seqs):
        top = seq.sampling_params.prompt_logprobs
        if top is None:
            continue
        first = seq.num_computed_tokens
        scored_end = min(first + num_new_tokens[i], seq.num_prompt_tokens - 1)
        if first < scored_end:
            count = scored_end - first
            scoring.spans[i] = (first + 1, len(scoring.rows), count)
            scoring.rows.extend(range(starts[i], starts[i] + count))
            scoring.targets += seq.token_ids[first + 1 : scored_end + 1]
            scoring.tops += [top] * count
    return scoring


def profiled_step_tokens(config: EngineConfig) -> list[int]:
    """Token counts of the steps whose peak memory bounds every step's: the largest step,
    and under all-to-all expert parallel the largest that exchanges fixed-size blocks
    (top_k times the bytes of a counted exchange, so it may peak higher though smaller)."""
    largest, fixed = config.max_num_batched_tokens, config.alltoall_fixed_block_tokens
    return [largest, fixed] if config.uses_alltoall and fixed < largest else [largest]
