"""Start-up steps: timed in the order they end, a step inside another named under it, taken
once (`LLMEngine.startup_seconds` holds an engine's; tests/test_tp_engine.py checks them)."""

import pytest

from bcg.timing import startup_step, take_startup_steps


def test_steps_are_taken_once_in_the_order_they_end_nested_ones_under_their_parent():
    take_startup_steps()
    with startup_step("weights"), startup_step("shards"):
        pass
    with pytest.raises(ValueError), startup_step("failed"):  # untimed, and leaves no parent
        raise ValueError
    with startup_step("graphs"):
        pass
    steps = take_startup_steps()
    assert list(steps) == ["weights > shards", "weights", "graphs"]
    assert all(seconds >= 0 for seconds in steps.values())
    assert take_startup_steps() == {}
