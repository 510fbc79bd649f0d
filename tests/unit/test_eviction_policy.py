"""The index's eviction policy (kvstore.core.order, kvstore.core.ghosts): LRU where a block used
again outlives blocks used once, for a bounded time; keys evicted lately come back hot; a put
never evicts its own cached keys. Plain LRU order and leaf-first are in test_index.py; how the
head start is chosen, in test_headstart.py. These fix it at HOT_TURNOVERS."""

from __future__ import annotations

import random

import pytest

from kvstore.core.ghosts import GhostFilter
from kvstore.core.headstart import HeadStart
from kvstore.core.index import Index
from kvstore.core.pages import PageAllocator
from kvstore.keys import BlockKey
from kvstore.tier import Tier
from tests.unit.test_index import NS, PAGE_BYTES, FakeClock, key, names, prepare, put, stored

HOT_TURNOVERS = 8


def make_index(num_pages: int = 4) -> tuple[Index, FakeClock]:
    """One L2 tier with the head start fixed at HOT_TURNOVERS."""
    index = Index({Tier.DRAM: PageAllocator(num_pages)}, {Tier.DRAM: PAGE_BYTES},
                  head_start=HeadStart((HOT_TURNOVERS,), HOT_TURNOVERS))
    return index, FakeClock()


def read(index: Index, *names_: str) -> None:
    index.touch(NS, [key(n) for n in names_])


def test_a_block_read_again_survives_a_scan_that_flushes_plain_lru() -> None:
    index, clock = make_index(num_pages=4)
    put(index, "h")
    read(index, "h")  # used twice: hot
    # A scan of eight blocks used once, two at a time, through a cache of four.
    evicted: list[str] = []
    for pair in ("ab", "cd", "ef", "gi"):
        clock.tick()
        evicted += names(put(index, pair[0]).evicted) + names(put(index, pair[1]).evicted)
    assert "h" in stored(index)
    assert "h" not in evicted
    assert evicted == ["a", "b", "c", "d", "e"]  # the scan evicts itself, oldest first


def test_a_hot_block_unused_for_its_head_start_goes_before_fresh_blocks() -> None:
    # The head start is HOT_TURNOVERS tiers full of touches; after that a hot block is
    # older than blocks used once, and goes first: nothing stays for ever.
    index, clock = make_index(num_pages=2)
    put(index, "h")
    read(index, "h")
    survived = 0
    for round_ in range(HOT_TURNOVERS * 4):
        clock.tick()
        put(index, f"new{round_}")  # used once, one touch each
        if index.get(NS, key("h")) is None:
            break
        survived += 1
    # It outlived exactly HOT_TURNOVERS turnovers of the two-page tier: 2 * HOT_TURNOVERS
    # puts of blocks used once, each evicting the one before it.
    assert survived == HOT_TURNOVERS * 2


def test_a_key_put_again_soon_after_its_eviction_comes_back_hot() -> None:
    index, clock = make_index(num_pages=2)
    put(index, "a")
    clock.tick()
    put(index, "b")
    clock.tick()
    assert names(put(index, "c").evicted) == ["a"]
    clock.tick()
    assert names(put(index, "a").evicted) == ["b"]  # a again: its second use
    clock.tick()
    # c (used once) goes before a, although a is the more recent: a is hot.
    assert names(put(index, "d").evicted) == ["c"]
    clock.tick()
    assert names(put(index, "e").evicted) == ["d"]
    assert stored(index) == {"a", "e"}


def test_a_key_put_again_long_after_its_eviction_comes_back_cold() -> None:
    # The ghost remembers two to four times what the index holds, and at least 4,096 keys.
    index, _ = make_index(num_pages=2)
    put(index, "a")
    index.evict_keys(NS, [key("a")])
    for _ in range(10_000):  # 10,000 removals later
        put(index, "b")
        index.evict_keys(NS, [key("b")])
    put(index, "a")
    assert index.get(NS, key("a")).seen == 1  # type: ignore[union-attr]
    put(index, "b")  # b left just now
    assert index.get(NS, key("b")).seen == 2  # type: ignore[union-attr]


def test_a_put_never_evicts_its_own_cached_keys_to_make_room() -> None:
    index, clock = make_index(num_pages=2)
    put(index, "a")  # the least recent, and a leaf
    clock.tick()
    put(index, "x")
    clock.tick()
    # The chain a -> c: a is cached (existing), c needs one page. Plain LRU would evict
    # a itself and report it as existing; the put holds it and x goes instead.
    plan = prepare(index, ["a", "c"])
    assert plan is not None and plan.existing == [0]
    assert names(plan.evicted) == ["x"]
    assert index.get(NS, key("a")).movable  # type: ignore[union-attr]
    index.complete_store(plan.plan_id, [1], success=True)
    assert stored(index) == {"a", "c"}


def test_a_refused_put_neither_counts_nor_touches_its_cached_keys() -> None:
    index, clock = make_index(num_pages=2)
    put(index, "a")
    clock.tick()
    put(index, "x")
    index.leases.set_pinned(NS, [key("x")], True)
    # a, c, d needs two more pages; only a (held) and x (pinned) are there: refused.
    assert prepare(index, ["a", "c", "d"]) is None
    entry = index.get(NS, key("a"))
    assert entry is not None and entry.seen == 1 and entry.movable
    index.leases.set_pinned(NS, [key("x")], False)
    assert names(index.evict_in_order(Tier.DRAM, None)) == ["a", "x"]


# --- the ghost filter ------------------------------------------------------------------------


def keys_(n: int, seed: int) -> list[BlockKey]:
    rng = random.Random(seed)
    return [BlockKey(rng.randbytes(32)) for _ in range(n)]


def test_recent_keys_has_no_false_negatives_for_the_last_span() -> None:
    recent = GhostFilter(factor=2, min_span=1000)
    added = keys_(3000, seed=1)
    for k in added:
        recent.add(NS, k, live_entries=100)
    # Spans of 1,000: the last 1,000 to 2,000 keys are remembered, every one of them.
    assert all((NS, k) in recent for k in added[-1000:])
    assert (NS, added[-1]) in recent and ("other", added[-1]) not in recent


def test_recent_keys_forgets_after_two_spans_and_rarely_errs() -> None:
    recent = GhostFilter(factor=2, min_span=1000)
    old = keys_(1000, seed=2)
    for k in old:
        recent.add(NS, k, live_entries=10)
    for k in keys_(2000, seed=3):
        recent.add(NS, k, live_entries=10)
    forgotten = sum((NS, k) not in recent for k in old)
    assert forgotten >= 985  # false positives: under 1% (12 bits a key)
    never = keys_(20_000, seed=4)
    false_positives = sum((NS, k) in recent for k in never)
    assert false_positives / len(never) < 0.01


def test_recent_keys_grows_its_span_with_the_index() -> None:
    recent = GhostFilter(factor=2, min_span=100)
    for k in keys_(101, seed=5):
        recent.add(NS, k, live_entries=5000)
    assert recent.span == 10_000


def test_recent_keys_rejects_a_bad_size() -> None:
    with pytest.raises(ValueError, match="factor and min_span must be positive"):
        GhostFilter(factor=0)
