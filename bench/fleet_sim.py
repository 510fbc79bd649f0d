"""Fleet simulation: what routing is worth to a fleet of engine replicas, each with its own
kvstore L2 (and L3), all sharing one L4 pool.

Replays a Mooncake-format trace (the public one in bench/traces/ by default, any other with
--trace, or a generated family of bench/trace_families.py with --family) over N replicas for
each N of --replicas (default 4, 16, 64), under four routing policies, and reports the fleet's
token hit rate per tier, the prefill work it saved, and its load imbalance (max / mean requests
per replica):

- `round_robin`: request i to replica i mod N;
- `least_loaded`: the replica with the least outstanding work (the router's estimate of what
  it sent there and has not seen finish: each request's whole prompt and output);
- `session_affinity`: the trace has no session id, so a request's session is its first hash
  id (the conversation's root: every turn of a conversation re-sends it), hashed to a replica;
- `prefix_aware`: what llm-d's precise prefix-cache scorer and Dynamo's KV router do, from KV
  events only. For each replica, the router keeps the blocks that replica announced stored
  and not yet removed, with the fastest tier each was announced in, and the L4 pool's blocks
  (the pool topic); it scores
  `recompute saved - lambda x load`, where recompute saved is the recompute time of the
  longest cached prefix, each block weighted by its medium (llm-d's weights: `gpu` 1.0, `cpu`
  0.8, `storage` 0.4; the store announces L2 as `cpu`, L3 and L4 as `storage`, as
  kvstore/integrations/vllm_events.py does), and load is the replica's outstanding work, the
  router's estimate (each outstanding request's prompt less its weighted match, and its
  output). With lambda = 1 that is "send where it is estimated to finish first", the cost
  Dynamo's router minimises; ties go to the least loaded, then the replica sent fewest.

Each replica's store is the store's own pure index and placement planner, driven as the daemon
drives them (bench/sim_store.py `StorePolicy`, the same as bench/trace_sim.py). Its KV events
are the daemon's own: the index feeds an `EventLog` (kvstore/daemon/events.py, the source of
the WatchEvents stream) as the daemon's index does, a STORED, MOVED or REMOVED event for every
entry it links, whose fastest tier changes, or that it removes; the router reads each
replica's events from sequence 1 on, as a WatchEvents subscriber does, and sees nothing else
of a store. L4 is one LRU over blocks
(Redis with `maxmemory-policy allkeys-lru`): every replica writes the blocks it computed to it
(the daemon's write-through), and reads from it the blocks that continue a request's prefix
past its local hit; a pool write is announced on the pool topic as it lands.

Time: requests arrive in timestamp order, at the trace's timestamps scaled so that the fleet
would be --utilization busy if nothing hit (default 0.7; the same load per replica at every N,
so least-loaded routing and the load term mean the same at each N). Each replica serves its
queue in order, one request at a time; a request takes
`prefill tokens computed x recompute cost + loaded blocks x the tier's load cost + output
tokens x decode cost`. A request's lookup and put happen when its service starts; the events
its put caused reach the router when it finishes (a store announces blocks once they are
written, after the prefill). Default costs, for a Llama-3-8B-class model (a 512-token block is
64 MiB of bf16 KV) on one H100-class GPU: recompute 0.1 ms a token (10,000 prefill tokens/s),
loads of a block 2.5 ms from L2 (25 GB/s host to device), 10 ms from L3 (6 GB/s NVMe), 20 ms
from L4 (about 3 GB/s over the network), decode 1 ms an output token (a ~30 ms decode step
shared by ~30 running requests). Only their ratios and the utilization matter.

Figures, per N: `fleet_hit_rate_n<N>` (prefix-aware's token hit rate vs round robin's),
`fleet_local_hit_rate_n<N>` (the same in the replicas' own tiers, L2 and L3: what routing
decides), `fleet_prefill_saved_n<N>` (the recompute time of all prompts that prefix-aware
saved, net of its loads, in %, vs round robin's) and `fleet_imbalance_n<N>` (prefix-aware's
max/mean requests per replica vs round robin's; lower is better). At N = 16 with the
benchmark's sizes (each L2 5% of the trace's distinct blocks, L4 50%, no L3) the targets are
the issue's: a hit rate >= 1.5x round robin's with an imbalance <= 1.25. `#` lines hold the
table of every policy and N, the ceiling (unbounded caches: no routing hits more), and a sweep
of lambda (and of the utilization) at --sweep-replicas, so that the conclusion does not rest
on one value of either.

    python bench/fleet_sim.py [--quick] [--trace PATH | --family NAME] [--replicas 4,16,64]
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from figures import Figure, run_main
from sim_store import StorePolicy
from trace_families import BLOCK_TOKENS, FAMILIES, generate
from trace_sim import Request, TraceError, distinct_blocks, load_trace, request_from_row

from kvstore.daemon.events import BlockEvent, EventLog, Kind
from kvstore.tier import Tier

DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "mooncake_synthetic_trace.jsonl"
POLICY_NAMES = ("round_robin", "least_loaded", "session_affinity", "prefix_aware")
GPU, CPU, STORAGE = "gpu", "cpu", "storage"
MEDIUM_WEIGHTS: Mapping[str, float] = {GPU: 1.0, CPU: 0.8, STORAGE: 0.4}
"""llm-d's precise prefix-cache scorer's weights by medium (unknown media score 0)."""
MEDIUM_OF_TIER: Mapping[Tier, str] = {Tier.HBM: CPU, Tier.DRAM: CPU, Tier.NVME: STORAGE}
"""What the store announces each local tier as (kvstore/integrations/vllm_events.py)."""
POOL_MEDIUM = STORAGE
L2, L3, L4 = Tier.DRAM.label, Tier.NVME.label, Tier.REMOTE.label  # the hit tiers' labels
TIER_NAMES: Mapping[str, str] = {L2: "L2", L3: "L3", L4: "L4"}
BENCHMARK = {"replicas": 16, "l2_pct": 5.0, "l4_pct": 50.0, "l3_factor": 0.0}
"""The issue's benchmark: its targets apply at these sizes only."""
HIT_TARGET, IMBALANCE_TARGET = ">= 1.5x", "<= 1.25 ratio"

