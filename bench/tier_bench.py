"""The L3 tier and the L3 -> L2 load path against their baselines, in one run.

- l3_write_2MiB, l3_read_2MiB: `NvmeTier` (posix, O_DIRECT, `--io-threads` N: N requests in
  flight) moving 2 MiB objects in batches between a real `DramTier` segment and its file (the
  store's L2 <-> L3 path) vs the raw disk at the same queue depth: N O_DIRECT `dd bs=2M` started
  together, each on its own run of a file of the same size in the same `--dir`, timed as a whole
  (bytes / (last copy's end - first copy's start), by dd's own timing, so dd's start-up is not
  billed to it) (target >= 0.8x); a single dd is timed too (JSON and `#` line only). Both files
  are preallocated and written before timing, and nothing goes through the page cache
  (`fincore` reports what is cached after the reads).
- get_after_prefetch: a real daemon (small L2, L3 in `--dir`); per round two fresh chains of
  256 KiB blocks are pushed into L3 by filler puts (then evicted, so nothing else moves while
  timing); one is read cold, the other `prefetch`ed to dram and then read: that get vs the
  cold get. prefetch_to_dram: the prefetch vs the same.

Ours and the baseline alternate which goes first, round by round (the single dd runs last);
each figure is the median over rounds. Prints `bench <name>: <ours> <unit> vs <baseline name>
<baseline> <unit> = <ratio>x` per figure (ratio > 1: we are better; latency ratios are
baseline/ours), info lines starting with `#`, and with `--json PATH` one JSON object there.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from figures import Figure, run_main

from kvstore.client import KVStoreClient
from kvstore.keys import BlockKey
from kvstore.tiers.base import IO_ALIGN_BYTES, Transfer
from kvstore.tiers.dram import DramTier
from kvstore.tiers.nvme import NvmeTier
from kvstore.tools.testing import start_daemon
from kvstore.units import GiB, KiB, MiB, parse_size

OBJECT_BYTES = 2 * MiB
PAGE_BYTES = 64 * KiB
BLOCK_BYTES = 256 * KiB
NAMESPACE = "tier-bench"
DD_SECONDS = re.compile(r"copied, ([0-9.]+) s")
DD_ENV = {**os.environ, "LC_ALL": "C"}  # dd prints its timing with a '.' decimal point


def alternate(ours: Callable[[], float], base: Callable[[], float], first_ours: bool
              ) -> tuple[float, float]:
    """(ours(), base()), run in the given order; each returns its own timing."""
    first, second = (ours, base) if first_ours else (base, ours)
    a, b = first(), second()
    return (a, b) if first_ours else (b, a)


@dataclass
class L3Bench:
    """Object j of the L3 file is written from source slot j % batch of the DRAM segment and
    read into destination slot j % batch (slots batch..2*batch-1)."""

    dram: DramTier
    tier: NvmeTier
    dd_file: Path
    batch: int
    num_objects: int
    pages_per_object: int = OBJECT_BYTES // PAGE_BYTES

    def _transfer(self, obj: int, slot: int) -> Transfer:
        ppo = self.pages_per_object
        buffers = self.dram.buffers(((slot * ppo, ppo),), OBJECT_BYTES)
        if any(int(np.frombuffer(b, np.uint8).ctypes.data) % IO_ALIGN_BYTES for b in buffers):
            raise RuntimeError("DRAM buffers are not 4 KiB aligned: the tier would not O_DIRECT")
        return Transfer(((obj * ppo, ppo),), OBJECT_BYTES, buffers)

    def _batches(self, first: int, count: int, write: bool) -> list[list[Transfer]]:
        base = 0 if write else self.batch
        objs = range(first, first + count)
        return [[self._transfer(j, base + j % self.batch) for j in objs[i : i + self.batch]]
                for i in range(0, count, self.batch)]

    def ours(self, first: int, count: int, write: bool) -> float:
        batches = self._batches(first, count, write)  # built untimed, as the store does
        move = self.tier.write if write else self.tier.read
        start = time.perf_counter()
        for batch in batches:
            errors = move(batch)
            if any(e is not None for e in errors):
                raise RuntimeError(f"L3 {'write' if write else 'read'} failed: {errors}")
        return time.perf_counter() - start

    def dd(self, first: int, count: int, write: bool, streams: int = 1) -> float:
        """Objects first..first+count-1 cut into `streams` disjoint runs, copied O_DIRECT by as
        many dd processes at once: seconds from the first copy's start to the last one's end."""
        cuts = [first + count * i // streams for i in range(streams + 1)]
        runs = [(a, b - a) for a, b in itertools.pairwise(cuts) if b > a]
        io = (["if=/dev/zero", f"of={self.dd_file}", "oflag=direct", "conv=notrunc"] if write
              else [f"if={self.dd_file}", "of=/dev/null", "iflag=direct"])
        at = "seek" if write else "skip"  # in 2 MiB blocks, like count
        args = [["dd", f"bs={OBJECT_BYTES}", f"count={n}", f"{at}={a}", *io] for a, n in runs]
        with ThreadPoolExecutor(len(args)) as pool:
            spans = list(pool.map(dd_span, args))
        return max(end for _, end in spans) - min(start for start, _ in spans)

    def fill_and_check(self, rng: np.random.Generator) -> None:
        """Random sources; write and read back the whole file on both sides (untimed), so
        every timed write overwrites written blocks and every read returns real data."""
        for slot in range(self.batch):
            src = np.frombuffer(self._transfer(0, slot).buffers[0], np.uint8)
            src[:] = rng.integers(0, 256, src.size, dtype=np.uint8)
        for first in range(0, self.num_objects, self.batch):
            count = min(self.batch, self.num_objects - first)
            self.ours(first, count, write=True)
            self.ours(first, count, write=False)
            for j in range(first, first + count):
                src, dst = (np.frombuffer(self._transfer(0, s).buffers[0], np.uint8)
                            for s in (j % self.batch, self.batch + j % self.batch))
                if not np.array_equal(src, dst):
                    raise RuntimeError(f"L3 object {j} read back other bytes than were written")
        self.dd(0, self.num_objects, write=True)
        self.dd(0, self.num_objects, write=False)


def dd_span(args: list[str]) -> tuple[float, float]:
    """Run dd; (start, end) of its copy on the perf_counter clock: it ends as dd exits, and
    lasts as long as dd's own timing says (which leaves out its start-up)."""
    proc = subprocess.run(args, capture_output=True, text=True, env=DD_ENV, check=False)
    end = time.perf_counter()
    match = DD_SECONDS.search(proc.stderr)
    if proc.returncode or match is None:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
    return end - float(match[1]), end


