"""Hard per-tenant quotas as arenas: each slot tier split into one page range per tenant.

Real index and placement objects. L2 is 14 pages: tenant A owns pages 0..4, tenant B pages
6..14, and pages 4 and 5 belong to nobody; L3 is 12 pages, A 0..4 and B 4..12. Namespaces
"a/..." are A's, "b/..." B's, and nobody owns "c/...". Narrated scenarios first (a tenant
at its capacity evicts or demotes only its own blocks, into its own L3 arena; adoption stays
inside the arena), then a hypothesis state machine that, after every step, checks each copy
lies inside its entry's arena and the books of every arena add up.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.core.index import Index
from kvstore.core.pages import PageAllocator, TierPages
from kvstore.core.placement import Demotion, Move, Placement, Room, RoomStep
from kvstore.core.records import Entry
from kvstore.extents import Arena, PageRun
from kvstore.keys import BlockKey
from kvstore.tier import Tier
from tests.unit.test_index import FAR, PAGE_BYTES, key, name, names

H, D, N = Tier.HBM, Tier.DRAM, Tier.NVME
A_NS, B_NS, NOBODY = "a/llama", "b/llama", "c/llama"
L2_PAGES, L3_PAGES = 14, 12
ARENAS = {
    D: [Arena("A", 0, 4), Arena("B", 6, 8)],
    N: [Arena("A", 0, 4), Arena("B", 4, 8)],
}


def by_prefix(namespace: str) -> str | None:
    return {"a/": "A", "b/": "B"}.get(namespace[:2])


def make(l3: bool = True) -> tuple[Index, Placement]:
    sizes = {D: L2_PAGES, N: L3_PAGES} if l3 else {D: L2_PAGES}
    index = Index({t: PageAllocator(n) for t, n in sizes.items()},
                  {t: PAGE_BYTES for t in sizes}, {t: ARENAS[t] for t in sizes}, by_prefix)
    return index, Placement(index, sizes)


_ids = itertools.count()


def put(index: Index, ns: str, *names_: str, size: int = PAGE_BYTES) -> list[Entry]:
    """Independent blocks, stored (prepare_store -> complete_store); the evicted entries."""
    keys = [key(n) for n in names_]
    plan_id = f"p{next(_ids)}"
    plan = index.prepare_store(plan_id, ns, keys, [size] * len(keys), [None] * len(keys), D,
                               FAR)
    assert plan is not None, f"no room for {names_} in {ns}"
    index.complete_store(plan_id, [7] * len(plan.blocks), success=True)
    return plan.evicted


def put_demoting(index: Index, placement: Placement, ns: str, n: str) -> list[Demotion]:
    """One block put as the daemon puts it: demote out of its arena first when the planner
    says so (every write succeeding), then store. The demotions done."""
    arena = by_prefix(ns)
    assert arena is not None
    done: list[Demotion] = []
    room = placement.room(D, 1, arena=arena)
    if room.step is RoomStep.DEMOTE:
        for e in index.moves.pick(D, room.short_pages * PAGE_BYTES, arena=arena):
            demotion = placement.demote(e)
            if demotion.move is Move.WRITE:
                placement.finish_demotion(demotion, written=True)
            done.append(demotion)
    put(index, ns, n)
    return done


def snapshot(index: Index, arena: str) -> dict[tuple[str, BlockKey], tuple[object, ...]]:
    """Everything about the arena's entries that another tenant must never change."""
    return {(e.namespace, e.key): (dict(e.copies), e.size_bytes, e.checksum)
            for e in index.entries() if e.arena == arena}


def inside(pages: tuple[PageRun, ...], arena: Arena) -> bool:
    return all(arena.first_page <= start and start + length <= arena.first_page + arena.num_pages
               for start, length in pages)


def arena_named(tier: Tier, arena: str) -> Arena:
    return next(a for a in ARENAS[tier] if a.name == arena)


def stored(index: Index, ns: str) -> set[str]:
    return {name(e.key) for e in index.entries() if e.namespace == ns}

# --- isolation ---------------------------------------------------------------------------------


