"""Trace simulation: the store's eviction policy against plain LRU and Belady's optimum.

Replays a request trace in the Mooncake format (JSON lines with `timestamp`, `input_length`,
`output_length`, `hash_ids`; each hash id is one 512-token prefix block, the last one maybe
partial) over a cache of N blocks, for several N, and reports block and token hit rates.

Hit semantics are the store's `Lookup`: a request hits the longest prefix of its hash ids
that is cached, and only that prefix counts. Then the engine computes the rest and puts it,
so every block of the request ends up cached (only its first N blocks when it has more than
the cache holds: a suffix without its prefix could never hit).

Policies, each `access(request_index, hash_ids) -> hit_blocks`:

- `LruPolicy`: plain LRU over blocks; touches every block of the request in order and
  evicts the least recently used block, even a parent whose child stays.
- `StorePolicy`: drives the store's real pure index (`kvstore.index.Index`, one DRAM tier of
  N one-byte pages, the request index as its clock) as the store does: `lease` (touch) the
  hit prefix, then `prepare_store` / `complete_store` the rest, so eviction is the index's
  own leaf-first LRU. Blocks already cached after a gap are not touched by that put, as in
  the store.
- `BeladyPolicy`: offline. Evicts the cached block whose next use (the next request that
  holds it) is farthest, a block never used again first; the request's own new blocks are
  candidates too (bypass). "Prefix-aware" means: on equal next use the deeper block (larger
  position in its request) goes first. In a prefix-consistent trace a parent is in every
  request its child is in, so its next use is never later than the child's; with that tie
  rule Belady never evicts a parent while its child is cached, its cache stays
  prefix-closed, and its prefix hits equal its plain hits, which Belady's MIN maximises.

Pure but for `load_trace` (reads the file) and the CLI at the bottom (prints, writes --json).
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from figures import Figure, write_report

from kvstore.entries import Tier
from kvstore.index import Index
from kvstore.keys import BlockKey
from kvstore.pages import PageAllocator

BLOCK_TOKENS = 512
NAMESPACE = "sim"
DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1].parent / "shared" / "traces"
    / "mooncake_synthetic_trace.jsonl"
)


@dataclass(frozen=True)
class Request:
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, i: int) -> int:
        """Tokens of block i: 512, but the last may be partial."""
        return max(0, min(BLOCK_TOKENS, self.input_length - i * BLOCK_TOKENS))


def load_trace(path: Path | str) -> list[Request]:
    """The requests of a Mooncake-format trace, in file order (blank lines skipped)."""
    requests: list[Request] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            requests.append(Request(
                float(row["timestamp"]), int(row["input_length"]), int(row["output_length"]),
                tuple(int(h) for h in row["hash_ids"]),
            ))
    return requests


def distinct_blocks(requests: Sequence[Request]) -> int:
    return len({h for r in requests for h in r.hash_ids})


# --- policies --------------------------------------------------------------------------------


class Policy(Protocol):
    def access(self, request_index: int, hash_ids: Sequence[int]) -> int: ...

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

    def access(self, request_index: int, hash_ids: Sequence[int]) -> int:
        hits = _prefix_hits(hash_ids, self._order.__contains__)
        for h in hash_ids[: self._capacity]:
            if h in self._order:
                self._order.move_to_end(h)
            else:
                self._order[h] = None
        while len(self._order) > self._capacity:
            self._order.popitem(last=False)
        return hits

    def cached_blocks(self) -> set[int]:
        return set(self._order)


def _block_key(hash_id: int) -> BlockKey:
    return BlockKey(hash_id.to_bytes(32, "big"))


class StorePolicy:
    """The store's own placement and eviction: its real index, one DRAM tier."""

    def __init__(self, capacity_blocks: int, requests: Sequence[Request] = ()) -> None:
        self._capacity = capacity_blocks
        self._now = 0.0
        # One page per block: the policy sees blocks, not bytes.
        self.index = Index({Tier.DRAM: PageAllocator(capacity_blocks)}, {Tier.DRAM: 1},
                           lambda: self._now)
        self._plans = 0

    def access(self, request_index: int, hash_ids: Sequence[int]) -> int:
        self._now = float(request_index)
        keys = [_block_key(h) for h in hash_ids[: self._capacity]]
        hits, _ = self.index.lookup(NAMESPACE, [_block_key(h) for h in hash_ids])
        self.index.lease(None, NAMESPACE, keys[:hits], deadline=0.0)  # the engine's read
        if hits < len(keys):
            self._put(keys, hits)
        return hits

    def _put(self, keys: list[BlockKey], start: int) -> None:
        """The engine's put of the blocks it computed: keys[start:], chained to parents."""
        parents = [keys[i - 1] if i else None for i in range(start, len(keys))]
        self._plans += 1
        plan_id = f"p{self._plans}"
        plan = self.index.prepare_store(plan_id, NAMESPACE, keys[start:], [1] * len(parents),
                                        parents, Tier.DRAM, deadline=float("inf"))
        if plan is None:
            raise RuntimeError("the index refused a put that fits its capacity")
        self.index.complete_store(plan_id, [0] * len(plan.blocks), success=True)

    def cached_blocks(self) -> set[int]:
        return {int.from_bytes(e.key, "big") for e in self.index.entries(Tier.DRAM)}


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