PoolEvent = tuple[bool, int]
"""An event of the pool topic: (stored: True / removed: False, the block's hash id)."""
TENANT = ""  # the events' tenant with auth off, as the daemon runs them here
EVENTS_PER_BLOCK = 4
"""The most events one block of a request can cause: its STORED, and for the room it takes
a demotion (MOVED) or an eviction (REMOVED), an L3 eviction to make room for that demotion
(REMOVED), and a promotion from L3 when it hits there (MOVED). A replica's event ring holds
this many per block of L2, so the events of one request always fit (a request's blocks are cut
to L2's size): the router, which reads after each request, never misses one. A ring as large as
the daemon's (65,536 events) would be as right and slower, since every read copies the ring."""


# --- costs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Costs:
    """What a request's service costs (the module's docstring says why these defaults)."""

    recompute_ms_per_token: float = 0.1
    decode_ms_per_token: float = 1.0
    load_ms_per_block: Mapping[str, float] = field(
        default_factory=lambda: {L2: 2.5, L3: 10.0, L4: 20.0})

    def no_hit_ms(self, request: Request) -> float:
        """The request's service time when nothing hits."""
        return (request.input_length * self.recompute_ms_per_token
                + request.output_length * self.decode_ms_per_token)


# --- what a replica announces ----------------------------------------------------------------


def block_id(key: bytes) -> int:
    """The trace's hash id of a sim_store key (its inverse, `sim_store.block_key`)."""
    return int.from_bytes(key, "big")


def read_events(log: EventLog, cursor: int) -> tuple[list[BlockEvent], int]:
    """Every event of a replica's stream from sequence `cursor` on, as a WatchEvents
    subscriber reads them, and the cursor after them. A gap would leave the router's view
    wrong, so it is an error here (the ring is sized so that there is none)."""
    batch = log.read(TENANT, cursor, log.capacity, timeout_s=0)
    if batch.dropped:
        raise RuntimeError(f"the router missed {batch.dropped} events: a ring of "
                           f"{log.capacity} is too small for one request's events")
    return batch.events, (batch.events[-1].sequence + 1 if batch.events else cursor)


class SharedPool:
    """L4: one LRU over blocks that every replica writes the blocks it computed to and reads
    a prefix's continuation from; each write's stored and removed blocks are events of the
    pool topic."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hash_ids: Sequence[int], start: int) -> int:
        """How many blocks from hash_ids[start] on the pool holds, in a row."""
        n = start
        while n < len(hash_ids) and hash_ids[n] in self._blocks:
            n += 1
        return n - start

    def read(self, hash_ids: Iterable[int]) -> None:
        for block in hash_ids:
            self._blocks.move_to_end(block)

    def write(self, hash_ids: Iterable[int]) -> list[PoolEvent]:
        """Store the blocks (a block there already is used again); the events it caused.
        A pool of no blocks is no pool: it stores nothing."""
        events: list[PoolEvent] = []
        if not self.capacity_blocks:
            return events
        for block in hash_ids:
            if block in self._blocks:
                self._blocks.move_to_end(block)
                continue
            self._blocks[block] = None
            events.append((True, block))
            if len(self._blocks) > self.capacity_blocks:
                old, _ = self._blocks.popitem(last=False)
                events.append((False, old))
        return events


# --- the router --------------------------------------------------------------------------------


class Router:
    """What a KV-event router knows of the fleet's caches: per replica, each block announced
    stored and not yet removed, with the fastest tier it was announced in (STORED and MOVED
    events carry it), and the pool's blocks. It is built from events alone; it holds no
    reference to a store."""

    def __init__(self, num_replicas: int, weights: Mapping[str, float] = MEDIUM_WEIGHTS) -> None:
        self._tier_weights = {int(t): weights.get(m, 0.0) for t, m in MEDIUM_OF_TIER.items()}
        self._pool_weight = weights.get(POOL_MEDIUM, 0.0)
        self.views: list[dict[int, int]] = [{} for _ in range(num_replicas)]
        self.pool: set[int] = set()

    def apply(self, replica: int, events: Iterable[BlockEvent]) -> None:
        """One replica's events, in sequence order."""
        view = self.views[replica]
        for event in events:
            if event.kind is Kind.REMOVED:  # gone from every tier of that replica
                view.pop(block_id(event.key), None)
            elif event.kind is Kind.CLEARED:  # a new daemon run: forget what the last held
                view.clear()
            else:  # STORED, MOVED: the block's fastest tier now
                view[block_id(event.key)] = event.tier

    def apply_pool(self, events: Iterable[PoolEvent]) -> None:
        for stored, block in events:
            if stored:
                self.pool.add(block)
            else:
                self.pool.discard(block)

    def pool_tail(self, request: Request) -> list[float]:
        """tail[i]: the weighted tokens of the pool's run of the request's blocks from i on
        (what a replica whose own prefix ends at i adds from L4); tail[n] = 0."""
        n = len(request.hash_ids)
        tail = [0.0] * (n + 1)
        for i in range(n - 1, -1, -1):
            if request.hash_ids[i] in self.pool:
                tail[i] = tail[i + 1] + self._pool_weight * request.block_tokens(i)
        return tail

    def match(self, replica: int, request: Request, tail: Sequence[float]) -> float:
        """Weighted tokens of the longest prefix the replica announced, continued in the
        pool: each block's tokens times its medium's weight."""
        view, weights = self.views[replica], self._tier_weights
        total = 0.0
        for i, block in enumerate(request.hash_ids):
            tier = view.get(block)
            weight = weights.get(tier, 0.0) if tier is not None else 0.0
            if not weight:
                return total + tail[i]
            total += weight * request.block_tokens(i)
        return total


