"""bench/l3_pressure.py runs end to end: `--quick --busy --json PATH` (in the session's shared
run of bench/run_all.py, tests/e2e/bench_run.py) scans L3-cached blocks with readers at once
through a small L2 on a real daemon, prints one house-format line per figure, and writes the
same as JSON with the counts behind them. Spurious misses are asserted by
tests/integration/test_l3_reads_under_pressure.py and test_unleased_reads.py; here, that no
read came back with wrong bytes and no reader failed."""

from __future__ import annotations

import pytest

from tests.e2e.bench_run import BenchRun
from tests.e2e.house_format import check_report, printed_figures

pytestmark = pytest.mark.bench("l3_pressure")


def test_l3_pressure_quick_json(bench_run: BenchRun) -> None:
    run = bench_run.script("l3_pressure")
    run.assert_ok()
    lines = run.lines
    assert all(line.startswith(("bench ", "#")) for line in lines), lines
    figures = run.report["figures"]
    check_report(figures, printed_figures(lines),
                 {"l3_pressure_hits", "l3_pressure_hits_default_client",
                  "l3_pressure_reads_per_s"})
    for name in ("l3_pressure_hits", "l3_pressure_hits_default_client"):
        extra = figures[name]
        assert extra["wrong"] == 0 and not extra["errors"], (name, extra)
        assert extra["l3_block_reads"] > 0, (name, extra)
