"""The paged decode-attention kernel against its baseline, in one run (GPU only).

- decode_kernel: kvstore.kernels.gpu.decode_attention (Triton) reading K/V through random,
  non-contiguous block tables vs torch `scaled_dot_product_attention` (enable_gqa) on the
  same K/V already gathered into contiguous [seqs, kv_heads, context, head_dim] tensors, the
  gather not timed. Default shape: 32 sequences x 2048 tokens of context, 32 query heads / 8
  KV heads, head_dim 128, bfloat16, blocks of 16 tokens. The kernel takes ~0.1 ms, less than
  Python and Triton take to launch it, so one launch between two events would time the host:
  each sample is `--launches` back-to-back calls captured in a CUDA graph and replayed between
  CUDA events (per call = sample / launches); when capture fails, the same calls run eagerly
  back to back, and the JSON says which. Ours and the baseline alternate; the figure is the
  median of `--reps` samples. The eager per-call time of both (host overhead included), and
  the torch reference (gather + SDPA, what runs without the kernels), are reported too (JSON
  and `#` line only); the outputs are checked against each other before timing.

Prints `bench decode_kernel: <ours> ms vs sdpa_gathered <base> ms = <ratio>x` (ratio =
baseline / ours: > 1 means the kernel is faster), or `bench decode_kernel: skipped (no CUDA
device)` with exit status 0; `--json PATH` writes the report there. Other benches import
`decode_kernel_figure()`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from figures import Figure, run_main

NAME = "decode_kernel"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Shape:
    seqs: int = 32
    context: int = 2048
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"
    reps: int = 30
    launches: int = 20


QUICK = Shape(seqs=4, context=256, heads=8, kv_heads=2, head_dim=64, reps=5, launches=4)


def _timed_ms(run: Callable[[], Any], calls: int) -> float:
    """Device time of run() between two CUDA events, divided by the calls it makes."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def _back_to_back(fn: Callable[[], Any], launches: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(launches):
            fn()

    return run


def _graphed(fns: list[Callable[[], Any]], launches: int) -> list[Callable[[], None]]:
    """Each fn called `launches` times inside one CUDA graph; returns the replays."""
    replays = []
    for fn in fns:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the default stream, as capture requires
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(launches):
                fn()
        replays.append(graph.replay)
    return replays


def _median_ms(runs: list[Callable[[], Any]], calls: int, reps: int) -> list[float]:
    """Median per-call time of each run (which makes `calls` calls), alternating the runs'
    order every rep."""
    for run in runs:  # warm-up: Triton's compilation, allocator, cuBLAS/SDPA kernel choice
        run()
    torch.cuda.synchronize()
    samples: list[list[float]] = [[] for _ in runs]
    for rep in range(reps):
        order = list(range(len(runs))) if rep % 2 == 0 else list(reversed(range(len(runs))))
        for i in order:
            samples[i].append(_timed_ms(runs[i], calls))
    return [statistics.median(s) for s in samples]


