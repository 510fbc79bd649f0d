"""The records the index and the store keep and hand out: entries, store plans, leases, put
sessions, reservations, read results and store stats (the tiers and a tier's figures are
shared with the client: `kvstore.tier`).

Pure data; the rules about them live in the index (`kvstore.core.index`, its leases and pins
in `kvstore.core.leases`, its moves between tiers in `kvstore.core.moves`) and the store
(`kvstore.daemon.store`, its reader and writer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.extents import Extent, PageRun
from kvstore.keys import BlockKey
from kvstore.tier import Tier, TierStats

if TYPE_CHECKING:
    import xxhash



NUM_TIERS = len(Tier) + 1  # per-tier counters are indexed by tier number; slot 0 unused


@dataclass(eq=False, slots=True)
class Entry:
    """One block, with a copy in one or more slot tiers (`copies`: tier -> its pages there).

    `tier` is the highest (fastest) tier holding it. A second copy exists when placement is
    inclusive (the L3 copy stays after a promotion) and for L1, which always keeps its L2 copy.
    """

    namespace: str
    key: BlockKey
    size_bytes: int
    copies: dict[Tier, tuple[PageRun, ...]]
    checksum: int
    parent: BlockKey | None
    # The arena (tenant) whose pages its copies take in every tier, fixed when it is stored.
    arena: str = ""
    # Cached children by their highest tier (shared with the index's child counts): a copy
    # in tier t is a leaf there when no child is cached in t or above.
    child_tiers: list[int] = field(default_factory=lambda: [0] * NUM_TIERS)
    pinned: bool = False
    leases: int = 0
    busy: int = 0  # moves and loads in flight: the entry and its pages stay put meanwhile
    seen: int = 1  # puts and reads of this key: the L3 admission policy counts them
    touch_seq: int = 0  # which heap items are current; 0 = none
    in_heaps: int = 0  # bit per tier whose eviction heap holds a current item
    tier: Tier = Tier.DRAM  # the fastest tier in copies, kept by the index (see __post_init__)

    def __post_init__(self) -> None:
        self.tier = min(self.copies)

    @property
    def children(self) -> int:
        return sum(self.child_tiers)

    @property
    def movable(self) -> bool:
        """Nobody holds it: not pinned, leased, or being moved or loaded."""
        return not self.pinned and self.leases == 0 and self.busy == 0

    @property
    def evictable(self) -> bool:
        return self.movable and self.children == 0

    def evictable_from(self, tier: Tier) -> bool:
        """Whether its copy in tier may leave the tier (be moved, or dropped when it is not
        the last copy): movable, and no child cached in tier or above."""
        return self.movable and not any(self.child_tiers[1 : tier + 1])

    def droppable_from(self, tier: Tier) -> bool:
        """Whether its copy in tier may be freed with nothing taking its place: as
        evictable_from, and then the entry stays cached elsewhere, or has no cached child
        (the last copy of a parent never goes: that would strand its children). An L1 copy
        goes with its L2 copy, so that pair counts as one."""
        if not self.evictable_from(tier):
            return False
        paired = (Tier.HBM,) if tier == Tier.DRAM else ()
        return self.children == 0 or any(t != tier and t not in paired for t in self.copies)

    def blocker(self, tier: Tier | None = None) -> str:
        """Why it (its copy in tier; None: every copy) cannot go now, one `Skipped` field."""
        if self.pinned:
            return "pinned"
        if self.leases:
            return "leased"
        if self.busy:
            return "loading"
        faster = self.child_tiers[1 : self.tier if tier is None else tier]
        return "child_in_faster_tier" if any(faster) else "has_children"


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
    client: str = ""  # who made it (kvstore.core.holdings)
    arena: str = ""  # whose pages the blocks take (the namespace's arena at prepare time)
    # Cached parents the blocks extend, held until the plan ends: evicted meanwhile, they
    # would leave the new blocks without their prefix.
    anchors: list[Entry] = field(default_factory=list)

    @property
    def size_bytes(self) -> int:
        return sum(block.size_bytes for block in self.blocks)

    @property
    def num_keys(self) -> int:
        """Keys of the request the plan was made for: its blocks and the existing ones."""
        return len(self.blocks) + len(self.existing)


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
    client: str = ""  # who holds it (kvstore.core.holdings)


@dataclass(slots=True)
class StoreStats:
    tiers: list[TierStats]
    shm_name: str
    shm_size_bytes: int
    leases: int
    reservations: int
    pinned: int
    hits: int
    misses: int
    prewarm: PrewarmState | None = None  # the running or last pre-warm


@dataclass(slots=True)
class PrewarmState:
    """Progress of a pre-warm: blocks and bytes brought in from L4 so far."""

    blocks: int = 0
    bytes: int = 0
    target_bytes: int = 0
    done: bool = False


@dataclass(slots=True)
class PutSession:
    """One put in flight: where each block's bytes go, and how many have arrived."""

    plan_id: str
    namespace: str
    sizes: list[int]
    targets: list[list[Extent] | None]  # per request position; None = already stored
    hashers: list[xxhash.xxh3_64 | None]
    total_bytes: int
    received_bytes: int = 0
    block: int = 0  # request position the next byte belongs to
    block_offset: int = 0
    # The stored blocks' checksums, given when the put began (bytes verified already); None:
    # hashed as they arrive (hashers).
    checksums: list[int] | None = None


@dataclass(slots=True)
class Reservation:
    reservation_id: str
    exists: list[bool]
    extents: list[list[Extent]]  # per key; empty for keys that exist
    expires_in_s: float


@dataclass(slots=True)
class ReadResult:
    lease_id: str
    entries: list[Entry | None]
    extents: list[list[Extent]] = field(default_factory=list)  # per found entry


@dataclass(slots=True)
class Skipped:
    """What an Evict could not remove, by reason (each block counted once, by its first)."""

    pinned: int = 0
    leased: int = 0
    loading: int = 0  # in use: a load, a move between tiers, or a put extending it
    child_in_faster_tier: int = 0  # its copy here is the prefix of a child cached higher up
    has_children: int = 0  # the last copy of a block whose cached children would be stranded

    def add(self, reason: str, count: int = 1) -> None:
        setattr(self, reason, getattr(self, reason) + count)

    @property
    def total(self) -> int:
        return (self.pinned + self.leased + self.loading + self.child_in_faster_tier
                + self.has_children)


@dataclass(frozen=True, slots=True)
class EvictResult:
    evicted: int
    evicted_bytes: int
    skipped: Skipped
