"""The engine's block manager: allocation, prefix caching on the store's chained keys, LRU
reuse of cached blocks released tail first, and copy-on-write after forks.

Narrated scenarios in the style of vLLM's kv_offload LRU tests, each asserting exact block
ids and the exact eviction order, then a hypothesis state machine that simulates the KV
memory itself (copies applied, tokens written into slots) and checks the books after every
step: the capacity partition, refcounts, keys, sharing, queued copies and what each sequence
reads back.

Keys are the caller's, as in the scheduler: a token list's chained block keys come from
`extend_keys` (or, as expected values, from the store's `prefix_keys`) and are passed to
`find_prefix` and `cache_full_blocks`; `allocate` takes only a token count.
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

from kvstore.engine import block_manager
from kvstore.engine.block_manager import (
    BlockManager,
    BlockRequestError,
    PrefixHit,
    StaleHitError,
    UnknownSequenceError,
)
from kvstore.engine.errors import EngineError
from kvstore.keys import BlockKey, InvalidKeyError, chain_key, namespace_root, prefix_keys

NS = "ns"
BS = 4


def toks(start: int, count: int) -> list[int]:
    """count distinct token ids from start: sequences built from disjoint ranges share
    nothing, so every hit in a scenario is one the scenario set up."""
    return list(range(start, start + count))


def keys_for(token_ids: Sequence[int], namespace: str = NS) -> list[BlockKey]:
    """The store's chained keys of token_ids' full blocks: what a sequence carries."""
    return prefix_keys(token_ids, BS, namespace)


def find(bm: BlockManager, token_ids: Sequence[int]) -> PrefixHit:
    """find_prefix as the scheduler calls it: the list's keys from extend_keys, its length."""
    return bm.find_prefix(bm.extend_keys([], token_ids), len(token_ids))


def hit_of(token_ids: Sequence[int], block_ids: list[int], namespace: str = NS) -> PrefixHit:
    """The PrefixHit find_prefix returns when token_ids' first len(block_ids) blocks are
    cached in block_ids: their token count and their keys with them."""
    num_blocks = len(block_ids)
    return PrefixHit(block_ids, num_blocks * BS, keys_for(token_ids, namespace)[:num_blocks])


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

    # 10 tokens take ceil(10 / 4) = 3 blocks, the lowest ids first.
    assert bm.allocate(1, 10) == [0, 1, 2]
    assert [bm.refcount(b) for b in range(4)] == [1, 1, 1, 0]
    assert bm.num_free_blocks == 5
    assert bm.num_referenced_blocks == 3

    # Growing within the last block takes nothing; crossing into a fourth block takes one.
    assert bm.allocate(1, 12) == [0, 1, 2]
    assert bm.allocate(1, 13) == [0, 1, 2, 3]
    # Asking for fewer tokens than the table covers is a no-op.
    assert bm.allocate(1, 5) == [0, 1, 2, 3]

    # Nothing was cached, so every block goes back to the free pool, tail first.
    bm.free(1)
    assert bm.num_free_blocks == 8
    assert bm.num_evictable_blocks == 0
    assert all(bm.refcount(b) == 0 and bm.block_key(b) is None for b in range(8))
    with pytest.raises(UnknownSequenceError, match="seq_id 1 has no block table"):
        bm.block_table(1)
    bm.free(1)  # an unknown sequence: no-op

    # The pool is FIFO: the never-used blocks 4..7 first, then 3, 2, 1, 0 as released.
    assert bm.allocate(2, 32) == [4, 5, 6, 7, 3, 2, 1, 0]
    assert bm.num_free_blocks == 0
    assert bm.allocate(3, 1) is None


def test_allocate_empty_and_zero_tokens() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS, namespace=NS)
    hit = bm.find_prefix(bm.extend_keys([], []), 0)
    assert hit == PrefixHit([], 0)
    assert bm.allocate(1, 0, hit) == []
    assert bm.block_table(1) == []
    assert bm.allocate(1, 1) == [0]


# --- prefix caching --------------------------------------------------------------------------


