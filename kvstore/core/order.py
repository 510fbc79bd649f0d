"""Per-tier eviction queues of the index: which copy of which entry goes first in each tier.

The order is LRU with a head start for hot blocks. Every touch of an entry takes the next
touch sequence number; a copy's rank is that number, plus, when the entry is hot (used
again: read, put again, or put again soon after it was evicted, `Entry.seen >= 2`), the head
start times the number of such copies its arena of the tier holds (the whole tier without
tenants). The lowest rank goes first, so a block used once goes before one used twice unless
the hot one has gone unused for about the head start's turnovers of the arena; nothing hot
stays for ever. The head start is the workload's (`kvstore.core.headstart`: shadow caches
pick 0, plain LRU, up to 16 turnovers); bench/trace_sim.py has the figures per trace family.

Pure. Each arena of each slot tier (kvstore.core.pages.TierPages) has a queue of the copies
kept there: a heap of cold copies and one of hot copies per copy size, each of (touch
sequence, namespace, key), ranked against the arena's pages when heads are compared, so a new
head start applies to every queued copy at once; a tenant's blocks compete only with its own.
Items go stale instead of being removed: an entry touched again gets a new sequence, and an
entry whose copy left the tier has that tier's bit cleared in `Entry.in_heaps`. A copy that
is not evictable when popped drops out of its heap; the index pushes it back (`push`) when it
becomes evictable, so the heaps hold at most about one current item per copy. Across a tier's
arenas (an admin's Evict without a namespace) the lowest rank of any arena goes first.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping

from kvstore.core.headstart import HeadStart
from kvstore.core.records import Entry
from kvstore.keys import BlockKey
from kvstore.tier import Tier

# (touch sequence, namespace, key): each heap orders by touch.
_HeapItem = tuple[int, str, BlockKey]


def eviction_rank(entry: Entry, tier: Tier, tier_pages: int, turnovers: float) -> int:
    """Where entry's copy in tier (in an arena of tier_pages pages) stands: the lowest rank
    goes first. A hot entry gets a head start of `turnovers` arenas full of copies its
    size."""
    rank = entry.touch_seq
    if entry.seen >= 2:
        rank += int(turnovers * tier_pages) // sum(run.length for run in entry.copies[tier])
    return rank


class _Queue:
    """One arena's copies: a heap of cold ones, and one of hot ones per copy size, each by
    touch. The head start is added when heads are compared, not when items are pushed, so
    a change of the head start applies to every queued copy at once."""

    __slots__ = ("pages", "cold", "hot")

    def __init__(self, pages: int) -> None:
        self.pages = pages  # the arena's size in pages
        self.cold: list[_HeapItem] = []
        self.hot: dict[int, list[_HeapItem]] = {}  # copy size in pages -> heap

    def heap_for(self, hot: bool, copy_pages: int) -> list[_HeapItem]:
        return self.hot.setdefault(copy_pages, []) if hot else self.cold

    def lowest(self, turnovers: float) -> tuple[tuple[int, int], list[_HeapItem]] | None:
        """The (rank, touch) of its lowest copy, and the heap holding it; None when empty."""
        best = ((self.cold[0][0], self.cold[0][0]), self.cold) if self.cold else None
        for copy_pages, heap in self.hot.items():
            if heap:
                seq = heap[0][0]
                rank = (seq + int(turnovers * self.pages) // copy_pages, seq)
                if best is None or rank < best[0]:
                    best = (rank, heap)
        return best

    def __len__(self) -> int:
        return len(self.cold) + sum(map(len, self.hot.values()))

    def heaps(self) -> list[list[_HeapItem]]:
        return [self.cold, *self.hot.values()]


class EvictionOrder:
    """One queue per arena of each tier over the copies kept there."""

    def __init__(self, arena_pages: Mapping[Tier, Mapping[str, int]],
                 lookup: Callable[[str, BlockKey], Entry | None],
                 head_start: HeadStart | None = None):
        """arena_pages: each tier's arenas and their sizes in pages; head_start: how hot
        blocks are ranked (default: chosen by the workload, kvstore.core.headstart)."""
        self._queues: dict[Tier, dict[str, _Queue]] = {
            t: {name: _Queue(pages) for name, pages in arenas.items()}
            for t, arenas in arena_pages.items()}
        self._lookup = lookup
        self._touches = 0
        self.head_start = head_start or HeadStart()

    def touch(self, entry: Entry, live_entries: int) -> None:
        """Make entry the most recently used in every tier that holds a copy."""
        self._touches += 1
        entry.touch_seq = self._touches
        self.head_start.access(entry.key, live_entries)
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
        arenas = self._queues[tier]
        if arena is None:
            queues = list(arenas.values())
        elif arena in arenas:
            queues = [arenas[arena]]
        else:
            return None
        bit = 1 << tier
        movable_only: list[Entry] = []
        try:
            while True:
                # The lowest copy of the queues searched: of one arena, or of every arena.
                heads = [h for q in queues if (h := q.lowest(self.head_start.turnovers))]
                if not heads:
                    return None
                _, heap = min(heads, key=lambda h: h[0])
                seq, namespace, key = heapq.heappop(heap)
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

    def _push(self, entry: Entry, tier: Tier) -> _Queue:
        entry.in_heaps |= 1 << tier
        queue = self._queues[tier][entry.arena]
        copy_pages = sum(run.length for run in entry.copies[tier])
        heapq.heappush(queue.heap_for(entry.seen >= 2, copy_pages),
                       (entry.touch_seq, entry.namespace, entry.key))
        return queue

    def _compact(self, tier: Tier, arena: str) -> None:
        bit = 1 << tier
        for heap in self._queues[tier][arena].heaps():
            live: dict[tuple[str, BlockKey], _HeapItem] = {}
            for item in heap:
                entry = self._lookup(item[1], item[2])
                if entry is not None and entry.touch_seq == item[0] and entry.in_heaps & bit:
                    live[(item[1], item[2])] = item
            heap[:] = live.values()
            heapq.heapify(heap)
