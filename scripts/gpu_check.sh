#!/usr/bin/env bash
# `make gpu-check` (or `bash scripts/gpu_check.sh`): the tests marked `gpu` and the GPU
# benchmarks, as one script for a lent, offline GPU machine.
#
# Stages, each under its own time limit, each reported in the summary (the figures file):
#   setup     install the carried wheels (.whl/, from `make gpu-wheels`) into /tmp/kvstore-site,
#             put it first on PYTHONPATH, install this tree editable        (<= 60 s)
#   preflight versions of torch, Triton, CUDA, cupy, grpcio, protobuf, kvikio; the imports
#             every later stage needs; stops the run with the reason when one fails   (<= 60 s)
#   kernels   the Triton kernels against the torch reference on CUDA
#             (tests/integration/test_gpu_kernels.py)                       (<= 75 s)
#   ordering  device copies on real streams and events
#             (tests/integration/test_device_copies_cuda.py)                (<= 30 s)
#   engine    the engine end to end on CUDA (tests/integration/test_engine_cuda.py)  (<= 45 s)
#   tiers     L1 HBM, the pinned L2 segment, the tier contract on CUDA      (<= 60 s)
#   gpu_bench l2_pinned_h2d, l2_to_l1, kvikio_read                         (<= 45 s)
#   kernel_bench  decode_kernel (Triton) vs torch SDPA over gathered blocks (<= 45 s)
# The pytest stages are the files of scripts/gpu_env.py GPU_TEST_FILES, -m gpu, 60 s a test.
# The first Triton launch of each kernel variant compiles it (seconds), hence kernels first:
# the later stages find those variants in Triton's cache. The whole run has a budget,
# GPU_CHECK_BUDGET_S (default 230 s): each stage's limit is cut to what is left of it, so a run
# never takes more than ~4 minutes of device time and a second try fits in a 15-minute lease;
# a stage the budget did not reach is reported "not run".
#
# Files under $OUT (./gpu-check-out when OUT is unset), written unbuffered as the run goes, so
# a killed run keeps what it had: gpu-check.txt (the summary: stage statuses, every `bench`
# line and the tests' outcomes), setup.log, pytest-<stage>.log, bench.log, gpu_bench.json,
# kernel_bench.json.
# Exits 0 only when every stage passed.
#
# GPU_CHECK_WHEELS names another wheel folder (default .whl); GPU_CHECK_INSTALL=0 skips the
# editable install where the tree is installed already (a development virtualenv).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check-out}"
mkdir -p "$out"
summary="$out/gpu-check.txt"
: >"$summary"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
wheels=${GPU_CHECK_WHEELS:-.whl}
budget_end=$((SECONDS + ${GPU_CHECK_BUDGET_S:-230}))
# limit N: N seconds, or what is left of the run's budget when that is less (at least 1).
limit() { local left=$((budget_end - SECONDS)); ((left < 1)) && left=1; echo $((left < $1 ? left : $1)); }
declare -A status=()
stages=(setup preflight kernels ordering engine tiers gpu_bench kernel_bench)
say() { echo "$*" | tee -a "$summary"; }
# budget_left NAME: true when at least 5 s of the run's budget remain; else NAME is "not run".
budget_left() {
  ((budget_end - SECONDS >= 5)) && return 0
  say "== $1: not run, the run's ${GPU_CHECK_BUDGET_S:-230} s budget is spent"
  return 1
}

finish() {
  say "== summary"
  local failed=0 stage
  for stage in "${stages[@]}"; do
    local rc=${status[$stage]:-not run}
    case $rc in
      0) say "   $stage: ok" ;;
      124|137) say "   $stage: TIMED OUT"; failed=1 ;;
      "not run") say "   $stage: not run"; failed=1 ;;
      *) say "   $stage: FAILED (exit $rc)"; failed=1 ;;
    esac
  done
  grep -h '^bench ' "$out/bench.log" 2>/dev/null | tee -a "$summary"
  local log
  for log in "$out"/pytest-*.log; do
    [ -f "$log" ] || continue
    grep -hE '^(FAILED|ERROR) |passed|failed|skipped' "$log" | tail -n 12 \
      | sed "s|^|$(basename "$log" .log): |" | tee -a "$summary"
  done
  exit "$failed"
}

