"""Fuzzing one live daemon (L2, L3 and an L4 redis-server) through every method of
kvstore.v1.KVStore with hypothesis.

What is sent, through raw byte channels (request and response serializers are identity):
- random bytes, and random protobuf wire fields, as the request of every unary and
  server-streaming method, and as the messages of a Put stream;
- valid serialized requests of every method (and Put streams) with bytes flipped, set,
  inserted, deleted, duplicated or truncated, messages dropped, repeated or swapped;
- structured requests built from the message fields: keys of every length, repeated keys,
  batches over server.max_batch_keys, empty / over-long / unicode namespaces, sizes that do
  not match, bogus lease and reservation ids, unknown enum values (every Tier and GetMode
  value in every mode, too), huge timeouts and byte counts, unknown fields; Put streams whose
  frames are cut anywhere, truncated, extended, reordered, merged, padded, lie about their
  length, carry a header twice or none; Reserve -> commit and lease -> Release flows; up to
  8 of these at once; Put, Get and Prefetch streams the client cancels midway; a reader and
  a writer that stall past their lease.

After every example: no status is INTERNAL, UNKNOWN or DEADLINE_EXCEEDED (every call has a
5 s deadline, so a hung call fails instead of hanging), the daemon is alive, its log gained no
"Traceback" and no ERROR line, an OK Get answers one `found` per key with payloads that match
their checksums, and blocks put with known content (the namespaces in VERIFIED) read back as
put. What the contract says must fail (a truncated or extended stream, a second header, a
commit after Release, unknown ids) is not acknowledged. At the end (the last test): blocks
stored with KVStoreClient before the fuzzing read back bit-exact, health is SERVING, the
daemon's metrics count no INTERNAL or UNKNOWN answer, leases and reservations return to 0
within the short timeouts configured here, and no DRAM or L3 page leaked.

Bounds: one daemon for the module; about 2,850 examples and 3,500 requests, derandomized (CI
runs the same examples every time); 20-35 s on two cores. FUZZ_EXAMPLES_SCALE=10 runs ten
times as many examples, for a longer run by hand.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import re
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.client import KVStoreClient
from kvstore.proto.frames import DATA_TAG, varint
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.tools.testing import Daemon, start_daemon, start_redis

TIMEOUT_S = 5.0
LEASE_TIMEOUT_S = RESERVATION_TIMEOUT_S = 2.0
SWEEP_INTERVAL_S = 0.2
MAX_OBJECT_BYTES = 1 << 20
MAX_BATCH_KEYS = 64
PAGE_BYTES = 16 << 10
SETTINGS = (  # a small L2, so that puts demote to L3 and reads promote back
    "dram.capacity_bytes=8MiB", f"dram.page_size_bytes={PAGE_BYTES}",
    f"server.max_object_bytes={MAX_OBJECT_BYTES}", "server.max_response_bytes=4MiB",
    f"server.max_batch_keys={MAX_BATCH_KEYS}", "server.chunk_bytes=64KiB",
    f"leases.lease_timeout_s={LEASE_TIMEOUT_S}",
    f"leases.reservation_timeout_s={RESERVATION_TIMEOUT_S}",
    f"leases.sweep_interval_s={SWEEP_INTERVAL_S}",
    "movers.put_wait_s=0.1",  # a put that finds L2 full waits this long per example
    "remote.popularity_flush_s=0.2", "remote.breaker_backoff_s=0.2", "remote.timeout_s=1",
)

SERVICE = "/kvstore.v1.KVStore/"
UNARY = ("Lookup", "Reserve", "Release", "Evict", "Pin", "Unpin", "Stats", "Hot", "Attach",
         "Limits")
SERVER_STREAMING = ("Get", "Prefetch", "Prewarm")
# Any bytes that parse make a valid DrainRequest (it has no fields), and a Drain stops the
# daemon the rest of the module fuzzes: tests/integration/test_drain.py drives it instead.
# A WatchEvents call that parses never ends until its caller leaves (it waits for events),
# which this harness would count as a hang: tests/integration/test_events.py sends it
# undecodable bytes and every from_sequence instead.
NOT_FUZZED = ("Drain", "WatchEvents")
FAULTS = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED)

# Blocks stored in VERIFIED namespaces always hold payload(namespace, key, size): every read
# of them checks that. Requests that may store other bytes (reordered frames, Reserve commits
# of unwritten pages, raw and mutated requests) use the JUNK namespaces.
VERIFIED = ("fuzz-verified", "fuzz/ünïcødé ✓", "v" * 256)
JUNK = ("fuzz-junk", "fuzz-mut")
KEEP_NS = "fuzz-keep"  # stored before, pinned; no fuzzed request names it
KEYS = [hashlib.sha256(b"fuzz key %d" % i).digest() for i in range(12)]
KEEP_KEYS = [hashlib.sha256(b"keep %d" % i).digest() for i in range(6)]
KEEP_VALUES = [hashlib.shake_256(b"keep %d" % n).digest(n)
               for n in (1, 4096, PAGE_BYTES, PAGE_BYTES + 1, 100_000, MAX_OBJECT_BYTES)]


def payload(namespace: str, key: bytes, size_bytes: int) -> bytes:
    """The content of a block in a VERIFIED namespace; a prefix of every longer one."""
    return hashlib.shake_256(namespace.encode() + b"\0" + key).digest(size_bytes)


def raw(b: bytes) -> bytes:
    return b


# --- the harness ---------------------------------------------------------------------------


class Fuzzer:
    """Sends raw requests to the daemon and judges every answer; remembers the leases and
    reservations it was granted, so the ones longer than the daemon's default are let go."""

    def __init__(self, daemon: Daemon, channel: grpc.Channel) -> None:
        self.daemon = daemon
        self._unary = {m: channel.unary_unary(SERVICE + m, request_serializer=raw,
                                              response_deserializer=raw) for m in UNARY}
        self._stream = {m: channel.unary_stream(SERVICE + m, request_serializer=raw,
                                                response_deserializer=raw)
                        for m in SERVER_STREAMING}
        self._put = channel.stream_unary(SERVICE + "Put", request_serializer=raw,
                                         response_deserializer=raw)
        self.requests = 0
        self._lock = threading.Lock()  # the concurrent test calls from several threads
        self.held: dict[str, float] = {}  # lease or reservation id -> seconds granted
        self.pinned: list[pb.PinRequest] = []  # every Pin that was OK, to undo at the end
        self._log_offset = 0

    def count(self) -> None:
        with self._lock:
            self.requests += 1

    def judge(self, what: str, err: grpc.RpcError) -> grpc.StatusCode:
        code: grpc.StatusCode = err.code()
        assert code not in FAULTS, f"{what}: {code.name}: {err.details()}"
        return code

    def call(self, method: str, request: bytes) -> list[bytes] | None:
        """One unary or server-streaming call: its response messages, or None for a status
        that is not OK (and not a fault)."""
        self.count()
        try:
            if method in UNARY:
                replies = [self._unary[method](request, timeout=TIMEOUT_S)]
            else:
                replies = list(self._stream[method](request, timeout=TIMEOUT_S))
        except grpc.RpcError as err:
            self.judge(f"{method}({request[:200]!r})", err)
            return None
        self._note(method, request, replies)
        return replies

    def put(self, messages: Sequence[bytes], cancel_after: int | None = None,
            cancel_delay_s: float = 0.0, pause_s: float = 0.0) -> pb.PutResponse | None:
        """A Put stream; with cancel_after, the client sends that many messages, waits
        cancel_delay_s, then cancels instead of half-closing; with pause_s, it waits that
        long before the last message."""
        self.count()
        what = f"Put({[m[:100] for m in messages]!r})"

        def paused() -> Iterator[bytes]:
            yield from messages[:-1]
            time.sleep(pause_s)
            yield from messages[-1:]

        if cancel_after is None:
            try:
                return pb.PutResponse.FromString(self._put(paused(), timeout=TIMEOUT_S))
            except grpc.RpcError as err:
                self.judge(what, err)
                return None
        sent, release = threading.Event(), threading.Event()

        def stream() -> Iterator[bytes]:
            yield from messages[:cancel_after]
            sent.set()
            release.wait(TIMEOUT_S)

        future = self._put.future(stream(), timeout=TIMEOUT_S)
        future.add_done_callback(lambda _: sent.set())  # refused before the last message
        sent.wait(TIMEOUT_S)
        time.sleep(cancel_delay_s)
        future.cancel()
        release.set()
        try:
            return pb.PutResponse.FromString(future.result(timeout=TIMEOUT_S))
        except grpc.FutureCancelledError:
            return None
        except grpc.RpcError as err:
            self.judge(what, err)
            return None

    def read_partly(self, method: str, request: bytes, after: int,
                    pause_s: float | None = None) -> None:
        """A server-streaming call the client cancels after `after` messages, or with
        pause_s, stops reading for that long and then reads to the end."""
        self.count()
        call = self._stream[method](request, timeout=TIMEOUT_S)
        replies: list[bytes] = []
        try:
            for reply in call:
                replies.append(reply)
                if len(replies) != after:
                    continue
                if pause_s is None:
                    call.cancel()
                    return
                time.sleep(pause_s)
        except grpc.RpcError as err:
            self.judge(f"{method}({request[:200]!r}) read {len(replies)}, {pause_s=}", err)
            return
        self._note(method, request, replies)

    def release(self, ids: list[str]) -> bool:
        return self.call("Release", pb.ReleaseRequest(ids=ids).SerializeToString()) is not None

    def _note(self, method: str, request: bytes, replies: list[bytes]) -> None:
        if method == "Reserve":
            reserved = pb.ReserveResponse.FromString(replies[0])
            self.held[reserved.reservation_id] = reserved.expires_in_ms / 1000
        elif method == "Get":
            check_get(pb.GetRequest.FromString(request), replies)
            head = pb.GetResponse.FromString(replies[0])
            if head.lease_id:
                self.held[head.lease_id] = head.lease_expires_in_ms / 1000
        elif method == "Pin":
            self.pinned.append(pb.PinRequest.FromString(request))
        elif method == "Lookup":
            keys = pb.LookupRequest.FromString(request).keys
            found = pb.LookupResponse.FromString(replies[0])
            assert len(found.tiers) == len(keys) and found.prefix_length <= len(keys)
            assert all(found.tiers[: found.prefix_length]), found

    def settle(self) -> None:
        """After each example: let go of what outlives the daemon's default timeouts (a
        client may ask for up to 10 minutes), and check the daemon is alive and logged no
        traceback."""
        for held_id in [i for i, s in self.held.items() if s > LEASE_TIMEOUT_S]:
            del self.held[held_id]
            self.release([held_id])  # INVALID_ARGUMENT when the example released it already
        rc = self.daemon.proc.poll()
        assert rc is None, f"the daemon exited with {rc}:\n{self.daemon.log()[-4000:]}"
        with self.daemon.log_path.open("rb") as f:
            f.seek(self._log_offset)
            new = f.read().decode(errors="replace")
        self._log_offset += len(new.encode(errors="replace"))
        assert "Traceback" not in new and " ERROR " not in new, new[-4000:]


