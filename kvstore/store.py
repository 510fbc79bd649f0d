"""The store: validates requests, composes the index with the tiers, owns leases and counters.

Every public method checks its input first and raises a typed error naming the field
(kvstore.errors), so a bad request never reaches the index or a tier and never damages
stored data. Puts are two-phase (plan → write → commit, or abort); reads hold a lease while
bytes are copied out, so the pages under a reader are never reused.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace

import xxhash

from kvstore import checks
from kvstore.config import Config
from kvstore.entries import (
    CommitResult,
    Entry,
    EvictResult,
    Extent,
    PutSession,
    ReadResult,
    Reservation,
    StorePlan,
    StoreStats,
    Tier,
    TierStats,
)
from kvstore.errors import Aborted, FailedPrecondition, InvalidArgument, ResourceExhausted
from kvstore.index import Index
from kvstore.keys import BlockKey
from kvstore.movers import Mover
from kvstore.pages import PageAllocator
from kvstore.prefetch import PrefetchProgress, prefetch
from kvstore.tier_setup import open_tiers
from kvstore.tiering import Load, Tiering
from kvstore.tiers.dram import DramTier
from kvstore.units import format_size


class Store:
    """The daemon's data plane, independent of gRPC. Thread-safe (one lock)."""

    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.RLock()
        self._opened = open_tiers(config)
        tiers = self._opened.tiers
        dram = tiers.get(Tier.DRAM)
        self.dram: DramTier | None = dram if isinstance(dram, DramTier) else None
        self.index = Index({t: PageAllocator(x.num_pages) for t, x in tiers.items()},
                           {t: x.page_size_bytes for t, x in tiers.items()}, clock)
        self._stats = {t: TierStats(t.label, t in tiers) for t in Tier}
        for t, tier in tiers.items():
            self._stats[t].backend = tier.backend
        self._hits = self._misses = 0  # Lookup: keys inside / past the cached prefix
        self.tiering = Tiering(config, self.index, self._lock, tiers, self._opened.manifest,
                               self._stats, clock)
        self._mover: Mover | None = None
        try:
            self.adopted = self.tiering.adopt()
        except BaseException:
            self.close()
            raise

    def describe_l3(self) -> str:
        nvme = self._opened.tiers.get(Tier.NVME)
        if nvme is None:
            return "L3 off"
        return (f"L3 {nvme.backend} in {self._opened.l3_dir}, "
                f"{format_size(nvme.capacity_bytes)}, {self.adopted} blocks re-adopted")

    def start(self, on_failure: Callable[[str], None]) -> None:
        """Start the background mover; on_failure(reason) if it ever fails."""
        self._mover = Mover(self.tiering, self.config.movers.interval_s, on_failure)
        self._mover.start()

    def close(self) -> None:
        if self._mover is not None:
            self._mover.stop()
            self._mover = None
        self.tiering.close()
        with self._lock:
            self._opened.close()
            self.dram = None

    def _check_keys(self, namespace: str, keys: Sequence[bytes]) -> list[BlockKey]:
        return checks.keys(namespace, keys, self.config.server.max_batch_keys)

    def _slot_tier(self) -> DramTier:
        if self.dram is None:
            raise FailedPrecondition("no slot tier is enabled (dram.enabled is false)")
        return self.dram

    # --- puts ------------------------------------------------------------------------------

    def _plan(
        self, namespace: str, keys: Sequence[bytes], sizes: Sequence[int], parent: bytes,
        independent: bool, timeout_s: float,
    ) -> tuple[str, list[BlockKey], list[int], list[list[Extent] | None]]:
        checked = self._check_keys(namespace, keys)
        sizes = checks.sizes(checked, sizes, self.config.server.max_object_bytes)
        parents = checks.chain_parents(checked, parent, independent)
        tier = self._slot_tier()
        plan_id = secrets.token_hex(12)
        with self._lock:
            plan = self._prepare(plan_id, namespace, checked, sizes, parents, timeout_s)
            if plan is None:
                need = sum(self.index.pages_per_object(Tier.DRAM, s) for s in sizes)
                raise ResourceExhausted(
                    f"sizes need {need} pages ({format_size(need * tier.page_size_bytes)}); the "
                    f"dram tier cannot free that many (capacity {format_size(tier.capacity_bytes)},"
                    " dram.capacity_bytes; pinned and leased blocks stay)"
                )
            targets: list[list[Extent] | None] = [None] * len(checked)
            for block in plan.blocks:
                targets[block.index] = tier.extents(block.pages, block.size_bytes)
        return plan_id, checked, sizes, targets

    def _prepare(
        self, plan_id: str, namespace: str, keys: list[BlockKey], sizes: list[int],
        parents: list[BlockKey | None], timeout_s: float,
    ) -> StorePlan | None:
        """With the lock held: L2 pages for a put. When L2 is full, wait (at most
        movers.put_wait_s) for the mover to demote blocks to L3, then evict instead."""
        deadline = self._clock() + timeout_s
        args = (plan_id, namespace, keys, sizes, parents, Tier.DRAM, deadline)
        plan = self.index.prepare_store(*args, evict=False)
        if plan is None:
            need = sum(self.index.pages_per_object(Tier.DRAM, s) for s in sizes)
            if self.tiering.wait_for_room(Tier.DRAM, need, self.config.movers.put_wait_s):
                plan = self.index.prepare_store(*args, evict=False)
        if plan is None:
            plan = self.index.prepare_store(*args, evict=True)
        if self.tiering.fullness(Tier.DRAM) >= self.config.movers.high_watermark:
            self.tiering.wake.set()
        return plan

    def begin_put(
        self, namespace: str, keys: Sequence[bytes], sizes: Sequence[int],
        parent: bytes = b"", independent: bool = False,
    ) -> PutSession:
        """Plan an inline put; feed its bytes with write(), then commit() or abort()."""
        plan_id, _, sizes, targets = self._plan(
            namespace, keys, sizes, parent, independent, self.config.leases.reservation_timeout_s
        )
        hashers = [xxhash.xxh3_64() if t is not None else None for t in targets]
        return PutSession(plan_id, namespace, sizes, targets, hashers, sum(sizes))

    def write(self, session: PutSession, data: memoryview) -> None:
        """Append a chunk of the concatenated payloads."""
        if session.received_bytes + len(data) > session.total_bytes:
            raise InvalidArgument(
                f"data: more than the {session.total_bytes} bytes that sizes add up to"
            )
        tier = self._slot_tier()
        with self._lock:
            if self.index.plan(session.plan_id) is None:
                raise Aborted("the put outlived leases.reservation_timeout_s and was abandoned")
            self._write_locked(tier, session, data)

    @staticmethod
    def _write_locked(tier: DramTier, session: PutSession, data: memoryview) -> None:
        done = 0
        while done < len(data):
            i = session.block
            n = min(session.sizes[i] - session.block_offset, len(data) - done)
            targets, hasher = session.targets[i], session.hashers[i]
            if targets is not None and hasher is not None:
                chunk = data[done : done + n]
                tier.write_at(targets, session.block_offset, chunk)
                hasher.update(chunk)
            done += n
            session.block_offset += n
            if session.block_offset == session.sizes[i]:
                session.block += 1
                session.block_offset = 0
        session.received_bytes += len(data)

    def commit(self, session: PutSession) -> CommitResult:
        if session.received_bytes != session.total_bytes:
            self.abort(session.plan_id)
            raise InvalidArgument(
                f"data: received {session.received_bytes} bytes; sizes add up to "
                f"{session.total_bytes}"
            )
        checksums = [h.intdigest() for h in session.hashers if h is not None]
        written = sum(s for s, t in zip(session.sizes, session.targets, strict=True) if t)
        return self._complete(session.plan_id, checksums, written)

    def abort(self, plan_id: str) -> None:
        with self._lock:
            if self.index.plan(plan_id) is not None:
                self.index.complete_store(plan_id, None, success=False)

    def _complete(self, plan_id: str, checksums: list[int], size_bytes: int) -> CommitResult:
        with self._lock:
            if self.index.plan(plan_id) is None:  # the sweeper expired it after the last write
                raise Aborted("the put outlived leases.reservation_timeout_s and was abandoned")
            result = self.index.complete_store(plan_id, checksums, success=True)
            self._stats[Tier.DRAM].bytes_in += size_bytes
            return result

    def reserve(
        self, namespace: str, keys: Sequence[bytes], sizes: Sequence[int], parent: bytes = b"",
        independent: bool = False, timeout_s: float | None = None,
    ) -> Reservation:
        """Pages for the client to write itself; commit_reservation() makes them entries."""
        timeout_s = timeout_s or self.config.leases.reservation_timeout_s
        plan_id, _, _, targets = self._plan(namespace, keys, sizes, parent, independent, timeout_s)
        return Reservation(
            plan_id, [t is None for t in targets], [t or [] for t in targets], timeout_s
        )

    def commit_reservation(self, namespace: str, reservation_id: str) -> CommitResult:
        tier = self._slot_tier()
        with self._lock:
            plan = self.index.plan(reservation_id)
            if plan is None or plan.namespace != namespace:
                raise InvalidArgument(
                    f"reservation_id {reservation_id!r} is unknown or expired in namespace "
                    f"{namespace!r}"
                )
            extents = [tier.extents(b.pages, b.size_bytes) for b in plan.blocks]
        # Checksums of what the client actually wrote, read without the lock: the pages are
        # the plan's alone, and _complete refuses the commit if the plan expired meanwhile.
        checksums = [tier.checksum(e) for e in extents]
        return self._complete(reservation_id, checksums, sum(b.size_bytes for b in plan.blocks))

    # --- reads -----------------------------------------------------------------------------

    def read(
        self, namespace: str, keys: Sequence[bytes], lease_timeout_s: float, leased: bool = True
    ) -> ReadResult:
        """Lease the found entries (the caller copies their bytes, then release()s), or with
        leased=False only touch them (for readers that verify checksums). Blocks only in L3
        are loaded into L2 first; a load already in flight is waited for, not repeated."""
        checked = self._check_keys(namespace, keys)
        tier = self.dram
        lease_id = secrets.token_hex(12)
        with self._lock:
            loads = self._start_loads(namespace, checked, Tier.DRAM)
        for load in loads.values():
            load.wait()
        with self._lock:
            deadline = self._clock() + lease_timeout_s
            entries = self.index.lease(
                lease_id if leased else None, namespace, checked, deadline, need=Tier.DRAM)
            result = ReadResult(lease_id, entries)
            for key, entry in zip(checked, entries, strict=True):
                self._count_read(entry, loads.get(key))
                if entry is not None:
                    assert tier is not None, "entries exist only in enabled tiers"
                    result.extents.append(
                        tier.extents(entry.places[Tier.DRAM], entry.size_bytes))
        return result

    def _start_loads(self, namespace: str, keys: Sequence[BlockKey],
                     target: Tier) -> dict[BlockKey, Load]:
        """With the lock held: loads of the keys cached only below target."""
        loads: dict[BlockKey, Load] = {}
        for key in keys:
            entry = self.index.get(namespace, key)
            if entry is not None and entry.tier > target and key not in loads:
                loads[key] = self.tiering.load(entry, target)
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
        tier = self._slot_tier()
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
            if not self.index.has_lease(lease_id):
                raise Aborted("the read outlived leases.lease_timeout_s and its lease expired")
            return copy(views, size)

    def release(self, ids: Sequence[str]) -> int:
        """End leases and abandon reservations; unknown or expired ids are an error (after
        the known ones are released)."""
        unknown: list[str] = []
        released = 0
        with self._lock:
            for rid in ids:
                if self.index.release(rid):
                    released += 1
                elif self.index.plan(rid) is not None:
                    self.index.complete_store(rid, None, success=False)
                    released += 1
                else:
                    unknown.append(rid)
        if unknown:
            raise InvalidArgument(
                f"ids: {unknown[:3]!r} unknown or expired ({len(unknown)} in all)"
            )
        return released

    def lookup(self, namespace: str, keys: Sequence[bytes]) -> tuple[int, list[Tier | None]]:
        checked = self._check_keys(namespace, keys)
        with self._lock:
            prefix, tiers = self.index.lookup(namespace, checked)
            self._hits += prefix
            self._misses += len(checked) - prefix
        return prefix, tiers

    def prefetch(
        self, namespace: str, keys: Sequence[bytes], target: Tier | None,
        deadline_s: float | None = None, cancelled: Callable[[], bool] = lambda: False,
    ) -> Iterator[PrefetchProgress]:
        """Bring keys up to target (default: the highest enabled tier); see kvstore.prefetch.
        Input is checked here, before the first progress message."""
        checked = self._check_keys(namespace, keys)
        tiers = self._opened.tiers
        if target is None:
            target = min(tiers, default=Tier.DRAM)
        if target not in tiers:
            raise FailedPrecondition(f"target_tier {target.label} is not enabled")
        if deadline_s is not None and not deadline_s > 0:
            raise InvalidArgument(f"deadline_ms must be > 0, got {deadline_s * 1000:g}")
        deadline = self._clock() + deadline_s if deadline_s is not None else None
        return prefetch(self._lock, self.index, self.tiering, namespace, checked, target,
                        deadline, cancelled, self._clock, 2 * self.config.nvme.io_threads)

    # --- operators -------------------------------------------------------------------------

    def evict(
        self, namespace: str, keys: Sequence[bytes], min_bytes: int, everything: bool,
        tier: Tier | None,
    ) -> EvictResult:
        modes = sum([bool(keys), min_bytes > 0, everything])
        if modes != 1:
            raise InvalidArgument("give exactly one of keys, bytes or all")
        if tier is not None and not self._stats[tier].enabled:
            raise FailedPrecondition(f"tier {tier.label} is not enabled")
        if namespace:
            checks.namespace(namespace)
        with self._lock:
            gone: dict[int, Entry] = {}  # entries that lost a copy, once each
            if keys:
                if not namespace:
                    raise InvalidArgument("namespace is required to evict keys")
                checked = self._check_keys(namespace, keys)
                evicted, skipped = self.index.evict_keys(namespace, checked)
                self._forget_l3(e for e in evicted if Tier.NVME in e.places)
                gone.update((id(e), e) for e in evicted)
            else:
                for t in [tier] if tier is not None else sorted(self._opened.tiers):
                    freed = sum(e.size_bytes for e in gone.values())
                    want = None if everything else min_bytes - freed
                    if want is not None and want <= 0:
                        break
                    evicted = self.index.evict_lru(t, want, namespace or None)
                    if t == Tier.NVME:
                        self._forget_l3(evicted)
                    gone.update((id(e), e) for e in evicted)
                skipped = self.index.unevictable(namespace or None) if everything else 0
            self.tiering.room.notify_all()
            return EvictResult(len(gone), sum(e.size_bytes for e in gone.values()), skipped)

    def _forget_l3(self, entries: Iterable[Entry]) -> None:
        for entry in entries:
            self.tiering.journal_free(entry)

    def set_pinned(self, namespace: str, keys: Sequence[bytes], pinned: bool) -> tuple[int, int]:
        checked = self._check_keys(namespace, keys)
        with self._lock:
            return self.index.set_pinned(namespace, checked, pinned)

    def sweep(self) -> tuple[int, int]:
        """Expire leases and reservations past their deadline; (leases, reservations)."""
        with self._lock:
            leases, plans = self.index.expire(self._clock())
        return len(leases), len(plans)

    def stats(self, namespace: str = "") -> StoreStats:
        if namespace:
            checks.namespace(namespace)
        with self._lock:
            out: list[TierStats] = []
            for t in Tier:
                row = replace(self._stats[t])
                tier = self._opened.tiers.get(t)
                if tier is not None:
                    alloc = self.index.allocator_stats(t)
                    row.capacity_bytes = tier.capacity_bytes
                    row.page_size_bytes = tier.page_size_bytes
                    row.free_pages = alloc.free_pages
                    row.largest_free_run_pages = alloc.largest_free_run
                    row.objects, row.used_bytes = self.index.usage(t, namespace or None)
                    row.evictions = self.index.evictions[t]
                out.append(row)
            return StoreStats(
                out,
                self.dram.shm_name if self.dram else "",
                self.dram.capacity_bytes if self.dram else 0,
                self.index.num_leases,
                self.index.num_plans,
                self.index.pinned_count(),
                self._hits,
                self._misses,
            )
