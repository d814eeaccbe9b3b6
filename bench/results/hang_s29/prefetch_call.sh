#!/bin/bash
# For the next session (two GPUs, about 6 minutes), on a copy of the tree with ar_prefetch.diff
# applied (this script applies it): the fused all-reduce + add + norm's extra programs ask L2
# for part of the next projection's weight while the ranks meet (the design of
# bench/results/ab_prefetch/ that stalled in session 26, most likely by the count race fixed
# in session 29). First its two-GPU test (fused calls with a prefetch asked), then qwen3-8b
# decode tp2-custom with BCG_AR_PREFETCH unset and at several sizes and shapes, tp1 once.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
rm -rf /tmp/pftree && cp -r . /tmp/pftree && cd /tmp/pftree && patch -s -p1 < bench/results/hang_s29/ar_prefetch.diff
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -k 5 90 python -m pytest -q -p no:cacheprovider tests/test_custom_all_reduce.py > $OUT/pf_custom.log 2>&1
echo "custom rc $?"; tail -1 $OUT/pf_custom.log
timeout -k 5 90 python bench/bench_tp.py --configs tp1 --parts decode --repeats 1 > $OUT/pf_tp1.log 2>&1
echo "tp1 rc $?"; grep -A5 "decode step" $OUT/pf_tp1.log | grep -E "^ *tp1 " | head -3
for setting in off 16,rows 16,head off; do
    if [ $setting = off ]; then unset BCG_AR_PREFETCH; else export BCG_AR_PREFETCH=$setting; fi
    timeout -k 5 100 python bench/bench_tp.py --configs tp2-custom --parts decode --repeats 1 \
        > $OUT/pf_$setting.log 2>&1
    echo "$setting rc $?"; grep -E "^ *tp2-custom +(1|8|64) " $OUT/pf_$setting.log | head -3
done
