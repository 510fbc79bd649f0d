"""bench/tier_bench.py runs end to end: `--quick --json PATH` (in the session's shared run of
bench/run_all.py, tests/e2e/bench_run.py) drives a real NvmeTier against as many parallel
O_DIRECT `dd`s as it has io threads (and a single dd, JSON only), and a real daemon's cold get
against prefetch-then-get, prints one `bench <name>: ... = <ratio>x` line per figure, writes a
JSON object of positive numbers, and leaves neither its files nor its shared-memory segments
behind. Speed is not asserted here; the targets live in the bench.

The runner gives it no --dir, so its files go under the repository's .bench-tmp/ (the
runner's working folder), on a disk; where that filesystem refuses O_DIRECT the test skips."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.bench_run import BenchRun
from tests.e2e.house_format import check_report, printed_figures

pytestmark = pytest.mark.bench("tier_bench")

FIGURES = {"l3_write_2MiB", "l3_read_2MiB", "get_after_prefetch", "prefetch_to_dram"}


def takes_o_direct(root: Path) -> bool:
    """Whether the filesystem of root (made if missing, removed after if left empty) opens
    files with O_DIRECT."""
    root.mkdir(exist_ok=True)
    probe = root / f"direct-probe-{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        return False
    finally:
        probe.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty: a bench run is using it
            root.rmdir()
    return True


@pytest.mark.skipif(shutil.which("dd") is None, reason="the L3 baseline needs dd")
def test_tier_bench_quick_json(bench_run: BenchRun) -> None:
    if not takes_o_direct(REPO / ".bench-tmp"):
        pytest.skip("the repo's filesystem does not take O_DIRECT")
    run = bench_run.script("tier_bench")
    run.assert_ok()

    lines = run.lines
    for line in lines:
        assert line.startswith(("bench ", "#")), f"neither a figure nor an info line: {line!r}"
    assert "O_DIRECT ours=True" in run.stdout
    report = run.report
    figures = report["figures"]
    check_report(figures, printed_figures(lines), FIGURES)
    assert figures["l3_read_2MiB"]["target"] == ">= 0.8x"
    streams = report["setup"]["io_threads"]
    for name in ("l3_write_2MiB", "l3_read_2MiB"):
        figure = figures[name]
        assert figure["baseline_name"] == f"dd O_DIRECT x{streams}"
        assert figure["baseline_streams"] == streams
        assert isinstance(figure["single_dd"], float) and figure["single_dd"] > 0
        assert len(figure["single_dd_s"]) == len(figure["baseline_s"]) == figure["rounds"]
    assert report["setup"]["l3_direct"] is True

    files_dir = Path(report["setup"]["dir"])
    assert files_dir.parent == REPO / ".bench-tmp", files_dir
    assert not files_dir.exists(), "the bench left its files behind"
    for shm_name in report["setup"]["shm_names"]:
        assert shm_name.startswith("kvstore-")
        assert not (Path("/dev/shm") / shm_name).exists(), f"{shm_name} was left behind"
