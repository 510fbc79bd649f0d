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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import xxhash

from kvstore import checks
from kvstore.config import Config, format_size
from kvstore.entries import CommitResult, Entry, Tier
from kvstore.errors import Aborted, FailedPrecondition, InvalidArgument, ResourceExhausted
from kvstore.index import Index
from kvstore.keys import BlockKey
from kvstore.pages import PageAllocator
from kvstore.tiers.dram import DramTier, Extent


@dataclass(slots=True)
class TierStats:
    tier: str
    enabled: bool
    capacity_bytes: int = 0
    used_bytes: int = 0
    objects: int = 0
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    page_size_bytes: int = 0
    free_pages: int = 0
    largest_free_run_pages: int = 0


@dataclass(slots=True)
class StoreStats:
    tiers: list[TierStats]
    shm_name: str
    shm_size_bytes: int
    leases: int
    reservations: int
    pinned: int
    hits: int
    misses: int


@dataclass(slots=True)
class PutSession:
    """One put in flight: where each block's bytes go, and how many have arrived."""

    plan_id: str
    namespace: str
    sizes: list[int]
    targets: list[list[Extent] | None]  # per request position; None = already stored
    hashers: list[xxhash.xxh3_64 | None]
    total_bytes: int
    received_bytes: int = 0
    block: int = 0  # request position the next byte belongs to
    block_offset: int = 0


@dataclass(slots=True)
class Reservation:
    reservation_id: str
    exists: list[bool]
    extents: list[list[Extent]]  # per key; empty for keys that exist
    expires_in_s: float


@dataclass(slots=True)
class ReadResult:
    lease_id: str
    entries: list[Entry | None]
    extents: list[list[Extent]] = field(default_factory=list)  # per found entry


@dataclass(frozen=True, slots=True)
class EvictResult:
    evicted: int
    evicted_bytes: int
    skipped: int


class Store:
    """The daemon's data plane, independent of gRPC. Thread-safe (one lock)."""

    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.RLock()
        self.dram: DramTier | None = None
        if config.dram.enabled:
            self.dram = DramTier(
                config.dram.capacity_bytes,
                config.dram.page_size_bytes,
                config.dram.shm_name or f"kvstore-{config.server.port}-{secrets.token_hex(4)}",
                config.dram.pin_memory,
            )
        allocators = {Tier.DRAM: PageAllocator(self.dram.num_pages)} if self.dram else {}
        pages = {Tier.DRAM: config.dram.page_size_bytes}
        self.index = Index(allocators, pages, clock)
        self._stats = {t: TierStats(t.label, t in allocators) for t in Tier}
        self._hits = self._misses = 0  # Lookup: keys inside / past the cached prefix

    def close(self) -> None:
        with self._lock:
            if self.dram is not None:
                self.dram.close()
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
            plan = self.index.prepare_store(
                plan_id, namespace, checked, sizes, parents, Tier.DRAM, self._clock() + timeout_s
            )
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
                tier.write(targets, session.block_offset, chunk)
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
        leased=False only touch them (for readers that verify checksums)."""
        checked = self._check_keys(namespace, keys)
        tier = self.dram
        lease_id = secrets.token_hex(12)
        with self._lock:
            deadline = self._clock() + lease_timeout_s
            entries = self.index.lease(lease_id if leased else None, namespace, checked, deadline)
            result = ReadResult(lease_id, entries)
            stats = self._stats[Tier.DRAM]
            for entry in entries:
                if entry is None:
                    stats.misses += 1  # L2 is the only tier a read looks in yet
                    continue
                assert tier is not None, "entries exist only in enabled tiers"
                stats.hits += 1
                stats.bytes_out += entry.size_bytes
                result.extents.append(tier.extents(entry.pages, entry.size_bytes))
        return result

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
        self, namespace: str, keys: Sequence[bytes], target: Tier | None
    ) -> tuple[int, int]:
        """(done, missing). Only L2 exists yet, so every cached key is already in place."""
        checked = self._check_keys(namespace, keys)
        if target is not None and not self._stats[target].enabled:
            raise FailedPrecondition(f"target_tier {target.label} is not enabled")
        with self._lock:
            _, tiers = self.index.lookup(namespace, checked)
        done = sum(1 for t in tiers if t is not None)
        return done, len(tiers) - done

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
            if keys:
                if not namespace:
                    raise InvalidArgument("namespace is required to evict keys")
                checked = self._check_keys(namespace, keys)
                evicted, skipped = self.index.evict_keys(namespace, checked)
            else:
                evicted = []
                for t in [tier] if tier is not None else self._enabled_slot_tiers():
                    want = None if everything else min_bytes - sum(e.size_bytes for e in evicted)
                    evicted += self.index.evict_lru(t, want, namespace or None)
                skipped = self.index.unevictable(namespace or None) if everything else 0
            return EvictResult(len(evicted), sum(e.size_bytes for e in evicted), skipped)

    def _enabled_slot_tiers(self) -> list[Tier]:
        return [Tier.DRAM] if self.dram is not None else []

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
                if t == Tier.DRAM and self.dram is not None:
                    alloc = self.index.allocator_stats(t)
                    row.capacity_bytes = self.dram.capacity_bytes
                    row.page_size_bytes = self.dram.page_size_bytes
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
