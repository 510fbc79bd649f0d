"""bench/l4_bench.py runs end to end: `--quick --json PATH` (in the session's shared run of
bench/run_all.py, tests/e2e/bench_run.py) drives the frame codec against a numpy copy, two real
daemons' L4 put and get and a third's pre-warm against redis-py on a real redis-server, prints
one `bench <name>: ... = <ratio>x` line per figure, writes a JSON object of positive numbers,
and leaves no shared-memory segment behind. Speed is not asserted here; the targets live in the
bench."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.e2e.bench_run import BenchRun
from tests.e2e.house_format import check_report, printed_figures

pytestmark = pytest.mark.bench("l4_bench")

DTYPES = ("fp16", "bf16")
RATIO_FIGURES = {f"compress_{d}" for d in DTYPES}
FIGURES = {f"{kind}_{d}" for kind in ("encode", "decode") for d in DTYPES} | {
    f"l4_{verb}_{size}" for verb in ("put", "get") for size in ("256KiB", "2MiB")
} | {"prewarm_32MiB"}


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_l4_bench_quick_json(bench_run: BenchRun) -> None:
    run = bench_run.script("l4_bench")
    run.assert_ok()

    lines = run.lines
    for line in lines:
        assert line.startswith(("bench ", "#")), f"neither a figure nor an info line: {line!r}"
    report = run.report
    figures = report["figures"]
    check_report(figures, printed_figures(lines), FIGURES | RATIO_FIGURES)
    for name in RATIO_FIGURES:
        figure = figures[name]
        assert figure["unit"] == "ratio" and figure["baseline"] == 1.0
        assert 0 < figure["ours"] <= 1.01  # a frame never grows past its 24-byte header
        assert 0 < figure["lz4_forced_ratio"] < 1.1

    for name in FIGURES:
        if name.startswith("l4_"):
            assert figures[name]["target"] == ">= 0.8x"
            assert figures[name]["batch_bytes"] == 32 * (256 << 10 if "256KiB" in name
                                                         else 2 << 20)
    assert figures["prewarm_32MiB"]["unit"] == "ms"
    assert figures["prewarm_32MiB"]["blocks"] == 16
    assert report["setup"]["a_admissions_refused"] == 0

    shm_names = report["setup"]["shm_names"]
    assert len(shm_names) == 2 + figures["prewarm_32MiB"]["rounds"]
    for shm_name in shm_names:
        assert shm_name.startswith("kvstore-")
        assert not (Path("/dev/shm") / shm_name).exists(), f"{shm_name} was left behind"
