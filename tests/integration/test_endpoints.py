"""The daemon's endpoints besides the KVStore verbs: gRPC health and reflection, the Prometheus
exporter, clean shutdown on SIGTERM (the shared-memory segment is removed), and a bad config
value refusing to start."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import InvalidArgument, KVStoreClient, prefix_keys
from kvstore.daemon import server
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.tools.testing import Daemon, free_port
from tests.conftest import REPO
from tests.helpers import metric, scrape

CAPACITY = 8 << 20


@pytest.fixture
def daemon(whole_daemon: Daemon) -> Daemon:
    """The metrics are the whole daemon's: the shared one for such tests (an 8 MiB L2,
    tests/conftest.py), emptied before each test."""
    return whole_daemon


@pytest.fixture
def channel(daemon: Daemon) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(daemon.target) as ch:
        yield ch


def test_health_is_serving_for_the_server_and_the_service(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "kvstore.v1.KVStore"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.RpcError) as info:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_the_service(channel: grpc.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvstore.v1.KVStore"),
    ]
    listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=5))
    names = {s.name for s in listed.list_services_response.service}
    assert {"kvstore.v1.KVStore", "grpc.health.v1.Health"} <= names

    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in described.file_descriptor_response.file_descriptor_proto]
    services = {f"{f.package}.{s.name}": s for f in files for s in f.service}
    methods = {m.name for m in services["kvstore.v1.KVStore"].method}
    assert methods == {"Put", "Get", "Lookup", "Prefetch", "Reserve", "Release", "Evict",
                       "Pin", "Unpin", "Stats", "Hot", "Prewarm", "Drain", "Attach", "Limits",
                       "WatchEvents"}


def test_prometheus_metrics_count_what_the_clients_did(daemon: Daemon,
                                                       channel: grpc.Channel) -> None:
    before = scrape(daemon)
    assert metric(before, "kvstore_tier_capacity_bytes", tier="dram") == CAPACITY
    assert metric(before, "kvstore_tier_enabled", tier="dram") == 1

    with KVStoreClient(daemon.target, "metrics", shared_memory=False) as kv:
        kv.evict(all=True, namespace="")
        keys = [bytes([i]) * 32 for i in range(3)]
        for k, size in zip(keys, (10, 70_000, 3), strict=True):
            assert kv.put([k], [b"v" * size]).stored == 1
        assert kv.get([keys[0], keys[1], bytes([9]) * 32]) == [b"v" * 10, b"v" * 70_000, None]
    with pytest.raises(grpc.RpcError) as info:
        rpc.KVStoreStub(channel).Lookup(pb.LookupRequest(namespace="metrics", keys=[b"short"]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    after = scrape(daemon)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert metric(after, "kvstore_tier_capacity_bytes", tier="dram") == CAPACITY
    assert metric(after, "kvstore_tier_objects", tier="dram") == 3
    assert metric(after, "kvstore_tier_used_bytes", tier="dram") == 70_013
    assert delta("kvstore_tier_hits_total", tier="dram") == 2
    assert delta("kvstore_tier_misses_total", tier="dram") == 1
    assert delta("kvstore_tier_bytes_in_total", tier="dram") == 70_013
    assert delta("kvstore_tier_bytes_out_total", tier="dram") == 70_010
    assert delta("kvstore_rpc_latency_seconds_count", code="OK", method="Put") >= 3
    assert delta("kvstore_rpc_latency_seconds_count", code="OK", method="Get") >= 1
    assert delta("kvstore_rpc_latency_seconds_count", code="INVALID_ARGUMENT",
                 method="Lookup") == 1
    assert metric(after, "kvstore_metrics_stats_errors_total") == 0


def test_prefix_hits_are_counted_in_blocks_and_tokens(daemon: Daemon,
                                                       channel: grpc.Channel) -> None:
    # 4 keys of 16 tokens, the first 2 stored: half the tokens are a prefix hit. A Lookup
    # that does not say its block_tokens counts blocks only.
    keys = prefix_keys(list(range(64)), 16, "hits")
    before = scrape(daemon)
    with KVStoreClient(daemon.target, "hits", shared_memory=False) as kv:
        kv.put(keys[:2], [b"a" * 100, b"b" * 100])
        assert kv.lookup(keys, block_tokens=16).prefix_length == 2
        assert kv.lookup(keys[:3]).prefix_length == 2
        with pytest.raises(InvalidArgument, match="block_tokens"):
            kv.lookup(keys, block_tokens=-1)
    with pytest.raises(grpc.RpcError) as info:
        rpc.KVStoreStub(channel).Lookup(pb.LookupRequest(
            namespace="hits", keys=keys, block_tokens=1 << 20))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "block_tokens" in (info.value.details() or "")
    after = scrape(daemon)

    def delta(name: str) -> float:
        return metric(after, name, tenant="") - metric(before, name, tenant="")

    assert delta("kvstore_lookup_blocks_total") == 4 + 3
    assert delta("kvstore_prefix_hit_blocks_total") == 2 + 2
    assert delta("kvstore_lookup_tokens_total") == 64
    assert delta("kvstore_prefix_hit_tokens_total") == 32


def test_metrics_families_follow_the_conventions(daemon: Daemon) -> None:
    with KVStoreClient(daemon.target, "conventions", shared_memory=False) as kv:
        kv.put([b"c" * 32], [b"v" * 1000])
        kv.pin([b"c" * 32])
        url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        kv.unpin([b"c" * 32])
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert not [n for n in families if n.endswith("_created")]  # no stray families
    assert "_created" not in text
    [build] = families["kvstore_build_info"].samples
    assert build.name == "kvstore_build_info" and build.value == 1
    assert set(build.labels) == {"version", "python", "grpc"} and build.labels["version"]
    for name in ("kvstore_leases", "kvstore_reservations", "kvstore_reserved_bytes",
                 "kvstore_pins", "kvstore_pinned_bytes", "kvstore_serving"):
        assert families[name].type == "gauge", name
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}
    assert samples[("kvstore_pins", ())] >= 1
    assert samples[("kvstore_pinned_bytes", ())] >= 1000
    assert samples[("kvstore_serving", ())] == 1
    assert samples[("kvstore_tenant_capacity_bytes", (("tenant", ""), ("tier", "dram")))] \
        == CAPACITY
    assert samples[("kvstore_tenant_used_bytes", (("tenant", ""), ("tier", "dram")))] >= 1000
    for family in families.values():  # Prometheus naming: counters end in _total, units
        if family.type == "counter":
            assert all(s.name.endswith("_total") for s in family.samples), family.name
        assert family.name.startswith(("kvstore_", "process_")), family.name
        assert not family.name.endswith(("_ms", "_kb", "_mb", "_milliseconds")), family.name


def _http(port: int, path: str) -> tuple[int, str]:
    """The status and body of GET path on the metrics port (an HTTP error's too)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_metrics_port_serves_metrics_and_health_only(daemon: Daemon) -> None:
    """/metrics and /healthz answer (200, SERVING: the daemon is serving); every other path
    is 404, so a probe or a scraper with a wrong path is seen failing."""
    status, text = _http(daemon.metrics_port, "/metrics")
    assert status == 200 and "kvstore_serving 1.0" in text
    assert _http(daemon.metrics_port, "/healthz") == (200, "SERVING\n")
    for path in ("/", "/metricz", "/healthz/x", "/ready"):
        status, text = _http(daemon.metrics_port, path)
        assert status == 404 and "serves /metrics and /healthz" in text, path


def test_healthz_is_503_while_the_daemon_drains(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """A drain turns /healthz to 503 NOT_SERVING during server.drain_notice_s, while the
    daemon still answers: an HTTP probe sees the replica leave before it is gone."""
    d = daemon_factory("dram.capacity_bytes=4MiB", "server.grace_s=4",
                       "server.drain_notice_s=3")
    assert _http(d.metrics_port, "/healthz") == (200, "SERVING\n")
    with KVStoreClient(d.target, "drain", shared_memory=False) as kv:
        kv.drain()
    seen = _http(d.metrics_port, "/healthz")
    deadline = time.monotonic() + 2.0  # the notice is 3 s: the 503 comes within it
    while seen[0] == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
        seen = _http(d.metrics_port, "/healthz")
    assert seen == (503, "NOT_SERVING\n")
    assert d.stop() == 0, d.log()


def test_sigterm_removes_the_shared_memory_segment_and_exits_0(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory("dram.capacity_bytes=4MiB")
    kv = KVStoreClient(d.target, "sigterm", shared_memory=True)
    try:
        assert kv.put([b"k" * 32], [b"held by an attached client"]).stored == 1
        name = kv.stats().shm_name
        assert name
        assert (Path("/dev/shm") / name).exists()
        assert kv.uses_shared_memory is True  # this process has the segment mapped

        assert d.stop() == 0, d.log()  # Daemon.stop sends SIGTERM
        assert not (Path("/dev/shm") / name).exists()
        assert "shutting down" in d.log()
    finally:
        kv.close()


@pytest.mark.parametrize(("setting", "named", "says"), [
    ("dram.capacity_bytes=4XB", "dram.capacity_bytes", "'4XB'"),
    ("dram.page_size_bytes=3000", "dram.page_size_bytes", "power of two"),
    ("leases.lease_timeout_s=0", "leases.lease_timeout_s", "must be > 0"),
    ("dram.capacity_byte=1GiB", "dram.capacity_bytes", "did you mean"),  # a typo
])
def test_a_bad_config_value_exits_2_naming_the_setting(
        setting: str, named: str, says: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """kvstore-server's entry point, in this process: a value the config refuses ends it
    with 2 before it binds, maps or logs anything (the process itself: the test below)."""
    for name in [k for k in os.environ if k.startswith("KVSTORE_")]:
        monkeypatch.delenv(name)
    port = free_port()
    assert server.main(["--port", str(port), "--metrics-port", str(free_port()),
                        "--set", setting]) == 2
    out, err = capsys.readouterr()
    assert named in err and says in err
    assert "listening" not in out
    assert list(Path("/dev/shm").glob(f"kvstore-{port}-*")) == []


def test_a_bad_config_value_ends_the_process_with_2() -> None:
    port = free_port()
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.daemon.server", "--port", str(port),
         "--metrics-port", str(free_port()), "--set", "dram.capacity_bytes=4XB"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")},
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "dram.capacity_bytes" in done.stderr and "'4XB'" in done.stderr
    assert "listening" not in done.stdout
    assert list(Path("/dev/shm").glob(f"kvstore-{port}-*")) == []


@pytest.mark.parametrize("busy", [
    "grpc",
    "metrics",
])
def test_a_busy_port_exits_2_and_leaves_no_segment(busy: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy_port = taken.getsockname()[1]
        port = busy_port if busy == "grpc" else free_port()
        metrics_port = busy_port if busy == "metrics" else free_port()
        try:
            done = subprocess.run(
                [sys.executable, "-m", "kvstore.daemon.server", "--port", str(port),
                 "--metrics-port", str(metrics_port), "--set", "dram.capacity_bytes=4MiB",
                 "--set", "nvme.capacity_bytes=64MiB"],
                capture_output=True, text=True, timeout=60, cwd=REPO,
                env={k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")},
            )
            leaked = list(Path("/dev/shm").glob(f"kvstore-{port}-*"))
        finally:
            for path in Path("/dev/shm").glob(f"kvstore-{port}-*"):
                path.unlink()  # this test's daemon made it: the port is ours
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "cannot start" in done.stderr
    assert str(busy_port) in done.stderr or "in use" in done.stderr
    assert leaked == []
