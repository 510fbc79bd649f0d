"""What a bare `kvstore-server` leaves and says, on a real daemon: its start line names the
version, the auth mode, L2's and L3's sizes and places, and the Unix socket; a scratch L3
(nvme.dir unset) is removed when the daemon stops, and one a killed daemon left is removed
by the next daemon that starts, while a chosen nvme.dir is kept; with auth on and no
server.unix_socket, clients get shared memory through a socket at a default path. The
banner's and the default path's rules in process: `--version`, the /tmp fallback."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstore.client import KVStoreClient
from kvstore.daemon import server
from kvstore.daemon.config import load_config
from kvstore.tools.testing import Daemon, start_daemon

SMALL = ("dram.capacity_bytes=8MiB", "hbm.mode=off")
#: daemon_factory puts L3 in the test's folder; an empty nvme.dir (a later --set wins) asks
#: for the default scratch folder under $XDG_CACHE_HOME instead.
SCRATCH = (*SMALL, "nvme.dir=")
TOKEN = "bare-start-token-0123456789"


def start_line(daemon: Daemon) -> str:
    lines = [line for line in daemon.log().splitlines() if " listening on " in line
             and line.startswith("kvstore-server ")]
    assert len(lines) == 1, daemon.log()
    return lines[0]


def cache_env(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    cache = tmp_path / "cache"
    cache.mkdir()
    return cache, {"XDG_CACHE_HOME": str(cache)}


def test_a_bare_start_names_its_tiers_and_leaves_nothing_behind(
        daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    cache, env = cache_env(tmp_path)
    d = daemon_factory(*SCRATCH, env=env)
    folder = cache / "kvstore" / str(d.port)
    assert (folder / "l3.data").stat().st_size == 64 << 20  # it was made, preallocated
    line = start_line(d)
    version = importlib.metadata.version("kvstore")
    assert line.startswith(f"kvstore-server {version} listening on 127.0.0.1:{d.port} "
                           "(plaintext, auth off, "), line
    assert re.search(rf"L2 shm kvstore-{d.port}-\w+, 8\.0 MiB, ", line), line
    assert ", no unix socket, " in line, line
    assert f"L3 posix in {folder}, 64.0 MiB, 0 blocks re-adopted; scratch: removed at stop, " \
        "set nvme.dir to keep it)" in line, line
    assert d.stop() == 0, d.log()
    assert list(cache.iterdir()) == [], "the scratch L3 folder (and kvstore/) is removed"
    assert "removed the scratch L3 folder" in d.log()


def test_an_l3_in_a_chosen_folder_is_kept_after_the_stop(
        daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    d = daemon_factory(*SMALL, f"nvme.dir={tmp_path / 'mine'}")
    assert "scratch" not in start_line(d)
    assert d.stop() == 0, d.log()
    assert (tmp_path / "mine" / "l3.data").stat().st_size == 64 << 20
    assert (tmp_path / "mine" / "manifest.journal").exists()


def test_a_killed_daemons_scratch_l3_is_removed_by_the_next_start_not_a_live_ones(
        daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    """One port after another used to leave 4 GiB each; now the next start on any port
    removes what a daemon killed before its stop left, and nothing of a running one."""
    cache, env = cache_env(tmp_path)
    killed = daemon_factory(*SCRATCH, env=env)
    running = daemon_factory(*SCRATCH, env=env)
    killed.proc.send_signal(signal.SIGKILL)
    killed.proc.wait(timeout=10)
    left = cache / "kvstore" / str(killed.port)
    assert (left / "l3.data").exists()  # a kill leaves it: no stop ran
    stray = cache / "kvstore" / "7"  # a folder with no lock file: not a daemon's, kept
    stray.mkdir()
    (stray / "l3.data").write_bytes(b"x")
    third = daemon_factory(*SCRATCH, env=env)
    assert not left.exists(), third.log()
    assert f"removed the scratch L3 folder {left} (64.0 MiB) that a killed daemon left" \
        in third.log()
    assert (cache / "kvstore" / str(running.port) / "l3.data").exists()
    assert (stray / "l3.data").exists()
    assert running.proc.poll() is None
    assert running.stop() == 0 and third.stop() == 0
    assert sorted(p.name for p in (cache / "kvstore").iterdir()) == ["7"]


# --- auth on: a Unix socket at a default path, so shared memory works ---------------------


def tenants(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(json.dumps({"tenants": [{
        "name": "engine", "role": "admin", "namespaces": [""],
        "tokens_sha256": [hashlib.sha256(TOKEN.encode()).hexdigest()]}]}))
    return path


def test_with_auth_on_and_no_socket_set_shared_memory_works_through_a_default_socket(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon serves kvstore-<port>.sock in $XDG_RUNTIME_DIR; a client given only the
    target and its token moves blocks through shared memory, bit-exact; the socket goes at
    the stop. (Before, shared memory was silently off: uses_shared_memory was None.)"""
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("KVSTORE_TOKEN", TOKEN)
    d = start_daemon(tmp_path, *SMALL, "nvme.enabled=false", "auth.mode=token",
                     f"auth.tenants_file={tenants(tmp_path)}",
                     env={"XDG_RUNTIME_DIR": str(runtime)})
    try:
        socket_path = runtime / f"kvstore-{d.port}.sock"
        assert "auth token, " in start_line(d)
        assert f", unix socket {socket_path}, " in start_line(d)
        with KVStoreClient(d.target, "bare/default-socket") as kv:
            keys, values = [os.urandom(32) for _ in range(3)], [os.urandom(70_000)] * 3
            kv.put(keys, values)
            assert kv.get(keys) == values
            assert kv.uses_shared_memory is True
            assert kv.stats().unix_socket == str(socket_path)
    finally:
        assert d.stop() == 0, d.log()
    assert not socket_path.exists()


