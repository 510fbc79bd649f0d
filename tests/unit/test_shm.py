"""Shared-memory segments under /dev/shm: create, attach, share bytes, close, unlink; host id."""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.shm import (
    SHM_DIR,
    TEMP_PREFIX,
    Segment,
    attach_segment,
    check_shm_name,
    create_segment,
    host_id,
    list_segments,
    remove_stale_segments,
)

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")


@pytest.fixture
def name() -> Iterator[str]:
    # Not "kvstore-...": every daemon that starts sweeps those names, and daemons of other
    # tests start meanwhile; the stale segments these tests leave on purpose are theirs.
    name = f"kvshm-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    path = SHM_DIR / name
    if path.exists():
        path.unlink()


def test_create_write_attach_read(name: str) -> None:
    with create_segment(name, 1 << 20) as owner:
        assert owner.size_bytes == 1 << 20 and owner.name == name
        owner.buf[4096:4101] = b"hello"
        with attach_segment(name) as reader:
            assert reader.size_bytes == 1 << 20
            assert reader.buf[4096:4101] == b"hello"
            reader.view()[0:3] = b"abc"  # writes go both ways
        assert bytes(owner.buf[0:3]) == b"abc"
        owner.unlink()


def test_segment_file_is_private(name: str) -> None:
    old_umask = os.umask(0)  # a permissive umask must not widen the mode
    try:
        seg = create_segment(name, 4096)
    finally:
        os.umask(old_umask)
    try:
        assert stat.S_IMODE(os.stat(SHM_DIR / name).st_mode) == 0o600
    finally:
        seg.close()
        seg.unlink()


