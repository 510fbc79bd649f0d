"""vLLM's time to first token with a prompt's prefix in kvstore (loaded by KVStoreConnector)
against recomputing it, in one run: `make bench-vllm` (vLLM's virtualenv, .venv-vllm).

vLLM on the CPU runs a random Llama large enough that prefill dominates (hidden 1024 x 8
layers, heads of 64, 4 KV heads; --quick: 512 x 4) with its own prefix cache off, so every hit
is the store's. Each rep sends a fresh `--prompt-tokens` prompt (a store miss: vLLM computes
it, and the connector saves its full blocks) and then the same prompt again (a store hit: the
full blocks are loaded, the last partial block computed). Baseline = the miss: it pays the
connector's Lookup and the copy-out of its blocks for saving, a few ms against seconds of
prefill, so the ratio is if anything understated. Rep order interleaves the two.

- vllm_ttft_l2: the prefix in the daemon's L2 (shared memory; the engine reads it through
  its shared-memory mapping, co-located).
- vllm_ttft_l3: the prefix in L3 only (fillers made the mover demote every prefix block,
  then were evicted; bench/engine_ttft.py's push_to_l3). L3 is a file on this machine's disk,
  through the page cache: on a GDS node the read is NVMe's.

Each tier runs in its own process (vLLM starts its engine per process) against its own daemon.
Prints `bench <name>: <ours> ms vs recompute <baseline> ms = <ratio>x` and `#` lines; with
`--json PATH`, JSON there. Target (issue 18): >= 3x from L2.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from engine_ttft import daemon, evict_all, push_to_l3
from figures import Figure, run_main

from kvstore.client import KVStoreClient
from kvstore.engine.random_model import save_random_llama
from kvstore.keys import prefix_keys
from kvstore.units import MiB

BLOCK = 128  # vLLM's CPU default block size
VOCAB = 4096
HERE = Path(__file__).resolve().parent


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine: reps of (fresh prompt: recompute, same prompt again: from the store)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the connector is reachable here
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="float32", seed=0,
              max_model_len=spec["prompt_tokens"] + 64, enforce_eager=True,
              enable_prefix_caching=False, kv_cache_memory_bytes=spec["kv_cache_bytes"],
              max_num_batched_tokens=spec["prompt_tokens"] + 64,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KVStoreConnector",
                  kv_connector_module_path="kvstore.integrations.vllm", kv_role="kv_both",
                  kv_connector_extra_config={"target": spec["target"], "timeout_s": 10.0}))
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    connector = get_kv_transfer_group()
    rng = random.Random(spec["seed"])

    def ttft(prompt: list[int]) -> float:
        started = time.perf_counter()
        [out] = llm.generate([TokensPrompt(prompt_token_ids=prompt)], one, use_tqdm=False)
        elapsed = (time.perf_counter() - started) * 1e3
        return elapsed if out.outputs[0].token_ids else float("nan")

    ttft([rng.randrange(100, VOCAB) for _ in range(2 * BLOCK + 1)])  # warm-up
    kv = KVStoreClient(spec["target"], connector.namespace)
    fill = KVStoreClient(spec["target"], connector.namespace + "/filler")
    recompute, hit, loaded = [], [], []
    for _ in range(spec["reps"]):
        prompt = [rng.randrange(100, VOCAB) for _ in range(spec["prompt_tokens"])]
        recompute.append(ttft(prompt))
        connector.link.flush(60.0)
        keys = prefix_keys(prompt[: (len(prompt) - 1) // BLOCK * BLOCK], BLOCK,
                           connector.namespace)
        if spec["tier"] == "nvme":
            push_to_l3(kv, fill, keys, spec["l2_bytes"])
        before = connector.link.stats.loaded_blocks
        hit.append(ttft(prompt))
        loaded.append(connector.link.stats.loaded_blocks - before)
        evict_all(kv)  # the next rep's prompt finds the tiers as this one did
    return {"recompute_ms": recompute, "hit_ms": hit, "loaded_blocks": loaded,
            "block_bytes": connector.paged.block_bytes}


def _run_tier(args: argparse.Namespace, model: Path, workdir: Path, tier: str
              ) -> dict[str, Any]:
    block_bytes = args.layers * args.kv_heads * BLOCK * 128 * 4  # float32, K|V of 64 each
    prefix_bytes = args.prompt_tokens // BLOCK * block_bytes
    l2_bytes = 4 * prefix_bytes if tier == "dram" else 2 * prefix_bytes
    with ExitStack() as stack:
        settings = (["nvme.enabled=false"] if tier == "dram"
                    else [f"nvme.capacity_bytes={8 * l2_bytes}", "movers.interval_s=0.01"])
        store = daemon(stack, workdir, block_bytes, l2_bytes, *settings)
        spec = {"model": str(model), "target": store.target, "tier": tier, "reps": args.reps,
                "prompt_tokens": args.prompt_tokens, "seed": 11, "l2_bytes": l2_bytes,
                "kv_cache_bytes": max(64 * MiB, 4 * prefix_bytes)}
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                              capture_output=True, text=True, cwd=HERE)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise RuntimeError(f"vLLM run ({tier}) failed:\n{proc.stderr[-6000:]}")
        return dict(json.loads(lines[-1].removeprefix("RESULT ")))


def run(args: argparse.Namespace) -> tuple[list[Figure], dict[str, Any]]:
    if args.quick:
        args.hidden, args.layers, args.prompt_tokens, args.reps = 512, 4, 1024, 3
    args.kv_heads = max(1, args.hidden // 256)
    figures = []
    with tempfile.TemporaryDirectory(prefix="vllm-ttft-") as tmp:
        workdir = Path(tmp)
        model = save_random_llama(
            workdir / "llama", vocab_size=VOCAB, hidden_size=args.hidden,
            intermediate_size=args.hidden * 11 // 4, num_layers=args.layers,
            num_heads=args.hidden // 64, num_kv_heads=args.kv_heads,
            max_position_embeddings=8192)
        for tier, name in (("dram", "vllm_ttft_l2"), ("nvme", "vllm_ttft_l3")):
            got = _run_tier(args, model, workdir, tier)
            ours, base = statistics.median(got["hit_ms"]), statistics.median(got["recompute_ms"])
            want = (args.prompt_tokens - 1) // BLOCK
            print(f"# {name}: hit ms {[round(x) for x in got['hit_ms']]}, recompute ms "
                  f"{[round(x) for x in got['recompute_ms']]}, blocks loaded per hit "
                  f"{got['loaded_blocks']} (of {want}, {got['block_bytes'] // 1024} KiB each)",
                  flush=True)
            figure = Figure(name, ours, "recompute", base, "ms", lower_is_better=True,
                            target=">= 3x" if tier == "dram" else "",
                            extra={"loaded_blocks": got["loaded_blocks"]})
            print(figure.line(), flush=True)
            figures.append(figure)
    setup = {"hidden": args.hidden, "layers": args.layers, "prompt_tokens": args.prompt_tokens,
             "reps": args.reps, "block_size": BLOCK, "device": "cpu", "cpus": os.cpu_count()}
    return figures, setup


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(_child(json.loads(sys.argv[2]))), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a small model, 1k tokens")
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")
    return run_main(parser.parse_args(), run, printed=True)


if __name__ == "__main__":
    sys.exit(main())
