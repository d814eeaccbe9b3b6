#!/bin/bash
# For session 44: the skinny kernel's K skew and TMA loads (skinny_skew_tma.diff: both knobs,
# off by default), in one call on two H200s (about 6 minutes):
#   bash bench/results/s43/next_calls.sh a
# a  applies the diff to the device's copy, runs the skinny, all-reduce-norm and PDL kernel
#    tests with each knob on, then profile_step.py's per-layer medians at tp1 and tp2 for
#    main's kernel, BCG_SKINNY_SKEW=1 and 5, BCG_SKINNY_TMA=1, and both
source bench/results/hang_s29/common.sh
case "$1" in
  a) git apply bench/results/s43/skinny_skew_tma.diff || exit 1
     for knob in BCG_SKINNY_SKEW=1 BCG_SKINNY_TMA=1; do
       env $knob timeout 200 python -m pytest -q -p no:cacheprovider \
         tests/test_kernels_skinny_linear.py tests/test_kernels_all_reduce_norm.py \
         tests/test_kernels_pdl.py > $OUT/tests_${knob%%=*}.log 2>&1
       echo "$knob tests rc $?"; tail -1 $OUT/tests_${knob%%=*}.log
     done
     bash bench/results/s43/calls.sh d - BCG_SKINNY_SKEW=1 BCG_SKINNY_SKEW=5 BCG_SKINNY_TMA=1 \
       "BCG_SKINNY_TMA=1 BCG_SKINNY_SKEW=1" ;;
  *) echo "usage: $0 a"; exit 2 ;;
esac
