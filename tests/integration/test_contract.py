"""Every checkable rule of proto/kvstore/v1/kvstore.proto (and docs/protocol.md), tried on a
real daemon through the raw generated stubs, never the client library, as an engine in another
language calls it. Errors are asserted by status code (ErrorInfo reasons are tested apart)."""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import xxhash

from kvstore.core.prefixhits import MAX_BLOCK_TOKENS
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.tools.testing import Daemon, start_daemon
from tests import helpers
from tests.helpers import code_of, sized_blocks, wait_until

KiB, MiB = 1 << 10, 1 << 20
CHUNK = 128 * KiB
MAX_MESSAGE = 1 * MiB
MAX_OBJECT = 512 * KiB
# Every limit Limits reports set away from its default, so an answer made of defaults fails.
SETTINGS = ("dram.capacity_bytes=32MiB", "dram.page_size_bytes=4KiB", "nvme.enabled=false",
            f"server.chunk_bytes={CHUNK}", f"server.max_message_bytes={MAX_MESSAGE}",
            "server.max_batch_keys=64", f"server.max_object_bytes={MAX_OBJECT}",
            "server.max_response_bytes=2MiB", "server.stream_idle_s=5",
            "leases.lease_timeout_s=7", "leases.reservation_timeout_s=9",
            "clients.max_pin_s=120")
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
OFF = grpc.StatusCode.FAILED_PRECONDITION
DRAM = pb.TIER_DRAM
MISS = pb.TIER_UNSPECIFIED
Served = tuple[grpc.Channel, rpc.KVStoreStub]


@contextmanager
def running(workdir: Path, *settings: str) -> Iterator[Served]:
    """A daemon of the caller's own, stopped (exit 0) on leaving."""
    d = start_daemon(workdir, *settings)
    try:
        with channel_to(d.target) as pair:
            yield pair
    finally:
        assert d.stop() == 0, d.log()


@contextmanager
def channel_to(target: str) -> Iterator[Served]:
    """A channel whose limits exceed the daemon's, so the daemon refuses first."""
    with grpc.insecure_channel(target, options=[
            ("grpc.max_send_message_length", 4 * MiB),
            ("grpc.max_receive_message_length", 4 * MiB)]) as channel:
        yield channel, rpc.KVStoreStub(channel)


@pytest.fixture(scope="module")
def served(shared_daemon: Callable[..., Daemon]) -> Iterator[Served]:
    """The module's daemon (shared_daemon: SETTINGS are this module's alone). Each test uses
    namespaces of its own, and reads the daemon's lease count as a change."""
    with channel_to(shared_daemon(*SETTINGS).target) as pair:
        yield pair


@pytest.fixture(scope="module")
def stub(served: Served) -> rpc.KVStoreStub:
    return served[1]


def put(stub: rpc.KVStoreStub, ns: str, keys: list[bytes], values: list[bytes],
        parent_key: bytes = b"", independent: bool = False) -> pb.PutResponse:
    """One Put: the header alone, then the data in chunk_bytes messages."""
    return helpers.put(stub, ns, keys, values, chunk_bytes=CHUNK, parent_key=parent_key,
                       independent=independent)


def put_code(stub: rpc.KVStoreStub, *messages: pb.PutRequest) -> grpc.StatusCode:
    return code_of(lambda: stub.Put(iter(messages)))


def tiers(stub: rpc.KVStoreStub, ns: str, keys: list[bytes]) -> list[int]:
    return list(stub.Lookup(pb.LookupRequest(namespace=ns, keys=keys)).tiers)


def test_limits_are_the_daemons_settings_and_what_is_off_fails_precondition(
        stub: rpc.KVStoreStub) -> None:
    got = stub.Limits(pb.LimitsRequest())
    assert got == pb.LimitsResponse(
        contract="kvstore.v1", max_message_bytes=MAX_MESSAGE, chunk_bytes=CHUNK,
        max_batch_keys=64, max_object_bytes=MAX_OBJECT, max_response_bytes=2 * MiB,
        key_bytes=32, max_namespace_bytes=256, default_lease_ms=7000, max_lease_ms=600_000,
        reservation_timeout_ms=9000, max_pin_ms=120_000, stream_idle_ms=5000,
        max_block_tokens=MAX_BLOCK_TOKENS, shared_memory=True, unix_socket="",
        auth_mode="off")
    # No L4 (remote.url), no auth: the verbs that need them are FAILED_PRECONDITION.
    assert code_of(lambda: stub.Hot(pb.HotRequest(namespace="c/off"))) == OFF
    assert code_of(lambda: stub.Prewarm(pb.PrewarmRequest())) == OFF
    assert code_of(lambda: stub.Attach(pb.AttachRequest())) == OFF