def check_get(request: pb.GetRequest, replies: list[bytes]) -> None:
    """An OK Get answers one `found` per key; inline payloads match their checksums, and
    those of VERIFIED namespaces are what was put."""
    head = pb.GetResponse.FromString(replies[0])
    assert len(head.found) == len(request.keys), head
    hits = [k for k, found in zip(request.keys, head.found, strict=True) if found]
    assert len(head.sizes) == len(hits) == len(head.checksums), head
    if request.mode == pb.GET_MODE_SHARED_MEMORY:
        assert [sum(e.length for e in loc.extents) for loc in head.locations] == list(head.sizes)
        return
    data = b"".join(pb.GetResponse.FromString(r).data for r in replies[1:])
    assert len(data) == sum(head.sizes)
    offset = 0
    for key, size, checksum in zip(hits, head.sizes, head.checksums, strict=True):
        block = data[offset : offset + size]
        offset += size
        assert xxhash.xxh3_64_intdigest(block) == checksum, f"{key.hex()}: checksum"
        if request.namespace in VERIFIED:
            assert block == payload(request.namespace, key, size), f"{key.hex()}: changed"


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzer]:
    workdir = tmp_path_factory.mktemp("fuzz")
    redis = start_redis(workdir)  # L4 on: Hot and Prewarm do more than refuse
    try:
        daemon = start_daemon(workdir, *SETTINGS, f"remote.url={redis.url}")
    except BaseException:
        redis.stop()
        raise
    try:
        with KVStoreClient(daemon.target, KEEP_NS) as kv:
            assert kv.put(KEEP_KEYS, KEEP_VALUES, independent=True).stored == len(KEEP_KEYS)
            kv.pin(KEEP_KEYS)  # so that a fuzzed Evict of everything leaves them
        with grpc.insecure_channel(daemon.target, options=[
                ("grpc.max_receive_message_length", 16 << 20)]) as channel:
            yield Fuzzer(daemon, channel)
    finally:
        daemon.stop()
        redis.stop()