def test_prefix_hit_after_first_sequence_finished() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, namespace=NS)
    prompt = toks(0, 10)
    # The prompt's keys are computed once, when its tokens are known, and carried with it.
    prompt_keys = bm.extend_keys([], prompt)

    assert bm.allocate(1, 10) == [0, 1, 2]
    bm.cache_full_blocks(1, prompt_keys, 10)
    # Two full blocks are keyed under the store's chained keys; the partial third is not.
    keys = prefix_keys(prompt, BS, NS)
    assert prompt_keys == keys
    assert bm.keys_of(1) == keys
    assert [bm.block_key(b) for b in range(3)] == [keys[0], keys[1], None]
    assert bm.stats.cached_blocks == 2

    bm.free(1)
    # The keyed blocks stay cached (evictable); the partial one returns to the free pool.
    assert bm.num_evictable_blocks == 2
    assert bm.num_free_blocks == 8
    assert bm.block_key(0) == keys[0]

    # The same prompt again: blocks 0 and 1 are found, 8 of its 10 tokens.
    hit = bm.find_prefix(prompt_keys, len(prompt))
    assert hit == PrefixHit([0, 1], 8, keys[:2])
    s = bm.stats
    assert (s.prefix_queries, s.prefix_query_tokens, s.prefix_hit_tokens) == (1, 10, 8)

    # The hit leads the table, the rest comes from the free pool (3 is next there).
    assert bm.allocate(2, 10, hit) == [0, 1, 3]
    assert [bm.refcount(b) for b in (0, 1, 3)] == [1, 1, 1]
    assert bm.num_evictable_blocks == 0
    assert bm.keys_of(2) == keys
    assert bm.num_free_blocks == 5


def test_prefix_hit_never_covers_the_whole_prompt() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, namespace=NS)
    prompt = toks(0, 8)  # exactly two full blocks
    keys = bm.extend_keys([], prompt)
    bm.allocate(1, 8)
    bm.cache_full_blocks(1, keys, 8)
    assert bm.keys_of(1) == prefix_keys(prompt, BS, NS)

    # Both blocks are cached, yet the last token must be computed for its logits: one block.
    assert bm.find_prefix(keys, 8) == hit_of(prompt, [0])
    # One more token (the same two full-block keys) and both blocks can be used.
    assert find(bm, prompt + [99]) == hit_of(prompt, [0, 1])
    assert bm.find_prefix(keys, 9) == hit_of(prompt, [0, 1])
    assert find(bm, prompt[:4]) == PrefixHit([], 0)
    assert bm.stats.prefix_hit_tokens == 20


def test_partial_hits_with_divergent_suffix() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS, namespace=NS)
    prompt = toks(0, 12)
    assert bm.allocate(1, 12) == [0, 1, 2]
    bm.cache_full_blocks(1, keys_for(prompt), 12)

    # Diverging at token 5 (inside block 1): only block 0 matches.
    other = prompt[:5] + [500] + prompt[6:]
    assert find(bm, other) == hit_of(prompt, [0])
    # Diverging at the very last token of block 1: still only block 0, since a chained key
    # covers the whole block.
    other2 = prompt[:7] + [700] + prompt[8:]
    hit = find(bm, other2)
    assert hit == hit_of(prompt, [0])
    # Diverging in block 0 invalidates every later block, even identical ones (the chain).
    assert find(bm, [900] + prompt[1:]) == PrefixHit([], 0)

    # Sequence 1 is still running: block 0 is shared by both tables.
    assert bm.allocate(2, 12, hit) == [0, 3, 4]
    assert bm.refcount(0) == 2
    bm.cache_full_blocks(2, keys_for(other2), 12)
    assert bm.keys_of(2)[0] == bm.keys_of(1)[0]
    assert bm.keys_of(2)[1] != bm.keys_of(1)[1]
    assert bm.block_key(3) == prefix_keys(other2, BS, NS)[1]

    # Releasing one holder keeps block 0 referenced by the other.
    bm.free(1)
    assert bm.refcount(0) == 1
    assert bm.num_evictable_blocks == 2  # blocks 1 and 2
    assert find(bm, prompt + [1]) == hit_of(prompt, [0, 1, 2])


