"""The Limits verb through the client library: both clients read the daemon's limits, and an
inline Put fits its messages to them whatever chunk_bytes the client was made with."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import pytest

from kvstore.client import AsyncKVStoreClient, KVStoreClient
from kvstore.tools.testing import Daemon

MiB = 1 << 20


@pytest.fixture
def daemon(shared_daemon: Callable[..., Daemon]) -> Daemon:
    # Smaller messages than the client's defaults (16 MiB messages, 4 MiB chunks).
    return shared_daemon("dram.capacity_bytes=32MiB", "server.max_message_bytes=2MiB",
                         "server.chunk_bytes=1MiB", "server.max_batch_keys=100",
                         "leases.lease_timeout_s=7")


def test_both_clients_read_the_daemons_limits(daemon: Daemon, ns: str) -> None:
    with KVStoreClient(daemon.target, ns) as kv:
        limits = kv.limits()
        assert kv.limits() is limits  # asked once
    assert (limits.contract, limits.max_message_bytes, limits.chunk_bytes) == (
        "kvstore.v1", 2 * MiB, 1 * MiB)
    assert (limits.max_batch_keys, limits.default_lease_ms, limits.key_bytes) == (100, 7000, 32)
    assert limits.shared_memory and limits.auth_mode == "off"

    async def aio() -> None:
        async with AsyncKVStoreClient(daemon.target, ns) as kv:
            assert await kv.limits() == limits
    asyncio.run(aio())


def test_an_inline_put_fits_its_messages_to_the_daemon(daemon: Daemon, ns: str) -> None:
    # The client's 4 MiB chunks would be refused by a daemon taking 2 MiB messages.
    blocks = [os.urandom(3 * MiB + 17), os.urandom(100)]
    keys = [bytes([i]) * 32 for i in range(2)]
    with KVStoreClient(daemon.target, ns, shared_memory=False) as kv:
        assert kv.chunk_bytes == 4 * MiB
        assert kv.put(keys, blocks, independent=True).stored == 2
        assert kv.get(keys) == blocks

    async def aio() -> None:
        more = [bytes([9 + i]) * 32 for i in range(2)]
        async with AsyncKVStoreClient(daemon.target, ns, shared_memory=False) as kv:
            assert (await kv.put(more, blocks, independent=True)).stored == 2
            assert await kv.get(more) == blocks
    asyncio.run(aio())
