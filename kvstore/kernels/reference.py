"""The paged KV-cache operations in plain torch: the reference every other implementation
(kvstore/kernels/gpu.py, in Triton) is checked against, and the implementation the engine runs
on CPU.

Owns the layouts. One engine's cache is one tensor
`kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` (index 0 of dim 1
is K, 1 is V); a layer's pools `kv_cache[l, 0]` and `kv_cache[l, 1]` are contiguous
`[num_blocks, block_size, num_kv_heads, head_dim]` views. Token slot = block_id * block_size
+ offset_in_block. Query head h reads KV head h // (num_heads // num_kv_heads), as HF
`repeat_kv` does.

Attention accumulates in fp32 (SDPA's CPU and CUDA kernels do so for bf16 and fp16) and
returns the query's dtype. Everything works on CPU and CUDA tensors alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

BlockIds = torch.Tensor | Sequence[int]


def _group_size(num_heads: int, num_kv_heads: int) -> int:
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    return num_heads // num_kv_heads


def _ids(ids: BlockIds, device: torch.device) -> torch.Tensor:
    """Block ids as an int64 tensor on `device` (lists are accepted for copy-on-write)."""
    if isinstance(ids, torch.Tensor):
        return ids.to(device=device, dtype=torch.long)
    return torch.tensor(list(ids), dtype=torch.long, device=device)


def write_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k_cache/v_cache[slot] = key/value[i] for slot = slot_mapping[i]; a slot < 0 skips the
    token (padding). key, value: [num_tokens, num_kv_heads, head_dim]."""
    if key.shape != value.shape or key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit a "
                         f"cache of {tuple(k_cache.shape)}")
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    keep = slots >= 0
    # Indexing by (block, offset) rather than a flat view works for non-contiguous pools too.
    slots = slots[keep]
    key = key.to(k_cache.device, k_cache.dtype)[keep]
    value = value.to(v_cache.device, v_cache.dtype)[keep]
    if k_cache.is_contiguous() and v_cache.is_contiguous():
        # A flat [slots, kv_heads, head_dim] view takes one index_copy_, 1.5-2.5x faster
        # than advanced-index assignment on CPU.
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value)
        return
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key
    v_cache[blocks, offsets] = value