def test_eviction_is_lru_with_tail_first_release() -> None:
    bm = BlockManager(num_blocks=7, block_size=BS, namespace=NS)
    a, b = toks(0, 12), toks(100, 8)

    assert bm.allocate(1, 12) == [0, 1, 2]
    bm.cache_full_blocks(1, keys_for(a), 12)
    assert bm.allocate(2, 8) == [3, 4]
    bm.cache_full_blocks(2, keys_for(b), 8)
    # Sequence 1 finishes first, then sequence 2: LRU order is 2, 1, 0 (tail first), 4, 3.
    bm.free(1)
    bm.free(2)
    assert bm.num_evictable_blocks == 5
    assert bm.num_free_blocks == 7

    # 4 blocks for unrelated tokens: the free block 5, 6, then evict 2 and 1 -- the tail of
    # the oldest sequence -- and keep its first block and all of sequence 2.
    assert bm.allocate(3, 16) == [5, 6, 2, 1]
    assert bm.stats.evictions == 2
    assert bm.block_key(2) is None and bm.block_key(1) is None
    assert bm.stats.cached_blocks == 3
    assert find(bm, a + [1]) == hit_of(a, [0])
    assert find(bm, b + [1]) == hit_of(b, [3, 4])

    # A hit revives block 0 (no longer evictable); the next eviction takes 4, then 3. The
    # hit covers exactly the 4 tokens allocated, which is fine.
    hit = find(bm, a)
    assert bm.allocate(4, 4, hit) == [0]
    assert bm.allocate(5, 4) == [4]
    assert bm.allocate(6, 4) == [3]
    assert bm.stats.evictions == 4
    assert bm.num_free_blocks == 0


def test_a_block_used_again_is_most_recently_used() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, namespace=NS)
    a, b = toks(0, 4), toks(100, 4)
    bm.allocate(1, 4)
    bm.cache_full_blocks(1, keys_for(a), 4)
    bm.allocate(2, 4)
    bm.cache_full_blocks(2, keys_for(b), 4)
    bm.free(1)
    bm.free(2)  # LRU order: 0, 1
    # Sequence 3 reuses block 0 and finishes: block 0 is now more recent than block 1.
    bm.allocate(3, 5, find(bm, a + [5]))
    bm.free(3)
    assert bm.allocate(4, 12) == [3, 2, 1]
    assert bm.block_key(0) == prefix_keys(a, BS, NS)[0]
    assert bm.stats.evictions == 1


def test_atomic_failure_leaves_state_untouched() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, namespace=NS)
    prompt = toks(0, 9)
    assert bm.allocate(1, 9) == [0, 1, 2]
    bm.cache_full_blocks(1, keys_for(prompt), 9)
    bm.free(1)  # 0 and 1 evictable, 2 and 3 free: 4 blocks an allocation can take

    # 17 tokens with a 2-block hit need 3 new blocks, but reviving the hit leaves only the 2
    # free ones: refused, and nothing is evicted to try.
    longer = prompt + toks(9, 8)
    hit = find(bm, longer)
    assert hit == hit_of(prompt, [0, 1])
    before = state(bm)
    assert bm.allocate(2, 17, hit) is None
    assert state(bm) == before
    with pytest.raises(UnknownSequenceError):
        bm.block_table(2)

    # One block fewer fits exactly, leaving no room at all.
    assert bm.allocate(2, 16, hit) == [0, 1, 3, 2]
    assert bm.num_free_blocks == 0
    # Growing past the pool is refused the same way.
    before = state(bm)
    assert bm.allocate(2, 17) is None
    assert state(bm) == before


