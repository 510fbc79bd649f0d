"""Start-up order and start-up errors of a real `kvstore-server`: it binds the gRPC port, then
the metrics port, and only then opens the store (shared memory, the L3 file, Redis). A taken
port stops the start at once with one line naming server.port (or metrics.port), no grpc
C-core log line on stderr, and nothing left behind: no segment in /dev/shm, no L3 folder or
file, no Unix socket file. A store that fails to open frees both ports again. A broken config
file names its line; a wrong setting is named, not the one it conflicts with. Health and
kvstore_serving agree. The config rules themselves are tests/unit/test_config.py."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvstore.core.errors import StartupError
from kvstore.daemon import server
from kvstore.daemon.config import load_config
from kvstore.daemon.server import serve
from kvstore.tools.testing import TEST_L3_RESERVE, Daemon, free_port
from tests.conftest import REPO
from tests.helpers import MiB, metric, scrape

SHM = Path("/dev/shm")
SMALL = ("dram.capacity_bytes=8MiB", "nvme.capacity_bytes=64MiB", "hbm.mode=off",
         "server.drain_notice_s=0", f"nvme.reserve_bytes={TEST_L3_RESERVE}")
C_CORE_LOG = re.compile(r"^[EWI]\d{4} .*\.cc:\d+\]", re.M)  # grpc's own log line


def run_server(*args: str, env: dict[str, str] | None = None,
               timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """kvstore-server run to its end (a start that fails), without the caller's KVSTORE_*."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.run([sys.executable, "-m", "kvstore.daemon.server", *args],
                          capture_output=True, text=True, timeout=timeout_s, cwd=REPO,
                          env={**clean, **(env or {})})


@contextmanager
def held_port(port: int = 0) -> Iterator[int]:
    """A loopback port something else listens on, as a plain socket holds it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        yield int(taken.getsockname()[1])


def segments(port: int) -> list[Path]:
    """L2 segments a daemon on port made under its default name (kvstore-<port>-<random>)."""
    return sorted(SHM.glob(f"kvstore-{port}-*"))


def start_fails(port: int, metrics_port: int, workdir: Path, *settings: str,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A start on these ports with L3 and a Unix socket in workdir; asserts it failed fast and
    left nothing behind, and returns it. Segments it leaked are removed (after the checks)."""
    args = ["--port", str(port), "--metrics-port", str(metrics_port)]
    for setting in (*SMALL, f"nvme.dir={workdir / 'l3'}",
                    f"server.unix_socket={workdir / 'kv.sock'}", *settings):
        args += ["--set", setting]
    began = time.monotonic()
    done = run_server(*args, env=env)
    took_s = time.monotonic() - began
    leaked = segments(port)
    for path in leaked:
        path.unlink()  # this test's daemon made it: the port is ours
    assert done.returncode == 2, done.stdout + done.stderr
    assert "listening on" not in done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    assert not C_CORE_LOG.search(done.stderr), done.stderr
    assert "add_port.cc" not in done.stderr
    assert leaked == []
    assert sorted(p.name for p in workdir.iterdir()) == [], "no L3 folder, no socket file"
    assert took_s < 30, f"took {took_s:.1f}s: it did not fail fast"
    return done


def error_line(done: subprocess.CompletedProcess[str]) -> str:
    """The one line the daemon printed about why it cannot start."""
    lines = [line for line in done.stderr.splitlines() if "cannot start" in line]
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    folder = tmp_path / "daemon"
    folder.mkdir()
    return folder


# --- a port that is taken ---------------------------------------------------------------


def test_a_busy_grpc_port_names_server_port_and_makes_nothing(workdir: Path) -> None:
    with held_port() as port:
        done = start_fails(port, free_port(), workdir)
    assert error_line(done) == (
        f"kvstore-server: cannot start: server.port {port}: cannot listen on 127.0.0.1:{port}: "
        "Address already in use (another process listens there); stop it or choose another "
        "port (--port, or 0 for any free port)")


def test_a_busy_metrics_port_names_metrics_port_and_makes_nothing(workdir: Path) -> None:
    with held_port() as metrics_port:
        done = start_fails(free_port(), metrics_port, workdir)
    line = error_line(done)
    assert line.startswith(f"kvstore-server: cannot start: metrics.port {metrics_port}: "
                           f"cannot serve metrics on 127.0.0.1:{metrics_port}: "), line
    assert "Address already in use" in line and "--metrics-port" in line
    assert "server.port" not in line


