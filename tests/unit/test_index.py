"""The index: two-phase stores, leases, pins and leaf-first LRU eviction.

Narrated scenarios in the style of vLLM's kv_offload LRU tests, each asserting the exact
eviction order, then a hypothesis state machine that checks the books (pages, refcounts,
usage) and replays every eviction against a from-scratch leaf-first LRU oracle.
"""

from __future__ import annotations

import copy
import itertools
from collections import Counter
from collections.abc import Iterable, Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvstore.core.holdings import Holding
from kvstore.core.index import Index
from kvstore.core.order import eviction_rank
from kvstore.core.pages import PageAllocator
from kvstore.core.records import CommitResult, Entry, PlannedBlock, StorePlan
from kvstore.extents import PageRun
from kvstore.keys import BlockKey
from kvstore.tier import Tier

PAGE_BYTES = 100
NS = "ns"
FAR = 1e9  # a deadline nothing reaches

# --- helpers ---------------------------------------------------------------------------------


class FakeClock:
    """The index's clock; tests move it by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float = 1.0) -> float:
        self.now += seconds
        return self.now


def key(name: str) -> BlockKey:
    return BlockKey(name.encode().ljust(32, b"."))


def name(k: BlockKey) -> str:
    return k.rstrip(b".").decode()


def names(entries: Iterable[Entry]) -> list[str]:
    return [name(e.key) for e in entries]


def make_index(
    num_pages: int = 4, tiers: Sequence[Tier] = (Tier.DRAM,)
) -> tuple[Index, FakeClock]:
    clock = FakeClock()
    index = Index(
        {t: PageAllocator(num_pages) for t in tiers}, {t: PAGE_BYTES for t in tiers}
    )
    return index, clock


_plan_ids = itertools.count()


def prepare(
    index: Index,
    names_: Sequence[str],
    *,
    ns: str = NS,
    tier: Tier = Tier.DRAM,
    sizes: Sequence[int] | None = None,
    first_parent: str | None = None,
    deadline: float = FAR,
    plan_id: str | None = None,
) -> StorePlan | None:
    """prepare_store for a chain: each key's parent is the key before it."""
    keys = [key(n) for n in names_]
    parents = [key(first_parent) if first_parent else None, *keys[:-1]]
    return index.prepare_store(
        plan_id or f"plan-{next(_plan_ids)}",
        ns,
        keys,
        sizes or [PAGE_BYTES] * len(keys),
        parents,
        tier,
        deadline,
    )


def commit(index: Index, plan: StorePlan) -> CommitResult:
    return index.complete_store(plan.plan_id, [7] * len(plan.blocks), success=True)


def put(index: Index, *names_: str, **kwargs: object) -> StorePlan:
    """Store a chain (prepare_store -> complete_store); returns the committed plan."""
    plan = prepare(index, names_, **kwargs)  # type: ignore[arg-type]
    assert plan is not None, f"no room for {names_}"
    commit(index, plan)
    return plan


ALL_NAMES = [chr(c) for c in range(ord("a"), ord("z") + 1)]


def stored(index: Index, ns: str = NS) -> set[str]:
    return {n for n in ALL_NAMES if index.get(ns, key(n)) is not None}


def used(index: Index, tier: Tier = Tier.DRAM) -> int:
    return index.allocator_stats(tier).used_pages


# --- plain LRU -------------------------------------------------------------------------------


def test_independent_blocks_are_evicted_least_recently_stored_first() -> None:
    index, clock = make_index(num_pages=3)
    for n in "abc":
        clock.tick()
        put(index, n)
    assert stored(index) == {"a", "b", "c"}
    clock.tick()
    # The tier is full: storing d evicts the oldest, a.
    assert names(put(index, "d").evicted) == ["a"]
    clock.tick()
    # Two more need two pages: b then c, oldest first, in one plan.
    plan = prepare(index, ["e", "f"])
    assert plan is not None and names(plan.evicted) == ["b", "c"]
    assert commit(index, plan) == CommitResult(stored=2, existing=0, evicted=2)
    assert stored(index) == {"d", "e", "f"}
    assert index.evictions == {Tier.DRAM: 3}


def test_blocks_stored_at_the_same_instant_go_in_store_order() -> None:
    index, _ = make_index(num_pages=3)
    put(index, "a")
    put(index, "b")
    put(index, "c")
    assert names(put(index, "d", "e").evicted) == ["a", "b"]


def test_a_lease_and_release_refreshes_recency_and_makes_the_block_hot() -> None:
    index, clock = make_index(num_pages=3)
    for n in "abc":
        clock.tick()
        put(index, n)
    # Read a at t=4: it becomes the most recent.
    clock.tick()
    assert names(e for e in index.leases.lease("l1", NS, [key("a")], FAR) if e) == ["a"]
    assert index.leases.release("l1") is True
    clock.tick()
    assert names(put(index, "d").evicted) == ["b"]
    clock.tick()
    assert names(put(index, "e").evicted) == ["c"]
    clock.tick()
    # a was used again, so it is hot: it outlives d and e, used once (tests/unit/
    # test_eviction_policy.py has the rest of the policy).
    assert names(put(index, "f").evicted) == ["d"]


def test_many_touches_keep_the_order_exact_through_heap_compaction() -> None:
    # Hundreds of lease/release rounds leave many stale heap items, so the heap is rebuilt
    # along the way, while a is held by a long lease; the order must still be by last access.
    index, clock = make_index(num_pages=4)
    for n in "abcd":
        clock.tick()
        put(index, n)
    clock.tick()
    index.leases.lease("held", NS, [key("a")], FAR)  # a: t=5, then untouched
    for round_ in range(300):
        clock.tick()
        n = "bcd"[round_ % 3]
        index.leases.lease(f"l{round_}", NS, [key(n)], FAR)
        index.leases.release(f"l{round_}")
    index.leases.release("held")
    # All four are hot (read again); a (t=5) is the least recent; rounds 297, 298, 299
    # touched b, c, d last. e, new, is used once: it goes before the hot ones.
    clock.tick()
    assert names(put(index, "e").evicted) == ["a"]
    assert names(index.evict_in_order(Tier.DRAM, None)) == ["e", "b", "c", "d"]


