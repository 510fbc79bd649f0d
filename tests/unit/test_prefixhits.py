"""Lookups' prefix hits by tenant (kvstore.core.prefixhits): blocks always, tokens where the
Lookup said its block size; copies out, so a caller cannot change the books."""

from __future__ import annotations

from kvstore.core.prefixhits import PrefixCounts, PrefixHits


def test_blocks_and_tokens_are_counted_by_tenant() -> None:
    hits = PrefixHits()
    hits.count("a", keys=4, prefix=2, block_tokens=16)
    hits.count("a", keys=3, prefix=3)  # no block size said: blocks only
    hits.count("b", keys=1, prefix=0, block_tokens=256)
    assert hits.of("a") == PrefixCounts(blocks=7, hit_blocks=5, tokens=64, hit_tokens=32)
    assert hits.of("a").miss_blocks == 2
    assert hits.of("b") == PrefixCounts(blocks=1, hit_blocks=0, tokens=256, hit_tokens=0)
    assert hits.of("never") == PrefixCounts()
    assert hits.total() == PrefixCounts(blocks=8, hit_blocks=5, tokens=320, hit_tokens=32)
    assert set(hits.by_tenant()) == {"a", "b"}


def test_what_is_handed_out_is_a_copy() -> None:
    hits = PrefixHits()
    hits.count("", keys=2, prefix=1)
    hits.of("").blocks = 99
    hits.by_tenant()[""].hit_blocks = 99
    assert hits.of("") == PrefixCounts(blocks=2, hit_blocks=1)
