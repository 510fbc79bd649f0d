"""A client refused the same-host paths tries again later (the session's token daemon, its
tenant team-a, raw sockets and raw Attach calls as the attacker, the real clients as the
victim): refused local sessions or out of Attach tickets, it moves its data inline or over
gRPC meanwhile, every call succeeding, and is back on shared memory and the local path within
5 s of the refusals ending, without spending a ticket per try; a pooled session the daemon
closed while it sat idle is replaced without a failed call. Both clients, since the steps are
written once (client/_base.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import select
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from kvstore.client import AsyncKVStoreClient, KVStoreClient, Retry
from kvstore.client._attach import TicketKeeper
from kvstore.client._localpath import LocalPath, _Session
from kvstore.daemon.localpath import REAP_IDLE_S
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.proto.localframe import COMMIT, LOOKUP
from kvstore.tools.testing import Daemon
from tests.helpers import RawSession, blocks, keys, metric, open_stub, wait_until
from tests.integration.test_auth import A_NS, TOKENS, md
from tests.integration.test_tenant_shm import evict_everything, exchange, token_daemon

#: The issue's target: back on shared memory and the local path within this of an attack's end.
BACK_WITHIN_S = 5.0
#: How long each attack lasts: long enough for several tries after pauses, short for the suite.
ATTACK_S = 1.0


@pytest.fixture
def daemon(shared_daemon: Callable[..., Daemon],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The session's token daemon with a Unix socket (test_tenant_shm.py), emptied after."""
    d = token_daemon(shared_daemon, tmp_path_factory)
    yield d
    evict_everything(d)


@pytest.fixture
def stub(daemon: Daemon) -> Iterator[rpc.KVStoreStub]:
    with open_stub(daemon.target) as s:
        yield s


def sock_of(daemon: Daemon) -> str:
    assert daemon.unix_socket is not None
    return str(daemon.unix_socket)


def attaches(daemon: Daemon) -> float:
    """Attach calls the daemon has answered OK so far: the tickets it has issued."""
    return metric(daemon, "kvstore_rpc_latency_seconds_count", method="Attach", code="OK")


def local_requests(daemon: Daemon, method: str) -> float:
    return metric(daemon, "kvstore_local_requests_total", method=method)


class Victim:
    """One client of team-a, blocking or awaited (on a loop of its own), driven from the
    test's thread: `do("get", keys)` is the same call whichever it is."""

    def __init__(self, kind: str, target: str, **options: Any) -> None:
        self._runner = asyncio.Runner() if kind == "async" else None
        options = {"token": TOKENS["team-a"], **options}
        if self._runner is None:
            self.kv: Any = KVStoreClient(target, A_NS, **options)
        else:
            async def make() -> AsyncKVStoreClient:
                return AsyncKVStoreClient(target, A_NS, **options)
            self.kv = self._runner.run(make())

    def do(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self.kv, verb)(*args, **kwargs)
        return self._runner.run(result) if self._runner is not None else result

    @property
    def local(self) -> LocalPath | None:
        """The local path, when it holds a session (after a call it pooled), else None."""
        local: LocalPath | None = self.kv._shm._local
        return local if local is not None and local._idle else None

    def round(self, ks: list[bytes], vs: list[bytes]) -> None:
        """A put, a get and a lookup, each checked: what an engine does between batches."""
        self.do("put", ks, vs)
        assert self.do("get", ks) == vs
        assert self.do("lookup", ks).prefix_length == len(ks)

    def close(self) -> None:
        self.do("close")
        if self._runner is not None:
            self._runner.close()


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Holders:
    """The attacker of the local path: team-a's sessions, opened with tickets from Attach
    until the daemon refuses one, each kept busy (the first byte of a frame sent, the rest
    never), so that none is idle for the daemon to close to make room."""

    def __init__(self, stub: rpc.KVStoreStub, path: str) -> None:
        self.sessions: list[RawSession] = []
        for _ in range(64):  # past the cap (32), with room for sessions of earlier tests
            ticket = stub.Attach(pb.AttachRequest(), metadata=md("team-a")).ticket
            raw = RawSession(path, ticket)
            if "hot" not in raw.hello:
                raw.close()
                assert raw.hello.get("reason") == "TOO_MANY_SESSIONS", raw.hello
                return
            raw.s.sendall(b"\x00")  # a frame begun: not idle from now on
            self.sessions.append(raw)
        raise AssertionError("the daemon never refused a session")

    def close(self) -> None:
        for raw in self.sessions:
            raw.close()


def test_refused_local_sessions_go_over_grpc_and_come_back_within_5s(
        daemon: Daemon, stub: rpc.KVStoreStub, kind: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "kvstore.client")
    ks, vs = blocks(4, 4096)
    holders = Holders(stub, sock_of(daemon))
    victim = Victim(kind, daemon.target)
    try:
        issued, served = attaches(daemon), local_requests(daemon, "Lookup")
        deadline = time.monotonic() + ATTACK_S
        while time.monotonic() < deadline:  # every call succeeds meanwhile, over gRPC
            victim.round(ks, vs)
            assert victim.kv.uses_shared_memory is True  # the arenas are not capped
            assert victim.local is None
        assert local_requests(daemon, "Lookup") == served
        # Tries after pauses sent the ticket the first refusal kept: the arenas' ticket and
        # the local path's, not one a try.
        assert attaches(daemon) - issued <= 3
    finally:
        holders.close()
    try:
        ended = time.monotonic()
        while victim.local is None:
            assert time.monotonic() - ended < BACK_WITHIN_S, "the local path did not come back"
            victim.round(ks, vs)
            time.sleep(0.01)
        served = local_requests(daemon, "Lookup")
        victim.round(ks, vs)
        assert local_requests(daemon, "Lookup") == served + 1  # the hot verbs over the socket
    finally:
        victim.close()
    said = [r.getMessage() for r in caplog.records if "local path" in r.getMessage()]
    assert [m.split(",")[0].split(" after")[0] for m in said] == [
        "kvstore: local path off for now", "kvstore: local path back on"], said
    assert "TOO_MANY_SESSIONS" in said[0] or "at most" in said[0]


