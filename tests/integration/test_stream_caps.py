"""Idle streams cannot freeze the daemon (a real daemon, raw gRPC): header-only Put streams
and inline Gets nobody reads each hold an RPC thread, so at most server.max_streams run at
once (all workers but two by default), clients.max_streams from one client (a quarter of
them stay for the others) and server.max_streams_per_connection on one connection. Past a
cap a new stream is RESOURCE_EXHAUSTED at once, naming the setting, while another client's
Lookup and the health check keep answering within 2 s; once the hog lets go, streams are
served again. A stream that waits on its client longer than server.stream_idle_s is aborted
(ABORTED, naming the setting) and what it held goes back, while a slow client that keeps
sending is served."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import KVStoreClient
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.tools.testing import Daemon
from tests.helpers import metric

NS = "caps"
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
BLOCK = 48 << 20  # far more than gRPC buffers for a reader that does not read
KEY = b"\x09" * 32


def connection(target: str) -> grpc.Channel:
    """A channel on its own TCP connection (gRPC shares them between alike channels)."""
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


def holding_the_block(d: Daemon) -> Daemon:
    """d, once it holds KEY's block (put again for each test: a re-put changes nothing)."""
    with KVStoreClient(d.target, NS) as kv:
        kv.put([KEY], [bytes(BLOCK)])
    return d


@pytest.fixture
def daemon(shared_daemon: Callable[..., Daemon]) -> Daemon:
    """The session's daemon for the caps on streams in flight, shared by the tests below:
    each cancels every stream it opened and waits until streams are served again."""
    # Every hog here is one client (127.0.0.1), so its cap is lifted to the server's.
    return holding_the_block(shared_daemon(
        "dram.capacity_bytes=128MiB", "server.workers=8", "server.max_streams_per_connection=4",
        "server.chunk_bytes=256KiB", "nvme.enabled=false", "clients.max_streams=6"))


class IdlePut:
    """A Put stream that sends its header and then nothing until released."""

    def __init__(self, stub: rpc.KVStoreStub, n: int) -> None:
        self.release = threading.Event()

        def messages() -> Iterator[pb.PutRequest]:
            yield pb.PutRequest(namespace=NS, keys=[bytes([n]) * 32], sizes=[1000],
                                independent=True)
            self.release.wait(30)

        self.call = stub.Put.future(messages(), timeout=30)

    def cancel(self) -> None:
        self.call.cancel()
        self.release.set()


def wait_for_plans(target: str, count: int) -> None:
    """Until the daemon holds count open put plans: the idle streams are in, each holding
    its thread (a stream's header is read, and planned, before it waits for data)."""
    deadline = time.monotonic() + 10
    with KVStoreClient(target, NS) as kv:
        while kv.stats().reservations != count:
            assert time.monotonic() < deadline, kv.stats().reservations
            time.sleep(0.05)


def expect_exhausted(setting: str, call: Callable[[], object]) -> None:
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == EXHAUSTED, info.value.details()
    assert setting in (info.value.details() or ""), info.value.details()
    assert time.monotonic() - started < 2, "refused at once, not after queueing"


