"""Leases and reservations in a real daemon with short timeouts: a shared-memory Get holds its
pages until Release or expiry, an abandoned Reserve gives its pages back, and a client that
dies mid-read never pins memory for ever."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest

from kvstore.client import KVStoreClient, Stats
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.tools.testing import Daemon
from tests.conftest import SIXTEEN_PAGES

PAGE = 64 << 10
NUM_PAGES = 16
LEASE_TIMEOUT_S = 2.0  # leases.lease_timeout_s in SIXTEEN_PAGES
NS = "leases"


@pytest.fixture
def daemon(shared_daemon: Callable[..., Daemon]) -> Daemon:
    """The shared 16-page daemon (leases of LEASE_TIMEOUT_S), emptied before each test by
    the kv fixture."""
    return shared_daemon(*SIXTEEN_PAGES)


@pytest.fixture
def kv(daemon: Daemon) -> Iterator[KVStoreClient]:
    with KVStoreClient(daemon.target, NS, shared_memory=False) as client:
        client.evict(all=True, namespace="")
        s = client.stats()
        assert (s.leases, s.reservations, s.pinned) == (0, 0, 0)
        assert free_pages(s) == NUM_PAGES
        yield client


@pytest.fixture
def stub(daemon: Daemon) -> Iterator[rpc.KVStoreStub]:
    with grpc.insecure_channel(daemon.target) as channel:
        yield rpc.KVStoreStub(channel)


def free_pages(stats: Stats) -> int:
    dram = stats.tier("dram")
    assert dram is not None
    return dram.free_pages


def key(i: int) -> bytes:
    return np.random.default_rng([7, i]).bytes(32)


def value(i: int) -> bytes:
    return np.random.default_rng([8, i]).bytes(PAGE)


def wait_for(kv: KVStoreClient, done: Callable[[Stats], bool], timeout_s: float = 10.0) -> Stats:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = kv.stats()
        if done(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def segment_bytes(shm_name: str, offset: int, length: int) -> bytes:
    with open(f"/dev/shm/{shm_name}", "rb") as f:
        f.seek(offset)
        return f.read(length)


def test_shared_memory_get_holds_its_block_until_the_lease_expires(
    kv: KVStoreClient, stub: rpc.KVStoreStub,
) -> None:
    keys = [key(i) for i in range(NUM_PAGES)]
    assert kv.put(keys, [value(i) for i in range(NUM_PAGES)], independent=True).stored == 16

    started = time.monotonic()
    (head,) = stub.Get(pb.GetRequest(namespace=NS, keys=[keys[0]],
                                     mode=pb.GET_MODE_SHARED_MEMORY))
    assert list(head.found) == [True]
    assert list(head.sizes) == [PAGE]
    assert head.lease_id
    assert head.lease_expires_in_ms == int(LEASE_TIMEOUT_S * 1000)
    assert head.shm_name == kv.stats().shm_name
    (location,) = head.locations
    (extent,) = location.extents
    assert extent.length == PAGE
    assert segment_bytes(head.shm_name, extent.offset, extent.length) == value(0)
    assert kv.stats().leases == 1

    # Make the leased block the least recently used, then put under pressure.
    assert kv.get(keys[1:]) == [value(i) for i in range(1, NUM_PAGES)]
    assert kv.put([key(100)], [value(100)]).evicted == 1
    assert kv.lookup(keys[:3]).tiers == ["dram", None, "dram"]  # keys[1] went, not keys[0]
    result = kv.evict([keys[0]])
    assert (result.evicted, result.skipped) == (0, 1)
    assert time.monotonic() - started < LEASE_TIMEOUT_S, "too slow to observe the lease"
    assert kv.stats().leases == 1

    stats = wait_for(kv, lambda s: s.leases == 0)
    assert stats.leases == 0
    assert time.monotonic() - started >= LEASE_TIMEOUT_S * 0.9  # expired, not dropped early

    # Unleased, it is the least recently used block again and the next to go (key(100),
    # used once, would go before the blocks read again: read it too).
    assert kv.get([key(100)]) == [value(100)]
    assert kv.put([key(101)], [value(101)]).evicted == 1
    assert kv.lookup(keys[:3]).tiers == [None, None, "dram"]

    with pytest.raises(grpc.RpcError) as info:
        stub.Release(pb.ReleaseRequest(ids=[head.lease_id]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert head.lease_id in info.value.details()


def test_release_ends_a_lease_at_once(kv: KVStoreClient, stub: rpc.KVStoreStub) -> None:
    assert kv.put([key(0)], [value(0)]).stored == 1
    (head,) = stub.Get(pb.GetRequest(namespace=NS, keys=[key(0)],
                                     mode=pb.GET_MODE_SHARED_MEMORY, lease_timeout_ms=60_000))
    assert head.lease_expires_in_ms == 60_000
    assert kv.stats().leases == 1
    assert kv.evict(all=True).skipped == 1
    assert stub.Release(pb.ReleaseRequest(ids=[head.lease_id])).released == 1
    assert kv.stats().leases == 0
    result = kv.evict(all=True)
    assert (result.evicted, result.skipped) == (1, 0)
    # A miss takes no lease at all.
    (miss,) = stub.Get(pb.GetRequest(namespace=NS, keys=[key(0)],
                                     mode=pb.GET_MODE_SHARED_MEMORY))
    assert list(miss.found) == [False]
    assert miss.lease_id == ""
    assert kv.stats().leases == 0


def test_an_abandoned_reservation_expires_and_frees_its_pages(
    kv: KVStoreClient, stub: rpc.KVStoreStub,
) -> None:
    keys = [key(0), key(1)]
    reserved = stub.Reserve(pb.ReserveRequest(namespace=NS, keys=keys, sizes=[PAGE, PAGE + 1],
                                              timeout_ms=300))
    assert reserved.reservation_id
    assert list(reserved.exists) == [False, False]
    assert reserved.expires_in_ms == 300
    stats = kv.stats()
    assert stats.reservations == 1
    assert free_pages(stats) == NUM_PAGES - 3  # one page, and two for PAGE + 1 bytes

    stats = wait_for(kv, lambda s: s.reservations == 0)
    assert stats.reservations == 0
    assert free_pages(stats) == NUM_PAGES
    assert kv.lookup(keys).tiers == [None, None]

    with pytest.raises(grpc.RpcError) as info:
        stub.Put(iter([pb.PutRequest(namespace=NS, reservation_id=reserved.reservation_id)]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "reservation_id" in info.value.details()
    assert reserved.reservation_id in info.value.details()
    assert free_pages(kv.stats()) == NUM_PAGES


def test_a_reservation_written_and_committed_in_time_is_stored(
    kv: KVStoreClient, stub: rpc.KVStoreStub,
) -> None:
    data = value(3)[:-1] + b"\x7f" + value(4)[: PAGE // 2]  # 1.5 pages: two extents or one run
    reserved = stub.Reserve(pb.ReserveRequest(namespace=NS, keys=[key(3)], sizes=[len(data)]))
    (location,) = reserved.locations
    with open(f"/dev/shm/{reserved.shm_name}", "r+b") as segment:
        written = 0
        for extent in location.extents:
            segment.seek(extent.offset)
            segment.write(data[written : written + extent.length])
            written += extent.length
    assert written == len(data)
    committed = stub.Put(iter([pb.PutRequest(namespace=NS,
                                             reservation_id=reserved.reservation_id)]))
    assert (committed.stored, committed.existing) == (1, 0)
    assert kv.stats().reservations == 0
    assert kv.get([key(3)]) == [data]

    # Release abandons a reservation at once.
    again = stub.Reserve(pb.ReserveRequest(namespace=NS, keys=[key(5)], sizes=[PAGE]))
    assert free_pages(kv.stats()) == NUM_PAGES - 3
    assert stub.Release(pb.ReleaseRequest(ids=[again.reservation_id])).released == 1
    assert free_pages(kv.stats()) == NUM_PAGES - 2


DIES_MID_READ = r"""
import os, sys
import grpc
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc

