"""The store against its baselines, in one run: a real `kvstore-server` subprocess and a real
`redis-server` on free ports, driven from this process through `kvstore.client` and redis-py.

For each object size (default 256 KiB and 2 MiB), in batches of 16:

- shm_get_into: `get_into` through the shared-memory segment, read through the daemon's read
  table (no round trip; checksums verified) vs a single-thread memcpy (`np.copyto`) of the
  same blocks into the same destination arrays (target >= 0.75x at 2 MiB, >= 0.45x at
  256 KiB); shm_get_into_noverify: the same without verifying (>= 0.9x, >= 0.7x); and
  shm_get_into_asked: the same read asking the daemon (the Get over its Unix socket, the
  local path; `read_table=False`), the path before the table, in the same run;
- shm_put_posted: four batches put with `wait=False` (copied into a grant of pages, each
  commit posted without waiting) and one `flush()` for their answers, vs a memcpy of the same
  four batches (no target of its own; the issue's put targets are shm_put's);
- shm_put: `put` through the segment (Reserve, copy + checksum, commit) vs the same memcpy
  (target >= 0.75x at 2 MiB, >= 0.4x at 256 KiB: issue 36's);
- inline_get: `get` in the gRPC stream, returning bytes, vs redis-py GET x 16 in one
  non-transactional pipeline, and inline_get_floor: the same vs a bare grpc-python stream
  of the same bytes (bench/grpc_floor.py; target >= 0.8x);
- inline_put: `put` in the gRPC stream vs redis-py SET x 16, pipelined;
- shm_first_put: a new client's first put batch after attaching vs a warm client's batch
  (target >= 0.67x, i.e. within 1.5x).

And `lookup` of a cached 1,024-key chain through the read table (p50 and p99; target p50 <=
0.05 ms) vs redis-py EXISTS of the same 1,024 keys in one pipeline, and its p50 vs the same
lookup asked of the daemon (lookup_asked). `#` lines give one co-located put's and get's
stages (Reserve, copy + checksum, commit; Get, copy + verify; a read through the table:
probe, copy + verify, the versions again), medians; the table read is timed with the native
helper (kvstore/native, one call) and, interleaved, without it (`table read numpy`), and the
line says which helper ran.

Then what authentication costs: a second daemon with auth.mode=token (a bearer token on every
call, the tenant's shared memory an arena reached through the Unix socket) against the first
(auth off), the same lookup p50 and the same 2 MiB shm_get_into, interleaved (target: within
5%, ratio >= 0.95x).

Every figure is warmed up, then ours and its baseline run alternately, repeat by repeat, so
background load hits both alike; the median per-batch figure is reported. Puts write new keys
every repeat (a re-put is an acknowledged no-op) and are evicted/deleted outside the timing.
Prints `bench <name>: <ours> <unit> vs <baseline> <baseline> <unit> = <ratio>x` per figure
(ratio > 1: we are better; latency ratios are baseline/ours) and, with --json, one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import redis
from figures import Figure, Op, gbps_figure, paired, percentile, run_main
from grpc_floor import GrpcFloor

from kvstore import native
from kvstore.client import KVStoreClient
from kvstore.client import _requests as rq
from kvstore.proto import localframe as lp  # the local path's verbs, timed one by one
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.tools.testing import start_daemon, start_redis
from kvstore.units import KiB, MiB, parse_size

ByteArray = npt.NDArray[np.uint8]
NAMESPACE = "bench"
LOOKUP_KEYS = 1024
PAGE_BYTES = 64 * KiB
SLACK_BYTES = 64 * MiB
PAGE_ALIGN = 4096
POSTED_BATCHES = 4  # shm_put_posted: batches posted before one flush()


# --- processes -------------------------------------------------------------------------------


@contextmanager
def kvstore_daemon(workdir: Path, capacity_bytes: int, shm_name: str,
                   *auth: str) -> Iterator[str]:
    """A kvstore-server subprocess with its Unix socket (the local path), SERVING; yields
    its target."""
    daemon = start_daemon(workdir, f"dram.capacity_bytes={capacity_bytes}",
                          f"dram.page_size_bytes={PAGE_BYTES}", f"dram.shm_name={shm_name}",
                          f"server.unix_socket={workdir / 'kvstore.sock'}",
                          "log_level=WARNING", *auth)
    try:
        yield daemon.target
    finally:
        daemon.stop()


@contextmanager
def redis_server(workdir: Path, read_bytes: int) -> Iterator[redis.Redis]:
    """A redis-server subprocess; yields a redis-py client that reads the socket `read_bytes`
    at a time (redis-py's default, 64 KiB, is slower for MiB values with its pure-Python
    parser, so this makes the baseline stronger)."""
    server = start_redis(workdir)
    client = redis.Redis(host="127.0.0.1", port=server.port, socket_read_size=read_bytes)
    try:
        client.ping()
        yield client
    finally:
        client.close()
        server.stop()


# --- measuring -------------------------------------------------------------------------------


# --- data ------------------------------------------------------------------------------------


def size_label(size_bytes: int) -> str:
    for unit, name in ((MiB, "MiB"), (KiB, "KiB")):
        if size_bytes % unit == 0:
            return f"{size_bytes // unit}{name}"
    return f"{size_bytes}B"


def new_keys(n: int) -> list[bytes]:
    return [secrets.token_bytes(32) for _ in range(n)]


def aligned_empty(nbytes: int, offset: int) -> ByteArray:
    """An uninitialised uint8 array whose address is `offset` mod 4096."""
    raw = np.empty(nbytes + 2 * PAGE_ALIGN, dtype=np.uint8)
    start = (offset - raw.ctypes.data) % PAGE_ALIGN
    return raw[start : start + nbytes]


@dataclass
class Blocks:
    """One size's data: 32 payloads (as bytes and as numpy source views) and 32 destination
    arrays, source and destination at the same offset mod 4096 so memcpy runs at full speed
    (no 4K-aliasing penalty flattering us)."""

    size_bytes: int
    payloads: list[bytes]
    sources: list[ByteArray]
    destinations: list[ByteArray]

    @classmethod
    def make(cls, size_bytes: int, batch: int, rng: np.random.Generator) -> Blocks:
        dst_all = np.empty(size_bytes * batch, dtype=np.uint8)
        dst_all.fill(0)  # fault the pages in: "warm"
        src_all = aligned_empty(size_bytes * batch, dst_all.ctypes.data % PAGE_ALIGN)
        src_all[:] = rng.integers(0, 256, size_bytes * batch, dtype=np.uint8)
        sources = [src_all[i * size_bytes : (i + 1) * size_bytes] for i in range(batch)]
        return cls(size_bytes, [s.tobytes() for s in sources], sources,
                   [dst_all[i * size_bytes : (i + 1) * size_bytes] for i in range(batch)])

    @property
    def batch_bytes(self) -> int:
        return self.size_bytes * len(self.payloads)

    def memcpy(self, _state: object = None) -> None:
        for dst, src in zip(self.destinations, self.sources, strict=True):
            np.copyto(dst, src)


# --- the figures -----------------------------------------------------------------------------


@dataclass
class Bench:
    shm: KVStoreClient  # reads L2 through the daemon's read table (the default)
    asked: KVStoreClient  # read_table=False: every read and lookup asks the daemon
    unverified: KVStoreClient  # the read table, checksums not verified
    inline: KVStoreClient
    redis: redis.Redis
    floor: GrpcFloor
    target: str
    repeats: int
    warmup: int

    def _redis_get(self, keys: list[bytes]) -> list[bytes | None]:
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        return pipe.execute()

    def _redis_set(self, keys: list[bytes], values: list[bytes]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for key, value in zip(keys, values, strict=True):
            pipe.set(key, value)
        pipe.execute()

    def _evict(self, keys: list[bytes]) -> None:
        evicted = self.shm.evict(keys).evicted
        if evicted != len(keys):
            raise RuntimeError(f"evicted {evicted} of {len(keys)} put keys; the put lost some")

    def per_size(self, blocks: Blocks) -> list[Figure]:
        label, nbytes = size_label(blocks.size_bytes), blocks.batch_bytes
        keys = new_keys(len(blocks.payloads))
        self.shm.put(keys, blocks.payloads)
        self._redis_set(keys, blocks.payloads)
        self._check_reads(keys, blocks)
        memcpy = Op(blocks.memcpy)
        out = []

        big = blocks.size_bytes >= 2 * MiB
        for name, client, target in (
                ("shm_get_into", self.shm, ">= 0.75x" if big else ">= 0.45x"),
                ("shm_get_into_noverify", self.unverified, ">= 0.9x" if big else ">= 0.7x"),
                ("shm_get_into_asked", self.asked, "")):
            into = Op(lambda _, c=client: c.get_into(keys, blocks.destinations))
            ours, base = paired(into, memcpy, self.repeats, self.warmup)
            out.append(gbps_figure(f"{name}_{label}", nbytes, ours, "memcpy", base,
                                   target=target))

        ours, base = paired(self._put_op(self.shm, blocks), memcpy, self.repeats, self.warmup)
        out.append(gbps_figure(f"shm_put_{label}", nbytes, ours, "memcpy", base,
                               target=">= 0.75x" if big else ">= 0.4x"))
        ours, base = paired(self._posted_op(blocks), Op(lambda _: [
            blocks.memcpy() for _ in range(POSTED_BATCHES)]), self.repeats, self.warmup)
        out.append(gbps_figure(f"shm_put_posted_{label}", nbytes * POSTED_BATCHES, ours,
                               "memcpy", base))
        self._stages(blocks, keys)

        ours, base = paired(Op(lambda _: self.inline.get(keys)),
                            Op(lambda _: self._redis_get(keys)), self.repeats, self.warmup)
        out.append(gbps_figure(f"inline_get_{label}", nbytes, ours, "redis GET", base))
        self.floor.prepare(nbytes)
        ours, base = paired(Op(lambda _: self.inline.get(keys)),
                            Op(lambda _: self.floor.fetch(nbytes)), self.repeats, self.warmup)
        out.append(gbps_figure(f"inline_get_floor_{label}", nbytes, ours, "bare grpc stream",
                               base, target=">= 0.8x"))
        out.append(self._first_put(blocks))

        redis_put = Op(lambda ks: self._redis_set(ks, blocks.payloads),
                       setup=lambda: new_keys(len(blocks.payloads)),
                       teardown=lambda ks: self.redis.delete(*ks))
        ours, base = paired(self._put_op(self.inline, blocks), redis_put, self.repeats,
                            self.warmup)
        out.append(gbps_figure(f"inline_put_{label}", nbytes, ours, "redis SET", base))

        self._evict(keys)
        self.redis.delete(*keys)
        return out

    def _first_put(self, blocks: Blocks) -> Figure:
        """A new client's first put batch (its memory just attached) vs a warm client's."""
        def fresh() -> KVStoreClient:
            client = KVStoreClient(self.target, NAMESPACE, shared_memory=True)
            client.get(new_keys(1))  # a miss: the client attaches the memory here
            return client

        def first(client: KVStoreClient) -> None:
            self._put_op(client, blocks).once()  # its keys evicted after

        ours, base = paired(Op(first, setup=fresh, teardown=lambda c: c.close()),
                            self._put_op(self.shm, blocks), self.repeats, self.warmup)
        return gbps_figure(f"shm_first_put_{size_label(blocks.size_bytes)}",
                           blocks.batch_bytes, ours, "warm client", base, target=">= 0.67x")

    def _stages(self, blocks: Blocks, keys: list[bytes]) -> None:
        """Print one co-located put's and get's stages (medians of the repeats)."""
        local = self.shm._shm.local
        if local is None:
            print("# stages: the local path is off")
            return
        stages: dict[str, list[float]] = {k: [] for k in (
            "reserve", "copy+checksum", "commit", "get", "copy+verify")}
        for _ in range(self.repeats):
            plan = rq.put_plan(NAMESPACE, new_keys(len(blocks.payloads)), blocks.sources,
                               None, False)
            t0 = time.perf_counter()
            reserved = local.call(lp.RESERVE, plan.reserve_request(), pb.ReserveResponse)
            t1 = time.perf_counter()
            checksums = self.shm._shm.write_reservation(reserved, plan.payloads)
            t2 = time.perf_counter()
            local.call(lp.COMMIT, plan.commit_request(reserved.reservation_id, checksums),
                       pb.PutResponse)
            t3 = time.perf_counter()
            got = local.call(lp.GET, self.shm._get_request(keys, True), pb.GetResponse)
            t4 = time.perf_counter()
            self.shm._shm.read_get(got, len(keys), blocks.destinations, True)
            t5 = time.perf_counter()
            for name, s in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4),
                               strict=True):
                stages[name].append(s)
            self._evict(plan.keys)
        tables = self.shm._shm.tables
        if tables is not None:  # a read through the table: probe, copy + verify, versions
            self._table_stages(tables, blocks, keys, stages)
        helper = "native" if native.LIB is not None else "numpy + xxhash (no native helper)"
        print(f"# stages {size_label(blocks.size_bytes)} x {len(keys)} ({helper}): " + ", ".join(
            f"{k} {statistics.median(v) * 1e3:.3f} ms" for k, v in stages.items()))

    def _table_stages(self, tables: Any, blocks: Blocks, keys: list[bytes],
                      stages: dict[str, list[float]]) -> None:
        """A read through the table with the native helper and without, interleaved."""
        stages["table read"], stages["table read numpy"] = [], []
        on = native.LIB is not None
        for _ in range(self.repeats):
            for name, use in (("table read", on), ("table read numpy", False)):
                native.use_native(use)
                t0 = time.perf_counter()
                got_all = tables.read(NAMESPACE, keys, blocks.destinations, True, None)
                stages[name].append(time.perf_counter() - t0)
                if None in got_all:
                    raise RuntimeError("a read through the table missed a cached block")
        native.use_native(on)

    def _put_op(self, client: KVStoreClient, blocks: Blocks) -> Op:
        def run(keys: list[bytes]) -> None:
            result = client.put(keys, blocks.payloads)
            if result.stored != len(keys):
                raise RuntimeError(f"put stored {result.stored} of {len(keys)} new keys")

        return Op(run, setup=lambda: new_keys(len(blocks.payloads)), teardown=self._evict)

    def _posted_op(self, blocks: Blocks) -> Op:
        """POSTED_BATCHES puts posted (put(..., wait=False), from a grant) and one flush()
        that waits for their answers, timed together."""
        def run(batches: list[list[bytes]]) -> None:
            for keys in batches:
                self.shm.put(keys, blocks.payloads, wait=False)
            stored = self.shm.flush().stored
            if stored != POSTED_BATCHES * len(blocks.payloads):
                raise RuntimeError(f"posted puts stored {stored} of "
                                   f"{POSTED_BATCHES * len(blocks.payloads)} new keys")

        def evict(batches: list[list[bytes]]) -> None:
            for keys in batches:
                self._evict(keys)

        return Op(run, setup=lambda: [new_keys(len(blocks.payloads))
                                      for _ in range(POSTED_BATCHES)], teardown=evict)

    def _check_reads(self, keys: list[bytes], blocks: Blocks) -> None:
        """Every path returns the bytes that were put, so no figure measures misses."""
        if self.inline.get(keys) != blocks.payloads or self._redis_get(keys) != blocks.payloads:
            raise RuntimeError("a read returned other bytes than were put")
        for dst in blocks.destinations:
            dst.fill(0)
        sizes = self.shm.get_into(keys, blocks.destinations)
        if sizes != [blocks.size_bytes] * len(keys) or any(
            not np.array_equal(d, s) for d, s in zip(blocks.destinations, blocks.sources,
                                                     strict=True)):
            raise RuntimeError("get_into returned other bytes than were put")
        if not self.shm.uses_shared_memory or self.inline.uses_shared_memory:
            raise RuntimeError("the shm client is not on shared memory, or the inline one is")

    def lookup(self, lookups: int) -> list[Figure]:
        keys = new_keys(LOOKUP_KEYS)
        self.shm.put(keys, [b"x"] * LOOKUP_KEYS)  # one chain, so the whole prefix hits
        self.redis.mset({k: b"x" for k in keys})
        if self.shm.lookup(keys).prefix_length != LOOKUP_KEYS:
            raise RuntimeError("the lookup chain is not fully cached")

        def exists(_: object) -> None:
            pipe = self.redis.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            if sum(pipe.execute()) != LOOKUP_KEYS:
                raise RuntimeError("redis lost lookup keys")

        ours_s, base_s = paired(Op(lambda _: self.shm.lookup(keys)), Op(exists), lookups,
                                self.warmup * 5)
        asked_s, _ = paired(Op(lambda _: self.asked.lookup(keys)), Op(exists), lookups,
                            self.warmup * 5)
        ours_ms = [s * 1e3 for s in ours_s]
        base_ms = [s * 1e3 for s in base_s]
        asked_ms = [s * 1e3 for s in asked_s]
        extra = {"keys": LOOKUP_KEYS, "samples": lookups}
        return [
            Figure(f"lookup_{LOOKUP_KEYS}_p50", percentile(ours_ms, 0.5), "redis EXISTS",
                   percentile(base_ms, 0.5), "ms", lower_is_better=True,
                   target="p50 <= 0.05 ms", extra={**extra, "target_ms": 0.05}),
            Figure(f"lookup_{LOOKUP_KEYS}_p99", percentile(ours_ms, 0.99), "redis EXISTS",
                   percentile(base_ms, 0.99), "ms", lower_is_better=True, extra=extra),
            Figure(f"lookup_asked_{LOOKUP_KEYS}_p50", percentile(ours_ms, 0.5),
                   "the daemon's Lookup", percentile(asked_ms, 0.5), "ms",
                   lower_is_better=True, extra=extra),
        ]


AUTH_TOKEN = secrets.token_urlsafe(32)
AUTH_SIZE = 2 * MiB


def token_daemon_settings(workdir: Path) -> list[str]:
    """auth.mode=token with one tenant owning the bench namespace, and the Unix socket."""
    tenants = workdir / "tenants.yaml"
    tenants.write_text(json.dumps({"tenants": [{
        "name": "bench", "namespaces": [NAMESPACE],
        "tokens_sha256": [hashlib.sha256(AUTH_TOKEN.encode()).hexdigest()]}]}))
    return ["auth.mode=token", f"auth.tenants_file={tenants}",
            f"server.unix_socket={workdir / 'kvstore.sock'}"]


def auth_cost(off: KVStoreClient, token: KVStoreClient, batch: int, repeats: int,
              lookups: int, warmup: int, rng: np.random.Generator) -> list[Figure]:
    """Lookup p50 and 2 MiB shm_get_into with auth.mode=token vs auth off, interleaved."""
    keys = new_keys(LOOKUP_KEYS)
    for client in (off, token):
        client.put(keys, [b"x"] * LOOKUP_KEYS)
    token_s, off_s = paired(Op(lambda _: token.lookup(keys)), Op(lambda _: off.lookup(keys)),
                            lookups, warmup * 5)
    figures = [Figure(f"auth_lookup_{LOOKUP_KEYS}_p50",
                      percentile([t * 1e3 for t in token_s], 0.5), "auth off",
                      percentile([t * 1e3 for t in off_s], 0.5), "ms",
                      lower_is_better=True, target=">= 0.95x",
                      extra={"keys": LOOKUP_KEYS, "samples": lookups, "auth": "token vs off"})]
    blocks = Blocks.make(AUTH_SIZE, batch, rng)
    data = new_keys(batch)
    for client in (off, token):
        client.put(data, blocks.payloads)
        if not client.uses_shared_memory:
            raise RuntimeError("a client of the auth comparison is not on shared memory")
    ours, base = paired(Op(lambda _: token.get_into(data, blocks.destinations)),
                        Op(lambda _: off.get_into(data, blocks.destinations)), repeats, warmup)
    figures.append(gbps_figure(f"auth_shm_get_into_{size_label(AUTH_SIZE)}", blocks.batch_bytes,
                               ours, "auth off", base, target=">= 0.95x"))
    if token.get(data[:1]) != blocks.payloads[:1]:
        raise RuntimeError("the token daemon returned other bytes than were put")
    return figures


def capacity_for(sizes: list[int], batch: int) -> int:
    """L2 bytes for every size's read set, the posted batches and a grant ahead in flight,
    the lookup chain."""
    def pages(size: int) -> int:
        return -(-size // PAGE_BYTES) * PAGE_BYTES

    reads = sum(pages(s) * batch for s in sizes)
    puts = (POSTED_BATCHES + 2) * max(pages(s) for s in sizes) * batch
    return reads + puts + LOOKUP_KEYS * PAGE_BYTES + SLACK_BYTES


def run(args: argparse.Namespace) -> tuple[list[Figure], dict[str, Any]]:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    shm_name = f"kvstore-bench-{os.getpid()}-{secrets.token_hex(4)}"
    capacity = capacity_for(sizes, args.batch)
    rng = np.random.default_rng(0)
    load_before = os.getloadavg()[0]
    figures: list[Figure] = []
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="store-bench-")))
        target = stack.enter_context(kvstore_daemon(workdir, capacity, shm_name))
        redis_client = stack.enter_context(redis_server(workdir, args.redis_read_bytes))
        shm = stack.enter_context(KVStoreClient(target, NAMESPACE, shared_memory=True))
        asked = stack.enter_context(KVStoreClient(target, NAMESPACE, shared_memory=True,
                                                  read_table=False))
        unverified = stack.enter_context(KVStoreClient(target, NAMESPACE, shared_memory=True,
                                                       verify_checksums=False))
        inline = stack.enter_context(KVStoreClient(target, NAMESPACE, shared_memory=False))
        floor = stack.enter_context(GrpcFloor())
        bench = Bench(shm, asked, unverified, inline, redis_client, floor, target,
                      args.repeats, args.warmup)
        for size in sizes:
            figures += bench.per_size(Blocks.make(size, args.batch, rng))
        figures += bench.lookup(args.lookups)
        token_dir = workdir / "token"
        token_dir.mkdir()
        token_target = stack.enter_context(kvstore_daemon(
            token_dir, capacity, f"{shm_name}-unused", *token_daemon_settings(token_dir)))
        with KVStoreClient(token_target, NAMESPACE, shared_memory=True,
                           token=AUTH_TOKEN) as token:
            figures += auth_cost(shm, token, args.batch, args.repeats, args.lookups,
                                 args.warmup, rng)
    setup = {
        "batch": args.batch, "repeats": args.repeats, "warmup": args.warmup,
        "lookups": args.lookups, "sizes_bytes": sizes, "dram_capacity_bytes": capacity,
        "shm_name": shm_name, "cpus": os.cpu_count(), "redis_py": redis.__version__,
        "redis_parser": "hiredis" if importlib.util.find_spec("hiredis") else "python",
        "redis_read_bytes": args.redis_read_bytes, "loadavg_1m": [load_before, os.getloadavg()[0]],
    }
    return figures, setup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="256KiB,2MiB", help="object sizes, comma-separated")
    parser.add_argument("--batch", type=int, default=16, help="objects per batch")
    parser.add_argument("--repeats", type=int, default=20, help="timed batches per figure")
    parser.add_argument("--warmup", type=int, default=3, help="untimed batches per figure")
    parser.add_argument("--lookups", type=int, default=300, help="timed lookups")
    parser.add_argument("--redis-read-bytes", type=parse_size, default=MiB,
                        help="redis-py socket_read_size (default 1MiB: its fastest for MiB values)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny smoke run: 3 repeats, 1 warm-up, 20 lookups (overrides)")
    parser.add_argument("--json", action="store_true", help="also print one JSON object")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup, args.lookups = 3, 1, 20
    if args.batch < 1 or args.repeats < 1 or args.warmup < 0 or args.lookups < 1:
        parser.error("--batch, --repeats and --lookups must be >= 1, --warmup >= 0")
    return run_main(args, run)


if __name__ == "__main__":
    sys.exit(main())
