"""The load of bench/soak.py: the constants and helpers every part of the run shares (block
content, keys, status codes, Tally), the soak clients (SoakClient, soak_client) and the hostile
client (Hostile, hostile_client). soak_client and hostile_client are the targets of spawned
processes, so they live in a module a spawned child can import. Who calls as whom, in each
auth mode, is soak_local.Tenancy's; the hostile requests on the Unix socket are
soak_local.LocalHostile's."""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from multiprocessing import queues
from typing import Any, TypeAlias

import grpc
from soak_local import B, LocalHostile, Tenancy, mutate, open_channel

from kvstore.client import KVStoreClient, KVStoreError
from kvstore.proto.frames import DATA_TAG, varint
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.units import KiB, MiB

SEED_SIZES = (1, 1000, 4096, 4097, 65_536, 100_000, 256 * KiB, MiB)
SHARED_SIZES = (256, 4096, 20_000, 65_536)
SOAK_SIZES, SOAK_WEIGHTS = (512, 2 * KiB, 8 * KiB, 32 * KiB), (4, 4, 2, 1)
VERBS = ("put shm", "put inline", "get inline", "get_into shm", "lookup", "prefetch", "stats")
VERB_WEIGHTS = (10, 5, 20, 20, 30, 8, 7)
SHARED_SHARE = 0.25  # of a client's operations, on the shared keys every client uses
LEASE_TIMEOUT_S = 5.0  # the daemon's default lease and reservation timeouts in this run
TIMEOUT_S = 5.0  # of every raw call; a hung call fails instead of hanging
SERVICE = "/kvstore.v1.KVStore/"
HOSTILE_UNARY = ("Lookup", "Reserve", "Release", "Pin", "Unpin", "Stats", "Hot")
HOSTILE_STREAMING = ("Get", "Prefetch", "Prewarm")
FAULTS = ("INTERNAL", "UNKNOWN")
Results: TypeAlias = "queues.Queue[dict[str, Any]]"  # what a spawned process reports
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



def codes_text(codes: Counter[str] | dict[str, int]) -> str:
    return ", ".join(f"{c} {n:,}" for c, n in sorted(codes.items(), key=lambda x: -x[1]))


def check_read(got: Sequence[bytes | None], expected: Sequence[bytes]) -> str:
    if any(g is None for g in got):
        return "MISS"
    return "OK" if list(got) == list(expected) else "CORRUPT"


# --- phase 2: the soak clients -----------------------------------------------------------------


class SoakClient:
    """One soak process: chains in its own namespace and its tenant's shared blocks, each
    through a shared-memory client (with auth on: its tenant's arena and the local path) and
    an inline one."""

    def __init__(self, index: int, target: str, stack: ExitStack, tenancy: Tenancy) -> None:
        self.rng = random.Random(index)
        self.ns = tenancy.client_ns(index)
        tenant = tenancy.client_tenant(index)
        self.shared_ns = tenancy.shared_ns(tenant)

        def open_(ns: str, shm: bool) -> KVStoreClient:
            return stack.enter_context(KVStoreClient(target, ns, shared_memory=shm,
                                                     token=tenancy.token(tenant)))

        self.own = (open_(self.ns, True), open_(self.ns, False))  # (shared memory, inline)
        self.shared = (open_(self.shared_ns, True), open_(self.shared_ns, False))
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
            return self.shared, self.shared_ns, self.rng.sample(shared_blocks(), 3)
        return self.own, self.ns, self.rng.choice(self.chains)

    def _put(self, verb: str, on_shared: bool) -> str:
        path = 0 if verb == "put shm" else 1
        if on_shared:  # seeded already: an acknowledged no-op, exercised under load
            blocks = self.rng.sample(shared_blocks(), 2)
            got = self.shared[path].put([k for k, _ in blocks],
                                        [payload(self.shared_ns, k, n) for k, n in blocks],
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
                out: Results, tenancy: Tenancy) -> None:
    """A spawned soak process: send `requests` or stop at duration_s; report its tally and
    every block it put."""
    with ExitStack() as stack:
        client = SoakClient(index, target, stack, tenancy)
        deadline = time.monotonic() + duration_s
        while client.tally.requests() < requests and time.monotonic() < deadline:
            client.step()
    blocks = [(client.ns, k, n) for chain in client.chains for k, n in chain]
    out.put({"role": "client", "tally": client.tally, "blocks": blocks})


