"""bench/engine_bench.py runs end to end: `--quick --json PATH` (in the session's shared run of
bench/run_all.py, tests/e2e/bench_run.py) serves SmolLM2-135M with the engine and with
transformers, prints one `bench <name>: ... = <ratio>x` line per figure and writes the same
figures as JSON. Speed is not asserted here; the targets live in the bench."""

from __future__ import annotations

import pytest

from tests.e2e.bench_run import BenchRun
from tests.e2e.house_format import check_report, printed_figures
from tests.engine.models import smollm2_gguf

pytestmark = [pytest.mark.slow, pytest.mark.bench("engine_bench")]


def test_engine_bench_quick_json(bench_run: BenchRun) -> None:
    smollm2_gguf()  # skips without the model wheel
    run = bench_run.script("engine_bench")
    run.assert_ok()
    lines = run.lines
    for line in lines:
        assert line.startswith(("bench ", "#")), f"neither a figure nor an info line: {line!r}"
    report = run.report
    check_report(report["figures"], printed_figures(lines), {"throughput_4", "ttft_256_prefix"})
    assert report["figures"]["ttft_256_prefix"]["cached_tokens"] == 256
