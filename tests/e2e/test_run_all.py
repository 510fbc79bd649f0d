"""`make bench`'s runner (bench/run_all.py): it runs the chosen scripts, keeps every figure line
and every `plot` line they print, each script's whole output and its own JSON report, and writes
bench/results-style JSON, the plots as PNG beside it (bench/plots.py) and Markdown that embeds
them; a failing script is reported and makes the run fail without stopping the others. Each
figure is judged against its target (met, missed, target not understood, no target), and the
exit status says whether one missed: 3, or 0 for a --quick run unless --strict.

The run read here is the session's shared quick run (tests/e2e/bench_run.py): the quick trace
simulation and store_bench (a real daemon and redis-server) at least, and whichever other
scripts the session's selected smoke tests read."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import REPO
from tests.e2e.bench_run import BenchRun, run_all_module
from tests.e2e.test_bench_plots import bench_module, check_png

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
    # Every figure is judged, in the JSON and in its Markdown row; every target the scripts
    # print is one the runner understands; a quick run's misses leave its exit status alone.
    for script in scripts:
        for name, figure in script["figures"].items():
            verdict = figure["verdict"]
            if figure["target"]:
                assert verdict in ("met", "missed"), (name, figure)
                assert figure["why"].endswith(f" against {figure['target']}"), (name, figure)
            else:
                assert verdict == "no target", (name, figure)
            assert f"| {name} | " in bench_run.markdown
            assert f"| {figure['target']} | {verdict} |" in bench_run.markdown
    assert bench_run.report["quick"] and bench_run.report["exit_status"] == bench_run.returncode


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


# --- targets: parsed, judged, reported, and the exit status -----------------------------------


def figures_module() -> ModuleType:
    return bench_module("figures")


@pytest.mark.parametrize(("target", "ours", "ratio", "unit", "verdict"), [
    # Every form bench/*.py prints, each on both sides of its line.
    (">= 0.8x", 4.0, 0.80, "GB/s", "met"), (">= 0.8x", 3.9, 0.79, "GB/s", "missed"),
    (">= 2x", 1.0, 2.00, "tok/s", "met"), (">= 2x", 1.0, 1.99, "tok/s", "missed"),
    (">= 1.08x", 0.2, 1.08, "ratio", "met"), (">= 1.08x", 0.2, 1.07, "ratio", "missed"),
    ("1.00x", 99.0, 1.00, "%", "met"), ("1.00x", 99.0, 0.99, "%", "missed"),
    ("~1.00x", 0.29, 1.02, "ratio", "met"), ("~1.00x", 0.29, 0.98, "ratio", "met"),
    ("~1.00x", 0.29, 1.03, "ratio", "missed"), ("~1.00x", 0.29, 0.97, "ratio", "missed"),
    (">= 0.91x, i.e. TPOT with loads <= 1.1x", 50.0, 0.91, "ms", "met"),
    (">= 0.91x, i.e. TPOT with loads <= 1.1x", 50.0, 0.90, "ms", "missed"),
    (">= 0.9x vs the better of always and never", 9.0, 1.20, "ms", "met"),
    (">= 0.9x vs the better of always and never", 9.0, 0.89, "ms", "missed"),
    # An absolute target is on ours, whatever the ratio says.
    ("p50 <= 0.45 ms", 0.45, 0.10, "ms", "met"), ("p50 <= 0.45 ms", 0.451, 30.0, "ms", "missed"),
    ("< 2 ms", 1.9, 1.0, "ms", "met"), ("> 2 GB/s", 2.0, 9.0, "GB/s", "missed"),
    ("", 1.0, 0.01, "GB/s", "no target"),
    # What it cannot read is said, never counted as met.
    ("fast enough", 9.0, 9.0, "GB/s", "target not understood"),
    ("0.45 ms", 0.1, 9.0, "ms", "target not understood"),  # a floor or a ceiling?
    ("p50 <= 0.45 s", 0.1, 9.0, "ms", "target not understood"),  # another unit
    (">= 0.8xx", 9.0, 9.0, "GB/s", "target not understood"),
])
def test_a_target_is_parsed_and_judged(target: str, ours: float, ratio: float, unit: str,
                                       verdict: str) -> None:
    got, why = figures_module().judge(target, ours, ratio, unit)
    assert got == verdict, why
    assert (why == "") == (verdict == "no target")
    if verdict == "target not understood":
        assert repr(target) in why


@pytest.mark.parametrize(("value", "decimals", "printed"), [
    (0.0041, 2, "0.0041"), (0.0030, 2, "0.0030"), (0.4937, 2, "0.49"), (1.3667, 2, "1.37"),
    (1234.5678, 2, "1234.57"), (0.12345, 3, "0.123"), (0.00012, 3, "0.00012"), (0.0, 2, "0.00"),
])
def test_numbers_print_with_enough_digits(value: float, decimals: int, printed: str) -> None:
    assert figures_module().number(value, decimals) == printed


def test_a_small_ratio_prints_its_digits_in_the_house_format() -> None:
    figure = figures_module().Figure("sim_vs_lru_x", 0.0041, "lru", 0.0030, "ratio",
                                     target=">= 1.00x")
    line = figure.line()
    assert line == ("bench sim_vs_lru_x: 0.0041 ratio vs lru 0.0030 ratio = 1.37x "
                    "(target >= 1.00x)")
    [parsed] = run_all_module().parse(line)[0].values()
    assert (parsed["ours"], parsed["baseline"], parsed["verdict"]) == (0.0041, 0.0030, "met")


TARGETS_SCRIPT = """
    import argparse, sys
    from pathlib import Path
    sys.path.insert(0, {bench!r})
    from figures import Figure, run_main

    def run(args):
        return [Figure("fast_enough", 2.0, "memcpy", 2.5, "GB/s", target=">= 0.75x"),
                Figure("too_slow", 1.0, "memcpy", 2.5, "GB/s", target=">= 0.75x"),
                Figure("tiny_hit_rate", 0.0041, "lru", 0.0030, "ratio"),
                Figure("lookup_p50", 0.5, "redis", 2.0, "ms", lower_is_better=True,
                       target="p50 <= 0.45 ms"),
                Figure("vague", 1.0, "sim", 1.0, "ratio", target="fast | enough")], {{}}

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    sys.exit(run_main(parser.parse_args(), run))
"""


def targets_script(tmp_path: Path) -> Path:
    """A real bench-style script (bench/figures.py's lines and JSON report) whose figures
    meet, miss, lack and garble their targets."""
    path = tmp_path / "targets_bench.py"
    path.write_text(textwrap.dedent(TARGETS_SCRIPT.format(bench=str(REPO / "bench"))))
    return path


def test_the_report_marks_a_missed_figure_and_the_exit_status_says_so(tmp_path: Path) -> None:
    run_all = run_all_module()
    script = run_all.Script("targets_bench", timeout_s=60, source=str(targets_script(tmp_path)))
    out = tmp_path / "full"
    assert run_all.run_suite([script], quick=False, strict=False, out=out) == 3
    [md_path] = out.glob("*.md")
    md = md_path.read_text()
    rows = {row.split(" | ")[3]: row for row in md.splitlines()
            if row.startswith("| targets_bench | ok |")}
    assert rows["fast_enough"].endswith("| 0.80x | >= 0.75x | met |")
    assert rows["too_slow"].endswith("| 0.40x | >= 0.75x | missed |")
    assert rows["lookup_p50"].endswith("| 4.00x | p50 <= 0.45 ms | missed |")
    assert rows["tiny_hit_rate"].endswith(
        "| 0.0041 vs 0.0030 ratio (lru) | 1.37x |  | no target |")
    assert rows["vague"].endswith(" | fast \\| enough | target not understood: 'fast \\| "
                                  "enough': not [label] [>=\\|>\\|<=\\|<\\|~] <number>x or <op> "
                                  "<number> <unit> |")
    assert ("**2 figures missed their targets**: too_slow, lookup_p50; **1 figure has a "
            "target the runner does not understand**: vague; so the run's exit status is 3, "
            "or 1 if a script also failed.") in md
    [report] = out.glob("*.json")
    figures = json.loads(report.read_text())["scripts"][0]["figures"]
    assert {n: f["verdict"] for n, f in figures.items()} == {
        "fast_enough": "met", "too_slow": "missed", "tiny_hit_rate": "no target",
        "lookup_p50": "missed", "vague": "target not understood"}
    assert figures["too_slow"]["why"] == "0.40x against >= 0.75x"
    assert figures["lookup_p50"]["why"] == "0.500 ms against p50 <= 0.45 ms"


def test_a_quick_run_counts_misses_only_when_strict_and_a_failure_comes_first(
        tmp_path: Path) -> None:
    run_all = run_all_module()
    script = run_all.Script("targets_bench", timeout_s=60, source=str(targets_script(tmp_path)))
    assert run_all.run_suite([script], quick=True, strict=False, out=tmp_path / "quick") == 0
    [md_path] = (tmp_path / "quick").glob("*.md")
    md = md_path.read_text()
    assert "| too_slow | " in md and "| >= 0.75x | missed |" in md
    assert "the exit status does not count them (--strict would)" in md
    assert run_all.run_suite([script], quick=True, strict=True, out=tmp_path / "strict") == 3
    # A script that fails makes it 1, whatever the targets said.
    failing = run_all.Script("no_such_bench", timeout_s=60)
    assert run_all.run_suite([script, failing], quick=False, strict=False,
                             out=tmp_path / "failed") == 1


def test_the_help_documents_the_exit_status() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "run_all.py"), "--help"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "Exit status:" in proc.stdout and "--strict" in proc.stdout
    for code in ("0  every script ran", "1  a script failed", "3  every script ended ok"):
        assert code in proc.stdout


OVERLAP_SCRIPT = """
    import argparse, sys, time
    from pathlib import Path
    sys.path.insert(0, {bench!r})
    from figures import Figure, run_main

    def run(args):
        (args.folder / args.me).touch()
        deadline = time.monotonic() + 30
        while not (args.folder / args.other).exists():
            if time.monotonic() > deadline:
                sys.exit(f"{{args.me}} ran alone: {{args.other}} never started")
            time.sleep(0.05)
        time.sleep(args.linger)
        return [Figure(f"{{args.me}}_ran", 1.0, "nothing", 1.0, "ratio")], {{}}

    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("me")
    parser.add_argument("other")
    parser.add_argument("linger", type=float)
    parser.add_argument("--json", type=Path)
    sys.exit(run_main(parser.parse_args(), run))
"""


def test_jobs_run_scripts_at_once_and_report_them_in_suite_order(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Each script waits until the other has started: only a run of both at once ends ok.
    source = tmp_path / "overlap_bench.py"
    source.write_text(textwrap.dedent(OVERLAP_SCRIPT.format(bench=str(REPO / "bench"))))
    run_all = run_all_module()
    first, second = (run_all.Script(me, args=(str(tmp_path), me, other, linger),
                                    quick_args=(str(tmp_path), me, other, linger),
                                    timeout_s=60, source=str(source))
                     for me, other, linger in (("first", "second", "1.0"),
                                               ("second", "first", "0")))
    out = tmp_path / "out"
    assert run_all.run_suite([first, second], quick=True, strict=False, out=out, jobs=2) == 0
    # The second ended first and printed first; the report keeps the suite's order.
    printed = capsys.readouterr().out
    assert printed.index("# second: ok") < printed.index("# first: ok"), printed
    [report] = out.glob("*.json")
    scripts = json.loads(report.read_text())["scripts"]
    assert [(s["script"], s["status"], list(s["figures"])) for s in scripts] == [
        ("first", "ok", ["first_ran"]), ("second", "ok", ["second_ran"])]


def test_jobs_below_one_are_refused_naming_the_flag() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "run_all.py"), "--jobs", "0"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and "--jobs must be at least 1, got 0" in proc.stderr, proc
