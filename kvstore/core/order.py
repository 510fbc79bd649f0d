"""Per-tier eviction queues of the index: which copy of which entry goes first in each tier.

The order is LRU with a head start for hot blocks. Every touch of an entry takes the next
touch sequence number; a copy's rank is that number, plus, when the entry is hot (used
again: read, put again, or put again soon after it was evicted, `Entry.seen >= 2`),
HOT_TURNOVERS times the number of such copies its arena of the tier holds (the whole tier
without tenants). The lowest rank goes first, so a block used once goes before one used
twice unless the hot one has gone unused for about HOT_TURNOVERS turnovers of the arena;
nothing hot stays for ever. On the Mooncake
trace at 5-20% capacity this beats plain LRU by about 8% in token hits (bench/trace_sim.py
has the figures, and why no online policy gets near Belady's optimum there).

Pure. Each arena of each slot tier (kvstore.core.pages.TierPages) has a heap of (rank, touch
sequence, namespace, key) over the copies kept there, ranked against the arena's pages: a
tenant's blocks compete only with its own. Items go stale instead of being removed: an entry
touched again gets a new sequence, and an entry whose copy left the tier has that tier's bit
cleared in `Entry.in_heaps`. A copy that is not evictable when popped drops out of the heap;
the index pushes it back (`push`) when it becomes evictable, so the heap holds at most about
one current item per copy. Across a tier's arenas (an admin's Evict without a namespace) the
lowest rank of any arena goes first.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping

from kvstore.core.records import Entry
from kvstore.keys import BlockKey
from kvstore.tier import Tier

# How many turnovers of its tier a hot block outlives a cold one by (bench/trace_sim.py:
# 4 to 16 do about equally well on the Mooncake trace; 2 loses a third of the gain).
HOT_TURNOVERS = 8

# (rank, touch sequence, namespace, key): the heap orders by rank, then touch order.
_HeapItem = tuple[int, int, str, BlockKey]
_PAST_EVERY_ITEM = (math.inf,)  # compares above every heap item: an empty heap's lowest


def _lowest(heap: list[_HeapItem]) -> tuple[float, ...] | _HeapItem:
    return heap[0] if heap else _PAST_EVERY_ITEM


def eviction_rank(entry: Entry, tier: Tier, tier_pages: int) -> int:
    """Where entry's copy in tier (in an arena of tier_pages pages) stands: the lowest rank
    goes first. A hot entry gets a head start of HOT_TURNOVERS arenas full of copies its
    size."""
    rank = entry.touch_seq
    if entry.seen >= 2:
        rank += HOT_TURNOVERS * tier_pages // sum(run.length for run in entry.copies[tier])
    return rank


class EvictionOrder:
    """One heap per arena of each tier over the copies kept there."""

    def __init__(self, arena_pages: Mapping[Tier, Mapping[str, int]],
                 lookup: Callable[[str, BlockKey], Entry | None]):
        """arena_pages: each tier's arenas and their sizes in pages."""
        self._heaps: dict[Tier, dict[str, list[_HeapItem]]] = {
            t: {name: [] for name in arenas} for t, arenas in arena_pages.items()}
        self._pages = {t: dict(arenas) for t, arenas in arena_pages.items()}
        # What pop_victim searches: every heap of a tier, or one arena's (heaps change only
        # in place, so these stay current)
        self._every = {t: list(heaps.values()) for t, heaps in self._heaps.items()}
        self._one = {t: {name: [heap] for name, heap in heaps.items()}
                     for t, heaps in self._heaps.items()}
        self._lookup = lookup
        self._touches = 0

    def touch(self, entry: Entry, live_entries: int) -> None:
        """Make entry the most recently used in every tier that holds a copy."""
        self._touches += 1
        entry.touch_seq = self._touches
        entry.in_heaps = 0
        for tier in entry.copies:
            if len(self._push(entry, tier)) > 2 * live_entries + 64:
                self._compact(tier, entry.arena)

    def push(self, entry: Entry) -> None:
        """Queue every copy of entry that is evictable now and not queued yet."""
        if not entry.touch_seq:
            return
        for tier in entry.copies:
            if not entry.in_heaps & (1 << tier) and entry.evictable_from(tier):
                self._push(entry, tier)

    def forget(self, entry: Entry, tier: Tier) -> None:
        """The copy in tier is gone: its queued item is stale."""
        entry.in_heaps &= ~(1 << tier)

    def pop_victim(self, tier: Tier, arena: str | None = None, *,
                   drop: bool = False) -> Entry | None:
        """The least recently used copy in tier's arena (None: in any arena of tier) that
        may go now; it leaves the queue. drop: the copy will be freed with nothing taking
        its place, so it must also be droppable (`Entry.droppable_from`); copies that may
        only move (the last copy of a parent) stay queued for the movers."""
        queues = self._every[tier] if arena is None else self._one[tier].get(arena)
        if queues is None:
            return None
        bit = 1 << tier
        movable_only: list[Entry] = []
        try:
            while True:
                # One arena: its heap; several: the one whose lowest item is the lowest.
                heap = queues[0] if len(queues) == 1 else min(queues, key=_lowest)
                if not heap:
                    return None
                _, seq, namespace, key = heapq.heappop(heap)
                entry = self._lookup(namespace, key)
                if entry is None or entry.touch_seq != seq or not entry.in_heaps & bit:
                    continue  # stale: touched again, moved out of the tier, or removed
                entry.in_heaps &= ~bit
                if tier in entry.copies and entry.evictable_from(tier):
                    if not drop or entry.droppable_from(tier):
                        return entry
                    movable_only.append(entry)
                # Not evictable now; push() queues it again when it becomes evictable.
        finally:
            for entry in movable_only:
                self._push(entry, tier)

    def pick(self, tier: Tier, max_bytes: int, max_entries: int | None = None,
             arena: str | None = None) -> list[Entry]:
        """Victims in tier's arena (None: any arena), about max_bytes of them (and at most
        max_entries), in leaf-first eviction order, taken out of the queue. A parent follows
        as soon as every child it has cached in tier (or above) is taken, as if they had
        already moved, so a chain leaves a tier tail first."""
        picked: list[Entry] = []
        under: dict[tuple[str, BlockKey], int] = {}  # picked children per parent
        follow: list[Entry] = []
        total = 0
        while total < max_bytes and (max_entries is None or len(picked) < max_entries):
            entry = follow.pop() if follow else self.pop_victim(tier, arena)
            if entry is None:
                break
            picked.append(entry)
            total += entry.size_bytes
            if entry.parent is None:
                continue
            link = (entry.namespace, entry.parent)
            under[link] = under.get(link, 0) + 1
            parent = self._lookup(*link)
            # Still counted under its picked children, a followed parent is never a victim
            # of pop_victim too: it is picked once. One stored under another arena (its
            # tenants were re-read) stays in that arena's queue.
            if (parent is not None and tier in parent.copies and parent.movable
                    and sum(parent.child_tiers[1 : tier + 1]) == under[link]
                    and (arena is None or parent.arena == arena)):
                follow.append(parent)
        return picked

    def _push(self, entry: Entry, tier: Tier) -> list[_HeapItem]:
        entry.in_heaps |= 1 << tier
        rank = eviction_rank(entry, tier, self._pages[tier][entry.arena])
        heap = self._heaps[tier][entry.arena]
        heapq.heappush(heap, (rank, entry.touch_seq, entry.namespace, entry.key))
        return heap

    def _compact(self, tier: Tier, arena: str) -> None:
        bit = 1 << tier
        live: dict[tuple[str, BlockKey], _HeapItem] = {}
        for item in self._heaps[tier][arena]:
            entry = self._lookup(item[2], item[3])
            if entry is not None and entry.touch_seq == item[1] and entry.in_heaps & bit:
                live[(item[2], item[3])] = item
        heap = self._heaps[tier][arena]
        heap[:] = live.values()
        heapq.heapify(heap)
