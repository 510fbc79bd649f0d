"""The store: validates requests, composes the index with the tiers, owns leases and counters.

Every public method checks its input first and raises a typed error naming the field
(kvstore.core.errors), so a bad request never reaches the index or a tier and never damages
stored data. Puts are two-phase (plan → write → commit, or abort) and belong to the store's
Writer (kvstore.daemon.writer); reads hold a lease while bytes are copied out, so the pages
under a reader are never reused, and belong to its Reader (kvstore.daemon.reader). The put
and read verbs here delegate to them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from kvstore.core import checks
from kvstore.core.errors import FailedPrecondition, InvalidArgument, StartupError
from kvstore.core.headstart import HeadStart
from kvstore.core.holdings import Caps, Holding
from kvstore.core.index import Index
from kvstore.core.pages import PageAllocator
from kvstore.core.prefixhits import PrefixCounts, PrefixHits
from kvstore.core.records import (
    CommitResult,
    Entry,
    EvictResult,
    PrewarmState,
    PutSession,
    ReadResult,
    Reservation,
    Skipped,
    StoreStats,
)
from kvstore.core.tenants import Tenant
from kvstore.daemon.auth import Auth
from kvstore.daemon.config import Config
from kvstore.daemon.movers import Mover
from kvstore.daemon.prefetch import PrefetchProgress, prefetch
from kvstore.daemon.reader import Reader
from kvstore.daemon.remote import Remote
from kvstore.daemon.tier_setup import open_tiers, split_arenas
from kvstore.daemon.tiering import Tiering
from kvstore.daemon.writer import Writer
from kvstore.extents import Arena
from kvstore.keys import BlockKey
from kvstore.tier import Tier, TierStats
from kvstore.tiers.dram import DramTier
from kvstore.tiers.redis_pool import HOT_MAX_MEMBERS
from kvstore.units import format_size

log = logging.getLogger(__name__)


SETTLE_CHUNK = 32  # deferred head-start uses per hold of the lock: about 1 ms


class Store:
    """The daemon's data plane, independent of gRPC. Thread-safe (one lock)."""

    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic,
                 auth: Auth | None = None) -> None:
        """auth: the daemon's tenants (read from config when None). With tenants, every slot
        tier is split into one arena per tenant (its quota, or an equal share of the rest)."""
        self.config = config
        self._clock = clock
        self._lock = threading.RLock()
        self.auth = auth if auth is not None else Auth(config)
        holders = self.auth.tenants.holders() if self.auth.on else []
        d = config.dram
        dram_arenas = split_arenas("dram", d.capacity_bytes // d.page_size_bytes, d.page_size_bytes,
                             holders) if holders and d.enabled else None
        self._opened = open_tiers(config, dram_arenas)
        tiers = self._opened.tiers
        dram = tiers.get(Tier.DRAM)
        self.dram: DramTier | None = dram if isinstance(dram, DramTier) else None
        arenas: dict[Tier, list[Arena]] = {}
        if holders:
            try:
                for t, x in tiers.items():  # L2's split is the one its arenas were made by
                    arenas[t] = dram_arenas if t is Tier.DRAM and dram_arenas else \
                        split_arenas(t.label, x.num_pages, x.page_size_bytes, holders)
            except StartupError:
                self._opened.close()
                raise
        self._head_start = HeadStart(deferred=True)  # its shadows run on the mover thread
        self.index = Index({t: PageAllocator(x.num_pages) for t, x in tiers.items()},
                           {t: x.page_size_bytes for t, x in tiers.items()},
                           arenas=arenas or None, arena_of=self.auth.arena_of,
                           head_start=self._head_start)
        self._stats = {t: TierStats(t.label, t in tiers) for t in Tier}
        for t, tier in tiers.items():
            self._stats[t].backend = tier.backend
        self._prefix_hits = PrefixHits()  # what Lookups asked and found, by tenant
        self.tiering = Tiering(config, self.index, self._lock, tiers, self._opened.manifest,
                               self._stats)
        self._mover: Mover | None = None
        self.remote: Remote | None = None
        self._prewarm: PrewarmState | None = None
        if self._opened.remote is not None and self.dram is not None:
            self.remote = Remote(config.remote, self._opened.remote, self._lock, self.index,
                                 self.dram, self._stats[Tier.REMOTE])
            self._stats[Tier.REMOTE].enabled = True
            self._stats[Tier.REMOTE].backend = self._opened.remote.backend
        c = config.clients  # the caps of each client, byte caps as shares of L2
        self.caps = Caps.of_shares(c.max_leases, c.max_reservations, c.max_reserved_share,
                                   c.max_pinned_share, d.capacity_bytes if d.enabled else 0)
        self._writer = Writer(config, self.index, self._lock, self.tiering, self._stats,
                              self._slot_tier, lambda: self.remote, clock, self.caps)
        self._reader = Reader(config, self.index, self._lock, self.tiering, self._stats,
                              lambda: self.dram, lambda: self.remote, self._writer, clock,
                              self.caps)
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
        """Start the background mover and the L4 workers; on_failure(reason) if one fails."""
        self._mover = Mover(self.tiering, self.config.movers.interval_s, on_failure,
                            self.settle_head_start)
        self._mover.start()
        if self.remote is not None:
            self.remote.start(on_failure)

    def settle_head_start(self) -> None:
        """Run the head start's deferred uses (kvstore.core.headstart), SETTLE_CHUNK at a
        time under the lock, so no request waits long behind them."""
        while True:
            with self._lock:
                if not self._head_start.settle(SETTLE_CHUNK):
                    return
            time.sleep(0)  # and the GIL: a request waiting for it runs now, not in 5 ms

    def close(self, l4_flush_s: float = 5.0) -> None:
        """Stop the workers and close the tiers; blocks queued for L4 get up to l4_flush_s
        to reach Redis first, and the L3 manifest is closed consistent."""
        if self.remote is not None:
            self.remote.close(l4_flush_s)
            self.remote = None
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
            raise FailedPrecondition("no slot tier is enabled (dram.enabled is false)",
                                     setting="dram.enabled")
        return self.dram

    # --- puts (kvstore.daemon.writer) ------------------------------------------------------

    def begin_put(self, namespace: str, keys: Sequence[bytes], sizes: Sequence[int],
                  parent: bytes = b"", independent: bool = False,
                  client: str = "") -> PutSession:
        """Plan an inline put; feed its bytes with write(), then commit() or abort()."""
        return self._writer.begin_put(namespace, keys, sizes, parent, independent, client)

    def write(self, session: PutSession, data: memoryview) -> None:
        """Append a chunk of the concatenated payloads."""
        self._writer.write(session, data)

    def commit(self, session: PutSession, to_remote: bool = True) -> CommitResult:
        """Make the put's blocks entries; with to_remote they are also offered to L4."""
        return self._writer.commit(session, to_remote)

    def abort(self, plan_id: str) -> None:
        self._writer.abort(plan_id)

    def import_blocks(self, namespace: str, keys: Sequence[BlockKey],
                      payloads: Sequence[bytes]) -> int:
        """Store blocks fetched from L4 in L2, not offered back to L4; how many were new."""
        return self._writer.import_blocks(namespace, keys, payloads)

    def reserve(self, namespace: str, keys: Sequence[bytes], sizes: Sequence[int],
                parent: bytes = b"", independent: bool = False,
                timeout_s: float | None = None, client: str = "") -> Reservation:
        """Pages for the client to write itself; commit_reservation() makes them entries."""
        return self._writer.reserve(namespace, keys, sizes, parent, independent, timeout_s,
                                    client)

    def commit_reservation(self, namespace: str, reservation_id: str,
                           checksums: Sequence[int] = ()) -> CommitResult:
        return self._writer.commit_reservation(namespace, reservation_id, checksums)

    # --- reads -----------------------------------------------------------------------------

    def read(
        self, namespace: str, keys: Sequence[bytes], lease_timeout_s: float, leased: bool = True,
        client: str = "", inline: bool = False,
    ) -> ReadResult:
        """Lease the found entries (the caller copies their bytes, then release()s), or with
        leased=False only touch them (for readers that verify checksums). An inline read is
        refused past server.max_response_bytes."""
        return self._reader.read(namespace, keys, lease_timeout_s, leased, client, inline)

    def chunks(
        self, result: ReadResult, chunk_bytes: int, copy: Callable[[list[memoryview], int], bytes]
    ) -> Iterator[bytes]:
        """The found payloads in pieces of at most chunk_bytes, each copy()'d under its lease."""
        return self._reader.chunks(result, chunk_bytes, copy)

    def release(self, ids: Sequence[str], owner: str | None = None) -> int:
        """End leases and abandon reservations; unknown or expired ids are an error (after
        the known ones are released). With owner, only that client's ids are released."""
        return self._reader.release(ids, owner)

    def lookup(self, namespace: str, keys: Sequence[bytes],
               block_tokens: int = 0) -> tuple[int, list[Tier | None]]:
        """The longest cached prefix of keys, each key's tier; counted in the prefix hits."""
        checked = self._check_keys(namespace, keys)
        remote = self.remote
        with self._lock:
            prefix, tiers = self.index.lookup(namespace, checked)
            if remote is None or prefix == len(checked):  # no L4 round trip to make
                self._count_lookup(namespace, len(checked), prefix, block_tokens)
                return prefix, tiers
        misses = [i for i, t in enumerate(tiers) if t is None]
        there = remote.exists(namespace, [checked[i] for i in misses])
        for i, found in zip(misses, there, strict=True):
            if found:
                tiers[i] = Tier.REMOTE
        prefix = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
        with self._lock:
            self._count_lookup(namespace, len(checked), prefix, block_tokens)
        return prefix, tiers

    def _count_lookup(self, namespace: str, keys: int, prefix: int, block_tokens: int) -> None:
        self._prefix_hits.count(self.auth.arena_of(namespace) or "", keys, prefix, block_tokens)

    def prefix_hits(self) -> dict[str, PrefixCounts]:  # by tenant ("" with auth off)
        with self._lock:
            return self._prefix_hits.by_tenant()

    def prefetch(
        self, namespace: str, keys: Sequence[bytes], target: Tier | None,
        deadline_s: float | None = None, cancelled: Callable[[], bool] = lambda: False,
    ) -> Iterator[PrefetchProgress]:
        """Bring keys up to target (default: the highest enabled tier); see kvstore.daemon.prefetch.
        Input is checked here, before the first progress message."""
        checked = self._check_keys(namespace, keys)
        checks.distinct(checked, "Prefetch")
        tiers = self._opened.tiers
        if target is None:
            target = min(tiers, default=Tier.DRAM)
        if target not in tiers:
            raise FailedPrecondition(f"target_tier {target.label} is not enabled",
                                     field="target_tier", setting=checks.switch(target))
        if deadline_s is not None and not deadline_s > 0:
            raise InvalidArgument(f"deadline_ms must be > 0, got {deadline_s * 1000:g}",
                                  field="deadline_ms")
        deadline = self._clock() + deadline_s if deadline_s is not None else None
        self._reader.fetch_remote(namespace, checked)  # L4 hits first, in one batch
        return prefetch(self._lock, self.index, self.tiering, namespace, checked, target,
                        deadline, cancelled, self._clock, 2 * self.config.nvme.io_threads)

    # --- L4 ---------------------------------------------------------------------------------

    def _remote(self) -> Remote:
        if self.remote is None:
            raise FailedPrecondition("L4 is off: set remote.url", setting="remote.url")
        return self.remote

    def hot(self, namespace: str, limit: int) -> list[tuple[bytes, float]]:
        checks.namespace(namespace)
        if not 0 <= limit <= HOT_MAX_MEMBERS:
            raise InvalidArgument(f"limit must be 0..{HOT_MAX_MEMBERS}, got {limit}",
                                  field="limit", limit=HOT_MAX_MEMBERS)
        return self._remote().hot(namespace, limit or 100)

    def prewarm(self, max_bytes: int, namespaces: Sequence[str] = ()) -> Iterator[PrewarmState]:
        """Pull the hottest L4 blocks into L2 (and, as L2 fills, L3) until max_bytes (default
        remote.prewarm_bytes; at most what L2 and L3 hold below their low watermarks)."""
        for namespace in namespaces:
            checks.namespace(namespace)
        remote = self._remote()
        room = sum(t.capacity_bytes for t in self._opened.tiers.values() if t.name != "hbm")
        target = min(max_bytes or self.config.remote.prewarm_bytes,
                     int(room * self.config.movers.low_watermark))
        return self._tracked(remote.prewarm(target, self._reader.missing, self.import_blocks,
                                            namespaces))

    def remote_namespaces(self) -> list[str]:
        """The namespaces L4's popularity knows (for a tenant's own pre-warm)."""
        return self._remote().namespaces()

    def _tracked(self, progress: Iterator[PrewarmState]) -> Iterator[PrewarmState]:
        for state in progress:
            self._prewarm = state  # what stats() reports
            yield state

    # --- operators -------------------------------------------------------------------------

    def evict(
        self, namespace: str, keys: Sequence[bytes], min_bytes: int, everything: bool,
        tier: Tier | None,
    ) -> EvictResult:
        checks.evict_modes(bool(keys), min_bytes, everything, tier,
                           tier is None or self._stats[tier].enabled)
        if namespace:
            checks.namespace(namespace)
        with self._lock:
            gone: dict[int, Entry] = {}  # entries that lost a copy, once each
            if keys:
                if not namespace:
                    raise InvalidArgument("namespace is required to evict keys",
                                          field="namespace")
                checked = self._check_keys(namespace, keys)
                evicted, skipped = self.index.evict_keys(namespace, checked)
                self.tiering.journal_free(e for e in evicted if Tier.NVME in e.copies)
                gone.update((id(e), e) for e in evicted)
            else:
                # Tier by tier, again while a pass frees something: a parent whose last
                # child went from another tier may go now.
                tiers = [tier] if tier is not None else sorted(self._opened.tiers)
                progress = True
                while progress:
                    progress = False
                    for t in tiers:
                        want = None if everything else min_bytes - sum(
                            e.size_bytes for e in gone.values())
                        if want is not None and want <= 0:
                            break
                        evicted = self.index.evict_in_order(t, want, namespace or None)
                        if t == Tier.NVME:
                            self.tiering.journal_free(evicted)
                        progress |= bool(evicted)
                        gone.update((id(e), e) for e in evicted)
                short = everything or sum(e.size_bytes for e in gone.values()) < min_bytes
                skipped = self.index.unevictable(namespace or None, tier) if short else Skipped()
            self.tiering.room.notify_all()
            return EvictResult(len(gone), sum(e.size_bytes for e in gone.values()), skipped)

    def set_pinned(self, namespace: str, keys: Sequence[bytes], pinned: bool,
                   client: str = "") -> tuple[int, int]:
        """Pin (for clients.max_pin_s, renewed by pinning again) or unpin; (changed,
        missing). Pins count against the client's clients.max_pinned_share."""
        checked = self._check_keys(namespace, keys)
        checks.distinct(checked, "Pin" if pinned else "Unpin")
        with self._lock:
            if not pinned:
                return self.index.leases.set_pinned(namespace, checked, False)
            found = [e for e in (self.index.get(namespace, k) for k in checked) if e is not None]
            more = sum(e.size_bytes for e in found
                       if self.index.holdings.pinned_by(namespace, e.key) != client)
            self.index.holdings.check(client, self._caps_of(client), pinned_bytes=more)
            deadline = self._clock() + self.config.clients.max_pin_s
            return self.index.leases.set_pinned(namespace, checked, True, client, deadline)

    def _caps_of(self, client: str) -> Caps:
        """The caps of client: a tenant's quota.pinned replaces clients.max_pinned_share."""
        tenant = self.auth.tenants.named(client) if self.auth.on else None
        if tenant is None or "pinned" not in tenant.quota:
            return self.caps
        return replace(self.caps, pinned_bytes=tenant.quota["pinned"])

    def sweep(self) -> tuple[int, int, int]:
        """Expire leases, reservations and pins past their deadline; how many of each."""
        with self._lock:
            leases, plans = self.index.expire(now := self._clock())
            pins = self.index.leases.expire_pins(now)
        return len(leases), len(plans), len(pins)

    def arena_usage(self) -> list[tuple[str, Tier, int, int, int]]:
        """(arena, tier, objects, used, capacity bytes) of each tenant's arena ("": auth off)."""
        out = []
        with self._lock:
            for t, x in self._opened.tiers.items():
                for a in self.index.arena_names(t):
                    objects, used, _, pages = self.index.arena_usage(t, a)
                    out.append((a, t, objects, used, pages * x.page_size_bytes))
        return out

    def holdings(self) -> dict[str, Holding]:
        """What each client holds now (leases, reservations, pins), by client."""
        with self._lock:
            return self.index.holdings.all()

    def stats(self, namespace: str = "", tenant: Tenant | None = None) -> StoreStats:
        """The whole daemon's figures (tenant None or an admin), or a client tenant's own:
        its arenas' capacity and use, its holdings and its Lookup hits; the per-tier
        activity counters are the daemon's and stay hidden from it."""
        if namespace:
            checks.namespace(namespace)
        own = tenant is not None and not tenant.admin
        with self._lock:
            out: list[TierStats] = []
            for t in Tier:
                row = replace(self._stats[t])
                tier = self._opened.tiers.get(t)
                if own:
                    row = TierStats(row.tier, row.enabled, backend=row.backend)
                if tier is not None:
                    row.capacity_bytes = tier.capacity_bytes
                    row.page_size_bytes = tier.page_size_bytes
                    if own:
                        assert tenant is not None
                        objects, used, free, pages = self.index.arena_usage(t, tenant.name)
                        row.capacity_bytes = pages * tier.page_size_bytes
                        row.free_pages = free
                        row.objects, row.used_bytes = objects, used
                    else:
                        alloc = self.index.allocator_stats(t)
                        row.free_pages = alloc.free_pages
                        row.largest_free_run_pages = alloc.largest_free_run
                        row.objects, row.used_bytes = self.index.usage(t, None)
                        row.evictions = self.index.evictions[t]
                    if namespace:
                        row.objects, row.used_bytes = self.index.usage(t, namespace)
                if t == Tier.REMOTE and self.remote is not None:
                    row.state = self.remote.state
                    self.remote.want_census()  # the pool's blocks: counted in the background
                out.append(row)
            if own:
                assert tenant is not None
                held = self.index.holdings.of(tenant.name)
                hits = self._prefix_hits.of(tenant.name)
                return StoreStats(out, "", 0, held.leases, held.reservations, held.pins,
                                  hits.hit_blocks, hits.miss_blocks, None)
            total = self._prefix_hits.total()
            return StoreStats(
                out,
                self.dram.shm_name if self.dram else "",
                self.dram.capacity_bytes if self.dram else 0,
                self.index.leases.num_leases,
                self.index.num_plans,
                self.index.leases.pinned_count(),
                total.hit_blocks,
                total.miss_blocks,
                replace(self._prewarm) if self._prewarm else None,
            )

