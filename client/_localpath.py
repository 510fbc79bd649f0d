"""The local path: the hot verbs (Lookup, shared-memory Get, Reserve, commit, Release) over
the daemon's Unix socket instead of gRPC, for a client on the daemon's host.

A gRPC call costs more than the work of a batch that lives in shared memory; a Unix-socket
round trip costs a few tens of microseconds. The messages are the contract's own
(kvstore.v1), framed as `kvstore.proto.localframe` says (the daemon imports it too).

Sessions are pooled, one per thread in flight; each opens with `HOT <ticket>` (a ticket
from Attach, auth on). Error replies are a google.rpc.Status, so an error raised here has
the same class, reason and metadata as over gRPC. A session that cannot be opened (no
socket, a refusal, an answer that opens no session) raises FailedPrecondition: the client
then uses gRPC for good. A session that breaks mid-call raises Unavailable, and the call is
retried whole. Every call blocks the thread that makes it: the asyncio client makes them in
worker threads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.message import DecodeError
from google.rpc import status_pb2

from kvstore.proto.localframe import CLOSING, REPLY, REQUEST, hello

from .errors import (
    FailedPrecondition,
    KVStoreError,
    Unavailable,
    from_status,
    from_status_proto,
)

logger = logging.getLogger("kvstore.client")

MAX_IDLE_SESSIONS = 16  # kept open between calls; more threads at once open extra ones

M = TypeVar("M")


class NoSession(FailedPrecondition):
    """The daemon gives no local session (no socket, none served, refused): use gRPC."""


class _Session:
    """One connection: requests answered in order; replies of posted requests skipped."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int) -> None:
        self.sock = sock
        self.max_frame_bytes = max_frame_bytes
        self.posted = 0  # requests sent whose replies nobody waits for
        self.closing = False
        self._head = bytearray(REPLY.size)

    def send(self, verb: int, body: bytes) -> None:
        if len(body) > self.max_frame_bytes:
            raise FailedPrecondition(f"the request ({len(body)} bytes) is over the local "
                                     f"path's {self.max_frame_bytes}-byte frames")
        self.sock.sendall(REQUEST.pack(len(body), verb) + body)

    def receive(self) -> tuple[int, bytes]:
        """(status, body) of the next reply not posted; an error's body is raised."""
        while True:
            length, status, flags = REPLY.unpack(self._read_into(self._head))
            body = self._read(length)
            self.closing = self.closing or bool(flags & CLOSING)
            if not self.posted:
                return status, body
            self.posted -= 1
            if status:
                logger.debug("kvstore: a posted local request failed: %s",
                             _error(status, body))

    def _read_into(self, buffer: bytearray) -> bytearray:
        view = memoryview(buffer)
        got = 0
        while got < len(buffer):
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError("the daemon closed the local session")
            got += k
        return buffer

    def _read(self, n: int) -> bytes:
        return bytes(self._read_into(bytearray(n))) if n else b""

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class LocalPath:
    """Pooled sessions on one daemon's Unix socket. Thread-safe.

    ticket() returns the handshake's ticket (auth on: a fresh Attach ticket per session;
    auth off: "-"). timeout_s bounds each call."""

    def __init__(self, path: str, ticket: Callable[[], str], timeout_s: float) -> None:
        self.path = path
        self._ticket = ticket
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._idle: list[_Session] = []
        self._closed = False

    def call(self, verb: int, request: Any, response_type: type[M]) -> M:
        """One request, its reply parsed; a daemon error raised as the client's error, a
        session the daemon does not give as NoSession."""
        body = request.SerializeToString()
        session = self._take()
        try:
            session.send(verb, body)
            status, reply = session.receive()
        except TimeoutError:
            session.close()
            raise Unavailable(f"the local session timed out after {self._timeout_s} s") \
                from None
        except OSError as exc:
            session.close()
            raise Unavailable(f"the local session broke: {exc}") from None
        self._give_back(session)
        if status:
            raise _error(status, reply)
        response: M = response_type.FromString(reply)  # type: ignore[attr-defined]
        return response

    def post(self, verb: int, request: Any) -> None:
        """Send a request without waiting for its reply (a Release): its reply is read and
        dropped before the session's next one. A failure is logged, never raised."""
        try:
            session = self._take()
        except KVStoreError as exc:
            logger.debug("kvstore: a posted local request was not sent: %s", exc)
            return
        try:
            session.send(verb, request.SerializeToString())
            session.posted += 1
        except (OSError, KVStoreError) as exc:
            session.close()
            logger.debug("kvstore: a posted local request was not sent: %s", exc)
            return
        self._give_back(session)

    def _take(self) -> _Session:
        with self._lock:
            if self._closed:
                raise NoSession("the local path is closed")
            if self._idle:
                return self._idle.pop()
        return self._open()

    def _give_back(self, session: _Session) -> None:
        with self._lock:
            if not self._closed and not session.closing and len(self._idle) < MAX_IDLE_SESSIONS:
                self._idle.append(session)
                return
        session.close()

    def _open(self) -> _Session:
        """A new session; FailedPrecondition when the daemon does not give one."""
        ticket = self._ticket()
        reply, sock = self._handshake(hello(ticket))
        hot = reply.get("hot")
        if sock is None or not isinstance(hot, dict) or not isinstance(
                hot.get("max_frame_bytes"), int):
            if sock is not None:
                sock.close()
            why = reply.get("error")
            raise NoSession(f"no local session on {self.path}: "
                            f"{why or 'the daemon did not answer the handshake'}")
        return _Session(sock, hot["max_frame_bytes"])

    def _handshake(self, line: bytes) -> tuple[dict[str, Any], socket.socket | None]:
        """The daemon's JSON answer to line on a new connection, and the connection when
        the answer opens a session (else it is closed); NoSession when it cannot be had."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._timeout_s)
            sock.connect(self.path)
            sock.sendall(line)
            text = _read_line(sock)
            reply = json.loads(text) if text else {}
        except (OSError, ValueError) as exc:
            sock.close()
            raise NoSession(f"no local session on {self.path}: {exc}") from None
        if not isinstance(reply, dict):
            reply = {}
        if isinstance(reply.get("hot"), dict):
            return reply, sock
        sock.close()
        return reply, None

    def probe(self) -> None:
        """Open one session and keep it idle: NoSession now rather than on a data call."""
        self._give_back(self._open())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for session in idle:
            session.close()


def _error(status: int, body: bytes) -> KVStoreError:
    """An error reply (a serialized google.rpc.Status) as the client's error; bytes that do
    not parse as one are shown as its message."""
    try:
        return from_status_proto(status_pb2.Status.FromString(body))
    except DecodeError:
        return from_status(status, body.decode(errors="replace"))


def _read_line(sock: socket.socket, limit: int = 4096) -> str:
    """One line, read a byte at a time: nothing past the newline may be consumed."""
    data = bytearray()
    while len(data) < limit:
        b = sock.recv(1)
        if not b or b == b"\n":
            break
        data += b
    return data.decode(errors="replace")
