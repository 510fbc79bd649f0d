"""The store's read side: leased reads, the chunks an inline Get streams under its lease,
and Release.

    read -> (the client copies shared memory, or chunks() streams it) -> release

A read brings the keys no local tier has from L4 into L2 first (one batched round trip),
loads the blocks only in L3 into L2 (a load already in flight is joined, not repeated), and
then leases what it found, so the pages under a reader are never reused. The Store builds one
Reader over its StoreState (`kvstore.daemon.storestate`: the index, the lock, the tiering and
the counters it shares with the store and the Writer) and its Writer (which imports what L4
answers), and exposes it as `store.reader`; the servicer and the hot verbs call it directly.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterator, Sequence

from kvstore.core import checks
from kvstore.core.errors import Aborted, InvalidArgument, Reason, ResourceExhausted
from kvstore.core.records import Entry, ReadResult
from kvstore.daemon.storestate import StoreState
from kvstore.daemon.tiering import Load
from kvstore.daemon.writer import Writer
from kvstore.keys import BlockKey
from kvstore.tier import Tier
from kvstore.units import format_size

log = logging.getLogger(__name__)


class Reader:
    """Reads and leases out of L2. Thread-safe: every change to the index is made with the
    store's lock held."""

    def __init__(self, state: StoreState, writer: Writer) -> None:
        """state: the store's, shared with writer, which imports the blocks a read fetches
        from L4. L2 and L4 are read from the state at each call, since the store drops them
        when it closes."""
        self._state = state
        self._writer = writer

    def read(
        self, namespace: str, keys: Sequence[bytes], lease_timeout_s: float, leased: bool = True,
        client: str = "", inline: bool = False,
    ) -> ReadResult:
        """Lease the entries found for keys in L2, for lease_timeout_s: the caller copies
        their bytes, then release()s the lease. With leased=False the entries are only
        touched (moved up in the eviction order), for readers that verify checksums. Keys
        no local tier holds are fetched from L4 first, and blocks only in L3 are loaded into
        L2; a load already in flight is waited for, not repeated. An inline read (one whose
        bytes the daemon streams) is refused when they add up to more than
        server.max_response_bytes."""
        checked = checks.keys(namespace, keys, self._state.config.server.max_batch_keys)
        checks.distinct(checked, "Get")
        lease_id = secrets.token_hex(12)
        self.fetch_remote(namespace, checked)
        with self._state.lock:
            if leased:  # no load started for a client at its cap (and checked again below)
                self._state.index.holdings.check(client, self._state.caps, leases=1)
            loads = self._start_loads(namespace, checked, Tier.DRAM)
            if not loads:  # the usual case, every hit in L2: lease in the same critical section
                result = self._lease(namespace, checked, lease_id, leased, lease_timeout_s,
                                     loads, client)
                return self._bounded(result) if inline else result
        for load in loads.values():
            load.wait()
        result = self._lease(namespace, checked, lease_id, leased, lease_timeout_s, loads, client)
        return self._bounded(result) if inline else result

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
            if leased:
                if loads:  # other reads of this client may have leased while we waited
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

    def _start_loads(self, namespace: str, keys: Sequence[BlockKey],
                     target: Tier) -> dict[BlockKey, Load]:
        """Start (or join) a load to target of each key cached only in a tier below it; the
        caller holds the lock. The loads, by key."""
        loads: dict[BlockKey, Load] = {}
        for key in keys:
            entry = self._state.index.get(namespace, key)
            if entry is not None and entry.tier > target and key not in loads:
                loads[key] = self._state.tiering.load(entry, target)
        return loads

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
