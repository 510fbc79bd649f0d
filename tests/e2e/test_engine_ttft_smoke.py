"""bench/engine_ttft.py runs end to end: `--quick --json PATH` (in the session's shared run of
bench/run_all.py, tests/e2e/bench_run.py) serves a tiny random Llama with its prefix recomputed
and loaded from L2, L3 and (with redis-server) L4 of real daemons, replays a slice of the
Mooncake trace with and without a store, prints one `bench <name>: ... = <ratio>x` line per
figure and writes the same figures as JSON, with each rep's store decision. Speed is not
asserted here; the targets live in the bench."""

from __future__ import annotations

import shutil

import pytest

from tests.e2e.bench_run import BenchRun
from tests.e2e.house_format import check_report, printed_figures

pytestmark = [pytest.mark.slow, pytest.mark.bench("engine_ttft")]


def test_engine_ttft_quick_json(bench_run: BenchRun) -> None:
    run = bench_run.script("engine_ttft")
    run.assert_ok()
    lines = run.lines
    for line in lines:
        assert line.startswith(("bench ", "#")), f"neither a figure nor an info line: {line!r}"

    expected = {"ttft_l2", "ttft_l3", "replay_prefill_saved", "replay_throughput"}
    if shutil.which("redis-server") is not None:
        expected.add("ttft_l4")
    report = run.report
    figures = report["figures"]
    check_report(figures, printed_figures(lines), expected)

    prefix_tokens = report["setup"]["prefix_tokens"]
    assert prefix_tokens == 256
    for name in expected & {"ttft_l2", "ttft_l3", "ttft_l4"}:
        # Every rep loaded exactly the prefix from the store: no suffix block, nothing less.
        assert figures[name]["store_tokens_reps"] == [prefix_tokens] * report["setup"]["reps"]
        assert figures[name]["store_tokens"] == prefix_tokens
        # The readers keep the default policy ("auto"); each rep's reason is recorded.
        decisions = figures[name]["decisions"]
        assert len(decisions) == report["setup"]["reps"]
        assert all(d and not d.startswith("recompute") for d in decisions), decisions
    assert figures["ttft_l2"]["target"] == ">= 5x"
    if "ttft_l4" in expected:
        assert figures["ttft_l4"]["remote_hits"] >= prefix_tokens // 16

    replay = figures["replay_prefill_saved"]
    assert replay["unit"] == "ratio" and replay["requests"] == 8
    # The store never makes an engine compute more, and this slice shares prefixes.
    assert 0 < replay["computed_tokens"] < replay["baseline_computed_tokens"]
    assert replay["store_tokens"] > 0
    assert replay["computed_tokens"] + replay["store_tokens"] + replay["local_tokens"] == (
        replay["prompt_tokens"])
