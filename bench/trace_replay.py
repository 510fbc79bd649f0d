"""Trace replay (issue 8): a Mooncake-format request trace against the store, two ways.

    python bench/trace_replay.py simulate [bench/trace_sim.py arguments]
    python bench/trace_replay.py live [--trace PATH] [--target HOST:PORT] [--capacity 0.1]
                                      [--block-bytes 4096] [--requests N] [--json PATH] [--quick]

`simulate` is bench/trace_sim.py: the store's pure index (no I/O) against LRU and Belady.

`live` replays the trace through `kvstore.client` against a real `kvstore-server`, as an
engine would: per request `lookup` its blocks (hash id -> key as in sim_store, in the
sim's namespace), `get` the hit prefix, `put` the blocks it missed (each --block-bytes; a request
longer than the cache puts only its first `capacity` blocks, as in the simulation). Without
--target it starts its own daemon with only an L2 tier of `capacity` blocks, one page each
(no L1, L3 or L4), so its hits are the simulated store policy's at the same capacity, request
for request; with --target it uses that daemon as it is, in a fresh namespace.

The baseline, in the same run, request by request (alternating which goes first): a real
`redis-server` with `maxmemory-policy allkeys-lru` and maxmemory sized to hold the same
number of blocks (its per-key cost measured first), driven as LMCache's Redis backend does:
one pipelined EXISTS of the request's keys, MGET of the hit prefix, pipelined SET of the
missing blocks. (Redis's LRU samples keys and stamps them with a 1 s clock, so on a fast
replay it is much less exact than the simulated plain LRU, printed for reference.)

Figures: token hit rate live vs the simulated store and vs Redis; prompt tokens per second
(tok/s; req/s in a `#` line) and p50/p99 latency per request (lookup + get + put), ours vs
Redis. Progress goes to stderr, a line per 10% of the requests.
"""

from __future__ import annotations

import argparse
import math
import secrets
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sim_store  # noqa: E402
import trace_sim  # noqa: E402
from figures import Figure, percentile, run_main  # noqa: E402

from kvstore.client import KVStoreClient, KVStoreError  # noqa: E402
from kvstore.keys import BlockKey  # noqa: E402
from kvstore.tools.testing import start_daemon, start_redis  # noqa: E402
from kvstore.units import MiB, format_size, parse_size  # noqa: E402

QUICK_REQUESTS = 300
MAX_BLOCK_BYTES = 64 * MiB  # server.max_object_bytes
MIN_PAGE_BYTES = 4096
CALIBRATION_KEYS = 512


class Replayer(Protocol):
    def access(self, keys: Sequence[BlockKey], payloads: Sequence[bytes]) -> int:
        """One request; the hit blocks read. payloads[i] is put for keys[i] if missing
        (payloads covers the blocks that fit the cache)."""


def _leading(flags: Sequence[object]) -> int:
    return next((i for i, f in enumerate(flags) if not f), len(flags))


class KVStoreReplay:
    """The engine's side of the store: Lookup, Get of the hit prefix, Put of the rest."""

    def __init__(self, client: KVStoreClient) -> None:
        self.client = client
        self.lost_blocks = 0  # looked up as hits, gone by the Get (only with a shared daemon)

    def access(self, keys: Sequence[BlockKey], payloads: Sequence[bytes]) -> int:
        found = self.client.lookup(keys).prefix_length
        got = _leading(self.client.get(keys[:found])) if found else 0
        self.lost_blocks += found - got
        if got < len(payloads):
            self.client.put(keys[got : len(payloads)], payloads[got:],
                            parent=keys[got - 1] if got else None)
        return got


class RedisReplay:
    """LMCache's Redis backend: EXISTS pipeline, MGET of the hits, pipelined SET of misses."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.refused_sets = 0  # OOM: over maxmemory with nothing left to evict


    def access(self, keys: Sequence[BlockKey], payloads: Sequence[bytes]) -> int:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        there = pipe.execute()
        hits = _leading(there)
        got = _leading(self.client.mget(keys[:hits])) if hits else 0
        pipe = self.client.pipeline(transaction=False)
        for i in range(got, len(payloads)):
            if i < hits or not there[i]:  # an existing block after the gap stays as it is
                pipe.set(keys[i], payloads[i])
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, redis.exceptions.OutOfMemoryError):
                self.refused_sets += 1  # the block is not cached: a miss next time
            elif isinstance(reply, Exception):
                raise reply
        return got


@dataclass
class Tally:
    token_hits: int = 0
    tokens: int = 0
    block_hits: int = 0
    latencies_s: list[float] = field(default_factory=list)

    def add(self, request: trace_sim.Request, hits: int, latency_s: float) -> None:
        self.block_hits += hits
        self.token_hits += sum(request.block_tokens(i) for i in range(hits))
        self.tokens += request.input_length
        self.latencies_s.append(latency_s)

    @property
    def token_hit_rate(self) -> float:
        return self.token_hits / self.tokens if self.tokens else 0.0

    @property
    def busy_s(self) -> float:  # the time this system spent on the requests
        return sum(self.latencies_s)

    def percentile_ms(self, q: float) -> float:
        return 1e3 * percentile(self.latencies_s, q)


def payload(hash_id: int, size_bytes: int) -> bytes:
    """A block's bytes: its hash id, then zeros (cheap to make, tells blocks apart)."""
    return (hash_id.to_bytes(8, "little") + bytes(max(0, size_bytes - 8)))[:size_bytes]


