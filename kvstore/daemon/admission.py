"""Admission of streaming calls: the caps that keep a few slow or idle clients from taking
every RPC thread.

The daemon serves from a pool of `server.workers` threads, and a streaming call (Put, Get,
Prefetch, Prewarm) holds one for as long as its client keeps it open, reading or not. So at
most `max_streams` streams run at once (by default all workers but two, which stay free for
unary calls such as Lookup and for the health check), and at most
`max_streams_per_connection` on one client connection (by default as many: gRPC carries all
the channels of a client process on one connection, so a tighter default would cap an
engine's threads together). Past either cap a new stream is
refused at once with RESOURCE_EXHAUSTED naming the setting, instead of queueing behind the
others until every caller times out.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kvstore.core.errors import ResourceExhausted
from kvstore.daemon.config import ServerConfig


def stream_cap(server: ServerConfig) -> int:
    """server.max_streams, or when it is 0, every worker but two (at least one)."""
    return server.max_streams or max(1, server.workers - 2)


class StreamSlots:
    """Counts the streams in flight, in all and per connection (gRPC's peer string)."""

    def __init__(self, server: ServerConfig) -> None:
        self.limit = stream_cap(server)
        self.per_connection = server.max_streams_per_connection or self.limit
        self._lock = threading.Lock()
        self._by_peer: dict[str, int] = {}
        self.in_flight = 0

    @contextmanager
    def held(self, peer: str) -> Iterator[None]:
        """A slot for one stream of peer while the block runs; ResourceExhausted if none."""
        with self._lock:
            if self.in_flight >= self.limit:
                raise ResourceExhausted(
                    f"{self.in_flight} streams are in flight, the most the daemon runs at once "
                    "(server.max_streams): retry shortly, or raise server.workers")
            if self._by_peer.get(peer, 0) >= self.per_connection:
                raise ResourceExhausted(
                    f"this connection has {self.per_connection} streams in flight "
                    "(server.max_streams_per_connection): finish or cancel one first")
            self.in_flight += 1
            self._by_peer[peer] = self._by_peer.get(peer, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= 1
                left = self._by_peer[peer] - 1
                if left:
                    self._by_peer[peer] = left
                else:
                    del self._by_peer[peer]
