"""Reads through the daemon's read table: lookups and L2 copies with no round trip.

The daemon publishes, per arena, a table of where each L2 block lies (kvstore/readtable.py
is the layout); a client receives its tenant's table as a read-only descriptor with a local
session's handshake (`HOT <ticket> tables`, client/_localpath.py) and maps it read-only here.
Then:

- a lookup probes the table for all its keys at once; the keys from the first one the table
  does not show on are asked of the daemon (L3, L4, and blocks the table leaves out);
- a read probes, copies each block the table shows from the arena into the caller's buffer
  (hashing it on the way when checksums are verified), checks the hash against the writer's
  checksum in the table, and re-reads each slot's version: a block whose slot changed while it
  was copied (its pages freed, maybe reused), whose hash differs, or that the table does not
  show, is read through the daemon's Get as before.

Nothing here is trusted for more than the copy it guards: a table the client damaged in its
own private copy could only make its own reads miss or fail their checksum.

What was read and looked up is reported to the daemon in batches (`Reports`): frames on the
local path that the daemon never answers, so that the blocks read stay recent in its eviction
order and its hit counts stay true. They go ahead of the client's next request on the local
path, before its next call over gRPC (ShmState.reports_in), when 1,024 keys or 50 ms are
pending, and at close.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import xxhash

from kvstore.keys import KEY_BYTES
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.localframe import LOOKED, LOOKUPS_READ, READS, REQUEST
from kvstore.readtable import (
    TableView,
    namespace_hash,
    offsets_of,
    tier_bytes,
)

from ._buffers import ByteArray, address, copy_bytes, native_lib, native_module
from ._segment import HASH_PIECE_BYTES, SharedSegment
from .results import TIER_NAMES

logger = logging.getLogger("kvstore.client")

#: Keys reported in one frame; a batch is sent when this many are pending, or when the
#: oldest pending report is REPORT_EVERY_S old at the next call (and at close).
REPORT_KEYS = 1024
REPORT_EVERY_S = 0.05
#: Reported keys kept at most while no frame can be sent; past it, the oldest are dropped
#: (recency is a hint: the daemon's eviction order only ages them sooner).
MAX_PENDING_KEYS = 16 * REPORT_KEYS

# kv_table_read's rows (dst, room, slot, version, location, length, sum, outcome) and its
# outcome for a block the table showed whose copy did not hold.
_IO_ROWS = 8
_REJECTED = -2

Post = Callable[[int, Any], bool]  # (verb, request) -> whether it was sent
# Each tier number's name (None: not a tier), indexed by a location word's low byte.
_TIER_NAMES: list[str | None] = [TIER_NAMES.get(t) for t in range(256)]
#: Keys a lookup's native probe writes into rows kept for the thread (_ProbeRows); a longer
#: lookup gets rows of its own, so that no thread keeps more than 128 KiB of them.
PROBE_ROWS_KEPT = 4096


class _ProbeRows(threading.local):
    """Per thread: the rows kv_probe writes (slot, version, location and length, a u64 each
    per key), kept from one lookup to the next with their addresses: a fresh array and its
    address cost about a microsecond a lookup. A lookup reads them before it returns, and a
    thread runs one lookup at a time, so no two lookups share them."""

    def __init__(self) -> None:
        self.rows = np.empty((4, PROBE_ROWS_KEPT), dtype=np.uint64)
        at = self.rows.ctypes.data
        self.at = tuple(at + 8 * PROBE_ROWS_KEPT * row for row in range(4))

    def take(self, n: int) -> tuple[np.ndarray, tuple[int, ...]]:
        """Rows for n keys and their four addresses."""
        if n <= PROBE_ROWS_KEPT:
            return self.rows, self.at
        rows = np.empty((4, n), dtype=np.uint64)
        at = rows.ctypes.data
        return rows, tuple(at + 8 * n * row for row in range(4))


_PROBE_ROWS = _ProbeRows()


class MappedTable:
    """One arena's read table, mapped read-only from the descriptor the daemon passed."""

    def __init__(self, arena: str, fd: int, size_bytes: int) -> None:
        self.arena = arena
        self._map = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        try:
            self.view = TableView(memoryview(self._map))
        except ValueError:
            self._map.close()
            raise

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # the view's arrays still export it: unmapped when collected
            logger.debug("kvstore: read table %r still in use; unmapped later", self.arena)


