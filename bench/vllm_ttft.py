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

The hybrid model (issue 35) is a random Gemma-3 text model whose `layer_types` interleave
sliding-window and full attention as Gemma 3 does, 5 sliding to 1 full (hidden 1024 x 12
layers: 10 sliding, 2 full; --quick: 512 x 6, 5 and 1), heads of 64, with a window of
`--window` tokens (512; --quick 256), small against the prompt, so vLLM runs it with its
hybrid KV-cache manager on (the connector supports it: `SupportsHMA`). Same reps, same prompt
length, its prefix in L2:

- vllm_ttft_l2_hybrid: TTFT from L2 against recomputing, as vllm_ttft_l2.
- vllm_hybrid_hit_bytes: the bytes a hit loaded (the connector's `loaded_bytes`, the counter
  it reports in vLLM's KV connector stats) against the bytes it would load if every layer were
  full attention (hit blocks x one layer's block bytes x layers), ratio = full / ours. What a
  hit needs follows from the layer mix: a full-attention layer needs every block before the
  cut; a sliding layer only the blocks its window covers before the cut,
  ceil((window - 1) / block) of them (vLLM's SlidingWindowManager: the first computed token
  attends to the window - 1 tokens before it). So with F full and S sliding layers, h hit
  blocks and w window blocks, a hit needs (F*h + S*w) / ((F+S)*h) of the full-attention bytes,
  and the target is the inverse as a ratio: (F+S)*h / (F*h + S*w), rounded down to the
  printed two decimals (at the default sizes 12*15 / (2*15 + 10*4) = 2.57x; --quick
  6*7 / (1*7 + 5*2) = 2.47x).

Each tier runs in its own process (vLLM starts its engine per process) against its own daemon.
Prints `bench <name>: <ours> ms vs recompute <baseline> ms = <ratio>x` and `#` lines; with
`--json PATH`, JSON there. Target (issue 18, and issue 35 for the hybrid): >= 3x from L2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
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
HEAD_DIM = 64  # vLLM's CPU attention runs heads of 64; both models use them
# Gemma 3's own mix: five sliding-window layers to one full-attention layer.
HYBRID_PATTERN = ["sliding_attention"] * 5 + ["full_attention"]
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Model:
    """A checkpoint the bench runs, and what its KV cache holds per token."""

    path: Path
    layer_types: tuple[str, ...]
    """Each layer's attention, in model order: "full_attention" or "sliding_attention"."""
    kv_heads: int
    window: int = 0
    """The sliding layers' window in tokens (0: the model has none)."""

    @property
    def layer_block_bytes(self) -> int:
        """One layer's share of a stored block: K and V for BLOCK tokens, float32."""
        return self.kv_heads * BLOCK * 2 * HEAD_DIM * 4

    @property
    def block_bytes(self) -> int:
        return len(self.layer_types) * self.layer_block_bytes

    def needed_bytes(self, hit_blocks: int) -> int:
        """The bytes a hit of hit_blocks needs, by vLLM's hybrid prefix-cache rule: every
        block before the cut for a full-attention layer, the window's blocks before the cut
        (ceil((window - 1) / BLOCK), what vLLM's SlidingWindowManager asks) for a sliding
        one."""
        window_blocks = min(hit_blocks, -(-(self.window - 1) // BLOCK))
        return sum(hit_blocks if kind == "full_attention" else window_blocks
                   for kind in self.layer_types) * self.layer_block_bytes


def save_random_gemma3(folder: Path, *, hidden: int, layers: int, window: int,
                       max_position_embeddings: int, seed: int = 0) -> Model:
    """A random Gemma-3 text model (transformers' Gemma3ForCausalLM, written by its
    save_pretrained as tests/vllm/test_hybrid.py writes its tiny one): `layers` layers in
    HYBRID_PATTERN's order, heads of HEAD_DIM, a KV head per 256 of hidden as the Llama has,
    and the MLP's width the Llama's (11/4 of hidden), so that per token the two cost alike."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    kinds = [HYBRID_PATTERN[i % len(HYBRID_PATTERN)] for i in range(layers)]
    kv_heads = max(1, hidden // 256)
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers, num_attention_heads=hidden // HEAD_DIM,
        num_key_value_heads=kv_heads, head_dim=HEAD_DIM, sliding_window=window,
        layer_types=kinds, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True, dtype="float32")
    Gemma3ForCausalLM(config).save_pretrained(folder)
    return Model(folder, tuple(kinds), kv_heads, window)


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
    recompute, hit, loaded, loaded_bytes = [], [], [], []
    for _ in range(spec["reps"]):
        prompt = [rng.randrange(100, VOCAB) for _ in range(spec["prompt_tokens"])]
        recompute.append(ttft(prompt))
        connector.link.flush(60.0)
        keys = prefix_keys(prompt[: (len(prompt) - 1) // BLOCK * BLOCK], BLOCK,
                           connector.namespace)
        if spec["tier"] == "nvme":
            push_to_l3(kv, fill, keys, spec["l2_bytes"])
        before = connector.link.stats.loaded_blocks, connector.link.stats.loaded_bytes
        hit.append(ttft(prompt))
        loaded.append(connector.link.stats.loaded_blocks - before[0])
        loaded_bytes.append(connector.link.stats.loaded_bytes - before[1])
        evict_all(kv)  # the next rep's prompt finds the tiers as this one did
    return {"recompute_ms": recompute, "hit_ms": hit, "loaded_blocks": loaded,
            "loaded_bytes": loaded_bytes, "block_bytes": connector.paged.block_bytes,
            "groups": connector.paged.num_groups}


def _run_tier(args: argparse.Namespace, model: Model, workdir: Path, tier: str
              ) -> dict[str, Any]:
    block_bytes = model.block_bytes
    prefix_bytes = args.prompt_tokens // BLOCK * block_bytes
    l2_bytes = 4 * prefix_bytes if tier == "dram" else 2 * prefix_bytes
    with ExitStack() as stack:
        settings = (["nvme.enabled=false"] if tier == "dram"
                    else [f"nvme.capacity_bytes={8 * l2_bytes}", "movers.interval_s=0.01"])
        store = daemon(stack, workdir, block_bytes, l2_bytes, *settings)
        spec = {"model": str(model.path), "target": store.target, "tier": tier, "reps": args.reps,
                "prompt_tokens": args.prompt_tokens, "seed": 11, "l2_bytes": l2_bytes,
                "kv_cache_bytes": max(64 * MiB, 4 * prefix_bytes)}
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                              capture_output=True, text=True, cwd=HERE)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise RuntimeError(f"vLLM run ({model.path.name}, {tier}) failed:\n"
                               f"{proc.stderr[-6000:]}")
        return dict(json.loads(lines[-1].removeprefix("RESULT ")))


def _ttft_figure(name: str, got: dict[str, Any], args: argparse.Namespace, target: str
                 ) -> Figure:
    """The median hit against the median recompute of one engine's reps, with its `#` line."""
    ours, base = statistics.median(got["hit_ms"]), statistics.median(got["recompute_ms"])
    want = (args.prompt_tokens - 1) // BLOCK
    print(f"# {name}: hit ms {[round(x) for x in got['hit_ms']]}, recompute ms "
          f"{[round(x) for x in got['recompute_ms']]}, group blocks loaded per hit "
          f"{got['loaded_blocks']} (a prefix of {want} blocks, "
          f"{got['block_bytes'] // 1024} KiB each over all layers)",
          flush=True)
    figure = Figure(name, ours, "recompute", base, "ms", lower_is_better=True, target=target,
                    extra={"loaded_blocks": got["loaded_blocks"]})
    print(figure.line(), flush=True)
    return figure


def _hit_bytes_figure(got: dict[str, Any], model: Model, prompt_tokens: int) -> Figure:
    """vllm_hybrid_hit_bytes: the median hit's loaded bytes against what the prompt's whole
    prefix blocks would weigh if every layer were full attention; the target is what vLLM's
    hybrid rule needs of them (`Model.needed_bytes`, the module docstring), as a ratio. The
    hit's blocks are the prompt's whole blocks before its last token, not the connector's
    loaded_blocks: with each KV-cache group stored on its own, that counts one block per group
    a load moved (a full group's every block, a sliding group's window). A hit that fell short
    shows as loaded bytes below `needed_bytes` in the JSON."""
    blocks = (prompt_tokens - 1) // BLOCK
    ours = statistics.median(got["loaded_bytes"]) / MiB
    full = blocks * model.layer_block_bytes * len(model.layer_types) / MiB
    if not blocks or not ours:
        raise RuntimeError(f"the hybrid model's hits loaded nothing ({got['loaded_blocks']} "
                           "group blocks): no hit to weigh")
    floor = math.floor(full / (model.needed_bytes(blocks) / MiB) * 100) / 100
    full_layers = model.layer_types.count("full_attention")
    print(f"# vllm_hybrid_hit_bytes: loaded MiB per hit "
          f"{[round(b / MiB, 2) for b in got['loaded_bytes']]}; {blocks} blocks x "
          f"{len(model.layer_types)} layers ({full_layers} full, "
          f"{len(model.layer_types) - full_layers} sliding, window {model.window}) x "
          f"{model.layer_block_bytes // 1024} KiB a layer's block; vLLM's KV-cache groups "
          f"{got['groups']} (its hybrid manager {'on' if got['groups'] > 1 else 'off'})",
          flush=True)
    figure = Figure("vllm_hybrid_hit_bytes", ours, "every layer full", full, "MiB",
                    lower_is_better=True,
                    target=f">= {floor:.2f}x, the full layers' share plus the windows",
                    extra={"loaded_bytes": got["loaded_bytes"],
                           "needed_bytes": model.needed_bytes(blocks)})
    print(figure.line(), flush=True)
    return figure


def run(args: argparse.Namespace) -> tuple[list[Figure], dict[str, Any]]:
    if args.quick:
        args.hidden, args.layers, args.prompt_tokens, args.reps = 512, 4, 1024, 3
        args.hybrid_layers, args.window = 6, 256
    kv_heads = max(1, args.hidden // 256)
    figures = []
    with tempfile.TemporaryDirectory(prefix="vllm-ttft-") as tmp:
        workdir = Path(tmp)
        llama = Model(save_random_llama(
            workdir / "llama", vocab_size=VOCAB, hidden_size=args.hidden,
            intermediate_size=args.hidden * 11 // 4, num_layers=args.layers,
            num_heads=args.hidden // HEAD_DIM, num_kv_heads=kv_heads,
            max_position_embeddings=8192), ("full_attention",) * args.layers, kv_heads)
        for tier, name in (("dram", "vllm_ttft_l2"), ("nvme", "vllm_ttft_l3")):
            got = _run_tier(args, llama, workdir, tier)
            figures.append(_ttft_figure(name, got, args, ">= 3x" if tier == "dram" else ""))
        gemma = save_random_gemma3(workdir / "gemma3", hidden=args.hidden,
                                   layers=args.hybrid_layers, window=args.window,
                                   max_position_embeddings=8192)
        got = _run_tier(args, gemma, workdir, "dram")
        figures.append(_ttft_figure("vllm_ttft_l2_hybrid", got, args, ">= 3x"))
        figures.append(_hit_bytes_figure(got, gemma, args.prompt_tokens))
    setup = {"hidden": args.hidden, "layers": args.layers, "prompt_tokens": args.prompt_tokens,
             "reps": args.reps, "block_size": BLOCK, "device": "cpu", "cpus": os.cpu_count(),
             "hybrid_layer_types": list(gemma.layer_types), "hybrid_window": args.window}
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
    # 12 layers: two of Gemma 3's 5:1 groups, prefill about 1.5x the 8-layer Llama's here
    # (3.7 s against 2.6 s), so it dominates a hit as it does the Llama's. A 512-token
    # window: 4 of a 2k prompt's 15 hit blocks, small against the prompt as Gemma 3's 1024
    # is against its 32k-128k contexts, yet more than one block, so the window's blocks and
    # not only the last one are what a sliding layer needs. --quick halves both (6 layers,
    # 256 tokens: 2 of a 1k prompt's 7 blocks).
    parser.add_argument("--hybrid-layers", type=int, default=12,
                        help="the hybrid Gemma-3's layers, 5 sliding to 1 full (--quick: 6)")
    parser.add_argument("--window", type=int, default=512,
                        help="its sliding window in tokens (--quick: 256)")
    parser.add_argument("--quick", action="store_true", help="a small model, 1k tokens")
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")
    return run_main(parser.parse_args(), run, printed=True)


if __name__ == "__main__":
    sys.exit(main())
