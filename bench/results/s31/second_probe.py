"""Session 31: why a second tp2 engine in one process finds GPU 0 full (call C). Builds the
tiny nemotron_h engine twice, printing each GPU's free memory and every process's use after
each close."""
import subprocess
import sys
import tempfile

import torch

from bcg.engine.llm import LLM
from bcg.engine.sampling_params import SamplingParams
from tests.hf_tiny import save_tiny_model
from tests.split_runs import PROMPTS


def show(when: str) -> None:
    free = [torch.cuda.mem_get_info(i)[0] / 2**30 for i in range(2)]
    print(f"PROBE {when}: free GiB {free[0]:.2f} {free[1]:.2f}", flush=True)
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory",
                           "--format=csv,noheader"], capture_output=True, text=True).stdout
    print("PROBE apps:", apps.replace("\n", " | "), flush=True)


path = tempfile.mkdtemp()
save_tiny_model("nemotron_h", path)
show("start")
for round_ in range(2):
    try:
        llm = LLM(path, tensor_parallel_size=2, dtype="bfloat16", max_model_len=256)
    except Exception as error:  # noqa: BLE001
        print(f"PROBE round {round_} failed: {error}", flush=True)
        show("after the failure")
        sys.exit(1)
    show(f"round {round_} built")
    llm.generate([list(p) for p in PROMPTS], SamplingParams(temperature=0, max_tokens=8),
                 use_tqdm=False)
    llm.close()
    show(f"round {round_} closed")