class Reports:
    """Reads and lookups answered through the table, waiting to be reported to the daemon
    in batches: the keys read (verb READS: the daemon touches them), and how many keys
    lookups found (verb LOOKUPS_READ: it counts them). Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._reads: dict[str, list[bytes]] = {}  # namespace -> keys read
        self._found: dict[tuple[str, int], int] = {}  # (namespace, block_tokens) -> keys
        self._count = 0  # keys in _reads
        self._since: float | None = None  # when the oldest report pending was made

    def read(self, namespace: str, keys: Sequence[bytes], post: Post | None) -> None:
        """Keys read through the table; what is due is sent with post (None: the local path
        is off, so they wait)."""
        if keys:
            now = self._clock()
            with self._lock:
                self._reads.setdefault(namespace, []).extend(keys)
                self._count += len(keys)
                if self._count > MAX_PENDING_KEYS:
                    self._trim()
                due = self._due(now)
            if due and post is not None:
                self.flush(post)

    def looked(self, namespace: str, found: int, block_tokens: int, post: Post | None) -> None:
        """A lookup found its first `found` keys through the table."""
        if found:
            now = self._clock()
            with self._lock:
                key = (namespace, block_tokens)
                self._found[key] = self._found.get(key, 0) + found
                due = self._due(now)
            if due and post is not None:
                self.flush(post)

    def _due(self, now: float) -> bool:
        """Whether what is pending is due to be sent, now that more was added. Under the
        lock."""
        if self._since is None:
            self._since = now
        return self._count >= REPORT_KEYS or now - self._since >= REPORT_EVERY_S

    @property
    def pending(self) -> bool:
        """Whether anything waits to be reported."""
        return self._since is not None

    def flush(self, post: Post) -> None:
        """Send everything pending with post, one frame each."""
        for verb, message in self._take():
            post(verb, message)  # not sent (no session): those reads go unreported

    def framed(self) -> bytes:
        """Everything pending as whole frames, for the local path to send ahead of its next
        request on the same session (LocalPath.ahead); b"" when nothing is."""
        if self._since is None:
            return b""
        frames = []
        for verb, message in self._take():
            body = message.SerializeToString()
            frames.append(REQUEST.pack(len(body), verb) + body)
        return b"".join(frames)

    def _take(self) -> list[tuple[int, Any]]:
        """What is pending, as (verb, message): the keys read REPORT_KEYS a frame, the
        lookups' counts one frame per namespace and block size; nothing is pending after."""
        with self._lock:
            reads, self._reads, self._count = self._reads, {}, 0
            found, self._found, self._since = self._found, {}, None
        out: list[tuple[int, Any]] = [
            (READS, pb.LookupRequest(namespace=namespace, keys=keys[at:at + REPORT_KEYS]))
            for namespace, keys in reads.items() for at in range(0, len(keys), REPORT_KEYS)]
        out += [(LOOKUPS_READ, _Looked(count, block_tokens, namespace))
                for (namespace, block_tokens), count in found.items()]
        return out

    def _trim(self) -> None:
        """Drop the oldest namespace's keys while over MAX_PENDING_KEYS. Under the lock."""
        while self._count > MAX_PENDING_KEYS and self._reads:
            self._count -= len(self._reads.pop(next(iter(self._reads))))


class _Looked:
    """Verb 7's body (localframe.LOOKED and the namespace), as a message is posted."""

    def __init__(self, found: int, block_tokens: int, namespace: str) -> None:
        self._body: bytes = LOOKED.pack(found, block_tokens) + namespace.encode("utf-8")

    def SerializeToString(self) -> bytes:  # noqa: N802 (posted as the protobuf messages are)
        return self._body


class InPlace:
    """Blocks read where they lie, for a consumer that copies them elsewhere itself (a
    host-to-device copy): `views[i]` is keys[i]'s block as a read-only view of this client's
    mapping of the arena, for the leading keys the read table shows (and whose checksums
    matched, hashed in place, when the client verifies). The daemon may free and reuse those
    pages at any moment, and nothing here stops it: what the consumer did with a view counts
    only for the leading `held()` of them, asked once the consumer is done with the bytes.
    A view keeps the mapping alive (never a dangling pointer), not the block."""

    __slots__ = ("views", "_table", "_slots", "_versions")

    def __init__(self, views: list[np.ndarray], table: TableView | None = None,
                 slots: np.ndarray | None = None, versions: np.ndarray | None = None) -> None:
        self.views = views
        self._table = table
        self._slots = slots
        self._versions = versions

    def held(self) -> int:
        """How many of the views, from the first, still are their blocks: each slot's version
        read again, as a read through the table does after its copies. Ask it after the
        bytes were used (a device copy: once it has completed)."""
        if not self.views or self._table is None:
            return 0
        assert self._slots is not None and self._versions is not None
        n = len(self.views)  # a caller may have dropped views from the end
        kept = self._table.unchanged(self._slots[:n], self._versions[:n])
        return n if kept.all() else int(kept.argmin())


