"""kvstore.kernels.gpu's Triton kernels run on CPU tensors through Triton's interpreter, against
kvstore.kernels.reference: the same @triton.jit functions CUDA compiles (kernels.gpu runs
them through the interpreter itself for CPU tensors, so it does not matter whether
TRITON_INTERPRET was set, or who imported Triton first).

The shapes are chosen for the edges: block tables from tests/engine/kv.random_tables (random,
reordered block ids, -1 or stale ids past each sequence's last block), contexts of 0 (a
padding row: zeros), 1, one past a block boundary (17 and 33 at block size 16; every
context at block size 1) and a partial last block; kv heads 1 (MQA), 8 with 16 query heads
(GQA) and 8 with 8 (MHA); head dims 64 and 128 (and 24, not a power of two, whose padding
lanes are masked); block sizes 1 and 16 (and 4); float32, float16 and bfloat16. Decode runs
both with the engine's split and tile sizes and with small ones, so that contexts of a few
dozen tokens cross tiles and context splits and the merge kernel runs. Copies must be
bit-exact; attention is compared with the reference in float32 on the same rounded inputs,
within a tolerance per dtype.

The interpreter runs Python, not what Triton's compiler makes of it: a value carried through
the decode loop as an int on entry and a float after passes here and fails to compile. So
every launch the ops make is also compiled, on this CPU, to a cubin for sm_80 and sm_90 by
the ptxas Triton's wheel carries (test_every_launch_compiles_to_a_cubin): only running the
binary needs a GPU (tests/integration/test_gpu_kernels.py).

What the interpreter does not cover: it runs each program instance in numpy, so nothing
here says anything about speed, occupancy or races between programs (copy_blocks'
requirement that destinations be distinct and not sources is a GPU-only hazard). It keeps
bfloat16 as raw uint16 and supports only conversions of it, which is all these kernels do
with it (every load is converted to float32 before arithmetic; copies move raw bits):
bfloat16 arithmetic or a bfloat16 tl.dot gives garbage here (it multiplies the uint16 bit
patterns) while it is right on the GPU, so the kernels do neither. And Triton 3.6's
interpreter fails on a loop bound read from memory under numpy 2 (`int()` of a one-element
array), which is why the decode loop has a fixed trip count.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# The test extra installs Triton on Linux x86-64 only, where its wheels are; elsewhere these
# tests are skipped, as the engine falls back to the reference there.
triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import native_specialize_impl  # noqa: E402

from kvstore.kernels import gpu  # noqa: E402
from kvstore.kernels import reference as ref  # noqa: E402
from tests.engine.kv import random_tables  # noqa: E402

# Attention output against the float32 reference on the same rounded inputs: float32 agrees
# to rounding (the online softmax reorders the sums), the half types to about one rounding
# of an output of magnitude up to ~4 (bfloat16 keeps 8 bits: 2**-6 there, 2**-9 relative).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def decode_case(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int,
                lens: list[int], seed: int, stale: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query, k_cache, v_cache, block_tables, context_lens), two spare columns in the table;
    with `stale`, the columns past each sequence's blocks name real blocks, not -1."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-c // block_size) for c in lens) + 2
    num_blocks = width * len(lens) + 3
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = random_tables(lens, block_size, num_blocks, width, gen)
    if stale:
        junk = torch.randint(0, num_blocks, tables.shape, generator=gen, dtype=torch.int32)
        tables = torch.where(tables < 0, junk, tables)
    query = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    return query, kv[0], kv[1], tables, torch.tensor(lens, dtype=torch.int32)


# (dtype, heads, kv_heads, head_dim, block_size, context lengths)
DECODE_CASES = [
    pytest.param(torch.float32, 8, 8, 64, 16, [1, 17, 0, 33, 16], id="mha-f32-d64-b16"),
    pytest.param(torch.bfloat16, 4, 1, 128, 16, [17, 1, 0, 40], id="mqa-bf16-d128-b16"),
    pytest.param(torch.float16, 16, 8, 128, 1, [3, 1, 0, 9], id="gqa-f16-d128-b1"),
    pytest.param(torch.bfloat16, 16, 8, 64, 16, [33, 0, 1], id="gqa-bf16-d64-b16"),
    pytest.param(torch.float32, 4, 1, 128, 1, [1, 7, 0], id="mqa-f32-d128-b1"),
    pytest.param(torch.float16, 8, 8, 64, 16, [0, 31], id="mha-f16-d64-b16"),
    pytest.param(torch.float32, 6, 2, 24, 4, [9, 0, 5], id="gqa-f32-d24-b4"),  # dims masked
]


def check_decode(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 scale: float) -> None:
    expected = ref.decode_attention(query.float(), k_cache.float(), v_cache.float(), tables,
                                    lens, scale)
    assert out.dtype == query.dtype and out.shape == query.shape
    err = (out.float() - expected).abs().max().item()
    assert err <= TOLERANCE[query.dtype], f"max error {err} > {TOLERANCE[query.dtype]}"
    for row in (lens == 0).nonzero().flatten().tolist():
        assert torch.equal(out[row].float(), torch.zeros(query.shape[1:]))


@pytest.mark.parametrize(("dtype", "heads", "kv_heads", "head_dim", "block_size", "lens"),
                         DECODE_CASES)
def test_decode_matches_reference(dtype: torch.dtype, heads: int, kv_heads: int,
                                  head_dim: int, block_size: int, lens: list[int]) -> None:
    """The engine's tile and split sizes: every context here fits one split."""
    query, k_cache, v_cache, tables, ctx = decode_case(dtype, heads, kv_heads, head_dim,
                                                       block_size, lens, seed=heads + head_dim)
    scale = head_dim**-0.5
    out = gpu.decode_attention(query, k_cache, v_cache, tables, ctx, scale)
    check_decode(out, query, k_cache, v_cache, tables, ctx, scale)


