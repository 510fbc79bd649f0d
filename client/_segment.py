"""Shared memory as the client sees it: `SharedSegment` (a mapped segment or arena, read and
written through numpy slices of one array over the whole mapping, so every copy is a single
memcpy with no Python-level per-byte work) and the copies a shared-memory Get or Reserve
makes. Extents from the daemon are bounds-checked before any copy; a bad one is DataLoss.
Which memory to use is decided in `_shm`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from kvstore import shm
from kvstore.memory import prefault, register_pinned, unregister_pinned
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb

from ._buffers import ByteArray, address, copy_bytes, native_copy_hash, native_lib
from ._wire import Fetched, GetHeader
from .errors import DataLoss, FailedPrecondition

logger = logging.getLogger("kvstore.client")

Spans = list[tuple[int, int]]
# Copies that are checksummed cut the block into pieces this large and hash each piece right
# after copying it, while it is still in the CPU's cache: one pass over memory instead of
# two. 256 KiB fits the L2 cache of current x86 and Arm server cores (1-2 MiB per core).
# The native helper (kvstore.native.PIECE_BYTES) measured best with the same size.
HASH_PIECE_BYTES = 256 * 1024


class SharedSegment:
    """The daemon's L2 segment, attached read-write in this process."""

    def __init__(self, segment: Any) -> None:
        self._segment = segment
        self.name: str = segment.name
        self._view: memoryview | None = segment.view()
        self.size_bytes: int = self._view.nbytes
        self.array: ByteArray = np.frombuffer(self._view, dtype=np.uint8)
        self.address = address(self.array)
        # Page tables populated in the background, so a fresh client's first batches do
        # not fault every page in (kvstore.memory).
        self.prefaulting = prefault(self.address, self.size_bytes, self.name)
        self.pinned = False  # registered as CUDA pinned memory (pin)

    def pin(self) -> bool:
        """Register the mapping as CUDA pinned memory, once (kvstore.memory.register_pinned:
        needs cupy and a device), so that host-to-device copies from it run by DMA without
        waiting for the host; whether it is registered."""
        if not self.pinned and self._view is not None:
            self.pinned = register_pinned(self.array, f"shared memory {self.name}")
        return self.pinned

    def spans(self, location: pb.BlockLocation, size: int, field: str) -> Spans:
        """(offset, length) pairs holding exactly `size` bytes, checked against the mapping."""
        out: Spans = []
        remaining = size
        limit = self.size_bytes
        for extent in location.extents:
            if remaining == 0:
                break
            offset, length = extent.offset, extent.length
            if offset + length > limit:
                raise DataLoss(
                    f"{field}: extent [{offset}, {offset + length}) lies outside the "
                    f"{limit}-byte segment {self.name}"
                )
            take = min(length, remaining)
            out.append((offset, take))
            remaining -= take
        if remaining:
            raise DataLoss(f"{field}: extents hold {size - remaining} of {size} bytes")
        return out

    def read_bytes(self, spans: Spans) -> bytes:
        arr = self.array
        if len(spans) == 1:
            offset, length = spans[0]
            return arr[offset : offset + length].tobytes()
        return b"".join([arr[o : o + n].data for o, n in spans])

    def read_into(self, spans: Spans, dst: ByteArray, *, digest: bool) -> int | None:
        """Copy the spans into dst; with digest, return the xxh3-64 of the bytes copied
        (hashed from dst as it is copied, so what is verified is what the caller got)."""
        lib = native_lib()
        if lib is not None:
            got = self._native(lib, [(spans, address(dst))], False, digest)
            return None if got is None else got[0]
        arr = self.array
        skew_base = address(dst) - self.address
        hasher = xxhash.xxh3_64() if digest else None
        pos = 0
        for offset, length in spans:
            _copy(dst, pos, arr, offset, length, skew_base + pos - offset, hasher)
            pos += length
        return hasher.intdigest() if hasher is not None else None

    def read_many(self, blocks: Sequence[tuple[Spans, ByteArray]], *,
                  digest: bool) -> list[int] | None:
        """Copy each block's spans into its array (as `read_into`); with digest, each block's
        xxh3-64 as copied. With the native helper, every span of every block in one call."""
        lib = native_lib()
        if lib is None:
            got = [self.read_into(spans, dst, digest=digest) for spans, dst in blocks]
            return [g for g in got if g is not None] if digest else None
        return self._native(lib, [(spans, address(dst)) for spans, dst in blocks], False,
                            digest)

    def write(self, spans: Spans, src: memoryview) -> int:
        """Copy src into the spans; the xxh3-64 of what was written (hashed from the segment
        as it is written: the writer's end-to-end checksum)."""
        return self.write_many([(spans, src)])[0]

    def write_many(self, blocks: Sequence[tuple[Spans, memoryview]]) -> list[int]:
        """Copy each block's source into its spans (as `write`); each block's xxh3-64 as
        written. With the native helper, every span of every block in one call."""
        lib = native_lib()
        if lib is None:
            return [self._write_numpy(spans, src) for spans, src in blocks]
        hashes = self._native(lib, [
            (spans, address(np.frombuffer(src, dtype=np.uint8)) if src.nbytes else 0)
            for spans, src in blocks], True, True)
        assert hashes is not None
        return hashes

    def _native(self, lib: Any, blocks: Sequence[tuple[Spans, int]], into_segment: bool,
                digest: bool) -> list[int] | None:
        """Copy blocks in one call of the native helper: each block's spans of this segment
        and the buffer at the address paired with them (its source when into_segment, else
        its destination), laid end to end; with digest, each block's xxh3-64 as copied. A
        block without spans copies nothing (its hash is the empty input's)."""
        seg_at: list[int] = []
        buf_at: list[int] = []
        lengths: list[int] = []
        more = bytearray()  # 1: the next span continues this block's hash
        ends: list[int] = []
        base = self.address
        for spans, at in blocks:
            for offset, length in spans or [(0, 0)]:
                seg_at.append(base + offset)
                buf_at.append(at)
                lengths.append(length)
                more.append(1)
                at += length
            more[-1] = 0
            ends.append(len(lengths) - 1)
        src, dst = (buf_at, seg_at) if into_segment else (seg_at, buf_at)
        hashes = native_copy_hash(lib, src, dst, lengths, bytes(more), digest)
        return None if hashes is None else [hashes[end] for end in ends]

    def _write_numpy(self, spans: Spans, src: memoryview) -> int:
        hasher = xxhash.xxh3_64()
        if not src.nbytes:
            return hasher.intdigest()
        source = np.frombuffer(src, dtype=np.uint8)
        arr = self.array
        skew_base = self.address - address(source)
        pos = 0
        for offset, length in spans:
            _copy(arr, offset, source, pos, length, skew_base + offset - pos, hasher)
            pos += length
        return hasher.intdigest()

    def close(self) -> None:
        # Drop our exports first so the mapping can actually be unmapped. A view another
        # thread still reads through keeps the mapping alive (never a dangling pointer); it
        # is unmapped when the last one is collected, and stays registered as pinned memory
        # (a device copy may still be reading it).
        self.array = np.empty(0, np.uint8)
        view, self._view = self._view, None
        in_use = False
        if view is not None:
            try:
                view.release()
            except BufferError:
                in_use = True
                logger.debug("kvstore: segment %s still in use; unmapped later", self.name)
        if self.pinned and not in_use:
            unregister_pinned(self.address)
        self.pinned = False
        self._segment.close()


