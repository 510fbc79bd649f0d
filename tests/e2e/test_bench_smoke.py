"""bench/store_bench.py runs end to end: `--quick --json` starts a real daemon and a real
redis-server, prints one `bench <name>: ... = <ratio>x` line per figure and a JSON object of
positive numbers, and leaves no shared-memory segment behind. Speed is not asserted here;
the targets live in the bench."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from tests.e2e.house_format import check_report, printed_figures

BENCH = REPO / "bench" / "store_bench.py"
FIGURES = {
    f"{kind}_{size}" for kind in ("shm_get_into", "shm_put", "inline_get", "inline_get_floor",
                                  "shm_first_put", "inline_put")
    for size in ("256KiB", "2MiB")
} | {"lookup_1024_p50", "lookup_1024_p99", "auth_lookup_1024_p50", "auth_shm_get_into_2MiB"}


def test_store_bench_quick_json() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stdout.splitlines()

    report = json.loads(lines[-1])
    figures = report["figures"]
    check_report(figures, printed_figures(lines), FIGURES)
    for name in FIGURES - {"lookup_1024_p50", "lookup_1024_p99", "auth_lookup_1024_p50"}:
        assert figures[name]["batch_bytes"] == 16 * (256 << 10 if "256KiB" in name else 2 << 20)

    shm_name = report["setup"]["shm_name"]
    assert shm_name.startswith("kvstore-")
    assert not (Path("/dev/shm") / shm_name).exists(), "the bench left its segment behind"
