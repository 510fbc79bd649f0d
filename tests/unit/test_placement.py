"""The placement planner over a real index: where a load or put gets room (free pages, else
demotion, else eviction), where a demoted block goes (free L3 pages, else L3 victims in
eviction order, else nowhere), admission, promotion, and who is never chosen.

Narrated scenarios with exact expectations; every block is one page of 100 bytes unless its
size says otherwise (helpers from test_index).
"""

from __future__ import annotations

import pytest

from kvstore.core.index import Index
from kvstore.core.pages import PageAllocator
from kvstore.core.placement import Move, Placement, Room, RoomStep
from kvstore.core.records import Entry
from kvstore.tier import Tier
from tests.unit.test_index import FAR, NS, PAGE_BYTES, key, names, put, stored

H, D, N = Tier.HBM, Tier.DRAM, Tier.NVME


def make(l2_pages: int, l3_pages: int = 0, l1_pages: int = 0, admit_min_seen: int = 1,
         inclusive: bool = False) -> tuple[Index, Placement]:
    sizes = {H: l1_pages, D: l2_pages, N: l3_pages}
    allocators = {t: PageAllocator(n) for t, n in sizes.items() if n > 0}
    index = Index(allocators, {t: PAGE_BYTES for t in allocators})
    return index, Placement(index, allocators, admit_min_seen, inclusive)


def entry(index: Index, n: str) -> Entry:
    found = index.get(NS, key(n))
    assert found is not None
    return found


def put_each(index: Index, *names_: str) -> None:
    """Independent one-page blocks, oldest first."""
    for n in names_:
        put(index, n)


def demote_all(index: Index, placement: Placement, num_blocks: int) -> list[Move]:
    """What the daemon's mover does, its writes succeeding: pick, demote, finish."""
    moves = []
    for e in index.moves.pick(D, num_blocks * PAGE_BYTES):
        demotion = placement.demote(e)
        if demotion.move is Move.WRITE:
            placement.finish_demotion(demotion, written=True)
        moves.append(demotion.move)
    return moves


# --- room for a load or a put ----------------------------------------------------------------


def test_a_load_takes_free_pages_first_and_evicts_nothing() -> None:
    index, placement = make(l2_pages=4, l3_pages=4)
    put_each(index, "a", "b")
    got = placement.alloc(D, 100)
    assert got.room == Room(D, RoomStep.FREE, 1, 0)
    assert got.pages is not None and got.evicted == ()
    assert stored(index) == {"a", "b"}
    assert index.free_pages(D) == 1


def test_short_of_l2_pages_with_an_l3_below_the_planner_demotes_first() -> None:
    index, placement = make(l2_pages=4, l3_pages=4)
    put_each(index, "a", "b", "c", "d")  # L2 full
    assert placement.room(D, 2) == Room(D, RoomStep.DEMOTE, 2, 2)
    got = placement.alloc(D, 100)
    # Nothing is taken yet: the executor demotes (the daemon's mover), then asks again.
    assert (got.room.step, got.pages, got.evicted) == (RoomStep.DEMOTE, None, ())
    assert (stored(index), index.evictions[D]) == ({"a", "b", "c", "d"}, 0)
    assert demote_all(index, placement, 1) == [Move.WRITE]  # a, the least recently used
    got = placement.alloc(D, 100, demoted=True)
    assert got.room.step is RoomStep.FREE and got.pages is not None
    assert set(entry(index, "a").copies) == {N}


def test_once_demoted_a_short_l2_evicts_in_eviction_order() -> None:
    index, placement = make(l2_pages=4, l3_pages=4)
    put_each(index, "a", "b", "c", "d")
    got = placement.alloc(D, 200, demoted=True)  # the mover freed nothing in time
    assert got.room == Room(D, RoomStep.EVICT, 2, 2)
    assert names(got.evicted) == ["a", "b"] and got.pages is not None
    assert stored(index) == {"c", "d"}


def test_without_l3_a_short_l2_evicts_at_once_in_eviction_order() -> None:
    index, placement = make(l2_pages=4)
    put_each(index, "a", "b", "c", "d")
    index.touch(NS, [key("a")])  # a is now the most recently used
    assert placement.room(D, 1).step is RoomStep.EVICT  # nothing below to demote to
    got = placement.alloc(D, 200)
    assert names(got.evicted) == ["b", "c"]
    assert stored(index) == {"a", "d"}
    assert index.evictions[D] == 2


