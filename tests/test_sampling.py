import math

import pytest
import torch

from bcg.engine.sampling_params import SamplingParams
from bcg.layers.sampler import (
    Penalties,
    Sampler,
    SamplingBatch,
    apply_top_k_top_p,
    token_logprobs,
)

PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])


def batch(rows: int, temperature=1.0, top_k=None, top_p=1.0, generators=None) -> SamplingBatch:
    top_k = 4 if top_k is None else top_k
    return SamplingBatch(
        temperatures=torch.full((rows,), float(temperature)),
        top_k=torch.full((rows,), top_k, dtype=torch.int64),
        top_p=torch.full((rows,), float(top_p)),
        generators=generators or [None] * rows,
        all_greedy=temperature == 0,
        any_top_k_top_p=top_k < 4 or top_p < 1,
    )


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits).nonzero().flatten().tolist())


def test_top_k_keeps_the_k_largest():
    logits = PROBS.log()[None]
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert kept(out[0]) == {1, 3}
    assert torch.equal(out[0, [1, 3]], logits[0, [1, 3]])


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = PROBS.log()[None].repeat(3, 1)
    out = apply_top_k_top_p(logits, torch.tensor([4, 4, 4]), torch.tensor([0.45, 0.75, 0.9]))
    assert [kept(row) for row in out] == [{1}, {1, 3}, {1, 2, 3}]


def test_top_p_applies_after_top_k_renormalises():
    # Top-2 renormalised: 0.5/0.8 = 0.625 and 0.375; p = 0.6 then keeps only the first.
    out = apply_top_k_top_p(PROBS.log()[None], torch.tensor([2]), torch.tensor([0.6]))
    assert kept(out[0]) == {1}


def test_the_most_likely_token_always_survives():
    out = apply_top_k_top_p(PROBS.log()[None], torch.tensor([1]), torch.tensor([1e-6]))
    assert kept(out[0]) == {1}


def test_an_all_greedy_batch_takes_the_argmax_in_the_logits_own_dtype():
    # bf16 logits with a tie at the maximum: the first index wins, as after a float copy.
    logits = torch.randn(3, 50).to(torch.bfloat16)
    logits[1, [7, 30]] = 100.0
    greedy = Sampler()(logits, batch(3, temperature=0))
    assert torch.equal(greedy, logits.float().argmax(dim=-1))
    assert greedy[1] == 7


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(4, 50)
    mixed = batch(4)
    mixed.temperatures = torch.tensor([0.0, 1.0, 0.0, 1.0])
    tokens = Sampler()(logits, mixed)
    assert tokens[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()
    assert Sampler()(logits, batch(4, temperature=0)).tolist() == logits.argmax(-1).tolist()


def test_samples_follow_the_distribution():
    torch.manual_seed(0)
    rows = 20000
    tokens = Sampler()(PROBS.log()[None].repeat(rows, 1), batch(rows))
    freq = torch.bincount(tokens, minlength=4).float() / rows
    assert torch.allclose(freq, PROBS, atol=0.015)


def test_temperature_sharpens():
    torch.manual_seed(0)
    rows = 5000
    tokens = Sampler()(PROBS.log()[None].repeat(rows, 1), batch(rows, temperature=0.25))
    assert (tokens == 1).float().mean() > 0.85


def test_seeded_row_is_independent_of_the_rest_of_the_batch():
    logits = torch.randn(3, 1000)

    def draw(rows: list[int], seeded_row: int) -> list[int]:
        gens = [None] * len(rows)
        gens[seeded_row] = torch.Generator().manual_seed(1234)
        sampler, sb = Sampler(), batch(len(rows), generators=gens)
        out = [sampler(logits[rows], sb)[seeded_row].item() for _ in range(5)]
        return out

    alone = draw([1], 0)
    assert draw([0, 1, 2], 1) == alone
    assert draw([2, 0, 1], 2) == alone


def test_different_seeds_differ():
    logits = torch.zeros(1, 1000)
    draws = [Sampler()(logits, batch(1, generators=[torch.Generator().manual_seed(s)])).item()
             for s in range(5)]
    assert len(set(draws)) > 1


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(seed="x"), "seed"),
])
def test_invalid_sampling_params_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_choices_of_the_largest_seed_count_on_from_zero():
    params = SamplingParams(seed=2**64 - 1, n=3)
    assert [params.for_choice(i).seed for i in range(3)] == [2**64 - 1, 0, 1]


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="END").stop == ["END"]


@pytest.mark.gpu
def test_seeded_sampling_on_cuda_is_reproducible():
    logits = torch.randn(2, 1000, device="cuda")

    def draw():
        gens = [torch.Generator(device="cuda").manual_seed(7), None]
        return Sampler()(logits, SamplingBatch(
            torch.ones(2, device="cuda"), torch.full((2,), 1000, device="cuda"),
            torch.full((2,), 0.9, device="cuda"), gens, False, True))[0].item()

    assert draw() == draw()


def penalised(presence=0.0, frequency=0.0, repetition=1.0, prompt=(), output=()) -> list[int]:
    """The greedy token of logits [0, 1, 2, 3] after penalties for one row."""
    tokens = list(prompt) + list(output)
    sb = SamplingBatch(None, None, None, [None], all_greedy=True, any_top_k_top_p=False,
                       penalties=Penalties(
                           rows=torch.tensor([0]), token_ids=torch.tensor([tokens or [4]]),
                           is_output=torch.tensor([[0.0] * len(prompt) + [1.0] * len(output)
                                                   or [0.0]]),
                           presence=torch.tensor([presence]), frequency=torch.tensor([frequency]),
                           repetition=torch.tensor([repetition])))
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    token = Sampler()(logits, sb).item()
    assert torch.equal(logits, torch.tensor([[0.0, 1.0, 2.0, 3.0]]))  # input left unchanged
    return token


def test_presence_penalty_counts_generated_tokens_once():
    assert penalised(presence=1.5, output=[3]) == 2
    assert penalised(presence=0.9, output=[3, 3, 3]) == 3
    assert penalised(presence=1.5, prompt=[3]) == 3  # prompt tokens are not penalised


def test_frequency_penalty_counts_every_occurrence():
    assert penalised(frequency=0.8, output=[3]) == 3
    assert penalised(frequency=0.8, output=[3, 3]) == 2


def test_repetition_penalty_divides_seen_logits_prompt_included():
    assert penalised(repetition=2.0, prompt=[3]) == 2
    assert penalised(repetition=1.2, prompt=[3]) == 3


def test_logit_adds_and_min_p():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    adds = (torch.tensor([0, 0]), torch.tensor([3, 0]), torch.tensor([float("-inf"), 10.0]))
    sb = SamplingBatch(None, None, None, [None], True, False, logit_adds=adds)
    assert Sampler()(logits, sb).item() == 0
    torch.manual_seed(0)
    rows = 200
    sb = batch(rows)
    sb.min_p = torch.full((rows,), 0.5)
    tokens = Sampler()(PROBS.log()[None].repeat(rows, 1), sb)
    assert set(tokens.tolist()) == {1, 3}  # 0.05 and 0.15 are below 0.5 x 0.5


def test_token_logprobs_rank_and_top():
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 0.0, 0.0]])
    scored = token_logprobs(logits, torch.tensor([2, 0]), 2)
    expected = logits.log_softmax(-1)
    assert torch.allclose(scored.logprobs, expected[[0, 1], [2, 0]])
    assert scored.ranks.tolist() == [2, 1]
    assert scored.top_ids[0].tolist() == [1, 2] and scored.top_ids[1, 0] == 0
