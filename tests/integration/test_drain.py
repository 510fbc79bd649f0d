"""Graceful drain on SIGTERM, against a real daemon: for server.drain_notice_s the daemon still
answers, with health NOT_SERVING, new data calls UNAVAILABLE (naming the drain) and Release
and Stats still served; a Get streaming when the signal came finishes bit-exact; then the
daemon exits 0 within server.grace_s. `kvstore-admin drain` (the Drain verb) does the same
without a signal, and says so in Stats."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
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


def test_admin_drain_stops_the_daemon_like_sigterm(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory("server.drain_notice_s=1.5", "server.grace_s=5", "nvme.enabled=false",
                       "dram.capacity_bytes=8MiB")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    out: dict[str, subprocess.CompletedProcess[str]] = {}

    def drain() -> None:
        out["drain"] = subprocess.run(
            [sys.executable, "-m", "kvstore.tools.admin", "--target", d.target, "drain",
             "--wait", "--json"], capture_output=True, text=True, timeout=30, env=env)

    asked = time.monotonic()
    waiter = threading.Thread(target=drain)
    waiter.start()
    with KVStoreClient(d.target, NS) as kv:
        deadline = time.monotonic() + 5
        while not kv.stats().draining:  # Stats is served while draining, and says so
            assert time.monotonic() < deadline, "Drain never began"
            time.sleep(0.05)
        assert kv.health() == "NOT_SERVING"
        again = kv.drain()  # a second Drain changes nothing
        assert again.already_draining and again.grace_s == 5
    waiter.join(timeout=30)
    done = out["drain"]
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    reply = json.loads(done.stdout)
    assert reply["already_draining"] is False and reply["stopped"] is True
    assert d.proc.wait(timeout=10) == 0, d.log()
    assert time.monotonic() - asked < 5 + 3, "exited within server.grace_s"
    assert "Drain asked by" in d.log()