def others_still_served(target: str) -> None:
    with connection(target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == serving
        reply = rpc.KVStoreStub(ch).Lookup(pb.LookupRequest(namespace=NS, keys=[KEY]), timeout=2)
        assert reply.prefix_length == 1


def wait_until_served(target: str) -> None:
    deadline = time.monotonic() + 10
    with KVStoreClient(target, NS) as kv:
        while True:
            try:
                kv.put([b"\x0a" * 32], [b"after"], independent=True)
                return
            except Exception:
                assert time.monotonic() < deadline, "streams never freed"
                time.sleep(0.1)


def test_idle_put_streams_hit_the_caps_and_nothing_else_starves(daemon: Daemon) -> None:
    hog_a, hog_b, other = (connection(daemon.target) for _ in range(3))
    try:
        a, b = rpc.KVStoreStub(hog_a), rpc.KVStoreStub(hog_b)
        idle = [IdlePut(a, 16 + i) for i in range(4)]
        wait_for_plans(daemon.target, 4)
        expect_exhausted("server.max_streams_per_connection", lambda: IdlePut(a, 30).call.result())
        idle += [IdlePut(b, 20 + i) for i in range(2)]  # 6 = workers - 2 streams in flight
        wait_for_plans(daemon.target, 6)
        put = rpc.KVStoreStub(other).Put
        expect_exhausted("server.max_streams", lambda: put(iter([pb.PutRequest(
            namespace=NS, keys=[b"\x0b" * 32], sizes=[1], data=b"x", independent=True)]),
            timeout=5))
        others_still_served(daemon.target)
        for stream in idle:
            stream.cancel()
        wait_until_served(daemon.target)
    finally:
        for ch in (hog_a, hog_b, other):
            ch.close()


def test_unread_inline_gets_hold_slots_until_they_end(daemon: Daemon) -> None:
    hogs = [connection(daemon.target) for _ in range(2)]
    try:
        gets = []
        for ch in hogs:
            for _ in range(3):
                stream = rpc.KVStoreStub(ch).Get(pb.GetRequest(namespace=NS, keys=[KEY]),
                                                timeout=30)
                assert list(next(stream).found) == [True]  # the header, then nothing read
                gets.append(stream)
        with connection(daemon.target) as other:
            stub = rpc.KVStoreStub(other)
            expect_exhausted("server.max_streams", lambda: list(stub.Get(
                pb.GetRequest(namespace=NS, keys=[KEY]), timeout=5)))
        others_still_served(daemon.target)
        for stream in gets:
            stream.cancel()
        wait_until_served(daemon.target)
    finally:
        for ch in hogs:
            ch.close()
    with KVStoreClient(daemon.target, NS) as kv:
        assert kv.get([KEY]) == [bytes(BLOCK)]
        assert kv.stats().leases == 0  # the cancelled Gets' leases went back


IDLE_S = 1.0
#: The settings of the daemon that aborts idle streams (test_error_reasons.py's too).
IDLE_SETTINGS = ("dram.capacity_bytes=128MiB", "server.chunk_bytes=256KiB",
                 f"server.stream_idle_s={IDLE_S}", "nvme.enabled=false")


@pytest.fixture
def idle_daemon(shared_daemon: Callable[..., Daemon]) -> Daemon:
    """The session's daemon of IDLE_SETTINGS: tests read its count of aborted streams as a
    delta, and each waits until every lease and reservation its streams held went back."""
    return holding_the_block(shared_daemon(*IDLE_SETTINGS))


def aborted_idle(d: Daemon, method: str) -> float:
    return metric(d, "kvstore_streams_aborted_idle_total", method=method)


def expect_idle_abort(call: Callable[[], object]) -> float:
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.ABORTED, info.value.details()
    assert "server.stream_idle_s" in (info.value.details() or ""), info.value.details()
    return time.monotonic() - started


def test_an_idle_put_stream_is_aborted_and_its_pages_freed(idle_daemon: Daemon) -> None:
    aborted = aborted_idle(idle_daemon, "Put")
    with connection(idle_daemon.target) as ch:
        idle = IdlePut(rpc.KVStoreStub(ch), 40)
        wait_for_plans(idle_daemon.target, 1)
        waited = expect_idle_abort(idle.call.result)
        idle.release.set()
    assert IDLE_S < waited + 0.5 < IDLE_S + 2.5, waited  # after stream_idle_s, not much later
    wait_for_plans(idle_daemon.target, 0)  # the plan's pages went back
    assert aborted_idle(idle_daemon, "Put") == aborted + 1
    with KVStoreClient(idle_daemon.target, NS) as kv:
        assert kv.lookup([bytes([40]) * 32]).prefix_length == 0
    assert "Traceback" not in idle_daemon.log(), idle_daemon.log()


def test_an_unread_inline_get_is_aborted_and_its_lease_released(idle_daemon: Daemon) -> None:
    aborted = aborted_idle(idle_daemon, "Get")
    with connection(idle_daemon.target) as ch:
        stream = rpc.KVStoreStub(ch).Get(pb.GetRequest(namespace=NS, keys=[KEY]), timeout=30)
        assert list(next(stream).found) == [True]  # the header, then nothing read
        time.sleep(IDLE_S * 3)  # gRPC's buffers fill at once, then the daemon waits on us
        with pytest.raises(grpc.RpcError) as info:
            for _ in stream:
                pass
    assert info.value.code() == grpc.StatusCode.ABORTED, info.value.details()
    assert "server.stream_idle_s" in (info.value.details() or "")
    with KVStoreClient(idle_daemon.target, NS) as kv:
        deadline = time.monotonic() + 5
        while kv.stats().leases:
            assert time.monotonic() < deadline, "the aborted Get kept its lease"
            time.sleep(0.05)
        assert kv.get([KEY]) == [bytes(BLOCK)]
    assert aborted_idle(idle_daemon, "Get") == aborted + 1
    assert "Traceback" not in idle_daemon.log(), idle_daemon.log()


def test_a_slow_client_that_keeps_sending_is_not_idle(idle_daemon: Daemon) -> None:
    """Six gaps of 0.6 x stream_idle_s: 3.6 x stream_idle_s in all, never idle that long."""
    key, size = b"\x0c" * 32, 6 * 1000
    aborted = aborted_idle(idle_daemon, "Put")

    def slow() -> Iterator[pb.PutRequest]:
        yield pb.PutRequest(namespace=NS, keys=[key], sizes=[size], independent=True)
        for _ in range(6):
            time.sleep(IDLE_S * 0.6)
            yield pb.PutRequest(data=b"s" * 1000)

    with connection(idle_daemon.target) as ch:
        assert rpc.KVStoreStub(ch).Put(slow(), timeout=30).stored == 1
    with KVStoreClient(idle_daemon.target, NS) as kv:
        assert kv.get([key]) == [b"s" * size]
    assert aborted_idle(idle_daemon, "Put") == aborted


def test_64_idle_puts_and_64_unread_gets_at_once(idle_daemon: Daemon) -> None:
    """The issue's barrage: 64 header-only Put streams and 64 inline Gets nobody reads, from
    eight connections. The daemon runs the first server.max_streams and refuses the rest at
    once; the victim's Lookup and health answer within 2 s throughout; the reaper then ends
    every stream it ran, and every page and lease comes back."""
    hogs = [connection(idle_daemon.target) for _ in range(8)]
    try:
        puts = [IdlePut(rpc.KVStoreStub(hogs[i % 8]), 100 + i) for i in range(64)]
        gets = []
        for i in range(64):
            stream = rpc.KVStoreStub(hogs[i % 8]).Get(pb.GetRequest(namespace=NS, keys=[KEY]),
                                                      timeout=30)
            gets.append(stream)
        others_still_served(idle_daemon.target)
        codes: dict[str, int] = {}
        for put in puts:
            try:
                put.call.result(timeout=IDLE_S + 10)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            codes[code] = codes.get(code, 0) + 1
            put.release.set()
        for stream in gets:
            try:
                for _ in stream:
                    pass
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            codes[code] = codes.get(code, 0) + 1
        assert set(codes) <= {"RESOURCE_EXHAUSTED", "ABORTED", "OK"}, codes
        assert codes.get("RESOURCE_EXHAUSTED", 0) >= 64, codes  # most: 6 run at a time
        assert codes.get("ABORTED", 0) >= 1, codes
        others_still_served(idle_daemon.target)
    finally:
        for ch in hogs:
            ch.close()
    with KVStoreClient(idle_daemon.target, NS) as kv:
        deadline = time.monotonic() + 10
        while (s := kv.stats()).leases or s.reservations:
            assert time.monotonic() < deadline, (s.leases, s.reservations)
            time.sleep(0.05)
        assert kv.get([KEY]) == [bytes(BLOCK)]


def test_one_client_cannot_take_every_stream_slot(daemon_factory: Callable[..., Daemon]) -> None:
    """A hog on 127.0.0.1 spread over six connections gets clients.max_streams (five of the
    six slots) and then RESOURCE_EXHAUSTED naming it; a client on ::1 still gets a stream."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 loopback: the second client needs an address of its own")
    d = daemon_factory("server.host=[::]", "dram.capacity_bytes=128MiB", "nvme.enabled=false",
                       "server.workers=8")
    with KVStoreClient(f"[::1]:{d.port}", NS) as kv:
        kv.put([KEY], [b"k" * 1000])
    hogs = [connection(f"127.0.0.1:{d.port}") for _ in range(6)]
    try:
        idle = [IdlePut(rpc.KVStoreStub(ch), 60 + i) for i, ch in enumerate(hogs[:5])]
        wait_for_plans(f"[::1]:{d.port}", 5)
        expect_exhausted("clients.max_streams", lambda: IdlePut(
            rpc.KVStoreStub(hogs[5]), 70).call.result())
        with connection(f"[::1]:{d.port}") as other:
            got = list(rpc.KVStoreStub(other).Get(pb.GetRequest(namespace=NS, keys=[KEY]),
                                                  timeout=2))
        assert b"".join(m.data for m in got) == b"k" * 1000
        for stream in idle:
            stream.cancel()
    finally:
        for ch in hogs:
            ch.close()
