"""The same-host fast path: whether to use the daemon's shared memory, and which.

`ShmState` owns the decision for both clients (made from one Stats call and on the arena path
one exchange of an Attach ticket; turned off for now by a refusal that passes, or for good by
one that does not), its one lock, what is attached, the tickets (`TicketKeeper`), and the
local path (`_localpath`: the hot verbs over the daemon's Unix socket) opened with it. Two
ways in:

    named segment   auth.mode off: Stats names /dev/shm/<shm_name>; same host id: attach it
    arenas          auth on: shm_name is empty and Stats names a Unix socket; same kernel
                    (the boot id: descriptors cross IPC namespaces, so pods need no hostIPC):
                    trade an Attach ticket on the socket for the tenant's arenas (_attach),
                    and look each response's `arena` up by name (an unknown one: one
                    re-Attach, then DataLoss)

The copies themselves are `_segment`'s; what passes and how long a path stays off, `_pause`'s.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from kvstore import shm
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.localframe import RELEASE

from ._attach import Arena, FetchAttach, TicketKeeper, receive_arenas
from ._buffers import ByteArray
from ._localpath import LocalPath, NoSession, NoSessionNow
from ._pause import Pause, TryLater, passes
from ._readtable import MappedTable, Post, TableReads
from ._segment import SharedSegment, attach, only_header, read_shm_get, write_reserved
from ._wire import Fetched, capacities, parse_get_header
from .errors import DataLoss, DeadlineExceeded, FailedPrecondition, KVStoreError, Unavailable

__all__ = [
    "SharedSegment",
    "ShmState",
    "only_header",
    "read_shm_get",
    "same_kernel",
    "write_reserved",
]

logger = logging.getLogger("kvstore.client")


def same_kernel(theirs: str, mine: str) -> bool:
    """Whether two host ids (kvstore.shm.host_id) name one kernel boot, whatever their IPC
    namespaces: enough for descriptors passed over a Unix socket."""
    return theirs.split(":", 1)[0] == mine.split(":", 1)[0]


class ShmState:
    """Whether the fast path is on, and the memory it uses: the one owner of that decision,
    for the blocking and the asyncio client alike.

    mode None: use it when co-located; False: never; True: required (FailedPrecondition when
    the daemon is on another host or its memory cannot be attached). unix_socket overrides
    the socket path the daemon reports (its folder may be mounted elsewhere here). clock is
    time.monotonic unless a test passes its own.

    Every method blocks the thread it runs on (RPCs through the functions it is handed,
    socket exchanges, mapping memory): the blocking client calls them on the caller's thread,
    the asyncio client in a worker thread, handing it functions that run their RPCs on its
    event loop and wait for them.

    The first decision is made once, from one Stats call (and an exchange on the arena path),
    however many threads or tasks make their first data call together: the first claims it,
    the others wait for its outcome. A Stats call that fails leaves it undecided (the call
    fails as it would inline; the next caller tries again), and so does a required path that
    cannot be had. Otherwise the outcome is one of three:

    - on: the memory is attached (and the local path opened, or paused on its own);
    - off for now: a refusal that passes (`_pause.passes`: the daemon's caps, a connection
      closed or timed out before an answer, Attach out of tickets or unreachable, its socket
      not there yet). Data moves inline without waiting until the `Pause` has passed; then
      the next data call tries again, alone (callers meanwhile go on inline, never waiting
      for its try), with a fresh Stats call and the ticket the last try did not redeem;
    - off for good: the daemon on another host or kernel, no segment and no socket,
      FEATURE_OFF, an answer that is not the protocol. Logged at INFO.

    A data call that finds the path broken (`fall_back`) turns it off for now when the
    failure passes, for good otherwise, or raises when the path is required. The lock guards
    the decision's turn, what is attached, and the pause; it is never held across an RPC or
    a socket exchange, so a caller waiting on it never waits for the daemon.
    """

    def __init__(self, mode: bool | None, unix_socket: str | None = None,
                 timeout_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 read_table: bool = True) -> None:
        """read_table: ask for the daemon's read tables with the local path, and read L2
        through them (client/_readtable.py); False: every read asks the daemon."""
        self.mode = mode
        self.read_table = read_table
        # The read table of this client's arena, opened with the local path; None: none.
        self._tables: TableReads | None = None
        self.unix_socket = unix_socket
        self.timeout_s = timeout_s
        self._clock = clock
        # The hot verbs over the daemon's Unix socket (opened with the shared memory when the
        # daemon has a socket); None: they go over gRPC. See `local`.
        self._local: LocalPath | None = None
        self.decided = mode is False
        self.segment: SharedSegment | None = None
        # Register every mapping of the daemon's memory as CUDA pinned memory, those attached
        # later too (pin_memory).
        self._pin = False
        # The arena path: the tenant's arenas by name, and the socket they came through
        # (None on the named-segment path).
        self.arenas: dict[str, SharedSegment] = {}
        self._socket_path: str | None = None
        # Attach tickets for the exchange and the local path's handshakes (arena path).
        self._tickets = TicketKeeper(clock=clock)
        # Off for now: until when, after how many refusals in a row.
        self._pause = Pause(clock)
        # Off for good (or closed): no pause may start again.
        self._for_good = False
        # Guards the decision, re-attaching, the pause and closing; never held across an RPC.
        self._lock = threading.Lock()
        # Set once the decision in flight is made (or has failed): what late callers wait on.
        self._deciding: threading.Event | None = None

    @property
    def required(self) -> bool:
        return self.mode is True

    @property
    def active(self) -> SharedSegment | None:
        """The named segment, or the first arena; None when inline."""
        if self.segment is not None:
            return self.segment
        return next(iter(self.arenas.values()), None)

    @property
    def in_use(self) -> bool | None:
        """True/False once decided (False while off for now), None before."""
        return (self.active is not None) if self.decided else None

    @property
    def local(self) -> LocalPath | None:
        """The local path when a hot verb may use it now (a session idle, or one may be
        opened: see LocalPath.ready); None: the hot verbs go over gRPC. Never blocks."""
        local = self._local
        return local if local is not None and local.ready() else None

    def needs_decision(self) -> bool:
        """Whether the next data call decides: nothing decided yet, or the path is off for
        now and its pause has passed. Never blocks (a look at two attributes and the clock),
        so the asyncio client asks it on its loop."""
        return not self.decided or self._pause.due()

    def segment_for(
        self,
        fetch_stats: Callable[[], pb.StatsResponse],
        fetch_attach: FetchAttach | None = None,
    ) -> SharedSegment | None:
        """The segment (or first arena) to use, or None for inline; decides first when
        needs_decision (fetch_stats is the one Stats call, fetch_attach the Attach RPC)."""
        while self.needs_decision():
            turn = self._claim()
            if turn is _GO_ON:
                break
            if turn is not None:
                turn.wait()
                continue
            try:
                self._try(fetch_stats, fetch_attach)
            finally:
                self._end_turn()
        return self.active

    def _claim(self) -> threading.Event | None:
        """None when the caller is to decide now (the turn is its own until `_end_turn`);
        _GO_ON when there is nothing to decide (decided between the caller's look and now)
        or another caller is trying again after a pause (this one goes on inline); else the
        first decision's turn to wait for, after which the caller looks again."""
        with self._lock:
            if not self.needs_decision():
                return _GO_ON
            if self._deciding is None:
                self._deciding = threading.Event()
                return None
            return self._deciding if not self.decided else _GO_ON

    def _end_turn(self) -> None:
        """The decision is made, or failed: wake the waiters either way."""
        with self._lock:
            turn, self._deciding = self._deciding, None
        if turn is not None:
            turn.set()

    def _try(self, fetch_stats: Callable[[], pb.StatsResponse],
             fetch_attach: FetchAttach | None) -> None:
        """Decide from a fresh Stats call. Its failure is raised on the first decision and,
        on a try after a pause, starts the next pause."""
        retrying = self.decided
        try:
            stats = fetch_stats()
        except KVStoreError as exc:
            if not retrying:
                raise
            self._off_for_now(f"Stats failed: {exc}")
            return
        self.decide(stats, fetch_attach)

    def decide(self, stats: pb.StatsResponse, fetch_attach: FetchAttach | None = None) -> None:
        """Decide from the daemon's Stats; attach when co-located, and open the local path
        when the daemon has a Unix socket. On the arena path the tickets come from
        fetch_attach, from whichever thread needs one."""
        try:
            path = self._route(stats)
            if path is None:
                segment = self._pinned(attach(stats.shm_name))
                with self._lock:
                    old, self.segment = self.segment, segment
                if old is not None:
                    old.close()
                self._open_local(self.unix_socket or stats.unix_socket, TicketKeeper())
            else:
                if fetch_attach is None:
                    raise FailedPrecondition(
                        "the daemon's memory is reached only through Attach")
                self._tickets.bind(fetch_attach)
                self._take_arenas(path, self._tickets.use(
                    lambda ticket: receive_arenas(path, ticket)))
                self._open_local(path, self._tickets)
        except KVStoreError as exc:
            self._refuse(exc)
            return
        self._on()

    def _open_local(self, path: str, tickets: TicketKeeper) -> None:
        """Send the hot verbs over the daemon's Unix socket from now on, when it has one and
        gives a session; when it refuses one for now, the local path is kept paused (it
        tries again on its own)."""
        if not path:
            return
        local = LocalPath(path, tickets, self.timeout_s, self._clock)
        given: list[tuple[str, int, int]] | None = None
        try:
            if self.read_table:  # the first session brings the read tables
                given = local.open_tables()
            else:
                local.probe()
        except NoSessionNow as exc:  # paused, and logged at INFO, by the local path itself
            logger.debug("kvstore: the local path's first session waits for its pause: %s", exc)
        except NoSession as exc:
            local.close()
            logger.info("kvstore: local path off, hot verbs use gRPC: %s", exc)
            return
        with self._lock:
            old, self._local = self._local, local
        if old is not None:
            old.close()
        if given is not None:
            self._map_tables(given)

    def _map_tables(self, given: list[tuple[str, int, int]]) -> None:
        """Map the read table the daemon passed with the first session (arena, descriptor,
        size), over the arena (or named segment) it describes, and close the descriptors;
        without one (the daemon publishes none: dram.read_table off, or it passed several)
        every read asks the daemon."""
        tables: TableReads | None = None
        try:
            if len(given) == 1:
                arena, fd, size_bytes = given[0]
                segment = self._segment_of(arena)
                if segment is not None:
                    tables = TableReads(MappedTable(arena, fd, size_bytes), segment)
            else:
                logger.debug("kvstore: the daemon passed %d read tables; reads ask it",
                             len(given))
        except (OSError, ValueError) as exc:
            logger.info("kvstore: read table not mapped, reads ask the daemon: %s", exc)
        finally:
            for _, fd, _ in given:
                os.close(fd)
        with self._lock:
            old, self._tables = self._tables, tables
            local = self._local
        if local is not None:  # the reports go ahead of the local path's next request
            local.ahead = tables.reports.framed if tables is not None else None
        if old is not None:
            old.close()

    def _segment_of(self, arena: str) -> SharedSegment | None:
        """The memory a table of arena describes: the named segment, or the arena."""
        return self.segment if self.segment is not None else self.arenas.get(arena)

    @property
    def tables(self) -> TableReads | None:
        """The read table to read through now: None when there is none, or when the memory
        it was opened over has been replaced (the daemon restarted: its next table comes
        with the next decision)."""
        tables = self._tables
        if tables is None or self._segment_of(tables.table.arena) is not tables.segment:
            return None
        return tables

    @property
    def reports_pending(self) -> bool:
        """Whether reads through the table wait to be reported (never blocks)."""
        tables = self._tables
        return tables is not None and tables.reports.pending

    def reports_in(self) -> None:
        """Make sure the daemon has taken in what this client read through the table before
        a call that may depend on it (one over gRPC: an Evict, a Stats, a Prefetch): when
        reports are pending, they go ahead of an empty Release on a local session, whose
        answer is waited for. A failure is logged: the reports are a hint."""
        tables, local = self._tables, self._local
        if tables is None or local is None or not tables.reports.pending:
            return
        # Taken now, so that a call this one makes (an Attach for a session's ticket) finds
        # nothing pending.
        ahead = tables.reports.framed()
        try:
            local.call(RELEASE, pb.ReleaseRequest(), pb.ReleaseResponse, ahead)
        except KVStoreError as exc:
            logger.debug("kvstore: reads through the table not reported before a call: %s",
                         exc)

    def report_post(self) -> Post | None:
        """How reports of reads through the table reach the daemon: the local path's
        unanswered posts; None while it is off."""
        local = self._local
        return local.post if local is not None else None

    def local_off(self, exc: NoSession) -> None:
        """A local session could not be had: for this call only when that passes
        (NoSessionNow: the local path paused itself), else the hot verbs use gRPC for
        good."""
        if isinstance(exc, NoSessionNow):
            return
        with self._lock:
            local, self._local = self._local, None
            tables, self._tables = self._tables, None
        if tables is not None:  # its reads could no longer be reported
            tables.close()
        if local is not None:
            logger.info("kvstore: local path off, hot verbs use gRPC: %s", exc)
            local.close()

    def _route(self, stats: pb.StatsResponse) -> str | None:
        """None: attach stats.shm_name by name; else the Unix socket to Attach through.
        FailedPrecondition (why) when neither can work."""
        mine = shm.host_id()
        elsewhere = FailedPrecondition(
            f"the daemon runs on another host (host_id {stats.host_id!r}, ours {mine!r})"
        )
        if stats.shm_name:
            if stats.host_id != mine:
                raise elsewhere
            return None
        path = self.unix_socket or stats.unix_socket
        if not path:
            raise FailedPrecondition(
                "the daemon has no shared-memory segment (shm_name is empty) and no Unix socket"
            )
        if not same_kernel(stats.host_id, mine):
            raise elsewhere
        return path

    def pin_memory(self) -> bool:
        """Register every mapping of the daemon's memory as CUDA pinned memory, now and as
        each is attached (SharedSegment.pin); whether any mapped now is."""
        self._pin = True
        with self._lock:
            held = [s for s in (self.segment, *self.arenas.values()) if s is not None]
        return any([s.pin() for s in held])

    def _pinned(self, segment: SharedSegment) -> SharedSegment:
        if self._pin:
            segment.pin()
        return segment

    def _take_arenas(self, path: str, arenas: list[Arena]) -> None:
        fresh = {arena.name: self._pinned(SharedSegment(arena)) for arena in arenas}
        with self._lock:
            old, self.arenas = self.arenas, fresh
            self._socket_path = path
        for segment in old.values():
            segment.close()

    def _refuse(self, exc: KVStoreError) -> None:
        """The way in failed: raise (required, or an RPC failure of the first decision that
        is not about the fast path), off for now (it passes), or off for good."""
        if self.required:
            if isinstance(exc, (Unavailable, DeadlineExceeded, FailedPrecondition)):
                raise exc
            raise FailedPrecondition(f"shared memory is required but cannot be had: {exc}")
        if passes(exc):
            self._off_for_now(str(exc))
            return
        self.disable(str(exc))

    def _on(self) -> None:
        """The decision is made and the memory attached: on, and said so after a pause."""
        with self._lock:
            off_s = self._pause.clear()
            self.decided = True
            self._for_good = False
        if off_s is not None:
            logger.info("kvstore: shared-memory path back on after %.1f s", off_s)

    def _off_for_now(self, why: str) -> None:
        """Inline until a pause has passed, then the next data call tries again. Logged at
        INFO when the path goes off, at DEBUG when a try after a pause fails again; nothing
        when another call's failure already paused it or it is off for good."""
        with self._lock:
            if self._pause.off() or (self._for_good and self.decided):
                return
            held = self._release()
            pause_s = self._pause.fail()
            first = self._pause.failures == 1
            self.decided = True
        if first:
            logger.info("kvstore: shared-memory path off for now, data moves inline: %s; "
                        "trying again in %.1f s", why, pause_s)
        else:
            logger.debug("kvstore: shared-memory path still off: %s; trying again in %.1f s",
                         why, pause_s)
        _close(held)

    def needs_attach(self, name: str) -> bool:
        """Whether a response names an arena this client does not hold (arena path only)."""
        return bool(name) and self._socket_path is not None and name not in self.arenas

    def ensure_arena(self, name: str, fetch_attach: FetchAttach) -> None:
        """Before a response's arena is used: one re-Attach when it names one not held (the
        daemon restarted, or added one); segment_named then finds it or raises DataLoss."""
        if not self.needs_attach(name):
            return
        path = self._socket_path or ""
        try:
            self._tickets.bind(fetch_attach)
            self._take_arenas(path, self._tickets.use(
                lambda ticket: receive_arenas(path, ticket)))
        except KVStoreError as exc:
            raise _reattach_failed(name, exc) from None

    def fall_back(self, exc: FailedPrecondition) -> None:
        """A data call found the fast path unusable: re-raise exc when it is required, else
        turn it off (for now when the failure passes, else for good) so this call and the
        later ones go inline."""
        if self.required:
            raise exc
        if passes(exc):
            self._off_for_now(str(exc))
        else:
            self.disable(str(exc))

    def segment_named(self, name: str) -> SharedSegment:
        """The segment or arena a response names; re-attaches by name if the daemon moved to
        a new segment. On the arena path an arena not held is DataLoss (ensure_arena first)."""
        if self._socket_path is not None:
            arenas = self.arenas
            if not arenas:  # closed, or turned off by another call meanwhile
                raise TryLater("the shared-memory path was turned off meanwhile")
            arena = arenas.get(name)
            if arena is None:
                raise DataLoss(f"the response names arena {name!r}, which the daemon did not "
                               "pass this client" if name else "the response names no arena")
            return arena
        current = self.segment
        if current is not None and (not name or name == current.name):
            return current
        if not name:
            raise DataLoss("the response names no shared-memory segment")
        with self._lock:
            current = self.segment
            if current is not None and name == current.name:
                return current
            fresh = self._pinned(attach(name))
            self.segment = fresh
        if current is not None:
            current.close()
        return fresh

    def write_reservation(
        self, reserved: pb.ReserveResponse, payloads: Sequence[memoryview]
    ) -> list[int]:
        """Write the payloads into the extents Reserve gave; each payload's checksum as
        written (0 for keys that exist), for the commit."""
        if len(reserved.exists) == len(payloads) and all(reserved.exists):
            return [0] * len(payloads)  # nothing to write, so no memory to name
        segment = self.segment_named(reserved.arena or reserved.shm_name)
        return write_reserved(segment, reserved, payloads)

    def read_get(
        self,
        response: pb.GetResponse,
        num_keys: int,
        arrays: list[ByteArray] | None,
        verify_checksums: bool,
    ) -> Fetched:
        """What a shared-memory Get's one response points at, checked and copied out."""
        header = parse_get_header(response, num_keys, capacities(arrays))
        if not header.found_index:
            return Fetched(header, [])
        segment = self.segment_named(response.arena or response.shm_name)
        return read_shm_get(segment, response, header, arrays, verify_checksums)

    def disable(self, reason: str) -> None:
        """Fall back to inline transfers for the rest of this client's life."""
        logger.info("kvstore: shared-memory path off: %s", reason)
        with self._lock:
            self.decided = True
            held = self._end()
        _close(held)

    def close(self) -> None:
        """Let go of everything attached (what was read through the table is reported
        first); nothing is tried again."""
        tables, post = self._tables, self.report_post()
        if tables is not None and post is not None:
            tables.reports.flush(post)
        with self._lock:
            held = self._end()
        _close(held)

    def _end(self) -> list[SharedSegment | LocalPath | TableReads]:
        """Off for good: no pause, no kept ticket, what is attached taken out (returned, for
        the caller to close outside the lock). Under the lock."""
        self._for_good = True
        self._pause.clear()
        self._tickets.clear()
        return self._release()

    def _release(self) -> list[SharedSegment | LocalPath | TableReads]:
        """Take what is attached out of the state; the caller closes it, outside the lock.
        Under the lock."""
        held: list[SharedSegment | LocalPath | TableReads] = [*self.arenas.values()]
        if self.segment is not None:
            held.append(self.segment)
        if self._local is not None:
            held.append(self._local)
        if self._tables is not None:
            held.append(self._tables)
        self.segment, self.arenas, self._local, self._tables = None, {}, None, None
        return held


def _close(held: list[SharedSegment | LocalPath | TableReads]) -> None:
    for item in held:
        item.close()


_GO_ON = threading.Event()  # the turn of a caller who does not decide and does not wait


def _reattach_failed(name: str, exc: KVStoreError) -> KVStoreError:
    """A failed re-Attach: UNAVAILABLE as it is (the call is retried), TryLater when it
    passes (the call goes inline for now), else FailedPrecondition (the call goes inline
    for good, or fails when shared memory is required)."""
    if isinstance(exc, (Unavailable, DeadlineExceeded)):
        return exc
    if passes(exc):
        return TryLater(f"re-Attach for arena {name!r} failed: {exc}")
    return FailedPrecondition(f"re-Attach for arena {name!r} failed: {exc}")
