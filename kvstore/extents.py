"""Where a block's bytes lie: runs of pages in a slot tier, and byte extents in a segment.

Shared by the core's page allocator, every tier and the daemon (value types, no logic).
"""

from __future__ import annotations

from typing import NamedTuple

Extent = tuple[int, int]  # (byte offset in a segment, e.g. the L2 shared memory; length in bytes)


class PageRun(NamedTuple):
    """`length` consecutive pages starting at page `start`."""

    start: int
    length: int


class Arena(NamedTuple):
    """A tenant's share of one slot tier: pages [first_page, first_page + num_pages)."""

    name: str  # the tenant's ("" for the one arena of a daemon without tenants)
    first_page: int
    num_pages: int
