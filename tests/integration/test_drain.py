"""Graceful drain on SIGTERM, against a real daemon: for server.drain_notice_s the daemon still
answers, with health NOT_SERVING, new data calls UNAVAILABLE (naming the drain) and Release
and Stats still served; a Get streaming when the signal came finishes bit-exact; then the
daemon exits 0 within server.grace_s."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import KVStoreClient
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.tools.testing import Daemon

NS = "drain"
BLOCK = 4 << 20


def test_sigterm_drains_visibly_then_exits_zero(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory("dram.capacity_bytes=32MiB", "server.chunk_bytes=256KiB",
                       "server.drain_notice_s=2", "server.grace_s=6", "nvme.enabled=false")
    key, value = b"\x07" * 32, bytes(range(256)) * (BLOCK // 256)
    with KVStoreClient(d.target, NS) as kv:
        kv.put([key], [value])
    with grpc.insecure_channel(d.target) as channel:
        stub, health = rpc.KVStoreStub(channel), health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert health.Check(health_pb2.HealthCheckRequest()).status == serving
        streaming = stub.Get(pb.GetRequest(namespace=NS, keys=[key]), timeout=10)
        head = next(streaming)  # a Get in flight when the signal comes
        assert list(head.found) == [True]
        signalled = time.monotonic()
        d.proc.terminate()
        time.sleep(0.3)
        status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as refused:
            stub.Lookup(pb.LookupRequest(namespace=NS, keys=[key]), timeout=1)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in (refused.value.details() or "")
        assert stub.Stats(pb.StatsRequest(namespace=NS), timeout=1).tiers  # operators watch
        with pytest.raises(grpc.RpcError) as unknown:  # served: Release still works
            stub.Release(pb.ReleaseRequest(ids=["no-such-lease"]), timeout=1)
        assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert time.monotonic() - signalled < 2, "the checks above ran inside the notice"
        assert b"".join(m.data for m in streaming) == value  # the in-flight Get finished
    assert d.proc.wait(timeout=10) == 0, d.log()
    assert time.monotonic() - signalled < 6 + 1, "exited within server.grace_s"
    assert "Traceback" not in d.log(), d.log()