# --- leaf-first --------------------------------------------------------------------------------


def test_a_parent_with_a_cached_child_goes_after_the_child() -> None:
    index, clock = make_index(num_pages=3)
    clock.tick()  # t=1: p alone
    put(index, "p")
    clock.tick()  # t=2: x
    put(index, "x")
    clock.tick()  # t=3: the chain p -> c; p is already stored, so only c is new
    plan = put(index, "p", "c")
    assert plan.existing == [0] and [name(b.key) for b in plan.blocks] == ["c"]
    assert index.get(NS, key("p")).children == 1  # type: ignore[union-attr]
    # p is the oldest, but it is not a leaf: x (t=2) goes first.
    clock.tick()
    assert names(put(index, "y").evicted) == ["x"]
    # Leaves now: c (t=3), y (t=4). p is still held by its child.
    clock.tick()
    assert names(put(index, "z").evicted) == ["c"]
    # c is gone, so p is a leaf again, ordered by its own last use (t=3, put again then):
    # used twice, it is hot and outlives y, used once.
    clock.tick()
    assert names(put(index, "w").evicted) == ["y"]
    assert stored(index) == {"p", "z", "w"}


def test_a_whole_chain_is_evicted_leaf_to_root() -> None:
    index, clock = make_index(num_pages=4)
    clock.tick()
    put(index, "a", "b", "c")  # a is the root, c the leaf; all at t=1
    clock.tick()
    put(index, "x")
    clock.tick()
    assert names(index.evict_in_order(Tier.DRAM, None)) == ["c", "b", "a", "x"]
    assert len(index) == 0
    assert used(index) == 0


def test_a_touched_root_still_waits_for_its_children() -> None:
    index, clock = make_index(num_pages=4)
    clock.tick()
    put(index, "a", "b")
    clock.tick()
    put(index, "x")
    clock.tick()
    index.leases.lease("l", NS, [key("a")], FAR)  # a: t=3, more recent than b and x
    index.leases.release("l")
    # b (t=1) is the LRU leaf; once it is gone a is a leaf at t=3, after x (t=2).
    assert names(index.evict_in_order(Tier.DRAM, None)) == ["b", "x", "a"]


def test_a_parent_stored_after_its_child_still_waits_for_the_child() -> None:
    index, clock = make_index(num_pages=4)
    clock.tick()
    put(index, "p")  # t=1
    # A request for the chain p -> c: p is stored, so the plan only reserves c.
    plan = prepare(index, ["p", "c"])
    assert plan is not None and plan.existing == [0]
    # Before c is committed, p is evicted (nothing protects the parent of a planned block).
    assert names(index.evict_in_order(Tier.DRAM, None)) == ["p"]
    clock.tick()
    commit(index, plan)  # c at t=2, its parent absent
    clock.tick()
    put(index, "p", "c")  # p stored again at t=3; c is existing
    assert index.get(NS, key("p")).children == 1  # type: ignore[union-attr]
    clock.tick()
    index.leases.lease("l", NS, [key("c")], FAR)  # c touched at t=4
    index.leases.release("l")
    # p (t=3) is older than c (t=4) but has a cached child: c goes first.
    assert names(index.evict_in_order(Tier.DRAM, 100)) == ["c"]
    assert names(index.evict_in_order(Tier.DRAM, 100)) == ["p"]


def test_evicting_a_parent_by_key_takes_its_descendants_leaves_first() -> None:
    index, clock = make_index(num_pages=4)
    clock.tick()
    put(index, "p", "c", "d")
    put(index, "x")
    # c and d without p could never be found by a lookup of their prefix: they go too.
    evicted, skipped = index.evict_keys(NS, [key("p")])
    assert names(evicted) == ["d", "c", "p"] and skipped.total == 0
    assert stored(index) == {"x"} and index.evictions == {Tier.DRAM: 3}


def test_a_child_stored_before_its_parent_counts_under_it() -> None:
    index, clock = make_index(num_pages=4)
    clock.tick()
    put(index, "c", first_parent="p")  # out of order: c names p, which is not cached
    clock.tick()
    put(index, "p")
    assert index.get(NS, key("p")).children == 1  # type: ignore[union-attr]
    clock.tick()
    put(index, "x")
    assert names(index.evict_in_order(Tier.DRAM, None)) == ["c", "p", "x"]


# --- leases ----------------------------------------------------------------------------------


def test_leased_entries_are_never_evicted() -> None:
    index, clock = make_index(num_pages=2)
    for n in "ab":
        clock.tick()
        put(index, n)
    found = index.leases.lease("l", NS, [key("a"), key("b")], FAR)
    assert names(e for e in found if e) == ["a", "b"]
    assert index.get(NS, key("a")).leases == 1  # type: ignore[union-attr]
    # Only leased entries could make room: no plan, nothing evicted, nothing reserved.
    assert prepare(index, ["c"]) is None
    assert stored(index) == {"a", "b"}
    assert index.evictions == {Tier.DRAM: 0}
    assert index.num_plans == 0 and used(index) == 2
    assert index.evict_in_order(Tier.DRAM, None) == []
    assert index.unevictable().total == 2
    # Once released they are ordinary LRU entries again (a, leased at t=2, before b).
    assert index.leases.release("l") is True
    assert index.leases.release("l") is False
    assert names(put(index, "c").evicted) == ["a"]


