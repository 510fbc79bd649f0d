"""Block events for routers (the WatchEvents verb) on real daemons: numbered without gaps under
concurrent puts, CLEARED first, MOVED on demotion and REMOVED on eviction, replayed from a
sequence still held, a gap reported when the buffer overflowed, a fresh daemon_id and CLEARED
after a restart (with the blocks it re-adopted from L3), and each tenant's stream its own."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore.client import KVStoreClient
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.tools.testing import Daemon
from tests.helpers import blocks, wait_until
from tests.integration.test_auth import TOKENS, auth_settings, md, tenants_doc, write_tenants

STORED, MOVED, REMOVED, CLEARED = (pb.BLOCK_EVENT_KIND_STORED, pb.BLOCK_EVENT_KIND_MOVED,
                                   pb.BLOCK_EVENT_KIND_REMOVED, pb.BLOCK_EVENT_KIND_CLEARED)
DRAM, NVME = pb.TIER_DRAM, pb.TIER_NVME
SMALL = ("dram.capacity_bytes=2MiB", "dram.page_size_bytes=64KiB", "nvme.capacity_bytes=16MiB",
         "nvme.page_size_bytes=64KiB", "movers.interval_s=0.02")


class Watcher:
    """A router's subscription: WatchEvents on a thread of its own, every response kept."""

    def __init__(self, target: str, from_sequence: int = 0,
                 metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._channel = grpc.insecure_channel(target)
        self._call = rpc.KVStoreStub(self._channel).WatchEvents(
            pb.WatchEventsRequest(from_sequence=from_sequence), metadata=metadata)
        self.responses: list[pb.WatchEventsResponse] = []
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for response in self._call:
                self.responses.append(response)
        except grpc.RpcError as exc:
            self.error = exc

    @property
    def events(self) -> list[Any]:
        return [e for r in list(self.responses) for e in r.events]

    def wait_for(self, check: Callable[[list[Any]], bool], what: str) -> list[Any]:
        wait_until(lambda: check(self.events), what)
        return self.events

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(10)
        self._channel.close()


@pytest.fixture
def watchers() -> Iterator[Callable[..., Watcher]]:
    opened: list[Watcher] = []

    def watch(*args: Any, **kwargs: Any) -> Watcher:
        opened.append(Watcher(*args, **kwargs))
        return opened[-1]

    yield watch
    for w in opened:
        w.close()


def _kinds(events: list[Any], kind: int) -> list[Any]:
    return [e for e in events if e.kind == kind]


def test_concurrent_puts_arrive_numbered_without_gaps_after_cleared(
        daemon_factory: Callable[..., Daemon], watchers: Callable[..., Watcher]) -> None:
    d = daemon_factory(*SMALL)
    watcher = watchers(d.target, from_sequence=1)
    keys, values = blocks(24, size=1024)

    def put(part: int) -> None:
        with KVStoreClient(d.target, f"ns{part}") as kv:
            for i in range(part, 24, 2):
                kv.put(keys[i:i + 1], values[i:i + 1], independent=True)

    threads = [threading.Thread(target=put, args=(p,)) for p in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = watcher.wait_for(lambda ev: len(_kinds(ev, STORED)) == 24, "24 STORED events")
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))
    assert events[0].kind == CLEARED
    stored = _kinds(events, STORED)
    assert {(e.namespace, e.key) for e in stored} == {(f"ns{i % 2}", keys[i]) for i in range(24)}
    assert {e.tier for e in stored} == {DRAM}
    assert len({r.daemon_id for r in watcher.responses}) == 1


def test_a_chain_demoted_then_evicted_is_stored_moved_and_removed(
        daemon_factory: Callable[..., Daemon], watchers: Callable[..., Watcher]) -> None:
    d = daemon_factory(*SMALL)
    watcher = watchers(d.target)
    keys, values = blocks(48, size=64 * 1024)  # 3 MiB: more than L2's 2 MiB
    with KVStoreClient(d.target, "chain") as kv:
        kv.put(keys[:8], values[:8])  # a chain: each block's parent is the one before
        for i in range(8, 48, 8):
            kv.put(keys[i:i + 8], values[i:i + 8], independent=True)
        events = watcher.wait_for(lambda ev: len(_kinds(ev, MOVED)) >= 8, "demotions")
        stored = {e.key: e for e in _kinds(events, STORED)}
        assert stored[keys[0]].parent == b"" and stored[keys[1]].parent == keys[0]
        assert all((e.from_tier, e.tier) == (DRAM, NVME) for e in _kinds(events, MOVED))
        kv.evict(keys[8:16])
    events = watcher.wait_for(lambda ev: len(_kinds(ev, REMOVED)) >= 8, "8 REMOVED")
    assert {e.key for e in _kinds(events, REMOVED)} >= set(keys[8:16])


