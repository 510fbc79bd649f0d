"""The four tiers as the wire contract numbers them (`kvstore.v1.Tier`), their names, and one
tier's figures (`TierStats`): the record the daemon counts into and the client returns.

Shared by the daemon, the client and the tools, so the names and the figures are written once.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Tier(IntEnum):
    """Tiers, numbered as in the wire contract; 0 (TIER_UNSPECIFIED) means none, a miss."""

    HBM = 1
    DRAM = 2
    NVME = 3
    REMOTE = 4

    @property
    def label(self) -> str:
        """The name operators see: "hbm", "dram", "nvme", "remote"."""
        return self.name.lower()


TIER_LABELS: tuple[str, ...] = tuple(t.label for t in Tier)


def tier_name(tier: int) -> str | None:
    """ "hbm"/"dram"/"nvme"/"remote" for a wire tier number, None for 0 (a miss)."""
    return Tier(tier).label if tier in Tier._value2member_map_ else None


@dataclass(frozen=True, slots=True)
class Medium:
    """Where a tier's blocks are, in the words of the KV-event formats routers read
    (docs/routing.md): vLLM's `medium` and `locality`, Mooncake's `medium`."""

    vllm: str
    locality: str
    mooncake: str


MEDIUM_OF_TIER: dict[Tier, Medium] = {
    Tier.HBM: Medium("CPU", "LOCAL", "cpu"),  # the store's L1: still a load, not the engine's GPU
    Tier.DRAM: Medium("CPU", "LOCAL", "cpu"),
    Tier.NVME: Medium("STORAGE", "LOCAL", "disk"),
    Tier.REMOTE: Medium("STORAGE", "REMOTE", "disk"),  # the pool every node reads
}
"""Each tier's medium, as the vLLM connector's events and kvstore-events announce it."""


@dataclass(slots=True)
class TierStats:
    """One tier's figures, field for field the wire contract's TierStats (tier by name)."""

    tier: str
    """"hbm", "dram", "nvme" or "remote"."""
    enabled: bool
    capacity_bytes: int = 0
    used_bytes: int = 0
    objects: int = 0
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    """Bytes written into the tier."""
    bytes_out: int = 0
    """Bytes read out of the tier."""
    evictions: int = 0
    page_size_bytes: int = 0
    free_pages: int = 0
    largest_free_run_pages: int = 0
    backend: str = ""
    """How the tier moves bytes: "shm", "cuda", "gds", "kvikio-compat", "posix"; "" when off."""
    promotions: int = 0
    """Blocks copied up into this tier from a slower one."""
    demotions: int = 0
    """Blocks moved down out of this tier under pressure."""
    admissions_refused: int = 0
    """Blocks not admitted (admission policy, or no room)."""
    checksum_failures: int = 0
    """Blocks read back damaged (dropped; a miss)."""
    io_errors: int = 0
    """Reads or writes that failed (a miss, or not admitted)."""
    queue_depth: int = 0
    """Transfers in flight now."""
    read_seconds: float = 0.0
    """Time spent reading bytes_out."""
    write_seconds: float = 0.0
    """Time spent writing bytes_in."""
    state: str = ""
    """L4's circuit breaker: "closed" (up), "open" (down, retrying with backoff) or
    "half-open" (probing); "" for local tiers."""

    @property
    def available(self) -> bool:
        """Enabled and reachable (L4's breaker closed)."""
        return self.enabled and self.state in ("", "closed")

    @property
    def read_bandwidth_bytes_s(self) -> float:
        """bytes_out / read_seconds; 0.0 before any read time is recorded."""
        return self.bytes_out / self.read_seconds if self.read_seconds > 0 else 0.0

    @property
    def write_bandwidth_bytes_s(self) -> float:
        """bytes_in / write_seconds; 0.0 before any write time is recorded."""
        return self.bytes_in / self.write_seconds if self.write_seconds > 0 else 0.0

    @property
    def used_fraction(self) -> float:
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes else 0.0

    @property
    def hit_rate(self) -> float | None:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else None
