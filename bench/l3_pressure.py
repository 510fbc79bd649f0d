"""Blocks cached in L3 read back by many readers at once through a small L2 (issue 32,
finding 6: an L3 block used to read as a miss when L2 had no room for it at that instant).

A real daemon (L2 of `--l2-size`, blocks of one 64 KiB page, L3 that holds them all, the
local path on) is filled with `--blocks` blocks in chains of 16, so that all but the last
L2-full lie in L3. `--threads` readers then scan random windows of 16 keys at once, each
Get's bytes checked against what was put, until `--reads` L3 block reads (the daemon's own
count: blocks it found in L3, plus those it served as misses) have been made. The readers
take turns among the three ways to read: shared-memory Gets over the local path,
`get_into`, and inline Gets over gRPC. Nothing evicts (L3 holds every block), so every key
asked for is cached and should come back.

- l3_pressure_hits: the % of the scans' L3 block reads that came back bit-exact, vs the % of
  the blocks that a lone reader (one key per Get, inline) gets right before the scan: all
  of them (target 1.00x: no spurious miss). Each block the scan missed is read alone again
  right after it, as the issue measured its misses: one returned is a spurious miss, one
  missed again was lost. Readers lease what they read (shared memory with
  `verify_checksums=False`, bytes checked here; inline Gets always lease).
- l3_pressure_hits_default_client: the same with clients on their defaults, whose
  shared-memory Gets verify checksums and so take no lease: a block demoted between the
  reply and the client's copy fails its checksum, and the client reads it once more under a
  lease (counted in the daemon's L3 reads, so this scan's L3 reads include those re-reads);
  before the client did so it evicted the block (lost: the lone reader right after missed
  it too). The race is rare unless the readers' process is busy (an engine's own Python
  work), which `--busy` adds: one thread spinning in the readers' process.
- l3_pressure_reads_per_s: L3 block reads per second of the scan with `--threads` readers
  vs one reader making Gets of the same kind (a quarter as many reads) on the same daemon
  and blocks (ratio > 1: readers at once get more done, their waits for L2 room included).

`#` lines give the counts behind each figure: spurious misses (missed by the scan, returned
alone), lost blocks (missed alone too), wrong bytes (always 0: checksums), and the Gets'
latency (p50, p99, slowest). Prints `bench <name>: <ours> <unit> vs <baseline name>
<baseline> <unit> = <ratio>x` per figure and, with `--json PATH`, one JSON object there.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from figures import Figure, percentile, run_main

from kvstore.client import KVStoreClient
from kvstore.tools.testing import Daemon, start_daemon
from kvstore.units import KiB, MiB, format_size, parse_size

BLOCK_BYTES = 64 * KiB  # one L2 page: a window of 16 keys needs 16 pages
WINDOW = 16  # keys per Get, as an engine asks for a 256-token prefix at 16 tokens a block
MODES = ("shm", "into", "inline")


@dataclass
class Scan:
    """What one scan saw: per block read, whether it came back bit-exact."""

    asked: int = 0
    hits: int = 0
    wrong: int = 0
    missed: dict[int, int] = field(default_factory=dict)  # missed reads, by block index
    misses: int = 0
    get_s: list[float] = field(default_factory=list)  # each Get's seconds
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, start: int, got: list[bytes | None], values: list[bytes],
            elapsed_s: float) -> None:
        with self.lock:
            self.asked += len(got)
            self.get_s.append(elapsed_s)
            for j, value in enumerate(got):
                if value is None:
                    self.misses += 1
                    self.missed[start + j] = self.missed.get(start + j, 0) + 1
                elif value == values[start + j]:
                    self.hits += 1
                else:
                    self.wrong += 1


def l3_reads(kv: KVStoreClient) -> int:
    """The daemon's L3 block reads so far: blocks a Get found only in L3, and those it then
    served as misses (every key the bench asks for is cached)."""
    nvme = kv.stats().tier("nvme")
    assert nvme is not None
    count: int = nvme.hits + nvme.misses
    return count


def fill(d: Daemon, keys: list[bytes], values: list[bytes]) -> None:
    """Empty the store, put the blocks in chains of 16 and wait until all but the last
    L2-full of them are in L3."""
    with KVStoreClient(d.target, "l3-pressure", shared_memory=False) as kv:
        kv.evict(all=True, namespace="")
        for i in range(0, len(keys), 16):
            kv.put(keys[i : i + 16], values[i : i + 16])
        settled = len(keys) * 3 // 4
        deadline = time.monotonic() + 60
        while kv.lookup(keys[:settled]).tiers.count("nvme") < settled:
            if time.monotonic() > deadline:
                raise SystemExit("the mover did not settle the blocks in L3 within 60 s")
            time.sleep(0.05)


def scan(d: Daemon, keys: list[bytes], values: list[bytes], threads: int, reads: int,
         leased: bool, seed: int, busy: bool = False) -> tuple[Scan, int, float]:
    """Readers at once scanning windows of WINDOW keys until `reads` L3 block reads were
    made; the scan, its L3 block reads, and its seconds. busy: one more thread spins in this
    process meanwhile, holding the interpreter as an engine's own work does."""
    result = Scan()
    with KVStoreClient(d.target, "l3-pressure", shared_memory=False) as kv:
        before = l3_reads(kv)
        stop = threading.Event()

        def reader(n: int) -> None:
            mode = MODES[n % len(MODES)]
            rng = random.Random(seed * 1000 + n)
            try:
                with KVStoreClient(d.target, "l3-pressure", shared_memory=mode != "inline",
                                   verify_checksums=mode == "inline" or not leased,
                                   unix_socket=str(d.unix_socket)) as client:
                    while not stop.is_set():
                        start = rng.randrange(len(keys) - WINDOW)
                        started = time.perf_counter()
                        got = read(client, mode, keys[start : start + WINDOW])
                        result.add(start, got, values, time.perf_counter() - started)
                    if client.uses_shared_memory != (mode != "inline"):
                        result.errors.append(f"{mode}: shared memory {client.uses_shared_memory}")
            except Exception as exc:
                result.errors.append(f"{mode}: {exc!r}")
                stop.set()

        def spin() -> None:
            while not stop.is_set():
                sum(range(10_000))

        workers = [threading.Thread(target=reader, args=(n,)) for n in range(threads)]
        if busy:
            workers.append(threading.Thread(target=spin))
        started = time.perf_counter()
        for w in workers:
            w.start()
        while not stop.is_set():
            time.sleep(0.05)
            if l3_reads(kv) - before >= reads:
                stop.set()
        for w in workers:
            w.join()
        elapsed_s = time.perf_counter() - started
        return result, l3_reads(kv) - before, elapsed_s


