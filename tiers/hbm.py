"""L1 HBM tier: one device arena of fixed-size pages on a CUDA GPU.

The arena is a single `torch.uint8` tensor of `num_pages * page_size_bytes` on one device,
allocated once. Which pages hold what is the index's business; this module only moves an
object's bytes between its device pages and host buffers. An object's byte stream is laid
over its page runs in order (run r covers bytes start*page_size .. (start+length)*page_size
of the arena), so a transfer is a list of (device range, host range) pieces: `split_transfer`.

Every copy of a batch is enqueued with `non_blocking=True` on one dedicated stream and the
stream is synchronized once at the end, so the copies of a batch overlap and the Python
thread never waits per copy. Host buffers are wrapped zero-copy (`torch.frombuffer`). Copies
are only truly asynchronous DMA when the host memory is pinned (page-locked): from pageable
memory the driver stages through a bounce buffer and the call returns only once the bytes
are staged. The L2 segment is pinned (`cudaHostRegister`) when cupy is installed, so L2<->L1
moves are DMA; without cupy they are correct but slower.

torch is imported lazily: a CPU-only daemon never loads CUDA.
"""

from __future__ import annotations

import errno
import logging
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from kvstore.extents import PageRun
from kvstore.tiers.base import Transfer

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MAX_FRACTION = 0.9  # leave HBM for the engine's weights and activations


class HbmUnavailable(RuntimeError):
    """No usable CUDA device for the L1 tier."""


class Piece(NamedTuple):
    """One contiguous copy: `length` bytes at arena byte `device_offset` <-> buffer bytes."""

    device_offset: int
    buffer_index: int
    buffer_offset: int
    length: int


def split_transfer(
    pages: Sequence[PageRun], size_bytes: int, buffer_lengths: Sequence[int], page_size_bytes: int
) -> list[Piece]:
    """The copies that move an object of size_bytes between its pages and its buffers.

    Both sides are consumed in order; a piece ends where a page run or a buffer ends. Raises
    ValueError when the pages or the buffers hold fewer than size_bytes.
    """
    if size_bytes < 0:
        raise ValueError(f"size_bytes must be >= 0, got {size_bytes}")
    if (size_bytes and pages and buffer_lengths and buffer_lengths[0] >= size_bytes
            and pages[0][1] * page_size_bytes >= size_bytes):
        return [Piece(pages[0][0] * page_size_bytes, 0, 0, size_bytes)]  # the common case
    page_bytes = sum(length for _, length in pages) * page_size_bytes
    if page_bytes < size_bytes:
        raise ValueError(f"pages hold {page_bytes} bytes, fewer than size_bytes={size_bytes}")
    if sum(buffer_lengths) < size_bytes:
        raise ValueError(
            f"buffers hold {sum(buffer_lengths)} bytes, fewer than size_bytes={size_bytes}"
        )
    pieces: list[Piece] = []
    run_index, run_done = 0, 0  # bytes of the current run already covered
    buf_index, buf_done = 0, 0
    remaining = size_bytes
    while remaining:
        start, length = pages[run_index]
        run_left = length * page_size_bytes - run_done
        buf_left = buffer_lengths[buf_index] - buf_done
        n = min(run_left, buf_left, remaining)
        if n:
            pieces.append(Piece(start * page_size_bytes + run_done, buf_index, buf_done, n))
        run_done += n
        buf_done += n
        remaining -= n
        if run_done == length * page_size_bytes:
            run_index, run_done = run_index + 1, 0
        if buf_done == buffer_lengths[buf_index]:
            buf_index, buf_done = buf_index + 1, 0
    return pieces


