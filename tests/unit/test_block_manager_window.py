"""The block manager with a sliding window (every layer windowed): blocks that slid out of a
sequence's window are released as it grows, so a long sequence holds a bounded number of
blocks; attention sinks stay; released blocks stay in the prefix cache (another sequence
with the same prefix still hits them); forks, frees and copy-on-write skip the released
entries; and a simulation of the KV memory under random starts, steps, forks and frees
reads back every attended position's own token."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    # The hit names only the blocks the window of its first computed token (36: tokens
    # 31..36) needs; the others are not taken, and stay cached-unreferenced.
    assert hit.block_ids[:7] == [FREED] * 7 and FREED not in hit.block_ids[7:]
    evictable = bm.num_evictable_blocks
    table = bm.allocate(2, 40, hit)
    assert table is not None
    assert [b == FREED for b in table] == [True] * 7 + [False] * 3
    # Block 7 (which sequence 1 released) is revived; the 7 before it stay unreferenced.
    assert bm.num_blocks_held(2) == 3 and bm.num_evictable_blocks == evictable - 1


def test_a_windowed_hit_needs_only_the_window_s_blocks() -> None:
    """With the early blocks of a prefix evicted, a hit still covers the prefix up to the
    last cut whose window's blocks are cached (vLLM's rule for a sliding-window group)."""
    bm = BlockManager(11, BS, NS, window=6)
    tokens = list(range(41))
    grow(bm, 1, tokens)  # 11 blocks; 0..7 slid out in that order
    bm.free(1)  # LRU order: 0..7, then 9, 8 (the tail first); 10 (partial) is free
    keys = bm.extend_keys([], tokens)
    assert bm.allocate(99, 16) is not None  # block 10, then evicts blocks 0, 1, 2
    assert bm.find_prefix(keys[:4], 17).num_tokens == 0  # cut 16 needs block 2: gone
    hit = bm.find_prefix(keys, 41)  # cut 40: the window of token 40 is 35..40, blocks 8, 9
    assert hit.num_tokens == 40 and hit.block_ids[:8] == [FREED] * 8
    assert bm.allocate(2, 41, hit) == [FREED] * 8 + hit.block_ids[8:] + [bm.block_table(2)[10]]
    assert bm.num_blocks_held(2) == 3


@pytest.mark.parametrize(("sinks", "want"), [(0, 40), (2, 0)])
def test_sinks_must_be_cached_for_a_windowed_hit(sinks: int, want: int) -> None:
    """The first key stands for a missing block 0: without sinks the hit does not need it;
    with sinks in block 0 no cut past it can be taken."""
    bm = BlockManager(16, BS, NS, window=6, sinks=sinks)
    tokens = list(range(41))
    grow(bm, 1, tokens)
    bm.free(1)
    keys = bm.extend_keys([], tokens)
    assert bm.find_prefix(keys, 41).num_tokens == 40
    assert bm.find_prefix([b"missing" * 4, *keys[1:]], 41).num_tokens == want


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


class _Sim:
    """Sequences driven through a windowed BlockManager with the KV memory simulated: each
    slot holds the token id written there. After every operation, every position a
    sequence's next write attends to (its window and its sinks) must read back that
    sequence's own token, through its table: a block released while still needed, reused by
    another sequence, or shared wrongly by a hit or a fork would show there."""

    def __init__(self, rng: random.Random, num_blocks: int, window: int, sinks: int) -> None:
        self.rng = rng
        self.bm = BlockManager(num_blocks, BS, NS, window=window, sinks=sinks)
        self.window, self.sinks = window, sinks
        self.memory: dict[int, dict[int, int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.keys: dict[int, list[Any]] = {}
        self.done: dict[int, int] = {}  # tokens written
        self.ids = itertools.count(1)

    def start(self) -> None:
        """A new sequence: a prefix of a live one's tokens (a hit, often) or fresh tokens."""
        base: list[int] = []
        if self.tokens and self.rng.random() < 0.6:
            other = self.rng.choice(list(self.tokens))
            base = self.tokens[other][: self.rng.randrange(0, self.done[other] + 1)]
        tokens = base + [self.rng.randrange(1000) for _ in range(80)]
        keys = self.bm.extend_keys([], tokens)
        seq = next(self.ids)
        first = len(base) + self.rng.randrange(1, 9)
        hit = self.bm.find_prefix(keys, first)
        if self.bm.allocate(seq, first, hit) is None:
            return
        self.tokens[seq], self.keys[seq], self.done[seq] = tokens, keys, hit.num_tokens
        self._write(seq, first)

    def step(self, seq: int) -> None:
        end = min(len(self.tokens[seq]), self.done[seq] + self.rng.choice([1, 1, 1, 3, 7]))
        if end > self.done[seq] and self.bm.allocate(seq, end) is not None:
            self._write(seq, end)

    def fork(self, seq: int) -> None:
        child = next(self.ids)
        self.bm.fork(seq, child)
        n = self.done[seq]
        self.tokens[child] = self.tokens[seq][:n] + [self.rng.randrange(1000) for _ in range(40)]
        self.keys[child] = self.bm.extend_keys([], self.tokens[child])
        self.done[child] = n

    def free(self, seq: int) -> None:
        self.bm.free(seq)
        for table in (self.tokens, self.keys, self.done):
            del table[seq]

    def _write(self, seq: int, end: int) -> None:
        for src, dst in self.bm.take_copies():
            self.memory[dst] = dict(self.memory.get(src, {}))
        table = self.bm.block_table(seq)
        for pos in range(self.done[seq], end):
            assert table[pos // BS] != FREED, f"seq {seq} writes {pos} into a released block"
            self.memory.setdefault(table[pos // BS], {})[pos % BS] = self.tokens[seq][pos]
        self.done[seq] = end
        self.bm.cache_full_blocks(seq, self.keys[seq], end)

    def check(self) -> None:
        bm = self.bm
        refs: Counter[int] = Counter()
        for seq, n in self.done.items():
            table = bm.block_table(seq)
            refs.update(b for b in table if b != FREED)
            attended = [p for p in range(n)
                        if p > n - self.window or p < self.sinks]  # the next write's reach
            for pos in attended:
                block = table[pos // BS]
                assert block != FREED, f"seq {seq}: position {pos} was released"
                assert self.memory[block][pos % BS] == self.tokens[seq][pos], (seq, pos)
        assert all(bm.refcount(b) == refs[b] for b in range(bm.num_blocks))
        assert bm.num_referenced_blocks == len(refs)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), window=st.sampled_from([1, 3, 4, 6, 9]),
       sinks=st.sampled_from([0, 0, 2, 5]), num_blocks=st.integers(6, 24))
def test_windowed_sequences_read_back_what_they_wrote(seed: int, window: int, sinks: int,
                                                      num_blocks: int) -> None:
    rng = random.Random(seed)
    sim = _Sim(rng, num_blocks, window, sinks)
    for _ in range(80):
        live = list(sim.tokens)
        op = rng.random()
        if not live or op < 0.15:
            sim.start()
        elif op < 0.8:
            sim.step(rng.choice(live))
        elif op < 0.88:
            sim.fork(rng.choice(live))
        else:
            sim.free(rng.choice(live))
        sim.check()
    for seq in list(sim.tokens):
        sim.free(seq)
    assert sim.bm.num_referenced_blocks == 0
