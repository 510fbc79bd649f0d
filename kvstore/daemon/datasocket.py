"""The data socket: INLINE Gets and Puts over TCP at socket speed, for engines on other hosts.

gRPC's Python binding sends and receives only `bytes`, so each payload is copied once more on
each side than a socket needs (bench/store_bench.py: an INLINE Get moves about half what a
bare gRPC stream does at 256 KiB). Here the local path's framing (`kvstore.proto.localframe`,
`kvstore.proto.dataframe` for the two verbs that carry payloads) runs over TCP: the daemon
sends a Get's blocks straight from its L2 pages (`socket.sendmsg` of views over them, under
the read's lease, which keeps the pages from reuse while they are sent) and receives a Put's
bytes straight into the pages a reservation planned for them (`recv_into`), hashing each
piece as it lands. gRPC stays the complete contract; this socket serves Lookup, Release and
the two data verbs only, and clients fall back to gRPC on any refusal.

It is the local path (`kvstore.daemon.localpath`) with another way in: the same tickets
(Attach over gRPC; the handshake's `HOT <ticket>` line redeems one), the same per-tenant
auth and re-check of the tenant on every request, the same caps (sessions in all and per
client, the idle limit, the frame deadline, max_frame_bytes for a request's message), the
same reader of frames, the same error replies. What differs:

- the listener: server.data_port on server.host, TLS when the gRPC port has TLS (the same
  files, re-read when they change; a client certificate required with auth.mode=mtls);
- the client an auth-off session is charged to: its IP address (`tcp:<address>`), as
  SO_PEERCRED names no process across hosts;
- a payload's deadline: the frame's, plus one second per PAYLOAD_BYTES_PER_S of payload;
- handshakes: each runs on a short-lived thread, bounded by EXCHANGE_TIMEOUT_S from accept
  to its line (TLS included); at most MAX_PENDING at once, MAX_PENDING_PER_PEER per address;
  a connection over a cap is closed at once (the Unix socket instead closes the oldest
  pending one: there a peer is a process of this host, here it may be anyone).

With TLS, payloads go through the TLS layer (which copies them into its records); sendmsg's
zero-copy send is for plaintext, which a trusted network (a pod network with its own
encryption) may choose.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from kvstore.core.errors import (
    InvalidArgument,
    Reason,
    ResourceExhausted,
    StartupError,
)
from kvstore.core.tenants import OPEN
from kvstore.daemon.attach import (
    EXCHANGE_TIMEOUT_S,
    MAX_PENDING,
    MAX_PENDING_PER_PEER,
    MAX_TICKET_LINE,
    Tickets,
)
from kvstore.daemon.auth import Auth, Caller
from kvstore.daemon.config import Config
from kvstore.daemon.faults import FaultLog, decoder, parsed
from kvstore.daemon.localpath import (
    SESSION_MAX_S,
    LocalSessions,
    _Broken,
    _Frames,
    _Session,
    send_line,
    send_reply,
)
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.verbs import MAX_LEASE_S, Verbs
from kvstore.proto.dataframe import (
    GET_DATA,
    MAX_IOV,
    PAYLOAD_BYTES_PER_S,
    PUT_DATA,
    TRAILER_OK,
    advanced,
)
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.localframe import CLOSING, LOOKUP, RELEASE, REPLY, VERSION

log = logging.getLogger(__name__)

DATA_VERBS = (LOOKUP, RELEASE, GET_DATA, PUT_DATA)
#: A Put's reservation outlives its payload's deadline by this much, so its pages are never
#: handed to another writer while this session still writes into them.
RESERVE_MARGIN_S = 5.0
#: Buffers per sendmsg call (Linux takes up to 1024, IOV_MAX).
ACCEPT_POLL_S = 0.5  #: how often the accept loop looks whether the daemon stops

#: A Get's reply must be sent whole this long (at most a quarter of the lease) before its
#: lease would expire.
LEASE_MARGIN_S = 1.0
_TRAILER_OK = bytes((TRAILER_OK,))


class _Gauge:
    """Where the local path's code counts its open sessions: a number of this socket's own,
    so the Unix socket's gauge (kvstore_local_sessions) counts only its own sessions."""

    def __init__(self) -> None:
        self.value = 0

    def set(self, value: float) -> None:
        self.value = int(value)