# --- routing policies ------------------------------------------------------------------------


class Dispatcher:
    """The router's side of the fleet: picks a replica for each request by its policy and
    keeps what it may know: each replica's outstanding work (its own estimate of what it sent
    there and has not seen finish, in whole microseconds, so that a replica with nothing
    outstanding is at exactly 0 and ties with the others) and how many requests it sent
    each."""

    def __init__(self, policy: str, num_replicas: int, router: Router, costs: Costs,
                 lam: float) -> None:
        if policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {policy!r}; one of {', '.join(POLICY_NAMES)}")
        self.policy, self.router, self.costs, self.lam = policy, router, costs, lam
        self.outstanding_us = [0] * num_replicas
        self.sent = [0] * num_replicas
        self._next = 0
        self._pick: Callable[[Request], tuple[int, float]] = getattr(self, f"_{policy}")

    def pick(self, request: Request) -> tuple[int, int]:
        """(replica, the router's estimate of the request's service there, us), counted as
        outstanding there until `done`."""
        replica, estimate_ms = self._pick(request)
        estimate_us = round(1000 * estimate_ms)
        self.outstanding_us[replica] += estimate_us
        self.sent[replica] += 1
        return replica, estimate_us

    def done(self, replica: int, estimate_us: int) -> None:
        self.outstanding_us[replica] -= estimate_us

    def _least_by_load(self) -> int:
        n = len(self.sent)
        return min(range(n), key=lambda r: (self.outstanding_us[r], self.sent[r], r))

    def _round_robin(self, request: Request) -> tuple[int, float]:
        replica, self._next = self._next, (self._next + 1) % len(self.sent)
        return replica, self.costs.no_hit_ms(request)

    def _least_loaded(self, request: Request) -> tuple[int, float]:
        return self._least_by_load(), self.costs.no_hit_ms(request)

    def _session_affinity(self, request: Request) -> tuple[int, float]:
        return session_replica(request, len(self.sent)), self.costs.no_hit_ms(request)

    def _prefix_aware(self, request: Request) -> tuple[int, float]:
        tail = self.router.pool_tail(request)
        per_token = self.costs.recompute_ms_per_token
        best: tuple[float, float, int, int] | None = None
        best_saved = 0.0
        for r in range(len(self.sent)):
            saved_ms = per_token * self.router.match(r, request, tail)
            load_ms = self.outstanding_us[r] / 1000
            key = (self.lam * load_ms - saved_ms, load_ms, self.sent[r], r)
            if best is None or key < best:
                best, best_saved = key, saved_ms
        assert best is not None
        return best[3], self.costs.no_hit_ms(request) - best_saved


def session_replica(request: Request, num_replicas: int) -> int:
    """The replica of the request's session: its first hash id (the conversation's root),
    hashed (CRC-32, stable across runs) onto the replicas."""
    return zlib.crc32(request.hash_ids[0].to_bytes(8, "little")) % num_replicas


# --- the fleet -------------------------------------------------------------------------------


@dataclass(frozen=True)
class FleetConfig:
    """One fleet: its size, each replica's tiers and the shared pool, in blocks, its costs,
    and the prefix-aware router's settings."""

    replicas: int
    l2_blocks: int
    """Each replica's L2."""
    l4_blocks: int
    """The one pool every replica shares; 0: none."""
    l3_blocks: int = 0
    """Each replica's L3; 0: none."""
    costs: Costs = field(default_factory=Costs)
    lam: float = 1.0
    """The weight of a replica's outstanding work against the recompute it would save."""
    weights: Mapping[str, float] = field(default_factory=lambda: dict(MEDIUM_WEIGHTS))
    """The router's weight of a block by the medium it was announced on."""