def test_a_refused_prepare_evicts_nothing_and_keeps_the_lru_order() -> None:
    index, clock = make_index(num_pages=3)
    clock.tick()
    put(index, "p", "q")  # t=1, p -> q
    clock.tick()
    put(index, "x")  # t=2
    clock.tick()
    index.leases.lease("l", NS, [key("x")], FAR)  # x: t=3, and held
    # Three pages are needed; evicting q and p would give only two, so nothing happens.
    assert prepare(index, ["a", "b", "c"]) is None
    assert stored(index) == {"p", "q", "x"}
    assert index.evictions == {Tier.DRAM: 0}
    assert index.num_plans == 0 and used(index) == 3
    assert index.get(NS, key("p")).children == 1  # type: ignore[union-attr]
    # The order is what it was: q (the leaf), then p, then x (t=3) once released.
    index.leases.release("l")
    assert names(index.evict_in_order(Tier.DRAM, None)) == ["q", "p", "x"]


def test_a_refused_prepare_keeps_the_order_of_entries_touched_at_the_same_instant() -> None:
    index, _ = make_index(num_pages=2)  # the clock stays at 0: only touch order separates
    put(index, "y")
    put(index, "x")
    index.leases.lease("l", NS, [key("x")], FAR)  # x touched after y, and held
    assert prepare(index, ["a", "b"]) is None  # y alone is not enough
    index.leases.release("l")
    assert names(index.evict_in_order(Tier.DRAM, None)) == ["y", "x"]


def test_a_request_larger_than_the_tier_is_refused_without_evicting() -> None:
    index, _ = make_index(num_pages=4)
    put(index, "a")
    # 2 + 3 pages (250 B -> 3 pages of 100 B) > 4 pages in the tier.
    assert prepare(index, ["b", "c"], sizes=[200, 250]) is None
    assert stored(index) == {"a"}
    assert index.evictions == {Tier.DRAM: 0}


def test_touch_marks_used_without_holding() -> None:
    index, clock = make_index(num_pages=3)
    for n in "abc":
        clock.tick()
        put(index, n)
    clock.tick()
    found = index.touch(NS, [key("a"), key("zz")])
    assert [name(e.key) if e else None for e in found] == ["a", None]
    assert index.leases.num_leases == 0
    assert index.get(NS, key("a")).leases == 0  # type: ignore[union-attr]
    assert index.get(NS, key("a")).seen == 2  # type: ignore[union-attr]  # a use, counted
    # a is the most recent now, and nothing holds it.
    assert names(index.evict_in_order(Tier.DRAM, None)) == ["b", "c", "a"]


def test_lease_reports_misses_and_records_nothing_when_all_miss() -> None:
    index, _ = make_index()
    put(index, "a")
    found = index.leases.lease("l1", NS, [key("a"), key("zz"), key("a")], FAR)
    assert [name(e.key) if e else None for e in found] == ["a", None, "a"]
    assert index.get(NS, key("a")).leases == 2  # type: ignore[union-attr]
    assert index.leases.lease("l2", NS, [key("zz")], FAR) == [None]
    assert index.leases.has_lease("l1") and not index.leases.has_lease("l2")
    assert index.leases.num_leases == 1
    with pytest.raises(ValueError, match="exists"):
        index.leases.lease("l1", NS, [key("a")], FAR)
    index.leases.release("l1")
    assert index.get(NS, key("a")).leases == 0  # type: ignore[union-attr]


# --- pins ------------------------------------------------------------------------------------


def test_pinned_entries_are_never_evicted_until_unpinned() -> None:
    index, clock = make_index(num_pages=3)
    for n in "abc":
        clock.tick()
        put(index, n)
    # Pin a twice in one call and a key that is not there: one change, one miss.
    assert index.leases.set_pinned(NS, [key("a"), key("a"), key("zz")], True) == (1, 1)
    assert index.leases.pinned_count() == 1
    clock.tick()
    assert names(put(index, "d").evicted) == ["b"]  # a is older but pinned
    assert index.leases.set_pinned(NS, [key("a")], False) == (1, 0)
    assert index.leases.set_pinned(NS, [key("a")], False) == (0, 0)
    # Unpinned, a is ordered by its own last access (t=1): first out.
    clock.tick()
    assert names(put(index, "e").evicted) == ["a"]
    clock.tick()
    assert names(put(index, "f").evicted) == ["c"]


def test_a_pinned_child_keeps_its_parent() -> None:
    index, clock = make_index(num_pages=3)
    clock.tick()
    put(index, "p", "c")
    clock.tick()
    put(index, "x")
    index.leases.set_pinned(NS, [key("c")], True)
    clock.tick()
    # p is the oldest and c is pinned; p has a cached child, so x is the only victim.
    assert names(put(index, "y").evicted) == ["x"]
    clock.tick()
    assert names(put(index, "z").evicted) == ["y"]
    assert index.unevictable().total == 2  # c (pinned) and p (its parent)
    assert prepare(index, ["w", "v"]) is None  # z alone cannot make two pages
    assert stored(index) == {"p", "c", "z"}  # and a refused plan evicts nothing
    # Unpinning c lets the chain go, leaf first, before z (t=4).
    index.leases.set_pinned(NS, [key("c")], False)
    assert names(index.evict_in_order(Tier.DRAM, None)) == ["c", "p", "z"]


# --- two-phase store -------------------------------------------------------------------------


def test_prepare_of_an_already_stored_key_reports_it_existing_and_takes_no_pages() -> None:
    index, _ = make_index()
    put(index, "a")
    plan = prepare(index, ["a"])
    assert plan is not None
    assert plan.blocks == [] and plan.existing == [0] and plan.evicted == []
    assert used(index) == 1
    assert commit(index, plan) == CommitResult(stored=0, existing=1, evicted=0)
    assert used(index) == 1 and len(index) == 1


def test_a_key_repeated_in_one_request_is_stored_once() -> None:
    index, _ = make_index()
    plan = prepare(index, ["a", "b", "a"])
    assert plan is not None
    assert [(b.index, name(b.key)) for b in plan.blocks] == [(0, "a"), (1, "b")]
    assert plan.existing == [2]
    assert used(index) == 2
    assert commit(index, plan) == CommitResult(stored=2, existing=1)
    assert used(index) == 2 and stored(index) == {"a", "b"}


