"""NemotronH (a Mamba2 hybrid with every block kind) against transformers' PyTorch path
through the engine: greedy tokens, chunked prefill, preemption and abort giving back every
block and state slot; and the mixer through our Triton kernels. (Prefill, decode and chunks
mixed with decodes, stepped by hand on every device: test_models_hf.)"""

import importlib
import inspect
import math

import pytest
import torch

from bcg.engine.llm import LLM
from bcg.engine.sampling_params import SamplingParams
from bcg.forward import MambaStateCache
from bcg.graph import BridgeBuffers, use_bridge_buffers
from bcg.layers.mamba_backend import MambaBackend, MambaOps
from bcg.layers.mamba_mixer import MambaMixer2
from bcg.loader.model_loader import load_model
from bcg.loader.model_source import resolve_model
from bcg.models.config import ModelConfig
from bcg.runner.graph_verify import verify_graphs
from tests.hf_tiny import (
    VOCAB,
    PagedHarness,
    assert_rows_match,
    hf_greedy,
    hf_logits,
    random_prompt,
    save_tiny_model,
)
from tests.kernels_support import kernels_skip_reason
from tests.numerics import relative_error

PROMPTS = [[(7 * i + 3 * j) % VOCAB for j in range(n)] for i, n in enumerate((5, 12, 30))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("nemotron_h")
    return save_tiny_model("nemotron_h", folder), folder


@pytest.fixture(scope="module")
def greedy(hf_folder):
    hf_model, folder = hf_folder
    return folder, [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in PROMPTS]


def make_llm(folder, **engine_args) -> LLM:
    return LLM(model=str(folder), device="cpu", block_size=4, **engine_args)


def greedy_tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_all_freed(llm: LLM) -> None:
    manager = llm.engine.scheduler.block_manager
    assert manager.num_free_blocks == llm.engine.runner.num_kv_blocks
    assert manager.state_slots.num_free == manager.state_slots.num_slots


def test_engine_greedy_and_chunked_match_transformers(greedy, caplog):
    folder, expected = greedy
    with caplog.at_level("INFO"):
        llm = make_llm(folder, max_model_len=128, max_num_batched_tokens=7)
    assert "prefix caching is off" in caplog.text
    assert not llm.engine.scheduler.block_manager.enable_prefix_caching
    assert greedy_tokens(llm) == expected
    assert_all_freed(llm)


def test_one_token_prompt_ignores_its_slots_stale_state(hf_folder):
    """A one-token prompt's first step is a decode-shaped batch; its slot (the only one)
    still holds the state of the sequence before it, which must not be read."""
    hf_model, folder = hf_folder
    harness = PagedHarness(folder, max_num_seqs=1)
    before = harness.new_sequence(random_prompt(9, seed=3))
    harness.step([before], [9])
    harness.block_manager.free(before)
    seq = harness.new_sequence([7])
    [rows] = harness.step([seq], [1])
    assert seq.state_slot == 0
    assert_rows_match((hf_model, harness, 1e-4), seq, rows, 0)


def test_engine_preemption_and_abort_free_every_slot(greedy):
    folder, _ = greedy
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    roomy = make_llm(folder, max_model_len=48)
    expected = greedy_tokens(roomy, PROMPTS[:2], params)
    small = make_llm(folder, kv_cache_tokens=48, max_model_len=48, max_num_seqs=2)
    assert greedy_tokens(small, PROMPTS[:2], params) == expected
    assert small.engine.stats.num_preemptions > 0
    assert_all_freed(small)
    engine = small.engine
    doomed = engine.add_request(PROMPTS[1], GREEDY)
    kept = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    assert engine.scheduler.block_manager.state_slots.num_free == 0
    engine.abort_request(doomed)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {kept}
    assert outputs[-1].outputs[0].token_ids == expected[0][: GREEDY.max_tokens]
    assert_all_freed(small)


def test_triton_kernels_in_the_model_match_transformers(hf_folder):
    """The mixer's state ops through our Triton kernels (the interpreter without a GPU): a
    prefill of two prompts (one over several chunks), then a decode step of both."""
    reason = kernels_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    from bcg.layers import triton_ops  # after kernels_support turned the interpreter on

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf_model, folder = hf_folder
    harness = PagedHarness(folder, device=device)
    harness.runner.mamba = MambaBackend(MambaOps(
        triton_ops.causal_conv1d_varlen, triton_ops.causal_conv1d_update,
        triton_ops.ssd_scan_varlen, triton_ops.selective_state_update))
    tiny = (hf_model, harness, 5e-3 if device == "cuda" else 1e-4)
    seqs = [harness.new_sequence(random_prompt(n, seed=n)) for n in (3, 19)]
    logits = harness.step(seqs, [3, 19])
    for seq, rows in zip(seqs, logits, strict=True):
        assert_rows_match(tiny, seq, rows, 0)
        seq.append_token(int(rows[-1].argmax()))
    for seq, rows in zip(seqs, harness.step(seqs, [1, 1]), strict=True):
        assert_rows_match(tiny, seq, rows, seq.num_tokens - 1)


def test_bridge_buffers_carry_the_mixer_without_changing_it(hf_folder):
    """Inside a runner's bridge scope (as while capturing) the mixer's projection, conv
    output and scan output live in shared bridge buffers; a prefill then a decode step
    through them still match transformers."""
    hf_model, folder = hf_folder
    harness = PagedHarness(folder)
    tiny = (hf_model, harness, 1e-4)
    bridges = BridgeBuffers()
    seqs = [harness.new_sequence(random_prompt(n, seed=n)) for n in (3, 19)]
    with use_bridge_buffers(bridges):
        for seq, rows in zip(seqs, harness.step(seqs, [3, 19]), strict=True):
            assert_rows_match(tiny, seq, rows, 0)
            seq.append_token(int(rows[-1].argmax()))
        for seq, rows in zip(seqs, harness.step(seqs, [1, 1]), strict=True):
            assert_rows_match(tiny, seq, rows, seq.num_tokens - 1)
    names = {name for name, _, _ in bridges._buffers}
    assert {"mamba_in_proj", "mamba_activated", "mamba_output"} <= names


def test_bench_prefill_gives_a_hybrids_rows_state_slots(hf_folder):
    """bench_prefill's rows write each sequence's final state, as the engine's prefills."""
    bench_prefill = importlib.import_module("bench.bench_prefill")
    batch = bench_prefill.make_batch(PagedHarness(hf_folder[1]).runner, 4, 16)
    assert batch.state_slots.tolist() == [0, 1, 2, 3]


class EagerAsGraph:
    """A stand-in graph runner (CPU: no CUDA graphs) whose replay is the eager stack."""

    mode = "full"

    def __init__(self, runner, kind: str, bucket: int) -> None:
        self.runner, self.kind, self.buckets = runner, kind, [bucket]

    def run(self, batch, bucket: int) -> torch.Tensor:
        return self.runner.forward_eager(batch)


def test_verify_graphs_runs_both_sides_from_the_same_state(hf_folder, monkeypatch):
    """--verify-graphs gives a hybrid's sequences real state slots; the graph's run moves
    their state on, so it is restored before the eager run (else they differ)."""
    runner = PagedHarness(hf_folder[1]).runner
    runner.graph_runners = [EagerAsGraph(runner, "decode", 4),
                            EagerAsGraph(runner, "prefill", 32)]
    verify_graphs(runner)
    monkeypatch.setattr(MambaStateCache, "restore", lambda *args: None)
    with pytest.raises(RuntimeError, match="differs from eager"):
        verify_graphs(runner)


@pytest.mark.parametrize("dummy", [False, True], ids=["checkpoint", "dummy"])
def test_A_is_derived_once_in_fp32_after_loading(hf_folder, dummy):
    source = resolve_model(str(hf_folder[1]), dummy_weights=dummy)
    model = load_model(source, torch.bfloat16, torch.device("cpu"))
    mixers = [m for m in model.modules() if isinstance(m, MambaMixer2)]
    assert len(mixers) == 3
    for mixer in mixers:
        assert mixer.A.dtype == torch.float32 and "A" not in mixer.state_dict()
        assert torch.equal(mixer.A, -torch.exp(mixer.A_log.float()))


def test_config_layouts_old_and_new_and_refusals():
    old = {"architectures": ["NemotronHForCausalLM"], "vocab_size": 16, "hidden_size": 8,
           "intermediate_size": 8, "num_attention_heads": 2, "mamba_num_heads": 4,
           "mamba_head_dim": 2, "ssm_state_size": 4, "n_groups": 2,
           "hybrid_override_pattern": "M-*M"}
    new = {k: v for k, v in old.items() if k != "hybrid_override_pattern"} | {
        "layers_block_type": ["linear_attention", "mlp", "full_attention", "linear_attention"]}
    for hf in (old, new):
        config = ModelConfig.from_hf_dict(hf)
        assert config.layer_types == "M-*M" and config.num_hidden_layers == 4
        assert (config.num_attention_layers, config.num_mamba_layers) == (1, 2)
        assert config.mamba.conv_dim == 4 * 2 + 2 * 2 * 4
    assert config.mamba.dt_limit == UNCLAMPED
    assert ModelConfig.from_hf_dict(old | {"mamba_dt_limit": [0.001, 0.1]}).mamba.dt_limit \
        == (0.001, 0.1)
    with pytest.raises(ValueError, match="time_step_limit"):
        ModelConfig.from_hf_dict(old | {"time_step_limit": [0.1, 0.01]})
    with pytest.raises(ValueError, match=r"\['E'\].*no MoE"):
        ModelConfig.from_hf_dict(old | {"hybrid_override_pattern": "M-E*"})
    with pytest.raises(ValueError, match="mamba_num_heads=4 is not a multiple of n_groups=3"):
        ModelConfig.from_hf_dict(old | {"n_groups": 3})


def test_config_legacy_mamba_keys_and_fixed_options():
    """Older configs' mamba_* names (winning over the current ones, as in transformers);
    options our blocks do not compute are refused."""
    base = {"architectures": ["NemotronHForCausalLM"], "vocab_size": 16, "hidden_size": 8,
            "intermediate_size": 8, "num_attention_heads": 2, "mamba_num_heads": 8,
            "mamba_head_dim": 2, "ssm_state_size": 4, "hybrid_override_pattern": "M*"}
    legacy = {"mamba_n_groups": 2, "mamba_d_conv": 3, "mamba_chunk_size": 16,
              "mamba_conv_bias": False, "n_groups": 4, "conv_kernel": 4}
    mamba = ModelConfig.from_hf_dict(base | legacy).mamba
    assert (mamba.n_groups, mamba.conv_kernel, mamba.chunk_size, mamba.conv_bias) \
        == (2, 3, 16, False)
    assert ModelConfig.from_hf_dict(base).mamba.n_groups == 8  # transformers' default
    for name, value in (("residual_in_fp32", True), ("mlp_hidden_act", "gelu"),
                        ("mamba_hidden_act", "relu")):
        with pytest.raises(ValueError, match=f"{name}={value!r} is not supported"):
            ModelConfig.from_hf_dict(base | {name: value})


# Half of every Mamba layer's heads get dt_bias = -8: softplus(dt + dt_bias) ~ 3e-4 there,
# below time_step_min (0.001), so a clamp at time_step_min changes the logits (~1e-3).
SLOW_HEAD_DT_BIAS = -8.0
UNCLAMPED = (0.0, math.inf)


def mamba_mixers(hf_model) -> list:
    return [layer.mixer for layer in hf_model.model.layers if hasattr(layer.mixer, "dt_bias")]


def save_slow_heads_model(folder, dt_limit: tuple[float, float]):
    """The tiny hybrid with slow heads and `time_step_limit` = `dt_limit`, saved; returned
    as transformers runs it with that limit in its chunked path (it clamps at time_step_min
    there instead, and never in its decode path)."""
    hf_model = save_tiny_model("nemotron_h", folder, time_step_limit=dt_limit)
    with torch.no_grad():
        for mixer in mamba_mixers(hf_model):
            mixer.dt_bias[::2] = SLOW_HEAD_DT_BIAS
    hf_model.save_pretrained(folder)
    for mixer in mamba_mixers(hf_model):
        mixer.time_step_limit = dt_limit
    return hf_model


def our_logits(folder, tokens: list[int], prefill: int) -> torch.Tensor:
    """Our logits at every position of `tokens`: the first `prefill` in one step (several
    scan chunks), then one decode step per token."""
    harness = PagedHarness(folder)
    seq = harness.new_sequence(tokens[:prefill])
    rows = harness.step([seq], [prefill])
    for token in tokens[prefill:]:
        seq.append_token(token)
        rows += harness.step([seq], [1])
    return torch.cat(rows)


def hf_decode_logits(hf_model, tokens: list[int], prefill: int) -> torch.Tensor:
    """transformers' logits likewise: its chunked path, then its recurrent decode path."""
    # transformers 5.2x renamed `past_key_values` to `cache` (the old name goes in 5.40)
    name = ("cache" if "cache" in inspect.signature(hf_model.forward).parameters
            else "past_key_values")
    with torch.no_grad():
        out = hf_model(torch.tensor([tokens[:prefill]]), use_cache=True)
        rows, cache = [out.logits[0]], getattr(out, name)
        for token in tokens[prefill:]:
            out = hf_model(torch.tensor([[token]]), use_cache=True, **{name: cache})
            rows.append(out.logits[0])
            cache = getattr(out, name)
    return torch.cat(rows).float()


@pytest.mark.parametrize("dt_limit", [UNCLAMPED, (0.002, 0.5)], ids=["none", "both"])
def test_dt_limit_applies_alike_in_prefill_and_decode(tmp_path, dt_limit):
    """Our prefill and decode rows against transformers' chunked path over the whole
    sequence with the config's limit: the limit applies at every token, decoded or not
    (transformers' and mamba_ssm's decode steps skip it). (0.002, 0.5) binds on the slow
    heads and on many tokens of the others."""
    hf_model = save_slow_heads_model(tmp_path, dt_limit)
    tokens = random_prompt(22, seed=5)
    expected = hf_logits(hf_model, tokens)
    assert relative_error(our_logits(tmp_path, tokens, 19), expected) <= 1e-4


def test_default_dt_limit_matches_transformers_decode_path(tmp_path):
    """No limit by default: our decode rows equal transformers' decode path (which never
    clamps); its own chunked path, clamped at time_step_min, is far from both."""
    hf_model = save_slow_heads_model(tmp_path, UNCLAMPED)
    tokens = random_prompt(22, seed=5)
    ours = our_logits(tmp_path, tokens, 19)
    assert relative_error(ours, hf_decode_logits(hf_model, tokens, 19)) <= 1e-4
    for mixer in mamba_mixers(hf_model):
        mixer.time_step_limit = (hf_model.config.time_step_min, math.inf)
    assert relative_error(ours, hf_logits(hf_model, tokens)) > 1e-3 / 2
