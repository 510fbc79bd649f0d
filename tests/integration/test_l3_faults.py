"""Faults under the L3 tier of a real daemon: damaged and truncated page files, a full
filesystem, kill -9 mid-burst, a torn manifest journal, and two daemons on one folder. Each
test asserts the contract: a damaged or lost block is a miss, never wrong bytes, and the
daemon keeps serving."""

from __future__ import annotations

import errno
import os
import re
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstore.client import KVStoreClient, KVStoreError, Retry, TierStats
from kvstore.daemon.manifest import HEADER_BYTES, JOURNAL_NAME
from kvstore.tools.testing import TEST_L3_RESERVE, Daemon, free_port
from tests.helpers import block_map, wait_until

PAGE = 64 << 10
NS = "l3faults"
# 64 pages of L2: 60 blocks pass the 0.9 watermark and the mover demotes about 13 to L3.
# No L1: these tests are about L2 <-> L3 (and probing CUDA costs each start seconds).
SMALL = ("dram.capacity_bytes=4MiB", "dram.page_size_bytes=64KiB", "nvme.capacity_bytes=16MiB",
         "nvme.page_size_bytes=64KiB", "movers.interval_s=0.02", "hbm.mode=off")
# On tiny_fs: the automatic L3 reserve (a quarter of the 64 MiB tmpfs), not the test default.
TINY = (*SMALL, "nvme.reserve_bytes=0")
Blocks = dict[bytes, bytes]
Factory = Callable[..., Daemon]


def nvme(kv: KVStoreClient) -> TierStats:
    tier = kv.stats().tier("nvme")
    assert tier is not None
    return tier


def put(kv: KVStoreClient, blocks: Blocks) -> None:
    result = kv.put(list(blocks), list(blocks.values()), independent=True)
    assert result.stored + result.existing == len(blocks)


def tiers(kv: KVStoreClient, keys: list[bytes]) -> dict[bytes, str | None]:
    return dict(zip(keys, kv.lookup(keys).tiers, strict=True))


def in_l3(kv: KVStoreClient, blocks: Blocks) -> list[bytes]:
    return [k for k, t in tiers(kv, list(blocks)).items() if t == "nvme"]


def push_to_l3(kv: KVStoreClient, blocks: Blocks) -> list[bytes]:
    """Put the blocks (60 fill L2 past its high watermark); the keys the mover demoted."""
    put(kv, blocks)
    wait_until(lambda: nvme(kv).objects > 0, "a demotion to L3")
    demoted = in_l3(kv, blocks)
    assert len(demoted) == nvme(kv).objects > 0
    return demoted


def assert_exact(kv: KVStoreClient, blocks: Blocks, keys: list[bytes], batch: int = 8) -> None:
    """Every key reads back bit-exact; in small batches, so promotions fit in L2."""
    for i in range(0, len(keys), batch):
        chunk = keys[i : i + batch]
        got = kv.get(chunk)
        for key, value in zip(chunk, got, strict=True):
            assert value is not None, f"{key.hex()[:12]} is reported present but reads a miss"
            assert value == blocks[key], f"{key.hex()[:12]} read back wrong bytes"


def assert_serving(kv: KVStoreClient, seed: int) -> None:
    """Health is SERVING and fresh blocks still round-trip through L2."""
    assert kv.health() == "SERVING"
    fresh = block_map(3, seed=seed)
    put(kv, fresh)
    assert kv.get(list(fresh)) == list(fresh.values())


