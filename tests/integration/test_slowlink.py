"""kvstore.tools.slowlink.SlowLink between real clients and a real redis-server: every round
trip through it costs its delay (once per burst, not once per reply), a new delay takes effect
at once, stop() closes the clients' connections; and a daemon whose L4 goes through it counts
the delay in its remote tier's read time. No fakes: a redis-server subprocess and real daemons.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from kvstore.client import KVStoreClient
from kvstore.client.results import TierStats
from kvstore.tools.slowlink import SlowLink
from kvstore.tools.testing import RedisServer, start_daemon, start_redis_on
from tests import helpers
from tests.helpers import PAGE, wait_until
from tests.integration.test_remote import remote

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="needs redis-server (`make redis` installs it)")

DELAY_S = 0.05
SLACK_S = 0.2  # scheduling on a loaded 2-core machine; a per-reply delay would be far more
NS = "slowlink-ns"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    s = start_redis_on(tmp_path)
    yield s
    s.stop()


@pytest.fixture
def link(server: RedisServer) -> Iterator[SlowLink]:
    with SlowLink("127.0.0.1", server.port, DELAY_S) as proxy:
        yield proxy


@pytest.fixture
def r(link: SlowLink) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(link.url, socket_timeout=5)
    yield client
    client.close()


def timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def test_each_round_trip_costs_the_delay(link: SlowLink, r: redis.Redis) -> None:
    assert link.url == f"redis://127.0.0.1:{link.port}"
    assert r.ping()  # connects; the first PING also pays the delay
    for call in (r.ping, lambda: r.set(b"k", b"v"), lambda: r.get(b"k")):
        assert DELAY_S <= timed(call) < DELAY_S + SLACK_S
    assert r.get(b"k") == b"v"


def test_a_pipelined_burst_costs_one_delay_not_fifty(link: SlowLink, r: redis.Redis) -> None:
    r.mset({f"k{i}".encode(): os.urandom(1024) for i in range(50)})
    pipe = r.pipeline(transaction=False)
    for i in range(50):
        pipe.get(f"k{i}".encode())
    replies: list[object] = []
    elapsed_s = timed(lambda: replies.extend(pipe.execute()))
    assert len(replies) == 50 and all(isinstance(v, bytes) and len(v) == 1024 for v in replies)
    assert DELAY_S <= elapsed_s < DELAY_S + SLACK_S  # 50 delays would be 2.5 s


def test_a_big_reply_in_many_chunks_costs_one_delay(link: SlowLink, r: redis.Redis) -> None:
    value = os.urandom(8 << 20)  # > 100 chunks of the proxy's reads
    r.set(b"big", value)
    got: list[object] = []
    elapsed_s = timed(lambda: got.append(r.get(b"big")))
    assert got == [value]  # every chunk arrived, in order
    assert DELAY_S <= elapsed_s < DELAY_S + SLACK_S + 0.3  # moving 8 MiB takes a little


def test_setting_the_delay_to_zero_speeds_the_link_up(link: SlowLink, r: redis.Redis) -> None:
    r.ping()
    assert timed(r.ping) >= DELAY_S
    link.delay_s = 0.0
    fast_s = min(timed(r.ping) for _ in range(5))
    assert fast_s < DELAY_S / 2
    link.delay_s = 2 * DELAY_S  # and slower again, on the same connection
    assert timed(r.ping) >= 2 * DELAY_S


def test_a_shorter_delay_reaches_a_reply_already_waiting(link: SlowLink,
                                                         r: redis.Redis) -> None:
    r.ping()
    link.delay_s = 5.0
    started = time.perf_counter()
    done = threading.Event()

    def execute() -> None:
        r.ping()
        done.set()

    threading.Thread(target=execute, daemon=True).start()
    time.sleep(0.2)
    assert not done.is_set()  # held by the 5 s delay
    link.delay_s = 0.0
    assert done.wait(2.0)
    assert time.perf_counter() - started < 1.5


def test_stop_closes_the_clients_connections(server: RedisServer) -> None:
    link = SlowLink("127.0.0.1", server.port, DELAY_S).start()
    r = redis.Redis.from_url(link.url, socket_timeout=5, retry_on_timeout=False)
    try:
        r.set(b"k", b"v")
        assert link.connections == 1
        link.stop()
        link.stop()  # idempotent
        assert link.connections == 0
        with pytest.raises(redis.ConnectionError):
            r.get(b"k")  # its connection was closed, and the listener is gone too
    finally:
        r.close()
    direct = redis.Redis(port=server.port, socket_timeout=5)
    assert direct.get(b"k") == b"v"  # Redis itself is untouched
    direct.close()


def test_an_upstream_that_is_down_closes_the_client(tmp_path: Path) -> None:
    down = start_redis_on(tmp_path)
    down.stop()
    with SlowLink("127.0.0.1", down.port, DELAY_S) as link:
        r = redis.Redis.from_url(link.url, socket_timeout=5)
        with pytest.raises(redis.ConnectionError):
            r.ping()
        r.close()


def test_a_negative_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="delay_s must be >= 0"):
        SlowLink("127.0.0.1", 1, -0.1)
    link = SlowLink("127.0.0.1", 1, 0.0)
    with pytest.raises(ValueError, match="delay_s must be >= 0"):
        link.delay_s = -1.0
    with pytest.raises(RuntimeError, match="not started"):
        _ = link.url


# --- a daemon whose L4 is behind the link -----------------------------------------------------


def drain_l4(kv: KVStoreClient, written_bytes: int, timeout_s: float = 15.0) -> None:
    """Wait until written_bytes reached Redis. queue_depth == 0 alone is not enough: the
    writer takes a batch off the queue before its SETs return, and through a slow link that
    batch is in flight for a whole delay while queue_depth already reads 0."""
    def drained() -> bool:
        row = remote(kv)
        return row.queue_depth == 0 and row.bytes_in >= written_bytes

    wait_until(drained, "the L4 write-through to drain", timeout_s)


Blocks = tuple[list[bytes], list[bytes]]


@dataclass
class L4Reader:
    """A daemon whose L4 is behind a SlowLink, and two sets of blocks only L4 holds: a first
    daemon wrote them through the link and is gone; this one has nothing local."""

    kv: KVStoreClient
    link: SlowLink
    blocks: list[Blocks]


@pytest.fixture(scope="module")
def l4_reader(tmp_path_factory: pytest.TempPathFactory) -> Iterator[L4Reader]:
    """Module-wide, so its two daemons start once (seconds each); each test reads its own
    blocks, which stay in L4 alone until then."""
    workdir = tmp_path_factory.mktemp("slowlink-daemons")
    server = start_redis_on(workdir)
    with ExitStack() as stack:
        stack.callback(server.stop)
        link = stack.enter_context(SlowLink("127.0.0.1", server.port, DELAY_S))
        settings = ("hbm.mode=off", "nvme.enabled=false", "dram.capacity_bytes=32MiB",
                    "dram.page_size_bytes=64KiB", f"remote.url={link.url}",
                    "remote.timeout_s=2")
        blocks = [helpers.blocks(4), helpers.blocks(4)]
        writer = start_daemon(workdir, *settings)
        try:
            with KVStoreClient(writer.target, NS, timeout_s=10) as kv:
                for keys, values in blocks:
                    assert kv.put(keys, values, independent=True).stored == 4
                drain_l4(kv, 8 * PAGE)
        finally:
            writer.stop()
        direct = stack.enter_context(redis.Redis(port=server.port, socket_timeout=5))
        assert len(direct.keys(b"kvs:v1:*")) == 8  # they went through the link to Redis
        reader = start_daemon(workdir, *settings)
        stack.callback(reader.stop)
        kv2 = stack.enter_context(KVStoreClient(reader.target, NS, timeout_s=10))
        yield L4Reader(kv2, link, blocks)


def read_all(kv: KVStoreClient, blocks: Blocks) -> tuple[TierStats, TierStats, float]:
    """The L4 row before and after a get of every key (checked), and the get's wall time."""
    keys, values = blocks
    assert kv.lookup(keys).tiers == ["remote"] * len(keys)
    before = remote(kv)
    got: list[bytes | None] = []
    elapsed_s = timed(lambda: got.extend(kv.get(keys)))
    assert got == values
    return before, remote(kv), elapsed_s


def test_a_daemon_reading_l4_through_the_link_waits_the_delay(l4_reader: L4Reader) -> None:
    before, after, elapsed_s = read_all(l4_reader.kv, l4_reader.blocks[0])
    assert after.hits - before.hits == 4  # every block came from L4, through the link
    assert elapsed_s >= DELAY_S


def test_a_daemon_reading_l4_through_the_link_counts_the_delay_in_read_seconds(
    l4_reader: L4Reader,
) -> None:
    before, after, _ = read_all(l4_reader.kv, l4_reader.blocks[1])
    assert after.hits - before.hits == 4
    assert after.read_seconds - before.read_seconds >= DELAY_S
