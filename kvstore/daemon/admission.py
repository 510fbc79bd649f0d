"""Admission of streaming calls: the caps that keep a few slow or idle clients from taking
every RPC thread, and the reaper that aborts streams whose client has gone quiet.

The daemon serves from a pool of `server.workers` threads, and a streaming call (Put, Get,
Prefetch, Prewarm) holds one for as long as its client keeps it open, reading or not. So at
most `max_streams` streams run at once (by default all workers but two, which stay free for
unary calls such as Lookup and for the health check), and at most
`max_streams_per_connection` on one client connection (by default as many: gRPC carries all
the channels of a client process on one connection, so a tighter default would cap an
engine's threads together), and at most `clients.max_streams` from one client (a peer
host, `client_of`; by default a quarter of the slots always stay for other clients). Past
any cap a new stream is refused at once with RESOURCE_EXHAUSTED naming the setting, instead
of queueing behind the others until every caller times out.

A stream that waits on its client (for the next Put message, or for the client to take the
next Get chunk) longer than `server.stream_idle_s` is aborted by `reap_idle`: the client gets
ABORTED naming the setting, the handler's blocked read or send fails at once, and the put's
pages or the read's lease go back. Time the daemon spends working for a stream (loading
from L3, waiting for a prefetch) is not idle time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar
from urllib.parse import unquote

import grpc
from google.rpc import status_pb2

from kvstore.core.errors import Reason, ResourceExhausted
from kvstore.daemon.config import Config, ServerConfig
from kvstore.daemon.faults import IDLE_SETTING, error_status

T = TypeVar("T")


def client_of(peer: str) -> str:
    """The caller's identity for the per-client caps (kvstore.core.holdings): its peer host,
    the port dropped, so all connections of one host count together ("ipv4:10.0.0.7",
    "ipv6:[::1]"); any other kind of peer (a Unix socket) as gRPC gives it."""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in address:
        return f"{kind}:{unquote(address.rpartition(':')[0])}"  # gRPC escapes [ and ]
    return peer


def stream_cap(server: ServerConfig) -> int:
    """server.max_streams, or when it is 0, every worker but two (at least one)."""
    return server.max_streams or max(1, server.workers - 2)


def client_stream_cap(config: Config) -> int:
    """clients.max_streams, or when it is 0, the stream cap less a quarter (at least one):
    the slots one client cannot take stay for the others."""
    cap = stream_cap(config.server)
    return config.clients.max_streams or max(1, cap - max(1, cap // 4))


class Stream:
    """One streaming call in flight, and since when (if at all) it waits on its client."""

    __slots__ = ("client", "_context", "waiting_since", "longest_wait_s", "aborted", "_why")

    def __init__(self, client: str, context: grpc.ServicerContext) -> None:
        self.client = client  # client_of its peer: whom its put or lease is charged to
        self._context = context
        self.waiting_since: float | None = None
        self.longest_wait_s = 0.0
        self.aborted = False  # by the reaper: its client sees ABORTED
        self._why = error_status(grpc.StatusCode.ABORTED, IDLE_SETTING, Reason.STREAM_IDLE,
                                 {"setting": IDLE_SETTING})

    def receive(self, messages: Iterable[T]) -> Iterator[T]:
        """The messages of the request stream, as they come; the time spent waiting for each
        next one counts as idle."""
        source = iter(messages)
        while True:
            self._wait()
            try:
                message = next(source)
            except StopIteration:
                return
            finally:
                self._work()
            yield message

    def send(self, messages: Iterable[T]) -> Iterator[T]:
        """The messages of the response stream; the time the client takes to accept each
        one counts as idle (gRPC resumes the generator once the message before is sent)."""
        for message in messages:
            self._wait()
            yield message
            self._work()

    def _wait(self) -> None:
        self.waiting_since = time.monotonic()

    def _work(self) -> None:
        since = self.waiting_since
        if since is not None:
            self.longest_wait_s = max(self.longest_wait_s, time.monotonic() - since)
        self.waiting_since = None

    def idle_status(self) -> status_pb2.Status:
        """What the call ends with once aborted idle: ABORTED, reason STREAM_IDLE."""
        return self._why

    def abort(self, details: str, idle_s: float) -> None:
        """End the call now with ABORTED (details as its message). gRPC's public cancel()
        carries no status, so the call's own cancel(code, details) is used where grpc has
        it (the client then reads why), the public one where not. A cancel sends no
        trailing metadata, so this ABORTED carries no ErrorInfo: a client reads an ABORTED
        without details whose message names server.stream_idle_s as STREAM_IDLE."""
        self._why = error_status(grpc.StatusCode.ABORTED, details, Reason.STREAM_IDLE,
                                 {"setting": IDLE_SETTING, "limit": f"{idle_s:g}"})
        self.aborted = True
        call = getattr(getattr(self._context, "_rpc_event", None), "call", None)
        try:
            call.cancel(grpc.StatusCode.ABORTED.value[0], details)  # type: ignore[union-attr]
        except (AttributeError, TypeError):
            self._context.cancel()


class StreamSlots:
    """Counts the streams in flight, in all, per client (client_of) and per connection
    (gRPC's peer string), and aborts those idle past server.stream_idle_s."""

    def __init__(self, config: Config) -> None:
        server = config.server
        self.limit = stream_cap(server)
        self.per_client = client_stream_cap(config)
        self.per_connection = server.max_streams_per_connection or self.limit
        self.idle_s = server.stream_idle_s
        self._lock = threading.Lock()
        self._by_peer: dict[str, int] = {}
        self._by_client: dict[str, int] = {}
        self._streams: set[Stream] = set()

    @property
    def in_flight(self) -> int:
        """How many streams run now."""
        return len(self._streams)

    @contextmanager
    def held(self, peer: str, context: grpc.ServicerContext,
             client: str | None = None) -> Iterator[Stream]:
        """Hold a slot for one stream of peer while the with-block runs; ResourceExhausted,
        naming the cap, when one of the caps is reached. client is whom the per-client cap
        counts the stream for (a tenant); by default the peer's host."""
        with self._lock:
            if len(self._streams) >= self.limit:
                raise ResourceExhausted(
                    f"{len(self._streams)} streams are in flight, the most the daemon runs at "
                    "once (server.max_streams): retry shortly, or raise server.workers",
                    Reason.TOO_MANY_STREAMS, limit=self.limit, setting="server.max_streams")
            if self._by_peer.get(peer, 0) >= self.per_connection:
                raise ResourceExhausted(
                    f"this connection has {self.per_connection} streams in flight "
                    "(server.max_streams_per_connection): finish or cancel one first",
                    Reason.TOO_MANY_STREAMS, limit=self.per_connection,
                    setting="server.max_streams_per_connection")
            client = client if client is not None else client_of(peer)
            if self._by_client.get(client, 0) >= self.per_client:
                raise ResourceExhausted(
                    f"this client ({client}) has {self.per_client} streams in flight, the "
                    "most one client may (clients.max_streams): finish or cancel one first",
                    Reason.TOO_MANY_STREAMS, limit=self.per_client, setting="clients.max_streams")
            stream = Stream(client, context)
            self._streams.add(stream)
            _count(self._by_peer, peer, 1)
            _count(self._by_client, client, 1)
        try:
            yield stream
        finally:
            with self._lock:
                self._streams.discard(stream)
                _count(self._by_peer, peer, -1)
                _count(self._by_client, client, -1)

    def reap_idle(self, now: float | None = None) -> int:
        """Abort every stream that has waited on its client for longer than idle_s, and
        return how many were aborted."""
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = [s for s in self._streams if not s.aborted and s.waiting_since is not None
                    and now - s.waiting_since > self.idle_s]
        for stream in idle:
            stream.abort(f"the stream sent or took nothing for {self.idle_s:g} s "
                         "(server.stream_idle_s); its pages and lease were let go", self.idle_s)
        return len(idle)

    def reap_forever(self, stop: threading.Event) -> None:
        """Run reap_idle() several times per idle_s until stop is set; this is the reaper
        thread's loop."""
        while not stop.wait(min(1.0, self.idle_s / 4)):
            self.reap_idle()


def _count(counts: dict[str, int], name: str, delta: int) -> None:
    left = counts.get(name, 0) + delta
    if left:
        counts[name] = left
    else:
        del counts[name]
