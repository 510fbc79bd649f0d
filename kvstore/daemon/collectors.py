"""The collectors of the daemon's metrics that read the store's figures on each scrape: per-tier
gauges and counters, coalesced loads, what each client holds, L3 admission, and what the store
counts by tenant (Lookups' prefix hits, arena use) with L4's dropped write-throughs.

Store figures are not mirrored into metric objects: each collector asks for fresh ones on every
scrape, so a scrape costs a few dictionary walks under the store's lock and nothing between
scrapes. `Metrics.watch_store` (kvstore.daemon.metrics) registers them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.daemon.l3room import REASONS, AdmissionState

if TYPE_CHECKING:
    from kvstore.core.holdings import Holding
    from kvstore.daemon.store import Store

logger = logging.getLogger(__name__)

LOADS_COALESCED = "kvstore_loads_coalesced_total"
L3_ADMISSION_ENABLED = "kvstore_l3_admission_enabled"
L3_ADMISSION_OFF = "kvstore_l3_admission_off"
L3_FREE = "kvstore_l3_filesystem_free_bytes"
L3_RESERVE = "kvstore_l3_filesystem_reserve_bytes"

class TierStatsLike(Protocol):
    """What the collector reads from one tier's stats (read-only, so frozen dataclasses fit)."""

    @property
    def tier(self) -> str: ...  # "dram", "hbm", "nvme", "remote"
    @property
    def enabled(self) -> bool: ...
    @property
    def capacity_bytes(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    @property
    def objects(self) -> int: ...
    @property
    def hits(self) -> int: ...
    @property
    def misses(self) -> int: ...
    @property
    def bytes_in(self) -> int: ...
    @property
    def bytes_out(self) -> int: ...
    @property
    def evictions(self) -> int: ...
    @property
    def available(self) -> bool: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def promotions(self) -> int: ...
    @property
    def demotions(self) -> int: ...
    @property
    def admissions_refused(self) -> int: ...
    @property
    def checksum_failures(self) -> int: ...
    @property
    def io_errors(self) -> int: ...
    @property
    def read_seconds(self) -> float: ...
    @property
    def write_seconds(self) -> float: ...


# (metric name, help, attribute of TierStatsLike)
_TIER_GAUGES = (
    ("kvstore_tier_enabled", "1 if the tier is enabled, else 0.", "enabled"),
    ("kvstore_tier_available", "1 if enabled and reachable (L4: Redis up), else 0.",
     "available"),
    ("kvstore_tier_capacity_bytes", "Bytes the tier can hold.", "capacity_bytes"),
    ("kvstore_tier_used_bytes", "Bytes the tier holds now.", "used_bytes"),
    ("kvstore_tier_objects", "Blocks the tier holds now.", "objects"),
    ("kvstore_tier_queue_depth", "Transfers in flight to or from the tier now.", "queue_depth"),
)
_TIER_COUNTERS = (
    ("kvstore_tier_hits_total", "Reads served by the tier.", "hits"),
    ("kvstore_tier_misses_total", "Reads the tier could not serve.", "misses"),
    ("kvstore_tier_bytes_in_total", "Bytes written into the tier.", "bytes_in"),
    ("kvstore_tier_bytes_out_total", "Bytes read out of the tier.", "bytes_out"),
    ("kvstore_tier_evictions_total", "Blocks evicted from the tier (gone from it, not moved).",
     "evictions"),
    ("kvstore_tier_promotions_total", "Blocks copied up into the tier from a slower one.",
     "promotions"),
    ("kvstore_tier_demotions_total", "Blocks moved down out of the tier under pressure.",
     "demotions"),
    ("kvstore_tier_admissions_refused_total",
     "Blocks not admitted (admission policy, no room, write error).", "admissions_refused"),
    ("kvstore_tier_checksum_failures_total", "Blocks read back damaged; dropped, a miss.",
     "checksum_failures"),
    ("kvstore_tier_io_errors_total", "Reads or writes of the tier that failed.", "io_errors"),
    ("kvstore_tier_read_seconds_total",
     "Wall time the tier was busy reading; rate(bytes_out) / rate(this) = read bandwidth.",
     "read_seconds"),
    ("kvstore_tier_write_seconds_total", "Wall time the tier was busy writing.",
     "write_seconds"),
)


class TierCollector(Collector):
    """Asks stats_fn on each scrape; a failing stats_fn costs the tier metrics, not the scrape."""

    def __init__(self, stats_fn: Callable[[], Sequence[TierStatsLike]]) -> None:
        self._stats_fn = stats_fn
        self._failures = 0  # scrapes whose stats_fn raised; exported so alerts can see it
        self._failures_lock = threading.Lock()  # the exporter serves scrapes on many threads

    def _failures_family(self) -> Metric:
        family = CounterMetricFamily(
            "kvstore_metrics_stats_errors_total",
            "Scrapes whose tier stats could not be read (see the daemon log).",
        )
        family.add_metric([], float(self._failures))
        return family

    def describe(self) -> Iterator[Metric]:
        # Names only, so the registry can refuse duplicates without calling stats_fn.
        for name, doc, _ in _TIER_GAUGES:
            yield GaugeMetricFamily(name, doc, labels=["tier"])
        for name, doc, _ in _TIER_COUNTERS:
            yield CounterMetricFamily(name, doc, labels=["tier"])
        yield self._failures_family()

    def collect(self) -> Iterator[Metric]:
        try:
            families = self._families(list(self._stats_fn()))
        except Exception:
            logger.exception("tier stats failed; this scrape has no kvstore_tier_* metrics")
            with self._failures_lock:
                self._failures += 1
            yield self._failures_family()
            return
        yield from families
        yield self._failures_family()

    @staticmethod
    def _families(stats: Sequence[TierStatsLike]) -> list[Metric]:
        families: list[Metric] = []
        kinds = ((GaugeMetricFamily, _TIER_GAUGES), (CounterMetricFamily, _TIER_COUNTERS))
        for kind, table in kinds:
            for name, doc, attr in table:
                family = kind(name, doc, labels=["tier"])
                for tier in stats:
                    family.add_metric([tier.tier], float(getattr(tier, attr)))
                families.append(family)
        return families


class CountCollector(Collector):
    """One counter without labels, read from count_fn on each scrape."""

    def __init__(self, name: str, doc: str, count_fn: Callable[[], int]) -> None:
        self._name, self._doc, self._count_fn = name, doc, count_fn

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self._name, self._doc)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._doc)
        family.add_metric([], float(self._count_fn()))
        yield family


