"""`make bench`'s runner (bench/run_all.py): it runs the chosen scripts, keeps every figure line
and every `plot` line they print, each script's whole output and its own JSON report, and writes
bench/results-style JSON, the plots as PNG beside it (bench/plots.py) and Markdown that embeds
them; a failing script is reported and makes the run fail without stopping the others.

The run read here is the session's shared quick run (tests/e2e/bench_run.py): the quick trace
simulation and store_bench (a real daemon and redis-server) at least, and whichever other
scripts the session's selected smoke tests read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.bench_run import BenchRun, run_all_module
from tests.e2e.test_bench_plots import check_png

pytestmark = pytest.mark.bench("store_bench", "trace_sim")

FAMILIES = ("multiturn", "sysprompt", "rag", "agent", "synthetic")
POLICIES = {"lru", "store", "freq_oracle", "belady"}


def test_run_all_writes_the_figures_as_json_and_markdown(bench_run: BenchRun) -> None:
    scripts = bench_run.report["scripts"]
    # In the suite's order; trace_sim twice: every trace family with L2 alone, and the public
    # trace over an L3. The run fails exactly when a script did not end "ok".
    ran = [s["script"] for s in scripts]
    assert ran == [s.name for s in run_all_module().SUITE if s.name in ran]
    assert ran.count("trace_sim") == 2
    assert (bench_run.returncode == 0) == all(s["status"] == "ok" for s in scripts)
    store = bench_run.script("store_bench").outcome
    families, with_l3 = (bench_run.script("trace_sim", n).outcome for n in (1, 2))
    assert store["status"] == "ok", store
    assert store["figures"]["shm_get_into_2MiB"]["unit"] == "GB/s"
    for script in (families, with_l3):
        assert script["script"] == "trace_sim" and script["status"] == "ok"
        for name, figure in script["figures"].items():
            assert figure["line"] in bench_run.stdout
            assert figure["ratio"] > 0 and figure["unit"] == "ratio", name
    for family in FAMILIES:
        assert {f"sim_vs_lru_{family}_{pct}pct" for pct in (2, 10, 40)} <= set(
            families["figures"]), family
    assert families["figures"]["sim_vs_lru_synthetic_10pct"]["target"] == ">= 1.08x"
    assert families["figures"]["sim_vs_lru_rag_10pct"]["target"] == ">= 1.00x"
    assert set(with_l3["figures"]) == {"sim_tokens_10pct_l3x4", "sim_vs_lru_10pct_l3x4"}
    assert "| trace_sim | ok |" in bench_run.markdown
    assert "sim_vs_lru_agent_5pct" in bench_run.markdown


def test_each_scripts_output_and_json_report_are_kept_beside_the_report(
        bench_run: BenchRun) -> None:
    stamp = bench_run.report["date"]
    for script in bench_run.report["scripts"]:
        for key in ("stdout_file", "stderr_file", "json_file"):
            path = Path(script[key])
            assert path.parent == Path(stamp) and (bench_run.out / path).is_file(), (key, script)
    # Every figure the runner parsed is a line of the kept stdout, and in the script's report.
    first, second = (bench_run.script("trace_sim", n) for n in (1, 2))
    assert Path(second.outcome["json_file"]).name == "trace_sim-2.json"
    for run in (first, second):
        for name, figure in run.outcome["figures"].items():
            assert figure["line"] in run.lines
            assert run.report["figures"][name]["ratio"] == pytest.approx(figure["ratio"],
                                                                          abs=0.005)
    # store_bench prints its report as its last stdout line; the runner keeps it as a file.
    store = bench_run.script("store_bench")
    assert store.report == json.loads(store.lines[-1])
    assert set(store.report["figures"]) == set(store.outcome["figures"])


def test_the_plot_data_is_every_policy_at_every_capacity(bench_run: BenchRun) -> None:
    families, with_l3 = (bench_run.script("trace_sim", n).outcome for n in (1, 2))
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


def test_run_all_draws_the_plots_beside_the_report_and_embeds_them(bench_run: BenchRun) -> None:
    stamp = bench_run.report["date"]
    ran = {s["script"] for s in bench_run.report["scripts"] if s["status"] == "ok"}
    for name in ("hit_rate", "bandwidth"):
        png = bench_run.out / f"{stamp}-{name}.png"
        check_png(png)
        assert f"]({png.name})" in bench_run.markdown
        assert f"# plot {name}: {png}" in bench_run.stdout
    ttft = bench_run.out / f"{stamp}-ttft.png"
    if "engine_ttft" in ran:
        check_png(ttft)
        assert "Not in it: vllm_ttft not run" in bench_run.markdown
    else:
        assert not ttft.exists()
        assert ("- TTFT with the prefix from L2 / L3 / L4 vs recompute: no data: engine_ttft "
                "not run; vllm_ttft not run") in bench_run.markdown
    # What the bandwidth plot lacks, and why: the scripts that were not run.
    [lacks] = [line for line in bench_run.markdown.splitlines()
               if line.startswith("Not in it:") and "gpu_bench" in line]
    for name in ("tier_bench", "l4_bench", "gpu_bench"):
        assert (f"{name} not run" in lacks) == (name not in ran), (name, lacks)


def test_a_failing_script_is_reported_not_fatal(tmp_path: Path) -> None:
    run_all = run_all_module()
    outcome = run_all.run_script(run_all.Script("no_such_bench", timeout_s=60), quick=False)
    assert outcome.status == "failed (exit 2)" and outcome.figures == {}
    assert any("no_such_bench" in line for line in outcome.info)
    # With files, its whole stderr is kept; it wrote no JSON report, and none is named.
    files = tmp_path / "stamp" / "no_such_bench"
    outcome = run_all.run_script(run_all.Script("no_such_bench", timeout_s=60), quick=False,
                                 files=files)
    assert outcome.status == "failed (exit 2)" and outcome.json_file == ""
    assert outcome.stderr_file == "stamp/no_such_bench.err"
    assert "no_such_bench.py" in (tmp_path / outcome.stderr_file).read_text()
