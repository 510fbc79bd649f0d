"""The same-host fast path: deciding whether to use the daemon's shared-memory segment, and
copying blocks in and out of it.

`ShmState` owns the decision for both clients (made once, from one Stats call: same host id
and the segment attaches; undone for good by a fall-back), its one lock, and the attached
segment. `SharedSegment` copies with numpy slices of one array over
the whole mapping, so every copy is a single memcpy with no Python-level per-byte work.
Extents from the daemon are bounds-checked before any copy; a bad one is DataLoss.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import xxhash

from kvstore import shm
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb

from ._buffers import ByteArray, address, copy_bytes
from ._wire import Fetched, GetHeader, capacities, parse_get_header
from .errors import DataLoss, FailedPrecondition

logger = logging.getLogger("kvstore.client")

Spans = list[tuple[int, int]]


class SharedSegment:
    """The daemon's L2 segment, attached read-write in this process."""

    def __init__(self, segment: Any) -> None:
        self._segment = segment
        self.name: str = segment.name
        self._view: memoryview | None = segment.view()
        self.size_bytes: int = self._view.nbytes
        self.array: ByteArray = np.frombuffer(self._view, dtype=np.uint8)
        self.address = address(self.array)

    def spans(self, location: pb.BlockLocation, size: int, field: str) -> Spans:
        """(offset, length) pairs holding exactly `size` bytes, checked against the mapping."""
        out: Spans = []
        remaining = size
        limit = self.size_bytes
        for extent in location.extents:
            if remaining == 0:
                break
            offset, length = extent.offset, extent.length
            if offset + length > limit:
                raise DataLoss(
                    f"{field}: extent [{offset}, {offset + length}) lies outside the "
                    f"{limit}-byte segment {self.name}"
                )
            take = min(length, remaining)
            out.append((offset, take))
            remaining -= take
        if remaining:
            raise DataLoss(f"{field}: extents hold {size - remaining} of {size} bytes")
        return out

    def read_bytes(self, spans: Spans) -> bytes:
        arr = self.array
        if len(spans) == 1:
            offset, length = spans[0]
            return arr[offset : offset + length].tobytes()
        return b"".join([arr[o : o + n].data for o, n in spans])

    def read_into(self, spans: Spans, dst: ByteArray, *, digest: bool) -> int | None:
        """Copy the spans into dst; with digest, return the xxh3-64 of the bytes copied
        (hashed from dst, so what is verified is what the caller got)."""
        arr = self.array
        skew_base = address(dst) - self.address
        pos = 0
        for offset, length in spans:
            copy_bytes(
                dst[pos : pos + length], arr[offset : offset + length], skew_base + pos - offset
            )
            pos += length
        return xxhash.xxh3_64_intdigest(dst[:pos].data) if digest else None

    def write(self, spans: Spans, src: memoryview) -> None:
        if not src.nbytes:
            return
        source = np.frombuffer(src, dtype=np.uint8)
        arr = self.array
        skew_base = self.address - address(source)
        pos = 0
        for offset, length in spans:
            copy_bytes(
                arr[offset : offset + length], source[pos : pos + length], skew_base + offset - pos
            )
            pos += length

    def close(self) -> None:
        # Drop our exports first so the mapping can actually be unmapped. A view another
        # thread still reads through keeps the mapping alive (never a dangling pointer); it
        # is unmapped when the last one is collected.
        self.array = np.empty(0, np.uint8)
        view, self._view = self._view, None
        if view is not None:
            try:
                view.release()
            except BufferError:
                logger.debug("kvstore: segment %s still in use; unmapped later", self.name)
        self._segment.close()


def attach(name: str) -> SharedSegment:
    """Attach the named segment; FailedPrecondition (with why) when it cannot be."""
    try:
        return SharedSegment(shm.attach_segment(name))
    except (OSError, ValueError) as exc:
        raise FailedPrecondition(f"cannot attach shared-memory segment {name!r}: {exc}") from None


