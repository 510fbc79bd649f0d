"""Local sessions: the hot verbs on the daemon's Unix socket, for co-located clients.

A gRPC call costs a co-located client more than the work it asks for (0.6-1 ms per call on
a 2-core machine against 0.04 ms for a Unix-socket round trip of the same bytes), so a
client on this host may send its hot verbs over the socket instead. Same messages, same
checks, same answers as over gRPC (the logic is `kvstore.daemon.verbs`, shared); gRPC stays
the complete contract and every verb works over it alone.

The handshake and the frames are `kvstore.proto.localframe`'s, which the client imports
too. A session is closed after the reply that passes SESSION_MAX_S (flags bit 0: the client
opens a new one, with a fresh ticket, so a revoked tenant does not keep a session). A frame
over max_frame_bytes or an unknown verb is answered with an error; a broken frame closes
the session.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvstore.core.errors import (
    InvalidArgument,
    Reason,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvstore.core.tenants import OPEN
from kvstore.daemon.attach import Tickets
from kvstore.daemon.auth import Auth, Caller
from kvstore.daemon.faults import FaultLog, code_of, decoder, described, parsed
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.verbs import Verbs
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.localframe import (
    CLOSING,
    COMMIT,
    GET,
    LOOKUP,
    RELEASE,
    REPLY,
    REQUEST,
    RESERVE,
    STATUS_BODY,
    VERB_NAMES,
    VERSION,
)

log = logging.getLogger(__name__)

MAX_SESSIONS = 256  #: local sessions open at once, all clients together
MAX_SESSIONS_PER_CLIENT = 32  #: per tenant (auth on) or per host (auth off)
SESSION_MAX_S = 300.0  #: a session is closed after the reply that passes this age
FRAME_TIMEOUT_S = 10.0  #: a frame begun must arrive whole within this
LOCAL_CLIENT = "unix:local"  #: whom auth-off sessions' holdings are charged to

Handler = Callable[[Caller, Any], Any]


def _verbs(v: Verbs) -> dict[int, tuple[str, Callable[[bytes], Any], Handler]]:
    handlers: dict[int, tuple[Callable[[bytes], Any], Handler]] = {
        LOOKUP: (decoder(pb.LookupRequest), v.lookup),
        GET: (decoder(pb.GetRequest), v.get_shared),
        RESERVE: (decoder(pb.ReserveRequest), v.reserve),
        COMMIT: (decoder(pb.PutRequest), v.commit),
        RELEASE: (decoder(pb.ReleaseRequest), v.release),
    }
    return {verb: (VERB_NAMES[verb], *handler) for verb, handler in handlers.items()}


class LocalSessions:
    """The sessions a daemon serves on its Unix socket; one thread each. Thread-safe."""

    def __init__(self, verbs: Verbs, auth: Auth, tickets: Tickets, metrics: Metrics,
                 faults: FaultLog, draining: threading.Event, max_frame_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._verbs = _verbs(verbs)
        self._auth = auth
        self._tickets = tickets
        self._metrics = metrics
        self._faults = faults
        self._draining = draining
        self.max_frame_bytes = max_frame_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._open: dict[socket.socket, str] = {}  # session -> client

    def open(self, conn: socket.socket, ticket: str) -> bool:
        """Answer a `HOT <ticket>` handshake; on success the session runs on its own thread
        and owns conn (True). Else the refusal is sent and the caller closes conn."""
        ticket = (ticket.split() or ["-"])[0]
        try:
            caller = self._caller(ticket)
        except Unauthenticated as exc:
            _send_line(conn, {"error": str(exc), "reason": exc.reason})
            return False
        with self._lock:
            mine = sum(1 for c in self._open.values() if c == caller.client)
            if len(self._open) >= MAX_SESSIONS or mine >= MAX_SESSIONS_PER_CLIENT:
                refusal = (f"{len(self._open)} local sessions are open ({mine} of this "
                           f"client's); at most {MAX_SESSIONS} ({MAX_SESSIONS_PER_CLIENT} per "
                           "client): use gRPC, or close idle clients")
            else:
                refusal = ""
                self._open[conn] = caller.client
                self._metrics.local_sessions.set(len(self._open))
        if refusal:
            _send_line(conn, {"error": refusal, "reason": Reason.TOO_MANY_SESSIONS})
            return False
        try:
            _send_line(conn, {"hot": {"version": VERSION,
                                      "max_frame_bytes": self.max_frame_bytes}})
        except OSError:
            self._forget(conn)
            return False
        threading.Thread(target=self._serve, args=(conn, caller), name="local-session",
                         daemon=True).start()
        return True

    def close(self) -> None:
        """End every session (the daemon stops): their clients see the socket close."""
        with self._lock:
            sessions = list(self._open)
        for conn in sessions:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _caller(self, ticket: str) -> Caller:
        if not self._auth.on:
            return Caller(OPEN, LOCAL_CLIENT)
        tenant = self._tickets.redeem(ticket) if ticket and ticket != "-" else None
        if tenant is None:
            raise Unauthenticated("unknown, used or expired ticket (call Attach again, and "
                                  "redeem it within 30 s)")
        return self._current(tenant)

    def _current(self, name: str) -> Caller:
        """The tenant as the tenants file says now (re-read on SIGHUP): removed, it is
        refused from its next request on."""
        tenant = self._auth.tenants.named(name)
        if tenant is None:
            raise Unauthenticated(f"tenant {name!r} is no longer in auth.tenants_file")
        return Caller(tenant, tenant.name)

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._open.pop(conn, None)
            self._metrics.local_sessions.set(len(self._open))

    def _serve(self, conn: socket.socket, caller: Caller) -> None:
        born = self._clock()
        buffer = bytearray(64 * 1024)
        try:
            with conn:
                while True:
                    frame = _receive(conn, buffer, self.max_frame_bytes)
                    if frame is None:
                        return
                    verb, body = frame
                    closing = self._clock() - born >= SESSION_MAX_S
                    status, reply = self._answer(caller, verb, body)
                    flags = (CLOSING if closing else 0) | (STATUS_BODY if status else 0)
                    conn.sendall(REPLY.pack(len(reply), status, flags) + reply)
                    if closing:
                        return
        except (OSError, _Broken) as exc:
            log.debug("local session ended: %s", exc)
        finally:
            self._forget(conn)

    def _answer(self, caller: Caller, verb: int, body: memoryview | None) -> tuple[int, bytes]:
        """(status, reply bytes) of one request; an error's bytes are a serialized
        google.rpc.Status with its ErrorInfo."""
        started = time.perf_counter()
        entry = self._verbs.get(verb)
        method = entry[0] if entry else "Unknown"
        try:
            if body is None:
                raise ResourceExhausted(f"the frame is over max_frame_bytes "
                                        f"({self.max_frame_bytes}, server.max_message_bytes)",
                                        Reason.MESSAGE_TOO_LARGE, limit=self.max_frame_bytes,
                                        setting="server.max_message_bytes")
            if entry is None:
                raise InvalidArgument(f"verb {verb} is not a local verb (1..5)", field="verb")
            if self._draining.is_set() and method != "Release":
                raise Unavailable("the daemon is draining (it is stopping): retry on another "
                                  "replica or after its restart", Reason.DRAINING)
            if self._auth.on:
                caller = self._current(caller.tenant.name)
            request = parsed(entry[1](bytes(body)))
            response = entry[2](caller, request)
        except Exception as exc:
            status = described(exc)
            code = code_of(status)
            self._metrics.observe_local(method, code.name, time.perf_counter() - started)
            self._faults.fault(method, LOCAL_CLIENT, code, status.message)
            return status.code, status.SerializeToString()
        self._metrics.observe_local(method, "OK", time.perf_counter() - started)
        return 0, response.SerializeToString()


class _Broken(Exception):
    """A frame that cannot be read whole: the session ends."""


def _receive(conn: socket.socket, buffer: bytearray,
             limit: int) -> tuple[int, memoryview | None] | None:
    """The next (verb, body) — body None when over limit (its bytes skipped) — or None when
    the client closed the session between frames."""
    conn.settimeout(None)  # idle between frames costs this thread only
    head = _read(conn, REQUEST.size, bytearray(REQUEST.size), first=True)
    if head is None:
        return None
    length, verb = REQUEST.unpack(head)
    conn.settimeout(FRAME_TIMEOUT_S)
    if length > limit:
        _skip(conn, length)
        return verb, None
    if len(buffer) < length:
        buffer.extend(bytes(length - len(buffer)))
    body = _read(conn, length, buffer)
    assert body is not None
    return verb, body


def _read(conn: socket.socket, n: int, buffer: bytearray,
          first: bool = False) -> memoryview | None:
    view = memoryview(buffer)[:n]
    got = 0
    while got < n:
        try:
            k = conn.recv_into(view[got:])
        except TimeoutError:
            raise _Broken(f"a frame stalled for {FRAME_TIMEOUT_S} s") from None
        if k == 0:
            if first and got == 0:
                return None
            raise _Broken("the client closed the session inside a frame")
        got += k
    return view


def _skip(conn: socket.socket, n: int) -> None:
    scratch = bytearray(min(n, 1 << 20))
    while n:
        k = conn.recv_into(scratch, min(n, len(scratch)))
        if k == 0:
            raise _Broken("the client closed the session inside a frame")
        n -= k


def _send_line(conn: socket.socket, message: dict[str, object]) -> None:
    conn.sendall((json.dumps(message) + "\n").encode())
