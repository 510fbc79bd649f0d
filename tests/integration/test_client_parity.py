"""The two clients behave as one (a real daemon): the same script of calls, run once through
`KVStoreClient` and once through `AsyncKVStoreClient`, gives the same results and errors, by
the same path, with the same requests counted by the daemon. Each path is checked: the local
path (a daemon with a Unix socket: the hot verbs over it, the blocks through shared memory),
shared memory with every verb over gRPC (a daemon without a socket), inline gRPC
(shared_memory=False), and auth on (the tenant's arena through the socket, a fresh Attach
ticket per local session). The asyncio client never does blocking work on its event loop:
the local-path calls, the copies through shared memory and of inline data, and the
shared-memory decision run in worker threads.

The signatures are checked without a daemon in tests/unit/test_client_parity.py."""

from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.client import AsyncKVStoreClient, KVStoreClient
from kvstore.client._localpath import LocalPath
from kvstore.client._shm import ShmState
from kvstore.client._wire import InlineAssembler
from kvstore.tools.testing import Daemon
from tests.integration.test_auth import A_NS, TOKENS, tenants_doc, write_tenants

SIZES = [1, 4097, 65536, 70_000, 3, 200_000, 10, 65535]
MISSING = b"\x00" * 32

# path -> (what the daemon is started with, what the clients are built with, what they use:
# (shared memory, the local path))
PATHS: dict[str, tuple[tuple[str, ...], dict[str, Any], tuple[bool, bool]]] = {
    "local": (("server.unix_socket={sock}",), {}, (True, True)),
    "shm": ((), {}, (True, False)),
    "inline": ((), {"shared_memory": False}, (False, False)),
    "arena": (("server.unix_socket={sock}", "auth.mode=token", "auth.tenants_file={tenants}"),
              {"token": TOKENS["team-a"]}, (True, True)),
}
# Blocking work the asyncio client must run off its loop, and the path that does it.
BLOCKING = {
    "local": {"LocalPath.call", "ShmState.segment_for", "ShmState.read_get",
              "ShmState.write_reservation"},
    "shm": {"ShmState.segment_for", "ShmState.read_get", "ShmState.write_reservation"},
    "inline": {"InlineAssembler.feed"},  # shared_memory=False: nothing to decide
}
BLOCKING["arena"] = BLOCKING["local"]


@pytest.fixture
def start(daemon_factory: Callable[..., Daemon], tmp_path: Path) -> Callable[[str], Daemon]:
    def start_for(path: str) -> Daemon:
        tenants = write_tenants(tmp_path / "tenants.yaml", tenants_doc())
        settings = [s.format(sock=tmp_path / "kv.sock", tenants=tenants) for s in PATHS[path][0]]
        return daemon_factory("dram.capacity_bytes=32MiB", "dram.page_size_bytes=64KiB",
                              "nvme.enabled=false", *settings)
    return start_for


class Awaited:
    """An AsyncKVStoreClient driven from the test's thread: each call runs on the client's own
    event loop until it is done, so one script drives both clients."""

    def __init__(self, target: str, namespace: str, **options: Any) -> None:
        self.loop = asyncio.new_event_loop()

        async def build() -> AsyncKVStoreClient:
            return AsyncKVStoreClient(target, namespace, **options)

        self.client = self.loop.run_until_complete(build())

    def __getattr__(self, name: str) -> Any:
        member = getattr(self.client, name)
        if not callable(member):
            return member
        return lambda *args, **kwargs: self.loop.run_until_complete(member(*args, **kwargs))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


def raised(call: Callable[[], object]) -> tuple[str, str]:
    """The error a call raises: its class and message."""
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    raise AssertionError("the call raised nothing")


def script(kv: Any, namespace: str) -> list[object]:
    """Every verb once or more, and what each answered."""
    rng = np.random.default_rng(7)
    ks = [bytes(rng.integers(0, 256, 32, dtype=np.uint8)) for _ in SIZES]
    vs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in SIZES]
    out: list[object] = [kv.put(ks[:4], vs[:4]), kv.put(ks[:4], vs[:4])]  # the second: existing
    out.append(kv.put(ks[4:], [np.frombuffer(v, np.uint8) for v in vs[4:]], parent=ks[3]))
    out += [kv.lookup(ks, block_tokens=16), kv.lookup([*ks[:2], MISSING, ks[3]])]
    out.append(kv.get([*ks, MISSING]))
    buffers = [bytearray(n + 3) for n in SIZES] + [bytearray(8)]
    out += [kv.get_into([*ks, MISSING], buffers), [bytes(b) for b in buffers]]
    out += [kv.pin(ks[:2]), kv.unpin([ks[0], MISSING])]
    progress: list[object] = []
    out += [kv.prefetch(ks, tier="dram", on_progress=progress.append), progress]
    out += [kv.evict(ks[6:]), kv.lookup(ks), kv.get(ks[5:])]
    dram = kv.stats(namespace=namespace).tier("dram")
    out += [(dram.objects, dram.used_bytes), kv.health(), kv.limits()]
    out.append(raised(lambda: kv.get([b"short"])))
    out.append(raised(lambda: kv.put(ks[:1], [b""])))
    out.append(raised(lambda: kv.release(["no-such-lease"])))
    out.append(raised(lambda: kv.hot()))  # L4 is off
    out.append(kv.evict(all=True))
    return out


