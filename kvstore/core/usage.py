"""What each namespace, and each arena, keeps in each tier: objects and bytes, for Stats and
quotas.

Pure; the index counts every copy that appears in or leaves a tier. One book entry per
(namespace, arena, tier), so counting a copy costs one dict update; Stats sum them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.core.records import Entry
from kvstore.tier import Tier


@dataclass(slots=True)
class _Usage:
    objects: int = 0
    size_bytes: int = 0


class UsageBook:
    """Objects and bytes of the copies in each tier, by namespace and arena."""

    def __init__(self) -> None:
        # (namespace, arena, tier): a namespace's blocks keep the arena they were stored in,
        # so one namespace has two arenas only after its tenant changed
        self._usage: dict[tuple[str, str, Tier], _Usage] = {}

    def count(self, entry: Entry, tier: Tier, sign: int) -> None:
        """entry's copy in tier appeared (sign +1) or left (-1)."""
        at = (entry.namespace, entry.arena, tier)
        usage = self._usage.get(at)
        if usage is None:
            usage = self._usage[at] = _Usage()
        usage.objects += sign
        usage.size_bytes += sign * entry.size_bytes
        if not usage.objects:
            del self._usage[at]

    def get(self, tier: Tier, namespace: str | None = None) -> tuple[int, int]:
        """(objects, bytes) committed in tier, for one namespace or all."""
        return self._sum(tier, namespace, None)

    def arena(self, tier: Tier, arena: str) -> tuple[int, int]:
        """(objects, bytes) committed in tier's arena."""
        return self._sum(tier, None, arena)

    def _sum(self, tier: Tier, namespace: str | None, arena: str | None) -> tuple[int, int]:
        objects = size = 0
        for (ns, a, t), u in self._usage.items():
            if t == tier and namespace in (None, ns) and arena in (None, a):
                objects += u.objects
                size += u.size_bytes
        return objects, size
