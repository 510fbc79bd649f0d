"""The INLINE Get (the bytes in the gRPC stream) against a real daemon that cuts its stream
into small messages (server.chunk_bytes=64KiB): blocks spanning several messages, blocks of
exactly one message, many blocks in one message, misses among hits, get_into into larger
buffers, with and without checksum verification, the sync and the async client, and a plain
protobuf client reading the same stream. Then the reassembly on hand-made streams: zero-size
blocks, checksums computed on the way, a corrupt block reported as bad."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import numpy as np
import pytest
import xxhash

from kvstore.client import AsyncKVStoreClient, KVStoreClient
from kvstore.client._wire import (
    Fetched,
    InlineAssembler,
    finish_get,
    finish_get_into,
    parse_get_header,
)
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.tools.testing import Daemon
from kvstore.units import KiB
from tests import helpers

CHUNK = 64 * KiB
# Off by one around the message size, exactly one and three messages, several messages and a
# tail, and small blocks that share a message with their neighbours.
SIZES = [1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK, 200_000, 7, 4096, 5 * CHUNK + 3, 2]


@pytest.fixture
def daemon(shared_daemon: Callable[..., Daemon]) -> Daemon:
    """A shared daemon whose messages are small (64 KiB chunks, 1 MiB messages), so blocks
    cross message boundaries; each test reads and writes its own namespace (`ns`)."""
    return shared_daemon("dram.capacity_bytes=32MiB", "dram.page_size_bytes=4KiB",
                         f"server.chunk_bytes={CHUNK}", "server.max_message_bytes=1MiB")


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_get_and_get_into_are_bit_exact_across_message_boundaries(daemon: Daemon, ns: str,
                                                                  verify: bool) -> None:
    keys, values = helpers.keys(len(SIZES), 1), helpers.values(SIZES, 1)
    missing = helpers.keys(2, 2)
    asked = [missing[0], *keys[:4], missing[1], *keys[4:]]
    expected = [None, *values[:4], None, *values[4:]]
    with KVStoreClient(daemon.target, ns, shared_memory=False,
                       verify_checksums=verify) as kv:
        assert kv.put(keys, values, independent=True).stored == len(keys)
        got = kv.get(asked)
        assert got == expected
        assert all(type(g) is bytes for g in got if g is not None)
        # Buffers larger than their blocks: the block lands at the start, the rest untouched.
        buffers = [np.full(len(v or b"") + 100, 0xAB, np.uint8) for v in expected]
        sizes = kv.get_into(asked, buffers)
        assert sizes == [None if v is None else len(v) for v in expected]
        for buffer, value in zip(buffers, expected, strict=True):
            n = len(value or b"")
            assert buffer[:n].tobytes() == (value or b"")
            assert (buffer[n:] == 0xAB).all()
        assert kv.uses_shared_memory is False


def test_many_blocks_in_one_message_and_one_block_per_message(daemon: Daemon, ns: str) -> None:
    small = helpers.values([1000] * 40, 3)  # 40 KB: all in the first message
    exact = helpers.values([CHUNK] * 4, 4)  # one message each, boundaries aligned
    keys = helpers.keys(44, 3)
    with KVStoreClient(daemon.target, ns, shared_memory=False) as kv:
        kv.put(keys, small + exact, independent=True)
        assert kv.get(keys) == small + exact
        assert kv.get(keys[40:]) == exact  # each block is one whole message
        aligned = [np.empty(CHUNK, np.uint8) for _ in exact]
        assert kv.get_into(keys[40:], aligned) == [CHUNK] * 4
        assert [a.tobytes() for a in aligned] == exact
        arrays = [np.empty(len(v), np.uint8) for v in small + exact]
        assert kv.get_into(keys, arrays) == [len(v) for v in small + exact]
        assert [a.tobytes() for a in arrays] == small + exact
        # Only misses: a header and no data.
        assert kv.get(helpers.keys(3, 5)) == [None, None, None]


def test_async_client_reassembles_the_same_stream(daemon: Daemon, ns: str) -> None:
    keys, values = helpers.keys(len(SIZES), 6), helpers.values(SIZES, 6)

    async def run() -> None:
        async with AsyncKVStoreClient(daemon.target, ns, shared_memory=False) as kv:
            await kv.put(keys, values, independent=True)
            assert await kv.get(keys) == values
            arrays = [np.zeros(len(v) + 1, np.uint8) for v in values]
            assert await kv.get_into(keys, arrays) == [len(v) for v in values]
            assert [a[: len(v)].tobytes() for a, v in zip(arrays, values, strict=True)] == values

    asyncio.run(run())


def test_a_plain_protobuf_client_reads_the_same_stream(daemon: Daemon, ns: str) -> None:
    """The frames the daemon writes by hand are GetResponses to any protobuf reader: the
    header first and alone, then the data in order."""
    keys, values = helpers.keys(3, 9), helpers.values([CHUNK + 5, 10, 2 * CHUNK], 9)
    with KVStoreClient(daemon.target, ns, shared_memory=False) as kv:
        kv.put(keys, values, independent=True)
    with grpc.insecure_channel(daemon.target) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        request = pb.GetRequest(namespace=ns, keys=[keys[0], b"\0" * 32, *keys[1:]],
                                mode=pb.GET_MODE_INLINE)
        messages = list(stub.Get(request, timeout=10))
    first = messages[0]
    assert list(first.found) == [True, False, True, True]
    assert list(first.sizes) == [len(v) for v in values]
    assert list(first.checksums) == [xxhash.xxh3_64_intdigest(v) for v in values]
    assert not first.data and all(len(m.data) == CHUNK for m in messages[1:-1])
    assert b"".join(m.data for m in messages[1:]) == b"".join(values)


# --- the reassembly on hand-made streams ----------------------------------------------------


def header_of(blocks: list[bytes | None], corrupt: int | None = None) -> pb.GetResponse:
    found = [b for b in blocks if b is not None]
    checksums = [xxhash.xxh3_64_intdigest(b) for b in found]
    if corrupt is not None:
        checksums[corrupt] ^= 1
    return pb.GetResponse(found=[b is not None for b in blocks], sizes=[len(b) for b in found],
                          checksums=checksums)


def feed_in_pieces(assembler: InlineAssembler, stream: bytes, step: int) -> Fetched:
    for start in range(0, len(stream), step):
        assembler.feed(memoryview(bytes(stream[start : start + step])))
    return assembler.fetched()


@pytest.mark.parametrize("step", [1, 3, 64, 10_000])
def test_zero_size_blocks_and_checksums_computed_on_the_way(step: int) -> None:
    blocks: list[bytes | None] = [b"", b"abc", None, b"", b"x" * 5000, b"", b"yz", b""]
    found = [b for b in blocks if b is not None]
    keys = helpers.keys(len(blocks), 7)
    stream = b"".join(found)

    fetched = feed_in_pieces(
        InlineAssembler(parse_get_header(header_of(blocks), len(blocks)), verify=True),
        stream, step)
    assert fetched.payloads == found
    assert fetched.digests == [xxhash.xxh3_64_intdigest(b) for b in found]
    assert finish_get(keys, fetched, True) == (blocks, [])

    arrays = [np.zeros(len(b or b"") + 2, np.uint8) for b in blocks]
    header = parse_get_header(header_of(blocks), len(blocks), [a.nbytes for a in arrays])
    targets = [arrays[i] for i in header.found_index]
    fetched = feed_in_pieces(InlineAssembler(header, targets, verify=True), stream, step)
    assert fetched.payloads == [] and fetched.digests == [xxhash.xxh3_64_intdigest(b)
                                                          for b in found]
    sizes, bad = finish_get_into(keys, fetched, arrays, True)
    assert sizes == [None if b is None else len(b) for b in blocks] and bad == []
    assert [a[: len(b or b"")].tobytes() for a, b in zip(arrays, blocks, strict=True)] == [
        b or b"" for b in blocks]


def test_a_block_that_fails_its_checksum_is_reported_bad_both_ways() -> None:
    blocks: list[bytes | None] = [b"a" * 100, b"b" * 70_000, b"c" * 3]
    keys = helpers.keys(3, 8)
    stream = b"".join(b for b in blocks if b is not None)
    header = parse_get_header(header_of(blocks, corrupt=1), 3)
    fetched = feed_in_pieces(InlineAssembler(header, verify=True), stream, 4096)
    assert finish_get(keys, fetched, True) == ([blocks[0], None, blocks[2]], [keys[1]])
    assert finish_get(keys, fetched, False) == (blocks, [])

    arrays = [np.zeros(len(b or b""), np.uint8) for b in blocks]
    fetched = feed_in_pieces(InlineAssembler(header, list(arrays), verify=True), stream, 4096)
    assert finish_get_into(keys, fetched, arrays, True) == ([100, None, 3], [keys[1]])
    # Without digests (an assembler that did not verify), the buffers are hashed instead.
    fetched = feed_in_pieces(InlineAssembler(header, list(arrays)), stream, 4096)
    assert fetched.digests is None
    assert finish_get_into(keys, fetched, arrays, True) == ([100, None, 3], [keys[1]])