SCALE = float(os.environ.get("FUZZ_EXAMPLES_SCALE", "1"))  # > 1 for a longer run by hand


def fuzz(max_examples: int) -> settings:
    return settings(max_examples=max(1, int(max_examples * SCALE)), deadline=None,
                    derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])


# --- strategies ----------------------------------------------------------------------------

U32 = st.one_of(st.integers(0, 3000), st.sampled_from([600_000, 600_001, 2**32 - 1]),
                st.integers(0, 2**32 - 1))
U64 = st.one_of(st.integers(0, 1 << 20), st.sampled_from([2**63, 2**64 - 1]),
                st.integers(0, 2**64 - 1))
ENUM_VALUES = [0, 1, 2, 3, 4, 5, -1, -(2**31), 2**31 - 1]  # of Tier and GetMode, and unknown
ENUM = st.sampled_from(ENUM_VALUES)
WEIRD_NAMESPACES = ("", " ", "\x00", "n" * 257, "é" * 128, "é" * 129, "🙂" * 64, "🙂" * 65,
                    "x" * 100_000, "../../etc/passwd", "line\nbreak", "%s%n{}")
NAMESPACE = st.one_of(st.sampled_from(VERIFIED), st.sampled_from(VERIFIED),
                      st.sampled_from(VERIFIED), st.sampled_from(WEIRD_NAMESPACES),
                      st.text(max_size=20), st.text(min_size=60, max_size=130))
NO_VERIFIED_NAMESPACE = st.one_of(st.sampled_from(JUNK), st.sampled_from(WEIRD_NAMESPACES),
                                  st.text(max_size=20))
KEY = st.one_of(st.sampled_from(KEYS), st.binary(min_size=32, max_size=32),
                st.binary(max_size=33), st.binary(min_size=33, max_size=80))
DISTINCT = st.lists(st.sampled_from(KEYS), min_size=1, max_size=8, unique=True)
MANY_KEYS = [hashlib.sha256(b"many %d" % i).digest() for i in range(MAX_BATCH_KEYS + 1)]
KEY_LISTS = st.one_of(
    DISTINCT, DISTINCT, DISTINCT,
    st.lists(st.sampled_from(KEYS), max_size=8),  # repeats likely
    st.lists(KEY, max_size=6),  # of any length
    st.sampled_from([[KEYS[0]] * (MAX_BATCH_KEYS + 1), MANY_KEYS[:MAX_BATCH_KEYS], MANY_KEYS]),
)
BOGUS_ID = st.one_of(st.text(max_size=30), st.binary(min_size=12, max_size=12).map(bytes.hex),
                     st.sampled_from(["", "x" * 100_000, "🙂" * 1000]))
UNKNOWN_FIELDS = st.sampled_from([b"", b"", b"", b"\xf8\x06\x01", b"\x9a\x06\x03abc",
                                  b"\x0d\x01\x02\x03\x04", b"\x10\x01"])
MUTATION = st.tuples(st.sampled_from(["flip", "set", "insert", "delete", "truncate",
                                      "duplicate"]),
                     st.integers(0, 1 << 16), st.integers(0, 255), st.binary(min_size=1,
                                                                             max_size=8))
