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
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import xxhash
from prometheus_client.parser import text_string_to_metric_families

from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.tools.testing import Daemon, start_daemon
from tests.integration.test_auth import A_NS, B_NS, KEY, md, put, tenants_doc, write_tenants

MiB = 1 << 20


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    tenants = write_tenants(tmp_path / "tenants.yaml", tenants_doc())
    sock = tmp_path / "kvstore.sock"
    d = start_daemon(tmp_path, "auth.mode=token", f"auth.tenants_file={tenants}",
                     f"server.unix_socket={sock}", "dram.capacity_bytes=32MiB",
                     "nvme.enabled=false")
    yield d
    d.stop()


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
    put(stub, "team-a", A_NS)
    missing = bytes(range(2, 34))
    stub.Lookup(pb.LookupRequest(namespace=A_NS, keys=[KEY, missing], block_tokens=16),
                metadata=md("team-a"))
    stub.Lookup(pb.LookupRequest(namespace=B_NS, keys=[KEY]), metadata=md("team-b"))
    url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        families = list(text_string_to_metric_families(response.read().decode()))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families for s in f.samples}

    def of(name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    assert of("kvstore_lookup_blocks_total", tenant="team-a") == 2
    assert of("kvstore_prefix_hit_blocks_total", tenant="team-a") == 1
    assert of("kvstore_lookup_tokens_total", tenant="team-a") == 32
    assert of("kvstore_prefix_hit_tokens_total", tenant="team-a") == 16
    assert of("kvstore_lookup_blocks_total", tenant="team-b") == 1
    assert of("kvstore_prefix_hit_blocks_total", tenant="team-b") == 0  # B's KEY: not A's
    assert of("kvstore_tenant_capacity_bytes", tenant="team-a", tier="dram") == 8 * MiB
    assert of("kvstore_tenant_used_bytes", tenant="team-a", tier="dram") == 1200
    assert of("kvstore_tenant_used_bytes", tenant="team-b", tier="dram") == 0
