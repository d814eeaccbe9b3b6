"""The scheduler driven by a fake model whose next token is a function of the sequence."""

from bcg.engine.block_manager import BlockManager
from bcg.engine.sampling_params import SamplingParams
from bcg.engine.scheduler import Scheduler
from bcg.engine.sequence import Sequence

BLOCK = 4


def fake_next_token(token_ids: list[int]) -> int:
    return (sum(token_ids) * 31 + len(token_ids)) % 97


def make_scheduler(num_blocks=100, max_num_seqs=8, max_tokens_per_step=32) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BLOCK), max_num_seqs, max_tokens_per_step)


def make_requests(prompt_lens, max_tokens=6) -> list[Sequence]:
    params = SamplingParams(max_tokens=max_tokens)
    return [Sequence(str(i), [(i + j) % 97 for j in range(n)], params)
            for i, n in enumerate(prompt_lens)]


def run_to_completion(scheduler: Scheduler, seqs: list[Sequence]) -> list:
    """Drive steps until every sequence has max_tokens outputs; return each step's output."""
    for s in seqs:
        scheduler.add(s)
    steps = []
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        assert output.seqs, "a step with unfinished requests scheduled nothing"
        assert output.num_tokens <= scheduler.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.max_num_seqs
        steps.append(output)
        sampled = scheduler.advance(output)
        for s in sampled:
            s.append_token(fake_next_token(s.token_ids))
        scheduler.cache_computed_blocks(output)  # as the engine: tokens known, then stops
        for s in sampled:
            if s.num_output_tokens == s.sampling_params.max_tokens:
                scheduler.finish(s, "length")
        assert len(steps) < 1000
    return steps


def expected_outputs(seqs: list[Sequence]) -> dict[str, list[int]]:
    result = {}
    for s in seqs:
        tokens = s.prompt_token_ids
        for _ in range(s.sampling_params.max_tokens):
            tokens = tokens + [fake_next_token(tokens)]
        result[s.request_id] = tokens[len(s.prompt_token_ids):]
    return result


def test_long_prompt_is_prefilled_in_chunks_and_samples_once():
    scheduler = make_scheduler(max_tokens_per_step=16)
    [s] = make_requests([50], max_tokens=2)
    steps = run_to_completion(scheduler, [s])
    assert [o.num_new_tokens for o in steps] == [[16], [16], [16], [2], [1]]
    assert s.num_output_tokens == 2


def test_decodes_go_first_and_a_prompt_chunk_fills_the_rest():
    scheduler = make_scheduler(max_tokens_per_step=10)
    a, b = make_requests([3, 30], max_tokens=4)
    scheduler.add(a)
    first = scheduler.schedule()
    scheduler.advance(first)
    a.append_token(1)
    scheduler.add(b)
    second = scheduler.schedule()
    assert second.seqs == [a, b] and second.num_new_tokens == [1, 9]


def test_decodes_go_longest_first_and_prompt_chunks_keep_their_order():
    scheduler = make_scheduler(max_tokens_per_step=64)
    short, long, middle = make_requests([3, 12, 7], max_tokens=4)
    for seq in (short, long, middle):
        scheduler.add(seq)
    scheduler.advance(scheduler.schedule())
    for seq in (short, long, middle):
        seq.append_token(1)
    late, early = make_requests([9, 5], max_tokens=4)
    scheduler.add(late)
    scheduler.add(early)
    step = scheduler.schedule()
    assert step.seqs == [long, middle, short, late, early]
    assert step.num_new_tokens == [1, 1, 1, 9, 5]


def test_fifo_admission_and_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2)
    seqs = make_requests([4, 4, 4, 4])
    for s in seqs:
        scheduler.add(s)
    output = scheduler.schedule()
    assert output.seqs == seqs[:2] and list(scheduler.waiting) == seqs[2:]


def test_every_request_completes_with_same_tokens_under_preemption():
    seqs = make_requests([9, 14, 6, 11, 20, 3], max_tokens=10)
    steps = run_to_completion(make_scheduler(num_blocks=12, max_tokens_per_step=16), seqs)
    assert any(o.num_preempted for o in steps)
    assert {s.request_id: s.output_token_ids for s in seqs} == expected_outputs(seqs)
    assert all(s.is_finished for s in seqs)


def test_blocks_all_return_after_completion():
    scheduler = make_scheduler(num_blocks=12, max_tokens_per_step=16)
    run_to_completion(scheduler, make_requests([9, 14, 6, 11], max_tokens=5))
    assert scheduler.block_manager.num_free_blocks == 12


def test_preempted_sequence_is_recomputed_with_its_outputs():
    scheduler = make_scheduler(num_blocks=6, max_tokens_per_step=64)
    a, b = make_requests([8, 8], max_tokens=12)
    steps = run_to_completion(scheduler, [a, b])
    recomputes = [n for o in steps for s, n in zip(o.seqs, o.num_new_tokens, strict=True)
                  if n > 1 and s.num_output_tokens]
    assert recomputes, "expected a preempted sequence to be recomputed with its outputs"
    assert {s.request_id: s.output_token_ids for s in (a, b)} == expected_outputs([a, b])


def test_prefix_cache_shortens_a_repeated_prompt():
    scheduler = make_scheduler()
    first, = make_requests([13], max_tokens=1)
    run_to_completion(scheduler, [first])
    again = Sequence("again", first.prompt_token_ids, SamplingParams(max_tokens=1))
    steps = run_to_completion(scheduler, [again])
    assert steps[0].num_new_tokens == [1] and again.num_cached_tokens == 12


def test_finish_of_a_waiting_request_frees_nothing_and_removes_it():
    scheduler = make_scheduler(max_num_seqs=1)
    a, b = make_requests([4, 4])
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()
    scheduler.finish(b, "abort")
    assert list(scheduler.waiting) == [] and b.finish_reason == "abort"
    assert scheduler.running == [a]
