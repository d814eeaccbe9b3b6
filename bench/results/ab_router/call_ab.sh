python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
nvidia-smi -L
for i in 1 2; do
  for side in before after; do
    if [ $side = before ]; then P=/tmp/site:$PWD/.carry/before; else P=/tmp/site:$PWD; fi
    echo "=== $side $i"
    PYTHONPATH=$P timeout 200 python bench/bench_moe.py --configs tp1 --parts decode 2>&1 | grep -E "^ *tp1 |tp1:|Error" | tail -6
  done
done
cp bench/results/bench_moe.json $OUT/
