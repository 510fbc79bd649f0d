"""bench/index_scaling.py runs end to end: `--quick --json PATH` (in the session's shared run of
bench/run_all.py, tests/e2e/bench_run.py) fills the real index at two sizes, prints one
house-format line per operation and size, and writes the same as JSON. Whether the cost stays
flat is the bench's business, not a test's."""

from __future__ import annotations

import pytest

from tests.e2e.bench_run import BenchRun
from tests.e2e.house_format import check_report, printed_figures

pytestmark = pytest.mark.bench("index_scaling")


def test_index_scaling_quick_json(bench_run: BenchRun) -> None:
    run = bench_run.script("index_scaling")
    run.assert_ok()
    lines = run.lines
    assert all(line.startswith(("bench ", "#")) for line in lines), lines
    expected = {f"index_{op}_at_8k" for op in ("lookup_1024", "put_32_evicting",
                                                "evict_lru_1024")}
    check_report(run.report["figures"], printed_figures(lines), expected)
