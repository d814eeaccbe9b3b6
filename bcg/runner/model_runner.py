"""ModelRunner: owns the model and the KV cache; turns scheduled sequences into tokens.

One step is `prepare` (scheduled sequences -> ForwardBatch), `forward` (the transformer
stack under the forward context; graph runners replace this part), then the head on the
rows to sample and the sampler. The runner knows sequences only through `ScheduledSequence`.
"""

from __future__ import annotations

import logging
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from bcg.config import EngineConfig
from bcg.layers.attention import Attention
from bcg.layers.sampler import Sampler, SamplingBatch
from bcg.loader.model_loader import load_model
from bcg.loader.model_source import ModelSource
from bcg.runner.context import ForwardContext, set_forward_context
from bcg.runner.forward_batch import ForwardBatch
from bcg.runner.graph_runner import GraphRunner
from bcg.runner.graph_setup import build_graph_runners
from bcg.runner.graph_verify import verify_graphs
from bcg.runner.kv_cache import KVCache

if TYPE_CHECKING:
    from bcg.kernels.decode_attention import DecodePlan

logger = logging.getLogger(__name__)

ALIGN_BYTES = 16  # Triton's pointer specialisation: every batch tensor starts on this


class SamplingOptions(Protocol):
    temperature: float
    top_k: int  # 0 or less = off
    top_p: float


class ScheduledSequence(Protocol):
    token_ids: list[int]
    num_computed_tokens: int  # tokens whose K/V are already in the cache
    block_table: Sequence[int]  # array('i') (copied fastest) or a list of ints
    sampling_params: SamplingOptions
    generator: torch.Generator | None