def test_stale_hit_is_refused() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS, namespace=NS)
    prompt = toks(0, 5)
    bm.allocate(1, 5)
    bm.cache_full_blocks(1, keys_for(prompt), 5)
    bm.free(1)
    hit = find(bm, prompt)
    assert hit == hit_of(prompt, [0])
    # Another sequence evicts block 0 between find_prefix and allocate.
    assert bm.allocate(2, 12) == [2, 1, 0]
    bm.free(2)
    before = state(bm)
    with pytest.raises(StaleHitError, match=r"hit.block_ids\[0\] \(block 0\)"):
        bm.allocate(3, 5, hit)
    assert state(bm) == before

    # Block 0 cached again (free FIFO: 0, 1, 2 as released), by a running sequence.
    assert bm.allocate(3, 5) == [0, 1]
    bm.cache_full_blocks(3, keys_for(prompt), 5)
    before = state(bm)
    # A hit whose keys are other tokens' is refused: block 0 does not hold them.
    with pytest.raises(StaleHitError, match=r"hit.block_ids\[0\] \(block 0\) no longer holds"):
        bm.allocate(4, 5, PrefixHit([0], 4, keys_for(toks(50, 5))[:1]))
    # So is one without its keys, or whose token count is not its blocks'.
    with pytest.raises(StaleHitError, match=r"hit.keys \(0\)"):
        bm.allocate(4, 5, PrefixHit([0], 4))
    with pytest.raises(StaleHitError, match="num_tokens"):
        bm.allocate(4, 5, PrefixHit([0], 3, keys_for(prompt)[:1]))
    # A fresh hit covering more than the tokens allocated is refused; exactly as many is fine.
    fresh = find(bm, prompt)
    assert fresh == hit_of(prompt, [0])
    before = state(bm)
    with pytest.raises(StaleHitError, match="hit covers 4 tokens, more than the 3 allocated"):
        bm.allocate(4, 3, fresh)
    assert state(bm) == before
    assert bm.allocate(4, 4, fresh) == [0]
    assert bm.refcount(0) == 2
    assert bm.keys_of(4) == keys_for(prompt)


def test_prefix_caching_off() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, namespace=NS, enable_prefix_caching=False)
    prompt = toks(0, 9)
    assert bm.allocate(1, 9) == [0, 1, 2]
    bm.cache_full_blocks(1, keys_for(prompt), 9)
    assert bm.keys_of(1) == []
    assert all(bm.block_key(b) is None for b in range(4))
    bm.free(1)
    assert bm.num_evictable_blocks == 0
    assert find(bm, prompt) == PrefixHit([], 0)
    s = bm.stats
    assert (s.prefix_queries, s.prefix_query_tokens, s.prefix_hit_tokens) == (1, 9, 0)
    assert s.cached_blocks == 0
    # The same prompt gets fresh blocks (3, then the released 2 and 1).
    assert bm.allocate(2, 9, find(bm, prompt)) == [3, 2, 1]


def test_duplicate_key_keeps_the_first_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, namespace=NS)
    prompt = toks(0, 9)
    # Both admitted before either was computed: no hit for the second one.
    assert bm.allocate(1, 9) == [0, 1, 2]
    assert bm.allocate(2, 9, find(bm, prompt)) == [3, 4, 5]
    bm.cache_full_blocks(1, keys_for(prompt), 9)
    bm.cache_full_blocks(2, keys_for(prompt), 9)

    keys = prefix_keys(prompt, BS, NS)
    assert bm.keys_of(2) == keys == bm.keys_of(1)
    assert [bm.block_key(b) for b in range(6)] == [keys[0], keys[1], None, None, None, None]
    assert bm.stats.cached_blocks == 2

    # The duplicates are private: released, they go back to free, not to the cache.
    bm.free(2)
    assert bm.num_evictable_blocks == 0
    bm.free(1)
    assert bm.num_evictable_blocks == 2
    assert find(bm, prompt) == hit_of(prompt, [0, 1])


def test_keys_follow_the_store_scheme_incrementally() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, namespace=NS)
    prompt = toks(1000, 14)
    bm.allocate(1, 14)
    keys = bm.extend_keys([], prompt[:9])  # the tokens known so far: two full blocks
    bm.cache_full_blocks(1, keys, 3)
    assert bm.keys_of(1) == []
    bm.cache_full_blocks(1, keys, 9)
    key0 = chain_key(namespace_root(NS), prompt[:4])
    assert keys == [key0, chain_key(key0, prompt[4:8])]
    assert bm.keys_of(1) == keys
    bm.cache_full_blocks(1, keys, 5)  # below what is cached: no-op
    assert bm.keys_of(1) == keys
    # The rest of the tokens: one more key, chained onto the ones carried.
    assert bm.extend_keys(keys, prompt) is keys
    bm.cache_full_blocks(1, keys, 14)
    assert bm.keys_of(1) == prefix_keys(prompt, BS, NS)
    assert [bm.block_key(b) for b in bm.block_table(1)] == [*prefix_keys(prompt, BS, NS), None]


