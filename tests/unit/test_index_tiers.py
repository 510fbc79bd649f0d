"""The index across tiers: copies in several tiers, leaf-first per tier, picks for the mover,
and re-adoption. Narrated scenarios with exact expectations (helpers from test_index)."""

from __future__ import annotations

from kvstore.entries import Entry, Tier
from kvstore.index import Index
from kvstore.pages import PageRun
from tests.unit.test_index import key, make_index, names, put

D, N, H = Tier.DRAM, Tier.NVME, Tier.HBM


def entry(index: Index, n: str) -> Entry:
    found = index.get("ns", key(n))
    assert found is not None
    return found


def move_down(index: Index, n: str) -> None:
    """What a finished demotion does: a copy in L3, then the L2 copy goes."""
    e = entry(index, n)
    pages = index.alloc(N, e.size_bytes)
    assert pages is not None
    index.add_copy(e, N, pages)
    assert index.drop_copy(e, D) is False


def test_a_parent_whose_only_child_went_to_l3_is_a_leaf_of_l2_but_not_of_l3() -> None:
    index, clock = make_index(num_pages=4, tiers=(D, N))
    put(index, "p", "c")  # p is the parent of c
    move_down(index, "c")
    assert entry(index, "p").evictable_from(D)
    assert not entry(index, "p").evictable_from(N)  # its child is cached in L3
    assert names(index.evict_lru(D, None)) == ["p"]
    assert names(index.evict_lru(N, None)) == ["c"]


def test_pick_takes_the_leaf_then_its_parents_as_if_they_had_moved() -> None:
    index, clock = make_index(num_pages=8, tiers=(D, N))
    put(index, "a", "b", "c")  # the chain a <- b <- c, oldest
    clock.tick()
    put(index, "x")
    clock.tick()
    put(index, "y")
    picked = index.pick(D, 4 * 100)
    assert names(picked) == ["c", "b", "a", "x"]
    assert all(e.busy == 1 and not e.movable for e in picked)
    assert names(index.evict_lru(D, None)) == ["y"]  # busy entries never go
    for e in picked:
        index.done(e)
    assert names(index.evict_lru(D, None)) == ["c", "b", "a", "x"]


def test_pick_takes_a_parent_only_after_all_its_children_in_the_tier() -> None:
    index, clock = make_index(num_pages=8, tiers=(D, N))
    put(index, "r", "a")
    clock.tick()
    put(index, "b", first_parent="r")  # r has two children, a and b
    assert names(index.pick(D, 300)) == ["a", "b", "r"]


def test_a_promoted_copy_counts_its_child_in_the_faster_tier_again() -> None:
    index, clock = make_index(num_pages=4, tiers=(D, N))
    put(index, "p", "c")
    move_down(index, "c")
    move_down(index, "p")
    c = entry(index, "c")
    pages = index.alloc(D, c.size_bytes)
    assert pages is not None
    index.add_copy(c, D, pages)
    assert (c.tier, sorted(c.places)) == (D, [D, N])
    assert entry(index, "p").child_tiers[D] == 1
    assert index.usage(D) == (1, 100) and index.usage(N) == (2, 200)
    index.drop_copy(c, N)  # exclusive placement: the L3 copy goes
    assert index.usage(N) == (1, 100)
    assert index.allocator_stats(N).used_pages == 1


def test_dropping_the_last_copy_removes_the_entry_and_frees_every_page() -> None:
    index, _ = make_index(num_pages=4, tiers=(D, N))
    put(index, "a")
    move_down(index, "a")
    assert index.drop_copy(entry(index, "a"), N) is True
    assert index.get("ns", key("a")) is None
    assert index.allocator_stats(D).used_pages == index.allocator_stats(N).used_pages == 0


def test_dropping_an_l2_copy_drops_the_l1_copy_with_it() -> None:
    index, _ = make_index(num_pages=4, tiers=(H, D, N))
    put(index, "a")
    a = entry(index, "a")
    for tier in (H, N):
        pages = index.alloc(tier, a.size_bytes)
        assert pages is not None
        index.add_copy(a, tier, pages)
    assert a.tier == H
    index.drop_copy(a, D)
    assert sorted(a.places) == [N]
    assert index.allocator_stats(H).used_pages == 0


def test_a_refused_put_restores_copies_it_had_dropped_from_l2() -> None:
    index, _ = make_index(num_pages=2, tiers=(D, N))
    put(index, "a")
    move_down(index, "a")
    a = entry(index, "a")
    pages = index.alloc(D, a.size_bytes)
    assert pages is not None
    index.add_copy(a, D, pages)  # a in L2 and L3 (inclusive)
    put(index, "b")  # L2 is full
    assert index.prepare_store("p", "ns", [key("c"), key("d"), key("e")], [100] * 3,
                               [None] * 3, D, 1e9) is None
    assert sorted(entry(index, "a").places) == [D, N] and index.get("ns", key("b")) is not None
    assert index.evictions[D] == 0


def test_adopt_takes_the_named_pages_or_refuses() -> None:
    index, _ = make_index(num_pages=4, tiers=(D, N))
    assert index.adopt("ns", key("a"), 100, 7, None, N, (PageRun(2, 1),)) is not None
    assert index.adopt("ns", key("b"), 100, 7, None, N, (PageRun(2, 1),)) is None  # taken
    assert index.adopt("ns", key("a"), 100, 7, None, N, (PageRun(0, 1),)) is None  # known key
    assert index.lookup("ns", [key("a"), key("b")]) == (1, [N, None])