class _Metrics:
    """The daemon's metrics as the local path's code sees them from here: this socket's
    requests are counted as RPCs of their method (kvstore_rpc_*), not as local requests."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self.local_sessions = _Gauge()

    def observe_local(self, method: str, code: str, latency_s: float) -> None:
        self._metrics.observe_rpc(method, code, latency_s)


class _DataFrames(_Frames):
    """A session's frames (the local path's reader), and the raw payloads that follow a
    PUT_DATA frame, read by the same deadline, extended for the payload's size."""

    _timeout_s = 0.0  # the socket's timeout as fill_hashed last set it (0: set it anew)

    def extend_for(self, payload_bytes: int) -> None:
        """The frame's deadline, extended by a second per PAYLOAD_BYTES_PER_S of payload."""
        self._deadline += payload_bytes / PAYLOAD_BYTES_PER_S
        self._timeout_s = 0.0

    def left_s(self) -> float:
        return max(0.0, self._deadline - self._clock())

    def fill_hashed(self, view: memoryview, hasher: Any) -> None:
        """view filled with the payload's next bytes, each piece hashed as it lands (still
        in cache). The socket's timeout is set again only when less than half of it is left
        before the deadline (each setting is a system call, and a 2 MiB block arrives in
        tens of reads), so a payload is cut within 1.5x of its deadline at worst."""
        conn, clock, deadline = self._conn, self._clock, self._deadline
        got, size = 0, len(view)
        try:
            while got < size:
                left_s = deadline - clock()
                if left_s <= 0:
                    raise _Broken(f"a frame was not whole within {self._frame_timeout_s:g} s")
                if left_s < self._timeout_s / 2 or not self._timeout_s:
                    self._timeout_s = left_s
                    conn.settimeout(left_s)
                with view[got:] as part:
                    k = conn.recv_into(part)
                if k == 0:
                    raise _Broken("the client closed the session inside a frame")
                with view[got:got + k] as piece:
                    hasher.update(piece)
                got += k
        except TimeoutError:
            raise _Broken(f"a frame was not whole within {self._frame_timeout_s:g} s") \
                from None

    def drop(self, length: int) -> None:
        """Read and drop length payload bytes (a key that exists, a refused put)."""
        self._skip(length)
        self._timeout_s = 0.0  # _skip set the socket's timeout its own way

    def _arrival(self) -> None:
        """As the local path's, for a TLS session too (which cannot peek): its socket
        readable, or bytes already decrypted."""
        if not isinstance(self._conn, ssl.SSLSocket):
            super()._arrival()
            return
        if self._conn.pending():
            return
        left_s = self._deadline - self._clock()
        if left_s <= 0 or not select.select([self._conn], [], [], left_s)[0]:
            raise _Broken(f"a frame was not whole within {self._frame_timeout_s:g} s")


