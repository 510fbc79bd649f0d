# Triton kernels take pointers, ints and tl.constexpr, and Triton reads their annotations:
# they stay unannotated, and triton.jit is untyped. The host functions are fully typed.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""The paged KV-cache operations in Triton, with the signatures and semantics of
kvstore/kernels/reference.py: what `ops_for` picks for a CUDA device.

Owns the kernels and their launches. Every kernel is written once, below, as a `@triton.jit`
function; on CUDA tensors it is compiled by Triton and launched on torch's current stream of
the tensors' device (Triton launches there), so it is ordered with the torch work around it.
On CPU tensors the very same functions run through Triton's interpreter (numpy, one program
instance after another): that is how CI checks them without a GPU
(tests/unit/test_triton_kernels.py). The engine never does that: on CPU `ops_for` gives the
torch reference, which is orders of magnitude faster than the interpreter.

- decode_attention: one program per (sequence, query head, context split of 512 tokens)
  walks its [start, end) range of the context in tiles of tokens, each token's block found
  through the block table (so any block size, holes and reordered ids, a partial last
  block), with an fp32 online softmax; query head h reads KV head h // group. When the
  longest context has more than one split, a second kernel merges the splits' partial
  results (flash-decoding, as vLLM's paged attention v2), so a few long sequences still
  fill the device. With a sliding window (and sinks), the range walked is the attended
  positions only (sinks, then the window), so the work and the splits are bounded by the
  window, and blocks outside it are never read. float32, float16, bfloat16; head_dim <= 256.
- write_cache, copy_blocks, gather_blocks, scatter_blocks: copies of raw bits (the tensors
  are viewed as integers of the element's width), so they are exact for every dtype, NaNs
  and all.
- prefill_attention is the torch reference: one SDPA call per sequence, which on CUDA is a
  flash or memory-efficient kernel already; a Triton prefill kernel would have to beat that
  over a cached prefix, and nothing here has shown it would.

Every kernel's offsets are computed in int64: a cache of more than 2**31 elements is common.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import triton
import triton.language as tl

from .reference import BlockIds, _group_size, _ids, check_window, prefill_attention

__all__ = ["copy_blocks", "decode_attention", "gather_blocks", "prefill_attention",
           "scatter_blocks", "write_cache"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
# Elements of K (and as many of V) one decode program holds per tile: 32 tokens at head_dim
# 128, 64 at 64, 16 at 256. ptxas -v on the sm_90 cubins (bfloat16, 4 warps, pointers and
# strides divisible by 16 as Triton specializes them for head_dim 64, 128 and 256): 56
# registers a thread, nothing spilled (4 bytes in the split variant at 256), so 9 programs
# (36 warps) an SM, each loading 8 KiB of K and 8 KiB of V a tile; 2048 elements took 48-56
# registers too, for half the bytes in flight, and 8192 took 80-92. The kernel is bound by
# memory: bytes in flight per SM are what matter. (Strides Triton cannot prove divisible,
# head_dim 24 say, take 168 registers at 4096: such models are rare.)
DECODE_TILE_ELEMENTS = 4096
# Tokens of context one decode program reads (rounded to whole tiles): 512, as vLLM's paged
# attention v2 partitions, is 16 tiles at head_dim 128. Fewer would multiply the partial
# results (head_dim + 2 floats per split, against 512 x head_dim x 2 elements of K/V read);
# more would leave the device idle for a few long sequences (1 sequence of 8k tokens x 32
# heads is 512 programs at 512 tokens a split: about 4 for each of an H100's 132 SMs).
DECODE_SPLIT_TOKENS = 512
# Splits the merge kernel reads at once: 16 x head_dim 256 floats stay in registers.
MERGE_CHUNK_SPLITS = 16
# Elements one copy program moves: 4096 two-byte elements are 8 KiB, a 16-token block of
# 2 KV heads x 128 dims; a larger block takes several programs along grid axis 2.
COPY_CHUNK_ELEMENTS = 4096
# The window the kernel is given for "no window": longer than any context (int32 lengths),
# so that the window's start, context_len - NO_WINDOW, is below 0 and clamps to 0.
NO_WINDOW = 2**31 - 1
# CUDA's limit on grid axes 1 and 2.
MAX_GRID_YZ = 65535
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ---------------------------------------------------------------------------------------
# Kernels. Each takes raw pointers (tensors) and element strides; Python ints that vary
# per call are plain arguments, the shapes that size a tile are tl.constexpr.


@triton.jit
def _decode_kernel(out_ptr, part_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, scale,
                   window, sinks, stride_q_seq, stride_q_head, stride_o_seq, stride_o_head,
                   stride_cache_block, stride_cache_token, stride_cache_head, stride_table,
                   block_size, group,
                   HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, TILE: tl.constexpr,
                   SPLIT_TILES: tl.constexpr, PARTIAL: tl.constexpr):
    """Attention of query head program_id(1) of sequence program_id(0) over context split
    program_id(2): indexes [start, end), the split's SPLIT_TILES tiles of the attended
    positions. Those are the context [0, context_len) when window >= context_len; else the
    first num_sinks = min(sinks, lo) positions followed by the window [lo, context_len),
    lo = context_len - window, numbered consecutively: index i reads position i below
    num_sinks and i - num_sinks + lo from there. Unless PARTIAL (one split covers every
    context), the normalized output is stored; if PARTIAL, the split's running max, sum of
    weights and unnormalized accumulator go to part_ptr for _decode_merge_kernel.

    The loop runs a fixed SPLIT_TILES times and skips the tiles past `end`: a loop bound
    read from memory cannot be interpreted (Triton 3.6's interpreter takes int() of a
    one-element array for range(), which numpy 2 refuses), and a fixed count is what the
    compiler pipelines best anyway."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    kv_head = head // group
    context_len = tl.load(lens_ptr + seq)
    lo = tl.maximum(context_len - window, 0)
    num_sinks = tl.minimum(sinks, lo)
    attended = num_sinks + context_len - lo
    start = split * (SPLIT_TILES * TILE)
    end = tl.minimum(attended, start + SPLIT_TILES * TILE)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_q_seq + head * stride_q_head + dims, mask=dim_ok,
                other=0.0).to(tl.float32)
    q = q * scale
    running_max = -float("inf")
    weight_sum = 0.0
    acc = tl.zeros([HEAD_PAD], dtype=tl.float32)
    for tile in range(SPLIT_TILES):
        tile_start = start + tile * TILE
        if tile_start < end:
            index = tile_start + tl.arange(0, TILE)
            live = index < end
            pos = tl.where(index < num_sinks, index, index - num_sinks + lo)
            block = tl.load(tables_ptr + seq * stride_table + pos // block_size, mask=live,
                            other=0).to(tl.int64)
            rows = (block * stride_cache_block + (pos % block_size) * stride_cache_token
                    + kv_head * stride_cache_head)
            offsets = rows[:, None] + dims[None, :]
            kv_mask = live[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
            scores = tl.sum(k * q[None, :], axis=1)
            scores = tl.where(live, scores, -float("inf"))
            # The tile has a live position, so new_max is finite and the rescale of an empty
            # running state (max -inf) is exp(-inf) = 0.
            new_max = tl.maximum(running_max, tl.max(scores, axis=0))
            rescale = tl.exp(running_max - new_max)
            weights = tl.exp(scores - new_max)
            v = tl.load(v_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * rescale + tl.sum(weights[:, None] * v, axis=0)
            weight_sum = weight_sum * rescale + tl.sum(weights, axis=0)
            running_max = new_max
    if PARTIAL:
        # part[seq, head, split] = (max, sum, acc[HEAD_DIM]); an empty split stores -inf, 0, 0.
        row = ((seq * tl.num_programs(1) + head) * tl.num_programs(2) + split) * (HEAD_DIM + 2)
        tl.store(part_ptr + row, running_max)
        tl.store(part_ptr + row + 1, weight_sum)
        tl.store(part_ptr + row + 2 + dims, acc, mask=dim_ok)
    else:
        # A context of 0 (a padding row) read nothing: its output is zeros, as the reference's
        # (acc is zeros then, so dividing it by 1 stores zeros without a 0 / 0).
        out = acc / tl.where(weight_sum > 0.0, weight_sum, 1.0)
        tl.store(out_ptr + seq * stride_o_seq + head * stride_o_head + dims,
                 out.to(out_ptr.dtype.element_ty), mask=dim_ok)


@triton.jit
def _decode_merge_kernel(out_ptr, part_ptr, stride_o_seq, stride_o_head, num_splits,
                         HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                         SPLIT_CHUNK: tl.constexpr, SPLIT_CHUNKS: tl.constexpr):
    """out[seq, head] = the softmax-weighted merge of the num_splits partial results of
    _decode_kernel for (program_id(0), program_id(1)); zeros when every split was empty.
    Two passes over the splits, SPLIT_CHUNK at a time: the largest max first, then the sums
    and accumulators rescaled to it."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    first = (seq * tl.num_programs(1) + head) * num_splits
    top = -float("inf")
    for chunk in range(SPLIT_CHUNKS):
        splits = chunk * SPLIT_CHUNK + tl.arange(0, SPLIT_CHUNK)
        maxes = tl.load(part_ptr + (first + splits) * (HEAD_DIM + 2),
                        mask=splits < num_splits, other=-float("inf"))
        top = tl.maximum(top, tl.max(maxes, axis=0))
    # An empty split has max -inf, so its factor is exp(-inf) = 0; when every split is empty
    # top is -inf too, and -inf - -inf would be NaN: 0 stands in for it then.
    top = tl.where(top > -float("inf"), top, 0.0)
    total = 0.0
    merged = tl.zeros([HEAD_PAD], dtype=tl.float32)
    for chunk in range(SPLIT_CHUNKS):
        splits = chunk * SPLIT_CHUNK + tl.arange(0, SPLIT_CHUNK)
        split_ok = splits < num_splits
        rows = (first + splits) * (HEAD_DIM + 2)
        maxes = tl.load(part_ptr + rows, mask=split_ok, other=-float("inf"))
        sums = tl.load(part_ptr + rows + 1, mask=split_ok, other=0.0)
        accs = tl.load(part_ptr + rows[:, None] + 2 + dims[None, :],
                       mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
        factors = tl.exp(maxes - top)
        total += tl.sum(sums * factors, axis=0)
        merged += tl.sum(accs * factors[:, None], axis=0)
    out = merged / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq * stride_o_seq + head * stride_o_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


@triton.jit
def _write_kernel(k_cache_ptr, v_cache_ptr, key_ptr, value_ptr, slots_ptr,
                  stride_key_token, stride_key_head, stride_value_token, stride_value_head,
                  head_dim, row_elements, CHUNK: tl.constexpr):
    """Token program_id(0)'s K and V rows (kv_heads x head_dim, any token and head strides,
    unit dim stride) to cache slot slots[token] of the contiguous pools; a slot < 0 skips.
    program_id(1) picks the chunk of the row."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    elements = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    keep = (elements < row_elements) & (slot >= 0)
    heads = elements // head_dim
    dims = elements % head_dim
    key = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims,
                  mask=keep)
    value = tl.load(value_ptr + token * stride_value_token + heads * stride_value_head + dims,
                    mask=keep)
    # A contiguous pool's slot s is row s of [num_blocks * block_size, kv_heads * head_dim].
    dst = slot * row_elements + elements
    tl.store(k_cache_ptr + dst, key, mask=keep)
    tl.store(v_cache_ptr + dst, value, mask=keep)


@triton.jit
def _copy_kernel(dst_ptr, src_ptr, dst_ids_ptr, src_ids_ptr,
                 stride_dst_block, stride_dst_plane, stride_src_block, stride_src_plane,
                 block_elements, HAS_DST_IDS: tl.constexpr, HAS_SRC_IDS: tl.constexpr,
                 CHUNK: tl.constexpr):
    """Pair program_id(0), plane program_id(1) (a layer's K or V), chunk program_id(2):
    block dst_ids[pair] (or pair) of dst = block src_ids[pair] (or pair) of src."""
    pair = tl.program_id(0).to(tl.int64)
    plane = tl.program_id(1).to(tl.int64)
    dst_block = pair
    src_block = pair
    if HAS_DST_IDS:
        dst_block = tl.load(dst_ids_ptr + pair).to(tl.int64)
    if HAS_SRC_IDS:
        src_block = tl.load(src_ids_ptr + pair).to(tl.int64)
    elements = tl.program_id(2).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    keep = elements < block_elements
    bits = tl.load(src_ptr + src_block * stride_src_block + plane * stride_src_plane + elements,
                   mask=keep)
    tl.store(dst_ptr + dst_block * stride_dst_block + plane * stride_dst_plane + elements, bits,
             mask=keep)


# ---------------------------------------------------------------------------------------
# Which build of a kernel runs: compiled on CUDA, interpreted on CPU (the same function).


_INTERPRETED: dict[Any, Any] = {}
# One interpreted run at a time: the interpreter patches triton.language module-wide.
_INTERPRETER_LOCK = threading.RLock()


def _interpreted(fn: Any) -> Any:
    """Triton's interpreter for the Python function of `fn` (a @triton.jit function, or one
    already interpreted when TRITON_INTERPRET=1 was set before Triton was imported); the same
    wrapper for the same function, always."""
    from triton.runtime.interpreter import InterpretedFunction

    runner = _INTERPRETED.get(fn)
    if runner is None:
        runner = _INTERPRETED[fn] = InterpretedFunction(fn.fn)
    return runner


@contextmanager
def _interpreter_scope() -> Iterator[None]:
    """triton.language as the interpreter needs it for the duration, and as it was after.

    Its own @triton.jit helpers (tl.sum, tl.max, tl.zeros...) are interpreted: Triton does
    that only when TRITON_INTERPRET=1 was set before it was imported, and whoever imported
    it first (a GPU test, torch) decided that. Every module binding of a helper gets the same
    wrapper, since the interpreter recognises its fast reductions by identity
    (tl.standard._sum_combine). And every attribute of the language's modules and classes is
    put back afterwards: the interpreter patches them for each helper call and never
    restores those patches, after which Triton could no longer compile a kernel in this
    process."""
    # Imported lazily by the interpreter's argument handling, gluon copies tl's helpers
    # and insists they are compiled ones: it must be imported before the swap.
    import triton.experimental.gluon  # noqa: F401
    from triton.runtime.jit import JITFunction

    modules = [tl, tl.core, tl.standard, tl.math]
    namespaces: list[Any] = [*modules, tl.tensor, tl.dtype, tl.core.tensor_descriptor_base]
    with _INTERPRETER_LOCK:
        saved = [(space, dict(vars(space))) for space in namespaces]
        for module in modules:
            for name, member in list(vars(module).items()):
                if isinstance(member, JITFunction):
                    setattr(module, name, _interpreted(member))
        try:
            yield
        finally:
            for space, before in saved:
                _restore(space, before)


def _restore(space: Any, before: dict[str, Any]) -> None:
    """Sets every attribute of `space` (a module or class) back to `before`. A class loses
    what was added to it (the interpreter overrides inherited methods); a module keeps it,
    since what the interpreter adds to a module is the globals its rewritten helpers run
    with (and only names the module lacked)."""
    if isinstance(space, type):
        for name in [name for name in vars(space) if name not in before]:
            delattr(space, name)
    for name, value in before.items():
        if vars(space).get(name) is not value:
            setattr(space, name, value)


def _launch(kernel: Any, grid: tuple[int, ...], device: torch.device, *args: Any,
            **constexprs: Any) -> None:
    """Runs `kernel` over `grid`: compiled on the current stream of CUDA `device` (made the
    current device for the launch, since Triton launches on the current one), or through the
    interpreter for CPU tensors."""
    if device.type == "cpu":
        with _interpreter_scope():
            _interpreted(kernel)[grid](*args, **constexprs)
        return
    with torch.cuda.device(device):
        kernel[grid](*args, **constexprs)


def _device_of(*tensors: torch.Tensor) -> torch.device:
    """The one device all `tensors` live on: CUDA, or CPU for the interpreter."""
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type not in ("cuda", "cpu"):
        found = sorted(str(d) for d in devices)
        raise ValueError(f"kvstore.kernels.gpu needs tensors on one CUDA device (or the CPU, "
                         f"for Triton's interpreter), got {found}; use "
                         "kvstore.kernels.ops_for(device)")
    return next(iter(devices))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t viewed as integers of its element's width: copies of them are exact for any dtype."""
    return t.view(_BITS[t.element_size()])


def _require_pool(pool: torch.Tensor, name: str) -> None:
    if pool.dim() != 4 or not pool.is_contiguous():
        raise ValueError(f"{name} must be a contiguous [num_blocks, block_size, kv_heads, "
                         f"head_dim] pool, got {tuple(pool.shape)} strides {pool.stride()}")


# ---------------------------------------------------------------------------------------
# decode_attention


def _check_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_seqs, num_heads, head_dim], got "
                         f"{tuple(query.shape)}")
    _require_pool(k_cache, "k_cache")
    _require_pool(v_cache, "v_cache")
    num_seqs, num_heads, head_dim = query.shape
    _group_size(num_heads, k_cache.shape[2])
    if query.dtype not in DTYPES or {k_cache.dtype, v_cache.dtype} != {query.dtype}:
        raise ValueError(f"query/cache dtypes {query.dtype}/{k_cache.dtype}/{v_cache.dtype}: "
                         "need one of float32, float16, bfloat16 for all three")
    if k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"query head_dim {head_dim} vs caches {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    if head_dim > MAX_HEAD_DIM or num_heads > MAX_GRID_YZ:
        raise ValueError(f"head_dim {head_dim} > {MAX_HEAD_DIM} or num_heads {num_heads} > "
                         f"{MAX_GRID_YZ}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_blocks], got "
                         f"{tuple(block_tables.shape)}")
    if tuple(context_lens.shape) != (num_seqs,):
        raise ValueError(f"context_lens must be [num_seqs={num_seqs}], got "
                         f"{tuple(context_lens.shape)}")


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     scale: float, *, window: int | None = None,
                     sinks: int = 0) -> torch.Tensor:
    """As reference.decode_attention (window and sinks included), by the paged decode kernel
    (no gather of K/V; table entries of blocks outside the window and sinks are not read)."""
    return _decode(query, k_cache, v_cache, block_tables, context_lens, scale,
                   DECODE_SPLIT_TOKENS, window=window, sinks=sinks)


def _decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
            split_tokens: int, tile_tokens: int | None = None, *,
            window: int | None = None, sinks: int = 0) -> torch.Tensor:
    """decode_attention with contexts cut into splits of about `split_tokens` tokens (rounded
    to whole tiles of `tile_tokens`, a power of two; None: sized by head_dim). The unit
    tests pass small ones, so that contexts of a few dozen tokens cross tiles and splits."""
    device = _device_of(query, k_cache, v_cache)
    _check_decode(query, k_cache, v_cache, block_tables, context_lens)
    check_window(window, sinks)
    num_seqs, num_heads, head_dim = query.shape
    block_size = k_cache.shape[1]
    if query.stride(2) != 1:
        query = query.contiguous()
    tables = block_tables.to(device=device, dtype=torch.int32).contiguous()
    lens = context_lens.to(device=device, dtype=torch.int32).contiguous()
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=query.dtype, device=device)
    if num_seqs == 0:
        return out
    head_pad = triton.next_power_of_2(head_dim)
    tile = tile_tokens or max(16, DECODE_TILE_ELEMENTS // head_pad)
    split_tiles = max(1, split_tokens // tile)
    # The table's width bounds every context without reading the lengths (on the device:
    # reading them would wait for the work queued before).
    max_tokens = tables.shape[1] * block_size
    if window is not None:  # a window attends to at most window + sinks positions
        max_tokens = min(max_tokens, window + sinks)
    splits = max(1, -(-max_tokens // (split_tiles * tile)))
    if splits > MAX_GRID_YZ:
        raise ValueError(f"block_tables {tuple(tables.shape)} would need {splits} context "
                         f"splits > {MAX_GRID_YZ}")
    part = out
    if splits > 1:
        part = torch.empty((num_seqs, num_heads, splits, head_dim + 2), dtype=torch.float32,
                           device=device)
    _launch(_decode_kernel, (num_seqs, num_heads, splits), device,
            out, part, query, k_cache, v_cache, tables, lens, float(scale),
            NO_WINDOW if window is None else window, sinks,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
            block_size, num_heads // k_cache.shape[2],
            HEAD_DIM=head_dim, HEAD_PAD=head_pad, TILE=tile, SPLIT_TILES=split_tiles,
            PARTIAL=splits > 1)
    if splits > 1:
        chunk = min(MERGE_CHUNK_SPLITS, triton.next_power_of_2(splits))
        _launch(_decode_merge_kernel, (num_seqs, num_heads), device,
                out, part, out.stride(0), out.stride(1), splits,
                HEAD_DIM=head_dim, HEAD_PAD=head_pad, SPLIT_CHUNK=chunk,
                SPLIT_CHUNKS=triton.next_power_of_2(triton.cdiv(splits, chunk)))
    return out


# ---------------------------------------------------------------------------------------
# write_cache


def write_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """As reference.write_cache (a slot < 0 skips the token). key and value may be strided
    over tokens and heads (slices of a fused projection); they are converted to the cache's
    dtype first when theirs differs."""
    device = _device_of(key, value, k_cache, v_cache)
    _require_pool(k_cache, "k_cache")
    _require_pool(v_cache, "v_cache")
    fits = key.dim() == 3 and key.shape == value.shape and key.shape[1:] == k_cache.shape[2:]
    if not fits or v_cache.shape != k_cache.shape or slot_mapping.shape != key.shape[:1]:
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} / slot_mapping "
                         f"{tuple(slot_mapping.shape)} do not fit a cache of "
                         f"{tuple(k_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype} differ")

    def rows(t: torch.Tensor) -> torch.Tensor:
        t = t.to(k_cache.dtype)
        return t if t.stride(2) == 1 else t.contiguous()

    key, value = rows(key), rows(value)
    slots = slot_mapping.to(device=device, dtype=torch.int64).contiguous()
    num_tokens, _, head_dim = key.shape
    row_elements = key.shape[1] * head_dim
    if num_tokens == 0:
        return
    chunk = min(COPY_CHUNK_ELEMENTS, triton.next_power_of_2(row_elements))
    _launch(_write_kernel, (num_tokens, triton.cdiv(row_elements, chunk)), device,
            _bits(k_cache), _bits(v_cache), _bits(key), _bits(value), slots,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            head_dim, row_elements, CHUNK=chunk)


# ---------------------------------------------------------------------------------------
# copy_blocks, gather_blocks, scatter_blocks: one copy kernel over (pair, plane, chunk).


def _cache_geometry(kv_cache: torch.Tensor) -> tuple[int, int, int]:
    """(planes = num_layers * 2, elements per block, elements between planes) of a
    contiguous cache."""
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2 or not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be a contiguous [num_layers, 2, num_blocks, block_size, "
                         f"kv_heads, head_dim] tensor, got {tuple(kv_cache.shape)}")
    block_elements = kv_cache[0, 0, 0].numel()
    return kv_cache.shape[0] * 2, block_elements, kv_cache.shape[2] * block_elements


def _copy(dst: torch.Tensor, src: torch.Tensor, dst_ids: torch.Tensor | None,
          src_ids: torch.Tensor | None, num_pairs: int, planes: int, block_elements: int,
          dst_strides: tuple[int, int], src_strides: tuple[int, int]) -> None:
    """For each pair p and plane: block (dst_ids[p] or p) of dst = block (src_ids[p] or p)
    of src; strides are (between blocks, between planes) in elements."""
    if num_pairs == 0:
        return
    chunk = min(COPY_CHUNK_ELEMENTS, triton.next_power_of_2(block_elements))
    chunks = triton.cdiv(block_elements, chunk)
    if planes > MAX_GRID_YZ or chunks > MAX_GRID_YZ:
        raise ValueError(f"{planes} layer planes or {chunks} chunks a block > {MAX_GRID_YZ}")
    bits_dst, bits_src = _bits(dst), _bits(src)
    _launch(_copy_kernel, (num_pairs, planes, chunks), dst.device,
            bits_dst, bits_src, dst_ids if dst_ids is not None else bits_dst,
            src_ids if src_ids is not None else bits_src,
            *dst_strides, *src_strides, block_elements,
            HAS_DST_IDS=dst_ids is not None, HAS_SRC_IDS=src_ids is not None, CHUNK=chunk)


def copy_blocks(kv_cache: torch.Tensor, src_ids: BlockIds, dst_ids: BlockIds) -> None:
    """As reference.copy_blocks; the pairs are copied in parallel, so dst blocks must be
    distinct and none of them a source (true of copy-on-write into fresh blocks)."""
    device = _device_of(kv_cache)
    planes, block_elements, plane_elements = _cache_geometry(kv_cache)
    src = _ids(src_ids, device).contiguous()
    dst = _ids(dst_ids, device).contiguous()
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError(f"src_ids {tuple(src.shape)} and dst_ids {tuple(dst.shape)} must be "
                         "equal-length 1-D")
    strides = (block_elements, plane_elements)
    _copy(kv_cache, kv_cache, dst, src, src.numel(), planes, block_elements, strides, strides)


def _staging_shape(kv_cache: torch.Tensor, count: int) -> tuple[int, ...]:
    return (count, kv_cache.shape[0], 2, *kv_cache.shape[3:])


def gather_blocks(kv_cache: torch.Tensor, block_ids: BlockIds,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """As reference.gather_blocks: one copy kernel into a staging buffer on the cache's
    device (`out` itself when it is there, in the cache's dtype), then one copy to `out`
    when it is elsewhere (pinned host memory, say: synchronous, as the reference's)."""
    device = _device_of(kv_cache)
    planes, block_elements, plane_elements = _cache_geometry(kv_cache)
    ids = _ids(block_ids, device).contiguous()
    shape = _staging_shape(kv_cache, ids.numel())
    if out is not None and (tuple(out.shape) != shape or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {shape} tensor, got {tuple(out.shape)}")
    direct = out is not None and out.device == device and out.dtype == kv_cache.dtype
    staged = out if direct and out is not None else kv_cache.new_empty(shape)
    _copy(staged, kv_cache, None, ids, ids.numel(), planes, block_elements,
          (planes * block_elements, block_elements), (block_elements, plane_elements))
    if out is None or staged is out:
        return staged
    return out.copy_(staged)


def scatter_blocks(staging: torch.Tensor, kv_cache: torch.Tensor, block_ids: BlockIds) -> None:
    """As reference.scatter_blocks (staging may be on the host: it is copied over first).
    Duplicate ids leave one of their rows, unspecified which."""
    device = _device_of(kv_cache)
    planes, block_elements, plane_elements = _cache_geometry(kv_cache)
    ids = _ids(block_ids, device).contiguous()
    shape = _staging_shape(kv_cache, ids.numel())
    if tuple(staging.shape) != shape:
        raise ValueError(f"staging must be {shape}, got {tuple(staging.shape)}")
    rows = staging.to(device=device, dtype=kv_cache.dtype).contiguous()
    _copy(kv_cache, rows, ids, None, ids.numel(), planes, block_elements,
          (block_elements, plane_elements), (planes * block_elements, block_elements))


def probe(device: torch.device) -> None:
    """Compiles and runs a small decode and copy on `device` and checks them against the
    reference: raises when Triton cannot build or run the kernels there (ops_for then falls
    back to the reference)."""
    from . import reference

    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(1, 2, 4, 2, 1, 16, generator=gen).to(device)
    query = torch.randn(2, 2, 16, generator=gen).to(device)
    tables = torch.tensor([[3, 1], [2, -1]], dtype=torch.int32, device=device)
    lens = torch.tensor([3, 2], dtype=torch.int32, device=device)
    got = decode_attention(query, kv[0, 0], kv[0, 1], tables, lens, 0.25)
    want = reference.decode_attention(query, kv[0, 0], kv[0, 1], tables, lens, 0.25)
    checks: list[tuple[str, Callable[[], bool]]] = [
        ("decode_attention", lambda: bool(torch.allclose(got, want, atol=1e-4, rtol=0))),
        ("gather_blocks", lambda: bool(torch.equal(gather_blocks(kv, [2, 0]),
                                                   reference.gather_blocks(kv, [2, 0])))),
    ]
    for name, check in checks:
        if not check():
            raise RuntimeError(f"the Triton {name} disagrees with the reference on {device}")