@pytest.mark.parametrize(("dtype", "heads", "kv_heads", "head_dim", "block_size", "lens"),
                         DECODE_CASES)
def test_decode_across_tiles_and_splits_matches_reference(
        dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int,
        lens: list[int]) -> None:
    """Tiles of 4 tokens, splits of 8: a 33-token context crosses 9 tiles and 5 splits,
    the table's spare columns make empty splits, and the merge kernel runs; the columns
    past each sequence name stale blocks, which must not be read."""
    query, k_cache, v_cache, tables, ctx = decode_case(
        dtype, heads, kv_heads, head_dim, block_size, lens, seed=7 * heads + head_dim,
        stale=True)
    scale = 0.3
    out = gpu._decode(query, k_cache, v_cache, tables, ctx, scale, split_tokens=8,
                      tile_tokens=4)
    check_decode(out, query, k_cache, v_cache, tables, ctx, scale)


def freed_outside_window(tables: torch.Tensor, lens: torch.Tensor, block_size: int,
                         window: int, sinks: int) -> torch.Tensor:
    """tables with -1 for every block the decode token cannot attend to (blocks that slid
    out of its window, past the sink blocks): what the block manager leaves there."""
    tables = tables.clone()
    for row, ctx in enumerate(lens.tolist()):
        first = max(0, ctx - window) // block_size
        tables[row, -(-sinks // block_size) : first] = -1
    return tables


# (window, sinks, split_tokens, tile_tokens) at block size 16, contexts from 0 to 50: a
# window under a block, of one block, spanning two and three blocks; sinks of part of a
# block and of more than one; the engine's split and tile sizes (None), and small ones so
# that a window crosses tiles and splits.
WINDOW_CASES = [
    pytest.param(5, 0, None, None, id="w5"),
    pytest.param(16, 0, 8, 4, id="w16-split"),
    pytest.param(20, 0, None, None, id="w20"),
    pytest.param(40, 0, 8, 4, id="w40-split"),
    pytest.param(7, 3, 8, 4, id="w7-sinks3-split"),
    pytest.param(20, 18, None, None, id="w20-sinks18"),
]


@pytest.mark.parametrize(("window", "sinks", "split_tokens", "tile_tokens"), WINDOW_CASES)
def test_decode_with_a_window_matches_reference(window: int, sinks: int,
                                                split_tokens: int | None,
                                                tile_tokens: int | None) -> None:
    """Contexts shorter than the window, as long and longer (up to 10x a 5-token one); the
    blocks outside the window are -1 in the table, which must not be read."""
    lens = [1, 17, 0, 33, 50, 5, 21]
    query, k_cache, v_cache, tables, ctx = decode_case(torch.float32, 4, 2, 32, 16, lens,
                                                       seed=window + sinks)
    tables = freed_outside_window(tables, ctx, 16, window, sinks)
    if split_tokens is None:
        out = gpu.decode_attention(query, k_cache, v_cache, tables, ctx, 0.3, window=window,
                                   sinks=sinks)
    else:
        out = gpu._decode(query, k_cache, v_cache, tables, ctx, 0.3, split_tokens,
                          tile_tokens, window=window, sinks=sinks)
    expected = ref.decode_attention(query, k_cache, v_cache, tables, ctx, 0.3, window=window,
                                    sinks=sinks)
    err = (out - expected).abs().max().item()
    assert err <= TOLERANCE[torch.float32], f"max error {err}"
    assert torch.equal(out[2], torch.zeros(4, 32))  # the padding row


def test_decode_reads_a_strided_query_and_sees_the_last_token() -> None:
    query, k_cache, v_cache, tables, ctx = decode_case(torch.float32, 4, 2, 64, 16, [33], 3)
    fused = torch.cat([query, torch.randn(1, 2, 64)], dim=1)
    strided = fused[:, :4]  # a slice of a fused projection: strided over heads
    before = gpu.decode_attention(strided, k_cache, v_cache, tables, ctx, 0.125)
    check_decode(before, query, k_cache, v_cache, tables, ctx, 0.125)
    block = int(tables[0, 32 // 16])
    v_cache[block, 0] += 10.0  # position 32: the last one attended
    v_cache[block, 1] += 10.0  # position 33: past the context
    after = gpu.decode_attention(strided, k_cache, v_cache, tables, ctx, 0.125)
    assert (after - before).abs().max() > 1e-3
    check_decode(after, query, k_cache, v_cache, tables, ctx, 0.125)


def test_decode_of_no_sequences_and_of_only_padding() -> None:
    query, k_cache, v_cache, tables, ctx = decode_case(torch.float32, 4, 1, 64, 16, [0, 0], 4)
    assert torch.equal(gpu.decode_attention(query, k_cache, v_cache, tables, ctx, 0.1),
                       torch.zeros_like(query))
    empty = gpu.decode_attention(query[:0], k_cache, v_cache, tables[:0], ctx[:0], 0.1)
    assert empty.shape == (0, 4, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "strided"), [(16, True), (1, False)])
def test_write_cache_matches_reference_bit_exact(dtype: torch.dtype, block_size: int,
                                                 strided: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    num_blocks = 192 // block_size
    kv = torch.randn(2, num_blocks, block_size, 4, 64, generator=gen).to(dtype)
    fused = torch.randn(20, 12, 64, generator=gen).to(dtype)
    # Slices of a fused projection: strided over tokens, and the key over heads too.
    key, value = fused[:, 0:8:2], fused[:, 8:12]
    if not strided:
        key, value = key.contiguous(), value.contiguous()
    slots = torch.randperm(192, generator=gen)[:20]
    slots[::3] = -1  # padding tokens: skipped
    expected = kv.clone()
    gpu.write_cache(key, value, kv[0], kv[1], slots)
    ref.write_cache(key, value, expected[0], expected[1], slots)
    assert torch.equal(kv.view(torch.uint8), expected.view(torch.uint8))
    written = slots[slots >= 0]
    assert torch.equal(kv[0].flatten(0, 1)[written], key[slots >= 0])


def test_write_cache_converts_the_dtype_and_keeps_nan_bits() -> None:
    gen = torch.Generator().manual_seed(5)
    kv = torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16)
    key = torch.randn(3, 2, 64, generator=gen)
    value = torch.randn(3, 2, 64, generator=gen)
    value[1, 0, :4] = float("nan")
    slots = torch.tensor([5, 63, 17])
    expected = kv.clone()
    gpu.write_cache(key, value, kv[0], kv[1], slots)
    ref.write_cache(key, value, expected[0], expected[1], slots)
    assert torch.equal(kv.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_matches_reference_bit_exact(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    # 16 x 8 x 64 = 8192 elements a block: two copy programs (chunks) per block and plane.
    cache = torch.randn(3, 2, 20, 16, 8, 64, generator=gen).to(dtype)
    expected = cache.clone()
    gpu.copy_blocks(cache, [0, 5, 7, 19], torch.tensor([3, 2, 11, 1]))
    ref.copy_blocks(expected, [0, 5, 7, 19], [3, 2, 11, 1])
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    gpu.copy_blocks(cache, [], [])
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gather_scatter_round_trip_bit_exact(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 2, 16, 1, 8, 64, generator=gen).to(dtype)  # block size 1
    ids = torch.tensor([9, 0, 15, 4])
    staging = gpu.gather_blocks(cache, ids)
    assert torch.equal(staging, ref.gather_blocks(cache, ids)) and staging.is_contiguous()
    out = torch.empty_like(staging)
    assert gpu.gather_blocks(cache, [9, 0, 15, 4], out=out) is out
    assert torch.equal(out, staging)
    wider = torch.empty(staging.shape, dtype=torch.float64)  # another dtype: copied after
    assert gpu.gather_blocks(cache, ids, out=wider) is wider
    assert torch.equal(wider, staging.double())
    other = torch.zeros_like(cache)
    gpu.scatter_blocks(staging, other, [1, 2, 3, 5])
    expected = torch.zeros_like(cache)
    ref.scatter_blocks(staging, expected, [1, 2, 3, 5])
    assert torch.equal(other, expected)
    assert torch.equal(other[:, :, [1, 2, 3, 5]], cache[:, :, [9, 0, 15, 4]])


def test_bad_arguments_are_named() -> None:
    query, k_cache, v_cache, tables, ctx = decode_case(torch.float32, 4, 2, 64, 16, [5], 6)
    with pytest.raises(ValueError, match="k_cache must be a contiguous"):
        gpu.decode_attention(query, k_cache.transpose(1, 2), v_cache, tables, ctx, 0.1)
    with pytest.raises(ValueError, match="dtypes"):
        gpu.decode_attention(query.half(), k_cache, v_cache, tables, ctx, 0.1)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        gpu.decode_attention(query[:, :3], k_cache, v_cache, tables, ctx, 0.1)
    with pytest.raises(ValueError, match="context_lens must be"):
        gpu.decode_attention(query, k_cache, v_cache, tables, ctx.repeat(2), 0.1)
    with pytest.raises(ValueError, match="one CUDA device"):
        gpu.decode_attention(query.to("meta"), k_cache, v_cache, tables, ctx, 0.1)
    cache = torch.zeros(1, 2, 4, 16, 2, 64)
    with pytest.raises(ValueError, match="equal-length"):
        gpu.copy_blocks(cache, [0, 1], [2])
    with pytest.raises(ValueError, match="kv_cache must be a contiguous"):
        gpu.gather_blocks(cache[0], [0])
    with pytest.raises(ValueError, match="staging must be"):
        gpu.scatter_blocks(torch.zeros(2, 1, 2, 16, 2, 64), cache, [0])
    with pytest.raises(ValueError, match="slot_mapping"):
        gpu.write_cache(torch.zeros(3, 2, 64), torch.zeros(3, 2, 64), cache[0, 0], cache[0, 1],
                        torch.zeros(2, dtype=torch.long))


def test_the_interpreted_kernels_are_the_compiled_ones() -> None:
    """What runs here is the Python function CUDA compiles, not a copy of it."""
    for kernel in (gpu._decode_kernel, gpu._decode_merge_kernel, gpu._write_kernel,
                   gpu._copy_kernel):
        assert gpu._interpreted(kernel).fn is kernel.fn


Launch = tuple[Any, tuple[Any, ...], dict[str, Any]]


@pytest.fixture(scope="module")
def launches() -> Iterator[list[Launch]]:
    """(kernel, arguments, constexprs) of every launch that a few small calls of each op
    make, recorded on the way to the interpreter: the variants CUDA would compile (a float32
    and a bfloat16 decode, split and not, block size and group 1; the copy kernel with its
    source ids, its destination ids and both)."""
    recorded: list[Launch] = []
    launch = gpu._launch

    def record(kernel: Any, grid: tuple[int, ...], device: torch.device, *args: Any,
               **constexprs: Any) -> None:
        recorded.append((kernel, args, constexprs))
        launch(kernel, grid, device, *args, **constexprs)

    mp = pytest.MonkeyPatch()
    mp.setattr(gpu, "_launch", record)
    try:
        for dtype, block_size, kv_heads in ((torch.float32, 16, 2), (torch.bfloat16, 1, 4)):
            query, k_cache, v_cache, tables, ctx = decode_case(dtype, 4, kv_heads, 64,
                                                               block_size, [3, 0], seed=8)
            gpu.decode_attention(query, k_cache, v_cache, tables, ctx, 0.1)
            gpu._decode(query, k_cache, v_cache, tables, ctx, 0.1, split_tokens=2,
                        tile_tokens=2)
            gpu._decode(query, k_cache, v_cache, tables, ctx, 0.1, split_tokens=2,
                        tile_tokens=2, window=2, sinks=3)
        cache = torch.zeros(1, 2, 4, 2, 2, 64, dtype=torch.bfloat16)
        gpu.write_cache(torch.ones(2, 2, 64), torch.ones(2, 2, 64), cache[0, 0], cache[0, 1],
                        torch.tensor([1, -1]))
        gpu.copy_blocks(cache, [0], [1])
        gpu.scatter_blocks(gpu.gather_blocks(cache, [2]), cache, [3])
    finally:
        mp.undo()
    yield recorded


@pytest.mark.parametrize("arch", [80, 90])
def test_every_launch_compiles_to_a_cubin(arch: int, launches: list[Launch],
                                          tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """What the interpreter cannot say, whether Triton's compiler takes the kernels (types,
    values carried through loops and branches, pointer arithmetic), is checked without a GPU:
    each recorded launch is compiled for sm_80 and sm_90 (A100, H100/H200) down to a cubin by
    the ptxas Triton's wheel carries, with the argument types and the specializations (an int
    of 1 becomes a constant, 16-byte alignment and divisibility) Triton's launcher would give
    it. An empty cache directory: a
    binary cached by an earlier run must not hide an error. This also shows that running the
    interpreter first left the language as the compiler needs it."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    compiled = set()
    for kernel, args, constexprs in launches:
        signature, constants, attrs = {}, dict(constexprs), {}
        for index, (name, arg) in enumerate(zip(kernel.arg_names, args, strict=False)):
            # As Triton's launcher does: each argument's type and specialization key (an int
            # of 1 becomes a constant; "D" marks a pointer or int divisible by 16).
            kind, key = native_specialize_impl(CUDABackend, arg, False, True, True)
            signature[name] = kind
            if kind == "constexpr":
                constants[name] = key
            elif isinstance(key, str):
                attrs[(index,)] = CUDABackend.parse_attr(key)
        signature.update(dict.fromkeys(constexprs, "constexpr"))
        source = ASTSource(kernel, signature, constexprs=constants, attrs=attrs)
        binary = triton.compile(source, target=GPUTarget("cuda", arch, 32))
        assert binary.asm["cubin"] and ".target sm_" in binary.asm["ptx"]
        compiled.add(kernel.__name__)
    assert compiled == {"_decode_kernel", "_decode_merge_kernel", "_write_kernel",
                        "_copy_kernel"}
    assert any(tmp_path.iterdir())  # compiled here, not loaded from another run's cache