class DataSessions(LocalSessions):
    """The sessions a daemon serves on its data socket; one thread each. Thread-safe.

    Everything but the transport is the local path's: this class only names auth-off
    clients by address, answers the handshake without read tables, and adds the two verbs
    whose payloads follow their frames (see the module's docstring)."""

    def __init__(self, verbs: Verbs, auth: Auth, tickets: Tickets, metrics: Metrics,
                 faults: FaultLog, draining: threading.Event, max_frame_bytes: int,
                 clock: Callable[[], float] = time.monotonic, **limits: float) -> None:
        self.counted = _Metrics(metrics)
        super().__init__(verbs, auth, tickets, self.counted, faults,  # type: ignore[arg-type]
                         draining, max_frame_bytes, clock, **limits)
        self._verbs = {verb: entry for verb, entry in self._verbs.items()
                       if verb in (LOOKUP, RELEASE)}
        self._data = verbs
        self._max_payload = verbs.config.server.max_response_bytes

    @property
    def open_sessions(self) -> int:
        """Sessions open now (for tests and the banner)."""
        return self.counted.local_sessions.value

    def _caller(self, conn: socket.socket, ticket: str) -> Caller:
        if not self._auth.on:
            return Caller(OPEN, tcp_client(conn))
        return super()._caller(conn, ticket)

    def _welcome(self, conn: socket.socket, caller: Caller, tables: bool) -> None:
        """The handshake's answer; read tables are shared memory, which a host away has not
        (asked for, none are named)."""
        hot: dict[str, object] = {"version": VERSION, "max_frame_bytes": self.max_frame_bytes}
        if tables:
            hot["tables"] = []
        send_line(conn, {"hot": hot})

    def _run(self, session: _Session, caller: Caller) -> None:
        born = self._clock()
        frames = _DataFrames(session.conn, self.max_frame_bytes, self._frame_timeout_s,
                             self._clock)
        conn = session.conn
        while True:
            session.idle_since = self._clock()
            begun = frames.wait(self._idle_limit_s)
            session.idle_since = None
            if not begun:
                return
            verb, body = frames.read()
            closing = self._clock() - born >= SESSION_MAX_S
            if verb == GET_DATA:
                self._get(conn, caller, body, closing)
            elif verb == PUT_DATA:
                closing = self._put(frames, caller, body, closing) or closing
            else:
                if verb not in DATA_VERBS:
                    status, reply = self._refuse_verb(caller, verb)
                else:
                    status, reply = self._answer(caller, verb, body)
                send_reply(conn, status, reply, closing)
            if closing:
                return

    def _refuse_verb(self, caller: Caller, verb: int) -> tuple[int, bytes]:
        return self._failed("Unknown", caller, InvalidArgument(
            f"verb {verb} is not a data-socket verb ({', '.join(map(str, DATA_VERBS))})",
            field="verb"), time.perf_counter())

    def _checked(self, caller: Caller, body: bytes | None, method: str, message: Any,
                 request: Any = None) -> tuple[Caller, Any]:
        """As the local path's answer checks every request (the frame's size, the drain,
        the tenant as the tenants file says now); then the message parsed (unless it was:
        request)."""
        if body is None:
            raise self._too_large()
        caller = self._admitted(caller, method)
        return caller, request if request is not None else parsed(decoder(message)(body))

    # --- GET_DATA -------------------------------------------------------------------------

    def _get(self, conn: socket.socket, caller: Caller, body: bytes | None,
             closing: bool) -> None:
        """Answer an INLINE Get: its header, the found blocks from their pages and the
        trailer, gathered into as few sends as the socket takes, all by a deadline inside the
        read's lease (so no page is reused while it is sent, and the trailer is sent as soon
        as the last byte is); the lease is released after the reply, off the client's wait.
        A reply that cannot be sent by then ends the session."""
        started = time.perf_counter()
        clock = self._store.state.clock
        try:
            caller, request = self._checked(caller, body, "Get", pb.GetRequest)
            caller.data(request.namespace)
            shared, timeout_s, _ = self._data.get_options(request)
            if shared:
                raise InvalidArgument("mode: the data socket streams INLINE Gets; a "
                                      "SHARED_MEMORY Get is the local path's", field="mode")
            # Taken before the read, so the lease (timeout_s from inside it) outlives it.
            deadline = clock() + timeout_s - min(LEASE_MARGIN_S, timeout_s / 4)
            result = self._store.reader.read(request.namespace, request.keys, timeout_s, True,
                                             caller.client, inline=True)
        except Exception as exc:
            send_reply(conn, *self._failed("Get", caller, exc, started), closing)
            return
        head = self._data.header(result).SerializeToString()
        held = any(e is not None for e in result.entries)
        try:
            views = [memoryview(REPLY.pack(len(head), 0, CLOSING if closing else 0) + head)]
            if held:
                tier = self._store.state.dram
                assert tier is not None, "a read with hits came from L2"
                views.extend(v for extents in result.extents for v in tier.views(extents))
            views.append(memoryview(_TRAILER_OK))
            _send_by(conn, views, deadline, clock)
        finally:
            if held:
                self._release(result.lease_id)
        self.counted.observe_local("Get", "OK", time.perf_counter() - started)

    def _release(self, lease_id: str) -> None:
        """End a Get's lease once its reply is out. It cannot have expired: the reply's
        deadline is inside it (an error here is a clock gone wrong, logged)."""
        try:
            self._store.reader.release([lease_id])
        except InvalidArgument as exc:
            log.warning("data socket: a Get's lease had ended before its reply was sent "
                        "whole: %s", exc)

    # --- PUT_DATA -------------------------------------------------------------------------

    def _put(self, frames: _DataFrames, caller: Caller, body: bytes | None,
             closing: bool) -> bool:
        """Answer a Put whose payloads follow its frame. True when the session must close
        (its payload could not be delimited, so the stream cannot be read on)."""
        conn = frames._conn
        started = time.perf_counter()
        try:
            request, total = self._payload_bytes(body)
        except Exception as exc:
            send_reply(conn, *self._failed("Put", caller, exc, started), True)
            return True
        frames.extend_for(total)
        try:
            caller, request = self._checked(caller, body, "Put", pb.PutRequest, request)
            caller.data(request.namespace)
            if request.reservation_id or request.data:
                field = "reservation_id" if request.reservation_id else "data"
                raise InvalidArgument(f"{field}: a data-socket Put carries its bytes after "
                                      "its frame; commits are the local path's", field=field)
        except Exception as exc:
            frames.drop(total)
            send_reply(conn, *self._failed("Put", caller, exc, started), closing)
            return False
        try:
            response = self._receive_put(frames, caller, request, total)
        except _Broken:
            raise
        except Exception as exc:
            send_reply(conn, *self._failed("Put", caller, exc, started), closing)
            return False
        reply = response.SerializeToString()
        send_reply(conn, 0, reply, closing)
        self.counted.observe_local("Put", "OK", time.perf_counter() - started)
        return False

    def _payload_bytes(self, body: bytes | None) -> tuple[pb.PutRequest, int]:
        """A PUT_DATA frame's payload size, sum(sizes); an error when it cannot be known or
        is over server.max_response_bytes (the session then closes)."""
        if body is None:
            raise self._too_large()
        request = parsed(decoder(pb.PutRequest)(body))
        total = sum(request.sizes)
        if total > self._max_payload:
            raise ResourceExhausted(
                f"sizes: a data-socket Put of {total} bytes is over server.max_response_bytes "
                f"({self._max_payload}); split it", Reason.MESSAGE_TOO_LARGE,
                limit=self._max_payload, setting="server.max_response_bytes")
        return request, int(total)

    def _receive_put(self, frames: _DataFrames, caller: Caller, request: pb.PutRequest,
                     total: int) -> pb.PutResponse:
        """Reserve the put's pages, receive each new block's bytes straight into them (the
        bytes of keys already stored are read and dropped), and commit them with the
        checksums hashed as they arrived. Any failure gives the pages back; a failure
        before the whole payload was read ends the session (_Broken)."""
        config = self._store.config
        timeout_s = min(float(MAX_LEASE_S), max(config.leases.reservation_timeout_s,
                                                frames.left_s() + RESERVE_MARGIN_S))
        writer = self._store.writer
        try:
            reserved = writer.reserve(request.namespace, request.keys, request.sizes,
                                      request.parent_key, request.independent, timeout_s,
                                      caller.client)
        except Exception:
            frames.drop(total)
            raise
        committed = False
        try:
            sums = self._receive_blocks(frames, request.sizes, reserved.exists,
                                        reserved.extents)
            _check_sums(request.checksums, sums, reserved.exists)
            result = writer.commit_reservation(request.namespace, reserved.reservation_id,
                                               sums)
            committed = True
        finally:
            if not committed:
                writer.abort(reserved.reservation_id)
        return pb.PutResponse(stored=result.stored, existing=result.existing,
                              evicted=result.evicted)

    def _receive_blocks(self, frames: _DataFrames, sizes: Sequence[int],
                        exists: Sequence[bool], extents: Sequence[Sequence[tuple[int, int]]]
                        ) -> list[int]:
        """Each block's bytes into its reserved pages (dropped for a key that exists), and
        its checksum (0 for a key that exists, which commit ignores)."""
        tier = self._store.state.dram
        assert tier is not None, "a reservation is of L2 pages"
        sums: list[int] = []
        for size, there, where in zip(sizes, exists, extents, strict=True):
            if there:
                frames.drop(size)
                sums.append(0)
                continue
            hasher = xxhash.xxh3_64()
            for view in tier.views(where):
                frames.fill_hashed(view, hasher)
            sums.append(hasher.intdigest())
        return sums