class BeladyPolicy:
    """Belady's offline optimum, prefix-aware (module docstring); a heap, lazy deletion."""

    def __init__(self, capacity_blocks: int, requests: Sequence[Request]) -> None:
        self._capacity = capacity_blocks
        self._next = next_uses(requests)
        self._cached: dict[int, tuple[int, int]] = {}  # block -> (next use, depth)
        # (-next use, -depth, block): the top is the block to evict; stale items skipped.
        self._heap: list[tuple[int, int, int]] = []

    def access(self, request_index: int, hash_ids: Sequence[int]) -> int:
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
        return hits

    def _compact(self) -> None:
        self._heap = [(-use, -depth, h) for h, (use, depth) in self._cached.items()]
        heapq.heapify(self._heap)

    def cached_blocks(self) -> set[int]:
        return set(self._cached)


PolicyFactory = Callable[[int, Sequence[Request]], Policy]
POLICIES: dict[str, PolicyFactory] = {
    "lru": LruPolicy, "store": StorePolicy, "belady": BeladyPolicy,
}


# --- simulation ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    policy: str
    capacity_blocks: int
    tier: str
    block_hits: int
    blocks: int
    token_hits: int
    tokens: int

    @property
    def block_hit_rate(self) -> float:
        return self.block_hits / self.blocks if self.blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.token_hits / self.tokens if self.tokens else 0.0


def run_policy(name: str, policy: Policy, capacity_blocks: int,
               requests: Sequence[Request]) -> Result:
    block_hits = blocks = token_hits = tokens = 0
    for r, request in enumerate(requests):
        hits = policy.access(r, request.hash_ids)
        n = len(request.hash_ids)
        block_hits += hits
        blocks += n
        token_hits += sum(request.block_tokens(i) for i in range(hits))
        tokens += sum(request.block_tokens(i) for i in range(n))
    return Result(name, capacity_blocks, Tier.DRAM.label, block_hits, blocks, token_hits, tokens)


def simulate(requests: Sequence[Request], capacities: Sequence[int],
             policies: Mapping[str, PolicyFactory] = POLICIES) -> list[Result]:
    """One Result per (capacity in blocks, policy), capacities outer."""
    return [
        run_policy(name, factory(capacity, requests), capacity, requests)
        for capacity in capacities for name, factory in policies.items()
    ]


def resolve_capacities(spec: str, num_distinct: int) -> list[tuple[str, int]]:
    """(label, blocks) per comma-separated item: below 1 a fraction of the trace's distinct
    blocks ("10pct"), else an absolute number of blocks ("4096blocks")."""
    resolved: list[tuple[str, int]] = []
    for item in spec.split(","):
        value = float(item)
        if value <= 0:
            raise ValueError(f"capacity {item!r} must be positive")
        if value < 1:
            label = f"{value * 100:g}pct".replace(".", "_")
            resolved.append((label, max(1, round(value * num_distinct))))
        else:
            resolved.append((f"{int(value)}blocks", int(value)))
    return resolved


# --- CLI -------------------------------------------------------------------------------------


def _figures(label: str, by_policy: Mapping[str, Result]) -> list[Figure]:
    store = by_policy["store"].token_hit_rate
    extra = {"capacity_blocks": by_policy["store"].capacity_blocks}
    return [
        Figure(f"sim_tokens_{label}", store, "belady", by_policy["belady"].token_hit_rate,
               "ratio", target=">= 0.90x", extra=extra),
        Figure(f"sim_vs_lru_{label}", store, "lru", by_policy["lru"].token_hit_rate,
               "ratio", target=">= 1.00x", extra=extra),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--capacities", default="0.05,0.1,0.2",
                        help="fractions (< 1) of the distinct blocks, or numbers of blocks")
    parser.add_argument("--requests", type=int, default=None, help="replay only the first N")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    requests = load_trace(args.trace)[: args.requests]
    num_distinct = distinct_blocks(requests)
    capacities = resolve_capacities(args.capacities, num_distinct)
    print(f"# trace {args.trace}: {len(requests)} requests, {num_distinct} distinct blocks, "
          f"{sum(len(r.hash_ids) for r in requests)} block accesses")
    print("# store = kvstore.index.Index (leaf-first LRU), one dram tier, 1 page per block")
    results = simulate(requests, [blocks for _, blocks in capacities])
    figures: list[Figure] = []
    for n, (label, blocks) in enumerate(capacities):
        chunk = results[n * len(POLICIES) : (n + 1) * len(POLICIES)]
        by_policy = {r.policy: r for r in chunk}
        print(f"# capacity {label} = {blocks} blocks (tier dram)")
        print("#   policy  block_hit  token_hit")
        for name, result in by_policy.items():
            print(f"#   {name:<7} {result.block_hit_rate:9.4f}  {result.token_hit_rate:9.4f}")
        figures += _figures(label, by_policy)
    for figure in figures:
        print(figure.line())
    if args.json is not None:
        write_report(args.json, figures,
                     {"trace": str(args.trace), "requests": len(requests),
                      "distinct_blocks": num_distinct})
    return 0


if __name__ == "__main__":
    sys.exit(main())
