"""The wire details shared by the sync and async clients: argument validation, method paths
and channel options, Put frame encoding, Get frame decoding and the reassembly of payloads.

Put and Get bypass protobuf for their bulk bytes. A data-only message is exactly field 4
(`bytes data`), so Put frames are written as `header || 0x22 varint(len) chunk` with one copy
of the caller's bytes, and data-only Get messages are decoded as a memoryview into the
received buffer (protobuf would copy each chunk into a fresh bytes object first). Messages
that are not data-only go through the generated classes unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np
import xxhash

from kvstore import keys as key_rules
from kvstore.keys import BlockKey, InvalidKeyError
from kvstore.proto.frames import data_frame, data_of
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.units import KiB, MiB

from ._buffers import ByteArray, address, copy_bytes
from .errors import DataLoss, InvalidArgument

T = TypeVar("T")

DEFAULT_CHUNK_BYTES = 4 * MiB
DEFAULT_MAX_MESSAGE_BYTES = 16 * MiB
PUT_METHOD = "/kvstore.v1.KVStore/Put"
GET_METHOD = "/kvstore.v1.KVStore/Get"
HEALTH_SERVICE = ""

TIER_VALUES: dict[str, int] = {
    "hbm": pb.TIER_HBM,
    "dram": pb.TIER_DRAM,
    "nvme": pb.TIER_NVME,
    "remote": pb.TIER_REMOTE,
}


def channel_options(max_message_bytes: int, *, sync: bool) -> list[tuple[str, int]]:
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
    if sync:
        # Server-streaming calls (Get, Prefetch) then run on the caller's thread instead of
        # handing every message over from a polling thread: about a third faster per call.
        options.append(("SingleThreadedUnaryStream", 1))
    return options


def check_client_args(
    namespace: str, chunk_bytes: int, max_message_bytes: int, timeout_s: float
) -> str:
    """Validate the constructor's arguments; return the namespace."""
    ns = check_namespace_arg(namespace, "namespace")
    if chunk_bytes <= 0:
        raise InvalidArgument(f"chunk_bytes must be positive, got {chunk_bytes}")
    if max_message_bytes < chunk_bytes + 64 * KiB:
        raise InvalidArgument(
            f"max_message_bytes ({max_message_bytes}) must exceed chunk_bytes ({chunk_bytes}) "
            "by at least 64 KiB of header room"
        )
    if timeout_s <= 0:
        raise InvalidArgument(f"timeout_s must be positive, got {timeout_s}")
    return ns


def _checked(check: Callable[[], T], prefix: str = "") -> T:
    """check(), a broken key rule (kvstore.keys) raised as the client's InvalidArgument."""
    try:
        return check()
    except InvalidKeyError as exc:
        raise InvalidArgument(f"{prefix}{exc}") from None


def check_namespace_arg(namespace: str, field: str) -> str:
    """namespace, else InvalidArgument prefixed by field ("namespaces[1]: ...")."""
    return _checked(lambda: key_rules.check_namespace(namespace), f"{field}: ")


def check_keys(keys: Sequence[bytes], field: str = "keys") -> list[bytes]:
    """keys as a list of 32-byte `bytes`, else InvalidArgument naming the bad entry."""
    # list[BlockKey] is a list[bytes]; the cast only undoes list invariance.
    return cast(list[bytes], _checked(lambda: key_rules.check_keys(keys, field)))


def check_key(key: bytes, field: str) -> BlockKey:
    """One 32-byte key (parent, ...), else InvalidArgument naming field."""
    return _checked(lambda: key_rules.check_key(key, field))


def tier_value(tier: str | None, field: str = "tier") -> int:
    """The proto enum of a tier name; None means TIER_UNSPECIFIED."""
    if tier is None:
        return int(pb.TIER_UNSPECIFIED)
    value = TIER_VALUES.get(tier.lower()) if isinstance(tier, str) else None
    if value is None:
        raise InvalidArgument(f"{field} must be one of {sorted(TIER_VALUES)} or None, got {tier!r}")
    return value


