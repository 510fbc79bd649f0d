"""`make bench`'s runner (bench/run_all.py): it runs the chosen scripts, keeps every figure line
and every `plot` line they print, and writes bench/results-style JSON, the plots as PNG beside
it (bench/plots.py) and Markdown that embeds them; a failing script is reported and makes the
run fail without stopping the others."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.e2e.test_bench_plots import check_png

FAMILIES = ("multiturn", "sysprompt", "rag", "agent", "synthetic")
POLICIES = {"lru", "store", "freq_oracle", "belady"}


@dataclass(frozen=True)
class Run:
    stdout: str
    out: Path
    report: dict[str, Any]
    markdown: str


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One real run of the quick trace simulation and store_bench (a real daemon and
    redis-server), shared by the tests below."""
    out = tmp_path_factory.mktemp("results")
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run_all.py"), "--only", "trace_sim",
         "--only", "store_bench", "--quick", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [report_path] = out.glob("*.json")
    return Run(proc.stdout, out, json.loads(report_path.read_text()),
               report_path.with_suffix(".md").read_text())


def test_run_all_writes_the_figures_as_json_and_markdown(run: Run) -> None:
    # store_bench first (the suite's order); trace_sim twice: every trace family with L2
    # alone, and the public trace over an L3
    store, families, with_l3 = run.report["scripts"]
    assert store["script"] == "store_bench" and store["status"] == "ok"
    assert store["figures"]["shm_get_into_2MiB"]["unit"] == "GB/s"
    for script in (families, with_l3):
        assert script["script"] == "trace_sim" and script["status"] == "ok"
        for name, figure in script["figures"].items():
            assert figure["line"] in run.stdout
            assert figure["ratio"] > 0 and figure["unit"] == "ratio", name
    for family in FAMILIES:
        assert {f"sim_vs_lru_{family}_{pct}pct" for pct in (2, 10, 40)} <= set(
            families["figures"]), family
    assert families["figures"]["sim_vs_lru_synthetic_10pct"]["target"] == ">= 1.08x"
    assert families["figures"]["sim_vs_lru_rag_10pct"]["target"] == ">= 1.00x"
    assert set(with_l3["figures"]) == {"sim_tokens_10pct_l3x4", "sim_vs_lru_10pct_l3x4"}
    assert "| trace_sim | ok |" in run.markdown and "sim_vs_lru_agent_5pct" in run.markdown


def test_the_plot_data_is_every_policy_at_every_capacity(run: Run) -> None:
    _, families, with_l3 = run.report["scripts"]
    assert set(families["plots"]) == {f"hit_rate_{f}" for f in FAMILIES}
    assert set(with_l3["plots"]) == {"hit_rate_mooncake_synthetic_trace_l3x4"}
    for family in FAMILIES:
        data = families["plots"][f"hit_rate_{family}"]
        assert data["family"] == family and data["l3_factor"] == 0 and data["requests"] == 600
        assert data["capacities"] == ["1pct", "2pct", "5pct", "10pct", "20pct", "40pct"]
        assert set(data["token_hit_rates"]) == POLICIES
        for rates in data["token_hit_rates"].values():
            assert len(rates) == 6 and all(0 <= r <= 1 for r in rates)
        # the figure lines and the plot data are the same simulation
        for n, label in enumerate(data["capacities"]):
            figure = families["figures"].get(f"sim_vs_lru_{family}_{label}")
            if figure is not None:  # none where LRU hit nothing
                rates = {p: r[n] for p, r in data["token_hit_rates"].items()}
                assert figure["ratio"] == pytest.approx(rates["store"] / rates["lru"], abs=0.02)


def test_run_all_draws_the_plots_beside_the_report_and_embeds_them(run: Run) -> None:
    stamp = run.report["date"]
    for name in ("hit_rate", "bandwidth"):
        png = run.out / f"{stamp}-{name}.png"
        check_png(png)
        assert f"]({png.name})" in run.markdown
        assert f"# plot {name}: {png}" in run.stdout
    assert not (run.out / f"{stamp}-ttft.png").exists()
    assert ("- TTFT with the prefix from L2 / L3 / L4 vs recompute: no data: engine_ttft not "
            "run; vllm_ttft not run") in run.markdown
    assert "Not in it: tier_bench not run; l4_bench not run; gpu_bench not run" in run.markdown


def test_a_failing_script_is_reported_not_fatal() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import run_all
    finally:
        sys.path.remove(str(REPO / "bench"))
    outcome = run_all.run_script(run_all.Script("no_such_bench", timeout_s=60), quick=False)
    assert outcome.status == "failed (exit 2)" and outcome.figures == {}
    assert any("no_such_bench" in line for line in outcome.info)