def test_plan_pages_are_contiguous_per_block_and_sized_by_page_count() -> None:
    index, _ = make_index(num_pages=8)
    plan = prepare(index, ["a", "b", "c"], sizes=[250, 1, 100])
    assert plan is not None
    assert [b.pages for b in plan.blocks] == [
        (PageRun(0, 3),),
        (PageRun(3, 1),),
        (PageRun(4, 1),),
    ]
    assert [b.parent for b in plan.blocks] == [None, key("a"), key("b")]
    assert index.pages_per_object(Tier.DRAM, 0) == 1
    assert index.pages_per_object(Tier.DRAM, 101) == 2


def test_an_abandoned_plan_frees_its_pages() -> None:
    index, _ = make_index()
    plan = prepare(index, ["a", "b"])
    assert plan is not None and used(index) == 2 and index.plan(plan.plan_id) is plan
    result = index.complete_store(plan.plan_id, None, success=False)
    assert result == CommitResult(0, 0)
    assert used(index) == 0 and len(index) == 0 and index.num_plans == 0
    assert index.lookup(NS, [key("a")]) == (0, [None])
    with pytest.raises(KeyError):
        index.complete_store(plan.plan_id, None, success=False)


def test_a_plan_id_cannot_be_reused_while_open() -> None:
    index, _ = make_index()
    prepare(index, ["a"], plan_id="same")
    with pytest.raises(ValueError, match="exists"):
        prepare(index, ["b"], plan_id="same")
    assert used(index) == 1


def test_expire_ends_leases_and_abandons_plans_past_their_deadline() -> None:
    index, clock = make_index(num_pages=4)
    put(index, "a")
    index.leases.lease("short", NS, [key("a")], deadline=10.0)
    index.leases.lease("long", NS, [key("a")], deadline=20.0)
    prepare(index, ["b", "c"], deadline=5.0, plan_id="p5")
    prepare(index, ["d"], deadline=15.0, plan_id="p15")
    assert used(index) == 4
    assert index.expire(4.0) == ([], [])
    # Deadlines are inclusive.
    assert index.expire(5.0) == ([], ["p5"])
    assert used(index) == 2 and index.plan("p5") is None
    assert index.expire(10.0) == (["short"], [])
    assert index.get(NS, key("a")).leases == 1  # type: ignore[union-attr]
    assert index.expire(30.0) == (["long"], ["p15"])
    assert index.get(NS, key("a")).leases == 0  # type: ignore[union-attr]
    assert index.leases.num_leases == 0 and index.num_plans == 0 and used(index) == 1
    # a is evictable again.
    clock.tick()
    assert names(index.evict_in_order(Tier.DRAM, None)) == ["a"]


def test_when_another_plan_commits_a_key_first_the_losers_pages_are_freed() -> None:
    index, _ = make_index(num_pages=8)
    first = prepare(index, ["a", "b"])
    second = prepare(index, ["b", "c"], first_parent="a")
    assert first is not None and second is not None
    assert used(index) == 4  # both plans hold a page for b
    assert index.complete_store(second.plan_id, [1, 2], success=True) == CommitResult(2, 0)
    # The first plan stores a; b is already there, so its page goes back.
    assert index.complete_store(first.plan_id, [3, 4], success=True) == CommitResult(1, 1)
    assert used(index) == 3
    b = index.get(NS, key("b"))
    assert b is not None and b.checksum == 1 and b.copies[Tier.DRAM] == second.blocks[0].pages
    # b names a as its parent and was cached before a: a counts it.
    assert index.get(NS, key("a")).children == 1  # type: ignore[union-attr]


def checksum_of(index: Index, n: str) -> int:
    entry = index.get(NS, key(n))
    assert entry is not None, f"{n} is not stored"
    return entry.checksum


def _held_ahead(index: Index, pages: int, client: str = "c") -> StorePlan:
    """A plan holding `pages` pages ahead of their blocks, as a grant does: one placeholder
    a page."""
    plan = index.prepare_store("grant", NS, [key(f"_{i}") for i in range(pages)],
                               [PAGE_BYTES] * pages, [None] * pages, Tier.DRAM, FAR,
                               client=client)
    assert plan is not None
    return plan


def test_commit_part_stores_blocks_and_keeps_the_rest_held() -> None:
    index, _ = make_index(num_pages=6)
    plan = _held_ahead(index, 4)
    placeholders = list(plan.blocks)
    assert index.holdings.of("c").reserved_bytes == 4 * PAGE_BYTES

    # Two real blocks on the first two pages; the other two pages stay the plan's.
    first = [PlannedBlock(i, key(n), 60, placeholders[i].pages, None)
             for i, n in enumerate("ab")]
    result = index.commit_part("grant", first, [1, 2], placeholders[2:])
    assert result == CommitResult(2, 0, 0)
    assert stored(index) == {"a", "b"} and checksum_of(index, "b") == 2
    assert index.plan("grant") is plan and plan.blocks == placeholders[2:]
    assert (index.holdings.of("c").reservations, index.holdings.of("c").reserved_bytes) == \
        (1, 2 * PAGE_BYTES)
    assert used(index) == 4  # nothing freed: two entries, two pages still held

    # A refused commit (no checksums) frees its pages; a key stored meanwhile keeps its
    # entry, and the last commit ends the plan and its holding.
    refused = [PlannedBlock(0, key("c"), 60, placeholders[2].pages, None)]
    assert index.commit_part("grant", refused, None, placeholders[3:]) == CommitResult(0, 0)
    assert "c" not in stored(index) and used(index) == 3
    again = [PlannedBlock(0, key("a"), 60, placeholders[3].pages, None)]
    assert index.commit_part("grant", again, [9], []) == CommitResult(0, 1, 0)
    assert checksum_of(index, "a") == 1 and used(index) == 2
    assert index.plan("grant") is None and index.holdings.of("c") == Holding()
    with pytest.raises(KeyError):
        index.commit_part("grant", [], [], [])


