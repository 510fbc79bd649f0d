"""The page allocator: contiguous best fit, fewest-runs fallback, coalescing frees, misuse
errors, and a hypothesis state machine that checks its books against a plain set of pages."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstore.core.pages import AllocatorStats, PageAllocator
from kvstore.extents import PageRun

# --- helpers ---------------------------------------------------------------------------------


def pages_of(runs: tuple[PageRun, ...] | list[PageRun]) -> list[int]:
    return [p for start, length in runs for p in range(start, start + length)]


def maximal_runs(free: set[int]) -> list[PageRun]:
    """The free set as maximal runs, in page order."""
    runs: list[PageRun] = []
    for page in sorted(free):
        if runs and runs[-1].start + runs[-1].length == page:
            runs[-1] = PageRun(runs[-1].start, runs[-1].length + 1)
        else:
            runs.append(PageRun(page, 1))
    return runs


def expected_alloc(free: set[int], num_pages: int) -> tuple[PageRun, ...] | None:
    """The documented policy, computed from scratch: best fit (smallest run that fits, lowest
    start on a tie); else whole runs longest first (lowest start on a tie), the last one cut."""
    if num_pages > len(free):
        return None
    runs = maximal_runs(free)
    fitting = [r for r in runs if r.length >= num_pages]
    if fitting:
        best = min(fitting, key=lambda r: (r.length, r.start))
        return (PageRun(best.start, num_pages),)
    taken: list[PageRun] = []
    remaining = num_pages
    for run in sorted(runs, key=lambda r: (-r.length, r.start)):
        if not remaining:
            break
        taken.append(PageRun(run.start, min(run.length, remaining)))
        remaining -= taken[-1].length
    return tuple(taken)


def carve(num_pages: int, sizes: list[int]) -> tuple[PageAllocator, list[tuple[PageRun, ...]]]:
    """A fresh allocator with objects of `sizes` allocated back to back from page 0."""
    allocator = PageAllocator(num_pages)
    objects = []
    for size in sizes:
        runs = allocator.alloc(size)
        assert runs is not None
        objects.append(runs)
    return allocator, objects


# --- exact scenarios -------------------------------------------------------------------------


def test_fresh_allocator_hands_out_contiguous_runs_from_page_zero() -> None:
    allocator = PageAllocator(10)
    assert allocator.stats() == AllocatorStats(10, 10, 0, 1, 10)
    assert allocator.alloc(3) == (PageRun(0, 3),)
    assert allocator.alloc(2) == (PageRun(3, 2),)
    assert allocator.alloc(5) == (PageRun(5, 5),)
    assert allocator.stats() == AllocatorStats(10, 0, 10, 0, 0)
    assert allocator.alloc(1) is None


def test_best_fit_takes_the_smallest_run_that_fits_and_keeps_the_long_run_whole() -> None:
    # Pages: [a:0-2][u:3][b:4-5][u:6][c:7-15]; freeing a, b, c leaves holes of 3, 2 and 9.
    allocator, (a, _, b, _, c) = carve(16, [3, 1, 2, 1, 9])
    allocator.free(a)
    allocator.free(b)
    allocator.free(c)
    assert allocator.stats() == AllocatorStats(16, 14, 2, 3, 9)
    # One page: the 2-hole is the smallest that fits (not the first, not the 9-run).
    assert allocator.alloc(1) == (PageRun(4, 1),)
    # Two pages: holes are now 3, 1 and 9, so the 3-hole.
    assert allocator.alloc(2) == (PageRun(0, 2),)
    # One page again: holes 1 (page 2), 1 (page 5) and 9 tie on length -> lowest start.
    assert allocator.alloc(1) == (PageRun(2, 1),)
    assert allocator.alloc(1) == (PageRun(5, 1),)
    # Only now does anything come out of the long run, and it stays one piece.
    assert allocator.largest_free_run == 9
    assert allocator.alloc(9) == (PageRun(7, 9),)
    assert allocator.free_pages == 0


def test_equal_length_runs_tie_break_on_lowest_start() -> None:
    allocator, (a, _, b, _) = carve(8, [2, 1, 2, 3])
    allocator.free(b)
    allocator.free(a)
    assert allocator.alloc(2) == (PageRun(0, 2),)
    assert allocator.alloc(2) == (PageRun(3, 2),)


def test_when_no_run_fits_the_fewest_runs_are_taken_longest_first() -> None:
    # Pages: [a:0-2][u:3][b:4-5][u:6][c:7][u:8-11]; free holes of 3, 2 and 1 (6 pages).
    allocator, (a, _, b, _, c, _) = carve(12, [3, 1, 2, 1, 1, 4])
    for runs in (c, a, b):
        allocator.free(runs)
    assert allocator.stats() == AllocatorStats(12, 6, 6, 3, 3)
    # Five pages: the 3-hole then the 2-hole, two runs, never three.
    assert allocator.alloc(5) == (PageRun(0, 3), PageRun(4, 2))
    assert allocator.stats() == AllocatorStats(12, 1, 11, 1, 1)


def test_the_last_piece_of_a_multi_run_alloc_is_cut_from_the_longest_remaining_run() -> None:
    allocator, (a, _, b, _, c, _) = carve(12, [3, 1, 2, 1, 1, 4])
    for runs in (a, b, c):
        allocator.free(runs)
    # Four pages: the 3-hole, then one page from the 2-hole (the longest left), not the 1-hole.
    assert allocator.alloc(4) == (PageRun(0, 3), PageRun(4, 1))
    assert allocator.stats() == AllocatorStats(12, 2, 10, 2, 1)
    # Everything left, in one call: both single pages.
    assert allocator.alloc(2) == (PageRun(5, 1), PageRun(7, 1))


def test_free_coalesces_with_both_neighbours() -> None:
    allocator, (a, b, c) = carve(9, [3, 3, 3])
    allocator.free(a)
    allocator.free(c)
    assert allocator.stats() == AllocatorStats(9, 6, 3, 2, 3)
    allocator.free(b)  # joins the run before it and the run after it
    assert allocator.stats() == AllocatorStats(9, 9, 0, 1, 9)
    assert allocator.alloc(9) == (PageRun(0, 9),)


def test_freeing_a_multi_run_object_restores_the_largest_run() -> None:
    allocator, (a, _, b, _, c, _) = carve(12, [3, 1, 2, 1, 1, 4])
    for runs in (a, b, c):
        allocator.free(runs)
    obj = allocator.alloc(6)
    assert obj == (PageRun(0, 3), PageRun(4, 2), PageRun(7, 1))
    allocator.free(obj)
    assert allocator.stats() == AllocatorStats(12, 6, 6, 3, 3)


def test_alloc_more_than_free_is_none_and_changes_nothing() -> None:
    allocator, (_, b, _) = carve(10, [4, 2, 4])
    allocator.free(b)
    before = allocator.stats()
    assert allocator.alloc(3) is None
    assert allocator.alloc(11) is None
    assert allocator.stats() == before
    assert allocator.alloc(2) == (PageRun(4, 2),)


def test_double_free_raises_and_changes_nothing() -> None:
    allocator, (a, _) = carve(6, [2, 4])
    allocator.free(a)
    before = allocator.stats()
    with pytest.raises(ValueError, match="double free"):
        allocator.free(a)
    assert allocator.stats() == before


@pytest.mark.parametrize(
    "run",
    [PageRun(8, 4), PageRun(10, 1), PageRun(-1, 1), PageRun(0, 0), PageRun(3, -1)],
)
def test_out_of_range_or_empty_run_raises(run: PageRun) -> None:
    allocator, _ = carve(10, [10])
    with pytest.raises(ValueError, match="outside"):
        allocator.free((run,))
    assert allocator.free_pages == 0


@pytest.mark.parametrize(
    "run",
    [
        PageRun(2, 4),  # tail overlaps the free run at 4-5
        PageRun(5, 2),  # head overlaps the free run at 4-5
        PageRun(3, 4),  # covers the whole free run 4-5
        PageRun(4, 1),  # inside it
    ],
)
def test_a_run_overlapping_free_pages_raises(run: PageRun) -> None:
    allocator, (_, b, _) = carve(10, [4, 2, 4])
    allocator.free(b)
    with pytest.raises(ValueError, match="double free"):
        allocator.free((run,))
    assert allocator.stats() == AllocatorStats(10, 2, 8, 1, 2)


def test_alloc_of_zero_or_negative_pages_raises() -> None:
    allocator = PageAllocator(4)
    with pytest.raises(ValueError, match="positive"):
        allocator.alloc(0)
    with pytest.raises(ValueError, match="positive"):
        allocator.alloc(-2)
    assert allocator.free_pages == 4


def test_take_claims_back_exactly_the_pages_just_freed() -> None:
    allocator, (a, b, c) = carve(10, [3, 4, 3])
    allocator.free(a)
    allocator.free(b)  # coalesces into one free run 0-6
    allocator.take(b)  # the middle of nothing: the tail of that run
    assert allocator.stats() == AllocatorStats(10, 3, 7, 1, 3)
    allocator.free(c)
    allocator.free(b)  # 0-9 free
    allocator.take((PageRun(4, 2),))  # from the middle of a run: it splits in two
    assert allocator.stats() == AllocatorStats(10, 8, 2, 2, 4)
    assert allocator.alloc(4) == (PageRun(0, 4),)
    assert allocator.alloc(4) == (PageRun(6, 4),)


@pytest.mark.parametrize(
    "run",
    [
        PageRun(3, 2),  # page 4 is free, page 3 is not
        PageRun(5, 2),  # page 5 is free, page 6 is not
        PageRun(0, 1),  # used
        PageRun(4, 0),  # empty
        PageRun(-1, 1),
        PageRun(9, 2),  # past the end
    ],
)
def test_take_of_pages_that_are_not_all_free_raises_and_changes_nothing(run: PageRun) -> None:
    allocator, (_, b, _) = carve(10, [4, 2, 4])
    allocator.free(b)
    with pytest.raises(ValueError, match="not free"):
        allocator.take((run,))
    assert allocator.stats() == AllocatorStats(10, 2, 8, 1, 2)


@pytest.mark.parametrize("num_pages", [0, -1])
def test_allocator_needs_at_least_one_page(num_pages: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        PageAllocator(num_pages)


# --- state machine ---------------------------------------------------------------------------


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocs and frees; the model is the set of pages each live object holds."""

    allocator: PageAllocator
    num_pages: int
    live: list[tuple[PageRun, ...]]

    @initialize(num_pages=st.integers(1, 40))
    def start(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.allocator = PageAllocator(num_pages)
        self.live = []

    def free_set(self) -> set[int]:
        held = {p for runs in self.live for p in pages_of(runs)}
        return set(range(self.num_pages)) - held

    @rule(data=st.data())
    def alloc(self, data: st.DataObject) -> None:
        size = data.draw(st.integers(1, self.num_pages + 2), label="size")
        expected = expected_alloc(self.free_set(), size)
        before = self.allocator.stats()
        runs = self.allocator.alloc(size)
        assert runs == expected
        if runs is None:
            assert self.allocator.stats() == before
        else:
            assert sum(r.length for r in runs) == size
            self.live.append(runs)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.live) - 1), label="object")
        self.allocator.free(self.live.pop(i))

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free_then_take_back(self, data: st.DataObject) -> None:
        """take() undoes a free that no alloc has followed."""
        runs = self.live[data.draw(st.integers(0, len(self.live) - 1), label="object")]
        before = self.allocator.stats()
        self.allocator.free(runs)
        self.allocator.take(runs)
        assert self.allocator.stats() == before

    @rule(start=st.integers(-2, 42), length=st.integers(-1, 6))
    def take_bogus_run(self, start: int, length: int) -> None:
        """Taking a run that is not entirely free is refused, atomically."""
        if length > 0 and set(range(start, start + length)) <= self.free_set():
            return  # all free: a legal take
        before = self.allocator.stats()
        with pytest.raises(ValueError):
            self.allocator.take((PageRun(start, length),))
        assert self.allocator.stats() == before

    @rule(start=st.integers(-2, 42), length=st.integers(-1, 6))
    def free_bogus_run(self, start: int, length: int) -> None:
        """A run that is out of range or touches a free page is refused, atomically."""
        free = self.free_set()
        span = set(range(start, start + length))
        if length > 0 and start >= 0 and start + length <= self.num_pages and not span & free:
            return  # a run of used pages: freeing it would be legal, not misuse
        before = self.allocator.stats()
        with pytest.raises(ValueError):
            self.allocator.free((PageRun(start, length),))
        assert self.allocator.stats() == before

    @invariant()
    def books_balance(self) -> None:
        stats = self.allocator.stats()
        assert stats.free_pages + stats.used_pages == self.num_pages
        assert stats.used_pages == sum(len(pages_of(runs)) for runs in self.live)

    @invariant()
    def live_objects_are_disjoint_and_in_range(self) -> None:
        held = [p for runs in self.live for p in pages_of(runs)]
        assert len(held) == len(set(held))
        assert all(0 <= p < self.num_pages for p in held)

    @invariant()
    def free_space_is_maximal_runs_of_the_free_set(self) -> None:
        runs = maximal_runs(self.free_set())
        stats = self.allocator.stats()
        assert stats.free_pages == sum(r.length for r in runs)
        assert stats.free_runs == len(runs)  # no two free runs are adjacent
        assert stats.largest_free_run == max((r.length for r in runs), default=0)


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None
)
test_allocator_state_machine = AllocatorMachine.TestCase
