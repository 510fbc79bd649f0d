"""Shared memory per tenant (a real daemon, raw gRPC and a raw Unix socket): each tenant's
L2 pages are a memfd of their own, handed only to that tenant's authenticated clients over
the daemon's Unix socket. A's client receives A's arena alone; nothing opens B's by name,
ticket or descriptor trick; whatever A writes into all the memory it can reach leaves B's
block (and B's reservation in flight) bit-exact."""

from __future__ import annotations

import json
import mmap
import os
import socket
from collections.abc import Callable, Iterator

import grpc
import pytest
import xxhash

from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.tools.testing import Daemon
from tests.helpers import MiB, metric, scrape
from tests.integration.test_auth import (
    A_NS,
    B_NS,
    KEY,
    auth_settings,
    md,
    put,
    tenants_doc,
    write_tenants,
)


def token_daemon(shared_daemon: Callable[..., Daemon],
                 tmp_path_factory: pytest.TempPathFactory) -> Daemon:
    """The session's token daemon with a Unix socket (test_auth.py's settings and tenants:
    team-a, team-b and the admin root), shared by the tests of tenants here, in
    test_local_path.py and in test_error_reasons.py. Its tenants file is one per session (per
    xdist worker), so that every module names the same settings; none rewrites it."""
    tenants = tmp_path_factory.getbasetemp() / "shared-tenants.yaml"
    if not tenants.exists():
        write_tenants(tenants, tenants_doc())
    return shared_daemon(*auth_settings(tenants), unix_socket=True)


def evict_everything(d: Daemon) -> None:
    """Empty a token daemon, as its admin: the `ns` fixture cannot, lacking a token."""
    with grpc.insecure_channel(d.target) as channel:
        rpc.KVStoreStub(channel).Evict(pb.EvictRequest(all=True), metadata=md("root"),
                                       timeout=10)