def test_different_namespaces_never_share() -> None:
    prompt = toks(0, 9)
    a = BlockManager(num_blocks=4, block_size=BS, namespace="tenant-a")
    b = BlockManager(num_blocks=4, block_size=BS, namespace="tenant-b")
    for bm in (a, b):
        bm.allocate(1, 9)
        bm.cache_full_blocks(1, bm.extend_keys([], prompt), 9)
    assert a.keys_of(1) == keys_for(prompt, "tenant-a")
    assert b.keys_of(1) == keys_for(prompt, "tenant-b")
    assert not set(a.keys_of(1)) & set(b.keys_of(1))
    # Only what a manager computed in its own namespace is ever found there.
    fresh_b = BlockManager(num_blocks=4, block_size=BS, namespace="tenant-b")
    assert find(fresh_b, prompt) == PrefixHit([], 0)
    assert find(b, prompt) == hit_of(prompt, [0, 1], "tenant-b")
    assert b.find_prefix(a.keys_of(1), len(prompt)) == PrefixHit([], 0)


def test_extend_keys_hashes_each_block_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hash once: extending a sequence's keys hashes only its new full blocks, and nothing
    else in the manager hashes at all -- find_prefix, allocate and cache_full_blocks take
    the keys they are given."""
    hashed: list[Sequence[int]] = []
    real_chain_key = chain_key  # kvstore.keys.chain_key, which the manager imported

    def counting_chain_key(parent: BlockKey, block_tokens: Sequence[int]) -> BlockKey:
        hashed.append(list(block_tokens))
        return real_chain_key(parent, block_tokens)

    monkeypatch.setattr(block_manager, "chain_key", counting_chain_key)
    bm = BlockManager(num_blocks=16, block_size=BS, namespace=NS)

    tokens = toks(0, 40)  # 10 full blocks
    keys = bm.extend_keys([], tokens)
    assert hashed == [tokens[i : i + BS] for i in range(0, 40, BS)]
    assert keys == prefix_keys(tokens, BS, NS)

    tokens += toks(40, 6)  # one more full block, and a partial one that is not hashed
    assert bm.extend_keys(keys, tokens) is keys
    assert len(hashed) == 11 and hashed[-1] == toks(40, 4)
    tokens += toks(46, 10)  # the partial block fills, and two more: 14 full blocks
    assert bm.extend_keys(keys, tokens) is keys
    assert len(hashed) == 14 and hashed[-3:] == [toks(44, 4), toks(48, 4), toks(52, 4)]
    assert keys == prefix_keys(tokens, BS, NS)
    bm.extend_keys(keys, tokens)  # no new full block: nothing to hash
    assert len(hashed) == 14

    # The rest of a sequence's life, and a second one that hits, hash nothing more.
    hashed.clear()
    assert bm.allocate(1, 56) is not None
    bm.cache_full_blocks(1, keys, 56)
    bm.fork(1, 2)
    bm.free(1)
    bm.free(2)
    hit = bm.find_prefix(keys, 56)
    assert hit == PrefixHit(list(range(13)), 52, keys[:13])
    assert bm.allocate(3, 56, hit) == [*range(13), 14]  # 14 is free; 13 stays cached
    bm.cache_full_blocks(3, keys, 56)
    assert hashed == []


# --- copy-on-write ---------------------------------------------------------------------------


def test_copy_on_write_after_fork() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, namespace=NS)
    prompt = toks(0, 6)
    assert bm.allocate(1, 6) == [0, 1]
    bm.cache_full_blocks(1, keys_for(prompt), 6)
    bm.fork(1, 2)
    assert bm.block_table(2) == [0, 1]
    assert (bm.refcount(0), bm.refcount(1)) == (2, 2)
    assert bm.keys_of(2) == bm.keys_of(1)

    # Both sample token 6, which lands in the shared partial block 1. The first to allocate
    # gets a copy (block 2); the other then holds block 1 alone and writes in place.
    assert bm.allocate(1, 7) == [0, 2]
    assert (bm.refcount(0), bm.refcount(1), bm.refcount(2)) == (2, 1, 1)
    assert bm.allocate(2, 7) == [0, 1]
    assert bm.take_copies() == [(1, 2)]
    assert bm.take_copies() == []

    # Filling and crossing the block boundary copies nothing more: nothing is shared.
    assert bm.allocate(1, 9) == [0, 2, 3]
    assert bm.allocate(2, 9) == [0, 1, 4]
    assert bm.take_copies() == []
    assert bm.num_free_blocks == 3

    # Sequence 3 forks from 2 at 9 tokens: block 4 holds one token and is shared. Sequence 2
    # grows by a chunk of 4: its copy of block 4 (5) leads, then one new block (6).
    bm.fork(2, 3)
    assert bm.allocate(3, 9) == [0, 1, 4]  # no-op
    assert bm.allocate(2, 13) == [0, 1, 5, 6]
    assert bm.take_copies() == [(4, 5)]
    assert (bm.refcount(4), bm.refcount(5), bm.refcount(6)) == (1, 1, 1)
    assert bm.num_free_blocks == 1


def test_fork_at_a_block_boundary_copies_nothing() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, namespace=NS)
    assert bm.allocate(1, 8) == [0, 1]  # both blocks full
    bm.fork(1, 2)
    # Token 8 starts a new block for each: the shared full blocks are only read.
    assert bm.allocate(1, 9) == [0, 1, 2]
    assert bm.allocate(2, 9) == [0, 1, 3]
    assert bm.take_copies() == []
    assert [bm.refcount(b) for b in range(4)] == [2, 2, 1, 1]


def test_copy_source_stays_pinned_until_taken() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, namespace=NS)
    bm.allocate(1, 6)
    bm.fork(1, 2)
    assert bm.allocate(1, 7) == [0, 2]
    # The sibling is preempted in the same step: block 1 has no table, but the queued copy
    # still reads it, so it is neither free nor handed out.
    bm.free(2)
    assert bm.refcount(1) == 0
    assert bm.num_free_blocks == 1  # only block 3
    assert bm.num_referenced_blocks == 3
    assert bm.allocate(3, 8) is None
    assert bm.take_copies() == [(1, 2)]
    assert bm.num_free_blocks == 2
    assert bm.allocate(3, 8) == [3, 1]


def test_copy_into_a_released_block_is_dropped() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, namespace=NS)
    bm.allocate(1, 6)
    bm.fork(1, 2)
    assert bm.allocate(1, 7) == [0, 2]
    # The sequence that copied is preempted before the copy ran: the copy is dropped.
    bm.free(1)
    assert bm.take_copies() == []
    assert (bm.refcount(0), bm.refcount(1), bm.refcount(2)) == (1, 1, 0)
    assert bm.num_free_blocks == 2


def test_chained_copies_keep_their_intermediate_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, namespace=NS)
    bm.allocate(1, 5)  # [0, 1]
    bm.fork(1, 2)
    assert bm.allocate(1, 6) == [0, 2]  # copy (1, 2)
    bm.fork(1, 3)  # shares block 2 before the copy into it has run
    assert bm.allocate(1, 7) == [0, 3]  # copy (2, 3)
    # Block 2's only other holder goes: the copy into it stays, since (2, 3) reads it.
    bm.free(3)
    assert bm.refcount(2) == 0
    assert bm.take_copies() == [(1, 2), (2, 3)]
    assert bm.num_free_blocks == 5  # 2 came back with the copies taken

    # The same chain again, and this time the readers of both copies go: both are dropped
    # and the first source, still held by a sibling, is merely unpinned.
    bm.fork(2, 5)  # sequence 2 holds [0, 1] with 5 tokens
    assert bm.allocate(2, 6) == [0, 4]  # copy (1, 4)
    bm.fork(2, 6)
    assert bm.allocate(2, 7) == [0, 5]  # copy (4, 5)
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
    bm.allocate(1, 10)
    bm.cache_full_blocks(1, keys_for(prompt), 10)
    bm.fork(1, 2)
    bm.free(1)
    # The child holds everything alone: nothing evictable, nothing freed.
    assert bm.block_table(2) == [0, 1, 2]
    assert [bm.refcount(b) for b in (0, 1, 2)] == [1, 1, 1]
    assert bm.num_free_blocks == 5
    # It writes into the partial block in place.
    assert bm.allocate(2, 11) == [0, 1, 2]
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
    keys = keys_for(toks(0, 6))  # one full block
    with pytest.raises(BlockRequestError, match="num_tokens"):
        bm.allocate(1, -1)
    with pytest.raises(BlockRequestError, match="num_tokens"):
        bm.find_prefix(keys, -1)
    bm.allocate(1, 5)
    with pytest.raises(BlockRequestError, match="hit given for seq_id 1"):
        bm.allocate(1, 6, PrefixHit([], 0))
    with pytest.raises(BlockRequestError, match="exceeds the 5 tokens allocated"):
        bm.cache_full_blocks(1, keys, 6)
    # Keys shorter than the blocks num_tokens fills are refused, and nothing is registered.
    before = state(bm)
    with pytest.raises(BlockRequestError, match=r"fills 1 blocks; keys has 0"):
        bm.cache_full_blocks(1, [], 4)
    with pytest.raises(BlockRequestError, match=r"fills 2 blocks; keys has 1"):
        bm.cache_full_blocks(1, keys, 8)
    with pytest.raises(BlockRequestError, match="num_tokens"):
        bm.cache_full_blocks(1, keys, -1)
    assert state(bm) == before
    with pytest.raises(UnknownSequenceError, match="seq_id 9"):
        bm.cache_full_blocks(9, keys, 4)
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
    share, copy or hit shows up as a sequence reading back tokens it never had. Each sequence
    carries its keys, extended by extend_keys as its tokens grow, as the scheduler does."""

    def __init__(self) -> None:
        super().__init__()
        self.caching = True
        self.bm = BlockManager(M_BLOCKS, M_BS, NS)
        self.ids = itertools.count()
        self.tokens: dict[int, list[int]] = {}
        self.seq_keys: dict[int, list[BlockKey]] = {}  # seq -> its carried chained keys
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

    def check_find_prefix(self, tokens: Sequence[int], keys: list[BlockKey]) -> PrefixHit:
        """find_prefix with the token list's carried keys, against the store's keys of the
        tokens and the blocks that hold them."""
        before = self.bm.stats
        hit = self.bm.find_prefix(keys, len(tokens))
        max_blocks = max(0, (len(tokens) - 1) // M_BS)
        cached = {k: b for b in range(M_BLOCKS) if (k := self.bm.block_key(b)) is not None}
        store_keys = prefix_keys(tokens, M_BS, NS)
        expected: list[int] = []
        if self.caching:
            for key in store_keys[:max_blocks]:
                if key not in cached:
                    break
                expected.append(cached[key])
        assert hit == PrefixHit(expected, len(expected) * M_BS, store_keys[: len(expected)])
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
        keys = self.bm.extend_keys([], prompt)  # hashed once, then carried
        hit = self.check_find_prefix(prompt, keys) if use_hit else None
        hit_blocks = hit.block_ids if hit else []
        hit_tokens = len(hit_blocks) * M_BS
        # As a scheduler asks: at least the hit. Now and then less, which is refused.
        low = 0 if data.draw(st.integers(0, 7)) == 0 else hit_tokens
        num_tokens = data.draw(st.integers(low, len(prompt)))
        before = state(self.bm)
        seq_id = next(self.ids)
        if num_tokens < hit_tokens:
            event("admit: hit covers more than num_tokens")
            with pytest.raises(StaleHitError, match="more than"):
                self.bm.allocate(seq_id, num_tokens, hit)
            assert state(self.bm) == before
            return
        expected = self.taken(ceil_div(num_tokens, M_BS) - len(hit_blocks), set(hit_blocks))
        table = self.bm.allocate(seq_id, num_tokens, hit)
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
        self.seq_keys[seq_id] = keys
        self.allocated[seq_id] = num_tokens
        self.written[seq_id] = hit_tokens
        self.num_keys[seq_id] = len(hit_blocks)
        self.family[seq_id] = seq_id
        if num_tokens > hit_tokens:
            self.pending[seq_id] = (hit_tokens, num_tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(TOKEN, max_size=3), preempt=st.booleans())
    def grow(self, data: st.DataObject, extra: list[int], preempt: bool) -> None:
        """A chunk of prefill or decode; refused, the scheduler may preempt another sequence
        (before the step's copies ran, so a copy's source or target may lose its holder)."""
        seq_id = self.live(data)
        self.tokens[seq_id] += extra  # decoding appends; allocated tokens never change
        self.bm.extend_keys(self.seq_keys[seq_id], self.tokens[seq_id])
        num_tokens = data.draw(st.integers(0, len(self.tokens[seq_id])))
        if not self.allocate_more(seq_id, num_tokens) and preempt and len(self.tokens) > 1:
            others = sorted(s for s in self.tokens if s != seq_id)
            self.free_seq(data.draw(st.sampled_from(others)))

    def allocate_more(self, seq_id: int, num_tokens: int) -> bool:
        """allocate() for a running sequence, checked against the expected table."""
        covered = self.allocated[seq_id]
        table0 = self.bm.block_table(seq_id)
        before = state(self.bm)
        if num_tokens <= covered:
            assert self.bm.allocate(seq_id, num_tokens) == table0
            assert state(self.bm) == before
            return True
        cow = covered % M_BS != 0 and self.bm.refcount(table0[-1]) > 1
        expected = self.taken(ceil_div(num_tokens, M_BS) - len(table0) + cow, set())
        table = self.bm.allocate(seq_id, num_tokens)
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
        for seq_id, keys in self.seq_keys.items():
            self.bm.cache_full_blocks(seq_id, keys, self.written[seq_id])
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
        """Some of a sequence's written blocks registered; now and then with too few keys,
        which is refused and changes nothing."""
        seq_id = self.live(data)
        num_tokens = data.draw(st.integers(0, self.written[seq_id]))
        keys = self.seq_keys[seq_id]
        num_full = num_tokens // M_BS
        if num_full and data.draw(st.integers(0, 7)) == 0:
            event("cache: too few keys")
            short = keys[: data.draw(st.integers(0, num_full - 1))]
            before = state(self.bm)
            with pytest.raises(BlockRequestError, match=f"keys has {len(short)}$"):
                self.bm.cache_full_blocks(seq_id, short, num_tokens)
            assert state(self.bm) == before
            return
        self.bm.cache_full_blocks(seq_id, keys, num_tokens)
        if self.caching:
            self.num_keys[seq_id] = max(self.num_keys[seq_id], num_full)

    @precondition(lambda self: any(s not in self.pending for s in self.tokens))
    @rule(data=st.data(), decode=st.booleans())
    def fork(self, data: st.DataObject, decode: bool) -> None:
        """n > 1 sampling; with decode, both then sample one token each, as the next step
        does (the first into a shared partial block copies it)."""
        parent = self.live(data, idle_only=True)  # forks happen after the forward pass
        child = next(self.ids)
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.seq_keys[child] = list(self.seq_keys[parent])
        for book in (self.allocated, self.written, self.num_keys, self.family):
            book[child] = book[parent]
        if not decode:
            return
        for seq_id in data.draw(st.permutations([parent, child])):
            tokens = self.tokens[seq_id]
            num_tokens = self.allocated[seq_id] + 1
            if num_tokens > len(tokens):
                tokens.append(data.draw(TOKEN))
                self.bm.extend_keys(self.seq_keys[seq_id], tokens)
            self.allocate_more(seq_id, num_tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.free_seq(self.live(data))

    def free_seq(self, seq_id: int) -> None:
        self.bm.free(seq_id)
        self.history.append(self.tokens[seq_id])
        del self.seq_keys[seq_id]
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
            store_keys = prefix_keys(tokens, M_BS, NS)
            assert self.seq_keys[seq_id] == store_keys  # extend_keys kept up with the tokens
            assert bm.keys_of(seq_id) == store_keys[: self.num_keys[seq_id]]
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
    assert bm.allocate(1, 9) is not None and bm.allocate(2, 9) is not None
    bm.cache_full_blocks(1, keys_for(held), 9)
    bm.cache_full_blocks(2, keys_for(done), 9)
    bm.free(2)  # its 2 full blocks become cached-unreferenced, its partial one free
    assert bm.reset_prefix_cache() == 2
    assert find(bm, done).num_tokens == 0
    assert find(bm, held).num_tokens == 8  # seq 1 still holds its keyed blocks
    assert bm.num_free_blocks == 5 and bm.stats.cached_blocks == 2