channel = grpc.insecure_channel(sys.argv[1])
stub = rpc.KVStoreStub(channel)
(head,) = stub.Get(pb.GetRequest(namespace=sys.argv[2], keys=[bytes.fromhex(sys.argv[3])],
                                 mode=pb.GET_MODE_SHARED_MEMORY))
extent = head.locations[0].extents[0]
with open("/dev/shm/" + head.shm_name, "rb") as f:
    f.seek(extent.offset)
    print(head.lease_id, f.read(16).hex(), flush=True)
os._exit(0)  # no Release, no channel close: as if the process were killed mid-read
"""


def test_a_client_that_dies_mid_read_never_pins_memory_for_ever(
    daemon: Daemon, kv: KVStoreClient,
) -> None:
    assert kv.put([key(9)], [value(9)]).stored == 1
    child = subprocess.run([sys.executable, "-c", DIES_MID_READ, daemon.target, NS, key(9).hex()],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    lease_id, first_bytes = child.stdout.split()
    assert first_bytes == value(9)[:16].hex()
    assert kv.evict([key(9)]).skipped == 1  # the dead client's lease still holds it

    stats = wait_for(kv, lambda s: s.leases == 0)
    assert stats.leases == 0
    result = kv.evict([key(9)])
    assert (result.evicted, result.skipped) == (1, 0)
    assert free_pages(kv.stats()) == NUM_PAGES
    assert lease_id  # the daemon handed out a real lease


@pytest.mark.parametrize("shared_memory", [False, True], ids=["inline", "shm"])
def test_a_refused_get_into_leaves_no_lease_behind(daemon: Daemon, kv: KVStoreClient,
                                                   shared_memory: bool) -> None:
    assert kv.put([key(0), key(1)], [value(0), value(1)], independent=True).stored == 2
    with KVStoreClient(daemon.target, NS, shared_memory=shared_memory) as reader:
        with pytest.raises(ValueError, match=r"buffers\[1\] holds 100 bytes"):
            reader.get_into([key(0), key(1)], [bytearray(PAGE), bytearray(100)])
        assert reader.uses_shared_memory is shared_memory
    stats = wait_for(kv, lambda s: s.leases == 0, timeout_s=LEASE_TIMEOUT_S / 2)
    assert stats.leases == 0  # released at once, not left to expire
    result = kv.evict(all=True)
    assert (result.evicted, result.skipped) == (2, 0)


def test_an_inline_put_that_stalls_past_the_reservation_timeout_is_aborted(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """An inline put holds its pages like a reservation; a sender that stalls past
    leases.reservation_timeout_s loses them (ABORTED), and nothing half-written is visible."""
    d = daemon_factory("nvme.enabled=false", "dram.capacity_bytes=1MiB",
                       "leases.reservation_timeout_s=0.3", "leases.sweep_interval_s=0.05")
    k = key(7)

    def stalled() -> Iterator[pb.PutRequest]:
        yield pb.PutRequest(namespace=NS, keys=[k], sizes=[PAGE], data=b"x" * 100)
        time.sleep(1.0)
        yield pb.PutRequest(data=b"y" * (PAGE - 100))

    with grpc.insecure_channel(d.target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            rpc.KVStoreStub(channel).Put(stalled())
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert "reservation_timeout_s" in info.value.details()
    with KVStoreClient(d.target, NS) as kv:
        assert kv.lookup([k]).prefix_length == 0
        stats = kv.stats()
        assert stats.reservations == 0 and free_pages(stats) == NUM_PAGES
