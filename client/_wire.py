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
#: Bytes of protobuf framing around a data message's payload (tag, length varint), with room.
FRAME_SLACK_BYTES = 64
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
    if type(keys) is list and key_rules.all_keys(keys):  # the usual case, with no wrapping
        return keys
    # list[BlockKey] is a list[bytes]; the cast only undoes list invariance.
    return cast(list[bytes], _checked(lambda: key_rules.check_keys(keys, field)))


def check_keys_joined(keys: Sequence[bytes], field: str = "keys") -> tuple[list[bytes], bytes]:
    """check_keys, and the keys back to back (for a probe of the read table, which would
    join them again otherwise)."""
    if type(keys) is list:
        joined = key_rules.joined_keys(keys)
        if joined is not None:  # the usual case: checked by the join
            return keys, joined
    key_list = check_keys(keys, field)
    return key_list, b"".join(key_list)


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
    """Checksums computed while copying, by a client that verifies (through shared memory or
    an INLINE Get); None: finish_get/finish_get_into hash the payloads or buffers."""
    held: bool = True
    """Whether the daemon held the blocks while they were copied: an INLINE Get (streamed
    under the daemon's lease) or a leased shared-memory Get. False for a shared-memory Get
    without a lease, whose blocks the daemon may move (demote to L3, its pages reused) before
    the copy: a checksum that fails there is no evidence of damage (see `reread_indexes`)."""


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
    into them; without, each block's bytes are made the moment its last piece arrives: that
    piece copied once when the block came in one message, else its pieces joined. Either way
    a message's buffer is let go as soon as its blocks are done, so the next message reuses
    memory that is already mapped (and warm), not fresh pages.

    With `verify`, each block's xxh3 is computed right after it is made or copied, while its
    bytes are still in cache (hashing every block at the end reads them all back from memory),
    and `fetched()` hands the digests to finish_get/finish_get_into.
    """

    def __init__(
        self, header: GetHeader, targets: list[ByteArray] | None = None, verify: bool = False
    ) -> None:
        self.header = header
        self._sizes = header.sizes
        self._targets = targets
        self._addresses = [address(t) for t in targets] if targets is not None else []
        self._verify = verify
        self._payloads: list[bytes] = []
        """get(): the finished blocks' bytes, in order."""
        self._digests: list[int] = []
        """verify: the finished blocks' checksums, in order."""
        self._pieces: list[memoryview] = []
        """get(): the pieces of the block in progress, when it spans messages."""
        self._hasher: Any = None
        """get_into() with verify: the running hash of the block in progress, ditto."""
        self._block = 0
        self._pos = 0
        self._skip_empty()

    @classmethod
    def start(
        cls,
        first: pb.GetResponse | memoryview,
        num_keys: int,
        arrays: list[ByteArray] | None,
        verify: bool = False,
    ) -> InlineAssembler:
        """The assembler of an INLINE Get from its first message: the header checked (for
        get_into, against the buffers' sizes) and any data the header carries fed."""
        header = parse_get_header(first, num_keys, capacities(arrays))
        targets = None if arrays is None else [arrays[i] for i in header.found_index]
        assembler = cls(header, targets, verify)
        if isinstance(first, pb.GetResponse) and first.data:
            assembler.feed(memoryview(first.data))
        return assembler

    def _skip_empty(self) -> None:
        sizes = self._sizes
        while self._block < len(sizes) and sizes[self._block] == 0:
            if self._targets is None:
                self._payloads.append(b"")
            if self._verify:
                self._digests.append(_EMPTY_DIGEST)
            self._block += 1

    def _next_block(self) -> None:
        self._block += 1
        self._pos = 0
        self._skip_empty()

    def feed(self, chunk: memoryview) -> None:
        size = chunk.nbytes
        if not size:
            return
        if self._targets is None:
            self._keep(chunk, size)
        else:
            self._copy(chunk, size, self._targets)

    def _keep(self, chunk: memoryview, size: int) -> None:
        """get(): cut chunk into the blocks it carries; make each block finished here."""
        sizes = self._sizes
        offset = 0
        while offset < size:
            block = self._block
            if block >= len(sizes):
                raise DataLoss("Get stream carried more data than the sizes it announced")
            want = sizes[block] - self._pos
            left = size - offset
            if left < want:  # the block goes on in the next message
                self._pieces.append(chunk[offset:] if offset else chunk)
                self._pos += left
                return
            piece = chunk if want == size else chunk[offset : offset + want]
            if self._pieces:
                self._pieces.append(piece)
                payload = b"".join(self._pieces)
                self._pieces = []
            else:
                payload = bytes(piece)
            self._payloads.append(payload)
            if self._verify:
                self._digests.append(xxhash.xxh3_64_intdigest(payload))
            offset += want
            self._next_block()

    def _copy(self, chunk: memoryview, size: int, targets: list[ByteArray]) -> None:
        """get_into(): copy chunk into the targets of the blocks it carries."""
        sizes = self._sizes
        source = np.frombuffer(chunk, dtype=np.uint8)
        source_address = address(source)
        offset = 0
        while offset < size:
            block = self._block
            if block >= len(sizes):
                raise DataLoss("Get stream carried more data than the sizes it announced")
            pos = self._pos
            block_size = sizes[block]
            take = min(block_size - pos, size - offset)
            target = targets[block][pos : pos + take]
            skew = self._addresses[block] + pos - source_address - offset
            copy_bytes(target, source[offset : offset + take], skew)
            offset += take
            if self._verify:
                if take == block_size:  # the whole block in this chunk
                    self._digests.append(xxhash.xxh3_64_intdigest(target.data))
                else:
                    if self._hasher is None:
                        self._hasher = xxhash.xxh3_64()
                    self._hasher.update(target.data)
                    if pos + take == block_size:
                        self._digests.append(self._hasher.intdigest())
                        self._hasher = None
            if pos + take == block_size:
                self._next_block()
            else:
                self._pos = pos + take

    def finish(self) -> None:
        if self._block < len(self._sizes):
            done = sum(self._sizes[: self._block]) + self._pos
            raise DataLoss(f"Get stream ended after {done} of {sum(self._sizes)} announced bytes")

    def payloads(self) -> list[bytes]:
        """Each block's bytes; only without targets, once the stream is complete."""
        return self._payloads

    def fetched(self) -> Fetched:
        """The whole stream, checked complete: get()'s payloads, or none for get_into(),
        and with verify each block's checksum."""
        self.finish()
        return Fetched(
            self.header,
            [] if self._targets is not None else self._payloads,
            self._digests if self._verify else None,
        )