MUTATIONS = st.lists(MUTATION, min_size=1, max_size=6)


def mutate(message: bytes, mutations: Sequence[tuple[str, int, int, bytes]]) -> bytes:
    out = bytearray(message)
    for op, position, value, blob in mutations:
        i = position % (len(out) + 1)
        if op == "flip" and out:
            out[i % len(out)] ^= 1 << (value % 8)
        elif op == "set" and out:
            out[i % len(out)] = value
        elif op == "insert":
            out[i:i] = blob
        elif op == "delete":
            del out[i : i + 1 + value % 8]
        elif op == "truncate":
            del out[i:]
        elif op == "duplicate":
            out[i:i] = out[i : i + 1 + value % 16]
    return bytes(out)


@st.composite
def wire_fields(draw: st.DrawFn) -> bytes:
    """Random protobuf wire fields: mostly the field numbers the messages use, any wire type."""
    out = bytearray()
    for _ in range(draw(st.integers(0, 6))):
        number = draw(st.one_of(st.integers(1, 8), st.integers(1, 2**29 - 1)))
        wire = draw(st.sampled_from([0, 0, 1, 2, 2, 2, 5, 3, 4, 6, 7]))
        out += varint(number << 3 | wire)
        if wire == 0:
            out += varint(draw(U64))
        elif wire in (1, 5):
            out += draw(st.binary(min_size=8 if wire == 1 else 4, max_size=8 if wire == 1 else 4))
        elif wire == 2:
            body = draw(st.one_of(st.binary(max_size=40), st.sampled_from(KEYS),
                                  st.sampled_from(JUNK).map(str.encode)))
            out += varint(len(body)) + body
    return bytes(out)


RANDOM_BYTES = st.one_of(st.binary(max_size=512), wire_fields())


# --- random and mutated bytes --------------------------------------------------------------


def test_the_fuzzed_methods_are_every_method_of_the_service() -> None:
    served = {m.name for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods}
    assert {*UNARY, *SERVER_STREAMING, "Put", *NOT_FUZZED} == served


@fuzz(500)
@given(method=st.sampled_from(UNARY + SERVER_STREAMING), request=RANDOM_BYTES)
def test_random_bytes_as_a_request(fuzzer: Fuzzer, method: str, request: bytes) -> None:
    fuzzer.call(method, request)
    fuzzer.settle()


@fuzz(150)
@given(messages=st.lists(RANDOM_BYTES, max_size=4))
def test_random_bytes_as_a_put_stream(fuzzer: Fuzzer, messages: list[bytes]) -> None:
    fuzzer.put(messages)
    fuzzer.settle()


MUT_NS = JUNK[1]
SEEDS: list[tuple[str, pb.Message]] = [
    ("Lookup", pb.LookupRequest(namespace=MUT_NS, keys=KEYS[:3])),
    ("Get", pb.GetRequest(namespace=MUT_NS, keys=KEYS[:2])),
    ("Get", pb.GetRequest(namespace=MUT_NS, keys=KEYS[:2], mode=pb.GET_MODE_SHARED_MEMORY,
                          lease_timeout_ms=1000)),
    ("Get", pb.GetRequest(namespace=MUT_NS, keys=KEYS[2:3], mode=pb.GET_MODE_SHARED_MEMORY,
                          no_lease=True)),
    ("Prefetch", pb.PrefetchRequest(namespace=MUT_NS, keys=KEYS[:3], target_tier=pb.TIER_DRAM,
                                    deadline_ms=500)),
    ("Reserve", pb.ReserveRequest(namespace=MUT_NS, keys=KEYS[6:8], sizes=[100, 20_000],
                                  timeout_ms=1000, parent_key=KEYS[5])),
    ("Release", pb.ReleaseRequest(ids=["0123456789abcdef01234567", "x"])),
    ("Evict", pb.EvictRequest(namespace=MUT_NS, keys=KEYS[:2])),
    ("Evict", pb.EvictRequest(namespace=MUT_NS, bytes=4096, tier=pb.TIER_DRAM)),
    ("Pin", pb.PinRequest(namespace=MUT_NS, keys=KEYS[:2])),
    ("Unpin", pb.PinRequest(namespace=MUT_NS, keys=KEYS[:2])),
    ("Stats", pb.StatsRequest(namespace=MUT_NS, include_config=True)),
    ("Hot", pb.HotRequest(namespace=MUT_NS, limit=10)),
    ("Prewarm", pb.PrewarmRequest(bytes=1 << 20, namespaces=[MUT_NS])),
]


def _seed_put_streams() -> list[list[bytes]]:
    sizes = [300, 20_000, 5]
    data = b"".join(payload(MUT_NS, k, n) for k, n in zip(KEYS[3:6], sizes, strict=True))
    header = pb.PutRequest(namespace=MUT_NS, keys=KEYS[3:6], sizes=sizes)
    return [
        [pb.PutRequest(namespace=MUT_NS, keys=KEYS[3:6], sizes=sizes, data=data,
                       parent_key=KEYS[2]).SerializeToString()],
        [header.SerializeToString(), DATA_TAG + varint(1000) + data[:1000],
         DATA_TAG + varint(len(data) - 1000) + data[1000:]],
        [pb.PutRequest(namespace=MUT_NS, keys=KEYS[8:10], sizes=[7, 7], independent=True,
                       data=b"x" * 14).SerializeToString()],
        [pb.PutRequest(namespace=MUT_NS, reservation_id="0123456789abcdef01234567")
         .SerializeToString()],
    ]