def test_replay_from_a_held_sequence_and_a_gap_past_the_buffer(
        daemon_factory: Callable[..., Daemon], watchers: Callable[..., Watcher]) -> None:
    d = daemon_factory("events.buffer_events=8", "nvme.enabled=false")
    keys, values = blocks(20, size=1024)
    with KVStoreClient(d.target, "r") as kv:
        kv.put(keys, values, independent=True)  # CLEARED + 20 STORED: sequences 1..21
    replay = watchers(d.target, from_sequence=15)
    events = replay.wait_for(lambda ev: len(ev) == 7, "the replay of 15..21")
    assert [e.sequence for e in events] == list(range(15, 22))
    assert [e.key for e in events] == keys[13:]
    assert replay.responses[0].dropped == 0
    late = watchers(d.target, from_sequence=2)  # 2..13 are no longer held
    events = late.wait_for(lambda ev: len(ev) == 8, "the 8 held events")
    assert late.responses[0].dropped == 12
    assert [e.sequence for e in events] == list(range(14, 22))


def test_a_restart_clears_and_announces_what_l3_kept(
        daemon_factory: Callable[..., Daemon], watchers: Callable[..., Watcher],
        tmp_path: Path) -> None:
    d = daemon_factory(*SMALL, f"nvme.dir={tmp_path / 'l3'}")
    first = watchers(d.target, from_sequence=1)
    keys, values = blocks(48, size=64 * 1024)
    with KVStoreClient(d.target, "kept") as kv:
        for i in range(0, 48, 8):
            kv.put(keys[i:i + 8], values[i:i + 8], independent=True)
    first.wait_for(lambda ev: len(_kinds(ev, MOVED)) >= 8, "demotions to L3")
    d.stop()  # the daemon below re-adopts the same L3 folder
    again = daemon_factory(*SMALL, f"nvme.dir={tmp_path / 'l3'}")
    second = watchers(again.target, from_sequence=1)
    events = second.wait_for(lambda ev: len(_kinds(ev, STORED)) >= 8, "re-adopted blocks")
    assert events[0].kind == CLEARED
    assert second.responses[0].daemon_id != first.responses[0].daemon_id
    assert {e.tier for e in _kinds(events, STORED)} == {NVME}
    assert {e.key for e in _kinds(events, STORED)} <= set(keys)


def test_a_tenant_sees_only_its_own_namespaces(
        daemon_factory: Callable[..., Daemon], watchers: Callable[..., Watcher],
        tmp_path: Path) -> None:
    tenants = write_tenants(tmp_path / "tenants.yaml", tenants_doc())
    d = daemon_factory(*auth_settings(tenants))
    a = watchers(d.target, from_sequence=1, metadata=md("team-a"))
    b = watchers(d.target, from_sequence=1, metadata=md("team-b"))
    keys, values = blocks(6, size=1024)
    with KVStoreClient(d.target, "team-b/m", token=TOKENS["team-b"]) as kv:
        kv.put(keys[:3], values[:3], independent=True)
    with KVStoreClient(d.target, "team-a/m", token=TOKENS["team-a"]) as kv:
        kv.put(keys[3:], values[3:], independent=True)
    seen_a = a.wait_for(lambda ev: len(_kinds(ev, STORED)) == 3, "team-a's 3 blocks")
    seen_b = b.wait_for(lambda ev: len(_kinds(ev, STORED)) == 3, "team-b's 3 blocks")
    assert {e.namespace for e in _kinds(seen_a, STORED)} == {"team-a/m"}
    assert {e.namespace for e in _kinds(seen_b, STORED)} == {"team-b/m"}
    assert [e.sequence for e in seen_a] == [1, 2, 3, 4]  # numbered per tenant
    unauthenticated = watchers(d.target)
    wait_until(lambda: unauthenticated.error is not None, "the refusal")
    assert unauthenticated.error.code() == grpc.StatusCode.UNAUTHENTICATED


