"""Soak and attack run against a real `kvstore-server` subprocess (L2 in shared memory, L3 in a
temporary folder, L4 on a real `redis-server`), all in one run; regenerates
docs/RELIABILITY.md with `python bench/soak.py --report docs/RELIABILITY.md`.

1. Seed: blocks of known content (shake-256 of namespace and key, so any reader can check
   them) are put with KVStoreClient and remembered.
2. Soak: --clients processes (multiprocessing, spawn) mix put (shared memory and inline),
   get (inline), get_into (shared memory), lookup, prefetch and stats on their own and on
   shared keys, checking every read, while ONE hostile process sends fuzzed requests over
   raw byte channels: random bytes, mutated valid requests, bogus ids, repeated keys, Put
   streams of the wrong shape, streams it cancels midway. --requests in all (10% hostile),
   or until --duration-s. The daemon's RSS is sampled every second throughout.
3. Attacks, one at a time, while a victim process probes Lookup, an inline Get and the
   grpc.health.v1 check with 2 s deadlines: (a) 64 idle header-only Put streams, (b) 64
   inline Gets of a 48 MiB block nobody reads, (c) a lease storm (shared-memory Gets with
   10-minute leases, never released), (d) Reserves of 8 MiB with 10-minute timeouts until
   refused, (e) a pin storm over 8 MiB blocks. Each is compared with a quiet window
   measured just before it; the hog's statuses are counted, then it lets go (cancels,
   disconnects, unpins) and Stats must show its leases / reservations / pins gone.
4. After: the daemon is alive and SERVING, no INTERNAL or UNKNOWN status (clients, and the
   daemon's own `kvstore_rpc_latency_seconds_count`), every block put reads back bit-exact
   (verified / lost / corrupted), no lease or reservation outlives its timeout, RSS
   start / max / end.

Prints `bench attack_<a>_<probe>_p99: <under attack> ms vs quiet <quiet> ms = <ratio>x`
(ratio < 1: the victim is slower under attack), `#` info lines and, with --json, JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import math
import multiprocessing as mp
import os
import platform
import queue
import random
import re
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from multiprocessing import queues, synchronize
from pathlib import Path
from typing import Any, TypeAlias

import grpc
from figures import Figure, percentile, run_main
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import KVStoreClient, KVStoreError
from kvstore.proto.frames import DATA_TAG, varint
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.tools.testing import Daemon, start_daemon, start_redis
from kvstore.units import KiB, MiB, format_size, parse_size

SEED_NS, SHARED_NS, HOG_NS, JUNK_NS = "soak-seed", "soak-shared", "soak-hog", "soak-junk"
SEED_SIZES = (1, 1000, 4096, 4097, 65_536, 100_000, 256 * KiB, MiB)
SHARED_SIZES = (256, 4096, 20_000, 65_536)
SOAK_SIZES, SOAK_WEIGHTS = (512, 2 * KiB, 8 * KiB, 32 * KiB), (4, 4, 2, 1)
VERBS = ("put shm", "put inline", "get inline", "get_into shm", "lookup", "prefetch", "stats")
VERB_WEIGHTS = (10, 5, 20, 20, 30, 8, 7)
SHARED_SHARE = 0.25  # of a client's operations, on the shared keys every client uses
LEASE_TIMEOUT_S = 5.0  # the daemon's default lease and reservation timeouts in this run
TIMEOUT_S = 5.0  # of every raw call; a hung call fails instead of hanging
PROBE_TIMEOUT_S = 2.0  # of the victim's calls
UNREAD_BLOCK = 48 * MiB  # far more than gRPC buffers for a reader that does not read
HOG_BLOCK = 8 * MiB
HOG_STREAMS, HOG_CONNECTIONS = 64, 8
SERVICE = "/kvstore.v1.KVStore/"
HOSTILE_UNARY = ("Lookup", "Reserve", "Release", "Pin", "Unpin", "Stats", "Hot")
HOSTILE_STREAMING = ("Get", "Prefetch", "Prewarm")
FAULTS = ("INTERNAL", "UNKNOWN")
Results: TypeAlias = "queues.Queue[dict[str, Any]]"  # what a spawned process reports
Sample: TypeAlias = tuple[float, str, float, str, str]  # a victim's call: t, probe, ms, code, why
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1),
                  ("grpc.max_receive_message_length", 64 * MiB)]


def payload(namespace: str, key: bytes, size_bytes: int) -> bytes:
    """The content of every block this run puts: anyone can recompute it from the key."""
    return hashlib.shake_256(namespace.encode() + b"\0" + key).digest(size_bytes)


def key_of(*parts: object) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


def shared_blocks() -> list[tuple[bytes, int]]:
    return [(key_of("shared", i), SHARED_SIZES[i % len(SHARED_SIZES)]) for i in range(64)]


def identity(b: bytes) -> bytes:
    return b


def details_of(exc: BaseException | None) -> str:
    """A failed call's message, cut short: it says which limit refused it."""
    if isinstance(exc, grpc.RpcError):
        text = str(exc.details() or "")
    else:
        text = str(exc or "")
    return text if len(text) <= 200 else text[:200] + "..."


def code_of(exc: BaseException) -> str:
    """A failed call's status name, however it failed."""
    if isinstance(exc, KVStoreError):
        return str(exc.code.name)
    if isinstance(exc, grpc.RpcError):
        return str(exc.code().name)
    return f"client {type(exc).__name__}"


# --- tallies ---------------------------------------------------------------------------------