def _check_sums(given: Sequence[int], sums: Sequence[int], exists: Sequence[bool]) -> None:
    """The writer's checksums, when it sent them, against the bytes as they arrived."""
    if not given:
        return
    if len(given) != len(sums):
        raise InvalidArgument(f"checksums: {len(given)} values for {len(sums)} keys (one per "
                              "key, or none)", field="checksums")
    for i, (want, got) in enumerate(zip(given, sums, strict=True)):
        if not exists[i] and want != got:
            raise InvalidArgument(f"checksums[{i}] does not match the bytes received",
                                  Reason.CHECKSUM_MISMATCH, field=f"checksums[{i}]")


def _send_by(conn: socket.socket, views: list[memoryview], deadline: float,
             clock: Callable[[], float]) -> None:
    """views sent in order, every byte by deadline (_Broken past it): gathered, up to
    MAX_IOV to a sendmsg call and without a copy, in plaintext; one sendall each through
    TLS, which copies into its records anyway. Each call waits at most until deadline."""
    def wait_s() -> float:
        left_s = deadline - clock()
        if left_s <= 0:
            raise _Broken("a Get's reply was not sent whole within its lease")
        return left_s

    try:
        if isinstance(conn, ssl.SSLSocket):
            for view in views:
                conn.settimeout(wait_s())
                conn.sendall(view)
            return
        pending = views
        while pending:
            conn.settimeout(wait_s())
            sent = conn.sendmsg(pending[:MAX_IOV])
            pending = advanced(pending, sent)
    except TimeoutError:
        raise _Broken("a Get's reply was not sent whole within its lease") from None


