"""The engine's block manager: allocation, prefix caching on the store's chained keys, LRU
reuse of cached blocks released tail first, and copy-on-write after forks.

Narrated scenarios in the style of vLLM's kv_offload LRU tests, each asserting exact block
ids and the exact eviction order, then a hypothesis state machine that simulates the KV
memory itself (copies applied, tokens written into slots) and checks the books after every
step: the capacity partition, refcounts, keys, sharing, queued copies and what each sequence
reads back.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvstore.engine.block_manager import (
    BlockManager,
    BlockRequestError,
    PrefixHit,
    StaleHitError,
    UnknownSequenceError,
)
from kvstore.engine.errors import EngineError
from kvstore.keys import InvalidKeyError, chain_key, namespace_root, prefix_keys

NS = "ns"
BS = 4


def toks(start: int, count: int) -> list[int]:
    """count distinct token ids from start: sequences built from disjoint ranges share
    nothing, so every hit in a scenario is one the scenario set up."""
    return list(range(start, start + count))


def state(bm: BlockManager) -> tuple[Any, ...]:
    """Everything the manager holds, to assert that a failed call changed none of it."""
    seqs = {s: (list(q.table), list(q.keys), q.num_tokens) for s, q in bm._seqs.items()}
    return (
        list(bm._free),
        list(bm._evictable),
        list(bm._refcounts),
        list(bm._pins),
        list(bm._block_keys),
        dict(bm._key_to_block),
        seqs,
        list(bm._copies),
        bm.stats,
    )


# --- allocation ------------------------------------------------------------------------------


def test_allocate_free_round_trip() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, namespace=NS)
    prompt = toks(0, 10)

    # 10 tokens take ceil(10 / 4) = 3 blocks, the lowest ids first.
    assert bm.allocate(1, prompt, 10) == [0, 1, 2]
    assert [bm.refcount(b) for b in range(4)] == [1, 1, 1, 0]
    assert bm.num_free_blocks == 5
    assert bm.num_referenced_blocks == 3

    # Growing within the last block takes nothing; crossing into a fourth block takes one.
    assert bm.allocate(1, prompt + [10, 11], 12) == [0, 1, 2]
    assert bm.allocate(1, prompt + [10, 11, 12], 13) == [0, 1, 2, 3]
    # Asking for fewer tokens than the table covers is a no-op.
    assert bm.allocate(1, prompt, 5) == [0, 1, 2, 3]

    # Nothing was cached, so every block goes back to the free pool, tail first.
    bm.free(1)
    assert bm.num_free_blocks == 8
    assert bm.num_evictable_blocks == 0
    assert all(bm.refcount(b) == 0 and bm.block_key(b) is None for b in range(8))
    with pytest.raises(UnknownSequenceError, match="seq_id 1 has no block table"):
        bm.block_table(1)
    bm.free(1)  # an unknown sequence: no-op

    # The pool is FIFO: the never-used blocks 4..7 first, then 3, 2, 1, 0 as released.
    assert bm.allocate(2, toks(100, 32), 32) == [4, 5, 6, 7, 3, 2, 1, 0]
    assert bm.num_free_blocks == 0
    assert bm.allocate(3, toks(200, 1), 1) is None


def test_allocate_empty_and_zero_tokens() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS, namespace=NS)
    hit = bm.find_prefix([])
    assert hit == PrefixHit([], 0)
    assert bm.allocate(1, [], 0, hit) == []
    assert bm.block_table(1) == []
    assert bm.allocate(1, [7], 1) == [0]


# --- prefix caching --------------------------------------------------------------------------


def test_prefix_hit_after_first_sequence_finished() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, namespace=NS)
    prompt = toks(0, 10)

    assert bm.allocate(1, prompt, 10) == [0, 1, 2]
    bm.cache_full_blocks(1, prompt, 10)
    # Two full blocks are keyed under the store's chained keys; the partial third is not.
    keys = prefix_keys(prompt, BS, NS)
    assert bm.keys_of(1) == keys
    assert [bm.block_key(b) for b in range(3)] == [keys[0], keys[1], None]
    assert bm.stats.cached_blocks == 2

    bm.free(1)
    # The keyed blocks stay cached (evictable); the partial one returns to the free pool.
    assert bm.num_evictable_blocks == 2
    assert bm.num_free_blocks == 8
    assert bm.block_key(0) == keys[0]

    # The same prompt again: blocks 0 and 1 are found, 8 of its 10 tokens.
    hit = bm.find_prefix(prompt)
    assert hit == PrefixHit([0, 1], 8)
    s = bm.stats
    assert (s.prefix_queries, s.prefix_query_tokens, s.prefix_hit_tokens) == (1, 10, 8)

    # The hit leads the table, the rest comes from the free pool (3 is next there).
    assert bm.allocate(2, prompt, 10, hit) == [0, 1, 3]
    assert [bm.refcount(b) for b in (0, 1, 3)] == [1, 1, 1]
    assert bm.num_evictable_blocks == 0
    assert bm.keys_of(2) == keys
    assert bm.num_free_blocks == 5


def test_prefix_hit_never_covers_the_whole_prompt() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, namespace=NS)
    prompt = toks(0, 8)  # exactly two full blocks
    bm.allocate(1, prompt, 8)
    bm.cache_full_blocks(1, prompt, 8)
    assert bm.keys_of(1) == prefix_keys(prompt, BS, NS)

    # Both blocks are cached, yet the last token must be computed for its logits: one block.
    assert bm.find_prefix(prompt) == PrefixHit([0], 4)
    # One more token and both blocks can be used.
    assert bm.find_prefix(prompt + [99]) == PrefixHit([0, 1], 8)
    assert bm.find_prefix(prompt[:4]) == PrefixHit([], 0)
    assert bm.stats.prefix_hit_tokens == 12


def test_partial_hits_with_divergent_suffix() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS, namespace=NS)
    prompt = toks(0, 12)
    assert bm.allocate(1, prompt, 12) == [0, 1, 2]
    bm.cache_full_blocks(1, prompt, 12)

    # Diverging at token 5 (inside block 1): only block 0 matches.
    other = prompt[:5] + [500] + prompt[6:]
    assert bm.find_prefix(other) == PrefixHit([0], 4)
    # Diverging at the very last token of block 1: still only block 0, since a chained key
    # covers the whole block.
    other2 = prompt[:7] + [700] + prompt[8:]
    hit = bm.find_prefix(other2)
    assert hit == PrefixHit([0], 4)
    # Diverging in block 0 invalidates every later block, even identical ones (the chain).
    assert bm.find_prefix([900] + prompt[1:]) == PrefixHit([], 0)

    # Sequence 1 is still running: block 0 is shared by both tables.
    assert bm.allocate(2, other2, 12, hit) == [0, 3, 4]
    assert bm.refcount(0) == 2
    bm.cache_full_blocks(2, other2, 12)
    assert bm.keys_of(2)[0] == bm.keys_of(1)[0]
    assert bm.keys_of(2)[1] != bm.keys_of(1)[1]
    assert bm.block_key(3) == prefix_keys(other2, BS, NS)[1]

    # Releasing one holder keeps block 0 referenced by the other.
    bm.free(1)
    assert bm.refcount(0) == 1
    assert bm.num_evictable_blocks == 2  # blocks 1 and 2
    assert bm.find_prefix(prompt + [1]) == PrefixHit([0, 1, 2], 12)


def test_eviction_is_lru_with_tail_first_release() -> None:
    bm = BlockManager(num_blocks=7, block_size=BS, namespace=NS)
    a, b = toks(0, 12), toks(100, 8)

    assert bm.allocate(1, a, 12) == [0, 1, 2]
    bm.cache_full_blocks(1, a, 12)
    assert bm.allocate(2, b, 8) == [3, 4]
    bm.cache_full_blocks(2, b, 8)
    # Sequence 1 finishes first, then sequence 2: LRU order is 2, 1, 0 (tail first), 4, 3.
    bm.free(1)
    bm.free(2)
    assert bm.num_evictable_blocks == 5
    assert bm.num_free_blocks == 7

    # 4 blocks for unrelated tokens: the free block 5, 6, then evict 2 and 1 -- the tail of
    # the oldest sequence -- and keep its first block and all of sequence 2.
    assert bm.allocate(3, toks(200, 16), 16) == [5, 6, 2, 1]
    assert bm.stats.evictions == 2
    assert bm.block_key(2) is None and bm.block_key(1) is None
    assert bm.stats.cached_blocks == 3
    assert bm.find_prefix(a + [1]) == PrefixHit([0], 4)
    assert bm.find_prefix(b + [1]) == PrefixHit([3, 4], 8)

    # A hit revives block 0 (no longer evictable); the next eviction takes 4, then 3.
    hit = bm.find_prefix(a)
    assert bm.allocate(4, a, 4, hit) == [0]
    assert bm.allocate(5, toks(300, 4), 4) == [4]
    assert bm.allocate(6, toks(400, 4), 4) == [3]
    assert bm.stats.evictions == 4
    assert bm.num_free_blocks == 0


def test_a_block_used_again_is_most_recently_used() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, namespace=NS)
    a, b = toks(0, 4), toks(100, 4)
    bm.allocate(1, a, 4)
    bm.cache_full_blocks(1, a, 4)
    bm.allocate(2, b, 4)
    bm.cache_full_blocks(2, b, 4)
    bm.free(1)
    bm.free(2)  # LRU order: 0, 1
    # Sequence 3 reuses block 0 and finishes: block 0 is now more recent than block 1.
    bm.allocate(3, a + [5], 5, bm.find_prefix(a + [5]))
    bm.free(3)
    assert bm.allocate(4, toks(200, 12), 12) == [3, 2, 1]
    assert bm.block_key(0) == prefix_keys(a, BS, NS)[0]
    assert bm.stats.evictions == 1


def test_atomic_failure_leaves_state_untouched() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, namespace=NS)
    prompt = toks(0, 9)
    assert bm.allocate(1, prompt, 9) == [0, 1, 2]
    bm.cache_full_blocks(1, prompt, 9)
    bm.free(1)  # 0 and 1 evictable, 2 and 3 free: 4 blocks an allocation can take

    # 17 tokens with a 2-block hit need 3 new blocks, but reviving the hit leaves only the 2
    # free ones: refused, and nothing is evicted to try.
    longer = prompt + toks(9, 8)
    hit = bm.find_prefix(longer)
    assert hit == PrefixHit([0, 1], 8)
    before = state(bm)
    assert bm.allocate(2, longer, 17, hit) is None
    assert state(bm) == before
    with pytest.raises(UnknownSequenceError):
        bm.block_table(2)

    # One block fewer fits exactly, leaving no room at all.
    assert bm.allocate(2, longer, 16, hit) == [0, 1, 3, 2]
    assert bm.num_free_blocks == 0
    # Growing past the pool is refused the same way.
    before = state(bm)
    assert bm.allocate(2, longer, 17) is None
    assert state(bm) == before


def test_stale_hit_is_refused() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS, namespace=NS)
    prompt = toks(0, 5)
    bm.allocate(1, prompt, 5)
    bm.cache_full_blocks(1, prompt, 5)
    bm.free(1)
    hit = bm.find_prefix(prompt)
    assert hit == PrefixHit([0], 4)
    # Another sequence evicts block 0 between find_prefix and allocate.
    assert bm.allocate(2, toks(100, 12), 12) == [2, 1, 0]
    bm.free(2)
    before = state(bm)
    with pytest.raises(StaleHitError, match=r"hit.block_ids\[0\] \(block 0\)"):
        bm.allocate(3, prompt, 5, hit)
    assert state(bm) == before
    # A hit for other tokens is refused too.
    with pytest.raises(StaleHitError):
        bm.allocate(3, toks(50, 5), 5, PrefixHit([1], 4))
    with pytest.raises(StaleHitError, match="num_tokens"):
        bm.allocate(3, prompt, 5, PrefixHit([0], 3))


def test_prefix_caching_off() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, namespace=NS, enable_prefix_caching=False)
    prompt = toks(0, 9)
    assert bm.allocate(1, prompt, 9) == [0, 1, 2]
    bm.cache_full_blocks(1, prompt, 9)
    assert bm.keys_of(1) == []
    assert all(bm.block_key(b) is None for b in range(4))
    bm.free(1)
    assert bm.num_evictable_blocks == 0
    assert bm.find_prefix(prompt) == PrefixHit([], 0)
    s = bm.stats
    assert (s.prefix_queries, s.prefix_query_tokens, s.prefix_hit_tokens) == (1, 9, 0)
    assert s.cached_blocks == 0
    # The same prompt gets fresh blocks (3, then the released 2 and 1).
    assert bm.allocate(2, prompt, 9, bm.find_prefix(prompt)) == [3, 2, 1]


def test_duplicate_key_keeps_the_first_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, namespace=NS)
    prompt = toks(0, 9)
    # Both admitted before either was computed: no hit for the second one.
    assert bm.allocate(1, prompt, 9) == [0, 1, 2]
    assert bm.allocate(2, prompt, 9, bm.find_prefix(prompt)) == [3, 4, 5]
    bm.cache_full_blocks(1, prompt, 9)
    bm.cache_full_blocks(2, prompt, 9)

    keys = prefix_keys(prompt, BS, NS)
    assert bm.keys_of(2) == keys == bm.keys_of(1)
    assert [bm.block_key(b) for b in range(6)] == [keys[0], keys[1], None, None, None, None]
    assert bm.stats.cached_blocks == 2

    # The duplicates are private: released, they go back to free, not to the cache.
    bm.free(2)
    assert bm.num_evictable_blocks == 0
    bm.free(1)
    assert bm.num_evictable_blocks == 2
    assert bm.find_prefix(prompt) == PrefixHit([0, 1], 8)


def test_keys_follow_the_store_scheme_incrementally() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, namespace=NS)
    prompt = toks(1000, 14)
    bm.allocate(1, prompt, 14)
    bm.cache_full_blocks(1, prompt, 3)
    assert bm.keys_of(1) == []
    bm.cache_full_blocks(1, prompt, 9)
    key0 = chain_key(namespace_root(NS), prompt[:4])
    assert bm.keys_of(1) == [key0, chain_key(key0, prompt[4:8])]
    bm.cache_full_blocks(1, prompt, 5)  # below what is cached: no-op
    bm.cache_full_blocks(1, prompt, 14)
    assert bm.keys_of(1) == prefix_keys(prompt, BS, NS)
    assert [bm.block_key(b) for b in bm.block_table(1)] == [*prefix_keys(prompt, BS, NS), None]


def test_different_namespaces_never_share() -> None:
    prompt = toks(0, 9)
    a = BlockManager(num_blocks=4, block_size=BS, namespace="tenant-a")
    b = BlockManager(num_blocks=4, block_size=BS, namespace="tenant-b")
    for bm in (a, b):
        bm.allocate(1, prompt, 9)
        bm.cache_full_blocks(1, prompt, 9)
    assert a.keys_of(1) == prefix_keys(prompt, BS, "tenant-a")
    assert b.keys_of(1) == prefix_keys(prompt, BS, "tenant-b")
    assert not set(a.keys_of(1)) & set(b.keys_of(1))
    # Only what a manager computed in its own namespace is ever found there.
    fresh_b = BlockManager(num_blocks=4, block_size=BS, namespace="tenant-b")
    assert fresh_b.find_prefix(prompt) == PrefixHit([], 0)
    assert b.find_prefix(prompt) == PrefixHit([0, 1], 8)


# --- copy-on-write ---------------------------------------------------------------------------


def test_copy_on_write_after_fork() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, namespace=NS)
    prompt = toks(0, 6)
    assert bm.allocate(1, prompt, 6) == [0, 1]
    bm.cache_full_blocks(1, prompt, 6)
    bm.fork(1, 2)
    assert bm.block_table(2) == [0, 1]
    assert (bm.refcount(0), bm.refcount(1)) == (2, 2)
    assert bm.keys_of(2) == bm.keys_of(1)

    # Both sample token 6, which lands in the shared partial block 1. The first to allocate
    # gets a copy (block 2); the other then holds block 1 alone and writes in place.
    assert bm.allocate(1, prompt + [61], 7) == [0, 2]
    assert (bm.refcount(0), bm.refcount(1), bm.refcount(2)) == (2, 1, 1)
    assert bm.allocate(2, prompt + [62], 7) == [0, 1]
    assert bm.take_copies() == [(1, 2)]
    assert bm.take_copies() == []

    # Filling and crossing the block boundary copies nothing more: nothing is shared.
    assert bm.allocate(1, prompt + [61, 71, 81], 9) == [0, 2, 3]
    assert bm.allocate(2, prompt + [62, 72, 82], 9) == [0, 1, 4]
    assert bm.take_copies() == []
    assert bm.num_free_blocks == 3

    # Sequence 3 forks from 2 at 9 tokens: block 4 holds one token and is shared. Sequence 2
    # grows by a chunk of 4: its copy of block 4 (5) leads, then one new block (6).
    bm.fork(2, 3)
    assert bm.allocate(3, prompt + [62, 72, 82], 9) == [0, 1, 4]  # no-op
    assert bm.allocate(2, toks(0, 13), 13) == [0, 1, 5, 6]
    assert bm.take_copies() == [(4, 5)]
    assert (bm.refcount(4), bm.refcount(5), bm.refcount(6)) == (1, 1, 1)
    assert bm.num_free_blocks == 1


def test_fork_at_a_block_boundary_copies_nothing() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, namespace=NS)
    assert bm.allocate(1, toks(0, 8), 8) == [0, 1]  # both blocks full
    bm.fork(1, 2)
    # Token 8 starts a new block for each: the shared full blocks are only read.
    assert bm.allocate(1, toks(0, 9), 9) == [0, 1, 2]
    assert bm.allocate(2, toks(0, 9), 9) == [0, 1, 3]
    assert bm.take_copies() == []
    assert [bm.refcount(b) for b in range(4)] == [2, 2, 1, 1]


def test_copy_source_stays_pinned_until_taken() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, namespace=NS)
    prompt = toks(0, 6)
    bm.allocate(1, prompt, 6)
    bm.fork(1, 2)
    assert bm.allocate(1, prompt + [6], 7) == [0, 2]
    # The sibling is preempted in the same step: block 1 has no table, but the queued copy
    # still reads it, so it is neither free nor handed out.
    bm.free(2)
    assert bm.refcount(1) == 0
    assert bm.num_free_blocks == 1  # only block 3
    assert bm.num_referenced_blocks == 3
    assert bm.allocate(3, toks(100, 8), 8) is None
    assert bm.take_copies() == [(1, 2)]
    assert bm.num_free_blocks == 2
    assert bm.allocate(3, toks(100, 8), 8) == [3, 1]


def test_copy_into_a_released_block_is_dropped() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, namespace=NS)
    prompt = toks(0, 6)
    bm.allocate(1, prompt, 6)
    bm.fork(1, 2)
    assert bm.allocate(1, prompt + [6], 7) == [0, 2]
    # The sequence that copied is preempted before the copy ran: the copy is dropped.
    bm.free(1)
    assert bm.take_copies() == []
    assert (bm.refcount(0), bm.refcount(1), bm.refcount(2)) == (1, 1, 0)
    assert bm.num_free_blocks == 2


def test_chained_copies_keep_their_intermediate_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, namespace=NS)
    prompt = toks(0, 5)
    bm.allocate(1, prompt, 5)  # [0, 1]
    bm.fork(1, 2)
    assert bm.allocate(1, toks(0, 6), 6) == [0, 2]  # copy (1, 2)
    bm.fork(1, 3)  # shares block 2 before the copy into it has run
    assert bm.allocate(1, toks(0, 7), 7) == [0, 3]  # copy (2, 3)
    # Block 2's only other holder goes: the copy into it stays, since (2, 3) reads it.
    bm.free(3)
    assert bm.refcount(2) == 0
    assert bm.take_copies() == [(1, 2), (2, 3)]
    assert bm.num_free_blocks == 5  # 2 came back with the copies taken

    # The same chain again, and this time the readers of both copies go: both are dropped
    # and the first source, still held by a sibling, is merely unpinned.
    bm.fork(2, 5)  # sequence 2 holds [0, 1] with 5 tokens
    assert bm.allocate(2, toks(0, 6), 6) == [0, 4]  # copy (1, 4)
    bm.fork(2, 6)
    assert bm.allocate(2, toks(0, 7), 7) == [0, 5]  # copy (4, 5)
    bm.free(6)
    assert bm.num_free_blocks == 3  # 4 is still pinned by (4, 5)
    bm.free(2)
    assert bm.take_copies() == []
    assert bm.num_free_blocks == 5
    assert (bm.refcount(1), bm.refcount(4), bm.refcount(5)) == (1, 0, 0)
    assert bm.block_table(5) == [0, 1]


def test_fork_then_free_parent() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, namespace=NS)
    prompt = toks(0, 10)
    bm.allocate(1, prompt, 10)
    bm.cache_full_blocks(1, prompt, 10)
    bm.fork(1, 2)
    bm.free(1)
    # The child holds everything alone: nothing evictable, nothing freed.
    assert bm.block_table(2) == [0, 1, 2]
    assert [bm.refcount(b) for b in (0, 1, 2)] == [1, 1, 1]
    assert bm.num_free_blocks == 5
    # It writes into the partial block in place.
    assert bm.allocate(2, prompt + [10], 11) == [0, 1, 2]
    assert bm.take_copies() == []
    bm.free(2)
    assert bm.num_evictable_blocks == 2
    assert bm.num_free_blocks == 8


# --- misuse ----------------------------------------------------------------------------------


def test_misuse_raises_typed_errors() -> None:
    for kwargs, match in [
        ({"num_blocks": 0, "block_size": 4}, "num_blocks"),
        ({"num_blocks": -1, "block_size": 4}, "num_blocks"),
        ({"num_blocks": 4, "block_size": 0}, "block_size"),
    ]:
        with pytest.raises(BlockRequestError, match=match):
            BlockManager(namespace=NS, **kwargs)
    with pytest.raises(InvalidKeyError, match="namespace"):
        BlockManager(4, BS, "")

    bm = BlockManager(num_blocks=4, block_size=BS, namespace=NS)
    prompt = toks(0, 6)
    with pytest.raises(BlockRequestError, match="num_tokens"):
        bm.allocate(1, prompt, -1)
    with pytest.raises(BlockRequestError, match=r"num_tokens \(7\) exceeds len\(token_ids\)"):
        bm.allocate(1, prompt, 7)
    bm.allocate(1, prompt, 5)
    with pytest.raises(BlockRequestError, match="hit given for seq_id 1"):
        bm.allocate(1, prompt, 6, PrefixHit([], 0))
    with pytest.raises(BlockRequestError, match="exceeds the 5 tokens allocated"):
        bm.cache_full_blocks(1, prompt, 6)
    with pytest.raises(UnknownSequenceError, match="seq_id 9"):
        bm.cache_full_blocks(9, prompt, 4)
    with pytest.raises(UnknownSequenceError, match="parent_id 9"):
        bm.fork(9, 2)
    with pytest.raises(BlockRequestError, match="child_id 1"):
        bm.fork(1, 1)
    with pytest.raises(BlockRequestError, match="block_id 4"):
        bm.refcount(4)
    with pytest.raises(BlockRequestError, match="block_id -1"):
        bm.block_key(-1)
    with pytest.raises(UnknownSequenceError):
        bm.keys_of(9)
    # The whole tree is catchable as the engine's errors and as the builtin kinds.
    assert issubclass(UnknownSequenceError, KeyError)
    assert issubclass(BlockRequestError, ValueError)
    assert issubclass(StaleHitError, EngineError)


# --- the state machine -----------------------------------------------------------------------

M_BLOCKS = 12
M_BS = 2
TOKEN = st.integers(0, 2)  # a small alphabet, so prompts share prefixes often
PROMPT = st.lists(TOKEN, min_size=1, max_size=9)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admissions (with and without hits), growth, forward passes, caching, forks,
    frees and lookups. The model keeps the KV memory itself: a forward pass applies the
    queued copies, then writes each sequence's new tokens into its blocks' slots, so a wrong
    share, copy or hit shows up as a sequence reading back tokens it never had."""

    def __init__(self) -> None:
        super().__init__()
        self.caching = True
        self.bm = BlockManager(M_BLOCKS, M_BS, NS)
        self.ids = itertools.count()
        self.tokens: dict[int, list[int]] = {}
        self.allocated: dict[int, int] = {}
        self.written: dict[int, int] = {}
        self.pending: dict[int, tuple[int, int]] = {}  # seq -> tokens to write next forward
        self.num_keys: dict[int, int] = {}
        self.family: dict[int, int] = {}  # forks share a family; hits share only keyed blocks
        self.memory: list[list[int | None]] = [[None] * M_BS for _ in range(M_BLOCKS)]
        self.origin: dict[int, bytes] = {}  # block -> chained key of the prefix written into it
        self.evictions = 0
        self.history: list[list[int]] = []  # token lists seen, so new prompts can share them

    @initialize(caching=st.sampled_from([True, True, True, False]))
    def setup(self, caching: bool) -> None:
        self.caching = caching
        self.bm = BlockManager(M_BLOCKS, M_BS, NS, enable_prefix_caching=caching)

    # --- model helpers ---

    def taken(self, count: int, revived: set[int]) -> tuple[list[int], int] | None:
        """The blocks the next `count` takes must be (free FIFO, then LRU cached minus the
        hit being revived) and how many of them are evictions; None if they do not fit."""
        free = list(self.bm._free)
        lru = [b for b in self.bm._evictable if b not in revived]
        if count > len(free) + len(lru):
            return None
        return (free + lru)[:count], max(0, count - len(free))

    def check_find_prefix(self, tokens: Sequence[int]) -> PrefixHit:
        before = self.bm.stats
        hit = self.bm.find_prefix(tokens)
        max_blocks = max(0, (len(tokens) - 1) // M_BS)
        cached = {k: b for b in range(M_BLOCKS) if (k := self.bm.block_key(b)) is not None}
        expected: list[int] = []
        if self.caching:
            for key in prefix_keys(tokens, M_BS, NS)[:max_blocks]:
                if key not in cached:
                    break
                expected.append(cached[key])
        assert hit == PrefixHit(expected, len(expected) * M_BS)
        for i, block_id in enumerate(hit.block_ids):
            assert self.memory[block_id] == list(tokens[i * M_BS : (i + 1) * M_BS])
        after = self.bm.stats
        assert after.prefix_queries == before.prefix_queries + 1
        assert after.prefix_query_tokens == before.prefix_query_tokens + len(tokens)
        assert after.prefix_hit_tokens == before.prefix_hit_tokens + hit.num_tokens
        return hit

    def live(self, data: st.DataObject, idle_only: bool = False) -> int:
        ids = sorted(s for s in self.tokens if not (idle_only and s in self.pending))
        return data.draw(st.sampled_from(ids))

    # --- rules ---

    def draw_prompt(self, data: st.DataObject) -> list[int]:
        """A fresh prompt, or (mostly) most of a token list seen before plus a suffix."""
        if not self.history or data.draw(st.integers(0, 3)) == 0:
            return data.draw(PROMPT)
        base = data.draw(st.sampled_from(self.history[-8:]))
        cut = data.draw(st.integers(len(base) // 2, len(base)))
        prompt = base[:cut] + data.draw(st.lists(TOKEN, max_size=3))
        return prompt or [0]

    @rule(data=st.data(), use_hit=st.sampled_from([True, True, True, False]))
    def admit(self, data: st.DataObject, use_hit: bool) -> None:
        prompt = self.draw_prompt(data)
        self.history.append(prompt)
        hit = self.check_find_prefix(prompt) if use_hit else None
        num_tokens = data.draw(st.integers(0, len(prompt)))
        hit_blocks = hit.block_ids if hit else []
        covered = max(num_tokens, len(hit_blocks) * M_BS)
        expected = self.taken(ceil_div(covered, M_BS) - len(hit_blocks), set(hit_blocks))
        before = state(self.bm)
        seq_id = next(self.ids)
        table = self.bm.allocate(seq_id, prompt, num_tokens, hit)
        event(f"admit: hit {len(hit_blocks)} blocks, {'refused' if expected is None else 'ok'}")
        if expected is None:
            assert table is None
            assert state(self.bm) == before
            if self.tokens:  # make room for the next one, as a scheduler would
                self.free_seq(min(self.tokens))
            return
        new_blocks, evicted = expected
        event(f"admit: {evicted} evicted")
        assert table == hit_blocks + new_blocks
        self.evictions += evicted
        self.tokens[seq_id] = list(prompt)
        self.allocated[seq_id] = covered
        self.written[seq_id] = len(hit_blocks) * M_BS
        self.num_keys[seq_id] = len(hit_blocks)
        self.family[seq_id] = seq_id
        if covered > self.written[seq_id]:
            self.pending[seq_id] = (self.written[seq_id], covered)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(TOKEN, max_size=3), preempt=st.booleans())
    def grow(self, data: st.DataObject, extra: list[int], preempt: bool) -> None:
        """A chunk of prefill or decode; refused, the scheduler may preempt another sequence
        (before the step's copies ran, so a copy's source or target may lose its holder)."""
        seq_id = self.live(data)
        self.tokens[seq_id] += extra  # decoding appends; allocated tokens never change
        num_tokens = data.draw(st.integers(0, len(self.tokens[seq_id])))
        if not self.allocate_more(seq_id, num_tokens) and preempt and len(self.tokens) > 1:
            others = sorted(s for s in self.tokens if s != seq_id)
            self.free_seq(data.draw(st.sampled_from(others)))

    def allocate_more(self, seq_id: int, num_tokens: int) -> bool:
        """allocate() for a running sequence, checked against the expected table."""
        tokens = self.tokens[seq_id]
        covered = self.allocated[seq_id]
        table0 = self.bm.block_table(seq_id)
        before = state(self.bm)
        if num_tokens <= covered:
            assert self.bm.allocate(seq_id, tokens, num_tokens) == table0
            assert state(self.bm) == before
            return True
        cow = covered % M_BS != 0 and self.bm.refcount(table0[-1]) > 1
        expected = self.taken(ceil_div(num_tokens, M_BS) - len(table0) + cow, set())
        table = self.bm.allocate(seq_id, tokens, num_tokens)
        event(f"grow: cow={cow}, {'refused' if expected is None else 'ok'}")
        if expected is None:
            assert table is None
            assert state(self.bm) == before
            return False
        new_blocks, evicted = expected
        if cow:
            assert table == table0[:-1] + new_blocks
            assert self.bm._copies[-1] == (table0[-1], new_blocks[0])
        else:
            assert table == table0 + new_blocks
        self.evictions += evicted
        start = self.pending[seq_id][0] if seq_id in self.pending else covered
        self.pending[seq_id] = (start, num_tokens)
        self.allocated[seq_id] = num_tokens
        return True

    @rule(cache_all=st.booleans())
    def step(self, cache_all: bool) -> None:
        """An engine step: the forward pass, then (if cache_all) every full block registered,
        as the engine does; else the `cache` rule registers some, some time later."""
        self.forward()
        if not cache_all:
            return
        for seq_id, tokens in self.tokens.items():
            self.bm.cache_full_blocks(seq_id, tokens, self.written[seq_id])
            if self.caching:
                self.num_keys[seq_id] = max(self.num_keys[seq_id], self.written[seq_id] // M_BS)

    def forward(self) -> None:
        """What the runner does each step: the queued copies, then the new tokens' KV."""
        for src, dst in self.bm.take_copies():
            self.memory[dst] = list(self.memory[src])
            if src in self.origin:
                self.origin[dst] = self.origin[src]
            else:
                self.origin.pop(dst, None)
        for seq_id, (start, stop) in self.pending.items():
            table = self.bm.block_table(seq_id)
            tokens = self.tokens[seq_id]
            for i in range(start, stop):
                self.memory[table[i // M_BS]][i % M_BS] = tokens[i]
            keys = prefix_keys(tokens[:stop], M_BS, NS)
            for j in range(start // M_BS, stop // M_BS):
                self.origin[table[j]] = keys[j]
            self.written[seq_id] = stop
        self.pending.clear()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        seq_id = self.live(data)
        num_tokens = data.draw(st.integers(0, self.written[seq_id]))
        self.bm.cache_full_blocks(seq_id, self.tokens[seq_id], num_tokens)
        if self.caching:
            self.num_keys[seq_id] = max(self.num_keys[seq_id], num_tokens // M_BS)

    @precondition(lambda self: any(s not in self.pending for s in self.tokens))
    @rule(data=st.data(), decode=st.booleans())
    def fork(self, data: st.DataObject, decode: bool) -> None:
        """n > 1 sampling; with decode, both then sample one token each, as the next step
        does (the first into a shared partial block copies it)."""
        parent = self.live(data, idle_only=True)  # forks happen after the forward pass
        child = next(self.ids)
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        for book in (self.allocated, self.written, self.num_keys, self.family):
            book[child] = book[parent]
        if not decode:
            return
        for seq_id in data.draw(st.permutations([parent, child])):
            tokens = self.tokens[seq_id]
            num_tokens = self.allocated[seq_id] + 1
            if num_tokens > len(tokens):
                tokens.append(data.draw(TOKEN))
            self.allocate_more(seq_id, num_tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.free_seq(self.live(data))

    def free_seq(self, seq_id: int) -> None:
        self.bm.free(seq_id)
        self.history.append(self.tokens[seq_id])
        for book in (self.tokens, self.allocated, self.written, self.num_keys, self.family):
            del book[seq_id]
        self.pending.pop(seq_id, None)

    # --- invariants ---

    @invariant()
    def capacity_is_partitioned(self) -> None:
        bm = self.bm
        free, lru = list(bm._free), list(bm._evictable)
        referenced = [b for b in range(M_BLOCKS) if bm.refcount(b) or bm._pins[b]]
        assert len(set(free)) == len(free)
        assert sorted(free + lru + referenced) == list(range(M_BLOCKS))
        assert bm.num_free_blocks == len(free) + len(lru)
        assert bm.num_free_blocks + bm.num_referenced_blocks == M_BLOCKS
        assert all(bm.block_key(b) is not None for b in lru)
        assert all(bm.block_key(b) is None for b in free)

    @invariant()
    def refcounts_count_tables(self) -> None:
        holders: Counter[int] = Counter()
        for seq_id in self.tokens:
            table = self.bm.block_table(seq_id)
            assert len(set(table)) == len(table)
            assert len(table) == ceil_div(self.allocated[seq_id], M_BS)
            holders.update(table)
        assert [self.bm.refcount(b) for b in range(M_BLOCKS)] == [
            holders[b] for b in range(M_BLOCKS)
        ]

    @invariant()
    def shared_only_through_hits_and_forks(self) -> None:
        seen: dict[int, tuple[int, int]] = {}  # block -> (seq, position)
        for seq_id in self.tokens:
            for pos, block_id in enumerate(self.bm.block_table(seq_id)):
                if block_id in seen:
                    other, other_pos = seen[block_id]
                    assert pos == other_pos
                    same_family = self.family[other] == self.family[seq_id]
                    assert same_family or self.bm.block_key(block_id) is not None
                seen[block_id] = (seq_id, pos)

    @invariant()
    def keys_are_the_store_keys(self) -> None:
        bm = self.bm
        keyed = {b: k for b in range(M_BLOCKS) if (k := bm.block_key(b)) is not None}
        assert len(set(keyed.values())) == len(keyed)
        assert bm._key_to_block == {k: b for b, k in keyed.items()}
        for block_id, key in keyed.items():
            assert self.origin.get(block_id) == key  # written under exactly that prefix
        for seq_id, tokens in self.tokens.items():
            expected = prefix_keys(tokens, M_BS, NS)[: self.num_keys[seq_id]]
            assert bm.keys_of(seq_id) == expected
        assert bm.stats.cached_blocks == len(keyed)
        assert bm.stats.evictions == self.evictions
        assert bm.stats.free_blocks == bm.num_free_blocks

    @invariant()
    def queued_copies_read_live_blocks(self) -> None:
        bm = self.bm
        pins: Counter[int] = Counter(src for src, _ in bm._copies)
        assert [bm._pins[b] for b in range(M_BLOCKS)] == [pins[b] for b in range(M_BLOCKS)]
        for src, dst in bm._copies:
            assert src != dst
            assert bm.refcount(dst) >= 1  # someone will read the copy
            assert src not in bm._free and src not in bm._evictable

    @invariant()
    def every_sequence_reads_back_its_tokens(self) -> None:
        memory = [list(slots) for slots in self.memory]
        for src, dst in self.bm._copies:  # as the runner will before the next forward
            memory[dst] = list(memory[src])
        for seq_id, tokens in self.tokens.items():
            table = self.bm.block_table(seq_id)
            got = [memory[table[i // M_BS]][i % M_BS] for i in range(self.written[seq_id])]
            assert got == tokens[: self.written[seq_id]]


BlockManagerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=60, deadline=None
)
test_block_manager_machine = BlockManagerMachine.TestCase


def test_reset_prefix_cache_forgets_only_unreferenced_blocks() -> None:
    bm = BlockManager(8, 4, "ns")
    held, done = list(range(10, 19)), list(range(30, 39))
    assert bm.allocate(1, held, 9) is not None and bm.allocate(2, done, 9) is not None
    bm.cache_full_blocks(1, held, 9)
    bm.cache_full_blocks(2, done, 9)
    bm.free(2)  # its 2 full blocks become cached-unreferenced, its partial one free
    assert bm.reset_prefix_cache() == 2
    assert bm.find_prefix(done).num_tokens == 0
    assert bm.find_prefix(held).num_tokens == 8  # seq 1 still holds its keyed blocks
    assert bm.num_free_blocks == 5 and bm.stats.cached_blocks == 2
