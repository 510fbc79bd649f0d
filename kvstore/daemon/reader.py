"""The store's read side: leased reads, the chunks an inline Get streams under its lease,
and Release.

    read -> (the client copies shared memory, or chunks() streams it) -> release

A read brings the keys no local tier has from L4 into L2 first (one batched round trip),
loads the blocks only in L3 into L2 (a load already in flight is joined, not repeated), and
then leases what it found, so the pages under a reader are never reused. The Store creates
one Reader, shares its lock, index, tiering, counters and Writer (for L4 imports) with it,
and delegates its read verbs to it.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence

from kvstore.core import checks
from kvstore.core.errors import Aborted, InvalidArgument, Reason, ResourceExhausted
from kvstore.core.holdings import Caps
from kvstore.core.index import Index
from kvstore.core.records import Entry, ReadResult
from kvstore.daemon.config import Config
from kvstore.daemon.remote import Remote
from kvstore.daemon.tiering import Load, Tiering
from kvstore.daemon.writer import Writer
from kvstore.keys import BlockKey
from kvstore.tier import Tier, TierStats
from kvstore.tiers.dram import DramTier
from kvstore.units import format_size

log = logging.getLogger(__name__)


class Reader:
    """Reads and leases out of L2. Thread-safe: every index change holds lock."""

    def __init__(
        self, config: Config, index: Index, lock: threading.RLock, tiering: Tiering,
        stats: dict[Tier, TierStats], dram: Callable[[], DramTier | None],
        remote: Callable[[], Remote | None], writer: Writer, clock: Callable[[], float],
        caps: Caps,
    ) -> None:
        """dram() and remote() return L2 and L4 or None; both are asked at each call: the
        store drops them when it closes."""
        self._config = config
        self._index = index
        self._lock = lock
        self._tiering = tiering
        self._stats = stats
        self._dram = dram
        self._remote = remote
        self._writer = writer
        self._clock = clock
        self._caps = caps

    def read(
        self, namespace: str, keys: Sequence[bytes], lease_timeout_s: float, leased: bool = True,
        client: str = "", inline: bool = False,
    ) -> ReadResult:
        """Lease the found entries (the caller copies their bytes, then release()s), or with
        leased=False only touch them (for readers that verify checksums). Blocks only in L3
        are loaded into L2 first; a load already in flight is waited for, not repeated."""
        checked = checks.keys(namespace, keys, self._config.server.max_batch_keys)
        checks.distinct(checked, "Get")
        lease_id = secrets.token_hex(12)
        self.fetch_remote(namespace, checked)
        with self._lock:
            if leased:  # no load started for a client at its cap (and checked again below)
                self._index.holdings.check(client, self._caps, leases=1)
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
        cap = self._config.server.max_response_bytes
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
        tier = self._dram()
        with self._lock:
            if leased:
                if loads:  # other reads of this client may have leased while we waited
                    self._index.holdings.check(client, self._caps, leases=1)
                deadline = self._clock() + lease_timeout_s
                entries = self._index.leases.lease(lease_id, namespace, checked, deadline,
                                            need=Tier.DRAM, client=client)
            else:
                entries = self._index.touch(namespace, checked, need=Tier.DRAM)
            result = ReadResult(lease_id, entries)
            for key, entry in zip(checked, entries, strict=True):
                self._count_read(entry, loads.get(key))
                if entry is not None:
                    assert tier is not None, "entries exist only in enabled tiers"
                    result.extents.append(
                        tier.extents(entry.copies[Tier.DRAM], entry.size_bytes))
        remote = self._remote()
        if remote is not None:
            remote.touch(namespace, [k for k, e in zip(checked, entries, strict=True) if e])
        return result

    def fetch_remote(self, namespace: str, keys: Sequence[BlockKey]) -> None:
        """Bring the keys no local tier has from L4 into L2 (one batched round trip)."""
        remote = self._remote()
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
        """With the lock held: loads of the keys cached only below target."""
        loads: dict[BlockKey, Load] = {}
        for key in keys:
            entry = self._index.get(namespace, key)
            if entry is not None and entry.tier > target and key not in loads:
                loads[key] = self._tiering.load(entry, target)
        return loads

    def _count_read(self, entry: Entry | None, load: Load | None) -> None:
        dram, nvme = self._stats[Tier.DRAM], self._stats[Tier.NVME]
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
        tier = self._dram()
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
        with self._lock:
            if not self._index.leases.has_lease(lease_id):
                raise Aborted("the read outlived leases.lease_timeout_s and its lease expired",
                              Reason.ENTRY_VANISHED, setting="leases.lease_timeout_s")
            return copy(views, size)

    def release(self, ids: Sequence[str], owner: str | None = None) -> int:
        """End leases and abandon reservations; unknown or expired ids are an error (after
        the known ones are released). With owner, another client's ids count as unknown."""
        unknown: list[int] = []  # indexes into ids
        released = 0
        with self._lock:
            for i, rid in enumerate(ids):
                if owner is not None and self._holder_of(rid) not in (owner, None):
                    unknown.append(i)
                elif self._index.leases.release(rid):
                    released += 1
                elif self._index.plan(rid) is not None:
                    self._index.complete_store(rid, None, success=False)
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
        holder = self._index.leases.holder_of(lease_or_plan_id)
        plan = self._index.plan(lease_or_plan_id) if holder is None else None
        return plan.client if plan is not None else holder

    def missing(self, namespace: str, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """The keys no local tier holds."""
        with self._lock:
            return [k for k in keys if self._index.get(namespace, k) is None]
