"""The block manager with a sliding window (every layer windowed): blocks that slid out of a
sequence's window are released as it grows, so a long sequence holds a bounded number of
blocks; attention sinks stay; released blocks stay in the prefix cache (another sequence
with the same prefix still hits them); forks, frees and copy-on-write skip the released
entries."""

from __future__ import annotations

import pytest

from kvstore.engine.block_manager import FREED, BlockManager, BlockRequestError

NS = "ns"
BS = 4


def grow(bm: BlockManager, seq_id: int, tokens: list[int], start: int = 0,
         keys: list | None = None) -> int:
    """Decode-style: allocate one token at a time from `start`, registering full blocks as
    the scheduler does after each step; returns the most blocks the sequence held."""
    keys = bm.extend_keys([] if keys is None else keys, tokens)
    most = 0
    for n in range(start + 1, len(tokens) + 1):
        assert bm.allocate(seq_id, n) is not None
        bm.cache_full_blocks(seq_id, keys, n)
        most = max(most, bm.num_blocks_held(seq_id))
    return most


@pytest.mark.parametrize(("window", "sinks"), [(1, 0), (4, 0), (6, 0), (9, 0), (6, 5)])
def test_a_long_sequence_holds_a_bounded_number_of_blocks(window: int, sinks: int) -> None:
    bm = BlockManager(64, BS, NS, window=window, sinks=sinks)
    tokens = list(range(200))
    most = grow(bm, 1, tokens)
    bound = -(-sinks // BS) + -(-window // BS) + 1
    assert most <= bound == bm.max_blocks_held(200, 1)
    assert most >= bound - 1  # the bound is what the window needs, not slack
    table = bm.block_table(1)
    sink_blocks = -(-sinks // BS)
    first_live = (200 - 1 - window + 1) // BS  # the block of the last write's window start
    assert all(b != FREED for b in table[:sink_blocks])
    assert all(b == FREED for b in table[sink_blocks:first_live])
    assert all(b != FREED for b in table[first_live:])
    assert bm.num_referenced_blocks == bm.num_blocks_held(1)
    bm.free(1)
    assert bm.num_referenced_blocks == 0 and bm.num_free_blocks == 64


def test_released_blocks_stay_cached_for_another_sequence() -> None:
    """The blocks that slid out are cached-unreferenced: a second sequence with the same
    prefix takes every one of them as a hit (and releases them again as it grows)."""
    bm = BlockManager(64, BS, NS, window=6)
    tokens = list(range(40))
    grow(bm, 1, tokens)
    assert bm.num_evictable_blocks >= 7  # blocks 0..7 slid out; their keys remain
    keys = bm.extend_keys([], tokens)
    hit = bm.find_prefix(keys, len(tokens))
    assert hit.num_tokens == 36  # every full block but the one holding the last token
    table = bm.allocate(2, 40, hit)
    assert table is not None
    # Only the window of the next write (token 36: tokens 31..36) is held by sequence 2.
    assert [b == FREED for b in table] == [True] * 7 + [False] * 3
    assert bm.num_blocks_held(2) == 3
    # The hit's blocks out of the window were not taken: nobody references them.
    assert all(bm.refcount(b) == 0 for b in hit.block_ids[:7])


@pytest.mark.parametrize(("window", "sinks", "step"),
                         [(1, 0, 1), (6, 0, 1), (6, 0, 8), (5, 0, 3), (9, 0, 5), (6, 5, 8)])
def test_a_pool_of_exactly_the_bound_suffices(window: int, sinks: int, step: int) -> None:
    """Blocks that slid out are released before the room for the new ones is counted, so
    a pool of max_blocks_held blocks carries a sequence computed `step` tokens at a time
    forever (were they released after, a chunk would need more room than the bound and
    every one of these but step 1 would fail)."""
    bound = BlockManager(1, BS, NS, window=window, sinks=sinks).max_blocks_held(10**6, step)
    bm = BlockManager(bound, BS, NS, window=window, sinks=sinks)
    tokens = list(range(150))
    keys = bm.extend_keys([], tokens)
    for n in range(step, len(tokens) + 1, step):
        assert bm.allocate(1, n) is not None, n
        bm.cache_full_blocks(1, keys, n)
        assert bm.num_blocks_held(1) <= bound


def test_no_window_releases_nothing() -> None:
    bm = BlockManager(64, BS, NS)
    assert grow(bm, 1, list(range(50))) == 13 == bm.max_blocks_held(50, 1)


def test_fork_and_free_skip_released_entries() -> None:
    bm = BlockManager(32, BS, NS, window=5)
    grow(bm, 1, list(range(30)))
    bm.fork(1, 2)
    held = bm.num_blocks_held(1)
    assert bm.num_blocks_held(2) == held and bm.num_referenced_blocks == held
    assert bm.allocate(2, 31) is not None  # the shared partial last block is copied
    assert len(bm.take_copies()) == 1
    bm.free(1)
    bm.free(2)
    assert bm.num_referenced_blocks == 0 and bm.num_free_blocks == 32


def test_a_prefill_chunk_keeps_the_window_before_it() -> None:
    """A chunk of 10 tokens written at 20..29 attends back to 20 - window + 1 = 15: block 3
    stays, blocks 0..2 go; the bound for a 10-token step is what it holds."""
    bm = BlockManager(32, BS, NS, window=6)
    tokens = list(range(30))
    keys = bm.extend_keys([], tokens)
    assert bm.allocate(1, 20) is not None
    bm.cache_full_blocks(1, keys, 20)
    table = bm.allocate(1, 30)
    assert table is not None
    assert [b == FREED for b in table] == [True] * 3 + [False] * 5
    assert bm.num_blocks_held(1) <= bm.max_blocks_held(30, 10)


def test_bad_window_is_named() -> None:
    with pytest.raises(BlockRequestError, match="window"):
        BlockManager(4, BS, NS, window=0)
    with pytest.raises(BlockRequestError, match="sinks"):
        BlockManager(4, BS, NS, window=4, sinks=-1)