def replay(requests: Sequence[trace_sim.Request], capacity_blocks: int, block_bytes: int,
           replayers: Sequence[Replayer]) -> list[Tally]:
    """Every request through every replayer in turn (alternating which goes first, so
    background load hits both alike); one Tally per replayer."""
    tallies = [Tally() for _ in replayers]
    step, began = max(1, len(requests) // 10), time.monotonic()
    for r, request in enumerate(requests, 1):
        keys = [sim_store.block_key(h) for h in request.hash_ids]
        payloads = [payload(h, block_bytes) for h in request.hash_ids[:capacity_blocks]]
        order = range(len(replayers)) if r % 2 else reversed(range(len(replayers)))
        for i in order:
            start = time.perf_counter()
            hits = replayers[i].access(keys, payloads)
            tallies[i].add(request, hits, time.perf_counter() - start)
        if r % step == 0 or r == len(requests):
            print(f"trace_replay: {r}/{len(requests)} requests ({100 * r // len(requests)}%), "
                  f"{time.monotonic() - began:.1f} s", file=sys.stderr, flush=True)
    return tallies


# --- the processes ---------------------------------------------------------------------------


def page_bytes_for(block_bytes: int) -> int:
    """The smallest allowed L2 page (a power of two, >= 4 KiB) that holds one block."""
    return max(MIN_PAGE_BYTES, 1 << (block_bytes - 1).bit_length())


def own_daemon_settings(capacity_blocks: int, block_bytes: int) -> list[str]:
    """Only L2, one page per block, `capacity_blocks` pages: the simulated store's cache."""
    page = page_bytes_for(block_bytes)
    return [f"dram.capacity_bytes={capacity_blocks * page}", f"dram.page_size_bytes={page}",
            "nvme.enabled=false", "hbm.mode=off", "remote.url=", "log_level=WARNING"]


def baseline_redis(client: redis.Redis, capacity_blocks: int, block_bytes: int) -> dict[str, int]:
    """maxmemory for `capacity_blocks` blocks: what the empty server uses plus that many
    times the measured cost of one block (32-byte key, block_bytes value, allocator
    rounding and dict overhead), with allkeys-lru eviction. Returns the sizing."""
    client.flushall()
    base = int(client.info("memory")["used_memory"])
    pipe = client.pipeline(transaction=False)
    for i in range(CALIBRATION_KEYS):
        pipe.set(b"calibrate" + i.to_bytes(23, "big"), payload(i, block_bytes))
    pipe.execute()
    per_key = math.ceil((int(client.info("memory")["used_memory"]) - base) / CALIBRATION_KEYS)
    client.flushall()
    base = int(client.info("memory")["used_memory"])
    maxmemory = base + capacity_blocks * per_key
    client.config_set("maxmemory", str(maxmemory))
    client.config_set("maxmemory-policy", "allkeys-lru")
    samples = client.config_get("maxmemory-samples")["maxmemory-samples"]
    return {"maxmemory": maxmemory, "base_used_memory": base, "per_key_bytes": per_key,
            "maxmemory_samples": int(str(samples))}


def connect_target(target: str) -> KVStoreClient:
    """A client of a daemon we did not start; SystemExit(1) with one line if it is not up."""
    client = KVStoreClient(target, f"trace-{secrets.token_hex(4)}", timeout_s=5.0)
    try:
        status = client.health()
    except KVStoreError as exc:
        client.close()
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SystemExit(f"error: cannot reach a kvstore daemon at --target {target}: "
                         f"{first}") from None
    if status != "SERVING":
        client.close()
        raise SystemExit(f"error: the kvstore daemon at --target {target} is {status}")
    return client


# --- the run ---------------------------------------------------------------------------------


def start_systems(stack: ExitStack, args: argparse.Namespace, capacity_blocks: int,
                  label: str, setup: dict[str, Any]) -> tuple[KVStoreClient, redis.Redis]:
    """The daemon (ours, or --target's) and the baseline redis-server, stopped by stack."""
    workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="trace-replay-")))
    if args.target is None:
        settings = own_daemon_settings(capacity_blocks, args.block_bytes)
        daemon = start_daemon(workdir, *settings)
        stack.callback(daemon.stop)
        # The sim's namespace: the index's ghost filter hashes it, so its rare false
        # positives (and with them the hits) are the simulation's exactly.
        client = stack.enter_context(KVStoreClient(daemon.target, sim_store.NAMESPACE))
        print(f"# kvstore: own daemon, L2 only: {capacity_blocks} blocks ({label}) of "
              f"{format_size(args.block_bytes)}, one "
              f"{format_size(page_bytes_for(args.block_bytes))} page each", flush=True)
        setup["daemon_settings"] = settings
    else:
        client = stack.enter_context(connect_target(args.target))
        print(f"# kvstore: --target {args.target}, used as it is (namespace "
              f"{client.namespace}); its hits match the simulation only if it holds "
              f"{capacity_blocks} blocks in L2 alone", flush=True)
    server = start_redis(workdir)
    stack.callback(server.stop)
    redis_client = stack.enter_context(redis.Redis(host="127.0.0.1", port=server.port))
    sizing = baseline_redis(redis_client, capacity_blocks, args.block_bytes)
    setup.update(target=args.target or "own", redis=sizing)
    print(f"# redis: allkeys-lru, maxmemory {format_size(sizing['maxmemory'])} = empty "
          f"{format_size(sizing['base_used_memory'])} + {capacity_blocks} x "
          f"{sizing['per_key_bytes']} B measured per block "
          f"(maxmemory-samples {sizing['maxmemory_samples']})", flush=True)
    return client, redis_client