#: (metric name, help, attribute of kvstore.core.holdings.Holding)
_CLIENT_GAUGES = (
    ("kvstore_client_leases", "Read leases the client holds (cap: clients.max_leases).",
     "leases"),
    ("kvstore_client_reservations", "Reservations and Puts in flight of the client "
     "(cap: clients.max_reservations).", "reservations"),
    ("kvstore_client_reserved_bytes", "Their bytes (cap: clients.max_reserved_share of L2).",
     "reserved_bytes"),
    ("kvstore_client_pins", "Blocks the client pinned (each ends after clients.max_pin_s).",
     "pins"),
    ("kvstore_client_pinned_bytes", "Their bytes (cap: clients.max_pinned_share of L2).",
     "pinned_bytes"),
)


class HoldingsCollector(Collector):
    """What each client holds, by client ("" = the daemon's own work), read on each scrape;
    a client that holds nothing has no series."""

    def __init__(self, holdings_fn: Callable[[], Mapping[str, Holding]]) -> None:
        self._holdings_fn = holdings_fn

    def describe(self) -> Iterator[Metric]:
        for name, doc, attr in _CLIENT_GAUGES:
            yield GaugeMetricFamily(name, doc, labels=["client"])
            yield GaugeMetricFamily(_total_name(name), _total_doc(attr))

    def collect(self) -> Iterator[Metric]:
        held = self._holdings_fn()
        for name, doc, attr in _CLIENT_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["client"])
            for client, holding in held.items():
                family.add_metric([client], float(getattr(holding, attr)))
            yield family
            yield GaugeMetricFamily(_total_name(name), _total_doc(attr), value=float(
                sum(getattr(h, attr) for h in held.values())))


def _total_name(client_name: str) -> str:
    return client_name.replace("kvstore_client_", "kvstore_")  # kvstore_leases, ...


def _total_doc(attr: str) -> str:
    return f"The daemon's {attr.replace('_', ' ')}: every client's together."


