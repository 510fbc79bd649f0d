"""`make bench`'s runner (bench/run_all.py): it runs the chosen scripts, keeps every figure line
they print, and writes bench/results-style JSON and Markdown; a failing script is reported and
makes the run fail without stopping the others."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_run_all_writes_the_figures_as_json_and_markdown(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run_all.py"), "--only", "trace_sim", "--quick",
         "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [report_path] = tmp_path.glob("*.json")
    report = json.loads(report_path.read_text())
    # trace_sim runs twice: every trace family with L2 alone, and the public trace over an L3
    families, with_l3 = report["scripts"]
    for script in (families, with_l3):
        assert script["script"] == "trace_sim" and script["status"] == "ok"
        for name, figure in script["figures"].items():
            assert figure["line"] in proc.stdout
            assert figure["ratio"] > 0 and figure["unit"] == "ratio", name
    for family in ("multiturn", "sysprompt", "rag", "agent", "synthetic"):
        assert {f"sim_vs_lru_{family}_{pct}pct" for pct in (2, 10, 40)} <= set(
            families["figures"]), family
    assert families["figures"]["sim_vs_lru_synthetic_10pct"]["target"] == ">= 1.08x"
    assert families["figures"]["sim_vs_lru_rag_10pct"]["target"] == ">= 1.00x"
    assert set(with_l3["figures"]) == {"sim_tokens_10pct_l3x4", "sim_vs_lru_10pct_l3x4"}
    markdown = report_path.with_suffix(".md").read_text()
    assert "| trace_sim | ok |" in markdown and "sim_vs_lru_agent_5pct" in markdown


def test_a_failing_script_is_reported_not_fatal() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import run_all
    finally:
        sys.path.remove(str(REPO / "bench"))
    outcome = run_all.run_script(run_all.Script("no_such_bench", timeout_s=60), quick=False)
    assert outcome.status == "failed (exit 2)" and outcome.figures == {}
    assert any("no_such_bench" in line for line in outcome.info)