_EMPTY_DIGEST = xxhash.xxh3_64_intdigest(b"")


def chunk_of(message: pb.GetResponse | memoryview) -> memoryview:
    if isinstance(message, memoryview):
        return message
    return memoryview(message.data)


def finish_get(
    keys: Sequence[bytes], fetched: Fetched, verify_checksums: bool
) -> tuple[list[bytes | None], list[bytes]]:
    """Per-key results of get(), and the keys whose checksum did not match (now misses)."""
    header = fetched.header
    out: list[bytes | None] = [None] * len(keys)
    bad: list[bytes] = []
    digests = fetched.digests
    for j, i in enumerate(header.found_index):
        payload = fetched.payloads[j]
        if verify_checksums:
            digest = digests[j] if digests is not None else xxhash.xxh3_64_intdigest(payload)
            if digest != header.checksums[j]:
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


def reread_indexes(fetched: Fetched, out: Sequence[object]) -> list[int]:
    """The request indexes of the blocks to read once more, under a lease, before any is
    judged damaged: those found whose checksum failed (None in `out`, the per-key result of
    finish_get or finish_get_into) on a read the daemon did not hold. Under L2 pressure the
    daemon demotes a block to L3 and reuses its pages between its reply and the client's copy
    as a matter of course; the block is intact in L3, and evicting it would turn one spurious
    miss into a lost block for every reader after. A failure on a held read (inline, or
    leased) is damage: nothing to read again, the block is evicted."""
    if fetched.held:
        return []
    return [i for i in fetched.header.found_index if out[i] is None]


def merge_reread(out: list[T | None], indexes: Sequence[int], again: Sequence[T | None]) -> None:
    """Put the results of the blocks read again (`again`, one per index) in their places of
    out, the first read's per-key results: a block that passed its checksum the second time
    is a hit, one that failed it or was not found is a miss."""
    for i, result in zip(indexes, again, strict=True):
        out[i] = result
