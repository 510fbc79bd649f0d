"""`kvstore-engine`: generate from the command line with the included engine.

    kvstore-engine generate --model PATH --prompt "..." [--chat] [--max-tokens N] ...

Text goes to stdout (or JSON lines with --json); progress and errors go to stderr. Bad input
(a missing model, an unsupported architecture, a too-long prompt, bad sampling values) exits 2
with one line naming the problem, before any generation starts."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvstore.engine.errors import EngineError
from kvstore.engine.llm import LLM, EngineConfig, StepInfo
from kvstore.engine.sampling import SamplingParams
from kvstore.integrations.codecs import CODECS
from kvstore.units import format_size


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore-engine", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("--model", required=True, help="Hugging Face folder or .gguf file")
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    gen.add_argument("--prompt-file", help="a file with one prompt per line")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--n", type=int, default=1, help="samples per prompt")
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--device", default="auto")
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--kv-cache-size", default="1GiB")
    gen.add_argument("--max-num-seqs", type=int, default=32)
    gen.add_argument("--no-prefix-caching", action="store_true")
    gen.add_argument("--max-model-len", type=int,
                     help="prompt + output of one sequence (default: the model's context)")
    gen.add_argument("--attention-sinks", type=int, default=0, metavar="K",
                     help="keep the first K tokens beside a sliding window (StreamingLLM), so "
                     "generation may run past the model's context; an approximation that "
                     "changes outputs")
    gen.add_argument("--store", metavar="HOST[:PORT]",
                     help="a kvstore daemon (no port: 50051): load cached prompts from it, "
                     "offload to it (with auth on, credentials from KVSTORE_TOKEN or "
                     "KVSTORE_TOKEN_FILE and KVSTORE_TLS_*)")
    gen.add_argument("--store-codec", choices=CODECS, default="none",
                     help="how blocks are stored (with --store): none (raw), fp8 or int4 "
                     "(lossy: fewer bytes, slightly different outputs; docs/codecs.md)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per request")
    return parser


def _prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompts.extend(line.rstrip("\n") for line in f if line.strip())
        except OSError as exc:
            raise EngineError(f"--prompt-file: {exc}") from exc
    if not prompts:
        raise EngineError("give at least one --prompt or a --prompt-file")
    return prompts


def _generate(args: argparse.Namespace, err: Console) -> int:
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        seed=args.seed,
        n=args.n,
    )
    prompts = _prompts(args)
    config = EngineConfig(
        kv_cache_size=args.kv_cache_size,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=not args.no_prefix_caching,
        max_model_len=args.max_model_len,
        attention_sinks=args.attention_sinks,
        store=args.store,
        store_codec=args.store_codec,
        dtype=args.dtype,
        device=args.device,
    )
    with err.status("loading the model"):
        llm = LLM(args.model, config)
    try:
        _answer(args, llm, prompts, params, err)
    finally:
        llm.close()
    return 0


def _answer(args: argparse.Namespace, llm: LLM, prompts: list[str], params: SamplingParams,
            err: Console) -> None:
    if args.chat:
        if llm.tokenizer is None:
            raise EngineError("--chat needs a tokenizer; this checkpoint has none")
        prompts = [
            llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts
        ]
    columns = (
        TextColumn("generating"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[tokens]} tokens"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("generate", total=len(prompts), tokens=0)

        def on_step(info: StepInfo) -> None:
            bar.update(task, completed=info.finished_requests, tokens=info.generated_tokens)

        outputs = llm.generate(prompts, params, on_step=on_step)
    for out in outputs:
        if args.json:
            print(
                json.dumps(
                    {
                        "request_id": out.request_id,
                        "outputs": [asdict(c) for c in out.outputs],
                        "metrics": asdict(out.metrics),
                    }
                )
            )
            continue
        for completion in out.outputs:
            print(completion.text if completion.text is not None else completion.token_ids)
        m = out.metrics
        loaded = (f", {m.store_prompt_tokens} loaded from the store: "
                  f"{format_size(m.store_loaded_bytes)}" if m.store_prompt_tokens else "")
        err.print(
            f"[dim]{m.prompt_tokens} prompt tokens ({m.cached_prompt_tokens} cached{loaded}), "
            f"{m.generated_tokens} generated, TTFT {m.ttft_s * 1000:.1f} ms, "
            f"TPOT {m.tpot_s * 1000:.1f} ms[/dim]",
            soft_wrap=True,  # one line however wide: the terminal wraps it, not rich
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    err = Console(stderr=True)
    try:
        return _generate(args, err)
    except EngineError as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
