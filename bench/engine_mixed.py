"""The engine's asynchronous store loads and its load-or-recompute rule, each against its
baseline in the same run.

- mixed_tpot: decodes keep their pace while other requests load. A daemon's L2 holds prefixes
  an earlier engine computed; a fresh reader engine (after prefills of its own, so "auto"
  decides by cost) steps `--decodes` decode requests (16-token prompts, `--decode-tokens`
  generated) with `add_request`/`step`. In a "loads" phase, every `--every-steps` steps while
  they decode, a request = a stored prefix + `--arrival-tokens` fresh tokens (max_tokens=1)
  arrives: its lookup and load run on the loader threads while the batch keeps stepping, then
  it joins the batch for its fresh tokens. "none" runs the same decodes with no arrivals.
  Figure: the decodes' TPOT (median over them of RequestMetrics.tpot_s: the wall time between
  their tokens, so whatever the loads take from the step loop counts, and so do the arrivals'
  own tokens), median over `--reps` phases of each, ordered A B B A ...; ratio = no-loads TPOT /
  with-loads TPOT, target >= 0.91x (TPOT with loads <= 1.1x). Both start with the engine's
  prefix cache reset, so every arrival loads. A third phase, "local", right after each "loads",
  sends the same arrivals while their prefixes are still in the engine's own prefix cache: their
  compute without a load, which splits the difference in two (`#` lines, JSON). `#` lines also
  give the steps after which a load was in flight, the arrivals' TTFT and decisions, and the
  CPU seconds of this process and of the daemon per phase.
- policy_l4_fast, policy_l4_mid, policy_l4_slow: the rule follows the better choice as L4
  slows. Daemon A writes prefixes through to a real redis-server; the readers' daemon B reaches
  it through a SlowLink (kvstore/tools/slowlink.py) holding every reply `delay`: 0, then
  `--mid-delay` and `--slow-delay` times the recompute TTFT measured first. Every policy pays
  the Lookup's delay (it asks Redis); a load pays about one more (the Prefetch reads Redis), so
  loading stops paying at a delay near the recompute: mid is in between, slow past it. Per
  delay, a fresh reader engine per store_load_policy (auto, always, never), after prefills of
  its own; each rep asks each one for its own prefix, which only Redis holds (never asked twice:
  a Lookup's Prefetch brings a hit up to L2 even when the rule computes; B's copies are evicted
  between delays). The first rep, where auto learns L4's cost from its first load, is reported
  apart (`#` lines, JSON `first_rep`); the figure is auto's median TTFT over the
  `--policy-reps` reps after it vs the better of always's and never's (target >= 0.9x, within
  10%). Skipped without `redis-server`.

Model: a random Llama 512 x 4 (bench/engine_ttft.py's replay model, 4 KiB of K/V per token): a
decode step of 8 requests takes tens of ms on a 2-core CPU, a load of a 1k-token prefix (4 MiB)
overlaps a step, and recomputing 1k tokens takes under a second, so the slow link's delays stay
seconds (1024 x 8: ~120 ms a step, tens of seconds a slow rep). --quick: 256 x 2, 256-token
prefixes, fewer and shorter requests and reps. Prints `bench <name>: <ours> <unit> vs <baseline
name> <baseline> <unit> = <ratio>x` (ratio > 1: ours is better), `#` info lines and, with
`--json PATH`, JSON there.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import engine_ttft as ttft
import torch
from engine_ttft import BLOCK, ONE, info, random_tokens, shown
from figures import Figure, run_main

from kvstore.client import KVStoreClient
from kvstore.engine import LLM, SamplingParams
from kvstore.engine.outputs import RequestMetrics, RequestOutput
from kvstore.engine.sequence import SeqStatus
from kvstore.keys import BlockKey, prefix_keys
from kvstore.tools.slowlink import SlowLink
from kvstore.tools.testing import start_redis_on
from kvstore.units import MiB

DECODE_PROMPT_TOKENS = BLOCK  # one block: nothing to look up (the last token is computed)
POLICY_SUFFIX_TOKENS = 32
POLICIES = ("auto", "always", "never")
WARM = random.Random(11)


def new_engine(model: Path, args: argparse.Namespace, store: str | None, num_blocks: int,
               timeout_s: float | None = None, **overrides: Any) -> LLM:
    """An engine after one short request, so that first-call costs are not timed."""
    llm = LLM(str(model), device=args.device, store=store, num_blocks=num_blocks,
              store_timeout_s=timeout_s or args.store_timeout_s, **overrides)
    llm.generate([random_tokens(WARM, BLOCK + 1)], ONE)
    return llm


def warm_prefill(llm: LLM, prefix_tokens: int) -> None:
    """Prefills of the engine's own (half a prefix, then a whole one), so that its prefill
    model can estimate what computing a hit costs: "auto" decides by cost from here on."""
    for tokens in (prefix_tokens // 2, prefix_tokens):
        llm.generate([random_tokens(WARM, tokens + BLOCK)],
                     SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))


def write_prefixes(model: Path, args: argparse.Namespace, target: str,
                   prefixes: list[list[int]]) -> None:
    """An engine on target computes every prefix (a few at a time) and offloads it."""
    batch = 4
    num_blocks = batch * (max(map(len, prefixes)) // BLOCK + 2) + 8
    with new_engine(model, args, target, num_blocks) as llm:
        for start in range(0, len(prefixes), batch):
            llm.generate([p + random_tokens(WARM, BLOCK) for p in prefixes[start:start + batch]],
                         ONE)
        if llm.connector is not None:
            llm.connector.flush(timeout_s=120.0)


def keys_of(prefixes: list[list[int]], namespace: str) -> list[BlockKey]:
    return [key for p in prefixes for key in prefix_keys(p, BLOCK, namespace)]


def mib(nbytes: int) -> int:
    """nbytes rounded up to whole MiB."""
    return -(-nbytes // MiB) * MiB


# --- mixed_tpot ------------------------------------------------------------------------------


def loading(llm: LLM) -> int:
    """Requests waiting on a load from the store right now."""
    return sum(seq.status is SeqStatus.LOADING for seq in llm.scheduler.waiting)


@dataclass
class Phase:
    kind: str
    """"loads", "local" (the arrivals' prefixes in the engine's own prefix cache) or "none"."""
    tpot_ms: float
    """Median over the decodes of their TPOT."""
    step_ms: float
    """Median step after the decodes' first (prefill) step, until the last decode finished."""
    steps: int
    loading_steps: int
    """Of those steps, the ones after which a load was in flight."""
    arrivals: list[RequestMetrics]
    wall_s: float
    cpu_s: float
    """CPU seconds of this process (the engine and its loader threads) in the phase."""
    daemon_cpu_s: float

    def summary(self) -> dict[str, Any]:
        """For the JSON: every field, the arrivals as the prompt tokens each loaded."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "arrivals"}
        return out | {"arrival_store_tokens": [m.store_prompt_tokens for m in self.arrivals]}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; 0.0 elsewhere)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def run_phase(llm: LLM, rng: random.Random, args: argparse.Namespace, kind: str,
              prefixes: list[list[int]], daemon_pid: int) -> Phase:
    """--decodes decode requests stepped to the end; while they decode, every --every-steps
    steps one arrival = the next of prefixes + fresh tokens (none for kind "none"). "loads"
    first drops the engine's prefix cache, so that every arrival loads its prefix; "local"
    keeps it (run after "loads", which left every prefix there)."""
    if kind != "local":
        llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    decodes = {llm.add_request(random_tokens(rng, DECODE_PROMPT_TOKENS), params)
               for _ in range(args.decodes)}
    to_come = iter(prefixes if kind != "none" else [])
    wall, cpu, daemon_cpu = time.perf_counter(), time.process_time(), cpu_seconds(daemon_pid)
    done: dict[int, RequestOutput] = {}
    step_s: list[float] = []
    loading_steps = step = 0
    while llm.has_unfinished:
        decoding = not decodes <= done.keys()
        if decoding and step and step % args.every_steps == 0:
            prefix = next(to_come, None)
            if prefix is not None:
                llm.add_request(prefix + random_tokens(rng, args.arrival_tokens), ONE)
        start = time.perf_counter()
        done.update((out.request_id, out) for out in llm.step())
        if decoding and step:
            step_s.append(time.perf_counter() - start)
            loading_steps += loading(llm) > 0
        step += 1
    return Phase(kind, statistics.median(done[i].metrics.tpot_s for i in decodes) * 1e3,
                 statistics.median(step_s) * 1e3, len(step_s), loading_steps,
                 [out.metrics for i, out in done.items() if i not in decodes],
                 time.perf_counter() - wall, time.process_time() - cpu,
                 cpu_seconds(daemon_pid) - daemon_cpu)


ORDERS = (("loads", "local", "none"), ("none", "loads", "local"))
"""Phases per rep, alternating (A B B A ... for loads and none); local right after loads."""


def mixed_figure(args: argparse.Namespace, workdir: Path, model: Path, probe: LLM) -> Figure:
    rng = random.Random(2)
    tokens = args.mixed_prefix_tokens
    arrivals = (args.decode_tokens - 1) // args.every_steps  # the most one phase takes
    prefixes = [random_tokens(rng, tokens) for _ in range(arrivals)]
    block_bytes = ttft.block_bytes_of(probe)
    prefix_blocks = tokens // BLOCK
    l2_bytes = mib(max(64 * MiB, 2 * arrivals * (prefix_blocks + 1) * block_bytes))
    # Room for every prefix at once (the "local" phase) besides the decodes.
    num_blocks = (args.decodes * -(-(DECODE_PROMPT_TOKENS + args.decode_tokens) // BLOCK)
                  + (arrivals + 2) * (prefix_blocks + 1) + 16)
    with ExitStack() as stack:
        store = ttft.daemon(stack, workdir, block_bytes, l2_bytes, "nvme.enabled=false")
        write_prefixes(model, args, store.target, prefixes)
        kv = stack.enter_context(KVStoreClient(store.target, probe.namespace))
        ttft.wait_tiers(kv, keys_of(prefixes, probe.namespace), "dram")
        llm = stack.enter_context(new_engine(model, args, store.target, num_blocks))
        warm_prefill(llm, tokens)
        for kind in ORDERS[0]:  # untimed: the first of each kind
            run_phase(llm, rng, args, kind, prefixes, store.proc.pid)
        phases: dict[str, list[Phase]] = {kind: [] for kind in ORDERS[0]}
        for rep in range(args.reps):
            for kind in ORDERS[rep % 2]:
                phases[kind].append(run_phase(llm, rng, args, kind, prefixes, store.proc.pid))
    return mixed_report(args, phases, tokens)


def mixed_report(args: argparse.Namespace, phases: dict[str, list[Phase]],
                 prefix_tokens: int) -> Figure:
    ours, local, base = phases["loads"], phases["local"], phases["none"]
    came = [m for p in ours for m in p.arrivals]
    loaded = sum(m.store_prompt_tokens == prefix_tokens for m in came)
    steps = sum(p.steps for p in ours)
    in_flight = sum(p.loading_steps for p in ours)
    decisions = Counter(m.store_decision.split(" ~")[0] for m in came)
    for name, runs in (("with loads", ours), ("arrivals from the local prefix cache", local),
                       ("no loads", base)):
        info(f"mixed {name}: decode TPOT {[round(p.tpot_ms, 1) for p in runs]} ms (median "
             f"{statistics.median(p.tpot_ms for p in runs):.1f}), median step "
             f"{[round(p.step_ms, 1) for p in runs]} ms; per phase "
             f"{statistics.median(p.wall_s for p in runs):.1f} s wall, CPU "
             f"{statistics.median(p.cpu_s for p in runs):.1f} s engine process + "
             f"{statistics.median(p.daemon_cpu_s for p in runs):.1f} s daemon")
    info(f"mixed: {args.decodes} decodes of {args.decode_tokens} tokens; with loads, an arrival "
         f"every {args.every_steps} steps: {len(came)} arrivals, {loaded} loaded their whole "
         f"{prefix_tokens}-token prefix; a load in flight after {in_flight} of {steps} decode "
         f"steps; arrivals' TTFT median "
         f"{statistics.median(m.ttft_s for m in came) * 1e3:.0f} ms; decisions "
         f"{dict(decisions)}")
    return shown(Figure(
        "mixed_tpot", statistics.median(p.tpot_ms for p in ours), "no loads",
        statistics.median(p.tpot_ms for p in base), "ms", lower_is_better=True,
        target=">= 0.91x, i.e. TPOT with loads <= 1.1x",
        extra={"decodes": args.decodes, "decode_tokens": args.decode_tokens,
               "every_steps": args.every_steps, "arrival_tokens": args.arrival_tokens,
               "prefix_tokens": prefix_tokens, "arrivals": len(came), "arrivals_loaded": loaded,
               "arrival_ttft_ms": [m.ttft_s * 1e3 for m in came],
               "arrival_decisions": [m.store_decision for m in came],
               "decode_steps": steps, "steps_with_load_in_flight": in_flight,
               "local_tpot_ms": statistics.median(p.tpot_ms for p in local),
               "phases": {kind: [p.summary() for p in runs] for kind, runs in phases.items()}}))


# --- policy_l4_* -----------------------------------------------------------------------------


@dataclass
class Rep:
    ttft_ms: float
    store_tokens: int
    recomputed_tokens: int
    decision: str


@dataclass
class Link:
    """Daemon B behind the slow link, and the prefixes only Redis holds (by policy, rep)."""

    slow: SlowLink
    kv_b: KVStoreClient
    target: str
    prefixes: dict[tuple[str, int], list[int]]
    keys: list[BlockKey]


def policy_figures(args: argparse.Namespace, workdir: Path, model: Path,
                   probe: LLM) -> list[Figure]:
    if shutil.which("redis-server") is None:
        info("policy_l4_* skipped: redis-server is not on PATH")
        return []
    rng = random.Random(3)
    tokens = args.policy_prefix_tokens
    compute_ms = statistics.median(
        probe.generate([random_tokens(rng, tokens + POLICY_SUFFIX_TOKENS)], ONE)[0]
        .metrics.ttft_s * 1e3 for _ in range(3))
    delays_s = {"fast": 0.0, "mid": args.mid_delay * compute_ms / 1e3,
                "slow": args.slow_delay * compute_ms / 1e3}
    info(f"policy: {tokens + POLICY_SUFFIX_TOKENS}-token prompts, recompute TTFT median "
         f"{compute_ms:.0f} ms; L4 reply delays {[round(d * 1e3) for d in delays_s.values()]} "
         "ms")
    block_bytes = ttft.block_bytes_of(probe)
    prefixes = {(policy, rep): random_tokens(rng, tokens)
                for rep in range(args.policy_reps + 1) for policy in POLICIES}
    l2_bytes = mib(max(64 * MiB, 4 * len(prefixes) * (tokens // BLOCK + 1) * block_bytes))
    timeout_s = 4 * max(delays_s.values()) + 5  # Redis calls through the link
    with ExitStack() as stack:
        redis = start_redis_on(workdir)
        stack.callback(redis.stop)
        slow = stack.enter_context(SlowLink("127.0.0.1", redis.port, 0.0))
        a, b = (ttft.daemon(stack, workdir, block_bytes, l2_bytes, "nvme.enabled=false",
                            f"remote.url={url}", f"remote.timeout_s={timeout_s}")
                for url in (redis.url, slow.url))
        write_prefixes(model, args, a.target, list(prefixes.values()))
        kv_b = stack.enter_context(KVStoreClient(b.target, probe.namespace))
        keys = keys_of(list(prefixes.values()), probe.namespace)
        link = Link(slow, kv_b, b.target, prefixes, keys)
        ttft.wait_tiers(kv_b, link.keys, "remote")  # A's write-through is asynchronous
        return [policy_figure(args, model, link, name, delay_s, compute_ms, rng)
                for name, delay_s in delays_s.items()]


@contextmanager
def readers(args: argparse.Namespace, model: Path, target: str, timeout_s: float
            ) -> Iterator[dict[str, LLM]]:
    """A fresh engine per policy on target, each after a prefill of its own."""
    tokens = args.policy_prefix_tokens
    num_blocks = 2 * (tokens + POLICY_SUFFIX_TOKENS) // BLOCK + 8
    with ExitStack() as stack:
        engines = {policy: stack.enter_context(
            new_engine(model, args, target, num_blocks, timeout_s, store_load_policy=policy))
            for policy in POLICIES}
        for llm in engines.values():
            warm_prefill(llm, tokens)
        yield engines


def policy_figure(args: argparse.Namespace, model: Path, link: Link, name: str,
                  delay_s: float, compute_ms: float, rng: random.Random) -> Figure:
    """Every policy's TTFT with L4 `delay_s` away; the prefixes are in Redis only."""
    link.slow.delay_s = delay_s
    ttft.evict_all(link.kv_b)  # what earlier readers brought up or computed
    ttft.wait_tiers(link.kv_b, link.keys, "remote", timeout_s=60.0 + 4 * delay_s)
    runs: dict[str, list[Rep]] = {policy: [] for policy in POLICIES}
    with readers(args, model, link.target, args.store_timeout_s + 4 * delay_s) as engines:
        for rep in range(args.policy_reps + 1):
            for policy in POLICIES[rep % 3:] + POLICIES[:rep % 3]:  # each goes first in turn
                prompt = link.prefixes[(policy, rep)] + random_tokens(rng, POLICY_SUFFIX_TOKENS)
                [out] = engines[policy].generate([prompt], ONE)
                m = out.metrics
                runs[policy].append(Rep(m.ttft_s * 1e3, m.store_prompt_tokens,
                                        m.store_recomputed_tokens, m.store_decision))
    return policy_report(f"policy_l4_{name}", runs, delay_s, compute_ms)