# --- Put frames -----------------------------------------------------------------------------


def put_frames(
    header: pb.PutRequest, payloads: Sequence[memoryview], chunk_bytes: int
) -> Iterator[bytes]:
    """Serialized PutRequests: the header (plus the first chunk), then data-only messages
    of at most chunk_bytes each, whose data concatenated is the payloads in order."""
    head: bytes = header.SerializeToString()
    pieces: list[memoryview] = []
    filled = 0
    for payload in payloads:
        size = payload.nbytes
        offset = 0
        while offset < size:
            take = min(chunk_bytes - filled, size - offset)
            pieces.append(payload if take == size else payload[offset : offset + take])
            filled += take
            offset += take
            if filled == chunk_bytes:
                yield data_frame(head, pieces, filled)
                head, pieces, filled = b"", [], 0
    if head or filled:
        yield data_frame(head, pieces, filled)


# --- Get frames -----------------------------------------------------------------------------


def decode_get_response(raw: bytes) -> pb.GetResponse | memoryview:
    """A data-only GetResponse as a memoryview of its data, anything else parsed."""
    data = data_of(raw)
    return pb.GetResponse.FromString(raw) if data is None else data


@dataclass(frozen=True)
class GetHeader:
    """The first GetResponse, checked: which keys were found, their sizes and checksums."""

    found_index: list[int]
    """Request index of each found key, in order."""
    sizes: list[int]
    checksums: list[int]


def parse_get_header(
    first: pb.GetResponse | memoryview,
    num_keys: int,
    capacities: Sequence[int] | None = None,
) -> GetHeader:
    """The checked first GetResponse; with capacities (get_into), also that every found
    block fits its buffer."""
    if isinstance(first, memoryview):
        raise DataLoss("Get stream began with data and no header")
    found = first.found
    if len(found) != num_keys:
        raise DataLoss(f"Get response has {len(found)} found flags for {num_keys} keys")
    found_index = [i for i, hit in enumerate(found) if hit]
    sizes = list(first.sizes)
    checksums = list(first.checksums)
    if len(sizes) != len(found_index) or len(checksums) != len(found_index):
        raise DataLoss(
            f"Get response has {len(sizes)} sizes and {len(checksums)} checksums for "
            f"{len(found_index)} found keys"
        )
    header = GetHeader(found_index, sizes, checksums)
    if capacities is not None:
        check_buffer_sizes(header, capacities)
    return header


@dataclass(frozen=True)
class Fetched:
    """What a Get brought back, before checksums are judged."""

    header: GetHeader
    payloads: list[bytes]
    """get(): each found block's bytes. get_into(): empty (the blocks are in the buffers)."""
    digests: list[int] | None = None
    """get_into() through shared memory: checksums computed while copying."""


def identity(frame: bytes) -> bytes:
    """The serializer of pre-framed requests (put_frames)."""
    return frame


def capacities(arrays: list[ByteArray] | None) -> list[int] | None:
    return None if arrays is None else [a.nbytes for a in arrays]


def check_buffer_sizes(header: GetHeader, capacities: Sequence[int]) -> None:
    """ValueError naming buffers[i] when a found block does not fit its buffer."""
    for i, size in zip(header.found_index, header.sizes, strict=True):
        if capacities[i] < size:
            raise ValueError(f"buffers[{i}] holds {capacities[i]} bytes; the block is {size} bytes")


