"""Requests a hostile or broken client sends, through raw gRPC (the client library refuses
most of them before the wire), against a real daemon: bytes that do not parse, a Put whose
later messages carry header fields, a 100 kB id echoed back, repeated keys, an inline Get
larger than server.max_response_bytes, and a Put the client cancels. Each gets the status
the contract promises, naming the field, logs no traceback, and leaves the daemon serving
with every block stored before intact."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc
import pytest

from kvstore.client import KVStoreClient
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.tools.testing import Daemon
from tests.helpers import metric, scrape, wait_until

NS = "hostile"
INVALID = grpc.StatusCode.INVALID_ARGUMENT
BLOCK = 1 << 20
KEYS = [bytes([i]) * 32 for i in range(1, 4)]
VALUES = [bytes([i]) * BLOCK for i in range(1, 4)]


#: One daemon for the whole module (tests/conftest.py's shared_daemon); each test starts by
#: putting the blocks (again) and ends by checking them.
SETTINGS = ("dram.capacity_bytes=16MiB", "server.max_object_bytes=1MiB",
            "server.max_response_bytes=2MiB", "nvme.enabled=false")


@pytest.fixture
def daemon_with_blocks(shared_daemon: Callable[..., Daemon]) -> Iterator[Daemon]:
    d = shared_daemon(*SETTINGS)
    with KVStoreClient(d.target, NS) as kv:
        kv.put(KEYS, VALUES, independent=True)
    yield d
    with KVStoreClient(d.target, NS) as kv:  # whatever the test did, nothing stored changed
        assert kv.get(KEYS[:2]) == VALUES[:2] and kv.get(KEYS[2:]) == VALUES[2:]
        assert kv.stats().leases == 0
    # The log covers every test of the module so far: none may have logged a traceback.
    assert "Traceback" not in d.log() and " ERROR " not in d.log(), d.log()


@pytest.fixture
def channel(daemon_with_blocks: Daemon) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(daemon_with_blocks.target, options=[
            ("grpc.max_receive_message_length", 8 << 20)]) as ch:
        yield ch


def raw_unary(channel: grpc.Channel, method: str) -> Callable[..., bytes]:
    return channel.unary_unary(f"/kvstore.v1.KVStore/{method}",  # type: ignore[no-any-return]
                               request_serializer=lambda b: b, response_deserializer=lambda b: b)


def expect(code: grpc.StatusCode, named: str, call: Callable[[], object]) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    assert err.code() == code, err.details()
    assert named in err.details(), f"{named!r} not in {err.details()!r}"
    return str(err.details())


BAD_UTF8_NAMESPACE = bytes([0x0A, 0x02, 0xFF, 0xFE])  # field 1 (namespace), 2 bytes, not UTF-8


def test_requests_that_do_not_parse_are_invalid_argument(channel: grpc.Channel) -> None:
    for method in ("Lookup", "Pin", "Evict", "Stats", "Reserve"):
        expect(INVALID, "does not parse", lambda m=method: raw_unary(channel, m)(  # type: ignore[misc]
            BAD_UTF8_NAMESPACE, timeout=5))
    for method in ("Get", "Prefetch"):
        stream = channel.unary_stream(f"/kvstore.v1.KVStore/{method}",
                                      request_serializer=lambda b: b,
                                      response_deserializer=lambda b: b)
        expect(INVALID, f"{method}Request", lambda s=stream: list(s(BAD_UTF8_NAMESPACE,  # type: ignore[misc]
                                                                    timeout=5)))
    put = channel.stream_unary("/kvstore.v1.KVStore/Put", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
    expect(INVALID, "PutRequest", lambda: put(iter([BAD_UTF8_NAMESPACE]), timeout=5))


def test_a_later_put_message_with_a_header_field_is_refused(channel: grpc.Channel) -> None:
    stub = rpc.KVStoreStub(channel)
    key = b"\x42" * 32
    header = pb.PutRequest(namespace=NS, keys=[key], sizes=[8], independent=True)
    for extra, field in ((pb.PutRequest(data=b"1234", parent_key=KEYS[0]), "parent_key"),
                         (pb.PutRequest(data=b"1234", independent=True), "independent"),
                         (pb.PutRequest(data=b"1234", namespace=NS), "namespace")):
        expect(INVALID, field, lambda e=extra: stub.Put(iter([header, e]), timeout=5))  # type: ignore[misc]
    assert stub.Lookup(pb.LookupRequest(namespace=NS, keys=[key])).prefix_length == 0


def test_an_echoed_100kb_id_comes_back_cut_as_invalid_argument(channel: grpc.Channel) -> None:
    stub = rpc.KVStoreStub(channel)
    details = expect(INVALID, "unknown", lambda: stub.Release(pb.ReleaseRequest(
        ids=["x" * 100_000]), timeout=5))
    assert len(details) < 1000 and "characters cut" in details and details.startswith("ids")


def test_repeated_keys_are_refused_by_name(channel: grpc.Channel) -> None:
    stub = rpc.KVStoreStub(channel)
    keys = [KEYS[0], KEYS[1], KEYS[0]]
    expect(INVALID, "keys[2] repeats keys[0]",
           lambda: list(stub.Get(pb.GetRequest(namespace=NS, keys=keys), timeout=5)))
    expect(INVALID, "keys[2] repeats keys[0]",
           lambda: list(stub.Prefetch(pb.PrefetchRequest(namespace=NS, keys=keys), timeout=5)))
    expect(INVALID, "keys[2] repeats keys[0]",
           lambda: stub.Pin(pb.PinRequest(namespace=NS, keys=keys), timeout=5))
    # 4,096 copies of one key: the amplification the check is there for, refused at once.
    expect(INVALID, "keys[1] repeats keys[0]", lambda: list(stub.Get(
        pb.GetRequest(namespace=NS, keys=[KEYS[0]] * 1000), timeout=5)))


def test_an_inline_get_over_max_response_bytes_is_refused(channel: grpc.Channel) -> None:
    stub = rpc.KVStoreStub(channel)
    expect(grpc.StatusCode.RESOURCE_EXHAUSTED, "server.max_response_bytes",
           lambda: list(stub.Get(pb.GetRequest(namespace=NS, keys=KEYS), timeout=5)))
    messages = list(stub.Get(pb.GetRequest(namespace=NS, keys=KEYS[:2]), timeout=5))
    assert sum(len(m.data) for m in messages) == 2 * BLOCK  # at the cap: served


def test_a_put_the_client_cancels_counts_as_cancelled(daemon_with_blocks: Daemon,
                                                       channel: grpc.Channel) -> None:
    stub = rpc.KVStoreStub(channel)
    hold = threading.Event()
    cancelled = metric(daemon_with_blocks, "kvstore_rpc_latency_seconds_count",
                       code="CANCELLED", method="Put")
    with KVStoreClient(daemon_with_blocks.target, NS) as kv:
        reservations = kv.stats().reservations

    def messages() -> Iterator[pb.PutRequest]:
        yield pb.PutRequest(namespace=NS, keys=[b"\x43" * 32], sizes=[1000], independent=True)
        hold.wait(5)

    call = stub.Put.future(messages(), timeout=10)
    # Cancel only once the daemon has read the header and planned the put: a call cancelled
    # before its handler starts never reaches the servicer at all.
    with KVStoreClient(daemon_with_blocks.target, NS) as kv:
        wait_until(lambda: kv.stats().reservations == reservations + 1, "the put to start")
    call.cancel()
    # Counted as CANCELLED, never as INTERNAL nor as a client fault: gRPC may deliver the
    # cancel as an early end of the stream before it marks the call cancelled (about 1 run
    # in 6), and the daemon waits a moment for the cancel before it calls the Put short.
    wait_until(lambda: metric(daemon_with_blocks, "kvstore_rpc_latency_seconds_count",
                              code="CANCELLED", method="Put") > cancelled,
               "the cancelled Put to be counted")
    hold.set()
    assert not any(code == "INTERNAL" for (_, labels) in scrape(daemon_with_blocks)
                   for name, code in labels if name == "code")
    with KVStoreClient(daemon_with_blocks.target, NS) as kv:
        assert kv.stats().reservations == reservations  # the cancelled put's pages went back
