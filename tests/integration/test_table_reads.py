"""Reads through the read table (a real daemon, real clients, real processes): lookups and L2
reads answered from the table the daemon publishes match what the daemon answers and skip it;
the table cannot be written by a client, each tenant sees only its own, and a client that
damages its own private copy hurts only its own reads (which fall back to the daemon); reads
are reported, so the blocks read stay recent; with the table off, everything asks the daemon;
and readers hammering the table while a writer keeps L2 under pressure (evictions, demotions,
pages reused) never accept a wrong byte (TABLE_SOAK_S sets how long, 10 s here)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import mmap
import multiprocessing
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvstore import native
from kvstore.client import AsyncKVStoreClient, KVStoreClient
from kvstore.client._readtable import TableReads
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.proto.localframe import LOOKUP, READS
from kvstore.readtable import TableView, namespace_hash
from kvstore.tools.testing import Daemon
from tests.helpers import keys, metric
from tests.integration.test_auth import A_NS, B_NS, TOKENS, md
from tests.integration.test_l3_reads_under_pressure import L2_PAGES, fill, pressure
from tests.integration.test_l3_reads_under_pressure import blocks as l3_blocks
from tests.integration.test_local_path import LOCAL_SETTINGS, local_requests, sock_of
from tests.integration.test_tenant_shm import evict_everything, token_daemon

__all__ = ["pressure"]  # the fixture, shared with test_l3_reads_under_pressure.py

SOAK_S = float(os.environ.get("TABLE_SOAK_S", "10"))


@pytest.fixture(params=["native", "numpy"])
def helper(request: pytest.FixtureRequest) -> Iterator[str]:
    """The client's copies with the native helper (kvstore/native), then with numpy + xxhash."""
    was = native.LIB
    if request.param == "native" and native.load() is None:
        pytest.skip("the native helper is not built (`make native`)")
    native.use_native(request.param == "native")
    yield str(request.param)
    native.LIB = was


@pytest.fixture
def daemon(shared_daemon: Callable[..., Daemon]) -> Daemon:
    """The session's local-path daemon (auth off; tests work in their own namespace)."""
    return shared_daemon(*LOCAL_SETTINGS, unix_socket=True)