@dataclass
class Tally:
    """Per verb: every latency (ms) and the statuses by code. Plain data, so it crosses
    process boundaries as is."""

    latency_ms: dict[str, list[float]] = field(default_factory=dict)
    codes: dict[str, Counter[str]] = field(default_factory=dict)

    def add(self, verb: str, latency_ms: float, code: str) -> None:
        self.latency_ms.setdefault(verb, []).append(latency_ms)
        self.codes.setdefault(verb, Counter())[code] += 1

    def timed(self, verb: str, call: Callable[[], str]) -> str:
        """Run call (it returns "OK" or what was wrong with the answer); record it."""
        start = time.perf_counter()
        try:
            code = call()
        except Exception as exc:  # recorded by code, never dropped
            code = code_of(exc)
        self.add(verb, (time.perf_counter() - start) * 1e3, code)
        return code

    def merge(self, other: Tally) -> None:
        for verb, samples in other.latency_ms.items():
            self.latency_ms.setdefault(verb, []).extend(samples)
        for verb, codes in other.codes.items():
            self.codes.setdefault(verb, Counter()).update(codes)

    def requests(self) -> int:
        return sum(sum(c.values()) for c in self.codes.values())

    def by_code(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for codes in self.codes.values():
            total.update(codes)
        return total


def check_read(got: Sequence[bytes | None], expected: Sequence[bytes]) -> str:
    if any(g is None for g in got):
        return "MISS"
    return "OK" if list(got) == list(expected) else "CORRUPT"


# --- phase 2: the soak clients -----------------------------------------------------------------


class SoakClient:
    """One soak process: chains in its own namespace and the shared blocks, each through a
    shared-memory client and an inline one."""

    def __init__(self, index: int, target: str, stack: ExitStack) -> None:
        self.rng = random.Random(index)
        self.ns = f"soak-client-{index}"

        def open_(ns: str, shm: bool) -> KVStoreClient:
            return stack.enter_context(KVStoreClient(target, ns, shared_memory=shm))

        self.own = (open_(self.ns, True), open_(self.ns, False))  # (shared memory, inline)
        self.shared = (open_(SHARED_NS, True), open_(SHARED_NS, False))
        self.tally = Tally()
        self.chains: list[list[tuple[bytes, int]]] = []
        self.put_count = 0

    def step(self) -> None:
        verb = self.rng.choices(VERBS, VERB_WEIGHTS)[0]
        on_shared = self.rng.random() < SHARED_SHARE
        if verb.startswith("put"):
            self.tally.timed(verb, lambda: self._put(verb, on_shared))
            return
        on_shared = on_shared or not self.chains
        (client, inline), ns, blocks = self._pick(on_shared)
        keys = [k for k, _ in blocks]
        expected = [payload(ns, k, n) for k, n in blocks]
        calls: dict[str, Callable[[], str]] = {
            "get inline": lambda: check_read(inline.get(keys), expected),
            "get_into shm": lambda: self._get_into(client, keys, expected),
            "lookup": lambda: "OK" if client.lookup(keys).prefix_length == len(keys)
            else "SHORT PREFIX",
            "prefetch": lambda: "OK" if client.prefetch(keys, deadline_s=2.0).missing == 0
            else "MISSING",
            "stats": lambda: "OK" if client.stats().version else "NO VERSION",
        }
        self.tally.timed(verb, calls[verb])

    def _pick(self, on_shared: bool
              ) -> tuple[tuple[KVStoreClient, KVStoreClient], str, list[tuple[bytes, int]]]:
        if on_shared:  # shared blocks are independent: a sample is a valid "chain"
            return self.shared, SHARED_NS, self.rng.sample(shared_blocks(), 3)
        return self.own, self.ns, self.rng.choice(self.chains)

    def _put(self, verb: str, on_shared: bool) -> str:
        path = 0 if verb == "put shm" else 1
        if on_shared:  # seeded already: an acknowledged no-op, exercised under load
            blocks = self.rng.sample(shared_blocks(), 2)
            got = self.shared[path].put([k for k, _ in blocks],
                                        [payload(SHARED_NS, k, n) for k, n in blocks],
                                        independent=True)
            return "OK" if got.existing == 2 else "NOT EXISTING"
        blocks = [(key_of(self.ns, self.put_count, i),
                   self.rng.choices(SOAK_SIZES, SOAK_WEIGHTS)[0])
                  for i in range(self.rng.randint(1, 3))]
        self.put_count += 1
        result = self.own[path].put([k for k, _ in blocks],
                                    [payload(self.ns, k, n) for k, n in blocks])
        self.chains.append(blocks)  # acknowledged (a put that raised never gets here)
        return "OK" if result.stored + result.existing == len(blocks) else "NOT STORED"

    @staticmethod
    def _get_into(client: KVStoreClient, keys: list[bytes], expected: list[bytes]) -> str:
        buffers = [bytearray(len(e)) for e in expected]
        sizes = client.get_into(keys, buffers)
        return check_read([bytes(b) if n is not None else None
                           for b, n in zip(buffers, sizes, strict=True)], expected)


def soak_client(index: int, target: str, requests: int, duration_s: float,
                out: Results) -> None:
    """A spawned soak process: send `requests` or stop at duration_s; report its tally and
    every block it put."""
    with ExitStack() as stack:
        client = SoakClient(index, target, stack)
        deadline = time.monotonic() + duration_s
        while client.tally.requests() < requests and time.monotonic() < deadline:
            client.step()
    blocks = [(client.ns, k, n) for chain in client.chains for k, n in chain]
    out.put({"role": "client", "tally": client.tally, "blocks": blocks})


# --- phase 2: the hostile client ---------------------------------------------------------------


def mutate(data: bytes, rng: random.Random) -> bytes:
    """data with 1-3 of: a bit flipped, a byte set, bytes inserted, deleted, duplicated,
    the tail cut, garbage appended."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        op, i = rng.randrange(7), rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[i % len(b)] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[i % len(b)] = rng.randrange(256)
        elif op == 2:
            b[i:i] = rng.randbytes(rng.randint(1, 8))
        elif op == 3:
            del b[i : i + rng.randint(1, 8)]
        elif op == 4:
            b[i:i] = b[i : i + rng.randint(1, 16)]
        elif op == 5:
            del b[i:]
        else:
            b += rng.randbytes(rng.randint(1, 16))
    return bytes(b)


class Hostile:
    """Fuzzed requests over raw byte channels, in JUNK_NS. Evict is only sent structured:
    random bytes can decode as "evict everything", which would make the verified blocks
    look lost. Leases, reservations and pins it is granted it gives back (some leases and
    reservations are left to expire), so the end of the run can check nothing leaked."""

    def __init__(self, channel: grpc.Channel, seed: int) -> None:
        self.rng = random.Random(seed)
        self.unary = {m: channel.unary_unary(SERVICE + m, request_serializer=identity,
                                             response_deserializer=identity)
                      for m in (*HOSTILE_UNARY, "Evict")}
        self.streaming = {m: channel.unary_stream(SERVICE + m, request_serializer=identity,
                                                  response_deserializer=identity)
                          for m in HOSTILE_STREAMING}
        self.put = channel.stream_unary(SERVICE + "Put", request_serializer=identity,
                                        response_deserializer=identity)
        self.tally = Tally()
        self.keys = [key_of("junk", i) for i in range(16)]
        self.templates = self._templates()
        self.cases: dict[str, Callable[[], None]] = {
            "random": self._random, "mutated": self._mutated, "bogus ids": self._bogus_ids,
            "repeated keys": self._repeated_keys, "cancelled": self._cancelled,
            "put shapes": self._put_shapes, "evict": self._evict}

    def _templates(self) -> dict[str, bytes]:
        ns, keys = JUNK_NS, self.keys
        return {m: r.SerializeToString() for m, r in {
            "Lookup": pb.LookupRequest(namespace=ns, keys=keys[:3]),
            "Reserve": pb.ReserveRequest(namespace=ns, keys=keys[8:9], sizes=[1000],
                                         timeout_ms=1000, independent=True),
            "Release": pb.ReleaseRequest(ids=["bogus"]),
            "Pin": pb.PinRequest(namespace=ns, keys=keys[:2]),
            "Unpin": pb.PinRequest(namespace=ns, keys=keys[:2]),
            "Stats": pb.StatsRequest(namespace=ns, include_config=True),
            "Hot": pb.HotRequest(namespace=ns, limit=10),
            "Get": pb.GetRequest(namespace=ns, keys=keys[:2], mode=pb.GET_MODE_SHARED_MEMORY,
                                 lease_timeout_ms=1000),
            "Prefetch": pb.PrefetchRequest(namespace=ns, keys=keys[:3], deadline_ms=500,
                                           target_tier=pb.TIER_DRAM),
            "Prewarm": pb.PrewarmRequest(bytes=64 * KiB, namespaces=[ns]),
        }.items()}

    def put_messages(self, first: int = 0) -> list[bytes]:
        keys = self.keys[first : first + 2]
        sizes = [3000, 70_000]
        data = b"".join(payload(JUNK_NS, k, n) for k, n in zip(keys, sizes, strict=True))
        header = pb.PutRequest(namespace=JUNK_NS, keys=keys, sizes=sizes, independent=True)
        half = len(data) // 2
        return [header.SerializeToString(), DATA_TAG + varint(half) + data[:half],
                DATA_TAG + varint(len(data) - half) + data[half:]]

    def step(self) -> None:
        name = self.rng.choices(list(self.cases), (15, 40, 8, 8, 12, 12, 5))[0]
        self.cases[name]()

    # --- sending ---

    def call(self, method: str, request: bytes, label: str = "") -> None:
        replies: list[bytes] = []

        def send() -> str:
            if method in self.unary:
                replies.append(self.unary[method](request, timeout=TIMEOUT_S))
            else:
                replies.extend(self.streaming[method](request, timeout=TIMEOUT_S))
            return "OK"

        if self.tally.timed(f"{method} ({label})" if label else method, send) == "OK":
            self._note(method, request, replies)

    def send_put(self, messages: list[bytes], label: str) -> None:
        def send() -> str:
            self.put(iter(messages), timeout=TIMEOUT_S)
            return "OK"

        self.tally.timed(f"Put ({label})", send)

    def _note(self, method: str, request: bytes, replies: list[bytes]) -> None:
        """Give back what an OK answer granted, most of it at once (the rest expires)."""
        held, expires_ms = "", 0
        if method == "Get" and replies:
            head = pb.GetResponse.FromString(replies[0])
            held, expires_ms = head.lease_id, head.lease_expires_in_ms
        elif method == "Reserve":
            reserved = pb.ReserveResponse.FromString(replies[0])
            held, expires_ms = reserved.reservation_id, reserved.expires_in_ms
        elif method == "Pin":
            self.call("Unpin", request, "undo")
        if held and (expires_ms > LEASE_TIMEOUT_S * 1000 or self.rng.random() < 0.7):
            self.call("Release", pb.ReleaseRequest(ids=[held]).SerializeToString(), "undo")

    # --- the cases ---

    def _random(self) -> None:
        method = self.rng.choice([*HOSTILE_UNARY, *HOSTILE_STREAMING, "Put"])
        garbage = [self.rng.randbytes(self.rng.randint(0, 64))
                   for _ in range(self.rng.randint(1, 3))]
        if method == "Put":
            self.send_put(garbage, "random bytes")
        else:
            self.call(method, garbage[0], "random bytes")

    def _mutated(self) -> None:
        method = self.rng.choice([*self.templates, "Put"])
        if method != "Put":
            self.call(method, mutate(self.templates[method], self.rng), "mutated")
            return
        messages = [mutate(m, self.rng) if self.rng.random() < 0.5 else m
                    for m in self.put_messages(self.rng.randrange(8))]
        op = self.rng.randrange(4)
        if op == 0:
            messages.pop(self.rng.randrange(len(messages)))
        elif op == 1:
            messages.insert(1, messages[self.rng.randrange(len(messages))])
        elif op == 2:
            messages[1], messages[2] = messages[2], messages[1]
        self.send_put(messages, "mutated")

    def _bogus_ids(self) -> None:
        ids = self.rng.choice([[os.urandom(16).hex()], [""], ["x" * 100_000],
                               ["lease-1", "lease-1"], [str(self.rng.randrange(1 << 64))]])
        self.call("Release", pb.ReleaseRequest(ids=ids).SerializeToString(), "bogus ids")

    def _repeated_keys(self) -> None:
        keys = [self.keys[0], self.keys[1], self.keys[0]]
        method, request = self.rng.choice([
            ("Get", pb.GetRequest(namespace=JUNK_NS, keys=keys)),
            ("Pin", pb.PinRequest(namespace=JUNK_NS, keys=keys)),
            ("Lookup", pb.LookupRequest(namespace=JUNK_NS, keys=keys)),
            ("Prefetch", pb.PrefetchRequest(namespace=JUNK_NS, keys=keys)),
            ("Reserve", pb.ReserveRequest(namespace=JUNK_NS, keys=keys, sizes=[1, 1, 1]))])
        self.call(method, request.SerializeToString(), "repeated keys")

    def _put_shapes(self) -> None:
        head, *data = self.put_messages(self.rng.randrange(8))
        shapes = {"header twice": [head, head, *data], "no header": data,
                  "data short": [head, data[0]], "data long": [head, *data, data[0]],
                  "header in data": [head, data[0], head]}
        name = self.rng.choice(list(shapes))
        self.send_put(shapes[name], name)

    def _evict(self) -> None:
        keys = self.rng.sample(self.keys, self.rng.randint(0, 4))
        self.call("Evict", pb.EvictRequest(namespace=JUNK_NS, keys=keys).SerializeToString(),
                  "junk keys")

    def _cancelled(self) -> None:
        if self.rng.random() < 0.5:
            self.tally.timed("Put (cancelled midway)", self._cancel_put)
            return
        method = self.rng.choice(["Get", "Prefetch"])
        request = (pb.GetRequest(namespace=JUNK_NS, keys=self.keys[:4]) if method == "Get"
                   else pb.PrefetchRequest(namespace=JUNK_NS, keys=self.keys[:4]))

        def read_one() -> str:
            call = self.streaming[method](request.SerializeToString(), timeout=TIMEOUT_S)
            next(iter(call), None)
            call.cancel()
            return "CANCELLED (by the client)"

        self.tally.timed(f"{method} (cancelled midway)", read_one)

    def _cancel_put(self) -> str:
        messages, sent, release = self.put_messages(), threading.Event(), threading.Event()

        def stream() -> Iterator[bytes]:
            yield from messages[: self.rng.randint(1, 2)]
            sent.set()
            release.wait(TIMEOUT_S)

        future = self.put.future(stream(), timeout=TIMEOUT_S)
        future.add_done_callback(lambda _: sent.set())
        sent.wait(TIMEOUT_S)
        future.cancel()
        release.set()
        try:
            future.result(timeout=TIMEOUT_S)
        except grpc.FutureCancelledError:
            return "CANCELLED (by the client)"
        return "OK"


def hostile_client(target: str, requests: int, duration_s: float,
                   out: Results) -> None:
    """The spawned hostile process: fuzzed requests until `requests` or duration_s."""
    with grpc.insecure_channel(target, options=OWN_CONNECTION) as channel:
        hostile = Hostile(channel, seed=1234)
        for first in range(0, 8, 2):
            hostile.send_put(hostile.put_messages(first), "valid")  # something to find
        deadline = time.monotonic() + duration_s
        while hostile.tally.requests() < requests and time.monotonic() < deadline:
            hostile.step()
    out.put({"role": "hostile", "tally": hostile.tally, "blocks": []})


# --- the daemon, watched -----------------------------------------------------------------------


class RssSampler:
    """The daemon's /proc/<pid>/status VmRSS, RssAnon and RssShmem every interval_s, labelled
    with the phase the run is in."""

    def __init__(self, pid: int, interval_s: float = 1.0) -> None:
        self.pid, self.interval_s, self.phase = pid, interval_s, "start"
        self.t0 = time.monotonic()
        self.samples: list[tuple[float, str, int, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.sample()
        self._thread.start()

    def sample(self) -> None:
        try:
            text = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return  # the daemon is gone: the end of the run reports that
        kib = {m[0]: int(m[1]) * KiB for m in re.findall(r"^(\w+):\s+(\d+) kB", text, re.M)}
        self.samples.append((time.monotonic() - self.t0, self.phase, kib.get("VmRSS", 0),
                             kib.get("RssAnon", 0), kib.get("RssShmem", 0)))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def rpc_counts(daemon: Daemon) -> dict[tuple[str, str], float]:
    """(method, code) -> RPCs answered, from the daemon's Prometheus endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics",
                                  timeout=TIMEOUT_S).read().decode()
    pattern = r'kvstore_rpc_latency_seconds_count\{code="(\w+)",method="(\w+)"\} (\S+)'
    return {(m, c): float(n) for c, m, n in re.findall(pattern, text)}


