"""kvstore.kernels.gpu (Triton, compiled) against kvstore.kernels.reference on a real GPU: decode
attention in float32, float16 and bfloat16 (compared with the reference in float32 on the
same rounded inputs), long contexts whose splits the merge kernel combines, a launch on a
side stream and on a second device's tensors, and exact equality for the cache write and
the block copies. tests/unit/test_triton_kernels.py runs the same kernels on CPU through
Triton's interpreter; this file is what only a GPU checks: the compiled code. Marked gpu:
skipped without a CUDA device (tests/conftest.py) or without a CUDA build of torch."""

from __future__ import annotations

import pytest
import torch

from kvstore import kernels
from kvstore.kernels import reference as ref
from tests.engine.kv import random_tables

# Without Triton (not installed off Linux x86-64) there is nothing here to test; on a GPU
# machine, `make gpu-check`'s preflight fails first when the image lacks it.
gpu = pytest.importorskip("kvstore.kernels.gpu")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch has no CUDA device"),
]

DEV = torch.device("cuda", 0)
TOLERANCE = {torch.float32: 5e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def decode_case(dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int, block_size: int,
                lens: list[int], seed: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-c // block_size) for c in lens) + 2
    num_blocks = width * len(lens) + 3
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = random_tables(lens, block_size, num_blocks, width, gen)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    return (q.to(DEV), kv[0].to(DEV), kv[1].to(DEV), tables.to(DEV),
            torch.tensor(lens, dtype=torch.int32, device=DEV))


def test_ops_for_cuda_picks_the_kernels() -> None:
    kernels._OPS.clear()
    assert kernels.ops_for(DEV) is gpu
    assert kernels.ops_for("cpu") is ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "heads", "kv_heads", "block_size"),
                         [(64, 8, 8, 16), (80, 12, 4, 16), (128, 32, 8, 16), (256, 4, 1, 32),
                          (24, 6, 2, 1)])
def test_decode_matches_reference(dtype: torch.dtype, head_dim: int, heads: int,
                                  kv_heads: int, block_size: int) -> None:
    # A padding row (0), contexts of 1 and one past a block, and 1029 and 2500 tokens: 3 and
    # 5 splits of 512, so the merge kernel runs and the table has empty splits for most rows.
    lens = [1, 17, 0, 300, 1029, 64, 5, 2500]
    q, k, v, tables, ctx = decode_case(dtype, head_dim, heads, kv_heads, block_size, lens)
    scale = head_dim**-0.5
    out = gpu.decode_attention(q, k, v, tables, ctx, scale)
    expected = ref.decode_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(),
                                    tables.cpu(), ctx.cpu(), scale)
    assert out.dtype == dtype and out.shape == q.shape
    err = (out.float().cpu() - expected).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max error {err}"
    assert torch.equal(out[2].float().cpu(), torch.zeros(heads, head_dim))


@pytest.mark.parametrize(("window", "sinks"), [(7, 0), (16, 0), (40, 0), (600, 0), (40, 4)],
                         ids=["under-a-block", "a-block", "across-blocks", "across-splits",
                              "with-sinks"])
def test_windowed_decode_matches_reference(window: int, sinks: int) -> None:
    # Contexts shorter and longer than each window, one past a block edge, and 2500 tokens,
    # whose window of 600 spans two of the 512-token splits the merge kernel combines.
    lens = [1, 17, 0, 39, 41, 300, 2500]
    q, k, v, tables, ctx = decode_case(torch.bfloat16, 128, 8, 2, 16, lens, seed=3)
    scale = 128**-0.5
    out = gpu.decode_attention(q, k, v, tables, ctx, scale, window=window, sinks=sinks)
    expected = ref.decode_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(),
                                    tables.cpu(), ctx.cpu(), scale, window=window, sinks=sinks)
    err = (out.float().cpu() - expected).abs().max().item()
    assert err <= TOLERANCE[torch.bfloat16], f"max error {err}"