def page_cache_bytes(path: Path) -> int | None:
    """Bytes of path resident in the page cache (util-linux fincore), None without it."""
    if shutil.which("fincore") is None:
        return None
    proc = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                          capture_output=True, text=True, check=False)
    return int(proc.stdout.split()[0]) if proc.returncode == 0 and proc.stdout.strip() else None


def l3_figures(args: argparse.Namespace, workdir: Path, shm_name: str
               ) -> tuple[list[Figure], dict[str, Any]]:
    num_objects, round_objects = args.file_size // OBJECT_BYTES, args.round_size // OBJECT_BYTES
    round_bytes, qd = round_objects * OBJECT_BYTES, args.io_threads
    dd_file = workdir / "dd.bin"
    with dd_file.open("wb") as f:
        os.posix_fallocate(f.fileno(), 0, num_objects * OBJECT_BYTES)  # as the tier does
    samples: dict[str, list[float]] = {f"{s}_{w}": [] for s in ("ours", "ddq", "dd1") for w in "wr"}
    with ExitStack() as stack:
        dram = DramTier(2 * args.batch * OBJECT_BYTES, PAGE_BYTES, shm_name, pin_memory=False)
        stack.callback(dram.close)
        tier = NvmeTier(workdir / "l3.bin", num_objects * OBJECT_BYTES, PAGE_BYTES,
                        backend="posix", io_threads=qd)
        stack.callback(tier.close)
        if not tier.direct:
            raise RuntimeError(f"{workdir} refuses O_DIRECT; point --dir at a local disk")
        bench = L3Bench(dram, tier, dd_file, args.batch, num_objects)
        bench.fill_and_check(np.random.default_rng(0))
        for r in range(args.rounds):
            first = (r * round_objects) % num_objects
            for write, w in ((True, "w"), (False, "r")):
                o, b = alternate(partial(bench.ours, first, round_objects, write),
                                 partial(bench.dd, first, round_objects, write, qd), r % 2 == 0)
                samples[f"ours_{w}"].append(o)
                samples[f"ddq_{w}"].append(b)
                samples[f"dd1_{w}"].append(bench.dd(first, round_objects, write))
        cached = {"ours": page_cache_bytes(tier.path), "dd": page_cache_bytes(dd_file)}
    gbps = {k: round_bytes / statistics.median(v) / 1e9 for k, v in samples.items()}
    print(f"# l3: {workdir}, O_DIRECT ours={tier.direct} (backend {tier.backend}, {qd} io "
          f"threads) dd=True (x{qd} and x1); single dd O_DIRECT: write {gbps['dd1_w']:.2f} "
          f"GB/s, read {gbps['dd1_r']:.2f} GB/s; page cache after the reads: ours "
          f"{cached['ours']} B, dd {cached['dd']} B", flush=True)
    figures = []
    for name, w in (("l3_write_2MiB", "w"), ("l3_read_2MiB", "r")):
        extra = {"round_bytes": round_bytes, "rounds": args.rounds, "batch": args.batch,
                 "bytes_moved": round_bytes * args.rounds, "baseline_streams": qd,
                 "ours_s": samples[f"ours_{w}"], "baseline_s": samples[f"ddq_{w}"],
                 "single_dd": gbps[f"dd1_{w}"], "single_dd_s": samples[f"dd1_{w}"]}
        figures.append(Figure(name, gbps[f"ours_{w}"], f"dd O_DIRECT x{qd}", gbps[f"ddq_{w}"],
                              "GB/s", target=">= 0.8x", extra=extra))
    setup = {"l3_direct": True, "l3_file_bytes": num_objects * OBJECT_BYTES,
             "io_threads": qd, "page_cache_bytes_after": cached}
    return figures, setup