def read(client: KVStoreClient, mode: str, window: list[bytes]) -> list[bytes | None]:
    if mode != "into":
        got: list[bytes | None] = client.get(window)
        return got
    buffers = [bytearray(BLOCK_BYTES) for _ in window]
    sizes = client.get_into(window, buffers)
    return [bytes(b[:s]) if s is not None else None for b, s in zip(buffers, sizes, strict=True)]


def alone(d: Daemon, keys: list[bytes], values: list[bytes], indexes: Iterable[int]
          ) -> set[int]:
    """Which of the blocks at indexes a lone reader gets back bit-exact, one key per Get,
    inline."""
    with KVStoreClient(d.target, "l3-pressure", shared_memory=False) as kv:
        return {i for i in sorted(indexes) if kv.get([keys[i]])[0] == values[i]}


def hits_figure(name: str, s: Scan, l3: int, before: float, returned: set[int], target: str,
                log: Callable[[str], None]) -> Figure:
    """The % of the scan's L3 block reads that came back bit-exact, vs the % of every block
    that a lone reader got right before the scan (before); returned: the blocks the scan
    missed that a lone reader got right after it (spurious misses; the others were lost)."""
    lost = [i for i in s.missed if i not in returned]
    ours = 100.0 * (l3 - s.misses - s.wrong) / l3
    log(f"# {name}: {l3} L3 block reads ({s.asked} block reads in all): {s.misses} missed, "
        f"of {len(s.missed)} blocks: {len(returned)} returned alone right after (spurious), "
        f"{len(lost)} lost; {s.wrong} wrong bytes; Get p50 {percentile(s.get_s, 0.5) * 1000:.1f} "
        f"ms, p99 {percentile(s.get_s, 0.99) * 1000:.1f} ms, slowest {max(s.get_s) * 1000:.0f} ms")
    return Figure(name, ours, "read alone", before, "%", target=target,
                  extra={"l3_block_reads": l3, "block_reads": s.asked, "misses": s.misses,
                         "spurious_blocks": len(returned), "lost_blocks": len(lost),
                         "wrong": s.wrong, "get_p50_ms": percentile(s.get_s, 0.5) * 1000,
                         "get_p99_ms": percentile(s.get_s, 0.99) * 1000,
                         "slowest_get_ms": max(s.get_s) * 1000,
                         "errors": s.errors})


