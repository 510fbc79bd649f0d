"""tiers/redis_pool.py against real redis-server processes: standalone, password, TLS, a
3-node Redis Cluster, and Redis going away (stopped, hung) and coming back. No fakes."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from kvstore.tiers.redis_pool import (
    HOT_MAX_MEMBERS,
    RedisPool,
    RemoteUnavailable,
    block_key,
    hot_key,
)
from kvstore.tools.testing import (
    RedisClusterServers,
    RedisServer,
    free_port,
    start_redis,
    start_redis_cluster,
    start_redis_on,
    start_redis_tls,
    start_redis_with_password,
)


def k(i: int | str) -> bytes:
    """A 32-byte block key, as the store's keys are."""
    return hashlib.sha256(str(i).encode()).digest()


def raw(server: RedisServer | int) -> redis.Redis:
    port = server if isinstance(server, int) else server.port
    return redis.Redis(port=port, socket_timeout=5)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    s = start_redis(tmp_path)
    yield s
    s.stop()


@pytest.fixture
def pool(server: RedisServer) -> Iterator[RedisPool]:
    p = RedisPool(server.url, timeout_s=2.0)
    yield p
    p.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    c = start_redis_cluster(tmp_path_factory.mktemp("cluster"), nodes=3)
    yield c
    c.stop()


# --- keys ------------------------------------------------------------------------------------


def test_block_key_layout() -> None:
    key = k(1)
    assert block_key("llama-8b", key) == b"kvs:v1:llama-8b:" + key.hex().encode()
    ns = "модель/ü"
    assert block_key(ns, key) == b"kvs:v1:" + ns.encode() + b":" + key.hex().encode()
    assert hot_key("llama-8b") == b"kvs:v1hot:llama-8b"
    # A namespace named "hot" has block keys that no popularity key can equal.
    assert not block_key("hot", key).startswith(b"kvs:v1hot:")


def test_braces_in_a_namespace_never_make_a_hash_tag() -> None:
    """In Redis Cluster `{...}` in a key picks the slot: a namespace like "{tenant}" must not
    pin all its blocks to one slot. Escaping also keeps distinct namespaces distinct."""
    for ns in ("{tenant}", "a{b", "}{", "{}", "x{y}z"):
        assert b"{" not in block_key(ns, k(1)) and b"}" not in block_key(ns, k(1))
        assert b"{" not in hot_key(ns) and b"}" not in hot_key(ns)
    assert block_key("{t}", k(1)) == b"kvs:v1:%7Bt%7D:" + k(1).hex().encode()
    spellings = ["a{", "a%7B", "a%257B", "a}", "a%7D", "a%"]
    assert len({block_key(ns, k(1)) for ns in spellings}) == len(spellings)


# --- standalone round trips --------------------------------------------------------------------


def test_round_trip_with_ttl(pool: RedisPool, server: RedisServer) -> None:
    assert pool.backend == "redis" and pool.name == "remote"
    pool.ping()
    items = [("m", k(1), b"frame-one"), ("m", k(2), memoryview(b"frame-two")), ("m", k(3), b"")]
    pool.set(items, ttl_s=60.0)
    wanted = [(ns, key) for ns, key, _ in items] + [("m", k(4))]
    assert pool.get(wanted) == [b"frame-one", b"frame-two", b"", None]
    assert pool.exists(wanted) == [True, True, True, False]
    for ns, key, _ in items:
        assert 0 < raw(server).pttl(block_key(ns, key)) <= 60_000
    assert pool.delete([("m", k(1)), ("m", k(2)), ("m", k(4))]) == 2
    assert pool.get(wanted) == [None, None, b"", None]
    assert pool.exists([]) == [] and pool.get([]) == [] and pool.delete([]) == 0
    pool.set([], ttl_s=1.0)


def test_zero_ttl_means_no_expiry(pool: RedisPool, server: RedisServer) -> None:
    pool.set([("m", k(1), b"kept")], ttl_s=0)
    assert raw(server).pttl(block_key("m", k(1))) == -1  # exists, no expiry