class InlineAssembler:
    """Routes the data chunks of an INLINE Get to per-block sinks, in order.

    With `targets` (one writable flat uint8 array per found block), chunks are copied straight
    into them; without, each block's pieces are kept (zero-copy) for a single join later.
    """

    def __init__(self, header: GetHeader, targets: list[ByteArray] | None = None) -> None:
        self.header = header
        self._sizes = header.sizes
        self._targets = targets
        self._addresses = [address(t) for t in targets] if targets is not None else []
        self.pieces: list[list[memoryview]] = [[] for _ in header.sizes]
        self._block = 0
        self._pos = 0
        self._skip_empty()

    @classmethod
    def start(
        cls,
        first: pb.GetResponse | memoryview,
        num_keys: int,
        arrays: list[ByteArray] | None,
    ) -> InlineAssembler:
        """The assembler of an INLINE Get from its first message: the header checked (for
        get_into, against the buffers' sizes) and any data the header carries fed."""
        header = parse_get_header(first, num_keys, capacities(arrays))
        targets = None if arrays is None else [arrays[i] for i in header.found_index]
        assembler = cls(header, targets)
        if isinstance(first, pb.GetResponse) and first.data:
            assembler.feed(memoryview(first.data))
        return assembler

    def _skip_empty(self) -> None:
        sizes = self._sizes
        while self._block < len(sizes) and sizes[self._block] == 0:
            self._block += 1

    def feed(self, chunk: memoryview) -> None:
        size = chunk.nbytes
        offset = 0
        source: ByteArray | None = None
        source_address = 0
        if self._targets is not None and size:
            source = np.frombuffer(chunk, dtype=np.uint8)
            source_address = address(source)
        while offset < size:
            block = self._block
            if block >= len(self._sizes):
                raise DataLoss("Get stream carried more data than the sizes it announced")
            take = min(self._sizes[block] - self._pos, size - offset)
            if source is None:
                self.pieces[block].append(chunk if take == size else chunk[offset : offset + take])
            else:
                skew = self._addresses[block] + self._pos - source_address - offset
                assert self._targets is not None  # source is only set with targets
                target = self._targets[block]
                copy_bytes(
                    target[self._pos : self._pos + take], source[offset : offset + take], skew
                )
            offset += take
            self._pos += take
            if self._pos == self._sizes[block]:
                self._block += 1
                self._pos = 0
                self._skip_empty()

    def finish(self) -> None:
        if self._block < len(self._sizes):
            done = sum(self._sizes[: self._block]) + self._pos
            raise DataLoss(f"Get stream ended after {done} of {sum(self._sizes)} announced bytes")

    def payloads(self) -> list[bytes]:
        """Each block's bytes (one copy per block); only without targets."""
        return [b"".join(p) for p in self.pieces]

    def fetched(self) -> Fetched:
        """The whole stream, checked complete: get()'s payloads, or none for get_into()."""
        self.finish()
        return Fetched(self.header, [] if self._targets is not None else self.payloads())


def chunk_of(message: pb.GetResponse | memoryview) -> memoryview:
    if isinstance(message, memoryview):
        return message
    return memoryview(message.data)


def verify(payload: Any, checksum: int) -> bool:
    return bool(xxhash.xxh3_64_intdigest(payload) == checksum)


def finish_get(
    keys: Sequence[bytes], fetched: Fetched, verify_checksums: bool
) -> tuple[list[bytes | None], list[bytes]]:
    """Per-key results of get(), and the keys whose checksum did not match (now misses)."""
    header = fetched.header
    out: list[bytes | None] = [None] * len(keys)
    bad: list[bytes] = []
    for j, i in enumerate(header.found_index):
        payload = fetched.payloads[j]
        if verify_checksums and not verify(payload, header.checksums[j]):
            bad.append(keys[i])
            continue
        out[i] = payload
    return out, bad


def finish_get_into(
    keys: Sequence[bytes], fetched: Fetched, arrays: Sequence[Any], verify_checksums: bool
) -> tuple[list[int | None], list[bytes]]:
    """Per-key results of get_into() (block sizes), and the keys whose checksum failed."""
    header, digests = fetched.header, fetched.digests
    out: list[int | None] = [None] * len(keys)
    bad: list[bytes] = []
    for j, i in enumerate(header.found_index):
        size = header.sizes[j]
        if verify_checksums:
            digest = (
                digests[j] if digests is not None else xxhash.xxh3_64_intdigest(arrays[i][:size])
            )
            if digest != header.checksums[j]:
                bad.append(keys[i])
                continue
        out[i] = size
    return out, bad
