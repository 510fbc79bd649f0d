"""`kvstore-admin` run as a subprocess against a real daemon, on a pipe: what each command
prints, what it changes, its global options (before or after the command), its one-line errors
and its exit codes (0 ok, 1 a failed request, 2 unreachable or a bad command line). L4 (Redis)
is in test_admin_l4.py, a terminal's --watch in test_admin_watch.py, targets without a port
in test_admin_default_port.py."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvstore import __version__
from kvstore.client import KVStoreClient, prefix_keys
from kvstore.tools.testing import Daemon, free_port
from tests.conftest import REPO

CAPACITY = 8 << 20
PAGE = 64 << 10
NS = "admin-ns"


@pytest.fixture
def daemon(whole_daemon: Daemon) -> Daemon:
    """The admin shows the whole daemon: the shared one for such tests (8 MiB of 64 KiB
    pages, tests/conftest.py), emptied before each test."""
    return whole_daemon


@pytest.fixture
def kv(daemon: Daemon) -> Iterator[KVStoreClient]:
    with KVStoreClient(daemon.target, NS, shared_memory=False) as client:
        yield client


def admin(target: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    """kvstore-admin --target target args (target None: args alone), no KVSTORE_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    where = ["--target", target] if target is not None else []
    return subprocess.run([sys.executable, "-m", "kvstore.tools.admin", *where, *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=env)


def admin_all(*runs: tuple[str | None, ...]) -> list[subprocess.CompletedProcess[str]]:
    """admin(*run) for each run, side by side (each is a whole interpreter start)."""
    with ThreadPoolExecutor(len(runs)) as pool:
        return list(pool.map(lambda run: admin(*run), runs))  # type: ignore[arg-type]


def failed(done: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """The one line on stderr of a command that exited with code."""
    assert done.returncode == code, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    lines = done.stderr.splitlines()
    start = "error: " if code == 1 else ("error: ", "kvstore-admin")  # 2: a usage error too
    assert len(lines) == 1 and lines[0].startswith(start), done.stderr
    assert "Traceback" not in done.stderr and "_InactiveRpcError" not in done.stderr
    return lines[0]


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
    expected = kv.stats().to_dict()
    # stats never asks for the config (`config` shows it): no always-empty field
    assert "config_json" not in printed and expected.pop("config_json") == ""
    assert printed == expected
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

    out = ok(admin(daemon.target, "--namespace", NS, "pin", keys[0].hex()))
    assert out.strip() == "pinned 1; missing 0"
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


def test_pin_of_a_missing_key_exits_1_naming_it(daemon: Daemon, kv: KVStoreClient) -> None:
    """A key that is not stored cannot be pinned: exit 1 and the keys named, not exit 0
    (before, `pinned 1; missing 1` and 0, so a script never learnt its block was unprotected);
    the keys that are stored are pinned all the same."""
    keys, values = blocks(2)
    kv.put(keys[:1], values[:1])
    stored, missing = keys[0].hex(), keys[1].hex()
    plain = admin(daemon.target, "--namespace", NS, "pin", stored, missing)
    assert plain.stdout.strip() == "pinned 1; missing 1"
    assert failed(plain) == (f"error: NOT_FOUND: 1 of 2 keys are not stored in namespace "
                             f"{NS!r}, so not pinned: {missing}")
    assert kv.unpin(keys[:1]).changed == 1
    as_json, unpin = admin_all((daemon.target, "--namespace", NS, "--json", "pin", missing,
                                stored),
                               (daemon.target, "--namespace", NS, "unpin", missing))
    assert as_json.returncode == 1, as_json.stderr
    assert json.loads(as_json.stdout) == {"changed": 1, "missing": 1, "missing_keys": [missing]}
    assert json.loads(as_json.stderr) == {
        "code": "NOT_FOUND", "reason": "KEYS_MISSING", "exit_code": 1,
        "message": f"1 of 2 keys are not stored in namespace {NS!r}, so not pinned: {missing}"}
    assert failed(unpin) == (f"error: NOT_FOUND: 1 of 1 keys are not stored in namespace "
                             f"{NS!r}, so not unpinned: {missing}")
    assert kv.stats().pinned == 1  # the stored key
    assert kv.unpin(keys[:1]).changed == 1


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


def test_limits_shows_what_a_client_must_respect(daemon: Daemon) -> None:
    limits = json.loads(ok(admin(daemon.target, "limits", "--json")))
    assert limits["contract"] == "kvstore.v1" and limits["key_bytes"] == 32
    assert limits["max_message_bytes"] == 8 << 20 and limits["chunk_bytes"] == 4 << 20
    table = ok(admin(daemon.target, "limits"))
    assert "max_message_bytes" in table and "8.0 MiB" in table


def test_config_json_is_the_effective_config(daemon: Daemon, kv: KVStoreClient) -> None:
    """Settings left to the daemon ("", auto, 0) show what it chose: the segment it created,
    the L3 backend it opened, whether L1 is on, the stream caps it derived."""
    config = json.loads(ok(admin(daemon.target, "config", "--json")))
    assert config["dram"]["capacity_bytes"] == CAPACITY
    assert config["dram"]["page_size_bytes"] == PAGE
    assert config["server"]["port"] == daemon.port
    stats = kv.stats()
    tiers = {t.tier: t for t in stats.tiers}
    assert stats.shm_name and config["dram"]["shm_name"] == stats.shm_name
    assert config["nvme"]["backend"] == tiers["nvme"].backend != "auto"
    assert config["nvme"]["dir"] == str(daemon.log_path.parent / f"l3-{daemon.port}")
    assert config["hbm"]["mode"] == ("on" if tiers["hbm"].enabled else "off")
    assert config["server"]["max_streams"] == 8 - 2  # workers less two, as 0 means
    assert 0 < config["clients"]["max_streams"] < config["server"]["max_streams"]
    shown = ok(admin(daemon.target, "config"))
    assert f'"shm_name": "{stats.shm_name}"' in shown and '"backend": "auto"' not in shown


def test_an_unreachable_daemon_exits_2_naming_the_target() -> None:
    target = f"127.0.0.1:{free_port()}"
    done = admin(target, "--timeout", "3", "stats")
    line = failed(done, 2)
    assert line.startswith(f"error: UNAVAILABLE: the kvstore daemon at {target} is unreachable")


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


def test_stats_watch_on_a_pipe_prints_each_frame_as_it_is_made(daemon: Daemon,
                                                                kv: KVStoreClient) -> None:
    """Piped without --json, --watch prints one whole table per period, flushed at once (rich's
    live display would hold it all back until the end): frames arrive while it runs, and a
    put made meanwhile shows in a later one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    watch = subprocess.Popen(
        [sys.executable, "-m", "kvstore.tools.admin", "stats", "--watch", "0.1",
         "--target", daemon.target],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in watch.stdout or []])
    reader.start()

    def next_dram_objects() -> int:
        while True:  # the dram row of the next frame's tier table: │ dram │ yes │ shm │ ...
            cells = [c.strip() for c in lines.get(timeout=20).split("│")]
            if len(cells) > 8 and cells[1] == "dram":
                return int(cells[7].replace(",", ""))

    try:
        assert next_dram_objects() == 0
        kv.put(*blocks(2))
        seen = [next_dram_objects()]
        while seen[-1] != 2 and len(seen) < 100:
            seen.append(next_dram_objects())
        assert seen[-1] == 2 and set(seen) <= {0, 2}, seen
        assert watch.poll() is None  # all of this while it still runs
    finally:
        watch.send_signal(signal.SIGINT)
        _, err = watch.communicate(timeout=20)
        reader.join(10)
    assert watch.returncode == 0, err


def test_global_options_go_before_or_after_the_command(daemon: Daemon,
                                                       kv: KVStoreClient) -> None:
    keys, values = blocks(2)
    kv.put(keys, values, independent=True)
    key = keys[0].hex()
    done = admin_all(
        (daemon.target, "--json", "stats"), (None, "stats", "--json", "--target", daemon.target),
        (daemon.target, "--namespace", NS, "--json", "lookup", key),
        (daemon.target, "lookup", key, "--namespace", NS, "--json"),
        (daemon.target, "--json", "lookup", "--namespace", NS, key),
        # evict and stats take the same --namespace as every other command
        (daemon.target, "evict", "--namespace", "elsewhere", "--all"),
        (daemon.target, "stats", "--namespace", NS),
        (daemon.target, "--namespace", NS, "hot", "--namespace", "b"),
        (daemon.target, "--token", "a", "health", "--token-file", "f"),
    )
    before, after = (json.loads(ok(d)) for d in done[:2])
    assert [t["objects"] for t in before["tiers"]] == [t["objects"] for t in after["tiers"]]
    assert before["tiers"][1]["objects"] == 2
    found = [json.loads(ok(d)) for d in done[2:5]]
    assert found == [{"prefix_length": 1, "keys": [{"key": key, "tier": "dram"}]}] * 3
    assert "evicted 0 entries" in ok(done[5]) and "lookup hits / misses" in ok(done[6])
    assert kv.lookup(keys).tiers == ["dram", "dram"]
    twice = failed(done[7], 2)
    assert "argument --namespace: given twice, 'admin-ns' and 'b'" in twice
    assert "prewarm takes several: --namespaces" in twice
    assert "not allowed with argument --token" in failed(done[8], 2)


def test_evict_takes_several_keys_after_one_key_flag(daemon: Daemon, kv: KVStoreClient) -> None:
    keys, values = blocks(3)
    kv.put(keys, values, independent=True)
    out = ok(admin(daemon.target, "evict", "--namespace", NS, "--key", keys[0].hex(),
                   keys[2].hex()))
    assert out.startswith(f"evicted 2 entries (128.0 KiB) from namespace {NS!r}"), out
    assert kv.lookup(keys).tiers == [None, "dram", None]
    assert "evict --key needs --namespace" in admin(daemon.target, "evict", "--key",
                                                    keys[1].hex()).stderr


def test_an_unknown_health_service_is_one_line_naming_it(daemon: Daemon) -> None:
    bogus, plain = admin_all((daemon.target, "health", "--service", "bogus"),
                             (daemon.target, "health", "--json"))
    assert failed(bogus) == ("error: NOT_FOUND: the daemon has no health service 'bogus' (it "
                             "serves '' and 'kvstore.v1.KVStore')")
    assert json.loads(ok(plain)) == {"service": "", "status": "SERVING"}


def test_l4_off_hot_and_prewarm_fail_in_one_line_without_a_progress_bar(
        daemon: Daemon) -> None:
    runs = [(daemon.target, "prewarm"), (daemon.target, "prewarm", "--bytes", "1MiB"),
            (daemon.target, "--namespace", NS, "hot")]  # --json: test_json_errors_...
    for run, done in zip(runs, admin_all(*runs), strict=True):
        assert failed(done) == "error: FAILED_PRECONDITION: L4 is off: set remote.url", run
        assert done.stdout == "", run  # no bar, no "prewarmed 0 blocks"


def _json_error(done: subprocess.CompletedProcess[str], code: int) -> dict[str, object]:
    """The one JSON object on stderr of a --json command that exited with code."""
    assert done.returncode == code, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    error: dict[str, object] = json.loads(done.stderr)
    assert set(error) == {"code", "reason", "message", "exit_code"}
    assert error["exit_code"] == code
    return error


def test_json_errors_are_one_object_on_stderr_with_the_same_exit_code(daemon: Daemon) -> None:
    """With --json every error is one JSON object (code, reason, message, exit_code) and the
    exit code stays the plain one: a failed request 1, the daemon unreachable or a bad
    command line 2. Before, they were the plain `error: ...` line."""
    gone = f"127.0.0.1:{free_port()}"
    bogus, off, unreachable, usage, bad_key = admin_all(
        (daemon.target, "--json", "health", "--service", "bogus"),
        (daemon.target, "prewarm", "--json"),
        (gone, "--timeout", "3", "stats", "--json"),
        (daemon.target, "--json", "evict"),
        (daemon.target, "--json", "--namespace", NS, "lookup", "ab"))
    assert _json_error(bogus, 1) == {
        "code": "NOT_FOUND", "reason": "", "exit_code": 1,
        "message": "the daemon has no health service 'bogus' (it serves '' and "
                   "'kvstore.v1.KVStore')"}
    assert _json_error(off, 1) == {"code": "FAILED_PRECONDITION", "reason": "FEATURE_OFF",
                                   "message": "L4 is off: set remote.url", "exit_code": 1}
    error = _json_error(unreachable, 2)
    assert (error["code"], error["reason"]) == ("UNAVAILABLE", "UNREACHABLE")
    assert str(error["message"]).startswith(f"the kvstore daemon at {gone} is unreachable")
    assert _json_error(usage, 2) == {
        "code": "INVALID_ARGUMENT", "reason": "USAGE", "exit_code": 2,
        "message": "kvstore-admin: evict needs --bytes, --all or --key"}
    error = _json_error(bad_key, 2)
    assert (error["code"], error["reason"]) == ("INVALID_ARGUMENT", "USAGE")
    assert error["message"] == ("kvstore-admin lookup: argument KEYHEX: key 'ab' is 1 bytes; "
                                "keys are 32 bytes (64 hex)")


def test_version_is_the_package_version_the_daemon_reports(daemon: Daemon,
                                                           kv: KVStoreClient) -> None:
    """`kvstore-admin --version` says kvstore.__version__, the version a daemon of the same
    installation reports in Stats (and `kvstore-server --version`)."""
    done = admin(None, "--version")
    assert ok(done) == f"kvstore-admin {__version__}\n"
    assert kv.stats().version == __version__


def test_a_commands_help_shows_its_own_options_and_points_to_the_global_ones() -> None:
    """`kvstore-admin pin --help` describes pin (its KEYHEX argument included) and names the
    global options once, pointing to `kvstore-admin --help`, which describes each of them
    once. Before, every command's help repeated all of them."""
    top, pin, lookup = admin_all((None, "--help"), (None, "pin", "--help"),
                                 (None, "lookup", "--help"))
    globals_ = ("--target", "--namespace", "--timeout", "--json", "--token", "--token-file",
                "--tls-ca", "--tls-cert", "--tls-key", "--tls-server-name")
    described = ok(top).split("global options (before or after the command):")[1]
    for flag in globals_:  # each described on a line of its own, once
        rows = [line for line in described.splitlines() if line.strip().startswith(flag + " ")
                or line.strip() == flag]
        assert len(rows) == 1, (flag, rows)
    assert "KVSTORE_TLS_CA_FILE" in ok(top)
    for done in (pin, lookup):
        text = ok(done)
        assert "KVSTORE_" not in text  # no global option described here
        assert "`kvstore-admin --help` describes each" in " ".join(text.split())
        own, pointer = text.split("Global options, before or after the command:")
        for flag in globals_:  # named once, in the pointer; not in the usage or the options
            assert len(re.findall(rf"{flag}(?![\w-])", pointer)) == 1, (flag, text)
            assert not re.search(rf"(\[|^ +){flag}(?![\w-])", own, re.MULTILINE), (flag, text)
    assert "Needs --namespace. Exits 1, naming them, when any key is not stored." in " ".join(
        ok(pin).split())
    assert "KEYHEX      a block key: 64 hex digits" in ok(pin)
    assert "--tokens TOKENS" in ok(lookup) and "tokens per block (16)" in ok(lookup)