def policy_report(name: str, runs: dict[str, list[Rep]], delay_s: float,
                  compute_ms: float) -> Figure:
    median = {p: statistics.median(r.ttft_ms for r in reps[1:]) for p, reps in runs.items()}
    best = min(("always", "never"), key=median.__getitem__)
    first = runs["auto"][0]
    info(f"{name}: L4 reply delay {delay_s * 1e3:.0f} ms ({delay_s * 1e3 / compute_ms:.2f}x "
         f"the recompute); TTFT median of reps 2..{len(runs['auto'])}: "
         + ", ".join(f"{p} {median[p]:.0f} ms" for p in POLICIES))
    info(f"{name}: auto's first rep (it learns L4's cost): {first.ttft_ms:.0f} ms, "
         f"{first.store_tokens} tokens loaded, {first.decision!r}; after it: "
         + "; ".join(f"{r.ttft_ms:.0f} ms {r.decision!r}" for r in runs["auto"][1:]))
    return shown(Figure(
        name, median["auto"], f"policy {best}", median[best], "ms", lower_is_better=True,
        target=">= 0.9x vs the better of always and never",
        extra={"delay_ms": delay_s * 1e3, "recompute_ms": compute_ms, "best_fixed": best,
               "never_compute_ms": median["never"] - delay_s * 1e3,
               "medians_ms": median, "reps": len(runs["auto"]) - 1,
               "note": "medians over the reps after the first; first_rep: auto learns L4's "
                       "cost from its first load",
               "first_rep": {p: asdict(reps[0]) for p, reps in runs.items()},
               "runs": {p: [asdict(r) for r in reps[1:]] for p, reps in runs.items()}}))