def test_requests_past_the_limits_are_refused(stub: rpc.KVStoreStub) -> None:
    lim, ns, key = stub.Limits(pb.LimitsRequest()), "c/lim", os.urandom(32)
    for bad in (pb.LookupRequest(namespace=ns, keys=[key] * (lim.max_batch_keys + 1)),
                pb.LookupRequest(namespace=ns, keys=[key[:-1]]), pb.LookupRequest(),
                pb.LookupRequest(namespace="x" * (lim.max_namespace_bytes + 1))):
        assert code_of(lambda b=bad: stub.Lookup(b)) == INVALID
    big = pb.PutRequest(namespace=ns, keys=[key], sizes=[lim.max_object_bytes + 1])
    assert put_code(stub, big) == INVALID
    assert code_of(lambda: stub.Get(pb.GetRequest(namespace=ns, keys=[key], lease_timeout_ms=(
        lim.max_lease_ms + 1), mode=pb.GET_MODE_SHARED_MEMORY))) == INVALID
    # Four blocks at max_object_bytes are 2 MiB: one byte more is over max_response_bytes.
    keys, values = sized_blocks([MAX_OBJECT] * 4 + [1], 3)
    put(stub, ns, keys, values, independent=True)
    assert sum(len(m.data) for m in stub.Get(pb.GetRequest(namespace=ns, keys=keys[:4]))
               ) == lim.max_response_bytes
    assert code_of(lambda: stub.Get(pb.GetRequest(namespace=ns, keys=keys))) == EXHAUSTED


def test_put_header_first_then_data_alone(stub: rpc.KVStoreStub) -> None:
    ns = "c/put-framing"
    keys, values = sized_blocks([300 * KiB, 10, 5000], 1)
    data = b"".join(values)
    # The first message may carry data after its header; every later one carries data alone.
    first = pb.PutRequest(namespace=ns, keys=keys, sizes=[len(v) for v in values],
                          data=data[:1000], independent=True)
    rest = [pb.PutRequest(data=data[i : i + CHUNK]) for i in range(1000, len(data), CHUNK)]
    assert stub.Put(iter([first, *rest])) == pb.PutResponse(stored=3)
    assert b"".join(m.data for m in stub.Get(pb.GetRequest(namespace=ns, keys=keys))) == data

    # A header field in a later message, data before any header, bytes short of the sizes,
    # sizes not one per key: INVALID_ARGUMENT, and nothing of that Put is stored.
    more, payload = sized_blocks([100, 100], 2)
    head = pb.PutRequest(namespace=ns, keys=more, sizes=[100, 100], independent=True)
    assert put_code(stub, head, pb.PutRequest(data=payload[0]),
                    pb.PutRequest(keys=[os.urandom(32)], data=payload[1])) == INVALID
    assert put_code(stub, pb.PutRequest(data=b"x" * 200)) == INVALID
    assert put_code(stub, head, pb.PutRequest(data=payload[0])) == INVALID
    assert put_code(stub, pb.PutRequest(namespace=ns, keys=more, sizes=[100])) == INVALID
    assert tiers(stub, ns, more) == [MISS, MISS]


def test_a_message_over_max_message_bytes_is_resource_exhausted(stub: rpc.KVStoreStub) -> None:
    """max_message_bytes counts the whole encoded message; a Put data message may exceed
    chunk_bytes as long as it fits."""
    ns = "c/max-message"
    fits = pb.PutRequest(data=b"\0" * (MAX_MESSAGE - 4))  # tag 1 byte, length 3, data
    assert fits.ByteSize() == MAX_MESSAGE and len(fits.data) > CHUNK
    n = len(fits.data)
    keys, other = [os.urandom(32), os.urandom(32)], [os.urandom(32), os.urandom(32)]
    assert stub.Put(iter([pb.PutRequest(namespace=ns, keys=keys, independent=True, sizes=[
        MAX_OBJECT, n - MAX_OBJECT]), fits])).stored == 2
    over = pb.PutRequest(data=b"\0" * (n + 1))
    assert over.ByteSize() == MAX_MESSAGE + 1
    assert put_code(stub, pb.PutRequest(namespace=ns, keys=other, independent=True, sizes=[
        MAX_OBJECT, n + 1 - MAX_OBJECT]), over) == EXHAUSTED
    assert tiers(stub, ns, other) == [MISS, MISS]