def test_commit_part_checks_the_checksums_before_changing_anything() -> None:
    index, _ = make_index(num_pages=4)
    plan = _held_ahead(index, 2)
    block = PlannedBlock(0, key("a"), 60, plan.blocks[0].pages, None)
    with pytest.raises(ValueError, match="one checksum per block"):
        index.commit_part("grant", [block], [1, 2], plan.blocks[1:])
    assert index.plan("grant") is plan and len(plan.blocks) == 2 and stored(index) == set()
    assert index.holdings.of("c").reserved_bytes == 2 * PAGE_BYTES


# --- queries ---------------------------------------------------------------------------------


def test_lookup_returns_the_longest_cached_prefix_and_every_tier() -> None:
    index, _ = make_index(tiers=(Tier.DRAM, Tier.NVME))
    put(index, "a", "b")
    put(index, "d", tier=Tier.NVME)
    assert index.lookup(NS, [key("a"), key("b"), key("x"), key("d")]) == (
        2,
        [Tier.DRAM, Tier.DRAM, None, Tier.NVME],
    )
    assert index.lookup(NS, [key("a"), key("b"), key("d")]) == (
        3,
        [Tier.DRAM, Tier.DRAM, Tier.NVME],
    )
    assert index.lookup(NS, [key("x"), key("a")]) == (0, [None, Tier.DRAM])
    assert index.lookup("other", [key("a")]) == (0, [None])
    assert index.lookup(NS, []) == (0, [])


def test_usage_is_counted_per_namespace_and_tier() -> None:
    index, _ = make_index(num_pages=8, tiers=(Tier.DRAM, Tier.NVME))
    put(index, "a", "b", sizes=[100, 150])
    put(index, "x", ns="other", sizes=[50])
    put(index, "n", tier=Tier.NVME, sizes=[300])
    assert index.usage(Tier.DRAM, NS) == (2, 250)
    assert index.usage(Tier.DRAM, "other") == (1, 50)
    assert index.usage(Tier.DRAM) == (3, 300)
    assert index.usage(Tier.NVME, NS) == (1, 300)
    assert index.usage(Tier.NVME, "other") == (0, 0)
    assert index.usage(Tier.DRAM, "nope") == (0, 0)
    index.evict_keys(NS, [key("b")])
    assert index.usage(Tier.DRAM, NS) == (1, 100)
    assert index.usage(Tier.DRAM) == (2, 150)


# --- explicit eviction -----------------------------------------------------------------------


def test_evict_keys_removes_exactly_those_and_skips_pinned_and_leased() -> None:
    index, _ = make_index(num_pages=8)
    put(index, "a")
    put(index, "b")
    put(index, "p", "c")
    index.leases.set_pinned(NS, [key("a")], True)
    index.leases.lease("l", NS, [key("b")], FAR)
    evicted, skipped = index.evict_keys(NS, [key("a"), key("b"), key("p"), key("zz")])
    # p goes with its child c (leaves first); a and b are held, each by its own reason.
    assert names(evicted) == ["c", "p"] and (skipped.pinned, skipped.leased) == (1, 1)
    assert stored(index) == {"a", "b"}
    assert index.evictions == {Tier.DRAM: 2}
    assert used(index) == 2


def test_a_key_whose_descendant_is_pinned_is_skipped_whole() -> None:
    index, _ = make_index(num_pages=8)
    put(index, "p", "c", "d")
    index.leases.set_pinned(NS, [key("d")], True)
    evicted, skipped = index.evict_keys(NS, [key("p")])
    assert evicted == [] and skipped.pinned == 1  # a pin protects its whole prefix
    assert stored(index) == {"p", "c", "d"}


def test_evict_lru_stops_once_min_bytes_are_freed() -> None:
    index, clock = make_index(num_pages=4)
    for n in "abcd":
        clock.tick()
        put(index, n)
    assert names(index.evict_in_order(Tier.DRAM, 150)) == ["a", "b"]
    assert names(index.evict_in_order(Tier.DRAM, 100)) == ["c"]
    assert stored(index) == {"d"}


def test_evict_lru_with_a_namespace_leaves_the_others_in_lru_order() -> None:
    index, clock = make_index(num_pages=6)
    clock.tick()
    put(index, "a", ns="one")  # t=1
    clock.tick()
    put(index, "x", ns="two")  # t=2
    clock.tick()
    put(index, "b", ns="one")  # t=3
    clock.tick()
    put(index, "y", ns="two")  # t=4
    clock.tick()
    put(index, "z", ns="two")  # t=5
    assert names(index.evict_in_order(Tier.DRAM, None, namespace="one")) == ["a", "b"]
    assert index.usage(Tier.DRAM, "one") == (0, 0)
    assert index.usage(Tier.DRAM, "two") == (3, 300)
    # The entries of "two" were looked at and put back: still oldest first.
    clock.tick()
    assert names(put(index, "c", "d", "e", "f", ns="one").evicted) == ["x"]
    assert names(index.evict_in_order(Tier.DRAM, 1, namespace="two")) == ["y"]
    assert names(index.evict_in_order(Tier.DRAM, None)) == ["z", "f", "e", "d", "c"]


def test_evict_lru_only_touches_its_tier() -> None:
    index, clock = make_index(tiers=(Tier.DRAM, Tier.NVME))
    clock.tick()
    put(index, "a", tier=Tier.NVME)
    clock.tick()
    put(index, "b")
    assert names(index.evict_in_order(Tier.DRAM, None)) == ["b"]
    assert index.evictions == {Tier.DRAM: 1, Tier.NVME: 0}
    assert stored(index) == {"a"}


# --- malformed chains ------------------------------------------------------------------------


