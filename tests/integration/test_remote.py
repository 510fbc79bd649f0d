"""L4 through real daemons and real redis-server processes: blocks written through by one
daemon are found, fetched and verified by another (standalone Redis, a 3-node Redis Cluster,
TLS, a password); popularity drives pre-warming; a Redis outage, a hung Redis and a damaged
block never stop the local tiers. No fakes: every Redis here is a redis-server subprocess.

Tests that neither stop, hang nor pre-warm from their Redis share one: the module's `pool`,
written through by the session's daemon A and read by its daemon B, each test in a namespace
of its own and reading the daemons' counters as deltas. Pre-warming pulls the hottest blocks
of every namespace, so its tests keep a Redis of their own."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path

import pytest
import redis

from kvstore.client import (
    AsyncKVStoreClient,
    FailedPrecondition,
    HotResult,
    KVStoreClient,
    PrewarmResult,
    Unavailable,
)
from kvstore.client.results import TierStats
from kvstore.daemon.blockframe import CODEC_RAW, HEADER_BYTES, decode
from kvstore.daemon.remote import AUTO_SKIP_BLOCKS, RUN_BYTES
from kvstore.tiers.redis_pool import block_key
from kvstore.tools.slowlink import SlowLink
from kvstore.tools.testing import (
    Daemon,
    RedisServer,
    start_redis_cluster,
    start_redis_on,
    start_redis_tls,
    start_redis_with_password,
)
from tests.conftest import REPO
from tests.helpers import PAGE, blocks, keys, metric, sized_blocks, wait_until

WAIT_S = 15.0  # for L4: a write-through queue, a breaker, a census on a busy machine
# Small local tiers, no L1; each daemon keeps its L3 in its own folder (start_daemon).
LOCAL = ("dram.capacity_bytes=32MiB", "dram.page_size_bytes=64KiB", "hbm.mode=off",
         "nvme.capacity_bytes=16MiB", "nvme.page_size_bytes=64KiB")
Make = Callable[..., Daemon]


def l4(url: str, *settings: str) -> tuple[str, ...]:
    """LOCAL plus an L4 pool at url that fails over and comes back quickly."""
    return (*LOCAL, f"remote.url={url}", "remote.breaker_backoff_s=0.2",
            "remote.timeout_s=1", *settings)


def remote(kv: KVStoreClient) -> TierStats:
    row = kv.stats().tier("remote")
    assert row is not None and row.enabled, "the daemon reports no L4"
    return row


def in_redis(r: redis.Redis | redis.RedisCluster, keys: Sequence[bytes], ns: str) -> int:
    """How many of the blocks Redis holds (one EXISTS per key: keys span cluster slots)."""
    return sum(int(r.exists(block_key(ns, k))) for k in keys)


def raw(server: RedisServer, password: str = "") -> redis.Redis:
    return redis.Redis(port=server.port, password=password or None, socket_timeout=5)


@pytest.fixture
def clients(ns: str) -> Iterator[Callable[[Daemon], KVStoreClient]]:
    """Clients of the test's namespace, closed when it ends."""
    with ExitStack() as stack:
        def connect(d: Daemon) -> KVStoreClient:
            return stack.enter_context(KVStoreClient(d.target, ns, timeout_s=10))
        yield connect


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The Redis the session's daemons A and B share: no test stops or hangs it."""
    s = start_redis_on(tmp_path_factory.mktemp("pool"))
    yield s
    s.stop()


@pytest.fixture
def pool_r(pool: RedisServer) -> Iterator[redis.Redis]:
    client = raw(pool)
    yield client
    client.close()


@pytest.fixture
def a(shared_daemon: Make, pool: RedisServer) -> Daemon:
    """The daemon that writes through to the pool, flushing popularity every 0.1 s and giving
    its blocks there a TTL of 60 s."""
    return shared_daemon(*l4(pool.url, "remote.popularity_flush_s=0.1", "remote.ttl_s=60"))


@pytest.fixture
def b(shared_daemon: Make, pool: RedisServer) -> Daemon:
    """The daemon that reads what A wrote: it never puts a block itself."""
    return shared_daemon(*l4(pool.url))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    s = start_redis_on(tmp_path)
    yield s
    s.stop()


@pytest.fixture
def r(server: RedisServer) -> Iterator[redis.Redis]:
    client = raw(server)
    yield client
    client.close()


