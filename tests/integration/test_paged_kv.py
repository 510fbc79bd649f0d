"""Blocks of paged KV tensors in three layouts through a real daemon (PagedKV + StoreLink, the
halves the vLLM connector is made of): gathered, put, read by a fresh link into other block
ids, bit for bit; and the cross-layer layout is read straight into the cache."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvstore.integrations.link import StoreLink
from kvstore.integrations.paged import PagedKV
from kvstore.tools.testing import Daemon

NUM_BLOCKS, LAYERS = 24, 3


def _random(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen).view(
        torch.bfloat16)  # NaNs and all: compared as bits


def per_layer(seed: int | None) -> list[tuple[str, torch.Tensor]]:
    """vLLM's CPU layout: per layer [blocks, kv_heads, block_size, K|V head_dim]."""
    shape = (NUM_BLOCKS, 2, 16, 128)
    return [(f"l{i}", _random(shape, i + seed) if seed is not None else torch.zeros(
        shape, dtype=torch.bfloat16)) for i in range(LAYERS)]


def kv_outer(seed: int | None) -> list[tuple[str, torch.Tensor]]:
    """Flash-attention's classic layout: per layer [K/V, blocks, block_size, heads, dim]."""
    shape = (2, NUM_BLOCKS, 16, 2, 64)
    return [(f"l{i}", _random(shape, i + seed) if seed is not None else torch.zeros(
        shape, dtype=torch.bfloat16)) for i in range(LAYERS)]


def cross_layer(seed: int | None) -> list[tuple[str, torch.Tensor]]:
    """One buffer [blocks, layers, 2, heads, block_size, dim]: each block contiguous."""
    shape = (NUM_BLOCKS, LAYERS, 2, 2, 16, 64)
    buf = _random(shape, seed) if seed is not None else torch.zeros(shape, dtype=torch.bfloat16)
    return [(f"l{i}", buf[:, i]) for i in range(LAYERS)]


def _bits(layers: list[tuple[str, torch.Tensor]], paged: PagedKV, ids: list[int]) -> list[
        torch.Tensor]:
    return [t.index_select(d, torch.tensor(ids)).view(torch.int16)
            for (_, t), d in zip(layers, paged.dims, strict=True)]


@pytest.mark.parametrize(("layout", "direct"), [(per_layer, False), (kv_outer, False),
                                                 (cross_layer, True)])
def test_blocks_round_trip_bit_exact_into_other_block_ids(
        daemon: Daemon, ns: str, layout: Callable[[int | None], list[tuple[str, torch.Tensor]]],
        direct: bool) -> None:
    source = layout(7)
    paged = PagedKV(source, NUM_BLOCKS)
    assert paged.direct is direct
    keys = [bytes([i]) * 32 for i in range(1, 6)]
    saver = StoreLink(daemon.target, ns, 16)
    try:
        staged = paged.gather([9, 3, 17, 4, 20])
        assert saver.offload(keys, paged.rows(staged), None)
        assert saver.flush(10.0) and saver.stats.offloaded_blocks == 5
    finally:
        saver.close()

    target = layout(None)
    fresh = PagedKV(target, NUM_BLOCKS)
    into = [2, 23, 5, 11, 0]
    loader = StoreLink(daemon.target, ns, 16)
    try:
        if fresh.direct:
            assert loader.read(keys, fresh.direct_rows(into)) == 5
        else:
            staging = fresh.staging(5)
            assert loader.read(keys, fresh.rows(staging)) == 5
            fresh.scatter(staging, into)
    finally:
        loader.close()
    for got, want in zip(_bits(target, fresh, into), _bits(source, paged, [9, 3, 17, 4, 20]),
                         strict=True):
        assert torch.equal(got, want)
    others = [b for b in range(NUM_BLOCKS) if b not in into]
    assert all(not t.any() for t in _bits(target, fresh, others))


def test_layouts_that_are_not_a_cache_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"KV cache l0 has shape \(5, 2\): no dimension of 24"):
        PagedKV([("l0", torch.zeros(5, 2))], NUM_BLOCKS)
    with pytest.raises(ValueError, match="no KV cache layers"):
        PagedKV([], NUM_BLOCKS)
