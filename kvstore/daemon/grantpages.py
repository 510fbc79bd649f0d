"""One grant's pages, as the daemon keeps them (kvstore.daemon.writer's grants).

A grant is a plan in the index (so it is held, counted and expired as a reservation is)
whose blocks are placeholders: one per run of consecutive pages, never made entries. Here
are the same pages by their place in the grant (the numbers a client's commit names),
which of them a commit has used, and the placeholders that cover the rest. Arrays, so that a
commit of hundreds of pages costs a few numpy calls, not a Python step a page.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.core.errors import InvalidArgument
from kvstore.core.records import PlannedBlock
from kvstore.extents import PageRun
from kvstore.keys import KEY_BYTES, BlockKey

#: Pages a grant's placeholders are made of when it is planned: runs this long keep the
#: grant's pages mostly consecutive (one copy a block) and its plan short.
PLACEHOLDER_PAGES = 16
_NO_KEY = BlockKey(bytes(KEY_BYTES))  # a placeholder's: it never becomes an entry


class GrantPages:
    """The tier's page numbers of one grant by their place in it, and which are used."""

    def __init__(self, blocks: Sequence[PlannedBlock]) -> None:
        self.pages = pages_of([run for block in blocks for run in block.pages])
        self.used = np.zeros(len(self.pages), dtype=bool)

    def take(self, counts: Sequence[int], numbers: np.ndarray, grant_id: str
             ) -> list[tuple[PageRun, ...]]:
        """The runs of each block of a commit: counts[i] pages each, named by their places
        in numbers, block after block. Every place is checked (in the grant, unused, named
        once) and marked used; InvalidArgument naming the first bad block changes nothing."""
        ends = np.cumsum(np.asarray(counts, dtype=np.int64))
        if len(numbers) != (int(ends[-1]) if len(ends) else 0):
            raise InvalidArgument(f"blocks: they take {int(ends[-1]) if len(ends) else 0} "
                                  f"pages; {len(numbers)} page numbers follow",
                                  field="blocks")
        if not len(numbers):
            return []
        if int(numbers.max()) >= len(self.pages) or self.used[numbers].any():
            self._refuse(numbers, numbers >= len(self.pages), ends, grant_id)
            self._refuse(numbers, self.used[numbers], ends, grant_id)
        before = int(np.count_nonzero(self.used))
        self.used[numbers] = True
        if int(np.count_nonzero(self.used)) - before != len(numbers):  # a place named twice
            self.used[numbers] = False  # none was used before
            order = np.sort(numbers)
            twice = order[np.flatnonzero(order[1:] == order[:-1])[0]]
            self._refuse(numbers, numbers == twice, ends, grant_id)
        return _block_runs(self.pages[numbers], ends)

    def _refuse(self, numbers: np.ndarray, bad: np.ndarray, ends: np.ndarray,
                grant_id: str) -> None:
        """InvalidArgument naming the block of the first bad place, if any is bad."""
        if bad.any():
            at = int(np.argmax(bad))
            block = int(np.searchsorted(ends, at, side="right"))
            raise InvalidArgument(
                f"blocks[{block}].pages: page {int(numbers[at])} is not an unused page of "
                f"grant {grant_id!r} ({len(self.pages)} pages), or is named twice",
                field=f"blocks[{block}].pages")

    def placeholders(self, page_size: int) -> list[PlannedBlock]:
        """One placeholder block a run of the pages not used yet (none when all are)."""
        rest = self.pages[~self.used]
        return [PlannedBlock(-1, _NO_KEY, length * page_size, (PageRun(start, length),), None)
                for start, length in runs_of(np.sort(rest))]

    @property
    def left(self) -> int:
        return int(len(self.pages) - np.count_nonzero(self.used))


def _block_runs(absolute: np.ndarray, ends: np.ndarray) -> list[tuple[PageRun, ...]]:
    """Each block's pages (absolute, block after block; block i ends at ends[i]) as runs,
    all cut at once: where the pages stop being consecutive, and where a block ends."""
    first = np.ones(len(absolute), dtype=bool)  # where a run starts: no sort needed
    first[1:] = np.diff(absolute) != 1
    first[ends[:-1]] = True
    starts = np.flatnonzero(first)
    lengths = np.diff(np.append(starts, len(absolute)))
    owners = np.searchsorted(ends, starts, side="right")
    out: list[list[PageRun]] = [[] for _ in range(len(ends))]
    for owner, page, length in zip(owners.tolist(), absolute[starts].tolist(),
                                    lengths.tolist(), strict=True):
        out[owner].append(PageRun(page, length))
    return [tuple(runs) for runs in out]


def pages_of(runs: Sequence[PageRun]) -> np.ndarray:
    """Every page number of runs, in order."""
    if not runs:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(start, start + length, dtype=np.int64)
                           for start, length in runs])


def runs_of(pages: np.ndarray) -> tuple[PageRun, ...]:
    """Page numbers in order as runs, consecutive ones joined."""
    if not len(pages):
        return ()
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(pages)]))
    return tuple(PageRun(int(pages[s]), int(e - s))
                 for s, e in zip(starts.tolist(), ends.tolist(), strict=True))
