"""Keys the index removed lately, remembered approximately in little memory.

Pure. The index's eviction policy treats a block as hot when it was used again; a block
whose second use comes after it was evicted is put again as a new entry, so the index asks
this filter whether the key left recently (a "ghost" entry, as in 2Q and ARC; a Bloom
filter of them, as in TinyLFU's doorkeeper). In the Mooncake trace most reuse comes after
an LRU cache of 10% of the blocks has forgotten the block, so without this memory the
policy cannot tell a reused block from a one-time one (bench/trace_sim.py).

Two generations of Bloom filter: keys go into the current one; when it has taken `span`
keys it becomes the previous one and a new current one starts, its span set from the
index's size then. A key is recent while it is in either: for the last `span` to `2 * span`
removals.
16 bits per key and 4 probes: about 0.25% false positives per generation, 0.5% for both,
so a one-time block is rarely taken for a reused one; a false positive only lets it outlive
its LRU place. About 8 bytes per entry the index holds.
"""

from __future__ import annotations

import xxhash

from kvstore.keys import BlockKey

BITS_PER_KEY = 16
PROBES = 4
_MASK64 = (1 << 64) - 1


class _Bloom:
    def __init__(self, capacity: int) -> None:
        self.bits = max(64, capacity * BITS_PER_KEY)
        self.array = bytearray((self.bits + 7) // 8)
        self.added = 0

    def add(self, digest: int) -> None:
        # Kirsch and Mitzenmacher: probes h1 + i * h2 of one 128-bit hash.
        h1, h2, bits, array = digest & _MASK64, (digest >> 64) | 1, self.bits, self.array
        for i in range(PROBES):
            p = (h1 + i * h2) % bits
            array[p >> 3] |= 1 << (p & 7)
        self.added += 1

    def __contains__(self, digest: int) -> bool:
        h1, h2, bits, array = digest & _MASK64, (digest >> 64) | 1, self.bits, self.array
        for i in range(PROBES):
            p = (h1 + i * h2) % bits
            if not array[p >> 3] >> (p & 7) & 1:
                return False
        return True


class GhostFilter:
    """Approximately the last `span` to `2 * span` keys added (no false negatives), where
    span is `factor` times the live entries when a generation starts (at least min_span):
    a ghost of about two to four times what the index holds."""

    def __init__(self, factor: int = 2, min_span: int = 4096) -> None:
        if factor <= 0 or min_span <= 0:
            raise ValueError(f"factor and min_span must be positive, got {factor}, {min_span}")
        self._factor = factor
        self._min_span = min_span
        self.span = min_span
        self._current = _Bloom(min_span)
        self._previous = _Bloom(1)
        self._seeds: dict[str, int] = {}  # namespace -> the seed its keys are hashed with

    def _digest(self, namespace: str, key: BlockKey) -> int:
        seed = self._seeds.get(namespace)
        if seed is None:
            seed = self._seeds[namespace] = xxhash.xxh64_intdigest(namespace.encode())
        return xxhash.xxh3_128_intdigest(key, seed=seed)

    def add(self, namespace: str, key: BlockKey, live_entries: int) -> None:
        if self._current.added >= self.span:
            self.span = max(self._min_span, self._factor * live_entries)
            self._previous, self._current = self._current, _Bloom(self.span)
            self._seeds.clear()  # namespaces come and go; the cache stays small
        self._current.add(self._digest(namespace, key))

    def __contains__(self, item: tuple[str, BlockKey]) -> bool:
        digest = self._digest(*item)
        return digest in self._current or digest in self._previous
