"""L3 NVMe tier: one preallocated file of fixed-size pages; a SlotTier.

Owns the file (created mode 0600, preallocated where the filesystem can; a preallocation
that fails midway leaves no partial file behind), the byte moves
between its pages and host buffers, and the tier's I/O counters. Two backends sit behind one
small interface: kvikio (GPUDirect Storage, or its POSIX compatibility mode) when an NVIDIA
driver is present, else plain preadv/pwritev on a bounded thread pool, through an O_DIRECT
descriptor when a transfer's buffers are 4 KiB aligned and a buffered one otherwise. Which
pages hold what, and re-adopting them after a restart, is the index's and the manifest's.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvstore.extents import PageRun
from kvstore.tiers.base import IO_ALIGN_BYTES, Transfer, padded_size

log = logging.getLogger(__name__)

Segment = tuple[int, list[memoryview]]  # (file offset in bytes, buffers to move there, in order)
BACKENDS = ("auto", "posix", "kvikio")
# The filesystem cannot preallocate at all (nothing was allocated): the file stays sparse.
# Any other failure (ENOSPC, EDQUOT, EFBIG, EIO) may have allocated part of it: undone.
_NO_FALLOCATE = frozenset({errno.EOPNOTSUPP, errno.EINVAL})
_IOV_MAX = 1024  # Linux's limit on iovecs per preadv/pwritev call


def split_iovecs(
    pages: Sequence[PageRun], page_size_bytes: int, buffers: Sequence[memoryview], size_bytes: int
) -> list[Segment]:
    """Lay the first size_bytes of an object's byte stream (its buffers, concatenated) onto its
    page runs: one (file offset, buffer slices) per run touched, in order. Pure: slices, no
    copies. ValueError when the buffers or the pages hold fewer than size_bytes."""
    views = [memoryview(b).cast("B") for b in buffers]
    out: list[Segment] = []
    remaining, bi, cur = size_bytes, 0, memoryview(b"")
    for start, length in pages:
        if remaining == 0:
            break
        run_left = min(length * page_size_bytes, remaining)
        iov: list[memoryview] = []
        out.append((start * page_size_bytes, iov))
        while run_left:
            while not len(cur):
                if bi == len(views):
                    raise ValueError(f"buffers hold fewer than the object's {size_bytes} bytes")
                cur, bi = views[bi], bi + 1
            n = min(len(cur), run_left)
            iov.append(cur[:n])
            cur, run_left, remaining = cur[n:], run_left - n, remaining - n
    if remaining:
        raise ValueError(f"pages {tuple(pages)} hold fewer than the object's {size_bytes} bytes")
    return out


def _aligned(buffers: Sequence[memoryview], need_bytes: int) -> bool:
    """True when every buffer starts and ends on a 4 KiB boundary and they hold need_bytes."""
    total = 0
    for b in buffers:
        if b.nbytes % IO_ALIGN_BYTES or _address(b) % IO_ALIGN_BYTES:
            return False
        total += b.nbytes
    return total >= need_bytes


def _address(buf: memoryview) -> int:
    if buf.nbytes == 0:
        return 0
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def _advance(iov: list[memoryview], n: int) -> list[memoryview]:
    """iov without its first n bytes."""
    while n and iov:
        if n >= len(iov[0]):
            n -= len(iov[0])
            iov = iov[1:]
        else:
            iov = [iov[0][n:], *iov[1:]]
            n = 0
    return iov


class _Backend(Protocol):
    label: str  # "gds", "kvikio-compat" or "posix"
    direct: bool  # whether aligned transfers bypass the page cache

    def move(self, segments: Sequence[Segment], direct: bool, write: bool) -> None:
        """Move the bytes of segments to (write) or from the file; OSError on failure."""
        ...

    def close(self) -> None: ...


class _PosixBackend:
    """preadv/pwritev on two descriptors: O_DIRECT for aligned transfers, buffered for the rest."""

    label = "posix"

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        self._direct_fd = _open_direct(path)
        self.direct = self._direct_fd >= 0

    def move(self, segments: Sequence[Segment], direct: bool, write: bool) -> None:
        fd = self._direct_fd if direct and self.direct else self._fd
        for offset, iov in segments:
            _move_all(fd, iov, offset, write, direct)

    def close(self) -> None:
        for fd in (self._fd, self._direct_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._direct_fd = -1


def _open_direct(path: Path) -> int:
    """An O_DIRECT descriptor on path, or -1 when its filesystem refuses one (older tmpfs)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        log.info(
            "L3 file %s: O_DIRECT refused (%s); every transfer goes through the page cache",
            path,
            exc.strerror,
        )
        return -1


