"""Page allocator shared by every slot tier (L1 HBM, L2 DRAM, L3 NVMe).

A tier is an arena of `num_pages` fixed-size pages. An object takes ceil(size / page_size)
pages: one contiguous run when a free run is long enough (best fit, so long runs stay
whole for large objects), else the fewest runs that cover it, longest first. Any freed page
serves any object, so there is no external fragmentation. Pure: no I/O, no clock.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from kvstore.extents import PageRun


@dataclass(frozen=True)
class AllocatorStats:
    num_pages: int
    free_pages: int
    used_pages: int
    free_runs: int
    largest_free_run: int


class PageAllocator:
    """Free space as maximal runs, indexed by start (coalescing) and by length (best fit)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self.free_pages = 0
        self._starts: list[int] = []  # sorted starts of free runs
        self._length_at: dict[int, int] = {}  # free run start -> length
        self._lengths: list[int] = []  # sorted distinct free-run lengths
        self._starts_of_length: dict[int, set[int]] = {}
        self._add_run(0, num_pages)

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.free_pages

    @property
    def largest_free_run(self) -> int:
        return self._lengths[-1] if self._lengths else 0

    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            num_pages=self.num_pages,
            free_pages=self.free_pages,
            used_pages=self.used_pages,
            free_runs=len(self._starts),
            largest_free_run=self.largest_free_run,
        )

    def alloc(self, num_pages: int) -> tuple[PageRun, ...] | None:
        """Pages for one object, or None when fewer than num_pages are free."""
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        if num_pages > self.free_pages:
            return None
        i = bisect.bisect_left(self._lengths, num_pages)
        if i < len(self._lengths):
            start = min(self._starts_of_length[self._lengths[i]])
            return (self._take(start, num_pages),)
        runs: list[PageRun] = []
        remaining = num_pages
        while remaining:
            longest = self._lengths[-1]
            start = min(self._starts_of_length[longest])
            run = self._take(start, min(longest, remaining))
            runs.append(run)
            remaining -= run.length
        return tuple(runs)

    def free(self, runs: tuple[PageRun, ...] | list[PageRun]) -> None:
        """Return runs to the free space; freeing a page that is already free is misuse."""
        for run in runs:
            self._check_used(run)
            start, length = run
            end = start + length
            i = bisect.bisect_left(self._starts, start)
            if i > 0:
                prev = self._starts[i - 1]
                if prev + self._length_at[prev] == start:
                    start, length = prev, length + self._length_at[prev]
                    self._remove_run(prev)
            if end in self._length_at:
                length += self._length_at[end]
                self._remove_run(end)
            self._add_run(start, length)

    def take(self, runs: tuple[PageRun, ...] | list[PageRun]) -> None:
        """Claim exactly these free pages again (undoing a free that has not been followed by
        an alloc); claiming a page that is not free is misuse."""
        for start, length in runs:
            i = bisect.bisect_right(self._starts, start) - 1
            if i < 0 or length <= 0:
                raise ValueError(f"page run {(start, length)} is not free")
            free_start = self._starts[i]
            free_length = self._length_at[free_start]
            if start + length > free_start + free_length:
                raise ValueError(f"page run {(start, length)} is not free")
            self._remove_run(free_start)
            if start > free_start:
                self._add_run(free_start, start - free_start)
            if free_start + free_length > start + length:
                self._add_run(start + length, free_start + free_length - start - length)

    def _check_used(self, run: PageRun) -> None:
        start, length = run
        if length <= 0 or start < 0 or start + length > self.num_pages:
            raise ValueError(f"page run {run} is outside 0..{self.num_pages}")
        i = bisect.bisect_right(self._starts, start)
        if i > 0 and self._starts[i - 1] + self._length_at[self._starts[i - 1]] > start:
            raise ValueError(f"page run {run} overlaps free pages (double free)")
        if i < len(self._starts) and self._starts[i] < start + length:
            raise ValueError(f"page run {run} overlaps free pages (double free)")

    def _take(self, start: int, num_pages: int) -> PageRun:
        length = self._length_at[start]
        self._remove_run(start)
        if length > num_pages:
            self._add_run(start + num_pages, length - num_pages)
        return PageRun(start, num_pages)

    def _add_run(self, start: int, length: int) -> None:
        bisect.insort(self._starts, start)
        self._length_at[start] = length
        starts = self._starts_of_length.get(length)
        if starts is None:
            self._starts_of_length[length] = {start}
            bisect.insort(self._lengths, length)
        else:
            starts.add(start)
        self.free_pages += length

    def _remove_run(self, start: int) -> None:
        length = self._length_at.pop(start)
        del self._starts[bisect.bisect_left(self._starts, start)]
        starts = self._starts_of_length[length]
        starts.discard(start)
        if not starts:
            del self._starts_of_length[length]
            del self._lengths[bisect.bisect_left(self._lengths, length)]
        self.free_pages -= length
