"""`kvstore-admin` run as a subprocess against a real daemon: what each command prints, what it
changes, and its exit codes (0 ok, 1 a failed request, 2 unreachable or a bad command line)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from kvstore.client import KVStoreClient, prefix_keys
from kvstore.tools.testing import Daemon, free_port, start_daemon
from tests.conftest import REPO

CAPACITY = 8 << 20
PAGE = 64 << 10
NS = "admin-ns"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("admin"), f"dram.capacity_bytes={CAPACITY}",
                     "dram.page_size_bytes=64KiB")
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture
def kv(daemon: Daemon) -> Iterator[KVStoreClient]:
    with KVStoreClient(daemon.target, NS, shared_memory=False) as client:
        client.evict(all=True, namespace="")
        yield client


def admin(target: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.run([sys.executable, "-m", "kvstore.tools.admin", "--target", target, *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=env)


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def blocks(n: int, size: int = PAGE) -> tuple[list[bytes], list[bytes]]:
    keys = [bytes([i + 1]) * 32 for i in range(n)]
    return keys, [bytes([i]) * size for i in range(n)]


def test_stats_table_and_json_match_the_client(daemon: Daemon, kv: KVStoreClient) -> None:
    keys, values = blocks(3)
    kv.put(keys, values, independent=True)
    kv.get(keys[:2])

    table = ok(admin(daemon.target, "stats"))
    tiers_table, movement_table = table.split("movement and health")
    (dram_row,) = [line for line in tiers_table.splitlines() if " dram " in line]
    assert "8.0 MiB" in dram_row  # capacity
    assert "192.0 KiB" in dram_row  # used: three 64 KiB blocks
    assert "yes" in dram_row
    assert "leases" in table and "pinned" in table
    assert "backend" in tiers_table.splitlines()[2]  # header, under the title and the rule
    movement_rows = [line.split()[1] for line in movement_table.splitlines() if "│" in line]
    assert "dram" in movement_rows
    assert movement_rows == [t.tier for t in kv.stats().tiers if t.enabled]  # only enabled

    printed = json.loads(ok(admin(daemon.target, "stats", "--json")))
    expected = kv.stats()
    assert printed == expected.to_dict()
    (dram,) = [t for t in printed["tiers"] if t["tier"] == "dram"]
    assert dram["capacity_bytes"] == CAPACITY
    assert (dram["objects"], dram["used_bytes"]) == (3, 3 * PAGE)
    assert dram["free_pages"] == CAPACITY // PAGE - 3


def test_stats_names_each_tier_backend(daemon: Daemon, kv: KVStoreClient) -> None:
    """An operator sees how each tier moves bytes: dram is the shared-memory segment, every
    enabled tier names a known backend, a tier that is off has none ("-" in the table)."""
    printed = json.loads(ok(admin(daemon.target, "stats", "--json")))
    backends = {t["tier"]: t["backend"] if t["enabled"] else None for t in printed["tiers"]}
    assert backends["dram"] == "shm"
    known = {"shm", "cuda", "gds", "kvikio-compat", "posix"}
    assert all(b in known for b in backends.values() if b is not None), backends
    assert all(t["backend"] == "" for t in printed["tiers"] if not t["enabled"])

    table = ok(admin(daemon.target, "stats")).split("movement and health")[0]
    for tier, backend in backends.items():
        (row,) = [line.split() for line in table.splitlines() if f" {tier} " in line]
        assert row[5] == (backend or "-"), row  # │ tier │ on │ backend │ ...


def test_health_prints_serving_and_exits_0(daemon: Daemon) -> None:
    assert ok(admin(daemon.target, "health", "--service", "kvstore.v1.KVStore")).strip() == (
        "SERVING")


def test_lookup_shows_the_prefix_length(daemon: Daemon, kv: KVStoreClient) -> None:
    tokens = list(range(64))
    keys = prefix_keys(tokens, 16, NS)
    kv.put(keys[:2], [b"a", b"b"])
    hexes = [k.hex() for k in keys]

    out = ok(admin(daemon.target, "--namespace", NS, "lookup", *hexes))
    assert "prefix length: 2 of 4" in out
    rows = [line for line in out.splitlines() if any(h in line for h in hexes)]
    assert ["dram" in r for r in rows] == [True, True, False, False]
    assert ["miss" in r for r in rows] == [False, False, True, True]

    printed = json.loads(ok(admin(daemon.target, "--namespace", NS, "lookup", "--json",
                                  "--tokens", ",".join(map(str, tokens)))))
    assert printed == {
        "prefix_length": 2,
        "keys": [{"key": h, "tier": t} for h, t in zip(hexes, ["dram", "dram", None, None],
                                                         strict=True)],
    }


def test_pin_evict_all_and_unpin(daemon: Daemon, kv: KVStoreClient) -> None:
    keys, values = blocks(3)
    kv.put(keys, values, independent=True)
    missing = (b"\xee" * 32).hex()

    out = ok(admin(daemon.target, "--namespace", NS, "pin", keys[0].hex(), missing))
    assert out.strip() == "pinned 1; missing 1"
    assert kv.stats().pinned == 1

    out = ok(admin(daemon.target, "evict", "--all"))
    assert out.strip() == ("evicted 2 entries (128.0 KiB) from every namespace, every tier; "
                           "skipped 1 (1 pinned)")
    assert kv.lookup(keys).tiers == ["dram", None, None]

    out = ok(admin(daemon.target, "--namespace", NS, "unpin", keys[0].hex()))
    assert out.strip() == "unpinned 1; missing 0"
    assert kv.stats().pinned == 0
    result = kv.evict(all=True)
    assert (result.evicted, result.skipped) == (1, 0)


def test_evict_bytes_takes_the_least_recently_used(daemon: Daemon, kv: KVStoreClient) -> None:
    # Keys no earlier test used: a key evicted lately and put again comes back hot, and
    # would outlive these (tests/unit/test_eviction_policy.py).
    keys, values = blocks(20)  # 1.25 MiB
    keys = [b"lru" + k[3:] for k in keys]
    kv.put(keys, values, independent=True)
    with KVStoreClient(daemon.target, "admin-other", shared_memory=False) as other:
        other.put([keys[0]], [b"another namespace"])

    printed = json.loads(ok(admin(daemon.target, "evict", "--bytes", "1MiB",
                                  "--namespace", NS, "--json")))
    assert printed == {"evicted": 16, "evicted_bytes": 1 << 20, "skipped": 0, "reasons": {}}
    assert kv.lookup(keys).tiers == [None] * 16 + ["dram"] * 4

    with KVStoreClient(daemon.target, "admin-other", shared_memory=False) as other:
        assert other.get([keys[0]]) == [b"another namespace"]


def test_config_json_is_the_effective_config(daemon: Daemon) -> None:
    config = json.loads(ok(admin(daemon.target, "config", "--json")))
    assert config["dram"]["capacity_bytes"] == CAPACITY
    assert config["dram"]["page_size_bytes"] == PAGE
    assert config["server"]["port"] == daemon.port


def test_an_unreachable_daemon_exits_2_naming_the_target() -> None:
    target = f"127.0.0.1:{free_port()}"
    done = admin(target, "--timeout", "3", "stats")
    assert done.returncode == 2, done.stdout + done.stderr
    assert target in done.stderr
    assert "unreachable" in done.stderr


@pytest.mark.parametrize(("key", "says"), [
    ("zz" * 32, "is not hex"),
    ("ab" * 31, "keys are 32 bytes"),
])
def test_a_bad_key_is_refused_before_any_request(daemon: Daemon, key: str, says: str) -> None:
    done = admin(daemon.target, "--namespace", NS, "lookup", key)
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr
    assert key in done.stderr
    assert "Traceback" not in done.stderr


def test_stats_watch_refreshes_until_interrupted(daemon: Daemon, kv: KVStoreClient) -> None:
    """--watch --json prints a fresh stats line every period: a put made while it runs shows
    up in the next lines, and Ctrl-C (SIGINT) ends it with exit code 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    watch = subprocess.Popen(
        [sys.executable, "-m", "kvstore.tools.admin", "--target", daemon.target, "stats",
         "--watch", "0.1", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in watch.stdout or []])
    reader.start()

    def next_objects() -> int:
        stats = json.loads(lines.get(timeout=20))
        return next(int(t["objects"]) for t in stats["tiers"] if t["tier"] == "dram")

    try:
        assert next_objects() == 0
        keys, values = blocks(5)
        kv.put(keys, values)
        seen = [next_objects()]
        while seen[-1] != 5 and len(seen) < 100:  # lines printed before the put show 0
            seen.append(next_objects())
        assert seen[-1] == 5 and set(seen) <= {0, 5}, seen
    finally:
        watch.send_signal(signal.SIGINT)
        _, err = watch.communicate(timeout=20)
        reader.join(10)
    assert watch.returncode == 0, err
