"""`kvstore-admin hot` and `prewarm` against a real daemon with a real Redis (L4), on a pipe
(and prewarm's bar on a terminal): whole keys that paste into `lookup`, sizes in one family
of units, and with Redis down a
one-line `error: UNAVAILABLE: ...` and exit code 1 (the daemon is up; it could not do it)."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client import KVStoreClient
from kvstore.tools.testing import Daemon, RedisServer, start_daemon, start_redis
from tests.helpers import wait_until
from tests.integration.test_admin_cli import admin, admin_all, failed, ok
from tests.integration.test_admin_watch import Terminal

PAGE = 64 << 10
NS = "admin-l4"
LOCAL = ("dram.capacity_bytes=16MiB", "dram.page_size_bytes=64KiB", "hbm.mode=off",
         "nvme.enabled=false")


def l4(url: str) -> tuple[str, ...]:
    return (*LOCAL, f"remote.url={url}", "remote.breaker_backoff_s=0.2", "remote.timeout_s=1",
            "remote.popularity_flush_s=0.1")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory,
           redis_server: RedisServer) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("admin-l4"), *l4(redis_server.url))
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def hot_keys(daemon: Daemon) -> list[bytes]:
    """Four blocks in L4, read so that they are the namespace's hottest, hottest first."""
    keys = [secrets.token_bytes(32) for _ in range(4)]
    with KVStoreClient(daemon.target, NS, shared_memory=False) as kv:
        kv.put(keys, [bytes([i]) * PAGE for i in range(4)], independent=True)
        for reads, key in zip((4, 3, 2, 1), keys, strict=True):
            for _ in range(reads):
                kv.get([key])
        wait_until(lambda: kv.hot(10).keys == keys, "the four reads ranked in Redis",
                   timeout_s=15, pause_s=0.05)
    return keys


def test_hot_shows_whole_keys_that_lookup_and_pin_take(daemon: Daemon,
                                                       hot_keys: list[bytes]) -> None:
    table, as_json = admin_all((daemon.target, "--namespace", NS, "hot"),
                               (daemon.target, "hot", "--namespace", NS, "--json"))
    shown = re.findall(r"\b[0-9a-f]{64}\b", ok(table))
    assert shown == [k.hex() for k in hot_keys], ok(table)
    assert "…" not in ok(table)
    assert [row["key"] for row in json.loads(ok(as_json))["keys"]] == shown
    pasted = json.loads(ok(admin(daemon.target, "--namespace", NS, "--json", "lookup", *shown)))
    assert [row["tier"] for row in pasted["keys"]] == ["dram"] * 4
    assert ok(admin(daemon.target, "--namespace", NS, "pin", shown[0])).strip() == (
        "pinned 1; missing 0")
    with KVStoreClient(daemon.target, NS, shared_memory=False) as kv:
        assert kv.unpin([hot_keys[0]]).changed == 1


def test_stats_shows_a_redis_without_maxmemory_as_unlimited(daemon: Daemon) -> None:
    """L4's capacity is Redis's maxmemory; this Redis has none (its default), which is no
    limit: the table says "unlimited" (before: "0 B", as if L4 had no room), and --json keeps
    the daemon's 0."""
    table, as_json = admin_all((daemon.target, "stats"), (daemon.target, "stats", "--json"))
    tiers = ok(table).split("movement and health")[0]
    (row,) = [[c.strip() for c in line.split("│")] for line in tiers.splitlines()
              if " remote " in line]
    assert row[4:7] == ["unlimited", row[5], "-"], row  # capacity, used, used%
    assert "0 B" not in row
    (dram,) = [line for line in tiers.splitlines() if " dram " in line]
    assert "16.0 MiB" in dram  # a tier with a capacity still shows it
    (remote,) = [t for t in json.loads(ok(as_json))["tiers"] if t["tier"] == "remote"]
    assert remote["enabled"] and remote["capacity_bytes"] == 0


def test_prewarm_reports_binary_units_only(daemon: Daemon, hot_keys: list[bytes]) -> None:
    with KVStoreClient(daemon.target, NS, shared_memory=False) as kv:
        assert kv.evict(hot_keys).evicted == 4
        assert kv.lookup(hot_keys).tiers == ["remote"] * 4
        out = ok(admin(daemon.target, "prewarm", "--bytes", "4MiB", "--namespaces", NS))
        assert out.strip() == f"prewarmed 4 blocks (256.0 KiB of a 4.0 MiB target) from {NS!r}"
        assert not re.search(r"\d ?[kMG]B\b", out)  # no decimal units beside the binary ones
        assert kv.lookup(hot_keys).tiers == ["dram"] * 4

        assert kv.evict(hot_keys).evicted == 4  # again, on a terminal: the bar too
        term = Terminal("--target", daemon.target, "prewarm", "--bytes", "4MiB")
        assert term.finish() == 0, term.text
        assert "256.0 KiB of 4.0 MiB" in term.text and "━" in term.text  # the bar, drawn
        assert not re.search(r"\d ?[kMG]B\b", term.text), term.text
        assert term.text.strip().endswith("prewarmed 4 blocks (256.0 KiB of a 4.0 MiB target) "
                                          "from every namespace")


def test_with_redis_down_hot_and_prewarm_fail_in_one_line_exit_1(tmp_path: Path) -> None:
    """The daemon is up and answers UNAVAILABLE: a "could not", exit 1, not 2 (unreachable);
    before, hot printed an empty table and prewarm "prewarmed 0 blocks", both exit 0."""
    server = start_redis(tmp_path)
    d = start_daemon(tmp_path, *l4(server.url))
    try:
        with KVStoreClient(d.target, NS, shared_memory=False) as kv:
            kv.put([secrets.token_bytes(32)], [b"x" * PAGE])
            server.stop()
            done = admin_all((d.target, "--namespace", NS, "hot"),
                             (d.target, "prewarm", "--bytes", "1MiB"),
                             (d.target, "--json", "prewarm", "--namespaces", NS))
            for run in done[:2]:
                line = failed(run, 1)
                assert line.startswith("error: UNAVAILABLE: ") and "L4 is down" in line, line
                assert "unreachable" not in line and run.stdout == ""
            assert done[2].returncode == 1 and done[2].stdout == ""  # --json: the same, as JSON
            error = json.loads(done[2].stderr)
            assert (error["code"], error["exit_code"]) == ("UNAVAILABLE", 1)
            assert "L4 is down" in error["message"] and "unreachable" not in error["message"]
            assert kv.health() == "SERVING"  # the local tiers still serve
    finally:
        server.stop()
        assert d.stop() == 0, d.log()