def samples_this_step(seq: ScheduledSequence, num_new_tokens: int) -> bool:
    """A sequence samples once its last known token is computed (not after a partial chunk)."""
    return seq.num_computed_tokens + num_new_tokens == len(seq.token_ids)


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int) -> None:
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.model = load_model(source, self.dtype, self.device, config.seed)
        self.model_config = source.config
        self.attention_scales = self._attention_scales()
        self.sampler = Sampler()
        self.forward_counts: Counter[str] = Counter()
        self._decode_plans: dict[int, DecodePlan] = {}
        # Prefill graphs never touch the cache inside a segment, so they are captured against a
        # one-block stand-in before the cache is sized: their pool is then counted as used.
        # Decode graphs bake the cache in; their pool is measured first and set aside.
        self.kv_cache = self._new_kv_cache(1)
        self.graph_runners: list[GraphRunner] = []  # tried in order; decode first
        decode, prefill = build_graph_runners(self, config, max_model_len)
        if prefill is not None:
            prefill.capture_all()
            self.graph_runners.append(prefill)
        decode_pool_bytes = decode.measure_pool_bytes() if decode is not None else 0
        self.kv_cache = self._allocate_kv_cache(config, max_model_len, decode_pool_bytes)
        if decode is not None:
            decode.capture_all()
            self.graph_runners.insert(0, decode)
        if config.verify_graphs and self.graph_runners:
            verify_graphs(self)

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @torch.inference_mode()
    def execute(self, seqs: Sequence[ScheduledSequence], num_new_tokens: list[int]) -> list[int]:
        """Run one step; return the sampled token of each sequence that samples, in order."""
        batch = self.prepare(seqs, num_new_tokens)
        hidden_states = self.forward(batch)
        sampling = [s for s, n in zip(seqs, num_new_tokens, strict=True) if samples_this_step(s, n)]
        if not sampling:
            return []
        # A pure decode samples every row: a view then, not a gather (a launch and a copy).
        rows = batch.sample_indices if len(sampling) < batch.num_tokens else slice(None)
        logits = self.model.compute_logits(hidden_states[rows])
        return self.sampler(logits, self.sampling_batch(sampling)).tolist()

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
        plan = self._decode_plan(batch.num_seqs) if batch.is_decode and self.uses_kernels else None
        return ForwardContext(batch, self.kv_cache, self.attention_scales, plan)

    @property
    def uses_kernels(self) -> bool:
        return self.device.type == "cuda"

    def _decode_plan(self, num_seqs: int) -> DecodePlan:
        """One decode-kernel workspace per power-of-two batch size, shared by all layers and
        steps (and by the decode graphs of that size, which never replay at once)."""
        size = 1 << (num_seqs - 1).bit_length()
        if size not in self._decode_plans:
            from bcg.kernels.decode_attention import plan_decode  # needs Triton: CUDA only

            c = self.model_config
            self._decode_plans[size] = plan_decode(size, c.num_attention_heads,
                                                   c.num_key_value_heads, c.head_dim, self.device)
        return self._decode_plans[size]

    def prepare(self, seqs: Sequence[ScheduledSequence], num_new_tokens: list[int]) -> ForwardBatch:
        # Built in `array`s and sent as two buffers (int64, int32): Python lists and one tensor
        # per field cost milliseconds per step at hundreds of sequences.
        input_ids, positions, slots, sample_indices = (array("q") for _ in range(4))
        cu_seqlens_q, seq_lens, block_tables = array("i", [0]), array("i"), array("i")
        max_blocks = max(len(seq.block_table) for seq in seqs)
        padding = array("i", [-1]) * max_blocks
        for seq, n in zip(seqs, num_new_tokens, strict=True):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self._slots(seq.block_table, start, end))
            cu_seqlens_q.append(cu_seqlens_q[-1] + n)
            seq_lens.append(end)
            if samples_this_step(seq, n):
                sample_indices.append(cu_seqlens_q[-1] - 1)
            block_tables.extend(seq.block_table)
            block_tables.extend(padding[: max_blocks - len(seq.block_table)])
        longs = self._upload([input_ids, positions, slots, sample_indices], torch.int64)
        ints = self._upload([cu_seqlens_q, seq_lens, block_tables], torch.int32)
        return ForwardBatch(
            input_ids=longs[0],
            positions=longs[1],
            slot_mapping=longs[2],
            sample_indices=longs[3],
            cu_seqlens_q=ints[0],
            seq_lens=ints[1],
            block_tables=ints[2].view(len(seqs), max_blocks),
            num_tokens=len(input_ids),
            num_seqs=len(seqs),
            max_seqlen_q=max(num_new_tokens),
            max_seq_len=max(seq_lens),
        )

    def sampling_batch(self, seqs: Sequence[ScheduledSequence]) -> SamplingBatch:
        params = [seq.sampling_params for seq in seqs]
        generators = [seq.generator for seq in seqs]
        if all(p.temperature == 0 for p in params):  # no per-row tensors to build and copy
            return SamplingBatch(temperatures=None, top_k=None, top_p=None, generators=generators,
                                 all_greedy=True, any_top_k_top_p=False)
        vocab_size = self.model_config.vocab_size
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        return SamplingBatch(
            temperatures=self._to_device([p.temperature for p in params], torch.float32),
            top_k=self._to_device(top_k, torch.int64),
            top_p=self._to_device([p.top_p for p in params], torch.float32),
            generators=generators,
            all_greedy=False,
            any_top_k_top_p=any(k < vocab_size for k in top_k) or any(p.top_p < 1 for p in params),
        )

    def _slots(self, block_table: Sequence[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def _upload(self, parts: list[array], dtype: torch.dtype) -> list[torch.Tensor]:
        """`parts` (one typecode, matching `dtype`) as device tensors: one host buffer, one
        copy, views into it. Each view starts 16-byte aligned: kernels specialise on pointer
        alignment, and a misaligned one misses the launch cache (a compile, then a slow
        launch every step)."""
        flat = array(parts[0].typecode)
        align = ALIGN_BYTES // flat.itemsize
        offsets = []
        for part in parts:
            offsets.append(len(flat))
            flat.extend(part)
            flat.extend(array(flat.typecode, [0]) * (-len(flat) % align))
        host = torch.frombuffer(flat, dtype=dtype)
        if self.device.type == "cuda":
            host = host.pin_memory()
        device = host.to(self.device, non_blocking=True)
        return [device[o : o + len(p)] for o, p in zip(offsets, parts, strict=True)]

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        pin = self.device.type == "cuda"
        return torch.tensor(values, dtype=dtype, pin_memory=pin).to(self.device, non_blocking=True)

    def _attention_scales(self) -> list[float]:
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        assert [layer.layer_id for layer in layers] == list(range(len(layers)))
        return [layer.scale for layer in layers]

    def _allocate_kv_cache(
        self, config: EngineConfig, max_model_len: int, reserved_bytes: int = 0
    ) -> KVCache:
        num_blocks = self._num_kv_blocks(config, max_model_len, reserved_bytes)
        capacity = num_blocks * self.block_size
        if capacity < max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens, fewer than max_model_len={max_model_len}: "
                "raise gpu_memory_utilization or kv_cache_tokens, or lower max_model_len"
            )
        logger.info("KV cache: %d blocks of %d tokens (%d tokens)", num_blocks,
                    self.block_size, capacity)
        return self._new_kv_cache(num_blocks)

    def _new_kv_cache(self, num_blocks: int) -> KVCache:
        c = self.model_config
        return KVCache(c.num_hidden_layers, num_blocks, self.block_size, c.num_key_value_heads,
                       c.head_dim, self.dtype, self.device)

    def _num_kv_blocks(self, config: EngineConfig, max_model_len: int, reserved_bytes: int) -> int:
        if config.kv_cache_tokens is not None:
            return -(-config.kv_cache_tokens // self.block_size)
        if self.device.type != "cuda":
            return -(-max_model_len // self.block_size)
        c = self.model_config
        block_bytes = KVCache.bytes_per_block(c.num_hidden_layers, self.block_size,
                                              c.num_key_value_heads, c.head_dim, self.dtype)
        return max(0, self._free_kv_bytes(config, max_model_len) - reserved_bytes) // block_bytes

    def _free_kv_bytes(self, config: EngineConfig, max_model_len: int) -> int:
        """Memory left for the KV cache: the allowed share of the GPU, minus what is in use now
        (weights, graph pools, other processes), minus the peak activations of the largest step."""
        activation_bytes = self._profile_activation_bytes(
            config.max_num_batched_tokens, config.max_num_seqs, max_model_len
        )
        free, total = torch.cuda.mem_get_info(self.device)
        allowed = int(total * config.gpu_memory_utilization)
        return max(0, allowed - (total - free) - activation_bytes)

    @torch.inference_mode()
    def _profile_activation_bytes(self, num_tokens: int, max_num_seqs: int,
                                  max_model_len: int) -> int:
        """Peak extra memory of the largest step: a forward of `num_tokens` prompt tokens in
        sequences as long as allowed (the largest attention), then sampling `max_num_seqs` rows
        with top-p."""
        lengths = [min(max_model_len, num_tokens - start)
                   for start in range(0, num_tokens, max_model_len)]
        blocks_per_seq = -(-max_model_len // self.block_size)
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.kv_cache = self._new_kv_cache(blocks_per_seq * len(lengths))
        seqs = [_ProfileSequence(n, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
                for i, n in enumerate(lengths)]
        hidden_states = self.forward(self.prepare(seqs, lengths))  # a graph if captured
        rows = min(max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden_states[:rows])
        self.sampler(logits, self.sampling_batch([seqs[0]] * rows))
        torch.cuda.synchronize(self.device)
        del self.kv_cache, hidden_states, logits
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        return peak - before


@dataclass
class _ProfileSamplingParams:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.9


class _ProfileSequence:
    """A prompt of `num_tokens` zeros, just enough of a sequence for `prepare` and sampling."""

    def __init__(self, num_tokens: int, block_table: list[int]) -> None:
        self.token_ids = [0] * num_tokens
        self.num_computed_tokens = 0
        self.block_table = block_table
        self.sampling_params = _ProfileSamplingParams()
        self.generator = None
