"""The Unix socket that hands a tenant its arenas (kvstore.daemon.attach), with a real DRAM
tier split into memfd arenas: a ticket is good once and for its tenant alone, floods of idle
connections are refused, and what a tenant's mapping writes lands in its arena only."""

from __future__ import annotations

import json
import mmap
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.core.errors import ResourceExhausted, StartupError
from kvstore.daemon.attach import MAX_TICKETS_PER_TENANT, AttachSocket, Tickets
from kvstore.extents import Arena, PageRun
from kvstore.tiers.dram import DramTier

PAGE = 64 * 1024


@pytest.fixture
def dram() -> Iterator[DramTier]:
    tier = DramTier(16 * PAGE, PAGE, "unused", pin_memory=False,
                    arenas=[Arena("a", 0, 4), Arena("b", 4, 12)])
    yield tier
    tier.close()


@pytest.fixture
def served(tmp_path: Path, dram: DramTier) -> Iterator[tuple[str, Tickets]]:
    tickets = Tickets()
    path = str(tmp_path / "kv.sock")
    sock = AttachSocket(path, tickets, dram.arena_fds)
    sock.start()
    yield path, tickets
    sock.close()
    assert not os.path.exists(path)


def exchange(path: str, line: bytes) -> tuple[dict[str, object], list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(line)
        data, fds, _, _ = socket.recv_fds(s, 65536, 16)
    return json.loads(data), fds


def test_a_ticket_gives_its_tenant_its_arena_once(served: tuple[str, Tickets],
                                                   dram: DramTier) -> None:
    path, tickets = served
    ticket = tickets.issue("a")
    message, fds = exchange(path, ticket.encode() + b"\n")
    assert message == {"arenas": [{"name": "a", "size_bytes": 4 * PAGE}]} and len(fds) == 1
    view = mmap.mmap(fds[0], 4 * PAGE)
    os.close(fds[0])
    view[:] = b"\x01" * (4 * PAGE)  # all of a's memory
    assert dram.checksum(dram.extents([PageRun(4, 12)], 12 * PAGE)) == \
        dram.checksum([(4 * PAGE, 12 * PAGE)])  # b's bytes: still zeros, and unchanged
    assert bytes(next(dram.views([(4 * PAGE, 16)]))) == bytes(16)
    assert bytes(next(dram.views([(0, 4)]))) == b"\x01" * 4  # a's writes are a's pages
    assert dram.arena_extents([(5 * PAGE + 3, 10)]) == ("b", [(PAGE + 3, 10)])
    again, none = exchange(path, ticket.encode() + b"\n")
    assert "error" in again and none == []


@pytest.mark.parametrize("line", [b"forged\n", b"\n", b"x" * 5000, b""])
def test_bad_tickets_get_an_error_and_no_descriptor(served: tuple[str, Tickets],
                                                    line: bytes) -> None:
    message, fds = exchange(served[0], line)
    assert "error" in message and fds == []


def test_tickets_expire_and_are_capped() -> None:
    now = [0.0]
    tickets = Tickets(clock=lambda: now[0])
    old = tickets.issue("a")
    now[0] = 31.0
    assert tickets.redeem(old) is None
    for _ in range(MAX_TICKETS_PER_TENANT):
        tickets.issue("a")
    with pytest.raises(ResourceExhausted, match="Attach tickets"):
        tickets.issue("a")
    assert tickets.redeem(tickets.issue("b")) == "b"  # others are not held up


def test_idle_connections_do_not_block_others(served: tuple[str, Tickets]) -> None:
    path, tickets = served
    idle = []
    for _ in range(20):  # more than MAX_EXCHANGES, none sending anything
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        idle.append(s)
    deadline = time.monotonic() + 10  # the idle ones time out after EXCHANGE_TIMEOUT_S
    while True:
        try:
            message, fds = exchange(path, tickets.issue("b").encode() + b"\n")
            break
        except (ConnectionError, json.JSONDecodeError, OSError):
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert message["arenas"] == [{"name": "b", "size_bytes": 12 * PAGE}]
    for fd in fds:
        os.close(fd)
    for s in idle:
        s.close()


def test_a_file_in_the_way_is_not_replaced(tmp_path: Path) -> None:
    path = tmp_path / "not-a-socket"
    path.write_text("keep me")
    with pytest.raises(StartupError, match="not a socket"):
        AttachSocket(str(path), Tickets(), lambda _: [])
    assert path.read_text() == "keep me"