# --- phase 2: the hostile client ---------------------------------------------------------------


class Hostile:
    """Fuzzed requests over raw byte channels, in the junk namespace (tenant B's with auth
    on, as B). Evict is only sent structured: random bytes can decode as "evict everything",
    which would make the verified blocks look lost. Leases, reservations and pins it is
    granted it gives back (some leases and reservations are left to expire), so the end of
    the run can check nothing leaked. With auth on, a share of its requests go to the Unix
    socket instead (LocalHostile), and some calls carry no token or a wrong one."""

    def __init__(self, channel: grpc.Channel, seed: int, tenancy: Tenancy,
                 target: str = "") -> None:
        self.rng = random.Random(seed)
        self.ns = tenancy.junk_ns
        self.target = target
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
        self.weights = [15, 40, 8, 8, 12, 12, 5]
        self.local: LocalHostile | None = None
        if tenancy.on:
            self.local = LocalHostile(tenancy.unix_socket, rpc.KVStoreStub(channel), self.ns,
                                      self.rng)
            self.cases |= {"local": self._local, "credentials": self._credentials}
            self.weights += [40, 5]

    def _templates(self) -> dict[str, bytes]:
        ns, keys = self.ns, self.keys
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
        data = b"".join(payload(self.ns, k, n) for k, n in zip(keys, sizes, strict=True))
        header = pb.PutRequest(namespace=self.ns, keys=keys, sizes=sizes, independent=True)
        half = len(data) // 2
        return [header.SerializeToString(), DATA_TAG + varint(half) + data[:half],
                DATA_TAG + varint(len(data) - half) + data[half:]]

    def step(self) -> None:
        name = self.rng.choices(list(self.cases), self.weights)[0]
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
            ("Get", pb.GetRequest(namespace=self.ns, keys=keys)),
            ("Pin", pb.PinRequest(namespace=self.ns, keys=keys)),
            ("Lookup", pb.LookupRequest(namespace=self.ns, keys=keys)),
            ("Prefetch", pb.PrefetchRequest(namespace=self.ns, keys=keys)),
            ("Reserve", pb.ReserveRequest(namespace=self.ns, keys=keys, sizes=[1, 1, 1]))])
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
        self.call("Evict", pb.EvictRequest(namespace=self.ns, keys=keys).SerializeToString(),
                  "junk keys")

    def _local(self) -> None:
        assert self.local is not None
        name, case = self.local.step()
        self.tally.timed(name, case)

    def _credentials(self) -> None:
        """A Lookup with no token, or with one nobody holds: UNAUTHENTICATED, and nothing
        else learnt."""
        token = self.rng.choice([None, "not-a-token-0123456789"])
        request = pb.LookupRequest(namespace=self.ns, keys=self.keys[:1]).SerializeToString()
        with open_channel(self.target, token) as channel:
            lookup = channel.unary_unary(SERVICE + "Lookup", request_serializer=identity,
                                         response_deserializer=identity)
            self.tally.timed("Lookup (no token)" if token is None else "Lookup (wrong token)",
                             lambda: "OK" if lookup(request, timeout=TIMEOUT_S) is not None
                             else "NO REPLY")

    def _cancelled(self) -> None:
        if self.rng.random() < 0.5:
            self.tally.timed("Put (cancelled midway)", self._cancel_put)
            return
        method = self.rng.choice(["Get", "Prefetch"])
        request = (pb.GetRequest(namespace=self.ns, keys=self.keys[:4]) if method == "Get"
                   else pb.PrefetchRequest(namespace=self.ns, keys=self.keys[:4]))

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
                   out: Results, tenancy: Tenancy) -> None:
    """The spawned hostile process: fuzzed requests until `requests` or duration_s."""
    with open_channel(target, tenancy.token(B), OWN_CONNECTION) as channel:
        hostile = Hostile(channel, 1234, tenancy, target)
        for first in range(0, 8, 2):
            hostile.send_put(hostile.put_messages(first), "valid")  # something to find
        deadline = time.monotonic() + duration_s
        while hostile.tally.requests() < requests and time.monotonic() < deadline:
            hostile.step()
    out.put({"role": "hostile", "tally": hostile.tally, "blocks": []})