@dataclass
class Job:
    """A request on its way through a replica."""

    index: int  # in arrival order
    request: Request
    arrival_ms: float
    estimate_us: int  # the router's, counted in its outstanding work
    start_ms: float = 0.0


class Replica:
    """One engine with its store, whose index feeds its own event log as the daemon's does
    (the index's `published` mirror); a FIFO queue served one request at a time."""

    def __init__(self, config: FleetConfig) -> None:
        self.store = StorePolicy(config.l2_blocks, l3_blocks=config.l3_blocks)
        self.events = EventLog(EVENTS_PER_BLOCK * config.l2_blocks + 1,  # + CLEARED
                               lambda namespace: TENANT)
        self.store.index.published = self.events
        self.cursor = 1  # the router's next sequence: from the first, CLEARED
        self.queue: deque[Job] = deque()
        self.running: Job | None = None


@dataclass
class FleetResult:
    """What one policy did to one fleet: hits by tier, the prefill work, each request's
    tokens and hits, where the requests went and how long each took."""

    policy: str
    replicas: int
    lam: float
    tokens: int = 0
    tier_token_hits: dict[str, int] = field(default_factory=dict)  # L2/L3/L4 label -> tokens
    served: list[int] = field(default_factory=list)  # per request: times it was served
    request_hit_tokens: list[int] = field(default_factory=list)
    request_tokens: list[int] = field(default_factory=list)
    requests_per_replica: list[int] = field(default_factory=list)
    recompute_ms: float = 0.0  # every prompt token recomputed
    prefill_ms: float = 0.0  # what the prefills cost: tokens computed and blocks loaded
    latencies_ms: list[float] = field(default_factory=list)
    simulate_s: float = 0.0

    @property
    def token_hits(self) -> int:
        return sum(self.tier_token_hits.values())

    @property
    def token_hit_rate(self) -> float:
        return self.token_hits / self.tokens if self.tokens else 0.0

    def tier_hit_rate(self, label: str) -> float:
        return self.tier_token_hits.get(label, 0) / self.tokens if self.tokens else 0.0

    @property
    def local_hit_rate(self) -> float:
        """Token hits in the replicas' own tiers (L2, L3): what routing decides."""
        return self.tier_hit_rate(L2) + self.tier_hit_rate(L3)

    @property
    def prefill_saved(self) -> float:
        """The share of the prompts' recompute time saved, net of the loads."""
        return 1 - self.prefill_ms / self.recompute_ms if self.recompute_ms else 0.0

    @property
    def imbalance(self) -> float:
        """Max / mean requests per replica (1 = even)."""
        counts = self.requests_per_replica
        mean = sum(counts) / len(counts)
        return max(counts) / mean if mean else 1.0

    def latency_ms(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else 0.0

    @property
    def mean_latency_ms(self) -> float:
        return sum(self.latencies_ms) / len(self.latencies_ms) if self.latencies_ms else 0.0


class Fleet:
    """N replicas, one pool, one router and a policy, driven request by request
    (`arrive(request, at_ms)`, then `finish()` at the end)."""

    def __init__(self, config: FleetConfig, policy: str) -> None:
        if config.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {config.replicas}")
        self.config = config
        self.replicas = [Replica(config) for _ in range(config.replicas)]
        self.pool = SharedPool(config.l4_blocks)
        self.router = Router(config.replicas, config.weights)
        self.dispatcher = Dispatcher(policy, config.replicas, self.router, config.costs,
                                     config.lam)
        self.result = FleetResult(policy, config.replicas, config.lam)
        self._finishing: list[tuple[float, int, int]] = []  # (at ms, job index, replica)
        self._arrived = 0

    def arrive(self, request: Request, at_ms: float) -> int:
        """Finish what ends by at_ms, route the request and queue it; its replica."""
        self._finish_until(at_ms)
        replica, estimate_us = self.dispatcher.pick(request)
        job = Job(self._arrived, request, at_ms, estimate_us)
        self._arrived += 1
        self.result.served.append(0)
        self.result.request_hit_tokens.append(0)
        self.result.request_tokens.append(0)
        self.replicas[replica].queue.append(job)
        if self.replicas[replica].running is None:
            self._start(replica, at_ms)
        return replica

    def finish(self) -> FleetResult:
        """Serve every queued request; the result."""
        self._finish_until(float("inf"))
        self.result.requests_per_replica = list(self.dispatcher.sent)
        return self.result

    def _finish_until(self, at_ms: float) -> None:
        while self._finishing and self._finishing[0][0] <= at_ms:
            now_ms, _, replica = heapq.heappop(self._finishing)
            self._end(replica, now_ms)

    def _start(self, replica: int, now_ms: float) -> None:
        """The next queued request's lookup, loads and put, and when it will end."""
        r = self.replicas[replica]
        job = r.queue.popleft()
        r.running, job.start_ms = job, now_ms
        service_ms = self._serve(r, job)
        heapq.heappush(self._finishing, (now_ms + service_ms, job.index, replica))

    def _serve(self, r: Replica, job: Job) -> float:
        """The request through the replica's store and the pool: hits counted by tier, the
        pool read and written (its events reach the router at once); its service time."""
        request, costs, res = job.request, self.config.costs, self.result
        ids = request.hash_ids
        fits = ids[: self.config.l2_blocks]  # a Get's blocks must fit in L2 together
        local = r.store.access(job.index, ids)
        start = len(local)
        from_pool = self.pool.match(fits, start)
        self.pool.read(fits[start:start + from_pool])
        self.router.apply_pool(self.pool.write(fits[start + from_pool:]))
        tiers = [*local, *[L4] * from_pool]
        load_ms = 0.0
        for i, tier in enumerate(tiers):
            res.tier_token_hits[tier] = res.tier_token_hits.get(tier, 0) + request.block_tokens(i)
            load_ms += costs.load_ms_per_block[tier]
        hit_tokens = sum(request.block_tokens(i) for i in range(len(tiers)))
        prompt = sum(request.block_tokens(i) for i in range(len(ids)))
        res.tokens += prompt
        res.served[job.index] += 1
        res.request_hit_tokens[job.index] = hit_tokens
        res.request_tokens[job.index] = prompt
        prefill_ms = (prompt - hit_tokens) * costs.recompute_ms_per_token + load_ms
        res.recompute_ms += prompt * costs.recompute_ms_per_token
        res.prefill_ms += prefill_ms
        return prefill_ms + request.output_length * costs.decode_ms_per_token

    def _end(self, replica: int, now_ms: float) -> None:
        """The running request ends: the router hears what its put changed (the replica's
        events since the last request ended: only this one ran meanwhile), and the next
        starts."""
        r = self.replicas[replica]
        job = r.running
        assert job is not None
        events, r.cursor = read_events(r.events, r.cursor)
        self.router.apply(replica, events)
        self.dispatcher.done(replica, job.estimate_us)
        self.result.latencies_ms.append(now_ms - job.arrival_ms)
        r.running = None
        if r.queue:
            self._start(replica, now_ms)


def arrival_times_ms(requests: Sequence[Request], costs: Costs, num_replicas: int,
                     utilization: float) -> list[float]:
    """Each request's arrival: its timestamp, scaled so that N replicas would be
    `utilization` busy if nothing hit (all at 0 when the trace spans no time)."""
    first = min(r.timestamp for r in requests)
    span = max(r.timestamp for r in requests) - first
    if span <= 0:
        return [0.0] * len(requests)
    work_ms = sum(costs.no_hit_ms(r) for r in requests)
    scale = work_ms / (num_replicas * utilization * span)
    return [(r.timestamp - first) * scale for r in requests]


def simulate(requests: Sequence[Request], policy: str, config: FleetConfig,
             utilization: float) -> FleetResult:
    """One policy over the fleet, the requests in timestamp order."""
    started = time.perf_counter()
    ordered = sorted(requests, key=lambda r: r.timestamp)  # stable: ties keep file order
    fleet = Fleet(config, policy)
    for request, at_ms in zip(ordered, arrival_times_ms(ordered, config.costs, config.replicas,
                                                        utilization), strict=True):
        fleet.arrive(request, at_ms)
    result = fleet.finish()
    result.simulate_s = time.perf_counter() - started
    return result


# --- CLI -------------------------------------------------------------------------------------


def _row(result: FleetResult) -> str:
    return (f"# | {result.replicas} | {result.policy} | {result.tier_hit_rate(L2):.4f} | "
            f"{result.tier_hit_rate(L3):.4f} | {result.tier_hit_rate(L4):.4f} | "
            f"{result.token_hit_rate:.4f} | {result.token_hits / 1e6:.2f} | "
            f"{100 * result.prefill_saved:.1f} | {result.imbalance:.3f} | "
            f"{result.mean_latency_ms / 1e3:.2f} | {result.latency_ms(0.99) / 1e3:.2f} |")


TABLE_HEAD = ("# | N | policy | L2 hit | L3 hit | L4 hit | token hit | Mtok saved | "
              "prefill saved % | imbalance | mean s | p99 s |")
TABLE_RULE = "# |---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"


def summary(result: FleetResult) -> dict[str, object]:
    return {"policy": result.policy, "replicas": result.replicas, "lambda": result.lam,
            "token_hit_rate": round(result.token_hit_rate, 5),
            "tier_token_hit_rates": {TIER_NAMES[t]: round(result.tier_hit_rate(t), 5)
                                     for t in (L2, L3, L4)},
            "prefill_tokens_saved": result.token_hits,
            "prefill_saved": round(result.prefill_saved, 5),
            "imbalance": round(result.imbalance, 4),
            "requests_per_replica": result.requests_per_replica,
            "mean_latency_ms": round(result.mean_latency_ms, 1),
            "p99_latency_ms": round(result.latency_ms(0.99), 1),
            "simulate_s": round(result.simulate_s, 2)}


def _figures(n: int, by_policy: Mapping[str, FleetResult], at_benchmark: bool,
             ceiling: float) -> list[Figure]:
    ours, rr = by_policy["prefix_aware"], by_policy["round_robin"]
    if rr.token_hit_rate:
        print(f"# N = {n}: no routing can beat round robin's token hit rate by more than the "
              f"ceiling's {ceiling / rr.token_hit_rate:.2f}x ({ceiling:.4f} / "
              f"{rr.token_hit_rate:.4f}); L4 hits {rr.tier_hit_rate(L4):.4f} of its tokens")
    extra = {"replicas": n, "policies": {p: summary(r) for p, r in by_policy.items()}}
    candidates = [
        (f"fleet_hit_rate_n{n}", ours.token_hit_rate, rr.token_hit_rate, "ratio",
         HIT_TARGET if at_benchmark else ""),
        (f"fleet_local_hit_rate_n{n}", ours.local_hit_rate, rr.local_hit_rate, "ratio", ""),
        (f"fleet_prefill_saved_n{n}", 100 * ours.prefill_saved, 100 * rr.prefill_saved, "%",
         "")]
    figures = []
    for name, value, baseline, unit, target in candidates:
        if value > 0 and baseline > 0:
            figures.append(Figure(name, value, "round_robin", baseline, unit, target=target,
                                  extra=extra))
        else:  # a ratio to nothing means nothing
            print(f"# {name}: prefix_aware {value:.4f}, round_robin {baseline:.4f}, no ratio")
    figures.append(Figure(f"fleet_imbalance_n{n}", ours.imbalance, "round_robin",
                          rr.imbalance, "ratio", lower_is_better=True,
                          target=IMBALANCE_TARGET if at_benchmark else "", extra=extra))
    return figures


def ceiling_hit_rate(requests: Sequence[Request]) -> float:
    """The token hit rate of unbounded caches shared by the whole fleet: every block seen
    before hits (up to the first one not seen), whatever the routing."""
    seen: set[int] = set()
    hits = tokens = 0
    for request in sorted(requests, key=lambda r: r.timestamp):
        ids = request.hash_ids
        n = 0
        while n < len(ids) and ids[n] in seen:
            n += 1
        hits += sum(request.block_tokens(i) for i in range(n))
        tokens += sum(request.block_tokens(i) for i in range(len(ids)))
        seen.update(ids)
    return hits / tokens if tokens else 0.0


def _sweep(requests: Sequence[Request], config: FleetConfig, utilization: float,
           lambdas: Sequence[float], utilizations: Sequence[float]) -> list[dict[str, object]]:
    """Prefix-aware at each lambda, and against round robin at each utilization, as `#`
    lines; their summaries."""
    rows: list[dict[str, object]] = []
    n = config.replicas
    rr = simulate(requests, "round_robin", config, utilization)
    print(f"# lambda sweep, N = {n}, utilization {utilization:g} (round robin: token hit "
          f"{rr.token_hit_rate:.4f}, imbalance {rr.imbalance:.3f}, mean "
          f"{rr.mean_latency_ms / 1e3:.2f} s)")
    print("# | lambda | token hit (vs round robin) | local hit (vs round robin) | L4 hit | "
          "prefill saved % (vs round robin) | imbalance | mean s | p99 s |")
    print("# |---:|---:|---:|---:|---:|---:|---:|---:|")
    for lam in lambdas:
        r = simulate(requests, "prefix_aware", replace(config, lam=lam), utilization)
        print(f"# | {lam:g} | {r.token_hit_rate:.4f} ({_vs(r.token_hit_rate, rr.token_hit_rate)})"
              f" | {r.local_hit_rate:.4f} ({_vs(r.local_hit_rate, rr.local_hit_rate)}) | "
              f"{r.tier_hit_rate(L4):.4f} | {100 * r.prefill_saved:.1f} "
              f"({_vs(r.prefill_saved, rr.prefill_saved)}) | {r.imbalance:.3f} | "
              f"{r.mean_latency_ms / 1e3:.2f} | {r.latency_ms(0.99) / 1e3:.2f} |")
        rows.append({"sweep": "lambda", "utilization": utilization, **summary(r)})
    if utilizations:
        print(f"# utilization sweep, N = {n}, lambda {config.lam:g}")
        print("# | utilization | token hit, prefix_aware / round_robin | local hit | prefill "
              "saved % | prefix_aware imbalance | mean s |")
        print("# |---:|---:|---:|---:|---:|---:|")
    for u in utilizations:
        ours, base = (simulate(requests, p, config, u) for p in ("prefix_aware", "round_robin"))
        print(f"# | {u:g} | {ours.token_hit_rate:.4f} / {base.token_hit_rate:.4f} "
              f"({_vs(ours.token_hit_rate, base.token_hit_rate)}) | {ours.local_hit_rate:.4f} / "
              f"{base.local_hit_rate:.4f} ({_vs(ours.local_hit_rate, base.local_hit_rate)}) | "
              f"{100 * ours.prefill_saved:.1f} / {100 * base.prefill_saved:.1f} | "
              f"{ours.imbalance:.3f} | {ours.mean_latency_ms / 1e3:.2f} / "
              f"{base.mean_latency_ms / 1e3:.2f} |")
        rows += [{"sweep": "utilization", "utilization": u, **summary(x)} for x in (ours, base)]
    return rows


def _vs(ours: float, baseline: float) -> str:
    return f"{ours / baseline:.2f}x" if baseline else "-"


def run(args: argparse.Namespace, requests: list[Request],
        source: str) -> tuple[list[Figure], dict[str, object]]:
    """Every policy at every N, the sweep, the table; the figures and the setup."""
    num_distinct = distinct_blocks(requests)
    l2 = max(1, round(args.l2_pct / 100 * num_distinct))
    l3, l4 = round(args.l3 * l2), round(args.l4_pct / 100 * num_distinct)
    costs = Costs(args.recompute_ms, args.decode_ms, {L2: args.load_ms[0], L3: args.load_ms[1],
                                                      L4: args.load_ms[2]})
    ceiling = ceiling_hit_rate(requests)
    print(f"# {source}: {len(requests)} requests, {num_distinct} distinct blocks; ceiling "
          f"token hit rate {ceiling:.4f} (unbounded caches: every block seen before hits)")
    print(f"# each replica: L2 {l2} blocks ({args.l2_pct:g}%)" + (
        f", L3 {l3} ({args.l3:g}x L2)" if l3 else "") + f"; shared L4 {l4} blocks "
        f"({args.l4_pct:g}%{'' if l4 else ': none'}); utilization {args.utilization:g}; "
        f"lambda {args.lam:g}; costs: "
        f"recompute {costs.recompute_ms_per_token:g} ms/token, decode "
        f"{costs.decode_ms_per_token:g} ms/token, loads "
        + ", ".join(f"{TIER_NAMES[t]} {ms:g}" for t, ms in costs.load_ms_per_block.items())
        + " ms/block")
    print(f"# router weights by medium: {dict(MEDIUM_WEIGHTS)}; L2 announced as cpu, L3 and L4 "
          "as storage")
    span_ms = max(r.timestamp for r in requests) - min(r.timestamp for r in requests)
    if span_ms > 0:
        busy = sum(costs.no_hit_ms(r) for r in requests) / span_ms
        print(f"# the trace's own timestamps, read as ms, would keep {busy:.1f} replicas busy "
              "if nothing hit; arrivals are scaled to the utilization at each N instead")
    sizes = {"l2_pct": args.l2_pct, "l4_pct": args.l4_pct, "l3_factor": args.l3}
    figures: list[Figure] = []
    results: list[FleetResult] = []
    for n in args.replicas:
        config = FleetConfig(n, l2, l4, l3, costs, args.lam)
        by_policy = {p: simulate(requests, p, config, args.utilization) for p in args.policy}
        results += by_policy.values()
        print(TABLE_HEAD if n == args.replicas[0] else "# (table continued)")
        if n == args.replicas[0]:
            print(TABLE_RULE)
        for r in by_policy.values():
            print(_row(r))
        if "prefix_aware" in by_policy and "round_robin" in by_policy:
            at_benchmark = {"replicas": n, **sizes} == BENCHMARK
            figures += _figures(n, by_policy, at_benchmark, ceiling)
        print(f"# N = {n}: simulated in "
              f"{sum(r.simulate_s for r in by_policy.values()):.1f} s", flush=True)
    sweep: list[dict[str, object]] = []
    if args.sweep_replicas:
        config = FleetConfig(args.sweep_replicas, l2, l4, l3, costs, args.lam)
        sweep = _sweep(requests, config, args.utilization, args.sweep_lambdas,
                       args.sweep_utilizations)
    setup: dict[str, object] = {
        "trace": source, "requests": len(requests), "distinct_blocks": num_distinct,
        "ceiling_token_hit_rate": round(ceiling, 5),
        "l2_blocks": l2, "l3_blocks": l3, "l4_blocks": l4, **sizes,
        "utilization": args.utilization, "lambda": args.lam,
        "costs": {"recompute_ms_per_token": costs.recompute_ms_per_token,
                  "decode_ms_per_token": costs.decode_ms_per_token,
                  "load_ms_per_block": {TIER_NAMES[t]: ms
                                        for t, ms in costs.load_ms_per_block.items()}},
        "medium_weights": dict(MEDIUM_WEIGHTS),
        "results": [summary(r) for r in results], "sweep": sweep}
    return figures, setup


def _numbers(kind: type, name: str, low: float,
             high: float = float("inf")) -> Callable[[str], list[float]]:
    """An argparse type: comma-separated numbers of kind, each in [low, high]."""
    def parse(text: str) -> list[float]:
        values = []
        for item in text.split(","):
            try:
                value = kind(item)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{name}: {item!r} is not a number") from None
            if not low <= value <= high:
                raise argparse.ArgumentTypeError(f"{name}: {item!r} must be in [{low:g}, "
                                                 f"{high:g}]")
            values.append(value)
        return values
    parse.__name__ = name  # argparse names the type in its message
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=None,
                   help=f"a Mooncake-format trace (default {DEFAULT_TRACE.name})")
    p.add_argument("--family", choices=FAMILIES, default=None,
                   help="a generated trace family of bench/trace_families.py instead")
    p.add_argument("--seed", type=int, default=0, help="of a generated family")
    p.add_argument("--requests", type=int, default=None, help="replay only the first N")
    p.add_argument("--replicas", type=_numbers(int, "--replicas", 1), default=[4, 16, 64],
                   help="numbers of replicas, comma-separated (default 4,16,64)")
    p.add_argument("--policy", action="append", choices=POLICY_NAMES, default=None,
                   help="only these policies (repeatable; default all)")
    p.add_argument("--l2-pct", type=float, default=5.0,
                   help="each replica's L2, in %% of the trace's distinct blocks (default 5)")
    p.add_argument("--l3", type=float, default=0.0, metavar="FACTOR",
                   help="give each replica an L3 of FACTOR x its L2 (default 0: none)")
    p.add_argument("--l4-pct", type=float, default=50.0,
                   help="the shared L4, in %% of the trace's distinct blocks (default 50; "
                        "0: none)")
    p.add_argument("--utilization", type=float, default=0.7,
                   help="how busy the fleet would be if nothing hit (default 0.7)")
    p.add_argument("--lam", type=float, default=1.0,
                   help="prefix-aware's load weight lambda (default 1)")
    p.add_argument("--recompute-ms", type=float, default=0.1, help="per prompt token")
    p.add_argument("--decode-ms", type=float, default=1.0, help="per output token")
    p.add_argument("--load-ms", type=_numbers(float, "--load-ms", 0), default=[2.5, 10.0, 20.0],
                   help="per block loaded from L2,L3,L4 (default 2.5,10,20)")
    p.add_argument("--sweep-replicas", type=int, default=16,
                   help="N of the lambda and utilization sweeps (0: no sweep)")
    p.add_argument("--sweep-lambdas", type=_numbers(float, "--sweep-lambdas", 0),
                   default=[0.25, 0.5, 1, 2, 4])
    p.add_argument("--sweep-utilizations", type=_numbers(float, "--sweep-utilizations", 0.01),
                   default=[0.5, 0.9])
    p.add_argument("--quick", action="store_true",
                   help="smoke size: 600 requests, N = 4 and 16, a short sweep")
    p.add_argument("--json", type=Path, default=None)
    return p


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (exit 2) naming the flag, for what argparse's types do not check."""
    if args.trace is not None and args.family:
        parser.error("--trace and --family: give one")
    if args.requests is not None and args.requests < 1:
        parser.error(f"--requests must be >= 1, got {args.requests}")
    if not 0 < args.l2_pct <= 100:
        parser.error(f"--l2-pct must be a percentage above 0, at most 100, got {args.l2_pct:g}")
    if not 0 <= args.l4_pct <= 100:
        parser.error(f"--l4-pct must be a percentage from 0 (no L4) to 100, got "
                     f"{args.l4_pct:g}")
    if not 0 <= args.l3 < float("inf"):
        parser.error(f"--l3 must be a number >= 0, got {args.l3:g}")
    if not 0 < args.utilization < float("inf"):
        parser.error(f"--utilization must be above 0, got {args.utilization:g}")
    for flag, value in (("--lam", args.lam), ("--recompute-ms", args.recompute_ms),
                        ("--decode-ms", args.decode_ms)):
        if not 0 <= value < float("inf"):
            parser.error(f"{flag} must be a number >= 0, got {value:g}")
    if len(args.load_ms) != 3:
        parser.error(f"--load-ms: give three numbers (L2,L3,L4), got {len(args.load_ms)}")
    if args.sweep_replicas < 0:
        parser.error(f"--sweep-replicas must be >= 0, got {args.sweep_replicas}")


def _requests(args: argparse.Namespace) -> tuple[list[Request], str]:
    """The requests to replay and where they came from (TraceError when a trace is bad)."""
    if args.family:
        trace = generate(args.family, args.seed, args.requests)
        requests = [request_from_row(row, f"{args.family}:{n}")
                    for n, row in enumerate(trace.rows)]
        return requests, f"family {args.family}, seed {args.seed}"
    path = args.trace or DEFAULT_TRACE
    return load_trace(path)[: args.requests], f"trace {path}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.requests = args.requests or 600
        args.replicas = [4, 16]
        args.sweep_lambdas, args.sweep_utilizations = [0.5, 2.0], []
    args.replicas = [int(n) for n in args.replicas]
    args.policy = [p for p in POLICY_NAMES if not args.policy or p in args.policy]
    _check(parser, args)
    try:
        requests, source = _requests(args)
    except TraceError as exc:
        parser.error(str(exc))
    assert BLOCK_TOKENS == 512  # the trace format's block size, which Request assumes
    return run_main(args, lambda args: run(args, requests, source))


if __name__ == "__main__":
    sys.exit(main())
