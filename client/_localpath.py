"""The local path: the hot verbs (Lookup, shared-memory Get, Reserve, commit, Release) over
the daemon's Unix socket instead of gRPC, for a client on the daemon's host.

A gRPC call costs more than the work of a batch that lives in shared memory; a Unix-socket
round trip costs a few tens of microseconds. The messages are the contract's own
(kvstore.v1), framed as `kvstore.proto.localframe` says (the daemon imports it too).

Sessions are pooled, one per thread in flight; each opens with `HOT <ticket>` (a ticket
from Attach with auth on, taken from the client's `TicketKeeper`, which keeps one the daemon
did not redeem for the next try). Error replies are a google.rpc.Status, so an error raised
here has the same class, reason and metadata as over gRPC. Every call blocks the thread that
makes it: the asyncio client makes them in worker threads.

When no session can be had:

- for good (`NoSession`: the daemon serves none, FEATURE_OFF, an answer that is not the
  protocol): the client sends the hot verbs over gRPC from then on;
- for now (`NoSessionNow`: a refusal at the daemon's caps, a handshake closed or timed out
  before an answer, the socket not there yet, Attach out of tickets): no new session is
  opened until a `Pause` has passed; calls with no idle session go over gRPC meanwhile, and
  the first after the pause opens one (one caller at a time).

The daemon closes sessions idle too long, and idle ones to make room at its caps, so an idle
session is checked before it is reused (one non-blocking peek: the daemon's close reads as
the end of the stream). If one still breaks before any byte of its reply arrives (closed
between the check and the request), Lookup, Get, Reserve and Release are sent once more on a
fresh session: the daemon reads a request whole before it acts on it, and each of these may
be asked twice (a Reserve or a leased Get asked twice holds pages that expire). A commit is
not: a session cut after the daemon read it may have stored the blocks and used the
reservation up, and sending it again would fail with an unknown reservation. It fails
Unavailable instead, and the client retries the whole put (Reserve answers `exists` for what
the cut commit stored). A session that breaks in any other way raises Unavailable, and the
call is retried whole.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.message import DecodeError
from google.rpc import status_pb2

from kvstore.proto.localframe import (
    CLOSING,
    COMMIT,
    GET,
    LOOKUP,
    NO_REPLY,
    RELEASE,
    REPLY,
    REQUEST,
    RESERVE,
    TABLES_OPTION,
    VERB_NAMES,
    hello,
)

from ._attach import TicketKeeper, connect
from ._pause import (
    BAD_TICKET_REASON,
    Pause,
    TicketRefused,
    TryLater,
    passes,
    refusal_passes,
)
from .errors import (
    FailedPrecondition,
    KVStoreError,
    Unavailable,
    from_status,
    from_status_proto,
)

logger = logging.getLogger("kvstore.client")

MAX_TABLES = 16  # read tables one handshake may pass (one per arena of the tenant)
MAX_IDLE_SESSIONS = 16  # kept open between calls; more threads at once open extra ones

#: The verbs sent once more on a fresh session when a reused one breaks before any byte of
#: the reply (see the module's docstring: never a commit).
RESENDABLE = frozenset({LOOKUP, GET, RESERVE, RELEASE})
assert COMMIT not in RESENDABLE

M = TypeVar("M")
T = TypeVar("T")


class NoSession(FailedPrecondition):
    """The daemon gives no local session, and will not (it serves none, FEATURE_OFF, an
    answer that is not the protocol): the hot verbs use gRPC for good."""


class NoSessionNow(NoSession):
    """No local session for this call (no new one until the pause after a refusal that
    passes; or a request over the frame size): this call goes over gRPC, the path stays."""


class _Unanswered(Exception):
    """A session broke before any byte of its reply arrived."""


#: What receives a posted request's answer, later: its reply's bytes, or the error it got (the
#: daemon's, or Unavailable when the session ended before the answer came).
Answer = Callable[["bytes | KVStoreError"], None]


class _Session:
    """One connection: requests answered in order; the replies of posted requests handed to
    their receivers (or dropped) as they come, before the reply of a request waited for."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int, timeout_s: float) -> None:
        self.sock = sock
        self.max_frame_bytes = max_frame_bytes
        self.timeout_s = timeout_s
        # Requests sent whose replies nobody waits for, in order: each one's receiver, or
        # None when its reply is dropped.
        self.waiting: deque[Answer | None] = deque()
        self.closing = False
        self.reply_bytes = 0  # bytes of the awaited reply read so far
        self._head = bytearray(REPLY.size)

    def send(self, verb: int, body: bytes, ahead: bytes = b"") -> None:
        """Send one request, preceded by ahead: whole frames the daemon does not answer."""
        self.reply_bytes = 0
        self.sock.sendall(ahead + REQUEST.pack(len(body), verb) + body)

    def receive(self) -> tuple[int, bytes]:
        """(status, body) of the next reply not posted; an error's body is raised."""
        while True:
            status, body = self.next_reply()
            if not self.waiting:
                return status, body
            self._hand_on(status, body)

    def settle(self) -> None:
        """Read the replies of every posted request and hand them on."""
        while self.waiting:
            self._hand_on(*self.next_reply())

    def next_reply(self) -> tuple[int, bytes]:
        """(status, body) of the next reply on the socket, posted or not; its closing flag
        kept on the session."""
        length, status, flags = REPLY.unpack(self._read_into(self._head))
        body = self.read(length)
        self.closing = self.closing or bool(flags & CLOSING)
        return status, body

    def _hand_on(self, status: int, body: bytes) -> None:
        """A posted request's reply, to its receiver (a failure only logged without one)."""
        answer = self.waiting.popleft()
        if answer is not None:
            answer(_error(status, body) if status else body)
        elif status:
            logger.debug("kvstore: a posted local request failed: %s", _error(status, body))

    def alive(self) -> bool:
        """Whether the daemon has not closed the session (while it sat idle): a peek that
        never waits. The end of the stream means closed; nothing to read means alive; bytes
        to read are the replies of posted requests."""
        try:
            self.sock.settimeout(0.0)
            try:
                return self.sock.recv(1, socket.MSG_PEEK) != b""
            finally:
                self.sock.settimeout(self.timeout_s)
        except BlockingIOError:
            return True
        except OSError:
            return False

    def _read_into(self, buffer: bytearray) -> bytearray:
        view = memoryview(buffer)
        got = 0
        while got < len(buffer):
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError("the daemon closed the local session")
            got += k
            if not self.waiting:
                self.reply_bytes += k
        return buffer

    def read(self, n: int) -> bytes:
        """The next n bytes of the socket (ConnectionError when the daemon closed it)."""
        return bytes(self._read_into(bytearray(n))) if n else b""

    def close(self) -> None:
        """Close the connection; posted requests still unanswered get Unavailable (the
        daemon may or may not have acted on them)."""
        with contextlib.suppress(OSError):
            self.sock.close()
        while self.waiting:
            answer = self.waiting.popleft()
            if answer is not None:
                answer(Unavailable("the local session ended before the daemon answered a "
                                   "posted request (it may or may not have been carried out)"))


