"""What each namespace keeps in each tier: objects and bytes, for Stats and quotas.

Pure; the index counts every copy that appears in or leaves a tier.
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
    def __init__(self) -> None:
        self._usage: dict[tuple[str, Tier], _Usage] = {}

    def count(self, entry: Entry, tier: Tier, sign: int) -> None:
        """entry's copy in tier appeared (sign +1) or left (-1)."""
        usage = self._usage.setdefault((entry.namespace, tier), _Usage())
        usage.objects += sign
        usage.size_bytes += sign * entry.size_bytes
        if not usage.objects:
            del self._usage[(entry.namespace, tier)]

    def get(self, tier: Tier, namespace: str | None = None) -> tuple[int, int]:
        """(objects, bytes) committed in tier, for one namespace or all."""
        if namespace is not None:
            u = self._usage.get((namespace, tier))
            return (u.objects, u.size_bytes) if u else (0, 0)
        objects = size = 0
        for (_, t), u in self._usage.items():
            if t == tier:
                objects += u.objects
                size += u.size_bytes
        return objects, size
