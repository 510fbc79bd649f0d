"""Handing a tenant's shared-memory arenas to its co-located clients, and the handshakes of
local sessions, on the daemon's Unix socket.

A client calls Attach over gRPC (authenticated like any call) and gets a ticket: random,
good once, for ATTACH_TICKET_S. It then connects to the daemon's Unix socket
(server.unix_socket), sends the ticket and a newline, and receives one JSON line
`{"arenas": [{"name": ..., "size_bytes": N}, ...]}` with one file descriptor per arena
(SCM_RIGHTS), or `{"error": "...", "reason": "..."}` and no descriptor. The descriptors are of
its tenant's arenas only, so no client can map another tenant's memory: there is nothing to
open by name. A line `HOT <ticket>` instead opens a local session (kvstore.daemon.localpath),
which takes the connection over.

Anyone who reaches the socket's folder may connect (the ticket, not the file mode, is the
credential), so no connection may keep the socket from others. One thread serves every
handshake: it accepts, reads each connection's line as its bytes arrive (never waiting on
one), and answers the moment the newline comes. A handshake has EXCHANGE_TIMEOUT_S from
accept to its newline, in all, however its bytes trickle in. Handshakes waiting for their line
are capped per peer process (SO_PEERCRED) and in all; a new connection over a cap closes the
oldest pending one, not itself: a real client writes its whole line right after connecting,
so it is answered within a turn of the loop, and the oldest is the likeliest to be a
slowloris. Descriptors a client passes with its line are never received (plain recv: the
kernel drops them).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import resource
import secrets
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvstore.core.errors import Reason, ResourceExhausted, StartupError

log = logging.getLogger(__name__)

ATTACH_TICKET_S = 30.0  #: a ticket unused this long is refused
MAX_TICKETS = 4096  #: outstanding tickets, all tenants together
MAX_TICKETS_PER_TENANT = 64
#: The longest line: a ticket is 43 characters (`HOT ` and a ticket, 47); the rest is room
#: for a longer ticket format without letting a line cost more than a few hundred bytes.
MAX_TICKET_LINE = 256
#: From accept to the line's newline, in all. A real client writes its whole line in one send
#: right after connecting (microseconds); 2 s also covers one descheduled for a while on a
#: loaded node, and bounds what a silent or trickling connection holds.
EXCHANGE_TIMEOUT_S = 2.0
#: Handshakes waiting for their line, all peers together; over it, the oldest is closed. Each
#: costs one descriptor and a few hundred bytes. A node's engines open at most a few dozen
#: at once (one per session a client pools, and one for the arenas), so 256 is never reached
#: but by a flood; it is also held to a quarter of the daemon's descriptor limit (see
#: _max_pending), so that a flood cannot starve the daemon's other sockets and files.
MAX_PENDING = 256
#: Pending handshakes of one peer process (one user, for peers in another pid namespace,
#: which the kernel reports as pid 0); over it, that peer's own oldest is closed, so one peer
#: alone never sheds another's (only floods from many together reach MAX_PENDING). A client
#: opens at most ~17 at once (16 pooled sessions and one for the arenas); 64 leaves room for
#: several clients of one user in other pid namespaces (pods of one uid all look alike) and
#: is over twice ACCEPTS_PER_TURN (see there).
MAX_PENDING_PER_PEER = 64
#: Connections accepted per turn of the loop before the pending ones are read: a handshake
#: accepted in one turn is read in the next, after at most 2 x 16 newer ones of its peer were
#: accepted (under its cap of 64), so a flood from its own peer (or user) cannot shed it
#: before its line is read.
ACCEPTS_PER_TURN = 16
#: A reply is one small line into a socket that has sent nothing yet: it never waits for
#: room. The bound keeps any surprise from stalling every other handshake for long.
SEND_TIMEOUT_S = 0.2
#: When accept fails for want of descriptors (and no pending handshake is left to close), it
#: is retried after this: long enough not to spin, short against a client's 5 s exchange.
ACCEPT_PAUSE_S = 0.1
#: Connections the kernel queues before accept (they cost it memory, not descriptors). A
#: client's connect with a timeout fails at once (EAGAIN) when the queue is full, so it holds a
#: burst of a thousand connects: a node's clients starting together, or a flood of idle ones;
#: and no longer, since under a flood that reconnects as fast as it can a real client waits
#: behind the whole queue (~50 us a connection to accept and close: ~50 ms).
LISTEN_BACKLOG = 1024
#: At most one line per this about connections closed over a cap or a deadline, and about
#: unexpected errors of one exchange: an attack of thousands logs a line, not thousands.
LOG_EVERY_S = 10.0


class Tickets:
    """One-time tickets, each naming the tenant it was issued to. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._tickets: dict[str, tuple[str, float]] = {}  # ticket -> (tenant, deadline)

    def issue(self, tenant: str) -> str:
        now = self._clock()
        with self._lock:
            self._expire(now)
            mine = sum(1 for t, _ in self._tickets.values() if t == tenant)
            if mine >= MAX_TICKETS_PER_TENANT or len(self._tickets) >= MAX_TICKETS:
                raise ResourceExhausted(
                    f"tenant {tenant!r} holds {mine} unused Attach tickets; redeem them on "
                    "the Unix socket or wait for them to expire", Reason.QUOTA_EXCEEDED,
                    limit=MAX_TICKETS_PER_TENANT if mine >= MAX_TICKETS_PER_TENANT
                    else MAX_TICKETS)
            ticket = secrets.token_urlsafe(32)
            self._tickets[ticket] = (tenant, now + ATTACH_TICKET_S)
        return ticket

    def peek(self, ticket: str) -> str | None:
        """The tenant a valid ticket was issued to, without using it up: for a caller that
        may refuse the request it comes with (a cap reached) and must leave the ticket good
        for the client's next try."""
        with self._lock:
            held = self._tickets.get(ticket)
        if held is None or held[1] < self._clock():
            return None
        return held[0]

    def redeem(self, ticket: str) -> str | None:
        """The tenant a valid ticket was issued to; None for an unknown or expired one. A
        ticket is good once."""
        with self._lock:
            held = self._tickets.pop(ticket, None)
        if held is None or held[1] < self._clock():
            return None
        return held[0]

    def _expire(self, now: float) -> None:
        for ticket in [t for t, (_, deadline) in self._tickets.items() if deadline < now]:
            del self._tickets[ticket]


