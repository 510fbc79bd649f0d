"""The Unix socket exchange that follows Attach: a one-time ticket in, the tenant's
shared-memory arenas out as file descriptors (SCM_RIGHTS), each mapped read-write, whole;
and the tickets themselves (`TicketKeeper`), which the local path's handshakes spend too.

    client -> daemon   the ticket (ASCII, AttachResponse.ticket) and b"\\n"
    daemon -> client   one UTF-8 JSON line, then it closes:
                       {"arenas": [{"name": "<arena>", "size_bytes": N}, ...]}\\n in one
                       sendmsg carrying one descriptor per arena, in the same order; or
                       {"error": "<why>", "reason": "<ErrorInfo reason>"}\\n with none

Every failure is a FailedPrecondition saying why. One that passes is a `TryLater` (the socket
not there yet, a connection closed or timed out before an answer, a refusal at a cap, an
unknown ticket): the client tries again after a pause, with the same ticket when it was not
redeemed. The rest (FEATURE_OFF, an error without a reason that passes, a malformed answer, a
descriptor that cannot be mapped) are for good. Every descriptor received is closed, mapped
or not: a mapping keeps its own reference to the file.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb

from ._pause import BAD_TICKET_REASON, TicketRefused, TryLater, refusal_passes
from .errors import FailedPrecondition

logger = logging.getLogger("kvstore.client")

MAX_REPLY_BYTES = 65536
MAX_ARENAS = 16
EXCHANGE_TIMEOUT_S = 5.0
#: A ticket is used again only within this share of its lifetime (AttachResponse's
#: expires_in_ms, 30 s today: 20 s). The client counts from when the answer arrived, after
#: the daemon started counting; the last third covers that, the exchange or handshake still
#: to run, and a host descheduled for seconds.
REUSE_SHARE = 2 / 3
#: The lifetime assumed when Attach does not say (expires_in_ms 0): the daemon's 30 s.
DEFAULT_TICKET_S = 30.0
#: Tickets kept at most: as many as threads of one client can have had refused at once (one
#: per session it pools, and the arenas' exchange). Tickets past it are left to expire.
MAX_KEPT_TICKETS = 17

FetchAttach = Callable[[], pb.AttachResponse]
T = TypeVar("T")


class Arena:
    """One arena mapped from its descriptor; what SharedSegment wraps (name, view, close)."""

    def __init__(self, name: str, buf: mmap.mmap) -> None:
        self.name = name
        self.buf = buf
        self.size_bytes = len(buf)

    def view(self) -> memoryview:
        return memoryview(self.buf)

    def close(self) -> None:
        try:
            self.buf.close()
        except BufferError:  # views still alive keep it mapped until they are collected
            logger.debug("kvstore: arena %s still in use; unmapped later", self.name)

    def __repr__(self) -> str:
        return f"Arena(name={self.name!r}, size_bytes={self.size_bytes})"


@dataclass(frozen=True)
class Ticket:
    """An Attach ticket, how long it may be sent again, and whether it is one sent before."""

    text: str
    reusable_until_s: float
    kept: bool = False


class TicketKeeper:
    """Attach tickets for the arenas' exchange and the local sessions' handshakes, which
    take the same tickets. Each attempt takes one; one the daemon did not redeem (the
    connection closed or timed out before an answer, a refusal at a cap) is kept and sent
    again by the next attempt while it is young, so a client refused for minutes spends a
    ticket every 20 s, not one per try, and never runs its tenant out of them (64 unused at
    most, `kvstore.daemon.attach`). Thread-safe.

    fetch: the Attach RPC, blocking (bound again by each decision, `bind`); None with auth
    off, where every handshake sends "-" and there is nothing to keep."""

    def __init__(self, fetch: FetchAttach | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self._clock = clock
        self._lock = threading.Lock()
        self._kept: list[Ticket] = []

    @property
    def needed(self) -> bool:
        """Whether tickets come from Attach (auth on), rather than being "-"."""
        return self._fetch is not None

    def bind(self, fetch: FetchAttach) -> None:
        """Fetch tickets with this Attach function from now on (the latest caller's)."""
        self._fetch = fetch

    def use(self, attempt: Callable[[str], T]) -> T:
        """attempt(ticket text) with a kept ticket, else a fresh one; a ticket it did not
        redeem (TryLater with ticket_unused) is kept. When a kept ticket turns out used up
        (TicketRefused: the daemon redeemed it after all), once more with a fresh one. The
        Attach RPC's own failure is raised as it is."""
        ticket = self._take()
        try:
            return self._attempt(attempt, ticket)
        except TicketRefused:
            if not ticket.kept:
                raise
        logger.debug("kvstore: a kept Attach ticket was used up; trying a fresh one")
        return self._attempt(attempt, self._fresh())

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()

    def _attempt(self, attempt: Callable[[str], T], ticket: Ticket) -> T:
        try:
            return attempt(ticket.text)
        except TryLater as exc:
            if exc.ticket_unused:
                self._keep(ticket)
            raise

    def _take(self) -> Ticket:
        now = self._clock()
        with self._lock:
            while self._kept:
                ticket = self._kept.pop()
                if now < ticket.reusable_until_s:
                    return ticket
        return self._fresh()

    def _fresh(self) -> Ticket:
        fetch = self._fetch
        if fetch is None:
            return Ticket("-", float("inf"))
        reply = fetch()
        lifetime_s = reply.expires_in_ms / 1000 if reply.expires_in_ms > 0 \
            else DEFAULT_TICKET_S
        return Ticket(reply.ticket, self._clock() + lifetime_s * REUSE_SHARE)

    def _keep(self, ticket: Ticket) -> None:
        if self._fetch is None or self._clock() >= ticket.reusable_until_s:
            return
        with self._lock:
            if len(self._kept) < MAX_KEPT_TICKETS:
                self._kept.append(Ticket(ticket.text, ticket.reusable_until_s, kept=True))


def connect(path: str, timeout_s: float, what: str) -> socket.socket:
    """A stream connection to the daemon's Unix socket at path, timeout_s on each operation.
    TryLater when nothing serves there yet (no socket file, or nobody accepting: a daemon
    restarting) or its backlog is full; FailedPrecondition for good otherwise (no
    permission, not a socket, a path too long). what: the attempt, for the message."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # A Unix socket's connect with a Python timeout is non-blocking and fails at once
        # (EAGAIN) while the daemon's accept queue is full, as under a reconnect flood; in
        # blocking mode the kernel waits for room in the queue, up to SO_SNDTIMEO.
        seconds = max(timeout_s, 0.001)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", int(seconds), int(seconds % 1 * 1e6)))
        sock.connect(path)
        sock.settimeout(timeout_s)
    except (FileNotFoundError, ConnectionError, BlockingIOError, TimeoutError) as exc:
        sock.close()
        raise TryLater(f"{what}: nothing serves the daemon's Unix socket {path} now: {exc}",
                       ticket_unused=True) from None
    except OSError as exc:
        sock.close()
        raise FailedPrecondition(
            f"{what}: cannot connect to the daemon's Unix socket {path}: {exc}") from None
    return sock


def receive_arenas(path: str, ticket: str, *,
                   timeout_s: float = EXCHANGE_TIMEOUT_S) -> list[Arena]:
    """Trade ticket for the arenas on the daemon's Unix socket at path, mapped."""
    data, fds = _exchange(path, ticket, timeout_s)
    try:
        return _map_all(path, _parse(path, data, len(fds)), fds)
    finally:
        for fd in fds:
            os.close(fd)


def _exchange(path: str, ticket: str, timeout_s: float) -> tuple[bytes, list[int]]:
    """Send the ticket; the reply's bytes (up to its newline) and the descriptors it carried.
    TryLater when the connection fails before the reply's newline."""
    if not ticket or not ticket.isascii() or not ticket.isprintable():
        raise FailedPrecondition(f"Attach returned an unusable ticket {ticket!r}")
    deadline = time.monotonic() + timeout_s
    data = bytearray()
    fds: list[int] = []
    try:
        with connect(path, timeout_s, "cannot attach") as sock:
            sock.sendall(ticket.encode("ascii") + b"\n")
            while b"\n" not in data:
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    raise TimeoutError(f"no reply within {timeout_s:g} s")
                sock.settimeout(remaining_s)
                chunk, got, flags, _ = socket.recv_fds(sock, MAX_REPLY_BYTES, MAX_ARENAS)
                fds.extend(got)
                if flags & socket.MSG_CTRUNC:
                    raise FailedPrecondition(
                        f"the daemon's Unix socket {path} passed more than {MAX_ARENAS} "
                        "descriptors")
                if not chunk:
                    break
                data += chunk
                if len(data) > MAX_REPLY_BYTES:
                    raise FailedPrecondition(f"the daemon's Unix socket {path} sent a reply "
                                             f"longer than {MAX_REPLY_BYTES} bytes")
    except BaseException as exc:
        for fd in fds:
            os.close(fd)
        if isinstance(exc, OSError):  # sending or reading: the answer did not come
            raise TryLater(f"cannot attach through the daemon's Unix socket {path}: {exc}",
                           ticket_unused=not data) from None
        raise
    return bytes(data), fds


def _parse(path: str, data: bytes, num_fds: int) -> list[tuple[str, int]]:
    """(name, size_bytes) per arena, in descriptor order; TryLater for no answer or a
    refusal that passes, FailedPrecondition for any other refusal or a malformed reply."""
    line, newline, _ = data.partition(b"\n")
    if not newline:
        raise TryLater(
            f"the daemon's Unix socket {path} closed the connection "
            + (f"inside its answer: {data[:200]!r}" if data else
               "without an answer (its handshakes may all be taken)"),
            ticket_unused=not data)
    reply: Any = None
    try:
        reply = json.loads(line.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError included
        reply = None
    if not isinstance(reply, dict):
        raise FailedPrecondition(
            f"the daemon's Unix socket {path} sent a malformed reply: {data[:200]!r}")
    if "error" in reply:
        _refused(path, reply)
    arenas = reply.get("arenas")
    if not isinstance(arenas, list) or not all(
        isinstance(a, dict) and isinstance(a.get("name"), str) and a["name"]
        and isinstance(a.get("size_bytes"), int) for a in arenas
    ):
        raise FailedPrecondition(f"the daemon's Unix socket {path} sent a malformed arena "
                                 f"list: {data[:200]!r}")
    named = [(str(a["name"]), int(a["size_bytes"])) for a in arenas]
    if len(named) != num_fds:
        raise FailedPrecondition(f"the daemon's Unix socket {path} named {len(named)} arenas "
                                 f"but passed {num_fds} descriptors")
    if not named:
        raise FailedPrecondition(f"the daemon's Unix socket {path} passed no arenas")
    if len({name for name, _ in named}) != len(named):
        raise FailedPrecondition(f"the daemon's Unix socket {path} named an arena twice")
    return named


def _refused(path: str, reply: dict[str, Any]) -> None:
    """Raise the refusal reply names: TicketRefused for a bad ticket, TryLater (the ticket
    kept) for one that passes, FailedPrecondition for the rest (FEATURE_OFF among them)."""
    reason = reply.get("reason")
    why = f"the daemon's Unix socket {path} refused the ticket: {reply['error']}"
    if reason == BAD_TICKET_REASON:
        raise TicketRefused(why)
    if refusal_passes(reason):
        raise TryLater(why, ticket_unused=True)
    raise FailedPrecondition(why)


def _map_all(path: str, named: list[tuple[str, int]], fds: list[int]) -> list[Arena]:
    arenas: list[Arena] = []
    try:
        for (name, size_bytes), fd in zip(named, fds, strict=True):
            arenas.append(Arena(name, _map(path, name, size_bytes, fd)))
    except BaseException:
        for arena in arenas:
            arena.close()
        raise
    return arenas


def _map(path: str, name: str, size_bytes: int, fd: int) -> mmap.mmap:
    try:
        file_bytes = os.fstat(fd).st_size
        if file_bytes <= 0 or file_bytes < size_bytes:
            raise ValueError(f"its file holds {file_bytes} bytes, the daemon says {size_bytes}")
        return mmap.mmap(fd, file_bytes, flags=mmap.MAP_SHARED,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError) as exc:
        raise FailedPrecondition(
            f"cannot map arena {name!r} from the daemon's Unix socket {path}: {exc}") from None