def test_a_tenant_past_its_l2_arena_evicts_only_its_own_blocks() -> None:
    index, _ = make(l3=False)
    put(index, B_NS, *[f"b{i}" for i in range(6)])
    before = snapshot(index, "B")
    # A's arena holds 4 pages: each put past that evicts A's least recently used block.
    for i in range(20):
        evicted = put(index, A_NS, f"a{i}")
        assert names(evicted) == ([f"a{i - 4}"] if i >= 4 else [])
    assert stored(index, A_NS) == {"a16", "a17", "a18", "a19"}
    assert snapshot(index, "B") == before  # same blocks, same pages, same bytes
    assert index.arena_usage(D, "B") == (6, 6 * PAGE_BYTES, 2, 8)
    assert index.arena_usage(D, "A") == (4, 4 * PAGE_BYTES, 0, 4)
    assert index.evictions[D] == 16


def test_a_put_bigger_than_its_arena_is_refused_though_the_other_arena_is_empty() -> None:
    index, _ = make(l3=False)
    put(index, A_NS, "a0")
    assert index.prepare_store("p", A_NS, [key(f"x{i}") for i in range(5)], [PAGE_BYTES] * 5,
                               [None] * 5, D, FAR) is None
    assert stored(index, A_NS) == {"a0"} and index.evictions[D] == 0
    assert index.free_pages(D, "B") == 8


def test_demotion_out_of_an_l2_arena_lands_in_the_same_tenants_l3_arena() -> None:
    index, placement = make()
    for i in range(10):  # B: 8 L2 pages, so 2 of its blocks go down to B's L3 arena
        put_demoting(index, placement, B_NS, f"b{i}")
    before = snapshot(index, "B")
    assert [name(e.key) for e in index.entries(N)] == ["b0", "b1"]
    demotions = [d for i in range(12) for d in put_demoting(index, placement, A_NS, f"a{i}")]
    # A's 12 blocks: 4 in its L2 arena, 4 in its L3 arena, the 4 oldest evicted from L3.
    assert stored(index, A_NS) == {f"a{i}" for i in range(4, 12)}
    assert {d.move for d in demotions} == {Move.WRITE}
    assert names(e for d in demotions for e in d.l3_evicted) == ["a0", "a1", "a2", "a3"]
    for e in index.entries():
        if e.arena == "A" and N in e.copies:
            assert inside(e.copies[N], arena_named(N, "A"))
    assert snapshot(index, "B") == before
    assert index.evictions == {D: 0, N: 4}


def test_a_load_of_a_tenants_block_makes_room_in_its_own_l2_arena() -> None:
    index, placement = make()
    for i in range(5):
        put_demoting(index, placement, A_NS, f"a{i}")  # a0 went down to L3
    put(index, B_NS, "b0")
    before = snapshot(index, "B")
    a0 = index.get(A_NS, key("a0"))
    assert a0 is not None and set(a0.copies) == {N}
    index.moves.hold(a0)
    got = placement.alloc(D, a0.size_bytes, demoted=True, arena=a0.arena)  # A is full
    assert got.room == Room(D, RoomStep.EVICT, 1, 1) and names(got.evicted) == ["a1"]
    assert got.pages is not None and inside(got.pages, arena_named(D, "A"))
    assert placement.promote(a0, D, got.pages) is True
    index.moves.done(a0)
    assert snapshot(index, "B") == before


def test_a_copy_on_another_arenas_pages_is_misuse() -> None:
    index, _ = make()
    put(index, A_NS, "a0")
    a0 = index.get(A_NS, key("a0"))
    pages = index.moves.alloc(N, PAGE_BYTES, "B")
    assert a0 is not None and pages is not None
    with pytest.raises(ValueError, match="outside arena 'A'"):
        index.moves.add_copy(a0, N, pages)
    index.moves.free(N, pages)
    assert index.free_pages(N, "B") == 8