def test_a_tiny_ttl_expires(pool: RedisPool, server: RedisServer) -> None:
    pool.set([("m", k(1), b"brief")], ttl_s=0.3)
    assert 0 < raw(server).pttl(block_key("m", k(1))) <= 300
    deadline = time.monotonic() + 10
    while pool.exists([("m", k(1))]) != [False]:
        assert time.monotonic() < deadline, "a 0.3 s TTL did not expire in 10 s"
        time.sleep(0.05)
    assert pool.get([("m", k(1))]) == [None]


def test_a_batch_of_500_in_one_pipeline(pool: RedisPool, server: RedisServer) -> None:
    items = [("batch", k(i), os.urandom(i * 37 % 4096)) for i in range(500)]
    pool.set(items, ttl_s=60.0)
    # one SET per block and nothing else: no MULTI/EXEC wrapper, no retries
    stats = raw(server).info("commandstats")
    assert stats["cmdstat_set"]["calls"] == 500
    assert "cmdstat_multi" not in stats and "cmdstat_exec" not in stats
    keys = [(ns, key) for ns, key, _ in items]
    assert pool.get(keys) == [v for _, _, v in items]
    assert pool.exists(keys) == [True] * 500
    assert raw(server).dbsize() == 500
    assert pool.delete(keys) == 500
    assert raw(server).dbsize() == 0


def test_census_counts_blocks_only_and_redis_memory(pool: RedisPool,
                                                    server: RedisServer) -> None:
    assert pool.census()[0] == 0
    pool.set([(ns, k(i), b"v" * 1000) for i in range(30) for ns in ("a", "b")], ttl_s=60.0)
    pool.add_popularity("a", {k(1): 1.0})  # popularity and meta keys are not blocks
    raw(server).set(b"unrelated", b"x")
    raw(server).config_set("maxmemory", str(64 << 20))
    blocks, used, limit = pool.census()
    assert blocks == 60
    assert used >= 60 * 1000 and limit == 64 << 20


def test_namespaces_are_isolated(pool: RedisPool) -> None:
    pool.set([("a", k(1), b"in a"), ("b", k(1), b"in b"), ("{a}", k(1), b"in {a}")], 60.0)
    assert pool.get([("a", k(1)), ("b", k(1)), ("{a}", k(1)), ("c", k(1))]) == [
        b"in a", b"in b", b"in {a}", None]
    assert pool.delete([("a", k(1))]) == 1
    assert pool.exists([("a", k(1)), ("b", k(1)), ("{a}", k(1))]) == [False, True, True]


def test_a_value_redis_py_cannot_encode_is_a_bug_not_an_outage(pool: RedisPool) -> None:
    with pytest.raises(redis.DataError):
        pool.set([("m", k(1), {"not": "bytes"})], 60.0)


def test_bad_url_is_refused_without_echoing_it() -> None:
    with pytest.raises(ValueError, match="redis://") as info:
        RedisPool("http://user:hunter2@example.com:6379")
    assert "hunter2" not in str(info.value)


# --- popularity --------------------------------------------------------------------------------


def test_popularity_accumulates_and_ranks(pool: RedisPool) -> None:
    assert pool.hot("m", 10) == [] and pool.namespaces() == []
    pool.add_popularity("m", {k(1): 1.0, k(2): 5.0, k(3): 2.5})
    pool.add_popularity("m", {k(1): 10.0})
    pool.add_popularity("other", {k(9): 99.0})
    pool.add_popularity("quiet", {})  # nothing to send: not listed either
    assert pool.hot("m", 10) == [(k(1), 11.0), (k(2), 5.0), (k(3), 2.5)]
    assert pool.hot("m", 2) == [(k(1), 11.0), (k(2), 5.0)]
    assert pool.hot("m", 0) == []
    assert all(len(key) == 32 for key, _ in pool.hot("m", 10))
    assert pool.hot("other", 10) == [(k(9), 99.0)]
    assert pool.namespaces() == ["m", "other"]
    pool.add_popularity("{ü}", {k(1): 1.0})
    assert pool.namespaces() == ["m", "other", "{ü}"]  # listed as given, not escaped
    assert pool.hot("{ü}", 1) == [(k(1), 1.0)]