@pytest.fixture
def daemon(shared_daemon: Callable[..., Daemon],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The session's token daemon, emptied when each test ends: tests here put into the
    tenants' own namespaces and read what each tenant uses."""
    d = token_daemon(shared_daemon, tmp_path_factory)
    yield d
    evict_everything(d)


@pytest.fixture
def stub(daemon: Daemon) -> Iterator[rpc.KVStoreStub]:
    with grpc.insecure_channel(daemon.target) as channel:
        yield rpc.KVStoreStub(channel)


def exchange(path: str, ticket: str) -> tuple[dict[str, object], list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(ticket.encode() + b"\n")
        data, fds, _, _ = socket.recv_fds(s, 65536, 16)
    return json.loads(data), fds


def attach(stub: rpc.KVStoreStub, tenant: str) -> dict[str, mmap.mmap]:
    reply = stub.Attach(pb.AttachRequest(), metadata=md(tenant))
    message, fds = exchange(reply.unix_socket, reply.ticket)
    maps = {}
    for arena, fd in zip(message["arenas"], fds, strict=True):  # type: ignore[arg-type]
        assert os.fstat(fd).st_size == arena["size_bytes"]
        maps[arena["name"]] = mmap.mmap(fd, arena["size_bytes"])
        os.close(fd)
    return maps


def test_a_client_receives_only_its_tenants_arena(stub: rpc.KVStoreStub) -> None:
    arenas = attach(stub, "team-a")
    assert list(arenas) == ["team-a"] and len(arenas["team-a"]) == 8 * MiB  # its quota
    assert list(attach(stub, "team-b")) == ["team-b"]
    stats = stub.Stats(pb.StatsRequest(), metadata=md("team-a"))
    assert stats.shm_name == "" and stats.unix_socket
    assert not [p for p in os.listdir("/dev/shm") if p.startswith("kvstore-")
                and str(stats.unix_socket) in p]  # nothing named for anyone to open


def test_tickets_are_good_once_and_only_real_ones(stub: rpc.KVStoreStub) -> None:
    reply = stub.Attach(pb.AttachRequest(), metadata=md("team-a"))
    ok, fds = exchange(reply.unix_socket, reply.ticket)
    assert "arenas" in ok and len(fds) == 1
    os.close(fds[0])
    for ticket in (reply.ticket, "forged-ticket", "", "x" * 10_000):
        refused, none = exchange(reply.unix_socket, ticket)
        assert "error" in refused and none == []


def test_nothing_a_can_write_changes_b(stub: rpc.KVStoreStub) -> None:
    secret = os.urandom(MiB)
    put(stub, "team-b", B_NS, KEY, secret)
    # B reserves pages and has not committed yet: the attack the issue found.
    pending = os.urandom(64 * 1024)
    reserved = stub.Reserve(pb.ReserveRequest(namespace=B_NS, keys=[bytes(32)],
                                              sizes=[len(pending)]), metadata=md("team-b"))
    assert reserved.arena == "team-b" and reserved.shm_name == ""
    b_map = attach(stub, "team-b")["team-b"]
    for ext in reserved.locations[0].extents:
        b_map[ext.offset : ext.offset + ext.length] = pending[:ext.length]
    # A writes over every byte of all the shared memory it can reach.
    a_map = attach(stub, "team-a")["team-a"]
    a_map[:] = b"\xee" * len(a_map)
    commit = stub.Put(iter([pb.PutRequest(namespace=B_NS,
                                          reservation_id=reserved.reservation_id)]),
                      metadata=md("team-b"))
    assert commit.stored == 1
    got = stub.Get(pb.GetRequest(namespace=B_NS, keys=[KEY, bytes(32)],
                                 mode=pb.GET_MODE_SHARED_MEMORY), metadata=md("team-b"))
    head = next(iter(got))
    assert head.arena == "team-b"
    blocks = [b"".join(bytes(b_map[e.offset : e.offset + e.length]) for e in loc.extents)
              for loc in head.locations]
    assert blocks == [secret, pending]
    assert list(head.checksums) == [xxhash.xxh3_64_intdigest(secret),
                                    xxhash.xxh3_64_intdigest(pending)]
    stub.Release(pb.ReleaseRequest(ids=[head.lease_id]), metadata=md("team-b"))


def test_a_cannot_resize_its_arena(stub: rpc.KVStoreStub) -> None:
    reply = stub.Attach(pb.AttachRequest(), metadata=md("team-a"))
    _, fds = exchange(reply.unix_socket, reply.ticket)
    try:
        for size in (0, 64 * MiB):
            with pytest.raises(PermissionError):
                os.ftruncate(fds[0], size)  # sealed: shrinking would SIGBUS the daemon
    finally:
        os.close(fds[0])
    put(stub, "team-a", A_NS)  # the daemon goes on using it


def test_another_tenants_lease_cannot_be_released(stub: rpc.KVStoreStub) -> None:
    put(stub, "team-b", B_NS)
    head = next(iter(stub.Get(pb.GetRequest(namespace=B_NS, keys=[KEY],
                                            mode=pb.GET_MODE_SHARED_MEMORY),
                              metadata=md("team-b"))))
    with pytest.raises(grpc.RpcError) as info:
        stub.Release(pb.ReleaseRequest(ids=[head.lease_id]), metadata=md("team-a"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.Release(pb.ReleaseRequest(ids=[head.lease_id]),
                        metadata=md("team-b")).released == 1


def test_metrics_count_each_tenants_hits_and_arena_apart(daemon: Daemon,
                                                         stub: rpc.KVStoreStub) -> None:
    before = scrape(daemon)  # the daemon is shared: its counters are read as deltas
    put(stub, "team-a", A_NS)
    missing = bytes(range(2, 34))
    stub.Lookup(pb.LookupRequest(namespace=A_NS, keys=[KEY, missing], block_tokens=16),
                metadata=md("team-a"))
    stub.Lookup(pb.LookupRequest(namespace=B_NS, keys=[KEY]), metadata=md("team-b"))
    after = scrape(daemon)

    def counted(name: str, tenant: str) -> float:
        return metric(after, name, tenant=tenant) - metric(before, name, tenant=tenant)

    assert counted("kvstore_lookup_blocks_total", "team-a") == 2
    assert counted("kvstore_prefix_hit_blocks_total", "team-a") == 1
    assert counted("kvstore_lookup_tokens_total", "team-a") == 32
    assert counted("kvstore_prefix_hit_tokens_total", "team-a") == 16
    assert counted("kvstore_lookup_blocks_total", "team-b") == 1
    assert counted("kvstore_prefix_hit_blocks_total", "team-b") == 0  # B's KEY: not A's
    # Gauges of what each holds now: every test before this one left the daemon empty.
    assert metric(after, "kvstore_tenant_capacity_bytes", tenant="team-a", tier="dram") == 8 * MiB
    assert metric(after, "kvstore_tenant_used_bytes", tenant="team-a", tier="dram") == 1200
    assert metric(after, "kvstore_tenant_used_bytes", tenant="team-b", tier="dram") == 0