def test_room_is_decided_per_arena() -> None:
    index, placement = make()
    put(index, A_NS, "a0", "a1", "a2", "a3")
    assert placement.room(D, 1, arena="A") == Room(D, RoomStep.DEMOTE, 1, 1)
    assert placement.room(D, 1, arena="B") == Room(D, RoomStep.FREE, 1, 0)
    # More than the arena holds: demotion cannot help, and eviction refuses it.
    assert placement.room(D, 5, arena="A") == Room(D, RoomStep.EVICT, 5, 5)
    assert placement.alloc(D, 5 * PAGE_BYTES, arena="A").pages is None
    # An arena the tier does not have (a tenant added since the start) has no room at all.
    assert placement.room(D, 1, arena="Z") == Room(D, RoomStep.EVICT, 1, 1)
    assert placement.alloc(D, PAGE_BYTES, arena="Z").pages is None
    assert index.make_room(D, 1, "Z") is None and index.moves.alloc(D, 1, "Z") is None
    assert stored(index, A_NS) == {"a0", "a1", "a2", "a3"}


def test_a_namespace_no_tenant_owns_cannot_be_stored_or_adopted() -> None:
    index, _ = make()
    put(index, A_NS, "a0", "a1", "a2", "a3")
    assert index.prepare_store("p", NOBODY, [key("c")], [PAGE_BYTES], [None], D, FAR) is None
    assert index.prepare_store("q", NOBODY, [key("c")], [PAGE_BYTES], [None], D, FAR,
                               evict=False) is None
    assert index.moves.adopt(NOBODY, key("c"), PAGE_BYTES, 7, None, N, (PageRun(0, 1),)) is None
    assert stored(index, A_NS) == {"a0", "a1", "a2", "a3"} and index.num_plans == 0
    assert index.free_pages(N) == L3_PAGES


def test_adopt_takes_only_free_pages_inside_the_namespaces_arena() -> None:
    index, _ = make()

    def adopt(n: str, *runs: PageRun) -> Entry | None:
        return index.moves.adopt(A_NS, key(n), PAGE_BYTES, 7, None, N, runs)

    # A restart with another split: A's old pages now lie in B's arena, or straddle its end.
    assert adopt("x", PageRun(5, 1)) is None
    assert adopt("x", PageRun(3, 2)) is None
    assert adopt("x", PageRun(0, 1), PageRun(6, 1)) is None  # all or nothing
    assert index.free_pages(N, "A") == 4 and index.free_pages(N, "B") == 8
    entry = adopt("x", PageRun(1, 2))
    assert entry is not None and entry.arena == "A"
    assert index.arena_usage(N, "A") == (1, PAGE_BYTES, 2, 4)


# --- tenants re-read, admin eviction, books ----------------------------------------------------


def test_an_entry_keeps_its_arena_when_the_tenants_are_re_read() -> None:
    index, _ = make(l3=False)
    put(index, A_NS, "old")
    index.arena_of = lambda ns: "B" if ns.startswith("a/") else None  # a/ moved to B
    for i in range(10):  # 8 pages of B: the two oldest new blocks go, never "old"
        put(index, A_NS, f"n{i}")
    old = index.get(A_NS, key("old"))
    assert old is not None and old.arena == "A" and inside(old.copies[D], arena_named(D, "A"))
    assert stored(index, A_NS) == {"old", *[f"n{i}" for i in range(2, 10)]}
    assert index.arena_usage(D, "A")[:2] == (1, PAGE_BYTES)
    assert index.arena_usage(D, "B")[:2] == (8, 8 * PAGE_BYTES)


def test_a_pick_in_one_arena_leaves_a_parent_stored_in_another() -> None:
    index, _ = make()
    put(index, A_NS, "p")
    index.arena_of = lambda ns: "B" if ns.startswith("a/") else None
    plan = index.prepare_store("c", A_NS, [key("c")], [PAGE_BYTES], [key("p")], D, FAR)
    assert plan is not None
    index.complete_store("c", [7], success=True)
    # Picked from B, c would bring its parent along, were p not in A's queue.
    assert names(index.moves.pick(D, 10 * PAGE_BYTES, arena="B")) == ["c"]
    assert names(index.moves.pick(D, 10 * PAGE_BYTES, arena="A")) == []  # p waits for c to move


def test_evict_without_a_namespace_goes_across_arenas_in_eviction_order() -> None:
    index, _ = make(l3=False)
    for n in ("a0", "b0", "a1", "b1"):
        put(index, A_NS if n[0] == "a" else B_NS, n)
    assert names(index.evict_in_order(D, PAGE_BYTES, B_NS)) == ["b0"]
    assert names(index.evict_in_order(D, None)) == ["a0", "a1", "b1"]


