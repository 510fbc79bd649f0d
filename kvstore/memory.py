"""Process memory for bulk copies, the daemon's and a client's alike: the C allocator's policy,
pre-faulting a shared mapping, and registering one as CUDA pinned memory.

Both ends of the data path copy multi-MiB buffers. glibc serves each buffer over 128 KiB with
a fresh mmap and returns it to the OS on free, so every copy into a new buffer page-faults
its way in (about 255 faults per 2 MiB buffer; copies ran at ~0.8 GB/s instead of ~7 GB/s,
bench/store_bench.py). `keep_freed_buffers` lets glibc keep freed buffers, as the
MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ and MALLOC_TOP_PAD_ variables would.

A process that maps the daemon's shared memory faults each page in on first touch (15-65k
faults per phase of a fresh client's first puts); `prefault` populates the page tables once,
in the background, when the memory is attached.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable, contents unchanged
PREFAULT_MAX_BYTES = 64 << 30  # page tables cost 1/512 of what they map: bounded
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_tuned = False
_lock = threading.Lock()


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


def keep_freed_buffers() -> bool:
    """Tune glibc for large buffers, once per process; False when not glibc, refused, or left
    to the MALLOC_* variables the user set."""
    global _tuned
    with _lock:
        if _tuned:
            return True
        if any(name in os.environ for name in _ENV):
            log.debug("MALLOC_* set in the environment; allocator left to it")
            return False
        libc = _libc()
        if libc is None:
            log.debug("not glibc; allocator left as it is")
            return False
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
        ok = all([
            libc.mallopt(m_mmap_threshold, 32 << 20),  # glibc's maximum
            libc.mallopt(m_trim_threshold, 1 << 30),
            libc.mallopt(m_top_pad, 64 << 20),
        ])
        if not ok:
            log.warning("mallopt refused a setting; large copies may run slower")
        _tuned = ok
        return ok


def prefault(address: int, size_bytes: int, name: str) -> threading.Thread | None:
    """Populate the page tables of a mapping [address, address + size_bytes) writable, on a
    background thread (started and returned; None when there is nothing to do). Contents are
    untouched, so the daemon and other clients may use the memory meanwhile. Without
    MADV_POPULATE_WRITE (Linux < 5.14) the mapping is left to fault in as it is used."""
    size = min(size_bytes, PREFAULT_MAX_BYTES)
    libc = _libc()
    if size <= 0 or libc is None:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def run() -> None:
        if madvise(address, size, MADV_POPULATE_WRITE) != 0:
            log.debug("prefault of %s: madvise failed (errno %d); pages fault in on use",
                      name, ctypes.get_errno())

    thread = threading.Thread(target=run, name=f"prefault-{name}", daemon=True)
    thread.start()
    return thread


def register_pinned(buf: Any, what: str) -> bool:
    """cudaHostRegister buf (a numpy array over a mapping) when cupy and a CUDA device are
    present, so that copies between it and a device run by DMA without waiting for the host;
    False (logged, never raised: a driver error must not stop a CPU-only process) otherwise.
    what: the memory, for the log."""
    try:
        import cupy
    except ImportError:
        log.info("%s is plain memory: cupy is not installed", what)
        return False
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            log.info("%s is plain memory: no CUDA device", what)
            return False
        cupy.cuda.runtime.hostRegister(buf.ctypes.data, buf.nbytes, 0)
    except Exception as exc:
        log.warning("%s is plain memory: cudaHostRegister failed: %s", what, exc)
        return False
    log.info("%s registered as CUDA pinned memory (%d bytes)", what, buf.nbytes)
    return True


def unregister_pinned(address: int) -> None:
    """Undo register_pinned of the memory at address (before its mapping goes)."""
    import cupy

    try:
        cupy.cuda.runtime.hostUnregister(address)
    except Exception as exc:
        log.warning("cudaHostUnregister failed: %s", exc)
