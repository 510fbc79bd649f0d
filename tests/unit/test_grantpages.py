"""A grant's pages as the daemon keeps them (kvstore/daemon/grantpages.py): a commit's pages
become each block's runs, every page is checked and used once, and what is left is covered
by placeholders that free exactly the unused pages."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core.errors import InvalidArgument
from kvstore.core.records import PlannedBlock
from kvstore.daemon.grantpages import GrantPages, runs_of
from kvstore.extents import PageRun
from kvstore.keys import BlockKey

KEY = BlockKey(bytes(32))


def granted(*runs: tuple[int, int]) -> GrantPages:
    return GrantPages([PlannedBlock(-1, KEY, n * 4096, (PageRun(s, n),), None) for s, n in runs])


def test_a_commit_s_pages_become_each_block_s_runs_cut_at_gaps_and_block_ends() -> None:
    held = granted((10, 4), (30, 4))  # places 0-3 are pages 10-13, places 4-7 pages 30-33
    runs = held.take([3, 3], np.array([0, 1, 2, 3, 4, 5]), "g")
    assert runs == [(PageRun(10, 3),), (PageRun(13, 1), PageRun(30, 2))]
    assert held.left == 2
    assert [b.pages for b in held.placeholders(4096)] == [(PageRun(32, 2),)]


@pytest.mark.parametrize(("numbers", "field"), [
    ([0, 8], "blocks[1].pages"),  # past the grant
    ([1, 1], "blocks[0].pages"),  # named twice
])
def test_a_bad_page_is_refused_naming_its_block_and_nothing_is_used(
        numbers: list[int], field: str) -> None:
    held = granted((0, 8))
    with pytest.raises(InvalidArgument) as raised:
        held.take([1, 1], np.array(numbers), "g")
    assert raised.value.metadata["field"] == field
    assert held.left == 8


def test_a_used_page_cannot_be_taken_again_and_counts_must_match() -> None:
    held = granted((0, 8))
    held.take([2], np.array([6, 7]), "g")
    with pytest.raises(InvalidArgument, match="page 7"):
        held.take([1], np.array([7]), "g")
    with pytest.raises(InvalidArgument) as raised:
        held.take([2], np.array([0]), "g")
    assert raised.value.metadata["field"] == "blocks"
    assert sum(b.size_bytes for b in held.placeholders(4096)) == 6 * 4096


def test_runs_join_consecutive_pages_only() -> None:
    assert runs_of(np.array([3, 4, 5, 9, 10, 2])) == (PageRun(3, 3), PageRun(9, 2),
                                                       PageRun(2, 1))
    assert runs_of(np.array([], dtype=np.int64)) == ()
