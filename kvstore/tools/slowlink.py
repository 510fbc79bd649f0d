"""A TCP proxy that slows a tier on purpose: every reply from the upstream (a redis-server, say)
is held for `delay_s` before it reaches the client, so the daemon's L4 behaves like a pool far
away on the network, without a mock anywhere. Tests and benchmarks of the load-or-recompute
rule use it to make a real tier slow, and can speed it up again by setting `delay_s`.

Per connection: a pump forwards the client's requests upstream at once; a reader stamps each
chunk of the upstream's replies with its arrival time and queues it; a sender passes each chunk
on at its own arrival + delay_s. Chunks keep their order, and a burst of chunks costs one delay,
not one per chunk (the reader never sleeps). Either side closing closes both.

Used by tests and bench/; not imported by the daemon or the client.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from types import TracebackType

CHUNK_BYTES = 64 << 10
_EOF = b""  # queued after the upstream's last reply: deliver what came before, then close


class SlowLink:
    """A TCP proxy on 127.0.0.1 that forwards to (host, port) and holds each chunk of the
    upstream's replies for `delay_s` before passing it on (requests pass at once), so every
    round trip through it takes at least delay_s more: a far-away Redis. Threads: per
    connection a request pump, a reply reader and a reply sender (the delay waits in the
    sender, never in the reader); closes both sides when either closes."""

    def __init__(self, host: str, port: int, delay_s: float) -> None:
        self.upstream = (host, port)
        self._delay_s = _checked(delay_s)
        # Guards the connections and delay_s; senders wait on it, so a new (shorter) delay
        # or a stop reaches a chunk already waiting.
        self._cv = threading.Condition()
        self._connections: set[_Connection] = set()
        self._listener: socket.socket | None = None
        self._port = 0
        self._acceptor: threading.Thread | None = None
        self._stopped = False

    @property
    def delay_s(self) -> float:
        """How long each reply chunk is held; settable while running (>= 0)."""
        return self._delay_s

    @delay_s.setter
    def delay_s(self, value: float) -> None:
        with self._cv:
            self._delay_s = _checked(value)
            self._cv.notify_all()

    @property
    def port(self) -> int:
        """The loopback port the proxy listens on (once started)."""
        if self._listener is None:
            raise RuntimeError("SlowLink is not started: call start() first")
        return self._port

    @property
    def url(self) -> str:
        """redis://127.0.0.1:<port>, for `remote.url`."""
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> SlowLink:
        """Listen on a free loopback port and accept connections in a thread."""
        if self._listener is not None:
            raise RuntimeError("SlowLink is already started")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        self._listener, self._port = listener, int(listener.getsockname()[1])
        self._acceptor = threading.Thread(target=self._accept_forever, args=(listener,),
                                          name=f"slowlink-accept-{self.port}", daemon=True)
        self._acceptor.start()
        return self

    def stop(self) -> None:
        """Close the listener and every connection (both sides); idempotent."""
        with self._cv:
            if self._stopped:
                return
            self._stopped = True
            connections = list(self._connections)
            self._cv.notify_all()
        for conn in connections:
            conn.close()
        if self._listener is not None:
            _shut(self._listener)  # wakes the acceptor out of accept()
            if self._acceptor is not None:
                self._acceptor.join(timeout=5)
            self._listener.close()
        for conn in connections:
            conn.join(timeout=5)

    def __enter__(self) -> SlowLink:
        return self if self._listener is not None else self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def connections(self) -> int:
        """Client connections open now."""
        with self._cv:
            return len(self._connections)

    def _accept_forever(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # the listener was shut by stop()
            conn = _Connection(self, client)
            with self._cv:
                if self._stopped:
                    client.close()
                    return
                self._connections.add(conn)
            conn.start()

    def _forget(self, conn: _Connection) -> None:
        with self._cv:
            self._connections.discard(conn)

    def _wait_until_due(self, arrived: float, conn: _Connection) -> bool:
        """Block until arrived + delay_s (delay_s as it is then); False if the connection or
        the proxy closed meanwhile."""
        with self._cv:
            while not (self._stopped or conn.closed):
                remaining = arrived + self._delay_s - time.monotonic()
                if remaining <= 0:
                    return True
                self._cv.wait(remaining)
            return False

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()


class _Connection:
    """One client and its upstream: a request pump, a reply reader and a reply sender."""

    def __init__(self, link: SlowLink, client: socket.socket) -> None:
        self.link = link
        self.client = client
        self.upstream: socket.socket | None = None
        self.replies: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
        self.closed = False
        self._close_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        pump = threading.Thread(target=self._pump_requests, name="slowlink-requests",
                                daemon=True)
        self._threads.append(pump)
        pump.start()

    def join(self, timeout: float) -> None:
        for t in list(self._threads):
            if t is not threading.current_thread():
                t.join(timeout)

    def close(self) -> None:
        """Shut both sockets, which wakes every thread blocked on them. The pump closes them
        once the other threads are done: a descriptor closed under a thread still reading it
        could be reused by a new socket and read by the wrong connection."""
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
        for sock in (self.client, self.upstream):
            if sock is not None:
                _shut(sock)
        self.link._forget(self)
        self.link._wake()

    def _pump_requests(self) -> None:
        """Connect upstream, start the reply threads, forward requests as they come; then
        close everything once the reply threads are done."""
        try:
            self._forward()
        finally:
            self.close()
            for t in self._threads[1:]:
                t.join()
            self.client.close()
            if self.upstream is not None:
                self.upstream.close()

    def _forward(self) -> None:
        try:
            upstream = socket.create_connection(self.link.upstream, timeout=5)
        except OSError:
            return  # the client sees its connection closed, as with a Redis that is down
        upstream.settimeout(None)
        for sock in (self.client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._close_lock:
            if self.closed:  # stopped while connecting
                upstream.close()
                return
            self.upstream = upstream
        for t in (threading.Thread(target=self._read_replies, args=(upstream,),
                                   name="slowlink-reader", daemon=True),
                  threading.Thread(target=self._send_replies, name="slowlink-sender",
                                   daemon=True)):
            self._threads.append(t)
            t.start()
        _copy(self.client, upstream)

    def _read_replies(self, upstream: socket.socket) -> None:
        """Stamp each reply chunk with its arrival time; never sleeps, so bursts do not add up."""
        while True:
            try:
                chunk = upstream.recv(CHUNK_BYTES)
            except OSError:
                chunk = _EOF
            self.replies.put((time.monotonic(), chunk))
            if chunk == _EOF:
                return

    def _send_replies(self) -> None:
        """Pass each chunk on at its arrival + delay_s; after the upstream's EOF, close."""
        while True:
            arrived, chunk = self.replies.get()
            if chunk == _EOF or not self.link._wait_until_due(arrived, self):
                break
            try:
                self.client.sendall(chunk)
            except OSError:
                break
        self.close()


def _copy(source: socket.socket, sink: socket.socket) -> None:
    """Forward source to sink until either fails or source reaches EOF."""
    while True:
        try:
            chunk = source.recv(CHUNK_BYTES)
            if not chunk:
                return
            sink.sendall(chunk)
        except OSError:
            return


def _shut(sock: socket.socket) -> None:
    """shutdown() both ways: wakes a thread blocked in recv or accept on it, unlike close()."""
    with contextlib.suppress(OSError):  # not connected, or already shut: nothing to wake
        sock.shutdown(socket.SHUT_RDWR)


def _checked(delay_s: float) -> float:
    if not delay_s >= 0:
        raise ValueError(f"delay_s must be >= 0 seconds, got {delay_s!r}")
    return float(delay_s)
