"""Session 30: where does rank 0 stop when its worker dies mid-step on GPUs? Prints the step's
error and its time, then whether close() ends within 20 s (stacks of every thread if not)."""
import faulthandler
import sys
import tempfile
import threading
import time

from bcg.distributed import rank_loop
from bcg.engine.llm import LLM
from bcg.engine.sampling_params import SamplingParams
from tests.hf_tiny import save_tiny_model
from tests.split_runs import PROMPTS
from tests.test_tp_engine import worker_dying_in_a_step

extra = {"enable_custom_all_reduce": True} if sys.argv[1] == "custom" else {}
path = tempfile.mkdtemp()
save_tiny_model("qwen3", path)
rank_loop.spawned_worker_main = worker_dying_in_a_step
llm = LLM(path, tensor_parallel_size=2, dtype="bfloat16", max_model_len=256, **extra)
start = time.monotonic()
try:
    llm.generate([list(p) for p in PROMPTS], SamplingParams(temperature=0, max_tokens=8),
                 use_tqdm=False)
    print("PROBE step returned", flush=True)
except BaseException as error:  # noqa: BLE001
    print(f"PROBE step raised {type(error).__name__}: {error}", flush=True)
print(f"PROBE after {time.monotonic() - start:.1f} s", flush=True)
closer = threading.Thread(target=llm.close, daemon=True)
closer.start()
closer.join(20)
print(f"PROBE close ended: {not closer.is_alive()}", flush=True)
if closer.is_alive():
    faulthandler.dump_traceback(all_threads=True)
sys.stdout.flush()
import os  # noqa: E402
os._exit(0)
