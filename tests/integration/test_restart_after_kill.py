"""A daemon restarted the instant after a kill -9 starts, serves, and leaves exactly one L2
segment in /dev/shm: its own. The dead daemon's segment is taken because nobody holds its
lock, however new it looks (kvstore/shm.py)."""

from __future__ import annotations

import mmap
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from kvstore.client import KVStoreClient
from kvstore.shm import SHM_DIR, TEMP_PREFIX, attach_segment
from kvstore.tools.testing import Daemon

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")

Make = Callable[..., Daemon]

# Small, so each daemon starts and each client pre-faults its mapping in a few milliseconds.
CAPACITY = "8MiB"
# How often the writer below faults in a page it has not touched: far inside the 2 s under
# which the old rule ("younger than 2 s: maybe being created, leave it") kept a segment.
TOUCH_EVERY_S = 0.05


@contextmanager
def fresh_mtime(name: str) -> Iterator[None]:
    """While inside, a client that has the segment mapped goes on writing to pages it has
    not written yet: tmpfs stamps the file's mtime on each such first write fault, so the
    segment keeps looking brand new for as long as the restart takes, whether the host
    starts a daemon in a tenth of a second or in three. That is what a pre-faulting client
    does to a dead daemon's segment, made independent of timing."""
    segment = attach_segment(name)
    stop = threading.Event()

    def touch() -> None:
        for offset in range(0, segment.size_bytes, mmap.PAGESIZE):
            if stop.wait(TOUCH_EVERY_S):
                return
            segment.buf[offset] = 1

    writer = threading.Thread(target=touch, name=f"touch-{name}", daemon=True)
    writer.start()
    try:
        yield
    finally:
        stop.set()
        writer.join()
        segment.close()


def attached_client(d: Daemon, namespace: str) -> KVStoreClient:
    """A client with the daemon's segment mapped (and pre-faulted), one block written."""
    kv = KVStoreClient(d.target, namespace, shared_memory=True)
    assert kv.put([b"k" * 32], [b"v" * 4096]).stored == 1
    assert kv.get([b"k" * 32]) == [b"v" * 4096]
    assert kv.uses_shared_memory is True
    return kv


def segments_of(*daemons: Daemon, names: tuple[str, ...]) -> list[str]:
    """What /dev/shm holds of these daemons: the given segment names and the temporary names
    their processes create segments under. Other tests' daemons run meanwhile; their
    segments are not counted."""
    temps = tuple(f"{TEMP_PREFIX}{d.proc.pid}-" for d in daemons)
    return sorted(p.name for p in SHM_DIR.iterdir()
                  if p.name in names or p.name.startswith(temps))


def kill_9(d: Daemon) -> None:
    d.proc.send_signal(signal.SIGKILL)
    assert d.proc.wait(10) == -signal.SIGKILL


@pytest.mark.parametrize("fixed_name", [True, False], ids=["fixed-name", "random-name"])
def test_a_restart_right_after_kill_9_starts_and_leaves_one_segment(
        daemon_factory: Make, fixed_name: bool) -> None:
    """kill -9 while a client has the segment mapped and keeps its mtime fresh, then start
    again at once. With a fixed dram.shm_name the new daemon used to exit 2 ("already
    exists"); with the default random name it used to start beside the dead daemon's
    segment and leave it in /dev/shm for good."""
    settings = [f"dram.capacity_bytes={CAPACITY}"]
    if fixed_name:
        # Not "kvstore-...": daemons of other tests, starting meanwhile, sweep those names
        # too, and only the restarted daemon should reclaim this one (its log says so).
        settings.append(f"dram.shm_name=kvtest-restart-{os.getpid()}-{secrets.token_hex(4)}")
    first = daemon_factory(*settings)
    kv = attached_client(first, "before")
    try:
        old_name = kv.stats().shm_name
        old_inode = os.stat(SHM_DIR / old_name).st_ino
        with fresh_mtime(old_name):
            kill_9(first)
            assert time.time() - os.stat(SHM_DIR / old_name).st_mtime < 2.0  # looks new
            second = daemon_factory(*settings)
    finally:
        kv.close()

    kv = attached_client(second, "after")  # it serves, through shared memory
    try:
        new_name = kv.stats().shm_name
    finally:
        kv.close()
    assert (new_name == old_name) is fixed_name
    assert segments_of(first, second, names=(old_name, new_name)) == [new_name]
    assert os.stat(SHM_DIR / new_name).st_ino != old_inode
    if fixed_name:
        assert f"removed stale shared-memory segment {SHM_DIR / old_name}" in second.log()
