"""bench/store_bench.py runs end to end: `--quick --json` (in the session's shared run of
bench/run_all.py, tests/e2e/bench_run.py) starts a real daemon and a real redis-server, prints
one `bench <name>: ... = <ratio>x` line per figure and a JSON object of positive numbers, and
leaves no shared-memory segment behind. Speed is not asserted here; the targets live in the
bench."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.bench_run import BenchRun
from tests.e2e.house_format import check_report, printed_figures

pytestmark = pytest.mark.bench("store_bench")

FIGURES = {
    f"{kind}_{size}" for kind in ("shm_get_into", "shm_get_into_noverify", "shm_get_into_asked",
                                  "shm_put", "inline_get", "inline_get_floor", "shm_first_put",
                                  "inline_put", "shm_put_posted")
    for size in ("256KiB", "2MiB")
} | {"lookup_1024_p50", "lookup_1024_p99", "lookup_asked_1024_p50", "auth_lookup_1024_p50",
     "auth_shm_get_into_2MiB"}


def test_store_bench_quick_json(bench_run: BenchRun) -> None:
    run = bench_run.script("store_bench")
    run.assert_ok()
    lines = run.lines

    report = json.loads(lines[-1])
    figures = report["figures"]
    check_report(figures, printed_figures(lines), FIGURES)
    for name in FIGURES - {"lookup_1024_p50", "lookup_1024_p99", "lookup_asked_1024_p50",
                           "auth_lookup_1024_p50"}:
        batches = 4 if name.startswith("shm_put_posted") else 1  # four posted, one flush
        assert figures[name]["batch_bytes"] == batches * 16 * (256 << 10 if "256KiB" in name
                                                               else 2 << 20)

    shm_name = report["setup"]["shm_name"]
    assert shm_name.startswith("kvstore-")
    assert not (Path("/dev/shm") / shm_name).exists(), "the bench left its segment behind"
