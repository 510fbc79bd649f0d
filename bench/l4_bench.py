"""L4 (the shared Redis pool) and its frame codec against their baselines, in one run: a real
`redis-server` and real `kvstore-server`s (L2 only: `nvme.enabled=false`, `hbm.mode=off`; each
with its Unix socket, as the Helm chart deploys it: this process's clients take the local
path, as a co-located engine does), driven from here through `kvstore.client` and redis-py (1
MiB socket reads; hiredis parses replies if present). The baseline's connections pack commands
as the daemon's do (`redis_pool.connection_class`: redis-py's own packer, which hands large
values to the socket as they are). redis-py's default with hiredis installed copies each value
into one new buffer first: in a process with glibc's default malloc settings that SETs 32 x
256 KiB or 2 MiB at about half the speed, but this process runs with
`kvstore.memory.keep_freed_buffers` (the client sets it), where the copy costs no page faults
and the two are within ~0-30% of each other. The default packer's time stays in the `# stages`
line (JSON: `set_hiredis_packer_s`).

- l4_put_<size> (256 KiB, 2 MiB): daemon A's `put` of a fresh 32-block chain, timed until all
  32 are in Redis (the write-through is asynchronous: the bench polls a multi-key EXISTS every
  1 ms) vs redis-py SET x 32, pipelined, of the same frames (encoded untimed), same TTL.
  A `# stages` line splits ours into A's puts into L2 and what follows until all are in Redis
  (L4's own share: the write-through overlaps the later puts); JSON: `put_l2_s`.
- l4_get_<size>: daemon B, which never saw the keys, `get`s the 32 blocks A wrote (fetched
  from L4, verified, imported into L2, copied out of shared memory by the client) vs redis-py
  GET x 32, pipelined, + `blockframe.decode` of each (what a client needs for verified bytes).
- prewarm_<size> (1 GiB; --quick 32 MiB): A puts 2 MiB blocks, reads each once and waits
  until `hot()` ranks them all; then a fresh daemon C `prewarm`s that many bytes (timed: the
  RPC; C's L2 is checked to hold them) vs redis-py GET (64 a pipeline) + decode of the frames.
  The same C pre-warms again after `evict(all)` (`#` line, JSON: its L2 pages are touched).
- compress_<dtype> (fp16, bf16): stored / raw bytes of `blockframe.encode` with the store's
  settings (auto, shuffle) on generated K/V blocks [4 layers, K|V, 16 tokens, 8 heads, 128]
  (normal, per-channel scales, keys with a few 8-20x channels) vs raw (1.00); forced lz4 in
  the `#` line and JSON. encode_<dtype>, decode_<dtype>: the codec's GB/s (checksum included)
  vs a numpy copy of the same bytes, run last, on a heap glibc neither trims nor mmaps per
  block (mallopt), so that they time the codec, not the page faults of fresh output buffers.

Ours and the baseline alternate which goes first, round by round, on new keys; each figure
is the median. Prints `bench <name>: <ours> <unit> vs <baseline name> <baseline> <unit> =
<ratio>x` (ratio > 1: we are better), `#` info lines and, with `--json PATH`, JSON there.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import redis
from figures import Figure, run_main

from kvstore.client import KVStoreClient
from kvstore.daemon.blockframe import HEADER_BYTES, decode, encode
from kvstore.keys import BlockKey
from kvstore.tiers.redis_pool import block_key, connection_class
from kvstore.tools.testing import Daemon, start_daemon, start_redis
from kvstore.units import GiB, KiB, MiB, parse_size

NS_IO, NS_HOT = "l4-bench", "l4-bench-hot"
BATCH = 32
TTL_S = 3600.0
PAGE_BYTES = 64 * KiB
POLL_S = 0.001  # polling Redis faster competes with the writer for this VM's 2 cores
PUT_STEP = 8  # blocks per put in the L4 put figure
FETCH_BATCH = 64  # blocks per baseline GET pipeline in the pre-warm figure (as the daemon)
KV_SHAPE = (4, 2, 8, 128)  # layers, K|V, kv heads, head dim (tokens go after K|V)
TOKENS = {256 * KiB: 16, 2 * MiB: 128}
T = TypeVar("T")


def size_label(size_bytes: int) -> str:
    unit, name = next(u for u in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB"), (1, "B"))
                      if size_bytes % u[0] == 0)
    return f"{size_bytes // unit}{name}"


def new_keys(n: int) -> list[BlockKey]:
    return [BlockKey(secrets.token_bytes(32)) for _ in range(n)]


def shown(figures: list[Figure]) -> list[Figure]:
    for figure in figures:
        print(figure.line(), flush=True)
    return figures


def alternate(ours: Callable[[], float], base: Callable[[], float], first_ours: bool
              ) -> tuple[float, float]:
    """(ours(), base()), run in the given order; each returns its own timing."""
    first, second = (ours, base) if first_ours else (base, ours)
    a, b = first(), second()
    return (a, b) if first_ours else (b, a)


def kv_block(rng: np.random.Generator, tokens: int, dtype: str) -> bytes:
    """One block's K/V [layers, 2, tokens, heads, dim] as fp16 or bf16 (float32 rounded to
    nearest even): a lognormal scale per layer and channel; keys also get a per-channel offset
    and 4 channels 8-20x larger."""
    layers, _, heads, dim = KV_SHAPE
    out = np.empty((layers, 2, tokens, heads, dim), np.float32)
    for layer in range(layers):
        k_scale = rng.lognormal(0.0, 0.5, (heads, dim)).astype(np.float32)
        big = rng.choice(dim, 4, replace=False)
        k_scale[:, big] *= rng.uniform(8.0, 20.0, (heads, 4)).astype(np.float32)
        k_mean = 0.5 * k_scale * rng.standard_normal((heads, dim), np.float32)
        out[layer, 0] = k_mean + k_scale * rng.standard_normal((tokens, heads, dim), np.float32)
        v_scale = rng.lognormal(-1.0, 0.3, (heads, dim)).astype(np.float32)
        out[layer, 1] = v_scale * rng.standard_normal((tokens, heads, dim), np.float32)
    if dtype == "fp16":
        return out.astype(np.float16).tobytes()
    bits = out.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def timed(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[float, T]:
    """(seconds, result) of fn(*args, **kwargs)."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def seconds(fn: Callable[..., object], *args: Any) -> float:
    return timed(fn, *args)[0]


