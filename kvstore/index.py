"""The index: (namespace, key) -> entry, page ownership, leases, pins, leaf-first LRU eviction.

Pure: no I/O and no clock reads (the clock is passed in). Stores are two-phase, as in vLLM's
offload LRU manager: `prepare_store` reserves pages (evicting if it must) and returns a plan
the caller fills; `complete_store(plan, ...)` makes the entries visible, or frees the pages.
Reads take a lease on entries (`lease`), which `release` or `expire` ends.

Eviction takes the least-recently-used *leaf* of a tier: an entry with a cached child (the
next block of its prefix) goes only after that child, as in SGLang's radix cache. Pinned,
leased and not-yet-committed entries are never evicted.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvstore.entries import CommitResult, Entry, Lease, PlannedBlock, StorePlan, Tier
from kvstore.keys import BlockKey
from kvstore.pages import AllocatorStats, PageAllocator


@dataclass(slots=True)
class _Usage:
    objects: int = 0
    size_bytes: int = 0


# (last access, touch sequence, namespace, key): the heap orders by recency, then touch order.
_HeapItem = tuple[float, int, str, BlockKey]


class Index:
    """All entries of one daemon, their pages in each slot tier, and who holds them."""

    def __init__(
        self,
        allocators: Mapping[Tier, PageAllocator],
        page_size_bytes: Mapping[Tier, int],
        clock: Callable[[], float],
    ) -> None:
        self._allocators = dict(allocators)
        self._page_size = dict(page_size_bytes)
        self._clock = clock
        self._entries: dict[str, dict[BlockKey, Entry]] = {}  # namespace -> key -> entry
        self._num_entries = 0
        self._num_pinned = 0  # only set_pinned changes it: eviction never takes a pinned entry
        self._heaps: dict[Tier, list[_HeapItem]] = {t: [] for t in allocators}
        self._touches = 0
        self._plans: dict[str, StorePlan] = {}
        self._leases: dict[str, Lease] = {}
        self._usage: dict[tuple[str, Tier], _Usage] = {}
        self.evictions: dict[Tier, int] = {t: 0 for t in allocators}
        # (namespace, key) -> how many cached entries name key as their parent
        self._child_counts: dict[tuple[str, BlockKey], int] = {}

    # --- queries ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._num_entries

    def get(self, namespace: str, key: BlockKey) -> Entry | None:
        return self._entries.get(namespace, {}).get(key)

    def lookup(self, namespace: str, keys: Sequence[BlockKey]) -> tuple[int, list[Tier | None]]:
        """Longest cached prefix of keys, and each key's tier (None for a miss)."""
        get = self._entries.get(namespace, {}).get
        tiers = [e.tier if e is not None else None for e in map(get, keys)]
        try:
            return tiers.index(None), tiers
        except ValueError:
            return len(tiers), tiers

    def usage(self, tier: Tier, namespace: str | None = None) -> tuple[int, int]:
        """(objects, bytes) committed in tier, for one namespace or all."""
        if namespace is not None:
            u = self._usage.get((namespace, tier))
            return (u.objects, u.size_bytes) if u else (0, 0)
        objects = size = 0
        for (_, t), u in self._usage.items():
            if t == tier:
                objects += u.objects
                size += u.size_bytes
        return objects, size

    def has_lease(self, lease_id: str) -> bool:
        return lease_id in self._leases

    def allocator_stats(self, tier: Tier) -> AllocatorStats:
        return self._allocators[tier].stats()

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_plans(self) -> int:
        return len(self._plans)

    def pinned_count(self) -> int:
        return self._num_pinned

    def pages_per_object(self, tier: Tier, size_bytes: int) -> int:
        return max(1, -(-size_bytes // self._page_size[tier]))

    # --- two-phase store -------------------------------------------------------------------

    def prepare_store(
        self,
        plan_id: str,
        namespace: str,
        keys: Sequence[BlockKey],
        sizes: Sequence[int],
        parents: Sequence[BlockKey | None],
        tier: Tier,
        deadline: float,
    ) -> StorePlan | None:
        """Reserve pages for the keys not yet stored; None when they cannot fit even after
        evicting every evictable entry of the tier (then nothing is reserved or evicted)."""
        if plan_id in self._plans:
            raise ValueError(f"plan {plan_id!r} exists")
        allocator = self._allocators[tier]
        blocks: list[PlannedBlock] = []
        existing: list[int] = []
        seen: set[BlockKey] = set()
        for i, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            if key in seen or key in self._entries.get(namespace, {}):
                existing.append(i)
                continue
            seen.add(key)
            blocks.append(PlannedBlock(i, key, size, (), parents[i]))
        needed = sum(self.pages_per_object(tier, b.size_bytes) for b in blocks)
        if needed > allocator.num_pages:
            return None
        evicted = self._make_room(tier, needed)
        if evicted is None:
            return None
        for block in blocks:
            pages = allocator.alloc(self.pages_per_object(tier, block.size_bytes))
            assert pages is not None, "room was made for the whole plan"
            block.pages = pages
        plan = StorePlan(plan_id, namespace, tier, blocks, existing, evicted, deadline)
        self._plans[plan_id] = plan
        return plan

    def plan(self, plan_id: str) -> StorePlan | None:
        return self._plans.get(plan_id)

    def complete_store(
        self, plan_id: str, checksums: Sequence[int] | None, success: bool
    ) -> CommitResult:
        """Commit (checksums[i] for plan.blocks[i]) or abandon a plan; its pages either
        become entries or are freed. A key stored meanwhile by another plan wins."""
        plan = self._plans.pop(plan_id, None)
        if plan is None:
            raise KeyError(f"unknown or expired plan {plan_id!r}")
        allocator = self._allocators[plan.tier]
        if not success:
            for block in plan.blocks:
                allocator.free(block.pages)
            return CommitResult(0, 0)
        if checksums is None or len(checksums) != len(plan.blocks):
            raise ValueError(f"a commit needs one checksum per planned block ({len(plan.blocks)})")
        now = self._clock()
        stored = 0
        for block, checksum in zip(plan.blocks, checksums, strict=True):
            if block.key in self._entries.get(plan.namespace, {}):
                allocator.free(block.pages)
                continue
            entry = Entry(
                plan.namespace, block.key, block.size_bytes, plan.tier, block.pages, checksum,
                block.parent, last_access=now,
            )
            self._insert(entry)
            stored += 1
        return CommitResult(
            stored, len(plan.existing) + len(plan.blocks) - stored, len(plan.evicted)
        )

    def expire(self, now: float) -> tuple[list[str], list[str]]:
        """End leases and abandon plans past their deadline; return (lease ids, plan ids)."""
        lease_ids = [lid for lid, lease in self._leases.items() if lease.deadline <= now]
        for lid in lease_ids:
            self.release(lid)
        plan_ids = [pid for pid, plan in self._plans.items() if plan.deadline <= now]
        for pid in plan_ids:
            self.complete_store(pid, None, success=False)
        return lease_ids, plan_ids

    # --- reads and leases ------------------------------------------------------------------

    def lease(
        self, lease_id: str | None, namespace: str, keys: Sequence[BlockKey], deadline: float
    ) -> list[Entry | None]:
        """Touch and hold the entries of keys (None for a miss) until release/expiry; with
        lease_id None only touch them. No lease is recorded when nothing was found."""
        if lease_id is not None and lease_id in self._leases:
            raise ValueError(f"lease {lease_id!r} exists")
        now = self._clock()
        found: list[Entry | None] = []
        held: list[Entry] = []
        for key in keys:
            entry = self.get(namespace, key)
            found.append(entry)
            if entry is not None:
                if lease_id is not None:
                    entry.leases += 1
                    held.append(entry)
                self._touch(entry, now)
        if held and lease_id is not None:
            self._leases[lease_id] = Lease(lease_id, held, deadline)
        return found

    def release(self, lease_id: str) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        for entry in lease.entries:
            entry.leases -= 1
            self._maybe_push(entry)
        return True

    # --- pins ------------------------------------------------------------------------------

    def set_pinned(self, namespace: str, keys: Iterable[BlockKey], pinned: bool) -> tuple[int, int]:
        """(changed, missing)."""
        changed = missing = 0
        for key in keys:
            entry = self.get(namespace, key)
            if entry is None:
                missing += 1
            elif entry.pinned != pinned:
                entry.pinned = pinned
                self._num_pinned += 1 if pinned else -1
                changed += 1
                self._maybe_push(entry)
        return changed, missing

    # --- eviction --------------------------------------------------------------------------

    def evict_keys(self, namespace: str, keys: Iterable[BlockKey]) -> tuple[list[Entry], int]:
        """Remove exactly these (children of a removed entry stay, and count again if it is
        stored again); skip pinned or
        leased ones. Returns (evicted, skipped)."""
        evicted: list[Entry] = []
        skipped = 0
        for key in keys:
            entry = self.get(namespace, key)
            if entry is None:
                continue
            if entry.pinned or entry.leases:
                skipped += 1
                continue
            self._remove(entry)
            evicted.append(entry)
        return evicted, skipped

    def evict_lru(
        self, tier: Tier, min_bytes: int | None, namespace: str | None = None
    ) -> list[Entry]:
        """Evict leaf-first LRU entries of tier (of one namespace, or all) until min_bytes
        are freed, or everything evictable when min_bytes is None."""
        evicted: list[Entry] = []
        freed = 0
        others: list[Entry] = []
        while min_bytes is None or freed < min_bytes:
            entry = self._pop_victim(tier)
            if entry is None:
                break
            if namespace is not None and entry.namespace != namespace:
                others.append(entry)
                continue
            self._remove(entry)
            evicted.append(entry)
            freed += entry.size_bytes
        for entry in others:
            self._maybe_push(entry)
        return evicted

    def unevictable(self, namespace: str | None = None) -> int:
        """Entries not evictable now (pinned, leased, or with a cached child); right after a
        full eviction, exactly the pinned and leased ones and their ancestors."""
        return sum(
            1 for e in self._all_entries()
            if (namespace is None or e.namespace == namespace) and not e.evictable
        )

    def _make_room(self, tier: Tier, needed_pages: int) -> list[Entry] | None:
        """Evict leaf-first LRU entries until needed_pages are free; all or nothing."""
        allocator = self._allocators[tier]
        evicted: list[tuple[Entry, int]] = []
        while allocator.free_pages < needed_pages:
            entry = self._pop_victim(tier)
            if entry is None:
                self._restore(evicted)
                return None
            evicted.append((entry, entry.touch_seq))
            self._remove(entry)
        return [entry for entry, _ in evicted]

    def _restore(self, evicted: list[tuple[Entry, int]]) -> None:
        """Undo evictions whose pages nothing has reused: a refused put evicts nothing."""
        for entry, touch_seq in reversed(evicted):
            self._allocators[entry.tier].take(entry.pages)
            self.evictions[entry.tier] -= 1
            self._link(entry)
            entry.touch_seq = touch_seq  # back to its old place in the LRU order
            entry.in_heap = False
            self._maybe_push(entry)

    def _pop_victim(self, tier: Tier) -> Entry | None:
        heap = self._heaps[tier]
        while heap:
            _, seq, namespace, key = heapq.heappop(heap)
            entry = self.get(namespace, key)
            if entry is None or entry.touch_seq != seq:
                continue  # stale item: the entry was touched again or removed
            entry.in_heap = False
            if entry.evictable:
                return entry
            # Not evictable now; _maybe_push puts it back when it becomes evictable.
        return None

    # --- bookkeeping -----------------------------------------------------------------------

    def _insert(self, entry: Entry) -> None:
        self._link(entry)
        self._touch(entry, entry.last_access)

    def _link(self, entry: Entry) -> None:
        """Make entry visible: the map, usage, and parent/child counts."""
        self._entries.setdefault(entry.namespace, {})[entry.key] = entry
        self._num_entries += 1
        usage = self._usage.setdefault((entry.namespace, entry.tier), _Usage())
        usage.objects += 1
        usage.size_bytes += entry.size_bytes
        # Children may be cached before their parent (stored out of order, or the parent was
        # evicted by key and stored again): count them whether or not the parent is here.
        entry.children = self._child_counts.get((entry.namespace, entry.key), 0)
        if (entry.children or entry.parent == entry.key) and self._closes_cycle(entry):
            entry.parent = None  # honest keys are prefix hashes and cannot loop; bad input can
        if entry.parent is not None:
            link = (entry.namespace, entry.parent)
            self._child_counts[link] = self._child_counts.get(link, 0) + 1
            parent = self.get(*link)
            if parent is not None:
                parent.children += 1

    def _closes_cycle(self, entry: Entry) -> bool:
        """Whether entry's cached ancestors lead back to entry. A cycle would make every
        entry on it a parent of a cached child for ever, so never evictable. Only an entry
        with cached children can close one, so in-order stores never walk."""
        seen = {entry.key}
        key = entry.parent
        while key is not None:
            if key in seen:
                return True
            seen.add(key)
            ancestor = self.get(entry.namespace, key)
            key = ancestor.parent if ancestor is not None else None
        return False

    def _remove(self, entry: Entry) -> None:
        bucket = self._entries[entry.namespace]
        del bucket[entry.key]
        if not bucket:
            del self._entries[entry.namespace]
        self._num_entries -= 1
        usage = self._usage[(entry.namespace, entry.tier)]
        usage.objects -= 1
        usage.size_bytes -= entry.size_bytes
        if not usage.objects:
            del self._usage[(entry.namespace, entry.tier)]
        self._allocators[entry.tier].free(entry.pages)
        self.evictions[entry.tier] += 1
        entry.touch_seq = 0
        if entry.parent is not None:
            link = (entry.namespace, entry.parent)
            remaining = self._child_counts[link] - 1
            if remaining:
                self._child_counts[link] = remaining
            else:
                del self._child_counts[link]
            parent = self.get(*link)
            if parent is not None:
                parent.children -= 1
                self._maybe_push(parent)

    def _touch(self, entry: Entry, now: float) -> None:
        self._touches += 1
        entry.last_access = now
        entry.touch_seq = self._touches
        entry.in_heap = True
        heap = self._heaps[entry.tier]
        heapq.heappush(heap, (now, self._touches, entry.namespace, entry.key))
        if len(heap) > 2 * self._num_entries + 64:
            self._compact(entry.tier)

    def _maybe_push(self, entry: Entry) -> None:
        if entry.evictable and not entry.in_heap and entry.touch_seq:
            entry.in_heap = True
            heapq.heappush(
                self._heaps[entry.tier],
                (entry.last_access, entry.touch_seq, entry.namespace, entry.key),
            )

    def _all_entries(self) -> Iterator[Entry]:
        for bucket in self._entries.values():
            yield from bucket.values()

    def _compact(self, tier: Tier) -> None:
        live = [
            (e.last_access, e.touch_seq, e.namespace, e.key)
            for e in self._all_entries()
            if e.tier == tier and e.in_heap
        ]
        heapq.heapify(live)
        self._heaps[tier] = live
