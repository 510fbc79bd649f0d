"""bench/trace_replay.py end to end: `live` replays the public trace through a real daemon and
a real redis-server and prints house-format figures, its token hit rate that of the simulated
store policy at the same capacity (its `live --quick` run is the one in the session's shared
run of bench/run_all.py, tests/e2e/bench_run.py); bad input ends with one line naming what to
fix; and `simulate` is bench/trace_sim.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.tools.testing import free_port
from tests.conftest import REPO
from tests.e2e.bench_run import BenchRun
from tests.e2e.house_format import check_report, printed_figures

SCRIPT = REPO / "bench" / "trace_replay.py"
TRACE = REPO / "bench" / "traces" / "mooncake_synthetic_trace.jsonl"
# The live store drives the same index as the simulation, in the same namespace, so today
# their hits agree exactly; the tolerance leaves room for timing (a lease, a mover) only.
SIM_TOLERANCE = 0.02

ROWS: list[dict[str, object]] = [
    {"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]},
    {"timestamp": 1, "input_length": 1500, "output_length": 8, "hash_ids": [1, 2, 3]},
    {"timestamp": 2, "input_length": 600, "output_length": 8, "hash_ids": [4, 5]},
    {"timestamp": 3, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]},
]


def replay(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout_s)


def small_trace(tmp_path: Path, rows: list[dict[str, object]] | None = None) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows or ROWS))
    return path


@pytest.mark.bench("trace_replay")
def test_live_quick_matches_the_simulation_and_reports_in_house_format(
        bench_run: BenchRun) -> None:
    run = bench_run.script("trace_replay")
    run.assert_ok()
    # The runner gives no --trace: the default is the public trace.
    assert run.report["setup"]["trace"] == str(TRACE)
    lines = run.lines
    assert all(line.startswith(("bench ", "#")) for line in lines), lines
    expected = {"live_tokens_vs_sim_10pct", "live_tokens_vs_redis_10pct",
                "live_throughput", "live_latency_p50", "live_latency_p99"}
    report = run.report
    check_report(report["figures"], printed_figures(lines), expected)
    vs_sim = report["figures"]["live_tokens_vs_sim_10pct"]
    assert vs_sim["ours"] == pytest.approx(vs_sim["baseline"], rel=SIM_TOLERANCE), vs_sim
    setup = report["setup"]
    assert setup["requests"] == 300 and setup["target"] == "own"
    # Both caches were full and evicting: the figures are about eviction, not a cold start.
    assert setup["kvstore_blocks_at_end"] == setup["capacity_blocks"]
    assert setup["kvstore_evictions"] > 0 and setup["redis_evicted_keys"] > 0
    assert setup["lost_blocks"] == 0
    assert "trace_replay: 300/300 requests (100%)" in run.stderr


def test_live_on_a_tiny_trace_hits_what_the_simulation_hits(tmp_path: Path) -> None:
    # 4 blocks of cache: request 1 hits [1, 2], request 2 evicts 3 (a leaf), request 3
    # hits [1, 2] again: 1024 + 1024 of 4148 tokens.
    proc = replay("live", "--trace", str(small_trace(tmp_path)), "--capacity", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figure = printed_figures(proc.stdout.splitlines())["live_tokens_vs_sim_4blocks"]
    assert figure["ours"] == figure["base"] == f"{2048 / 4148:.2f}"
    assert "# kvstore token hit 0.4937  block hits 4 " in proc.stdout


def test_malformed_trace_line_exits_2_naming_line_and_field(tmp_path: Path) -> None:
    bad = [ROWS[0], {**ROWS[1], "input_length": "many"}]
    trace = small_trace(tmp_path, bad)
    proc = replay("live", "--trace", str(trace), timeout_s=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert f"{trace}:2" in line and "input_length" in line
    missing = replay("live", "--trace", str(tmp_path / "nope.jsonl"), timeout_s=60)
    assert missing.returncode == 2 and "nope.jsonl" in missing.stderr
    assert "Traceback" not in proc.stderr + missing.stderr


@pytest.mark.parametrize("flag, value", [("--capacity", "0"), ("--capacity", "-0.5"),
                                         ("--block-bytes", "0"), ("--requests", "0")])
def test_bad_numbers_exit_2_naming_the_flag(tmp_path: Path, flag: str, value: str) -> None:
    proc = replay("live", "--trace", str(small_trace(tmp_path)), flag, value, timeout_s=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"error: {flag} must be" in proc.stderr and "Traceback" not in proc.stderr


def test_unreachable_target_exits_1_with_one_line(tmp_path: Path) -> None:
    target = f"127.0.0.1:{free_port()}"  # nothing listens there
    proc = replay("live", "--trace", str(small_trace(tmp_path)), "--target", target,
                  timeout_s=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: cannot reach a kvstore daemon at --target {target}")


def test_simulate_is_trace_sim(tmp_path: Path) -> None:
    args = ["--trace", str(small_trace(tmp_path)), "--capacities", "2,4"]
    proc = replay("simulate", *args, timeout_s=60)
    direct = subprocess.run([sys.executable, str(REPO / "bench" / "trace_sim.py"), *args],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == direct.returncode == 0, proc.stderr + direct.stderr
    assert "bench sim_tokens_4blocks:" in proc.stdout
    assert "plot hit_rate_trace {" in proc.stdout

    def untimed(stdout: str) -> list[str]:  # "# trace: simulated in 0.0 s" is a wall time
        return [line for line in stdout.splitlines() if " simulated in " not in line]

    assert untimed(proc.stdout) == untimed(direct.stdout)