def test_with_events_off_the_verb_names_the_setting(
        daemon_factory: Callable[..., Daemon], watchers: Callable[..., Watcher]) -> None:
    d = daemon_factory("events.buffer_events=0", "nvme.enabled=false")
    off = watchers(d.target)
    wait_until(lambda: off.error is not None, "the refusal")
    assert off.error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "events.buffer_events" in off.error.details()


@pytest.mark.parametrize("raw", [b"\xff\xff\xff", b"\x08", b"\x08\x80\x80\x80\x80\x80\x80\x80"
                                 b"\x80\x80\x80\x01"])
def test_undecodable_requests_are_invalid_arguments(
        shared_daemon: Callable[..., Daemon], raw: bytes) -> None:
    d = shared_daemon("nvme.enabled=false")
    with grpc.insecure_channel(d.target) as channel:
        call = channel.unary_stream("/kvstore.v1.KVStore/WatchEvents")(raw, timeout=5)
        with pytest.raises(grpc.RpcError) as refused:
            list(call)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_sequence_not_reached_yet_waits_for_it_without_harm(
        daemon_factory: Callable[..., Daemon], watchers: Callable[..., Watcher]) -> None:
    """A sequence beyond the stream's end is not an error: the subscriber waits, the store
    serves others meanwhile, and the ring keeps going."""
    d = daemon_factory("nvme.enabled=false")
    far = [watchers(d.target, from_sequence=s) for s in (2**64 - 1, 10**6)]
    keys, values = blocks(4, size=1024)
    with KVStoreClient(d.target, "far") as kv:
        kv.put(keys, values, independent=True)
        assert kv.lookup(keys).prefix_length == 4
    now = watchers(d.target, from_sequence=1)
    now.wait_for(lambda ev: len(ev) == 5, "CLEARED and 4 STORED")
    assert all(w.events == [] and w.error is None for w in far)


def test_both_clients_watch_events(daemon_factory: Callable[..., Daemon]) -> None:
    """KVStoreClient.watch_events and AsyncKVStoreClient.watch_events: the same stream from
    sequence 1; closing the iterator ends the call."""
    import asyncio

    from kvstore.client import AsyncKVStoreClient

    d = daemon_factory("nvme.enabled=false")
    keys, values = blocks(2, size=1024)
    with KVStoreClient(d.target, "w") as kv:
        kv.put(keys, values, independent=True)
        stream = kv.watch_events(1)
        first = next(stream)
        stream.close()
    assert [e.kind for e in first.events] == [CLEARED, STORED, STORED]

    async def watch() -> list[Any]:
        async with AsyncKVStoreClient(d.target, "w") as akv:
            stream = akv.watch_events(1)
            response = await stream.__anext__()
            await stream.aclose()
            return list(response.events)

    assert [e.key for e in asyncio.run(watch())] == [b"", *keys]


def test_blocks_written_to_the_pool_are_announced(
        daemon_factory: Callable[..., Daemon], watchers: Callable[..., Watcher],
        tmp_path: Path) -> None:
    """With an L4 pool, each block the daemon writes through to Redis is POOL_STORED (tier
    REMOTE) once Redis holds it, after its STORED; its local tiers stay as they were."""
    from kvstore.tools.testing import start_redis

    redis_server = start_redis(tmp_path)
    try:
        d = daemon_factory("nvme.enabled=false", f"remote.url={redis_server.url}")
        watcher = watchers(d.target, from_sequence=1)
        keys, values = blocks(5, size=4096)
        with KVStoreClient(d.target, "pooled") as kv:
            kv.put(keys, values)
            events = watcher.wait_for(lambda ev: len(_kinds(ev, pb.BLOCK_EVENT_KIND_POOL_STORED))
                                      == 5, "5 POOL_STORED")
            assert kv.lookup(keys).tiers == ["dram"] * 5
        pooled = _kinds(events, pb.BLOCK_EVENT_KIND_POOL_STORED)
        assert [e.key for e in pooled] == keys and {e.tier for e in pooled} == {pb.TIER_REMOTE}
        stored_at = {e.key: e.sequence for e in _kinds(events, STORED)}
        assert all(stored_at[e.key] < e.sequence for e in pooled)
    finally:
        redis_server.stop()