def tcp_client(conn: socket.socket) -> str:
    """The client an auth-off data session is charged to: its address, `tcp:<address>`."""
    try:
        return f"tcp:{conn.getpeername()[0]}"
    except OSError:
        return "tcp:unknown"


class _TlsFiles:
    """The gRPC port's TLS files as an ssl context, made again when one of them changes
    (looked at on each handshake), as the gRPC port re-reads them."""

    def __init__(self, config: Config) -> None:
        s = config.server
        self._files = [s.tls_cert_file, s.tls_key_file] + (
            [s.tls_client_ca_file] if s.tls_client_ca_file else [])
        self._mtls = config.auth.mode == "mtls"
        self._stamp = self._stamps()
        self.context = self._load()

    def _stamps(self) -> tuple[float, ...]:
        try:
            return tuple(os.stat(path).st_mtime for path in self._files)
        except OSError:
            return ()

    def _load(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self._files[0], self._files[1])
            if len(self._files) > 2:
                context.load_verify_locations(self._files[2])
        except (OSError, ssl.SSLError) as exc:
            raise StartupError(f"server.tls_cert_file / server.tls_key_file: the data socket "
                               f"cannot load them: {exc}") from None
        context.verify_mode = ssl.CERT_REQUIRED if self._mtls else ssl.CERT_NONE
        return context

    def current(self) -> ssl.SSLContext:
        now = self._stamps()
        if now and now != self._stamp:
            try:
                self.context = self._load()
                self._stamp = now
                log.info("data socket: TLS certificate files changed; serving the new ones")
            except StartupError as exc:
                log.error("data socket: TLS files changed but cannot be read; serving the old "
                          "ones: %s", exc)
        return self.context


