"""kvstore.kernels.reference against a naive oracle: per-token softmax attention in float64
over K/V rebuilt position by position from the block tables, with explicit loops."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import kernels
from kvstore.kernels import reference as ref
from tests.engine.kv import random_tables

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def make_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype, gen: torch.Generator, layers: int = 1) -> torch.Tensor:
    shape = (layers, 2, num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype)


def oracle_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     table: torch.Tensor, positions: list[int], scale: float,
                     window: int | None = None, sinks: int = 0) -> torch.Tensor:
    """q [n, heads, dim]: row i attends to cache positions 0..positions[i] of one sequence;
    with a window, only to those t with positions[i] - window < t (transformers'
    sliding-window rule), or t < sinks. Only attended positions are read from the table."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, pos in enumerate(positions):
        seen = [t for t in range(pos + 1)
                if window is None or t > pos - window or t < sinks]
        keys = torch.stack([k_cache[int(table[t // block_size]), t % block_size]
                            for t in seen]).double()
        values = torch.stack([v_cache[int(table[t // block_size]), t % block_size]
                              for t in seen]).double()
        for h in range(q.shape[1]):
            kv = h // group
            scores = [float(q[i, h].double() @ keys[j, kv]) * scale for j in range(len(seen))]
            top = max(scores)
            weights = torch.tensor([math.exp(x - top) for x in scores], dtype=torch.float64)
            out[i, h] = (weights / weights.sum()) @ values[:, kv]
    return out


def free_outside_window(tables: torch.Tensor, lens: list[int], q_lens: list[int],
                        block_size: int, window: int, sinks: int) -> torch.Tensor:
    """tables with -1 in every entry no token of the step attends to (blocks that slid out
    of the window, as the block manager frees them): the kernels must not read those."""
    tables = tables.clone()
    for s, (ctx, q_len) in enumerate(zip(lens, q_lens, strict=True)):
        first = max(0, ctx - q_len - window + 1) // block_size
        sink_blocks = -(-sinks // block_size)
        for b in range(sink_blocks, first):
            tables[s, b] = -1
    return tables


def oracle_decode(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lens: list[int],
                  scale: float, window: int | None = None, sinks: int = 0) -> torch.Tensor:
    return torch.stack([oracle_attention(q[s : s + 1], kv[0, 0], kv[0, 1], tables[s],
                                         [ctx - 1], scale, window, sinks)[0]
                        for s, ctx in enumerate(lens)])


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    err = (actual.double() - expected).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max error {err} > {TOLERANCE[dtype]} for {dtype}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 3), (8, 2)])
def test_decode_matches_oracle(dtype: torch.dtype, heads: int, kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    block_size, dim, lens = 4, 16, [1, 7, 13, 4, 9]  # none but 4 a multiple of block_size
    kv = make_cache(24, block_size, kv_heads, dim, dtype, gen)
    tables = random_tables(lens, block_size, 24, width=6, gen=gen)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    out = ref.decode_attention(q, kv[0, 0], kv[0, 1], tables,
                               torch.tensor(lens, dtype=torch.int32), 0.3)
    assert out.shape == q.shape
    assert_close(out, oracle_decode(q, kv, tables, lens, 0.3), dtype)


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=5),
       block_size=st.sampled_from([1, 4, 16]), group=st.sampled_from([1, 2, 4]),
       kv_heads=st.integers(1, 2), seed=st.integers(0, 2**16), pad=st.sampled_from([-1, 0]))
def test_decode_hypothesis(lens: list[int], block_size: int, group: int, kv_heads: int,
                           seed: int, pad: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-ctx // block_size) for ctx in lens) + 1
    num_blocks = width * len(lens)
    kv = make_cache(num_blocks, block_size, kv_heads, 8, torch.float32, gen)
    tables = random_tables(lens, block_size, num_blocks, width, gen)
    tables[tables < 0] = pad  # padding may be -1 or a real block id: both must be ignored
    q = torch.randn(len(lens), kv_heads * group, 8, generator=gen)
    out = ref.decode_attention(q, kv[0, 0], kv[0, 1], tables,
                               torch.tensor(lens, dtype=torch.int32), 8**-0.5)
    assert_close(out, oracle_decode(q, kv, tables, lens, 8**-0.5), torch.float32)


def test_decode_reads_only_the_context() -> None:
    """Writing past context_len changes nothing; writing inside it changes the output."""
    gen = torch.Generator().manual_seed(1)
    kv = make_cache(8, 4, 2, 8, torch.float32, gen)
    tables = torch.tensor([[5, 2, -1, -1]], dtype=torch.int32)
    q = torch.randn(1, 4, 8, generator=gen)
    lens = torch.tensor([6], dtype=torch.int32)
    before = ref.decode_attention(q, kv[0, 0], kv[0, 1], tables, lens, 0.5)
    kv[0, :, 2, 2:] = 100.0  # block 2 offsets 2.. are positions 6, 7: past the context
    kv[0, :, 0] = 100.0  # block 0 is nobody's (the padding gather must not leak it)
    assert torch.equal(ref.decode_attention(q, kv[0, 0], kv[0, 1], tables, lens, 0.5), before)
    kv[0, 1, 2, 1] = 100.0  # V at position 5, the last one attended
    after = ref.decode_attention(q, kv[0, 0], kv[0, 1], tables, lens, 0.5)
    assert (after - before).abs().max() > 1.0


def test_decode_uses_repeat_kv_head_mapping() -> None:
    """Query heads 0, 1 read KV head 0 and heads 2, 3 KV head 1 (not h % num_kv_heads)."""
    kv = torch.zeros(1, 2, 1, 2, 2, 4)
    kv[0, 1, 0, :, 0] = 1.0  # V of KV head 0 is all ones, of KV head 1 all zeros
    q = torch.randn(1, 4, 4)
    out = ref.decode_attention(q, kv[0, 0], kv[0, 1], torch.zeros(1, 1, dtype=torch.int32),
                               torch.tensor([2], dtype=torch.int32), 1.0)
    assert torch.allclose(out[0, :, 0], torch.tensor([1.0, 1.0, 0.0, 0.0]))


def test_decode_padding_row_is_zero() -> None:
    gen = torch.Generator().manual_seed(2)
    kv = make_cache(4, 4, 1, 8, torch.float32, gen)
    tables = torch.tensor([[3, -1], [-1, -1]], dtype=torch.int32)
    q = torch.randn(2, 2, 8, generator=gen)
    out = ref.decode_attention(q, kv[0, 0], kv[0, 1], tables,
                               torch.tensor([3, 0], dtype=torch.int32), 1.0)
    assert torch.equal(out[1], torch.zeros(2, 8))
    assert torch.isfinite(out).all() and out[0].abs().sum() > 0


def test_decode_rejects_bad_gqa_ratio() -> None:
    kv = torch.zeros(1, 2, 2, 4, 2, 8)
    with pytest.raises(ValueError, match="multiple"):
        ref.decode_attention(torch.zeros(1, 3, 8), kv[0, 0], kv[0, 1],
                             torch.zeros(1, 1, dtype=torch.int32),
                             torch.tensor([1], dtype=torch.int32), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_prefill_with_cached_prefix_matches_oracle(dtype: torch.dtype, group: int) -> None:
    gen = torch.Generator().manual_seed(group)
    block_size, kv_heads, dim = 4, 2, 8
    q_lens, lens = [5, 1, 7, 3], [11, 6, 7, 3]  # prefixes of 6, 5, 0, 0 cached tokens
    kv = make_cache(20, block_size, kv_heads, dim, dtype, gen)
    tables = random_tables(lens, block_size, 20, width=4, gen=gen)
    q = torch.randn(sum(q_lens), kv_heads * group, dim, generator=gen).to(dtype)
    starts = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    out = ref.prefill_attention(q, kv[0, 0], kv[0, 1], tables, starts,
                                torch.tensor(lens, dtype=torch.int32), 0.4)
    expected = torch.cat([
        oracle_attention(q[int(starts[s]) : int(starts[s + 1])], kv[0, 0], kv[0, 1], tables[s],
                         list(range(ctx - q_len, ctx)), 0.4)
        for s, (q_len, ctx) in enumerate(zip(q_lens, lens, strict=True))])
    assert_close(out, expected, dtype)


# Windows of one token, under a block, one block, between blocks, and longer than every
# context (so nothing slides out); with and without two sink tokens.
WINDOWS = [(1, 0), (3, 0), (4, 0), (6, 0), (64, 0), (3, 2), (6, 5)]


@pytest.mark.parametrize(("window", "sinks"), WINDOWS)
def test_decode_window_matches_oracle(window: int, sinks: int) -> None:
    gen = torch.Generator().manual_seed(window * 10 + sinks)
    block_size, lens = 4, [1, 7, 13, 4, 9, 22]
    kv = make_cache(40, block_size, 2, 8, torch.float32, gen)
    tables = random_tables(lens, block_size, 40, width=7, gen=gen)
    q = torch.randn(len(lens), 4, 8, generator=gen)
    ctx = torch.tensor(lens, dtype=torch.int32)
    full = ref.decode_attention(q, kv[0, 0], kv[0, 1], tables, ctx, 0.3)
    tables = free_outside_window(tables, lens, [1] * len(lens), block_size, window, sinks)
    out = ref.decode_attention(q, kv[0, 0], kv[0, 1], tables, ctx, 0.3, window=window,
                               sinks=sinks)
    assert_close(out, oracle_decode(q, kv, tables, lens, 0.3, window, sinks), torch.float32)
    # A context longer than window + sinks attends to less than the whole context.
    changed = [s for s, n in enumerate(lens) if n > window + sinks]
    unchanged = [s for s, n in enumerate(lens) if n <= window]
    assert all((out[s] - full[s]).abs().max() > 1e-4 for s in changed)
    assert torch.allclose(out[unchanged], full[unchanged], atol=1e-6)


@pytest.mark.parametrize(("window", "sinks"), WINDOWS)
def test_prefill_window_matches_oracle(window: int, sinks: int) -> None:
    gen = torch.Generator().manual_seed(window * 10 + sinks + 1)
    block_size, kv_heads, group = 4, 2, 2
    # Cached prefixes of 6, 5, 0, 0 and 14 tokens: chunks that start inside, at and past
    # the window's reach.
    q_lens, lens = [5, 1, 7, 3, 9], [11, 6, 7, 3, 23]
    kv = make_cache(40, block_size, kv_heads, 8, torch.float32, gen)
    tables = random_tables(lens, block_size, 40, width=6, gen=gen)
    tables = free_outside_window(tables, lens, q_lens, block_size, window, sinks)
    q = torch.randn(sum(q_lens), kv_heads * group, 8, generator=gen)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    out = ref.prefill_attention(q, kv[0, 0], kv[0, 1], tables,
                                torch.tensor(starts, dtype=torch.int32),
                                torch.tensor(lens, dtype=torch.int32), 0.4, window=window,
                                sinks=sinks)
    expected = torch.cat([
        oracle_attention(q[starts[s] : starts[s + 1]], kv[0, 0], kv[0, 1], tables[s],
                         list(range(ctx - q_len, ctx)), 0.4, window, sinks)
        for s, (q_len, ctx) in enumerate(zip(q_lens, lens, strict=True))])
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_window_must_be_a_positive_int(bad: object) -> None:
    kv = torch.zeros(1, 2, 2, 4, 1, 8)
    with pytest.raises(ValueError, match="window must be a positive int"):
        ref.decode_attention(torch.zeros(1, 1, 8), kv[0, 0], kv[0, 1],
                             torch.zeros(1, 1, dtype=torch.int32),
                             torch.tensor([1], dtype=torch.int32), 1.0,
                             window=bad)


def test_prefill_of_one_token_equals_decode() -> None:
    gen = torch.Generator().manual_seed(3)
    lens = [9, 1, 16]
    kv = make_cache(16, 4, 2, 16, torch.float32, gen)
    tables = random_tables(lens, 4, 16, width=5, gen=gen)
    q = torch.randn(3, 4, 16, generator=gen)
    ctx = torch.tensor(lens, dtype=torch.int32)
    decode = ref.decode_attention(q, kv[0, 0], kv[0, 1], tables, ctx, 0.25)
    prefill = ref.prefill_attention(q, kv[0, 0], kv[0, 1], tables,
                                    torch.arange(4, dtype=torch.int32), ctx, 0.25)
    torch.testing.assert_close(prefill, decode, atol=1e-6, rtol=1e-5)


def test_prefill_rejects_short_context() -> None:
    kv = torch.zeros(1, 2, 4, 4, 1, 8)
    with pytest.raises(ValueError, match="context_len 2 < its 3 new tokens"):
        ref.prefill_attention(torch.zeros(3, 1, 8), kv[0, 0], kv[0, 1],
                              torch.zeros(1, 1, dtype=torch.int32),
                              torch.tensor([0, 3], dtype=torch.int32),
                              torch.tensor([2], dtype=torch.int32), 1.0)


def test_write_cache_skips_negative_slots_then_decode_reads_it() -> None:
    gen = torch.Generator().manual_seed(4)
    k_cache, v_cache = torch.zeros(2, 4, 4, 2, 8).unbind(0)
    key, value = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    slots = torch.tensor([13, -1, 0, 7, -1])  # blocks 3, 0, 1 at offsets 1, 0, 3
    ref.write_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[3, 1], key[0]) and torch.equal(v_cache[1, 3], value[3])
    assert torch.equal(k_cache[0, 0], key[2])
    written = torch.zeros(4, 4, dtype=torch.bool)
    written[3, 1] = written[0, 0] = written[1, 3] = True
    assert k_cache[~written].abs().sum() == 0 and v_cache[~written].abs().sum() == 0
    # Block table [0, 3]: positions 0..3 are slots 0..3 and 4, 5 are slots 12, 13, so a
    # context of 6 sees token 2 first, token 0 last and zeros (never written) between.
    q = torch.randn(1, 2, 8, generator=gen)
    zero = torch.zeros(2, 8)
    keys = torch.stack([key[2], zero, zero, zero, zero, key[0]])  # [6 positions, 2 heads, 8]
    values = torch.stack([value[2], zero, zero, zero, zero, value[0]])
    scores = torch.einsum("hd,phd->hp", q[0], keys) * 0.5
    expected = torch.einsum("hp,phd->hd", scores.softmax(-1), values)
    k_cache[3, 2] = 50.0  # slot 14 = position 6: not attended
    out = ref.decode_attention(q, k_cache, v_cache, torch.tensor([[0, 3]], dtype=torch.int32),
                               torch.tensor([6], dtype=torch.int32), 0.5)
    torch.testing.assert_close(out[0], expected)


def test_gather_scatter_round_trip_in_another_order() -> None:
    gen = torch.Generator().manual_seed(5)
    cache = make_cache(10, 4, 2, 8, torch.float32, gen, layers=3)
    ids = torch.tensor([7, 2, 9, 0])
    staging = ref.gather_blocks(cache, ids)
    assert staging.shape == (4, 3, 2, 4, 2, 8) and staging.is_contiguous()
    assert torch.equal(staging[1, 2, 1], cache[2, 1, 2])  # block 2, layer 2, V
    other = torch.zeros_like(cache)
    ref.scatter_blocks(staging, other, [1, 3, 5, 8])
    assert torch.equal(other[:, :, [1, 3, 5, 8]], cache[:, :, [7, 2, 9, 0]])
    assert other[:, :, [0, 2, 4, 6, 7, 9]].abs().sum() == 0
    same = torch.empty(2, 3, 2, 4, 2, 8)
    assert ref.gather_blocks(other, torch.tensor([8, 3]), out=same) is same
    assert torch.equal(same, staging[[3, 1]])
    out = torch.empty(2, 3, 2, 4, 2, 8, dtype=torch.float64)  # another dtype: converted
    assert ref.gather_blocks(other, [3, 8], out=out) is out
    assert torch.equal(out, cache[:, :, [2, 0]].permute(2, 0, 1, 3, 4, 5).double())


def test_gather_into_out_of_the_wrong_shape_fails() -> None:
    cache = torch.zeros(1, 2, 4, 2, 1, 4)
    with pytest.raises(ValueError, match="contiguous"):
        ref.gather_blocks(cache, [0, 1], out=torch.empty(1, 1, 2, 2, 1, 4))


@pytest.mark.parametrize("as_list", [True, False])
def test_copy_blocks(as_list: bool) -> None:
    gen = torch.Generator().manual_seed(6)
    cache = make_cache(6, 2, 1, 4, torch.float32, gen, layers=2)
    before = cache.clone()
    src, dst = [0, 4], [5, 1]
    if as_list:
        ref.copy_blocks(cache, src, dst)
    else:
        ref.copy_blocks(cache, torch.tensor(src), torch.tensor(dst))
    assert torch.equal(cache[:, :, [5, 1]], before[:, :, [0, 4]])
    assert torch.equal(cache[:, :, [0, 2, 3, 4]], before[:, :, [0, 2, 3, 4]])
    ref.copy_blocks(cache, [], [])
    with pytest.raises(ValueError, match="equal-length"):
        ref.copy_blocks(cache, [0, 1], [2])


def test_ops_for_cpu_is_the_reference(caplog: pytest.LogCaptureFixture) -> None:
    kernels._OPS.clear()
    with caplog.at_level(logging.INFO, logger="kvstore.kernels"):
        assert kernels.ops_for("cpu") is ref
        assert kernels.ops_for(torch.device("cpu")) is ref
    assert sum("torch reference" in r.getMessage() for r in caplog.records) == 1  # cached


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: ops_for picks "
                    "the Triton kernels (tests/integration/test_gpu_kernels.py)")
def test_ops_for_cuda_without_a_device_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    """No CUDA here: the probe of the Triton kernels fails for real, and ops_for logs why
    and gives the reference."""
    kernels._OPS.clear()
    with caplog.at_level(logging.INFO, logger="kvstore.kernels"):
        assert kernels.ops_for("cuda:0") is ref
        assert kernels.ops_for("cuda:0") is ref
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Triton kernels are unavailable" in warnings[0]
    kernels._OPS.clear()
