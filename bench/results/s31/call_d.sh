#!/bin/bash
# Session 31, call D (two GPUs): the second engine's full GPU (second_probe.py) with wip.diff
# and with wip.diff less the collectives' warm-up at init; then the dying tests alone.
source bench/results/hang_s29/common.sh
rm -rf /tmp/noconnect && cp -r . /tmp/noconnect
sed -i '/^    _connect_collectives(_current, device)$/d' /tmp/noconnect/bcg/distributed/parallel_state.py
grep -c "_connect_collectives" /tmp/noconnect/bcg/distributed/parallel_state.py
run second_wip 100 python bench/results/s31/second_probe.py
grep PROBE $OUT/second_wip.log | cut -c1-300
run second_noconnect 100 env PYTHONPATH=/tmp/site:/tmp/noconnect bash -c "cd /tmp/noconnect && python bench/results/s31/second_probe.py"
grep PROBE $OUT/second_noconnect.log | cut -c1-300
rm -rf /tmp/base && cp -r . /tmp/base && (cd /tmp/base && patch -s -R -p1 < bench/results/s31/wip.diff) || exit 1
run second_base 100 env PYTHONPATH=/tmp/site:/tmp/base bash -c "cd /tmp/base && python bench/results/s31/second_probe.py"
grep PROBE $OUT/second_base.log | cut -c1-300