def served(daemon: Daemon) -> dict[tuple[str, ...], float]:
    """What the daemon has counted: requests by method and code, local-path ones by method;
    read until two reads 50 ms apart agree (a reply can reach the client before the daemon
    counts its request)."""
    def read() -> dict[tuple[str, ...], float]:
        url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
        text = urllib.request.urlopen(url).read().decode()
        counts = {("rpc", m, c): float(n) for c, m, n in re.findall(
            r'^kvstore_rpc_latency_seconds_count\{code="(\w+)",method="(\w+)"\} (\S+)$', text,
            re.M)}
        counts.update({("local", m): float(n) for m, n in re.findall(
            r'^kvstore_local_requests_total\{method="(\w+)"\} (\S+)$', text, re.M)})
        return counts

    last = read()
    for _ in range(40):
        time.sleep(0.05)
        now = read()
        if now == last:
            return now
        last = now
    raise AssertionError("the daemon's counts did not settle")


def delta(after: dict[tuple[str, ...], float],
          before: dict[tuple[str, ...], float]) -> dict[tuple[str, ...], float]:
    return {k: n - before.get(k, 0.0) for k, n in after.items() if n != before.get(k, 0.0)}


@pytest.fixture
def threads_of(monkeypatch: pytest.MonkeyPatch) -> dict[str, set[int]]:
    """The threads each piece of blocking work ran on, by its name."""
    seen: dict[str, set[int]] = {}

    def recording(label: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            seen.setdefault(label, set()).add(threading.get_ident())
            return real(*args, **kwargs)
        return recorded

    for owner, name in ((LocalPath, "call"), (ShmState, "segment_for"), (ShmState, "read_get"),
                        (ShmState, "write_reservation"), (InlineAssembler, "feed")):
        label = f"{owner.__name__}.{name}"
        monkeypatch.setattr(owner, name, recording(label, getattr(owner, name)))
    return seen


@pytest.mark.parametrize("path", list(PATHS))
def test_both_clients_answer_the_same_calls_the_same_by_the_same_path(
        path: str, start: Callable[[str], Daemon], threads_of: dict[str, set[int]]) -> None:
    daemon = start(path)
    options, expected_path = PATHS[path][1], PATHS[path][2]
    prefix = f"{A_NS}/parity-{path}" if path == "arena" else f"parity/{path}"

    before = served(daemon)
    with KVStoreClient(daemon.target, f"{prefix}/sync", **options) as kv:
        blocking = script(kv, f"{prefix}/sync")
        blocking_path = (kv.uses_shared_memory, kv._shm.local is not None)
    after_blocking = served(daemon)

    threads_of.clear()
    aio = Awaited(daemon.target, f"{prefix}/aio", **options)
    try:
        awaited = script(aio, f"{prefix}/aio")
        awaited_path = (aio.uses_shared_memory, aio._shm.local is not None)
    finally:
        aio.close()
    after_awaited = served(daemon)

    assert awaited == blocking
    assert awaited_path == blocking_path == expected_path
    by_blocking, by_awaited = delta(after_blocking, before), delta(after_awaited, after_blocking)
    assert by_awaited == by_blocking
    local = {k: n for k, n in by_awaited.items() if k[0] == "local"}
    assert bool(local) is expected_path[1], local  # the local path served what it should
    loop_thread = threading.get_ident()  # each awaited call ran its loop on this thread
    assert set(threads_of) == BLOCKING[path]
    assert all(loop_thread not in ran_on for ran_on in threads_of.values()), threads_of


def test_a_reader_without_checksums_ends_its_leases_the_same_way(
        start: Callable[[str], Daemon]) -> None:
    # No checksums: each shared-memory Get takes a lease, which both clients end over the
    # local path without waiting for its answer (read_table=False: every Get asks the
    # daemon, rather than reading through its read table, which takes no lease).
    daemon = start("local")
    ks = [bytes([i]) * 32 for i in range(1, 5)]

    def reads(kv: Any) -> list[object]:
        kv.put(ks, [b"v" * 5000] * 4)
        got = [kv.get(ks) for _ in range(3)]
        kv.lookup(ks)  # the session reads the posted Releases' answers before this one
        return [got, kv.stats().leases]

    before = served(daemon)
    with KVStoreClient(daemon.target, "parity/leased/sync", verify_checksums=False,
                       read_table=False) as kv:
        blocking = reads(kv)
    after_blocking = served(daemon)
    aio = Awaited(daemon.target, "parity/leased/aio", verify_checksums=False, read_table=False)
    try:
        awaited = reads(aio)
    finally:
        aio.close()
    after_awaited = served(daemon)

    assert awaited == blocking == [[[b"v" * 5000] * 4] * 3, 0]
    by_blocking, by_awaited = delta(after_blocking, before), delta(after_awaited, after_blocking)
    assert by_awaited == by_blocking and by_awaited[("local", "Release")] == 3
