"""Handing a tenant's shared-memory arenas to its co-located clients.

A client calls Attach over gRPC (authenticated like any call) and gets a ticket: random,
good once, for ATTACH_TICKET_S. It then connects to the daemon's Unix socket
(server.unix_socket), sends the ticket and a newline, and receives one JSON line
`{"arenas": [{"name": ..., "size_bytes": N}, ...]}` with one file descriptor per arena
(SCM_RIGHTS), or `{"error": "..."}` and no descriptor. The descriptors are of its tenant's
arenas only, so no client can map another tenant's memory: there is nothing to open by name.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvstore.core.errors import Reason, ResourceExhausted, StartupError

log = logging.getLogger(__name__)

ATTACH_TICKET_S = 30.0  #: a ticket unused this long is refused
MAX_TICKETS = 4096  #: outstanding tickets, all tenants together
MAX_TICKETS_PER_TENANT = 64
MAX_TICKET_LINE = 256
EXCHANGE_TIMEOUT_S = 2.0  #: a connection that sends no ticket this long is closed
MAX_EXCHANGES = 8  #: connections served at once; more are closed at once


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


class AttachSocket:
    """The daemon's Unix socket: tickets in, arena descriptors out (arena_fds None: auth off,
    no arenas to hand out), and `HOT` handshakes handed to the local path
    (kvstore.daemon.localpath). One thread accepts; each exchange runs on a short-lived
    thread of its own, at most MAX_EXCHANGES at once."""

    def __init__(self, path: str, tickets: Tickets, arena_fds: ArenaFds | None,
                 open_session: OpenSession | None = None) -> None:
        self.path = path
        self._tickets = tickets
        self._arena_fds = arena_fds
        self._open_session = open_session
        self._slots = threading.BoundedSemaphore(MAX_EXCHANGES)
        self._sock = _listen(path)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="attach-socket", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=2)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._stop.is_set():
                    return
                log.exception("attach socket: accept failed")
                time.sleep(0.1)
                continue
            if not self._slots.acquire(blocking=False):
                conn.close()  # a flood of idle connections costs nothing but refusals
                continue
            threading.Thread(target=self._exchange, args=(conn,), name="attach",
                             daemon=True).start()

    def _exchange(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(EXCHANGE_TIMEOUT_S)
            ticket = _read_line(conn)
            verb, _, rest = ticket.partition(" ")
            if verb == "HOT" and self._open_session is not None:
                if self._open_session(conn, rest.strip()):
                    return  # the session owns conn now
                conn.close()
                return
            with conn:
                if self._arena_fds is None:
                    _send(conn, {"error": "auth.mode is off: attach the named segment "
                                          "(StatsResponse.shm_name) instead",
                                 "reason": Reason.FEATURE_OFF}, [])
                    return
                tenant = self._tickets.redeem(ticket) if ticket else None
                if tenant is None:
                    _send(conn, {"error": "unknown, used or expired ticket (call Attach "
                                          "again, and redeem it within 30 s)",
                                 "reason": Reason.UNAUTHENTICATED}, [])
                    return
                arenas = self._arena_fds(tenant)
                if not arenas:
                    _send(conn, {"error": f"tenant {tenant!r} has no shared-memory arena",
                                 "reason": Reason.FEATURE_OFF}, [])
                    return
                _send(conn, {"arenas": [{"name": n, "size_bytes": size}
                                        for n, _, size in arenas]},
                      [fd for _, fd, _ in arenas])
                log.debug("attach: gave tenant %r %d arenas", tenant, len(arenas))
        except OSError as exc:
            conn.close()
            log.info("attach socket: an exchange failed: %s", exc)
        finally:
            self._slots.release()


def _read_line(conn: socket.socket) -> str:
    data = b""
    while b"\n" not in data and len(data) <= MAX_TICKET_LINE:
        try:
            chunk = conn.recv(MAX_TICKET_LINE + 1 - len(data))
        except TimeoutError:
            return ""  # no ticket in time: answered as a bad one
        if not chunk:
            break
        data += chunk
    line, _, _ = data.partition(b"\n")
    return line.decode("ascii", errors="replace").strip() if len(line) <= MAX_TICKET_LINE \
        else ""


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
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise StartupError(f"server.unix_socket {path}: cannot listen: {exc}") from None
    return sock
