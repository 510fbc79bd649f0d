"""The worker side over paged KV tensors in vLLM's CPU layout, against a real daemon: blocks
saved by one connector and loaded by a fresh one arrive bit for bit, wherever the block tables
put them, and what cannot arrive is reported for recompute."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvstore.client import KVStoreClient
from kvstore.integrations.vllm import KVStoreConnector
from kvstore.integrations.vllm_steps import KVStoreMetadata, LoadSpec, SaveSpec
from kvstore.keys import prefix_keys
from kvstore.tools.testing import Daemon
from tests.vllm.conftest import STORE_SETTINGS, StoreView
from tests.vllm.harness import BLOCK, LAYERS, vllm_config, worker


def _finish(connector: KVStoreConnector, req_id: str, timeout_s: float = 10.0) -> set[int]:
    """Wait for req_id's load; the block ids reported as failed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, done = connector.get_finished(set())
        if done and req_id in done:
            return connector.get_block_ids_with_load_errors()
        time.sleep(0.01)
    raise AssertionError(f"{req_id}: its load never finished")


def _bits(caches: dict[str, torch.Tensor], block_ids: list[int]) -> list[torch.Tensor]:
    return [caches[name][block_ids].view(torch.int32) for name in LAYERS]


def _save(connector: KVStoreConnector, keys: list[bytes], block_ids: list[int]) -> None:
    connector.bind_connector_metadata(KVStoreMetadata(saves=[SaveSpec(keys, block_ids, None)]))
    connector.wait_for_save()
    connector.clear_connector_metadata()
    assert connector.link.flush(10.0)


def _load(connector: KVStoreConnector, req_id: str, keys: list[bytes],
          block_ids: list[int], tier: str = "") -> set[int]:
    connector.bind_connector_metadata(KVStoreMetadata(loads=[LoadSpec(req_id, keys,
                                                                      block_ids, tier)]))
    connector.start_load_kv(None)  # type: ignore[arg-type]
    connector.clear_connector_metadata()
    return _finish(connector, req_id)


def test_blocks_saved_by_one_worker_load_bit_exact_into_a_fresh_one_in_any_order(
        store: StoreView, model_dir: Path) -> None:
    config = vllm_config(model_dir, store.options())
    saver, saved = worker(config, seed=21)  # random bits: NaNs and all
    keys = prefix_keys(list(range(3, 3 + 5 * BLOCK)), BLOCK, saver.namespace)
    _save(saver, keys, [9, 3, 17, 4, 40])
    assert saver.link.stats.offloaded_blocks == 5
    saver.shutdown()  # a fresh connector: its own link, nothing pending from the saver
    loader, loaded = worker(config)  # zeros
    assert loader.link.stats.offloaded_blocks == 0
    assert _load(loader, "r1", keys, [2, 30, 5, 11, 1], tier="dram") == set()
    for got, want in zip(_bits(loaded, [2, 30, 5, 11, 1]), _bits(saved, [9, 3, 17, 4, 40]),
                         strict=True):
        assert torch.equal(got, want)
    untouched = [b for b in range(loaded[LAYERS[0]].shape[0]) if b not in (2, 30, 5, 11, 1)]
    assert all(not t.any() for t in _bits(loaded, untouched))
    assert loader.link.stats.loaded_blocks == 5
    assert loader.link.stats.loaded_bytes == 5 * loader.paged.block_bytes
    stats = loader.get_kv_connector_stats()
    assert stats is not None and stats.data["loaded_blocks"] == 5
    assert stats.data["loaded_bytes"] == 5 * loader.paged.block_bytes
    assert "lookups" not in stats.data  # the scheduler side reports those
    # The whole load, timed for the scheduler side's rates (it may live in another process).
    [(origin, tier, nbytes, seconds)] = stats.data["loads"]
    assert (origin, tier, nbytes) == (loader.worker.origin, "dram", 5 * loader.paged.block_bytes)
    assert 0 < seconds < 10.0
    assert loader.link.rates.estimate("dram", 1) is not None  # its own link learnt it too
    assert loader.get_kv_connector_stats() is None


def test_a_gap_in_the_chain_reports_it_and_every_block_after_it(
        store: StoreView, model_dir: Path) -> None:
    config = vllm_config(model_dir, store.options())
    saver, saved = worker(config, seed=22)
    keys = prefix_keys(list(range(7, 7 + 4 * BLOCK)), BLOCK, saver.namespace)
    _save(saver, keys[:2], [1, 2])  # blocks 2 and 3 never stored
    saver.shutdown()
    loader, loaded = worker(config)
    assert _load(loader, "r2", keys, [10, 11, 12, 13], tier="dram") == {12, 13}
    for got, want in zip(_bits(loaded, [10, 11]), _bits(saved, [1, 2]), strict=True):
        assert torch.equal(got, want)
    assert loader.link.stats.load_failures == 1
    stats = loader.get_kv_connector_stats()
    assert stats is not None and "loads" not in stats.data  # a partial load teaches nothing


def test_loads_in_place_arrive_bit_exact_and_blocks_that_moved_are_reported(
        shared_daemon: Callable[..., Daemon], model_dir: Path, ns: str) -> None:
    """Co-located (the daemon's Unix socket and read table), a worker whose loads read in
    place (on by default only on a GPU) copies each block from its pages in L2: bit for bit;
    a block whose pages moved before the copy landed is reported, with every one after it."""
    d = shared_daemon(*STORE_SETTINGS, unix_socket=True)
    config = vllm_config(model_dir, {"target": d.target, "namespace_salt": ns})
    saver, saved = worker(config, seed=24)
    keys = prefix_keys(list(range(9, 9 + 4 * BLOCK)), BLOCK, saver.namespace)
    try:
        _save(saver, keys, [9, 3, 17, 4])
        saver.shutdown()
        loader, loaded = worker(config)
        assert not loader.worker.in_place and not loader.paged.direct  # CPU, staged layout
        loader.worker.in_place = True
        assert _load(loader, "r5", keys, [2, 30, 5, 11], tier="dram") == set()
        for got, want in zip(_bits(loaded, [2, 30, 5, 11]), _bits(saved, [9, 3, 17, 4]),
                             strict=True):
            assert torch.equal(got, want)
        assert loader.link.stats.loaded_in_place_blocks == 4
        read_in_place = loader.link.read_in_place

        def evict_third_after_reading(*args: Any, **kw: Any) -> Any:
            landed = read_in_place(*args, **kw)
            assert landed.in_place_blocks == 4
            with KVStoreClient(d.target, loader.namespace) as kv:
                assert kv.evict(keys=[keys[2]]).evicted == 2
            return landed

        loader.link.read_in_place = evict_third_after_reading  # type: ignore[method-assign]
        assert _load(loader, "r6", keys, [20, 21, 22, 23], tier="dram") == {22, 23}
    finally:
        with KVStoreClient(d.target, saver.namespace, shared_memory=False) as kv:
            kv.evict(all=True)


def test_a_dead_store_fails_the_whole_load_and_still_finishes_the_request(
        own_store: Daemon, model_dir: Path) -> None:
    config = vllm_config(model_dir, {"target": own_store.target, "timeout_s": 0.5})
    loader, _ = worker(config)
    keys = prefix_keys(list(range(11, 11 + 3 * BLOCK)), BLOCK, loader.namespace)
    own_store.stop()
    assert _load(loader, "r3", keys, [4, 5, 6]) == {4, 5, 6}
    assert not loader.link.available
