"""Page allocators shared by every slot tier (L1 HBM, L2 DRAM, L3 NVMe).

A `PageAllocator` hands out the pages [first_page, first_page + num_pages) of a tier. An
object takes ceil(size / page_size) pages: one contiguous run when a free run is long enough
(best fit, so long runs stay whole for large objects), else the fewest runs that cover it,
longest first. Any freed page serves any object, so there is no external fragmentation.

`TierPages` is one tier's pages as arenas (kvstore.extents.Arena), one allocator each over
the arena's own range: a tenant's blocks take pages of its arena only. Without tenants a
tier is one arena "" whose allocator covers the whole tier. Pure: no I/O, no clock.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvstore.extents import Arena, PageRun


@dataclass(frozen=True)
class AllocatorStats:
    num_pages: int
    free_pages: int
    used_pages: int
    free_runs: int
    largest_free_run: int


class PageAllocator:
    """Free space as maximal runs, indexed by start (coalescing) and by length (best fit)."""

    def __init__(self, num_pages: int, first_page: int = 0) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        if first_page < 0:
            raise ValueError(f"first_page must be >= 0, got {first_page}")
        self.num_pages = num_pages
        self.first_page = first_page
        self.free_pages = 0
        self._starts: list[int] = []  # sorted starts of free runs
        self._length_at: dict[int, int] = {}  # free run start -> length
        self._lengths: list[int] = []  # sorted distinct free-run lengths
        self._starts_of_length: dict[int, set[int]] = {}
        self._add_run(first_page, num_pages)

    @property
    def end_page(self) -> int:
        return self.first_page + self.num_pages

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
        an alloc, or adopting pages a previous run left); all or nothing: claiming a page
        that is not free here (or outside these pages) is misuse, and claims none."""
        taken: list[PageRun] = []
        try:
            for run in runs:
                self._take_exactly(run)
                taken.append(run)
        except ValueError:
            self.free(taken)
            raise

    def _take_exactly(self, run: PageRun) -> None:
        start, length = run
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
        if length <= 0 or start < self.first_page or start + length > self.end_page:
            raise ValueError(f"page run {run} is outside {self.first_page}..{self.end_page}")
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


class TierPages:
    """One slot tier's pages as named arenas, an allocator each (see the module docstring)."""

    def __init__(self, arenas: Mapping[str, PageAllocator]) -> None:
        if not arenas:
            raise ValueError("a tier needs at least one arena")
        self.arenas = dict(arenas)
        ordered = sorted(self.arenas.values(), key=lambda a: a.first_page)
        for before, after in zip(ordered, ordered[1:], strict=False):
            if after.first_page < before.end_page:
                raise ValueError(f"arenas overlap at page {after.first_page}")
        self._ordered = ordered
        self._firsts = [a.first_page for a in ordered]

    @classmethod
    def whole(cls, allocator: PageAllocator) -> TierPages:
        """The tier as one arena "" (no tenants): allocator is its only allocator."""
        return cls({"": allocator})

    @classmethod
    def split(cls, num_pages: int, arenas: Sequence[Arena]) -> TierPages:
        """The pages 0..num_pages split into arenas; pages outside every arena are never
        handed out. ValueError for an arena past the tier's end, overlaps or a repeated
        name."""
        names = [a.name for a in arenas]
        if len(set(names)) != len(names):
            raise ValueError(f"arena names repeat: {names}")
        for a in arenas:
            if a.first_page + a.num_pages > num_pages:
                raise ValueError(f"arena {a.name!r} (pages {a.first_page}.."
                                 f"{a.first_page + a.num_pages}) ends past the tier's "
                                 f"{num_pages} pages")
        return cls({a.name: PageAllocator(a.num_pages, a.first_page) for a in arenas})

    @property
    def free_pages(self) -> int:
        return sum(a.free_pages for a in self._ordered)

    def holds(self, arena: str, runs: tuple[PageRun, ...]) -> bool:
        """Whether every run lies inside the named arena's pages."""
        a = self.arenas.get(arena)
        return a is not None and all(
            a.first_page <= start and start + length <= a.end_page for start, length in runs)

    def _owner(self, run: PageRun) -> PageAllocator:
        """The arena allocator whose pages run starts in; ValueError when none's does."""
        start = run[0]
        i = bisect.bisect_right(self._firsts, start) - 1
        if i < 0 or start >= self._ordered[i].end_page:
            raise ValueError(f"page run {tuple(run)} lies in no arena")
        return self._ordered[i]

    def free(self, runs: tuple[PageRun, ...] | list[PageRun]) -> None:
        """Give back runs, each to the arena it lies in (a run across arenas is misuse)."""
        if len(self._ordered) == 1:
            self._ordered[0].free(runs)
            return
        for run in runs:
            self._owner(run).free((run,))

    def stats(self) -> AllocatorStats:
        """The whole tier's: its arenas' pages together."""
        if len(self._ordered) == 1:
            return self._ordered[0].stats()
        each = [a.stats() for a in self._ordered]
        return AllocatorStats(
            num_pages=sum(s.num_pages for s in each),
            free_pages=sum(s.free_pages for s in each),
            used_pages=sum(s.used_pages for s in each),
            free_runs=sum(s.free_runs for s in each),
            largest_free_run=max(s.largest_free_run for s in each),
        )