class ShmState:
    """Whether the fast path is on, and the segment it uses: the one owner of that decision,
    for the blocking and the asyncio client alike.

    mode None: use it when co-located; False: never; True: required (FailedPrecondition when
    the daemon is on another host or its segment cannot be attached).

    The decision is made once, from one Stats call, however many threads or tasks make their
    first data call together: the first claims it, the others wait for its outcome. A Stats
    that fails (or a required path that cannot be had) leaves it undecided, and the next
    caller tries again. A data call that finds the path broken falls back to inline for good
    (`fall_back`), unless the path is required.
    """

    def __init__(self, mode: bool | None) -> None:
        self.mode = mode
        self.decided = mode is False
        self.segment: SharedSegment | None = None
        # Guards the decision, re-attaching and closing; never held across an RPC or an
        # await, which is what lets one lock serve both clients.
        self._lock = threading.Lock()
        # The decision in flight, which late callers wait on (blocking or awaited).
        self._deciding: Future[None] | None = None

    @property
    def required(self) -> bool:
        return self.mode is True

    @property
    def in_use(self) -> bool | None:
        """True/False once decided, None before."""
        return (self.segment is not None) if self.decided else None

    def segment_for(self, fetch_stats: Callable[[], pb.StatsResponse]) -> SharedSegment | None:
        """The segment to use, or None for inline; decides first (fetch_stats is the one
        Stats call) when undecided. The blocking client's way in."""
        while not self.decided:
            mine, turn = self._claim()
            if not mine:
                turn.result()
                continue
            stats: pb.StatsResponse | None = None
            try:
                stats = fetch_stats()
            finally:
                self._settle(turn, stats)
        return self.segment

    async def segment_for_async(
        self, fetch_stats: Callable[[], Awaitable[pb.StatsResponse]]
    ) -> SharedSegment | None:
        """segment_for, awaiting the Stats call and the decision: the asyncio client's way in."""
        while not self.decided:
            mine, turn = self._claim()
            if not mine:
                await asyncio.wrap_future(turn)
                continue
            stats: pb.StatsResponse | None = None
            try:
                stats = await fetch_stats()
            finally:
                self._settle(turn, stats)
        return self.segment

    def _claim(self) -> tuple[bool, Future[None]]:
        """(True, turn) when the caller is to decide now; else (False, what to wait for)."""
        with self._lock:
            if self._deciding is not None:
                return False, self._deciding
            turn: Future[None] = Future()
            # A running future cannot be cancelled, so a waiter that is cancelled (an asyncio
            # task) cannot cancel the turn the other waiters share.
            turn.set_running_or_notify_cancel()
            if self.decided:  # decided between the caller's check and now
                turn.set_result(None)
                return False, turn
            self._deciding = turn
            return True, turn

    def _settle(self, turn: Future[None], stats: pb.StatsResponse | None) -> None:
        """Adopt stats (None: the Stats call failed), then wake the waiters either way."""
        try:
            if stats is not None:
                self.adopt(stats)
        finally:
            with self._lock:
                self._deciding = None
            turn.set_result(None)

    def adopt(self, stats: pb.StatsResponse) -> None:
        """Decide from the daemon's Stats; attach when co-located."""
        try:
            self.segment = self._choose(stats)
        except FailedPrecondition as exc:
            if self.required:
                raise
            logger.info("kvstore: shared-memory path off: %s", exc)
            self.segment = None
        self.decided = True

    def _choose(self, stats: pb.StatsResponse) -> SharedSegment:
        if not stats.shm_name:
            raise FailedPrecondition("the daemon has no shared-memory segment (shm_name is empty)")
        mine = shm.host_id()
        if stats.host_id != mine:
            raise FailedPrecondition(
                f"the daemon runs on another host (host_id {stats.host_id!r}, ours {mine!r})"
            )
        return attach(stats.shm_name)

    def fall_back(self, exc: FailedPrecondition) -> None:
        """A data call found the fast path unusable: re-raise exc when it is required, else
        turn it off so this call and every later one go inline."""
        if self.required:
            raise exc
        self.disable(str(exc))

    def segment_named(self, name: str) -> SharedSegment:
        """The segment a response names; re-attaches if the daemon moved to a new one."""
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
    ) -> int:
        """Write the payloads into the extents Reserve gave; the count written."""
        return write_reserved(self.segment_named(reserved.shm_name), reserved, payloads)

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
        segment = self.segment_named(response.shm_name)
        return read_shm_get(segment, response, header, arrays, verify_checksums)

    def disable(self, reason: str) -> None:
        """Fall back to inline transfers for the rest of this client's life."""
        logger.info("kvstore: shared-memory path off: %s", reason)
        self.decided = True
        self.close()

    def close(self) -> None:
        with self._lock:
            segment, self.segment = self.segment, None
        if segment is not None:
            segment.close()


def only_header(messages: Sequence[pb.GetResponse | memoryview]) -> pb.GetResponse:
    """The one message a shared-memory Get answers, else DataLoss."""
    if len(messages) != 1 or isinstance(messages[0], memoryview):
        raise DataLoss(f"a shared-memory Get answered {len(messages)} messages, not one header")
    return messages[0]


def read_shm_get(
    segment: SharedSegment,
    resp: pb.GetResponse,
    header: GetHeader,
    arrays: Sequence[ByteArray] | None,
    verify_checksums: bool,
) -> Fetched:
    """Copy the found blocks out of shared memory: into arrays[request index] when given
    (with their checksums computed on the way), else as bytes per found block."""
    locations = resp.locations
    if len(locations) != len(header.sizes):
        raise DataLoss(
            f"Get response has {len(locations)} locations for {len(header.sizes)} found keys"
        )
    if arrays is None:
        payloads = [
            segment.read_bytes(segment.spans(locations[j], size, f"locations[{j}]"))
            for j, size in enumerate(header.sizes)
        ]
        return Fetched(header, payloads)
    digests: list[int] = []
    for j, size in enumerate(header.sizes):
        spans = segment.spans(locations[j], size, f"locations[{j}]")
        digest = segment.read_into(spans, arrays[header.found_index[j]], digest=verify_checksums)
        if digest is not None:
            digests.append(digest)
    return Fetched(header, [], digests if verify_checksums else None)


def write_reserved(
    segment: SharedSegment, resp: pb.ReserveResponse, payloads: Sequence[memoryview]
) -> int:
    """Write every payload whose key does not exist into its reserved extents; the count."""
    exists, locations = resp.exists, resp.locations
    if len(exists) != len(payloads) or len(locations) != len(payloads):
        raise DataLoss(
            f"Reserve response has {len(exists)} exists flags and {len(locations)} locations "
            f"for {len(payloads)} keys"
        )
    written = 0
    for i, payload in enumerate(payloads):
        if exists[i]:
            continue
        segment.write(segment.spans(locations[i], payload.nbytes, f"locations[{i}]"), payload)
        written += 1
    return written
