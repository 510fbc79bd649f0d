"""The index: (namespace, key) -> entry, page ownership, leaf-first eviction.

Pure: no I/O, no clock reads (deadlines are passed in). Two-phase stores, as in vLLM's offload
LRU manager: `prepare_store` reserves pages (evicting if it must), `complete_store` commits or
frees them. `touch` marks entries used without holding them; leases and pins, which hold them,
live in `index.leases` (`kvstore.core.leases`); `expire` ends the leases and plans past their
deadline. Lookups of big namespaces go through a key table (`kvstore.core.keytable`).

Eviction takes the lowest-ranked *leaf* of a tier: LRU, but a hot block (used again, or put
again soon after its eviction: `kvstore.core.ghosts`) outlives a block used once by a head start
the workload chooses (`kvstore.core.order`, `kvstore.core.headstart`). An entry with a cached
child (the next block of its prefix) goes only after that child, as in SGLang's radix cache; a
copy in tier t is a leaf there when no child is cached in t or a faster tier, so a parent can be
demoted to L3 after its child. Pinned, leased, moving and uncommitted entries never go, nor the
cached keys of a put while it makes room. An entry may have copies in several tiers
(`Entry.copies`); the store's tiering changes them with `index.moves` (`kvstore.core.moves`):
it picks the copies to move to another tier, or holds an entry for a load, until they are
done; it discards damaged blocks, and at start caches again what a previous run left in L3
(`adopt`).

The leases and the moves are parts of the Index kept in modules of their own: each is handed
the Index itself (`Leases(index)`, `Moves(index)`) and works on its state directly. Every
entry inserted or removed and every copy added or dropped, whether here or by them, goes
through the bookkeeping at the end of this module, which keeps the entry map, the key tables,
usage, child counts and the eviction order in step.

Each tier may be split into arenas, one per tenant (`kvstore.core.pages.TierPages`):
`arena_of(namespace)` names the arena a namespace's blocks are stored in (None: no tenant owns
it, so it cannot be stored), and the entry keeps that arena (`Entry.arena`) in every tier it has
a copy in. Room is made within the arena only: a tenant at its arena's capacity evicts its own
blocks, never another's. Without arenas every tier is one arena "".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import chain
from typing import Protocol

from kvstore.core.children import ChildCounts
from kvstore.core.ghosts import GhostFilter
from kvstore.core.headstart import HeadStart
from kvstore.core.holdings import Holdings
from kvstore.core.keytable import KeyTiers
from kvstore.core.leases import Leases
from kvstore.core.moves import Moves, Pages
from kvstore.core.order import EvictionOrder
from kvstore.core.pages import AllocatorStats, PageAllocator, TierPages
from kvstore.core.records import CommitResult, Entry, PlannedBlock, Skipped, StorePlan
from kvstore.core.usage import UsageBook
from kvstore.extents import Arena
from kvstore.keys import BlockKey
from kvstore.tier import Tier


class Published(Protocol):
    """Who mirrors the index's entries outside it (the daemon's read tables,
    kvstore.daemon.readtable): told of every entry linked, whose copies changed, or removed,
    from the bookkeeping below, in the same call (under the store's lock), so that a block's
    mirror is withdrawn before its pages can be reused."""

    def added(self, entry: Entry) -> None: ...

    def changed(self, entry: Entry, before: Tier) -> None: ...

    def removed(self, entry: Entry) -> None: ...


class Mirrors:
    """Several `Published` mirrors (the read tables, the block events) told of each change
    in turn, in the order given."""

    def __init__(self, mirrors: Sequence[Published]) -> None:
        self._mirrors = tuple(mirrors)

    def added(self, entry: Entry) -> None:
        for mirror in self._mirrors:
            mirror.added(entry)

    def changed(self, entry: Entry, before: Tier) -> None:
        for mirror in self._mirrors:
            mirror.changed(entry, before)

    def removed(self, entry: Entry) -> None:
        for mirror in self._mirrors:
            mirror.removed(entry)


def mirrored(*mirrors: Published | None) -> Published | None:
    """What the index tells of its changes: the one mirror given (not None), `Mirrors` of
    several, or None for none."""
    present = [m for m in mirrors if m is not None]
    return None if not present else present[0] if len(present) == 1 else Mirrors(present)


def one_arena(namespace: str) -> str | None:
    """The arena of every namespace when tiers are not split: the one arena ""."""
    return ""


class Index:
    """All entries of one daemon, their pages in each slot tier, and who holds them."""

    def __init__(self, allocators: Mapping[Tier, PageAllocator],
                 page_size_bytes: Mapping[Tier, int],
                 arenas: Mapping[Tier, Sequence[Arena]] | None = None,
                 arena_of: Callable[[str], str | None] | None = None,
                 head_start: HeadStart | None = None) -> None:
        """allocators: the pages of each slot tier; page_size_bytes: each tier's page size.

        arenas: how each tier's pages are split between arenas, one per tenant; a split
        must cover every tier or none. None: each tier is one arena "", its whole allocator.

        arena_of: the arena a namespace's blocks are stored in (by default "" for every
        namespace). It may be replaced at any time (`index.arena_of = ...`); an entry keeps
        the arena it was stored in.

        head_start: how hot blocks are ranked in the eviction order (see EvictionOrder); by
        default the workload chooses it."""
        if arenas and set(arenas) != set(allocators):
            raise ValueError(f"arenas split tiers {sorted(t.label for t in arenas)}; split "
                             f"every tier ({sorted(t.label for t in allocators)}) or none")
        self._pages = {t: TierPages.split(a.num_pages, arenas[t]) if arenas else
                       TierPages.whole(a) for t, a in allocators.items()}
        self.arena_of: Callable[[str], str | None] = arena_of or one_arena
        self._page_size = dict(page_size_bytes)
        self._entries: dict[str, dict[BlockKey, Entry]] = {}  # namespace -> key -> entry
        self._tiers = KeyTiers(self._entries)  # big namespaces' tiers again, for lookups
        self._num_entries = 0
        self._order = EvictionOrder(
            {t: {name: a.num_pages for name, a in pages.arenas.items()}
             for t, pages in self._pages.items()}, self.get, head_start)
        self._plans: dict[str, StorePlan] = {}
        self.holdings = Holdings()  # each client's leases, plans and pins
        self._usage = UsageBook()
        self.evictions: dict[Tier, int] = {t: 0 for t in allocators}
        self._children = ChildCounts(self.get)
        self._ghosts = GhostFilter()  # keys removed lately: put again, they come back hot
        self.leases = Leases(self)
        self.moves = Moves(self)
        # Told of every change of the entries' copies (the daemon's read tables); None: none.
        self.published: Published | None = None

    # --- queries ---------------------------------------------------------------------------

    def __len__(self) -> int:
        """How many entries are cached."""
        return self._num_entries

    @property
    def head_start(self) -> float:
        """The hot blocks' head start now, in turnovers of a tier (kvstore.core.headstart)."""
        return self._order.head_start.turnovers

    def get(self, namespace: str, key: BlockKey) -> Entry | None:
        """The entry of key in namespace; None when it is not cached."""
        return self._entries.get(namespace, {}).get(key)

    def lookup(self, namespace: str, keys: Sequence[BlockKey]) -> tuple[int, list[Tier | None]]:
        """Longest cached prefix of keys, and each key's tier (None for a miss)."""
        return self._tiers.lookup(namespace, keys)

    def usage(self, tier: Tier, namespace: str | None = None) -> tuple[int, int]:
        """(objects, bytes) committed in tier, for one namespace or all."""
        return self._usage.get(tier, namespace)

    def allocator_stats(self, tier: Tier) -> AllocatorStats:
        """The whole tier's pages (every arena's together)."""
        return self._pages[tier].stats()

    def arena_names(self, tier: Tier) -> list[str]:
        """The names of tier's arenas (the one arena "" when tiers are not split)."""
        return list(self._pages[tier].arenas)

    def arena_usage(self, tier: Tier, arena: str) -> tuple[int, int, int, int]:
        """(objects, used_bytes, free_pages, num_pages) of arena in tier. An arena the tier
        does not have holds nothing and has no pages."""
        objects, used_bytes = self._usage.arena(tier, arena)
        allocator = self._allocator(tier, arena)
        if allocator is None:
            return objects, used_bytes, 0, 0
        return objects, used_bytes, allocator.free_pages, allocator.num_pages

    @property
    def num_plans(self) -> int:
        """How many put plans hold reserved pages, not yet committed or abandoned."""
        return len(self._plans)

    def pages_per_object(self, tier: Tier, size_bytes: int) -> int:
        """How many pages of tier an object of size_bytes takes (at least one)."""
        return max(1, -(-size_bytes // self._page_size[tier]))

    def free_pages(self, tier: Tier, arena: str | None = None) -> int:
        """Free pages of tier's arena (0 for an arena the tier does not have), or of the
        whole tier when arena is None."""
        if arena is None:
            return self._pages[tier].free_pages
        allocator = self._allocator(tier, arena)
        return allocator.free_pages if allocator is not None else 0

    def entries(self, tier: Tier | None = None) -> Iterator[Entry]:
        """Every entry with a copy in tier, or every entry when tier is None."""
        return (e for e in self._all_entries() if tier is None or tier in e.copies)

    def _allocator(self, tier: Tier, arena: str) -> PageAllocator | None:
        """The pages of arena in tier; None when the tier has no such arena."""
        return self._pages[tier].arenas.get(arena)

    def _arena_pages(self, namespace: str, tier: Tier) -> tuple[str, PageAllocator] | None:
        """The arena namespace's blocks are stored in now, and its pages in tier; None when
        no tenant owns the namespace, or when tier has no such arena."""
        arena = self.arena_of(namespace)
        allocator = self._allocator(tier, arena) if arena is not None else None
        if arena is None or allocator is None:
            return None
        return arena, allocator

    # --- two-phase store -------------------------------------------------------------------

    def prepare_store(
        self, plan_id: str, namespace: str, keys: Sequence[BlockKey], sizes: Sequence[int],
        parents: Sequence[BlockKey | None], tier: Tier, deadline: float, evict: bool = True,
        client: str = "",
    ) -> StorePlan | None:
        """Reserve pages for the keys not stored yet in the namespace's arena of tier, and
        charge them to client's reservations. To make room it evicts from that arena, or
        takes only its free pages when evict is False. The plan holds its pages until
        complete_store commits or abandons it by plan_id, or expire abandons it past
        deadline.

        Returns None, and then reserves and evicts nothing, when the namespace has no arena
        in tier, or when the new keys do not fit even after evicting every evictable entry
        of the arena (with evict=False: when they do not fit in its free pages)."""
        if plan_id in self._plans:
            raise ValueError(f"plan {plan_id!r} exists")
        found = self._arena_pages(namespace, tier)
        if found is None:
            return None
        arena, allocator = found
        blocks, existing, cached = self._split_keys(namespace, keys, sizes, parents)
        needed = sum(self.pages_per_object(tier, b.size_bytes) for b in blocks)
        if needed > allocator.num_pages:
            return None
        outside = {b.parent for b in blocks if b.parent is not None} - set(keys)
        anchors = [e for k in outside if (e := self.get(namespace, k)) is not None]
        for entry in [*cached, *anchors]:  # held, so that making room cannot evict them
            entry.busy += 1
        evicted = self.make_room(tier, needed, arena) if evict else (
            [] if allocator.free_pages >= needed else None)
        for entry in cached:  # a put of a cached key is a use: it counts, and refreshes it
            entry.busy -= 1
            if evicted is None:
                self._order.push(entry)
            else:
                self._use(entry)
        if evicted is None:
            self._release(anchors)
            return None
        for block in blocks:
            pages = allocator.alloc(self.pages_per_object(tier, block.size_bytes))
            assert pages is not None, "room was made for the whole plan"
            block.pages = pages
        plan = StorePlan(plan_id, namespace, tier, blocks, existing, evicted, deadline, client,
                         arena, anchors)
        self._plans[plan_id] = plan
        self.holdings.change(client, reservations=1, reserved_bytes=plan.size_bytes)
        return plan

    def _split_keys(
        self, namespace: str, keys: Sequence[BlockKey], sizes: Sequence[int],
        parents: Sequence[BlockKey | None],
    ) -> tuple[list[PlannedBlock], list[int], list[Entry]]:
        """Split a put's keys into the blocks to store (each new key once), the positions
        of the keys cached already or repeated in the put, and the entries of those cached
        already."""
        blocks: list[PlannedBlock] = []
        existing: list[int] = []
        seen: set[BlockKey] = set()
        cached: list[Entry] = []
        for i, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            stored = self.get(namespace, key)
            if stored is not None:
                cached.append(stored)
            if key in seen or stored is not None:
                existing.append(i)
                continue
            seen.add(key)
            blocks.append(PlannedBlock(i, key, size, (), parents[i]))
        return blocks, existing, cached

    def plan(self, plan_id: str) -> StorePlan | None:
        """The plan of this id while it holds its pages; None once it was committed or
        abandoned, or when there never was one."""
        return self._plans.get(plan_id)

    def complete_store(
        self, plan_id: str, checksums: Sequence[int] | None, success: bool
    ) -> CommitResult:
        """Commit a plan when success is True, or abandon it. Committed, each planned block
        becomes an entry with checksums[i] as the checksum of plan.blocks[i]; abandoned, its
        pages are freed. A key that another plan stored meanwhile keeps that plan's entry,
        and this plan's pages for it are freed."""
        plan = self._plans.pop(plan_id, None)
        if plan is None:
            raise KeyError(f"unknown or expired plan {plan_id!r}")
        self._release(plan.anchors)
        self.holdings.change(plan.client, reservations=-1, reserved_bytes=-plan.size_bytes)
        allocator = self._pages[plan.tier].arenas[plan.arena]
        if not success:
            for block in plan.blocks:
                allocator.free(block.pages)
            return CommitResult(0, 0)
        if checksums is None or len(checksums) != len(plan.blocks):
            raise ValueError(f"a commit needs one checksum per planned block ({len(plan.blocks)})")
        stored = self._store_blocks(plan, plan.blocks, checksums)
        return CommitResult(
            stored, len(plan.existing) + len(plan.blocks) - stored, len(plan.evicted)
        )

    def commit_part(
        self, plan_id: str, blocks: list[PlannedBlock], checksums: Sequence[int] | None,
        rest: list[PlannedBlock],
    ) -> CommitResult:
        """Commit part of a plan that holds pages ahead of their blocks (a grant: its
        blocks are placeholders): blocks, on pages the plan held, become entries with
        checksums (checksums None: refused, their pages are freed), and the plan holds on to
        rest (placeholders of the pages not used yet), same id and deadline; with rest empty
        it ends. Its client's reserved bytes follow what it holds. A key stored meanwhile
        keeps its entry, and this commit's pages for it are freed. The entries evicted to make
        the plan's room are counted in the first commit's result."""
        plan = self._plans.get(plan_id)
        if plan is None:
            raise KeyError(f"unknown or expired plan {plan_id!r}")
        if checksums is not None and len(checksums) != len(blocks):
            raise ValueError(f"a commit needs one checksum per block ({len(blocks)})")
        held = plan.size_bytes
        evicted, plan.evicted = len(plan.evicted), []
        plan.blocks = rest
        if rest:
            self.holdings.change(plan.client, reserved_bytes=plan.size_bytes - held)
        else:
            del self._plans[plan_id]
            self._release(plan.anchors)
            self.holdings.change(plan.client, reservations=-1, reserved_bytes=-held)
        if checksums is None:
            allocator = self._pages[plan.tier].arenas[plan.arena]
            for block in blocks:
                allocator.free(block.pages)
            return CommitResult(0, 0, evicted)
        stored = self._store_blocks(plan, blocks, checksums)
        return CommitResult(stored, len(blocks) - stored, evicted)

    def _store_blocks(self, plan: StorePlan, blocks: list[PlannedBlock],
                      checksums: Sequence[int]) -> int:
        """Make blocks (on pages of plan's arena) entries; how many were new (a key that
        another plan stored meanwhile keeps that entry, and its pages here are freed)."""
        allocator = self._pages[plan.tier].arenas[plan.arena]
        cached = self._entries.get(plan.namespace, {})
        stored = 0
        for block, checksum in zip(blocks, checksums, strict=True):
            if block.key in cached:
                allocator.free(block.pages)  # stored meanwhile by another plan
                continue
            self._insert(Entry(
                plan.namespace, block.key, block.size_bytes, {plan.tier: block.pages}, checksum,
                block.parent, plan.arena,
            ))
            if not stored:
                cached = self._entries[plan.namespace]  # made by the first insert if new
            stored += 1
        return stored

    def _release(self, held: list[Entry]) -> None:
        """A put no longer holds these entries: each is queued for eviction again."""
        for entry in held:
            entry.busy -= 1
            self._order.push(entry)

    def expire(self, now: float) -> tuple[list[str], list[str]]:
        """End leases and abandon plans past their deadline; return (lease ids, plan ids)."""
        lease_ids = self.leases.expired(now)
        for lid in lease_ids:
            self.leases.release(lid)
        plan_ids = [pid for pid, plan in self._plans.items() if plan.deadline <= now]
        for pid in plan_ids:
            self.complete_store(pid, None, success=False)
        return lease_ids, plan_ids

    # --- reads -----------------------------------------------------------------------------

    def touch(self, namespace: str, keys: Sequence[BlockKey],
              need: Tier | None = None) -> list[Entry | None]:
        """Mark the entries of keys used (seen once more, most recent in the eviction order)
        without holding them; None for a miss, or for an entry with no copy in tier `need`."""
        found: list[Entry | None] = []
        for key in keys:
            entry = self.get(namespace, key)
            if entry is not None and need is not None and need not in entry.copies:
                entry = None
            found.append(entry)
            if entry is not None:
                self._use(entry)
        return found

    def _use(self, entry: Entry) -> None:
        """Count a use of entry, and make it the most recent in the eviction order."""
        entry.seen += 1
        self._order.touch(entry, self._num_entries)

    # --- eviction --------------------------------------------------------------------------

    def evict_keys(self, namespace: str,
                   keys: Iterable[BlockKey]) -> tuple[list[Entry], Skipped]:
        """Remove the entries of these keys, every copy of each, together with their cached
        descendants (leaves first), so that no cached block is left without its prefix. A
        key whose tree holds a pinned, leased or moving block is skipped, and counted under
        that block's reason. Returns the entries removed and the skips."""
        evicted: list[Entry] = []
        skipped = Skipped()
        for key in keys:
            entry = self.get(namespace, key)
            if entry is None:
                continue
            tree = [*self._children.descendants(entry), entry]
            held = next((e for e in tree if not e.movable), None)
            if held is not None:
                skipped.add(held.blocker())
                continue
            for node in tree:
                self._remove(node, counted=True)
            evicted += tree
        return evicted, skipped

    def remove_tree(self, entry: Entry, counted: bool) -> list[Entry]:
        """Remove entry and its cached descendants, leaves first; what was removed."""
        tree = [*self._children.descendants(entry), entry]
        for node in tree:
            self._remove(node, counted)
        return tree

    def drop_orphans(self) -> list[Entry]:
        """Remove every cached block whose parent is not cached, with its descendants (at
        start, L3 blocks whose prefix lived only in L2 before a crash); what was removed."""
        orphans = [e for e in self._all_entries()
                   if e.parent is not None and self.get(e.namespace, e.parent) is None]
        return [gone for e in orphans if self.get(e.namespace, e.key) is e
                for gone in self.remove_tree(e, counted=False)]

    def evict_in_order(self, tier: Tier, min_bytes: int | None,
                       namespace: str | None = None) -> list[Entry]:
        """Evict copies in tier, leaf first in eviction order across every arena of tier,
        until min_bytes are freed, or every evictable copy when min_bytes is None. Only the
        copies of namespace's entries go, or those of every namespace when it is None.
        Returns the entries whose copy in tier went."""
        evicted: list[Entry] = []
        freed = 0
        others: list[Entry] = []
        while min_bytes is None or freed < min_bytes:
            entry = self._order.pop_victim(tier, drop=True)
            if entry is None:
                break
            if namespace is not None and entry.namespace != namespace:
                others.append(entry)
                continue
            self._drop(entry, tier, counted=True)
            evicted.append(entry)
            freed += entry.size_bytes
        for entry in others:
            self._order.push(entry)
        return evicted

    def unevictable(self, namespace: str | None = None, tier: Tier | None = None) -> Skipped:
        """Count, by reason, the entries of namespace (of every namespace when it is None)
        that cannot be dropped now: those with a copy in tier whose copy cannot go, or, when
        tier is None, those that are not evictable. Right after a full eviction of every
        tier, these are exactly the pinned and leased entries and their ancestors."""
        skipped = Skipped()
        for e in self._all_entries():
            if namespace is not None and e.namespace != namespace:
                continue
            stuck = not e.evictable if tier is None else (
                tier in e.copies and not e.droppable_from(tier))
            if stuck:
                skipped.add(e.blocker(tier))
        return skipped

    def make_room(self, tier: Tier, needed_pages: int, arena: str = "") -> list[Entry] | None:
        """Evict copies in tier's arena, leaf first in eviction order, until needed_pages are
        free there, all or nothing. Returns the entries whose copy in tier went (some keep a
        copy in another tier); None, having evicted nothing, when that many pages cannot be
        freed, or when the tier has no such arena."""
        allocator = self._allocator(tier, arena)
        if allocator is None or needed_pages > allocator.num_pages:
            return None
        evicted: list[tuple[Entry, Pages, int, bool]] = []
        while allocator.free_pages < needed_pages:
            entry = self._order.pop_victim(tier, arena, drop=True)
            if entry is None:
                self._restore(tier, evicted)
                return None
            pages, seq = entry.copies[tier], entry.touch_seq
            evicted.append((entry, pages, seq, self._drop(entry, tier, counted=True)))
        return [entry for entry, *_ in evicted]

    def _restore(self, tier: Tier, evicted: list[tuple[Entry, Pages, int, bool]]) -> None:
        """Undo evictions whose pages nothing has reused: a refused put evicts nothing."""
        for entry, pages, touch_seq, removed in reversed(evicted):
            self._pages[tier].arenas[entry.arena].take(pages)
            self.evictions[tier] -= 1
            if removed:
                entry.copies, entry.tier = {tier: pages}, tier
                self._link(entry)
            else:
                self._add_copy(entry, tier, pages)
            entry.touch_seq = touch_seq  # back to its old place in the eviction order
            entry.in_heaps = 0
            self._order.push(entry)

    # --- bookkeeping -----------------------------------------------------------------------
    # index.moves calls these too: every change of the entries and their copies goes through
    # them, so that the map, the key tables, usage, child counts and eviction order agree.

    def _insert(self, entry: Entry) -> None:
        """Cache a new entry, whose one copy's pages are taken already, as the most recently
        used; a key evicted lately comes back hot."""
        if (entry.namespace, entry.key) in self._ghosts:
            entry.seen = 2  # its second use came after its eviction
        self._link(entry)
        self._order.touch(entry, self._num_entries)

    def _link(self, entry: Entry) -> None:
        """Make entry visible: the map, usage, and parent/child counts."""
        self._entries.setdefault(entry.namespace, {})[entry.key] = entry
        self._tiers.added(entry)
        if self.published is not None:
            self.published.added(entry)
        self._num_entries += 1
        for tier in entry.copies:
            self._usage.count(entry, tier, +1)
        self._children.link(entry)

    def _add_copy(self, entry: Entry, tier: Tier, pages: Pages) -> None:
        """Record a new copy of entry on pages of tier (taken already)."""
        before = entry.tier
        entry.copies[tier] = pages
        entry.tier = min(entry.copies)
        self._usage.count(entry, tier, +1)
        self._moved(entry, before)

    def _drop(self, entry: Entry, tier: Tier, counted: bool) -> bool:
        """Free entry's copy in tier, counted as an eviction of tier when counted is True.
        Its L1 copy goes with its L2 one, since L1 holds only blocks that L2 holds. The entry
        is removed when no copy is left, and then the result is True."""
        if counted:
            self.evictions[tier] += 1
        if len(entry.copies) == 1:
            self._remove(entry, counted=False)
            return True
        if tier == Tier.DRAM and Tier.HBM in entry.copies:
            self._drop(entry, Tier.HBM, counted=False)
            if len(entry.copies) == 1:  # only its L2 copy was left
                self._remove(entry, counted=False)
                return True
        before = entry.tier
        self._pages[tier].arenas[entry.arena].free(entry.copies.pop(tier))
        entry.tier = min(entry.copies)
        self._usage.count(entry, tier, -1)
        self._order.forget(entry, tier)
        self._moved(entry, before)
        return False

    def _moved(self, entry: Entry, before: Tier) -> None:
        """A copy of entry was added or dropped, so its fastest tier may no longer be before:
        the key tables and child counts follow, and when entry left a tier its cached parent
        is queued again (a copy of the parent may have become a leaf)."""
        self._tiers.changed(entry, before)
        if self.published is not None:
            self.published.changed(entry, before)
        parent = self._children.moved(entry, before)
        if parent is not None:
            self._order.push(parent)

    def _remove(self, entry: Entry, counted: bool) -> None:
        """Forget entry and free every copy (each counted as an eviction when counted is
        True). Its cached children stay cached: whoever must not strand them calls
        remove_tree, which removes them first."""
        bucket = self._entries[entry.namespace]
        del bucket[entry.key]
        self._tiers.removed(entry)
        if self.published is not None:  # before the pages are freed below
            self.published.removed(entry)
        if not bucket:
            del self._entries[entry.namespace]
        self._num_entries -= 1
        if entry.pinned:  # removed anyway (damaged bytes): its pin goes with it
            self.holdings.unpin(entry.namespace, entry.key)
        for tier, pages in entry.copies.items():
            self._usage.count(entry, tier, -1)
            self._pages[tier].arenas[entry.arena].free(pages)
            if counted:
                self.evictions[tier] += 1
        entry.touch_seq = 0
        entry.in_heaps = 0
        self._ghosts.add(entry.namespace, entry.key, self._num_entries)
        parent = self._children.unlink(entry)
        if parent is not None:
            self._order.push(parent)

    def _all_entries(self) -> Iterator[Entry]:
        return chain.from_iterable(bucket.values() for bucket in self._entries.values())