def test_zero_keys_are_ok_stored_keys_immutable_and_lookup_reports_prefix_and_tiers(
        stub: rpc.KVStoreStub) -> None:
    ns = "c/immutable"
    assert stub.Put(iter([pb.PutRequest(namespace=ns)])) == pb.PutResponse()
    assert stub.Lookup(pb.LookupRequest(namespace=ns)) == pb.LookupResponse()
    assert [m.found for m in stub.Get(pb.GetRequest(namespace=ns))] == [[]]
    keys, values = sized_blocks([64, 64, 64], 4)
    assert put(stub, ns, keys, values, independent=True) == pb.PutResponse(stored=3)
    assert put(stub, ns, keys[:2], [b"\1" * 64, b"\2" * 64]) == pb.PutResponse(existing=2)
    assert b"".join(m.data for m in stub.Get(pb.GetRequest(namespace=ns, keys=keys))
                    ) == b"".join(values)
    got = stub.Lookup(pb.LookupRequest(namespace=ns, block_tokens=16,
                                       keys=[keys[0], keys[1], os.urandom(32), keys[2]]))
    assert (got.prefix_length, list(got.tiers)) == (2, [DRAM, DRAM, MISS, DRAM])


def test_inline_get_frames_and_orders_by_found_keys(stub: rpc.KVStoreStub) -> None:
    ns = "c/inline"
    keys, values = sized_blocks([300 * KiB, 1, 200 * KiB], 6)
    put(stub, ns, keys, values, independent=True)
    messages = list(stub.Get(pb.GetRequest(namespace=ns, keys=[
        os.urandom(32), keys[2], keys[0], os.urandom(32), keys[1]])))
    head, data = messages[0], messages[1:]
    # The first message: found per key, sizes and checksums per found key in request order.
    assert list(head.found) == [False, True, True, False, True]
    assert list(head.sizes) == [len(values[2]), len(values[0]), len(values[1])]
    assert list(head.checksums) == [xxhash.xxh3_64_intdigest(v)
                                    for v in (values[2], values[0], values[1])]
    assert (head.data, head.lease_id, head.lease_expires_in_ms, len(head.locations)) == (
        b"", "", 0, 0)
    # Then data alone, at most chunk_bytes each, the found payloads concatenated in that order.
    assert all(m.ListFields() == [(pb.GetResponse.DESCRIPTOR.fields_by_name["data"], m.data)]
               for m in data)
    assert all(0 < len(m.data) <= CHUNK for m in data)
    assert b"".join(m.data for m in data) == values[2] + values[0] + values[1]
    # Each key at most once.
    twice = pb.GetRequest(namespace=ns, keys=[keys[0], keys[0]])
    assert code_of(lambda: stub.Get(twice)) == INVALID


def test_checksums_are_xxh3_64_seed_0_as_fixed64(served: Served) -> None:
    """The digest's unsigned 64-bit value is the fixed64, so on the wire its 8 bytes are
    little-endian: the reverse of xxh3's canonical (big-endian) digest bytes."""
    (channel, stub), ns = served, "c/xxh3"
    keys, values = sized_blocks([1, 4096, 100_000], 7)
    put(stub, ns, keys, values, independent=True)
    raw_get = channel.unary_stream("/kvstore.v1.KVStore/Get", response_deserializer=None,
                                   request_serializer=pb.GetRequest.SerializeToString)
    first = next(iter(raw_get(pb.GetRequest(namespace=ns, keys=keys))))
    wire = b"".join(xxhash.xxh3_64(v, seed=0).digest()[::-1] for v in values)
    assert b"\x1a" + bytes([len(wire)]) + wire in first  # field 3, packed
    for v, value in zip(values, struct.unpack("<3Q", wire), strict=True):
        assert value == xxhash.xxh3_64_intdigest(v) == int(xxhash.xxh3_64_hexdigest(v), 16)


