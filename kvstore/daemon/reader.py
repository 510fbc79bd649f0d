"""The store's read side: leased reads, the chunks an inline Get streams under its lease,
and Release.

    read -> (the client copies shared memory, or chunks() streams it) -> release

A read brings the keys no local tier has from L4 into L2 first (one batched round trip),
loads the blocks only in L3 into L2 (a load already in flight is joined, not repeated), and
then leases what it found, so the pages under a reader are never reused. From the loads to
the lease the tiering holds every block the read found (`Tiering.hold_read`), so a block
cached in L3 is a miss only when it is damaged, or when L2 had no room for it before the
read's time to wait ran out. The Store builds one
Reader over its StoreState (`kvstore.daemon.storestate`: the index, the lock, the tiering and
the counters it shares with the store and the Writer) and its Writer (which imports what L4
answers), and exposes it as `store.reader`; the servicer and the hot verbs call it directly.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterator, Sequence

from kvstore.core import checks
from kvstore.core.errors import Aborted, InvalidArgument, Reason, ResourceExhausted
from kvstore.core.records import Entry, ReadResult
from kvstore.daemon.storestate import StoreState
from kvstore.daemon.tiering import HeldRead, Load
from kvstore.daemon.writer import Writer
from kvstore.keys import BlockKey
from kvstore.tier import Tier
from kvstore.units import format_size

log = logging.getLogger(__name__)

#: The longest a read waits for L2 room for its L3 blocks, and how long when its caller gave
#: no deadline (a local-path Get); a gRPC Get waits until its deadline if that comes first.
#: A read waits only while other reads' leases and loads, puts and pins hold L2, and each
#: read or put holds it for a copy or an L3 read: milliseconds. Scans of 16-key Gets from 4
#: to 12 threads at once over an L2 of 32 and of 16 pages (oversubscribed 2 to 12 times over,
#: on 2 cores) waited 0.18 s at most, the reads taking turns. A read still short after 2 s
#: finds L2 held by what does not end soon (leases a client does not release, which expire
#: after leases.lease_timeout_s, 30 s by default; pins), and a miss, which an engine
#: recomputes, then serves it better than a longer wait; a client's call timeout (30 s by
#: default) is there to detect a dead daemon, not to be spent on one read. 2 s also keeps
#: the answer inside any timeout a client sets above it.
READ_WAIT_S = 2.0
#: Kept back from a caller's deadline: the read stops waiting for room this long before
#: it, so that the reply reaches the client before its deadline does and it gets its hits
#: and misses, not DEADLINE_EXCEEDED. Leasing and sending the reply take well under a
#: millisecond, and some milliseconds across a network; on a host with tens of runnable
#: threads per core a thread waits tens of milliseconds for its turn on one, which 0.25 s
#: covers several times over. It costs only reads that give up anyway.
REPLY_MARGIN_S = 0.25
#: The warning that reads served L3 blocks as misses for want of L2 room comes at most this
#: often: once a minute tells an operator that L2 is too small for its readers without
#: flooding the log of a daemon serving thousands of Gets a second.
GAVE_UP_LOG_EVERY_S = 60.0


class Reader:
    """Reads and leases out of L2. Thread-safe: every change to the index is made with the
    store's lock held."""

    def __init__(self, state: StoreState, writer: Writer) -> None:
        """state: the store's, shared with writer, which imports the blocks a read fetches
        from L4. L2 and L4 are read from the state at each call, since the store drops them
        when it closes."""
        self._state = state
        self._writer = writer
        self._quiet_until = 0.0  # no "served as misses" warning before this monotonic time

    def read(
        self, namespace: str, keys: Sequence[bytes], lease_timeout_s: float, leased: bool = True,
        client: str = "", inline: bool = False, deadline_s: float | None = None,
    ) -> ReadResult:
        """Lease the entries found for keys in L2, for lease_timeout_s: the caller copies
        their bytes, then release()s the lease. With leased=False the entries are only
        touched (moved up in the eviction order), for readers that verify checksums. Keys
        no local tier holds are fetched from L4 first, and blocks only in L3 are loaded into
        L2; a load already in flight is waited for, not repeated. An inline read (one whose
        bytes the daemon streams) is refused when they add up to more than
        server.max_response_bytes.

        A block cached in L3 is a hit even when L2 has no room for it at once: the read
        waits for room (`Tiering.hold_read`) for READ_WAIT_S at most, and not past its
        caller's deadline less REPLY_MARGIN_S (deadline_s: the seconds left, as gRPC tells
        them; None: no deadline); only then is a block L2 could not take a miss. A read
        larger than L2 gets the prefix of its blocks that fits."""
        checked = checks.keys(namespace, keys, self._state.config.server.max_batch_keys)
        checks.distinct(checked, "Get")
        lease_id = secrets.token_hex(12)
        until = time.monotonic() + _wait_s(deadline_s)
        self.fetch_remote(namespace, checked)
        lock, tiering = self._state.lock, self._state.tiering
        while True:
            with lock:
                if leased:  # no load started for a client at its cap (and checked again below)
                    self._state.index.holdings.check(client, self._state.caps, leases=1)
                held = tiering.hold_read(namespace, checked, until)
                if not held.loads:  # every hit in L2 (or no more time to wait): lease now
                    if held.short:
                        self._gave_up(held.short)
                    result = self._lease(namespace, checked, lease_id, leased,
                                         lease_timeout_s, {}, client)
                    return self._bounded(result) if inline else result
            for load in held.loads.values():
                load.wait()
            with lock:
                try:
                    if self._load_failed(namespace, held) and time.monotonic() < until:
                        continue  # a joined load failed for want of room: try again
                    result = self._lease(namespace, checked, lease_id, leased,
                                         lease_timeout_s, held.loads, client)
                finally:
                    tiering.release_read(held)
            return self._bounded(result) if inline else result

    def _load_failed(self, namespace: str, held: HeldRead) -> bool:
        """Whether a load the read waited for failed while its block is still cached below
        L2: a load it joined (a Prefetch's) that found no room, since its own loads had
        their pages before they started. A damaged block is no longer cached."""
        for key, load in held.loads.items():
            entry = self._state.index.get(namespace, key)
            if not load.ok and entry is not None and entry.tier > Tier.DRAM:
                return True
        return False

    def _gave_up(self, blocks: int) -> None:
        """Log, at most once a minute, that a read served blocks cached in L3 as misses
        because L2 had no room for them before its time to wait ran out."""
        now = time.monotonic()
        if now < self._quiet_until:
            return
        self._quiet_until = now + GAVE_UP_LOG_EVERY_S
        log.warning("a Get served %d blocks cached in L3 as misses: L2 had no room for them "
                    "before the Get's deadline or within %.0f s (L2 held by leases, loads, "
                    "puts and pins: raise dram.capacity_bytes, or release leases sooner)",
                    blocks, READ_WAIT_S)

    def _bounded(self, result: ReadResult) -> ReadResult:
        """An inline read streams every found byte: refuse one over server.max_response_bytes
        (its lease released) rather than let one small request make the daemon send GiBs."""
        cap = self._state.config.server.max_response_bytes
        total = sum(e.size_bytes for e in result.entries if e is not None)
        if total <= cap:
            return result
        self.release([result.lease_id])
        raise ResourceExhausted(
            f"keys: the Get would return {format_size(total)}, over server.max_response_bytes "
            f"({format_size(cap)}); ask for fewer keys per Get", Reason.MESSAGE_TOO_LARGE,
            field="keys", limit=cap, setting="server.max_response_bytes")

    def _lease(self, namespace: str, checked: list[BlockKey], lease_id: str, leased: bool,
               lease_timeout_s: float, loads: dict[BlockKey, Load], client: str) -> ReadResult:
        tier, index = self._state.dram, self._state.index
        with self._state.lock:
            if leased:  # other reads of this client may have leased while this one waited
                index.holdings.check(client, self._state.caps, leases=1)
                deadline = self._state.clock() + lease_timeout_s
                entries = index.leases.lease(lease_id, namespace, checked, deadline,
                                             need=Tier.DRAM, client=client)
            else:
                entries = index.touch(namespace, checked, need=Tier.DRAM)
            result = ReadResult(lease_id, entries)
            for key, entry in zip(checked, entries, strict=True):
                self._count_read(entry, loads.get(key))
                if entry is not None:
                    assert tier is not None, "entries exist only in enabled tiers"
                    result.extents.append(
                        tier.extents(entry.copies[Tier.DRAM], entry.size_bytes))
        remote = self._state.remote
        if remote is not None:
            remote.touch(namespace, [k for k, e in zip(checked, entries, strict=True) if e])
        return result

    def reads_reported(self, namespace: str, keys: Sequence[bytes]) -> int:
        """Take in reads a client made through its read table without asking (reported in
        batches: kvstore.daemon.localpath): each key still in L2 is touched (seen once more,
        the most recent in the eviction order) and counted as an L2 hit, in one hold of the
        lock. Keys no longer in L2 are passed over. How many were touched."""
        checked = checks.keys(namespace, keys, self._state.config.server.max_batch_keys)
        with self._state.lock:
            found = [e for e in self._state.index.touch(namespace, checked, need=Tier.DRAM)
                     if e is not None]
            for entry in found:
                self._count_read(entry, None)
        remote = self._state.remote
        if remote is not None and found:
            remote.touch(namespace, [e.key for e in found])
        return len(found)

    def fetch_remote(self, namespace: str, keys: Sequence[BlockKey]) -> None:
        """Bring the keys no local tier has from L4 into L2 (one batched round trip)."""
        remote = self._state.remote
        if remote is None:
            return
        missing = self.missing(namespace, list(dict.fromkeys(keys)))
        if not missing:
            return
        found = [(k, p) for k, p in zip(missing, remote.fetch(namespace, missing),
                                        strict=True) if p is not None]
        if not found:
            return
        try:
            self._writer.import_blocks(namespace, [k for k, _ in found], [p for _, p in found])
        except ResourceExhausted as exc:  # more than L2 can take at once: they stay misses
            log.warning("L4 hits not brought into L2: %s", exc)

    def _count_read(self, entry: Entry | None, load: Load | None) -> None:
        """Count one key of a read: a hit in L2, or a miss in L2 that L3 held (and loaded)
        or did not hold."""
        dram, nvme = self._state.stats[Tier.DRAM], self._state.stats[Tier.NVME]
        if entry is not None and load is None:
            dram.hits += 1
            dram.bytes_out += entry.size_bytes
            return
        dram.misses += 1
        if entry is not None:
            nvme.hits += 1
        elif nvme.enabled:
            nvme.misses += 1

    def chunks(
        self, result: ReadResult, chunk_bytes: int, copy: Callable[[list[memoryview], int], bytes]
    ) -> Iterator[bytes]:
        """The found payloads concatenated, cut into pieces of at most chunk_bytes; each is
        handed to copy(views, size) (which frames it for the wire) under the lock with the
        lease checked, so the bytes copied are never those of a reused page."""
        tier = self._state.dram
        assert tier is not None, "a result with extents came from L2"
        pending: list[memoryview] = []
        pending_bytes = 0
        for extents in result.extents:
            for view in tier.views(extents):
                while len(view):
                    take = view[: chunk_bytes - pending_bytes]
                    view = view[len(take) :]
                    pending.append(take)
                    pending_bytes += len(take)
                    if pending_bytes == chunk_bytes:
                        yield self._copy(result.lease_id, pending, pending_bytes, copy)
                        pending, pending_bytes = [], 0
        if pending:
            yield self._copy(result.lease_id, pending, pending_bytes, copy)

    def _copy(
        self, lease_id: str, views: list[memoryview], size: int,
        copy: Callable[[list[memoryview], int], bytes],
    ) -> bytes:
        with self._state.lock:
            if not self._state.index.leases.has_lease(lease_id):
                raise Aborted("the read outlived leases.lease_timeout_s and its lease expired",
                              Reason.ENTRY_VANISHED, setting="leases.lease_timeout_s")
            return copy(views, size)

    def release(self, ids: Sequence[str], owner: str | None = None) -> int:
        """End the leases and abandon the reservations named by ids, and say how many there
        were. Ids that are unknown or expired raise InvalidArgument, after the known ones
        are released. With owner, the ids another client holds count as unknown."""
        unknown: list[int] = []  # indexes into ids
        released = 0
        with self._state.lock:
            for i, rid in enumerate(ids):
                if owner is not None and self._holder_of(rid) not in (owner, None):
                    unknown.append(i)
                elif self._state.index.leases.release(rid):
                    released += 1
                elif self._state.index.plan(rid) is not None:
                    self._state.index.complete_store(rid, None, success=False)
                    released += 1
                else:
                    unknown.append(i)
            if released:
                self._state.tiering.holds_ended()
        if unknown:
            named = [ids[i] for i in unknown[:3]]
            raise InvalidArgument(
                f"ids: {named!r} unknown or expired ({len(unknown)} in all)",
                Reason.LEASE_EXPIRED, field=f"ids[{unknown[0]}]")
        return released

    def _holder_of(self, lease_or_plan_id: str) -> str | None:
        """The client holding the lease or plan of this id; None when there is neither."""
        holder = self._state.index.leases.holder_of(lease_or_plan_id)
        plan = self._state.index.plan(lease_or_plan_id) if holder is None else None
        return plan.client if plan is not None else holder

    def missing(self, namespace: str, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """The keys no local tier holds."""
        with self._state.lock:
            return [k for k in keys if self._state.index.get(namespace, k) is None]


def _wait_s(deadline_s: float | None) -> float:
    """How long a read may wait for L2 room, given the seconds left before its caller's
    deadline (None: no deadline)."""
    if deadline_s is None:
        return READ_WAIT_S
    return max(0.0, min(READ_WAIT_S, deadline_s - REPLY_MARGIN_S))
