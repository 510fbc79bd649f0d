"""Time to first token with the prefix in the store, against recomputing it, in one run; and a
scaled replay of the Mooncake trace with the store against without it.

- ttft_l2, ttft_l3, ttft_l4: TTFT of a request = a `--prefix-tokens` shared prefix + 32 fresh
  tokens, on a fresh engine (its own prefix cache is empty) whose store holds the prefix, which
  an earlier engine computed and offloaded: in the daemon's L2; in its L3 (filler puts made
  the mover demote every prefix block, then the fillers were evicted); in L4 (another engine
  wrote it through daemon A to a real redis-server; the reader's daemon B never held it and
  fetches it from Redis; skipped without `redis-server`). Baseline: the same prompts on an
  engine without a store and without prefix caching (full recompute). Median of `--reps`,
  each rep with other 32 suffix tokens and a fresh reader after a warm-up request. The
  figure's `store_tokens` is the fewest prompt tokens a rep loaded from the store (target of
  ttft_l2: <= 0.2x the recompute TTFT, i.e. ratio >= 5x), `decisions` each rep's
  load-or-recompute reason: the readers keep the default store_load_policy "auto", and one
  that has timed no long prefill yet loads ("no estimate yet"; bench/engine_mixed.py measures
  the rule). The `#` lines also give the floor: the same prompt served from the writer's own
  prefix cache (no load; the suffix computed).
- replay_prefill_saved, replay_throughput: `--replay-requests` requests of the Mooncake trace,
  one at a time in trace order, through an engine with a store and one without (the same small
  local KV cache: one long request's worth, so the local prefix cache cannot hold the working
  set). Each hash id (512 tokens in the trace) becomes `--tokens-per-hash` deterministic random
  tokens, so shared hash ids are shared prefixes; outputs are capped at `--replay-max-tokens`.
  The trace reuses a prefix ~1,650 requests later (median) and its first 40 requests share
  none, so the default slice takes whole prefix groups (requests with the same first hash id)
  in a seeded random order and keeps the first N in trace order (`--replay-slice head`: the
  first N; see bench/engine_replay.py). prefill_saved: prompt tokens computed / prompt tokens,
  with the store vs without (ratio = computed without / computed with); throughput: prompt
  tokens per second of the whole replay (the same requests: the ratio of requests/s).

Models are random Llamas written here (heads of 64, 4 query heads per KV head, vocab 4,096):
hidden 1024 x 8 layers for TTFT (prefill of 2k tokens takes seconds on this CPU), 512 x 4 for
the replay; --quick uses 256 x 2 for both. With CUDA the same runs on the GPU (bfloat16) with
2048 x 16 and 1024 x 8 and a 4k prefix; that path has not been run yet. Prints `bench <name>:
<ours> <unit> vs <baseline name> <baseline> <unit> = <ratio>x` (ratio > 1: the store is
better), `#` info lines and, with `--json PATH`, JSON there.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from engine_replay import TRACE, replay, requests_of, trace_slice
from figures import Figure, run_main

from kvstore.client import KVStoreClient
from kvstore.engine import LLM, SamplingParams
from kvstore.engine.random_model import save_random_llama
from kvstore.keys import BlockKey, prefix_keys
from kvstore.tools.testing import Daemon, start_daemon, start_redis_on
from kvstore.units import KiB, MiB

BLOCK = 16  # tokens per engine block and per store key (the engine's default)
SUFFIX_TOKENS = 32
VOCAB = 4096
FILLER = bytes(256 * KiB)
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
WARM = random.Random(7)


def shown(figure: Figure) -> Figure:
    print(figure.line(), flush=True)
    return figure


def info(text: str) -> None:
    print(f"# {text}", flush=True)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB - 1) for _ in range(n)]


def save_llama(folder: Path, hidden: int, layers: int, seed: int = 0) -> Path:
    """A random Llama of the given width and depth (64-wide heads, 4 query heads per KV head)."""
    return Path(save_random_llama(
        folder, vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_layers=layers, num_heads=hidden // 64, num_kv_heads=max(1, hidden // 256),
        max_position_embeddings=8192, seed=seed,
    ))


def engine(model: Path, args: argparse.Namespace, store: str | None, num_blocks: int,
           **overrides: Any) -> LLM:
    """An engine after one short warm-up request, so that first-call costs are not timed."""
    llm = LLM(str(model), device=args.device, store=store, num_blocks=num_blocks,
              store_timeout_s=args.store_timeout_s, **overrides)
    llm.generate([random_tokens(WARM, BLOCK + 1)], ONE)
    return llm


def ttft_of(llm: LLM, prompt: list[int]) -> tuple[float, int, str]:
    """(TTFT in ms, prompt tokens loaded from the store, the store decision) of one request."""
    [out] = llm.generate([prompt], ONE)
    m = out.metrics
    return m.ttft_s * 1e3, m.store_prompt_tokens, m.store_decision


def block_bytes_of(llm: LLM) -> int:
    kv = llm.runner.kv_cache
    return int(kv.numel() // llm.block_manager.num_blocks * kv.element_size())


_SOCKETS = itertools.count()


def daemon(stack: ExitStack, workdir: Path, block_bytes: int, l2_bytes: int,
           *settings: str) -> Daemon:
    """A daemon whose pages fit the engine's blocks, with a Unix socket as a co-located
    engine's daemon has (the Helm chart's): the engine's loads take the local path, not gRPC;
    stopped on the way out."""
    page = max(4 * KiB, min(64 * KiB, 1 << (block_bytes.bit_length() - 1)))
    socket = workdir / f"kvstore-{next(_SOCKETS)}.sock"  # its own, even after others stopped
    started = start_daemon(workdir, "hbm.mode=off", "log_level=WARNING",
                           f"dram.capacity_bytes={l2_bytes}", f"dram.page_size_bytes={page}",
                           f"nvme.page_size_bytes={page}", f"server.unix_socket={socket}",
                           *settings)
    stack.callback(started.stop)
    return started


def wait_tiers(kv: KVStoreClient, keys: list[BlockKey], want: str, timeout_s: float = 60.0
               ) -> None:
    deadline = time.monotonic() + timeout_s
    while (tiers := kv.lookup(keys).tiers) != [want] * len(keys):
        if time.monotonic() > deadline:
            raise RuntimeError(f"prefix blocks not all in {want} after {timeout_s} s: "
                               f"{dict(Counter(tiers))}")
        time.sleep(0.01)


def evict_all(kv: KVStoreClient, timeout_s: float = 30.0) -> None:
    """Evict the client's namespace from every local tier, retrying blocks busy right now."""
    deadline = time.monotonic() + timeout_s
    while kv.evict(all=True).skipped:
        if time.monotonic() > deadline:
            raise RuntimeError(f"blocks of {kv.namespace} still busy after {timeout_s} s")
        time.sleep(0.01)


