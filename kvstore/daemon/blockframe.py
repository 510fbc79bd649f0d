"""The codec of one L4 (Redis) value: a fixed header and its payload in a single frame.

One Redis value holds the whole frame, so a reader can never see a header without its data.
This module is pure: bytes in, bytes out, no I/O.

Byte layout (little-endian, ``struct`` format ``<4sBBHQQ``, ``HEADER_BYTES`` = 24)::

    offset  size  field
    0       4     magic       b"KVS4"
    4       1     version     u8, 1
    5       1     codec       u8: 0 raw, 1 lz4 block, 2 lz4 block over a 2-byte shuffle
    6       2     reserved    u16, must be 0
    8       8     raw length  u64, bytes of the payload before compression
    16      8     checksum    u64, xxh3-64 of the RAW payload
    24      ...   body        the payload (raw) or an lz4 block without a size prefix

The 2-byte shuffle turns ``[a0 b0 a1 b1 ...]`` into ``[a0 a1 ... b0 b1 ...]``: the high
bytes of fp16/bf16 values (sign and exponent) sit together, which is what lz4 can match.
Every header field is checked on decode and the payload is re-hashed, so a corrupt frame
raises ``FrameError`` and never yields wrong bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import lz4.block
import numpy as np
import xxhash

MAGIC = b"KVS4"
VERSION = 1
CODEC_RAW, CODEC_LZ4, CODEC_LZ4_SHUFFLE2 = 0, 1, 2
_CODECS = (CODEC_RAW, CODEC_LZ4, CODEC_LZ4_SHUFFLE2)
_HEADER = struct.Struct("<4sBBHQQ")
HEADER_BYTES = _HEADER.size

# lz4 pays only when it saves at least 20%: with the shuffle it runs at about 0.5 GB/s a
# core, so bf16 K/V (which saves 12-16%) cost more write-through bandwidth than it saved in
# Redis memory (bench/l4_bench.py); remote.compress=lz4 forces it. The sample must show the
# saving before the whole payload is compressed, so incompressible data costs one 64 KiB
# trial, not a full pass.
_MAX_RATIO = 0.8
_SAMPLE_BYTES = 64 * 1024
_SAMPLE_SLICES = 4
_LZ4_MAX_INPUT_BYTES = 0x7E000000  # LZ4_MAX_INPUT_SIZE
_LZ4_MAX_EXPANSION = 255  # one lz4 block byte never stands for more than 255 output bytes
_COMPRESS_MODES = ("auto", "lz4", "none")


class FrameError(ValueError):
    """A frame that is not a valid, intact kvstore L4 value; the message says why."""


def _bytes_view(data: bytes | memoryview) -> memoryview:
    return memoryview(data).cast("B")  # a typed (e.g. fp16) view counts bytes, not items


def _shuffle2(data: bytes | memoryview) -> bytes:
    # whole-array ops on 16-bit lanes: several times faster than a transposed byte copy
    values = np.frombuffer(data, dtype="<u2")
    planes = np.empty(2 * values.size, dtype=np.uint8)
    planes[: values.size] = values & 0xFF
    planes[values.size :] = values >> 8
    return planes.tobytes()


def _unshuffle2(data: bytes) -> bytes:
    planes = np.frombuffer(data, dtype=np.uint8)
    num_values = planes.size // 2
    values = np.empty(num_values, dtype="<u2")
    values[:] = planes[num_values:]
    values <<= 8
    values |= planes[:num_values]
    return values.tobytes()


def _lz4(data: bytes | memoryview, shuffled: bool) -> bytes:
    body: bytes = lz4.block.compress(_shuffle2(data) if shuffled else data, store_size=False)
    return body


def _pays(compressed_bytes: int, raw_bytes: int) -> bool:
    return compressed_bytes < _MAX_RATIO * raw_bytes


def _sample(view: memoryview) -> memoryview | bytes:
    """Up to 64 KiB of the payload: all of it when small, else even-aligned spread slices."""
    if len(view) <= _SAMPLE_BYTES:
        return view
    slice_bytes = _SAMPLE_BYTES // _SAMPLE_SLICES
    step = (len(view) - slice_bytes) // (_SAMPLE_SLICES - 1)
    starts = [(i * step) & ~1 for i in range(_SAMPLE_SLICES)]
    return b"".join(view[s : s + slice_bytes] for s in starts)


def _choose(view: memoryview, compress: str, shuffle: bool) -> tuple[int, bytes | memoryview]:
    """The codec and body for ``view`` under ``compress``."""
    if compress == "none":
        return CODEC_RAW, view
    if len(view) > _LZ4_MAX_INPUT_BYTES:
        if compress == "lz4":
            raise ValueError(f"payload of {len(view)} bytes is too large for an lz4 block")
        return CODEC_RAW, view
    shuffled = shuffle and len(view) % 2 == 0
    codec = CODEC_LZ4_SHUFFLE2 if shuffled else CODEC_LZ4
    if compress == "lz4":
        return codec, _lz4(view, shuffled)
    sample = _sample(view)
    sample_body = _lz4(sample, shuffled)
    if not _pays(len(sample_body), len(sample)):
        return CODEC_RAW, view
    body = sample_body if len(sample) == len(view) else _lz4(view, shuffled)
    return (codec, body) if _pays(len(body), len(view)) else (CODEC_RAW, view)


def encode(
    payload: bytes | memoryview,
    compress: str = "auto",
    shuffle: bool = True,
    checksum: int | None = None,
) -> bytes:
    """One frame holding ``payload``.

    ``compress``: "none" stores raw; "lz4" always compresses (over a 2-byte shuffle when
    ``shuffle`` and the length is even); "auto" compresses only when a sample and then the
    whole payload shrink below 80%. ``checksum`` is the payload's xxh3-64 when the
    caller already knows it; it is trusted here and verified by ``decode``.
    """
    return b"".join(encode_parts(payload, compress, shuffle, checksum))


def encode_parts(
    payload: bytes | memoryview,
    compress: str = "auto",
    shuffle: bool = True,
    checksum: int | None = None,
) -> tuple[bytes, bytes | memoryview]:
    """The frame ``encode`` makes, as (header, body) without joining them: a raw body is a
    view of ``payload`` itself (which must then stay unchanged until the parts are sent), so
    a writer that hands both parts to the socket one after the other sends the frame with
    no copy of the payload. The arguments are ``encode``'s; so are the bytes, part for part.
    """
    if compress not in _COMPRESS_MODES:
        raise ValueError(f"compress must be one of {_COMPRESS_MODES}, got {compress!r}")
    view = _bytes_view(payload)
    if checksum is None:
        checksum = xxhash.xxh3_64_intdigest(view)
    elif not 0 <= checksum < 1 << 64:
        raise ValueError(f"checksum must be an unsigned 64-bit integer, got {checksum}")
    codec, body = _choose(view, compress, shuffle)
    return _HEADER.pack(MAGIC, VERSION, codec, 0, len(view), checksum), body


def _parse(frame: bytes | memoryview) -> tuple[int, int, int, memoryview]:
    """(codec, raw length, checksum, body) of a frame whose header is valid."""
    view = _bytes_view(frame)
    if len(view) < HEADER_BYTES:
        raise FrameError(f"truncated frame: {len(view)} bytes, the header alone is {HEADER_BYTES}")
    magic, version, codec, reserved, raw_bytes, checksum = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise FrameError(f"unsupported frame version {version}, this reader knows {VERSION}")
    if codec not in _CODECS:
        raise FrameError(f"unknown codec {codec}")
    if reserved != 0:
        raise FrameError(f"reserved header field is {reserved:#06x}, expected 0")
    body = view[HEADER_BYTES:]
    if codec == CODEC_RAW and len(body) != raw_bytes:
        raise FrameError(f"raw length {raw_bytes} but the frame carries {len(body)} bytes")
    if codec != CODEC_RAW and raw_bytes > _LZ4_MAX_EXPANSION * len(body):
        raise FrameError(f"raw length {raw_bytes} is impossible for a {len(body)}-byte lz4 body")
    if codec == CODEC_LZ4_SHUFFLE2 and raw_bytes % 2:
        raise FrameError(f"odd raw length {raw_bytes} for a 2-byte shuffled payload")
    return codec, raw_bytes, checksum, body


def frame_checksum(frame: bytes | memoryview) -> int:
    """The xxh3-64 the header records for the raw payload, without decoding the body."""
    return _parse(frame)[2]


def header_codec(header: bytes | memoryview) -> int:
    """The codec byte of a frame's header alone (as ``encode_parts`` returns it), unchecked:
    for the writer that made it, not for frames read back (``decode_view`` checks those)."""
    return _bytes_view(header)[5]


def decode(frame: bytes | memoryview) -> bytes:
    """The raw payload of ``frame``, verified against its checksum."""
    return bytes(decode_view(frame))


@dataclass(frozen=True, slots=True)
class Verified:
    """A payload decoded from its frame (``data``: maybe a view into the frame) and its
    xxh3-64, which the frame's header records and the payload was found to match: whoever
    keeps the payload keeps the checksum without hashing it again."""

    data: bytes | memoryview
    checksum: int

    def __len__(self) -> int:
        return len(self.data)


def decode_view(frame: bytes | memoryview) -> bytes | memoryview:
    """The raw payload of ``frame``, verified against its checksum, without a copy where it
    can: a view into ``frame`` itself when the frame is stored raw (the frame must then stay
    unchanged while the view is used), new bytes when it was compressed. The store imports
    L4 blocks from these views straight into L2, one copy fewer per block than ``decode``."""
    return decode_verified(frame).data


def decode_verified(frame: bytes | memoryview) -> Verified:
    """As ``decode_view``, with the checksum the payload matched."""
    codec, raw_bytes, checksum, body = _parse(frame)
    payload: bytes | memoryview = body
    if codec != CODEC_RAW:
        try:
            unpacked: bytes = lz4.block.decompress(body, uncompressed_size=raw_bytes)
        except (lz4.block.LZ4BlockError, OverflowError, ValueError, MemoryError) as err:
            raise FrameError(f"corrupt lz4 body: {err}") from err
        if len(unpacked) != raw_bytes:
            raise FrameError(f"lz4 body holds {len(unpacked)} bytes, header says {raw_bytes}")
        payload = _unshuffle2(unpacked) if codec == CODEC_LZ4_SHUFFLE2 else unpacked
    actual = xxhash.xxh3_64_intdigest(payload)
    if actual != checksum:
        raise FrameError(f"checksum mismatch: header {checksum:#018x}, payload {actual:#018x}")
    return Verified(payload, checksum)