@pytest.fixture
def tenant_daemon(shared_daemon: Callable[..., Daemon],
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = token_daemon(shared_daemon, tmp_path_factory)
    yield d
    evict_everything(d)


def tables_of(path: str, ticket: str = "-") -> tuple[dict[str, Any], list[int], socket.socket]:
    """A session opened by hand asking for the read tables: the handshake's answer, the
    descriptors passed with it, and the session's socket."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    s.sendall(f"HOT {ticket} tables\n".encode())
    line, fds = b"", []
    while not line.endswith(b"\n"):
        chunk, got, _, _ = socket.recv_fds(s, 1, 16)
        fds += got
        if not chunk:
            break
        line += chunk
    return json.loads(line), fds, s


def ticket_of(d: Daemon, tenant: str) -> str:
    with grpc.insecure_channel(d.target) as channel:
        return str(rpc.KVStoreStub(channel).Attach(pb.AttachRequest(),
                                                   metadata=md(tenant)).ticket)


def table_reads(kv: KVStoreClient) -> TableReads:
    tables = kv._shm.tables
    assert tables is not None, "the client reads through no table"
    return tables


def test_reads_and_lookups_through_the_table_match_the_daemon_and_skip_it(
        daemon: Daemon, ns: str, helper: str) -> None:
    rng = np.random.default_rng(5)
    blocks = [rng.integers(0, 256, size, dtype=np.uint8) for size in (1, 4096, 70_000, 300_000)]
    ks, absent = keys(4), keys(2)
    with KVStoreClient(daemon.target, ns) as kv, \
            KVStoreClient(daemon.target, ns, read_table=False) as asked:
        kv.put(ks, blocks)
        tables = table_reads(kv)
        before = {m: local_requests(daemon, m) for m in ("Get", "Lookup")}
        out = [np.zeros(b.size, np.uint8) for b in blocks]
        assert kv.get_into(ks, out) == [b.size for b in blocks]
        assert all(np.array_equal(a, b) for a, b in zip(out, blocks, strict=True))
        assert kv.get(ks) == [b.tobytes() for b in blocks]
        assert kv.lookup(ks).prefix_length == 4
        assert {m: local_requests(daemon, m) for m in ("Get", "Lookup")} == before
        assert tables.hits == 8 and tables.rejected == 0
        # What the table does not show is asked of the daemon, and the answers are its own.
        for chain in ([*ks[:2], absent[0], *ks[2:]], [absent[0], *ks], [*ks, *absent]):
            assert kv.lookup(chain) == asked.lookup(chain)
            assert kv.get(chain) == asked.get(chain)
        assert local_requests(daemon, "Lookup") > before["Lookup"]


def test_blocks_read_in_place_are_their_bytes_until_their_slots_move(
        daemon: Daemon, ns: str) -> None:
    rng = np.random.default_rng(11)
    blocks = [rng.integers(0, 256, size, dtype=np.uint8) for size in (4096, 70_000, 300_000, 5)]
    ks, [absent] = keys(4), keys(1)
    with KVStoreClient(daemon.target, ns) as kv, \
            KVStoreClient(daemon.target, ns, verify_checksums=False) as unverified, \
            KVStoreClient(daemon.target, ns, shared_memory=False) as remote:
        kv.put(ks, blocks)
        before = local_requests(daemon, "Get")
        got = kv.get_in_place([*ks, absent])  # the four the table shows, then a miss
        assert [v.tobytes() for v in got.views] == [b.tobytes() for b in blocks]
        assert not any(v.flags.writeable for v in got.views)
        with pytest.raises(ValueError, match="read-only"):
            got.views[0][0] = 1
        assert got.held() == 4 and local_requests(daemon, "Get") == before
        assert table_reads(kv).hits == 4
        assert kv.get_in_place([absent, *ks]).views == []  # the leading keys only
        assert remote.get_in_place(ks).views == []  # no shared memory: nothing in place
        # A byte of the second block damaged where it lies: a verifying client's views stop
        # before it; one that does not verify is shown it (its copy would be wrong too).
        segment = kv._shm.segment
        assert segment is not None
        at = got.views[1].ctypes.data - segment.address
        segment.array[at] ^= 0xFF
        try:
            assert len(kv.get_in_place(ks).views) == 1
            assert len(unverified.get_in_place(ks).views) == 4
        finally:
            segment.array[at] ^= 0xFF
        # The third block leaves (and the fourth, its descendant): their slots move, so
        # the views taken before count only up to them.
        assert kv.evict(keys=[ks[2]]).evicted == 2
        assert got.held() == 2
        assert len(kv.get_in_place(ks).views) == 2


def test_the_async_client_reads_in_place_too(daemon: Daemon, ns: str) -> None:
    ks = keys(2)

    async def run() -> list[bytes]:
        async with AsyncKVStoreClient(daemon.target, ns) as kv:
            await kv.put(ks, [b"one", b"two"])
            got = await kv.get_in_place(ks)
            assert got.held() == 2
            return [v.tobytes() for v in got.views]

    assert asyncio.run(run()) == [b"one", b"two"]


def test_the_table_cannot_be_written_through_any_descriptor(daemon: Daemon, ns: str) -> None:
    with KVStoreClient(daemon.target, ns) as kv:
        kv.put(keys(3), [b"x" * 5000] * 3)
    hello, fds, s = tables_of(sock_of(daemon))
    try:
        assert [t["arena"] for t in hello["hot"]["tables"]] == [""] and len(fds) == 1
        fd, size = fds[0], hello["hot"]["tables"][0]["size_bytes"]
        with pytest.raises(PermissionError):  # the descriptor is read-only
            mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        # Opened again read-write through /proc, the memfd's seals still refuse any write.
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(rw, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(rw, b"\0" * 8, 4096)
            with pytest.raises(PermissionError):
                os.ftruncate(rw, 0)
        finally:
            os.close(rw)
        shared = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        private = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
        private[4096:size] = b"\xff" * (size - 4096)  # a copy of one's own: nobody else's
        assert shared[4096:8192] != private[4096:8192]
        with pytest.raises(ValueError, match="no magic"):
            TableView(memoryview(bytearray(4096)))
        shared.close()
        private.close()
    finally:
        for fd in fds:
            os.close(fd)
        s.close()


def test_each_tenant_gets_its_own_table_and_reports_only_its_own(
        tenant_daemon: Daemon) -> None:
    path = sock_of(tenant_daemon)
    k = keys(4)
    with KVStoreClient(tenant_daemon.target, A_NS, token=TOKENS["team-a"]) as a, \
            KVStoreClient(tenant_daemon.target, B_NS, token=TOKENS["team-b"]) as b:
        a.put(k, [b"a" * 100] * 4)
        b.put(k, [b"b" * 200] * 4)
        assert table_reads(a).table.arena == "team-a"
        assert table_reads(b).table.arena == "team-b"
        assert a.get(k) == [b"a" * 100] * 4 and b.get(k) == [b"b" * 200] * 4
    views = {}
    for tenant in ("team-a", "team-b"):
        hello, fds, s = tables_of(path, ticket_of(tenant_daemon, tenant))
        assert [t["arena"] for t in hello["hot"]["tables"]] == [tenant] and len(fds) == 1
        size = hello["hot"]["tables"][0]["size_bytes"]
        views[tenant] = (TableView(memoryview(mmap.mmap(fds[0], size, prot=mmap.PROT_READ))),
                         s)
        os.close(fds[0])
    a_view, a_session = views["team-a"]
    b_view, b_session = views["team-b"]
    # Each table shows its tenant's blocks only, whatever namespace one probes it with.
    for view, mine, theirs in ((a_view, A_NS, B_NS), (b_view, B_NS, A_NS)):
        shown = view.probe(namespace_hash(mine), k)
        other = view.probe(namespace_hash(theirs), k)
        assert shown is not None and shown.prefix() == 4
        assert other is not None and (other.slots < 0).all()
    assert (a_view.probe(namespace_hash(A_NS), k).lengths == 100).all()  # type: ignore[union-attr]
    # A report naming another tenant's namespace is refused (and, as every report, never
    # answered): the session goes on and answers its next request.
    denied = metric(tenant_daemon, "kvstore_rpc_latency_seconds_count", method="ReportReads",
                    code="PERMISSION_DENIED")
    request = pb.LookupRequest(namespace=B_NS, keys=k).SerializeToString()
    a_session.sendall(len(request).to_bytes(4, "little") + bytes([READS]) + request)
    lookup = pb.LookupRequest(namespace=A_NS, keys=k).SerializeToString()
    a_session.sendall(len(lookup).to_bytes(4, "little") + bytes([LOOKUP]) + lookup)
    head = a_session.recv(6, socket.MSG_WAITALL)
    body = a_session.recv(int.from_bytes(head[:4], "little"), socket.MSG_WAITALL)
    assert head[4] == 0 and pb.LookupResponse.FromString(body).prefix_length == 4
    assert metric(tenant_daemon, "kvstore_rpc_latency_seconds_count", method="ReportReads",
                  code="PERMISSION_DENIED") == denied + 1
    a_session.close()
    b_session.close()


def test_a_damaged_private_copy_changes_only_its_owners_reads(daemon: Daemon, ns: str,
                                                              helper: str) -> None:
    rng = np.random.default_rng(9)
    blocks = [rng.integers(0, 256, 20_000, dtype=np.uint8).tobytes() for _ in range(6)]
    ks = keys(6)
    with KVStoreClient(daemon.target, ns) as writer, KVStoreClient(daemon.target, ns) as other, \
            KVStoreClient(daemon.target, ns) as victim:
        writer.put(ks, blocks)
        before = writer.stats()
        assert victim.get(ks) == blocks and other.get(ks) == blocks  # (their tables mapped)
        reads, others = table_reads(victim), table_reads(other)
        reads.hits = others.hits = 0
        # The victim's table replaced by a private copy of its own in which every location
        # points one page further on (lengths kept): wrong places, not wrong sizes.
        hello, fds, s = tables_of(sock_of(daemon))
        s.close()
        size = hello["hot"]["tables"][0]["size_bytes"]
        private = mmap.mmap(fds[0], size, flags=mmap.MAP_PRIVATE,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fds[0])
        words = np.frombuffer(private, np.uint64)
        slots = words[512:512 + reads.table.view.capacity * 8].reshape(-1, 8)
        live = (slots[:, 6] & np.uint64(0xFF)) != 0
        assert live.sum() >= 6
        slots[live, 6] += np.uint64(4096 << 8)  # the offset is the word's upper 56 bits
        reads.table.view = TableView(memoryview(private))
        assert victim.get(ks) == blocks  # every copy failed its checksum: asked the daemon
        assert reads.hits == 0 and reads.rejected == 6
        out = [np.zeros(20_000, np.uint8) for _ in ks]
        assert victim.get_into(ks, out) == [20_000] * 6  # the same, into buffers
        assert [a.tobytes() for a in out] == blocks
        assert reads.hits == 0 and reads.rejected == 12
        assert other.get(ks) == blocks and others.hits == 6
        after = writer.stats()
        assert [(t.tier, t.objects, t.used_bytes) for t in after.tiers] == \
            [(t.tier, t.objects, t.used_bytes) for t in before.tiers]


def test_with_the_table_off_reads_ask_the_daemon(
        daemon_factory: Callable[..., Daemon], daemon: Daemon, ns: str,
        tmp_path: Path) -> None:
    off = daemon_factory(*LOCAL_SETTINGS, "dram.read_table=false",
                         f"server.unix_socket={tmp_path / 'off.sock'}")
    ks = keys(3)
    for target, options in ((off.target, {}), (daemon.target, {"read_table": False})):
        with KVStoreClient(target, ns, **options) as kv:
            kv.put(ks, [b"q" * 3000] * 3)
            assert kv.uses_local_path and kv._shm.tables is None
            assert kv.get(ks) == [b"q" * 3000] * 3
            assert kv.lookup(ks).prefix_length == 3
    assert local_requests(off, "Get") >= 1 and local_requests(off, "Lookup") >= 1


def test_reads_through_the_table_are_reported_and_keep_blocks_recent(
        daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    # 1 MiB of 4 KiB pages, no L3: 17 blocks of 15 pages fit.
    d = daemon_factory("dram.capacity_bytes=1MiB", "dram.page_size_bytes=4KiB",
                       "nvme.enabled=false", f"server.unix_socket={tmp_path / 'kv.sock'}")
    size = 15 * 4096
    first, second, third = keys(8), keys(8), keys(8)
    with KVStoreClient(d.target, "ns") as kv:
        kv.put(first, [b"1" * size] * 8, independent=True)
        kv.put(second, [b"2" * size] * 8, independent=True)
        hits = next(t.hits for t in kv.stats().tiers if t.tier == "dram")
        assert kv.get(first) == [b"1" * size] * 8 and table_reads(kv).hits == 8
        # Reported ahead of the client's next call over gRPC (a Stats here), at once:
        # counted as L2 hits...
        assert next(t.hits for t in kv.stats().tiers if t.tier == "dram") == hits + 8
        assert kv.get(first) == [b"1" * size] * 8
        # ... and ahead of its next request on the local path (this put's Reserve): touched
        # before the put makes room, so the blocks not read go first.
        kv.put(third, [b"3" * size] * 8, independent=True)
    with KVStoreClient(d.target, "ns", read_table=False) as kv:
        found_first = [t is not None for t in kv.lookup(first).tiers]
        found_second = [t is not None for t in kv.lookup(second).tiers]
    assert all(found_first), "blocks read through the table were evicted as if unused"
    assert not all(found_second)


# --- readers against a writer under pressure, in processes of their own -------------------


def _payload(key: bytes, size: int) -> np.ndarray:
    """The block put under key: its bytes follow from the key alone."""
    return np.resize(np.frombuffer(hashlib.sha512(key).digest(), np.uint8), size)


def _key(i: int) -> bytes:
    return hashlib.sha256(f"soak-{i}".encode()).digest()


def _size(i: int) -> int:
    return (64 + (i * 37) % 448) * 1024  # 64 KiB to 511 KiB


def _writer(target: str, until: float, latest: Any) -> None:
    with KVStoreClient(target, "soak") as kv:
        i = 0
        while time.time() < until:
            batch = list(range(i, i + 4))
            kv.put([_key(j) for j in batch], [_payload(_key(j), _size(j)) for j in batch],
                   independent=True)
            i += 4
            latest.value = i


def _reader(target: str, until: float, latest: Any, verify: bool, out: Any) -> None:
    rng = np.random.default_rng(os.getpid())
    wrong = blocks = lookups = 0
    buffers = [np.empty(512 * 1024, np.uint8) for _ in range(8)]
    with KVStoreClient(target, "soak", verify_checksums=verify) as kv:
        while time.time() < until:
            top = latest.value
            if top < 8:
                time.sleep(0.01)
                continue
            picks = sorted({int(j) for j in rng.integers(max(0, top - 48), top, 8)})
            ks = [_key(j) for j in picks]
            got = kv.get_into(ks, buffers[:len(ks)])
            for j, size, buf in zip(picks, got, buffers, strict=False):
                if size is None:
                    continue
                blocks += 1
                if size != _size(j) or not np.array_equal(buf[:size], _payload(_key(j), size)):
                    wrong += 1
            found = kv.lookup(ks)
            lookups += 1
            assert 0 <= found.prefix_length <= len(ks)
        tables = kv._shm.tables
        out.put({"verify": verify, "wrong": wrong, "blocks": blocks, "lookups": lookups,
                 "table_hits": tables.hits if tables else 0,
                 "table_rejected": tables.rejected if tables else 0})


def test_readers_never_accept_a_wrong_byte_while_pages_are_reused(
        daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    # 8 MiB of L2 (about 28 blocks) and a small L3: every put evicts or demotes, and each
    # freed page is soon written again by the next put.
    d = daemon_factory("dram.capacity_bytes=8MiB", "dram.page_size_bytes=4KiB",
                       "nvme.capacity_bytes=32MiB", f"server.unix_socket={tmp_path / 'kv.sock'}")
    ctx = multiprocessing.get_context("spawn")
    latest, out = ctx.Value("q", 0), ctx.Queue()
    until = time.time() + 3 + SOAK_S  # spawned processes take a few seconds to start
    procs = [ctx.Process(target=_writer, args=(d.target, until, latest))]
    procs += [ctx.Process(target=_reader, args=(d.target, until, latest, verify, out))
              for verify in (True, False)]
    for p in procs:
        p.start()
    results = [out.get(timeout=SOAK_S + 60) for _ in range(2)]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0, f"a soak process failed (exit {p.exitcode})"
    print("table soak:", results, "puts:", latest.value)
    for r in results:
        assert r["wrong"] == 0, r
        assert r["table_hits"] > 0 and r["blocks"] > r["table_hits"] // 2, r


def test_a_get_larger_than_l2_copies_what_l2_holds_and_asks_for_the_rest(
        pressure: Daemon, ns: str) -> None:
    """The daemon's Get of more than L2 holds gets the prefix that fits
    (test_l3_reads_under_pressure.py); through the table, the blocks in L2 are copied out
    first, so they are hits too, and the daemon loads the rest from L3 in their place."""
    ks, values = l3_blocks(2 * L2_PAGES, seed=16)
    with KVStoreClient(pressure.target, ns, shared_memory=True,
                       unix_socket=str(pressure.unix_socket)) as kv:
        fill(kv, ks, values)
        asked = ks[: L2_PAGES + 16]
        got = kv.get(asked)
        assert all(g is None or g == v for g, v in zip(got, values, strict=False))
        # The daemon alone gives the L2_PAGES that fit; the table adds what L2 held (all
        # but what the mover took to L3 meanwhile).
        assert table_reads(kv).hits > 0
        assert sum(g is not None for g in got) == L2_PAGES + table_reads(kv).hits