def test_both_ports_busy_names_the_grpc_port(workdir: Path) -> None:
    with held_port() as port, held_port() as metrics_port:
        done = start_fails(port, metrics_port, workdir)
    line = error_line(done)
    assert f"server.port {port}: cannot listen" in line
    assert "metrics" not in line


def test_a_second_daemon_with_the_same_settings_names_the_port_not_the_l3_folder(
        daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    """The operator's case: the default ports (and so the default per-port L3 folder) are
    taken by a daemon already running. The message is about the port, and the running
    daemon's L3 folder is not touched."""
    first = daemon_factory(*SMALL)
    l3 = tmp_path / f"l3-{first.port}"  # kvstore.tools.testing's folder for that port
    before = {p.name: p.stat().st_mtime_ns for p in l3.iterdir()}
    first_segments = segments(first.port)
    done = run_server("--port", str(first.port), "--metrics-port", str(first.metrics_port),
                      *(a for s in (*SMALL, f"nvme.dir={l3}") for a in ("--set", s)))
    assert done.returncode == 2, done.stderr
    line = error_line(done)
    assert f"server.port {first.port}" in line
    assert "L3 folder" not in done.stderr and "metrics.port" not in done.stderr
    assert not C_CORE_LOG.search(done.stderr), done.stderr
    assert segments(first.port) == first_segments  # the first daemon's own, no other
    assert {p.name: p.stat().st_mtime_ns for p in l3.iterdir()} == before
    assert first.proc.poll() is None  # still serving


def test_an_address_not_of_this_host_names_server_host(workdir: Path) -> None:
    done = start_fails(free_port(), free_port(), workdir, "server.host=192.0.2.1")  # TEST-NET-1
    assert "cannot start: server.host '192.0.2.1': cannot listen on 192.0.2.1:" in \
        error_line(done)


def test_a_default_l3_folder_is_not_made_when_the_port_is_busy(tmp_path: Path) -> None:
    """No nvme.dir: L3 would live in $XDG_CACHE_HOME/kvstore/<port>; nothing appears there."""
    cache = tmp_path / "cache"
    cache.mkdir()
    with held_port() as port:
        done = run_server("--port", str(port), "--metrics-port", str(free_port()),
                          *(a for s in SMALL for a in ("--set", s)),
                          env={"XDG_CACHE_HOME": str(cache)})
    leaked = segments(port)
    assert done.returncode == 2 and f"server.port {port}" in done.stderr, done.stderr
    assert list(cache.iterdir()) == []
    assert leaked == []


# --- a store that fails to open frees the ports -----------------------------------------


def can_bind(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
            probe.listen()
        except OSError:
            return False
    return True


def test_a_store_that_cannot_open_frees_both_ports_and_its_segment(tmp_path: Path) -> None:
    """In this process, so the ports can be checked after serve() gives up: grpc keeps the
    port of a server that never started until it is started and stopped."""
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    port, metrics_port = free_port(), free_port()
    shm_name = f"kvstore-test-startup-{os.getpid()}-{port}"
    config = load_config(env={}, overrides=[
        f"server.port={port}", f"metrics.port={metrics_port}", f"dram.shm_name={shm_name}",
        f"nvme.dir={not_a_folder}", *SMALL])
    with pytest.raises(StartupError, match=r"cannot use the L3 folder .*\(nvme\.dir\)"):
        serve(config, threading.Event())
    assert can_bind(port), "the gRPC port is still held"
    assert can_bind(metrics_port), "the metrics port is still held"
    assert not (SHM / shm_name).exists()


def test_a_busy_metrics_port_frees_the_grpc_port_in_process(tmp_path: Path) -> None:
    port = free_port()
    with held_port() as metrics_port:
        config = load_config(env={}, overrides=[
            f"server.port={port}", f"metrics.port={metrics_port}",
            f"nvme.dir={tmp_path / 'l3'}", *SMALL])
        with pytest.raises(StartupError, match=rf"^metrics\.port {metrics_port}: "):
            serve(config, threading.Event())
    assert can_bind(port)
    assert not (tmp_path / "l3").exists()


# --- the config: the setting that is wrong, the line that is broken ---------------------
# A config the daemon refuses ends its start before it binds, maps or logs anything, so these
# run kvstore-server's entry point in this process; test_endpoints.py runs the process once
# for its exit status.


@pytest.fixture
def refused(capsys: pytest.CaptureFixture[str],
            monkeypatch: pytest.MonkeyPatch) -> Callable[..., str]:
    """refused(*args): what kvstore-server's main says on stderr as it refuses its config
    (it must return 2), without the caller's KVSTORE_* variables."""
    for name in [k for k in os.environ if k.startswith("KVSTORE_")]:
        monkeypatch.delenv(name)

    def run(*args: str) -> str:
        capsys.readouterr()
        assert server.main(list(args)) == 2
        return capsys.readouterr().err

    return run


def test_broken_yaml_names_the_file_and_the_line(tmp_path: Path,
                                                refused: Callable[..., str]) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("server:\n  port: 6000\ndram:\n  capacity_bytes: [1GiB\n"
                    "  page_size_bytes: 64KiB\n")
    assert refused("--config", str(path)).strip() == (
        f"kvstore-server: config file {path} line 5 column 18: not valid YAML: expected ',' "
        "or ']', but got ':' (while parsing a flow sequence at line 4 column 19)")


def test_a_bad_value_in_the_file_names_its_line(tmp_path: Path,
                                               refused: Callable[..., str]) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("movers:\n  low_watermark: 0.5\n  high_watermark: 1.5\n")
    assert refused("--config", str(path)).strip() == (
        f"kvstore-server: movers.high_watermark = 1.5 (from {path} line 3): must be in (0, 1]: "
        "a share of the tier's capacity; use e.g. 0.9")


@pytest.mark.parametrize(("setting", "blamed"), [
    ("movers.high_watermark=1.5", "movers.high_watermark = '1.5' (from --set): must be in (0, 1]"),
    ("movers.high_watermark=0.6",
     "movers.high_watermark = '0.6' (from --set): must be above movers.low_watermark (0.75)"),
    ("movers.low_watermark=0.95",
     "movers.low_watermark = '0.95' (from --set): must be below movers.high_watermark (0.9)"),
    ("server.chunk_bytes=8MiB",
     "server.chunk_bytes = '8MiB' (from --set): must be <= server.max_message_bytes"),
    ("server.grace_s=0.5",
     "server.grace_s = '0.5' (from --set): must be at least server.drain_notice_s (1)"),
    ("dram.page_size_bytes=2GiB",
     "dram.page_size_bytes = '2GiB' (from --set): must be <= dram.capacity_bytes (1.0 GiB)"),
])
def test_a_wrong_setting_is_named_not_the_one_it_conflicts_with(
        setting: str, blamed: str, refused: Callable[..., str]) -> None:
    err = refused("--port", str(free_port()), "--set", setting)
    assert err.startswith(f"kvstore-server: {blamed}"), err
    assert len(err.strip().splitlines()) == 1, err


# --- health and kvstore_serving ---------------------------------------------------------


def serving_gauge(daemon: Daemon) -> float:
    samples = scrape(daemon)
    assert ("kvstore_serving", ()) in samples, samples
    assert metric(samples, "kvstore_tier_capacity_bytes", tier="dram") == 8 * MiB
    return samples[("kvstore_serving", ())]


def test_kvstore_serving_follows_health_through_the_drain(
        daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory(*SMALL, "server.drain_notice_s=2", "server.grace_s=4")
    assert serving_gauge(d) == 1  # start_daemon waited for health SERVING
    d.proc.terminate()
    time.sleep(0.5)  # inside the drain notice: health NOT_SERVING, the exporter still up
    assert serving_gauge(d) == 0
    assert d.proc.wait(timeout=10) == 0, d.log()


def test_an_ambiguous_size_is_refused_naming_both_spellings(
        refused: Callable[..., str]) -> None:
    """Redis reads 256mb as 256 MiB; kvstore's MB is 10^6: the start is refused, not guessed."""
    err = refused("--port", str(free_port()), "--dram-capacity", "256mb")
    assert err == (
        "kvstore-server: dram.capacity_bytes = '256mb' (from --dram-capacity): '256mb' is "
        "ambiguous: write 256MB (decimal, 10^6 bytes a MB) or 256MiB (binary, 2^20: what "
        "Redis reads 'mb' as)\n")


def test_a_size_limit_in_a_refusal_is_a_size_not_a_byte_count(
        refused: Callable[..., str]) -> None:
    err = refused("--port", str(free_port()), "--set", "server.max_message_bytes=4MiB")
    assert "+ 64KiB = 4.1 MiB (4160KiB); raise it" in err, err
    assert not re.search(r"\b\d{5,}\b", err), err
