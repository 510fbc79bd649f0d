"""KV events for routers through vLLM's own publisher: a `vllm.LLM` with the connector and
`kv_events_config` on publishes, beside its own events, a `BlockStored` for every block the
connector saved (medium CPU: the store's L2) and every block it loaded, under vLLM's own block
hashes; a ZMQ subscriber decodes them with vLLM's `KVEventBatch`, as a router does."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from kvstore.tools.testing import free_port
from tests.vllm.conftest import StoreView

BLOCK = 128  # vLLM's CPU default
PROMPT = [3 + (i * 7 + i // 5) % 500 for i in range(700)]  # 5 full blocks and 60 tokens
STORED = 5
Run = Callable[..., tuple[dict[str, Any], str]]


class Subscriber:
    """A router's end of vLLM's KV-event stream: a SUB socket vLLM's publisher connects to,
    every batch decoded with vLLM's own classes."""

    def __init__(self) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.bind(self.endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list[Any] = []
        self.frames: list[list[bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(50):
                frames = self._socket.recv_multipart()
                self.frames.append(frames)
                self.events += self._decoder.decode(frames[-1]).events

    def drain(self) -> list[Any]:
        """The events received so far, and forget them."""
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)
        self._context.term()


@pytest.fixture
def subscriber() -> Iterator[Subscriber]:
    sub = Subscriber()
    yield sub
    sub.close()


def _ours(events: list[Any]) -> list[BlockStored]:
    """The connector's events: vLLM's own carry no locality."""
    return [e for e in events if isinstance(e, BlockStored) and e.locality is not None]


def _hashes(events: list[BlockStored]) -> list[Any]:
    return [h for e in events for h in e.block_hashes]


def test_blocks_saved_and_loaded_reach_a_subscriber_of_vllms_publisher(
        store: StoreView, model_dir: Path, llm_run: Run, subscriber: Subscriber) -> None:
    args = {"model": str(model_dir), "prompts": [PROMPT], "connector": store.options(),
            "kv_events": subscriber.endpoint}
    writer, _ = llm_run(args)
    store.evict_at_end(writer["namespace"])
    assert writer["stats"]["offloaded_blocks"] == STORED
    events = subscriber.drain()
    own = [e for e in events if isinstance(e, BlockStored) and e.locality is None]
    saved = _ours(events)
    assert {(e.medium, e.locality, e.block_size) for e in saved} == {("CPU", "LOCAL", BLOCK)}
    # Every saved block announced once, under the hash vLLM gave it in its own events.
    assert _hashes(saved) == _hashes(own)[:STORED]
    first = saved[0]
    assert first.parent_block_hash is None
    assert first.token_ids == PROMPT[:len(first.block_hashes) * BLOCK]
    assert sum(len(e.token_ids) for e in saved) == STORED * BLOCK
    assert all(f[0] == b"kv" and len(f[1]) == 8 for f in subscriber.frames)  # topic, seq

    reader, _ = llm_run(args)
    assert reader["stats"]["loaded_blocks"] == STORED
    loaded = _ours(subscriber.drain())
    assert _hashes(loaded) == _hashes(saved)  # the same blocks, found in the store's L2
    assert {(e.medium, e.locality) for e in loaded} == {("CPU", "LOCAL")}


def test_without_kv_events_the_connector_keeps_none(
        store: StoreView, model_dir: Path) -> None:
    """With vLLM's KV events off, the scheduler side keeps no events (no memory spent)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvstore.integrations.vllm import KVStoreConnector
    from tests.vllm.harness import kv_cache_config, vllm_config

    conn = KVStoreConnector(vllm_config(model_dir, store.options()),
                            KVConnectorRole.SCHEDULER, kv_cache_config(16))
    assert conn.scheduler.events is None and list(conn.take_events()) == []
    conn.shutdown()


def test_each_tier_has_its_medium_and_a_full_queue_drops_the_oldest() -> None:
    """L1/L2 are CPU, L3 STORAGE, L4 STORAGE seen from other nodes too (REMOTE); past its
    bound the queue drops the oldest events and counts them."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from kvstore.integrations.vllm_events import StoreEvents
    from tests.vllm.harness import BLOCK as SMALL
    from tests.vllm.harness import kv_cache_config, request

    events = StoreEvents(kv_cache_config(16), SMALL, max_events=3)
    req = request([1 + i % 90 for i in range(4 * SMALL + 3)])
    for first, tier in enumerate(("hbm", "dram", "nvme", "remote")):
        events.stored(req, first, first + 1, 0, tier, [bytes([first]) * 32])
    events.stored(req, 4, 6, 0, "dram", [b"4" * 32, b"5" * 32])  # past the full blocks: none
    assert events.dropped == 1
    taken = events.take()
    assert [(e.medium, e.locality) for e in taken] == [
        ("CPU", "LOCAL"), ("STORAGE", "LOCAL"), ("STORAGE", "REMOTE")]
    assert [e.parent_block_hash for e in taken] == [
        maybe_convert_block_hash(req.block_hashes[i]) for i in range(3)]
    assert taken[2].token_ids == req.all_token_ids[3 * SMALL:4 * SMALL]
    assert events.take() == []


def test_the_daemons_removals_and_moves_of_announced_blocks_are_announced(
        store: StoreView, model_dir: Path) -> None:
    """A scheduler-side connector with vLLM's events on follows the daemon's stream: blocks
    it announced that the daemon evicts become BlockRemoved under vLLM's hashes; a block it
    never announced stays unannounced."""
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import BlockRemoved
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from kvstore.client import KVStoreClient
    from kvstore.integrations.vllm import KVStoreConnector
    from kvstore.keys import chain_key
    from tests.helpers import wait_until
    from tests.vllm.harness import BLOCK as SMALL
    from tests.vllm.harness import kv_cache_config, request, vllm_config

    config = vllm_config(model_dir, store.options())
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    conn = KVStoreConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(16))
    events = conn.scheduler.events
    assert events is not None
    req = request([1 + i % 90 for i in range(3 * SMALL + 1)])
    keys = [chain_key(b"root" * 8, [i]) for i in range(3)]
    with KVStoreClient(store.target, conn.namespace) as kv:
        kv.put(keys, [b"x" * 256] * 3, independent=True)
        events.stored(req, 0, 2, 0, "dram", keys[:2])  # announced: blocks 0 and 1 only
        assert len(conn.take_events()) == 1
        kv.evict(keys)
    removed: list[BlockRemoved] = []
    wait_until(lambda: removed.extend(e for e in conn.take_events()
                                      if isinstance(e, BlockRemoved)) or len(removed) >= 2,
               "two BlockRemoved")
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(
        maybe_convert_block_hash(h) for h in req.block_hashes[:2])
    assert {(e.medium, e.locality) for e in removed} == {("CPU", "LOCAL")}
    conn.shutdown()


def test_a_move_to_another_medium_and_a_restart_are_announced() -> None:
    """L2 -> L3 (the daemon's MOVED): BlockRemoved of CPU, BlockStored of STORAGE under the
    same hash; a move within a medium or of a block never announced: nothing; a daemon
    restart: every block announced is announced removed."""
    from vllm.distributed.kv_events import BlockRemoved

    from kvstore.integrations.vllm_events import StoreEvents
    from tests.vllm.harness import BLOCK as SMALL
    from tests.vllm.harness import kv_cache_config, request

    events = StoreEvents(kv_cache_config(16), SMALL)
    req = request([1 + i % 90 for i in range(2 * SMALL + 3)])
    keys = [b"a" * 32, b"b" * 32]
    events.stored(req, 0, 2, 0, "dram", keys)
    events.take()
    events.store_changed(2, keys[0], 3)  # MOVED, now in nvme
    events.store_changed(2, keys[1], 1)  # MOVED to hbm: still CPU
    events.store_changed(3, b"c" * 32, 2)  # REMOVED, never announced
    moved = events.take()
    assert [(type(e).__name__, e.medium) for e in moved] == [
        ("BlockRemoved", "CPU"), ("BlockStored", "STORAGE")]
    assert moved[0].block_hashes == moved[1].block_hashes and moved[1].token_ids == []
    events.store_cleared()
    cleared = events.take()
    assert all(isinstance(e, BlockRemoved) for e in cleared) and len(cleared) == 2
    assert {e.medium for e in cleared} == {"STORAGE", "CPU"}