def _move_all(fd: int, iov: list[memoryview], offset: int, write: bool, direct: bool) -> None:
    """preadv/pwritev until iov is done; a read that ends early is OSError(EIO)."""
    verb = "write" if write else "read"
    while iov:
        chunk = iov[:_IOV_MAX]
        n = os.pwritev(fd, chunk, offset) if write else os.preadv(fd, chunk, offset)
        # A read of 0 is EOF; an O_DIRECT transfer can only go on from an aligned offset.
        if n == 0 or (direct and n % IO_ALIGN_BYTES):
            missing = sum(len(b) for b in iov) - n
            raise OSError(
                errno.EIO,
                f"short {verb} at offset {offset}: {missing} bytes missing "
                "(was the L3 file truncated?)",
            )
        offset += n
        iov = _advance(iov, n)


class _KvikioBackend:
    """kvikio.CuFile with host buffers: GDS where the platform has it, else kvikio's POSIX
    compatibility mode. kvikio parallelises and aligns internally."""

    def __init__(self, path: Path, kvikio: Any) -> None:
        self._file = kvikio.CuFile(path, "r+")
        self.direct = _gds_available()
        self.label = "gds" if self.direct else "kvikio-compat"

    def move(self, segments: Sequence[Segment], direct: bool, write: bool) -> None:
        verb = "write" if write else "read"
        op = self._file.pwrite if write else self._file.pread
        futures: list[tuple[Any, int, int]] = []
        error: OSError | None = None
        try:
            for offset, iov in segments:
                for b in iov:
                    arr = np.frombuffer(b, dtype=np.uint8)
                    futures.append((op(arr, arr.nbytes, offset), arr.nbytes, offset))
                    offset += arr.nbytes
        except RuntimeError as exc:  # kvikio reports failures as RuntimeError
            error = OSError(errno.EIO, f"kvikio {verb} failed: {exc}")
        for future, wanted, at in futures:  # wait for every I/O before the buffers go away
            try:
                done = int(future.get())
            except RuntimeError as exc:
                done, error = -1, error or OSError(errno.EIO, f"kvikio {verb} failed: {exc}")
            if 0 <= done != wanted:
                error = error or OSError(
                    errno.EIO, f"short {verb} at offset {at}: {done} of {wanted} bytes"
                )
        if error is not None:
            raise error

    def close(self) -> None:
        self._file.close()


def _gds_available() -> bool:
    """Whether cuFile moves bytes by GPUDirect Storage (not its own POSIX fallback)."""
    try:
        from kvikio import cufile_driver

        if hasattr(cufile_driver, "get"):
            return bool(cufile_driver.get("is_gds_available"))
        return bool(cufile_driver.DriverProperties().is_gds_available)
    except (ImportError, RuntimeError, AttributeError, KeyError) as exc:
        log.info("L3: GPUDirect Storage unavailable (%s); kvikio runs in compatibility mode", exc)
        return False


def _load_kvikio() -> Any | None:
    """The kvikio module when it imports and an NVIDIA driver with a device is present."""
    try:
        import kvikio
    except ImportError:
        return None
    try:
        import cupy

        has_device = cupy.cuda.runtime.getDeviceCount() > 0
    except ImportError:
        has_device = Path("/proc/driver/nvidia/version").exists()
    except Exception as exc:  # cupy raises its own CUDARuntimeError when there is no driver
        log.info("L3: no usable NVIDIA driver (%s)", exc)
        has_device = False
    return kvikio if has_device else None


