"""The L2 shared-memory segment: create, attach, view, close and unlink it, sweep away the ones
dead daemons left; host identity.

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
import secrets
import socket
import stat
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
MAX_SHM_NAME_CHARS = 200
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
_BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
_IPC_NS_PATH = "/proc/self/ns/ipc"
#: A segment is created under a name with this prefix (then the creator's pid and a random
#: part), locked, sized and mapped there, and only then linked to its real name
#: (create_segment). Every stale sweep also sweeps this prefix, so a creator killed before
#: it published leaves nothing behind past the next start. It begins like the automatic
#: segment names (kvstore-<port>-<random>) so that `ls /dev/shm/kvstore-*` shows it too.
TEMP_PREFIX = "kvstore-creating-"
# Attempts at a locked temporary file. One fails only when a concurrent sweep (another
# daemon starting on the host) opens the file in the microseconds between its creation and
# its flock; eight failures in a row mean something else is at work, not bad luck.
_CREATE_ATTEMPTS = 8


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
        # The creator holds an exclusive flock on this descriptor for its whole life, from
        # before the segment had its name; the kernel drops it when the process dies however
        # it dies, which is how a later daemon tells a stale segment from a live one, by the
        # lock alone (remove_stale_segments; _create_locked says who else could hold it).
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
    """Create /dev/shm/<name> (mode 0600) of size_bytes, map it and hold its lock. The name
    must be new, or a stale segment's (its lock free), which is removed first.

    The segment is made under a temporary name, locked, sized and mapped there, and only then
    published under its real name with link(2), which never replaces an existing file. So
    every segment that has its public name is locked already, and the stale sweep
    (remove_stale_segments) can judge any file by its lock alone: one whose lock it can take
    has no live creator, however new it is.
    """
    check_shm_name(name)
    if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes <= 0:
        raise ValueError(f"size_bytes must be a positive integer, got {size_bytes!r}")
    _check_room(size_bytes)
    fd, temp = _create_locked(size_bytes)
    buf: mmap.mmap | None = None
    try:
        buf = _map(fd, size_bytes)
        _publish(temp, SHM_DIR / name)
    except BaseException:
        if buf is not None:
            buf.close()
        _unlink_held(temp)  # this process still holds its lock: nobody else has removed it
        os.close(fd)
        raise
    return Segment(name, size_bytes, buf, owner_fd=fd)


def _create_locked(size_bytes: int) -> tuple[int, Path]:
    """A new file under a temporary name (TEMP_PREFIX, this pid, a random part), mode 0600,
    of size_bytes, whose exclusive flock this process holds: (descriptor, path).

    The file exists unlocked for the instant between its open and its flock, and a
    concurrent sweep (another daemon starting) may take it then: its flock wins ours, or it
    has unlinked the name by the time ours succeeds. Either way this attempt is abandoned
    and another made under a fresh name.

    Who else could hold this lock: a flock belongs to the open file description, not to the
    process, and lasts while any descriptor or mapping refers to that description. Here
    those are this descriptor, the one mmap duplicates from it (dup shares the description)
    and the MAP_SHARED mapping itself, all the creating process's own, gone when it dies
    however it dies. Python opens them close-on-exec and the daemon never forks without
    exec, so no child inherits them. The one way descriptors leave the daemon, SCM_RIGHTS in
    kvstore/daemon/attach.py, sends only the tenants' memfd arenas (DramTier.arena_fds skips
    the named segment, which has none). Clients of a named segment open it by name
    (attach_segment), which gives them a description of their own that never takes the
    lock: a client, alive or hung, mapping a dead daemon's segment and writing to it, cannot
    make that segment look alive. (A fork without exec in the daemon, say multiprocessing's
    "fork" start method, would break this: the child would keep the lock until it exits.)
    """
    for _ in range(_CREATE_ATTEMPTS):
        path = SHM_DIR / f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            continue  # the random part repeated: draw another
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # a sweep holds it, and is removing it
            continue
        except BaseException:
            os.close(fd)  # the file is left unlocked: the next sweep removes it
            raise
        if not _names(path, os.fstat(fd)):
            os.close(fd)  # a sweep removed it between our open and our flock
            continue
        try:
            os.fchmod(fd, 0o600)  # the umask can only narrow the mode; make it exact
            os.ftruncate(fd, size_bytes)
        except BaseException:
            _unlink_held(path)
            os.close(fd)
            raise
        return fd, path
    raise OSError(
        errno.EAGAIN,
        f"could not create a shared-memory segment in {SHM_DIR}: {_CREATE_ATTEMPTS} new "
        "files in a row were locked or removed by someone else before this daemon could lock "
        "them; is another program sweeping /dev/shm?",
    )


def _publish(temp: Path, path: Path) -> None:
    """Give the locked file at temp its public name, then drop the temporary one. A file
    already there is removed first if it is stale (a daemon killed since this start's
    sweep); if it is live, or not this user's to judge, the name is refused."""
    for _ in range(2):
        try:
            os.link(temp, path, follow_symlinks=False)
        except FileExistsError:
            verdict = _sweep(path.name)
            if verdict in ("removed", "absent"):
                continue  # stale, or just removed by another sweep: try the name again
            raise _name_taken(path, verdict) from None
        _unlink_held(temp)
        return
    raise _name_taken(path, "live")  # stale when swept, live again when linked: a race lost