say "== gpu-check $(date -u +%FT%TZ) on $(nvidia-smi --query-gpu=name,driver_version \
  --format=csv,noheader 2>/dev/null | head -1)"
say "== /dev/shm free: $(df -h --output=avail /dev/shm 2>/dev/null | tail -1 | tr -d ' ')"

say "== setup (log: setup.log)"
(
  set -e
  if [ -d "$wheels" ]; then
    # Only what the image lacks is in .whl, so nothing here shadows its own test stack.
    timeout "$(limit 60)" "$py" -m pip install --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/kvstore-site "$wheels"/*.whl
  else
    echo "no $wheels/: run 'make gpu-wheels' where pip reaches an index, and carry .whl"
  fi
  if [ "${GPU_CHECK_INSTALL:-1}" != 0 ]; then
    timeout "$(limit 60)" "$py" -m pip install --no-index --no-deps --no-build-isolation -e .
  fi
) >"$out/setup.log" 2>&1
status[setup]=$?
if [ "${status[setup]}" -ne 0 ]; then
  tail -n 20 "$out/setup.log" | tee -a "$summary"
  finish
fi
[ -d "$wheels" ] && export PYTHONPATH=/tmp/kvstore-site${PYTHONPATH:+:$PYTHONPATH}

say "== preflight"
timeout "$(limit 60)" "$py" scripts/gpu_env.py preflight 2>&1 | tee -a "$out/setup.log" "$summary"
status[preflight]=${PIPESTATUS[0]}
[ "${status[preflight]}" -eq 0 ] || finish

per_test=()
"$py" -c 'import pytest_timeout' 2>/dev/null && per_test=(--timeout=60)
# pytest_stage NAME LIMIT FILE...: the files' gpu tests, their log in pytest-NAME.log.
pytest_stage() {
  local name=$1 seconds=$2
  shift 2
  budget_left "$name" || return 0
  say "== $name: pytest -m gpu $* (log: pytest-$name.log)"
  timeout -k 5 "$(limit "$seconds")" "$py" -m pytest -m gpu -v -rfEs -p no:cacheprovider \
    --durations=5 "${per_test[@]}" "$@" >"$out/pytest-$name.log" 2>&1
  status[$name]=$?
}
mapfile -t files < <("$py" scripts/gpu_env.py test-files)
tier_files=()
for f in "${files[@]}"; do
  case $f in
    */test_gpu_kernels.py|*/test_device_copies_cuda.py|*/test_engine_cuda.py) ;;
    *) tier_files+=("$f") ;;
  esac
done
pytest_stage kernels 75 tests/integration/test_gpu_kernels.py
pytest_stage ordering 30 tests/integration/test_device_copies_cuda.py
pytest_stage engine 45 tests/integration/test_engine_cuda.py
pytest_stage tiers 60 "${tier_files[@]}"

budget_left gpu_bench && {
say "== gpu_bench: bench/gpu_bench.py (log: bench.log)"
timeout -k 5 "$(limit 45)" "$py" bench/gpu_bench.py --moved-bytes $((1 << 30)) --repeats 5 --json \
  >>"$out/bench.log" 2>&1
status[gpu_bench]=$?
grep '^{' "$out/bench.log" | tail -n 1 >"$out/gpu_bench.json"
}

budget_left kernel_bench && {
say "== kernel_bench: bench/kernel_bench.py (log: bench.log)"
timeout -k 5 "$(limit 45)" "$py" bench/kernel_bench.py --json "$out/kernel_bench.json" >>"$out/bench.log" 2>&1
status[kernel_bench]=$?
}
finish