def longest_stream_wait_s(daemon: Daemon) -> dict[str, float]:
    """Per streaming method, the bound of the smallest bucket of the daemon's
    kvstore_stream_longest_wait_seconds histogram that holds every finished stream: no
    stream waited longer on its client than that (the figure server.stream_idle_s is set
    against). inf when some waited past the largest bucket."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics",
                                  timeout=TIMEOUT_S).read().decode()
    pattern = r'kvstore_stream_longest_wait_seconds_bucket\{le="([^"]+)",method="(\w+)"\} (\S+)'
    buckets: dict[str, list[tuple[float, float]]] = {}
    for le, method, n in re.findall(pattern, text):
        buckets.setdefault(method, []).append((float(le), float(n)))
    out = {}
    for method, rows in buckets.items():
        rows.sort()
        total = rows[-1][1]
        if total:
            out[method] = next(le for le, n in rows if n == total)
    return out


def held(kv: KVStoreClient) -> tuple[int, int, int]:
    stats = kv.stats()
    return stats.leases, stats.reservations, stats.pinned


def wait_held(kv: KVStoreClient, at_most: tuple[int, int, int], timeout_s: float
              ) -> float | None:
    """Seconds until leases, reservations and pins are each back to at_most; None if not
    within timeout_s."""
    start = time.monotonic()
    while True:
        if all(n <= m for n, m in zip(held(kv), at_most, strict=True)):
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            return None
        time.sleep(0.1)


# --- phase 3: the victim and the attacks --------------------------------------------------------


def victim(target: str, lookup_keys: list[bytes], get_key: bytes, get_value: bytes,
           stop: synchronize.Event, out: Results) -> None:
    """A spawned process (so the hogs' threads do not slow it down): Lookup, an inline Get
    and the health check in turn, 2 s deadlines, on its own connection, until stop is set.
    Samples are (monotonic start, probe, latency ms, code, details): CLOCK_MONOTONIC is
    system-wide."""
    samples: list[Sample] = []
    with grpc.insecure_channel(target, options=OWN_CONNECTION) as channel:
        stub, health = rpc.KVStoreStub(channel), health_pb2_grpc.HealthStub(channel)

        def lookup() -> str:
            reply = stub.Lookup(pb.LookupRequest(namespace=SEED_NS, keys=lookup_keys),
                                timeout=PROBE_TIMEOUT_S)
            return "OK" if reply.prefix_length == len(lookup_keys) else "SHORT PREFIX"

        def get() -> str:
            replies = list(stub.Get(pb.GetRequest(namespace=SEED_NS, keys=[get_key]),
                                    timeout=PROBE_TIMEOUT_S))
            return "OK" if b"".join(r.data for r in replies) == get_value else "CORRUPT"

        def check() -> str:
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
            return "OK" if reply.status == health_pb2.HealthCheckResponse.SERVING else "NOT SERVING"

        out.put({"ready": True})
        while not stop.is_set():
            for name, probe in (("lookup", lookup), ("get", get), ("health", check)):
                start, details = time.monotonic(), ""
                try:
                    code = probe()
                except Exception as exc:  # recorded by code, never dropped
                    code, details = code_of(exc), details_of(exc)
                samples.append((start, name, (time.monotonic() - start) * 1e3, code, details))
            time.sleep(0.01)
    out.put({"samples": samples})


@dataclass
class Window:
    """The victim's calls of one probe in one window of time."""

    latency_ms: list[float]
    codes_in_order: list[str]
    details: dict[str, str]  # code -> the message of the first call that failed with it

    @classmethod
    def of(cls, samples: list[Sample], probe: str, start: float, end: float) -> Window:
        mine = [s for s in samples if s[1] == probe and start <= s[0] < end]
        details: dict[str, str] = {}
        for _, _, _, code, text in mine:
            if text:
                details.setdefault(code, text)
        return cls([s[2] for s in mine], [s[3] for s in mine], details)

    @property
    def codes(self) -> Counter[str]:
        return Counter(self.codes_in_order)

    def p(self, q: float) -> float:
        """The q-quantile of the time to a served answer: a call that failed (refused, timed
        out, wrong) counts as the whole 2 s deadline, since the victim went without."""
        served = [ms if code == "OK" else PROBE_TIMEOUT_S * 1e3
                  for ms, code in zip(self.latency_ms, self.codes_in_order, strict=True)]
        return percentile(served, q) if served else math.nan

    def failures(self) -> str:
        bad = {c: n for c, n in self.codes.items() if c != "OK"}
        return ", ".join(f"{c} {n}" for c, n in sorted(bad.items())) or "none"


class Attack:
    """A hog: prepare() untimed before the quiet window, start() puts the hog in place,
    let_go() is what the hog does when it stops (cancel, disconnect, unpin), clean_up()
    what the run does when the daemon did not free the hog's resources by then."""

    name = ""
    let_go_words = ""
    describe = ""  # formatted with the Scale's fields

    def __init__(self, target: str, scale: Scale) -> None:
        self.target, self.scale = target, scale
        self.what = self.describe.format(**asdict(scale))
        self.codes: Counter[str] = Counter()
        self.details: dict[str, str] = {}  # code -> the first refusal's message
        self.channels: list[grpc.Channel] = []

    def count(self, code: str, exc: BaseException | None = None) -> None:
        self.codes[code] += 1
        if exc is not None:
            self.details.setdefault(code, details_of(exc))

    def connect(self, n: int) -> list[grpc.Channel]:
        new = [grpc.insecure_channel(self.target, options=OWN_CONNECTION) for _ in range(n)]
        self.channels += new
        return new

    def disconnect(self) -> None:
        for channel in self.channels:
            channel.close()
        self.channels = []

    def prepare(self, kv: KVStoreClient) -> None:
        """Untimed set-up (the blocks the hog uses)."""

    def start(self) -> None:
        raise NotImplementedError

    def hold_s(self) -> float:
        return self.scale.hold_s

    def let_go(self) -> None:
        self.disconnect()

    def clean_up(self) -> str:
        """'' when there is nothing the run can do."""
        return ""


class IdleStreams(Attack):
    """Streams that sit idle: held past server.stream_idle_s when the daemon has one (up to
    30 s), to see what it does with them."""

    def hold_s(self) -> float:
        idle_s = self.scale.stream_idle_s
        return max(self.scale.hold_s, idle_s + 2.0 if 0 < idle_s <= 30 else 0.0)


class IdlePuts(IdleStreams):
    name, let_go_words = "idle_puts", "the hog cancelled"
    describe = (f"{HOG_STREAMS} Put streams on {HOG_CONNECTIONS} connections that send a header "
            "(one key, sizes [1000], independent) and then nothing")

    def start(self) -> None:
        self.release = threading.Event()
        self.calls: list[grpc.Future] = []
        for i, channel in enumerate(self.connect(HOG_CONNECTIONS) * 8):
            header = pb.PutRequest(namespace=HOG_NS, keys=[key_of("idle", i)], sizes=[1000],
                                   independent=True)
            self.calls.append(rpc.KVStoreStub(channel).Put.future(
                self._idle(header), timeout=120))
        time.sleep(1.0)  # refusals come back at once

    def _idle(self, header: pb.PutRequest) -> Iterator[pb.PutRequest]:
        yield header
        self.release.wait(120)

    def let_go(self) -> None:
        for call in self.calls:
            if call.done():
                exc = call.exception()
                self.count(code_of(exc) if exc else "OK", exc)
            else:
                self.codes["held open until the hog cancelled"] += 1
                call.cancel()
        self.release.set()
        self.disconnect()


class UnreadGets(IdleStreams):
    name, let_go_words = "unread_gets", "the hog cancelled"
    describe = (f"{HOG_STREAMS} inline Gets of a {format_size(UNREAD_BLOCK)} block on "
            f"{HOG_CONNECTIONS} connections; the hog reads the header, then nothing")

    def prepare(self, kv: KVStoreClient) -> None:
        self.key = key_of("unread")
        with KVStoreClient(self.target, HOG_NS) as hog:
            hog.put([self.key], [bytes(UNREAD_BLOCK)])

    def start(self) -> None:
        self.calls: list[Any] = []
        lock = threading.Lock()

        def open_one(channel: grpc.Channel) -> None:
            call = rpc.KVStoreStub(channel).Get(pb.GetRequest(namespace=HOG_NS,
                                                              keys=[self.key]), timeout=120)
            try:
                next(call)
            except Exception as exc:  # refused: counted by code
                with lock:
                    self.count(code_of(exc), exc)
                return
            with lock:
                self.calls.append(call)

        threads = [threading.Thread(target=open_one, args=(ch,), daemon=True)
                   for ch in self.connect(HOG_CONNECTIONS) * 8]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)

    def let_go(self) -> None:
        for call in self.calls:
            if call.done():  # the daemon ended it (an idle-stream limit)
                self.count(call.code().name)
                self.details.setdefault(call.code().name, str(call.details()))
            else:
                self.codes["header read, then left unread (not ended on the hog's side)"] += 1
                call.cancel()
        self.disconnect()