def encode_all(payloads: list[bytes], compress: str = "auto") -> list[bytes]:
    return [encode(p, compress) for p in payloads]  # the store's settings: auto, shuffle


def decode_all(frames: list[bytes]) -> list[bytes]:
    return [decode(f) for f in frames]


def warm_heap() -> bool:
    """Keep freed memory in this process's heap (glibc): no trim, no mmap below 32 MiB."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-1, 1 << 30) and libc.mallopt(-3, 32 << 20))
    except (OSError, AttributeError):
        return False


def compression_figures(args: argparse.Namespace, rng: np.random.Generator, warm: bool
                        ) -> list[Figure]:
    out: list[Figure] = []
    for dtype in ("fp16", "bf16"):
        payloads = [kv_block(rng, TOKENS[256 * KiB], dtype) for _ in range(args.codec_blocks)]
        raw = sum(map(len, payloads))
        frames, forced = encode_all(payloads), encode_all(payloads, "lz4")
        if decode_all(frames + forced) != payloads * 2:
            raise RuntimeError("a frame decoded to other bytes than were encoded")
        source = np.frombuffer(b"".join(payloads), np.uint8)  # the same bytes, one copy
        copy = partial(seconds, np.copyto, source.copy(), source)
        enc, dec = partial(seconds, encode_all, payloads), partial(seconds, decode_all, frames)
        rows = [(*alternate(enc, copy, r % 2 == 0), *alternate(dec, copy, r % 2 == 1),
                 seconds(encode_all, payloads, "lz4"), seconds(decode_all, forced))
                for r in range(args.codec_rounds)]
        gbps = [raw / statistics.median(column) / 1e9 for column in zip(*rows, strict=True)]
        lz4, stored = sum(map(len, forced)) / raw, sum(map(len, frames)) / raw
        extra = {"blocks": len(payloads), "block_bytes": len(payloads[0]), "dtype": dtype,
                 "shape": [KV_SHAPE[0], 2, TOKENS[256 * KiB], *KV_SHAPE[2:]],
                 "raw_frames": sum(f[5] == 0 for f in frames), "lz4_forced_ratio": lz4,
                 "lz4_forced_encode_gbps": gbps[4], "lz4_forced_decode_gbps": gbps[5],
                 "header_bytes": HEADER_BYTES, "rounds": args.codec_rounds, "warm_heap": warm}
        print(f"# {dtype}: auto stored {extra['raw_frames']}/{len(frames)} frames raw; forced "
              f"lz4 (shuffled) would store {lz4:.3f} of the bytes, encode {gbps[4]:.2f} "
              f"GB/s, decode {gbps[5]:.2f} GB/s", flush=True)
        out += shown([Figure(f"compress_{dtype}", stored, "raw", 1.0, "ratio", True, extra=extra),
                      Figure(f"encode_{dtype}", gbps[0], "memcpy", gbps[1], "GB/s", extra=extra),
                      Figure(f"decode_{dtype}", gbps[2], "memcpy", gbps[3], "GB/s", extra=extra)])
    return out


def rkeys(namespace: str, keys: Sequence[BlockKey]) -> list[bytes]:
    return [block_key(namespace, bytes(k)) for k in keys]


def remote_hits(kv: KVStoreClient) -> int:
    return sum(t.hits for t in kv.stats().tiers if t.tier == "remote")


def redis_get_decode(r: redis.Redis, keys: list[bytes]) -> tuple[float, list[bytes]]:
    """(seconds, payloads) of pipelined GETs, FETCH_BATCH at a time, each frame decoded."""
    start = time.perf_counter()
    out: list[bytes] = []
    for i in range(0, len(keys), FETCH_BATCH):
        pipe = r.pipeline(transaction=False)
        for key in keys[i : i + FETCH_BATCH]:
            pipe.get(key)
        out += [decode(f) for f in pipe.execute()]
    return time.perf_counter() - start, out


@dataclass
class L4:
    a: KVStoreClient  # NS_IO on daemon A: writes through to Redis
    a_hot: KVStoreClient  # NS_HOT on daemon A
    b: KVStoreClient  # NS_IO on daemon B: reads from Redis
    r: redis.Redis  # the baseline: connections as the daemon's (connection_class)
    r_default: redis.Redis  # redis-py's defaults (hiredis's packer): the `#` line only
    start_c: Callable[[int], Daemon]  # a fresh daemon C with this much L2
    put_l2_s: list[float] = field(default_factory=list)  # of each put_ours: A's puts alone
    set_default_s: list[float] = field(default_factory=list)  # put_base on r_default

    def wait_in_redis(self, namespace: str, keys: Sequence[BlockKey]) -> None:
        names, deadline = rkeys(namespace, keys), time.monotonic() + 60.0
        while self.r.exists(*names) < len(names):
            if time.monotonic() > deadline:
                raise RuntimeError(f"blocks not in Redis after 60 s: {self.a.stats().tiers}")
            time.sleep(POLL_S)

    def put_ours(self, keys: list[BlockKey], payloads: list[bytes]) -> float:
        """The batch as an engine offloads it, PUT_STEP blocks at a time as they fill, timed
        until every block is in Redis: the write-through overlaps the later puts."""
        start = time.perf_counter()
        for i in range(0, len(keys), PUT_STEP):
            step = slice(i, i + PUT_STEP)
            if self.a.put(keys[step], payloads[step], independent=True).stored != len(
                    keys[step]):
                raise RuntimeError("A did not store every new key")
        self.put_l2_s.append(time.perf_counter() - start)
        if not self.a.uses_local_path:
            raise RuntimeError("A's client is not on the local path (its Unix socket)")
        self.wait_in_redis(NS_IO, keys)
        return time.perf_counter() - start

    def put_base(self, keys: list[BlockKey], frames: list[bytes],
                 client: redis.Redis | None = None) -> float:
        pipe = (client or self.r).pipeline(transaction=False)
        for name, frame in zip(rkeys(NS_IO, keys), frames, strict=True):
            pipe.set(name, frame, px=int(TTL_S * 1000))
        return seconds(pipe.execute)  # the commands go out (and are answered) here

    def get_ours(self, keys: list[BlockKey], payloads: list[bytes]) -> float:
        hits = remote_hits(self.b)
        elapsed, values = timed(self.b.get, keys)
        if values != payloads or remote_hits(self.b) - hits != len(keys):
            raise RuntimeError("B's get did not return every block from L4 as A put it")
        return elapsed

    def get_base(self, namespace: str, keys: list[BlockKey], payloads: list[bytes]) -> float:
        elapsed, values = redis_get_decode(self.r, rkeys(namespace, keys))
        if values != payloads:
            raise RuntimeError("redis GET + decode returned other bytes than A put")
        return elapsed

    def round(self, payloads: list[bytes], frames: list[bytes], first_ours: bool
              ) -> tuple[float, float, float, float]:
        """(ours put, base put, ours get, base get) in seconds, on fresh keys."""
        ours, base = new_keys(len(payloads)), new_keys(len(payloads))
        put_o, put_b = alternate(partial(self.put_ours, ours, payloads),
                                 partial(self.put_base, base, frames), first_ours)
        self.r.delete(*rkeys(NS_IO, base))
        self.set_default_s.append(self.put_base(base, frames, self.r_default))
        if self.r.get(rkeys(NS_IO, ours)[0]) != frames[0]:
            raise RuntimeError("A wrote another frame than blockframe.encode makes")
        self.a.evict(ours)
        get_o, get_b = alternate(partial(self.get_ours, ours, payloads),
                                 partial(self.get_base, NS_IO, ours, payloads), not first_ours)
        self.b.evict(ours)
        self.r.delete(*rkeys(NS_IO, ours), *rkeys(NS_IO, base))
        return put_o, put_b, get_o, get_b

    def fill_hot(self, blocks: list[bytes], total_bytes: int) -> tuple[list[BlockKey], list[bytes]]:
        """Put total_bytes of blocks through A, read each once, wait until hot() ranks all."""
        keys = new_keys(total_bytes // len(blocks[0]))
        payloads = [blocks[j % len(blocks)] for j in range(len(keys))]
        for i in range(0, len(keys), BATCH):
            chunk, values = keys[i : i + BATCH], payloads[i : i + BATCH]
            if self.a_hot.put(chunk, values, independent=True).stored != len(chunk):
                raise RuntimeError("A did not store a pre-warm batch")
            self.wait_in_redis(NS_HOT, chunk)
            if self.a_hot.get(chunk) != values:
                raise RuntimeError("A read back other bytes than it put")
            self.a_hot.evict(chunk)
        deadline = time.monotonic() + 30.0
        while not set(keys) <= set(self.a_hot.hot(limit=len(keys) + 1).keys):
            if time.monotonic() > deadline:
                raise RuntimeError("hot() did not rank every pre-warm block within 30 s")
            time.sleep(0.1)
        return keys, payloads

    def prewarm_ours(self, total_bytes: int, again_ms: list[float]) -> float:
        c = self.start_c(-(-total_bytes * 3 // 2 // MiB) * MiB)  # pre-warm stops at 75% of L2
        try:
            with KVStoreClient(c.target, NS_HOT) as kv:
                prewarm = partial(timed, kv.prewarm, total_bytes, [NS_HOT], timeout_s=600)
                elapsed, result = prewarm()
                dram = kv.stats().tier("dram")
                kv.evict(all=True)
                again_s, again = prewarm()
                again_ms.append(again_s * 1e3)
        finally:
            c.stop()
        if min(result.bytes, again.bytes, dram.used_bytes if dram else 0) < total_bytes:
            raise RuntimeError(f"C pre-warmed short of {total_bytes} B: {result}, {dram}")
        return elapsed


def l4_figures(args: argparse.Namespace, l4: L4, rng: np.random.Generator) -> list[Figure]:
    out: list[Figure] = []
    for size in (256 * KiB, 2 * MiB):
        payloads = [kv_block(rng, TOKENS[size], args.dtype) for _ in range(BATCH)]
        frames = encode_all(payloads)
        l4.round(payloads, frames, True)  # warm-up
        l4.put_l2_s.clear()
        l4.set_default_s.clear()
        rounds = [l4.round(payloads, frames, r % 2 == 0) for r in range(args.rounds)]
        batch_bytes = size * BATCH
        gbps = [batch_bytes / statistics.median(r[i] for r in rounds) / 1e9 for i in range(4)]
        tail_s = [r[0] - l2 for r, l2 in zip(rounds, l4.put_l2_s, strict=True)]
        print(f"# stages {size_label(size)} put: A's {BATCH // PUT_STEP} puts into L2 "
              f"{statistics.median(l4.put_l2_s) * 1e3:.1f} ms, then until all are in Redis "
              f"{statistics.median(tail_s) * 1e3:.1f} ms (medians); redis SET "
              f"{statistics.median(r[1] for r in rounds) * 1e3:.1f} ms (with redis-py's "
              f"default packer {statistics.median(l4.set_default_s) * 1e3:.1f} ms)", flush=True)
        extra = {"batch": BATCH, "batch_bytes": batch_bytes, "rounds": args.rounds,
                 "dtype": args.dtype, "frame_ratio": sum(map(len, frames)) / batch_bytes,
                 "samples_s": {n: [r[i] for r in rounds]
                               for i, n in enumerate(("put", "set", "get", "get_decode"))},
                 "put_l2_s": list(l4.put_l2_s), "set_hiredis_packer_s": list(l4.set_default_s)}
        pairs = (("put", "redis SET", 0), ("get", "redis GET+decode", 2))
        out += shown([Figure(f"l4_{verb}_{size_label(size)}", gbps[i], base, gbps[i + 1],
                             "GB/s", target=">= 0.8x", extra=extra) for verb, base, i in pairs])
    return out


def prewarm_figure(args: argparse.Namespace, l4: L4, rng: np.random.Generator) -> Figure:
    total = args.prewarm_size
    blocks = [kv_block(rng, TOKENS[2 * MiB], args.dtype) for _ in range(BATCH)]
    keys, payloads = l4.fill_hot(blocks, total)
    again: list[float] = []
    rounds = [alternate(partial(l4.prewarm_ours, total, again),
                        partial(l4.get_base, NS_HOT, keys, payloads), r % 2 == 0)
              for r in range(args.prewarm_rounds)]
    ours_ms, base_ms = ([r[i] * 1e3 for r in rounds] for i in (0, 1))
    ours, base = statistics.median(ours_ms), statistics.median(base_ms)
    print(f"# prewarm: {len(keys)} x 2 MiB in {ours:.0f} ms = {total / ours / 1e6:.2f} GB/s "
          f"(the same C again after evict(all): {statistics.median(again):.0f} ms); redis "
          f"GET+decode {total / base / 1e6:.2f} GB/s", flush=True)
    extra = {"bytes": total, "blocks": len(keys), "ours_ms": ours_ms, "baseline_ms": base_ms,
             "rounds": args.prewarm_rounds, "again_ms": again}
    return shown([Figure(f"prewarm_{size_label(total)}", ours, "redis GET+decode", base, "ms",
                         lower_is_better=True, extra=extra)])[0]


def run(args: argparse.Namespace) -> tuple[list[Figure], dict[str, Any]]:
    rng, load_before = np.random.default_rng(0), os.getloadavg()[0]
    shm = f"kvstore-l4bench-{os.getpid()}-{secrets.token_hex(3)}"
    shm_names = [f"{shm}-a", f"{shm}-b"]
    figures: list[Figure] = []
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="l4-bench-")))
        server = start_redis(workdir)
        stack.callback(server.stop)

        def daemon(capacity: int, shm_name: str, *settings: str) -> Daemon:
            """Started, and stopped at the latest on the way out (a second stop is a no-op)."""
            started = start_daemon(
                workdir, f"dram.capacity_bytes={capacity}", f"dram.page_size_bytes={PAGE_BYTES}",
                f"dram.shm_name={shm_name}", "nvme.enabled=false", "hbm.mode=off",
                f"remote.url={server.url}", f"remote.ttl_s={TTL_S}", "log_level=WARNING",
                f"server.unix_socket={workdir / (shm_name + '.sock')}", *settings)
            stack.callback(started.stop)
            return started

        def daemon_c(capacity: int) -> Daemon:
            shm_names.append(f"{shm}-c{len(shm_names) - 1}")
            return daemon(capacity, shm_names[-1])

        a = daemon(args.l2_size, shm_names[0], "remote.popularity_flush_s=0.2")
        b = daemon(args.l2_size, shm_names[1])
        r, r_default = (redis.Redis(connection_pool=redis.ConnectionPool(
            host="127.0.0.1", port=server.port, socket_read_size=args.redis_read_bytes,
            **kwargs)) for kwargs in ({"connection_class": connection_class()}, {}))
        stack.callback(r.close)
        stack.callback(r_default.close)
        a_io, a_hot, b_io = (stack.enter_context(KVStoreClient(d.target, ns))
                             for d, ns in ((a, NS_IO), (a, NS_HOT), (b, NS_IO)))
        l4 = L4(a_io, a_hot, b_io, r, r_default, daemon_c)
        figures += l4_figures(args, l4, rng)
        figures.append(prewarm_figure(args, l4, rng))
        remote = l4.a.stats().tier("remote")
    figures += compression_figures(args, rng, warm_heap())
    setup = {"quick": args.quick, "cpus": os.cpu_count(), "redis_py": redis.__version__,
             "redis_parser": "hiredis" if importlib.util.find_spec("hiredis") else "python",
             "redis_read_bytes": args.redis_read_bytes, "l2_bytes": args.l2_size, "ttl_s": TTL_S,
             "dtype": args.dtype, "shm_names": shm_names,
             "loadavg_1m": [load_before, os.getloadavg()[0]],
             "a_admissions_refused": remote.admissions_refused if remote else None}
    return figures, setup


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--rounds", type=int, default=9, help="timed put/get rounds per size")
    add("--dtype", choices=("bf16", "fp16"), default="bf16", help="K/V dtype of the L4 blocks")
    add("--l2-size", type=parse_size, default=256 * MiB, help="L2 of daemons A and B")
    add("--prewarm-size", type=parse_size, default=GiB, help="bytes to pre-warm (2 MiB blocks)")
    add("--prewarm-rounds", type=int, default=3, help="timed pre-warms (a fresh daemon each)")
    add("--redis-read-bytes", type=parse_size, default=MiB, help="redis-py socket_read_size")
    add("--quick", action="store_true", help="a tiny smoke run (overrides the sizes)")
    add("--json", type=Path, metavar="PATH", help="also write one JSON object to PATH")
    args = parser.parse_args(argv)
    args.codec_blocks, args.codec_rounds = (4, 3) if args.quick else (16, 15)  # 256 KiB each
    if args.quick:
        args.rounds, args.prewarm_size, args.prewarm_rounds = 2, 32 * MiB, 2
    if min(args.rounds, args.prewarm_rounds) < 1 or args.prewarm_size % (2 * MiB) or (
            args.prewarm_size <= 0):
        parser.error("rounds must be >= 1, --prewarm-size a positive multiple of 2 MiB")
    if args.l2_size < 2 * BATCH * 2 * MiB:
        parser.error("--l2-size must hold two batches of 32 x 2 MiB")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args(argv), run, printed=True)


if __name__ == "__main__":
    sys.exit(main())