def _prepare_file(path: Path, capacity_bytes: int) -> bool:
    """Create or resize the L3 file and preallocate it; True when it stays sparse (the
    filesystem cannot preallocate). If that fails midway (no room, say) nothing partial is
    left: a file this call created is removed, one it grew is cut back to its old size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, old_size_bytes = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                     0o600), -1
    except FileExistsError:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        old_size_bytes = os.fstat(fd).st_size
    try:
        return _preallocate(fd, path, old_size_bytes, capacity_bytes)
    except BaseException:
        _undo_prepare(fd, path, old_size_bytes, capacity_bytes)
        raise
    finally:
        os.close(fd)


def _preallocate(fd: int, path: Path, size_bytes: int, capacity_bytes: int) -> bool:
    """Size the open L3 file (size_bytes now; -1 when just created) to capacity_bytes and
    preallocate it; True when it stays sparse."""
    if size_bytes != capacity_bytes:
        if size_bytes > 0:
            log.warning("L3 file %s is %d bytes; resizing to %d", path, size_bytes, capacity_bytes)
        os.ftruncate(fd, capacity_bytes)
    try:
        os.posix_fallocate(fd, 0, capacity_bytes)
    except OSError as exc:
        if exc.errno not in _NO_FALLOCATE:
            raise OSError(exc.errno, f"preallocating {capacity_bytes} bytes for {path} failed: "
                          f"{exc.strerror}") from exc
        log.warning(
            "L3 file %s is sparse: preallocating %d bytes failed (%s); writes may "
            "fail with no room left",
            path,
            capacity_bytes,
            exc.strerror,
        )
        return True
    return False


def _undo_prepare(fd: int, path: Path, old_size_bytes: int, capacity_bytes: int) -> None:
    """After a failed _preallocate: remove the file it created (old_size_bytes -1), or give
    back what it added to an existing one (whose old bytes stay as they were)."""
    try:
        if old_size_bytes < 0:
            path.unlink(missing_ok=True)
            log.info("L3 file %s removed: it could not be preallocated", path)
        elif old_size_bytes < capacity_bytes:
            os.ftruncate(fd, old_size_bytes)
    except OSError as exc:
        log.error("L3 file %s: cannot undo the failed preallocation (%s); remove it by hand",
                  path, exc.strerror)


def _check_args(capacity_bytes: int, page_size_bytes: int, backend: str, io_threads: int) -> None:
    """ValueError, saying what to change, for settings the tier cannot run with."""
    if page_size_bytes <= 0 or page_size_bytes % IO_ALIGN_BYTES:
        raise ValueError(
            f"nvme page_size_bytes must be a positive multiple of "
            f"{IO_ALIGN_BYTES}, got {page_size_bytes}"
        )
    if capacity_bytes < page_size_bytes:
        raise ValueError(
            f"nvme capacity_bytes ({capacity_bytes}) must hold at least one "
            f"page of {page_size_bytes} bytes"
        )
    if backend not in BACKENDS:
        raise ValueError(f"nvme.backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if io_threads < 1:
        raise ValueError(f"nvme io_threads must be >= 1, got {io_threads}")


class NvmeTier:
    """Page runs of the L3 file, moved in batches on a bounded pool of I/O threads."""

    name = "nvme"

    def __init__(
        self,
        path: Path,
        capacity_bytes: int,
        page_size_bytes: int,
        backend: str = "auto",
        io_threads: int = 4,
    ) -> None:
        _check_args(capacity_bytes, page_size_bytes, backend, io_threads)
        self.path = Path(path)
        self.page_size_bytes = page_size_bytes
        self.num_pages = capacity_bytes // page_size_bytes
        self.capacity_bytes = self.num_pages * page_size_bytes
        kvikio = None if backend == "posix" else _load_kvikio()
        if backend == "kvikio" and kvikio is None:
            raise RuntimeError(
                "nvme.backend=kvikio needs kvikio and an NVIDIA driver with a GPU, "
                "and this host has none; set nvme.backend=posix (or auto)"
            )
        self.sparse = _prepare_file(self.path, self.capacity_bytes)
        self._io: _Backend = (
            _KvikioBackend(self.path, kvikio) if kvikio is not None else _PosixBackend(self.path)
        )
        self.backend = self._io.label
        self.direct = self._io.direct
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstore-nvme")
        self._lock = threading.Lock()
        self._closed = False
        self.bytes_read = self.bytes_written = self.reads = self.writes = self.io_errors = 0
        self.queue_depth = 0
        log.info(
            "L3 %s: %d pages of %d bytes, backend %s, O_DIRECT %s%s",
            self.path,
            self.num_pages,
            page_size_bytes,
            self.backend,
            self.direct,
            ", sparse" if self.sparse else "",
        )

    def write(self, batch: Sequence[Transfer]) -> list[OSError | None]:
        """Copy each transfer's buffers into its pages, transfers in parallel."""
        return self._run(batch, write=True)

    def read(self, batch: Sequence[Transfer]) -> list[OSError | None]:
        """Copy each transfer's pages into its buffers, transfers in parallel."""
        return self._run(batch, write=False)

    def close(self) -> None:
        """Wait for transfers in flight, then close the file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._io.close()

    def _run(self, batch: Sequence[Transfer], write: bool) -> list[OSError | None]:
        if self._closed:
            raise ValueError(f"L3 tier {self.path} is closed")
        plans = [self._plan(t, write) for t in batch]  # misuse raises before any I/O
        futures = [
            self._pool.submit(self._move, segs, direct, nbytes, write)
            for segs, direct, nbytes in plans
        ]
        return [f.result() for f in futures]

    def _plan(self, t: Transfer, write: bool) -> tuple[list[Segment], bool, int]:
        """The transfer's segments, whether they go O_DIRECT, and the bytes they move."""
        for start, length in t.pages:
            if start < 0 or length <= 0 or start + length > self.num_pages:
                raise ValueError(f"page run {(start, length)} is outside 0..{self.num_pages}")
        if not write and any(b.readonly for b in t.buffers):
            raise ValueError("a read's buffers must be writable")
        direct = self.direct and _aligned(t.buffers, padded_size(t.size_bytes))
        nbytes = padded_size(t.size_bytes) if direct else t.size_bytes
        return split_iovecs(t.pages, self.page_size_bytes, t.buffers, nbytes), direct, nbytes

    def _move(
        self, segments: list[Segment], direct: bool, nbytes: int, write: bool
    ) -> OSError | None:
        with self._lock:
            self.queue_depth += 1
        error: OSError | None = None
        try:
            self._io.move(segments, direct, write)
        except OSError as exc:
            error = exc
        with self._lock:
            self.queue_depth -= 1
            if error is not None:
                self.io_errors += 1
            elif write:
                self.writes += 1
                self.bytes_written += nbytes
            else:
                self.reads += 1
                self.bytes_read += nbytes
        return error