def test_decode_reads_a_strided_query_on_a_side_stream() -> None:
    q, k, v, tables, ctx = decode_case(torch.bfloat16, 128, 8, 2, 16, [40, 7, 300])
    qkv = torch.cat([q, torch.randn(3, 4, 128, device=DEV, dtype=q.dtype)], dim=1)
    query = qkv[:, :8]  # a slice of a fused projection: strided over heads
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = gpu.decode_attention(query, k, v, tables, ctx, 0.1)
    stream.synchronize()
    expected = ref.decode_attention(q, k, v, tables, ctx, 0.1)
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_kernels_run_on_their_tensors_device_not_the_current_one() -> None:
    """Triton launches on the current device: kernels.gpu makes the tensors' one current."""
    second = torch.device("cuda", 1)
    q, k, v, tables, ctx = decode_case(torch.float16, 64, 4, 2, 16, [40, 0, 600])
    q, k, v, tables, ctx = (t.to(second) for t in (q, k, v, tables, ctx))
    with torch.cuda.device(0):
        out = gpu.decode_attention(q, k, v, tables, ctx, 0.125)
        cache = torch.randn(2, 2, 8, 16, 2, 64, device=second)
        staged = gpu.gather_blocks(cache, [7, 1])
    assert out.device == second and staged.device == second
    expected = ref.decode_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(),
                                    tables.cpu(), ctx.cpu(), 0.125)
    assert (out.float().cpu() - expected).abs().max().item() <= TOLERANCE[torch.float16]
    assert torch.equal(staged.cpu(), ref.gather_blocks(cache.cpu(), [7, 1]))


def test_decode_is_sensitive_to_the_last_token() -> None:
    q, k, v, tables, ctx = decode_case(torch.float16, 64, 4, 4, 16, [33])
    before = gpu.decode_attention(q, k, v, tables, ctx, 0.125)
    block = int(tables[0, 32 // 16])
    v[block, 0] += 10.0  # position 32, the last one attended
    v[block, 1] += 10.0  # position 33: past the context
    after = gpu.decode_attention(q, k, v, tables, ctx, 0.125)
    expected = ref.decode_attention(q, k, v, tables, ctx, 0.125)
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, expected, atol=5e-3, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_write_cache_matches_reference(dtype: torch.dtype, strided: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 12, 16, 4, 128, generator=gen).to(dtype).to(DEV)
    fused = torch.randn(20, 12, 128, generator=gen).to(dtype).to(DEV)
    key, value = fused[:, :4], fused[:, 4:8]
    if not strided:
        key, value = key.contiguous(), value.contiguous()
    slots = torch.randperm(12 * 16, generator=gen)[:20].to(DEV)
    slots[::3] = -1
    expected = kv.clone()
    gpu.write_cache(key, value, kv[0], kv[1], slots)
    ref.write_cache(key, value, expected[0], expected[1], slots)
    assert torch.equal(kv, expected)


def test_copy_blocks_matches_reference() -> None:
    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(3, 2, 20, 16, 2, 64, generator=gen).to(torch.bfloat16).to(DEV)
    expected = cache.clone()
    gpu.copy_blocks(cache, [0, 5, 7, 19], torch.tensor([3, 2, 11, 1], device=DEV))
    ref.copy_blocks(expected, [0, 5, 7, 19], [3, 2, 11, 1])
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("pinned", [False, True])
def test_gather_scatter_round_trip_through_the_host(pinned: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(4, 2, 16, 16, 2, 64, generator=gen).to(torch.float16).to(DEV)
    ids = torch.tensor([9, 0, 15, 4], device=DEV)
    staging = gpu.gather_blocks(cache, ids)
    assert torch.equal(staging, ref.gather_blocks(cache, ids))
    host = torch.empty(staging.shape, dtype=staging.dtype, pin_memory=pinned)
    assert gpu.gather_blocks(cache, ids, out=host) is host
    assert torch.equal(host, staging.cpu())
    other = torch.zeros_like(cache)
    gpu.scatter_blocks(host, other, [1, 2, 3, 5])
    assert torch.equal(other[:, :, [1, 2, 3, 5]], cache[:, :, [9, 0, 15, 4]])
    assert other[:, :, [0, 4, 6]].abs().sum() == 0
