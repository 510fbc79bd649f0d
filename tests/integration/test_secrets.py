"""Secrets stay out of what a real daemon shows operators: its L4 URL carries a password in the
`user:password@` part and another in the query string, remote.password a third (from
KVSTORE_REMOTE_PASSWORD); none of them is in `Stats(include_config)` or `kvstore-admin config`.
The URL names a port on 127.0.0.1 nothing listens on: L4 is down, the daemon serves anyway."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvstore.client import KVStoreClient
from kvstore.tools.testing import Daemon, free_port, start_daemon
from tests.conftest import REPO

USER_PW, QUERY_PW, ENV_PW = (f"{name}-{secrets.token_hex(8)}" for name in ("user", "query", "env"))
SECRETS = (USER_PW, QUERY_PW, ENV_PW)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, str]]:
    """The daemon, and the URL it must show: remote.url with its two passwords as ***."""
    port = free_port()  # no Redis there
    url = f"redis://ops:{{}}@127.0.0.1:{port}/0?password={{}}&health_check_interval=0"
    d = start_daemon(tmp_path_factory.mktemp("secrets"), "dram.capacity_bytes=8MiB",
                     "dram.page_size_bytes=64KiB", "hbm.mode=off",
                     f"remote.url={url.format(USER_PW, QUERY_PW)}", "remote.timeout_s=1",
                     "remote.breaker_backoff_s=0.2", env={"KVSTORE_REMOTE_PASSWORD": ENV_PW})
    yield d, url.format("***", "***")
    assert d.stop() == 0, d.log()


def test_stats_include_config_hides_every_secret(daemon: tuple[Daemon, str]) -> None:
    d, shown_url = daemon
    with KVStoreClient(d.target, "secrets-ns", shared_memory=False) as kv:
        assert kv.health() == "SERVING"
        config_json = kv.stats(include_config=True).config_json
    assert [s for s in SECRETS if s in config_json] == []
    remote = json.loads(config_json)["remote"]
    assert (remote["url"], remote["password"]) == (shown_url, "***")


def test_admin_config_hides_every_secret(daemon: tuple[Daemon, str]) -> None:
    d, shown_url = daemon
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    for extra in ([], ["--json"]):
        done = subprocess.run(
            [sys.executable, "-m", "kvstore.tools.admin", "--target", d.target, "config",
             *extra], capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        assert [s for s in SECRETS if s in done.stdout + done.stderr] == []
        assert f'"url": "{shown_url}"' in done.stdout