def cuda_unavailable_reason(device: int = 0) -> str | None:
    """Why CUDA device `device` cannot be used, or None when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    try:
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return f"torch {torch.__version__} is a CPU-only build"
        count = torch.cuda.device_count()
        if count == 0 or not torch.cuda.is_available():
            return "no CUDA device is visible (driver missing or CUDA_VISIBLE_DEVICES empty)"
        if not 0 <= device < count:
            return f"CUDA device {device} does not exist ({count} visible)"
    except Exception as exc:  # a broken driver reads as "no GPU", never as a crash
        return f"CUDA initialisation failed: {exc}"
    return None


def cuda_available() -> bool:
    """True when torch has CUDA and at least one device is visible; never raises."""
    return cuda_unavailable_reason(0) is None


def _io_error(exc: BaseException) -> OSError:
    return OSError(errno.EIO, f"CUDA copy failed: {exc}")


def _byte_view(buffer: memoryview, writable: bool) -> memoryview:
    """buffer as a flat byte view; raises on memory a copy cannot use."""
    view = buffer if isinstance(buffer, memoryview) else memoryview(buffer)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")  # raises TypeError for non-contiguous memory
    if writable and view.readonly:
        raise ValueError("a read's target buffer is read-only")
    return view


def _host_tensor(view: memoryview, offset: int, length: int) -> torch.Tensor:
    """A CPU uint8 tensor over view[offset:offset+length], sharing its memory."""
    import torch

    if not view.readonly:
        return torch.frombuffer(view, dtype=torch.uint8, count=length, offset=offset)
    with warnings.catch_warnings():
        # A write's source may be read-only memory; torch warns, but the copy only reads it.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(view, dtype=torch.uint8, count=length, offset=offset)


class HbmTier:
    """L1: `num_pages` pages of `page_size_bytes` in one tensor on `cuda:{device}`.

    `reads`/`writes` count transfers that succeeded, `bytes_read`/`bytes_written` their
    size_bytes. `read` and `write` raise ValueError for misuse (pages outside the arena, pages
    or buffers shorter than size_bytes, a read-only read target) before moving any byte;
    a CUDA failure is an OSError(EIO) result for each transfer it hit.
    """

    name = "hbm"
    backend = "cuda"

    def __init__(
        self, capacity_bytes: int, fraction: float, page_size_bytes: int, device: int = 0
    ) -> None:
        if page_size_bytes <= 0:
            raise ValueError(f"page_size_bytes must be positive, got {page_size_bytes}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 (0: size by fraction), "
                             f"got {capacity_bytes}")
        if capacity_bytes == 0 and not 0 < fraction <= MAX_FRACTION:
            raise ValueError(f"fraction must be in (0, {MAX_FRACTION}] when capacity_bytes is 0,"
                             f" got {fraction}")
        reason = cuda_unavailable_reason(device)
        if reason is not None:
            raise HbmUnavailable(f"the HBM tier needs a CUDA GPU: {reason}; "
                                 "set hbm.mode=off or auto")
        import torch

        self.device = device
        self.page_size_bytes = page_size_bytes
        if capacity_bytes == 0:
            free_bytes, _total = torch.cuda.mem_get_info(device)
            capacity_bytes = int(free_bytes * fraction)
        self.num_pages = capacity_bytes // page_size_bytes
        if self.num_pages == 0:
            raise ValueError(f"HBM capacity {capacity_bytes} bytes is less than one page "
                             f"({page_size_bytes} bytes); raise hbm.capacity_bytes or "
                             "hbm.fraction_of_free")
        self.capacity_bytes = self.num_pages * page_size_bytes
        try:
            self._arena: torch.Tensor | None = torch.empty(
                self.capacity_bytes, dtype=torch.uint8, device=f"cuda:{device}"
            )
        except torch.OutOfMemoryError as exc:
            raise HbmUnavailable(f"cannot allocate {self.capacity_bytes} bytes of HBM on "
                                 f"cuda:{device}: {exc}; lower hbm.capacity_bytes or "
                                 "hbm.fraction_of_free, "
                                 "or set hbm.mode=off or auto") from exc
        stream_type: Any = torch.cuda.Stream  # untyped in torch's stubs
        self._stream: Any = stream_type(device=device)
        self.bytes_read = 0
        self.bytes_written = 0
        self.reads = 0
        self.writes = 0

    def write(self, batch: Sequence[Transfer]) -> list[OSError | None]:
        """Copy each transfer's host buffers into its device pages (H2D), one batch on the
        tier's stream; returns when every copy has landed."""
        return self._counted(batch, to_device=True)

    def read(self, batch: Sequence[Transfer]) -> list[OSError | None]:
        """Copy each transfer's device pages into its host buffers (D2H), one batch on the
        tier's stream; returns when every copy has landed."""
        return self._counted(batch, to_device=False)

    def _counted(self, batch: Sequence[Transfer], to_device: bool) -> list[OSError | None]:
        results = self._copy(batch, to_device=to_device)
        for transfer, error in zip(batch, results, strict=True):
            if error is not None:
                continue
            if to_device:
                self.writes += 1
                self.bytes_written += transfer.size_bytes
            else:
                self.reads += 1
                self.bytes_read += transfer.size_bytes
        return results

    def device_view(self, pages: Sequence[PageRun], size_bytes: int) -> list[torch.Tensor]:
        """The object's bytes on the device, run by run (views of the arena, no copy).

        Valid until the index frees the pages. Work queued on other streams must be ordered
        by the caller; `read` and `write` wait for the caller's current stream first.
        """
        arena = self._live_arena()
        self._check_pages(pages)
        views: list[torch.Tensor] = []
        remaining = size_bytes
        for start, length in pages:
            if remaining <= 0:
                break
            n = min(length * self.page_size_bytes, remaining)
            views.append(arena.narrow(0, start * self.page_size_bytes, n))
            remaining -= n
        if remaining > 0:
            raise ValueError(f"pages hold fewer than size_bytes={size_bytes} bytes")
        return views

    def close(self) -> None:
        """Free the arena and return cached device memory to the driver; idempotent."""
        if self._arena is None:
            return
        import torch

        self._arena = None
        try:
            self._stream.synchronize()  # nothing is in flight after read/write; be sure
            torch.cuda.empty_cache()
        except RuntimeError as exc:  # a dead context must not stop a shutdown
            log.warning("HBM tier close: %s", exc)

    # --- internals -------------------------------------------------------------------------

    def _live_arena(self) -> torch.Tensor:
        if self._arena is None:
            raise ValueError("the HBM tier is closed")
        return self._arena

    def _check_pages(self, pages: Sequence[PageRun]) -> None:
        for start, length in pages:
            if start < 0 or length <= 0 or start + length > self.num_pages:
                raise ValueError(f"page run {(start, length)} is outside 0..{self.num_pages}")

    def _plan(self, transfer: Transfer, to_device: bool) -> tuple[list[Piece], list[memoryview]]:
        """Pieces and flat buffer views for one transfer; raises ValueError on misuse."""
        self._check_pages(transfer.pages)
        views = [_byte_view(b, writable=not to_device) for b in transfer.buffers]
        pieces = split_transfer(transfer.pages, transfer.size_bytes, [v.nbytes for v in views],
                                self.page_size_bytes)
        return pieces, views

    def _copy(self, batch: Sequence[Transfer], to_device: bool) -> list[OSError | None]:
        import torch

        arena = self._live_arena()
        # Validate the whole batch before enqueueing anything: misuse moves no bytes.
        plans = [self._plan(transfer, to_device) for transfer in batch]
        results: list[OSError | None] = [None] * len(batch)
        keep: list[torch.Tensor] = []  # host tensors must outlive their queued copies
        try:
            # Order after work the caller queued on its stream (e.g. on a device_view).
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        except RuntimeError as exc:
            return [_io_error(exc) for _ in batch]
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            for i, (pieces, views) in enumerate(plans):
                try:
                    for offset, buf_index, buf_offset, n in pieces:
                        host = _host_tensor(views[buf_index], buf_offset, n)
                        keep.append(host)
                        if to_device:
                            arena.narrow(0, offset, n).copy_(host, non_blocking=True)
                        else:
                            host.copy_(arena.narrow(0, offset, n), non_blocking=True)
                except RuntimeError as exc:
                    results[i] = _io_error(exc)
        try:
            self._stream.synchronize()
        except RuntimeError as exc:
            return [error or _io_error(exc) for error in results]
        return results