ArenaFds = Callable[[str], list[tuple[str, int, int]]]  # tenant -> (name, fd, size) each
# A `HOT <ticket>` handshake: True when the local path took the connection over.
OpenSession = Callable[[socket.socket, str], bool]
Peer = tuple[str, int]  # ("pid", pid), or ("uid", uid) for a peer in another pid namespace


class _Refused(Exception):
    """A line answered with an error: the message and its reason go to the client."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Handshake:
    """A connection accepted and not yet answered: its line so far, its peer, its deadline."""

    __slots__ = ("conn", "deadline", "line", "peer")

    def __init__(self, conn: socket.socket, peer: Peer, deadline: float) -> None:
        self.conn = conn
        self.peer = peer
        self.deadline = deadline
        self.line = bytearray()


class _Episode:
    """One warning line when a kind of failure starts (its traceback at DEBUG), silence while
    it lasts, one info line when it ends: a failure that repeats every turn logs twice."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._count = 0

    def failed(self, exc: BaseException) -> None:
        self._count += 1
        if self._count == 1:
            log.warning("attach socket: %s: %s: %s (logged once until it recovers)",
                        self._what, type(exc).__name__, exc)
            log.debug("attach socket: %s", self._what, exc_info=exc)

    def ended(self) -> None:
        if self._count:
            log.info("attach socket: %s: recovered after %d failures", self._what, self._count)
            self._count = 0


class _Throttled:
    """At most one line per LOG_EVERY_S, saying how many were left out since the last."""

    def __init__(self, level: int) -> None:
        self._level = level
        self._last = -LOG_EVERY_S
        self._left_out = 0

    def log(self, message: str, exc: BaseException | None = None) -> None:
        now = time.monotonic()
        if now - self._last < LOG_EVERY_S:
            self._left_out += 1
            return
        more = f" ({self._left_out} more like it since the last line)" if self._left_out else ""
        log.log(self._level, "attach socket: %s%s", message, more)
        if exc is not None:
            log.debug("attach socket: %s", message, exc_info=exc)
        self._last, self._left_out = now, 0


