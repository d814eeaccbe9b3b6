#!/usr/bin/env bash
# The GPU suite and the benchmarks, for the device machine (see README "GPU checks").
# Usage: scripts/gpu_check.sh [step ...]   steps: tests bench_graph bench_buffers ... (default: all);
# a quoted step may carry arguments: scripts/gpu_check.sh "bench_offline --models qwen3-0.6b",
# and "tests models_hf sampling" runs only the test files whose names contain those words.
# With several GPUs visible the test files run in parallel lanes, one GPU each
# (GPU_CHECK_LANES=N sets the count), and the several-GPU files after them on every GPU.
# GPU_CHECK_FILES=single (or multi) runs only the one-GPU (or the several-GPU) test files,
# for device calls too short for both; GPU_CHECK_K="expr" passes -k "expr" to every test
# file (e.g. GPU_CHECK_FILES=multi GPU_CHECK_K="tiny-llama or dying": a part of
# tests/test_multi_gpu.py, which takes more than one call's 10 minutes whole).
# Wheels missing on that machine travel in .whl/ (carry it) and are installed to /tmp/site,
# which later calls on the same (warm) machine reuse without carrying them again.
set -uo pipefail
cd "$(dirname "$0")/.."
GPU_CHECK_FILES=${GPU_CHECK_FILES:-all}
case "$GPU_CHECK_FILES" in
  single | multi | all) ;;
  *) echo "gpu_check: GPU_CHECK_FILES must be single, multi or all" >&2; exit 2 ;;
esac
export PYTHONUNBUFFERED=1
install_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$@"
}
if compgen -G ".whl/*.whl" >/dev/null; then
  # One bad wheel (say a split file joined without its first half) fails pip's whole call:
  # then install them one by one, so the others still arrive, and name the bad one.
  if ! install_wheels .whl/*.whl 2>/dev/null; then
    for wheel in .whl/*.whl; do
      install_wheels "$wheel" 2>/dev/null || echo "gpu_check: could not install $wheel"
    done
  fi
fi
[ -d /tmp/site ] && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
log_dir="${OUT:-/tmp/gpu_check}"
mkdir -p "$log_dir"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests bench_graph bench_buffers bench_attention bench_prefill bench_decode)
# Files whose tests need several GPUs at once: they run after the others, with every GPU.
MULTI_GPU_FILES=" tests/test_multi_gpu.py tests/test_symm_mem.py "

# One test file in its own process (a CUDA error is sticky and would fail every later test),
# its output appended to $2; prints its summary line. Kernel tests run unmarked: on a GPU
# they compile and launch the real kernels.
test_file() {
  local file=$1 log=$2 started=$SECONDS marker=(-m gpu) only=()
  [[ "$file" == tests/test_kernels_* ]] && marker=()
  [ -n "${GPU_CHECK_K:-}" ] && only=(-k "$GPU_CHECK_K")
  python3 -m pytest -q "${marker[@]}" "${only[@]}" -p no:cacheprovider --tb=short "$file" \
    >"$log.one" 2>&1
  cat "$log.one" >>"$log"
  echo "$(basename "$file"): $(tail -n 1 "$log.one") [$((SECONDS - started)) s]"
}

# A file's summary line, numbered for the sorted summary on stdout, and at once on stderr:
# a run cut short by a time limit still shows the files it finished.
record() {
  printf '%05d %s\n' "$1" "$2"
  echo "gpu_check: $2" >&2
}

# The given test files, one GPU each, in as many parallel lanes as GPUs are visible
# (GPU_CHECK_LANES overrides), then the several-GPU files; every output goes to tests.log
# and each file's summary line to stdout, in file order.
run_tests() {
  local single=() multi=() devices=() scratch lane file
  for file in "$@"; do
    if [[ "$MULTI_GPU_FILES" == *" $file "* ]]; then multi+=("$file"); else single+=("$file"); fi
  done
  case "$GPU_CHECK_FILES" in
    single) multi=() ;;
    multi) single=() ;;
  esac
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    IFS=, read -ra devices <<<"$CUDA_VISIBLE_DEVICES"
  else
    mapfile -t devices < <(python3 -c 'import torch; print(*range(torch.cuda.device_count()))' |
      tr ' ' '\n' | grep .)
  fi
  local lanes=${GPU_CHECK_LANES:-${#devices[@]}}
  [ "$lanes" -ge 1 ] || lanes=1
  scratch=$(mktemp -d)
  for ((lane = 0; lane < lanes; lane++)); do
    (
      [ ${#devices[@]} -gt 0 ] && export CUDA_VISIBLE_DEVICES=${devices[lane % ${#devices[@]}]}
      for ((i = lane; i < ${#single[@]}; i += lanes)); do
        record "$i" "$(test_file "${single[i]}" "$scratch/lane$lane.log")"
      done >"$scratch/summary$lane"
    ) &
  done
  wait
  for ((i = 0; i < ${#multi[@]}; i++)); do
    record "$((${#single[@]} + i))" "$(test_file "${multi[i]}" "$scratch/multi.log")"
  done >"$scratch/summary_multi"
  cat "$scratch"/lane*.log "$scratch"/multi.log >"$log_dir/tests.log" 2>/dev/null
  sort -n "$scratch"/summary* | cut -d' ' -f2-
  rm -rf "$scratch"
}

summary=()
for step in "${steps[@]}"; do
  echo "=== $step"
  # A step may carry arguments: "bench_offline --models qwen3-0.6b".
  name="${step%% *}"
  args=()
  [ "$name" != "$step" ] && read -ra args <<<"${step#* }"
  if [ "$name" = tests ]; then
    # Files with gpu-marked tests (marks may come from shared helpers), and every kernel file.
    gpu_files=$(python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider tests 2>/dev/null |
      grep -oE '^tests/test_[a-z0-9_]+\.py' | sort -u)
    selected=()
    for file in $(printf '%s\n' $gpu_files tests/test_kernels_*.py | sort -u); do
      if [ ${#args[@]} -gt 0 ]; then
        wanted=0
        for word in "${args[@]}"; do [[ "$file" == *"$word"* ]] && wanted=1; done
        [ $wanted = 1 ] || continue
      fi
      selected+=("$file")
    done
    mapfile -t lines < <(run_tests "${selected[@]}")
    summary+=("${lines[@]}")
    grep -hE "^(FAILED|ERROR)" "$log_dir/tests.log" | head -20
  else
    python3 "bench/$name.py" "${args[@]}" 2>&1 | tee "$log_dir/$name.log"
    status=${PIPESTATUS[0]}
    json=$(ls -t bench/results/"$name"*.json 2>/dev/null | head -n 1)
    [ -n "$json" ] && cp -f "$json" "$log_dir/"
    summary+=("$step: exit $status, ${json:-no json}")
  fi
done
echo
echo "=== summary ($(python3 -c 'import torch; print(torch.cuda.get_device_name(), "torch", torch.__version__)'))"
printf '%s\n' "${summary[@]}"
