"""The one-cache policies bench/trace_sim.py compares the store with (its docstring says what
each is and why): `LruPolicy`, `FrequencyOraclePolicy` and `BeladyPolicy`, each
`access(request_index, hash_ids) -> the tier label of each hit block`, and `POLICIES`, every
policy by name with the store's own (bench/sim_store.py). Pure.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from sim_store import StorePolicy

from kvstore.tier import Tier

if TYPE_CHECKING:
    from trace_sim import Request

ONE_CACHE = Tier.DRAM.label  # the tier the one-cache policies stand for


class Policy(Protocol):
    def access(self, request_index: int, hash_ids: Sequence[int]) -> list[str]: ...

    def cached_blocks(self) -> set[int]: ...


def _prefix_hits(hash_ids: Sequence[int], cached: Callable[[int], bool]) -> int:
    for i, h in enumerate(hash_ids):
        if not cached(h):
            return i
    return len(hash_ids)


class LruPolicy:
    """Plain LRU over blocks, blind to prefixes."""

    def __init__(self, capacity_blocks: int, requests: Sequence[Request] = ()) -> None:
        self._capacity = capacity_blocks
        self._order: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def access(self, request_index: int, hash_ids: Sequence[int]) -> list[str]:
        hits = _prefix_hits(hash_ids, self._order.__contains__)
        for h in hash_ids[: self._capacity]:
            if h in self._order:
                self._order.move_to_end(h)
            else:
                self._order[h] = None
        while len(self._order) > self._capacity:
            self._order.popitem(last=False)
        return [ONE_CACHE] * hits

    def cached_blocks(self) -> set[int]:
        return set(self._order)


def next_uses(requests: Sequence[Request]) -> list[list[int]]:
    """next_uses[r][i]: the index of the next request after r holding block
    requests[r].hash_ids[i], or len(requests) when there is none."""
    never = len(requests)
    seen: dict[int, int] = {}
    result: list[list[int]] = [[] for _ in requests]
    for r in range(len(requests) - 1, -1, -1):
        ids = requests[r].hash_ids
        result[r] = [seen.get(h, never) for h in ids]
        for h in ids:
            seen[h] = r
    return result


def remaining_uses(requests: Sequence[Request]) -> list[list[int]]:
    """remaining_uses[r][i]: how many requests after r hold block requests[r].hash_ids[i]."""
    later: dict[int, int] = {}
    result: list[list[int]] = [[] for _ in requests]
    for r in range(len(requests) - 1, -1, -1):
        ids = requests[r].hash_ids
        result[r] = [later.get(h, 0) for h in ids]
        for h in set(ids):
            later[h] = later.get(h, 0) + 1
    return result


class FrequencyOraclePolicy:
    """Evicts the block fewest later requests hold (module docstring); lazy-deletion heap."""

    def __init__(self, capacity_blocks: int, requests: Sequence[Request]) -> None:
        self._capacity = capacity_blocks
        self._remaining = remaining_uses(requests)
        self._cached: dict[int, int] = {}  # block -> touch sequence of its current heap item
        self._heap: list[tuple[int, int, int, int]] = []  # (uses left, -depth, seq, block)
        self._seq = 0

    def access(self, request_index: int, hash_ids: Sequence[int]) -> list[str]:
        hits = _prefix_hits(hash_ids, self._cached.__contains__)
        uses = self._remaining[request_index]
        for depth, h in enumerate(hash_ids):
            self._seq += 1
            self._cached[h] = self._seq
            heapq.heappush(self._heap, (uses[depth], -depth, self._seq, h))
        while len(self._cached) > self._capacity:
            _, _, seq, h = heapq.heappop(self._heap)
            if self._cached.get(h) == seq:
                del self._cached[h]
        if len(self._heap) > 4 * self._capacity + 64:
            live = {(seq, h) for h, seq in self._cached.items()}
            self._heap = [item for item in self._heap if (item[2], item[3]) in live]
            heapq.heapify(self._heap)
        return [ONE_CACHE] * hits

    def cached_blocks(self) -> set[int]:
        return set(self._cached)


class BeladyPolicy:
    """Belady's offline optimum, prefix-aware (module docstring); a heap, lazy deletion."""

    def __init__(self, capacity_blocks: int, requests: Sequence[Request]) -> None:
        self._capacity = capacity_blocks
        self._next = next_uses(requests)
        self._cached: dict[int, tuple[int, int]] = {}  # block -> (next use, depth)
        # (-next use, -depth, block): the top is the block to evict; stale items skipped.
        self._heap: list[tuple[int, int, int]] = []

    def access(self, request_index: int, hash_ids: Sequence[int]) -> list[str]:
        hits = _prefix_hits(hash_ids, self._cached.__contains__)
        for depth, (h, use) in enumerate(zip(hash_ids, self._next[request_index], strict=True)):
            self._cached[h] = (use, depth)
            heapq.heappush(self._heap, (-use, -depth, h))
        while len(self._cached) > self._capacity:
            neg_use, neg_depth, h = heapq.heappop(self._heap)
            if self._cached.get(h) == (-neg_use, -neg_depth):
                del self._cached[h]
        if len(self._heap) > 4 * self._capacity + 64:
            self._compact()
        return [ONE_CACHE] * hits

    def _compact(self) -> None:
        self._heap = [(-use, -depth, h) for h, (use, depth) in self._cached.items()]
        heapq.heapify(self._heap)

    def cached_blocks(self) -> set[int]:
        return set(self._cached)


PolicyFactory = Callable[[int, Sequence["Request"]], Policy]
POLICIES: dict[str, PolicyFactory] = {
    "lru": LruPolicy, "store": StorePolicy, "freq_oracle": FrequencyOraclePolicy,
    "belady": BeladyPolicy,
}
