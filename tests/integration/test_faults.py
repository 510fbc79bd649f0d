"""Faults around a real daemon, each against the real thing (a kvstore-server subprocess, a
redis-server subprocess, a client subprocess): Redis killed and restarted under a serving
daemon, a client killed with leases and reservations outstanding, SIGTERM while Put and Get
streams are in flight, and SIGTERM taken by a thread other than the daemon's main one. Each
test asserts the contract: the local tiers keep serving, what a dead party held is given
back, what was acknowledged is exact, and a stop on request is clean.

Not here: kill -9 mid-burst and restart on the same L3 folder, a full filesystem, and exact
L3 re-adoption after a clean restart (test_l3_faults.py); SIGTERM with nothing in flight
(test_drain.py).
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest
import redis

from kvstore.client import KVStoreClient, Retry, Stats, TierStats
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.tiers.redis_pool import block_key
from kvstore.tools.testing import Daemon, start_redis_on
from tests.helpers import blocks, wait_until

PAGE = 64 << 10
NS = "faults"
Make = Callable[..., Daemon]
# No L1 (probing CUDA costs each start seconds), no L3 unless a test says so.
LOCAL = ("dram.page_size_bytes=64KiB", "hbm.mode=off", "nvme.enabled=false")


def tier(stats: Stats, name: str) -> TierStats:
    row = stats.tier(name)
    assert row is not None and row.enabled, f"the daemon reports no {name} tier"
    return row


def sigterm_thread(d: Daemon, tid: int) -> None:
    """SIGTERM to one thread of the daemon (tgkill(2)) rather than to the process: kill(2)
    lets the kernel hand the signal to any thread, and the daemon must act on it whichever
    thread takes it (the test at the end)."""
    tgkill = getattr(ctypes.CDLL(None, use_errno=True), "tgkill", None)
    if tgkill is None:
        pytest.skip("this libc has no tgkill (glibc >= 2.30 has)")
    if tgkill(d.proc.pid, tid, signal.SIGTERM) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"tgkill({d.proc.pid}, {tid}): {os.strerror(errno)}")


def stop_cleanly(d: Daemon) -> None:
    """SIGTERM to the daemon, as kill(1) sends it; it must exit 0."""
    d.proc.terminate()
    assert d.proc.wait(15) == 0, d.log()


@pytest.fixture
def clients() -> Iterator[Callable[..., KVStoreClient]]:
    """Clients closed at the end of the test; one attempt per call (a retry on UNAVAILABLE
    would hide the very failures these tests look for)."""
    with ExitStack() as stack:
        def connect(d: Daemon, timeout_s: float = 10.0,
                    shared_memory: bool | None = None) -> KVStoreClient:
            return stack.enter_context(KVStoreClient(
                d.target, NS, timeout_s=timeout_s, retry=Retry(attempts=1),
                shared_memory=shared_memory))
        yield connect


# --- 1. Redis killed and restarted under a serving daemon ---------------------------------


def l4(url: str) -> tuple[str, ...]:
    """An L2-only daemon writing through to Redis at url; its breaker retries after 0.2 s,
    doubling, so an outage of a second or two heals within about as long again."""
    return (*LOCAL, "dram.capacity_bytes=16MiB", f"remote.url={url}", "remote.timeout_s=1",
            "remote.breaker_backoff_s=0.2")


def in_redis(r: redis.Redis, keys: list[bytes]) -> int:
    return sum(int(r.exists(block_key(NS, k))) for k in keys)


DEADLINE_S = 2.0


def test_redis_killed_under_a_serving_daemon_never_reaches_clients_and_heals_by_itself(
    daemon_factory: Make, clients: Callable[..., KVStoreClient], tmp_path: Path,
) -> None:
    """kill -9 of redis-server while a daemon writes through to it: every put, get, lookup
    and health check keeps answering (OK, SERVING, within a 2 s deadline), before the breaker
    has opened and after; once redis-server is back on the same port the breaker closes with
    no client call to prompt it, and blocks put after that reach Redis, where a second daemon
    reads them bit-exact."""
    first = start_redis_on(tmp_path)
    redis_port = first.port
    try:
        a = daemon_factory(*l4(first.url))
        kv = clients(a, timeout_s=DEADLINE_S)
        written: dict[bytes, bytes] = dict(zip(*blocks(2), strict=True))
        assert kv.put(list(written), list(written.values()), independent=True).stored == 2
        wait_until(lambda: tier(kv.stats(), "remote")
                   .bytes_in == 2 * PAGE, "the write-through to reach Redis")
        first.proc.send_signal(signal.SIGKILL)
        assert first.proc.wait(10) == -signal.SIGKILL
    finally:
        first.stop()

    def serve_round() -> None:
        """A put, a get of everything put so far, a lookup with a miss, a health check:
        each answered without error within DEADLINE_S (the client's timeout)."""
        started = time.monotonic()
        keys, values = blocks(2)
        assert kv.put(keys, values, independent=True).stored == 2
        written.update(zip(keys, values, strict=True))
        assert kv.get(list(written)) == list(written.values())
        unknown = secrets.token_bytes(32)
        assert kv.lookup([*keys, unknown]).tiers == ["dram", "dram", None]
        assert kv.health() == "SERVING"
        assert time.monotonic() - started < DEADLINE_S

    serve_round()  # at once: the breaker is still closed, the pool's connections dead
    rounds = 1
    while tier(kv.stats(), "remote").state == "closed":
        assert rounds < 50, "the breaker never opened although Redis is gone"
        serve_round()
        rounds += 1
    serve_round()  # and with the breaker open
    down = tier(kv.stats(), "remote")
    assert down.state in ("open", "half-open")
    assert down.io_errors > 0
    queued = list(written)[2:]  # put while Redis was gone: they wait for it
    # (not while a batch is tried)
    wait_until(lambda: tier(kv.stats(), "remote").queue_depth == len(queued),
               "the blocks put meanwhile queued for Redis", timeout_s=2)

    second = start_redis_on(tmp_path, redis_port)  # back where the daemon expects it
    r = redis.Redis(port=second.port, socket_timeout=5)
    try:
        # Stats never calls Redis
        wait_until(lambda: tier(kv.stats(), "remote").state == "closed",
                   "the breaker to close by itself")
        wait_until(lambda: in_redis(r, queued) == len(queued),
                   "the queued blocks in the new Redis")
        after_keys, after_values = blocks(3)
        assert kv.put(after_keys, after_values, independent=True).stored == 3
        wait_until(lambda: in_redis(r, after_keys) == 3,
                   "the blocks put after the restart in Redis")
        assert tier(kv.stats(), "remote").state == "closed"

        b = clients(daemon_factory(*l4(second.url)))
        assert b.lookup(after_keys).tiers == ["remote"] * 3
        assert b.get(after_keys) == after_values  # verified by checksum, then compared
        row = tier(b.stats(), "remote")
        assert (row.hits, row.checksum_failures) == (3, 0)
        assert a.proc.poll() is None and kv.health() == "SERVING"
        stop_cleanly(a)  # its L4 writer, through an outage, still stops on request
    finally:
        r.close()
        second.stop()


# --- 2. a client killed while holding leases and reservations ---------------------------

LEASE_TIMEOUT_S = 1.5  # short, yet long enough to look at the leases on a loaded 2-core box
RESERVATION_TIMEOUT_S = 1.5
NUM_PAGES = 16

# Takes two shared-memory read leases and two reservations (writing junk into the first's
# pages), prints "ready" and what it got as JSON, then sleeps until it is killed.
HOLDS_AND_SLEEPS = r"""
import json, sys, time
import grpc
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc

target, ns, keys, new_keys = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
keys = [bytes.fromhex(k) for k in keys.split(",")]
new_keys = [bytes.fromhex(k) for k in new_keys.split(",")]
page = int(sys.argv[5])
stub = rpc.KVStoreStub(grpc.insecure_channel(target))
out = {"leases": [], "expires_ms": [], "read": [], "reservations": [], "reserve_ms": [],
       "first_call_at": time.monotonic()}  # CLOCK_MONOTONIC: the test's clock too
for part in (keys[:2], keys[2:]):
    (head,) = stub.Get(pb.GetRequest(namespace=ns, keys=part, mode=pb.GET_MODE_SHARED_MEMORY))
    assert list(head.found) == [True] * len(part), head
    out["leases"].append(head.lease_id)
    out["expires_ms"].append(head.lease_expires_in_ms)
    with open("/dev/shm/" + head.shm_name, "rb") as f:
        for location in head.locations:
            block = b""
            for extent in location.extents:
                f.seek(extent.offset)
                block += f.read(extent.length)
            out["read"].append(block.hex())
for part, sizes in ((new_keys[:2], [page, page]), (new_keys[2:], [page + 1])):
    reserved = stub.Reserve(pb.ReserveRequest(namespace=ns, keys=part, sizes=sizes,
                                              independent=True))
    assert list(reserved.exists) == [False] * len(part), reserved
    out["reservations"].append(reserved.reservation_id)
    out["reserve_ms"].append(reserved.expires_in_ms)
    if len(part) == 2:  # half-written pages: the client dies before committing them
        with open("/dev/shm/" + reserved.shm_name, "r+b") as f:
            for location in reserved.locations:
                for extent in location.extents:
                    f.seek(extent.offset)
                    f.write(b"\xee" * extent.length)
print("ready", json.dumps(out), flush=True)
time.sleep(120)
"""


def test_a_client_killed_holding_leases_and_reservations_gives_everything_back(
    daemon_factory: Make, clients: Callable[..., KVStoreClient],
) -> None:
    """A client process takes two shared-memory read leases (three blocks) and two
    reservations (four pages, half of them written), then is killed with SIGKILL: the
    daemon still counts its leases and reservations and the leased blocks resist eviction;
    after leases.lease_timeout_s / leases.reservation_timeout_s the sweeper drops them all,
    the free L2 pages are what they were before the client came, the reserved keys were
    never stored, and the blocks it read are still there, bit-exact, and evictable."""
    d = daemon_factory(*LOCAL, "dram.capacity_bytes=1MiB",
                       f"leases.lease_timeout_s={LEASE_TIMEOUT_S}",
                       f"leases.reservation_timeout_s={RESERVATION_TIMEOUT_S}",
                       "leases.sweep_interval_s=0.1")
    kv = clients(d, shared_memory=False)
    keys, values = blocks(3)
    assert kv.put(keys, values, independent=True).stored == 3
    new_keys = [secrets.token_bytes(32) for _ in range(3)]
    before = kv.stats()
    assert (before.leases, before.reservations) == (0, 0)
    free_before = tier(before, "dram").free_pages
    assert free_before == NUM_PAGES - 3

    child = subprocess.Popen(
        [sys.executable, "-c", HOLDS_AND_SLEEPS, d.target, NS, ",".join(k.hex() for k in keys),
         ",".join(k.hex() for k in new_keys), str(PAGE)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stderr is not None
        line = child.stdout.readline()  # "" when it died instead
        assert line.startswith("ready "), f"the client failed:\n{line}{child.stderr.read()}"
        child.send_signal(signal.SIGKILL)
        assert child.wait(10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    held = json.loads(line.removeprefix("ready "))
    started: float = held["first_call_at"]  # before any lease or reservation existed
    assert held["expires_ms"] == [int(LEASE_TIMEOUT_S * 1000)] * 2
    assert held["reserve_ms"] == [int(RESERVATION_TIMEOUT_S * 1000)] * 2
    assert [bytes.fromhex(h) for h in held["read"]] == values  # real leases on real bytes

    orphaned = kv.stats()
    assert (orphaned.leases, orphaned.reservations) == (2, 2)
    assert tier(orphaned, "dram").free_pages == free_before - 4  # 1 + 1 + 2 pages reserved
    result = kv.evict(keys)
    assert (result.evicted, result.skipped) == (0, 3)  # the dead client's leases hold them
    observed_s = time.monotonic() - started
    assert observed_s < min(LEASE_TIMEOUT_S, RESERVATION_TIMEOUT_S), "too slow to observe"

    def all_expired() -> bool:
        stats = kv.stats()
        return (stats.leases, stats.reservations) == (0, 0)

    gone = wait_until(all_expired, "the orphaned leases and reservations to expire")
    assert gone - started >= min(LEASE_TIMEOUT_S, RESERVATION_TIMEOUT_S)  # expired, not dropped
    after = kv.stats()
    assert tier(after, "dram").free_pages == free_before
    assert kv.lookup(new_keys).tiers == [None] * 3  # junk in reserved pages never committed
    assert kv.get(new_keys) == [None] * 3
    assert kv.get(keys) == values
    result = kv.evict(keys)
    assert (result.evicted, result.skipped) == (3, 0)
    assert tier(kv.stats(), "dram").free_pages == NUM_PAGES
    stop_cleanly(d)


# --- 3. SIGTERM while streams are in flight -----------------------------------------------

GRACE_S = 10.0
NOTICE_S = 1.0  # long enough to find a refused call in on a loaded box
BLOCK = 8 << 20
CHUNK = 256 << 10  # the daemon's server.chunk_bytes too: under a raw channel's 4 MiB limit
LEAD_CHUNKS = 4  # sent (or read) before the signal; the rest after it, slowly
PAUSE_S = 0.06  # 28 remaining chunks x 0.06 s: each stream outlives the drain notice


def test_sigterm_lets_put_and_get_streams_in_flight_finish_then_exits_zero(
    daemon_factory: Make, clients: Callable[..., KVStoreClient],
) -> None:
    """SIGTERM while an inline Put is being sent and an inline Get is being read, both
    slowly and past the end of the drain notice: a new data call gets UNAVAILABLE (naming
    the drain), the Put is acknowledged as stored, the Get returns every byte bit-exact,
    and the daemon exits 0 within server.grace_s."""
    d = daemon_factory(*LOCAL, "dram.capacity_bytes=32MiB", f"server.chunk_bytes={CHUNK}",
                       f"server.grace_s={GRACE_S}", f"server.drain_notice_s={NOTICE_S}")
    get_key, put_key = secrets.token_bytes(32), secrets.token_bytes(32)
    get_value, put_value = os.urandom(BLOCK), os.urandom(BLOCK)
    assert clients(d).put([get_key], [get_value]).stored == 1

    signalled = threading.Event()
    put_started, get_started = threading.Event(), threading.Event()
    put_out: list[pb.PutResponse] = []
    got: list[bytes] = []
    errors: list[BaseException] = []
    finished: dict[str, float] = {}

    def slow_put_frames() -> Iterator[pb.PutRequest]:
        yield pb.PutRequest(namespace=NS, keys=[put_key], sizes=[BLOCK], independent=True)
        for i in range(0, BLOCK, CHUNK):
            if i == LEAD_CHUNKS * CHUNK:
                put_started.set()
                signalled.wait(10)
            if i >= LEAD_CHUNKS * CHUNK:
                time.sleep(PAUSE_S)
            yield pb.PutRequest(data=put_value[i : i + CHUNK])

    def put(stub: rpc.KVStoreStub) -> None:
        try:
            put_out.append(stub.Put(slow_put_frames(), timeout=30))
            finished["put"] = time.monotonic()
        except BaseException as exc:
            errors.append(exc)
            put_started.set()

    def get(stub: rpc.KVStoreStub) -> None:
        try:
            stream = stub.Get(pb.GetRequest(namespace=NS, keys=[get_key]), timeout=30)
            head = next(stream)
            assert list(head.found) == [True] and list(head.sizes) == [BLOCK]
            for _ in range(LEAD_CHUNKS):
                got.append(next(stream).data)
            get_started.set()
            signalled.wait(10)
            for message in stream:
                time.sleep(PAUSE_S)
                got.append(message.data)
            finished["get"] = time.monotonic()
        except BaseException as exc:
            errors.append(exc)
            get_started.set()

    with grpc.insecure_channel(d.target) as channel:
        stub = rpc.KVStoreStub(channel)
        threads = [threading.Thread(target=put, args=(stub,), daemon=True),
                   threading.Thread(target=get, args=(stub,), daemon=True)]
        for t in threads:
            t.start()
        assert put_started.wait(10) and get_started.wait(10)
        assert not errors, errors
        d.proc.terminate()
        signalled_at = time.monotonic()
        signalled.set()

        def refused() -> bool:  # the handler may not have run yet: the first calls pass
            try:
                stub.Lookup(pb.LookupRequest(namespace=NS, keys=[get_key]), timeout=1)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                assert "draining" in (exc.details() or ""), exc.details()
                return True
            return False

        wait_until(refused, "a new Lookup to be refused", timeout_s=NOTICE_S + 2)
        new_key, new_value = blocks(1)
        with pytest.raises(grpc.RpcError) as new_put:
            stub.Put(iter([pb.PutRequest(namespace=NS, keys=new_key, sizes=[PAGE],
                                         data=new_value[0])]), timeout=2)
        assert new_put.value.code() == grpc.StatusCode.UNAVAILABLE

        for t in threads:
            t.join(20)
        assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a stream never finished"
    (response,) = put_out
    assert (response.stored, response.existing) == (1, 0)
    assert b"".join(got) == get_value
    # Both streams outlived the notice: they ran on after the server stopped taking calls.
    assert min(finished.values()) > signalled_at + NOTICE_S

    assert d.proc.wait(GRACE_S + 5) == 0, d.log()
    assert time.monotonic() - signalled_at < GRACE_S, "exited within server.grace_s"
    assert "Traceback" not in d.log(), d.log()


# --- 4. SIGTERM taken by a thread other than the main one ---------------------------------


def test_sigterm_taken_by_any_daemon_thread_starts_the_drain(daemon_factory: Make) -> None:
    """kill(2) of a process may deliver SIGTERM to any of its threads that does not block
    it; here it is aimed at one of the daemon's other threads (a gRPC or RPC worker thread),
    the way the kernel delivered it in the runs that hung. The daemon must still drain and
    exit 0."""
    d = daemon_factory(*LOCAL, "dram.capacity_bytes=8MiB")
    others = sorted(int(t) for t in os.listdir(f"/proc/{d.proc.pid}/task")
                    if int(t) != d.proc.pid)
    assert others, "the daemon runs no thread besides its main one"
    sigterm_thread(d, others[0])
    try:
        wait_until(lambda: "shutting down" in d.log(), "the daemon to start draining",
                   timeout_s=3)
        assert d.proc.wait(GRACE_S) == 0, d.log()
    finally:
        if d.proc.poll() is None:  # it ignored the signal: stop it, not leak it
            stop_cleanly(d)
