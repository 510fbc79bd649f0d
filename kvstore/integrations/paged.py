"""`PagedKV`: blocks of an engine's paged KV cache given as one tensor per layer, each with a
block dimension, in whatever layout the attention backend chose.

One stored block is every layer's slice of one engine block, layer after layer, each slice in
its tensor's own element order with the block dimension taken out (for vLLM's CPU backend a
layer's slice is [kv_heads, block_size, 2 * head_dim]). `gather` copies blocks out into a
staging buffer of such rows; `scatter` writes rows back. Neither orders itself against the
forward pass: the worker runs both through `device_copies`, on its copy stream. When the layers
are views of one buffer with the block outermost (a cross-layer layout), a block's rows already
lie contiguous in the cache: `direct_rows` gives views of them, so loads read straight into
the cache with no staging and no scatter.

Two layouts of a layer's block are known, and a `PagedKV` is told which it holds (`layout`):

- `KV`: every layer holds a key and a value per token and KV head, in whatever order the
  backend chose (vLLM's CPU backend: [kv_heads, block_size, K|V head_dim]);
- `LATENT`: Multi-head Latent Attention (DeepSeek V2/V3, Kimi K2): one compressed latent
  vector per token, shared by every head, with no K/V split (vLLM's MLA backends:
  [block_size, kv_lora_rank + qk_rope_head_dim], its CPU one with a head dimension of 1).
  It is the same on every tensor-parallel rank, which is why the connector stores it once
  (`vllm_worker`).

Both are copied the same way, byte for byte; the layout is named in `signature` so that a
block of one is never mistaken for a block of the other.

A hybrid model (vLLM's hybrid KV-cache manager: sliding-window layers beside full-attention
ones) keeps its layers in several KV-cache groups, each with block ids of its own (the groups
may even share one buffer). A stored block is still every layer's slice of one block position,
in model order; `gather` and `scatter` take the first group's block ids and `more_groups`, the
other groups' ids for the same positions. A negative id marks a position where that group
holds no block (a sliding window's blocks that slid out): `scatter` writes nothing there.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from kvstore.integrations.device_copies import device_ids

KV = "kv"
LATENT = "latent"
LAYOUTS = (KV, LATENT)


def _block_dim(tensor: torch.Tensor, num_blocks: int, name: str) -> int:
    dims = [d for d, size in enumerate(tensor.shape) if size == num_blocks]
    if not dims:
        raise ValueError(f"KV cache {name} has shape {tuple(tensor.shape)}: no dimension of "
                         f"{num_blocks} blocks")
    return max(dims, key=tensor.stride)  # the outermost, if a head count equals num_blocks


class PagedKV:
    def __init__(self, layers: Sequence[tuple[str, torch.Tensor]], num_blocks: int,
                 layout: str = KV, groups: Sequence[int] | None = None) -> None:
        """layers: (name, tensor) in model order; num_blocks: the cache's block count;
        layout: `KV` or `LATENT` (the module's docstring); groups: each layer's KV-cache
        group, 0 to n - 1 (default: one group)."""
        if not layers:
            raise ValueError("no KV cache layers to register")
        self.groups = list(groups) if groups is not None else [0] * len(layers)
        self.num_groups = max(self.groups) + 1
        if len(self.groups) != len(layers) or set(self.groups) != set(range(self.num_groups)):
            raise ValueError(f"KV cache groups {self.groups}: one per layer, numbered 0 to "
                             f"n - 1 with none empty")
        if layout not in LAYOUTS:
            raise ValueError(f"KV cache layout must be one of {', '.join(LAYOUTS)}, "
                             f"got {layout!r}")
        self.layout = layout
        self.names = [name for name, _ in layers]
        self.tensors = [tensor for _, tensor in layers]
        self.num_blocks = num_blocks
        self.dims = [_block_dim(t, num_blocks, n) for n, t in layers]
        self.shapes = [t.shape[:d] + t.shape[d + 1:] for t, d in zip(self.tensors, self.dims,
                                                                     strict=True)]
        self.layer_bytes = [int(np.prod(shape)) * t.element_size()
                            for shape, t in zip(self.shapes, self.tensors, strict=True)]
        self.offsets = [sum(self.layer_bytes[:i]) for i in range(len(self.layer_bytes))]
        self.block_bytes = sum(self.layer_bytes)
        if layout == LATENT:
            for name, shape in zip(self.names, self.shapes, strict=True):
                # [block_size, latent width], after any dimensions of 1 (vLLM's CPU MLA
                # backend keeps a head dimension of 1): a K/V split or KV heads are not latent.
                if len(shape) < 2 or any(size != 1 for size in shape[:-2]):
                    raise ValueError(f"KV cache {name}: a latent (MLA) block is [block_size, "
                                     f"latent width], got {tuple(shape)}")
        self.device = self.tensors[0].device
        # Several groups address one position by different block ids: never one buffer row.
        self._base = self._cross_layer_base() if self.num_groups == 1 else None

    def _cross_layer_base(self) -> int | None:
        """The address of block 0 when every block's layers lie contiguous, one after another,
        in host memory; else None."""
        if self.device.type != "cpu":
            return None
        base = self.tensors[0].select(self.dims[0], 0).data_ptr()
        for t, d, off in zip(self.tensors, self.dims, self.offsets, strict=True):
            block0 = t.select(d, 0)
            if (not block0.is_contiguous() or block0.data_ptr() != base + off
                    or t.stride(d) * t.element_size() != self.block_bytes):
                return None
        return base

    @property
    def direct(self) -> bool:
        return self._base is not None

    def signature(self) -> str:
        """The layout a stored block depends on: K/V or latent, the layer count, dtypes and
        per-layer block shapes (`latent 2L/torch.float32:128x576`)."""
        shapes = {f"{t.dtype}:{'x'.join(map(str, s))}" for t, s in zip(self.tensors,
                                                                       self.shapes, strict=True)}
        return f"{self.layout} {len(self.tensors)}L/" + "+".join(sorted(shapes))

    def staging(self, count: int) -> torch.Tensor:
        """count rows of block_bytes, pinned when the cache is on a GPU."""
        return torch.empty((count, self.block_bytes), dtype=torch.uint8,
                           pin_memory=self.device.type == "cuda")

    @staticmethod
    def rows(staging: torch.Tensor) -> list[np.ndarray]:
        return [row.numpy() for row in staging]

    def direct_rows(self, block_ids: Sequence[int]) -> list[np.ndarray]:
        """Writable views of the cache's own memory, one block each (only when `direct`)."""
        assert self._base is not None
        return [np.ctypeslib.as_array((ctypes.c_uint8 * self.block_bytes).from_address(
            self._base + b * self.block_bytes)) for b in block_ids]

    def _per_group(self, block_ids: Sequence[int],
                   more_groups: Sequence[Sequence[int]]) -> list[list[int]]:
        """Every group's block ids for the same positions."""
        per_group = [list(block_ids), *(list(g) for g in more_groups)]
        if len(per_group) != self.num_groups or any(len(g) != len(block_ids)
                                                    for g in per_group):
            raise ValueError(f"block ids for {len(per_group)} groups of "
                             f"{[len(g) for g in per_group]} positions; the cache has "
                             f"{self.num_groups} groups")
        return per_group

    def gather(self, block_ids: Sequence[int], out: torch.Tensor | None = None, *,
               more_groups: Sequence[Sequence[int]] = ()) -> torch.Tensor:
        """A staging copy of the blocks, one row each, on the host: into `out` (len(block_ids)
        rows of block_bytes) when given. more_groups: the other groups' block ids for the
        same positions, every one held. On a GPU the rows are gathered on the device and
        copied to the host in one copy that does not wait for it (out is pinned): the caller
        orders it (`device_copies`)."""
        per_group = self._per_group(block_ids, more_groups)
        out = self.staging(len(block_ids)) if out is None else out
        ids = [device_ids(g, self.device) for g in per_group]
        rows = out if self.device == out.device else torch.empty(
            out.shape, dtype=torch.uint8, device=self.device)
        for t, d, off, size, g in zip(self.tensors, self.dims, self.offsets, self.layer_bytes,
                                      self.groups, strict=True):
            part = t.index_select(d, ids[g]).movedim(d, 0).reshape(len(block_ids), -1)
            rows[:, off:off + size].copy_(part.view(torch.uint8))
        if rows is not out:
            out.copy_(rows, non_blocking=True)
        return out

    def scatter(self, staging: torch.Tensor, block_ids: Sequence[int], *,
                more_groups: Sequence[Sequence[int]] = ()) -> None:
        """Write staged rows into the blocks (the first len(block_ids) rows). more_groups:
        the other groups' block ids for the same positions; a negative id (in any group)
        is a position that group does not hold, and gets nothing."""
        if not block_ids:
            return
        per_group = self._per_group(block_ids, more_groups)
        count = len(block_ids)
        rows = staging[:count].to(self.device, non_blocking=True)
        held = [[i for i, b in enumerate(g) if b >= 0] for g in per_group]
        picks = [None if len(h) == count else device_ids(h, self.device) for h in held]
        ids = [device_ids([g[i] for i in h], self.device)
               for g, h in zip(per_group, held, strict=True)]
        for t, d, off, size, shape, g in zip(self.tensors, self.dims, self.offsets,
                                             self.layer_bytes, self.shapes, self.groups,
                                             strict=True):
            if not held[g]:
                continue
            pick = picks[g]
            part = rows[:, off:off + size] if pick is None else rows.index_select(
                0, pick)[:, off:off + size]
            part = part.contiguous().view(t.dtype)
            t.index_copy_(d, ids[g], part.reshape(len(held[g]), *shape).movedim(0, d))
