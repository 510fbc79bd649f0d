"""Puts from a grant (client/_grants.py, the local path's GRANT and COMMIT_GRANTED verbs),
against real daemon processes: posted commits come back through flush() or the next put,
refusals are never lost, a grant held by a client killed with kill -9 comes back at its
deadline, a daemon killed with kill -9 leaves every unanswered commit reported, and hostile
frames on the new verbs are refused with an error naming the field, damaging nothing."""

from __future__ import annotations

import os
import secrets
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvstore.client import KVStoreClient
from kvstore.client.errors import (
    DeadlineExceeded,
    InvalidArgument,
    KVStoreError,
    ResourceExhausted,
    Unavailable,
)
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.proto.localframe import (
    COMMIT_GRANTED,
    GRANT,
    GRANT_REPLY,
    RELEASE,
    commit_granted,
    grant_request,
)
from kvstore.shm import attach_segment
from kvstore.tools.testing import Daemon
from tests.helpers import RawSession, keys, wait_until
from tests.integration.test_auth import A_NS, B_NS, md
from tests.integration.test_tenant_shm import token_daemon

PAGE = 4096
#: Small pages, every commit's checksums re-read, reservations (and grants) held 2 s.
SETTINGS = ("dram.capacity_bytes=16MiB", f"dram.page_size_bytes={PAGE}", "nvme.enabled=false",
            "dram.verify_commits=all", "leases.reservation_timeout_s=2")
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


@pytest.fixture
def daemon(daemon_factory: Callable[..., Daemon], tmp_path: Path) -> Daemon:
    """A daemon of this test's own, with a local path (its holdings are read whole)."""
    return daemon_factory(*SETTINGS, f"server.unix_socket={tmp_path / 'kv.sock'}")