class LeaseStorm(Attack):
    name, let_go_words = "lease_storm", "the hog disconnected"
    describe = ("{leases} shared-memory Gets of seed blocks with lease_timeout_ms=600000, "
                "never released (4 threads)")

    def prepare(self, kv: KVStoreClient) -> None:
        self.keys = [key_of(SEED_NS, i) for i in range(0, 64, 8)]  # the 1-byte seed blocks
        self.ids: list[str] = []

    def start(self) -> None:
        (channel,) = self.connect(1)
        stub, lock = rpc.KVStoreStub(channel), threading.Lock()

        def storm(n: int) -> None:
            for i in range(n):
                request = pb.GetRequest(namespace=SEED_NS, keys=[self.keys[i % len(self.keys)]],
                                        mode=pb.GET_MODE_SHARED_MEMORY, lease_timeout_ms=600_000)
                error: Exception | None = None
                try:
                    head = next(iter(stub.Get(request, timeout=TIMEOUT_S)))
                    code = "OK (lease kept)" if head.lease_id else "OK (no lease)"
                except Exception as exc:  # refused: counted by code
                    head, code, error = None, code_of(exc), exc
                with lock:
                    self.count(code, error)
                    if head is not None and head.lease_id:
                        self.ids.append(head.lease_id)

        threads = [threading.Thread(target=storm, args=(self.scale.leases // 4,))
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def clean_up(self) -> str:
        return release_all(self.target, self.ids)


def release_all(target: str, ids: list[str]) -> str:
    released: Counter[str] = Counter()
    with KVStoreClient(target, HOG_NS) as kv:
        for i in range(0, len(ids), 256):
            try:
                kv.release(ids[i : i + 256])
                released["OK"] += 1
            except KVStoreError as exc:  # some expired meanwhile: INVALID_ARGUMENT
                released[exc.code.name] += 1
    return f"an explicit Release of the {len(ids)} ids (Release calls: {codes_text(released)})"


class ReserveFull(Attack):
    name, let_go_words = "reserve_full", "the hog disconnected"
    describe = (f"Reserves of {format_size(HOG_BLOCK)} (timeout_ms=600000), one after another, "
            "until three in a row are refused")

    def start(self) -> None:
        (channel,) = self.connect(1)
        stub, refused = rpc.KVStoreStub(channel), 0
        self.ids: list[str] = []
        for i in range(self.scale.reserves):
            request = pb.ReserveRequest(namespace=HOG_NS, keys=[key_of("reserve", i)],
                                        sizes=[HOG_BLOCK], timeout_ms=600_000, independent=True)
            try:
                self.ids.append(stub.Reserve(request, timeout=TIMEOUT_S).reservation_id)
                self.count("OK")
                refused = 0
            except grpc.RpcError as exc:
                self.count(code_of(exc), exc)
                refused += 1
                if refused == 3:
                    break

    def clean_up(self) -> str:
        return release_all(self.target, self.ids)


class PinStorm(Attack):
    name, let_go_words = "pin_storm", "the hog unpinned"
    describe = ("Pin, over and over, of {pin_blocks} blocks of " + format_size(HOG_BLOCK)
                + " (one at a time and all at once) for the whole hold")

    def prepare(self, kv: KVStoreClient) -> None:
        self.keys = [key_of("pin", i) for i in range(self.scale.pin_blocks)]
        with KVStoreClient(self.target, HOG_NS) as hog:
            for key in self.keys:
                hog.put([key], [bytes(HOG_BLOCK)], independent=True)

    def start(self) -> None:
        (channel,) = self.connect(1)
        self.stub, self.stop = rpc.KVStoreStub(channel), threading.Event()
        self.thread = threading.Thread(target=self._storm, daemon=True)
        self.thread.start()
        time.sleep(0.5)

    def _storm(self) -> None:
        while not self.stop.is_set():
            for keys in [[k] for k in self.keys] + [self.keys]:
                try:
                    self.stub.Pin(pb.PinRequest(namespace=HOG_NS, keys=keys), timeout=TIMEOUT_S)
                    self.count("OK")
                except grpc.RpcError as exc:
                    self.count(code_of(exc), exc)

    def let_go(self) -> None:
        self.stop.set()
        self.thread.join()
        try:
            self.stub.Unpin(pb.PinRequest(namespace=HOG_NS, keys=self.keys), timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            self.count(f"Unpin {code_of(exc)}", exc)
        self.disconnect()


@dataclass(frozen=True)
class Scale:
    quiet_s: float
    hold_s: float
    leases: int
    reserves: int
    pin_blocks: int
    stream_idle_s: float  # the daemon's server.stream_idle_s; 0 when it has none


@dataclass
class AttackResult:
    name: str
    what: str
    hog_codes: dict[str, int]
    hog_details: dict[str, str]
    quiet: dict[str, Window]
    attack: dict[str, Window]
    before: tuple[int, int, int]
    during: tuple[int, int, int]  # once the hog is in place
    held_at_end: tuple[int, int, int]  # at the end of the hold, before the hog lets go
    after: tuple[int, int, int]
    freed: str
    hold_s: float


def settle(kv: KVStoreClient, timeout_s: float = 15.0) -> None:
    """Until no tier has transfers in flight (the L4 write-through of a prepared block), so
    the quiet window is quiet."""
    deadline = time.monotonic() + timeout_s
    while any(t.queue_depth for t in kv.stats().tiers) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # and the copies and frees after it


def run_attack(attack: Attack, kv: KVStoreClient, rss: RssSampler
               ) -> tuple[AttackResult, tuple[float, float, float]]:
    """Prepare, measure a quiet window, attack, let go; the result and the window times."""
    rss.phase = f"attack {attack.name}"
    attack.prepare(kv)
    settle(kv)
    before = held(kv)
    quiet_start = time.monotonic()
    time.sleep(attack.scale.quiet_s)
    attack_start = time.monotonic()
    attack.start()
    during = held(kv)
    time.sleep(max(0.0, attack_start + attack.hold_s() - time.monotonic()))
    attack_end = time.monotonic()
    held_at_end = held(kv)
    attack.let_go()
    freed_s = wait_held(kv, before, 3.0)
    if freed_s is not None:
        freed = f"yes, {freed_s:.1f} s after {attack.let_go_words}"
    else:
        how = attack.clean_up()
        again = wait_held(kv, before, 10.0) if how else None
        freed = (f"not within 3 s after {attack.let_go_words}; "
                 + (f"after {how}: {'yes' if again is not None else 'no'}" if how else "no"))
    result = AttackResult(attack.name, attack.what, dict(attack.codes), attack.details, {}, {},
                          before, during, held_at_end,
                          held(kv), freed, attack_end - attack_start)
    return result, (quiet_start, attack_start, attack_end)


def victim_target(daemon: Daemon) -> str:
    """Where the victim connects: over IPv6 loopback when the host has it, so that it is
    another client than the hogs on 127.0.0.1 (the daemon's caps are per peer host)."""
    return f"[::1]:{daemon.port}" if socket.has_ipv6 else daemon.target


def attacks(daemon: Daemon, scale: Scale, rss: RssSampler, lookup_keys: list[bytes],
            get_key: bytes, get_value: bytes) -> list[AttackResult]:
    ctx = mp.get_context("spawn")
    out: Results = ctx.Queue()
    stop = ctx.Event()
    proc = ctx.Process(target=victim, args=(victim_target(daemon), lookup_keys, get_key,
                                            get_value, stop, out))
    proc.start()
    out.get(timeout=60)
    results, windows = [], []
    with KVStoreClient(daemon.target, HOG_NS, shared_memory=False) as kv:
        for cls in (IdlePuts, UnreadGets, LeaseStorm, ReserveFull, PinStorm):
            attack = cls(daemon.target, scale)
            result, times = run_attack(attack, kv, rss)
            print(f"# attack {result.name}: hog {result.hog_codes}; freed: {result.freed}",
                  flush=True)
            results.append(result)
            windows.append(times)
        kv.evict(all=True)  # the hogs' blocks
    stop.set()
    samples = out.get(timeout=120)["samples"]
    proc.join(30)
    for result, (quiet_start, attack_start, attack_end) in zip(results, windows, strict=True):
        for probe in ("lookup", "get", "health"):
            result.quiet[probe] = Window.of(samples, probe, quiet_start, attack_start)
            result.attack[probe] = Window.of(samples, probe, attack_start, attack_end)
    return results


# --- phases 1, 2 and 4 ------------------------------------------------------------------------


def seed(target: str) -> list[tuple[str, bytes, int]]:
    """The seed chains (16 x 8 blocks of SEED_SIZES) and the shared keys, put and returned."""
    blocks: list[tuple[str, bytes, int]] = []
    with KVStoreClient(target, SEED_NS) as kv:
        for chain in range(16):
            keys = [key_of(SEED_NS, chain * 8 + i) for i in range(8)]
            values = [payload(SEED_NS, k, n) for k, n in zip(keys, SEED_SIZES, strict=True)]
            if kv.put(keys, values).stored != len(keys):
                raise RuntimeError("the seed put did not store every block")
            blocks += [(SEED_NS, k, len(v)) for k, v in zip(keys, values, strict=True)]
    with KVStoreClient(target, SHARED_NS) as kv:
        pairs = shared_blocks()
        kv.put([k for k, _ in pairs], [payload(SHARED_NS, k, n) for k, n in pairs],
               independent=True)
        blocks += [(SHARED_NS, k, n) for k, n in pairs]
    return blocks


def soak(target: str, args: argparse.Namespace) -> tuple[Tally, Tally, list[Any], list[int]]:
    """The soak clients and the hostile one, in spawned processes: their tallies, every
    block the clients put, and each process's exit code."""
    ctx = mp.get_context("spawn")
    out: Results = ctx.Queue()
    hostile_requests = max(1, args.requests // 10)
    per_client = (args.requests - hostile_requests) // args.clients
    procs = [ctx.Process(target=soak_client, args=(i, target, per_client, args.duration_s, out))
             for i in range(args.clients)]
    procs.append(ctx.Process(target=hostile_client,
                             args=(target, hostile_requests, args.duration_s, out)))
    for p in procs:
        p.start()
    clients, hostile, blocks = Tally(), Tally(), []
    deadline = time.monotonic() + args.duration_s + 120
    for _ in procs:
        while True:
            try:
                result = out.get(timeout=1.0)
                break
            except queue.Empty:
                if time.monotonic() > deadline or not any(p.is_alive() for p in procs):
                    raise RuntimeError("a soak process died before reporting") from None
        (clients if result["role"] == "client" else hostile).merge(result["tally"])
        blocks += result["blocks"]
    for p in procs:
        p.join(30)
    return clients, hostile, blocks, [p.exitcode if p.exitcode is not None else -1
                                      for p in procs]


def verify(target: str, blocks: list[tuple[str, bytes, int]]) -> dict[str, int]:
    """Every block put reads back as put: verified, lost (a miss) or corrupted (other
    bytes). Checksums are not verified by the client here, so damage shows as damage."""
    by_ns: dict[str, dict[bytes, int]] = {}
    for ns, key, size in blocks:
        by_ns.setdefault(ns, {})[key] = size
    counts: Counter[str] = Counter()
    for ns, sizes in by_ns.items():
        keys = list(sizes)
        with KVStoreClient(target, ns, shared_memory=False, verify_checksums=False) as kv:
            for i in range(0, len(keys), 64):
                batch = keys[i : i + 64]
                for key, got in zip(batch, kv.get(batch), strict=True):
                    counts["lost" if got is None else "verified"
                           if got == payload(ns, key, sizes[key]) else "corrupted"] += 1
    return {k: counts[k] for k in ("verified", "lost", "corrupted")}


def after(daemon: Daemon, blocks: list[tuple[str, bytes, int]]) -> dict[str, Any]:
    """The end state: alive, SERVING, blocks intact, nothing left held, the daemon's own
    count of statuses, its log."""
    log = daemon.log()
    end: dict[str, Any] = {
        "alive": daemon.proc.poll() is None, "tracebacks": log.count("Traceback"),
        "error_lines": sum(" ERROR " in line for line in log.splitlines())}
    if not end["alive"]:
        return end | {"health": "DEAD", "objects": {"verified": 0, "lost": len(blocks),
                                                    "corrupted": 0},
                      "leases": -1, "reservations": -1, "pinned": -1, "settled_s": None,
                      "metrics_by_code": {}, "config": {}, "checksum_failures": 0}
    end["objects"] = verify(daemon.target, blocks)
    with KVStoreClient(daemon.target, HOG_NS, shared_memory=False) as kv:
        end["health"] = kv.health()
        end["settled_s"] = wait_held(kv, (0, 0, 0), LEASE_TIMEOUT_S + 5.0)
        end["leases"], end["reservations"], end["pinned"] = held(kv)
        stats = kv.stats(include_config=True)
    metrics: Counter[str] = Counter()
    for (_, code), n in rpc_counts(daemon).items():
        metrics[code] += int(n)
    return end | {"metrics_by_code": dict(metrics), "config": stats.config() or {},
                  "checksum_failures": sum(t.checksum_failures for t in stats.tiers)}


# --- the report --------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def codes_text(codes: Counter[str] | dict[str, int]) -> str:
    return ", ".join(f"{c} {n:,}" for c, n in sorted(codes.items(), key=lambda x: -x[1]))


def verb_rows(tally: Tally) -> list[list[object]]:
    return [[verb, f"{len(ms):,}", f"{percentile(ms, 0.5):.2f}", f"{percentile(ms, 0.99):.2f}",
             codes_text(tally.codes[verb])] for verb, ms in sorted(tally.latency_ms.items())]


def mib(n: int) -> str:
    return f"{n / MiB:,.0f}"


def sparkline(values: list[int], width: int = 72) -> str:
    if not values:
        return ""
    step = max(1, math.ceil(len(values) / width))
    points = [max(values[i : i + step]) for i in range(0, len(values), step)]
    low, high, ramp = min(points), max(points), " .:-=+*#%@"
    return "".join(ramp[0 if high == low else int((p - low) / (high - low) * (len(ramp) - 1))]
                   for p in points)


def rss_section(samples: list[tuple[float, str, int, int, int]]) -> str:
    rss = [s[2] for s in samples]
    picks = sorted({0, len(samples) - 1, rss.index(max(rss)),
                    *(i for i in range(1, len(samples)) if samples[i][1] != samples[i - 1][1]),
                    *range(0, len(samples), max(1, len(samples) // 10))})
    rows = [[f"{samples[i][0]:.0f}", samples[i][1], mib(samples[i][2]), mib(samples[i][3]),
             mib(samples[i][4])] for i in picks]
    return (f"VmRSS, one character per {max(1, math.ceil(len(rss) / 72))} s sample(s), "
            f"{mib(min(rss))} MiB (` `) to {mib(max(rss))} MiB (`@`):\n\n"
            f"```\n{sparkline(rss)}\n```\n\n"
            + table(["t (s)", "phase", "VmRSS MiB", "RssAnon MiB", "RssShmem MiB"], rows))


def attack_rows(results: list[AttackResult]) -> list[list[object]]:
    rows: list[list[object]] = []
    for r in results:
        for probe in ("lookup", "get", "health"):
            q, a = r.quiet[probe], r.attack[probe]
            rows.append([r.name, probe, f"{q.p(0.5):.2f} / {q.p(0.99):.2f}",
                         f"{a.p(0.5):.2f} / {a.p(0.99):.2f}",
                         f"{a.codes.get('OK', 0):,} of {len(a.latency_ms):,}",
                         a.codes.get("DEADLINE_EXCEEDED", 0), a.failures()])
    return rows


def summary_rows(summary: dict[str, Any], clients: Tally, hostile: Tally,
                 rss: RssSampler) -> list[list[object]]:
    end, objects = summary["after"], summary["after"]["objects"]
    rss_values = [s[2] for s in rss.samples]
    soak_codes = clients.by_code()
    return [
        ["requests sent by the soak clients", f"{clients.requests():,}"],
        ["requests sent by the hostile client", f"{hostile.requests():,}"],
        ["RPCs the daemon answered (its metrics, every phase)",
         f"{sum(end['metrics_by_code'].values()):,}"],
        ["daemon crashes", 0 if end["alive"] else 1],
        ["soak processes that exited non-zero", sum(1 for c in summary["exit_codes"] if c)],
        ["health at the end", end["health"]],
        ["INTERNAL / UNKNOWN answers seen by clients", summary["client_faults"]],
        ["INTERNAL / UNKNOWN answers in the daemon's metrics",
         sum(end["metrics_by_code"].get(c, 0) for c in FAULTS)],
        ["Tracebacks / ERROR lines in the daemon log",
         f"{end['tracebacks']} / {end['error_lines']}"],
        ["objects verified / lost / corrupted at the end",
         f"{objects['verified']:,} / {objects['lost']:,} / {objects['corrupted']:,}"],
        ["soak reads that missed / came back wrong (MISS, SHORT PREFIX / CORRUPT)",
         f"{soak_codes.get('MISS', 0) + soak_codes.get('SHORT PREFIX', 0)} / "
         f"{soak_codes.get('CORRUPT', 0)}"],
        ["checksum failures the tiers counted", end["checksum_failures"]],
        ["leases / reservations / pins left at the end",
         f"{end['leases']} / {end['reservations']} / {end['pinned']}"],
        ["longest wait of a soak stream on its client (histogram bound, by method)",
         ", ".join(f"{m} <= {s:g} s" for m, s in sorted(summary["stream_wait"].items()))
         or "-"],
        ["daemon VmRSS start / max / end (MiB)",
         f"{mib(rss_values[0])} / {mib(max(rss_values))} / {mib(rss_values[-1])}"],
        ["run time", f"{summary['run_s']:.0f} s (soak {summary['soak_s']:.0f} s, attacks "
                     f"{summary['attacks_s']:.0f} s)"],
    ]


def tried_section(summary: dict[str, Any], args: argparse.Namespace) -> str:
    caps = ", ".join(f"`{k}={v}`" for k, v in summary["caps"].items())
    return (
        f"One `kvstore-server` subprocess ({summary['settings_text']}) with L2 in shared "
        "memory, L3 in a temporary folder and L4 on a real `redis-server`, all on loopback. "
        f"Its limits as it reported them (Stats with include_config): {caps}.\n\n"
        f"1. **Seed**: {summary['seeded']} blocks of known content (shake-256 of namespace and "
        "key; sizes from 1 B to 1 MiB in chains of 8, and 64 shared blocks), put with "
        "`KVStoreClient`.\n"
        f"2. **Soak**: {args.clients} client processes (spawned) and one hostile process, "
        f"{summary['requests_asked']:,} requests asked for (10% hostile), at most "
        f"{args.duration_s:.0f} s. Each client mixes put (shared memory / inline), get "
        "(inline), get_into (shared memory), lookup, prefetch and stats, 75% on chains of "
        "its own namespace and 25% on the shared blocks every client re-puts and reads; every "
        "read is checked against the content it must have. The hostile process sends, over "
        "raw byte channels: random bytes to every method, valid requests with bytes flipped "
        "/ set / inserted / deleted / duplicated / cut, Put streams with messages dropped, "
        "repeated or swapped, a header twice or none, data short or long, bogus and 100 kB "
        "Release ids, repeated keys, and Put / Get / Prefetch streams it cancels midway. It "
        "gives back the leases, reservations and pins it is granted (some are left to "
        "expire).\n"
        "3. **Attacks**, one at a time, while a victim process (on `::1`, a client of its "
        "own) probes Lookup (a seed chain), "
        "an inline Get (a 4 KiB seed block) and the `grpc.health.v1` check, each with a 2 s "
        f"deadline: {args.quiet_s:.1f} s of quiet measured just before each attack, then at "
        f"least {args.hold_s:.1f} s under it (the idle-stream attacks are held past "
        "`server.stream_idle_s` when the daemon has one). Then the hog lets go (cancels, "
        "disconnects, unpins) and Stats must show its leases / reservations / pins back at "
        "their pre-attack values.\n"
        "4. **After**: liveness and health, the daemon's own status counts and log, every "
        "block read back, leases and reservations (each must be gone within the 5 s "
        "timeouts configured here), RSS.\n")


def attack_section(results: list[AttackResult]) -> str:
    why = [[r.name, "hog", code, f"`{text}`"] for r in results
           for code, text in r.hog_details.items()]
    why += [[r.name, f"victim {probe}", code, f"`{text}`"] for r in results
            for probe in ("lookup", "get", "health")
            for code, text in r.attack[probe].details.items()]
    return "\n".join([
        table(["attack", "what the hog does", "held", "hog's statuses by code",
               "leases / reservations / pins: before → hog in place → end of hold → after",
               "freed"],
              [[r.name, r.what, f"{r.hold_s:.0f} s", codes_text(r.hog_codes),
                " → ".join("/".join(map(str, h)) for h in
                           (r.before, r.during, r.held_at_end, r.after)), r.freed]
               for r in results]),
        "Leases, reservations and pins are daemon-wide counts from Stats: the victim's own "
        "Get in flight can show as one lease.\n",
        "Victim latency: p50 / p99 in ms of the time to a served answer; a call that "
        "failed (refused, timed out, wrong answer) counts as the whole 2 s deadline.\n",
        table(["attack", "probe", "quiet p50 / p99", "under attack p50 / p99",
               "served under attack", "timeouts (2 s)", "failed calls under attack"],
              attack_rows(results)),
        "Why calls were refused (the first message of each code):\n",
        table(["attack", "caller", "code", "message"], why) if why else "none\n",
    ])


def report(summary: dict[str, Any], clients: Tally, hostile: Tally,
           results: list[AttackResult], rss: RssSampler, args: argparse.Namespace) -> str:
    metrics = sorted(summary["after"]["metrics_by_code"].items(), key=lambda x: -int(x[1]))
    return "\n".join([
        "# Reliability: soak and attack run\n",
        "Generated by `python bench/soak.py --report docs/RELIABILITY.md` "
        f"({summary['mode']}) on {summary['machine']}, {summary['date']}. Every figure below "
        "comes from that one run: to change this file, change the script and rerun it.\n",
        "## Summary\n",
        table(["figure", "value"], summary_rows(summary, clients, hostile, rss)),
        "## What was tried\n",
        tried_section(summary, args),
        "## Soak: latency per verb (client side)\n",
        "Latency in ms. `MISS` / `SHORT PREFIX` / `CORRUPT`: the call succeeded but a block "
        "that must be there was not, or had other bytes.\n",
        table(["verb", "calls", "p50 ms", "p99 ms", "statuses by code"], verb_rows(clients)),
        "## Soak: the hostile client\n",
        table(["request", "calls", "p50 ms", "p99 ms", "statuses by code"], verb_rows(hostile)),
        "## The daemon's own count of statuses\n",
        "From `kvstore_rpc_latency_seconds_count{code=...}` at the end: every method, every "
        "phase, set-up and verification included.\n",
        table(["code", "RPCs"], [[c, f"{n:,}"] for c, n in metrics]),
        "## Attacks: the victim under each attack vs. the quiet window before it\n",
        attack_section(results),
        "## Daemon RSS over time\n",
        rss_section(rss.samples),
        HOW_TO_READ,
    ])


HOW_TO_READ = """## How to read this

- **Crashes, INTERNAL / UNKNOWN, Tracebacks** must all be 0: a hostile or broken request is
  answered with the status the contract names (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
  FAILED_PRECONDITION, ABORTED, ...), never with a fault. Client-side CANCELLED (by the
  client) is the hostile client hanging up on purpose.
- **lost / corrupted** must be 0: every block put (seed, shared, and every block each soak
  client put) is read back at the end with checksums off in the client, so damage shows as
  damage rather than as a miss. With L4 on, a block L2 and L3 had to drop is still in Redis.
- **Victim p99 under attack vs quiet**: the `bench attack_*` lines print it as a ratio
  (quiet / under attack; below 1 means the victim got slower). A hog may slow the victim; it
  must not starve it: timeouts (2 s) should be 0 and Lookup and health always answer.
  A call that failed counts as the whole 2 s deadline in the percentiles, so a victim whose
  Get is refused at once (RESOURCE_EXHAUSTED while the hog holds the stream slots) shows as
  starved, not as fast; the failures are listed by code, with the daemon's message.
- Every process here runs on one host, over loopback. The daemon tells clients apart by the
  peer's host, so the victim connects over IPv6 loopback (`::1`) and every hog and soak
  client over `127.0.0.1`: two clients, as two hosts or pods would be. Were they one
  client, a refusal the hog earned (a per-client cap) would land on the victim too.
- **freed**: once the hog cancels, disconnects or unpins, its leases, reservations and pins
  should go back to the pre-attack count without help; "end of hold" shows what the daemon
  already let go by itself (an idle-stream limit) while the hog still held on. Where the
  daemon cannot see the hog go (unary Gets and Reserves with 10-minute timeouts), the run
  releases the ids itself and says so; per-client caps (`clients.*`) bound how much one
  client can hold meanwhile.
- **RSS**: VmRSS includes the touched pages of the L2 shared-memory segment (RssShmem),
  which grow with the data held. RssAnon is the daemon's own heap: it grows with the index
  as the soak stores blocks, and with the buffers an attack makes the daemon allocate (the
  48 MiB block of the unread Gets); CPython and glibc seldom hand freed heap back, so a
  plateau after an attack is expected, while a climb that goes on when nothing new is
  stored would be a leak.
- Figures come from one run on the machine named above (two cores run the daemon, Redis, the
  clients and the hog together): compare runs on the same machine, not across machines.

The bounded, CI-run versions of these checks are the daemon's tests:
`tests/integration/test_stream_caps.py` (idle and unread streams),
`tests/integration/test_hostile_requests.py` (requests a broken client sends),
`tests/integration/test_fuzz.py` (hypothesis fuzzing of every method),
`tests/integration/test_faults.py` and `tests/integration/test_l3_faults.py` (tier and L3
faults). This run is the long, unbounded-by-CI version: more requests, more at once, and
attacks held open.
"""


# --- main ------------------------------------------------------------------------------------


def machine() -> str:
    cpu = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
    mem = re.search(r"MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text())
    return (f"{platform.node()} ({os.cpu_count()} CPUs, {cpu[1].strip() if cpu else '?'}, "
            f"{int(mem[1]) * KiB / (1 << 30) if mem else 0:.0f} GiB RAM, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
            f"grpcio {grpc.__version__})")


def size_text(n: int) -> str:
    return f"{n // MiB}MiB" if n % MiB == 0 else str(n)


def daemon_settings(args: argparse.Namespace, redis_url: str) -> list[str]:
    host = ["server.host=[::]"] if socket.has_ipv6 else []  # IPv4 and IPv6 loopback both
    return [*host, f"dram.capacity_bytes={size_text(args.l2)}", "dram.page_size_bytes=4KiB",
            f"nvme.capacity_bytes={size_text(args.l3)}", "nvme.page_size_bytes=4KiB",
            f"remote.url={redis_url}", f"leases.lease_timeout_s={LEASE_TIMEOUT_S}",
            f"leases.reservation_timeout_s={LEASE_TIMEOUT_S}", "leases.sweep_interval_s=0.5",
            "log_level=WARNING", *args.set]


def caps_of(config: dict[str, Any]) -> dict[str, Any]:
    """The daemon's stream limits and per-client caps (whichever of them it has)."""
    server = config.get("server", {})
    caps = {f"server.{k}": server[k] for k in ("workers", "max_streams",
                                               "max_streams_per_connection", "stream_idle_s")
            if k in server}
    caps |= {f"clients.{k}": v for k, v in config.get("clients", {}).items()}
    caps |= {f"leases.{k}": v for k, v in config.get("leases", {}).items()}
    return caps


def figures_of(results: list[AttackResult]) -> list[Figure]:
    return [Figure(f"attack_{r.name}_{probe}_p99", r.attack[probe].p(0.99), "quiet",
                   r.quiet[probe].p(0.99), "ms", lower_is_better=True,
                   extra={"timeouts": r.attack[probe].codes.get("DEADLINE_EXCEEDED", 0),
                          "codes": dict(r.attack[probe].codes), "hog_codes": r.hog_codes,
                          "freed": r.freed})
            for r in results for probe in ("lookup", "get", "health")]


def run(args: argparse.Namespace) -> tuple[list[Figure], dict[str, Any]]:
    started = time.monotonic()
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-")))
        redis = start_redis(workdir)
        stack.callback(redis.stop)
        settings = daemon_settings(args, redis.url)
        daemon = start_daemon(workdir, *settings)
        stack.callback(daemon.stop)
        rss = RssSampler(daemon.proc.pid)
        with KVStoreClient(daemon.target, SEED_NS) as kv:
            config = kv.stats(include_config=True).config() or {}
        scale = Scale(args.quiet_s, args.hold_s, args.leases, 2 * args.l2 // HOG_BLOCK + 8,
                      max(2, 3 * args.l2 // HOG_BLOCK // 4),
                      float(config.get("server", {}).get("stream_idle_s", 0)))
        rss.phase = "seed"
        blocks = seed(daemon.target)
        seeded = len(blocks)
        print(f"# seeded {len(blocks)} blocks; soak: {args.clients} clients + 1 hostile",
              flush=True)
        rss.phase = "soak"
        soak_start = time.monotonic()
        clients, hostile, put, exits = soak(daemon.target, args)
        soak_s = time.monotonic() - soak_start
        stream_wait = longest_stream_wait_s(daemon)  # before the attacks idle on purpose
        blocks += put
        print(f"# soak: {clients.requests():,} client + {hostile.requests():,} hostile requests "
              f"in {soak_s:.0f} s; {codes_text(clients.by_code())}", flush=True)
        attacks_start = time.monotonic()
        lookup_keys = [key_of(SEED_NS, 8 + i) for i in range(8)]
        results = attacks(daemon, scale, rss, lookup_keys, lookup_keys[2],
                          payload(SEED_NS, lookup_keys[2], SEED_SIZES[2]))
        attacks_s = time.monotonic() - attacks_start
        rss.phase = "after"
        end = after(daemon, blocks)
        rss.stop()
    client_faults = sum(t.by_code().get(c, 0) for t in (clients, hostile) for c in FAULTS)
    client_faults += sum(n for r in results for c, n in r.hog_codes.items() if c in FAULTS)
    summary = {
        "mode": "--quick" if args.quick else f"--requests {args.requests}",
        "machine": machine(), "date": dt.datetime.now(dt.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"),
        "settings_text": ", ".join(f"`{s}`" for s in settings if not s.startswith("remote.")),
        "seeded": seeded, "requests_asked": args.requests,
        "client_faults": client_faults, "after": end, "caps": caps_of(end["config"]),
        "run_s": time.monotonic() - started, "soak_s": soak_s, "attacks_s": attacks_s,
        "exit_codes": exits, "stream_wait": stream_wait,
    }
    print_summary(summary, clients, hostile)
    if args.report:
        args.report.write_text(report(summary, clients, hostile, results, rss, args))
        print(f"# wrote {args.report}", flush=True)
    setup = {k: v for k, v in summary.items() if k != "after"}
    setup |= {"after": {k: v for k, v in end.items() if k != "config"},
              "requests": clients.requests() + hostile.requests(),
              "client_codes": dict(clients.by_code()), "hostile_codes": dict(hostile.by_code()),
              "rss_bytes": [s[2] for s in rss.samples]}
    return figures_of(results), setup


def print_summary(summary: dict[str, Any], clients: Tally, hostile: Tally) -> None:
    end = summary["after"]
    print(f"# requests: {clients.requests() + hostile.requests():,} (clients "
          f"{clients.requests():,}, hostile {hostile.requests():,}); daemon RPCs "
          f"{sum(end['metrics_by_code'].values()):,}: {codes_text(end['metrics_by_code'])}")
    print(f"# crashes {0 if end['alive'] else 1}; INTERNAL/UNKNOWN: clients "
          f"{summary['client_faults']}, daemon metrics "
          f"{sum(end['metrics_by_code'].get(c, 0) for c in FAULTS)}; objects {end['objects']}; "
          f"left held: leases {end['leases']}, reservations {end['reservations']}, pins "
          f"{end['pinned']}; tracebacks {end['tracebacks']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100_000,
                        help="soak requests in all, 10%% of them hostile (default 100000)")
    parser.add_argument("--duration-s", type=float, default=240.0,
                        help="stop the soak after this long even if --requests are not sent")
    parser.add_argument("--clients", type=int, default=4, help="soak client processes")
    parser.add_argument("--leases", type=int, default=4000, help="Gets of the lease storm")
    parser.add_argument("--quiet-s", type=float, default=3.0, help="quiet window per attack")
    parser.add_argument("--hold-s", type=float, default=5.0, help="how long each hog holds")
    parser.add_argument("--l2", type=parse_size, default=256 * MiB, help="L2 capacity")
    parser.add_argument("--l3", type=parse_size, default=1024 * MiB, help="L3 capacity")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="more daemon settings (e.g. clients.max_leases=1000); repeatable")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 5000 requests, 500 leases, short windows (overrides)")
    parser.add_argument("--report", type=Path, help="write the Markdown report here")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="also write one JSON object to PATH")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.leases, args.quiet_s, args.hold_s = 5000, 500, 1.5, 2.0
    if args.requests < args.clients + 1 or args.clients < 1 or args.leases < 4:
        parser.error("--clients >= 1, --requests > --clients, --leases >= 4")
    return run_main(args, run)


if __name__ == "__main__":
    sys.exit(main())