@dataclass
class LoadBench:
    kv: KVStoreClient
    payloads: list[bytes]  # one chain's values, root first
    l2_bytes: int

    def chain(self) -> list[BlockKey]:
        keys = [BlockKey(secrets.token_bytes(32)) for _ in self.payloads]
        if self.kv.put(keys, self.payloads).stored != len(keys):
            raise RuntimeError("a fresh chain was not stored")
        return keys

    def tiers(self, keys: Sequence[BlockKey]) -> list[str | None]:
        return list(self.kv.lookup(keys).tiers)

    def push_to_l3(self, keys: list[BlockKey]) -> None:
        """Put filler blocks until every key is in L3, then evict the fillers."""
        fillers: list[BlockKey] = []
        batch = max(1, min(16, self.l2_bytes // BLOCK_BYTES // 8))
        while (tiers := self.tiers(keys)) != ["nvme"] * len(keys):
            if None in tiers:
                raise RuntimeError("a chain block left every tier while being pushed to L3 "
                                   "(the mover fell behind the filler puts)")
            if len(fillers) * BLOCK_BYTES > 4 * self.l2_bytes:
                raise RuntimeError(f"the chain is still in L2 after {len(fillers)} fillers")
            more = [BlockKey(secrets.token_bytes(32)) for _ in range(batch)]
            self.kv.put(more, self.payloads[:1] * batch, independent=True)
            fillers += more
            time.sleep(0.005)  # let the mover (movers.interval_s=0.01) take its step
        self.evict(fillers)

    def evict(self, keys: list[BlockKey], timeout_s: float = 30.0) -> None:
        """Evict keys from every tier, retrying those that are moving or leased right now."""
        deadline = time.monotonic() + timeout_s
        while keys:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(keys)} keys could not be evicted in {timeout_s} s")
            self.kv.evict(keys)
            keys = [k for k, t in zip(keys, self.tiers(keys), strict=True) if t is not None]
            time.sleep(0.01 if keys else 0.0)

    def get_ms(self, keys: list[BlockKey]) -> float:
        start = time.perf_counter()
        values = self.kv.get(keys)
        elapsed_s = time.perf_counter() - start
        if values != self.payloads:
            raise RuntimeError("get returned other bytes than were put")
        return elapsed_s * 1e3

    def prefetch_ms(self, keys: list[BlockKey]) -> float:
        start = time.perf_counter()
        result = self.kv.prefetch(keys, tier="dram")
        elapsed_s = time.perf_counter() - start
        if result.done != len(keys) or self.tiers(keys) != ["dram"] * len(keys):
            raise RuntimeError(f"prefetch left the chain short of dram: {result}")
        return elapsed_s * 1e3

    def round(self, cold_first: bool) -> tuple[float, float, float]:
        """(cold get, prefetch, get after prefetch) in ms, on two fresh chains in L3."""
        cold, warm = self.chain(), self.chain()
        self.push_to_l3(cold + warm)
        prefetch_ms: list[float] = []

        def prefetched() -> float:
            prefetch_ms.append(self.prefetch_ms(warm))
            return self.get_ms(warm)

        after, cold_ms = alternate(prefetched, partial(self.get_ms, cold), not cold_first)
        self.evict(cold + warm)
        return cold_ms, prefetch_ms[0], after


def load_figures(args: argparse.Namespace, workdir: Path, shm_name: str
                 ) -> tuple[list[Figure], dict[str, Any]]:
    daemon = start_daemon(workdir, f"dram.capacity_bytes={args.l2_size}",
                          f"dram.page_size_bytes={PAGE_BYTES}", f"dram.shm_name={shm_name}",
                          f"nvme.capacity_bytes={args.l3_size}", "movers.interval_s=0.01",
                          "log_level=WARNING")
    rng = np.random.default_rng(1)
    payloads = [rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8).tobytes()
                for _ in range(args.chain_blocks)]
    try:
        with KVStoreClient(daemon.target, NAMESPACE) as kv:
            bench = LoadBench(kv, payloads, args.l2_size)
            bench.round(cold_first=True)  # warm-up
            rounds = [bench.round(cold_first=r % 2 == 0) for r in range(args.load_rounds)]
            nvme = kv.stats().tier("nvme")
            backend = nvme.backend if nvme is not None else ""
    finally:
        daemon.stop()
    cold, pre, after = ([r[i] for r in rounds] for i in range(3))
    label = f"{args.chain_blocks}x{BLOCK_BYTES // KiB}KiB"
    extra = {"chain": label, "rounds": args.load_rounds, "cold_get_ms": cold,
             "prefetch_ms": pre, "get_after_prefetch_ms": after}
    cold_ms = statistics.median(cold)
    figures = [Figure(name, statistics.median(ms), "cold get", cold_ms, "ms",
                      lower_is_better=True, extra=extra)
               for name, ms in (("get_after_prefetch", after), ("prefetch_to_dram", pre))]
    setup = {"l2_bytes": args.l2_size, "l3_bytes": args.l3_size, "chain": label,
             "daemon_l3_backend": backend}
    return figures, setup