def test_popularity_set_is_trimmed_to_the_highest(server: RedisServer) -> None:
    small = RedisPool(server.url, hot_max_members=5)
    small.add_popularity("m", {k(i): float(i) for i in range(1, 9)})
    assert raw(server).zcard(hot_key("m")) == 5
    assert small.hot("m", 100) == [(k(i), float(i)) for i in (8, 7, 6, 5, 4)]
    small.close()


def test_popularity_set_keeps_100_000_members(pool: RedisPool, server: RedisServer) -> None:
    assert HOT_MAX_MEMBERS == 100_000
    pool.add_popularity("big", {i.to_bytes(32, "big"): float(i) for i in range(100_003)})
    assert raw(server).zcard(hot_key("big")) == 100_000
    assert raw(server).zscore(hot_key("big"), (2).to_bytes(32, "big")) is None  # lowest 3 gone
    assert raw(server).zscore(hot_key("big"), (3).to_bytes(32, "big")) == 3.0
    assert pool.hot("big", 1) == [((100_002).to_bytes(32, "big"), 100_002.0)]


def test_decay_scales_scores_once_per_period_across_daemons(server: RedisServer) -> None:
    a, b = RedisPool(server.url), RedisPool(server.url)  # two daemons sharing one Redis
    a.add_popularity("m", {k(1): 8.0, k(2): 2.0})
    assert a.decay("m", 0.5) is True
    assert b.hot("m", 10) == [(k(1), 4.0), (k(2), 1.0)]
    assert a.decay("m", 0.5, every_s=60) is True
    assert b.decay("m", 0.5, every_s=60) is False  # a already did it this period
    assert b.hot("m", 10) == [(k(1), 2.0), (k(2), 0.5)]
    with pytest.raises(ValueError, match="factor"):
        a.decay("m", 0.0)
    a.close()
    b.close()


# --- credentials and TLS -----------------------------------------------------------------------


def test_password_auth(tmp_path: Path) -> None:
    password = "s3cret-Pa55word"
    server = start_redis_with_password(tmp_path, password)
    try:
        good = RedisPool(server.url, password=password)
        good.set([("m", k(1), b"v")], 60.0)
        assert good.get([("m", k(1))]) == [b"v"]
        in_url = RedisPool(f"redis://:{password}@127.0.0.1:{server.port}/0")
        assert in_url.get([("m", k(1))]) == [b"v"]
        for bad in (RedisPool(server.url, password="wrong-" + password),
                    RedisPool(f"redis://:wrong-{password}@127.0.0.1:{server.port}/0"),
                    RedisPool(server.url)):
            with pytest.raises(RemoteUnavailable) as info:
                bad.get([("m", k(1))])
            message = str(info.value)
            assert f"127.0.0.1:{server.port}" in message
            assert password not in message
            assert "auth" in message.lower()
    finally:
        server.stop()


def test_tls_round_trip(tmp_path: Path) -> None:
    try:
        server = start_redis_tls(tmp_path)
    except RuntimeError as exc:
        if "without TLS support" in str(exc):
            pytest.skip(str(exc).splitlines()[0])
        raise
    try:
        assert server.url.startswith("rediss://")
        pool = RedisPool(server.url, tls_ca_file=server.ca_file)
        assert pool.backend == "redis-tls"
        pool.set([("m", k(1), b"over tls")], 60.0)
        assert pool.get([("m", k(1))]) == [b"over tls"]
        # the certificate is checked: without our CA the system's CAs refuse it
        with pytest.raises(RemoteUnavailable, match="certificate verify failed"):
            RedisPool(server.url, timeout_s=2.0).ping()
        # plain text to a TLS port is refused promptly, not hung
        started = time.monotonic()
        with pytest.raises(RemoteUnavailable):
            RedisPool(f"redis://127.0.0.1:{server.port}/0", timeout_s=1.0).ping()
        assert time.monotonic() - started < 5
    finally:
        server.stop()