class AttachSocket:
    """The daemon's Unix socket: tickets in, arena descriptors out (arena_fds None: auth off,
    no arenas to hand out), and `HOT` handshakes handed to the local path
    (kvstore.daemon.localpath). One thread serves every handshake (see the module's
    docstring); the keyword arguments are the module's limits, for tests."""

    def __init__(self, path: str, tickets: Tickets, arena_fds: ArenaFds | None,
                 open_session: OpenSession | None = None, *,
                 exchange_timeout_s: float = EXCHANGE_TIMEOUT_S,
                 max_pending: int = MAX_PENDING,
                 max_pending_per_peer: int = MAX_PENDING_PER_PEER) -> None:
        self.path = path
        self._tickets = tickets
        self._arena_fds = arena_fds
        self._open_session = open_session
        self._timeout_s = exchange_timeout_s
        self._max_pending = _max_pending(max_pending)
        self._max_per_peer = max_pending_per_peer
        # Every pending handshake in accept order, which is also deadline order; and each
        # peer's, for its cap. A dict keeps insertion order and removes in O(1).
        self._pending: dict[_Handshake, None] = {}
        self._by_peer: dict[Peer, dict[_Handshake, None]] = {}
        self._sock = _listen(path)
        self._sock.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ, self._sock)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._wake_r)
        self._resume_at: float | None = None  # accept paused (out of descriptors) until
        self._stop = threading.Event()
        self._accept_failures = _Episode("accept failed")
        self._loop_failures = _Episode("the serving loop failed")
        self._shed_log = _Throttled(logging.WARNING)
        self._expired_log = _Throttled(logging.INFO)
        self._fault_log = _Throttled(logging.WARNING)
        self._thread = threading.Thread(target=self._serve, name="attach-socket", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop serving: pending handshakes are closed, sessions already open are not (the
        local path ends them), and the socket file goes."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread.ident is not None:
            self._thread.join(timeout=2)
        if not self._thread.is_alive():
            self._close_all()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    @property
    def pending(self) -> int:
        """Handshakes accepted and waiting for their line (for tests and metrics)."""
        return len(self._pending)

    def _close_all(self) -> None:
        for hs in list(self._pending):
            self._drop(hs)
        self._selector.close()
        for sock in (self._sock, self._wake_r, self._wake_w):
            sock.close()

    def _serve(self) -> None:
        """The loop; anything unexpected in it is logged once per episode, and it goes on."""
        while not self._stop.is_set():
            try:
                self._turn()
                self._loop_failures.ended()
            except Exception as exc:
                self._loop_failures.failed(exc)
                self._stop.wait(ACCEPT_PAUSE_S)

    def _turn(self) -> None:
        """Wait for a connection, a line's bytes, the next deadline or the stop; serve them."""
        for key, _ in self._selector.select(self._wait_s()):
            if key.data is self._sock:
                self._accept_some()
            elif key.data is self._wake_r:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(64)
            elif key.data in self._pending:  # not closed earlier in this turn
                self._serve_handshake(key.data)
        now = time.monotonic()
        while self._pending:
            oldest = next(iter(self._pending))
            if oldest.deadline > now:
                break
            self._expired_log.log("closed handshakes that sent no whole line within "
                               f"{self._timeout_s:g} s of connecting")
            self._drop(oldest, _Refused(f"no ticket line within {self._timeout_s:g} s of "
                                        "connecting: send it right after connecting",
                                        Reason.UNAUTHENTICATED))
        if self._resume_at is not None and now >= self._resume_at:
            self._resume_at = None
            self._selector.register(self._sock, selectors.EVENT_READ, self._sock)

    def _wait_s(self) -> float | None:
        now = time.monotonic()
        waits = [self._resume_at - now] if self._resume_at is not None else []
        if self._pending:
            waits.append(next(iter(self._pending)).deadline - now)
        return max(0.0, min(waits)) if waits else None

    def _accept_some(self) -> None:
        """Accept up to ACCEPTS_PER_TURN of the connections queued (the socket was reported
        readable: at least one is)."""
        for i in range(ACCEPTS_PER_TURN):
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                # At the descriptor limit accept fails before it looks at the queue; after
                # an accept this turn the queue may be empty: the next turn's readiness says.
                if i == 0:
                    self._accept_failed(exc)
                return
            self._accept_failures.ended()
            self._admit(conn)

    def _accept_failed(self, exc: OSError) -> None:
        """Out of descriptors (EMFILE, ENFILE, ...) with a connection waiting: close the
        oldest pending handshake to free one, or, with none left, pause accepting for
        ACCEPT_PAUSE_S; both keep serving the pending ones. A client that left before its
        accept (ECONNABORTED) is nothing."""
        if exc.errno == errno.ECONNABORTED:
            return
        self._accept_failures.failed(exc)
        if self._pending and exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS,
                                           errno.ENOMEM):
            self._drop(next(iter(self._pending)), _Refused(
                "the daemon is short of descriptors; try again later", Reason.TOO_MANY_SESSIONS))
            return
        self._selector.unregister(self._sock)
        self._resume_at = time.monotonic() + ACCEPT_PAUSE_S

    def _admit(self, conn: socket.socket) -> None:
        """Read a new connection's line at once (a real client has sent it already); else
        make room under the caps and wait for it."""
        try:
            conn.setblocking(False)
            hs = _Handshake(conn, _peer(conn), time.monotonic() + self._timeout_s)
            line = _advance(hs)
            if line is not None:
                self._answer(conn, line)
                return
            self._make_room(hs.peer)
            self._selector.register(conn, selectors.EVENT_READ, hs)
        except Exception as exc:
            self._failed(conn, exc)
            return
        self._pending[hs] = None
        self._by_peer.setdefault(hs.peer, {})[hs] = None

    def _make_room(self, peer: Peer) -> None:
        """Close the peer's oldest pending handshake when it is at its cap, and the oldest of
        all when all are at theirs: the newcomer is the one likeliest to send its line now."""
        mine = self._by_peer.get(peer, {})
        if len(mine) >= self._max_per_peer:
            self._shed(next(iter(mine)), f"this peer's {self._max_per_peer}")
        if len(self._pending) >= self._max_pending:
            self._shed(next(iter(self._pending)), f"the socket's {self._max_pending}")

    def _shed(self, hs: _Handshake, cap: str) -> None:
        self._shed_log.log(f"closed the oldest pending handshakes to admit new connections "
                           f"(over {cap} pending: a flood of slow or idle connections?)")
        self._drop(hs, _Refused(f"closed unanswered to admit a newer connection (over {cap} "
                                "pending handshakes): send the line right after connecting",
                                Reason.TOO_MANY_SESSIONS))

    def _serve_handshake(self, hs: _Handshake) -> None:
        """A pending connection sent bytes (or closed): take them, and answer a whole line."""
        try:
            line = _advance(hs)
            if line is None:
                return
            self._forget(hs)
            self._answer(hs.conn, line)
        except Exception as exc:
            self._forget(hs)
            self._failed(hs.conn, exc)

    def _answer(self, conn: socket.socket, raw: bytes | _Refused) -> None:
        """Serve a whole line (or send its refusal); conn is closed after, unless the local
        path took it over."""
        conn.settimeout(SEND_TIMEOUT_S)  # blocking from here, and never for long
        try:
            if isinstance(raw, _Refused):
                raise raw
            try:
                line = raw.decode("ascii").strip()
            except UnicodeDecodeError:
                raise _Refused("the ticket line is not ASCII", Reason.UNAUTHENTICATED) from None
            verb, _, rest = line.partition(" ")
            if verb == "HOT":
                if self._open_session is None:
                    raise _Refused("this socket opens no local sessions", Reason.FEATURE_OFF)
                if self._open_session(conn, rest.strip()):
                    return  # the session owns conn now
            else:
                self._give_arenas(conn, line)
        except _Refused as refusal:
            _reply(conn, refusal)
        conn.close()

    def _give_arenas(self, conn: socket.socket, ticket: str) -> None:
        """Trade a ticket for its tenant's arenas. A ticket is used up only when the arenas
        go out: refused for a reason of the daemon's (no arena), it stays good."""
        if self._arena_fds is None:
            raise _Refused("auth.mode is off: attach the named segment "
                           "(StatsResponse.shm_name) instead", Reason.FEATURE_OFF)
        unknown = _Refused("unknown, used or expired ticket (call Attach again, and redeem "
                           f"it within {ATTACH_TICKET_S:g} s)", Reason.UNAUTHENTICATED)
        tenant = self._tickets.peek(ticket) if ticket else None
        if tenant is None:
            raise unknown
        arenas = self._arena_fds(tenant)
        if not arenas:
            raise _Refused(f"tenant {tenant!r} has no shared-memory arena", Reason.FEATURE_OFF)
        if self._tickets.redeem(ticket) != tenant:
            raise unknown  # redeemed meanwhile by another connection
        _send(conn, {"arenas": [{"name": n, "size_bytes": size} for n, _, size in arenas]},
              [fd for _, fd, _ in arenas])
        log.debug("attach: gave tenant %r %d arenas", tenant, len(arenas))

    def _forget(self, hs: _Handshake) -> None:
        """Stop watching a handshake (it is over, or about to be closed): before its
        connection closes, so that its descriptor, reused by the next accept, is not still
        registered."""
        if hs not in self._pending:
            return
        del self._pending[hs]
        mine = self._by_peer[hs.peer]
        del mine[hs]
        if not mine:
            del self._by_peer[hs.peer]
        self._selector.unregister(hs.conn)

    def _drop(self, hs: _Handshake, refusal: _Refused | None = None) -> None:
        self._forget(hs)
        if refusal is not None:
            _reply(hs.conn, refusal)
        hs.conn.close()

    def _failed(self, conn: socket.socket, exc: Exception) -> None:
        """One exchange went wrong: it alone is closed. A client that left (an OSError) is
        routine; anything else is a fault, logged as one line (its traceback at DEBUG)."""
        with contextlib.suppress(OSError):
            conn.close()
        if isinstance(exc, OSError):
            log.debug("attach socket: an exchange failed: %s", exc)
        else:
            self._fault_log.log(f"an exchange failed: {type(exc).__name__}: {exc} (its "
                                "connection was closed)", exc)