# --- the script ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--hidden", type=int, default=512, help="model width")
    add("--layers", type=int, default=4, help="model layers")
    add("--decodes", type=int, default=8, help="decode requests per phase")
    add("--decode-tokens", type=int, default=48, help="tokens each decode request generates")
    add("--every-steps", type=int, default=1, help="an arrival every this many steps")
    add("--arrival-tokens", type=int, default=4, help="fresh tokens after an arrival's prefix")
    add("--mixed-prefix-tokens", type=int, default=1024, help="each arrival's stored prefix")
    add("--reps", type=int, default=6, help="phases of each kind (median)")
    add("--policy-prefix-tokens", type=int, default=1024, help="prefix of the policy figures")
    add("--policy-reps", type=int, default=5, help="reps per policy after the first")
    add("--mid-delay", type=float, default=0.5, help="mid L4 delay, x the recompute TTFT")
    add("--slow-delay", type=float, default=3.0, help="slow L4 delay, x the recompute TTFT")
    add("--store-timeout-s", type=float, default=10.0, help="the engines' store_timeout_s "
        "(the policy readers add 4x the delay)")
    add("--only", choices=("mixed", "policy"), help="run one of the two parts")
    add("--quick", action="store_true", help="a tiny smoke run (overrides the sizes)")
    add("--json", type=Path, metavar="PATH", help="also write one JSON object to PATH")
    args = parser.parse_args(argv)
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        args.hidden, args.layers, args.decodes, args.decode_tokens = 256, 2, 4, 12
        args.mixed_prefix_tokens = args.policy_prefix_tokens = 256
        args.reps, args.policy_reps = 2, 1
    if args.hidden % 256 or min(args.mixed_prefix_tokens, args.policy_prefix_tokens) % BLOCK:
        parser.error(f"--hidden must be a multiple of 256, prefix tokens of {BLOCK}")
    if min(args.layers, args.decodes, args.every_steps, args.arrival_tokens, args.reps,
           args.policy_reps, args.mixed_prefix_tokens, args.policy_prefix_tokens) < 1:
        parser.error("counts must be >= 1")
    if args.decode_tokens <= args.every_steps:
        parser.error("--decode-tokens must exceed --every-steps: no arrival would come")
    if not 0 < args.mid_delay < args.slow_delay:
        parser.error("need 0 < --mid-delay < --slow-delay")
    return args


def all_figures(args: argparse.Namespace) -> tuple[list[Figure], dict[str, Any]]:
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    info(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device}; model "
         f"{args.hidden} x {args.layers} layers")
    with tempfile.TemporaryDirectory(prefix="engine-mixed-") as tmp:
        workdir = Path(tmp)
        model = ttft.save_llama(workdir / f"h{args.hidden}-l{args.layers}", args.hidden,
                                args.layers)
        longest = max(args.mixed_prefix_tokens, args.policy_prefix_tokens) + POLICY_SUFFIX_TOKENS
        with new_engine(model, args, None, longest // BLOCK + 8,
                        enable_prefix_caching=False) as probe:  # recomputes; block size
            warm_prefill(probe, longest)  # its first long prefills are not the recompute's
            figures = [] if args.only == "policy" else [mixed_figure(args, workdir, model, probe)]
            if args.only != "mixed":
                figures += policy_figures(args, workdir, model, probe)
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
