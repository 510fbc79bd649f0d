"""`make run`: the demo starts its own daemon, drives a small prefix-sharing workload through the
client, checks every loaded block bit-exact, prints the stats table and stops the daemon, which
removes its shared-memory segment."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_demo_runs_verifies_blocks_and_cleans_up() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["COLUMNS"] = "200"  # rich: keep lines and table rows whole in captured output
    env["KVSTORE_NVME_CAPACITY_BYTES"] = "64MiB"  # the 4 GiB default L3 file is not needed
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.tools.demo", "--requests", "8", "--block-bytes", "65536",
         "--port", "0", "--metrics-port", "0"],  # not the defaults: `make run` may be running
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    flat = " ".join(output.split())
    assert "8 requests" in flat
    assert "verified bit-exact" in flat
    assert re.search(r"\bdram\b.*\byes\b", output), output  # the stats table's L2 row
    assert "kvstore-server stopped (exit 0)" in flat

    port = re.search(r"starting.*--port (\d+)", flat)
    segment = re.search(r"L2 shm (kvstore-[\w.-]+)[,)]", flat)
    assert port and segment, output
    assert not (Path("/dev/shm") / segment.group(1)).exists()
    assert list(Path("/dev/shm").glob(f"kvstore-{port.group(1)}-*")) == []