def test_a_pick_takes_one_arenas_blocks_or_any() -> None:
    index, _ = make()
    for n in ("a0", "b0", "a1", "b1"):
        put(index, A_NS if n[0] == "a" else B_NS, n)
    picked = index.moves.pick(D, 10 * PAGE_BYTES, arena="B")
    assert names(picked) == ["b0", "b1"]
    for e in picked:
        index.moves.done(e)
    assert names(index.moves.pick(D, 3 * PAGE_BYTES)) == ["a0", "b0", "a1"]


def test_the_books_of_a_split_tier() -> None:
    index, _ = make()
    assert index.arena_names(D) == ["A", "B"]
    put(index, A_NS, "a0")
    put(index, B_NS, "b0", size=250)  # three pages
    assert index.free_pages(D) == 12 - 4  # pages 4 and 5 are nobody's: never free
    assert (index.free_pages(D, "A"), index.free_pages(D, "B"), index.free_pages(D, "Z")) == (
        3, 5, 0)
    stats = index.allocator_stats(D)
    assert (stats.num_pages, stats.free_pages, stats.used_pages) == (12, 8, 4)
    assert index.arena_usage(D, "B") == (1, 250, 5, 8)
    assert index.arena_usage(D, "Z") == (0, 0, 0, 0)
    assert index.usage(D, B_NS) == (1, 250)


def test_without_arenas_each_tier_is_one_arena_that_is_its_allocator() -> None:
    allocator = PageAllocator(4)
    index = Index({D: allocator}, {D: PAGE_BYTES})
    assert index.arena_names(D) == [""]
    put(index, "anything", "a", size=150)
    assert allocator.free_pages == index.free_pages(D) == index.free_pages(D, "") == 2
    assert index.arena_usage(D, "") == (1, 150, 2, 4)
    a = index.get("anything", key("a"))
    assert a is not None and a.arena == ""


def test_arenas_split_every_tier_or_none_and_never_overlap() -> None:
    allocators = {D: PageAllocator(8), N: PageAllocator(8)}
    with pytest.raises(ValueError, match="split every tier"):
        Index(allocators, {D: 1, N: 1}, {D: [Arena("A", 0, 8)]})
    with pytest.raises(ValueError, match="overlap"):
        TierPages.split(8, [Arena("A", 0, 5), Arena("B", 4, 4)])
    with pytest.raises(ValueError, match="past"):
        TierPages.split(8, [Arena("A", 0, 4), Arena("B", 4, 5)])
    with pytest.raises(ValueError, match="repeat"):
        TierPages.split(8, [Arena("A", 0, 4), Arena("A", 4, 4)])


def test_split_pages_go_back_to_the_arena_they_lie_in() -> None:
    pages = TierPages.split(14, ARENAS[D])
    b = pages.arenas["B"]
    assert b.alloc(8) == (PageRun(6, 8),)
    pages.free((PageRun(6, 2), PageRun(10, 1)))
    assert (b.free_pages, pages.arenas["A"].free_pages) == (3, 4)
    with pytest.raises(ValueError, match="no arena"):
        pages.free((PageRun(4, 1),))
    with pytest.raises(ValueError, match="outside 0..4"):
        pages.free((PageRun(3, 2),))  # starts in A, ends past it


# --- property: pages stay inside their arenas --------------------------------------------------

NAMES = [f"k{i}" for i in range(24)]