def test_a_block_written_through_by_one_daemon_is_read_by_another(
    a: Daemon, b: Daemon, clients: Callable[[Daemon], KVStoreClient], pool_r: redis.Redis,
    ns: str,
) -> None:
    ka, kb = clients(a), clients(b)
    was_a, was_b = remote(ka), remote(kb)
    keys, values = blocks(6)
    assert ka.put(keys, values).stored == 6
    wait_until(lambda: in_redis(pool_r, keys, ns) == 6, "the chain in Redis", WAIT_S)
    wait_until(lambda: remote(ka).bytes_in - was_a.bytes_in == 6 * PAGE, "A's L4 bytes_in",
               WAIT_S)
    assert remote(ka).state == "closed"

    found = kb.lookup(keys)
    assert found.tiers == ["remote"] * 6 and found.prefix_length == 6
    assert kb.get(keys) == values  # fetched, verified, imported into B's L2
    assert kb.lookup(keys).tiers == ["dram"] * 6
    row = remote(kb)
    assert (row.hits - was_b.hits, row.misses - was_b.misses,
            row.checksum_failures - was_b.checksum_failures) == (6, 0, 0)
    assert row.bytes_out - was_b.bytes_out == 6 * PAGE

    # Prefetch is the other way in: it brings L4 blocks into L2 before anyone reads them.
    keys2, values2 = blocks(4)
    ka.put(keys2, values2)
    wait_until(lambda: in_redis(pool_r, keys2, ns) == 4, "the second chain in Redis", WAIT_S)
    assert kb.lookup(keys2).tiers == ["remote"] * 4
    progress = kb.prefetch(keys2, tier="dram")
    assert (progress.done, progress.missing, progress.failed) == (4, 0, 0)
    assert kb.lookup(keys2).tiers == ["dram"] * 4
    assert remote(kb).hits - was_b.hits == 10
    assert kb.get(keys2) == values2
    assert remote(kb).hits - was_b.hits == 10  # the get was served from L2


def test_the_same_flow_over_a_redis_cluster_spreads_blocks_over_every_node(
    daemon_factory: Make, clients: Callable[[Daemon], KVStoreClient], tmp_path: Path, ns: str,
) -> None:
    cluster = start_redis_cluster(tmp_path, nodes=3)
    rc = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0], socket_timeout=5)
    nodes = [redis.Redis(port=p, socket_timeout=5) for p in cluster.ports]
    try:
        a = clients(daemon_factory(*l4(cluster.url, "remote.cluster=true")))
        b = clients(daemon_factory(*l4(cluster.url, "remote.cluster=true")))
        keys, values = blocks(24)
        a.put(keys, values)
        wait_until(lambda: in_redis(rc, keys, ns) == 24, "the chain in the cluster", WAIT_S)
        assert remote(a).backend == "redis-cluster"
        per_node = [len(node.keys(b"kvs:v1:*")) for node in nodes]
        assert sum(per_node) == 24 and all(n > 0 for n in per_node), per_node

        assert b.lookup(keys).tiers == ["remote"] * 24
        assert b.get(keys) == values
        assert b.lookup(keys).tiers == ["dram"] * 24
        assert remote(b).hits == 24
    finally:
        rc.close()
        for node in nodes:
            node.close()
        cluster.stop()


def test_prewarm_pulls_the_hottest_blocks_before_serving(
    daemon_factory: Make, clients: Callable[[Daemon], KVStoreClient], server: RedisServer,
    r: redis.Redis, ns: str,
) -> None:
    a = clients(daemon_factory(*l4(server.url, "remote.popularity_flush_s=0.1")))
    keys, values = blocks(8)
    a.put(keys, values, independent=True)
    wait_until(lambda: in_redis(r, keys, ns) == 8, "the blocks in Redis", WAIT_S)
    for _ in range(3):
        assert a.get(keys) == values
    wait_until(lambda: set(keys) <= set(a.hot(100).keys), "the read keys among A's hot()",
               WAIT_S)

    # C is SERVING only once pre-warm is done: its very first lookup finds everything local.
    c = daemon_factory(*l4(server.url, "remote.prewarm_bytes=8MiB"))
    kc = clients(c)
    assert kc.lookup(keys).tiers == ["dram"] * 8
    before = remote(kc)
    assert before.hits == 8
    assert kc.get(keys) == values
    after = remote(kc)
    assert (after.hits, after.misses) == (before.hits, before.misses)  # no Redis reads
    assert "pre-warm" in c.log()
    warmed = kc.stats().prewarm  # its progress stays in stats
    assert warmed is not None and warmed.done and (warmed.blocks, warmed.bytes) == (8, 8 * PAGE)

    # On a running daemon: the Prewarm RPC, then (after evicting) kvstore-admin prewarm. One
    # started without remote.prewarm_bytes shows no pre-warm in stats until asked for one.
    d = daemon_factory(*l4(server.url))
    kd = clients(d)
    assert kd.stats().prewarm is None
    assert kd.lookup(keys).tiers == ["remote"] * 8
    done = kd.prewarm(64 << 20)
    assert done.done and done.blocks == 8 and done.bytes == 8 * PAGE
    assert kd.lookup(keys).tiers == ["dram"] * 8
    assert kd.evict(all=True).evicted == 8
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.tools.admin", "--target", d.target, "prewarm",
         "--bytes", "64MiB"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "prewarmed 8 blocks" in out.stdout, out.stdout
    assert kd.lookup(keys).tiers == ["dram"] * 8


