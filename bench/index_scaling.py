"""How the index's per-operation cost grows with the number of stored blocks (issue 8): the
store's real pure index, filled with 10k, 100k and 1M blocks (chains of 1,024), then timed on

  lookup_1024:     Lookup of a whole cached 1,024-block chain;
  put_32_evicting: a two-phase put of a new 32-block chain into a full index, which first
                   evicts 32 blocks leaf-first LRU (so it times eviction too);
  evict_lru_1024:  evicting 1,024 blocks' worth of pages, as a mover or an admin evict does.

The baseline of each figure is the same operation at the smallest size, measured in the same
run: a ratio near 1.0x means the cost stays flat as the index grows (ratio = small / large).
Prints house-format lines, `#` info lines, and JSON with --json PATH; --ops times only some
of the three (e.g. `--ops lookup_1024`, to iterate on one quickly).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import Figure, run_main  # noqa: E402

from kvstore.core.index import Index  # noqa: E402
from kvstore.core.pages import PageAllocator  # noqa: E402
from kvstore.keys import BlockKey  # noqa: E402
from kvstore.tier import Tier  # noqa: E402

NS = "scaling"
CHAIN = 1024


class Filled:
    """An index holding `size` blocks (one page each) in chains of CHAIN, and full."""

    def __init__(self, size: int) -> None:
        self.index = Index({Tier.DRAM: PageAllocator(size)}, {Tier.DRAM: 1})
        self.plans = 0
        self.next_key = 0
        self.chains: list[list[BlockKey]] = []
        for _ in range(size // CHAIN):
            self.chains.append(self.put_chain(CHAIN))

    def keys(self, count: int) -> list[BlockKey]:
        start, self.next_key = self.next_key, self.next_key + count
        return [BlockKey(i.to_bytes(32, "big")) for i in range(start, start + count)]

    def put_chain(self, length: int) -> list[BlockKey]:
        keys = self.keys(length)
        parents = [None, *keys[:-1]]
        self.plans += 1
        plan = self.index.prepare_store(f"p{self.plans}", NS, keys, [1] * length, parents,
                                        Tier.DRAM, deadline=float("inf"))
        if plan is None:
            raise RuntimeError("the index refused a put it has room for")
        self.index.complete_store(f"p{self.plans}", [0] * length, success=True)
        return keys


def timed_ms(op: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        op()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


OPS = ("lookup_1024", "put_32_evicting", "evict_lru_1024")


def measure(size: int, reps: int, rng: random.Random,
            ops: tuple[str, ...] = OPS) -> dict[str, float]:
    start = time.perf_counter()
    filled = Filled(size)
    build_s = time.perf_counter() - start
    index = filled.index

    def lookup() -> object:
        return index.lookup(NS, rng.choice(filled.chains))

    result = {"build_s": build_s}
    if "lookup_1024" in ops:
        result["lookup_1024"] = timed_ms(lookup, reps)
    if "put_32_evicting" in ops:
        result["put_32_evicting"] = timed_ms(lambda: filled.put_chain(32), reps)
    if "evict_lru_1024" in ops:
        # evict_in_order alone; the refill that keeps the index full between reps is not timed.
        evict_times = []
        for _ in range(max(3, reps // 10)):
            t0 = time.perf_counter()
            index.evict_in_order(Tier.DRAM, CHAIN)
            evict_times.append((time.perf_counter() - t0) * 1e3)
            filled.put_chain(CHAIN)
        result["evict_lru_1024"] = statistics.median(evict_times)
    return result


def label(size: int) -> str:
    return f"{size // 1_000_000}M" if size >= 1_000_000 else f"{size // 1000}k"


def run(args: argparse.Namespace) -> tuple[list[Figure], dict[str, Any]]:
    rng = random.Random(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    ops = tuple(op for op in OPS if op in args.ops.split(","))
    if not ops or set(args.ops.split(",")) - set(OPS):
        raise SystemExit(f"--ops: a comma-separated subset of {','.join(OPS)}")
    results = {}
    for size in sizes:
        results[size] = measure(size, args.reps, rng, ops)
        r = results[size]
        timed = ", ".join(f"{op} {r[op]:.3f} ms" for op in ops)
        print(f"# {label(size)} blocks: built in {r['build_s']:.1f} s; {timed}", flush=True)
    base = sizes[0]
    figures = []
    for size in sizes[1:]:
        for op in ops:
            figure = Figure(f"index_{op}_at_{label(size)}", results[size][op],
                            f"at {label(base)}", results[base][op], "ms", lower_is_better=True,
                            target=">= 0.5x" if size == sizes[-1] else "")
            print(figure.line(), flush=True)
            figures.append(figure)
    return figures, {"sizes": sizes, "reps": args.reps, "chain": CHAIN, "ops": list(ops)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10240,102400,1048576",
                        help="blocks in the index, comma-separated, smallest first")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--ops", default=",".join(OPS),
                        help=f"which to time, comma-separated (default: all, {','.join(OPS)})")
    parser.add_argument("--quick", action="store_true", help="small sizes, for the smoke test")
    parser.add_argument("--json", type=Path, metavar="PATH")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.reps = "2048,8192", 20
    return run_main(args, run, printed=True)


if __name__ == "__main__":
    sys.exit(main())