SEED_PUTS = _seed_put_streams()


@fuzz(400)
@given(seed=st.sampled_from(SEEDS), mutations=MUTATIONS)
def test_mutated_valid_requests(fuzzer: Fuzzer, seed: tuple[str, pb.Message],
                                mutations: list[tuple[str, int, int, bytes]]) -> None:
    method, message = seed
    fuzzer.call(method, mutate(message.SerializeToString(), mutations))
    fuzzer.settle()


@fuzz(200)
@given(stream=st.sampled_from(SEED_PUTS), which=st.integers(0, 3), mutations=MUTATIONS,
       reshape=st.sampled_from(["mutate", "mutate", "drop", "repeat", "swap"]))
def test_mutated_valid_put_streams(fuzzer: Fuzzer, stream: list[bytes], which: int,
                                   mutations: list[tuple[str, int, int, bytes]],
                                   reshape: str) -> None:
    messages = list(stream)
    i = which % len(messages)
    if reshape == "mutate":
        messages[i] = mutate(messages[i], mutations)
    elif reshape == "drop":
        del messages[i]
    elif reshape == "repeat":
        messages.insert(i, messages[i])
    else:
        messages[0], messages[-1] = messages[-1], messages[0]
    fuzzer.put(messages)
    fuzzer.settle()


# --- structured requests -------------------------------------------------------------------


@st.composite
def evict_requests(draw: st.DrawFn) -> pb.EvictRequest:
    """Mostly one of keys, bytes or all (as it must be), at every tier."""
    modes = draw(st.sampled_from(["keys", "bytes", "all", "keys", "bytes", "all", "",
                                  "keys bytes", "bytes all", "keys bytes all"])).split()
    return pb.EvictRequest(namespace=draw(st.one_of(st.just(""), NAMESPACE)),
                           keys=draw(KEY_LISTS) if "keys" in modes else [],
                           bytes=draw(U64.filter(bool)) if "bytes" in modes else 0,
                           all="all" in modes, tier=draw(ENUM))


PIN = st.builds(pb.PinRequest, namespace=NAMESPACE, keys=KEY_LISTS)
MESSAGES: dict[str, st.SearchStrategy[pb.Message]] = {
    "Lookup": st.builds(pb.LookupRequest, namespace=NAMESPACE, keys=KEY_LISTS),
    "Get": st.builds(pb.GetRequest, namespace=NAMESPACE, keys=KEY_LISTS, mode=ENUM,
                     lease_timeout_ms=U32, no_lease=st.booleans()),
    "Prefetch": st.builds(pb.PrefetchRequest, namespace=NAMESPACE, keys=KEY_LISTS,
                          target_tier=ENUM, deadline_ms=U32),
    "Reserve": st.builds(pb.ReserveRequest, namespace=NO_VERIFIED_NAMESPACE, keys=KEY_LISTS,
                         sizes=st.lists(U64, max_size=8), timeout_ms=U32, parent_key=KEY,
                         independent=st.booleans()),
    "Release": st.builds(pb.ReleaseRequest, ids=st.lists(BOGUS_ID, max_size=4)),
    "Evict": evict_requests(),
    "Pin": PIN,
    "Unpin": PIN,
    "Stats": st.builds(pb.StatsRequest, namespace=NAMESPACE, include_config=st.booleans()),
    "Hot": st.builds(pb.HotRequest, namespace=NAMESPACE, limit=U32),
    "Prewarm": st.builds(pb.PrewarmRequest, bytes=U64, namespaces=st.lists(NAMESPACE,
                                                                           max_size=3)),
}
STRUCTURED = st.sampled_from(sorted(MESSAGES)).flatmap(
    lambda m: st.tuples(st.just(m), MESSAGES[m]))


@pytest.mark.parametrize("method", sorted(MESSAGES))
@fuzz(70)
@given(data=st.data())
def test_structured_requests(fuzzer: Fuzzer, method: str, data: st.DataObject) -> None:
    message = data.draw(MESSAGES[method], label="request")
    send_structured(fuzzer, (method, message), data.draw(UNKNOWN_FIELDS, label="unknown"))
    fuzzer.settle()


def send_structured(fuzzer: Fuzzer, case: tuple[str, pb.Message], unknown: bytes) -> None:
    method, message = case
    replies = fuzzer.call(method, message.SerializeToString() + unknown)
    if method == "Release" and message.ids:  # bogus ids only: refused, naming them
        assert replies is None, f"Release of unknown ids {message.ids!r} was OK"


SIZE = st.one_of(st.integers(1, 3000), st.integers(3000, 70_000),
                 st.sampled_from([0, PAGE_BYTES, PAGE_BYTES + 1, MAX_OBJECT_BYTES,
                                  MAX_OBJECT_BYTES + 1, 2**32 + 1, 2**64 - 1]))
# Alterations that change which bytes land where: their streams go to a JUNK namespace.
REORDERING = ("reorder", "merge", "lie")
MUST_FAIL = ("truncate", "extend", "header-later", "header-twice", "no-header")
HEADER_FIELDS = [pb.PutRequest(namespace="x"), pb.PutRequest(keys=[KEYS[0]]),
                 pb.PutRequest(sizes=[1]), pb.PutRequest(parent_key=KEYS[0]),
                 pb.PutRequest(independent=True), pb.PutRequest(reservation_id="r")]


