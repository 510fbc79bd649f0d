"""The benchmark report's plots (bench/plots.py): from the runner's report (bench/run_all.py's
parse of what the scripts print) to PNG files and the Markdown that embeds them. A report with
a script skipped, failed or not run draws what its data allows and says what it left out;
malformed data is named, never raised; `python bench/plots.py REPORT.json` redraws. The
runner's own run (trace_sim and store_bench, drawn for real) is in test_run_all.py."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import REPO

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def bench_module(name: str) -> ModuleType:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(REPO / "bench"))


def check_png(path: Path, min_width: int = 400, min_height: int = 300) -> tuple[int, int]:
    """A real PNG of a readable size and more than a blank canvas: (width, height)."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    length, kind, width, height = struct.unpack(">I4sII", data[8:24])
    assert (length, kind) == (13, b"IHDR"), f"{path}: the first chunk is not IHDR"
    assert width >= min_width and height >= min_height, (path, width, height)
    assert len(data) > 10_000, f"{path}: {len(data)} bytes is next to nothing drawn"
    return width, height


def outcome(script: str, status: str, stdout: str) -> dict[str, Any]:
    """One script's entry in the report, as bench/run_all.py makes it from its output."""
    run_all = bench_module("run_all")
    figures, info, plot_data = run_all.parse(stdout)
    return asdict(run_all.Outcome(script, status, 1.0, figures, info, plot_data))


def hit_rate_line(family: str, lru: list[float]) -> str:
    figures = bench_module("figures")
    pcts = [1, 2, 5, 10, 20, 40]
    return str(figures.plot_line(f"hit_rate_{family}", {
        "trace": family, "family": family, "l3_factor": 0.0, "requests": 600,
        "distinct_blocks": 2000, "capacities": [f"{p}pct" for p in pcts],
        "capacity_blocks": [20 * p for p in pcts], "capacity_pcts": pcts,
        "token_hit_rates": {"lru": lru, "store": [min(1.0, r * 1.2) for r in lru],
                            "freq_oracle": [min(1.0, r * 1.4) for r in lru],
                            "belady": [min(1.0, r * 1.5) for r in lru]}}))


ENGINE_TTFT = """\
# recompute: 2080-token prompt, TTFT median 2400 ms
bench ttft_l2: 310.000 ms vs recompute 2400.000 ms = 7.74x (target >= 5x)
bench ttft_l3: 520.000 ms vs recompute 2400.000 ms = 4.62x
bench replay_throughput: 900.00 tok/s vs no store 400.00 tok/s = 2.25x
"""
VLLM_TTFT = """\
bench vllm_ttft_l2: 600.000 ms vs recompute 2500.000 ms = 4.17x (target >= 3x)
bench vllm_ttft_l3: 800.000 ms vs recompute 2450.000 ms = 3.06x
"""
STORE_BENCH = """\
bench shm_get_into_256KiB: 1.92 GB/s vs memcpy 9.73 GB/s = 0.20x (target >= 0.35x)
bench inline_get_256KiB: 0.24 GB/s vs redis GET 0.60 GB/s = 0.40x
bench shm_get_into_2MiB: 3.25 GB/s vs memcpy 5.30 GB/s = 0.61x (target >= 0.75x)
bench inline_get_floor_2MiB: 0.73 GB/s vs bare grpc stream 1.01 GB/s = 0.73x (target >= 0.8x)
bench lookup_1024_p50: 1.724 ms vs redis EXISTS 15.882 ms = 9.21x (target p50 <= 0.45 ms)
"""


def report_of(*scripts: dict[str, Any], quick: bool = False) -> dict[str, Any]:
    return {"date": "2030-01-01T0000Z", "quick": quick, "cuda": False, "total_s": 1.0,
            "scripts": list(scripts)}


def test_a_report_missing_data_draws_what_it_can_and_says_what_it_left_out(
        tmp_path: Path) -> None:
    plots = bench_module("plots")
    report = report_of(
        outcome("trace_sim", "failed (exit 1)", "# simulating\n"),
        outcome("engine_ttft", "ok", ENGINE_TTFT),
        outcome("vllm_ttft", "skipped (no .venv-vllm/bin/python; `make test-vllm` builds it)", ""),
        outcome("store_bench", "ok", STORE_BENCH),
    )
    drawn = {d.name: d for d in plots.draw(report, tmp_path, "stamp")}

    hit_rate, ttft, bandwidth = drawn["hit_rate"], drawn["ttft"], drawn["bandwidth"]
    assert hit_rate.path is None and hit_rate.reason == "no data: trace_sim failed (exit 1)"
    assert not (tmp_path / "stamp-hit_rate.png").exists()
    assert ttft.path == tmp_path / "stamp-ttft.png"
    assert ttft.notes == ["vllm_ttft skipped (no .venv-vllm/bin/python; `make test-vllm` "
                          "builds it)"]
    assert bandwidth.path == tmp_path / "stamp-bandwidth.png"
    assert bandwidth.notes == ["tier_bench not run", "l4_bench not run",
                               "gpu_bench not run (no CUDA here)"]
    for d in (ttft, bandwidth):
        check_png(d.path)

    md = plots.markdown(list(drawn.values()))
    assert "![TTFT with the prefix from L2 / L3 / L4 vs recompute](stamp-ttft.png)" in md
    assert "](stamp-bandwidth.png)" in md and "stamp-hit_rate.png" not in md
    assert "Not in it: vllm_ttft skipped" in md
    assert ("- Token hit rate vs capacity, per trace family: no data: trace_sim failed "
            "(exit 1)") in md


