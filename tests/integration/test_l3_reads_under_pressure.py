"""Blocks cached in L3 read back under L2 pressure, through a real daemon: a Get's L3 blocks
are hits however little room L2 has at that instant. Reads whose blocks together need more
than L2 take turns rather than each holding part of it; a Get waits for room that another
client's lease holds until its time to wait runs out, and no longer; a Get larger than what
pins leave of L2 gets its prefix at once. Every byte returned is checked."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from kvstore.client import KVStoreClient
from kvstore.client.results import TierStats
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.tools.testing import Daemon
from tests.helpers import blocks, wait_until

L2_PAGES = 32  # dram.capacity_bytes / dram.page_size_bytes below; every block is one page
#: A 32-page L2 (blocks of one page), an L3 that holds every block the tests put, a mover
#: that looks every 20 ms, and pins up to the whole of L2 for the pin test.
PRESSURE = ("dram.capacity_bytes=2MiB", "dram.page_size_bytes=64KiB",
            "nvme.capacity_bytes=32MiB", "nvme.page_size_bytes=64KiB", "movers.interval_s=0.02",
            "clients.max_pinned_share=1")


@pytest.fixture
def pressure(shared_daemon: Callable[..., Daemon]) -> Daemon:
    """The session's daemon of PRESSURE settings with the local path, emptied before each
    test: the tests here fill both tiers."""
    d = shared_daemon(*PRESSURE, unix_socket=True)
    with KVStoreClient(d.target, "l3-pressure", shared_memory=False) as kv:
        kv.evict(all=True, namespace="")
        wait_until(lambda: all(t.objects == 0 for t in tiers(kv)), "an empty store")
    return d


@pytest.fixture
def stub(pressure: Daemon) -> Iterator[rpc.KVStoreStub]:
    with grpc.insecure_channel(pressure.target) as channel:
        yield rpc.KVStoreStub(channel)


def tiers(kv: KVStoreClient) -> tuple[TierStats, TierStats]:
    """The daemon's L2 and L3 rows."""
    s = kv.stats()
    dram, nvme = s.tier("dram"), s.tier("nvme")
    assert dram is not None and nvme is not None
    return dram, nvme


def fill(kv: KVStoreClient, keys: list[bytes], values: list[bytes], chain: int = 16) -> None:
    """Put the blocks in chains of `chain`, then wait until the mover has settled them (all
    but the last few in L3)."""
    for i in range(0, len(keys), chain):
        assert kv.put(keys[i : i + chain], values[i : i + chain]).evicted == 0
    wait_until(lambda: kv.lookup(keys[:-L2_PAGES]).tiers.count("nvme") == len(keys) - L2_PAGES,
               "the blocks before the last L2-full in L3")


def lease_all_of_l2(stub: rpc.KVStoreStub, ns: str, keys: list[bytes]) -> str:
    """Lease L2_PAGES blocks through a raw shared-memory Get that is never released by the
    client, so that L2 has no page left to free; return the lease id."""
    assert len(keys) == L2_PAGES
    [head] = list(stub.Get(pb.GetRequest(namespace=ns, keys=keys,
                                         mode=pb.GET_MODE_SHARED_MEMORY), timeout=10))
    lease_id: str = head.lease_id
    assert all(head.found) and lease_id
    return lease_id


