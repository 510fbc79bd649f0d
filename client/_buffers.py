"""Zero-copy conversion of caller buffers into flat byte views.

Values to put and buffers to fill may be bytes, bytearray, memoryview, numpy arrays, torch CPU
tensors or anything else exporting the buffer protocol, `__array_interface__` or DLPack. Each
becomes a 1-D uint8 view of the same memory (never a copy); a buffer that cannot be viewed
that way raises ValueError naming it (`values[3]`, `buffers[0]`). Torch is never imported
here: a tensor is recognised by its type's module and handled through the torch module the
caller already loaded.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, cast

import numpy as np
import numpy.typing as npt

try:
    from kvstore import native as _native
except ImportError:  # an install without the kvstore.native package: numpy + xxhash run
    _native = None  # type: ignore[assignment]

__all__ = ["address", "copy_bytes", "native_copy_hash", "native_lib", "native_module",
           "readable_view",
           "writable_array"]

ByteArray = npt.NDArray[np.uint8]

_PAGE_BYTES = 4096
# glibc's memcpy uses `rep movsb` for mid-sized copies; on AMD Zen 3/4 that runs ~10x slower
# when the destination sits a few bytes past the source modulo the page size, which is
# exactly where numpy's large arrays (page + 16 bytes) land against a page-aligned segment.
# A ufunc loop copies at full speed there; everywhere else memcpy is as fast or faster.
_ALIAS_BYTES = 64


def _data_field_at() -> int | None:
    """Where a numpy array object holds its data pointer (numpy's PyArrayObject: the object
    header, then `char *data`), when reading it there gives what `array.ctypes.data` gives;
    None elsewhere (another interpreter, another object layout)."""
    if sys.implementation.name != "cpython":  # id() is an object's address in CPython only
        return None
    at = 2 * ctypes.sizeof(ctypes.c_void_p)  # ob_refcnt, ob_type
    probes = [np.empty(n, np.uint8) for n in (1, 4096)]
    probes.append(probes[1][7:])
    for probe in probes:
        if ctypes.c_size_t.from_address(id(probe) + at).value != probe.ctypes.data:
            return None
    return at


# `array.ctypes.data` builds a ctypes helper object each time (0.8 us, per block on the read
# path); the pointer read where numpy keeps it costs a fifth of that.
_DATA_AT = _data_field_at()
_U8 = np.dtype(np.uint8)


def address(array: ByteArray) -> int:
    """The address of array's first byte."""
    if _DATA_AT is not None and type(array) is np.ndarray:
        return int(ctypes.c_size_t.from_address(id(array) + _DATA_AT).value)
    return int(array.ctypes.data)


def native_module() -> Any:
    """The kvstore.native module, or None where this install lacks it."""
    return _native


def native_lib() -> ctypes.CDLL | None:
    """The native copy + checksum helper (kvstore.native) when it is loaded and on, else None:
    the caller takes its numpy + xxhash path."""
    return _native.LIB if _native is not None else None


def native_copy_hash(lib: ctypes.CDLL, src: list[int], dst: list[int], lengths: list[int],
                     more: bytes | None, digest: bool) -> list[int] | None:
    """kvstore.native.copy_hash (only called with the library native_lib gave)."""
    assert _native is not None
    return _native.copy_hash(lib, src, dst, lengths, more, digest)


def copy_bytes(dst: ByteArray, src: ByteArray, skew: int) -> None:
    """dst[:] = src at memory speed; skew is (address(dst) - address(src)) % 4096."""
    if 0 < skew % _PAGE_BYTES < _ALIAS_BYTES:
        np.bitwise_or(src, 0, out=dst)
    else:
        np.copyto(dst, src)


def readable_view(value: object, field: str) -> memoryview:
    """A 1-D, format 'B' memoryview over value's bytes (C order), without copying."""
    if isinstance(value, bytes):
        return memoryview(value)
    if isinstance(value, memoryview) and value.format == "B" and value.ndim == 1:
        if not value.contiguous:
            raise ValueError(f"{field} must be contiguous")
        return value
    return _as_uint8(value, field, writable=False).data