def test_prewarm_brings_every_hit_of_mixed_sizes_and_passes_over_a_missing_one(
    daemon_factory: Make, clients: Callable[[Daemon], KVStoreClient], server: RedisServer,
    r: redis.Redis, ns: str,
) -> None:
    """Pre-warm fetches in runs of about RUN_BYTES (the first one block) while it imports the
    run before: blocks from 16 KiB to 512 KiB, several runs' worth, all arrive whole, and a
    block gone from Redis in the middle is only a miss."""
    sizes = [16 << 10, 512 << 10, 64 << 10, 300 << 10, 200 << 10] * 6
    assert sum(sizes) > 4 * RUN_BYTES
    chain, values = sized_blocks(sizes)
    a = clients(daemon_factory(*l4(server.url, "remote.popularity_flush_s=0.1")))
    a.put(chain, values, independent=True)
    wait_until(lambda: in_redis(r, chain, ns) == len(chain), "the blocks in Redis", WAIT_S)
    assert a.get(chain) == values
    wait_until(lambda: set(chain) <= set(a.hot(100).keys), "every key in hot()", WAIT_S)
    gone = len(chain) // 2
    assert r.delete(block_key(ns, chain[gone])) == 1

    kd = clients(daemon_factory(*l4(server.url)))
    done = kd.prewarm(64 << 20)
    assert done.done and done.blocks == len(chain) - 1
    assert done.bytes == sum(sizes) - sizes[gone]
    expected: list[str | None] = ["dram"] * len(chain)
    expected[gone] = None
    assert kd.lookup(chain).tiers == expected
    before = remote(kd)
    here = [k for i, k in enumerate(chain) if i != gone]
    assert kd.get(here) == [v for i, v in enumerate(values) if i != gone]
    assert remote(kd).hits == before.hits  # every one from L2: pre-warm brought it whole


def test_redis_lost_mid_prewarm_keeps_the_runs_that_arrived(
    daemon_factory: Make, clients: Callable[[Daemon], KVStoreClient], server: RedisServer,
    r: redis.Redis, ns: str,
) -> None:
    """Pre-warm through a link that holds every reply 0.3 s: once the first run (one block)
    has come, the link goes down while the next run is on its way. The pre-warm still ends
    (the breaker turns the rest into misses), and every block it reports is in L2, whole."""
    chain, values = blocks(30)
    a = clients(daemon_factory(*l4(server.url, "remote.popularity_flush_s=0.1")))
    a.put(chain, values, independent=True)
    wait_until(lambda: in_redis(r, chain, ns) == len(chain), "the blocks in Redis", WAIT_S)
    assert a.get(chain) == values
    wait_until(lambda: set(chain) <= set(a.hot(100).keys), "every key in hot()", WAIT_S)

    with SlowLink("127.0.0.1", server.port, 0.3) as link:
        d = daemon_factory(*l4(link.url))
        kd, watcher = clients(d), clients(d)
        ended: list[PrewarmResult] = []
        prewarm = threading.Thread(target=lambda: ended.append(kd.prewarm(64 << 20)))
        prewarm.start()
        wait_until(lambda: remote(watcher).hits >= 1, "the first run fetched", WAIT_S)
        link.stop()
        prewarm.join(WAIT_S)
    assert len(ended) == 1 and ended[0].done
    assert 1 <= ended[0].blocks < len(chain) and ended[0].bytes == ended[0].blocks * PAGE
    tiers = kd.lookup(chain).tiers
    here = [i for i, tier in enumerate(tiers) if tier == "dram"]
    assert len(here) == ended[0].blocks and set(tiers) <= {"dram", None}
    assert kd.get([chain[i] for i in here]) == [values[i] for i in here]
    assert kd.health() == "SERVING"


