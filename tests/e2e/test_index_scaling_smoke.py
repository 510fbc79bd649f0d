"""bench/index_scaling.py runs end to end: `--quick --json PATH` fills the real index at two
sizes, prints one house-format line per operation and size, and writes the same as JSON.
Whether the cost stays flat is the bench's business, not a test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from tests.e2e.house_format import check_report, printed_figures


def test_index_scaling_quick_json(tmp_path: Path) -> None:
    report_path = tmp_path / "index_scaling.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "index_scaling.py"), "--quick", "--json",
         str(report_path)], cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert all(line.startswith(("bench ", "#")) for line in lines), lines
    expected = {f"index_{op}_at_8k" for op in ("lookup_1024", "put_32_evicting",
                                                "evict_lru_1024")}
    check_report(json.loads(report_path.read_text())["figures"], printed_figures(lines),
                 expected)