def _advance(hs: _Handshake) -> bytes | _Refused | None:
    """Take what a connection has sent, up to and including its newline and never past it (a
    session's first frame may follow): the line when whole (without its newline), a refusal
    when it cannot become one, None while it is on its way. Plain recv: descriptors passed
    with the bytes are dropped by the kernel, never received."""
    while True:
        try:
            peeked = hs.conn.recv(MAX_TICKET_LINE + 1 - len(hs.line), socket.MSG_PEEK)
        except BlockingIOError:
            return None
        if not peeked:
            return _Refused("the connection ended before the ticket line's newline",
                            Reason.UNAUTHENTICATED)
        newline = peeked.find(b"\n")
        # What was peeked is there to take; a read may stop short of it at bytes sent with
        # descriptors, and the loop takes the rest.
        got = hs.conn.recv(newline + 1 if newline >= 0 else len(peeked))
        hs.line += got
        if got.endswith(b"\n"):
            return bytes(hs.line[:-1])
        if len(hs.line) > MAX_TICKET_LINE:
            return _Refused(f"the ticket line is over {MAX_TICKET_LINE} bytes",
                            Reason.UNAUTHENTICATED)


def _peer(conn: socket.socket) -> Peer:
    """Whom a connection's pending handshakes are counted against: its process, or its user
    when the kernel cannot name the process here (pid 0: another pid namespace)."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      struct.calcsize("3i")))
    return ("pid", pid) if pid > 0 else ("uid", uid)


def _max_pending(wanted: int) -> int:
    """wanted, held to a quarter of the descriptors this process may open: a flood of
    handshakes must leave the daemon descriptors for its other sockets and files."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft // 4))