class ArenaMachine(RuleBasedStateMachine):
    """Random puts (demoting first, as the daemon does), loads, reads, evictions and a
    re-read of the tenants that moves a/ to B, over A, B and an unowned namespace."""

    def __init__(self) -> None:
        super().__init__()
        self.index, self.placement = make()
        self.moved = False  # whether a/ is B's now

    def arena(self, ns: str) -> str | None:
        return self.index.arena_of(ns)

    def others_than(self, arena: str | None) -> dict[str, object]:
        return {a: snapshot(self.index, a) for a in ("A", "B") if a != arena}

    @rule(ns=st.sampled_from([A_NS, B_NS, NOBODY]),
          picks=st.lists(st.sampled_from(NAMES), min_size=1, max_size=4),
          sizes=st.lists(st.integers(1, 250), min_size=4, max_size=4),
          written=st.booleans(), chained=st.booleans())
    def put(self, ns: str, picks: list[str], sizes: list[int], written: bool,
            chained: bool) -> None:
        arena = self.arena(ns)
        before = self.others_than(arena)
        keys = [key(n) for n in picks]
        sizes = sizes[: len(keys)]
        if arena is not None:
            need = sum(self.index.pages_per_object(D, s) for s in sizes)
            room = self.placement.room(D, need, arena=arena)
            if room.step is RoomStep.DEMOTE:
                for e in self.index.moves.pick(D, room.short_pages * PAGE_BYTES, arena=arena):
                    assert e.arena == arena
                    demotion = self.placement.demote(e)
                    assert all(v.arena == arena for v in demotion.l3_evicted)
                    if demotion.move is Move.WRITE:
                        self.placement.finish_demotion(demotion, written)
        parents = [None, *keys[:-1]] if chained else [None] * len(keys)
        pid = f"p{next(_ids)}"
        plan = self.index.prepare_store(pid, ns, keys, sizes, parents, D, FAR)
        if arena is None:
            assert plan is None
        if plan is not None:
            assert all(e.arena == arena for e in plan.evicted)
            self.index.complete_store(pid, [1] * len(plan.blocks), success=True)
        assert self.others_than(arena) == before

    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        below = [e for e in self.index.entries(N) if D not in e.copies and e.movable]
        if not below:
            return
        entry = data.draw(st.sampled_from(below))
        before = self.others_than(entry.arena)
        self.index.moves.hold(entry)
        got = self.placement.alloc(D, entry.size_bytes, demoted=True, arena=entry.arena)
        if got.pages is not None:
            self.placement.promote(entry, D, got.pages)
        self.index.moves.done(entry)
        assert self.others_than(entry.arena) == before

    @rule(ns=st.sampled_from([A_NS, B_NS]), picks=st.lists(st.sampled_from(NAMES), max_size=4),
          hold=st.booleans())
    def read(self, ns: str, picks: list[str], hold: bool) -> None:
        lease_id = f"l{next(_ids)}"
        self.index.leases.lease(lease_id, ns, [key(n) for n in picks], FAR)
        if not hold:
            self.index.leases.release(lease_id)

    @rule(tier=st.sampled_from([D, N]), min_bytes=st.none() | st.integers(1, 600),
          ns=st.none() | st.sampled_from([A_NS, B_NS]))
    def evict(self, tier: Tier, min_bytes: int | None, ns: str | None) -> None:
        evicted = self.index.evict_in_order(tier, min_bytes, ns)
        assert ns is None or all(e.namespace == ns for e in evicted)

    @precondition(lambda self: not self.moved)
    @rule()
    def re_read_tenants(self) -> None:
        self.index.arena_of = lambda ns: "B" if ns[:2] in ("a/", "b/") else None
        self.moved = True

    @invariant()
    def every_copy_lies_inside_its_entrys_arena(self) -> None:
        for e in self.index.entries():
            for tier, pages in e.copies.items():
                assert inside(pages, arena_named(tier, e.arena)), (e.arena, tier, pages)

    @invariant()
    def every_arena_s_books_add_up(self) -> None:
        entries = list(self.index.entries())
        for tier, arenas in ARENAS.items():
            for arena in arenas:
                mine = [e for e in entries if e.arena == arena.name and tier in e.copies]
                owned = [p for e in mine for s, n in e.copies[tier] for p in range(s, s + n)]
                assert len(owned) == len(set(owned)), "a page is owned twice"
                objects, used_bytes, free, num_pages = self.index.arena_usage(tier, arena.name)
                assert num_pages == arena.num_pages
                assert free + len(owned) == num_pages
                assert (objects, used_bytes) == (len(mine), sum(e.size_bytes for e in mine))
            assert self.index.free_pages(tier) == sum(
                self.index.free_pages(tier, a.name) for a in arenas)


ArenaMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_arena_state_machine = ArenaMachine.TestCase
