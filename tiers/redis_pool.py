"""L4 remote pool I/O: one Redis or Redis Cluster, through redis-py, behind a small batched
interface. Values are opaque frames made elsewhere (kvstore.daemon.blockframe); which
blocks go to L4, when, and for how long is kvstore.daemon.remote's business, not this module's.

Keys. A block is one string key, `kvs:v1:<namespace>:<hex key>`. There are no literal braces:
in Redis Cluster `{...}` is a hash tag that would pin a whole namespace to one slot, and blocks
must spread over every node. So the namespace is escaped (`%` `{` `}` as %25 %7B %7D, which
keeps distinct namespaces distinct) and no key this module writes ever contains `{`.
Popularity is one sorted set per namespace, `kvs:v1:hot:<namespace>`, plus the set
`kvs:v1:namespaces` that lists every namespace that ever reported popularity.

Batches are one pipelined round trip (not a MULTI/EXEC transaction); in cluster mode redis-py's
ClusterPipeline groups the commands by node. Failures: every redis-py error that means "Redis
is not there" (refused, timed out, TLS or auth failure, cluster down, loading, out of memory,
read-only replica) becomes RemoteUnavailable, whose message names the host, never the password.
redis-py's own retries are off: a retry loop inside a call would turn an outage into
`attempts x timeout_s` stalls, and kvstore.daemon.breaker already decides when to try again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import unquote, urlsplit

import numpy as np
import redis
from redis._parsers.encoders import Encoder
from redis.backoff import NoBackoff
from redis.cluster import PipelineCommand
from redis.connection import PythonRespSerializer
from redis.exceptions import (
    AskError,
    DataError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.retry import Retry

PREFIX = b"kvs:v1:"  # blocks only: "kvs:v1:<namespace>:<hex key>"
# Popularity lives under its own prefix, so no namespace's block key can equal one of these.
NAMESPACES_KEY = b"kvs:v1meta:namespaces"
HOT_PREFIX = b"kvs:v1hot:"
DECAYED_PREFIX = b"kvs:v1meta:decayed:"
HOT_MAX_MEMBERS = 100_000  # popularity set size; past it the lowest scores are trimmed

# Server replies that can only come from a malformed command, i.e. a bug here: raised as they
# are. Every other refusal (OOM, READONLY, NOPERM, WRONGTYPE, unknown command on a managed
# Redis that disables it) is the server's state or policy and reads as "L4 unavailable".
CENSUS_SCAN_COUNT = 10_000  # keys per SCAN round trip of census(): 1M blocks in 100 trips
_MISUSE = ("wrong number of arguments", "syntax error")
_Command: Any = PipelineCommand  # untyped in redis-py


_BUFFER_CUTOFF = 6000  # redis-py's: a value past it is handed to the socket as it is

Value = bytes | memoryview | tuple[bytes | memoryview, ...]  # a tuple: its parts, in order


class _PartsSerializer(PythonRespSerializer):
    """redis-py's own packer, which also takes a value as a tuple of parts (a frame's header
    and its payload's view in L2): one RESP bulk string whose parts go to the socket one
    after the other, so the payload is never copied into a joined frame first."""

    def pack(self, *args: Any) -> list[bytes | memoryview]:
        if not any(isinstance(arg, tuple) for arg in args):
            packed: list[bytes | memoryview] = super().pack(*args)  # type: ignore[no-untyped-call]
            return packed
        output: list[bytes | memoryview] = []
        head = b"*%d\r\n" % len(args)
        for arg in args:
            parts = arg if isinstance(arg, tuple) else (self.encode(arg),)
            head += b"$%d\r\n" % sum(memoryview(p).nbytes for p in parts)
            for part in parts:
                if isinstance(part, memoryview) or len(part) > _BUFFER_CUTOFF:
                    output += (head, part)
                    head = b""
                else:
                    head += part
            head += b"\r\n"
        output.append(head)
        return output


def _unchunked_packer() -> Any:
    encoder = Encoder("utf-8", "strict", False)  # type: ignore[no-untyped-call]
    return _PartsSerializer(_BUFFER_CUTOFF, encoder.encode)


class _Connection(redis.Connection):
    """hiredis parses replies (faster GETs), but its command packer copies every value into
    one new buffer: a pipelined SET of 32 x 1 MiB took 47 ms with it and 15 ms with
    redis-py's own packer, which hands large values to the socket as they are."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(  # type: ignore[no-untyped-call]
            command_packer=_unchunked_packer(), **kwargs)


class _SslConnection(redis.SSLConnection):
    __doc__ = _Connection.__doc__

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(command_packer=_unchunked_packer(), **kwargs)


_LINE_READ_BYTES = 64 * 1024  # what a reply's header line asks the socket for