def test_a_daemon_told_to_prewarm_with_redis_down_serves_cold(
    daemon_factory: Make, clients: Callable[[Daemon], KVStoreClient], server: RedisServer,
) -> None:
    server.stop()
    d = daemon_factory(*l4(server.url, "remote.prewarm_bytes=8MiB"))
    kv = clients(d)
    assert kv.health() == "SERVING"
    keys, values = blocks(2)
    assert kv.put(keys, values).stored == 2 and kv.get(keys) == values
    assert "pre-warm skipped, serving cold" in d.log()


def test_a_redis_outage_leaves_the_local_tiers_serving_and_heals(
    daemon_factory: Make, clients: Callable[[Daemon], KVStoreClient], tmp_path: Path, ns: str,
) -> None:
    first = start_redis_on(tmp_path)
    port = first.port
    d = daemon_factory(*l4(first.url))
    kv = clients(d)
    keys1, values1 = blocks(4)
    kv.put(keys1, values1)
    r1 = raw(first)
    wait_until(lambda: in_redis(r1, keys1, ns) == 4, "the first chain in Redis", WAIT_S)
    r1.close()
    first.stop()

    keys2, values2 = blocks(4)  # queued for L4 while Redis is down
    assert kv.put(keys2, values2).stored == 4
    wait_until(lambda: remote(kv).state == "open", "the breaker to open", WAIT_S)
    assert remote(kv).io_errors > 0
    assert kv.health() == "SERVING"
    assert kv.get(keys1) == values1 and kv.get(keys2) == values2
    started = time.monotonic()
    unknown = secrets.token_bytes(32)
    found = kv.lookup([*keys1, *keys2, unknown])
    assert found.tiers == ["dram"] * 8 + [None] and found.prefix_length == 8
    assert time.monotonic() - started < 1.0  # the breaker answers, not a Redis timeout
    # The operator verbs about L4 itself say they could not, instead of an empty answer.
    with pytest.raises(Unavailable, match="hot: L4 is down"):
        kv.hot()
    with pytest.raises(Unavailable, match="L4 is down"):
        kv.prewarm()

    second = start_redis_on(tmp_path, port)  # Redis back where the daemon expects it
    try:
        r2 = raw(second)
        wait_until(lambda: in_redis(r2, keys2, ns) == 4, "the queued chain in the new Redis",
                   WAIT_S)
        wait_until(lambda: remote(kv).state == "closed", "the breaker to close", WAIT_S)
        assert remote(kv).queue_depth == 0
        assert kv.health() == "SERVING"
        r2.close()
    finally:
        second.stop()


def test_a_set_that_times_out_mid_batch_releases_its_blocks_and_keeps_the_batch(
    daemon_factory: Make, clients: Callable[[Daemon], KVStoreClient], server: RedisServer,
    r: redis.Redis, ns: str,
) -> None:
    """The write-through sends a raw frame from the block's L2 pages, so it holds the block
    until its SET returns. Redis answering EXISTS but not SET (CLIENT PAUSE WRITE) fails the
    batch mid-way after remote.timeout_s: the blocks must be released then (an evict takes
    them, none is left busy), the breaker opens, and the rest of the batch reaches Redis,
    byte for byte, once Redis takes writes again."""
    kv = clients(daemon_factory(*l4(server.url, "remote.breaker_backoff_s=4")))
    keys, values = blocks(4)
    r.client_pause(2500, all=False)  # CLIENT PAUSE 2500 WRITE: longer than timeout_s=1
    assert kv.put(keys, values, independent=True).stored == 4
    wait_until(lambda: remote(kv).state == "open", "the SET to time out", WAIT_S)
    assert remote(kv).io_errors > 0 and kv.health() == "SERVING"
    evicted = 0

    def evict_two() -> bool:  # the breaker holds the writer off for 4 s: no retry holds them
        nonlocal evicted
        evicted += int(kv.evict(keys[2:]).evicted)
        return evicted == 2

    wait_until(evict_two, "the two blocks of the failed batch evicted", timeout_s=2.0)
    assert kv.get(keys[:2]) == values[:2]
    wait_until(lambda: in_redis(r, keys[:2], ns) == 2, "the kept blocks in Redis", WAIT_S)
    frames = [r.get(block_key(ns, k)) for k in keys[:2]]
    assert [decode(f) for f in frames if isinstance(f, bytes)] == values[:2]
    wait_until(lambda: remote(kv).queue_depth == 0, "the queue drained", WAIT_S)
    assert remote(kv).state == "closed"


