"""Real processes for tests, benchmarks and the demo: a `kvstore-server` and a `redis-server`,
each on a free loopback port, started, waited for and stopped. No mocks: what runs is what
ships.

Used by tests/conftest.py, bench/ and kvstore/demo.py; not imported by the daemon or the client.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> int:
    """SIGTERM, then SIGKILL after timeout_s; the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


@dataclass
class Daemon:
    """A running kvstore-server subprocess."""

    proc: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    log_path: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, timeout_s: float = 10.0) -> int:
        return stop_process(self.proc, timeout_s)


def wait_serving(target: str, proc: subprocess.Popen[bytes], log_path: Path | None = None,
                 timeout_s: float = 30.0) -> None:
    """Return once the daemon's health says SERVING; raise (with its log, when it writes one)
    if it exits first or never gets there."""
    def log() -> str:
        return log_path.read_text() if log_path is not None else "(its output is above)"

    deadline = time.monotonic() + timeout_s
    # A refused first connection would put a shared channel into gRPC's reconnect backoff
    # (1 s, then longer); a short backoff makes the check answer as soon as the daemon does.
    options = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 200)]
    with grpc.insecure_channel(target, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"kvstore-server exited with {proc.returncode}:\n{log()}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0,
                                   wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.05)
    raise RuntimeError(f"kvstore-server not SERVING after {timeout_s}s:\n{log()}")


def start_daemon(workdir: Path, *settings: str, env: dict[str, str] | None = None) -> Daemon:
    """Start `kvstore-server` with `--set` settings (e.g. "dram.capacity_bytes=8MiB") and wait
    until it is SERVING. Its output goes to a log file in workdir."""
    port, metrics_port = free_port(), free_port()
    log_path = workdir / f"kvstore-server-{port}.log"
    args = [sys.executable, "-m", "kvstore.server", "--port", str(port),
            "--metrics-port", str(metrics_port)]
    # L3 lives in workdir and is small unless settings say otherwise (later --set wins).
    defaults = (f"nvme.dir={workdir / f'l3-{port}'}", "nvme.capacity_bytes=64MiB")
    for setting in (*defaults, *settings):
        args += ["--set", setting]
    with log_path.open("w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
    daemon = Daemon(proc, port, metrics_port, log_path)
    try:
        wait_serving(daemon.target, proc, log_path)
    except Exception:
        daemon.stop()
        raise
    return daemon


@dataclass
class RedisServer:
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> int:
        return stop_process(self.proc)


def start_redis(workdir: Path, timeout_s: float = 10.0) -> RedisServer:
    """A real redis-server without persistence on a free port, accepting connections."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (`make redis` installs it)")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return RedisServer(proc, port)
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    stop_process(proc)
    raise RuntimeError(f"redis-server did not start on port {port}")
