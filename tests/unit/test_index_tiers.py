"""The index across tiers: copies in several tiers, leaf-first per tier, picks for the mover,
and re-adoption. Narrated scenarios with exact expectations (helpers from test_index)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstore.core.index import Index
from kvstore.core.records import Entry
from kvstore.extents import PageRun
from kvstore.tier import Tier
from tests.unit.test_index import key, make_index, names, put

D, N, H = Tier.DRAM, Tier.NVME, Tier.HBM


def entry(index: Index, n: str) -> Entry:
    found = index.get("ns", key(n))
    assert found is not None
    return found


def move_down(index: Index, n: str) -> None:
    """What a finished demotion does: a copy in L3, then the L2 copy goes."""
    e = entry(index, n)
    pages = index.moves.alloc(N, e.size_bytes)
    assert pages is not None
    index.moves.add_copy(e, N, pages)
    assert index.moves.drop_copy(e, D) is False


def test_a_parent_whose_only_child_went_to_l3_may_follow_it_down_but_not_be_dropped() -> None:
    index, clock = make_index(num_pages=4, tiers=(D, N))
    put(index, "p", "c")  # p is the parent of c
    move_down(index, "c")
    assert entry(index, "p").evictable_from(D)  # a leaf of L2: it may move down after c
    assert not entry(index, "p").droppable_from(D)  # dropped, it would strand c
    assert not entry(index, "p").evictable_from(N)  # its child is cached in L3
    assert index.evict_in_order(D, None) == []
    assert names(index.moves.pick(D, 100)) == ["p"]  # the movers still take it down
    index.moves.done(entry(index, "p"))
    assert names(index.evict_in_order(N, None)) == ["c"]
    assert names(index.evict_in_order(D, None)) == ["p"]  # no child left: it may go


def test_pick_takes_the_leaf_then_its_parents_as_if_they_had_moved() -> None:
    index, clock = make_index(num_pages=8, tiers=(D, N))
    put(index, "a", "b", "c")  # the chain a <- b <- c, oldest
    clock.tick()
    put(index, "x")
    clock.tick()
    put(index, "y")
    picked = index.moves.pick(D, 4 * 100)
    assert names(picked) == ["c", "b", "a", "x"]
    assert all(e.busy == 1 and not e.movable for e in picked)
    assert names(index.evict_in_order(D, None)) == ["y"]  # busy entries never go
    for e in picked:
        index.moves.done(e)
    assert names(index.evict_in_order(D, None)) == ["c", "b", "a", "x"]


def test_pick_stops_at_max_entries_and_the_next_pick_goes_on_in_order() -> None:
    index, clock = make_index(num_pages=8, tiers=(D, N))
    put(index, "a", "b", "c")
    clock.tick()
    put(index, "x")
    first = index.moves.pick(D, 8 * 100, max_entries=2)
    assert names(first) == ["c", "b"]  # a follows b, but the round is full
    for e in first:
        index.moves.done(e)
        index.moves.drop_copy(e, D)  # as if demoted: b went, so a is a leaf now
    assert names(index.moves.pick(D, 8 * 100, max_entries=2)) == ["a", "x"]


def test_pick_takes_a_parent_only_after_all_its_children_in_the_tier() -> None:
    index, clock = make_index(num_pages=8, tiers=(D, N))
    put(index, "r", "a")
    clock.tick()
    put(index, "b", first_parent="r")  # r has two children, a and b
    assert names(index.moves.pick(D, 300)) == ["a", "b", "r"]


def test_a_busy_or_pinned_parent_does_not_follow_its_picked_child() -> None:
    index, clock = make_index(num_pages=8, tiers=(D, N))
    put(index, "a", "b")
    clock.tick()
    put(index, "c", "d")
    index.moves.hold(entry(index, "a"))  # a load of a is in flight
    index.leases.set_pinned("ns", [key("c")], True)
    assert names(index.moves.pick(D, 400)) == ["b", "d"]


def test_a_promoted_copy_counts_its_child_in_the_faster_tier_again() -> None:
    index, clock = make_index(num_pages=4, tiers=(D, N))
    put(index, "p", "c")
    move_down(index, "c")
    move_down(index, "p")
    c = entry(index, "c")
    pages = index.moves.alloc(D, c.size_bytes)
    assert pages is not None
    index.moves.add_copy(c, D, pages)
    assert (c.tier, sorted(c.copies)) == (D, [D, N])
    assert entry(index, "p").child_tiers[D] == 1
    assert index.usage(D) == (1, 100) and index.usage(N) == (2, 200)
    index.moves.drop_copy(c, N)  # exclusive placement: the L3 copy goes
    assert index.usage(N) == (1, 100)
    assert index.allocator_stats(N).used_pages == 1


def test_dropping_the_last_copy_removes_the_entry_and_frees_every_page() -> None:
    index, _ = make_index(num_pages=4, tiers=(D, N))
    put(index, "a")
    move_down(index, "a")
    assert index.moves.drop_copy(entry(index, "a"), N) is True
    assert index.get("ns", key("a")) is None
    assert index.allocator_stats(D).used_pages == index.allocator_stats(N).used_pages == 0


def test_dropping_an_l2_copy_drops_the_l1_copy_with_it() -> None:
    index, _ = make_index(num_pages=4, tiers=(H, D, N))
    put(index, "a")
    a = entry(index, "a")
    for tier in (H, N):
        pages = index.moves.alloc(tier, a.size_bytes)
        assert pages is not None
        index.moves.add_copy(a, tier, pages)
    assert a.tier == H
    index.moves.drop_copy(a, D)
    assert sorted(a.copies) == [N]
    assert index.allocator_stats(H).used_pages == 0


def test_a_refused_put_restores_copies_it_had_dropped_from_l2() -> None:
    index, _ = make_index(num_pages=2, tiers=(D, N))
    put(index, "a")
    move_down(index, "a")
    a = entry(index, "a")
    pages = index.moves.alloc(D, a.size_bytes)
    assert pages is not None
    index.moves.add_copy(a, D, pages)  # a in L2 and L3 (inclusive)
    put(index, "b")  # L2 is full
    assert index.prepare_store("p", "ns", [key("c"), key("d"), key("e")], [100] * 3,
                               [None] * 3, D, 1e9) is None
    assert sorted(entry(index, "a").copies) == [D, N] and index.get("ns", key("b")) is not None
    assert index.evictions[D] == 0


def test_a_re_put_counts_once_towards_admission_even_when_it_must_wait_for_room() -> None:
    index, clock = make_index(num_pages=2, tiers=(D, N))
    put(index, "a")
    put(index, "b")  # L2 full
    clock.tick()
    index.touch("ns", [key("a")])  # seen twice now; b is the LRU victim
    args = ("ns", [key("a"), key("c")], [100, 100], [None, None], D, 1e9)
    assert index.prepare_store("p1", *args, evict=False) is None  # no room yet
    assert entry(index, "a").seen == 2
    assert index.prepare_store("p2", *args, evict=True) is not None
    assert entry(index, "a").seen == 3


def test_adopt_takes_the_named_pages_or_refuses() -> None:
    index, _ = make_index(num_pages=4, tiers=(D, N))
    assert index.moves.adopt("ns", key("a"), 100, 7, None, N, (PageRun(2, 1),)) is not None
    assert index.moves.adopt("ns", key("b"), 100, 7, None, N, (PageRun(2, 1),)) is None  # taken
    assert index.moves.adopt("ns", key("a"), 100, 7, None, N, (PageRun(0, 1),)) is None  # known key
    assert index.lookup("ns", [key("a"), key("b")]) == (1, [N, None])


# --- random moves against the books ---------------------------------------------------------

NAMES = [f"k{i}" for i in range(8)]
PARENT = {"k1": "k0", "k2": "k1", "k3": "k1", "k5": "k4"}  # two small trees, k6 and k7 alone


class MovesMachine(RuleBasedStateMachine):
    """Puts, mover picks finished or failed, promotions (exclusive or inclusive), reads and
    evictions in any order, on a two-tier index; after every step the pages, usage and
    per-tier child counts must equal what the entries say, and nothing held was evicted."""

    def __init__(self) -> None:
        super().__init__()
        self.index, self.clock = make_index(num_pages=6, tiers=(D, N))
        self.held: list[tuple[Entry, dict[Tier, object]]] = []  # with its places then

    @rule(n=st.sampled_from(NAMES))
    def store(self, n: str) -> None:
        self.clock.tick()
        parent = PARENT.get(n)
        plan = self.index.prepare_store(f"p{self.clock.now}", "ns", [key(n)], [100],
                                        [key(parent) if parent else None], D, 1e9)
        if plan is not None:
            self.index.complete_store(plan.plan_id, [1] * len(plan.blocks), success=True)

    @rule(count=st.integers(1, 3), succeed=st.booleans())
    def demote(self, count: int, succeed: bool) -> None:
        for e in self.index.moves.pick(D, count * 100):
            pages = self.index.moves.alloc(N, e.size_bytes) if N not in e.copies else None
            if succeed and pages is not None:
                self.index.moves.add_copy(e, N, pages)
            self.index.moves.done(e)
            if succeed and N in e.copies and e.movable:
                self.index.moves.drop_copy(e, D)
            elif pages is not None and not succeed:
                self.index.moves.free(N, pages)

    @rule(n=st.sampled_from(NAMES), keep=st.booleans())
    def promote(self, n: str, keep: bool) -> None:
        e = self.index.get("ns", key(n))
        if e is None or D in e.copies or not e.movable:
            return
        pages = self.index.moves.alloc(D, e.size_bytes)
        if pages is None:
            return
        self.index.moves.hold(e)
        self.index.moves.add_copy(e, D, pages)
        if not keep:
            self.index.moves.drop_copy(e, N)
        self.index.moves.done(e)

    @rule(n=st.sampled_from(["k0", "k1", "k4"]))  # parents: what a pick may take to follow
    def hold(self, n: str) -> None:
        e = self.index.get("ns", key(n))
        if e is not None and len(self.held) < 2:
            self.index.moves.hold(e)
            self.held.append((e, dict(e.copies)))

    @rule()
    def release(self) -> None:
        if self.held:
            self.index.moves.done(self.held.pop()[0])

    @rule(tier=st.sampled_from([D, N]), everything=st.booleans())
    def evict(self, tier: Tier, everything: bool) -> None:
        self.index.evict_in_order(tier, None if everything else 100)

    @invariant()
    def books_balance(self) -> None:
        entries = list(self.index.entries())
        for tier in (D, N):
            owned = [p for e in entries if tier in e.copies for r in e.copies[tier]
                     for p in range(r.start, r.start + r.length)]
            assert len(owned) == len(set(owned))
            assert self.index.allocator_stats(tier).used_pages == len(owned)
            copies = [e for e in entries if tier in e.copies]
            assert self.index.usage(tier) == (len(copies), 100 * len(copies))
        for e in entries:
            expected = [0] * len(e.child_tiers)
            for c in entries:
                if c.parent == e.key:
                    expected[c.tier] += 1
            assert e.child_tiers == expected, name_of(e)
        for e, places in self.held:
            assert self.index.get("ns", e.key) is e, "a busy entry was evicted"
            assert e.copies == places, "a busy entry was moved"


def name_of(e: Entry) -> str:
    return e.key.rstrip(b".").decode()


MovesMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                          deadline=None)
test_moves_state_machine = MovesMachine.TestCase