def test_l1_evicts_at_once_and_its_blocks_stay_in_l2() -> None:
    index, placement = make(l2_pages=4, l3_pages=4, l1_pages=2)
    put_each(index, "a", "b")
    for n in "ab":
        pages = placement.alloc(H, 100).pages
        assert pages is not None
        assert placement.promote(entry(index, n), H, pages) is False  # L2 keeps its copy
    # Demoting an L1 copy would only drop it, so L1 never waits for the mover.
    assert placement.room(H, 1) == Room(H, RoomStep.EVICT, 1, 1)
    got = placement.alloc(H, 100)
    assert names(got.evicted) == ["a"]
    assert set(entry(index, "a").copies) == {D}


def test_room_for_more_pages_than_the_tier_holds_is_refused_without_waiting_or_evicting() -> None:
    index, placement = make(l2_pages=4, l3_pages=4)
    put_each(index, "a", "b")
    # No demotion could make 5 pages of 4: no waiting for the mover, and nothing evicted.
    assert placement.room(D, 5) == Room(D, RoomStep.EVICT, 5, 3)
    got = placement.alloc(D, 500)
    assert (got.pages, got.evicted) == (None, ())
    assert stored(index) == {"a", "b"} and index.evictions[D] == 0


def test_which_tiers_can_free_pages_by_moving_blocks_down() -> None:
    _, all_tiers = make(l2_pages=4, l3_pages=4, l1_pages=2)
    assert [all_tiers.can_demote(t) for t in (H, D, N)] == [True, True, False]
    _, l2_only = make(l2_pages=4)
    assert [l2_only.can_demote(t) for t in (H, D, N)] == [False, False, False]


# --- where a demoted block goes ----------------------------------------------------------------


def test_a_demoted_block_takes_free_l3_pages_and_leaves_l2_once_written() -> None:
    index, placement = make(l2_pages=4, l3_pages=4)
    put(index, "a")
    [a] = index.moves.pick(D, 100)
    demotion = placement.demote(a)
    assert (demotion.move, demotion.l3_evicted, demotion.left) == (Move.WRITE, (), False)
    assert set(a.copies) == {D} and not a.movable  # busy while its bytes are written
    assert index.free_pages(N) == 3
    assert placement.finish_demotion(demotion, written=True) is True
    assert set(a.copies) == {N} and a.busy == 0
    assert index.evictions == {D: 0, N: 0}


def test_a_full_l3_evicts_its_victims_in_eviction_order_and_reports_them() -> None:
    index, placement = make(l2_pages=4, l3_pages=2)
    put_each(index, "x", "y")
    assert demote_all(index, placement, 2) == [Move.WRITE, Move.WRITE]  # L3 is full
    index.touch(NS, [key("x")])  # x is now more recently used than y
    put(index, "a", sizes=[200])  # two pages
    [a] = index.moves.pick(D, 200)
    demotion = placement.demote(a)
    assert demotion.move is Move.WRITE
    # The daemon journals these FREE records before it writes a to their pages.
    assert names(demotion.l3_evicted) == ["y", "x"]
    assert stored(index) == {"a"} and index.evictions[N] == 2
    placement.finish_demotion(demotion, written=True)
    assert set(a.copies) == {N}


def test_a_block_l3_cannot_make_room_for_leaves_l2_unwritten() -> None:
    index, placement = make(l2_pages=4, l3_pages=2)
    put_each(index, "x", "y")
    demote_all(index, placement, 2)
    index.leases.set_pinned(NS, [key("x")], True)
    put(index, "a", sizes=[200])
    [a] = index.moves.pick(D, 200)
    demotion = placement.demote(a)
    assert (demotion.move, demotion.left, demotion.pages) == (Move.NO_ROOM, True, ())
    # All or nothing: y, evicted while trying, is back; a is gone, counted as an L2 eviction.
    assert stored(index) == {"x", "y"}
    assert index.evictions == {D: 1, N: 0}


def test_a_block_seen_fewer_than_admit_min_seen_times_is_not_admitted() -> None:
    index, placement = make(l2_pages=4, l3_pages=4, admit_min_seen=2)
    put_each(index, "a", "b")
    index.touch(NS, [key("b")])  # b: put and read, seen twice; a only put
    a, b = index.moves.pick(D, 200)
    assert names([a, b]) == ["a", "b"]
    demotion = placement.demote(a)
    assert (demotion.move, demotion.left) == (Move.NOT_ADMITTED, True)
    assert stored(index) == {"b"} and index.free_pages(N) == 4
    assert index.evictions[D] == 1
    assert placement.demote(b).move is Move.WRITE


