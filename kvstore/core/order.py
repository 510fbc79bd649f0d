"""Per-tier eviction queues of the index: which copy of which entry goes first in each tier.

The order is LRU with a head start for hot blocks. Every touch of an entry takes the next
touch sequence number; a copy's rank is that number, plus, when the entry is hot (used
again: read, put again, or put again soon after it was evicted, `Entry.seen >= 2`),
HOT_TURNOVERS times the number of such copies the tier holds. The lowest rank goes first,
so a block used once goes before one used twice unless the hot one has gone unused for
about HOT_TURNOVERS turnovers of the tier; nothing hot stays for ever. On the Mooncake
trace at 5-20% capacity this beats plain LRU by about 8% in token hits (bench/trace_sim.py
has the figures, and why no online policy gets near Belady's optimum there).

Pure. Each slot tier has a heap of (rank, touch sequence, namespace, key). Items go stale
instead of being removed: an entry touched again gets a new sequence, and an entry whose
copy left the tier has that tier's bit cleared in `Entry.in_heaps`. A copy that is not
evictable when popped drops out of the heap; the index pushes it back (`push`) when it
becomes evictable, so the heap holds at most about one current item per copy.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping

from kvstore.core.pages import PageAllocator
from kvstore.core.records import Entry
from kvstore.keys import BlockKey
from kvstore.tier import Tier

# How many turnovers of its tier a hot block outlives a cold one by (bench/trace_sim.py:
# 4 to 16 do about equally well on the Mooncake trace; 2 loses a third of the gain).
HOT_TURNOVERS = 8

# (rank, touch sequence, namespace, key): the heap orders by rank, then touch order.
_HeapItem = tuple[int, int, str, BlockKey]


def eviction_rank(entry: Entry, tier: Tier, tier_pages: int) -> int:
    """Where entry's copy in tier (of tier_pages pages) stands: the lowest rank goes first.
    A hot entry gets a head start of HOT_TURNOVERS tiers full of copies its size."""
    rank = entry.touch_seq
    if entry.seen >= 2:
        rank += HOT_TURNOVERS * tier_pages // sum(run.length for run in entry.copies[tier])
    return rank


class EvictionOrder:
    """One heap per tier over the copies kept there."""

    def __init__(self, allocators: Mapping[Tier, PageAllocator],
                 lookup: Callable[[str, BlockKey], Entry | None]):
        self._heaps: dict[Tier, list[_HeapItem]] = {t: [] for t in allocators}
        self._pages = {t: a.num_pages for t, a in allocators.items()}
        self._lookup = lookup
        self._touches = 0

    def touch(self, entry: Entry, live_entries: int) -> None:
        """Make entry the most recently used in every tier that holds a copy."""
        self._touches += 1
        entry.touch_seq = self._touches
        entry.in_heaps = 0
        for tier in entry.copies:
            self._push(entry, tier)
            if len(self._heaps[tier]) > 2 * live_entries + 64:
                self._compact(tier)

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

    def pop_victim(self, tier: Tier) -> Entry | None:
        """The least recently used copy in tier that may go now; it leaves the queue."""
        heap = self._heaps[tier]
        bit = 1 << tier
        while heap:
            _, seq, namespace, key = heapq.heappop(heap)
            entry = self._lookup(namespace, key)
            if entry is None or entry.touch_seq != seq or not entry.in_heaps & bit:
                continue  # stale: touched again, moved out of the tier, or removed
            entry.in_heaps &= ~bit
            if tier in entry.copies and entry.evictable_from(tier):
                return entry
            # Not evictable now; push() queues it again when it becomes evictable.
        return None

    def pick(self, tier: Tier, max_bytes: int, max_entries: int | None = None) -> list[Entry]:
        """Victims in tier, about max_bytes of them (and at most max_entries), in leaf-first
        eviction order, taken out of the queue. A parent follows as soon as every child it
        has cached in tier (or above) is taken, as if they had already moved, so a chain
        leaves a tier tail first."""
        picked: list[Entry] = []
        under: dict[tuple[str, BlockKey], int] = {}  # picked children per parent
        follow: list[Entry] = []
        total = 0
        while total < max_bytes and (max_entries is None or len(picked) < max_entries):
            entry = follow.pop() if follow else self.pop_victim(tier)
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
            # of pop_victim too: it is picked once.
            if (parent is not None and tier in parent.copies and parent.movable
                    and sum(parent.child_tiers[1 : tier + 1]) == under[link]):
                follow.append(parent)
        return picked

    def _push(self, entry: Entry, tier: Tier) -> None:
        entry.in_heaps |= 1 << tier
        rank = eviction_rank(entry, tier, self._pages[tier])
        heapq.heappush(self._heaps[tier], (rank, entry.touch_seq, entry.namespace, entry.key))

    def _compact(self, tier: Tier) -> None:
        bit = 1 << tier
        live: dict[tuple[str, BlockKey], _HeapItem] = {}
        for item in self._heaps[tier]:
            entry = self._lookup(item[2], item[3])
            if entry is not None and entry.touch_seq == item[1] and entry.in_heaps & bit:
                live[(item[2], item[3])] = item
        heap = list(live.values())
        heapq.heapify(heap)
        self._heaps[tier] = heap
