#!/usr/bin/env bash
# `make gpu-check` (or `bash scripts/gpu_check.sh`): the tests marked `gpu` and the GPU
# benchmarks, as one script for a lent, offline GPU machine.
#
# Stages, each under its own time limit, each reported in the summary:
#   setup     install the carried wheels (.whl/, from `make gpu-wheels`) into /tmp/kvstore-site,
#             put it first on PYTHONPATH, install this tree editable        (<= 60 s)
#   preflight versions of torch, CUDA, cupy, grpcio, protobuf, kvikio; the imports every later
#             stage needs; stops the run with the reason when one fails   (<= 60 s)
#   pytest    the GPU test files (scripts/gpu_env.py test-files), -m gpu, 60 s a test (<= 150 s)
#   gpu_bench l2_pinned_h2d, l2_to_l1, kvikio_read                         (<= 60 s)
#   kernels   decode_kernel vs SDPA                                        (<= 45 s)
# About 2 minutes when all goes well. The whole run also has a budget, GPU_CHECK_BUDGET_S
# (default 230 s): each stage's limit is cut to what is left of it, so a run never takes more
# than ~4 minutes of device time and a second try fits in a 15-minute lease.
#
# Files under $OUT (./gpu-check-out when OUT is unset), written unbuffered as the run goes, so
# a killed run keeps what it had: gpu-check.txt (the summary: stage statuses and every `bench`
# line), setup.log, pytest.log, bench.log, gpu_bench.json, kernel_bench.json.
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
say() { echo "$*" | tee -a "$summary"; }

finish() {
  say "== summary"
  local failed=0 stage
  for stage in setup preflight pytest gpu_bench kernels; do
    local rc=${status[$stage]:-not run}
    case $rc in
      0) say "   $stage: ok" ;;
      124|137) say "   $stage: TIMED OUT"; failed=1 ;;
      "not run") say "   $stage: not run"; failed=1 ;;
      *) say "   $stage: FAILED (exit $rc)"; failed=1 ;;
    esac
  done
  grep -h '^bench ' "$out/bench.log" 2>/dev/null | tee -a "$summary"
  grep -hE '^(FAILED|ERROR) |passed|failed' "$out/pytest.log" 2>/dev/null | tail -n 30 \
    | tee -a "$summary"
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

say "== pytest -m gpu (log: pytest.log)"
mapfile -t files < <("$py" scripts/gpu_env.py test-files)
per_test=()
"$py" -c 'import pytest_timeout' 2>/dev/null && per_test=(--timeout=60)
timeout -k 5 "$(limit 150)" "$py" -m pytest -m gpu -v -rfEs -p no:cacheprovider --durations=10 \
  --continue-on-collection-errors "${per_test[@]}" "${files[@]}" >"$out/pytest.log" 2>&1
status[pytest]=$?

say "== bench/gpu_bench.py (log: bench.log)"
timeout -k 5 "$(limit 60)" "$py" bench/gpu_bench.py --moved-bytes $((1 << 30)) --repeats 5 --json \
  >>"$out/bench.log" 2>&1
status[gpu_bench]=$?
grep '^{' "$out/bench.log" | tail -n 1 >"$out/gpu_bench.json"

say "== bench/kernel_bench.py"
timeout -k 5 "$(limit 45)" "$py" bench/kernel_bench.py --json "$out/kernel_bench.json" >>"$out/bench.log" 2>&1
status[kernels]=$?
finish
