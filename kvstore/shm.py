"""The L2 shared-memory segment: create, attach, view, close and unlink it; host identity.

Used by the daemon's DRAM tier (which creates and finally unlinks the segment) and by the
client's same-host fast path (which only attaches). multiprocessing.shared_memory is avoided
on purpose: before Python 3.13 its resource_tracker unlinks segments a process merely attached
to, which would tear the daemon's memory out from under it when a client exits.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
MAX_SHM_NAME_CHARS = 200
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
_BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
_IPC_NS_PATH = "/proc/self/ns/ipc"


def check_shm_name(name: str) -> str:
    """Return name if it is a safe segment name under /dev/shm, else raise ValueError."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"shm_name must be a non-empty string, got {name!r}")
    if len(name) > MAX_SHM_NAME_CHARS:
        raise ValueError(f"shm_name is {len(name)} characters; the limit is {MAX_SHM_NAME_CHARS}")
    if not _NAME_RE.fullmatch(name) or name in (".", ".."):
        raise ValueError(
            f"shm_name {name!r} may hold only letters, digits, '-', '_' and '.' "
            "(and may not be '.' or '..')"
        )
    return name


class Segment:
    """One mapped shared-memory file. `buf` is the mmap; `view()` a memoryview over it."""

    def __init__(self, name: str, size_bytes: int, buf: mmap.mmap, owner_fd: int = -1) -> None:
        self.name = name
        self.size_bytes = size_bytes
        self.buf = buf
        self.path = SHM_DIR / name
        # The creator holds an exclusive flock on this descriptor for its whole life; the
        # kernel drops it when the process dies however it dies, which is how a later daemon
        # tells a stale segment from a live one (remove_stale_segments).
        self._owner_fd = owner_fd

    @property
    def closed(self) -> bool:
        return self.buf.closed

    def view(self) -> memoryview:
        """A writable memoryview of the whole segment; release it before close() if you can."""
        return memoryview(self.buf)

    def close(self) -> None:
        """Unmap the segment. Safe to call again; a no-op once closed.

        If memoryviews or numpy arrays over the mapping are still alive, the mapping cannot be
        released yet: it stays valid for them and is unmapped when the last one is collected.
        """
        if self.buf.closed:
            return
        try:
            self.buf.close()
        except BufferError:
            logger.debug(
                "shm segment %s still has exported views; leaving it mapped until they are gone",
                self.name,
            )

    def unlink(self) -> None:
        """Remove the segment's name from /dev/shm (mappings that exist stay valid), and give
        up ownership."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            logger.info("shm segment %s was already unlinked", self.path)
        if self._owner_fd >= 0:
            os.close(self._owner_fd)
            self._owner_fd = -1

    def __enter__(self) -> Segment:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"Segment(name={self.name!r}, size_bytes={self.size_bytes}, {state})"


def _map(fd: int, size_bytes: int) -> mmap.mmap:
    # mmap duplicates the descriptor, so callers close theirs right after mapping.
    return mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _check_room(size_bytes: int) -> None:
    # tmpfs allocates lazily: an oversized segment would "work" and then SIGBUS on first touch
    # of a page that does not fit (Docker's default /dev/shm is 64 MiB). Fail at start instead.
    stat = os.statvfs(SHM_DIR)
    free_bytes = stat.f_bavail * stat.f_frsize
    if size_bytes > free_bytes:
        raise OSError(
            errno.ENOSPC,
            f"shared-memory segment of {size_bytes} bytes does not fit in {SHM_DIR} "
            f"({free_bytes} bytes free); lower dram.capacity_bytes or enlarge {SHM_DIR} "
            "(docker --shm-size, or a larger memory-backed volume in Kubernetes)",
        )


def create_segment(name: str, size_bytes: int) -> Segment:
    """Create /dev/shm/<name> (mode 0600) of size_bytes and map it. The name must be new."""
    check_shm_name(name)
    if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes <= 0:
        raise ValueError(f"size_bytes must be a positive integer, got {size_bytes!r}")
    _check_room(size_bytes)
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as exc:
        raise FileExistsError(
            exc.errno,
            f"shared-memory segment {path} already exists (another daemon, or a stale one "
            "left by a crash); choose another dram.shm_name or remove the file",
            str(path),
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.fchmod(fd, 0o600)  # the umask can only narrow the mode; make it exact
        os.ftruncate(fd, size_bytes)
        buf = _map(fd, size_bytes)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return Segment(name, size_bytes, buf, owner_fd=fd)


def remove_stale_segments(names: Iterable[str], min_age_s: float = 2.0) -> list[str]:
    """Unlink the named segments whose creator is gone (nobody holds their flock): what a
    crashed or killed daemon left behind. Segments younger than min_age_s are left alone,
    so one being created this instant (opened, not yet locked) is never taken."""
    removed = []
    now = time.time()
    for name in names:
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            if now - os.fstat(fd).st_mtime < min_age_s:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its daemon is alive
            os.unlink(path)
            removed.append(name)
            logger.warning("removed stale shared-memory segment %s (its daemon is gone)", path)
        finally:
            os.close(fd)
    return removed


def list_segments(prefix: str) -> list[str]:
    """Names of the segments under /dev/shm that start with prefix."""
    try:
        return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix))
    except FileNotFoundError:
        return []


def attach_segment(name: str) -> Segment:
    """Map an existing /dev/shm/<name> read-write, whole file."""
    check_shm_name(name)
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            exc.errno, f"shared-memory segment {path} does not exist", str(path)
        ) from None
    try:
        size_bytes = os.fstat(fd).st_size
        if size_bytes == 0:
            raise ValueError(f"shared-memory segment {path} is empty; it cannot be mapped")
        buf = _map(fd, size_bytes)
    finally:
        os.close(fd)
    return Segment(name, size_bytes, buf)


def host_id() -> str:
    """'<boot id>:<IPC namespace>': equal in two processes only if they share a kernel boot and
    an IPC namespace, which is what decides whether they see the same /dev/shm. Containers
    differ in hostname but share the node's /dev/shm when they share its IPC namespace
    (Kubernetes `hostIPC`, Docker `--ipc=host`), so the hostname is no test.

    Clients compare it with the daemon's to decide whether the shared-memory path is usable.
    """
    try:
        boot_id = _BOOT_ID_PATH.read_text().strip()
        ipc = os.readlink(_IPC_NS_PATH)
    except OSError:
        logger.debug("no %s or %s; host id falls back to the hostname", _BOOT_ID_PATH,
                     _IPC_NS_PATH)
        return socket.gethostname()
    return f"{boot_id}:{ipc}"