class _Replies:
    """The replies to a pipeline of GETs, read from the connection's socket with no parser
    between: each value's bytes go from the kernel straight into its own bytearray
    (`recv_into`, into a buffer never zero-filled). redis-py's hiredis parser copies every
    value twice more (into its buffer, then into new bytes): a pipelined GET of 32 frames
    on the bench's 2-core VM took, wall and CPU, 3.9 and 1.95 ms at 256 KiB through it,
    3.4 and 1.6 ms this way; at 2 MiB 47-62 and 12.2-12.5 ms, 43-58 and 11.0-11.2 ms
    (medians of 40, interleaved). Replies are bulk strings or nil
    (RESP2's or RESP3's); any other reply raises ResponseError (an error reply) or
    ConnectionError, and the caller then drops the connection, whose stream is no longer in
    step."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._buf = bytearray()  # read past the last reply's end: the next one's start

    def _fill(self) -> None:
        chunk = self._sock.recv(_LINE_READ_BYTES)
        if not chunk:
            raise redis.ConnectionError("Redis closed the connection mid-reply")
        self._buf += chunk

    def _line(self) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self._buf[:end])
        del self._buf[: end + 2]
        return line

    def bulk(self) -> memoryview | None:
        """The next reply: a view of a bulk string's bytes (in a buffer of its own, never
        zero-filled first), or None for nil."""
        line = self._line()
        if line[:1] == b"-":
            raise ResponseError(line[1:].decode("utf-8", "replace"))
        if line == b"_":  # RESP3's nil (redis-py 8 speaks RESP3 where the server does)
            return None
        if line[:1] != b"$" or not line[1:].lstrip(b"-").isdigit():
            raise redis.ConnectionError(f"unexpected reply to GET: {line[:32]!r}")
        size = int(line[1:])
        if size < 0:
            return None
        value: memoryview = np.empty(size + 2, np.uint8).data  # with its CRLF, cut off below
        have = min(len(self._buf), len(value))
        value[:have] = self._buf[:have]
        del self._buf[:have]
        while have < len(value):
            got = self._sock.recv_into(value[have:])
            if not got:
                raise redis.ConnectionError("Redis closed the connection mid-value")
            have += got
        if value[size:].tobytes() != b"\r\n":
            raise redis.ConnectionError("a GET reply's value did not end in CRLF")
        return value[:size]


def connection_class(tls: bool = False) -> type[redis.Connection]:
    """The redis-py connection class the pool's connections use (redis-py's own packer, which
    takes frames as parts): what a like-for-like redis-py baseline uses too."""
    return _SslConnection if tls else _Connection


class RemoteUnavailable(OSError):
    """Redis is unreachable, timed out, refused the login or the command, or the cluster is
    down; the message names the host and what failed, never the password."""


def _escaped(namespace: str) -> bytes:
    return (namespace.encode("utf-8").replace(b"%", b"%25")
            .replace(b"{", b"%7B").replace(b"}", b"%7D"))


def block_key(namespace: str, key: bytes) -> bytes:
    """The Redis key of one block: b"kvs:v1:" + escaped namespace + b":" + key in hex."""
    return PREFIX + _escaped(namespace) + b":" + key.hex().encode("ascii")


def hot_key(namespace: str) -> bytes:
    """The popularity sorted set of one namespace."""
    return HOT_PREFIX + _escaped(namespace)


class RedisPool:
    """The L4 tier's I/O (see the module docstring). Thread-safe, as redis-py's clients are."""

    name = "remote"

    def __init__(self, url: str, *, cluster: bool = False, username: str = "",
                 password: str = "", tls_ca_file: str = "", timeout_s: float = 2.0,
                 hot_max_members: int = HOT_MAX_MEMBERS) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            # never echo the URL: it may hold a password
            raise ValueError(f"remote.url must start with redis:// or rediss://, "
                             f"not {parts.scheme or '(no scheme)'}://")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        tls = parts.scheme == "rediss"
        # parts.port raises ValueError for a bad port: at construction, not on the first call
        self.address = f"{parts.hostname or 'localhost'}:{parts.port or 6379}"
        self.backend = ("redis-cluster" if cluster else "redis") + ("-tls" if tls else "")
        self.hot_max_members = hot_max_members
        self._secrets = [s for s in (password, unquote(parts.password or "")) if s]
        self._url = url
        self._cluster = cluster
        # Credentials in the URL win over these (redis-py's rule for from_url).
        self._kwargs: dict[str, Any] = {
            "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
            "retry": Retry(NoBackoff(), 0),
            "connection_class": connection_class(tls),
        }
        if username:
            self._kwargs["username"] = username
        if password:
            self._kwargs["password"] = password
        if tls and tls_ca_file:
            self._kwargs["ssl_ca_certs"] = tls_ca_file
        self._lock = threading.Lock()
        self._client: redis.Redis | redis.RedisCluster | None = None
        self._refresh_layout = False

    # --- plumbing ------------------------------------------------------------------------------

    def _conn(self) -> redis.Redis | redis.RedisCluster:
        """The client, made on first use (under _errors): RedisCluster reads the cluster's
        layout when it is made, so a pool whose Redis is down still constructs and each
        call tries again until Redis answers. After a cluster pipeline failed, the next call
        first re-reads the layout (see _cluster_pipelined)."""
        with self._lock:
            if self._client is None:
                if self._cluster:
                    self._client = redis.RedisCluster.from_url(self._url, **self._kwargs)
                else:
                    self._client = redis.Redis.from_url(self._url, **self._kwargs)
            client, refresh, self._refresh_layout = self._client, self._refresh_layout, False
        if refresh and isinstance(client, redis.RedisCluster):
            client.nodes_manager.initialize()
        return client

    def _unavailable(self, op: str, exc: BaseException) -> RemoteUnavailable:
        detail = str(exc) or "(no detail)"
        for secret in self._secrets:
            detail = detail.replace(secret, "***")
        return RemoteUnavailable(
            f"L4 Redis at {self.address} unavailable ({op}): {type(exc).__name__}: {detail}")

    @contextmanager
    def _errors(self, op: str) -> Iterator[None]:
        try:
            yield
        except (RemoteUnavailable, DataError):
            raise  # DataError: a value redis-py cannot encode, i.e. a bug in the caller
        except ResponseError as exc:  # includes ClusterDownError, ReadOnlyError, OOM
            if any(m in str(exc).lower() for m in _MISUSE):
                raise
            raise self._unavailable(op, exc) from exc
        except (RedisError, RedisClusterException, OSError) as exc:
            # RedisClusterException is not a RedisError: "cannot be connected", no slot owner
            raise self._unavailable(op, exc) from exc

    def _pipelined(self, op: str, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """One round trip (per node, in cluster mode); replies in command order."""
        if not commands:
            return []
        with self._errors(op):
            client = self._conn()
            if isinstance(client, redis.RedisCluster):
                return self._cluster_pipelined(client, commands)
            pipe: Any = client.pipeline(transaction=False)  # its execute_command is untyped
            for command in commands:
                pipe.execute_command(*command)
            return list(pipe.execute())

    def _cluster_pipelined(self, client: Any, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """ClusterPipeline.execute() re-sends each command that failed with a connection
        error or timeout on its own, one after another: 30 keys on a hung node cost 30 x
        timeout_s. So the batch goes first without redirections: a dead or hung node fails
        it within one timeout_s (and the next call re-reads the layout, as redis-py does
        after a single command fails). Only the commands answered MOVED / ASK / TRYAGAIN
        (slots being moved) go again the usual way, which follows them and refreshes the
        slot table; re-sending only those keeps ZINCRBY counted once and DEL counts right."""
        pipe = client.pipeline(transaction=False)  # (Any: redis-py's cluster side is untyped)
        stack = [_Command(command, {}, i) for i, command in enumerate(commands)]
        try:
            replies = list(pipe.send_cluster_commands(stack, raise_on_error=False,
                                                      allow_redirections=False))
            moved = [i for i, r in enumerate(replies) if isinstance(r, (AskError, TryAgainError))]
            if moved:  # MovedError is an AskError
                for i in moved:
                    pipe.execute_command(*commands[i])
                for i, reply in zip(moved, pipe.execute(raise_on_error=False), strict=True):
                    replies[i] = reply
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            return replies
        except (redis.ConnectionError, redis.TimeoutError):
            with self._lock:
                self._refresh_layout = True
            raise

    # --- blocks --------------------------------------------------------------------------------

    def ping(self) -> None:
        """Raise RemoteUnavailable unless Redis answers; in a cluster, every primary (redis-py
        would otherwise ask one node only)."""
        with self._errors("ping"):
            client = self._conn()
            if isinstance(client, redis.RedisCluster):
                client.ping(target_nodes=redis.RedisCluster.PRIMARIES)
            else:
                client.ping()

    def exists(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        replies = self._pipelined("exists", [("EXISTS", block_key(ns, k)) for ns, k in items])
        return [bool(r) for r in replies]

    def get(self, items: Sequence[tuple[str, bytes]]) -> list[bytes | memoryview | None]:
        """Each block's frame, None when absent: one pipelined round trip whose values are
        received straight into their own buffers (`_Replies`; in cluster mode through
        redis-py's parser, one round trip per node)."""
        commands = [("GET", block_key(ns, k)) for ns, k in items]
        if not commands:
            return []
        with self._errors("get"):
            client = self._conn()
            if isinstance(client, redis.RedisCluster):
                return [None if r is None else bytes(r)
                        for r in self._cluster_pipelined(client, commands)]
            return self._get_direct(client.connection_pool, commands)

    @staticmethod
    def _get_direct(pool: Any, commands: list[tuple[Any, ...]]) -> list[bytes | memoryview | None]:
        """The GETs sent down one of pool's connections and their replies read by
        `_Replies`; a connection left mid-stream (any failure) is dropped, never reused."""
        conn = pool.get_connection()
        try:
            conn.send_packed_command(conn.pack_commands(commands))
            replies = _Replies(conn._sock)
            out: list[bytes | memoryview | None] = [replies.bulk() for _ in commands]
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)
        return out

    def set(self, items: Sequence[tuple[str, bytes, Value]], ttl_s: float) -> None:
        """Write each block's frame; it expires after ttl_s (<= 0: when Redis evicts it). A
        frame may be a tuple of parts (header, payload view): Redis stores them joined, and
        they are sent without being joined here."""
        expiry: tuple[Any, ...] = ("PX", max(1, round(ttl_s * 1000))) if ttl_s > 0 else ()
        self._pipelined("set", [("SET", block_key(ns, k), v, *expiry) for ns, k, v in items])

    def delete(self, items: Sequence[tuple[str, bytes]]) -> int:
        """Delete blocks; how many existed."""
        replies = self._pipelined("delete", [("DEL", block_key(ns, k)) for ns, k in items])
        return sum(int(r) for r in replies)

    # --- popularity ----------------------------------------------------------------------------

    def add_popularity(self, namespace: str, scores: Mapping[bytes, float]) -> None:
        """Add scores to the namespace's popularity set and list the namespace; one round
        trip, which also trims the set to its hot_max_members highest scores."""
        if not scores:
            return
        zset = hot_key(namespace)
        commands: list[tuple[Any, ...]] = [("ZINCRBY", zset, float(score), bytes(key))
                                           for key, score in scores.items()]
        # Ranks 0 .. -(max+1) are the lowest members beyond the first `max`; an empty range
        # (a no-op) while the set is no larger than that.
        commands.append(("ZREMRANGEBYRANK", zset, 0, -(self.hot_max_members + 1)))
        commands.append(("SADD", NAMESPACES_KEY, namespace.encode("utf-8")))
        self._pipelined("add_popularity", commands)

    def decay(self, namespace: str, factor: float, every_s: float = 0.0) -> bool:
        """Multiply every popularity score of namespace by factor (0 < factor <= 1), server
        side. With every_s > 0, at most once per every_s across all the daemons that share
        this Redis (a SET NX PX marker elects one), so N daemons do not decay N times as
        fast. True when this call applied it."""
        if not 0 < factor <= 1:
            raise ValueError(f"decay factor must be in (0, 1], got {factor}")
        zset = hot_key(namespace)
        with self._errors("decay"):
            client = self._conn()
            if every_s > 0:
                marker = DECAYED_PREFIX + _escaped(namespace)
                if not client.set(marker, b"1", nx=True, px=max(1, round(every_s * 1000))):
                    return False
            client.zunionstore(zset, {zset: factor})  # one key: same slot in a cluster
        return True

    def hot(self, namespace: str, limit: int) -> list[tuple[bytes, float]]:
        """The namespace's most popular keys, highest score first."""
        if limit <= 0:
            return []
        with self._errors("hot"):
            replies: Any = self._conn().zrevrange(hot_key(namespace), 0, limit - 1,
                                                  withscores=True)
        return [(bytes(member), float(score)) for member, score in replies]

    def namespaces(self) -> list[str]:
        """Every namespace that reported popularity, sorted."""
        with self._errors("namespaces"):
            members: Any = self._conn().smembers(NAMESPACES_KEY)
        return sorted(bytes(m).decode("utf-8") for m in members)

    def census(self) -> tuple[int, int, int]:
        """(blocks, used_memory, maxmemory) of the whole pool, every daemon's blocks: a SCAN of
        the block prefix (every primary, in cluster mode) and INFO memory, summed over nodes
        (maxmemory 0: no limit set). O(keys) round trips of CENSUS_SCAN_COUNT: the daemon runs
        it in the background (kvstore.daemon.remote)."""
        with self._errors("census"):
            client = self._conn()
            blocks = sum(1 for _ in client.scan_iter(match=PREFIX + b"*",
                                                     count=CENSUS_SCAN_COUNT))
            info: Any = client.info("memory")
        nodes = [info] if "used_memory" in info else list(info.values())
        return (blocks, sum(int(n.get("used_memory", 0)) for n in nodes),
                sum(int(n.get("maxmemory", 0)) for n in nodes))

    def close(self) -> None:
        """Drop the connections (a later call would open new ones)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
