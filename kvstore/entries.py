"""The records the index keeps and hands out: tiers, entries, store plans, leases.

Pure data; `kvstore.index` owns every rule about them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from kvstore.keys import BlockKey
from kvstore.pages import PageRun


class Tier(IntEnum):
    """Tiers, numbered as in the wire contract (`kvstore.v1.Tier`)."""

    HBM = 1
    DRAM = 2
    NVME = 3
    REMOTE = 4

    @property
    def label(self) -> str:
        """The name operators see: "hbm", "dram", "nvme", "remote"."""
        return self.name.lower()


@dataclass(eq=False, slots=True)
class Entry:
    namespace: str
    key: BlockKey
    size_bytes: int
    tier: Tier
    pages: tuple[PageRun, ...]
    checksum: int
    parent: BlockKey | None
    last_access: float = 0.0
    children: int = 0
    pinned: bool = False
    leases: int = 0
    touch_seq: int = 0  # which heap item is current; 0 = none
    in_heap: bool = False

    @property
    def evictable(self) -> bool:
        return not self.pinned and self.leases == 0 and self.children == 0


@dataclass(slots=True)
class PlannedBlock:
    index: int  # position in the request
    key: BlockKey
    size_bytes: int
    pages: tuple[PageRun, ...]
    parent: BlockKey | None


@dataclass(slots=True)
class StorePlan:
    plan_id: str
    namespace: str
    tier: Tier
    blocks: list[PlannedBlock]
    existing: list[int]  # request positions already stored (or repeated in the request)
    evicted: list[Entry]  # entries removed to make room; their pages may be reused
    deadline: float


@dataclass(frozen=True, slots=True)
class CommitResult:
    stored: int
    existing: int
    evicted: int = 0  # entries evicted to make room for the plan


@dataclass(slots=True)
class Lease:
    lease_id: str
    entries: list[Entry]
    deadline: float
