"""Compute kernels for the engine's paged KV cache: the torch reference (`reference`, also the
CPU implementation) and Triton kernels (`gpu`, compiled by Triton for CUDA devices).

Owns the choice between them: `ops_for(device)` returns kernels.gpu when the device is a
CUDA device, Triton imports and a probe of its kernels there agrees with the reference, else
the reference; the choice is made once per device, logged, and cached. On CUDA,
prefill_attention is the torch reference (one SDPA call per sequence) in both.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol

import torch

from . import reference
from .reference import (
    copy_blocks,
    decode_attention,
    gather_blocks,
    prefill_attention,
    scatter_blocks,
    write_cache,
)

__all__ = ["KernelOps", "copy_blocks", "decode_attention", "gather_blocks", "ops_for",
           "prefill_attention", "reference", "scatter_blocks", "write_cache"]

log = logging.getLogger(__name__)


class KernelOps(Protocol):
    """What ops_for returns: kernels.reference or kernels.gpu (modules, same signatures).
    The attention ops take an optional sliding `window` and `sinks`, with the meaning
    reference.attendable gives them."""

    def write_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None: ...

    def decode_attention(self, query: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, scale: float, *,
                         window: int | None = None, sinks: int = 0) -> torch.Tensor: ...

    def prefill_attention(self, query: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, block_tables: torch.Tensor,
                          query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                          scale: float, *, window: int | None = None,
                          sinks: int = 0) -> torch.Tensor: ...

    def gather_blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor | Sequence[int],
                      out: torch.Tensor | None = None) -> torch.Tensor: ...

    def scatter_blocks(self, staging: torch.Tensor, kv_cache: torch.Tensor,
                       block_ids: torch.Tensor | Sequence[int]) -> None: ...

    def copy_blocks(self, kv_cache: torch.Tensor, src_ids: torch.Tensor | Sequence[int],
                    dst_ids: torch.Tensor | Sequence[int]) -> None: ...


_OPS: dict[torch.device, KernelOps] = {}
_OPS_LOCK = threading.Lock()


def _normalized(device: torch.device | str | int) -> torch.device:
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        # "cuda" means the current device; a CPU-only torch has none, and 0 fails over below.
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        dev = torch.device("cuda", index)
    return dev


def _pick(dev: torch.device) -> KernelOps:
    if dev.type != "cuda":
        log.info("kernels for %s: torch reference", dev)
        return reference
    try:
        from . import gpu

        gpu.probe(dev)
    except Exception as exc:  # no Triton, no driver, a compiler error: all mean "unusable"
        log.warning("kernels for %s: torch reference, the Triton kernels are unavailable "
                    "(%s: %s)", dev, type(exc).__name__, exc)
        return reference
    log.info("kernels for %s: Triton (kvstore/kernels/gpu.py)", dev)
    return gpu


def ops_for(device: torch.device | str | int) -> KernelOps:
    """The kernel implementations for tensors on `device` (chosen once per device)."""
    dev = _normalized(device)
    with _OPS_LOCK:
        ops = _OPS.get(dev)
        if ops is None:
            ops = _OPS[dev] = _pick(dev)
        return ops