def run(args: argparse.Namespace, requests: list[trace_sim.Request]
        ) -> tuple[list[Figure], dict[str, Any]]:
    """The live replay and its baseline; prints `#` lines, the figures and the wall time."""
    wall_start = time.monotonic()
    num_distinct = trace_sim.distinct_blocks(requests)
    [(label, capacity_blocks)] = trace_sim.resolve_capacities(repr(args.capacity), num_distinct)
    sim = {r.policy: r.token_hit_rate for r in trace_sim.simulate(
        requests, [capacity_blocks],
        {name: trace_sim.POLICIES[name] for name in ("store", "lru")})}
    setup: dict[str, Any] = {
        "trace": str(args.trace), "requests": len(requests), "distinct_blocks": num_distinct,
        "capacity": args.capacity, "capacity_blocks": capacity_blocks,
        "block_bytes": args.block_bytes, "sim_token_hit_rates": sim}
    print(f"# trace {args.trace}: {len(requests)} requests, {num_distinct} distinct blocks, "
          f"{sum(len(r.hash_ids) for r in requests)} block accesses", flush=True)
    with ExitStack() as stack:
        client, redis_client = start_systems(stack, args, capacity_blocks, label, setup)
        ours, theirs = KVStoreReplay(client), RedisReplay(redis_client)
        start = time.monotonic()
        live, base = replay(requests, capacity_blocks, args.block_bytes, [ours, theirs])
        setup["replay_s"] = time.monotonic() - start
        dram = client.stats().tier("dram")
        setup.update(
            shared_memory=client.uses_shared_memory, lost_blocks=ours.lost_blocks,
            redis_refused_sets=theirs.refused_sets,
            kvstore_evictions=dram.evictions if dram else None,
            kvstore_blocks_at_end=dram.objects if dram else None,
            redis_evicted_keys=int(redis_client.info("stats")["evicted_keys"]),
            redis_keys_at_end=int(redis_client.dbsize()))
    info(setup, live, base)
    found = figures(label, capacity_blocks, live, base, sim["store"])
    for figure in found:
        print(figure.line(), flush=True)
    setup["wall_s"] = time.monotonic() - wall_start
    print(f"# wall {setup['wall_s']:.1f} s")
    return found, setup