@contextmanager
def bench_dir(path: Path | None) -> Iterator[Path]:
    """--dir, or ./.bench-tmp/<unique> on the current folder's filesystem; removed after."""
    root = path if path is not None else Path.cwd() / ".bench-tmp"
    workdir = root / f"tier-bench-{os.getpid()}-{secrets.token_hex(3)}"
    workdir.mkdir(parents=True)
    try:
        yield workdir
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if path is None:
            with suppress(OSError):  # not empty: another run is using it
                root.rmdir()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--dir", type=Path, help="folder for the L3 and dd files (default ./.bench-tmp)")
    add("--file-size", type=parse_size, default=GiB, help="L3 and dd file size")
    add("--round-size", type=parse_size, default=128 * MiB, help="bytes per direction a round")
    add("--rounds", type=int, default=8, help="timed L3 rounds (each ours and dd, both ways)")
    add("--batch", type=int, default=16, help="2 MiB transfers per NvmeTier call")
    add("--io-threads", type=int, default=4, help="NvmeTier io_threads = dd processes at once")
    add("--l2-size", type=parse_size, default=64 * MiB, help="daemon L2 capacity")
    add("--l3-size", type=parse_size, default=512 * MiB, help="daemon L3 capacity")
    add("--chain-blocks", type=int, default=16, help="256 KiB blocks per chain")
    add("--load-rounds", type=int, default=9, help="timed cold-get/prefetch rounds")
    add("--quick", action="store_true", help="a tiny smoke run (overrides the sizes)")
    add("--json", type=Path, metavar="PATH", help="also write one JSON object to PATH")
    args = parser.parse_args(argv)
    if args.quick:
        args.file_size, args.round_size, args.rounds, args.batch = 16 * MiB, 8 * MiB, 2, 2
        args.l2_size, args.l3_size, args.chain_blocks, args.load_rounds = 8 * MiB, 64 * MiB, 4, 2
    if args.file_size % args.round_size or args.round_size % OBJECT_BYTES or args.round_size <= 0:
        parser.error("--round-size must be a multiple of 2 MiB that divides --file-size")
    if min(args.rounds, args.batch, args.io_threads, args.chain_blocks, args.load_rounds) < 1:
        parser.error("--rounds, --batch, --io-threads, --chain-blocks, --load-rounds must be >= 1")
    if 2 * args.chain_blocks * BLOCK_BYTES > args.l2_size // 2:
        parser.error("two chains must fit in half of --l2-size")
    return args


def run(args: argparse.Namespace) -> tuple[list[Figure], dict[str, Any]]:
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    load_before = os.getloadavg()[0]
    figures: list[Figure] = []
    setup: dict[str, Any] = {"quick": args.quick, "cpus": os.cpu_count()}
    with bench_dir(args.dir) as workdir:
        for part, shm_name, measure in (("l3", f"kvstore-tierbench-l3-{tag}", l3_figures),
                                        ("daemon", f"kvstore-tierbench-{tag}", load_figures)):
            (workdir / part).mkdir()
            part_figures, part_setup = measure(args, workdir / part, shm_name)
            for figure in part_figures:
                print(figure.line(), flush=True)
            figures += part_figures
            setup.update(part_setup)
            setup.setdefault("shm_names", []).append(shm_name)
        setup["dir"] = str(workdir)
    setup["loadavg_1m"] = [load_before, os.getloadavg()[0]]
    return figures, setup


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args(argv), run, printed=True)


if __name__ == "__main__":
    sys.exit(main())