def decode_kernel(shape: Shape) -> Figure:
    from kvstore.kernels import gpu
    from kvstore.kernels import reference as ref

    dev, dtype = torch.device("cuda"), DTYPES[shape.dtype]
    gen = torch.Generator(device=dev).manual_seed(0)
    per_seq = -(-shape.context // shape.block_size)
    num_blocks = shape.seqs * per_seq
    pool = (num_blocks, shape.block_size, shape.kv_heads, shape.head_dim)
    k_cache = torch.randn(pool, device=dev, dtype=dtype, generator=gen)
    v_cache = torch.randn(pool, device=dev, dtype=dtype, generator=gen)
    tables = torch.randperm(num_blocks, device=dev, generator=gen).view(shape.seqs, per_seq)
    tables = tables.to(torch.int32)
    lens = torch.full((shape.seqs,), shape.context, dtype=torch.int32, device=dev)
    query = torch.randn(shape.seqs, shape.heads, shape.head_dim, device=dev, dtype=dtype,
                        generator=gen)
    scale = shape.head_dim**-0.5
    # The baseline's contiguous K/V: [seqs, kv_heads, context, head_dim], gathered untimed.
    flat = tables.reshape(-1).long()
    k = k_cache[flat].view(shape.seqs, -1, shape.kv_heads, shape.head_dim)[:, : shape.context]
    v = v_cache[flat].view(shape.seqs, -1, shape.kv_heads, shape.head_dim)[:, : shape.context]
    k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    q4 = query[:, :, None, :]

    def ours() -> torch.Tensor:
        return gpu.decode_attention(query, k_cache, v_cache, tables, lens, scale)

    def baseline() -> torch.Tensor:
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)[:, :, 0]

    def reference() -> torch.Tensor:
        return ref.decode_attention(query, k_cache, v_cache, tables, lens, scale)

    err = (ours().float() - baseline().float()).abs().max().item()
    if err > 3e-2:
        raise RuntimeError(f"the kernel and SDPA disagree by {err}")
    fns, n = [ours, baseline, reference], shape.launches
    eager = [_back_to_back(fn, n) for fn in fns]
    try:
        timing, runs = "cuda_graph", _graphed(fns, n)
    except Exception as exc:  # capture is an optimisation of the timing, not the figure
        timing, runs = f"back_to_back (graph capture failed: {exc})", eager
        print(f"# decode_kernel: {timing}", flush=True)
    ours_ms, base_ms, ref_ms = _median_ms(runs, n, shape.reps)
    eager_ours_ms, eager_base_ms = _median_ms(eager[:2], n, shape.reps)
    kv_bytes = 2 * shape.seqs * shape.context * shape.kv_heads * shape.head_dim
    kv_bytes *= k_cache.element_size()
    extra = {"shape": asdict(shape), "timing": timing, "max_abs_diff": err,
             "torch_reference_ms": ref_ms, "eager_ours_ms": eager_ours_ms,
             "eager_sdpa_gathered_ms": eager_base_ms,
             "ours_kv_read_gbps": kv_bytes / ours_ms / 1e6, "device": torch.cuda.get_device_name()}
    print(f"# decode_kernel: torch reference (gather + SDPA) {ref_ms:.3f} ms; eager per call "
          f"{eager_ours_ms:.3f} ms ours, {eager_base_ms:.3f} ms sdpa; K/V "
          f"{kv_bytes / 2**20:.0f} MiB read at {extra['ours_kv_read_gbps']:.0f} GB/s by ours; "
          f"max |ours - sdpa| {err:.2e}; timing {timing.split(' ')[0]}", flush=True)
    return Figure(NAME, ours_ms, "sdpa_gathered", base_ms, "ms", lower_is_better=True,
                  extra=extra)


def decode_kernel_figure(shape: Shape | None = None) -> Figure | None:
    """The decode_kernel figure (for other benches to print and report), None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return decode_kernel(shape or Shape())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, with `shape` the Shape they name."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add, default = parser.add_argument, Shape()
    add("--seqs", type=int, default=default.seqs)
    add("--context", type=int, default=default.context, help="tokens of context per sequence")
    add("--heads", type=int, default=default.heads)
    add("--kv-heads", type=int, default=default.kv_heads)
    add("--head-dim", type=int, default=default.head_dim)
    add("--block-size", type=int, default=default.block_size)
    add("--dtype", choices=sorted(DTYPES), default=default.dtype)
    add("--reps", type=int, default=default.reps, help="timed samples of each")
    add("--launches", type=int, default=default.launches, help="calls per timed sample")
    add("--quick", action="store_true", help="a small smoke shape (overrides the others)")
    add("--json", type=Path, metavar="PATH", help="also write one JSON object to PATH")
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else Shape(
        args.seqs, args.context, args.heads, args.kv_heads, args.head_dim, args.block_size,
        args.dtype, args.reps, args.launches)
    if min(shape.seqs, shape.context, shape.reps, shape.block_size, shape.launches) < 1:
        parser.error("--seqs, --context, --reps, --launches and --block-size must be >= 1")
    args.shape = shape
    return args


def run(args: argparse.Namespace) -> tuple[list[Figure], dict[str, Any]]:
    return [decode_kernel(args.shape)], {"shape": asdict(args.shape), "quick": args.shape == QUICK}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(f"bench {NAME}: skipped (no CUDA device)")
        return 0
    try:
        import triton  # noqa: F401  (the kernels' only extra dependency)
    except ImportError:
        print(f"bench {NAME}: skipped (triton is not installed)")
        return 0
    try:
        return run_main(args, run)
    except Exception as exc:  # report it in the house format and fail the run
        print(f"bench {NAME}: failed ({exc})")
        return 1


if __name__ == "__main__":
    sys.exit(main())
