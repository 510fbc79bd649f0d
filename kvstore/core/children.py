"""Prefix-chain bookkeeping of the index: how many cached children each key has, per tier.

Pure. Leaf-first eviction needs, for every cached entry, its cached children counted by
the highest tier each child is in: a copy in tier t may go only when no child is cached in
t or a faster tier. Children may be cached before their parent (stored out of order, or the
parent was evicted by key and stored again), so counts are kept by key whether or not the
parent is here, and an entry shares its key's count list (`Entry.child_tiers`). The cached
children's keys are kept too (`children_of`): removing a block takes its cached descendants
with it, so that no cached block is ever left without its prefix.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.core.records import NUM_TIERS, Entry
from kvstore.keys import BlockKey
from kvstore.tier import Tier


class ChildCounts:
    """Every key's cached children: counted by the highest tier each is in, and by key."""

    def __init__(self, lookup: Callable[[str, BlockKey], Entry | None]) -> None:
        self._lookup = lookup
        self._counts: dict[tuple[str, BlockKey], list[int]] = {}
        self._kids: dict[tuple[str, BlockKey], set[BlockKey]] = {}

    def descendants(self, entry: Entry) -> list[Entry]:
        """entry's cached descendants, every child before its parent (leaves first)."""
        out: list[Entry] = []
        stack = [(entry, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                if node is not entry:
                    out.append(node)
                continue
            stack.append((node, True))
            for key in self._kids.get((node.namespace, node.key), ()):
                child = self._lookup(node.namespace, key)
                if child is not None:
                    stack.append((child, False))
        return out

    def link(self, entry: Entry) -> None:
        """entry became cached: share its key's counts and count it under its parent."""
        entry.child_tiers = self._counts.setdefault((entry.namespace, entry.key), [0] * NUM_TIERS)
        if (entry.children or entry.parent == entry.key) and self._closes_cycle(entry):
            entry.parent = None  # honest keys are prefix hashes and cannot loop; bad input can
        if entry.parent is not None:
            link = (entry.namespace, entry.parent)
            counts = self._counts.setdefault(link, [0] * NUM_TIERS)
            counts[entry.tier] += 1
            self._kids.setdefault(link, set()).add(entry.key)

    def moved(self, entry: Entry, before: Tier) -> Entry | None:
        """entry's highest tier changed from before; the cached parent whose copies may have
        become leaves, if any."""
        after = entry.tier
        if entry.parent is None or after == before:
            return None
        counts = self._counts[(entry.namespace, entry.parent)]
        counts[before] -= 1
        counts[after] += 1
        return self._lookup(entry.namespace, entry.parent) if after > before else None

    def unlink(self, entry: Entry) -> Entry | None:
        """entry stopped being cached; its cached parent (which may have become a leaf)."""
        if not entry.children:
            del self._counts[(entry.namespace, entry.key)]
        if entry.parent is None:
            return None
        link = (entry.namespace, entry.parent)
        counts = self._counts[link]
        counts[entry.tier] -= 1
        kids = self._kids[link]
        kids.discard(entry.key)
        if not kids:
            del self._kids[link]
        parent = self._lookup(*link)
        if parent is None and not any(counts):
            del self._counts[link]
        return parent

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
            ancestor = self._lookup(entry.namespace, key)
            key = ancestor.parent if ancestor is not None else None
        return False
