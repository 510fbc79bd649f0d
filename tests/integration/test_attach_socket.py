"""The daemon's Unix socket under attack (a real daemon with auth.mode=token, its real 2 s
deadline per ticket line, real clients): slow connections do not keep a client that starts
meanwhile from its arena and its local path, the attack's connections are gone within the
deadline once it stops, descriptors a client passes with its line are not kept, a ticket
gives its own tenant's arena alone, and nothing a client sends puts a Traceback in the log.

The broad fuzz of the socket, with a victim measured throughout, is test_local_attacks.py."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from kvstore.client import KVStoreClient
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.tools.testing import Daemon
from tests.helpers import wait_until
from tests.integration.test_auth import A_NS, TOKENS, md
from tests.integration.test_tenant_shm import evict_everything, token_daemon
from tests.unit.test_attach import SLACK_S, Slowloris, closed

DEADLINE_S = 2.0  #: kvstore.daemon.attach.EXCHANGE_TIMEOUT_S, the daemon's
#: A client's start (Attach, the exchange, a session's handshake, a put and a get) during
#: the attack: tens of milliseconds; before, its exchange was closed at once, unanswered.
CLIENT_S = 2.0


@pytest.fixture
def daemon(shared_daemon: Callable[..., Daemon],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The session's token daemon: emptied when the test ends, and no Traceback in what it
    logged meanwhile."""
    d = token_daemon(shared_daemon, tmp_path_factory)
    logged = len(d.log())
    yield d
    evict_everything(d)
    assert "Traceback" not in d.log()[logged:]


@pytest.fixture
def stub(daemon: Daemon) -> Iterator[rpc.KVStoreStub]:
    with grpc.insecure_channel(daemon.target) as channel:
        yield rpc.KVStoreStub(channel)


def path_of(daemon: Daemon) -> str:
    assert daemon.unix_socket is not None
    return str(daemon.unix_socket)


def ticket(stub: rpc.KVStoreStub, tenant: str) -> str:
    return str(stub.Attach(pb.AttachRequest(), metadata=md(tenant)).ticket)


def exchange(path: str, line: str, fds: list[int] | None = None) -> tuple[dict[str, object],
                                                                         list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        if fds:
            socket.send_fds(s, [line.encode() + b"\n"], fds)
        else:
            s.sendall(line.encode() + b"\n")
        data, got, _, _ = socket.recv_fds(s, 65536, 16)
    return json.loads(data), got


def start_a_client(daemon: Daemon) -> float:
    """A client of team-a from scratch: its arena and a local session, a put and a get; the
    seconds it took. Shared memory and the local path it must get, not fall back from."""
    started = time.monotonic()
    with KVStoreClient(daemon.target, A_NS, token=TOKENS["team-a"], shared_memory=True) as kv:
        key = os.urandom(32)
        assert kv.put([key], [b"v" * 70_000]).stored == 1
        assert kv.get([key]) == [b"v" * 70_000]
        assert kv.uses_shared_memory and kv._shm.local is not None
    return time.monotonic() - started


def test_a_slowloris_does_not_keep_a_new_client_from_shared_memory(
        daemon: Daemon, stub: rpc.KVStoreStub) -> None:
    """8 connections trickle a byte every 0.5 s (before: every exchange slot held for ~6
    minutes, and every other connection closed at once). A client started meanwhile gets its
    arena and its local session; a raw `HOT` handshake is answered; once the trickle stops,
    the daemon closes every attack connection within the deadline."""
    path = path_of(daemon)
    attack = Slowloris(path, 8)
    try:
        time.sleep(0.6)  # a byte or two in
        assert start_a_client(daemon) < CLIENT_S
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(path)
            s.sendall(f"HOT {ticket(stub, 'team-b')}\n".encode())
            assert "hot" in json.loads(s.recv(4096))
        message, fds = exchange(path, ticket(stub, "team-b"))
        assert [a["name"] for a in message["arenas"]] == ["team-b"]  # type: ignore[attr-defined]
        for fd in fds:
            os.close(fd)
        last_byte = attack.stop()
        gone = wait_until(lambda: all(closed(s) for s in attack.conns),
                          "every attack connection closed", timeout_s=10)
        assert gone - last_byte < DEADLINE_S + SLACK_S
    finally:
        attack.close()
    assert start_a_client(daemon) < CLIENT_S  # and after


def test_descriptors_passed_with_a_line_are_not_kept(daemon: Daemon,
                                                    stub: rpc.KVStoreStub) -> None:
    """A pipe's write end passed with a good ticket, a forged one, a half line that is then
    closed and one still pending: once this test closes its copy, the read end sees
    EOF (the daemon holds none: it reads with plain recv, so the kernel drops them), and the
    daemon's descriptor count is back where it was."""
    path = path_of(daemon)
    daemon_fds = f"/proc/{daemon.proc.pid}/fd"
    good = ticket(stub, "team-a")  # the channel's connection is open from here on
    before = len(os.listdir(daemon_fds))
    read_end, write_end = os.pipe()
    message, fds = exchange(path, good, [write_end] * 4)
    assert [a["name"] for a in message["arenas"]] == ["team-a"]  # type: ignore[attr-defined]
    for fd in fds:
        os.close(fd)
    message, fds = exchange(path, "forged", [write_end])
    assert message["reason"] == "UNAUTHENTICATED" and fds == []
    half = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    half.connect(path)
    socket.send_fds(half, [b"half a"], [write_end])
    half.close()
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    idle.connect(path)
    socket.send_fds(idle, [b"half a"], [write_end, write_end])
    os.close(write_end)
    os.set_blocking(read_end, False)

    def eof() -> bool:
        try:
            return os.read(read_end, 1) == b""
        except BlockingIOError:
            return False

    wait_until(eof, "EOF on the pipe: the daemon kept no copy of its write end",
               timeout_s=DEADLINE_S + 5)  # read and dropped with the half line's bytes
    os.close(read_end)
    assert not closed(idle)  # still pending: its passed descriptors went with its bytes
    idle.close()
    wait_until(lambda: len(os.listdir(daemon_fds)) <= before, "the daemon's count as before")


def test_a_ticket_gives_its_own_tenants_arena_and_is_used_once(
        daemon: Daemon, stub: rpc.KVStoreStub) -> None:
    """Whoever presents it, a ticket gives the arena of the tenant it was issued to; dressed
    up (another tenant's name after it, two tickets on one line) it is no ticket, and is not
    used up; once used, it is refused to everyone."""
    path = path_of(daemon)
    a, b = ticket(stub, "team-a"), ticket(stub, "team-b")
    for line in (f"{a} team-b", f"team-b {a}", f"{a} {b}", f"{b}{a}"):
        message, fds = exchange(path, line)
        assert message["reason"] == "UNAUTHENTICATED" and fds == [], line
    for t, tenant in ((b, "team-b"), (a, "team-a")):
        message, fds = exchange(path, t)
        assert [x["name"] for x in message["arenas"]] == [tenant]  # type: ignore[attr-defined]
        for fd in fds:
            os.close(fd)
        again, none = exchange(path, t)
        assert again["reason"] == "UNAUTHENTICATED" and none == []