@dataclass
class PutCase:
    namespace: str
    keys: list[bytes]
    messages: list[bytes]
    must_fail: bool


@st.composite
def put_streams(draw: st.DrawFn) -> PutCase:
    """A Put stream: a header, then its payloads cut into frames anywhere, then altered."""
    namespace = draw(st.one_of(st.sampled_from(VERIFIED), st.sampled_from(VERIFIED),
                               st.sampled_from(WEIRD_NAMESPACES), st.text(max_size=10)))
    keys = draw(st.one_of(st.lists(st.sampled_from(KEYS), max_size=6, unique=True),
                          st.lists(st.binary(min_size=32, max_size=32), max_size=4), KEY_LISTS))
    sizes = draw(st.one_of(st.lists(SIZE, min_size=len(keys), max_size=len(keys)),
                           st.lists(SIZE, max_size=7)))
    alter = draw(st.sampled_from(["none"] * 6 + ["empty-messages", "padded", *REORDERING,
                                                  *MUST_FAIL]))
    if alter in REORDERING:
        namespace = JUNK[0]
    data = b"".join(payload(namespace, k, n) for k, n in zip(keys, sizes, strict=False)
                    if n <= MAX_OBJECT_BYTES + 1)
    if alter == "truncate" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif alter == "extend":
        data += draw(st.binary(min_size=1, max_size=100))
    cuts: list[int] = sorted(draw(st.lists(st.integers(0, len(data)), max_size=5)))
    header_has_data: bool = draw(st.booleans())
    in_header = cuts.pop(0) if cuts and header_has_data else 0
    header = pb.PutRequest(namespace=namespace, keys=keys, sizes=sizes, data=data[:in_header],
                           parent_key=draw(st.one_of(st.just(b""), KEY)),
                           independent=draw(st.booleans()))
    bounds = [in_header, *cuts, len(data)]
    chunks = [data[a:b] for a, b in itertools.pairwise(bounds) if b > a or draw(st.booleans())]
    messages = [header.SerializeToString() + draw(UNKNOWN_FIELDS),
                *(DATA_TAG + varint(len(c)) + c for c in chunks)]
    if alter == "empty-messages":
        for _ in range(draw(st.integers(1, 3))):
            messages.insert(draw(st.integers(1, len(messages))), draw(st.sampled_from(
                [b"", DATA_TAG + b"\x00"])))
    elif alter == "reorder" and len(messages) > 1:
        messages = draw(st.permutations(messages))
    elif alter == "merge" and len(messages) > 1:
        i = draw(st.integers(0, len(messages) - 2))
        messages[i : i + 2] = [messages[i] + messages[i + 1]]
    elif alter == "padded" and chunks:  # the same length as a longer (legal) varint
        i = draw(st.integers(0, len(chunks) - 1))
        length = bytearray(varint(len(chunks[i])))
        pad = draw(st.integers(1, 10 - len(length)))
        length[-1] |= 0x80
        messages[1 + i] = DATA_TAG + bytes(length) + b"\x80" * (pad - 1) + b"\0" + chunks[i]
    elif alter == "lie" and chunks:
        i = draw(st.integers(0, len(chunks) - 1))
        lie = draw(st.integers(0, 2 * len(chunks[i]) + 2).filter(lambda n: n != len(chunks[i])))
        messages[1 + i] = DATA_TAG + varint(lie) + chunks[i]
    elif alter == "header-later":
        extra = pb.PutRequest()
        extra.MergeFrom(draw(st.sampled_from(HEADER_FIELDS)))
        extra.data = draw(st.binary(max_size=8))
        messages.insert(draw(st.integers(1, len(messages))), extra.SerializeToString())
    elif alter == "header-twice":
        messages.insert(1, messages[0])
    elif alter == "no-header":
        messages = messages[1:]
    must_fail = alter in MUST_FAIL and not (alter == "truncate" and not data and not sizes)
    return PutCase(namespace, keys, messages, must_fail)


def distinct_keys(keys: Sequence[bytes]) -> list[bytes]:
    return [k for k in dict.fromkeys(keys) if len(k) == 32][:MAX_BATCH_KEYS]


@fuzz(400)
@given(case=put_streams())
def test_structured_put_streams(fuzzer: Fuzzer, case: PutCase) -> None:
    send_put(fuzzer, case)
    fuzzer.settle()


def send_put(fuzzer: Fuzzer, case: PutCase) -> None:
    reply = fuzzer.put(case.messages)
    if reply is not None:
        assert not case.must_fail, f"a malformed Put stream was acknowledged: {reply}"
        assert reply.stored + reply.existing == len(case.keys), reply
        keys = distinct_keys(case.keys)
        if keys:  # read back (check_get compares VERIFIED payloads)
            fuzzer.call("Get", pb.GetRequest(namespace=case.namespace,
                                             keys=keys).SerializeToString())


def test_every_enum_value_in_every_mode(fuzzer: Fuzzer) -> None:
    """Not left to chance: each Tier and GetMode value, known or not, with each way of
    asking (Evict by keys, bytes, all or none of them; Get with and without a lease)."""
    namespace, keys = VERIFIED[0], KEYS[:2]
    for value in ENUM_VALUES:
        for evict in (dict(keys=keys), dict(bytes=1 << 20), dict(all=True), {}):
            fuzzer.call("Evict", pb.EvictRequest(namespace=namespace, tier=value, **evict)
                        .SerializeToString())
        fuzzer.call("Prefetch", pb.PrefetchRequest(namespace=namespace, keys=keys,
                                                   target_tier=value).SerializeToString())
        for no_lease in (False, True):
            fuzzer.call("Get", pb.GetRequest(namespace=namespace, keys=keys, mode=value,
                                             no_lease=no_lease).SerializeToString())
    fuzzer.settle()


