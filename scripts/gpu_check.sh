#!/usr/bin/env bash
# `make gpu-check`: every test marked `gpu` and the GPU benchmarks, as one script for a lent
# GPU machine (device tool). Sized to finish within 8 minutes; figures go to one file,
# $OUT/gpu-check.txt (or ./gpu-check.txt when OUT is unset).
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
log "== pytest -m gpu"
timeout 300 "$py" -m pytest -q -m gpu tests 2>&1 | tail -n 20 | tee -a "$report"
status=${PIPESTATUS[0]}
log "== bench/gpu_bench.py"
timeout 120 "$py" bench/gpu_bench.py 2>&1 | tee -a "$report"
log "== done (pytest exit $status)"
exit "$status"