class LocalPath:
    """Pooled sessions on one daemon's Unix socket. Thread-safe.

    tickets: the handshakes' tickets (auth on: Attach tickets, one a session, kept when not
    redeemed; auth off: "-"). timeout_s bounds each call. clock is time.monotonic unless a
    test passes its own."""

    #: What this path's sessions are called in its errors ("no local session on ...").
    kind = "local"
    #: Whether the handshake's answer may carry descriptors (read tables): a Unix socket's.
    passes_fds = True

    def __init__(self, path: str, tickets: TicketKeeper, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._tickets = tickets
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._idle: list[_Session] = []
        self._closed = False
        # Frames sent ahead of each request, on its session, which the daemon does not
        # answer: the read table's pending reports (client/_readtable.py), so that the daemon
        # takes in this client's reads before it acts on its next request. None: none.
        self.ahead: Callable[[], bytes] | None = None
        # No new session until it passes, after a refusal that passes; one caller at a time
        # opens one after it (_probing), the others use gRPC meanwhile.
        self._pause = Pause(clock)
        self._probing = False

    def ready(self) -> bool:
        """Whether a hot verb may use the path now: a session is idle, or one may be opened
        (no pause, or it has passed and no other caller is opening one). Never blocks."""
        return bool(self._idle) or not (self._pause.off() or self._probing)

    def call(self, verb: int, request: Any, response_type: type[M], ahead: bytes = b"") -> M:
        """One request, its reply parsed; a daemon error raised as the client's error, no
        session as NoSession (for good) or NoSessionNow (this call goes over gRPC). ahead:
        frames the daemon does not answer, sent before it on the same session."""
        reply = self.call_bytes(verb, request.SerializeToString(), ahead)
        response: M = response_type.FromString(reply)  # type: ignore[attr-defined]
        return response

    def call_bytes(self, verb: int, body: bytes, ahead: bytes = b"") -> bytes:
        """As call, with the request's and the reply's bytes as they are (the struct-packed
        verbs of kvstore.proto.localframe)."""
        sends = [ahead]  # the first send's frames ahead; a resend on a fresh session has none

        def exchange(session: _Session) -> tuple[int, bytes]:
            return self._round_trip(session, verb, body, sends.pop() if sends else b"")

        status, reply = self.exchange(exchange, verb in RESENDABLE, VERB_NAMES[verb])
        if status:
            raise _error(status, reply)
        return reply

    def exchange(self, exchange: Callable[[_Session], T], resend: bool, what: str) -> T:
        """exchange(session) on a pooled session (pooled again after it; it closes a session
        it breaks). When a reused session broke before any byte of the reply arrived
        (_Unanswered: closed by the daemon while it sat idle, say) and resend allows it, once
        more on a fresh session; else, and when that one breaks too, Unavailable. what: the
        request, for the log."""
        session, reused = self._take()
        try:
            result = exchange(session)
        except _Unanswered as exc:
            if not (reused and resend):
                raise Unavailable(f"the {self.kind} session broke: {exc}") from None
            logger.debug("kvstore: an idle %s session broke under a %s (%s); sending it on a "
                         "fresh one", self.kind, what, exc)
            session = self._new()
            try:
                result = exchange(session)
            except _Unanswered as again:
                raise Unavailable(f"the {self.kind} session broke: {again}") from None
        self._give_back(session)
        return result

    def post(self, verb: int, request: Any) -> bool:
        """Send a request without waiting for its reply (a Release): its reply is read and
        dropped before the session's next one (the read table's reports, NO_REPLY, have
        none). Sent once more on a fresh session when a reused one is found closed; any
        failure is logged, never raised. Whether it was sent."""
        body = request.SerializeToString()
        answered = verb not in NO_REPLY
        try:
            session, reused = self._take()
            if self._post_on(session, verb, body, answered):
                return True
            return reused and self._post_on(self._new(), verb, body, answered)
        except KVStoreError as exc:
            logger.debug("kvstore: a posted local request was not sent: %s", exc)
            return False

    def post_bytes(self, verb: int, body: bytes, answer: Answer) -> None:
        """Send a request without waiting: answer gets its reply (or error) later, from the
        thread that reads it (the session's next call, or `settle`). Sent once more on a
        fresh session when a reused one is found closed (a frame the daemon did not get
        whole is never acted on). A request that could not be sent raises: NoSession or
        NoSessionNow as call, Unavailable when the session broke under it."""
        session, reused = self._take()
        if self._post_on(session, verb, body, answer=answer):
            return
        if not (reused and self._post_on(self._new(), verb, body, answer=answer)):
            raise Unavailable("the local session broke while a posted request was sent")

    def settle(self) -> None:
        """Read the replies of the requests posted on every idle session (their receivers
        get them); a session that breaks meanwhile is closed (its receivers get
        Unavailable). Sessions in use answer theirs before their own reply."""
        with self._lock:
            idle, self._idle = self._idle, []
        for session in idle:
            try:
                session.settle()
            except OSError as exc:  # TimeoutError too
                logger.debug("kvstore: a local session broke while its posted replies were "
                             "read: %s", exc)
                session.close()
                continue
            self._give_back(session)

    def open_tables(self) -> list[tuple[str, int, int]]:
        """As probe, with the session opened asking for the read tables (`HOT <ticket>
        tables`): (arena, descriptor, size in bytes) of each table the daemon passed (none
        when it publishes none). The caller closes the descriptors."""
        got: list[list[tuple[str, int, int]]] = []

        def with_tables(ticket: str) -> _Session:
            session, tables = self._open_asking(ticket)
            got.append(tables)
            return session

        self._give_back(self._new(with_tables))
        return got[-1] if got else []

    def _post_on(self, session: _Session, verb: int, body: bytes,
                 answered: bool = True, answer: Answer | None = None) -> bool:
        """Send a posted request on session: True when it went (the session is pooled again),
        False when the session was closed under it (and is dropped)."""
        if len(body) > session.max_frame_bytes:
            self._give_back(session)
            raise NoSessionNow(f"a posted request of {len(body)} bytes is over the local "
                               f"path's {session.max_frame_bytes}-byte frames")
        try:
            session.send(verb, body)
        except OSError as exc:
            session.close()
            logger.debug("kvstore: a posted local request was not sent: %s", exc)
            return False
        if answered:
            session.waiting.append(answer)
        self._give_back(session)
        return True

    def _round_trip(self, session: _Session, verb: int, body: bytes,
                    ahead: bytes = b"") -> tuple[int, bytes]:
        """Send body and read its reply: (status, reply bytes). _Unanswered when the session
        broke before any byte of the reply, Unavailable when it broke later or timed out;
        NoSessionNow (the session pooled again) when body is over the frame size."""
        if len(body) > session.max_frame_bytes:
            self._give_back(session)
            raise NoSessionNow(f"the request ({len(body)} bytes) is over the local path's "
                               f"{session.max_frame_bytes}-byte frames")
        if self.ahead is not None:
            ahead += self.ahead()
        try:
            session.send(verb, body, ahead)
            return session.receive()
        except TimeoutError:
            session.close()
            raise Unavailable(f"the local session timed out after {self._timeout_s} s") \
                from None
        except OSError as exc:
            session.close()
            if not session.reply_bytes:
                raise _Unanswered(str(exc)) from None
            raise Unavailable(f"the local session broke: {exc}") from None

    def _take(self) -> tuple[_Session, bool]:
        """An idle session the daemon has not closed (True: reused), else a new one (False).
        Sessions the daemon closed while they sat idle are dropped."""
        while True:
            with self._lock:
                if self._closed:
                    raise NoSession("the local path is closed")
                if not self._idle:
                    break
                session = self._idle.pop()
            if session.alive():
                return session, True
            logger.debug("kvstore: dropped an idle local session the daemon closed")
            session.close()
        return self._new(), False

    def _give_back(self, session: _Session) -> None:
        with self._lock:
            if not self._closed and not session.closing and len(self._idle) < MAX_IDLE_SESSIONS:
                self._idle.append(session)
                return
        if session.waiting:  # their answers are on the way: read them before closing
            with contextlib.suppress(OSError):
                session.settle()
        session.close()

    def _new(self, opener: Callable[[str], _Session] | None = None) -> _Session:
        """A new session (opened by opener(ticket), by default a plain handshake).
        NoSessionNow while paused (or while another caller opens the first one after a
        pause), or when the daemon refuses for now, which starts a pause; NoSession when it
        never will."""
        with self._lock:
            if self._closed:
                raise NoSession("the local path is closed")
            paused = self._pause.until_s is not None
            if paused:
                if self._pause.off() or self._probing:
                    raise NoSessionNow("no new local session until the pause after a "
                                       "refusal has passed")
                self._probing = True
        try:
            session = self._tickets.use(opener or self._open)
        except NoSession:
            raise
        except KVStoreError as exc:  # a refusal, or the Attach call for a ticket failed
            if not passes(exc):
                raise NoSession(f"no {self.kind} session on {self.path}: {exc}") from None
            self._refused(exc)
            raise NoSessionNow(f"no {self.kind} session on {self.path} for now: {exc}") from None
        finally:
            if paused:
                with self._lock:
                    self._probing = False
        if paused:
            self._back_on()
        return session

    def _refused(self, exc: KVStoreError) -> None:
        """A refusal that passes: no new session until a pause has passed (a longer one
        when this was the try after a pause). Logged at INFO when the path goes off, at
        DEBUG when a try after a pause is refused again."""
        with self._lock:
            if self._pause.off():
                return  # another caller's refusal started this pause
            pause_s = self._pause.fail()
            first = self._pause.failures == 1
        if first:
            logger.info("kvstore: local path off for now, hot verbs use gRPC when no session "
                        "is idle: %s; trying again in %.1f s", exc, pause_s)
        else:
            logger.debug("kvstore: local path still off: %s; trying again in %.1f s",
                         exc, pause_s)

    def _back_on(self) -> None:
        with self._lock:
            off_s = self._pause.clear()
        if off_s is not None:
            logger.info("kvstore: local path back on after %.1f s", off_s)

    def _open(self, ticket: str) -> _Session:
        """A new session, opened with ticket: TryLater (TicketRefused for a bad ticket) when
        the daemon refuses for now, NoSession when it never will."""
        reply, sock, _ = self._handshake(hello(ticket))
        return self._session_of(reply, sock)

    def _open_asking(self, ticket: str) -> tuple[_Session, list[tuple[str, int, int]]]:
        """As _open, asking for the read tables too: the session, and the tables passed
        (arena, descriptor, size)."""
        reply, sock, fds = self._handshake(hello(ticket, TABLES_OPTION))
        try:
            session = self._session_of(reply, sock)
            listed = reply["hot"].get("tables")
            named = _tables(listed, len(fds)) if listed is not None else []
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return session, [(name, fd, size) for (name, size), fd in zip(named, fds, strict=True)]

    def _session_of(self, reply: dict[str, Any], sock: socket.socket | None) -> _Session:
        hot = reply.get("hot")
        if sock is not None and isinstance(hot, dict) and isinstance(
                hot.get("max_frame_bytes"), int):
            return _Session(sock, hot["max_frame_bytes"], self._timeout_s)
        if sock is not None:
            sock.close()
        why = f"no {self.kind} session on {self.path}: {reply.get('error') or reply}"
        reason = reply.get("reason")
        if reason == BAD_TICKET_REASON:
            raise TicketRefused(why)
        if refusal_passes(reason):
            raise TryLater(why, ticket_unused=True)
        raise NoSession(why)

    def _handshake(self, line: bytes
                   ) -> tuple[dict[str, Any], socket.socket | None, list[int]]:
        """The daemon's JSON answer to line on a new connection (`_connect`), and the
        connection when the answer opens a session (else it is closed), with the descriptors
        passed with the answer. TryLater when no answer comes (the socket not there, the
        connection closed or timed out first); NoSession when the answer is not a JSON
        object."""
        sock = self._connect()
        fds: list[int] = []
        try:
            sock.sendall(line)
            text = _read_line(sock, fds if self.passes_fds else None)
        except OSError as exc:
            sock.close()
            _close_fds(fds)
            raise TryLater(f"no {self.kind} session on {self.path}: {exc}",
                           ticket_unused=True) from None
        if not text:
            sock.close()
            _close_fds(fds)
            raise TryLater(f"no {self.kind} session on {self.path}: the daemon closed the "
                           "connection without an answer (its handshakes may all be taken)",
                           ticket_unused=True)
        try:
            reply = json.loads(text)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            sock.close()
            _close_fds(fds)
            raise NoSession(f"no {self.kind} session on {self.path}: the daemon answered the "
                            f"handshake with {text[:200]!r}")
        if isinstance(reply.get("hot"), dict):
            return reply, sock, fds
        sock.close()
        _close_fds(fds)
        return reply, None, []

    def _connect(self) -> socket.socket:
        """A connection to the daemon's Unix socket: TryLater when nothing answers now."""
        return connect(self.path, self._timeout_s, "no local session")

    def probe(self) -> None:
        """Open one session and keep it idle: NoSession (or NoSessionNow, the path then
        paused) now rather than on a data call."""
        self._give_back(self._new())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for session in idle:
            if session.waiting:
                with contextlib.suppress(OSError):
                    session.settle()
            session.close()


def _error(status: int, body: bytes) -> KVStoreError:
    """An error reply (a serialized google.rpc.Status) as the client's error; bytes that do
    not parse as one are shown as its message."""
    try:
        return from_status_proto(status_pb2.Status.FromString(body))
    except DecodeError:
        return from_status(status, body.decode(errors="replace"))


def _read_line(sock: socket.socket, fds: list[int] | None = None, limit: int = 4096) -> str:
    """One line, read a byte at a time: nothing past the newline may be consumed. With fds,
    the descriptors sent with it are received into it (at most MAX_TABLES; more, and the
    line is refused as not the protocol)."""
    data = bytearray()
    while len(data) < limit:
        if fds is None:
            b = sock.recv(1)
        else:
            b, got, flags, _ = socket.recv_fds(sock, 1, MAX_TABLES)
            fds.extend(got)
            if flags & socket.MSG_CTRUNC:
                raise OSError(f"the daemon passed more than {MAX_TABLES} descriptors")
        if not b or b == b"\n":
            break
        data += b
    return data.decode(errors="replace")


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    fds.clear()


def _tables(listed: object, num_fds: int) -> list[tuple[str, int]]:
    """(arena, size in bytes) of each table the handshake's answer names, in descriptor
    order; NoSession when the list is malformed or does not match the descriptors."""
    if not isinstance(listed, list) or not all(
            isinstance(t, dict) and isinstance(t.get("arena"), str)
            and isinstance(t.get("size_bytes"), int) and t["size_bytes"] > 0 for t in listed):
        raise NoSession(f"the daemon named its read tables malformed: {listed!r:.200}")
    if len(listed) != num_fds:
        raise NoSession(f"the daemon named {len(listed)} read tables and passed {num_fds} "
                        "descriptors")
    return [(t["arena"], t["size_bytes"]) for t in listed]
