"""The native helper (fastcopy.c beside this file), loaded with ctypes: batched copies hashed
with xxh3-64 as they are copied, and a whole read through the read table in one call.

`make` builds it (`make native`, a prerequisite of `make run` and `make test`) into _build/
here: a generic library and, on x86-64, AVX2 and AVX-512 builds of the same source, of which
the best the CPU runs is loaded (xxh3 picks its vector code when compiled, so one library
cannot serve every CPU at full speed). ctypes releases the GIL for each call.

Every caller keeps a pure numpy + python-xxhash path beside the native one and takes it when
`LIB` is None: the libraries were not built, failed to load, or `NO_KVSTORE_NATIVE=1` is set
in the environment (not a KVSTORE_* name: the daemon takes those for its settings and refuses
unknown ones); tests use `use_native(False)`. A failed load is logged once, at debug.
The hashes are the same either way (xxh3-64, seed 0: tests/unit/test_native.py checks).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["LIB", "PIECE_BYTES", "TableArgs", "TableParams", "build_dir", "copy_hash", "load",
           "use_native"]

logger = logging.getLogger("kvstore.native")

#: Bytes hashed at a time, right after they are copied, when a block of several spans is
#: hashed as one stream (xxh3's streaming state). A block of one span, nearly every block, is
#: copied and hashed one xxh3 block (1 KiB) at a time instead, in one fused loop (fastcopy.c
#: copy_hash_fused): 16 x 256 KiB against memcpy on a Zen 4 core, AVX-512 build, 0.67-0.70x
#: against 0.60-0.62x copying 256 KiB pieces then hashing them; 16 x 2 MiB 0.87-0.93x against
#: 0.76-0.81x.
PIECE_BYTES = 256 * 1024

_P = ctypes.c_void_p
_N = ctypes.c_size_t
_U64 = ctypes.c_uint64
# name -> (restype, argtypes); pointers travel as plain integers (c_void_p).
_SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "kv_cpu_level": (ctypes.c_int, []),
    "kv_copy_hash": (None, [_N, _P, _P, _P, _P, _N, _P]),
    "kv_probe": (_N, [_P, _P, _U64, _P, _N, _P, _P, _P, _P, _P]),
    "kv_table_read": (_N, [_P, _P, _U64, _P, _N, _U64, _U64, _P, _P, ctypes.c_int,
                           _P, _P, _P, _P, _P, _P]),
}
# kv_cpu_level's answer -> the library built for it (best first).
_VARIANTS = ((2, "libkvfast-avx512.so"), (1, "libkvfast-avx2.so"), (0, "libkvfast.so"))


class TableParams(ctypes.Structure):
    """A read table's hash constants as the Python side checked them when it opened the table
    (fastcopy.c table_params): the native probe never reads them from the shared memory."""

    _fields_ = [("capacity", _U64), ("shift", _U64), ("mult", _U64 * 4), ("ns_mult", _U64),
                ("mix", _U64)]


class TableArgs:
    """What the native read-table functions take for one table: its address, and its hash
    constants as `TableView` checked them (TableView.address and .params)."""

    def __init__(self, view: Any) -> None:
        self.view = view
        capacity, shift, m0, m1, m2, m3, ns_mult, mix = view.params
        self._params = TableParams(capacity, shift, (_U64 * 4)(m0, m1, m2, m3), ns_mult, mix)
        self.table: int = view.address
        self.params = ctypes.byref(self._params)


def build_dir() -> Path:
    """Where `make native` puts the libraries."""
    return Path(__file__).resolve().parent / "_build"


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes
    return lib


def load() -> ctypes.CDLL | None:
    """The best library this CPU runs, or None (not built, not loadable, NO_KVSTORE_NATIVE=1)."""
    if os.environ.get("NO_KVSTORE_NATIVE", "") not in ("", "0"):
        logger.debug("kvstore: native helper off (NO_KVSTORE_NATIVE); numpy + xxhash used")
        return None
    where = build_dir()
    try:
        generic = _open(where / "libkvfast.so")
    except (OSError, AttributeError) as exc:
        logger.debug("kvstore: native helper not loaded (%s); numpy + xxhash used "
                     "(`make native` builds it)", exc)
        return None
    level = generic.kv_cpu_level()
    for needs, name in _VARIANTS:
        if needs > level or not (where / name).exists():
            continue
        if needs == 0:
            return generic
        try:
            return _open(where / name)
        except (OSError, AttributeError) as exc:
            logger.debug("kvstore: native helper %s not loaded (%s); trying the next", name, exc)
    return generic


#: The loaded helper, None when the pure-Python paths run (see the module's docstring).
LIB: ctypes.CDLL | None = load()
_LOADED = LIB


def use_native(on: bool) -> bool:
    """Turn the native helper on (when it loaded) or off for this process; whether it is on
    now. Tests run both paths with it."""
    global LIB
    LIB = _LOADED if on else None
    return LIB is not None


def copy_hash(lib: ctypes.CDLL, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int],
              more: bytes | None, digest: bool) -> list[int] | None:
    """Copy lengths[i] bytes from address src[i] to address dst[i], all in one native call;
    with digest, the xxh3-64 per block (a block: one span, or a run of spans whose `more`
    byte is nonzero and the span after the run, hashed as one stream; the hash sits at the
    block's last span, 0 at the others). The addresses must be valid for the lengths: the
    callers bounds-check every span first."""
    n = len(lengths)
    # One ctypes array (src, dst, lengths, hashes): cheaper than numpy's for a few spans.
    table = (_U64 * (4 * n))(*src, *dst, *lengths)
    at = ctypes.addressof(table)
    lib.kv_copy_hash(n, at, at + 8 * n, at + 16 * n, at + 24 * n if digest else None,
                     PIECE_BYTES, more)
    return table[3 * n:] if digest else None
