"""The one interface every slot tier implements: L1 HBM, L2 DRAM, L3 NVMe.

A slot tier is an arena of `num_pages` pages of `page_size_bytes`; the index decides which
pages hold what (kvstore.core.pages, kvstore.core.index), the tier only moves bytes. Moves are
batched:
`read` and `write` take a list of transfers and return one result per transfer, None for
success or the OSError that failed it, so one bad block is a miss for that block alone.

A transfer's host buffers are scatter/gather memory (typically the object's pages in the
L2 shared-memory segment), so a read from L3 lands directly in its L2 pages with no extra
copy. Their total length is at least `size_bytes`; a tier may move up to
`padded_size(size_bytes)` bytes when the buffers are that long (O_DIRECT needs whole 4 KiB
blocks), so callers hand over buffers padded to the page they own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvstore.extents import PageRun

IO_ALIGN_BYTES = 4096  # O_DIRECT and GPUDirect Storage block size


def padded_size(size_bytes: int) -> int:
    """size_bytes rounded up to a whole number of 4 KiB blocks."""
    return -(-size_bytes // IO_ALIGN_BYTES) * IO_ALIGN_BYTES


@dataclass(frozen=True, slots=True)
class Transfer:
    """One object's bytes between a tier's pages and host memory."""

    pages: tuple[PageRun, ...]  # the object's pages in this tier, in order
    size_bytes: int  # the object's length
    buffers: Sequence[memoryview]  # host memory, in order: source of a write, target of a read


class SlotTier(Protocol):
    """What the store needs from a tier."""

    name: str  # "hbm", "dram" or "nvme"
    backend: str  # how it moves bytes: "cuda", "shm", "gds", "kvikio-compat", "posix"
    page_size_bytes: int
    num_pages: int
    capacity_bytes: int

    def write(self, batch: Sequence[Transfer]) -> list[OSError | None]:
        """Copy each transfer's buffers into its pages."""
        ...

    def read(self, batch: Sequence[Transfer]) -> list[OSError | None]:
        """Copy each transfer's pages into its buffers."""
        ...

    def close(self) -> None:
        ...