class DataSocket:
    """The TCP listener of the data socket on sock (`bind_data_port`'s, bound before the
    daemon opens its store), served by start(), stopped by close(). Each accepted
    connection's handshake (TLS, then its line) runs on a thread of its own, bounded by
    exchange_timeout_s; a line `HOT <ticket>` is handed to the sessions."""

    def __init__(self, config: Config, sessions: DataSessions, sock: socket.socket, *,
                 exchange_timeout_s: float = EXCHANGE_TIMEOUT_S,
                 max_pending: int = MAX_PENDING,
                 max_pending_per_peer: int = MAX_PENDING_PER_PEER) -> None:
        self._sessions = sessions
        self._timeout_s = exchange_timeout_s
        self._max_pending = max_pending
        self._max_per_peer = max_pending_per_peer
        self._tls = _TlsFiles(config) if config.server.tls_cert_file else None
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}  # address -> handshakes in progress
        self._stop = threading.Event()
        self._sock = sock
        self.port: int = self._sock.getsockname()[1]
        self.tls = self._tls is not None
        self._thread = threading.Thread(target=self._serve, name="data-socket", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop accepting (sessions already open are the sessions' to end)."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=2 * ACCEPT_POLL_S)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                log.warning("data socket: accept failed: %s", exc)
                self._stop.wait(0.1)
                continue
            peer = str(addr[0])
            if not self._enter(peer):
                log.debug("data socket: closed a connection of %s over the pending "
                          "handshakes' caps", peer)
                conn.close()
                continue
            try:
                threading.Thread(target=self._handshake, args=(conn, peer),
                                 name="data-handshake", daemon=True).start()
            except RuntimeError as exc:
                log.warning("data socket: no thread for a handshake: %s", exc)
                self._leave(peer)
                conn.close()

    def _enter(self, peer: str) -> bool:
        with self._lock:
            if sum(self._pending.values()) >= self._max_pending or \
                    self._pending.get(peer, 0) >= self._max_per_peer:
                return False
            self._pending[peer] = self._pending.get(peer, 0) + 1
            return True

    def _leave(self, peer: str) -> None:
        with self._lock:
            left = self._pending.get(peer, 1) - 1
            if left:
                self._pending[peer] = left
            else:
                self._pending.pop(peer, None)

    @property
    def pending(self) -> int:
        with self._lock:
            return sum(self._pending.values())

    def _handshake(self, conn: socket.socket, peer: str) -> None:
        """TLS (when on) and the line, by one deadline; then the session, or a refusal."""
        deadline = time.monotonic() + self._timeout_s
        owned = False
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                conn.settimeout(self._timeout_s)
                conn = self._tls.current().wrap_socket(conn, server_side=True)
            line = _read_line(conn, deadline, self._timeout_s)
            verb, _, rest = line.partition(" ")
            if verb != "HOT":
                _refuse(conn, "the data socket opens sessions only: send `HOT <ticket>`",
                        Reason.UNAUTHENTICATED)
                return
            conn.settimeout(self._timeout_s)  # for the answer; the session sets its own
            owned = self._sessions.open(conn, rest.strip())
        except (OSError, ValueError, _LineError) as exc:
            log.debug("data socket: a handshake of %s failed: %s", peer, exc)
            if isinstance(exc, _LineError):
                _refuse(conn, str(exc), Reason.UNAUTHENTICATED)
        finally:
            self._leave(peer)
            if not owned:
                with contextlib.suppress(OSError):
                    conn.close()


class _LineError(Exception):
    """A handshake line that cannot be one."""


def _read_line(conn: socket.socket, deadline: float, timeout_s: float) -> str:
    """The handshake's line, a byte at a time (nothing past its newline is consumed), by
    the deadline (timeout_s after accept, named in the error); _LineError when it is not a
    line of ASCII under MAX_TICKET_LINE bytes."""
    data = bytearray()
    while True:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise _LineError(f"no ticket line within {timeout_s:g} s of connecting")
        conn.settimeout(left_s)
        try:
            b = conn.recv(1)
        except TimeoutError:
            raise _LineError(f"no ticket line within {timeout_s:g} s of "
                             "connecting") from None
        if not b:
            raise OSError("the connection ended before the ticket line's newline")
        if b == b"\n":
            break
        data += b
        if len(data) > MAX_TICKET_LINE:
            raise _LineError(f"the ticket line is over {MAX_TICKET_LINE} bytes")
    try:
        return data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise _LineError("the ticket line is not ASCII") from None


def _refuse(conn: socket.socket, message: str, reason: str) -> None:
    """Refuse a handshake (as the sessions' refusals are sent), best effort: the connection
    is closed next either way."""
    with contextlib.suppress(OSError):
        conn.settimeout(0.2)
        send_line(conn, {"error": message, "reason": reason})


def bind_data_port(config: Config) -> socket.socket | None:
    """The data socket's listening socket (server.data_port on server.host), bound before
    the daemon opens its store; None when server.data_port is -1 (off)."""
    if config.server.data_port < 0:
        return None
    return _bind(config.server.host, config.server.data_port)


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket on host:port (0: any free port); StartupError naming
    server.data_port when it cannot listen."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise StartupError(f"server.data_port {port}: cannot listen on {host}: {exc}") \
            from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
        sock.settimeout(ACCEPT_POLL_S)
    except OSError as exc:
        sock.close()
        raise StartupError(f"server.data_port {port}: cannot listen on {host}:{port}: "
                           f"{exc.strerror or exc}; choose another port (--set "
                           "server.data_port=N, 0 for any free port, -1 for none)") from None
    return sock