def test_the_l4_row_counts_the_whole_pool_every_daemons_blocks(
    a: Daemon, b: Daemon, clients: Callable[[Daemon], KVStoreClient], pool_r: redis.Redis,
    ns: str,
) -> None:
    ka, kb = clients(a), clients(b)
    keys, values = blocks(5)
    assert ka.put(keys, values).stored == 5
    wait_until(lambda: in_redis(pool_r, keys, ns) == 5, "the chain in Redis", WAIT_S)
    pool_r.set(b"someone-elses-key", b"x")  # the same Redis may hold keys that are not blocks
    try:
        # B writes no block, ever: its L4 row still counts the pool's blocks, every daemon's
        # (these 5 and what earlier tests left), and nothing else.
        def pool_blocks() -> int:
            return sum(1 for _ in pool_r.scan_iter(match=b"kvs:v1:*"))

        wait_until(lambda: remote(kb).objects == pool_blocks() >= 5, "B's count of the pool",
                   timeout_s=20)
    finally:
        pool_r.delete(b"someone-elses-key")
    row = remote(kb)
    assert row.used_bytes >= 5 * PAGE  # Redis's used_memory: the frames and its own
    assert row.capacity_bytes == 0  # no maxmemory set: no limit


def test_queue_depth_counts_the_blocks_waiting_for_redis(
    daemon_factory: Make, clients: Callable[[Daemon], KVStoreClient], server: RedisServer,
) -> None:
    kv = clients(daemon_factory(*l4(server.url)))
    server.stop()
    kv.put(*blocks(4))
    wait_until(lambda: remote(kv).state == "open", "the breaker to open", WAIT_S)
    wait_until(lambda: remote(kv).queue_depth == 4, "4 blocks queued", timeout_s=2.0)


def test_a_damaged_block_in_redis_is_a_miss_and_is_deleted(
    a: Daemon, b: Daemon, clients: Callable[[Daemon], KVStoreClient], pool_r: redis.Redis,
    ns: str,
) -> None:
    ka, kb = clients(a), clients(b)
    was = remote(kb)
    keys, values = blocks(1)
    ka.put(keys, values)
    wait_until(lambda: in_redis(pool_r, keys, ns) == 1, "the block in Redis", WAIT_S)
    pool_r.set(block_key(ns, keys[0]), os.urandom(PAGE + 64))  # garbage where the frame was

    assert kb.lookup(keys).tiers == ["remote"]
    assert kb.get(keys) == [None]
    row = remote(kb)
    assert (row.checksum_failures - was.checksum_failures, row.hits - was.hits) == (1, 0)
    assert in_redis(pool_r, keys, ns) == 0
    assert kb.lookup(keys).tiers == [None]
    assert ka.get(keys) == values  # A's own copy is untouched