def run(args: argparse.Namespace) -> tuple[list[Figure], dict[str, Any]]:
    # A client warns when it evicts a block that failed its checksum under a lease; the
    # figures count any such block as a miss, and as lost.
    logging.getLogger("kvstore").setLevel(logging.ERROR)
    rng = np.random.default_rng(32)
    keys = [rng.bytes(32) for _ in range(args.blocks)]
    values = [rng.bytes(BLOCK_BYTES) for _ in range(args.blocks)]
    figures: list[Figure] = []
    setup: dict[str, Any] = {"blocks": args.blocks, "block_bytes": BLOCK_BYTES,
                             "l2_bytes": args.l2_size, "threads": args.threads,
                             "reads": args.reads, "cpus": os.cpu_count()}

    def log(line: str) -> None:
        print(line, flush=True)

    with tempfile.TemporaryDirectory(prefix="kvstore-l3-pressure-") as tmp:
        workdir = Path(tmp)
        d = start_daemon(workdir, f"dram.capacity_bytes={args.l2_size}",
                         "dram.page_size_bytes=64KiB", "nvme.page_size_bytes=64KiB",
                         f"nvme.capacity_bytes={2 * args.blocks * BLOCK_BYTES}",
                         "movers.interval_s=0.02", f"server.unix_socket={workdir / 'kv.sock'}")
        try:
            log(f"# {args.blocks} blocks of {format_size(BLOCK_BYTES)}, L2 "
                f"{format_size(args.l2_size)} ({args.l2_size // BLOCK_BYTES} blocks), "
                f"{args.threads} readers of {WINDOW} keys")
            fill(d, keys, values)
            before = 100.0 * len(alone(d, keys, values, range(len(keys)))) / len(keys)
            fill(d, keys, values)
            many, l3_many, many_s = scan(d, keys, values, args.threads, args.reads, True, 1)
            figure = hits_figure("l3_pressure_hits", many, l3_many, before,
                                 alone(d, keys, values, many.missed), "1.00x", log)
            figures.append(figure)
            log(figure.line())
            fill(d, keys, values)
            one, l3_one, one_s = scan(d, keys, values, 1, args.reads // 4, True, 2)
            figure = Figure("l3_pressure_reads_per_s", l3_many / many_s, "one reader",
                            l3_one / one_s, "reads/s",
                            extra={"threads": args.threads, "one_reader_misses": one.misses})
            figures.append(figure)
            log(figure.line())
            fill(d, keys, values)
            default, l3_default, _ = scan(d, keys, values, args.threads, args.reads, False, 3,
                                          args.busy)
            figure = hits_figure("l3_pressure_hits_default_client", default, l3_default,
                                 before, alone(d, keys, values, default.missed), "", log)
            figures.append(figure)
            log(figure.line())
            errors = many.errors + one.errors + default.errors
            if errors:
                raise SystemExit("readers failed: " + "; ".join(errors[:5]))
        finally:
            d.stop()
    return figures, setup


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--blocks", type=int, default=640, help="blocks put (64 KiB each)")
    add("--l2-size", type=parse_size, default=2 * MiB, help="the daemon's L2 capacity")
    add("--threads", type=int, default=6, help="readers at once")
    add("--reads", type=int, default=10_000, help="L3 block reads per scan")
    add("--busy", action="store_true",
        help="a thread spinning in the readers' process during the default-client scan")
    add("--quick", action="store_true", help="a small smoke run (overrides the sizes)")
    add("--json", type=Path, metavar="PATH", help="also write one JSON object to PATH")
    args = parser.parse_args(argv)
    if args.quick:
        args.blocks, args.reads = 256, 1_000
    if args.l2_size % BLOCK_BYTES or args.l2_size < WINDOW * BLOCK_BYTES:
        parser.error("--l2-size must be a multiple of 64 KiB and hold one Get (1 MiB)")
    if args.blocks < 4 * args.l2_size // BLOCK_BYTES or min(args.threads, args.reads) < 1:
        parser.error("--blocks must be at least 4 L2-fulls; --threads and --reads >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args(argv), run, printed=True)


if __name__ == "__main__":
    sys.exit(main())
