"""No cached block is ever stranded: whatever removes a block (eviction under pressure, Evict by
keys, bytes or all in any tier, a damaged copy, a restart that lost L2) leaves every cached
block reachable by a lookup of its own prefix, or removes it too (docs/architecture.md,
"Eviction"). A state machine over the pure index with an L2 and an L3: chained puts (always
from a cached prefix, as engines put), reads, demotions and promotions by the movers' verbs,
pins, every eviction form, discards and restarts; the invariant is checked after every step.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvstore.core.index import Index
from kvstore.core.pages import PageAllocator
from kvstore.core.records import Entry
from kvstore.tier import Tier
from tests.unit.test_index import FAR, NS, PAGE_BYTES, key, make_index, name, names, put

D, N = Tier.DRAM, Tier.NVME
PAGES = {D: 6, N: 14}
# A tree of names: a parent is the name without its last letter ("ab" is "a"'s child).
UNIVERSE = ["a", "ab", "abc", "abcd", "abd", "ac", "acd", "b", "bc", "bcd", "bd", "c", "cd"]


def parent_of(n: str) -> str | None:
    return n[:-1] or None


def reachable(index: Index, n: str) -> bool:
    """Whether a lookup of n's prefix (root first) finds every block of it."""
    path = [n[: i + 1] for i in range(len(n))]
    found, _ = index.lookup(NS, [key(p) for p in path])
    return found == len(path)


class StrandingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = self.fresh()
        self.pinned: set[str] = set()

    @staticmethod
    def fresh() -> Index:
        return Index({t: PageAllocator(n) for t, n in PAGES.items()},
                     {t: PAGE_BYTES for t in PAGES})

    def cached(self) -> list[Entry]:
        return [e for n in UNIVERSE if (e := self.index.get(NS, key(n))) is not None]

    def entry(self, data: st.DataObject) -> Entry | None:
        found = self.cached()
        return data.draw(st.sampled_from(found)) if found else None

    # --- rules ---------------------------------------------------------------------------

    @initialize(leaves=st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=4))
    def populate(self, leaves: list[str]) -> None:
        for leaf in leaves:
            self.put(leaf)

    @rule(leaf=st.sampled_from(UNIVERSE))
    def put(self, leaf: str) -> None:
        """The chain from the root to leaf: what a cached prefix lacks is stored in L2
        (making room by eviction, as the writer does)."""
        path = [leaf[: i + 1] for i in range(len(leaf))]
        hit = 0
        while hit < len(path) and self.index.get(NS, key(path[hit])) is not None:
            hit += 1
        rest = path[hit:]
        if not rest:
            return
        keys = [key(n) for n in rest]
        parents = [key(path[hit - 1]) if hit else None, *keys[:-1]]
        plan = self.index.prepare_store(f"p-{leaf}-{len(self.cached())}", NS, keys,
                                        [PAGE_BYTES] * len(keys), parents, D, FAR)
        if plan is not None:
            self.index.complete_store(plan.plan_id, [7] * len(plan.blocks), success=True)

    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        e = self.entry(data)
        if e is not None:
            self.index.touch(NS, [e.key])

    @rule(max_entries=st.integers(1, 4))
    def demote(self, max_entries: int) -> None:
        """The mover: pick L2 copies (leaf first), copy each to L3, drop the L2 copy."""
        for e in self.index.moves.pick(D, max_entries * PAGE_BYTES, max_entries):
            pages = self.index.moves.alloc(N, e.size_bytes, e.arena)
            if pages is not None and N not in e.copies:
                self.index.moves.add_copy(e, N, pages)
                self.index.moves.drop_copy(e, D)
            self.index.moves.done(e)

    @rule(data=st.data())
    def promote(self, data: st.DataObject) -> None:
        """A load of an L3 block into L2 (its L3 copy stays: inclusive)."""
        e = self.entry(data)
        if e is None or D in e.copies or not e.movable:
            return
        self.index.moves.hold(e)
        pages = self.index.moves.alloc(D, e.size_bytes, e.arena)
        if pages is not None:
            self.index.moves.add_copy(e, D, pages)
        self.index.moves.done(e)

    @rule(data=st.data(), pin=st.booleans())
    def pin(self, data: st.DataObject, pin: bool) -> None:
        e = self.entry(data)
        if e is not None:
            self.index.leases.set_pinned(NS, [e.key], pin)
            (self.pinned.add if pin else self.pinned.discard)(name(e.key))

    @rule(data=st.data())
    def evict_keys(self, data: st.DataObject) -> None:
        e = self.entry(data)
        if e is not None:
            evicted, _ = self.index.evict_keys(NS, [e.key])
            assert not {name(g.key) for g in evicted} & self.pinned

    @rule(tier=st.sampled_from([D, N]), min_bytes=st.none() | st.integers(1, 400))
    def evict_in_order(self, tier: Tier, min_bytes: int | None) -> None:
        self.index.evict_in_order(tier, min_bytes, NS)

    @rule(data=st.data())
    def discard(self, data: st.DataObject) -> None:
        """A damaged copy: the block goes, every copy, with its descendants (pinned or not:
        a block whose prefix cannot be served is no use to its pin)."""
        e = self.entry(data)
        if e is not None and e.movable:
            self.pinned -= set(names(self.index.moves.discard(e)))

    @rule()
    def restart(self) -> None:
        """kill -9: L2 and its pins are gone; L3 is re-adopted from the manifest (every L3
        copy), then blocks whose prefix is gone are dropped."""
        kept = [(e.key, e.parent, e.copies[N]) for e in self.cached() if N in e.copies]
        self.index = self.fresh()
        self.pinned.clear()
        for k, parent, pages in kept:
            assert self.index.moves.adopt(NS, k, PAGE_BYTES, 7, parent, N, pages) is not None
        self.index.drop_orphans()

    # --- the invariant -------------------------------------------------------------------

    @invariant()
    def every_cached_block_is_reachable_by_its_prefix(self) -> None:
        for e in self.cached():
            assert reachable(self.index, name(e.key)), (
                f"{name(e.key)} is stranded: cached {sorted(names(self.cached()))}")

    @invariant()
    def pins_keep_their_whole_prefix(self) -> None:
        for n in self.pinned:
            assert reachable(self.index, n), f"pinned {n} lost its prefix"


StrandingMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                              deadline=None)
test_no_block_is_ever_stranded = StrandingMachine.TestCase


# --- narrated scenarios ------------------------------------------------------------------


def test_a_dram_parent_whose_children_went_to_l3_is_not_dropped_under_pressure() -> None:
    """The chain's head in L2, its tail demoted to L3: room in L2 comes from elsewhere (or
    a put is refused), never from the head, which would strand the tail."""
    index, _ = make_index(num_pages=3, tiers=(D, N))
    put(index, "p", "q", "r")
    for n in ("r", "q"):
        e = index.get(NS, key(n))
        assert e is not None
        pages = index.moves.alloc(N, e.size_bytes)
        assert pages is not None
        index.moves.add_copy(e, N, pages)
        index.moves.drop_copy(e, D)
    put(index, "x")
    put(index, "y")  # L2 is full: p, x, y
    plan = index.prepare_store("z", NS, [key("z")], [PAGE_BYTES], [None], D, FAR)
    assert plan is not None and names(plan.evicted) == ["x"]  # not p, older as it is
    for n in ("p", "q", "r"):
        assert reachable(index, n)


def test_a_restart_drops_l3_blocks_whose_prefix_lived_only_in_l2() -> None:
    index, _ = make_index(num_pages=4, tiers=(D, N))
    put(index, "p", "q", "r")
    put(index, "s")
    copies = {}
    for n in ("q", "r", "s"):
        e = index.get(NS, key(n))
        assert e is not None
        pages = index.moves.alloc(N, e.size_bytes)
        assert pages is not None
        index.moves.add_copy(e, N, pages)
        index.moves.drop_copy(e, D)
        copies[n] = (e.parent, pages)
    fresh, _ = make_index(num_pages=4, tiers=(D, N))  # L2 (and p with it) is gone
    for n, (parent, pages) in copies.items():
        fresh.moves.adopt(NS, key(n), PAGE_BYTES, 7, parent, N, pages)
    dropped = fresh.drop_orphans()
    assert sorted(names(dropped)) == ["q", "r"]  # q's parent p is gone, r goes with q
    assert fresh.get(NS, key("s")) is not None  # a root keeps its place
    assert fresh.unevictable().total == 0