@fuzz(60)
@given(batch=st.lists(st.one_of(st.tuples(STRUCTURED, UNKNOWN_FIELDS), put_streams()),
                      min_size=2, max_size=8))
def test_structured_requests_sent_at_once(
        fuzzer: Fuzzer, batch: list[tuple[tuple[str, pb.Message], bytes] | PutCase]) -> None:
    """The same checks with up to 8 calls in flight: puts, reads, evictions and releases
    racing each other in the daemon."""
    def send(case: tuple[tuple[str, pb.Message], bytes] | PutCase) -> None:
        if isinstance(case, PutCase):
            send_put(fuzzer, case)
        else:
            send_structured(fuzzer, *case)

    with ThreadPoolExecutor(len(batch)) as pool:
        for done in [pool.submit(send, case) for case in batch]:
            done.result()
    fuzzer.settle()


@fuzz(150)
@given(namespace=st.sampled_from(JUNK), keys=KEY_LISTS, sizes=st.lists(SIZE, max_size=8),
       timeout_ms=U32, parent=st.one_of(st.just(b""), KEY), independent=st.booleans(),
       then=st.sampled_from(["commit", "commit-elsewhere", "commit-with-extra",
                             "commit-then-data", "commit-twice", "release-then-commit",
                             "release-twice", "leave"]))
def test_reserve_then_commit_or_release(fuzzer: Fuzzer, namespace: str, keys: list[bytes],
                                        sizes: list[int], timeout_ms: int, parent: bytes,
                                        independent: bool, then: str) -> None:
    request = pb.ReserveRequest(namespace=namespace, keys=keys, sizes=sizes,
                                timeout_ms=timeout_ms, parent_key=parent,
                                independent=independent)
    replies = fuzzer.call("Reserve", request.SerializeToString())
    if replies is not None:
        reserved = pb.ReserveResponse.FromString(replies[0])
        assert len(reserved.exists) == len(reserved.locations) == len(keys), reserved
        for size, exists, loc in zip(sizes, reserved.exists, reserved.locations, strict=True):
            assert sum(e.length for e in loc.extents) == (0 if exists else size), reserved
        rid = reserved.reservation_id
        commit = pb.PutRequest(namespace=namespace, reservation_id=rid)
        if then == "commit-elsewhere":
            commit.namespace = JUNK[1] if namespace == JUNK[0] else JUNK[0]
        elif then == "commit-with-extra":
            commit.MergeFrom(pb.PutRequest(keys=keys[:1] or [KEYS[0]], data=b"x"))
        if then.startswith("release"):
            fuzzer.release([rid])
            if then == "release-twice":
                assert not fuzzer.release([rid]), "a second Release of one id was OK"
            else:
                assert fuzzer.put([commit.SerializeToString()]) is None, "commit after Release"
        elif then != "leave":
            tail = [DATA_TAG + b"\x03abc"] if then == "commit-then-data" else []
            first = fuzzer.put([commit.SerializeToString(), *tail])
            if then in ("commit-elsewhere", "commit-with-extra"):
                assert first is None, f"{then} was OK: {first}"
            if then == "commit-twice" and first is not None:
                assert fuzzer.put([commit.SerializeToString()]) is None, "a second commit"
    fuzzer.settle()


@fuzz(100)
@given(namespace=st.sampled_from(VERIFIED), keys=st.lists(st.sampled_from(KEYS), min_size=1,
                                                          max_size=6, unique=True),
       lease_timeout_ms=st.one_of(st.just(0), st.integers(1, 3000), st.just(600_000)),
       bogus=st.lists(BOGUS_ID, max_size=2), order=st.randoms(use_true_random=False),
       twice=st.booleans())
def test_leases_and_reservations_released_with_bogus_ids(
        fuzzer: Fuzzer, namespace: str, keys: list[bytes], lease_timeout_ms: int,
        bogus: list[str], order: random.Random, twice: bool) -> None:
    got = fuzzer.call("Get", pb.GetRequest(namespace=namespace, keys=keys,
                                           mode=pb.GET_MODE_SHARED_MEMORY,
                                           lease_timeout_ms=lease_timeout_ms)
                      .SerializeToString())
    reserved = fuzzer.call("Reserve", pb.ReserveRequest(
        namespace=JUNK[0], keys=[hashlib.sha256(repr(keys).encode()).digest()], sizes=[1000],
        timeout_ms=lease_timeout_ms).SerializeToString())
    ids = list(bogus)
    if got is not None and pb.GetResponse.FromString(got[0]).lease_id:
        ids.append(pb.GetResponse.FromString(got[0]).lease_id)
    if reserved is not None:
        ids.append(pb.ReserveResponse.FromString(reserved[0]).reservation_id)
    if twice and ids:
        ids.append(ids[-1])
    order.shuffle(ids)
    ok = fuzzer.release(ids)
    if bogus or twice:
        assert not ok, f"Release({ids!r}) was OK"
    fuzzer.settle()


# --- streams the client cancels --------------------------------------------------------------


