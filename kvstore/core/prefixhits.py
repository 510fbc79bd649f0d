"""What Lookups asked and found, by tenant: keys (blocks) and tokens inside and past the cached
prefix, for Stats ("lookup hits / misses") and the kvstore_lookup_* / kvstore_prefix_hit_*
counters. The prefix hit rate is the figure an operator reads first: the share of a prompt's
tokens the engine did not have to recompute.

Pure; the store counts under its lock. Tokens are counted only for the Lookups that say how
many tokens a key covers (LookupRequest.block_tokens); keys are counted for all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

#: The largest block_tokens a Lookup may say (engines use 16 to 256 tokens per block).
MAX_BLOCK_TOKENS = 1 << 16


@dataclass(slots=True)
class PrefixCounts:
    blocks: int = 0
    """Keys looked up."""
    hit_blocks: int = 0
    """Keys inside the cached prefix."""
    tokens: int = 0
    """Tokens looked up (keys × block_tokens, where the Lookup said it)."""
    hit_tokens: int = 0
    """Tokens inside the cached prefix."""

    @property
    def miss_blocks(self) -> int:
        return self.blocks - self.hit_blocks


class PrefixHits:
    def __init__(self) -> None:
        self._by_tenant: dict[str, PrefixCounts] = {}  # "" = auth off's one tenant

    def count(self, tenant: str, keys: int, prefix: int, block_tokens: int = 0) -> None:
        """One Lookup of `keys` keys whose first `prefix` are cached."""
        counts = self._by_tenant.get(tenant)
        if counts is None:
            counts = self._by_tenant[tenant] = PrefixCounts()
        counts.blocks += keys
        counts.hit_blocks += prefix
        counts.tokens += keys * block_tokens
        counts.hit_tokens += prefix * block_tokens

    def of(self, tenant: str) -> PrefixCounts:
        """One tenant's counts (a copy; zeros for a tenant that never looked up)."""
        counts = self._by_tenant.get(tenant)
        return replace(counts) if counts is not None else PrefixCounts()

    def by_tenant(self) -> dict[str, PrefixCounts]:
        """Every tenant's counts (copies)."""
        return {tenant: replace(c) for tenant, c in self._by_tenant.items()}

    def total(self) -> PrefixCounts:
        out = PrefixCounts()
        for c in self._by_tenant.values():
            out.blocks += c.blocks
            out.hit_blocks += c.hit_blocks
            out.tokens += c.tokens
            out.hit_tokens += c.hit_tokens
        return out
