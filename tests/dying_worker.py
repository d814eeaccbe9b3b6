"""A tensor-parallel worker that dies in its first step, for the tests of rank 0's failure
path (on the CPU and on GPUs)."""

import os

from bcg.distributed import rank_loop
from bcg.runner import model_runner

FAILURE_SECONDS = 60  # an error must come this fast, well before any timeout


def worker_dying_in_a_step(*args) -> None:
    """A spawned worker's entry point whose first forward ends its process (code 3)."""
    def run_plan(self, plan, score_prompt=None):
        os._exit(3)

    model_runner.ModelRunner.run_plan = run_plan
    rank_loop.spawned_worker_main(*args)
