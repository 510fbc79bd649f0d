"""The index's moves: what the store's tiering does to cached entries between puts and
evictions. It copies them from tier to tier, removes a damaged one, and caches again, at
start, what a previous run left in L3.

    pick (a demotion) or hold (a load) -> alloc -> (copy the bytes) -> add_copy -> drop_copy
        -> done;  free instead of add_copy when the copy failed
    discard: a block whose bytes are damaged or unreadable goes, every copy, and its cached
        descendants with it
    adopt: at start, a block a previous run left in L3 (the manifest) is cached again

A picked or held entry is busy (`Entry.busy`): it is not evicted, picked or moved again until
done(), which queues it again in the eviction order. alloc takes free pages only, in the
arena the entry was stored in (`Entry.arena`); making room is the Index's (`make_room`, which
the placement planner, `kvstore.core.placement`, calls first).

Moves is a part of the Index, kept in a module of its own because the tiering is a concept
of its own: the Index makes one (`index.moves`) and hands it itself. Moves works on the
Index's own state: its tiers' pages, its eviction order, and the bookkeeping at the end of
`kvstore.core.index`, through which every entry inserted or removed and every copy added or
dropped goes, so that the entry map, the key tables, usage, child counts and the eviction
order stay in step. It asks the Index for a namespace's arena at each call, since
`Index.arena_of` may be replaced at any time. Pure: no I/O, no clock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.core.records import Entry
from kvstore.extents import PageRun
from kvstore.keys import BlockKey
from kvstore.tier import Tier

if TYPE_CHECKING:
    from kvstore.core.index import Index

Pages = tuple[PageRun, ...]


class Moves:
    """The tiering verbs over the entries, pages and eviction order of one Index."""

    def __init__(self, index: Index) -> None:
        self._index = index

    # --- moves between tiers (the store's movers and loads) --------------------------------

    def alloc(self, tier: Tier, size_bytes: int, arena: str = "") -> Pages | None:
        """Take free pages for an object of size_bytes in tier's arena, evicting nothing.
        None when not enough pages are free there, or when the tier has no such arena."""
        allocator = self._index._allocator(tier, arena)
        if allocator is None:
            return None
        return allocator.alloc(self._index.pages_per_object(tier, size_bytes))

    def free(self, tier: Tier, pages: Pages) -> None:
        """Give back pages from alloc() that never became a copy (a failed move)."""
        self._index._pages[tier].free(pages)

    def pick(self, tier: Tier, max_bytes: int, max_entries: int | None = None,
             arena: str | None = None) -> list[Entry]:
        """Pick the copies in tier's arena (in any arena of tier when arena is None) that
        move elsewhere next: leaf first in eviction order, about max_bytes of them and at
        most max_entries, each parent following its picked children. Every picked entry is
        busy, so it stays where it is until done()."""
        picked = self._index._order.pick(tier, max_bytes, max_entries, arena)
        for entry in picked:
            entry.busy += 1
        return picked

    def hold(self, entry: Entry) -> None:
        """Mark entry busy (a load in flight): not evicted or moved until done()."""
        entry.busy += 1

    def done(self, entry: Entry) -> None:
        """The move or load of entry ended: it is no longer busy, and is queued for eviction
        again."""
        entry.busy -= 1
        self._index._order.push(entry)

    def add_copy(self, entry: Entry, tier: Tier, pages: Pages) -> None:
        """A copy of entry now lies on pages of tier (allocated by alloc() in entry.arena)."""
        if not self._index._pages[tier].holds(entry.arena, pages):
            raise ValueError(f"pages {pages} of {tier.label} lie outside arena {entry.arena!r}")
        self._index._add_copy(entry, tier, pages)
        self._index._order.push(entry)

    def drop_copy(self, entry: Entry, tier: Tier, evicted: bool = False) -> bool:
        """Free entry's copy in tier, because it moved to another tier, or because it was
        evicted (evicted=True: counted as an eviction of tier). True when that was its last
        copy, so the entry was removed."""
        return self._index._drop(entry, tier, evicted)

    # --- entries that go or come back outside puts and evictions ---------------------------

    def discard(self, entry: Entry) -> list[Entry]:
        """Remove every copy of entry (its bytes are damaged or unreadable), and its cached
        descendants with it (they would be stranded); what was removed."""
        if self._index.get(entry.namespace, entry.key) is entry:
            return self._index.remove_tree(entry, counted=False)
        return []

    def adopt(
        self, namespace: str, key: BlockKey, size_bytes: int, checksum: int,
        parent: BlockKey | None, tier: Tier, pages: Pages,
    ) -> Entry | None:
        """Cache again an object a previous run left on pages of tier (as the L3 manifest
        says). None when the key is cached already, when its pages are not free, or when
        they do not lie inside its namespace's arena (the tenants, or how the tier is split
        between them, changed across the restart)."""
        if self._index.get(namespace, key) is not None:
            return None
        found = self._index._arena_pages(namespace, tier)
        if found is None:
            return None
        arena, allocator = found
        try:
            allocator.take(pages)
        except ValueError:
            return None
        entry = Entry(namespace, key, size_bytes, {tier: pages}, checksum, parent, arena)
        self._index._insert(entry)
        return entry
