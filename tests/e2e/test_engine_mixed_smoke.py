"""bench/engine_mixed.py runs end to end: `--quick --json PATH` (in the session's shared run of
bench/run_all.py, tests/e2e/bench_run.py) steps decodes while requests with store hits arrive
and load (real daemon), and asks engines of each store_load_policy for prefixes only a real
redis-server holds, behind a SlowLink at three delays; it prints one `bench <name>: ... =
<ratio>x` line per figure and writes the same figures as JSON. What is checked is what each
figure claims to measure (the arrivals loaded, loads were in flight, each policy did what it
says, auto decided by cost after its first load), never its speed: the targets live in the
bench."""

from __future__ import annotations

import shutil

import pytest

from tests.e2e.bench_run import BenchRun
from tests.e2e.house_format import check_report, printed_figures

pytestmark = [pytest.mark.slow, pytest.mark.bench("engine_mixed")]

POLICY_FIGURES = {"policy_l4_fast", "policy_l4_mid", "policy_l4_slow"}


def test_engine_mixed_quick_json(bench_run: BenchRun) -> None:
    run = bench_run.script("engine_mixed")
    run.assert_ok()
    lines = run.lines
    for line in lines:
        assert line.startswith(("bench ", "#")), f"neither a figure nor an info line: {line!r}"

    expected = {"mixed_tpot"}
    if shutil.which("redis-server") is not None:
        expected |= POLICY_FIGURES
    report = run.report
    figures = report["figures"]
    check_report(figures, printed_figures(lines), expected)
    setup = report["setup"]
    assert setup["mixed_prefix_tokens"] == setup["policy_prefix_tokens"] == 256

    mixed = figures["mixed_tpot"]
    assert mixed["target"] == ">= 0.91x, i.e. TPOT with loads <= 1.1x"
    phases = mixed["phases"]
    assert {kind: len(runs) for kind, runs in phases.items()} == {
        "loads": setup["reps"], "local": setup["reps"], "none": setup["reps"]}
    # Every arrival of a "loads" phase loaded its whole prefix, and loads overlapped steps.
    assert mixed["arrivals"] == setup["reps"] * ((setup["decode_tokens"] - 1)
                                                 // setup["every_steps"])
    assert mixed["arrivals_loaded"] == mixed["arrivals"]
    for run in phases["loads"]:
        assert run["arrival_store_tokens"] == [256] * len(run["arrival_store_tokens"])
    assert 0 < mixed["steps_with_load_in_flight"] <= mixed["decode_steps"]
    assert all(d and "recompute" not in d for d in mixed["arrival_decisions"])
    # "local" sent the same arrivals, served from the engine's own prefix cache; "none" none.
    for run in phases["local"]:
        assert run["arrival_store_tokens"] == [0] * (mixed["arrivals"] // setup["reps"])
        assert run["loading_steps"] == 0
    assert all(run["arrival_store_tokens"] == [] for run in phases["none"])

    for name in expected & POLICY_FIGURES:
        check_policy_figure(figures[name], setup["policy_reps"])
    if expected & POLICY_FIGURES:
        delays = [figures[f"policy_l4_{n}"]["delay_ms"] for n in ("fast", "mid", "slow")]
        assert delays[0] == 0 < delays[1] < delays[2]


def check_policy_figure(figure: dict[str, object], reps: int) -> None:
    """always loaded the whole prefix every rep, never none of it; auto's first rep had no L4
    rate yet and loaded, and after it auto decided by its estimates."""
    assert figure["target"] == ">= 0.9x vs the better of always and never"
    assert figure["baseline_name"] == f"policy {figure['best_fixed']}"
    runs = figure["runs"]
    first = figure["first_rep"]
    assert isinstance(runs, dict) and isinstance(first, dict)
    assert {p: len(r) for p, r in runs.items()} == {"auto": reps, "always": reps, "never": reps}
    for rep in [first["always"], *runs["always"]]:
        assert (rep["store_tokens"], rep["recomputed_tokens"]) == (256, 0)
        assert rep["decision"] == "policy always: load 16 blocks (remote)"
    for rep in [first["never"], *runs["never"]]:
        assert (rep["store_tokens"], rep["recomputed_tokens"]) == (0, 256)
        assert rep["decision"] == "policy never: recompute 16 blocks"
    assert first["auto"]["store_tokens"] == 256
    for rep in runs["auto"]:
        assert rep["decision"].startswith(("load ", "recompute ")), rep
        assert rep["store_tokens"] + rep["recomputed_tokens"] == 256