def _copy(dst: ByteArray, dst_at: int, src: ByteArray, src_at: int, length: int, skew: int,
          hasher: Any) -> None:
    """dst[dst_at:] = src[src_at:src_at + length]; with a hasher, piece by piece, each piece
    hashed from dst while it is in cache."""
    if hasher is None:
        copy_bytes(dst[dst_at : dst_at + length], src[src_at : src_at + length], skew)
        return
    for at in range(0, length, HASH_PIECE_BYTES):
        n = min(HASH_PIECE_BYTES, length - at)
        piece = dst[dst_at + at : dst_at + at + n]
        copy_bytes(piece, src[src_at + at : src_at + at + n], skew)
        hasher.update(piece.data)


def attach(name: str) -> SharedSegment:
    """Attach the named segment; FailedPrecondition (with why) when it cannot be."""
    try:
        return SharedSegment(shm.attach_segment(name))
    except (OSError, ValueError) as exc:
        raise FailedPrecondition(f"cannot attach shared-memory segment {name!r}: {exc}") from None


def only_header(messages: Sequence[pb.GetResponse | memoryview]) -> pb.GetResponse:
    """The one message a shared-memory Get answers, else DataLoss."""
    if len(messages) != 1 or isinstance(messages[0], memoryview):
        raise DataLoss(f"a shared-memory Get answered {len(messages)} messages, not one header")
    return messages[0]


def read_shm_get(
    segment: SharedSegment,
    resp: pb.GetResponse,
    header: GetHeader,
    arrays: Sequence[ByteArray] | None,
    verify_checksums: bool,
) -> Fetched:
    """Copy the found blocks out of shared memory: into arrays[request index] when given,
    else as bytes per found block; with verify_checksums, each block's checksum computed on
    the way (from what the caller gets, while it is still in cache)."""
    locations = resp.locations
    if len(locations) != len(header.sizes):
        raise DataLoss(
            f"Get response has {len(locations)} locations for {len(header.sizes)} found keys"
        )
    digests: list[int] = []
    if arrays is None:
        payloads: list[bytes] = []
        for j, size in enumerate(header.sizes):
            payload = segment.read_bytes(segment.spans(locations[j], size, f"locations[{j}]"))
            payloads.append(payload)
            if verify_checksums:
                digests.append(xxhash.xxh3_64_intdigest(payload))
        return Fetched(header, payloads, digests if verify_checksums else None)
    blocks = [(segment.spans(locations[j], size, f"locations[{j}]"),
               arrays[header.found_index[j]]) for j, size in enumerate(header.sizes)]
    got = segment.read_many(blocks, digest=verify_checksums)
    return Fetched(header, [], got)


def write_reserved(
    segment: SharedSegment, resp: pb.ReserveResponse, payloads: Sequence[memoryview]
) -> list[int]:
    """Write every payload whose key does not exist into its reserved extents; the checksum
    of each key's payload as written (0 for a key that exists), for the commit."""
    exists, locations = resp.exists, resp.locations
    if len(exists) != len(payloads) or len(locations) != len(payloads):
        raise DataLoss(
            f"Reserve response has {len(exists)} exists flags and {len(locations)} locations "
            f"for {len(payloads)} keys"
        )
    checksums = [0] * len(payloads)
    written = [i for i in range(len(payloads)) if not exists[i]]
    sums = segment.write_many([
        (segment.spans(locations[i], payloads[i].nbytes, f"locations[{i}]"), payloads[i])
        for i in written])
    for i, checksum in zip(written, sums, strict=True):
        checksums[i] = checksum
    return checksums