#: (metric name, help, attribute of kvstore.core.prefixhits.PrefixCounts)
_PREFIX_COUNTERS = (
    ("kvstore_lookup_blocks_total", "Keys (blocks) Lookups asked for, by tenant.", "blocks"),
    ("kvstore_prefix_hit_blocks_total", "Keys inside the cached prefix Lookups found, by "
     "tenant; / kvstore_lookup_blocks_total = the prefix hit rate in blocks.", "hit_blocks"),
    ("kvstore_lookup_tokens_total", "Tokens Lookups asked for, by tenant (Lookups that say "
     "their block_tokens).", "tokens"),
    ("kvstore_prefix_hit_tokens_total", "Tokens inside the cached prefix, by tenant; / "
     "kvstore_lookup_tokens_total = the share of prompt tokens not recomputed.", "hit_tokens"),
)
_TENANT_GAUGES = (
    ("kvstore_tenant_objects", "Blocks a tenant's arena of a tier holds (tenant \"\" with "
     "auth off: the whole tier)."),
    ("kvstore_tenant_used_bytes", "Bytes a tenant's arena of a tier holds."),
    ("kvstore_tenant_capacity_bytes", "Bytes a tenant's arena of a tier can hold (its quota "
     "or share)."),
)
L4_QUEUE_DROPPED = "kvstore_l4_queue_dropped_blocks_total"


class StoreCollector(Collector):
    """What the store counts by tenant (Lookups' prefix hits, arena use) and L4's dropped
    write-throughs, read on each scrape."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def describe(self) -> Iterator[Metric]:
        for name, doc, _ in _PREFIX_COUNTERS:
            yield CounterMetricFamily(name, doc, labels=["tenant"])
        for name, doc in _TENANT_GAUGES:
            yield GaugeMetricFamily(name, doc, labels=["tenant", "tier"])
        yield CounterMetricFamily(L4_QUEUE_DROPPED, self._dropped_doc)

    _dropped_doc = ("Committed blocks not written through to L4 because its queue "
                    "(remote.queue_bytes) was full: Redis is slower than the puts.")

    def collect(self) -> Iterator[Metric]:
        store = self._store
        hits = store.prefix_hits()
        for name, doc, attr in _PREFIX_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["tenant"])
            for tenant, counts in hits.items():
                family.add_metric([tenant], float(getattr(counts, attr)))
            yield family
        arenas = store.arena_usage()
        for i, (name, doc) in enumerate(_TENANT_GAUGES):
            gauge = GaugeMetricFamily(name, doc, labels=["tenant", "tier"])
            for arena, tier, *figures in arenas:
                gauge.add_metric([arena, tier.label], float(figures[i]))
            yield gauge
        remote = store.state.remote
        if remote is not None:
            yield CounterMetricFamily(L4_QUEUE_DROPPED, self._dropped_doc,
                                      value=float(remote.queue_dropped))


class L3AdmissionCollector(Collector):
    """Whether L3 takes new blocks and why not, and the room on its filesystem, read from
    state_fn on each scrape; nothing while state_fn says None (no L3)."""

    _DOCS = {
        L3_ADMISSION_ENABLED: "1 while new blocks may go into L3; 0 while its filesystem is "
        "short of room (kvstore_l3_admission_off says why).",
        L3_ADMISSION_OFF: "1 for the reason L3 admission is off: low_space (free space under "
        "the reserve) or no_room (an L3 write found no space); else 0.",
        L3_FREE: "Bytes free on the L3 filesystem at the mover's last check (about every "
        "second).",
        L3_RESERVE: "Bytes the daemon leaves free on the L3 filesystem; L3 admission goes "
        "off below it.",
    }

    def __init__(self, state_fn: Callable[[], AdmissionState | None]) -> None:
        self._state_fn = state_fn

    def describe(self) -> Iterator[Metric]:
        for name, doc in self._DOCS.items():
            yield GaugeMetricFamily(name, doc, labels=["reason"] if name == L3_ADMISSION_OFF
                                    else None)

    def collect(self) -> Iterator[Metric]:
        state = self._state_fn()
        if state is None:
            return
        docs = self._DOCS
        yield GaugeMetricFamily(L3_ADMISSION_ENABLED, docs[L3_ADMISSION_ENABLED],
                                value=float(state.enabled))
        off = GaugeMetricFamily(L3_ADMISSION_OFF, docs[L3_ADMISSION_OFF], labels=["reason"])
        for reason in REASONS:
            off.add_metric([reason], float(state.reason == reason))
        yield off
        yield GaugeMetricFamily(L3_FREE, docs[L3_FREE], value=float(max(state.free_bytes, 0)))
        yield GaugeMetricFamily(L3_RESERVE, docs[L3_RESERVE], value=float(state.reserve_bytes))
