"""bench/remote_bench.py runs end to end: `--quick --json PATH` (in the session's shared run of
bench/run_all.py, tests/e2e/bench_run.py) drives a real daemon's data socket and its gRPC
stream against a bare Python socket server, prints one `bench <name>: ... = <ratio>x` line per
figure with a `#` line of its paired ratios, and writes a JSON object of positive numbers.
Speed is not asserted here; the targets live in the bench."""

from __future__ import annotations

import pytest

from tests.e2e.bench_run import BenchRun
from tests.e2e.house_format import check_report, printed_figures

pytestmark = pytest.mark.bench("remote_bench")

SIZES = ("256KiB", "2MiB")
TARGETED = {f"remote_{verb}_{size}" for verb in ("get", "put") for size in SIZES}
FIGURES = TARGETED | {f"{kind}_{size}" for kind in ("remote_get_noverify", "grpc_get",
                                                     "grpc_put") for size in SIZES}


def test_remote_bench_quick_json(bench_run: BenchRun) -> None:
    run = bench_run.script("remote_bench")
    run.assert_ok()
    for line in run.lines:
        assert line.startswith(("bench ", "#")), f"neither a figure nor an info line: {line!r}"
    figures = run.report["figures"]
    check_report(figures, printed_figures(run.lines), FIGURES)
    for name in FIGURES:
        assert figures[name]["batch_bytes"] == 16 * (256 << 10 if "256KiB" in name else 2 << 20)
        assert figures[name]["baseline_name"] == "bare socket"
        assert (figures[name].get("target") == ">= 0.8x") == (name in TARGETED)
