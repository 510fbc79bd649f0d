#!/usr/bin/env bash
# `make gpu-check`: every test marked `gpu` and the GPU benchmarks, as one script for a lent
# GPU machine (device tool). Sized to finish within 8 minutes (pytest <= 240 s, benches <= 150 + 90 s,
# each under `timeout`); figures go to one file, $OUT/gpu-check.txt (or ./gpu-check.txt when
# OUT is unset). Exits non-zero when the tests or the benchmark failed or timed out.
#
# The GPU machine cannot reach a package index. It has python3 with torch, cupy, numpy,
# grpcio, protobuf, pyyaml, rich, xxhash and prometheus-client; `make gpu-wheels` (run where
# pip works) puts the rest in .whl/, which the device run must carry.
set -uo pipefail
cd "$(dirname "$0")/.."
report="${OUT:-.}/gpu-check.txt"
: >"$report"
log() { echo "$*" | tee -a "$report"; }

py=${PYTHON:-python3}
if [ -d .whl ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvstore-site .whl/*.whl \
    && export PYTHONPATH=/tmp/kvstore-site${PYTHONPATH:+:$PYTHONPATH}
fi
"$py" -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || log "note: editable install failed; running from the source tree"

log "== gpu-check $(date -u +%FT%TZ) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
log "== $("$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1 | tail -1)"
log "== /dev/shm free: $(df -h --output=avail /dev/shm 2>/dev/null | tail -1)"
log "== pytest -m gpu (HBM tier, pinned L2, kvikio tier contract, CUDA kernels vs reference)"
timeout 240 "$py" -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors tests 2>&1 | tail -n 40 | tee -a "$report"
status=${PIPESTATUS[0]}
log "== bench/gpu_bench.py (l2_pinned_h2d, l2_to_l1, kvikio_read)"
timeout 150 "$py" bench/gpu_bench.py --json 2>&1 | tee -a "$report"
bench_status=${PIPESTATUS[0]}
log "== bench/kernel_bench.py (decode_kernel vs SDPA on gathered K/V)"
timeout 90 "$py" bench/kernel_bench.py 2>&1 | tee -a "$report"
kernel_status=${PIPESTATUS[0]}
[ "$bench_status" -eq 0 ] && bench_status=$kernel_status
log "== done (pytest exit $status, bench exit $bench_status; 124 = timed out)"
[ "$status" -eq 0 ] && [ "$bench_status" -eq 0 ]