def test_server_refusal_reads_as_unavailable(tmp_path: Path) -> None:
    """OOM (maxmemory, noeviction) is the server's state, not our bug."""
    server = start_redis_on(tmp_path, 0, "--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    try:
        pool = RedisPool(server.url)
        with pytest.raises(RemoteUnavailable, match="OutOfMemoryError.*maxmemory"):
            pool.set([("m", k(i), os.urandom(256 * 1024)) for i in range(32)], 60.0)
    finally:
        server.stop()


# --- outages -----------------------------------------------------------------------------------


def _every_call(pool: RedisPool) -> dict[str, object]:
    return {
        "ping": pool.ping,
        "exists": lambda: pool.exists([("m", k(1))]),
        "get": lambda: pool.get([("m", k(1))]),
        "set": lambda: pool.set([("m", k(1), b"v")], 60.0),
        "delete": lambda: pool.delete([("m", k(1))]),
        "add_popularity": lambda: pool.add_popularity("m", {k(1): 1.0}),
        "decay": lambda: pool.decay("m", 0.5),
        "hot": lambda: pool.hot("m", 10),
        "namespaces": pool.namespaces,
        "census": pool.census,
    }


def test_stopped_redis_fails_fast_and_the_same_pool_recovers(tmp_path: Path) -> None:
    port = free_port()
    server = start_redis_on(tmp_path, port)
    pool = RedisPool(f"redis://127.0.0.1:{port}/0", timeout_s=1.0)
    pool.set([("m", k(1), b"before")], 60.0)
    server.stop()
    for op, call in _every_call(pool).items():
        started = time.monotonic()
        with pytest.raises(RemoteUnavailable, match=f"127.0.0.1:{port}") as info:
            call()  # type: ignore[operator]
        assert time.monotonic() - started < 1.0 + 2.0, f"{op} took too long"
        assert f"({op})" in str(info.value)
    server = start_redis_on(tmp_path, port)  # same port, empty (no persistence)
    try:
        assert pool.get([("m", k(1))]) == [None]  # first call after the restart works
        pool.set([("m", k(1), b"after")], 60.0)
        assert pool.get([("m", k(1))]) == [b"after"]
        pool.ping()
    finally:
        pool.close()
        server.stop()


def test_hung_redis_times_out_after_timeout_s(tmp_path: Path) -> None:
    """A stopped (SIGSTOP) process still accepts TCP connections but never answers: each
    call must give up after about timeout_s, not hang."""
    server = start_redis_on(tmp_path, 0)
    pool = RedisPool(server.url, timeout_s=0.5)
    pool.ping()
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        for call in (lambda: pool.get([("m", k(1))]), pool.ping):
            started = time.monotonic()
            with pytest.raises(RemoteUnavailable, match="Timeout"):
                call()
            elapsed = time.monotonic() - started
            assert 0.4 < elapsed < 0.5 + 2.0
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    pool.set([("m", k(1), b"awake")], 60.0)
    assert pool.get([("m", k(1))]) == [b"awake"]
    pool.close()
    server.stop()


def test_unreachable_redis_constructs_and_fails_per_call() -> None:
    port = free_port()  # nothing listens there
    for cluster in (False, True):
        pool = RedisPool(f"redis://127.0.0.1:{port}", cluster=cluster, timeout_s=0.5)
        with pytest.raises(RemoteUnavailable, match=f"127.0.0.1:{port}"):
            pool.ping()
        with pytest.raises(RemoteUnavailable):
            pool.get([("m", k(1))])
        pool.close()


# --- Redis Cluster -----------------------------------------------------------------------------


def _keys_per_node(cluster: RedisClusterServers) -> list[int]:
    return [raw(port).dbsize() for port in cluster.ports]


def test_cluster_round_trip_spreads_a_namespace(cluster: RedisClusterServers) -> None:
    pool = RedisPool(cluster.url, cluster=True)
    try:
        assert pool.backend == "redis-cluster"
        pool.ping()
        for ns in ("model-a", "{tenant}"):
            items = [(ns, k(i), f"{ns}:{i}".encode()) for i in range(200)]
            keys = [(n, key) for n, key, _ in items]
            pool.set(items, ttl_s=60.0)
            assert pool.get(keys + [(ns, k("absent"))]) == [v for _, _, v in items] + [None]
            assert pool.exists(keys[:3] + [(ns, k("absent"))]) == [True, True, True, False]
            counts = _keys_per_node(cluster)
            assert sum(counts) == 200 and sum(c > 0 for c in counts) == 3, counts
            slots = {raw(cluster.ports[0]).cluster("keyslot", block_key(ns, key))
                     for _, key in keys}
            assert len(slots) > 100  # spread over slots, no hash tag
            assert pool.census()[0] == 200  # every primary scanned
            assert pool.delete(keys) == 200
            assert _keys_per_node(cluster) == [0, 0, 0]
    finally:
        pool.close()


def test_cluster_popularity(cluster: RedisClusterServers) -> None:
    pool = RedisPool(cluster.url, cluster=True)
    try:
        pool.add_popularity("c1", {k(1): 3.0, k(2): 1.0})
        pool.add_popularity("c2", {k(3): 7.0})
        pool.add_popularity("c1", {k(2): 5.0})
        assert pool.hot("c1", 10) == [(k(2), 6.0), (k(1), 3.0)]
        assert {"c1", "c2"} <= set(pool.namespaces())
        assert pool.decay("c1", 0.5) is True
        assert pool.hot("c1", 10) == [(k(2), 3.0), (k(1), 1.5)]
    finally:
        pool.close()


def test_cluster_follows_a_slot_being_resharded(cluster: RedisClusterServers) -> None:
    """Batches go out without following redirections first (see _cluster_pipelined); while
    a slot migrates (ASK) and after it moved (MOVED) the pool must still work, re-sending
    only the redirected commands: a batch delete still counts each key once."""
    pool = RedisPool(cluster.url, cluster=True)
    ns = "moving"
    key_a = k("moving-a")
    slot = key_slot(block_key(ns, key_a))
    key_b = next(k(i) for i in range(10**6) if key_slot(block_key(ns, k(i))) == slot)
    others = [(ns, k(i)) for i in range(20)]
    router: Any = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    source = router.get_node_from_key(block_key(ns, key_a)).port
    router.close()
    target = next(p for p in cluster.ports if p != source)
    ids = {port: raw(port).cluster("myid") for port in cluster.ports}
    try:
        assert raw(source).cluster("countkeysinslot", slot) == 0
        pool.set([(n, key, b"x") for n, key in others] + [(ns, key_a, b"a")], 60.0)
        raw(target).cluster("setslot", slot, "importing", ids[source])
        raw(source).cluster("setslot", slot, "migrating", ids[target])
        pool.set([(ns, key_b, b"b")], 60.0)  # not on the source: ASK, then it lands on target
        assert pool.get([(ns, key_a), (ns, key_b)]) == [b"a", b"b"]
        raw(source).migrate("127.0.0.1", target, [block_key(ns, key_a)], 0, 5000)
        for port in [target, source] + [p for p in cluster.ports if p not in (source, target)]:
            raw(port).cluster("setslot", slot, "node", ids[target])
        assert raw(target).cluster("countkeysinslot", slot) == 2
        everything = others + [(ns, key_a), (ns, key_b)]
        assert pool.delete(everything) == 22  # the source answers MOVED for a and b
        assert pool.exists(everything) == [False] * 22
    finally:
        pool.close()


def test_cluster_node_hung_or_down_is_unavailable_not_a_hang(tmp_path: Path) -> None:
    own = start_redis_cluster(tmp_path, nodes=3)
    try:
        pool = RedisPool(own.url, cluster=True, timeout_s=0.5)
        keys = [("m", k(i)) for i in range(30)]  # about 10 on each node
        pool.set([(ns, key, b"v") for ns, key in keys], 60.0)
        hung = own.procs[2]
        os.kill(hung.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(RemoteUnavailable, match="Timeout"):
                pool.get(keys)
            # one timeout, not one per key of the hung node (redis-py's own re-sends)
            assert time.monotonic() - started < 0.5 + 1.0
        finally:
            os.kill(hung.pid, signal.SIGCONT)
        assert pool.get(keys) == [b"v"] * 30  # the same pool, once the node answers
        own.procs[1].terminate()
        own.procs[1].wait(10)
        for call in (lambda: pool.get(keys), pool.ping):
            started = time.monotonic()
            with pytest.raises(RemoteUnavailable, match="Connection"):
                call()
            assert time.monotonic() - started < 5
    finally:
        own.stop()


# --- the data path: frames sent as parts, GET replies read straight into buffers -------------


def test_a_frame_sent_as_parts_is_stored_joined(pool: RedisPool, server: RedisServer) -> None:
    """The write-through hands SET a frame as (header, payload view): Redis must store the
    parts joined, beside plain values in the same pipeline, whatever the parts' sizes."""
    big = os.urandom(300_000)
    items: list[tuple[str, bytes, Any]] = [
        ("p", k(1), (b"H" * 24, memoryview(big))),
        ("p", k(2), b"plain"),
        ("p", k(3), (b"head", b"small tail")),
        ("p", k(4), (b"", memoryview(big)[:7000], b"\r\n$-1\r\n")),  # RESP bytes inside
        ("p", k(5), (b"", b"")),
    ]
    pool.set(items, ttl_s=60.0)
    stored = [raw(server).get(block_key("p", k(i))) for i in range(1, 6)]
    assert stored == [b"H" * 24 + big, b"plain", b"headsmall tail",
                      big[:7000] + b"\r\n$-1\r\n", b""]
    assert all(0 < raw(server).pttl(block_key("p", k(i))) <= 60_000 for i in range(1, 6))


@pytest.mark.parametrize("protocol", [2, 3])
def test_get_reads_every_reply_shape_in_step(server: RedisServer, protocol: int) -> None:
    """Values around the 64 KiB line read, values holding RESP's own bytes, empty values and
    misses (RESP2's and RESP3's nil), all in one pipeline and then again on the same
    connection: a reply read one byte short or long would shift every later value."""
    values = [os.urandom(n) for n in (0, 1, 65_535, 65_536, 65_537, (1 << 20) + 3)]
    values.append(b"$5\r\nhello\r\n_\r\n-ERR no\r\n" * 100)
    pool = RedisPool(f"{server.url}?protocol={protocol}")
    try:
        pool.set([("g", k(i), v) for i, v in enumerate(values)], ttl_s=60.0)
        wanted = [("g", k(i)) for i in range(len(values))]
        wanted[3:3] = [("g", k("miss-1"))]
        wanted.append(("g", k("miss-2")))
        expected: list[bytes | None] = [*values[:3], None, *values[3:], None]
        for _ in range(3):
            assert pool.get(wanted) == expected
        assert pool.get([("g", k("miss-1"))]) == [None]
    finally:
        pool.close()


def test_an_error_reply_mid_pipeline_drops_the_connection_not_the_next_call(
        pool: RedisPool, server: RedisServer) -> None:
    """A GET answered with an error (a key of another type) fails that call as L4
    unavailable; the replies after it are never read, so that connection is dropped, and
    the next call on the same pool reads its own replies, not the stale ones."""
    pool.set([("e", k(i), bytes([i]) * 100_000) for i in range(4)], ttl_s=60.0)
    raw(server).delete(block_key("e", k(1)))
    raw(server).rpush(block_key("e", k(1)), b"not a string")
    with pytest.raises(RemoteUnavailable, match="WRONGTYPE"):
        pool.get([("e", k(i)) for i in range(4)])
    assert pool.get([("e", k(2)), ("e", k(3)), ("e", k(0))]) == [
        bytes([2]) * 100_000, bytes([3]) * 100_000, bytes([0]) * 100_000]