def push_to_l3(kv: KVStoreClient, fill: KVStoreClient, keys: list[BlockKey], l2_bytes: int
               ) -> None:
    """Put fillers (another namespace) until the mover demoted every prefix block to L3, then
    evict the fillers, so the prefix is in L3 only and L2 has room to load it. Each filler is
    read back once: the prefix was used again, so it is hot and would outlive fillers used
    once for eight turnovers of L2; read, the fillers are hot too, and newer."""
    filled = 0
    while (tiers := kv.lookup(keys).tiers) != ["nvme"] * len(keys):
        if None in tiers:
            raise RuntimeError("a prefix block left every tier while being pushed to L3")
        if filled > 4 * l2_bytes:
            raise RuntimeError(f"prefix still in L2 after {filled} B of fillers: {tiers}")
        fillers = [BlockKey(secrets.token_bytes(32)) for _ in range(8)]
        fill.put(fillers, [FILLER] * 8, independent=True)
        fill.get(fillers)
        filled += 8 * len(FILLER)
        time.sleep(0.005)  # the mover's turn (movers.interval_s=0.01)
    evict_all(fill)
    wait_tiers(kv, keys, "nvme")


@dataclass
class Ttft:
    """The shared prefix (every prompt adds fresh suffix tokens, so no suffix block is ever
    in the store) and what the runs so far found out."""

    args: argparse.Namespace
    workdir: Path
    model: Path
    rng: random.Random
    prefix: list[int]
    base_ms: list[float] = field(default_factory=list)
    block_bytes: int = 0
    namespace: str = ""
    floor: dict[str, float] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return (len(self.prefix) + SUFFIX_TOKENS) // BLOCK + 8

    @property
    def l2_bytes(self) -> int:
        return -(-max(16 * MiB, 4 * self.prefix_bytes) // MiB) * MiB

    @property
    def prefix_bytes(self) -> int:
        return len(self.prefix) // BLOCK * self.block_bytes

    @property
    def keys(self) -> list[BlockKey]:
        return prefix_keys(self.prefix, BLOCK, self.namespace)

    def prompt(self) -> list[int]:
        return self.prefix + random_tokens(self.rng, SUFFIX_TOKENS)

    def baseline(self) -> LLM:
        """The recompute engine: no store, no prefix caching (its block size is needed first)."""
        llm = engine(self.model, self.args, None, self.num_blocks, enable_prefix_caching=False)
        self.block_bytes, self.namespace = block_bytes_of(llm), llm.namespace
        return llm

    def write(self, target: str) -> None:
        """An engine on target computes (and offloads) the prefix; its TTFT, and that of the
        prefix from its own prefix cache (the floor: no load, the suffix computed) are kept."""
        with engine(self.model, self.args, target, self.num_blocks) as llm:
            self.floor["writer_ms"] = ttft_of(llm, self.prompt())[0]
            if llm.connector is not None:  # its offloads would compete for the CPU
                llm.connector.flush(timeout_s=60.0)
            self.floor["local_hit_ms"] = ttft_of(llm, self.prompt())[0]

    def daemon(self, stack: ExitStack, *settings: str) -> Daemon:
        return daemon(stack, self.workdir, self.block_bytes, self.l2_bytes, *settings)

    def reps(self, target: str, prepare: Callable[[], None]
             ) -> tuple[list[float], list[int], list[str]]:
        """(TTFT, store tokens, store decision) per rep of fresh engines on target."""
        ms, loaded, decisions = [], [], []
        for _ in range(self.args.reps):
            prepare()
            with engine(self.model, self.args, target, self.num_blocks) as llm:
                one_ms, tokens, decision = ttft_of(llm, self.prompt())
            ms.append(one_ms)
            loaded.append(tokens)
            decisions.append(decision)
        return ms, loaded, decisions

    def figure(self, name: str, ms: list[float], loaded: list[int], decisions: list[str],
               **extra: Any) -> Figure:
        info(f"{name}: TTFT {[round(m) for m in ms]} ms, store tokens {loaded}, decisions "
             f"{dict(Counter(decisions))}")
        return shown(Figure(name, statistics.median(ms), "recompute",
                            statistics.median(self.base_ms), "ms", lower_is_better=True,
                            target=">= 5x" if name == "ttft_l2" else "",
                            extra={"store_tokens": min(loaded), "store_tokens_reps": loaded,
                                   "decisions": decisions,
                                   "ms_reps": ms, "recompute_ms_reps": self.base_ms,
                                   "prefix_tokens": len(self.prefix),
                                   "suffix_tokens": SUFFIX_TOKENS, **self.floor, **extra}))


def remote_hits(kv: KVStoreClient) -> int:
    return sum(t.hits for t in kv.stats().tiers if t.tier == "remote")


def local_figures(run: Ttft, stack: ExitStack, base: LLM) -> list[Figure]:
    """The recompute baseline, then ttft_l2 and ttft_l3 on one daemon with L2 and L3."""
    local = run.daemon(stack, "movers.interval_s=0.01",
                       f"nvme.capacity_bytes={4 * run.l2_bytes + run.prefix_bytes}")
    run.write(local.target)  # also this process's first long prefill: untimed warm-up
    run.base_ms = [ttft_of(base, run.prompt())[0] for _ in range(run.args.reps)]
    info(f"recompute: {len(run.prefix) + SUFFIX_TOKENS}-token prompt, TTFT median "
         f"{statistics.median(run.base_ms):.0f} ms; the writer (store on) "
         f"{run.floor['writer_ms']:.0f} ms; the prefix from the writer's own prefix cache "
         f"{run.floor['local_hit_ms']:.0f} ms (the floor)")
    keys = run.keys
    kv = stack.enter_context(KVStoreClient(local.target, run.namespace))
    fill = stack.enter_context(KVStoreClient(local.target, "ttft-fillers"))
    l2 = run.reps(local.target, lambda: wait_tiers(kv, keys, "dram"))
    l3 = run.reps(local.target, lambda: push_to_l3(kv, fill, keys, run.l2_bytes))
    return [run.figure("ttft_l2", *l2), run.figure("ttft_l3", *l3)]


def l4_figure(run: Ttft, stack: ExitStack) -> Figure:
    """ttft_l4: daemon A writes through to Redis; the readers' daemon B never held the prefix
    (its local copies are evicted before every rep)."""
    redis = start_redis_on(run.workdir)
    stack.callback(redis.stop)
    a, b = (run.daemon(stack, "nvme.enabled=false", f"remote.url={redis.url}")
            for _ in range(2))
    run.write(a.target)
    keys = run.keys
    kv_b = stack.enter_context(KVStoreClient(b.target, run.namespace))
    wait_tiers(kv_b, keys, "remote")  # A's write-through is asynchronous
    hits = remote_hits(kv_b)

    def from_redis() -> None:
        evict_all(kv_b)
        wait_tiers(kv_b, keys, "remote")

    ms, loaded, decisions = run.reps(b.target, from_redis)
    return run.figure("ttft_l4", ms, loaded, decisions, remote_hits=remote_hits(kv_b) - hits)


def ttft_figures(args: argparse.Namespace, workdir: Path) -> list[Figure]:
    model = save_llama(workdir / f"ttft-h{args.hidden}-l{args.layers}", args.hidden, args.layers)
    rng = random.Random(1)
    run = Ttft(args, workdir, model, rng, random_tokens(rng, args.prefix_tokens))
    base = run.baseline()
    info(f"model {args.hidden} x {args.layers} layers on {args.device}; a block = {BLOCK} tokens "
         f"x all layers' K+V = {run.block_bytes // KiB} KiB; prefix {len(run.prefix)} tokens = "
         f"{run.prefix_bytes / MiB:.1f} MiB; L2 {run.l2_bytes // MiB} MiB")
    with ExitStack() as stack:
        figures = local_figures(run, stack, base)
    del base
    if shutil.which("redis-server") is None:
        info("ttft_l4 skipped: redis-server is not on PATH")
        return figures
    with ExitStack() as stack:
        return [*figures, l4_figure(run, stack)]


def replay_figures(args: argparse.Namespace, workdir: Path) -> list[Figure]:
    if not args.trace.exists():
        info(f"replay skipped: no trace at {args.trace}")
        return []
    rows = trace_slice(args.trace, args.replay_requests, args.replay_slice, args.replay_seed)
    requests = requests_of(rows, args.tokens_per_hash, args.replay_max_tokens, VOCAB)
    model = save_llama(workdir / f"replay-h{args.replay_hidden}-l{args.replay_layers}",
                       args.replay_hidden, args.replay_layers)
    num_blocks = max(-(-(len(p) + t) // BLOCK) for p, t in requests) + 4  # the longest fits
    llm = engine(model, args, None, num_blocks)
    base, block_bytes = replay(llm, requests), block_bytes_of(llm)
    del llm
    total_blocks = sum(len(p) + t for p, t in requests) // BLOCK + len(requests)
    l2_bytes = -(-max(64 * MiB, 2 * total_blocks * block_bytes) // MiB) * MiB
    with ExitStack() as stack:
        store = daemon(stack, workdir, block_bytes, l2_bytes, "nvme.enabled=false")
        with engine(model, args, store.target, num_blocks) as llm:
            ours = replay(llm, requests)
    for name, r in (("store", ours), ("no store", base)):
        info(f"replay {name}: {r.prompt_tokens} prompt tokens, {r.store_tokens} from the "
             f"store, {r.local_tokens} from the local prefix cache, {r.computed} computed; "
             f"{r.requests} requests in {r.seconds:.1f} s = {r.requests / r.seconds:.2f} req/s")
    extra = {"requests": ours.requests, "slice": args.replay_slice, "seed": args.replay_seed,
             "tokens_per_hash": args.tokens_per_hash, "local_blocks": num_blocks,
             "prompt_tokens": ours.prompt_tokens, "computed_tokens": ours.computed,
             "store_tokens": ours.store_tokens, "local_tokens": ours.local_tokens,
             "baseline_computed_tokens": base.computed, "baseline_local_tokens": base.local_tokens,
             "seconds": ours.seconds, "baseline_seconds": base.seconds}
    return [shown(Figure("replay_prefill_saved", ours.computed / ours.prompt_tokens, "no store",
                         base.computed / base.prompt_tokens, "ratio", lower_is_better=True,
                         extra=extra)),
            shown(Figure("replay_throughput", ours.prompt_tokens / ours.seconds, "no store",
                         base.prompt_tokens / base.seconds, "tok/s", extra=extra))]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--hidden", type=int, help="TTFT model width (default 1024; 2048 on CUDA)")
    add("--layers", type=int, help="TTFT model layers (default 8; 16 on CUDA)")
    add("--prefix-tokens", type=int, help="shared prefix (default 2048; 4096 on CUDA)")
    add("--reps", type=int, default=5, help="TTFT reps per figure (median)")
    add("--store-timeout-s", type=float, default=10.0, help="the engines' store_timeout_s")
    add("--trace", type=Path, default=TRACE, help="Mooncake-format JSONL trace")
    add("--replay-requests", type=int, default=40)
    add("--replay-slice", choices=("groups", "head"), default="groups",
        help="whole prefix groups in a seeded order (default), or the first N requests")
    add("--replay-seed", type=int, default=0)
    add("--tokens-per-hash", type=int, default=32, help="tokens per trace hash id (trace: 512)")
    add("--replay-max-tokens", type=int, default=4, help="cap on each request's output")
    add("--replay-hidden", type=int, help="replay model width (default 512; 1024 on CUDA)")
    add("--replay-layers", type=int, help="replay model layers (default 4; 8 on CUDA)")
    add("--quick", action="store_true", help="a tiny smoke run (overrides the sizes)")
    add("--json", type=Path, metavar="PATH", help="also write one JSON object to PATH")
    args = parser.parse_args(argv)
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    big = args.device == "cuda"
    defaults = {"hidden": (1024, 2048), "layers": (8, 16), "prefix_tokens": (2048, 4096),
                "replay_hidden": (512, 1024), "replay_layers": (4, 8)}
    for name, (cpu, cuda) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, cuda if big else cpu)
    if args.quick:
        args.hidden = args.replay_hidden = 256
        args.layers = args.replay_layers = 2
        args.prefix_tokens, args.reps, args.replay_requests = 256, 1, 8
    if args.hidden % 256 or args.replay_hidden % 256 or args.prefix_tokens % BLOCK:
        parser.error(f"widths must be multiples of 256, --prefix-tokens of {BLOCK}")
    if args.tokens_per_hash % BLOCK or min(args.reps, args.replay_requests) < 1:
        parser.error(f"--tokens-per-hash must be a multiple of {BLOCK}; counts >= 1")
    return args


def all_figures(args: argparse.Namespace) -> tuple[list[Figure], dict[str, Any]]:
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    info(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device}")
    with tempfile.TemporaryDirectory(prefix="engine-ttft-") as tmp:
        figures = ttft_figures(args, Path(tmp)) + replay_figures(args, Path(tmp))
    elapsed = time.perf_counter() - start
    info(f"done in {elapsed:.0f} s")
    setup = {key: str(value) if isinstance(value, Path) else value
             for key, value in vars(args).items()}
    setup |= {"threads": torch.get_num_threads(), "cpus": os.cpu_count(), "seconds": elapsed,
              "loadavg_1m": [load_before, os.getloadavg()[0]]}
    return figures, setup


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args(argv), all_figures, printed=True)


if __name__ == "__main__":
    sys.exit(main())