class SpentTickets:
    """The attacker of Attach: team-a's unused tickets, asked for until the daemon refuses
    (64 a tenant), then redeemed on the socket to end the attack."""

    def __init__(self, stub: rpc.KVStoreStub, path: str) -> None:
        self.path = path
        self.tickets: list[str] = []
        for _ in range(80):
            try:
                reply = stub.Attach(pb.AttachRequest(), metadata=md("team-a"))
            except grpc.RpcError as exc:
                assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                return
            self.tickets.append(reply.ticket)
        raise AssertionError("the daemon never refused a ticket")

    def redeem(self) -> None:
        for ticket in self.tickets:
            _, fds = exchange(self.path, ticket)
            for fd in fds:
                os.close(fd)
        self.tickets = []


def test_out_of_tickets_moves_data_inline_until_tickets_are_back(
        daemon: Daemon, stub: rpc.KVStoreStub, kind: str) -> None:
    ks, vs = blocks(4, 4096)
    spent = SpentTickets(stub, sock_of(daemon))
    victim = Victim(kind, daemon.target)
    try:
        deadline = time.monotonic() + ATTACK_S
        while time.monotonic() < deadline:
            victim.round(ks, vs)
            assert victim.kv.uses_shared_memory is False and victim.local is None
        spent.redeem()
        ended = time.monotonic()
        while not (victim.kv.uses_shared_memory and victim.local is not None):
            assert time.monotonic() - ended < BACK_WITHIN_S, "shared memory did not come back"
            victim.round(ks, vs)
            time.sleep(0.01)
        victim.round(ks, vs)
    finally:
        spent.redeem()
        victim.close()


def reap_idle_sessions(daemon: Daemon, stub: rpc.KVStoreStub) -> None:
    """Make the daemon close team-a's idle sessions for real: once they have been idle for
    REAP_IDLE_S, handshakes past the tenant's cap close them to make room. Then the
    handshakes' own sessions are closed, and gone from the daemon, so new ones fit."""
    time.sleep(REAP_IDLE_S + 0.2)
    Holders(stub, sock_of(daemon)).close()
    wait_until(lambda: metric(daemon, "kvstore_local_sessions") == 0,
               "the holders' sessions to be gone")


def hung_up(sock: socket.socket) -> bool:
    """Whether the daemon has closed its end of a session: the stream ends where it waits."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""


def test_a_pooled_session_the_daemon_closed_is_replaced_without_a_failed_call(
        daemon: Daemon, stub: rpc.KVStoreStub, kind: str) -> None:
    ks, vs = blocks(2, 4096)
    # One try a call: a call that met the closed session would fail, not be retried.
    victim = Victim(kind, daemon.target, retry=Retry(attempts=1))
    try:
        victim.round(ks, vs)
        local = victim.local
        assert local is not None and len(local._idle) == 1
        closed = local._idle[0]
        reap_idle_sessions(daemon, stub)
        assert hung_up(closed.sock)  # the daemon closed it
        victim.round(ks, vs)
        assert closed not in local._idle and local._idle  # a new session, pooled
        assert victim.local is local  # the same local path, never turned off
    finally:
        victim.close()


def test_a_session_cut_before_its_request_resends_all_but_a_commit(
        daemon: Daemon, stub: rpc.KVStoreStub, monkeypatch: pytest.MonkeyPatch) -> None:
    tickets = TicketKeeper(lambda: stub.Attach(pb.AttachRequest(), metadata=md("team-a")))
    local = LocalPath(sock_of(daemon), tickets, timeout_s=10.0)
    try:
        local.probe()
        local.probe()  # each opens a session of its own and pools it
        first = local._idle[0]
        assert len(local._idle) == 2
        reap_idle_sessions(daemon, stub)
        assert all(hung_up(s.sock) for s in local._idle)
        # The daemon's close lands between the check and the request: as if it had passed.
        monkeypatch.setattr(_Session, "alive", lambda self: True)
        commits = local_requests(daemon, "Put")
        with pytest.raises(Exception, match="local session broke") as failed:
            local.call(COMMIT, pb.PutRequest(namespace=A_NS, reservation_id="r"),
                       pb.PutResponse)
        assert type(failed.value).__name__ == "Unavailable"  # the client retries the put whole
        assert local_requests(daemon, "Put") == commits  # and did not send it again
        lookups = local_requests(daemon, "Lookup")
        answer = local.call(LOOKUP, pb.LookupRequest(namespace=A_NS, keys=keys(2)),
                            pb.LookupResponse)
        assert list(answer.tiers) == [0, 0]  # sent again on a fresh session
        assert local_requests(daemon, "Lookup") == lookups + 1
        assert first not in local._idle
    finally:
        local.close()