def info(setup: dict[str, Any], live: Tally, base: Tally) -> None:
    print(f"# payload {format_size(setup['block_bytes'])} per block, a partial last one too; "
          f"shared memory {'on' if setup['shared_memory'] else 'off'}")
    print(f"# evictions: kvstore {setup['kvstore_evictions']}, redis "
          f"{setup['redis_evicted_keys']}; at the end kvstore holds "
          f"{setup['kvstore_blocks_at_end']} blocks, redis {setup['redis_keys_at_end']} "
          f"(capacity {setup['capacity_blocks']})")
    if setup["redis_refused_sets"]:
        print(f"# redis refused {setup['redis_refused_sets']} SETs: over maxmemory with "
              "nothing left to evict")
    if setup["lost_blocks"]:
        print(f"# {setup['lost_blocks']} blocks looked up as hits were gone by the Get")
    for name, tally in (("kvstore", live), ("redis", base)):
        print(f"# {name:<7} token hit {tally.token_hit_rate:.4f}  block hits "
              f"{tally.block_hits}  {len(tally.latencies_s) / tally.busy_s:.1f} req/s  p50 "
              f"{tally.percentile_ms(0.5):.3f} ms  p99 {tally.percentile_ms(0.99):.3f} ms")
    sim = setup["sim_token_hit_rates"]
    print(f"# sim     token hit store {sim['store']:.4f}  lru {sim['lru']:.4f} (exact LRU; "
          "redis's is sampled)")


def figures(label: str, capacity_blocks: int, live: Tally, base: Tally,
            sim_store: float) -> list[Figure]:
    extra = {"capacity_blocks": capacity_blocks}
    out: list[Figure] = []
    for name, baseline_name, baseline in (("sim", "sim store", sim_store),
                                          ("redis", "redis allkeys-lru", base.token_hit_rate)):
        if live.token_hit_rate > 0 and baseline > 0:
            out.append(Figure(f"live_tokens_vs_{name}_{label}", live.token_hit_rate,
                              baseline_name, baseline, "ratio",
                              target="~1.00x" if name == "sim" else ">= 1.00x", extra=extra))
        else:
            print(f"# no live_tokens_vs_{name} figure: token hit rate "
                  f"{live.token_hit_rate:.4f} vs {baseline:.4f} (a ratio needs hits on both)")
    out += [
        Figure("live_throughput", live.tokens / live.busy_s, "redis", base.tokens / base.busy_s,
               "tok/s", extra={"requests_s": len(live.latencies_s) / live.busy_s,
                               "redis_requests_s": len(base.latencies_s) / base.busy_s}),
        Figure("live_latency_p50", live.percentile_ms(0.5), "redis", base.percentile_ms(0.5),
               "ms", lower_is_better=True),
        Figure("live_latency_p99", live.percentile_ms(0.99), "redis", base.percentile_ms(0.99),
               "ms", lower_is_better=True),
    ]
    return out


# --- CLI -------------------------------------------------------------------------------------


def parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The whole CLI (for --help and the mode), and the live mode's own parser."""
    top = argparse.ArgumentParser(prog="trace_replay.py", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = top.add_subparsers(dest="mode", required=True)
    modes.add_parser("simulate", add_help=False,
                     help="bench/trace_sim.py (its arguments follow; simulate --help)")
    live = modes.add_parser("live", help="replay against a running daemon and redis-server")
    live.add_argument("--trace", type=Path, default=trace_sim.DEFAULT_TRACE)
    live.add_argument("--target", metavar="HOST:PORT",
                      help="a running kvstore daemon, used as it is (default: start one)")
    live.add_argument("--capacity", type=float, default=0.1,
                      help="cache size: below 1 a fraction of the trace's distinct blocks, "
                           "else a number of blocks (default 0.1)")
    live.add_argument("--block-bytes", type=parse_size, default=4096,
                      help="payload per 512-token block, e.g. 4096 or 16KiB (default 4096)")
    live.add_argument("--requests", type=int, help="replay only the first N requests")
    live.add_argument("--json", type=Path, metavar="PATH", help="write the report here")
    live.add_argument("--quick", action="store_true",
                      help=f"the first {QUICK_REQUESTS} requests (unless --requests is given)")
    return top, live


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["simulate"]:
        return trace_sim.main(argv[1:])
    top, live = parsers()
    args = top.parse_args(argv)
    if not (math.isfinite(args.capacity) and args.capacity > 0):
        live.error(f"--capacity must be > 0 (a fraction below 1, or blocks), got {args.capacity}")
    if not 0 < args.block_bytes <= MAX_BLOCK_BYTES:
        live.error(f"--block-bytes must be 1..{format_size(MAX_BLOCK_BYTES)}, "
                   f"got {args.block_bytes}")
    if args.requests is not None and args.requests <= 0:
        live.error(f"--requests must be >= 1, got {args.requests}")
    if args.quick and args.requests is None:
        args.requests = QUICK_REQUESTS
    try:
        requests = trace_sim.load_trace(args.trace)[: args.requests]
    except trace_sim.TraceError as exc:
        print(f"trace_replay.py live: error: {exc}", file=sys.stderr)
        return 2
    return run_main(args, lambda args: run(args, requests), printed=True)


if __name__ == "__main__":
    sys.exit(main())