def _name_taken(path: Path, verdict: str) -> FileExistsError:
    if verdict == "live":
        why = ("another daemon holds its lock, so it is in use; choose another dram.shm_name "
               "for this daemon, or stop the other one")
    else:
        why = ("it is another user's, or not a regular file, so this daemon may not judge or "
               "remove it; choose another dram.shm_name, or remove the file")
    return FileExistsError(errno.EEXIST, f"shared-memory segment {path} already exists ({why})",
                           str(path))


def _names(path: Path, st: os.stat_result) -> bool:
    """Whether path (not following a symlink) is still the file st describes."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def _unlink_held(path: Path) -> None:
    """Remove a name whose file this process has locked (so nobody else removes it)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        logger.warning("shared-memory file %s vanished while this process held its lock; "
                       "something outside kvstore removes files in %s", path, SHM_DIR)


def remove_stale_segments(names: Iterable[str]) -> list[str]:
    """Unlink the named segments whose creator is gone (nobody holds their flock): what a
    crashed or killed daemon left behind, however recently. Every temporary name (TEMP_PREFIX)
    whose creator died before publishing its segment is swept too. Live segments, names that
    do not exist, and files this user may not open or that are not regular files are left
    alone. The names removed, in order."""
    removed = []
    for name in dict.fromkeys([*names, *list_segments(TEMP_PREFIX)]):
        if _sweep(name) == "removed":
            removed.append(name)
    return removed


def _sweep(name: str) -> str:
    """Remove /dev/shm/<name> if its lock is free. The verdict: "removed", "live" (its lock is
    held), "absent", or "foreign" (not a regular file, or not this user's to open or remove).

    Only a holder of a file's lock removes its name (its creator at shutdown, or a sweep like
    this one), and names are only ever added by link(2), which never replaces a file. So
    once this sweep holds the lock of the file it opened, and the name still leads to that
    file, nobody else can remove or replace that name before the unlink below. The check
    matters: between this open and this flock another sweep may have removed the file, and
    a new daemon published a new one under the same name."""
    path = SHM_DIR / name
    try:
        # O_NONBLOCK: a FIFO planted under a kvstore name must not hang the daemon's start.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return "absent"
    except OSError as exc:  # EACCES: another user's segment; ELOOP: a symlink
        logger.debug("not sweeping %s: %s", path, exc)
        return "foreign"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "foreign"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "live"
        if not _names(path, st):
            return "live" if os.path.lexists(path) else "absent"
        try:
            os.unlink(path)
        except PermissionError as exc:  # the sticky /dev/shm: only the owner may unlink
            logger.debug("not sweeping %s: %s", path, exc)
            return "foreign"
        if name.startswith(TEMP_PREFIX):
            logger.warning("removed shared-memory file %s: its creator died before it "
                           "published the segment", path)
        else:
            logger.warning("removed stale shared-memory segment %s (its daemon is gone)", path)
        return "removed"
    finally:
        os.close(fd)


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
