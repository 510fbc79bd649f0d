"""CUDA implementations of the paged KV-cache ops, with the signatures of kernels/reference.py.

Owns the launch side of kernels/csrc/*.cu: the sources are read at run time and compiled by
NVRTC through cupy's `RawModule` (once per device, on first use), and every kernel runs on
torch's current CUDA stream, so it is ordered with the torch work around it. Tensors reach
the kernels as raw device pointers (`data_ptr()`): torch owns the memory, and since the
launch is on torch's stream its caching allocator cannot hand a temporary's memory to later
work before the kernel has read it.

- decode_attention: one thread block per (sequence, query head), an fp32 online softmax over
  the context read through the block table; float32, float16, bfloat16; head_dim <= 256.
- write_cache, copy_blocks, gather_blocks, scatter_blocks: byte copies in the widest unit
  (up to 16 bytes) that divides every size and address involved.
- prefill_attention stays the torch reference (one SDPA call per sequence, which on CUDA is
  a flash / memory-efficient kernel already).

cupy is imported only by `load`: importing this module needs no GPU; calling it without
cupy raises CudaKernelsUnavailable.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from .reference import BlockIds, _group_size, _ids, prefill_attention

__all__ = ["CudaKernelsUnavailable", "copy_blocks", "decode_attention", "gather_blocks",
           "kernel_names", "load", "prefill_attention", "scatter_blocks", "write_cache"]

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = ("paged_kv.cu",)
NVRTC_OPTIONS = ("-std=c++17",)
DTYPE_TAGS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
DECODE_MAX_HEAD_DIMS = (32, 64, 128, 256)  # one compiled variant each
DECODE_THREADS = 128  # kDecodeThreads in paged_kv.cu
COPY_UNIT_BYTES = (16, 8, 4, 2, 1)
COPY_THREADS = 256
MAX_GRID_Y = 65535


class CudaKernelsUnavailable(RuntimeError):
    """The CUDA kernels cannot run here (no cupy, no device, or NVRTC rejected the source)."""


class Launcher(Protocol):
    """Runs entry point `name` over grid x block with the given kernel arguments. CupyKernels
    is the real one; the _launch_* functions take any, so the launch arithmetic can be
    exercised against an emulation of the kernels without a GPU."""

    def launch(self, name: str, grid: tuple[int, ...], block: tuple[int, ...],
               args: tuple[Any, ...]) -> None: ...


def kernel_names() -> list[str]:
    """Every extern "C" entry point this module launches (the nvcc test checks the PTX)."""
    decode = [f"decode_attention_{tag}_d{dim}" for tag in DTYPE_TAGS.values()
              for dim in DECODE_MAX_HEAD_DIMS]
    copies = [f"{op}_b{unit}" for unit in COPY_UNIT_BYTES for op in ("write_cache", "copy_blocks")]
    return decode + copies


def source_text() -> str:
    return "\n".join((CSRC_DIR / name).read_text() for name in SOURCES)


class CupyKernels:
    """The compiled module on one device."""

    def __init__(self, module: Any, device_index: int) -> None:
        import cupy

        self.device_index = device_index
        self._device = cupy.cuda.Device(device_index)
        self._functions = {name: module.get_function(name) for name in kernel_names()}
        # One cupy wrapper per torch stream, made once: a new ExternalStream per launch costs
        # more host time than the copy kernels take on the device.
        self._streams: dict[int, Any] = {}

    def _stream(self, handle: int) -> Any:
        stream = self._streams.get(handle)
        if stream is None:
            import cupy

            stream = self._streams[handle] = cupy.cuda.ExternalStream(handle, self.device_index)
        return stream

    def launch(self, name: str, grid: tuple[int, ...], block: tuple[int, ...],
               args: tuple[Any, ...]) -> None:
        handle = torch.cuda.current_stream(self.device_index).cuda_stream
        with self._device, self._stream(handle):  # cupy launches on its current stream
            self._functions[name](grid, block, args)


_LOADED: dict[int, CupyKernels] = {}
_LOAD_LOCK = threading.Lock()


def load(device_index: int) -> CupyKernels:
    """The kernels compiled for CUDA device `device_index` (compiled on the first call)."""
    try:
        import cupy
    except ImportError as exc:
        raise CudaKernelsUnavailable("cupy is not installed (pip install 'kvstore[gpu]')") from exc
    with _LOAD_LOCK:
        if device_index in _LOADED:
            return _LOADED[device_index]
        try:
            with cupy.cuda.Device(device_index):
                module = cupy.RawModule(code=source_text(), options=NVRTC_OPTIONS)
                module.compile()  # surface NVRTC errors here, not at the first launch
                kernels = CupyKernels(module, device_index)
        except Exception as exc:  # driver, NVRTC or missing-entry errors all mean "unusable"
            raise CudaKernelsUnavailable(
                f"kernels/csrc did not compile or load on cuda:{device_index}: {exc}") from exc
        _LOADED[device_index] = kernels
        return kernels


def _kernels_for(*tensors: torch.Tensor) -> CupyKernels:
    device = tensors[0].device
    if device.type != "cuda" or any(t.device != device for t in tensors):
        found = sorted({str(t.device) for t in tensors})
        raise ValueError(f"kvstore.kernels.cuda needs tensors on one CUDA device, got {found}; "
                         "use kvstore.kernels.ops_for(device)")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return load(index)


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _copy_unit(*sizes_bytes: int) -> int:
    """The widest copy unit that divides every size, stride and address given."""
    return next(u for u in COPY_UNIT_BYTES if all(s % u == 0 for s in sizes_bytes))


def _require_pool(pool: torch.Tensor, name: str) -> None:
    if pool.dim() != 4 or not pool.is_contiguous():
        raise ValueError(f"{name} must be a contiguous [num_blocks, block_size, kv_heads, "
                         f"head_dim] pool, got {tuple(pool.shape)} strides {pool.stride()}")


def _launch_decode(kernels: Launcher, query: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, block_tables: torch.Tensor,
                   context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    num_seqs, num_heads, head_dim = query.shape
    _require_pool(k_cache, "k_cache")
    _require_pool(v_cache, "v_cache")
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    _group_size(num_heads, num_kv_heads)
    if query.dtype not in DTYPE_TAGS or {k_cache.dtype, v_cache.dtype} != {query.dtype}:
        raise ValueError(f"query/cache dtypes {query.dtype}/{k_cache.dtype}/{v_cache.dtype}: "
                         "need one of float32, float16, bfloat16 for all three")
    if k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"query head_dim {head_dim} vs caches {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    max_dim = next((d for d in DECODE_MAX_HEAD_DIMS if d >= head_dim), None)
    if max_dim is None or num_seqs > MAX_GRID_Y:
        raise ValueError(f"head_dim {head_dim} > 256 or {num_seqs} sequences > {MAX_GRID_Y}")
    if query.stride(2) != 1:
        query = query.contiguous()
    tables = block_tables.to(device=query.device, dtype=torch.int32).contiguous()
    lens = context_lens.to(device=query.device, dtype=torch.int32).contiguous()
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    args = (_ptr(out), _ptr(query), _ptr(k_cache), _ptr(v_cache), _ptr(tables), _ptr(lens),
            np.float32(scale), np.int32(num_heads), np.int32(num_kv_heads), np.int32(head_dim),
            np.int32(block_size), np.int32(tables.stride(0)), np.int64(query.stride(0)),
            np.int64(query.stride(1)))
    name = f"decode_attention_{DTYPE_TAGS[query.dtype]}_d{max_dim}"
    kernels.launch(name, (num_heads, num_seqs), (DECODE_THREADS,), args)
    return out


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """As reference.decode_attention, by the paged decode kernel (no gather of K/V)."""
    kernels = _kernels_for(query, k_cache, v_cache)
    return _launch_decode(kernels, query, k_cache, v_cache, block_tables, context_lens, scale)


def _launch_write(kernels: Launcher, key: torch.Tensor, value: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    _require_pool(k_cache, "k_cache")
    _require_pool(v_cache, "v_cache")
    fits = key.shape == value.shape and key.shape[1:] == k_cache.shape[2:]
    if not fits or v_cache.shape != k_cache.shape or slot_mapping.shape != key.shape[:1]:
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} / slots "
                         f"{tuple(slot_mapping.shape)} do not fit a cache of "
                         f"{tuple(k_cache.shape)}")
    row = key.shape[1] * key.shape[2]

    def rows(t: torch.Tensor) -> torch.Tensor:  # token rows may be strided (a qkv slice)
        t = t.to(k_cache.dtype)
        return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()

    key, value = rows(key), rows(value)
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long).contiguous()
    if key.shape[0] == 0:
        return
    size = k_cache.element_size()
    unit = _copy_unit(row * size, key.stride(0) * size, value.stride(0) * size,
                      key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr())
    row_units = row * size // unit
    args = (_ptr(k_cache), _ptr(v_cache), _ptr(key), _ptr(value), _ptr(slots),
            np.int64(key.stride(0) * size // unit), np.int64(value.stride(0) * size // unit),
            np.int64(row_units))
    threads = min(COPY_THREADS, -(-row_units // 32) * 32)
    kernels.launch(f"write_cache_b{unit}", (key.shape[0],), (threads,), args)


def write_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """As reference.write_cache (a slot < 0 skips the token)."""
    kernels = _kernels_for(key, value, k_cache, v_cache)
    _launch_write(kernels, key, value, k_cache, v_cache, slot_mapping)


def _launch_copies(kernels: Launcher, dst: torch.Tensor, src: torch.Tensor,
                   dst_ids: torch.Tensor | None, src_ids: torch.Tensor | None, num_pairs: int,
                   num_planes: int, block_bytes: int, dst_strides: tuple[int, int],
                   src_strides: tuple[int, int]) -> None:
    """For each pair p and plane: block (dst_ids[p] or p) of dst = block (src_ids[p] or p) of
    src; strides are (between blocks, between planes) in bytes."""
    if num_pairs == 0:
        return
    if num_planes > MAX_GRID_Y:
        raise ValueError(f"{num_planes} layer planes > {MAX_GRID_Y}")
    unit = _copy_unit(block_bytes, *dst_strides, *src_strides, dst.data_ptr(), src.data_ptr())
    args = (_ptr(dst), _ptr(src), _ptr(dst_ids), _ptr(src_ids),
            *(np.int64(s // unit) for s in (*dst_strides, *src_strides)),
            np.int64(block_bytes // unit))
    threads = min(COPY_THREADS, -(-(block_bytes // unit) // 32) * 32)
    kernels.launch(f"copy_blocks_b{unit}", (num_pairs, num_planes), (threads,), args)


def _cache_geometry(kv_cache: torch.Tensor) -> tuple[int, int, int]:
    """(planes = num_layers * 2, block bytes, bytes between planes) of a contiguous cache."""
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2 or not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be a contiguous [num_layers, 2, num_blocks, block_size, "
                         f"kv_heads, head_dim] tensor, got {tuple(kv_cache.shape)}")
    block_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
    return kv_cache.shape[0] * 2, block_bytes, kv_cache.shape[2] * block_bytes


def _launch_copy_blocks(kernels: Launcher, kv_cache: torch.Tensor, src_ids: BlockIds,
                        dst_ids: BlockIds) -> None:
    src = _ids(src_ids, kv_cache.device).contiguous()
    dst = _ids(dst_ids, kv_cache.device).contiguous()
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError(f"src_ids {tuple(src.shape)} and dst_ids {tuple(dst.shape)} must be "
                         "equal-length 1-D")
    planes, block_bytes, plane_bytes = _cache_geometry(kv_cache)
    strides = (block_bytes, plane_bytes)
    _launch_copies(kernels, kv_cache, kv_cache, dst, src, src.numel(), planes, block_bytes,
                   strides, strides)


def copy_blocks(kv_cache: torch.Tensor, src_ids: BlockIds, dst_ids: BlockIds) -> None:
    """As reference.copy_blocks; the pairs are copied in parallel, so dst blocks must be
    distinct and none of them a source (true of copy-on-write into fresh blocks)."""
    _launch_copy_blocks(_kernels_for(kv_cache), kv_cache, src_ids, dst_ids)


def _launch_gather(kernels: Launcher, kv_cache: torch.Tensor, block_ids: BlockIds,
                   out: torch.Tensor | None) -> torch.Tensor:
    planes, block_bytes, plane_bytes = _cache_geometry(kv_cache)
    ids = _ids(block_ids, kv_cache.device).contiguous()
    shape = (ids.numel(), kv_cache.shape[0], 2, *kv_cache.shape[3:])
    if out is not None and (tuple(out.shape) != shape or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {shape} tensor, got {tuple(out.shape)}")
    direct = out is not None and out.device == kv_cache.device and out.dtype == kv_cache.dtype
    staged = out if direct and out is not None else kv_cache.new_empty(shape)
    _launch_copies(kernels, staged, kv_cache, None, ids, ids.numel(), planes, block_bytes,
                   (planes * block_bytes, block_bytes), (block_bytes, plane_bytes))
    if out is None or staged is out:
        return staged
    return out.copy_(staged)  # to pinned host memory, say: synchronous, as the reference


def gather_blocks(kv_cache: torch.Tensor, block_ids: BlockIds,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """As reference.gather_blocks: one copy kernel into a device staging buffer (`out` itself
    when it is on the cache's device), then one copy to `out` when it is elsewhere."""
    return _launch_gather(_kernels_for(kv_cache), kv_cache, block_ids, out)


def _launch_scatter(kernels: Launcher, staging: torch.Tensor, kv_cache: torch.Tensor,
                    block_ids: BlockIds) -> None:
    planes, block_bytes, plane_bytes = _cache_geometry(kv_cache)
    ids = _ids(block_ids, kv_cache.device).contiguous()
    shape = (ids.numel(), kv_cache.shape[0], 2, *kv_cache.shape[3:])
    if tuple(staging.shape) != shape:
        raise ValueError(f"staging must be {shape}, got {tuple(staging.shape)}")
    rows = staging.to(device=kv_cache.device, dtype=kv_cache.dtype).contiguous()
    _launch_copies(kernels, kv_cache, rows, ids, None, ids.numel(), planes, block_bytes,
                   (block_bytes, plane_bytes), (planes * block_bytes, block_bytes))


def scatter_blocks(staging: torch.Tensor, kv_cache: torch.Tensor, block_ids: BlockIds) -> None:
    """As reference.scatter_blocks (staging may be on the host: it is copied over first)."""
    _launch_scatter(_kernels_for(kv_cache), staging, kv_cache, block_ids)
