"""Session 22 plan: does the order of rows matter to decode attention on offline batches?
Lengths uniform in [100, 2048] at batch 256 / 128, qwen3-8b (32/8) and 0.6b (16/8) heads:
the same lengths in random order, longest first, shortest first (µs in CUDA graphs). If
longest-first wins by a few %, order rows (a permutation the step computes once) or let
the scheduler sort its decode rows."""
import sys

sys.path.insert(0, "bench")
import bench_attention as ba

torch = ba.torch
print(torch.cuda.get_device_name(), flush=True)
for heads in (32, 16):
    ba.NUM_HEADS = heads
    for batch in (256, 128):
        inputs = ba.DecodeInputs.build(batch, 2048, 100)
        lens = inputs.seq_lens.clone()
        line = f"heads {heads} batch {batch}:"
        for name, order in (("random", lens), ("longest first", lens.sort(descending=True)[0]),
                            ("shortest first", lens.sort()[0])):
            inputs.seq_lens.copy_(order)
            _, us, _ = ba.time_ours_decode(inputs)
            line += f" {name} {us:.1f} ({inputs.kv_bytes() / (us * 1e-6) / 3.35e12:.2f})"
        print(line, flush=True)