def writable_array(buffer: object, field: str) -> ByteArray:
    """A 1-D writable uint8 numpy array over buffer's memory, without copying."""
    if type(buffer) is np.ndarray and buffer.dtype is _U8 and buffer.ndim == 1 \
            and buffer.flags.c_contiguous and buffer.flags.writeable:
        return buffer  # already what is asked for (the common case, per block: kept cheap)
    if isinstance(buffer, bytes):
        raise ValueError(f"{field} is bytes, which is read-only; pass a bytearray or an array")
    return _as_uint8(buffer, field, writable=True)


def _as_uint8(value: object, field: str, *, writable: bool) -> ByteArray:
    array = _as_ndarray(value, field)
    if not array.flags.c_contiguous:
        raise ValueError(f"{field} must be C-contiguous (got strides {array.strides})")
    if writable and not array.flags.writeable:
        raise ValueError(f"{field} is read-only; pass a writable buffer")
    try:
        flat = array.reshape(-1).view(np.uint8)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"{field} of dtype {array.dtype} cannot be viewed as bytes: {exc}"
        ) from None
    return flat


def _as_ndarray(value: object, field: str) -> npt.NDArray[Any]:
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise ValueError(f"{field} holds Python objects, not raw bytes")
        return value
    if _is_torch_tensor(value):
        return _torch_as_ndarray(value, field)
    try:
        view = memoryview(value)  # type: ignore[arg-type]
    except TypeError:
        return _foreign_as_ndarray(value, field)
    if not view.c_contiguous:
        raise ValueError(f"{field} must be C-contiguous")
    if not view.nbytes:
        return np.empty(0, np.uint8)
    return np.frombuffer(view, dtype=np.uint8)


def _foreign_as_ndarray(value: object, field: str) -> npt.NDArray[Any]:
    device = getattr(value, "__dlpack_device__", None)
    if callable(device):
        device_type = device()[0]
        if device_type not in (1, 3):  # kDLCPU, kDLCUDAHost (pinned host memory)
            raise ValueError(
                f"{field} lives on a device (DLPack device type {device_type}); only CPU "
                "buffers are supported"
            )
        try:
            return np.from_dlpack(cast(Any, value))
        except (BufferError, TypeError, RuntimeError) as exc:
            raise ValueError(f"{field} cannot be exported through DLPack: {exc}") from None
    if hasattr(value, "__array_interface__"):
        return np.asarray(value)
    raise ValueError(
        f"{field} of type {type(value).__name__} is not a buffer (bytes, bytearray, memoryview, "
        "numpy array, torch CPU tensor)"
    )


def _is_torch_tensor(value: object) -> bool:
    module = type(value).__module__
    return module == "torch" or module.startswith("torch.")


def _torch_as_ndarray(tensor: Any, field: str) -> npt.NDArray[Any]:
    torch = sys.modules["torch"]  # loaded: the caller handed us one of its tensors
    device_type = tensor.device.type
    if device_type != "cpu":
        raise ValueError(
            f"{field} is a torch tensor on {tensor.device}; only CPU tensors are supported "
            "(copy it to the host first)"
        )
    if not tensor.is_contiguous():
        raise ValueError(f"{field} must be a contiguous tensor (call .contiguous())")
    flat = tensor.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        # bfloat16 and friends have no numpy dtype; a byte view of the same storage does.
        flat = flat.view(torch.uint8)
    try:
        array: npt.NDArray[Any] = np.from_dlpack(flat)
    except (BufferError, TypeError, RuntimeError):
        return flat.numpy()  # type: ignore[no-any-return]
    if not array.flags.writeable:
        # Legacy (unversioned) DLPack exports come back read-only; .numpy() shares the storage.
        return flat.numpy()  # type: ignore[no-any-return]
    return array
