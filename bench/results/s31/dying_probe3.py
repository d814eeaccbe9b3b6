"""For session 31 (two GPUs): why rank 0 does not come back when its worker dies mid-step.
Session 30's probe found, on two H200s: under NCCL the step raises the named error in 2.3 s
but the abort of the group (torch's `_abort_process_group()`, every group) never returns, so
close() waits for its lock for good; under the custom all-reduce (release_and_shared_norm_v2
applied) the step was not back when the probe's 55 s limit (start-up included) ended it.

Usage: [PROBE_ABORT_WAIT=S] [PROBE_EXIT=normal] python dying_probe2.py MODE ABORT
  MODE   nccl | custom (run with tp_failure_v3.diff applied, as next_call.sh checks)
  ABORT  all (as the launcher does: every group, the gloo CPU group too) | world (the NCCL
         WORLD group only, through `_abort_process_group(WORLD)`) | backend (only WORLD's
         NCCL backend's abort(), torch's bookkeeping left as it is)
Prints timestamps (PROBE lines) of the failure, the release, the abort's start and end, the
step's end, what rank 0's own signals hold after the release (read on a stream of its own),
and dumps every thread's stack if the step or close() is not back in time."""
import faulthandler
import os
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from bcg.distributed import launcher, rank_loop
from bcg.distributed.parallel_state import tensor_parallel
from bcg.engine.llm import LLM
from bcg.engine.sampling_params import SamplingParams
from tests.hf_tiny import save_tiny_model
from tests.split_runs import PROMPTS
from tests.test_tp_engine import worker_dying_in_a_step

MODE, ABORT = sys.argv[1], sys.argv[2]
T0 = time.monotonic()


def say(what: str) -> None:
    print(f"PROBE {time.monotonic() - T0:7.2f} s  {what}", flush=True)


def abort_group(self) -> None:
    say(f"abort ({ABORT}) starts")
    if ABORT == "all":
        dist.distributed_c10d._abort_process_group()
    elif ABORT == "world":
        dist.distributed_c10d._abort_process_group(dist.group.WORLD)
    else:
        dist.group.WORLD._get_backend(torch.device("cuda")).abort()
    say(f"abort ({ABORT}) returned")


def own_signals_after_release() -> None:
    custom = tensor_parallel().custom_all_reduce
    if custom is None:
        return say("no custom all-reduce")
    say(f"release flag {int(custom.rows.released.item())}")


record = launcher.Workers._record


def record_and_look(self, rank: int, message: str) -> None:
    say(f"failure recorded: rank {rank}: {message}")
    record(self, rank, message)
    say("release asked")
    for _ in range(3):
        own_signals_after_release()
        time.sleep(0.5)


launcher.Workers._abort_group = abort_group
# close() gives up on the abort within the join below; PROBE_ABORT_WAIT makes it give up sooner
launcher.ABORT_WAIT_SECONDS = float(os.environ.get("PROBE_ABORT_WAIT", "10"))
launcher.Workers._record = record_and_look
rank_loop.spawned_worker_main = worker_dying_in_a_step
extra = {"enable_custom_all_reduce": True} if MODE == "custom" else {}
path = tempfile.mkdtemp()
save_tiny_model("qwen3", path)
llm = LLM(path, tensor_parallel_size=2, dtype="bfloat16", max_model_len=256, **extra)
say("engine ready; generate")
stepper = threading.Thread(target=lambda: run_step(), daemon=True)


def run_step() -> None:
    try:
        llm.generate([list(p) for p in PROMPTS], SamplingParams(temperature=0, max_tokens=8),
                     use_tqdm=False)
        say("step returned")
    except BaseException as error:  # noqa: BLE001
        say(f"step raised {type(error).__name__}: {error}")


stepper.start()
stepper.join(25)
if stepper.is_alive():
    say("step not back in 25 s: stacks")
    faulthandler.dump_traceback(all_threads=True)
    os._exit(1)
closer = threading.Thread(target=llm.close, daemon=True)
closer.start()
closer.join(20)
say(f"close ended: {not closer.is_alive()}")
if closer.is_alive():
    faulthandler.dump_traceback(all_threads=True)
if os.environ.get("PROBE_EXIT") != "normal":
    os._exit(0)
say("exiting as a program does (PROBE_EXIT=normal)")
faulthandler.dump_traceback_later(30, exit=True)