def blocks_of(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def holdings(d: Daemon) -> dict[str, pb.ClientHoldings]:
    with grpc.insecure_channel(d.target) as channel:
        stats = rpc.KVStoreStub(channel).Stats(pb.StatsRequest(), timeout=10)
    return {c.client: c for c in stats.clients}


def free_dram_pages(d: Daemon) -> int:
    with grpc.insecure_channel(d.target) as channel:
        stats = rpc.KVStoreStub(channel).Stats(pb.StatsRequest(), timeout=10)
    return int(next(t.free_pages for t in stats.tiers if t.tier == pb.TIER_DRAM))


def test_posted_puts_are_provisional_until_flush_and_then_readable(daemon: Daemon) -> None:
    with KVStoreClient(daemon.target, "posted") as kv:
        batches = [(keys(8), blocks_of(8, 10_000 + i, i)) for i in range(6)]
        for ks, blocks in batches:
            result = kv.put(ks, blocks, wait=False)
            assert result.posted and result.stored == len(ks)
        assert kv.flush().stored == 6 * 8  # the daemon's answers, all of them
        assert kv.flush().stored == 0  # counted once
        for ks, blocks in batches:
            assert kv.get(ks) == [b.tobytes() for b in blocks]
        # A put that waits (it reserves) answers as the daemon does, existing keys too.
        ks, blocks = batches[0]
        waited = kv.put(ks, blocks)
        assert not waited.posted and (waited.stored, waited.existing) == (0, len(ks))
        assert kv.uses_local_path


def test_a_refused_posted_commit_is_raised_by_the_next_call_and_by_flush(daemon: Daemon) -> None:
    with KVStoreClient(daemon.target, "refused") as kv:
        k = keys(1)[0]
        # A chained put naming a block twice is refused when its commit is read.
        assert kv.put([k, k], blocks_of(2, 100, 1), wait=False).posted
        wait_until(lambda: _settled(kv), "the posted commit's answer")
        with pytest.raises(InvalidArgument) as raised:
            kv.put(keys(1), blocks_of(1, 100, 2))
        assert raised.value.field == "keys"
        kv.put(keys(1), blocks_of(1, 100, 3))  # raised once: the client goes on

        assert kv.put([k, k], blocks_of(2, 100, 4), wait=False).posted
        with pytest.raises(InvalidArgument):
            kv.flush()
        assert kv.flush().stored == 0  # nothing left to report

        # A read is a next call too: it raises the refusal before it reads.
        assert kv.put([k, k], blocks_of(2, 100, 5), wait=False).posted
        wait_until(lambda: _settled(kv), "the posted commit's answer")
        with pytest.raises(InvalidArgument):
            kv.lookup([k])
        assert kv.lookup([k]).prefix_length == 0  # raised once; the refused block is absent


def _settled(kv: KVStoreClient) -> bool:
    """Read the answers waiting on idle sessions (what the next call would do)."""
    local = kv._shm.local
    if local is not None:
        local.settle()
    return kv._grants is not None and kv._grants.posted.awaited == 0


def test_a_commit_whose_bytes_changed_is_refused_with_its_checksum_named(daemon: Daemon) -> None:
    """The writer's checksum is what the daemon checks (dram.verify_commits=all): bytes that
    changed in the pages after they were hashed are caught, reported, and not stored."""
    with KVStoreClient(daemon.target, "corrupt") as kv:
        kv.put(keys(1), blocks_of(1, 100, 0), wait=False)  # the first grant, the mapping
        kv.flush()
        grants = kv._grants
        assert grants is not None
        from kvstore.client import _requests as rq
        ks = keys(2)
        plan = rq.put_plan("corrupt", ks, blocks_of(2, 3 * PAGE, 5), None, False)
        placed = grants.place(plan)
        assert placed is not None
        segment = kv._shm.segment_named(placed[0].name)
        body = grants.write(plan, placed, kv._shm.segment_named)
        offset = int(placed[0].offsets[placed[1] + 3])  # block 1's first page
        segment.array[offset] ^= 0xFF  # a byte flipped after the writer hashed it
        grants.commit(body)
        with pytest.raises(InvalidArgument) as raised:
            kv.flush()
        assert raised.value.reason == "CHECKSUM_MISMATCH"
        assert raised.value.field == "blocks[1].checksum"
        assert kv.get(ks) == [None, None]  # neither block was stored


def test_no_room_for_a_grant_is_the_put_s_own_error(
        daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    """When the arena cannot make room (every block pinned), a put, posted or not, fails at
    once with the daemon's exact answer (it reserves after the grant is refused)."""
    d = daemon_factory(*SETTINGS, "clients.max_pinned_share=1",
                       f"server.unix_socket={tmp_path / 'kv.sock'}")
    with KVStoreClient(d.target, "full") as kv:
        pinned: list[bytes] = []
        with pytest.raises(ResourceExhausted):
            while True:
                ks = keys(16)
                kv.put(ks, blocks_of(16, 64 * 1024, len(pinned)), independent=True)
                kv.pin(ks)
                pinned += ks
        with pytest.raises(ResourceExhausted) as raised:
            kv.put(keys(4), blocks_of(4, 64 * 1024, 99), wait=False)
        assert raised.value.reason == "NO_ROOM"
        kv.unpin(pinned)
        assert kv.put(keys(4), blocks_of(4, 64 * 1024, 99), wait=False).posted
        assert kv.flush().stored == 4


_HOLDER = """
import sys, numpy as np
from kvstore.client import KVStoreClient
kv = KVStoreClient(sys.argv[1], "killed")
kv.put([bytes([7]) * 32], [np.ones(5000, np.uint8)], wait=False)
kv.flush()
print("held", flush=True)
sys.stdin.read()
"""


def test_a_client_killed_holding_a_grant_gets_its_pages_back_at_expiry(daemon: Daemon) -> None:
    free = free_dram_pages(daemon)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, daemon.target],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        held = holdings(daemon)[f"unix:pid:{holder.pid}"]
        assert held.reservations == 1 and held.reserved_bytes > 0  # its grant
        assert free_dram_pages(daemon) < free - 1
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
        # leases.reservation_timeout_s=2: the sweeper gives the grant's pages back.
        wait_until(lambda: f"unix:pid:{holder.pid}" not in holdings(daemon),
                   "the killed client's grant to expire", timeout_s=15)
        assert free_dram_pages(daemon) == free - 2  # only its one block (2 pages) stays
    finally:
        if holder.poll() is None:
            holder.kill()


def test_kill_9_of_the_daemon_leaves_every_unanswered_commit_reported(
        daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    """Commits posted while the daemon dies are never counted as stored: flush() raises
    Unavailable for them. Every batch whose commits were answered "stored" was readable."""
    # Room for every block the loop puts: nothing is evicted, so every miss is the kill's.
    d = daemon_factory(*SETTINGS, "dram.capacity_bytes=256MiB",
                       f"server.unix_socket={tmp_path / 'kv.sock'}")
    answered: list[tuple[list[bytes], list[np.ndarray]]] = []
    killing = threading.Event()  # set just before the signal: a read after it may miss
    with KVStoreClient(d.target, "crash") as kv:
        def killer() -> None:
            time.sleep(0.5)
            killing.set()
            d.proc.send_signal(signal.SIGKILL)

        threading.Thread(target=killer, daemon=True).start()
        failure: KVStoreError | None = None
        i = 0
        while failure is None and not killing.is_set():
            batch = [(keys(4), blocks_of(4, 20_000, i * 10 + j)) for j in range(3)]
            i += 1
            try:
                for ks, blocks in batch:
                    kv.put(ks, blocks, wait=False)
                assert kv.flush().stored == 12
            except KVStoreError as exc:
                failure = exc
                continue
            # Answered "stored": readable, unless the daemon is being killed meanwhile (a
            # client whose daemon died reads misses through its table).
            got = [kv.get(ks) for ks, _ in batch]
            want = [[b.tobytes() for b in blocks] for _, blocks in batch]
            assert got == want or killing.is_set()
            answered.extend(batch)
        d.proc.wait(10)
        # Whatever the loop's last step was, puts posted now are never taken as stored.
        with pytest.raises(KVStoreError):
            for j in range(4):
                kv.put(keys(4), blocks_of(4, 20_000, j), wait=False)
            kv.flush()
        if failure is not None:
            assert isinstance(failure, Unavailable | DeadlineExceeded), failure
    assert answered, "the daemon died before any commit was answered"


@pytest.fixture
def raw(daemon: Daemon) -> Iterator[RawSession]:
    """A local-path session written by hand (auth off)."""
    session = RawSession(str(daemon.unix_socket))
    yield session
    session.close()


def grant(session: RawSession, namespace: str, pages: int) -> tuple[bytes, list[int], str]:
    """A grant taken by hand: (id, each page's offset, the segment or arena named)."""
    session.send(GRANT, grant_request(namespace, pages))
    status, _, body = session.reply()
    assert status == 0, body
    gid, _, _, n, shm_len, arena_len = GRANT_REPLY.unpack_from(body)
    at = GRANT_REPLY.size + shm_len + arena_len
    name = body[GRANT_REPLY.size:at].decode()
    return gid, list(struct.unpack_from(f"<{n}Q", body, at)), name


def commit(session: RawSession, gid: bytes, namespace: str,
           blocks: list[tuple[bytes, int, int, int]], pages: list[int]) -> tuple[int, bytes]:
    session.send(COMMIT_GRANTED, commit_granted(
        gid, namespace, b"", True, blocks, struct.pack(f"<{len(pages)}I", *pages)))
    status, _, body = session.reply()
    return status, body


def test_hostile_commits_are_refused_naming_the_field_and_change_nothing(
        daemon: Daemon, raw: RawSession) -> None:
    import xxhash
    from google.rpc import status_pb2

    from kvstore.client.errors import from_status_proto

    def refused(status: int, body: bytes) -> KVStoreError:
        assert status == INVALID, (status, body)
        return from_status_proto(status_pb2.Status.FromString(body))

    gid, offsets, name = grant(raw, "hostile", 8)
    segment = attach_segment(name)
    data = bytes(range(256)) * 16  # one page
    segment.buf[offsets[0]:offsets[0] + PAGE] = data
    good = (keys(1)[0], PAGE, xxhash.xxh3_64_intdigest(data), 1)
    # An unknown grant, a page past the grant, a page named twice, too few pages.
    assert refused(*commit(raw, secrets.token_bytes(16), "hostile", [good], [0])).field \
        == "grant_id"
    assert refused(*commit(raw, gid, "hostile", [good], [8])).field == "blocks[0].pages"
    two = [good, (keys(1)[0], PAGE, 0, 1)]
    assert refused(*commit(raw, gid, "hostile", two, [0, 0])).field == "blocks[0].pages"
    assert refused(*commit(raw, gid, "hostile", [(good[0], 2 * PAGE, 0, 1)], [0])).field \
        == "blocks[0].pages"
    # Truncated and malformed bodies.
    whole = commit_granted(gid, "hostile", b"", True, [good], struct.pack("<I", 0))
    for cut in (0, 5, 22, len(whole) - 1):
        raw.send(COMMIT_GRANTED, whole[:cut])
        status, _, body = raw.reply()
        assert status == INVALID and b"CommitGranted" in body, (cut, body)
    for bad_grant in (b"", b"\x01\x00\x00"):
        raw.send(GRANT, bad_grant)
        assert raw.reply()[0] == INVALID
    raw.send(GRANT, grant_request("hostile", 0))
    assert b"pages" in raw.reply()[2]
    # None of that used a page: the good commit still takes page 0, once.
    status, body = commit(raw, gid, "hostile", [good], [0])
    assert status == 0 and pb.PutResponse.FromString(body).stored == 1
    assert refused(*commit(raw, gid, "hostile", [(keys(1)[0], PAGE, 0, 1)], [0])).field \
        == "blocks[0].pages"  # used now
    raw.send(RELEASE, pb.ReleaseRequest(ids=[gid.hex()]).SerializeToString())
    assert raw.reply()[0] == 0
    assert refused(*commit(raw, gid, "hostile", [good], [1])).reason == "RESERVATION_EXPIRED"
    segment.close()
    with KVStoreClient(daemon.target, "hostile") as kv:
        assert kv.get([good[0]]) == [data]


def test_random_bodies_on_the_new_verbs_get_errors_and_the_session_goes_on(
        daemon: Daemon, raw: RawSession) -> None:
    rng = np.random.default_rng(36)
    gid, _, _ = grant(raw, "fuzz", 4)
    head = commit_granted(gid, "fuzz", b"", True, [(keys(1)[0], 100, 0, 1)], b"\0\0\0\0")
    for i in range(300):
        verb = (GRANT, COMMIT_GRANTED)[i % 2]
        body = rng.integers(0, 256, int(rng.integers(0, 80)), dtype=np.uint8).tobytes()
        if i % 3 == 0:  # a real head with random bytes after it
            body = head[:int(rng.integers(0, len(head)))] + body
        raw.send(verb, body)
        status, flags, body = raw.reply()
        assert not flags & 1  # the session stays open
        assert status not in (grpc.StatusCode.INTERNAL.value[0],
                              grpc.StatusCode.UNKNOWN.value[0]), body
    assert raw.call(RELEASE, pb.ReleaseRequest())[0] == 0  # the session serves on


def test_another_tenant_cannot_commit_into_a_grant_or_name_its_pages(
        shared_daemon: Callable[..., Daemon],
        tmp_path_factory: pytest.TempPathFactory) -> None:
    d = token_daemon(shared_daemon, tmp_path_factory)
    with grpc.insecure_channel(d.target) as channel:
        stub = rpc.KVStoreStub(channel)
        a = RawSession(str(d.unix_socket), stub.Attach(pb.AttachRequest(),
                                                        metadata=md("team-a")).ticket)
        b = RawSession(str(d.unix_socket), stub.Attach(pb.AttachRequest(),
                                                        metadata=md("team-b")).ticket)
    try:
        gid, offsets, arena = grant(a, A_NS, 2)
        assert arena and offsets
        block = [(keys(1)[0], 10, 0, 1)]
        # B names A's grant: unknown to B (whoever asks, a grant is its client's only).
        status, body = commit(b, gid, B_NS, block, [0])
        assert status == INVALID and b"grant_id" in body
        # B names A's namespace: refused before any grant is looked at.
        status, body = commit(b, gid, A_NS, block, [0])
        assert status == grpc.StatusCode.PERMISSION_DENIED.value[0], body
        b.send(GRANT, grant_request(A_NS, 1))
        assert b.reply()[0] == grpc.StatusCode.PERMISSION_DENIED.value[0]
        # Nothing B sent used a page of A's grant: A's commit is checked against its bytes
        # (a checksum that does not match what the page holds is refused).
        status, body = commit(a, gid, A_NS, block, [0])
        assert status == INVALID and b"CHECKSUM_MISMATCH" in body
    finally:
        a.close()
        b.close()
