"""Who a caller is for the per-client caps, and how many streams one client may hold
(kvstore.daemon.admission): pure functions of gRPC's peer string and the config."""

from __future__ import annotations

import pytest

from kvstore.daemon.admission import client_of, client_stream_cap
from kvstore.daemon.config import load_config


@pytest.mark.parametrize(("peer", "client"), [
    ("ipv4:10.0.0.7:51234", "ipv4:10.0.0.7"),
    ("ipv6:%5B::1%5D:40000", "ipv6:[::1]"),  # gRPC escapes the brackets
    ("ipv6:%5Bfe80::1%5D:1", "ipv6:[fe80::1]"),
    ("unix:/run/kvstore.sock", "unix:/run/kvstore.sock"),
    ("unix:", "unix:"),
])
def test_a_client_is_its_peer_host(peer: str, client: str) -> None:
    assert client_of(peer) == client


@pytest.mark.parametrize(("settings", "cap"), [
    ((), 5),  # 8 workers: 6 streams, a quarter of them (1) kept for others
    (("server.workers=18",), 12),  # 16 streams, 4 kept
    (("server.workers=3",), 1),  # 1 stream: one client may still take it
    (("clients.max_streams=6",), 6),
])
def test_one_client_gets_the_stream_cap_less_a_quarter(settings: tuple[str, ...],
                                                        cap: int) -> None:
    assert client_stream_cap(load_config(env={}, overrides=settings)) == cap
