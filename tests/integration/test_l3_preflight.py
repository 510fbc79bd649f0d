"""L3 on a small real filesystem (a tmpfs mounted for the test): a real daemon refuses an
nvme.capacity_bytes larger than the filesystem holds beside its reserve, exits 2 naming the
setting and a value that fits, and leaves no file; that value starts. While running, free
space falling under the reserve, or an L3 write finding no room, turns L3 admission off (one
warning, the kvstore_l3_admission_* metrics) while L2 and reads of L3 go on, and it comes back
on once there is room again. The arithmetic is tests/unit/test_l3room.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstore.client import KVStoreClient, TierStats
from kvstore.tools.testing import Daemon, free_port
from tests.helpers import block_map, scrape, wait_until

PAGE = 64 << 10
NS = "l3preflight"
# 64 pages of L2: 60 blocks pass the 0.9 watermark and the mover demotes some to L3.
# nvme.reserve_bytes=0: the automatic reserve, not the test daemons' fixed one.
SMALL = ("dram.capacity_bytes=4MiB", "dram.page_size_bytes=64KiB", "nvme.page_size_bytes=64KiB",
         "movers.interval_s=0.02", "hbm.mode=off", "nvme.reserve_bytes=0")
Blocks = dict[bytes, bytes]
Mount = Callable[..., Path]


@pytest.fixture
def mount_tmpfs(tmp_path: Path) -> Iterator[Mount]:
    """mount("size=200m") -> a fresh tmpfs folder; unmounted at teardown. Skips where
    mounting is not allowed (it needs root, or CAP_SYS_ADMIN)."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        folder = tmp_path / f"fs{len(mounted)}"
        folder.mkdir()
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                                  capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"cannot mount a tmpfs for the L3 filesystem: {exc}")
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs (needs root): {done.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in reversed(mounted):  # after daemon_factory's teardown stopped the daemons
        if subprocess.run(["umount", str(folder)], capture_output=True, timeout=10).returncode:
            subprocess.run(["umount", "-l", str(folder)], check=False, timeout=10)


def free_bytes(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def server(*settings: str, port: int = 0,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """kvstore-server run to its end (a start that fails)."""
    args = [sys.executable, "-m", "kvstore.daemon.server", "--port", str(port or free_port()),
            "--set", "metrics.enabled=false", "--set", "server.drain_notice_s=0"]
    for setting in (*SMALL, *settings):
        args += ["--set", setting]
    return subprocess.run(args, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def reserve_bytes(daemon: Daemon) -> float:
    """The L3 reserve the daemon's metrics expose (a KeyError when they expose none)."""
    return scrape(daemon)[("kvstore_l3_filesystem_reserve_bytes", ())]


def admission(daemon: Daemon) -> str:
    """"on", or the reason it is off, as the metrics say."""
    samples = scrape(daemon)
    if samples[("kvstore_l3_admission_enabled", ())] == 1:
        return "on"
    (reason,) = [r for r in ("low_space", "no_room")
                 if samples[("kvstore_l3_admission_off", (("reason", r),))] == 1]
    return reason


def nvme(kv: KVStoreClient) -> TierStats:
    tier = kv.stats().tier("nvme")
    assert tier is not None
    return tier


def put_settled(kv: KVStoreClient, blocks: Blocks) -> None:
    """Put the blocks (each one stored) and wait until the mover has brought L2 back under
    its high watermark."""
    result = kv.put(list(blocks), list(blocks.values()), independent=True)
    assert result.stored == len(blocks)

    def settled() -> bool:
        dram = kv.stats().tier("dram")
        assert dram is not None
        return bool(dram.used_bytes < 0.9 * dram.capacity_bytes)

    wait_until(settled, "the mover to settle", timeout_s=15)


def assert_exact(kv: KVStoreClient, blocks: Blocks, keys: list[bytes]) -> None:
    for i in range(0, len(keys), 8):
        chunk = keys[i : i + 8]
        assert kv.get(chunk) == [blocks[k] for k in chunk]


def tiers(kv: KVStoreClient, blocks: Blocks) -> dict[bytes, str | None]:
    return dict(zip(blocks, kv.lookup(list(blocks)).tiers, strict=True))


# --- the preflight --------------------------------------------------------------------------


def test_an_l3_larger_than_the_filesystem_exits_2_naming_a_value_that_fits_and_leaves_no_file(
        mount_tmpfs: Mount, daemon_factory: Callable[..., Daemon]) -> None:
    fs = mount_tmpfs("size=200m")
    folder = fs / "l3"
    before = free_bytes(fs)
    done = server(f"nvme.dir={folder}", "nvme.capacity_bytes=1GiB")
    assert done.returncode == 2, done.stderr
    assert "cannot start: nvme.capacity_bytes (1.0 GiB" in done.stderr
    assert "200.0 MiB free" in done.stderr and "leaves 50.0 MiB of it free" in done.stderr
    assert not (folder / "l3.data").exists()
    assert free_bytes(fs) == before  # nothing allocated (the folder and its lock: no blocks)
    fits = re.search(r"set nvme\.capacity_bytes=(\d+MiB) or less", done.stderr)
    assert fits, done.stderr

    daemon = daemon_factory(*SMALL, f"nvme.dir={folder}", f"nvme.capacity_bytes={fits[1]}")
    # "L3 posix in ..., 124.0 MiB", in the line the daemon prints just after it says SERVING
    wait_until(lambda: f"{fits[1][:-3]}.0 MiB" in daemon.log(), "the L3 size in the start line")
    assert admission(daemon) == "on"  # the value that fits leaves the reserve free
    assert free_bytes(fs) >= reserve_bytes(daemon)


def test_the_l3_file_a_restart_reuses_counts_as_room(
        mount_tmpfs: Mount, daemon_factory: Callable[..., Daemon]) -> None:
    fs = mount_tmpfs("size=200m")
    l3 = (f"nvme.dir={fs / 'l3'}", "nvme.capacity_bytes=100MiB")
    first = daemon_factory(*SMALL, *l3)
    assert first.stop() == 0
    # 100 MiB would not fit in what is free now, but the file it needs is already there.
    assert free_bytes(fs) < 100 << 20
    second = daemon_factory(*SMALL, *l3)
    assert admission(second) == "on"
    assert second.stop() == 0
    # Growing it is checked against the free space plus that file: 160 MiB does not fit.
    done = server(f"nvme.dir={fs / 'l3'}", "nvme.capacity_bytes=160MiB")
    assert done.returncode == 2 and "plus 100.0 MiB its L3 file holds" in done.stderr
    assert (fs / "l3" / "l3.data").stat().st_size == 100 << 20  # untouched


def test_nvme_reserve_bytes_sets_the_reserve_at_start_and_while_running(
        mount_tmpfs: Mount, daemon_factory: Callable[..., Daemon]) -> None:
    fs = mount_tmpfs("size=200m")
    folder = fs / "l3"
    # A 120 MiB reserve on 200 MiB: 100 MiB of L3 fits beside the automatic 50 MiB, not this.
    done = server(f"nvme.dir={folder}", "nvme.capacity_bytes=100MiB",
                  "nvme.reserve_bytes=120MiB")
    assert done.returncode == 2, done.stderr
    assert "leaves 120.0 MiB of it free (the L3 reserve: nvme.reserve_bytes)" in done.stderr
    assert not (folder / "l3.data").exists()
    # A small one on a volume that holds L3 alone: 160 MiB and its manifest (up to 26 MiB)
    # fit beside 8 MiB, not beside the automatic 50 MiB.
    daemon = daemon_factory(*SMALL, f"nvme.dir={folder}", "nvme.capacity_bytes=160MiB",
                            "nvme.reserve_bytes=8MiB")
    assert admission(daemon) == "on"
    assert reserve_bytes(daemon) == 8 << 20


def test_with_the_default_folder_the_refusal_names_what_other_ports_left_behind(
        mount_tmpfs: Mount) -> None:
    cache = mount_tmpfs("size=200m")  # $XDG_CACHE_HOME: L3 folders are kvstore/<port>
    for port in ("40001", "40002"):
        folder = cache / "kvstore" / port
        folder.mkdir(parents=True)
        with (folder / "l3.data").open("wb") as f:
            os.posix_fallocate(f.fileno(), 0, 30 << 20)
    port = free_port()
    done = server("nvme.capacity_bytes=150MiB", port=port, env={"XDG_CACHE_HOME": str(cache)})
    assert done.returncode == 2, done.stderr
    assert f"does not fit in {cache}/kvstore/{port}" in done.stderr
    assert f"2 other L3 folders in {cache}/kvstore hold 60.0 MiB" in done.stderr
    assert not (cache / "kvstore" / str(port) / "l3.data").exists()


# --- the reserve while running --------------------------------------------------------------


def test_free_space_under_the_reserve_turns_l3_admission_off_and_back_on(
        mount_tmpfs: Mount, daemon_factory: Callable[..., Daemon]) -> None:
    fs = mount_tmpfs("size=200m")
    daemon = daemon_factory(*SMALL, f"nvme.dir={fs / 'l3'}", "nvme.capacity_bytes=32MiB")
    with KVStoreClient(daemon.target, NS) as kv:
        first = block_map(60, seed=1)
        put_settled(kv, first)
        held = [k for k, t in tiers(kv, first).items() if t == "nvme"]
        assert held and admission(daemon) == "on"

        # Someone else fills the disk to half the reserve (50 MiB on 200 MiB).
        reserve = int(reserve_bytes(daemon))
        filler = fs / "filler"
        with filler.open("wb") as f:
            os.posix_fallocate(f.fileno(), 0, free_bytes(fs) - reserve // 2)
        wait_until(lambda: admission(daemon) == "low_space", "admission off", timeout_s=15)
        written, refused = nvme(kv).bytes_in, nvme(kv).admissions_refused

        second = block_map(60, seed=2)
        put_settled(kv, second)  # L2 keeps taking puts: the mover drops blocks, unwritten
        assert nvme(kv).bytes_in == written
        assert nvme(kv).admissions_refused > refused
        in_l2 = [k for k, t in tiers(kv, second).items() if t == "dram"]
        assert in_l2
        assert_exact(kv, second, in_l2)
        assert_exact(kv, first, held[:8])  # what L3 holds reads back
        assert kv.health() == "SERVING"
        assert daemon.log().count("L3 admission off") == 1

        filler.unlink()
        wait_until(lambda: admission(daemon) == "on", "admission on", timeout_s=15)
        put_settled(kv, block_map(60, seed=3))
        assert nvme(kv).bytes_in > written
    assert "L3 admission back on" in daemon.log()


def test_an_l3_write_that_finds_no_room_turns_admission_off(
        mount_tmpfs: Mount, daemon_factory: Callable[..., Daemon]) -> None:
    # Five inodes: the root, the L3 folder, its lock, the L3 file and the journal. The first
    # manifest snapshot (compacting after every record) then finds no inode for its file:
    # ENOSPC while statvfs shows the bytes free, as a quota or a full inode table would.
    fs = mount_tmpfs("size=200m,nr_inodes=5")
    daemon = daemon_factory(*SMALL, f"nvme.dir={fs / 'l3'}", "nvme.capacity_bytes=32MiB",
                            "nvme.compact_after_records=1")
    with KVStoreClient(daemon.target, NS) as kv:
        blocks = block_map(60, seed=4)
        put_settled(kv, blocks)
        wait_until(lambda: admission(daemon) == "no_room", "admission off", timeout_s=15)
        assert free_bytes(fs) > reserve_bytes(daemon)
        refused = nvme(kv).admissions_refused
        more = block_map(60, seed=5)
        put_settled(kv, more)
        assert nvme(kv).admissions_refused > refused
        # L2 blocks first: reading L3 ones promotes them, and the mover then drops the
        # least recently used L2 blocks, unwritten.
        in_l2 = [k for k, t in tiers(kv, more).items() if t == "dram"]
        held = [k for k, t in tiers(kv, blocks).items() if t == "nvme"]
        assert in_l2 and held
        assert_exact(kv, more, in_l2)
        assert_exact(kv, blocks, held[:8])
        assert kv.health() == "SERVING"
    log = daemon.log()
    # one warning per hold-off (10 s, then 20 s...): one, unless this machine is very slow
    assert log.count("L3 admission off") >= 1 and "found no room" in log
    assert "L3 write failed" not in log  # no warning per block