def test_unix_socket_off_keeps_the_socket_off_with_auth_on(
        daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    d = daemon_factory(*SMALL, "nvme.enabled=false", "auth.mode=token",
                       f"auth.tenants_file={tenants(tmp_path)}", "server.unix_socket=off",
                       env={"XDG_RUNTIME_DIR": str(runtime)})
    assert ", no unix socket, " in start_line(d)
    assert list(runtime.iterdir()) == []


def test_the_default_socket_falls_back_to_a_folder_of_this_users_own_in_tmp(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    port = 40000 + os.getpid() % 20000
    path = Path(server.default_socket_path(port))
    assert path == Path("/tmp") / f"kvstore-{os.getuid()}" / f"kvstore-{port}.sock"
    st = path.parent.lstat()
    assert st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o700


def test_a_default_socket_folder_others_can_write_is_refused_with_the_fix(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """/tmp is everyone's: a folder another user could have made (or opened up) is never
    served in; the daemon warns, naming server.unix_socket, and serves inline."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    # A /tmp of the test's own: the host's /tmp/kvstore-<uid> serves other tests' daemons.
    monkeypatch.setattr(server, "SOCKET_FALLBACK_ROOT", tmp_path)
    folder = tmp_path / f"kvstore-{os.getuid()}"
    folder.mkdir(mode=0o700)
    assert server.default_socket_path(50051) == str(folder / "kvstore-50051.sock")
    folder.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="kvstore.daemon.server"):
        assert server.default_socket_path(50051) == ""
    assert f"no Unix socket ({folder} is not a folder of this user's alone)" in caplog.text
    assert "set server.unix_socket to a path" in caplog.text


def test_auth_off_or_l2_off_asks_for_no_default_socket() -> None:
    off = load_config(env={})
    assert server.resolved(off, 50051).server.unix_socket == ""
    no_l2 = load_config(env={}, overrides=["auth.mode=token", "auth.tenants_file=t.yaml",
                                           "dram.enabled=false", "nvme.enabled=false"])
    assert server.resolved(no_l2, 50051).server.unix_socket == ""


def test_port_0_names_per_port_things_after_the_port_it_got() -> None:
    cfg = server.resolved(load_config(env={}, overrides=["server.port=0"]), 41234)
    assert cfg.server.port == 41234


# --- --version ------------------------------------------------------------------------------


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        server.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == \
        f"kvstore-server {importlib.metadata.version('kvstore')}\n"
