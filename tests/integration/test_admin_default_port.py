"""A target without a port means the daemon's port 50051, not gRPC's 443: `kvstore-admin
--target HOST` and KVSTORE_TARGET=HOST, both clients, dns:///HOST, and StoreLink (what
`kvstore-engine --store HOST` and the vLLM connector open) reach a real daemon listening on
HOST:50051. HOST is a random loopback address (all of 127/8 is loopback on Linux), so port
50051 is free there whatever else runs on 127.0.0.1:50051."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client import AsyncKVStoreClient, KVStoreClient
from kvstore.integrations.link import StoreLink
from kvstore.tools.testing import free_port, stop_process, wait_serving
from tests.conftest import REPO
from tests.integration.test_admin_cli import failed, ok

NS = "default-port"


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A loopback address with a daemon on its port 50051."""
    workdir = tmp_path_factory.mktemp("default-port")
    address = f"127.{random.randrange(1, 255)}.{random.randrange(256)}.{random.randrange(1, 255)}"
    log_path = workdir / "kvstore-server.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.daemon.server", "--host", address, "--port", "50051",
             "--metrics-port", str(free_port()), "--set", "dram.capacity_bytes=8MiB",
             "--set", "nvme.enabled=false", "--set", "hbm.mode=off",
             "--set", "server.drain_notice_s=0"],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_serving(f"{address}:50051", proc, log_path)
        yield address
    finally:
        assert stop_process(proc) == 0, Path(log_path).read_text()


def run_admin(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.run([sys.executable, "-m", "kvstore.tools.admin", *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**clean, **(env or {})})


def test_admin_without_a_port_reaches_port_50051(host: str) -> None:
    assert ok(run_admin("--target", host, "health")).strip() == "SERVING"
    shown = ok(run_admin("stats", env={"KVSTORE_TARGET": host}))
    assert f"at {host}:50051" in shown  # the table's title names the address dialled
    line = failed(run_admin("--target", f"{host}:http", "health"), 2)
    assert f"target '{host}:http': port 'http' is not a number" in line


def test_both_clients_and_the_engine_link_reach_port_50051(host: str) -> None:
    key = bytes(range(32))
    for target in (host, f"dns:///{host}"):
        with KVStoreClient(target, NS, shared_memory=False) as kv:
            assert kv.target.endswith(f"{host}:50051")
            kv.put([key], [b"over the default port"])
            assert kv.get([key]) == [b"over the default port"]

    async def read() -> list[bytes | None]:
        async with AsyncKVStoreClient(host, NS, shared_memory=False) as akv:
            assert akv.target == f"{host}:50051"
            return await akv.get([key])
    assert asyncio.run(read()) == [b"over the default port"]

    link = StoreLink(host, NS, block_size=16)
    try:
        assert link.client.target == f"{host}:50051"
        assert link.lookup([key]).blocks == 1  # found: the link talks to this daemon
    finally:
        link.close()