def test_concurrent_16_key_scans_of_l3_blocks_never_miss(pressure: Daemon, ns: str) -> None:
    # 256 blocks, 32 of which fit in L2; four readers at once ask for 16 each (64 pages):
    # shared-memory Gets over the local path, get_into, and inline Gets over gRPC. Every
    # block stays cached throughout (L3 holds them all), so every key must come back.
    keys, values = blocks(256, seed=11)
    with KVStoreClient(pressure.target, ns, shared_memory=False) as kv:
        fill(kv, keys, values)
        _, nvme_before = tiers(kv)
    wrong: list[str] = []

    def reader(n: int) -> None:
        mode = ("shm", "into", "inline")[n % 3]
        try:
            scan(mode, random.Random(n))
        except Exception as exc:  # a thread's failure fails the test, not just the thread
            wrong.append(f"{mode}: {exc!r}")

    def scan(mode: str, rng: random.Random) -> None:
        # Bytes are checked here, each against what was put; verify_checksums=False makes
        # the shared-memory Get take a lease, under which the daemon guarantees its hits.
        with KVStoreClient(pressure.target, ns, shared_memory=mode != "inline",
                           verify_checksums=mode == "inline",
                           unix_socket=str(pressure.unix_socket)) as kv:
            for _ in range(32):
                start = rng.randrange(len(keys) - 16)
                window = keys[start : start + 16]
                if mode == "into":
                    buffers = [bytearray(len(values[0])) for _ in window]
                    sizes = kv.get_into(window, buffers)
                    got = [bytes(b[:s]) if s is not None else None
                           for b, s in zip(buffers, sizes, strict=True)]
                else:
                    got = kv.get(window)
                wrong.extend(f"{mode}: key {start + j} {'missed' if v is None else 'wrong'}"
                             for j, v in enumerate(got) if v != values[start + j])
            if kv.uses_shared_memory != (mode != "inline"):
                wrong.append(f"{mode}: shared memory {kv.uses_shared_memory}")

    threads = [threading.Thread(target=reader, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    with KVStoreClient(pressure.target, ns, shared_memory=False) as kv:
        _, nvme = tiers(kv)
    assert nvme.hits - nvme_before.hits >= 1500  # of 2,048 block reads, most came from L3


def test_a_get_waits_for_room_that_a_lease_holds_and_then_hits(
    pressure: Daemon, stub: rpc.KVStoreStub, ns: str,
) -> None:
    keys, values = blocks(L2_PAGES + 8, seed=12)
    with KVStoreClient(pressure.target, ns, shared_memory=False) as kv:
        fill(kv, keys, values)
        wanted = keys[:4]  # in L3
        assert kv.lookup(wanted).tiers == ["nvme"] * 4
        lease = lease_all_of_l2(stub, ns, keys[8:])
        assert tiers(kv)[0].free_pages == 0
        # The lease ends after 1 s, longer than movers.put_wait_s (0.5 s), which the load
        # used to wait before it gave up and the block read as a miss.
        release = threading.Timer(1.0, lambda: stub.Release(pb.ReleaseRequest(ids=[lease])))
        release.start()
        try:
            assert kv.get(wanted) == values[:4]
        finally:
            release.join()


def test_a_get_that_l2_cannot_serve_before_its_deadline_misses_in_time(
    pressure: Daemon, stub: rpc.KVStoreStub, ns: str,
) -> None:
    keys, values = blocks(L2_PAGES + 8, seed=13)
    with KVStoreClient(pressure.target, ns, shared_memory=False) as kv, KVStoreClient(
            pressure.target, ns, shared_memory=False, timeout_s=1.0) as hasty:
        fill(kv, keys, values)
        wanted = keys[:4]
        lease = lease_all_of_l2(stub, ns, keys[8:])
        try:
            started = time.monotonic()
            assert hasty.get(wanted) == [None] * 4  # an answer before the 1 s deadline
            assert time.monotonic() - started < 1.0
            assert kv.lookup(wanted).tiers == ["nvme"] * 4  # still cached: only L2 was full
        finally:
            kv.release([lease])
        assert hasty.get(wanted) == values[:4]
    assert "a Get served 4 blocks cached in L3 as misses" in pressure.log()


def test_a_get_larger_than_what_pins_leave_of_l2_gets_its_prefix_at_once(
    pressure: Daemon, ns: str,
) -> None:
    keys, values = blocks(L2_PAGES + 8, seed=14)
    with KVStoreClient(pressure.target, ns, shared_memory=False) as kv:
        pinned = keys[:28]
        kv.put(pinned, values[:28])
        assert kv.pin(pinned).changed == 28  # 28 of L2's 32 pages, for good
        try:
            for i in range(28, 40, 4):  # 4 at a time: what the pins leave of L2
                kv.put(keys[i : i + 4], values[i : i + 4], independent=True)
            wait_until(lambda: kv.lookup(keys[28:36]).tiers == ["nvme"] * 8, "8 blocks in L3")
            started = time.monotonic()
            got = kv.get(keys[28:36])
            # Room for 4 only: they come, the other 4 miss at once rather than after a wait
            # for room that the pins never give back (2 s).
            assert got == [*values[28:32], None, None, None, None]
            assert time.monotonic() - started < 1.5
        finally:
            kv.unpin(pinned)


def test_a_get_larger_than_l2_gets_the_prefix_that_fits(pressure: Daemon, ns: str) -> None:
    keys, values = blocks(2 * L2_PAGES, seed=15)
    # read_table=False: the daemon's Get alone. Through the read table, the 16 blocks that
    # are in L2 are copied first and are hits as well (test_table_reads.py).
    with KVStoreClient(pressure.target, ns, shared_memory=True, verify_checksums=False,
                       unix_socket=str(pressure.unix_socket), read_table=False) as kv:
        fill(kv, keys, values)
        asked = keys[: L2_PAGES + 16]
        assert kv.get(asked) == [*values[:L2_PAGES], *[None] * 16]