class TableReads:
    """Lookups and reads of one arena through its read table, copying from `segment` (the
    arena, or the named segment, the table describes)."""

    def __init__(self, table: MappedTable, segment: SharedSegment) -> None:
        self.table = table
        self.segment = segment
        self.reports = Reports()
        # Blocks read through the table, and those it showed whose copy did not hold (their
        # slot changed while copied, their checksum failed, or they lay out of bounds): read
        # through the daemon instead. Counts for tests and benchmarks; races may lose some.
        self.hits = 0
        self.rejected = 0
        self._native: Any = None  # the table's constants for the native helper (_table_args)

    def lookup(self, namespace: str, keys: Sequence[bytes], block_tokens: int,
               post: Post | None, joined: bytes | None = None
               ) -> tuple[int, list[str | None]] | None:
        """(how many keys from the first the table shows, their tiers' names); None when
        the keys cannot be probed (not all 32 bytes). joined: the keys back to back when the
        caller has them (client/_wire.py check_keys_joined), else they are joined here."""
        lib = native_lib()
        numbers: bytes | None
        if lib is not None:
            numbers = self._probe_native(lib, namespace, keys, joined)
        else:
            probe = self.table.view.probe(namespace_hash(namespace), keys, joined)
            numbers = None if probe is None else tier_bytes(probe.locs[:probe.prefix()])
        if numbers is None:
            return None
        found = len(numbers)
        tiers: list[str | None]
        if found and numbers.count(numbers[:1]) == found:  # one tier (the usual): one name
            tiers = [_TIER_NAMES[numbers[0]]] * found
        else:
            tiers = list(map(_TIER_NAMES.__getitem__, numbers))
        self.reports.looked(namespace, found, block_tokens, post)
        return found, tiers

    def read(self, namespace: str, keys: Sequence[bytes], arrays: Sequence[ByteArray] | None,
             verify: bool, post: Post | None) -> list[Any]:
        """Per key: the block (bytes, arrays None) or its size (copied into arrays[i]) when
        the table shows it and the copy held, else None (ask the daemon)."""
        lib = native_lib()
        if lib is not None and arrays is not None:
            return self._read_native(lib, namespace, keys, arrays, verify, post)
        out: list[Any] = [None] * len(keys)
        probe = self.table.view.probe(namespace_hash(namespace), keys)
        if probe is None:
            return out
        hits = np.flatnonzero(probe.slots >= 0)
        if not hits.size:
            return out
        offsets = offsets_of(probe.locs.take(hits)).tolist()
        lengths = probe.lengths.take(hits).tolist()
        sums = probe.sums.take(hits).tolist() if verify else None
        copied = self._copy(hits.tolist(), offsets, lengths, sums, arrays, out)
        if not copied:
            self.rejected += hits.size
            return out
        # The versions again, after every copy: a slot that moved on was rewritten (its
        # pages freed, maybe reused) while it was copied, and its copy does not count.
        kept = self.table.view.unchanged(probe.slots.take(copied), probe.versions.take(copied))
        read: list[bytes] = []
        for i, ok in zip(copied, kept.tolist(), strict=True):
            if ok:
                read.append(keys[i])
            else:
                out[i] = None
        self.hits += len(read)
        self.rejected += hits.size - len(read)
        self.reports.read(namespace, read, post)
        return out

    def in_place(self, namespace: str, keys: Sequence[bytes], verify: bool,
                 post: Post | None) -> InPlace:
        """The leading keys' blocks as read-only views of the arena where the table shows
        them (see InPlace), each hashed in place and checked against its slot's checksum
        when verify; the first a view cannot be had for (not shown, out of the mapping's
        bounds, a checksum that does not match) ends them."""
        probe = self.table.view.probe(namespace_hash(namespace), keys)
        if probe is None:
            return InPlace([])
        n = probe.prefix()
        offsets = offsets_of(probe.locs[:n]).tolist()
        lengths = probe.lengths[:n].tolist()
        sums = probe.sums[:n].tolist()
        arena, limit = self.segment.array, self.segment.size_bytes
        views: list[np.ndarray] = []
        for offset, length, checksum in zip(offsets, lengths, sums, strict=True):
            if offset + length > limit:
                break
            view = arena[offset:offset + length]
            if verify and xxhash.xxh3_64_intdigest(view.data) != checksum:
                break
            view = view.view()
            view.flags.writeable = False
            views.append(view)
        found = len(views)
        self.hits += found
        self.rejected += n - found
        self.reports.read(namespace, keys[:found], post)
        return InPlace(views, self.table.view, probe.slots[:found].copy(),
                       probe.versions[:found].copy())

    def _probe_native(self, lib: ctypes.CDLL, namespace: str, keys: Sequence[bytes],
                      joined: bytes | None) -> bytes | None:
        """The tier numbers (tier_bytes) of the keys the table shows from the first on,
        probed in one native call (kvstore/native fastcopy.c kv_probe); None as
        TableView.probe says."""
        n = len(keys)
        if joined is None:
            joined = b"".join(keys)
        if len(joined) != KEY_BYTES * n or not self.table.view.live:
            return None
        rows, (slot, version, loc, length) = _PROBE_ROWS.take(n)  # no sums: not read
        args = self._table_args()
        found = lib.kv_probe(args.table, args.params, namespace_hash(namespace), joined, n,
                             slot, version, loc, length, None)
        return tier_bytes(rows[2, :found])

    def _read_native(self, lib: ctypes.CDLL, namespace: str, keys: Sequence[bytes],
                     arrays: Sequence[ByteArray], verify: bool, post: Post | None) -> list[Any]:
        """`read` into arrays in one native call (kvstore/native fastcopy.c kv_table_read):
        the probe, every copy (hashed as copied when verify) and the versions again."""
        n = len(keys)
        joined = b"".join(keys)
        if len(joined) != KEY_BYTES * n or not self.table.view.live:
            return [None] * n
        # Rows: the buffers' addresses and sizes in; slot, version, location, length, sum
        # and the outcome (a length copied, or < 0: ask the daemon) out.
        io = np.empty((_IO_ROWS, n), dtype=np.int64)
        io[0] = [address(a) for a in arrays]
        io[1] = [a.nbytes for a in arrays]
        at = io.ctypes.data
        args, segment = self._table_args(), self.segment
        copied = lib.kv_table_read(
            args.table, args.params, namespace_hash(namespace), joined, n, segment.address,
            segment.size_bytes, at, at + 8 * n, verify,
            *(at + 8 * n * row for row in range(2, _IO_ROWS)))
        got = io[_IO_ROWS - 1]
        self.hits += copied
        if copied == n:
            self.reports.read(namespace, keys, post)
            return got.tolist()  # type: ignore[no-any-return]
        self.rejected += int(np.count_nonzero(got == _REJECTED))
        out = [g if g >= 0 else None for g in got.tolist()]
        self.reports.read(namespace, [k for k, g in zip(keys, out, strict=True)
                                      if g is not None], post)
        return out

    def _table_args(self) -> Any:
        """kvstore.native.TableArgs of the view read through now (made again when the view
        was replaced)."""
        args = self._native
        if args is None or args.view is not self.table.view:
            args = self._native = native_module().TableArgs(self.table.view)
        return args

    def _copy(self, hits: list[int], offsets: list[int], lengths: list[int],
              sums: list[int] | None, arrays: Sequence[ByteArray] | None,
              out: list[Any]) -> list[int]:
        """Copy each hit out of the segment into out (its bytes, or its size once copied into
        arrays[i]), checking its hash against sums when given; the request indexes copied."""
        segment, limit = self.segment, self.segment.size_bytes
        arena, base = segment.array, segment.address
        copied: list[int] = []
        for j, i in enumerate(hits):
            offset, length = offsets[j], lengths[j]
            if offset + length > limit:
                continue  # not this arena's: leave it to the daemon
            if arrays is None:
                payload = arena[offset:offset + length].tobytes()
                if sums is not None and xxhash.xxh3_64_intdigest(payload) != sums[j]:
                    continue
                out[i] = payload
            else:
                dst = arrays[i]
                if dst.nbytes < length:
                    continue  # the daemon's Get says what is wrong with the buffer
                into = dst if dst.nbytes == length else dst[:length]
                if length > HASH_PIECE_BYTES:  # hashed piece by piece as it is copied
                    digest = segment.read_into([(offset, length)], into,
                                               digest=sums is not None)
                else:  # one piece: copied, then hashed while in cache, with no hasher
                    skew = into.__array_interface__["data"][0] - base - offset
                    copy_bytes(into, arena[offset:offset + length], skew)
                    digest = xxhash.xxh3_64_intdigest(into.data) if sums is not None else None
                if sums is not None and digest != sums[j]:
                    continue
                out[i] = length
            copied.append(i)
        return copied


    def close(self) -> None:
        """Unmap the table (reports still pending are the caller's to flush first)."""
        self.table.close()