def _reply(conn: socket.socket, refusal: _Refused) -> None:
    """Best effort: a refusal the client may read, or not (it may be gone)."""
    with contextlib.suppress(OSError):
        conn.send(_refusal_line(str(refusal), refusal.reason))


@functools.lru_cache(maxsize=64)
def _refusal_line(message: str, reason: str) -> bytes:
    """A refusal's line, encoded once: a flood gets the same few refusals thousands of times
    a second, and encoding them was a fifth of the loop's time."""
    return (json.dumps({"error": message, "reason": reason}) + "\n").encode()


def _send(conn: socket.socket, message: dict[str, object], fds: list[int]) -> None:
    payload = (json.dumps(message) + "\n").encode()
    if fds:
        socket.send_fds(conn, [payload], fds)
    else:
        conn.sendall(payload)


def _listen(path: str) -> socket.socket:
    """Bind the Unix socket, replacing a stale socket file (never any other kind of file)."""
    target = Path(path)
    try:
        mode = target.lstat().st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None:
        if not stat.S_ISSOCK(mode):
            raise StartupError(f"server.unix_socket {path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            target.unlink()  # nobody listens: left by a daemon that died
        else:
            raise StartupError(f"server.unix_socket {path} is in use by another daemon")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        # Anyone who can reach the folder may connect: the ticket, not the file mode, is
        # the credential (engine pods may run as other users).
        os.chmod(path, 0o666)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise StartupError(f"server.unix_socket {path}: cannot listen: {exc}") from None
    return sock