def segment(name: str) -> mmap.mmap:
    fd = os.open(Path("/dev/shm") / name, os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


def read_location(buf: mmap.mmap, location: pb.BlockLocation) -> bytes:
    return b"".join(buf[e.offset : e.offset + e.length] for e in location.extents)


def test_shared_memory_get_locations_follow_found_keys_leased_or_not(stub: rpc.KVStoreStub) -> None:
    ns = "c/shm-get"
    keys, values = sized_blocks([5000, 9000, 1], 8)
    leases = stub.Stats(pb.StatsRequest()).leases  # the daemon's: read as a change
    put(stub, ns, keys, values, independent=True)
    [head] = stub.Get(pb.GetRequest(namespace=ns, keys=[keys[1], os.urandom(32), keys[0]],
                                    mode=pb.GET_MODE_SHARED_MEMORY))
    assert list(head.found) == [True, False, True] and len(head.locations) == 2
    assert head.shm_name and not head.arena and head.lease_id
    assert head.lease_expires_in_ms == 7000  # leases.lease_timeout_s, lease_timeout_ms 0
    with segment(head.shm_name) as buf:
        got = [read_location(buf, loc) for loc in head.locations]
    assert got == [values[1], values[0]]
    assert [xxhash.xxh3_64_intdigest(g) for g in got] == list(head.checksums)
    assert stub.Stats(pb.StatsRequest()).leases == leases + 1
    # Unknown ids: INVALID_ARGUMENT, after every known one is released.
    assert code_of(lambda: stub.Release(pb.ReleaseRequest(ids=[head.lease_id, "nope"]))) == INVALID
    assert stub.Stats(pb.StatsRequest()).leases == leases
    # no_lease: no lease taken, none to release; lease_expires_in_ms still says its length.
    for asked, reported in ((0, 7000), (1234, 1234)):
        [head] = stub.Get(pb.GetRequest(namespace=ns, keys=keys[:1], no_lease=True,
                                        lease_timeout_ms=asked, mode=pb.GET_MODE_SHARED_MEMORY))
        assert (head.lease_id, head.lease_expires_in_ms) == ("", reported)
        assert stub.Stats(pb.StatsRequest()).leases == leases
        with segment(head.shm_name) as buf:
            assert read_location(buf, head.locations[0]) == values[0]


def reserve_and_write(stub: rpc.KVStoreStub, ns: str, keys: list[bytes],
                      values: list[bytes]) -> pb.ReserveResponse:
    r = stub.Reserve(pb.ReserveRequest(namespace=ns, keys=keys, sizes=[len(v) for v in values],
                                       independent=True))
    with segment(r.shm_name) as buf:
        for loc, value in zip(r.locations, values, strict=True):
            at = 0
            for e in loc.extents:
                buf[e.offset : e.offset + e.length] = value[at : at + e.length]
                at += e.length
    return r


def test_a_commit_needs_the_namespace_is_one_message_and_checks_sums(
        stub: rpc.KVStoreStub) -> None:
    ns = "c/commit"
    keys, values = sized_blocks([6000, 70], 10)
    sums = [xxhash.xxh3_64_intdigest(v) for v in values]
    r = reserve_and_write(stub, ns, keys, values)
    assert list(r.exists) == [False, False] and r.expires_in_ms == 9000
    rid = r.reservation_id
    # Without the namespace, with keys, or with a second message: refused; the reservation
    # stays, and the right commit then stores it.
    commit = pb.PutRequest(namespace=ns, reservation_id=rid, checksums=sums)
    assert put_code(stub, pb.PutRequest(reservation_id=rid, checksums=sums)) == INVALID
    assert put_code(stub, pb.PutRequest(namespace=ns, reservation_id=rid, keys=keys)) == INVALID
    assert put_code(stub, commit, pb.PutRequest(data=b"x")) == INVALID
    assert stub.Put(iter([commit])) == pb.PutResponse(stored=2)
    head, *data = stub.Get(pb.GetRequest(namespace=ns, keys=keys))
    assert list(head.checksums) == sums
    assert b"".join(m.data for m in data) == b"".join(values)
    # A checksum that does not match the bytes written: refused, and the reservation freed.
    keys, values = sized_blocks([5000], 11)
    r = reserve_and_write(stub, ns, keys, values)
    wrong = [xxhash.xxh3_64_intdigest(values[0]) ^ 1]
    assert put_code(stub, pb.PutRequest(namespace=ns, reservation_id=r.reservation_id,
                                        checksums=wrong)) == INVALID
    assert tiers(stub, ns, keys) == [MISS]
    assert code_of(lambda: stub.Release(pb.ReleaseRequest(ids=[r.reservation_id]))) == INVALID


def test_a_parent_key_that_is_not_cached_is_accepted(stub: rpc.KVStoreStub) -> None:
    ns, (keys, values) = "c/parent", sized_blocks([100, 100], 12)
    assert put(stub, ns, keys, values, parent_key=os.urandom(32)).stored == 2
    assert tiers(stub, ns, keys) == [DRAM, DRAM]
    # A chain may not name a block twice, as a key or as parent_key.
    assert code_of(lambda: put(stub, ns, keys, values, keys[1])) == INVALID


def test_a_prefetch_streams_until_done_and_its_end_means_done(stub: rpc.KVStoreStub) -> None:
    ns = "c/prefetch"
    keys, values = sized_blocks([100, 100], 13)
    put(stub, ns, keys, values)
    miss = os.urandom(32)
    steps = list(stub.Prefetch(pb.PrefetchRequest(namespace=ns, keys=[*keys, miss],
                                                  target_tier=DRAM)))
    last = steps[-1]
    assert (last.done, last.missing, last.failed, last.total) == (2, 1, 0, 3)
    assert (last.prefix_length, last.deadline_exceeded) == (2, False)
    assert [pb.PrefetchProgress(total=0)] == list(stub.Prefetch(pb.PrefetchRequest(
        namespace=ns)))
    assert code_of(lambda: stub.Prefetch(pb.PrefetchRequest(namespace=ns, keys=keys,
                                                     target_tier=pb.TIER_NVME))) == OFF


def test_the_stats_namespace_filter_narrows_objects_and_used_bytes_only(
        stub: rpc.KVStoreStub) -> None:
    put(stub, "c/stats-a", *sized_blocks([4096, 100], 14), independent=True)
    put(stub, "c/stats-b", *sized_blocks([8192, 1, 1], 15), independent=True)
    everything, only_a = stub.Stats(pb.StatsRequest()), stub.Stats(pb.StatsRequest(
        namespace="c/stats-a"))
    row, all_row = (next(t for t in s.tiers if t.tier == DRAM) for s in (only_a, everything))
    assert (row.objects, row.used_bytes) == (2, 4196)
    assert all_row.objects >= 5 and all_row.used_bytes >= 4196 + 8194
    # Everything else is the daemon's, filter or not.
    for name in ("capacity_bytes", "page_size_bytes", "hits", "misses", "free_pages"):
        assert getattr(row, name) == getattr(all_row, name), name
    for name in ("leases", "reservations", "pinned", "hits", "misses", "shm_name"):
        assert getattr(only_a, name) == getattr(everything, name), name


def test_evict_takes_one_of_keys_bytes_or_all_and_spares_pins(stub: rpc.KVStoreStub) -> None:
    ns = "c/evict"
    keys, values = sized_blocks([100, 100, 100], 16)
    put(stub, ns, keys, values)  # one chain: keys[0] <- keys[1] <- keys[2]
    both = pb.EvictRequest(namespace=ns, keys=keys, all=True)
    assert code_of(lambda: stub.Evict(both)) == INVALID
    assert code_of(lambda: stub.Evict(pb.EvictRequest(keys=keys))) == INVALID
    pinned = stub.Pin(pb.PinRequest(namespace=ns, keys=[keys[0], os.urandom(32)]))
    assert pinned == pb.PinResponse(changed=1, missing=1)
    got = stub.Evict(pb.EvictRequest(namespace=ns, keys=[keys[0]]))  # its tree holds a pin
    assert (got.evicted, got.skipped, got.skipped_pinned) == (0, 1, 1)
    assert stub.Unpin(pb.PinRequest(namespace=ns, keys=keys[:1])).changed == 1
    # A block goes with its cached descendants.
    got = stub.Evict(pb.EvictRequest(namespace=ns, keys=[keys[1]]))
    assert (got.evicted, got.evicted_bytes, got.skipped) == (2, 200, 0)
    assert tiers(stub, ns, keys) == [DRAM, MISS, MISS]


PAGE = 64 * KiB
L3 = ("dram.capacity_bytes=2MiB", "dram.page_size_bytes=64KiB", "nvme.capacity_bytes=16MiB",
      "nvme.page_size_bytes=64KiB", "movers.interval_s=0.02")


def settled(stub: rpc.KVStoreStub, ns: str, keys: list[bytes]) -> list[int]:
    """The keys' tiers once the mover has stopped moving them."""
    seen = [tiers(stub, ns, keys)]

    def still() -> bool:
        seen.append(tiers(stub, ns, keys))
        return seen[-1] == seen[-2]
    wait_until(still, "the mover to settle", timeout_s=15, pause_s=0.3)
    return seen[-1]


def test_evict_by_tier_removes_the_blocks_whose_only_copy_was_there(tmp_path: Path) -> None:
    with running(tmp_path, *L3) as (_, stub):
        ns = "c/evict-tier"
        keys, values = sized_blocks([PAGE] * 48, 18)  # 1.5 times L2: some go down to L3
        for i in range(0, 48, 8):
            put(stub, ns, keys[i : i + 8], values[i : i + 8], independent=True)
        wait_until(lambda: pb.TIER_NVME in tiers(stub, ns, keys), "a block in L3", timeout_s=15)
        before = settled(stub, ns, keys)
        in_l3 = before.count(pb.TIER_NVME)
        assert in_l3 and before.count(DRAM) + in_l3 == 48
        got = stub.Evict(pb.EvictRequest(namespace=ns, all=True, tier=pb.TIER_NVME))
        assert (got.evicted, got.evicted_bytes, got.skipped) == (in_l3, in_l3 * PAGE, 0)
        assert tiers(stub, ns, keys) == [MISS if t == pb.TIER_NVME else t for t in before]
        # By bytes or all in a tier that is off: FAILED_PRECONDITION.
        assert code_of(lambda: stub.Evict(pb.EvictRequest(namespace=ns, all=True,
                                                   tier=pb.TIER_HBM))) == OFF


def namespace_root(namespace: str) -> bytes:
    return hashlib.sha256(b"kvstore/v1" + namespace.encode()).digest()


PARENTS: dict[str, Callable[[str], bytes]] = {
    "empty": lambda ns: b"", "root": namespace_root, "uncached": lambda ns: b"\7" * 32}


@pytest.fixture(scope="module")
def after_restart(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """The tiers of three L3 chains (parent_key empty, the namespace root, a block never
    cached) after a restart on the same L3 folder."""
    work = tmp_path_factory.mktemp("restart")
    settings = (*L3, f"nvme.dir={work / 'l3'}")
    chains = {name: sized_blocks([PAGE] * 4, 20 + i)[0] for i, name in enumerate(PARENTS)}
    with running(work, *settings) as (_, stub):
        for name, keys in chains.items():
            ns = f"c/restart-{name}"
            put(stub, ns, keys, [os.urandom(PAGE) for _ in keys], parent_key=PARENTS[name](ns))
        filler, values = sized_blocks([PAGE] * 40, 30)
        for i in range(0, 40, 8):
            put(stub, "c/filler", filler[i : i + 8], values[i : i + 8], independent=True)
        wait_until(lambda: all(tiers(stub, f"c/restart-{n}", k) == [pb.TIER_NVME] * 4
                               for n, k in chains.items()), "the chains in L3", timeout_s=15)
    with running(work, *settings) as (_, stub):
        return {n: tiers(stub, f"c/restart-{n}", k) for n, k in chains.items()}


def test_at_a_restart_a_chain_from_no_parent_stays_and_one_from_an_uncached_parent_goes(
        after_restart: dict[str, list[int]]) -> None:
    assert (after_restart["empty"], after_restart["uncached"]) == ([pb.TIER_NVME] * 4,
                                                                   [MISS] * 4)


def test_a_chain_whose_parent_key_is_the_namespace_root_survives_a_restart(
        after_restart: dict[str, list[int]]) -> None:
    assert after_restart["root"] == [pb.TIER_NVME] * 4
