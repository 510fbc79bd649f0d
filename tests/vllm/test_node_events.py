"""kvstore-events' frames decoded by vLLM itself: the node publisher's payloads, live and
replayed, go through vLLM's own msgspec decoder of `KVEventBatch`
(vllm.distributed.kv_events) as a router built on vLLM's classes decodes them, and come out as
vLLM's BlockStored / BlockRemoved / AllBlocksCleared with vLLM's media and the block hashes
vLLM's own conversion (maybe_convert_block_hash, int hashes by default) makes of kvstore's keys.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from kvstore.client import KVStoreClient
from kvstore.tools.events import NodePublisher
from kvstore.tools.testing import Daemon
from tests.helpers import blocks, wait_until
from tests.integration.test_events_publisher import (  # noqa: F401 (publish: a fixture)
    SMALL,
    Subscriber,
    _replay,
    publish,
)

Publish = Callable[..., tuple[NodePublisher, Subscriber]]


def _decoded(frames: list[list[bytes]]) -> list[Any]:
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    return [e for f in frames for e in decoder.decode(f[-1]).events]


def test_vllms_decoder_reads_the_publishers_stores_moves_and_removals(
        daemon_factory: Callable[..., Daemon], publish: Publish) -> None:  # noqa: F811
    d = daemon_factory(*SMALL)
    publisher, sub = publish(d)
    keys, values = blocks(48, size=64 * 1024)  # 3 MiB: more than L2 holds, so some move to L3
    with KVStoreClient(d.target, "vllm-decodes") as kv:
        kv.put(keys[:8], values[:8])
        for i in range(8, 48, 8):
            kv.put(keys[i:i + 8], values[i:i + 8], independent=True)
        wait_until(lambda: any(isinstance(e, BlockStored) and e.medium == MEDIUM_STORAGE
                               for e in _decoded(sub.frames)), "a block on STORAGE")
        kv.evict(keys[8:16])
    vllm_hashes = {maybe_convert_block_hash(BlockHash(k)) for k in keys}

    def stores() -> list[BlockStored]:
        return [e for e in _decoded(sub.frames) if isinstance(e, BlockStored)]

    wait_until(lambda: {h for e in stores() for h in e.block_hashes} == vllm_hashes
               and len([e for e in _decoded(sub.frames) if isinstance(e, BlockRemoved)]) >= 8,
               "every block announced, and the evictions")
    events = _decoded(sub.frames)
    assert {type(e) for e in events} >= {BlockStored, BlockRemoved}
    stored = stores()
    assert {h for e in stored for h in e.block_hashes} == vllm_hashes
    assert {e.medium for e in stored} == {MEDIUM_CPU, MEDIUM_STORAGE}
    assert all(e.token_ids == [] and e.block_size == 16 and e.locality == "LOCAL"
               for e in stored)
    first = next(e for e in stored
                 if maybe_convert_block_hash(BlockHash(keys[0])) in e.block_hashes)
    assert first.parent_block_hash is None
    assert {e.medium for e in events if isinstance(e, BlockRemoved)} <= {MEDIUM_CPU,
                                                                         MEDIUM_STORAGE}


def test_vllms_decoder_reads_replayed_batches_and_the_clear(
        daemon_factory: Callable[..., Daemon], publish: Publish) -> None:  # noqa: F811
    d = daemon_factory(*SMALL)
    publisher, sub = publish(d)
    keys, values = blocks(3, size=1024)
    with KVStoreClient(d.target, "replayed") as kv:
        kv.put(keys, values)
    wait_until(lambda: sum(len(e.block_hashes) for e in _decoded(sub.frames)
                           if isinstance(e, BlockStored)) == 3, "3 blocks")
    publisher.publishing.queue.put(publisher.translator.clear())  # as after a restart
    wait_until(lambda: any(isinstance(e, AllBlocksCleared) for e in _decoded(sub.frames)),
               "AllBlocksCleared")
    assert publisher.vllm.replay_endpoint is not None
    replayed = _replay(publisher.vllm.replay_endpoint, 0)
    live = list(sub.frames)
    assert replayed[-len(live):] == live
    events = _decoded(live)
    assert [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes] == [
        maybe_convert_block_hash(BlockHash(k)) for k in keys]
    assert isinstance(events[-1], AllBlocksCleared)
    assert {f[0] for f in live} == {b"kv@node:n1@replayed"}
