"""The store's own placement and eviction, for bench/trace_sim.py: the daemon's real pure
index (`kvstore.core.index.Index`) and placement planner (`kvstore.core.placement.Placement`),
their plans executed as the daemon executes them but without I/O, with L2 alone or with an L3
below it. This module keeps no rule of its own: where pages come from, where a demoted block
goes and what L3 admits are the planner's.

Each block is one page of one byte, and the request index is the clock. Per request:

1. `lookup` the request's keys: the hit prefix, each block's tier;
2. the Get: blocks of the hit prefix that are only in L3 are loaded into L2 (room as the
   planner places it, then `Placement.promote`), then the prefix is touched as one read;
3. the put of the rest: `prepare_store` / `complete_store`, chained to the hit prefix.

Where the daemon's mover demotes in the background to keep L2 below its watermark, here a
put or a load the planner finds short of L2 pages (`RoomStep.DEMOTE`) demotes first,
synchronously, in the index's own order (`Moves.pick`: leaf first, cold before hot), each
block moving as `Placement.demote` says and its write finishing at once; what is still short
is evicted. A Get's blocks must fit in L2 together, so a hit prefix counts up to L2's capacity.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.core.index import Index
from kvstore.core.pages import PageAllocator
from kvstore.core.placement import Move, Placement, RoomStep
from kvstore.core.records import Entry
from kvstore.keys import BlockKey
from kvstore.tier import Tier

NAMESPACE = "sim"


def block_key(hash_id: int) -> BlockKey:
    return BlockKey(hash_id.to_bytes(32, "big"))


class StorePolicy:
    """The store with an L2 of capacity_blocks, and an L3 of l3_blocks when that is > 0, which
    admits blocks seen at least admit_min_seen times (`nvme.admit_min_seen`; 1 = every block,
    the daemon's default)."""

    def __init__(self, capacity_blocks: int, requests: Sequence[object] = (),
                 l3_blocks: int = 0, admit_min_seen: int = 1) -> None:
        self._capacity = capacity_blocks
        allocators = {Tier.DRAM: PageAllocator(capacity_blocks)}
        if l3_blocks > 0:
            allocators[Tier.NVME] = PageAllocator(l3_blocks)
        self.index = Index(allocators, {t: 1 for t in allocators})
        self.placement = Placement(self.index, allocators, admit_min_seen)
        self._tiered = l3_blocks > 0
        self._plans = 0

    def access(self, request_index: int, hash_ids: Sequence[int]) -> list[str]:
        """The tier label of each block of the hit prefix."""
        keys = [block_key(h) for h in hash_ids[: self._capacity]]
        hits, tiers = self.index.lookup(NAMESPACE, keys)
        found = [self.index.get(NAMESPACE, key) for key in keys[:hits]]
        if self._tiered:
            self._load(found)
        self.index.touch(NAMESPACE, keys[:hits])  # the engine's read
        if hits < len(keys):
            self._put(keys, hits)
        return [tier.label for tier in tiers[:hits] if tier is not None]

    def cached_blocks(self) -> set[int]:
        """Blocks in L2 (the one cache the single-tier policies are compared with)."""
        return {int.from_bytes(e.key, "big") for e in self.index.entries(Tier.DRAM)}

    def _put(self, keys: list[BlockKey], start: int) -> None:
        """The engine's put of the blocks it computed: keys[start:], chained to parents."""
        parents = [keys[i - 1] if i else None for i in range(start, len(keys))]
        room = self.placement.room(Tier.DRAM, len(parents))  # one page per block
        if room.step is RoomStep.DEMOTE:
            self._demote(room.short_pages)
        self._plans += 1
        plan_id = f"p{self._plans}"
        plan = self.index.prepare_store(plan_id, NAMESPACE, keys[start:], [1] * len(parents),
                                        parents, Tier.DRAM, deadline=float("inf"))
        if plan is None:
            raise RuntimeError("the index refused a put that fits its capacity")
        self.index.complete_store(plan_id, [0] * len(plan.blocks), success=True)

    def _load(self, found: list[Entry | None]) -> None:
        """The Get's loads: every L3-only block of the prefix into L2, the prefix held."""
        held = [e for e in found if e is not None]
        for entry in held:
            self.index.moves.hold(entry)
        for entry in held:
            if Tier.DRAM in entry.copies:
                continue
            got = self.placement.alloc(Tier.DRAM, entry.size_bytes)
            if got.room.step is RoomStep.DEMOTE:
                self._demote(got.room.short_pages)
                got = self.placement.alloc(Tier.DRAM, entry.size_bytes, demoted=True)
            if got.pages is None:
                raise RuntimeError("no L2 room for a load, though the prefix fits L2")
            self.placement.promote(entry, Tier.DRAM, got.pages)
        for entry in held:
            self.index.moves.done(entry)

    def _demote(self, num_pages: int) -> None:
        """Move about num_pages blocks' worth out of L2, in eviction order, as the planner
        says; a write to L3 finishes at once (there is no I/O to fail)."""
        for entry in self.index.moves.pick(Tier.DRAM, num_pages):  # one byte per page
            demotion = self.placement.demote(entry, Tier.DRAM)
            if demotion.move is Move.WRITE:
                self.placement.finish_demotion(demotion, written=True)
