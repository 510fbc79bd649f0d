"""The store: the index composed with the tiers, and the one state its reader and writer share.

A Store opens the tiers the config asks for, builds the index over them and the tiering that
moves blocks between them, and puts these, with its lock, its counters and the clients' caps,
in one StoreState (`kvstore.daemon.storestate`). It hands that state to its Writer
(`store.writer`, `kvstore.daemon.writer`), which owns puts: two-phase, plan -> write ->
commit (or abort), and Reserve with its commit. It hands it as well to its Reader
(`store.reader`, `kvstore.daemon.reader`), which owns reads and Release: a read holds a lease
while its bytes are copied out, so the pages under a reader are never reused. Callers use
the reader and the writer directly.

The store itself owns Lookup and its prefix hits, Prefetch, the verbs about L4 (Hot and
pre-warm), the operators' verbs (Evict, Pin, Stats), the sweep of expired holdings, the
background workers and closing. Every public method, here and in the reader and the writer,
checks its input first and raises a typed error naming the field (`kvstore.core.errors`), so
a bad request never reaches the index or a tier and never damages stored data.
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
from kvstore.core.index import Index, mirrored
from kvstore.core.pages import PageAllocator
from kvstore.core.prefixhits import PrefixCounts, PrefixHits
from kvstore.core.records import Entry, EvictResult, PrewarmState, Skipped, StoreStats
from kvstore.core.tenants import Tenant
from kvstore.daemon.auth import Auth
from kvstore.daemon.config import Config
from kvstore.daemon.events import EventLog
from kvstore.daemon.movers import Mover
from kvstore.daemon.prefetch import PrefetchProgress, prefetch
from kvstore.daemon.reader import Reader
from kvstore.daemon.readtable import ReadTables
from kvstore.daemon.remote import Remote
from kvstore.daemon.storestate import StoreState
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


DEFERRED_CHUNK = 32  # deferred head-start uses per hold of the lock: about 1 ms


class Store:
    """The daemon's data plane, independent of gRPC. Thread-safe: one lock guards the index.

    Its reader (`store.reader`: Get and Release) and its writer (`store.writer`: Put, Reserve
    and its commit) are called directly; they work on the store's StoreState
    (`store.state`), which also holds L2 and L4 for everyone who needs them. The store's own
    verbs are Lookup, Prefetch, the L4 ones (Hot, pre-warm), the operators' (Evict, Pin,
    Stats) and the sweep of expired holdings.
    """

    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic,
                 auth: Auth | None = None) -> None:
        """Open the tiers config asks for and build the index over them. auth holds the
        daemon's tenants; when it is None, they are read from config. With tenants, every
        slot tier is split into one arena per tenant: its quota, or an equal share of what
        the quotas leave."""
        self.config = config
        self.auth = auth if auth is not None else Auth(config)
        holders = self.auth.tenants.holders() if self.auth.on else []
        d = config.dram
        dram_arenas = split_arenas("dram", d.capacity_bytes // d.page_size_bytes, d.page_size_bytes,
                             holders) if holders and d.enabled else None
        self._opened = open_tiers(config, dram_arenas)
        tiers = self._opened.tiers
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
        self._prefix_hits = PrefixHits()  # what Lookups asked and found, by tenant
        # Where each L2 block lies, for clients that read without a round trip; None: off.
        self.read_tables = self._read_tables(dram_arenas)
        # Each tenant's blocks stored, moved and removed, for routers; None: events off.
        self.events = (EventLog(self.config.events.buffer_events, self.auth.arena_of)
                       if self.config.events.buffer_events else None)
        self.index.published = mirrored(self.read_tables, self.events)
        self.state = self._build_state(clock)
        if self.events is not None and self.state.remote is not None:
            self.state.remote.on_written = self.events.pool_written
        self.tiering = self.state.tiering
        self.writer = Writer(self.state)
        self.reader = Reader(self.state, self.writer)
        self._mover: Mover | None = None
        self._prewarm: PrewarmState | None = None
        try:
            self.adopted = self.tiering.adopt()
        except BaseException:
            self.close()
            raise

    def _read_tables(self, dram_arenas: list[Arena] | None) -> ReadTables | None:
        """One read table per L2 arena (kvstore.daemon.readtable) when dram.read_table is
        on and L2 is a shared-memory tier; None otherwise."""
        dram = self._opened.tiers.get(Tier.DRAM)
        if not self.config.dram.read_table or not isinstance(dram, DramTier):
            return None
        arenas = dram_arenas or [Arena("", 0, dram.num_pages)]
        try:
            return ReadTables(arenas, dram.page_size_bytes)
        except OSError as exc:  # no memfd or sealing here: reads ask the daemon, as before
            log.warning("dram.read_table: no read tables (%s); every read asks the daemon",
                        exc)
            return None

    def _build_state(self, clock: Callable[[], float]) -> StoreState:
        """The state the store shares with its reader and writer: the lock, the tiering and
        L4 (when remote.url is set and L2 is on) built over the open tiers, the counters,
        and each client's caps (its byte caps as shares of L2)."""
        config, tiers, lock = self.config, self._opened.tiers, threading.RLock()
        stats = {t: TierStats(t.label, t in tiers) for t in Tier}
        for t, tier in tiers.items():
            stats[t].backend = tier.backend
        tiering = Tiering(config, self.index, lock, tiers, self._opened.manifest, stats)
        dram = tiers.get(Tier.DRAM)
        l2 = dram if isinstance(dram, DramTier) else None
        remote: Remote | None = None
        if self._opened.remote is not None and l2 is not None:
            remote = Remote(config.remote, self._opened.remote, lock, self.index, l2,
                            stats[Tier.REMOTE])
            stats[Tier.REMOTE].enabled = True
            stats[Tier.REMOTE].backend = self._opened.remote.backend
        c, d = config.clients, config.dram
        caps = Caps.of_shares(c.max_leases, c.max_reservations, c.max_reserved_share,
                              c.max_pinned_share, d.capacity_bytes if d.enabled else 0)
        return StoreState(config, self.index, lock, tiering, stats, clock, caps, l2, remote)

    def describe_l3(self) -> str:
        """One line for the start-up banner: where L3 is, its size and how many blocks it
        re-adopted, or that it is off."""
        nvme = self._opened.tiers.get(Tier.NVME)
        if nvme is None:
            return "L3 off"
        return (f"L3 {nvme.backend} in {self._opened.l3_dir}, "
                f"{format_size(nvme.capacity_bytes)}, {self.adopted} blocks re-adopted")

    def start(self, on_failure: Callable[[str], None]) -> None:
        """Start the background mover and the L4 workers; a worker that fails calls
        on_failure with the reason."""
        self._mover = Mover(self.tiering, self.config.movers.interval_s, on_failure,
                            self.run_deferred_head_start)
        self._mover.start()
        if self.state.remote is not None:
            self.state.remote.start(on_failure)

    def run_deferred_head_start(self) -> None:
        """Run the head start's deferred uses (kvstore.core.headstart), DEFERRED_CHUNK at a
        time under the lock, so no request waits long behind them."""
        while True:
            with self.state.lock:
                if not self._head_start.run_deferred(DEFERRED_CHUNK):
                    return
            time.sleep(0)  # and the GIL: a request waiting for it runs now, not in 5 ms

    def close(self, l4_flush_s: float = 5.0) -> None:
        """Stop the workers and close the tiers. Blocks queued for L4 get up to l4_flush_s
        to reach Redis first, and the L3 manifest is left consistent. L2 and L4 leave the
        state, so a call still running sees them gone."""
        remote = self.state.remote
        if remote is not None:
            remote.close(l4_flush_s)
            self.state.remote = None
        if self._mover is not None:
            self._mover.stop()
            self._mover = None
        self.tiering.close()
        with self.state.lock:
            self._opened.close()
            self.state.dram = None
            if self.read_tables is not None:
                self.index.published = None
                self.read_tables.close()
                self.read_tables = None

    def _check_keys(self, namespace: str, keys: Sequence[bytes]) -> list[BlockKey]:
        """The keys of a request as BlockKeys, after checking the namespace, each key's
        length and their number (at most server.max_batch_keys)."""
        return checks.keys(namespace, keys, self.config.server.max_batch_keys)

    def lookup(self, namespace: str, keys: Sequence[bytes],
               block_tokens: int = 0) -> tuple[int, list[Tier | None]]:
        """The length of the longest prefix of keys that some tier holds, and the tier of
        each key (L4 is asked only about the keys no local tier holds). Each Lookup is
        counted in its tenant's prefix hits, with block_tokens tokens per key."""
        checked = self._check_keys(namespace, keys)
        remote = self.state.remote
        with self.state.lock:
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
        with self.state.lock:
            self._count_lookup(namespace, len(checked), prefix, block_tokens)
        return prefix, tiers

    def lookups_reported(self, namespace: str, found: int, block_tokens: int) -> None:
        """Count keys a client found through its read table (a prefix of each of its
        Lookups, reported in batches: kvstore.daemon.localpath) in the prefix hits, as found;
        the rest of such a Lookup came to the daemon and was counted then."""
        checks.namespace(namespace)
        with self.state.lock:
            self._count_lookup(namespace, found, found, block_tokens)

    def _count_lookup(self, namespace: str, keys: int, prefix: int, block_tokens: int) -> None:
        """Count a Lookup in the prefix hits of the tenant owning namespace; the caller holds
        the lock."""
        self._prefix_hits.count(self.auth.arena_of(namespace) or "", keys, prefix, block_tokens)

    def prefix_hits(self) -> dict[str, PrefixCounts]:
        """What the Lookups asked and found, by tenant; with auth off, all under ""."""
        with self.state.lock:
            return self._prefix_hits.by_tenant()

    def prefetch(
        self, namespace: str, keys: Sequence[bytes], target: Tier | None,
        deadline_s: float | None = None, cancelled: Callable[[], bool] = lambda: False,
    ) -> Iterator[PrefetchProgress]:
        """Bring keys up to target (by default the highest enabled tier), reporting progress
        as they get there (kvstore.daemon.prefetch). The request is checked here, before the
        first progress message, and keys only L4 holds are fetched into L2 first, in one
        batch."""
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
        deadline = self.state.clock() + deadline_s if deadline_s is not None else None
        self.reader.fetch_remote(namespace, checked)  # L4 hits first, in one batch
        return prefetch(self.state.lock, self.index, self.tiering, namespace, checked, target,
                        deadline, cancelled, self.state.clock, 2 * self.config.nvme.io_threads)

    # --- L4 ---------------------------------------------------------------------------------

    def _remote(self) -> Remote:
        """L4, for the verbs that are about L4 itself; FailedPrecondition when it is off."""
        remote = self.state.remote
        if remote is None:
            raise FailedPrecondition("L4 is off: set remote.url", setting="remote.url")
        return remote

    def hot(self, namespace: str, limit: int) -> list[tuple[bytes, float]]:
        """The most popular keys of namespace in L4 with their scores (decayed read counts),
        highest first: at most limit of them, or 100 when limit is 0. Raises Unavailable
        while Redis is down."""
        checks.namespace(namespace)
        if not 0 <= limit <= HOT_MAX_MEMBERS:
            raise InvalidArgument(f"limit must be 0..{HOT_MAX_MEMBERS}, got {limit}",
                                  field="limit", limit=HOT_MAX_MEMBERS)
        return self._remote().hot(namespace, limit or 100)

    def prewarm(self, max_bytes: int, namespaces: Sequence[str] = ()) -> Iterator[PrewarmState]:
        """Pull the hottest L4 blocks into L2 (and, as L2 fills, into L3) until max_bytes
        have come, reporting progress as they do. max_bytes 0 means remote.prewarm_bytes,
        and it is never more than what L2 and L3 hold below their low watermarks.
        namespaces limits the pull to those; none means all."""
        for namespace in namespaces:
            checks.namespace(namespace)
        remote = self._remote()
        room = sum(t.capacity_bytes for t in self._opened.tiers.values() if t.name != "hbm")
        target = min(max_bytes or self.config.remote.prewarm_bytes,
                     int(room * self.config.movers.low_watermark))
        return self._tracked(remote.prewarm(target, self.reader.missing,
                                            self.writer.import_blocks, namespaces))

    def remote_namespaces(self) -> list[str]:
        """The namespaces L4's popularity knows (for a tenant's own pre-warm)."""
        return self._remote().namespaces()

    def _tracked(self, progress: Iterator[PrewarmState]) -> Iterator[PrewarmState]:
        """The pre-warm's progress, each state kept as the last one for stats() to report."""
        for state in progress:
            self._prewarm = state
            yield state

    # --- operators -------------------------------------------------------------------------

    def evict(
        self, namespace: str, keys: Sequence[bytes], min_bytes: int, everything: bool,
        tier: Tier | None,
    ) -> EvictResult:
        """Evict exactly one of: the entries of keys in namespace (with their cached
        descendants, so no block is left without its prefix), at least min_bytes in eviction
        order, or everything. A namespace limits an eviction by bytes or of everything to
        it, and a tier to that tier. Pinned, leased and moving blocks stay; the result says
        how many entries went, their bytes, and the blocks skipped, by reason."""
        checks.evict_modes(bool(keys), min_bytes, everything, tier,
                           tier is None or self.state.stats[tier].enabled)
        if namespace:
            checks.namespace(namespace)
        with self.state.lock:
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
        """Pin the entries of keys, or unpin them, and say how many changed and how many
        keys were missing. A pin lasts clients.max_pin_s and pinning again renews it; the
        bytes a client pins count against its clients.max_pinned_share (a tenant's
        quota.pinned when it has one)."""
        checked = self._check_keys(namespace, keys)
        checks.distinct(checked, "Pin" if pinned else "Unpin")
        with self.state.lock:
            if not pinned:
                return self.index.leases.set_pinned(namespace, checked, False)
            found = [e for e in (self.index.get(namespace, k) for k in checked) if e is not None]
            more = sum(e.size_bytes for e in found
                       if self.index.holdings.pinned_by(namespace, e.key) != client)
            self.index.holdings.check(client, self._caps_of(client), pinned_bytes=more)
            deadline = self.state.clock() + self.config.clients.max_pin_s
            return self.index.leases.set_pinned(namespace, checked, True, client, deadline)

    def _caps_of(self, client: str) -> Caps:
        """The caps of client: a tenant's quota.pinned replaces clients.max_pinned_share."""
        tenant = self.auth.tenants.named(client) if self.auth.on else None
        if tenant is None or "pinned" not in tenant.quota:
            return self.state.caps
        return replace(self.state.caps, pinned_bytes=tenant.quota["pinned"])

    def sweep(self) -> tuple[int, int, int]:
        """Expire the leases, reservations and pins past their deadline, and say how many
        of each expired."""
        with self.state.lock:
            leases, plans = self.index.expire(now := self.state.clock())
            pins = self.index.leases.expire_pins(now)
        return len(leases), len(plans), len(pins)

    def arena_usage(self) -> list[tuple[str, Tier, int, int, int]]:
        """Each arena of each tier as (arena, tier, objects, used bytes, capacity bytes). An
        arena is named after its tenant; with auth off each tier has one, named ""."""
        out = []
        with self.state.lock:
            for t, x in self._opened.tiers.items():
                for a in self.index.arena_names(t):
                    objects, used, _, pages = self.index.arena_usage(t, a)
                    out.append((a, t, objects, used, pages * x.page_size_bytes))
        return out

    def holdings(self) -> dict[str, Holding]:
        """What each client holds now (leases, reservations, pins), by client."""
        with self.state.lock:
            return self.index.holdings.all()

    def stats(self, namespace: str = "", tenant: Tenant | None = None) -> StoreStats:
        """The whole daemon's figures (tenant None or an admin), or a client tenant's own:
        its arenas' capacity and use, its holdings and its Lookup hits; the per-tier
        activity counters are the daemon's and stay hidden from it."""
        if namespace:
            checks.namespace(namespace)
        own = tenant is not None and not tenant.admin
        dram, remote = self.state.dram, self.state.remote
        with self.state.lock:
            out: list[TierStats] = []
            for t in Tier:
                row = replace(self.state.stats[t])
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
                if t == Tier.REMOTE and remote is not None:
                    row.state = remote.state
                    remote.want_census()  # the pool's blocks: counted in the background
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
                dram.shm_name if dram else "",
                dram.capacity_bytes if dram else 0,
                self.index.leases.num_leases,
                self.index.num_plans,
                self.index.leases.pinned_count(),
                total.hit_blocks,
                total.miss_blocks,
                replace(self._prewarm) if self._prewarm else None,
            )

