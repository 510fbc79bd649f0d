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

What a session may hold, so that no client can hold the path at others' expense:

- time: a frame begun (its first header byte) must arrive whole within FRAME_TIMEOUT_S, and
  a session idle between frames for IDLE_LIMIT_S is closed;
- slots: at most MAX_SESSIONS sessions, MAX_SESSIONS_PER_CLIENT per client (the tenant with
  auth on; with auth off the peer process, read from the socket's SO_PEERCRED). A handshake
  past a cap closes the least recently active session idle for REAP_IDLE_S or longer (of that
  client for its own cap, of anyone for the total) and is admitted; it is refused only when
  no session is idle, and then its ticket stays good for the client's next try;
- memory: a frame's bytes go into the session's buffer, grown as they arrive up to
  HEAP_FRAME_BYTES and cut back to STANDING_BYTES after the frame, or, for a larger frame,
  into an anonymous mapping made when its first body byte arrives, faulted in as bytes
  arrive and returned to the OS when the frame is read; nothing is allocated for a header
  alone.

Every session thread ends on any error with one log line (the traceback at DEBUG), closing
that session only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from kvstore.core.errors import (
    InvalidArgument,
    Reason,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvstore.core.prefixhits import MAX_BLOCK_TOKENS
from kvstore.core.tenants import OPEN
from kvstore.daemon.attach import Tickets
from kvstore.daemon.auth import Auth, Caller
from kvstore.daemon.faults import FaultLog, Undecodable, code_of, decoder, described, parsed
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.verbs import GrantedCommit, Verbs
from kvstore.keys import KEY_BYTES
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.localframe import (
    BLOCK,
    CLOSING,
    COMMIT,
    COMMIT_GRANTED,
    COMMITTED,
    GET,
    GRANT,
    GRANT_REQUEST,
    HAS_PARENT,
    INDEPENDENT,
    LOOKED,
    LOOKUP,
    LOOKUPS_READ,
    NO_REPLY,
    PAGE_NUMBER,
    READS,
    RELEASE,
    REPLY,
    REQUEST,
    RESERVE,
    STATUS_BODY,
    TABLES_OPTION,
    VERB_NAMES,
    VERSION,
)

log = logging.getLogger(__name__)

MAX_SESSIONS = 256  #: local sessions open at once, all clients together
#: Per client: the tenant (auth on) or the peer process (auth off). A client keeps up to 16
#: sessions idle between calls (client/_localpath.py), so this leaves it room for bursts of
#: twice that many threads at once.
MAX_SESSIONS_PER_CLIENT = 32
SESSION_MAX_S = 300.0  #: a session is closed after the reply that passes this age
#: A frame begun (its first header byte) must arrive whole within this. A client writes a
#: frame with one sendall, at most max_frame_bytes (8 MiB by default), which crosses a Unix
#: socket in milliseconds: 10 s covers a writer descheduled on a loaded host many times
#: over, and is what a slow sender can hold a session's thread for per frame.
FRAME_TIMEOUT_S = 10.0
#: A session that sends nothing between frames for this long is closed. Engines call many
#: times a second while they serve, so only a pool larger than the client's concurrency, or
#: a client that stopped serving, reaches it; closing then costs the client one handshake
#: (plus, with auth on, one Attach call: about a millisecond) on its next call, once a
#: minute at most per session, while a forgotten session no longer keeps a thread, a
#: descriptor and a buffer for SESSION_MAX_S. The caps' reaping (REAP_IDLE_S) frees slots
#: much sooner when they are wanted; this bounds what is held when they are not.
IDLE_LIMIT_S = 60.0
#: A session idle between frames at least this long may be closed to admit a new one at a
#: cap. A client in use sends on its sessions every few milliseconds; one idle for a second
#: belongs to a pool larger than its load, so closing it rarely cuts a request about to be
#: sent (and a cut one is retried by the client on a new session).
REAP_IDLE_S = 1.0
#: What a session's buffer is kept at between frames. A Lookup or Get of ~1,900 keys fits
#: (34 bytes a key); engines batch tens to hundreds. 256 sessions keep at most 16 MiB.
STANDING_BYTES = 64 * 1024
#: Frames up to this size are read into the session's buffer, doubled as their bytes fill it
#: (so it holds at most twice what arrived) and cut back to STANDING_BYTES after the frame;
#: larger ones into an anonymous mapping of their own, which the kernel takes back when it
#: is closed. Every Lookup, Get or Reserve of server.max_batch_keys (4096) keys is under it
#: (~140-160 KiB). Not a mapping for all: each page first written in a fresh mapping faults
#: (a 70 KiB frame took 77 us into a mapping against 8 us into the heap, on a 2-core VM),
#: while freed heap is kept and reused (kvstore/memory.py) -- so what slow partial frames
#: can leave the heap holding is bounded by 256 sessions x 256 KiB = 64 MiB.
HEAP_FRAME_BYTES = 256 * 1024
#: The most keys one lookups report may count: a client sends one every 50 ms at most, of
#: what its lookups found meanwhile (a million keys is 20 million a second).
MAX_REPORTED_KEYS = 1 << 20
LOCAL_CLIENT = "unix:local"  #: whom a peer the socket cannot name is charged to (auth off)

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid (SO_PEERCRED)

Handler = Callable[[Caller, Any], Any]


def _verbs(v: Verbs) -> dict[int, tuple[str, Callable[[bytes], Any], Handler]]:
    handlers: dict[int, tuple[Callable[[bytes], Any], Handler]] = {
        LOOKUP: (decoder(pb.LookupRequest), v.lookup),
        GET: (decoder(pb.GetRequest), v.get_shared),
        RESERVE: (decoder(pb.ReserveRequest), v.reserve),
        COMMIT: (decoder(pb.PutRequest), v.commit),
        RELEASE: (decoder(pb.ReleaseRequest), v.release),
    }
    named = {verb: (VERB_NAMES[verb], *handler) for verb, handler in handlers.items()}
    named[READS] = ("ReportReads", decoder(pb.LookupRequest), partial(_reads, v))
    named[LOOKUPS_READ] = ("ReportLookups", _looked, partial(_lookups, v))
    named[GRANT] = (VERB_NAMES[GRANT], _grant_asked, v.grant)
    named[COMMIT_GRANTED] = (VERB_NAMES[COMMIT_GRANTED], _granted_commit, v.commit_granted)
    return named


def _grant_asked(body: bytes) -> tuple[int, int, int, str] | Undecodable:
    """A GRANT body (localframe.GRANT_REQUEST, then the namespace): pages, timeout in ms,
    pages a run, namespace."""
    if len(body) < GRANT_REQUEST.size:
        return Undecodable(f"a Grant request is {GRANT_REQUEST.size} bytes and a namespace; "
                           f"got {len(body)} bytes")
    pages, timeout_ms, run_pages = GRANT_REQUEST.unpack_from(body)
    try:
        return pages, timeout_ms, run_pages, body[GRANT_REQUEST.size:].decode("utf-8")
    except UnicodeDecodeError:
        return Undecodable("a Grant request's namespace is not UTF-8")


def _granted_commit(body: bytes) -> GrantedCommit | Undecodable:
    """A COMMIT_GRANTED body (localframe.COMMITTED, ...), every length checked against what
    arrived before anything is read from it."""
    if len(body) < COMMITTED.size:
        return Undecodable(f"a CommitGranted request starts with {COMMITTED.size} bytes; got "
                           f"{len(body)}")
    grant_id, count, flags, ns_length = COMMITTED.unpack_from(body)
    at = COMMITTED.size + ns_length
    parent_end = at + (KEY_BYTES if flags & HAS_PARENT else 0)
    pages_at = parent_end + count * BLOCK.size
    if flags & ~(HAS_PARENT | INDEPENDENT) or pages_at > len(body):
        return Undecodable(f"a CommitGranted request of {count} blocks (flags {flags}) needs "
                           f"{pages_at} bytes before its page numbers; got {len(body)}")
    if (len(body) - pages_at) % PAGE_NUMBER.size:
        return Undecodable(f"a CommitGranted request's page numbers are {PAGE_NUMBER.size} "
                           f"bytes each; {len(body) - pages_at} bytes follow its blocks")
    try:
        namespace = body[COMMITTED.size:at].decode("utf-8")
    except UnicodeDecodeError:
        return Undecodable("a CommitGranted request's namespace is not UTF-8")
    blocks = list(BLOCK.iter_unpack(body[parent_end:pages_at]))
    numbers = np.frombuffer(body, dtype="<u4", offset=pages_at).astype(np.int64)
    return (grant_id, namespace, body[at:parent_end], bool(flags & INDEPENDENT), blocks,
            numbers)


def _looked(body: bytes) -> tuple[int, int, str] | Undecodable:
    """Verb 7's body (localframe.LOOKED, then the namespace): keys found, tokens each
    covers, namespace."""
    if len(body) < LOOKED.size:
        return Undecodable(f"a lookups report is {LOOKED.size} bytes and a namespace; got "
                           f"{len(body)} bytes")
    found, block_tokens = LOOKED.unpack_from(body)
    try:
        return found, block_tokens, body[LOOKED.size:].decode("utf-8")
    except UnicodeDecodeError:
        return Undecodable("a lookups report's namespace is not UTF-8")


def _reads(v: Verbs, caller: Caller, request: pb.LookupRequest) -> pb.LookupResponse:
    """Reads a client made through its read table, reported in a batch: touched in the
    eviction order and counted as hits. Only the caller's tenant's namespaces (and so only
    its own arena's blocks) can be named."""
    caller.data(request.namespace)
    v.store.reader.reads_reported(request.namespace, request.keys)
    return pb.LookupResponse()


def _lookups(v: Verbs, caller: Caller, report: tuple[int, int, str]) -> pb.LookupResponse:
    """How many keys a client's Lookups found through its read table, reported in a batch:
    counted in its tenant's prefix hits. Counts only: nothing else changes."""
    found, block_tokens, namespace = report
    caller.data(namespace)
    if block_tokens > MAX_BLOCK_TOKENS:
        raise InvalidArgument(f"block_tokens {block_tokens} exceeds {MAX_BLOCK_TOKENS}",
                              field="block_tokens", limit=MAX_BLOCK_TOKENS)
    if found > MAX_REPORTED_KEYS:
        raise InvalidArgument(f"a lookups report counts {found} keys, over "
                              f"{MAX_REPORTED_KEYS}", field="found", limit=MAX_REPORTED_KEYS)
    v.store.lookups_reported(namespace, found, block_tokens)
    return pb.LookupResponse()


def peer_client(conn: socket.socket) -> str:
    """The client an auth-off session is charged to: its peer process, `unix:pid:<pid>`, as
    the kernel names it (SO_PEERCRED). A peer in another pid namespace (another container)
    shows pid 0: it is named by its user, `unix:uid:<uid>`, so the processes of one user
    there share one cap. Where the socket gives no credentials, LOCAL_CLIENT."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except (OSError, AttributeError):  # not Linux, or not a Unix socket
        return LOCAL_CLIENT
    pid, uid, _ = _UCRED.unpack(raw)
    return f"unix:pid:{pid}" if pid > 0 else f"unix:uid:{uid}"


class _Session:
    """One open session as the sessions' table sees it: whose it is and since when it has
    waited between frames (None while it reads or answers one). Its thread writes
    idle_since without the lock; a handshake reads it under the lock, and a value a moment
    stale costs at most one request the client retries."""

    __slots__ = ("client", "conn", "idle_since")

    def __init__(self, conn: socket.socket, client: str, now: float) -> None:
        self.conn = conn
        self.client = client
        self.idle_since: float | None = now


class LocalSessions:
    """The sessions a daemon serves on its Unix socket; one thread each. Thread-safe.

    frame_timeout_s, idle_limit_s and reap_idle_s are FRAME_TIMEOUT_S, IDLE_LIMIT_S and
    REAP_IDLE_S unless a test needs them shorter."""

    def __init__(self, verbs: Verbs, auth: Auth, tickets: Tickets, metrics: Metrics,
                 faults: FaultLog, draining: threading.Event, max_frame_bytes: int,
                 clock: Callable[[], float] = time.monotonic, *,
                 frame_timeout_s: float = FRAME_TIMEOUT_S,
                 idle_limit_s: float = IDLE_LIMIT_S,
                 reap_idle_s: float = REAP_IDLE_S) -> None:
        self._verbs = _verbs(verbs)
        self._store = verbs.store
        self._auth = auth
        self._tickets = tickets
        self._metrics = metrics
        self._faults = faults
        self._draining = draining
        self.max_frame_bytes = max_frame_bytes
        self._clock = clock
        self._frame_timeout_s = frame_timeout_s
        self._idle_limit_s = idle_limit_s
        self._reap_idle_s = reap_idle_s
        self._lock = threading.Lock()
        self._open: dict[socket.socket, _Session] = {}

    def open(self, conn: socket.socket, ticket: str) -> bool:
        """Answer a `HOT <ticket>` handshake; on success the session runs on its own thread
        and owns conn (True). Else the refusal is sent and the caller closes conn."""
        words = ticket.split() or ["-"]
        ticket = words[0]
        try:
            caller = self._caller(conn, ticket)
            session = self._admit(conn, caller.client, ticket)
        except (Unauthenticated, ResourceExhausted) as exc:
            send_line(conn, {"error": str(exc), "reason": exc.reason})
            return False
        try:
            self._welcome(conn, caller, TABLES_OPTION in words[1:])
            threading.Thread(target=self._serve, args=(session, caller),
                             name="local-session", daemon=True).start()
        except (OSError, RuntimeError) as exc:  # RuntimeError: no thread could be started
            log.info("local session of %s not started: %s", caller.client, exc)
            self._forget(session)
            return False
        return True

    def _welcome(self, conn: socket.socket, caller: Caller, tables: bool) -> None:
        """The handshake's answer. Asked for tables (`HOT <ticket> tables`), it also names
        the caller's tenant's read tables, one read-only descriptor each sent with the line
        (an empty list when the daemon publishes none: dram.read_table off)."""
        hot: dict[str, object] = {"version": VERSION, "max_frame_bytes": self.max_frame_bytes}
        if not tables:
            send_line(conn, {"hot": hot})
            return
        published = self._store.read_tables
        given = published.fds(caller.tenant.name) if published is not None else []
        hot["tables"] = [{"arena": name, "size_bytes": size} for name, _, size in given]
        try:
            payload = _line({"hot": hot})
            if given:
                socket.send_fds(conn, [payload], [fd for _, fd, _ in given])
            else:
                conn.sendall(payload)
        finally:
            for _, fd, _ in given:
                os.close(fd)

    def close(self) -> None:
        """End every session (the daemon stops): their clients see the socket close."""
        with self._lock:
            for conn in self._open:
                _hang_up(conn)

    def _caller(self, conn: socket.socket, ticket: str) -> Caller:
        """Who the handshake's session would serve. The ticket is only looked at: it is
        used up when the session is admitted (`_admit`), so a refusal leaves it good."""
        if not self._auth.on:
            return Caller(OPEN, peer_client(conn))
        tenant = self._tickets.peek(ticket) if ticket and ticket != "-" else None
        if tenant is None:
            raise Unauthenticated(_BAD_TICKET)
        return self._current(tenant)

    def _admit(self, conn: socket.socket, client: str, ticket: str) -> _Session:
        """The session of conn, entered in the table: room made at a cap by closing an idle
        session, the ticket (auth on) used up. ResourceExhausted when there is no room."""
        now = self._clock()
        with self._lock:
            victim = self._room_for(client, now)
            if self._auth.on and self._tickets.redeem(ticket) is None:
                raise Unauthenticated(_BAD_TICKET)  # used by another handshake meanwhile
            if victim is not None:
                log.debug("local path: closed an idle session of %s (idle %.1f s) to admit "
                          "one of %s", victim.client, now - (victim.idle_since or now), client)
                self._drop(victim)
            session = self._open[conn] = _Session(conn, client, now)
            self._metrics.local_sessions.set(len(self._open))
        return session

    def _room_for(self, client: str, now: float) -> _Session | None:
        """None when a session of client fits under both caps; else the session to close to
        make room (the least recently active of those idle for reap_idle_s: client's own at
        its cap, anyone's at the total). Called under the lock."""
        mine = [s for s in self._open.values() if s.client == client]
        if len(mine) >= MAX_SESSIONS_PER_CLIENT:
            pool = mine
        elif len(self._open) >= MAX_SESSIONS:
            pool = list(self._open.values())
        else:
            return None
        idle = [s for s in pool
                if s.idle_since is not None and now - s.idle_since >= self._reap_idle_s]
        if idle:
            return min(idle, key=lambda s: s.idle_since or now)
        raise ResourceExhausted(
            f"{len(self._open)} local sessions are open ({len(mine)} of this client's), none "
            f"idle for {self._reap_idle_s:g} s; at most {MAX_SESSIONS} "
            f"({MAX_SESSIONS_PER_CLIENT} per client): use gRPC for now, or retry later",
            Reason.TOO_MANY_SESSIONS, limit=MAX_SESSIONS_PER_CLIENT
            if len(mine) >= MAX_SESSIONS_PER_CLIENT else MAX_SESSIONS)

    def _drop(self, session: _Session) -> None:
        """Take session out of the table and hang up its socket, so its thread reads the end
        and exits. Called under the lock, so its thread cannot close the socket (and its
        descriptor be reused) in between."""
        self._open.pop(session.conn, None)
        _hang_up(session.conn)

    def _current(self, name: str) -> Caller:
        """The tenant as the tenants file says now (re-read on SIGHUP): removed, it is
        refused from its next request on."""
        tenant = self._auth.tenants.named(name)
        if tenant is None:
            raise Unauthenticated(f"tenant {name!r} is no longer in auth.tenants_file")
        return Caller(tenant, tenant.name)

    def _forget(self, session: _Session) -> None:
        with self._lock:
            if self._open.get(session.conn) is session:
                del self._open[session.conn]
            self._metrics.local_sessions.set(len(self._open))

    def _serve(self, session: _Session, caller: Caller) -> None:
        """The session's thread: frames read and answered one at a time until the client
        leaves, a limit closes the session, or anything at all goes wrong."""
        conn = session.conn
        try:
            self._run(session, caller)
        except (OSError, _Broken) as exc:
            log.debug("local session of %s ended: %s", caller.client, exc)
        except Exception as exc:  # a bug: this session ends, the daemon and others go on
            log.error("local session of %s ended by an unexpected error: %s: %s",
                      caller.client, type(exc).__name__, str(exc).replace("\n", " "))
            log.debug("the local session's unexpected error", exc_info=True)
        finally:
            self._forget(session)  # before the close: a handshake never hangs up a reused fd
            conn.close()

    def _run(self, session: _Session, caller: Caller) -> None:
        born = self._clock()
        frames = _Frames(session.conn, self.max_frame_bytes, self._frame_timeout_s,
                         self._clock)
        while True:
            session.idle_since = self._clock()
            begun = frames.wait(self._idle_limit_s)
            session.idle_since = None
            if not begun:
                return
            verb, body = frames.read()
            status, reply = self._answer(caller, verb, body)
            if verb in NO_REPLY:  # a posted report: nobody waits, nothing is sent
                continue
            closing = self._clock() - born >= SESSION_MAX_S
            send_reply(session.conn, status, reply, closing)
            if closing:
                return

    def _answer(self, caller: Caller, verb: int, body: bytes | None) -> tuple[int, bytes]:
        """(status, reply bytes) of one request; an error's bytes are a serialized
        google.rpc.Status with its ErrorInfo."""
        started = time.perf_counter()
        entry = self._verbs.get(verb)
        method = entry[0] if entry else "Unknown"
        try:
            if body is None:
                raise self._too_large()
            if entry is None:
                raise InvalidArgument(f"verb {verb} is not a local verb (one of "
                                      f"{sorted(self._verbs)})", field="verb")
            caller = self._admitted(caller, method)
            request = parsed(entry[1](body))
            response = entry[2](caller, request)
        except Exception as exc:
            return self._failed(method, caller, exc, started)
        self._metrics.observe_local(method, "OK", time.perf_counter() - started)
        # A protobuf message, or a struct-packed reply already in bytes (Grant's).
        return 0, response if isinstance(response, bytes) else response.SerializeToString()

    def _too_large(self) -> ResourceExhausted:
        """The error of a frame over max_frame_bytes (its bytes were read and dropped)."""
        return ResourceExhausted(f"the frame is over max_frame_bytes ({self.max_frame_bytes}, "
                                 "server.max_message_bytes)", Reason.MESSAGE_TOO_LARGE,
                                 limit=self.max_frame_bytes, setting="server.max_message_bytes")

    def _admitted(self, caller: Caller, method: str) -> Caller:
        """What every request passes before it is parsed: a daemon not draining (a Release
        still goes), and the caller's tenant as the tenants file says now."""
        if self._draining.is_set() and method != "Release":
            raise Unavailable("the daemon is draining (it is stopping): retry on another "
                              "replica or after its restart", Reason.DRAINING)
        return self._current(caller.tenant.name) if self._auth.on else caller

    def _failed(self, method: str, caller: Caller, exc: Exception,
                started: float) -> tuple[int, bytes]:
        """A request's failure counted (metrics, the fault log) and answered: (status, a
        serialized google.rpc.Status)."""
        status = described(exc)
        code = code_of(status)
        self._metrics.observe_local(method, code.name, time.perf_counter() - started)
        self._faults.fault(method, caller.client, code, status.message)
        return status.code, status.SerializeToString()


_BAD_TICKET = "unknown, used or expired ticket (call Attach again, and redeem it within 30 s)"


class _Broken(Exception):
    """A frame that cannot be read whole, or a session idle past its limit: it ends."""


class _Frames:
    """One session's requests, read off its socket.

    Between frames the session waits up to an idle limit for a header's first byte; from
    that byte on, the whole frame (header and body) must arrive by one deadline, however
    the bytes trickle in. A body is read into the session's buffer (made at STANDING_BYTES
    when its first body byte arrives, doubled as bytes fill it up to HEAP_FRAME_BYTES, cut
    back after the frame) or, larger, into an anonymous mapping made when its first byte
    arrives: the kernel gives it pages as bytes land and takes them back when it is closed.
    So a session holds about what it has received, and the daemon's heap, which keeps what it
    frees (kvstore/memory.py), never grows by more than HEAP_FRAME_BYTES a session for a frame
    in flight. Each body is handed on as bytes of its own, and no view of the buffer outlives
    a read, so the buffer can be resized and no frame aliases it.
    """

    def __init__(self, conn: socket.socket, limit: int, frame_timeout_s: float,
                 clock: Callable[[], float]) -> None:
        self._conn = conn
        self._limit = limit
        self._frame_timeout_s = frame_timeout_s
        self._clock = clock
        self._head = bytearray(REQUEST.size)
        self._got = 0  # header bytes of the next frame already read
        self._deadline = 0.0
        self._standing: bytearray | None = None

    def wait(self, idle_limit_s: float) -> bool:
        """Wait for the next frame's first byte: False when the client closed the session
        instead, _Broken past idle_limit_s. The frame's deadline starts at that byte."""
        self._conn.settimeout(idle_limit_s)
        try:
            got = self._conn.recv_into(self._head)
        except TimeoutError:
            raise _Broken(f"idle between frames for {idle_limit_s:g} s") from None
        self._got = got
        self._deadline = self._clock() + self._frame_timeout_s
        return got > 0

    def read(self) -> tuple[int, bytes | None]:
        """The frame begun by `wait`: (verb, body), body None when it is over the limit (its
        bytes read and dropped)."""
        with memoryview(self._head) as head:
            self._fill(head, self._got)
        length, verb = REQUEST.unpack(self._head)
        if length > self._limit:
            self._skip(length)
            return verb, None
        if length == 0:
            return verb, b""
        if length > HEAP_FRAME_BYTES:
            return verb, self._mapped(length)
        return verb, self._buffered(length)

    def _standing_buffer(self) -> bytearray:
        """The session's buffer, made once a body byte has arrived."""
        if self._standing is None:
            self._arrival()
            self._standing = bytearray(STANDING_BYTES)
        return self._standing

    def _buffered(self, length: int) -> bytes:
        """A body read into the session's buffer, doubled whenever arrived bytes fill it."""
        buffer = self._standing_buffer()
        got = 0
        try:
            while got < length:
                if got == len(buffer):
                    buffer.extend(bytes(min(len(buffer), length - len(buffer))))
                with memoryview(buffer) as whole, whole[got:min(len(buffer), length)] as part:
                    got += self._recv(part)
            with memoryview(buffer) as whole, whole[:length] as body:
                return bytes(body)
        finally:
            if len(buffer) > STANDING_BYTES:  # a large frame's room goes back
                del buffer[STANDING_BYTES:]

    def _mapped(self, length: int) -> bytes:
        """A body read into an anonymous mapping of its own, closed once it is read."""
        self._arrival()
        with mmap.mmap(-1, length) as mapped, memoryview(mapped) as body:
            self._fill(body)
            return bytes(body)

    def _skip(self, length: int) -> None:
        """Read and drop an over-limit frame's body, by the same deadline."""
        with memoryview(self._standing_buffer()) as scratch:
            while length:
                with scratch[:min(length, STANDING_BYTES)] as part:
                    length -= self._recv(part)

    def _arrival(self) -> None:
        """Return once a body byte has arrived (left unread), so nothing is allocated for a
        header alone."""
        with memoryview(bytearray(1)) as probe:
            self._recv(probe, socket.MSG_PEEK)

    def _fill(self, view: memoryview, got: int = 0) -> None:
        """view filled from byte `got` on. Each part's view is released at once, even on
        an error, so a mapping can always be closed."""
        while got < len(view):
            with view[got:] as part:
                got += self._recv(part)

    def _recv(self, view: memoryview, flags: int = 0) -> int:
        """Some bytes into view (at least one), by the frame's deadline."""
        left_s = self._deadline - self._clock()
        if left_s <= 0:
            raise _Broken(f"a frame was not whole within {self._frame_timeout_s:g} s")
        self._conn.settimeout(left_s)
        try:
            k = self._conn.recv_into(view, len(view), flags)
        except TimeoutError:
            raise _Broken(f"a frame was not whole within {self._frame_timeout_s:g} s") \
                from None
        if k == 0:
            raise _Broken("the client closed the session inside a frame")
        return k


def _hang_up(conn: socket.socket) -> None:
    """End a session from outside its thread: its blocked read returns at once, as closed.
    A socket already reset or shut is ending anyway, so its error is not one."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


def _line(message: dict[str, object]) -> bytes:
    """A handshake answer: one line of JSON."""
    return (json.dumps(message) + "\n").encode()


def send_line(conn: socket.socket, message: dict[str, object]) -> None:
    """Send a handshake answer (a session, or a refusal)."""
    conn.sendall(_line(message))


def send_reply(conn: socket.socket, status: int, reply: bytes, closing: bool) -> None:
    """Send one reply frame: its status, whether the session ends after it (closing), and
    whether its bytes are an error's google.rpc.Status."""
    flags = (CLOSING if closing else 0) | (STATUS_BODY if status else 0)
    conn.sendall(REPLY.pack(len(reply), status, flags) + reply)
