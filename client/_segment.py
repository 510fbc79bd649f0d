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
from kvstore.memory import prefault
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb

from ._buffers import ByteArray, address, copy_bytes
from ._wire import Fetched, GetHeader
from .errors import DataLoss, FailedPrecondition

logger = logging.getLogger("kvstore.client")

Spans = list[tuple[int, int]]
# Copies that are checksummed cut the block into pieces this large and hash each piece right
# after copying it, while it is still in the CPU's cache: one pass over memory instead of
# two. 256 KiB fits the L2 cache of current x86 and Arm server cores (1-2 MiB per core).
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
        arr = self.array
        skew_base = address(dst) - self.address
        hasher = xxhash.xxh3_64() if digest else None
        pos = 0
        for offset, length in spans:
            _copy(dst, pos, arr, offset, length, skew_base + pos - offset, hasher)
            pos += length
        return hasher.intdigest() if hasher is not None else None

    def write(self, spans: Spans, src: memoryview) -> int:
        """Copy src into the spans; the xxh3-64 of what was written (hashed from the segment
        as it is written: the writer's end-to-end checksum)."""
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
        # is unmapped when the last one is collected.
        self.array = np.empty(0, np.uint8)
        view, self._view = self._view, None
        if view is not None:
            try:
                view.release()
            except BufferError:
                logger.debug("kvstore: segment %s still in use; unmapped later", self.name)
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
    for j, size in enumerate(header.sizes):
        spans = segment.spans(locations[j], size, f"locations[{j}]")
        digest = segment.read_into(spans, arrays[header.found_index[j]], digest=verify_checksums)
        if digest is not None:
            digests.append(digest)
    return Fetched(header, [], digests if verify_checksums else None)


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
    for i, payload in enumerate(payloads):
        if not exists[i]:
            checksums[i] = segment.write(
                segment.spans(locations[i], payload.nbytes, f"locations[{i}]"), payload)
    return checksums