def check_window(window: int | None, sinks: int) -> None:
    """Raise ValueError for a window that is not a positive int (or None) or negative sinks."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"sinks must be an int >= 0, got {sinks!r}")


def attendable(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None,
               sinks: int) -> torch.Tensor:
    """Which keys each query attends to, broadcast over query_pos[:, None] and key_pos[None]:
    key_pos <= query_pos, and, with a window, key_pos > query_pos - window (the window holds
    the query itself and the window - 1 positions before it: transformers'
    `sliding_window_overlay`, `kv_idx > q_idx - sliding_window`, the mask Mistral and Qwen2
    use) or key_pos < sinks (the attention sinks kept beside the window, StreamingLLM)."""
    mask = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        near = key_pos[None, :] > query_pos[:, None] - window
        if sinks:
            near |= key_pos[None, :] < sinks
        mask &= near
    return mask


def attended_blocks(context_len: int, num_new: int, block_size: int,
                    window: int | None, sinks: int) -> list[int]:
    """The blocks (indexes into a block table) a step's attention over a context of
    context_len tokens, num_new of them new, reads: every one without a window; with one,
    the blocks holding the sinks and those from the first new token's window start on.
    Blocks between them may have been freed (their table entries are then stale or -1): no
    kernel reads them."""
    num_blocks = -(-context_len // block_size)
    if window is None:
        return list(range(num_blocks))
    first = max(0, context_len - num_new - window + 1) // block_size
    return [*range(min(first, -(-sinks // block_size))), *range(first, num_blocks)]


def _gather_padded(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   lens: torch.Tensor, num_blocks: int, first: torch.Tensor | None = None,
                   sink_blocks: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V of every sequence as [num_seqs, num_blocks * block_size, kv_heads, head_dim]
    in one index_select each, and the [num_seqs, num_blocks * block_size] mask of real tokens.
    Table entries past a sequence's last block, or between its first `sink_blocks` blocks and
    its block `first[s]` (blocks that slid out of a window, maybe freed), may be anything (-1,
    stale ids): they are replaced by block 0 before gathering, and the caller masks those
    positions out."""
    num_seqs, width = block_tables.shape
    if width < num_blocks:
        raise ValueError(f"block_tables has {width} columns, the longest context needs "
                         f"{num_blocks}")
    block_size = k_cache.shape[1]
    device = k_cache.device
    table = block_tables[:, :num_blocks].to(device=device, dtype=torch.long)
    used = (lens + block_size - 1) // block_size
    cols = torch.arange(num_blocks, device=device)
    keep = cols < used[:, None]
    if first is not None:
        keep &= (cols >= first[:, None]) | (cols < sink_blocks)
    flat = torch.where(keep, table, 0).reshape(-1)
    padded = (num_seqs, num_blocks * block_size, *k_cache.shape[2:])
    # index_select is several times faster than advanced indexing for this gather on CPU.
    k = torch.index_select(k_cache, 0, flat).view(padded)
    v = torch.index_select(v_cache, 0, flat).view(padded)
    valid = torch.arange(num_blocks * block_size, device=device) < lens[:, None]
    return k, v, valid


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     scale: float, *, window: int | None = None,
                     sinks: int = 0) -> torch.Tensor:
    """One new token per sequence attends to positions 0..context_lens[s]-1 of its cache.

    query [num_seqs, num_heads, head_dim]; block_tables int32 [num_seqs, max_blocks];
    context_lens int32 [num_seqs] (the current token is already written). A sequence with
    context_len 0 (a padding row) gets zeros. Returns [num_seqs, num_heads, head_dim].

    With a `window`, the token (at position context_len - 1) attends only to positions
    context_len - window .. context_len - 1 (`window` tokens, itself included: see
    `attendable`), plus the first `sinks` positions; table entries of blocks wholly before
    that are never read (they may be -1).
    """
    check_window(window, sinks)
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = _group_size(num_heads, num_kv_heads)
    lens = context_lens.to(device=k_cache.device, dtype=torch.long)
    max_ctx = int(lens.max()) if num_seqs else 0
    if max_ctx <= 0:
        return torch.zeros_like(query)
    first = None
    if window is not None:
        first = (lens - window).clamp(min=0) // block_size
    k, v, valid = _gather_padded(k_cache, v_cache, block_tables, lens,
                                 -(-max_ctx // block_size), first, -(-sinks // block_size))
    if window is not None:
        valid &= _window_rows(lens, valid.shape[1], window, sinks)
    empty = lens <= 0
    valid[:, 0] |= empty  # an all-masked row would be NaN; its output is zeroed below
    # The `group` query heads of a KV head become its query rows: no K/V repeat is needed,
    # and decode has no causal mask, so every row shares the sequence's padding mask.
    q = query.reshape(num_seqs, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(
        q, k.transpose(1, 2).to(query.dtype), v.transpose(1, 2).to(query.dtype),
        attn_mask=valid[:, None, None, :], scale=scale)
    out = out.reshape(num_seqs, num_heads, head_dim)
    return out.masked_fill(empty[:, None, None], 0.0)


def _window_rows(lens: torch.Tensor, width: int, window: int, sinks: int) -> torch.Tensor:
    """[num_seqs, width]: the positions the last token of each context (at lens - 1) may
    attend to under the window and sinks, by `attendable`'s rule (causality aside: the
    padding mask already stops at lens)."""
    pos = torch.arange(width, device=lens.device)[None, :]
    near = pos > (lens - 1 - window)[:, None]
    if sinks:
        near |= pos < sinks
    return near


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                      context_lens: torch.Tensor, scale: float, *,
                      window: int | None = None, sinks: int = 0) -> torch.Tensor:
    """Causal attention of the new tokens of several sequences, concatenated.

    query [num_tokens, num_heads, head_dim]; query_start_loc int32 [num_seqs + 1]
    (cumulative, from 0); context_lens [num_seqs]: tokens in the cache after this step's
    write (cached prefix + new tokens). New token j of a sequence with q_len new tokens sits
    at position p = context_len - q_len + j and attends to positions 0..p; with a `window`,
    only to p - window + 1 .. p (and the first `sinks` positions), as `attendable` says. One
    SDPA call per sequence, over the blocks `attended_blocks` names (other table entries
    are never read). Returns [num_tokens, num_heads, head_dim].
    """
    check_window(window, sinks)
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = _group_size(num_heads, num_kv_heads)
    starts = [int(x) for x in query_start_loc.tolist()]
    lens = [int(x) for x in context_lens.tolist()]
    if len(starts) != len(lens) + 1 or starts[0] != 0 or starts[-1] != num_tokens:
        raise ValueError(f"query_start_loc {starts} does not cut {num_tokens} tokens into "
                         f"{len(lens)} sequences")
    out = torch.empty_like(query)
    device = k_cache.device
    for seq, (start, end, ctx) in enumerate(zip(starts, starts[1:], lens, strict=False)):
        q_len = end - start
        if q_len <= 0:
            continue
        if ctx < q_len:
            raise ValueError(f"sequence {seq}: context_len {ctx} < its {q_len} new tokens")
        read = attended_blocks(ctx, q_len, block_size, window, sinks)
        live = len(read) * block_size - (-(-ctx // block_size) * block_size - ctx)
        if read[-1] - read[0] + 1 == len(read):
            # One run of blocks (always, without sinks): a slice of the table, and the keys'
            # positions are a range.
            blocks = block_tables[seq, read[0] : read[-1] + 1].to(device=device,
                                                                  dtype=torch.long)
            key_pos = None  # a range from read[0] * block_size, made only if a mask needs it
        else:  # the sink blocks, then the window's: a gap between them
            cols = torch.tensor(read, dtype=torch.long, device=device)
            blocks = block_tables[seq].to(device=device, dtype=torch.long)[cols]
            # The position of every key gathered; the last block may be partly past ctx.
            key_pos = (cols[:, None] * block_size
                       + torch.arange(block_size, device=device)).flatten()[:live]
        k = torch.index_select(k_cache, 0, blocks).flatten(0, 1)[:live].to(query.dtype)
        v = torch.index_select(v_cache, 0, blocks).flatten(0, 1)[:live].to(query.dtype)
        windowed = window is not None and window < ctx
        if ctx == q_len and not windowed:  # no cached prefix, no window: plain causal
            o = F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                is_causal=True, scale=scale, enable_gqa=True)
            out[start:end] = o.transpose(0, 1)
            continue
        # A cached prefix or a window: the mask is not plain causal, and the `group` query
        # heads of a KV head become its rows (token-major), as in decode_attention: SDPA's
        # GQA path with a mask is several times slower on CPU (2.5x for 4 new tokens after
        # 1k cached ones), and the result is the same.
        rows = query[start:end].reshape(q_len, num_kv_heads, group, head_dim)
        rows = rows.permute(1, 0, 2, 3).reshape(num_kv_heads, q_len * group, head_dim)
        positions = torch.arange(ctx - q_len, ctx, device=device).repeat_interleave(group)
        if key_pos is None:
            key_pos = torch.arange(read[0] * block_size, ctx, device=device)
        mask = attendable(positions, key_pos, window, sinks)
        o = F.scaled_dot_product_attention(rows, k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, scale=scale)
        out[start:end] = o.reshape(num_kv_heads, q_len, group, head_dim).permute(
            1, 0, 2, 3).reshape(q_len, num_heads, head_dim)
    return out


def _staging_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """kv_cache as [num_blocks, num_layers, 2, block_size, kv_heads, head_dim] (a view)."""
    return kv_cache.permute(2, 0, 1, 3, 4, 5)


def staging_shape(kv_cache: torch.Tensor, count: int) -> tuple[int, ...]:
    """The shape of `count` staged blocks of kv_cache (what gather_blocks fills)."""
    return (count, *_staging_view(kv_cache).shape[1:])


def gather_blocks(kv_cache: torch.Tensor, block_ids: BlockIds,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """staging[i] = every layer's K and V of block block_ids[i]:
    [n, num_layers, 2, block_size, num_kv_heads, head_dim], contiguous, so one stored block is
    staging[i]'s bytes. `out` (e.g. pinned CPU memory for a GPU cache) is filled and returned;
    the copy is synchronous."""
    ids = _ids(block_ids, kv_cache.device)
    shape = staging_shape(kv_cache, ids.numel())
    if out is not None and (tuple(out.shape) != shape or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {shape} tensor, got {tuple(out.shape)}")
    if out is not None and out.device == kv_cache.device and out.dtype == kv_cache.dtype:
        return torch.index_select(_staging_view(kv_cache), 0, ids, out=out)
    staged = torch.index_select(_staging_view(kv_cache), 0, ids)  # contiguous
    if out is None:
        return staged
    return out.copy_(staged)


def scatter_blocks(staging: torch.Tensor, kv_cache: torch.Tensor, block_ids: BlockIds) -> None:
    """The inverse of gather_blocks: block block_ids[i] of every layer = staging[i]. staging
    may live on another device. Duplicate ids leave one of their rows, unspecified which."""
    ids = _ids(block_ids, kv_cache.device)
    shape = staging_shape(kv_cache, ids.numel())
    if tuple(staging.shape) != shape:
        raise ValueError(f"staging must be {shape}, got {tuple(staging.shape)}")
    rows = staging.to(device=kv_cache.device, dtype=kv_cache.dtype)
    kv_cache.index_copy_(2, ids, rows.permute(1, 2, 0, 3, 4, 5))


def copy_blocks(kv_cache: torch.Tensor, src_ids: BlockIds, dst_ids: BlockIds) -> None:
    """kv_cache[:, :, dst_ids[i]] = kv_cache[:, :, src_ids[i]] for every layer, K and V
    (copy-on-write of shared prefix blocks). Sources are read before any destination is
    written; the Triton version requires dst blocks to be distinct and not among the sources."""
    src = _ids(src_ids, kv_cache.device)
    dst = _ids(dst_ids, kv_cache.device)
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError(f"src_ids {tuple(src.shape)} and dst_ids {tuple(dst.shape)} must be "
                         "equal-length 1-D")
    if src.numel():
        kv_cache[:, :, dst] = kv_cache[:, :, src]
