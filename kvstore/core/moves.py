"""The index's moves: what the store's tiering does to cached entries between puts and
evictions — copy them from tier to tier, drop a damaged one, re-adopt what L3 kept.

    pick (a demotion) or hold (a load) -> alloc -> (copy the bytes) -> add_copy -> drop_copy
        -> done;  free instead of add_copy when the copy failed
    discard: a block whose bytes are damaged or unreadable goes, every copy, and its cached
        descendants with it
    adopt: at start, a block a previous run left in L3 (the manifest) is cached again

A picked or held entry is busy (`Entry.busy`): it is not evicted, picked or moved again until
done(), which queues it again in the eviction order. alloc takes free pages only, in the
arena the entry was stored in (`Entry.arena`); making room is the Index's (`make_room`, which
the placement planner, `kvstore.core.placement`, calls first).

The Index owns one (`index.moves`) and hands it only what it needs: its tiers' pages and its
eviction order (shared, not copied); three reads (`Index.get`, `Index.arena_of`,
`Index.pages_per_object`); and four changes of its own bookkeeping (an entry inserted or
removed, a copy added or dropped), which keep the entry map, usage, child counts and the
eviction order in step. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvstore.core.order import EvictionOrder
from kvstore.core.pages import TierPages
from kvstore.core.records import Entry
from kvstore.extents import PageRun
from kvstore.keys import BlockKey
from kvstore.tier import Tier

Pages = tuple[PageRun, ...]


class Moves:
    """The tiering verbs over the entries, pages and eviction order of one Index."""

    def __init__(
        self, pages: Mapping[Tier, TierPages], order: EvictionOrder, *,
        get: Callable[[str, BlockKey], Entry | None], arena_of: Callable[[str], str | None],
        pages_per_object: Callable[[Tier, int], int], insert: Callable[[Entry], None],
        add_copy: Callable[[Entry, Tier, Pages], None],
        drop_copy: Callable[[Entry, Tier, bool], bool],
        remove: Callable[[Entry, bool], list[Entry]],
    ) -> None:
        """insert(entry): cache a new entry (its one copy's pages taken already);
        add_copy(entry, tier, pages): record a new copy; drop_copy(entry, tier, counted):
        free one (counted: as an eviction), removing an entry left with no copy (then True);
        remove(entry, counted): free every copy and forget the entry, with its cached
        descendants; what was removed."""
        self._pages = pages
        self._order = order
        self._get = get
        self._arena_of = arena_of
        self._pages_per_object = pages_per_object
        self._insert = insert
        self._add_copy = add_copy
        self._drop_copy = drop_copy
        self._remove = remove

    # --- moves between tiers (the store's movers and loads) --------------------------------

    def alloc(self, tier: Tier, size_bytes: int, arena: str = "") -> Pages | None:
        """Free pages for an object in tier's arena, evicting nothing; None when they are not
        free (or the tier has no such arena)."""
        allocator = self._pages[tier].arenas.get(arena)
        if allocator is None:
            return None
        return allocator.alloc(self._pages_per_object(tier, size_bytes))

    def free(self, tier: Tier, pages: Pages) -> None:
        """Give back pages from alloc() that never became a copy (a failed move)."""
        self._pages[tier].free(pages)

    def pick(self, tier: Tier, max_bytes: int, max_entries: int | None = None,
             arena: str | None = None) -> list[Entry]:
        """Copies in tier's arena (None: any arena) to move elsewhere, leaf first in eviction
        order, about max_bytes of them and at most max_entries (parents follow their picked
        children); each is busy (stays put) until done()."""
        picked = self._order.pick(tier, max_bytes, max_entries, arena)
        for entry in picked:
            entry.busy += 1
        return picked

    def hold(self, entry: Entry) -> None:
        """Mark entry busy (a load in flight): not evicted or moved until done()."""
        entry.busy += 1

    def done(self, entry: Entry) -> None:
        entry.busy -= 1
        self._order.push(entry)

    def add_copy(self, entry: Entry, tier: Tier, pages: Pages) -> None:
        """A copy of entry now lies on pages of tier (allocated by alloc() in entry.arena)."""
        if not self._pages[tier].holds(entry.arena, pages):
            raise ValueError(f"pages {pages} of {tier.label} lie outside arena {entry.arena!r}")
        self._add_copy(entry, tier, pages)
        self._order.push(entry)

    def drop_copy(self, entry: Entry, tier: Tier, evicted: bool = False) -> bool:
        """Free entry's copy in tier (moved, or evicted); True when that was its last copy."""
        return self._drop_copy(entry, tier, evicted)

    # --- entries that go or come back outside puts and evictions ---------------------------

    def discard(self, entry: Entry) -> list[Entry]:
        """Remove every copy of entry (its bytes are damaged or unreadable), and its cached
        descendants with it (they would be stranded); what was removed."""
        if self._get(entry.namespace, entry.key) is entry:
            return self._remove(entry, False)
        return []

    def adopt(
        self, namespace: str, key: BlockKey, size_bytes: int, checksum: int,
        parent: BlockKey | None, tier: Tier, pages: Pages,
    ) -> Entry | None:
        """Re-adopt an object a previous run left in tier (from the L3 manifest); None when
        the key is cached already, its pages are not free, or they do not lie inside its
        namespace's arena (tenants or their split changed across the restart)."""
        if self._get(namespace, key) is not None:
            return None
        arena = self._arena_of(namespace)
        allocator = self._pages[tier].arenas.get(arena) if arena is not None else None
        if arena is None or allocator is None:
            return None
        try:
            allocator.take(pages)
        except ValueError:
            return None
        entry = Entry(namespace, key, size_bytes, {tier: pages}, checksum, parent, arena)
        self._insert(entry)
        return entry