def test_auto_compression_skips_its_sample_after_a_raw_block_of_the_namespace(
    a: Daemon, clients: Callable[[Daemon], KVStoreClient], pool_r: redis.Redis, ns: str,
) -> None:
    """remote.compress=auto: once a namespace's block stayed raw, its next AUTO_SKIP_BLOCKS
    blocks are written raw untried (even compressible ones); the one after is sampled again
    and compressed. Another namespace of the same daemon keeps its own count. Every frame
    decodes to the bytes put, whichever way it was written."""
    ka = clients(a)
    other = f"{ns}-other"
    kb = KVStoreClient(a.target, other, timeout_s=10)
    try:
        noise, noise_value = blocks(1)
        ka.put(noise, noise_value)
        wait_until(lambda: in_redis(pool_r, noise, ns) == 1, "the raw block in Redis", WAIT_S)
        zeros = bytes(PAGE)  # lz4 shrinks it to almost nothing
        chain = keys(AUTO_SKIP_BLOCKS + 2)
        for key in chain:  # one put each: written through in this order
            ka.put([key], [zeros], independent=True)
        elsewhere = keys(1)
        kb.put(elsewhere, [zeros])
        wait_until(lambda: in_redis(pool_r, chain, ns) == len(chain), "the blocks in Redis",
                   WAIT_S)
        wait_until(lambda: in_redis(pool_r, elsewhere, other) == 1, "the other namespace's",
                   WAIT_S)
        got = [pool_r.get(block_key(ns, k)) for k in noise + chain]
        frames = [f for f in got if isinstance(f, bytes)]
        assert len(frames) == len(got)
        assert [f[5] == CODEC_RAW for f in frames] == (
            [True] * (1 + AUTO_SKIP_BLOCKS) + [False] * 2)
        assert [len(f) for f in frames[1:]] == [HEADER_BYTES + PAGE] * AUTO_SKIP_BLOCKS + [
            len(frames[-1])] * 2 and len(frames[-1]) < PAGE // 10
        assert [decode(f) for f in frames] == noise_value + [zeros] * len(chain)
        other_frame = pool_r.get(block_key(other, elsewhere[0]))
        assert other_frame is not None and other_frame[5] != CODEC_RAW
    finally:
        kb.close()


def test_a_full_queue_skips_blocks_and_never_delays_a_put(
    daemon_factory: Make, clients: Callable[[Daemon], KVStoreClient], server: RedisServer,
    r: redis.Redis, ns: str,
) -> None:
    timeout_s = 2.0
    d = daemon_factory(*l4(server.url, "remote.queue_bytes=1MiB",
                           f"remote.timeout_s={timeout_s}"))
    kv = clients(d)
    kv.put(*blocks(1), independent=True)  # connections made while Redis answers
    keys, values = blocks(16, 256 << 10)
    os.kill(server.proc.pid, signal.SIGSTOP)  # hung, not gone: each Redis call times out
    try:
        started = time.monotonic()
        for key, value in zip(keys, values, strict=True):
            assert kv.put([key], [value]).stored == 1
        elapsed_s = time.monotonic() - started
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert elapsed_s < timeout_s  # no put waited for the hung Redis
    refused = remote(kv).admissions_refused
    assert 0 < refused < 16
    assert metric(d, "kvstore_l4_queue_dropped_blocks_total") == refused
    # What was queued still arrives; what was skipped never does.
    wait_until(lambda: in_redis(r, keys, ns) == 16 - refused, "the queued blocks in Redis",
               WAIT_S)
    wait_until(lambda: remote(kv).state == "closed", "the breaker to close", WAIT_S)
    assert kv.get(keys) == values


def test_tls_round_trip_between_two_daemons(
    daemon_factory: Make, clients: Callable[[Daemon], KVStoreClient], tmp_path: Path,
) -> None:
    try:
        tls = start_redis_tls(tmp_path)
    except RuntimeError as exc:
        if "TLS support" in str(exc):
            pytest.skip(str(exc).splitlines()[0])
        raise
    try:
        settings = l4(tls.url, f"remote.tls_ca_file={tls.ca_file}")
        a = clients(daemon_factory(*settings))
        b = clients(daemon_factory(*settings))
        keys, values = blocks(4)
        a.put(keys, values)
        wait_until(lambda: remote(a).bytes_in == 4 * PAGE, "A's write-through over TLS",
                   WAIT_S)
        assert remote(a).backend == "redis-tls"
        assert b.lookup(keys).tiers == ["remote"] * 4
        assert b.get(keys) == values
        assert (remote(b).hits, remote(b).state) == (4, "closed")
    finally:
        tls.stop()


def test_a_password_in_the_url_works(
    daemon_factory: Make, clients: Callable[[Daemon], KVStoreClient], tmp_path: Path, ns: str,
) -> None:
    password = secrets.token_hex(8)
    server = start_redis_with_password(tmp_path, password)
    try:
        url = f"redis://:{password}@127.0.0.1:{server.port}/0"
        a = clients(daemon_factory(*l4(url)))
        b = clients(daemon_factory(*l4(url)))
        keys, values = blocks(3)
        a.put(keys, values)
        r = raw(server, password)
        wait_until(lambda: in_redis(r, keys, ns) == 3, "the chain in Redis", WAIT_S)
        r.close()
        assert b.get(keys) == values
        assert (remote(b).hits, remote(b).state) == (3, "closed")
    finally:
        server.stop()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, str]]:
    """A Redis with a password, and a wrong password for it."""
    server = start_redis_with_password(tmp_path_factory.mktemp("guarded"), secrets.token_hex(8))
    yield server, f"wrong-{secrets.token_hex(8)}"
    server.stop()


