#!/bin/bash
# For the next session (two GPUs, about 6 minutes), on a copy of the tree with ar_prefetch.diff
# applied (this script applies it): the fused all-reduce + add + norm's extra programs ask L2
# for part of the next projection's weight while the ranks meet (the design of
# bench/results/ab_prefetch/ that stalled in session 26, most likely by the count race fixed
# in session 29). First its two-GPU test (fused calls with a prefetch asked), then qwen3-8b
# decode: tp1 once, tp2-custom with BCG_AR_PREFETCH unset, at 16 MiB in both shapes, unset.
rm -rf /tmp/pftree && cp -r . /tmp/pftree && cd /tmp/pftree
if grep -q RELEASED bcg/kernels/all_reduce_norm.py; then  # item 1's patch: take it out here
    patch -s -R -p1 < bench/results/hang_s29/release_and_shared_norm.diff || exit 1
fi
patch -s -p1 < bench/results/hang_s29/ar_prefetch.diff || exit 1
source bench/results/hang_s29/common.sh
run pf_custom 90 python -m pytest -q -p no:cacheprovider tests/test_custom_all_reduce.py
run pf_tp1 90 python bench/bench_tp.py --configs tp1 --parts decode --repeats 1
grep -E "^ *tp1 +(1|8|64) " $OUT/pf_tp1.log | head -3
for setting in off1 16,rows 16,head off2; do
    if [[ $setting = off* ]]; then unset BCG_AR_PREFETCH; else export BCG_AR_PREFETCH=$setting; fi
    name=pf_${setting/,/_}  # no commas in names that come back from the device
    run $name 100 python bench/bench_tp.py --configs tp2-custom --parts decode --repeats 1
    grep -E "^ *tp2-custom +(1|8|64) " $OUT/$name.log | head -3
done