def test_the_ttft_and_bandwidth_bars_are_the_figures_of_the_report() -> None:
    plots = bench_module("plots")
    report = report_of(outcome("engine_ttft", "ok", ENGINE_TTFT),
                       outcome("vllm_ttft", "ok", VLLM_TTFT),
                       outcome("store_bench", "ok", STORE_BENCH))
    ttft, notes = plots.ttft_data(report)
    assert notes == []
    assert [(b.label, b.ours, b.baseline, b.ratio) for b in ttft["engine_ttft"]] == [
        ("L2 (DRAM)", 310.0, 2400.0, 7.74), ("L3 (NVMe)", 520.0, 2400.0, 4.62)]
    assert [(b.label, b.baseline) for b in ttft["vllm_ttft"]] == [
        ("L2 (DRAM)", 2500.0), ("L3 (NVMe)", 2450.0)]  # each tier its own recompute

    bandwidth, _ = plots.bandwidth_data(report)
    assert list(bandwidth) == ["256KiB", "2MiB"]  # by size; ms figures are not bandwidth
    assert [(b.label, b.ours, b.baseline) for b in bandwidth["2MiB"]] == [
        ("shm_get_into vs memcpy", 3.25, 5.30),
        ("inline_get_floor vs bare grpc stream", 0.73, 1.01)]


def test_malformed_data_is_named_and_left_out_never_raised(tmp_path: Path) -> None:
    plots = bench_module("plots")
    bad_reports: list[object] = [{"scripts": "all of them"}, [], {"scripts": [{"script": "x"}]}]
    for bad in bad_reports:
        drawn = plots.draw(bad, tmp_path, "bad")
        assert [d.path for d in drawn] == [None, None, None]
        assert all(d.reason.startswith("bad data: report: scripts") for d in drawn), drawn

    short = json.loads(hit_rate_line("rag", [0.3, 0.31, 0.34, 0.36, 0.38, 0.4]).split(" ", 2)[2])
    short["token_hit_rates"]["lru"] = [0.3, 0.31]
    sim = outcome("trace_sim", "ok", hit_rate_line("agent", [0.17, 0.25, 0.41, 0.74, 0.94, 0.94])
                  + "\nplot hit_rate_rag " + json.dumps(short) + "\nplot hit_rate_x {oops}\n")
    broken = outcome("store_bench", "ok", STORE_BENCH)
    broken["figures"]["shm_get_into_2MiB"]["baseline"] = -1.0
    drawn = {d.name: d for d in plots.draw(report_of(sim, broken), tmp_path, "mixed")}

    assert sim["info"] == ["# plot hit_rate_x: not JSON (Expecting property name enclosed in "
                           "double quotes), left out"]
    assert drawn["hit_rate"].path is not None  # agent drawn, rag named and left out
    assert drawn["hit_rate"].notes == [
        "trace_sim plot hit_rate_rag: token_hit_rates.lru must be a list of 6 numbers, got "
        "[0.3, 0.31] (left out)"]
    assert ("store_bench figure shm_get_into_2MiB: baseline must be a finite number > 0, got "
            "-1.0 (left out)") in drawn["bandwidth"].notes
    bandwidth, _ = plots.bandwidth_data(report_of(sim, broken))
    assert [b.label for b in bandwidth["2MiB"]] == ["inline_get_floor vs bare grpc stream"]
    check_png(drawn["hit_rate"].path)
    check_png(drawn["bandwidth"].path)


def test_plots_py_redraws_a_saved_report_and_refreshes_its_markdown(tmp_path: Path) -> None:
    run_all = bench_module("run_all")
    sim = outcome("trace_sim", "ok", "\n".join(
        hit_rate_line(f, lru) for f, lru in (
            ("multiturn", [0.0, 0.01, 0.05, 0.16, 0.37, 0.51]),
            ("sysprompt", [0.11, 0.18, 0.43, 0.74, 0.91, 0.92]),
            ("synthetic", [0.002, 0.006, 0.008, 0.011, 0.036, 0.066]))))
    report = report_of(sim, outcome("engine_ttft", "ok", ENGINE_TTFT),
                       outcome("vllm_ttft", "ok", VLLM_TTFT), quick=True)
    path = tmp_path / "2030-01-01T0000Z.json"
    path.write_text(json.dumps(report))
    table = run_all.markdown([run_all.Outcome(**s) for s in report["scripts"]], "stamp", 1.0)
    path.with_suffix(".md").write_text(table)

    for _ in range(2):  # the second run replaces the section it wrote
        proc = subprocess.run([sys.executable, str(REPO / "bench" / "plots.py"), str(path)],
                              capture_output=True, text=True, timeout=120, cwd=REPO)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    md = path.with_suffix(".md").read_text()
    assert md.startswith(table) and md.count("## Plots") == 1
    assert "](2030-01-01T0000Z-hit_rate.png)" in md and "](2030-01-01T0000Z-ttft.png)" in md
    assert ("- Bandwidth of each path vs memcpy and its baselines: no data: store_bench not "
            "run") in md
    width, _ = check_png(tmp_path / "2030-01-01T0000Z-ttft.png")
    assert width >= 1000  # two panels: the engine's and vLLM's
    check_png(tmp_path / "2030-01-01T0000Z-hit_rate.png")
    assert not (tmp_path / "2030-01-01T0000Z-bandwidth.png").exists()


@pytest.mark.parametrize(("content", "message"), [
    (None, "No such file"), ("{", "Expecting property name"), ('{"date": 1}', "scripts must"),
])
def test_plots_py_names_the_file_and_field_of_a_bad_report(tmp_path: Path, content: str | None,
                                                          message: str) -> None:
    path = tmp_path / "report.json"
    if content is not None:
        path.write_text(content)
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "plots.py"), str(path)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: {path}: ") and message in proc.stderr, proc.stderr
