"""bench/engine_bench.py runs end to end: `--quick --json PATH` serves SmolLM2-135M with the
engine and with transformers, prints one `bench <name>: ... = <ratio>x` line per figure and
writes the same figures as JSON. Speed is not asserted here; the targets live in the bench."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.house_format import check_report, printed_figures
from tests.engine.models import smollm2_gguf

pytestmark = pytest.mark.slow

BENCH = REPO / "bench" / "engine_bench.py"


def test_engine_bench_quick_json(tmp_path: Path) -> None:
    smollm2_gguf()  # skips without the model wheel
    report_path = tmp_path / "engine_bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json", str(report_path)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    for line in lines:
        assert line.startswith(("bench ", "#")), f"neither a figure nor an info line: {line!r}"
    report = json.loads(report_path.read_text())
    check_report(report["figures"], printed_figures(lines), {"throughput_4", "ttft_1k_prefix"})
    assert report["figures"]["ttft_1k_prefix"]["cached_tokens"] == 1024
