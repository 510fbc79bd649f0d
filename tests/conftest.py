"""Shared fixtures: a real kvstore-server subprocess and a real redis-server, each on a free
port; GPU tests skip cleanly without CUDA."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]


def _cuda_available() -> bool:
    try:
        import cupy  # type: ignore[import-not-found]

        return bool(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no cupy, no driver, no device: all mean "no GPU here"
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (cupy + driver)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Daemon:
    """A running kvstore-server subprocess."""

    proc: subprocess.Popen[str]
    port: int
    metrics_port: int
    log_path: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def wait_serving(target: str, proc: subprocess.Popen[str], log_path: Path,
                 timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    # A refused first connection would put a shared channel into gRPC's reconnect backoff
    # (1 s, then longer); a short backoff makes the check answer as soon as the daemon does.
    options = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 200)]
    with grpc.insecure_channel(target, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"kvstore-server exited with {proc.returncode}:\n"
                                   f"{log_path.read_text()}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0,
                                   wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.05)
    raise RuntimeError(f"kvstore-server not SERVING after {timeout_s}s:\n{log_path.read_text()}")


def start_daemon(tmp_path: Path, *settings: str, env: dict[str, str] | None = None) -> Daemon:
    """Start `kvstore-server` with `--set` settings (e.g. "dram.capacity_bytes=8MiB")."""
    port, metrics_port = free_port(), free_port()
    log_path = tmp_path / f"kvstore-server-{port}.log"
    args = [sys.executable, "-m", "kvstore.server", "--port", str(port),
            "--metrics-port", str(metrics_port)]
    for setting in settings:
        args += ["--set", setting]
    log = log_path.open("w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    daemon = Daemon(proc, port, metrics_port, log_path)
    try:
        wait_serving(daemon.target, proc, log_path)
    except Exception:
        daemon.stop()
        raise
    return daemon


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []

    def make(*settings: str, env: dict[str, str] | None = None) -> Daemon:
        d = start_daemon(tmp_path, *settings, env=env)
        started.append(d)
        return d

    yield make
    for d in started:
        d.stop()


@pytest.fixture
def daemon(daemon_factory: Callable[..., Daemon]) -> Daemon:
    """A daemon with a small (32 MiB) L2 and 64 KiB pages."""
    return daemon_factory("dram.capacity_bytes=32MiB", "dram.page_size_bytes=64KiB")


@dataclass
class RedisServer:
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server on a free port (installed by `make test`)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed; `make test` installs it")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("redis-server did not start")
    yield RedisServer(proc, port)
    proc.terminate()
    proc.wait(10)
