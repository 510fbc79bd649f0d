"""The same-host fast path: whether to use the daemon's shared memory, and which.

`ShmState` owns the decision for both clients (made once, from one Stats call and on the
arena path one Attach; undone for good by a fall-back), its one lock, what is attached, and
the local path (`_localpath`: the hot verbs over the daemon's Unix socket) opened with it.
Two ways in:

    named segment   auth.mode off: Stats names /dev/shm/<shm_name>; same host id: attach it
    arenas          auth on: shm_name is empty and Stats names a Unix socket; same kernel
                    (the boot id: descriptors cross IPC namespaces, so pods need no hostIPC):
                    Attach, trade its ticket on the socket for the tenant's arenas (_attach),
                    and look each response's `arena` up by name (an unknown one: one
                    re-Attach, then DataLoss)

The copies themselves are `_segment`'s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from kvstore import shm
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb

from ._attach import Arena, receive_arenas
from ._buffers import ByteArray
from ._localpath import LocalPath, NoSession
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

FetchAttach = Callable[[], pb.AttachResponse]


def same_kernel(theirs: str, mine: str) -> bool:
    """Whether two host ids (kvstore.shm.host_id) name one kernel boot, whatever their IPC
    namespaces: enough for descriptors passed over a Unix socket."""
    return theirs.split(":", 1)[0] == mine.split(":", 1)[0]


class ShmState:
    """Whether the fast path is on, and the memory it uses: the one owner of that decision,
    for the blocking and the asyncio client alike.

    mode None: use it when co-located; False: never; True: required (FailedPrecondition when
    the daemon is on another host or its memory cannot be attached). unix_socket overrides
    the socket path the daemon reports (its folder may be mounted elsewhere here).

    Every method blocks the thread it runs on (RPCs through the functions it is handed,
    socket exchanges, mapping memory): the blocking client calls them on the caller's thread,
    the asyncio client in a worker thread, handing it functions that run their RPCs on its
    event loop and wait for them.

    The decision is made once, from one Stats call (and an Attach on the arena path), however
    many threads or tasks make their first data call together: the first claims it, the
    others wait for its outcome. A Stats or Attach that fails with UNAVAILABLE (or a required
    path that cannot be had) leaves it undecided, and the next caller tries again; any other
    failure of the way in means inline, logged at INFO. A data call that finds the path
    broken falls back to inline for good (`fall_back`), unless the path is required.
    """

    def __init__(self, mode: bool | None, unix_socket: str | None = None,
                 timeout_s: float = 30.0) -> None:
        self.mode = mode
        self.unix_socket = unix_socket
        self.timeout_s = timeout_s
        # The hot verbs over the daemon's Unix socket (opened with the shared memory when the
        # daemon has a socket); None: they go over gRPC.
        self.local: LocalPath | None = None
        self.decided = mode is False
        self.segment: SharedSegment | None = None
        # The arena path: the tenant's arenas by name, and the socket they came through
        # (None on the named-segment path).
        self.arenas: dict[str, SharedSegment] = {}
        self._socket_path: str | None = None
        # Guards the decision, re-attaching and closing; never held across an RPC, so a
        # caller waiting on it never waits for the daemon.
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
        """True/False once decided, None before."""
        return (self.active is not None) if self.decided else None

    def segment_for(
        self,
        fetch_stats: Callable[[], pb.StatsResponse],
        fetch_attach: FetchAttach | None = None,
    ) -> SharedSegment | None:
        """The segment (or first arena) to use, or None for inline; decides first when
        undecided (fetch_stats is the one Stats call, fetch_attach the Attach RPC)."""
        while not self.decided:
            turn = self._claim()
            if turn is not None:
                turn.wait()
                continue
            try:
                self.decide(fetch_stats(), fetch_attach)
            finally:
                self._end_turn()
        return self.active

    def _claim(self) -> threading.Event | None:
        """None when the caller is to decide now (the turn is its own until `_end_turn`); else
        the turn to wait for, after which the caller looks at `decided` again."""
        with self._lock:
            if self._deciding is not None:
                return self._deciding
            if self.decided:  # decided between the caller's look and now
                return _DONE
            self._deciding = threading.Event()
            return None

    def _end_turn(self) -> None:
        """The decision is made, or failed: wake the waiters either way."""
        with self._lock:
            turn, self._deciding = self._deciding, None
        if turn is not None:
            turn.set()

    def decide(self, stats: pb.StatsResponse, fetch_attach: FetchAttach | None = None) -> None:
        """Decide from the daemon's Stats; attach when co-located, and open the local path
        when the daemon has a Unix socket. On the arena path the local path keeps
        fetch_attach, for a fresh ticket per session it opens, from whichever thread opens
        one."""
        try:
            path = self._route(stats)
            if path is None:
                self.segment = attach(stats.shm_name)
                self._open_local(self.unix_socket or stats.unix_socket, lambda: "-")
            else:
                reply = self._attach_reply(fetch_attach)
                path = self._path_for(reply, path)
                self._take_arenas(path, receive_arenas(path, reply.ticket))
                assert fetch_attach is not None  # _attach_reply raised otherwise
                self._open_local(path, lambda: fetch_attach().ticket)
        except KVStoreError as exc:
            self._refuse(exc)
            return
        self.decided = True

    def _open_local(self, path: str, ticket: Callable[[], str]) -> None:
        """Send the hot verbs over the daemon's Unix socket from now on, when it has one and
        gives a session."""
        if not path:
            return
        local = LocalPath(path, ticket, self.timeout_s)
        try:
            local.probe()
        except NoSession as exc:
            local.close()
            logger.info("kvstore: local path off, hot verbs use gRPC: %s", exc)
            return
        self.local = local

    def local_off(self, exc: NoSession) -> None:
        """A local session could not be had: the hot verbs use gRPC for good."""
        with self._lock:
            local, self.local = self.local, None
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

    @staticmethod
    def _attach_reply(fetch_attach: FetchAttach | None) -> pb.AttachResponse:
        """fetch_attach(); FailedPrecondition when there is none to call."""
        if fetch_attach is None:
            raise FailedPrecondition("the daemon's memory is reached only through Attach")
        return fetch_attach()

    def _path_for(self, reply: pb.AttachResponse, reported: str) -> str:
        """The socket to trade the ticket on: ours, else the one Attach names."""
        return self.unix_socket or reply.unix_socket or reported

    def _take_arenas(self, path: str, arenas: list[Arena]) -> None:
        fresh = {arena.name: SharedSegment(arena) for arena in arenas}
        with self._lock:
            old, self.arenas = self.arenas, fresh
            self._socket_path = path
        for segment in old.values():
            segment.close()

    def _refuse(self, exc: KVStoreError) -> None:
        """The way in failed: try again later (UNAVAILABLE), raise (required), or go inline."""
        if isinstance(exc, (Unavailable, DeadlineExceeded)):
            raise exc
        if self.required:
            if isinstance(exc, FailedPrecondition):
                raise exc
            raise FailedPrecondition(f"shared memory is required but cannot be had: {exc}")
        logger.info("kvstore: shared-memory path off: %s", exc)
        self.decided = True

    def needs_attach(self, name: str) -> bool:
        """Whether a response names an arena this client does not hold (arena path only)."""
        return bool(name) and self._socket_path is not None and name not in self.arenas

    def ensure_arena(self, name: str, fetch_attach: FetchAttach) -> None:
        """Before a response's arena is used: one re-Attach when it names one not held (the
        daemon restarted, or added one); segment_named then finds it or raises DataLoss."""
        if not self.needs_attach(name):
            return
        try:
            reply = fetch_attach()
            path = self._path_for(reply, self._socket_path or "")
            self._take_arenas(path, receive_arenas(path, reply.ticket))
        except KVStoreError as exc:
            raise _reattach_failed(name, exc) from None

    def fall_back(self, exc: FailedPrecondition) -> None:
        """A data call found the fast path unusable: re-raise exc when it is required, else
        turn it off so this call and every later one go inline."""
        if self.required:
            raise exc
        self.disable(str(exc))

    def segment_named(self, name: str) -> SharedSegment:
        """The segment or arena a response names; re-attaches by name if the daemon moved to
        a new segment. On the arena path an arena not held is DataLoss (ensure_arena first)."""
        if self._socket_path is not None:
            arenas = self.arenas
            if not arenas:  # closed, or turned off by another call meanwhile
                raise FailedPrecondition("the shared-memory path was turned off")
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
            fresh = attach(name)
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
        self.decided = True
        self.close()

    def close(self) -> None:
        with self._lock:
            segment, self.segment = self.segment, None
            arenas, self.arenas = self.arenas, {}
            local, self.local = self.local, None
        if local is not None:
            local.close()
        for held in [segment, *arenas.values()]:
            if held is not None:
                held.close()


_DONE = threading.Event()
_DONE.set()  # the turn of a decision already made: nothing to wait for


def _reattach_failed(name: str, exc: KVStoreError) -> KVStoreError:
    """A failed re-Attach: UNAVAILABLE as it is (the call is retried), else FailedPrecondition
    (the call falls back to inline, or fails when shared memory is required)."""
    if isinstance(exc, (Unavailable, DeadlineExceeded)):
        return exc
    return FailedPrecondition(f"re-Attach for arena {name!r} failed: {exc}")