@fuzz(60)
@given(case=put_streams(), after=st.integers(0, 3), delay_s=st.sampled_from([0.0, 0.01, 0.03]))
def test_put_streams_the_client_cancels_midway(fuzzer: Fuzzer, case: PutCase, after: int,
                                               delay_s: float) -> None:
    fuzzer.put(case.messages, cancel_after=after, cancel_delay_s=delay_s)
    fuzzer.settle()


@fuzz(60)
@given(namespace=st.sampled_from(VERIFIED), seed=st.binary(min_size=4, max_size=4),
       sizes=st.lists(st.integers(1, 400_000), min_size=1, max_size=4),
       method=st.sampled_from(["Get", "Prefetch"]), after=st.integers(1, 6))
def test_get_and_prefetch_the_client_cancels_midway(fuzzer: Fuzzer, namespace: str,
                                                    seed: bytes, sizes: list[int], method: str,
                                                    after: int) -> None:
    keys = [hashlib.sha256(seed + bytes([i])).digest() for i in range(len(sizes))]
    data = b"".join(payload(namespace, k, n) for k, n in zip(keys, sizes, strict=True))
    fuzzer.put([pb.PutRequest(namespace=namespace, keys=keys, sizes=sizes,
                              data=data).SerializeToString()])
    request = (pb.GetRequest(namespace=namespace, keys=keys) if method == "Get" else
               pb.PrefetchRequest(namespace=namespace, keys=keys, target_tier=pb.TIER_DRAM))
    fuzzer.read_partly(method, request.SerializeToString(), after)
    fuzzer.settle()


def test_a_reader_and_a_writer_slower_than_their_lease(fuzzer: Fuzzer) -> None:
    """A Get whose reader stalls past leases.lease_timeout_s, and a Put whose writer stalls
    past leases.reservation_timeout_s: refused (ABORTED) or served, never a fault."""
    namespace, sizes = VERIFIED[0], [MAX_OBJECT_BYTES] * 4  # at server.max_response_bytes
    keys = [hashlib.sha256(b"slow %d" % i).digest() for i in range(len(sizes))]
    data = b"".join(payload(namespace, k, n) for k, n in zip(keys, sizes, strict=True))
    header = pb.PutRequest(namespace=namespace, keys=keys, sizes=sizes, independent=True)
    stalled = LEASE_TIMEOUT_S + 3 * SWEEP_INTERVAL_S
    fuzzer.put([header.SerializeToString(), DATA_TAG + varint(len(data)) + data],
               pause_s=stalled)
    fuzzer.put([header.SerializeToString(), DATA_TAG + varint(len(data)) + data])
    get = pb.GetRequest(namespace=namespace, keys=keys).SerializeToString()
    # Without BDP probing the window stays 64 KiB: the daemon blocks mid-stream, lease held.
    with grpc.insecure_channel(fuzzer.daemon.target, options=[
            ("grpc.http2.bdp_probe", 0), ("grpc.max_receive_message_length", 16 << 20)]) as ch:
        Fuzzer(fuzzer.daemon, ch).read_partly("Get", get, after=2, pause_s=stalled)
    fuzzer.settle()


# --- afterwards ------------------------------------------------------------------------------


def _rpc_counts(d: Daemon) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics",
                                  timeout=TIMEOUT_S).read().decode()
    pattern = r'kvstore_rpc_latency_seconds_count\{code="(\w+)",method="(\w+)"\} (\S+)'
    return {(m, c): float(n) for c, m, n in re.findall(pattern, text)}


def test_after_the_fuzzing_the_daemon_is_intact(fuzzer: Fuzzer) -> None:
    """Last in the module: everything above ran against this daemon."""
    fuzzer.settle()  # lets go of the long leases and reservations, checks the log
    with KVStoreClient(fuzzer.daemon.target, KEEP_NS) as kv:
        assert kv.get(KEEP_KEYS) == KEEP_VALUES
        assert kv.health() == "SERVING"
        deadline = time.monotonic() + max(LEASE_TIMEOUT_S, RESERVATION_TIMEOUT_S) + 1.5
        while (stats := kv.stats()).leases or stats.reservations:
            assert time.monotonic() < deadline, (stats.leases, stats.reservations)
            time.sleep(SWEEP_INTERVAL_S)
        faults = {k: n for k, n in _rpc_counts(fuzzer.daemon).items()
                  if k[1] in ("INTERNAL", "UNKNOWN")}
        assert not faults, faults
        # No page leaked: with every pin the fuzzing made undone and everything else
        # evicted, the pages in use are KEEP's (each block in one tier: placement is
        # exclusive).
        for pin in fuzzer.pinned:
            assert fuzzer.call("Unpin", pin.SerializeToString()) is not None
        assert fuzzer.call("Evict", pb.EvictRequest(all=True).SerializeToString())
        assert kv.stats().pinned == len(KEEP_KEYS)
        tiers = kv.lookup(KEEP_KEYS).tiers
        for tier in kv.stats().tiers:
            if not tier.enabled or tier.tier not in ("dram", "nvme"):
                continue
            mine = [len(v) for v, t in zip(KEEP_VALUES, tiers, strict=True) if t == tier.tier]
            pages = sum(-(-n // tier.page_size_bytes) for n in mine)
            assert tier.objects == len(mine), tier
            assert tier.free_pages == tier.capacity_bytes // tier.page_size_bytes - pages, tier
    fuzzer.settle()
    assert "Traceback" not in fuzzer.daemon.log()
