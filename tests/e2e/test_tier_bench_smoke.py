"""bench/tier_bench.py runs end to end: `--quick --json PATH` drives a real NvmeTier against
as many parallel O_DIRECT `dd`s as it has io threads (and a single dd, JSON only), and a real
daemon's cold get against prefetch-then-get, prints one `bench <name>: ... = <ratio>x` line
per figure, writes a JSON object of positive numbers, and leaves neither its files nor its
shared-memory segments behind. Speed is not asserted here; the targets live in the bench."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.house_format import check_report, printed_figures

BENCH = REPO / "bench" / "tier_bench.py"
FIGURES = {"l3_write_2MiB", "l3_read_2MiB", "get_after_prefetch", "prefetch_to_dram"}


def direct_io_dir(tmp_path: Path) -> Path:
    """A folder for the bench's files whose filesystem takes O_DIRECT: tmp_path, or (when
    /tmp is a tmpfs that refuses it) one under the repo, which is on a disk."""
    for root in (tmp_path, REPO / ".bench-tmp"):
        root.mkdir(exist_ok=True)
        probe = root / f"direct-probe-{os.getpid()}"
        try:
            os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            continue
        finally:
            probe.unlink(missing_ok=True)
        files_dir = root / f"tier-bench-smoke-{os.getpid()}"
        files_dir.mkdir()
        return files_dir
    pytest.skip("neither /tmp nor the repo's filesystem takes O_DIRECT")


@pytest.mark.skipif(shutil.which("dd") is None, reason="the L3 baseline needs dd")
def test_tier_bench_quick_json(tmp_path: Path) -> None:
    report_path = tmp_path / "tier_bench.json"
    files_dir = direct_io_dir(tmp_path)
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--dir", str(files_dir),
         "--json", str(report_path)],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"

    lines = proc.stdout.splitlines()
    for line in lines:
        assert line.startswith(("bench ", "#")), f"neither a figure nor an info line: {line!r}"
    assert "O_DIRECT ours=True" in proc.stdout
    report = json.loads(report_path.read_text())
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

    assert list(files_dir.iterdir()) == [], "the bench left its files behind"
    files_dir.rmdir()
    if files_dir.parent != tmp_path:
        with contextlib.suppress(OSError):  # not empty: another bench run is using it
            files_dir.parent.rmdir()
    for shm_name in report["setup"]["shm_names"]:
        assert shm_name.startswith("kvstore-")
        assert not (Path("/dev/shm") / shm_name).exists(), f"{shm_name} was left behind"