def test_unlink_removes_the_file_and_tolerates_a_second_call(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    seg = create_segment(name, 4096)
    seg.unlink()
    assert not (SHM_DIR / name).exists()
    seg.buf[0] = 7  # an unlinked segment stays mapped
    assert seg.buf[0] == 7
    with caplog.at_level(logging.INFO, logger="kvstore.shm"):
        seg.unlink()
    assert "already unlinked" in caplog.text
    seg.close()


def test_create_refuses_a_live_segments_name_and_leaves_no_file(name: str) -> None:
    with create_segment(name, 4096) as live:
        with pytest.raises(FileExistsError, match=r"already exists \(another daemon holds"):
            create_segment(name, 4096)
        assert live.path.exists()
        assert temporary_files(os.getpid()) == []
        live.unlink()


def test_attach_missing_segment(name: str) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        attach_segment(name)


def test_create_rejects_bad_sizes_and_leaves_no_file(name: str) -> None:
    for size in (0, -1):
        with pytest.raises(ValueError, match="size_bytes"):
            create_segment(name, size)
    assert not (SHM_DIR / name).exists()


def test_create_refuses_more_than_dev_shm_holds(name: str) -> None:
    st = os.statvfs(SHM_DIR)
    with pytest.raises(OSError, match="does not fit"):
        create_segment(name, st.f_blocks * st.f_frsize * 2 + (1 << 30))
    assert not (SHM_DIR / name).exists()


@pytest.mark.parametrize(
    "bad", ["", "a/b", "../x", ".", "..", "x" * 201, "sp ace", "ünï", "a\x00b"]
)
def test_name_validation(bad: str) -> None:
    with pytest.raises(ValueError, match="shm_name"):
        check_shm_name(bad)
    with pytest.raises(ValueError, match="shm_name"):
        create_segment(bad, 4096)
    with pytest.raises(ValueError, match="shm_name"):
        attach_segment(bad)


def test_good_names() -> None:
    for good in ("kvstore-50051-123", "a.b_c-d", "x" * 200):
        assert check_shm_name(good) == good


def test_close_with_live_views_keeps_mapping_and_logs(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    seg = create_segment(name, 4096)
    view = seg.view()
    with caplog.at_level(logging.DEBUG, logger="kvstore.shm"):
        seg.close()
    assert "exported views" in caplog.text
    assert not seg.closed
    view[0] = 9  # still valid memory
    assert seg.buf[0] == 9
    view.release()
    seg.close()
    assert seg.closed
    seg.close()  # idempotent
    seg.unlink()


def test_segment_repr_and_path(name: str) -> None:
    with create_segment(name, 4096) as seg:
        assert isinstance(seg, Segment)
        assert seg.path == Path("/dev/shm") / name
        assert "open" in repr(seg)
    assert "closed" in repr(seg)


def test_host_id_is_the_boot_and_the_ipc_namespace() -> None:
    hid = host_id()
    assert hid == host_id()
    # The node's boot and this process's IPC namespace (what decides the /dev/shm it sees).
    assert hid.endswith(os.readlink("/proc/self/ns/ipc")) and hid.count(":") >= 2
    if Path("/proc/sys/kernel/random/boot_id").exists():
        boot_id, _, _ = hid.partition(":")
        assert len(boot_id) == 36


def temporary_files(pid: int) -> list[str]:
    """The temporary names process pid creates segments under, as /dev/shm holds them now."""
    return list_segments(f"{TEMP_PREFIX}{pid}-")


def run_creator(name: str) -> None:
    """In a child process: create the segment, write to it, and die without unlinking it
    (what kill -9 does to a daemon)."""
    code = (
        "import os; from kvstore.shm import create_segment; "
        f"seg = create_segment({name!r}, 65536); seg.buf[:65536] = b'x' * 65536; os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_a_dead_creators_segment_is_removed_at_once_and_a_live_one_kept(name: str) -> None:
    """A segment whose creator died without unlinking (crash, SIGKILL) is reclaimed the very
    instant after, with its mtime fresh from the dead creator's writes: the lock decides,
    not the age. One whose creator is alive keeps its flock and is left alone."""
    dead = name
    run_creator(dead)
    assert time.time() - os.stat(SHM_DIR / dead).st_mtime < 2.0  # it looks brand new
    live = create_segment(f"{name}-live", 65536)
    try:
        removed = remove_stale_segments([dead, live.name, "kvstore-no-such"])
        assert dead in removed and live.name not in removed
        assert not (SHM_DIR / dead).exists()
        assert live.path.exists()
    finally:
        live.close()
        live.unlink()


def test_a_live_segment_is_kept_though_another_process_maps_and_writes_it(name: str) -> None:
    """A client that attached by name has a description of its own: its mapping neither
    takes nor keeps the creator's lock, so the segment stays live exactly as long as its
    creator does (the case the creator's lock must get right both ways)."""
    with create_segment(name, 65536) as live:
        with attach_segment(name) as client:
            client.buf[:4096] = b"c" * 4096
            assert remove_stale_segments([name]) == []
            assert live.path.exists()
        live.unlink()


def test_creating_over_a_dead_creators_segment_takes_its_name(name: str) -> None:
    """create_segment itself removes a stale segment in the way of its name (a daemon killed
    after this start's sweep), without a sweep beforehand."""
    run_creator(name)
    dead_inode = os.stat(SHM_DIR / name).st_ino
    with create_segment(name, 4096) as seg:
        assert os.stat(seg.path).st_ino != dead_inode and seg.size_bytes == 4096
        assert seg.buf[0] == 0  # a new segment, not the dead one's bytes
        seg.unlink()


def test_a_creator_killed_before_publishing_leaves_a_temporary_file_the_next_sweep_removes(
    name: str,
) -> None:
    """The creator stops at the publishing link(2), its temporary file created, locked and
    sized. While it lives a sweep leaves that file alone; once it is killed the next sweep
    removes it, and the public name never existed."""
    code = (
        "import os, time; from kvstore import shm\n"
        "def stall(*args, **kwargs):\n"
        "    print('locked', flush=True); time.sleep(60)\n"
        "os.link = stall\n"
        f"shm.create_segment({name!r}, 65536)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=REPO)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"locked\n"
        [temp] = temporary_files(child.pid)
        assert os.stat(SHM_DIR / temp).st_size == 65536
        assert temp not in remove_stale_segments([])
        assert (SHM_DIR / temp).exists()  # its creator is alive: kept
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        if child.stdout is not None:
            child.stdout.close()
    remove_stale_segments([])
    assert temporary_files(child.pid) == []
    assert not (SHM_DIR / name).exists()


def test_daemons_racing_for_one_name_over_a_stale_segment_one_wins_the_rest_refused(
    name: str,
) -> None:
    """Four creators start at one instant, each sweeping then creating the same name, as a
    daemon does, where a dead daemon's segment lies: exactly one gets the name, the others
    are told another daemon holds it, and nothing else is left in /dev/shm."""
    run_creator(name)
    start_at = time.time() + 0.3
    code = (
        "import sys, time; from kvstore.shm import create_segment, remove_stale_segments\n"
        f"time.sleep(max(0.0, {start_at} - time.time()))\n"
        f"remove_stale_segments([{name!r}])\n"
        "try:\n"
        f"    seg = create_segment({name!r}, 65536)\n"
        "except FileExistsError as exc:\n"
        "    print('refused', exc, flush=True)\n"
        "else:\n"
        "    print('won', flush=True); sys.stdin.read()\n"
    )
    children = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, cwd=REPO) for _ in range(4)]
    try:
        answers = [c.stdout.readline().decode() for c in children if c.stdout is not None]
        assert sorted(a.split()[0] for a in answers) == ["refused", "refused", "refused", "won"]
        assert all("another daemon holds its lock" in a for a in answers if a != "won\n")
        assert remove_stale_segments([name]) == []  # the winner is alive
        assert list_segments(name) == [name]
        assert [f for c in children for f in temporary_files(c.pid)] == []
    finally:
        for c in children:
            c.communicate(timeout=10)  # closing stdin lets the winner exit
    remove_stale_segments([name])
    assert not (SHM_DIR / name).exists()


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_sweep_leaves_what_is_not_a_regular_file_alone(name: str, kind: str,
                                                         tmp_path: Path) -> None:
    """A FIFO planted under a swept name would hang an open for reading; a symlink would
    lead the sweep elsewhere. Both are left where they are, and the sweep returns."""
    path = SHM_DIR / name
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    else:
        target = tmp_path / "target"
        target.write_bytes(b"keep")
        path.symlink_to(target)
    try:
        assert remove_stale_segments([name]) == []
        assert os.path.lexists(path)
        with pytest.raises(FileExistsError, match="not a regular file"):
            create_segment(name, 4096)
        assert temporary_files(os.getpid()) == []
    finally:
        path.unlink()
