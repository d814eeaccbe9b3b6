"""Session 20: bench_offline's workload (decode + breakable, overlap on) at several max_num_batched_tokens."""
import sys

sys.path.insert(0, "bench")
import bench_offline as bo
from bcg.engine.llm import LLM  # noqa: F401  (imported by bench_offline too)

model = sys.argv[1]
vocab = {"qwen3-0.6b": 151936, "qwen3-8b": 151936}[model]
requests = bo.workload(vocab)
out_tokens = bo.output_tokens(requests)
for tokens in map(int, sys.argv[2:]):
    run = bo.run_bcg(model, "decode + breakable", requests, 2, overlap=True,
                     max_num_batched_tokens=tokens)
    print(f"{model} max_num_batched_tokens {tokens}: {out_tokens / run['seconds']:.0f} out tok/s, "
          f"{run['seconds']:.2f} s (runs {run['run_seconds']}), start-up {run['startup_s']:.1f} s, "
          f"preemptions {run['preemptions']}, forwards {run['forwards']}", flush=True)