def test_an_entry_named_as_its_own_parent_is_still_evictable() -> None:
    """A self-parent (or any cycle) would make its entries parents of a cached child for
    ever; the index drops the link that would close the cycle."""
    index, clock = make_index(num_pages=2)
    put(index, "a", first_parent="a")  # parents = [a]: what Put sends for parent_key=a
    clock.tick()
    put(index, "b")
    assert index.unevictable().total == 0
    assert names(index.evict_in_order(Tier.DRAM, None)) in (["a", "b"], ["b"])
    assert len(index) == 0


def test_a_cycle_across_two_stores_is_broken_so_both_stay_evictable() -> None:
    """a names b as parent, then b names a: the second link would close a loop."""
    index, clock = make_index(num_pages=4)
    put(index, "a", first_parent="b")
    clock.tick()
    put(index, "b", first_parent="a")  # stored as a root: a stays b's child
    assert names(index.evict_in_order(Tier.DRAM, None)) == ["a", "b"]
    assert len(index) == 0 and index.unevictable().total == 0


# --- state machine ---------------------------------------------------------------------------

NAMESPACES = ("n1", "n2")
TIERS = (Tier.DRAM, Tier.NVME)
TIER_PAGES = {Tier.DRAM: 10, Tier.NVME: 6}
# Chained keys form one fixed tree per namespace (a key always has the same parent, as with
# real chained hashes): t0 is the root, parent(t_i) = t_((i-1)//2). r* are independent roots.
TREE = [f"t{i}" for i in range(7)]
ROOTS = ["r0", "r1", "r2"]
UNIVERSE = TREE + ROOTS


def tree_parent(n: str) -> str | None:
    i = int(n[1:])
    return None if n.startswith("r") or i == 0 else f"t{(i - 1) // 2}"


def tree_path(n: str) -> list[str]:
    path = [n]
    while (p := tree_parent(path[-1])) is not None:
        path.append(p)
    return path[::-1]


def oracle_victims(
    entries: list[Entry],
    tier: Tier,
    tier_pages: int,
    turnovers: float,
    stop: int,
    namespace: str | None,
    by_bytes: bool,
    held: set[tuple[str, BlockKey]] | None = None,
) -> tuple[list[tuple[str, BlockKey]], int]:
    """Leaf-first eviction from scratch: repeatedly take the evictable entry with the smallest
    (eviction rank, touch_seq) until `stop` bytes (or pages) are freed or none is left. These
    entries have one copy each, so dropping it removes the entry: it goes only when no child
    is cached in any tier (else they would be stranded).
    Returns the victims in order and what they free."""
    live = {
        (e.namespace, e.key): [eviction_rank(e, tier, tier_pages, turnovers), e.touch_seq,
                               e.children, e]
        for e in entries
        if e.tier == tier
    }
    victims: list[tuple[str, BlockKey]] = []
    freed = 0
    while freed < stop:
        candidates = [
            (v[0], v[1], k)
            for k, v in live.items()
            if v[2] == 0
            and not v[3].pinned
            and v[3].leases == 0
            and v[3].busy == 0  # e.g. the parent an open plan extends
            and (namespace is None or k[0] == namespace)
            and k not in (held or ())
        ]
        if not candidates:
            break
        _, _, k = min(candidates)
        e = live.pop(k)[3]
        victims.append(k)
        freed += e.size_bytes if by_bytes else sum(r.length for r in e.copies[e.tier])
        if e.parent is not None and (e.namespace, e.parent) in live:
            parent = live[(e.namespace, e.parent)]
            parent[2] -= 1
    return victims, freed