def page_of(l3_file: Path, value: bytes) -> int:
    """The L3 page whose first 64 bytes are value's (blocks are one page, page-aligned)."""
    data = l3_file.read_bytes()
    hits = [p for p in range(len(data) // PAGE) if data[p * PAGE : p * PAGE + 64] == value[:64]]
    assert len(hits) == 1, f"value found on pages {hits}"
    return hits[0]


def readopted(daemon: Daemon) -> int:
    found = re.findall(r"re-adopted (\d+) blocks", daemon.log())
    assert found, daemon.log()
    return int(found[-1])


def journal_commits(journal: Path) -> list[tuple[int, bytes]]:
    """(offset, key) of each COMMIT record in the journal (format: kvstore/daemon/manifest.py)."""
    data, at, out = journal.read_bytes(), HEADER_BYTES, []
    while at + 8 <= len(data):
        length, _crc = struct.unpack_from("<II", data, at)
        payload = data[at + 8 : at + 8 + length]
        if payload[0] == 1:  # COMMIT: u8 type, u16 n, namespace, 32-byte key, ...
            (n,) = struct.unpack_from("<H", payload, 1)
            out.append((at, payload[3 + n : 35 + n]))
        at += 8 + length
    assert at == len(data), "the journal ends inside a record"
    return out


@pytest.fixture
def kv_to() -> Iterator[Callable[[Daemon], KVStoreClient]]:
    """Clients to daemons, closed at the end of the test. They do not check checksums
    themselves (a client that does turns wrong bytes into a miss): what the tests read is
    exactly what the daemon served."""
    clients: list[KVStoreClient] = []

    def connect(daemon: Daemon) -> KVStoreClient:
        clients.append(KVStoreClient(daemon.target, NS, verify_checksums=False))
        return clients[-1]

    yield connect
    for client in clients:
        client.close()


# --- 1. flipped bytes -------------------------------------------------------------------


def test_flipped_bytes_in_l3_are_a_miss_never_wrong_bytes(
        daemon_factory: Factory, kv_to: Callable[[Daemon], KVStoreClient],
        tmp_path: Path) -> None:
    l3 = tmp_path / "l3"
    kv = kv_to(daemon_factory(*SMALL, f"nvme.dir={l3}"))
    blocks = block_map(60, seed=1)
    demoted = push_to_l3(kv, blocks)
    damaged, intact = demoted[:2], demoted[2:]
    with (l3 / "l3.data").open("r+b") as f:
        for key in damaged:
            f.seek(page_of(l3 / "l3.data", blocks[key]) * PAGE + 1000)
            f.write(bytes(b ^ 0xFF for b in blocks[key][1000:1008]))
    before = nvme(kv)

    assert kv.get(damaged) == [None, None]
    after = nvme(kv)
    assert after.checksum_failures == before.checksum_failures + 2
    assert after.io_errors == before.io_errors
    assert_exact(kv, blocks, intact)
    assert kv.get(damaged) == [None, None]  # the entries were dropped, not retried
    assert tiers(kv, damaged) == {k: None for k in damaged}
    assert nvme(kv).checksum_failures == before.checksum_failures + 2


# --- 2. I/O error on read ---------------------------------------------------------------


def test_truncated_l3_file_is_an_io_error_and_the_daemon_keeps_serving(
        daemon_factory: Factory, kv_to: Callable[[Daemon], KVStoreClient],
        tmp_path: Path) -> None:
    l3 = tmp_path / "l3"
    kv = kv_to(daemon_factory(*SMALL, f"nvme.dir={l3}"))
    blocks = block_map(60, seed=2)
    demoted = push_to_l3(kv, blocks)
    os.truncate(l3 / "l3.data", 0)
    before = nvme(kv)

    assert kv.get(demoted[:1]) == [None]
    after = nvme(kv)
    assert after.io_errors == before.io_errors + 1
    assert after.checksum_failures == before.checksum_failures
    assert tiers(kv, demoted[:1]) == {demoted[0]: None}
    in_l2 = [k for k, t in tiers(kv, list(blocks)).items() if t == "dram"]
    assert_exact(kv, blocks, in_l2[:10])
    assert_serving(kv, seed=20)


# --- 3. full filesystem -----------------------------------------------------------------


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs for the L3 folder: the 16 MiB L3 and its manifest fit beside the 16 MiB
    reserve (kvstore/daemon/l3room.py); skips where mounting is not allowed."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(folder)],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs for the full-disk test: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {done.stderr.strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False, timeout=10)


def fill_disk(folder: Path) -> None:
    """Take every byte left on folder's filesystem, as another program filling it would."""
    with (folder / "filler").open("wb", buffering=0) as f:
        for chunk in (b"\0" * (1 << 20), b"\0" * 4096):
            try:
                while True:
                    f.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    st = os.statvfs(folder)
    assert st.f_bavail * st.f_frsize < 4096


def fill_through(kv: KVStoreClient, seed: int = 300) -> Blocks:
    """Put 160 blocks (10 MiB, more than L2 holds); wait for the mover."""
    blocks: Blocks = {}
    for i in range(10):
        batch = block_map(16, seed=seed + i)
        put(kv, batch)
        blocks.update(batch)

    def settled() -> bool:  # below the high watermark (no demotion in flight), or it died
        dram = kv.stats().tier("dram")
        assert dram is not None
        return bool(dram.used_bytes < 0.9 * dram.capacity_bytes or kv.health() != "SERVING")

    wait_until(settled, "the mover to settle")
    return blocks


# "compacting": the mover snapshots the manifest every few records, and a snapshot that
# finds no room must not stop it (it did, marking the daemon NOT_SERVING, until 978acf4).
@pytest.mark.parametrize("compact_after_records", [100_000, 5], ids=["default", "compacting"])
def test_full_filesystem_refuses_admissions_and_keeps_serving(
        compact_after_records: int, tiny_fs: Path, daemon_factory: Factory,
        kv_to: Callable[[Daemon], KVStoreClient]) -> None:
    daemon = daemon_factory(*TINY, f"nvme.compact_after_records={compact_after_records}",
                            f"nvme.dir={tiny_fs}")
    kv = kv_to(daemon)
    blocks = block_map(60, seed=290)
    push_to_l3(kv, blocks)
    fill_disk(tiny_fs)  # another program takes the rest of the disk
    blocks.update(fill_through(kv))  # every put succeeded

    assert daemon.proc.poll() is None
    assert kv.health() == "SERVING"
    assert nvme(kv).admissions_refused > 0
    assert nvme(kv).objects > 0  # what L3 held before stays
    assert "L3 admission off" in daemon.log()
    # L2 blocks first: reading L3 ones promotes them, and the demotions that pressure then
    # causes are refused (admission is off), so the least recently used L2 blocks go (a
    # miss is fine after that; what is read first was reported present just before).
    found = tiers(kv, list(blocks))
    for tier in ("dram", "nvme"):
        assert_exact(kv, blocks, [k for k, t in found.items() if t == tier])
    assert_serving(kv, seed=30)


def test_restart_on_a_full_filesystem_readopts_its_blocks(
        tiny_fs: Path, daemon_factory: Factory,
        kv_to: Callable[[Daemon], KVStoreClient]) -> None:
    first = daemon_factory(*TINY, f"nvme.dir={tiny_fs}")
    kv = kv_to(first)
    blocks = fill_through(kv)
    held = in_l3(kv, blocks)
    assert held
    fill_disk(tiny_fs)
    assert first.stop() == 0, first.log()

    # The L3 file it reuses needs no room (RuntimeError if it exited 2); the compaction at
    # start finds none, so L3 admission starts off.
    second = daemon_factory(*TINY, f"nvme.dir={tiny_fs}")
    kv = kv_to(second)
    assert readopted(second) == len(held)
    assert in_l3(kv, blocks) == held
    assert_exact(kv, blocks, held)
    assert "L3 admission off" in second.log()


# --- 4. kill -9 and restart -------------------------------------------------------------

BURST_BATCHES, BURST_BATCH = 40, 10
# A small compaction threshold, so some kills land around a snapshot too.
KILL_SETTINGS = (*SMALL, "nvme.compact_after_records=40")


def burst(target: str, batches: list[Blocks], acked: list[int]) -> None:
    """Put the batches one after another until one fails (the daemon was killed)."""
    with KVStoreClient(target, NS, retry=Retry(attempts=1), timeout_s=10) as kv:
        for batch in batches:
            try:
                put(kv, batch)
            except KVStoreError:
                return
            acked.append(len(batch))


@pytest.mark.parametrize("kill_after_batches", [8, 15, 25])
def test_kill_9_mid_burst_then_restart_reads_back_only_exact_blocks(
        kill_after_batches: int, daemon_factory: Factory,
        kv_to: Callable[[Daemon], KVStoreClient], tmp_path: Path) -> None:
    l3 = f"nvme.dir={tmp_path / 'l3'}"
    first = daemon_factory(*KILL_SETTINGS, l3)
    batches = [block_map(BURST_BATCH, seed=400 + i) for i in range(BURST_BATCHES)]
    acked: list[int] = []
    putter = threading.Thread(target=burst, args=(first.target, batches, acked))
    putter.start()
    try:
        wait_until(lambda: len(acked) >= kill_after_batches, f"{kill_after_batches} batches put")
        os.kill(first.proc.pid, signal.SIGKILL)
    finally:
        first.proc.wait(10)
        putter.join(20)
    assert len(acked) < BURST_BATCHES, "the burst ended before the kill"
    written = {k: v for batch in batches[: len(acked) + 1] for k, v in batch.items()}
    never = {k: v for batch in batches[len(acked) + 1 :] for k, v in batch.items()}

    second = daemon_factory(*KILL_SETTINGS, l3)
    kv = kv_to(second)
    adopted = readopted(second)
    assert adopted >= 1
    assert nvme(kv).objects == adopted
    found = tiers(kv, list(written))
    present = [k for k, t in found.items() if t is not None]
    assert len(present) == adopted and {found[k] for k in present} == {"nvme"}
    assert_exact(kv, written, present)
    assert set(tiers(kv, [*never, *block_map(5, seed=499)]).values()) == {None}
    assert nvme(kv).checksum_failures == 0


def test_clean_restart_readopts_exactly_what_l3_held(
        daemon_factory: Factory, kv_to: Callable[[Daemon], KVStoreClient],
        tmp_path: Path) -> None:
    l3 = f"nvme.dir={tmp_path / 'l3'}"
    first = daemon_factory(*SMALL, l3)
    blocks = block_map(60, seed=5)
    demoted = push_to_l3(kv_to(first), blocks)
    assert first.stop() == 0, first.log()

    second = daemon_factory(*SMALL, l3)
    kv = kv_to(second)
    assert readopted(second) == nvme(kv).objects == len(demoted)
    assert in_l3(kv, blocks) == demoted  # and the L2 blocks died with the segment
    assert {t for t in tiers(kv, list(blocks)).values()} == {"nvme", None}
    assert_exact(kv, blocks, demoted)


# --- 5. torn manifest tail --------------------------------------------------------------


@pytest.mark.parametrize("tear", ["garbage", "chop"])
def test_torn_journal_tail_is_cut_and_intact_blocks_read_back(
        tear: str, daemon_factory: Factory, kv_to: Callable[[Daemon], KVStoreClient],
        tmp_path: Path) -> None:
    l3 = tmp_path / "l3"
    first = daemon_factory(*SMALL, f"nvme.dir={l3}")
    blocks = block_map(60, seed=6)
    demoted = push_to_l3(kv_to(first), blocks)
    assert first.stop() == 0, first.log()
    journal = l3 / JOURNAL_NAME
    commits = journal_commits(journal)  # the start compacted; each demotion appended one
    assert sorted(k for _, k in commits) == sorted(demoted)
    if tear == "garbage":
        torn = 37
        with journal.open("ab") as f:
            f.write(b"\xff" * torn)  # a frame length past the end: a short record
        lost: list[bytes] = []
    else:
        last_at, last_key = commits[-1]
        torn = 5
        os.truncate(journal, last_at + torn)  # the last record, cut inside its frame
        lost = [last_key]

    second = daemon_factory(*SMALL, f"nvme.dir={l3}")
    kv = kv_to(second)
    assert [int(n) for n in re.findall(r"torn tail of (\d+) bytes", second.log())] == [torn]
    intact = [k for k in demoted if k not in lost]
    assert readopted(second) == len(intact)
    assert in_l3(kv, blocks) == intact
    assert_exact(kv, blocks, intact)
    assert kv.get(lost) == [None] * len(lost)


# --- 6. two daemons, one folder ---------------------------------------------------------


def test_second_daemon_on_the_same_l3_folder_exits_2_naming_nvme_dir(
        daemon_factory: Factory, kv_to: Callable[[Daemon], KVStoreClient],
        tmp_path: Path) -> None:
    l3 = tmp_path / "l3"
    kv = kv_to(daemon_factory(*SMALL, f"nvme.dir={l3}"))
    blocks = block_map(60, seed=7)
    demoted = push_to_l3(kv, blocks)
    size_bytes = (l3 / "l3.data").stat().st_size

    # A different capacity: had it opened the file, it would have resized the first's.
    args = [sys.executable, "-m", "kvstore.daemon.server", "--port", str(free_port()),
            "--metrics-port", str(free_port())]
    for setting in (*SMALL, "nvme.capacity_bytes=8MiB", f"nvme.dir={l3}",
                    f"nvme.reserve_bytes={TEST_L3_RESERVE}"):
        args += ["--set", setting]
    second = subprocess.run(args, capture_output=True, text=True, timeout=60)

    assert second.returncode == 2, second.stderr
    assert "nvme.dir" in second.stderr and str(l3) in second.stderr, second.stderr
    assert (l3 / "l3.data").stat().st_size == size_bytes
    assert_exact(kv, blocks, demoted)
    assert_serving(kv, seed=70)