@pytest.fixture
def refused_login(shared_daemon: Make,
                  guarded: tuple[RedisServer, str]) -> tuple[Daemon, str]:
    """The session's daemon whose L4 URL carries a wrong password, and that password."""
    server, wrong = guarded
    return shared_daemon(*l4(f"redis://:{wrong}@127.0.0.1:{server.port}/0")), wrong


def test_a_wrong_password_leaves_the_daemon_serving_without_echoing_it(
    refused_login: tuple[Daemon, str], clients: Callable[[Daemon], KVStoreClient],
) -> None:
    d, wrong = refused_login
    kv = clients(d)
    assert kv.health() == "SERVING"
    wait_until(lambda: remote(kv).state == "open", "the breaker to open", WAIT_S)
    keys, values = blocks(2)
    assert kv.put(keys, values).stored == 2
    assert kv.get(keys) == values
    wait_until(lambda: remote(kv).io_errors > 0, "a counted L4 failure", WAIT_S)
    assert "L4 unavailable" in d.log()
    assert wrong not in d.log()
    assert wrong not in repr(kv.stats().to_dict())


def test_the_effective_config_in_stats_hides_the_password(
    refused_login: tuple[Daemon, str], clients: Callable[[Daemon], KVStoreClient],
) -> None:
    d, wrong = refused_login
    config_json = clients(d).stats(include_config=True).config_json
    assert config_json and wrong not in config_json


def test_blocks_in_redis_expire_after_remote_ttl_s(
    a: Daemon, clients: Callable[[Daemon], KVStoreClient], pool_r: redis.Redis, ns: str,
) -> None:
    kv = clients(a)  # remote.ttl_s=60
    keys, values = blocks(2)
    kv.put(keys, values)
    wait_until(lambda: in_redis(pool_r, keys, ns) == 2, "the blocks in Redis", WAIT_S)
    for key in keys:
        assert 0 < pool_r.pttl(block_key(ns, key)) <= 60_000


def test_the_async_client_ranks_hot_keys_and_prewarms_with_coroutine_progress(
    daemon_factory: Make, server: RedisServer, clients: Callable[[Daemon], KVStoreClient],
    ns: str,
) -> None:
    a = daemon_factory(*l4(server.url, "remote.popularity_flush_s=0.1"))
    keys, values = blocks(4)
    kv = clients(a)
    kv.put(keys, values, independent=True)
    for _ in range(3):
        kv.get(keys[:2])  # the first two are the hottest
    kv.get(keys[2:])
    wait_until(lambda: set(kv.hot(4).keys) == set(keys), "popularity in Redis", WAIT_S)
    d = daemon_factory(*l4(server.url))
    seen: list[int] = []

    async def on_progress(progress: PrewarmResult) -> None:
        await asyncio.sleep(0)
        seen.append(progress.blocks)

    async def scenario() -> tuple[HotResult, PrewarmResult]:
        async with AsyncKVStoreClient(d.target, ns, timeout_s=10) as akv:
            return await akv.hot(2), await akv.prewarm(64 << 20, on_progress=on_progress)

    hot, final = asyncio.run(scenario())
    assert set(hot.keys) == set(keys[:2]) and hot.scores[0] >= hot.scores[1] > 0
    assert final.done and final.blocks == 4 and seen[-1] == 4
    assert clients(d).lookup(keys).tiers == ["dram"] * 4


def test_evicting_l4_by_bytes_or_all_is_refused_naming_the_tier(
    a: Daemon, clients: Callable[[Daemon], KVStoreClient],
) -> None:
    """L4 has no eviction order (its keys expire): bytes= or all= for tier remote was an
    INTERNAL KeyError; it is FAILED_PRECONDITION, and the blocks stay."""
    kv = clients(a)
    keys, values = blocks(2)
    kv.put(keys, values)
    with pytest.raises(FailedPrecondition, match="tier remote"):
        kv.evict(tier="remote", bytes=1 << 20)
    with pytest.raises(FailedPrecondition, match="tier remote"):
        kv.evict(tier="remote", all=True)
    assert kv.get(keys) == values