class IndexMachine(RuleBasedStateMachine):
    """Random chained and independent stores (open plans interleaved), leases, pins, expiry
    and eviction (LRU and by key) over two namespaces and two tiers."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.allocators = {t: PageAllocator(TIER_PAGES[t]) for t in TIERS}
        self.index = Index(self.allocators, {t: PAGE_BYTES for t in TIERS})
        self.ids = itertools.count()
        self.plans: dict[str, float] = {}  # open plan id -> deadline
        self.leases: dict[str, tuple[float, list[tuple[str, BlockKey]]]] = {}
        self.pinned: set[tuple[str, BlockKey]] = set()
        self.evictions = {t: 0 for t in TIERS}
        # Stored while their parent was cached (or as a root): they must never lose it.
        self.rooted: set[tuple[str, BlockKey]] = set()

    # --- model helpers ---

    def entries(self, index: Index | None = None) -> list[Entry]:
        index = index or self.index
        found = (index.get(ns, key(n)) for ns in NAMESPACES for n in UNIVERSE)
        return [e for e in found if e is not None]

    def open_plans(self) -> list[StorePlan]:
        plans = [self.index.plan(pid) for pid in self.plans]
        assert all(p is not None for p in plans)
        return plans  # type: ignore[return-value]

    # --- rules ---

    def prepare_chain(
        self, ns: str, leaf: str, skip: int, tier: Tier, data: st.DataObject, ttl: float
    ) -> str | None:
        """prepare_store for the chain from the root to leaf, or its suffix after `skip`
        blocks (a prefix hit), checked against the oracle; the plan id, or None."""
        path = tree_path(leaf)
        skip = min(skip, len(path) - 1)
        names_ = path[skip:]
        sizes = data.draw(st.lists(st.integers(0, 250), min_size=len(names_), max_size=len(names_)))
        keys = [key(n) for n in names_]
        parents = [key(p) if (p := tree_parent(names_[0])) else None, *keys[:-1]]
        before = {(e.namespace, e.key) for e in self.entries()}
        new = {n for n in names_ if self.index.get(ns, key(n)) is None}
        needed = sum(self.index.pages_per_object(tier, sizes[names_.index(n)]) for n in new)
        free = self.allocators[tier].free_pages
        held = {(ns, key(n)) for n in names_ if n not in new}  # a put holds its cached keys
        first_parent = tree_parent(names_[0])  # ... and the cached parent it extends
        if first_parent is not None and self.index.get(ns, key(first_parent)) is not None:
            held.add((ns, key(first_parent)))
        expected, freed = oracle_victims(self.entries(), tier, TIER_PAGES[tier],
                                         self.index.head_start, needed - free,
                                         None, False, held)
        pid = f"plan-{next(self.ids)}"
        plan = self.index.prepare_store(pid, ns, keys, sizes, parents, tier, self.clock.now + ttl)
        if needed > TIER_PAGES[tier] or free + freed < needed:
            # It does not fit even after evicting everything evictable: nothing changes
            # (the full-eviction invariant checks the LRU order survived the attempt).
            assert plan is None
            assert {(e.namespace, e.key) for e in self.entries()} == before
            return None
        assert plan is not None
        assert [(e.namespace, e.key) for e in plan.evicted] == expected
        assert {(e.namespace, e.key) for e in self.entries()} == before - set(expected)
        assert {name(b.key) for b in plan.blocks} == new
        self.plans[pid] = plan.deadline
        self.evictions[tier] += len(expected)
        return pid

    def complete_plan(self, pid: str, success: bool) -> None:
        plan = self.index.plan(pid)
        assert plan is not None
        self.clock.tick(0.5)
        already = {b.key for b in plan.blocks if self.index.get(plan.namespace, b.key)}
        checksums = [1] * len(plan.blocks) if success else None
        result = self.index.complete_store(pid, checksums, success)
        del self.plans[pid]
        if success:
            assert result.stored == len(plan.blocks) - len(already)
            assert result.existing == len(plan.existing) + len(already)
            assert result.evicted == len(plan.evicted)
            for b in plan.blocks:
                assert self.index.get(plan.namespace, b.key) is not None
                parent = tree_parent(name(b.key))
                if parent is None or self.index.get(plan.namespace, key(parent)) is not None:
                    self.rooted.add((plan.namespace, b.key))
                else:
                    self.rooted.discard((plan.namespace, b.key))
        else:
            assert result == CommitResult(0, 0)

    chain_args = {
        "ns": st.sampled_from(NAMESPACES),
        "leaf": st.sampled_from(UNIVERSE),
        "skip": st.integers(0, 2),
        "tier": st.sampled_from(TIERS),
        "data": st.data(),
        "ttl": st.floats(1, 10),
    }

    @rule(**chain_args)
    def put(
        self, ns: str, leaf: str, skip: int, tier: Tier, data: st.DataObject, ttl: float
    ) -> None:
        """prepare_store and complete_store back to back: the common case."""
        pid = self.prepare_chain(ns, leaf, skip, tier, data, ttl)
        if pid is not None:
            self.complete_plan(pid, success=True)

    @initialize(data=st.data(), count=st.integers(2, 8))
    def populate(self, data: st.DataObject, count: int) -> None:
        """Start from a tier that already holds chains, so every rule has something to bite."""
        for _ in range(count):
            self.put(**{arg: data.draw(strategy) for arg, strategy in self.chain_args.items()})

    @rule(**chain_args)
    def prepare(
        self, ns: str, leaf: str, skip: int, tier: Tier, data: st.DataObject, ttl: float
    ) -> None:
        """A plan left open, to interleave with everything else."""
        self.prepare_chain(ns, leaf, skip, tier, data, ttl)

    @precondition(lambda self: bool(self.plans))
    @rule(data=st.data(), success=st.booleans())
    def complete(self, data: st.DataObject, success: bool) -> None:
        self.complete_plan(data.draw(st.sampled_from(sorted(self.plans))), success)

    def draw_names(self, data: st.DataObject, ns: str, max_size: int) -> list[str]:
        """Mostly stored keys (so leases and pins bite), sometimes a miss."""
        stored_ = [name(e.key) for e in self.entries() if e.namespace == ns]
        return data.draw(st.lists(st.sampled_from([*stored_, "r0", "t6"]), max_size=max_size))

    @rule(ns=st.sampled_from(NAMESPACES), data=st.data(), ttl=st.floats(1, 10),
          hold=st.booleans())
    def lease(self, ns: str, data: st.DataObject, ttl: float, hold: bool) -> None:
        """A lease, or (hold=False, no id) a plain touch."""
        picks = self.draw_names(data, ns, 4)
        self.clock.tick(0.5)
        lid = f"lease-{next(self.ids)}"
        deadline = self.clock.now + ttl
        before = {n: e.seen for n in set(picks) if (e := self.index.get(ns, key(n)))}
        keys = [key(n) for n in picks]
        found = (self.index.leases.lease(lid, ns, keys, deadline) if hold
                 else self.index.touch(ns, keys))
        held = [(ns, e.key) for e in found if e is not None]
        for n, seen in before.items():  # every touch of a key counts as a use
            assert self.index.get(ns, key(n)).seen == seen + picks.count(n)  # type: ignore[union-attr]
        if held and hold:
            self.leases[lid] = (deadline, held)
        assert self.index.leases.has_lease(lid) == (hold and bool(held))

    @precondition(lambda self: bool(self.leases))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lid = data.draw(st.sampled_from(sorted(self.leases)))
        assert self.index.leases.release(lid) is True
        del self.leases[lid]

    @rule(ns=st.sampled_from(NAMESPACES), data=st.data(), pinned=st.booleans())
    def pin(self, ns: str, data: st.DataObject, pinned: bool) -> None:
        picks = self.draw_names(data, ns, 3)
        self.index.leases.set_pinned(ns, [key(n) for n in picks], pinned)
        for n in picks:
            if pinned and self.index.get(ns, key(n)) is not None:
                self.pinned.add((ns, key(n)))
            elif not pinned:
                self.pinned.discard((ns, key(n)))

    @rule(seconds=st.floats(0, 6))
    def expire(self, seconds: float) -> None:
        now = self.clock.tick(seconds)
        lease_ids, plan_ids = self.index.expire(now)
        assert sorted(lease_ids) == sorted(lid for lid, (d, _) in self.leases.items() if d <= now)
        assert sorted(plan_ids) == sorted(pid for pid, d in self.plans.items() if d <= now)
        for lid in lease_ids:
            del self.leases[lid]
        for pid in plan_ids:
            del self.plans[pid]

    @rule(
        tier=st.sampled_from(TIERS),
        min_bytes=st.none() | st.integers(1, 600),
        namespace=st.none() | st.sampled_from(NAMESPACES),
    )
    def evict_in_order(self, tier: Tier, min_bytes: int | None, namespace: str | None) -> None:
        stop = 10**9 if min_bytes is None else min_bytes
        expected, _ = oracle_victims(self.entries(), tier, TIER_PAGES[tier],
                                     self.index.head_start, stop, namespace,
                                     by_bytes=True)
        evicted = self.index.evict_in_order(tier, min_bytes, namespace)
        assert [(e.namespace, e.key) for e in evicted] == expected
        self.evictions[tier] += len(evicted)
        if min_bytes is None:
            assert not any(
                e.evictable
                for e in self.entries()
                if e.tier == tier and namespace in (None, e.namespace)
            )

    @rule(ns=st.sampled_from(NAMESPACES), data=st.data())
    def evict_keys(self, ns: str, data: st.DataObject) -> None:
        picks = self.draw_names(data, ns, 3)
        held = {k for _, ks in self.leases.values() for k in ks} | self.pinned | {
            (e.namespace, e.key) for e in self.entries() if e.busy}  # an open plan's parent
        cached = {name(e.key) for e in self.entries() if e.namespace == ns}

        def tree(n: str) -> set[str]:  # n and its cached descendants (by parent links)
            kids = {c for c in cached if (e := self.index.get(ns, key(c))) is not None
                    and e.parent == key(n)}
            return {n}.union(*(tree(c) for c in kids))

        want: set[str] = set()
        want_skipped = 0
        for n in picks:  # a pick already gone (a repeat, or under an earlier pick) is a miss
            if n not in cached or n in want:
                continue
            names_ = tree(n) - want
            if any((ns, key(m)) in held for m in names_):
                want_skipped += 1
            else:
                want |= names_
        evicted, skipped = self.index.evict_keys(ns, [key(n) for n in picks])
        assert set(names(evicted)) == want and len(evicted) == len(want)
        assert skipped.total == want_skipped
        for e in evicted:  # each after its descendants: nothing is stranded on the way
            assert self.index.get(ns, key(name(e.key))) is None
            self.evictions[e.tier] += 1

    # --- invariants ---

    @invariant()
    def pages_balance(self) -> None:
        entries = self.entries()
        plans = self.open_plans()
        assert self.index.num_plans == len(self.plans)
        for tier, allocator in self.allocators.items():
            stats = allocator.stats()
            assert stats.free_pages + stats.used_pages == TIER_PAGES[tier]
            owned = [r for e in entries if e.tier == tier for r in e.copies[e.tier]] + [
                r for p in plans if p.tier == tier for b in p.blocks for r in b.pages
            ]
            pages = [pg for start, length in owned for pg in range(start, start + length)]
            assert len(pages) == len(set(pages)), "a page is owned twice"
            assert stats.used_pages == len(pages)
        for e in entries:
            assert sum(r.length for r in e.copies[e.tier]) == self.index.pages_per_object(
                e.tier, e.size_bytes
            )

    @invariant()
    def leases_and_pins_hold_their_entries(self) -> None:
        counts = Counter(k for _, held in self.leases.values() for k in held)
        assert self.index.leases.num_leases == len(self.leases)
        for ns_key in counts.keys() | self.pinned:
            assert self.index.get(*ns_key) is not None, f"{ns_key} was evicted while held"
        for e in self.entries():
            assert e.leases == counts[(e.namespace, e.key)]
            assert e.pinned == ((e.namespace, e.key) in self.pinned)
        assert self.index.leases.pinned_count() == len(self.pinned)

    @invariant()
    def a_full_eviction_now_would_follow_the_oracle(self) -> None:
        """On a copy: evicting everything evictable goes in leaf-first LRU order, so no
        evictable entry has dropped out of the eviction queue."""
        scratch = copy.deepcopy(self.index)
        for tier in TIERS:
            expected, _ = oracle_victims(self.entries(scratch), tier, TIER_PAGES[tier],
                                         scratch.head_start, 10**9,
                                         None, True)
            assert [(e.namespace, e.key) for e in scratch.evict_in_order(tier, None)] == expected

    @invariant()
    def no_cached_block_loses_its_prefix(self) -> None:
        """A block stored with its prefix cached keeps it: whatever removes a block takes its
        cached descendants with it, or waits until they are gone."""
        for e in self.entries():
            if (e.namespace, e.key) in self.rooted and e.parent is not None:
                assert self.index.get(e.namespace, e.parent) is not None, (
                    f"{name(e.key)} was stranded: its parent {name(e.parent)} is gone")

    @invariant()
    def children_count_the_cached_entries_naming_them_as_parent(self) -> None:
        entries = self.entries()
        actual = Counter((e.namespace, e.parent) for e in entries if e.parent is not None)
        for e in entries:
            assert e.children == actual[(e.namespace, e.key)]

    @invariant()
    def evictions_are_counted_per_tier(self) -> None:
        assert self.index.evictions == self.evictions

    @invariant()
    def usage_matches_entries(self) -> None:
        entries = self.entries()
        assert len(self.index) == len(entries)
        for tier in TIERS:
            in_tier = [e for e in entries if e.tier == tier]
            assert self.index.usage(tier) == (len(in_tier), sum(e.size_bytes for e in in_tier))
            for ns in NAMESPACES:
                mine = [e for e in in_tier if e.namespace == ns]
                assert self.index.usage(tier, ns) == (len(mine), sum(e.size_bytes for e in mine))


IndexMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
test_index_state_machine = IndexMachine.TestCase
