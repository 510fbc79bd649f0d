"""What the client's verbs return: frozen dataclasses mirroring the proto responses, with tiers
as names ("hbm", "dram", "nvme", "remote"; None for a miss) instead of enum numbers. A tier's
figures are `kvstore.tier.TierStats`, the record the daemon itself counts into."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from kvstore.keys import BlockKey
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.tier import Tier, TierStats, tier_name

from .errors import DataLoss

__all__ = [
    "ClientHoldings",
    "DrainResult",
    "EvictResult",
    "HotResult",
    "LookupResult",
    "PinResult",
    "PrefetchResult",
    "PrewarmResult",
    "PutResult",
    "ReleaseResult",
    "Stats",
    "TIER_NAMES",
    "TierStats",
    "tier_name",
]

TIER_NAMES: dict[int, str] = {int(t): t.label for t in Tier}


@dataclass(frozen=True)
class PutResult:
    stored: int
    """Blocks newly stored."""
    existing: int
    """Blocks already present (unchanged: values are immutable)."""
    evicted: int
    """Entries the daemon evicted to make room. Posted puts write into a grant, whose room
    was made when it was taken: those evictions are counted by the first commit from it
    (in `flush()`'s totals)."""
    posted: bool = False
    """True for `put(..., wait=False)` when its commit was posted: the counts are then
    provisional (every key counted as stored), and `flush()` gives the daemon's answers or
    raises the first refusal."""


@dataclass(frozen=True)
class LookupResult:
    prefix_length: int
    """keys[0:prefix_length] are all cached."""
    tiers: list[str | None]
    """The tier of each key, None for a miss."""


@dataclass(frozen=True)
class PrefetchResult:
    done: int
    """Keys now in the target tier or above."""
    missing: int
    """Keys in no tier."""
    failed: int
    """Keys that could not be moved (no room, read error)."""
    total: int
    prefix_length: int = 0
    """keys[0:prefix_length] are all in the target tier (or above)."""
    deadline_exceeded: bool = False
    """The deadline passed before every key was moved; the last message then says so."""


@dataclass(frozen=True)
class EvictResult:
    evicted: int
    evicted_bytes: int
    skipped: int
    """Blocks that could not go: the sum of `reasons`."""
    reasons: dict[str, int] = field(default_factory=dict)
    """Why, by kind, only the non-zero ones: "pinned", "leased", "loading" (a load or a
    move in flight), "child_in_faster_tier" (the prefix of a block cached in a faster tier),
    "has_children" (the last copy of a block whose cached children would be stranded)."""


@dataclass(frozen=True)
class PinResult:
    changed: int
    missing: int


@dataclass(frozen=True)
class ReleaseResult:
    released: int


@dataclass(frozen=True)
class HotResult:
    keys: list[BlockKey]
    """The most used blocks of the namespace across every daemon sharing L4, hottest first."""
    scores: list[float]
    """Decayed read counts, one per key."""


@dataclass(frozen=True)
class PrewarmResult:
    blocks: int
    """Blocks brought into the local tiers so far."""
    bytes: int
    """Their size in bytes."""
    target_bytes: int
    """Prewarm stops once this many bytes are local."""
    done: bool
    """The last message: the daemon has finished."""


@dataclass(frozen=True)
class ClientHoldings:
    """What one client holds in the daemon, against the caps of its `clients` settings."""

    client: str
    """The caller's tenant (auth on) or peer host ("ipv4:10.0.0.7", auth off); "" is the
    daemon's own work."""
    leases: int
    reservations: int
    """Reserves not committed, and Puts in flight."""
    reserved_bytes: int
    pins: int
    pinned_bytes: int


@dataclass(frozen=True)
class DrainResult:
    already_draining: bool
    """A drain had begun before this call."""
    streams_in_flight: int
    """Streaming calls the drain lets finish."""
    grace_s: float
    """The daemon exits at most this long after the drain began."""


@dataclass(frozen=True)
class Stats:
    tiers: list[TierStats]
    shm_name: str
    """The L2 segment, for co-located clients ("" when there is none)."""
    shm_size_bytes: int
    host_id: str
    leases: int
    reservations: int
    pinned: int
    version: str
    config_json: str
    """The daemon's effective config, only when asked for (include_config=True)."""
    hits: int
    misses: int
    prewarm: PrewarmResult | None = None
    """The running or last pre-warm from L4; None when there was none."""
    clients: list[ClientHoldings] = field(default_factory=list)
    """What each client holds now (leases, reservations, pins)."""
    draining: bool = False
    """The daemon is stopping (SIGTERM or Drain) and refuses new data calls."""
    auth_mode: str = ""
    """The daemon's auth.mode: "off", "token" or "mtls"."""
    tenant: str = ""
    """The caller's tenant ("" with auth off); a client role sees only its own tenant's
    figures in tiers, hits, misses and clients."""
    unix_socket: str = ""
    """The daemon's Unix socket for Attach, as its host sees it ("" when it has none)."""

    def tier(self, name: str) -> TierStats | None:
        """The stats of one tier by name, or None if the daemon does not report it."""
        return next((t for t in self.tiers if t.tier == name), None)

    def config(self) -> dict[str, Any] | None:
        """config_json parsed, or None when it was not requested."""
        if not self.config_json:
            return None
        parsed: dict[str, Any] = json.loads(self.config_json)
        return parsed

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def put_result(resp: pb.PutResponse) -> PutResult:
    return PutResult(stored=resp.stored, existing=resp.existing, evicted=resp.evicted)


@dataclass(frozen=True)
class Limits:
    """What the daemon takes and offers (the Limits verb; LimitsResponse field for field)."""

    contract: str
    max_message_bytes: int
    chunk_bytes: int
    max_batch_keys: int
    max_object_bytes: int
    max_response_bytes: int
    key_bytes: int
    max_namespace_bytes: int
    default_lease_ms: int
    max_lease_ms: int
    reservation_timeout_ms: int
    max_pin_ms: int
    stream_idle_ms: int
    max_block_tokens: int
    shared_memory: bool
    unix_socket: str
    auth_mode: str


def limits_result(resp: pb.LimitsResponse) -> Limits:
    return Limits(**{f.name: getattr(resp, f.name) for f in fields(Limits)})


def lookup_result(resp: pb.LookupResponse) -> LookupResult:
    return LookupResult(
        prefix_length=resp.prefix_length, tiers=list(map(TIER_NAMES.get, resp.tiers))
    )


def prefetch_result(resp: pb.PrefetchProgress) -> PrefetchResult:
    return PrefetchResult(
        done=resp.done,
        missing=resp.missing,
        failed=resp.failed,
        total=resp.total,
        prefix_length=resp.prefix_length,
        deadline_exceeded=resp.deadline_exceeded,
    )


_SKIP_REASONS = ("pinned", "leased", "loading", "child_in_faster_tier", "has_children")


def evict_result(resp: pb.EvictResponse) -> EvictResult:
    reasons = {name: getattr(resp, f"skipped_{name}") for name in _SKIP_REASONS}
    return EvictResult(evicted=resp.evicted, evicted_bytes=resp.evicted_bytes,
                       skipped=resp.skipped, reasons={k: v for k, v in reasons.items() if v})


def pin_result(resp: pb.PinResponse) -> PinResult:
    return PinResult(changed=resp.changed, missing=resp.missing)


def release_result(resp: pb.ReleaseResponse) -> ReleaseResult:
    return ReleaseResult(released=resp.released)


def stats_result(resp: pb.StatsResponse) -> Stats:
    names = [f.name for f in fields(TierStats) if f.name != "tier"]
    tiers = [
        TierStats(tier_name(t.tier) or "unspecified", **{n: getattr(t, n) for n in names})
        for t in resp.tiers
    ]
    return Stats(
        tiers=tiers,
        shm_name=resp.shm_name,
        shm_size_bytes=resp.shm_size_bytes,
        host_id=resp.host_id,
        leases=resp.leases,
        reservations=resp.reservations,
        pinned=resp.pinned,
        version=resp.version,
        config_json=resp.config_json,
        hits=resp.hits,
        misses=resp.misses,
        prewarm=prewarm_result(resp.prewarm) if resp.HasField("prewarm") else None,
        clients=[ClientHoldings(c.client, c.leases, c.reservations, c.reserved_bytes, c.pins,
                                c.pinned_bytes) for c in resp.clients],
        draining=resp.draining,
        auth_mode=resp.auth_mode,
        tenant=resp.tenant,
        unix_socket=resp.unix_socket,
    )


def drain_result(resp: pb.DrainResponse) -> DrainResult:
    return DrainResult(already_draining=resp.already_draining,
                       streams_in_flight=resp.streams_in_flight, grace_s=resp.grace_s)


def hot_result(resp: pb.HotResponse) -> HotResult:
    if len(resp.keys) != len(resp.scores):
        raise DataLoss(f"Hot answered {len(resp.keys)} keys with {len(resp.scores)} scores")
    return HotResult(keys=[BlockKey(k) for k in resp.keys], scores=list(resp.scores))


def prewarm_result(resp: pb.PrewarmProgress) -> PrewarmResult:
    return PrewarmResult(
        blocks=resp.blocks, bytes=resp.bytes, target_bytes=resp.target_bytes, done=resp.done
    )