def test_a_block_already_in_l3_just_drops_its_l2_copy() -> None:
    index, placement = make(l2_pages=4, l3_pages=4, inclusive=True)
    put(index, "a")
    demote_all(index, placement, 1)
    pages = placement.alloc(D, 100).pages
    assert pages is not None
    assert placement.promote(entry(index, "a"), D, pages) is False  # inclusive: L3 copy stays
    assert set(entry(index, "a").copies) == {D, N}
    [a] = index.moves.pick(D, 100)
    demotion = placement.demote(a)
    assert (demotion.move, demotion.left, demotion.pages) == (Move.DROP, True, ())
    assert set(a.copies) == {N} and index.free_pages(N) == 3  # nothing written
    assert index.evictions == {D: 0, N: 0}


def test_a_failed_write_frees_its_l3_pages_and_the_block_leaves_l2() -> None:
    index, placement = make(l2_pages=4, l3_pages=4)
    put(index, "a")
    [a] = index.moves.pick(D, 100)
    demotion = placement.demote(a)
    assert placement.finish_demotion(demotion, written=False) is True
    assert stored(index) == set() and index.free_pages(N) == 4
    assert index.evictions == {D: 1, N: 0}


def test_a_block_leased_during_its_write_keeps_its_l2_copy_until_demoted_again() -> None:
    index, placement = make(l2_pages=4, l3_pages=4)
    put(index, "a")
    [a] = index.moves.pick(D, 100)
    demotion = placement.demote(a)
    index.leases.lease("reader", NS, [key("a")], FAR)  # a Get while the bytes are written
    assert placement.finish_demotion(demotion, written=True) is False
    assert set(a.copies) == {D, N}
    index.leases.release("reader")
    assert demote_all(index, placement, 1) == [Move.DROP]
    assert set(a.copies) == {N}


def test_exclusive_promotion_frees_the_l3_copy() -> None:
    index, placement = make(l2_pages=4, l3_pages=4)
    put(index, "a")
    demote_all(index, placement, 1)
    pages = placement.alloc(D, 100).pages
    assert pages is not None
    assert placement.promote(entry(index, "a"), D, pages) is True  # the daemon journals a FREE
    assert set(entry(index, "a").copies) == {D} and index.free_pages(N) == 4


# --- never chosen ---------------------------------------------------------------------------


def test_pinned_leased_and_busy_entries_are_never_chosen() -> None:
    index, placement = make(l2_pages=4, l3_pages=3)
    put_each(index, "p", "l", "h", "f")
    index.leases.set_pinned(NS, [key("p")], True)
    index.leases.lease("reader", NS, [key("l")], FAR)
    index.moves.hold(entry(index, "h"))  # a load in flight
    assert names(index.moves.pick(D, 4 * PAGE_BYTES)) == ["f"]  # the only block demotion may take
    index.moves.done(entry(index, "f"))
    got = placement.alloc(D, 100, demoted=True)
    assert names(got.evicted) == ["f"]
    got = placement.alloc(D, 100, demoted=True)
    assert (got.room.step, got.pages, got.evicted) == (RoomStep.EVICT, None, ())
    assert stored(index) == {"p", "l", "h"}


def test_pinned_leased_and_busy_l3_entries_are_never_evicted_for_a_demotion() -> None:
    index, placement = make(l2_pages=4, l3_pages=3)
    put_each(index, "p", "l", "h")
    demote_all(index, placement, 3)  # L3 full
    index.leases.set_pinned(NS, [key("p")], True)
    index.leases.lease("reader", NS, [key("l")], FAR)
    index.moves.hold(entry(index, "h"))
    put(index, "a")
    [a] = index.moves.pick(D, 100)
    assert placement.demote(a).move is Move.NO_ROOM
    assert stored(index) == {"p", "l", "h"} and index.evictions[N] == 0


# --- misuse -------------------------------------------------------------------------------------


def test_misuse_raises() -> None:
    index, placement = make(l2_pages=4, l3_pages=4, admit_min_seen=2)
    put(index, "a")
    with pytest.raises(ValueError, match="picked"):
        placement.demote(entry(index, "a"))  # not picked: not busy
    [a] = index.moves.pick(D, 100)
    with pytest.raises(ValueError, match="picked"):
        placement.demote(a, N)  # it has no copy in L3
    refused = placement.demote(a)  # seen once: not admitted
    with pytest.raises(ValueError, match="only a WRITE"):
        placement.finish_demotion(refused, written=True)
    l2_index, l2_only = make(l2_pages=4)
    put(l2_index, "c")
    [c] = l2_index.moves.pick(D, 100)
    with pytest.raises(ValueError, match="no tier below dram"):
        l2_only.demote(c)
    with pytest.raises(ValueError, match="admit_min_seen"):
        Placement(index, [D, N], admit_min_seen=0)
