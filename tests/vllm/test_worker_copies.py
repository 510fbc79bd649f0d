"""The order of the vLLM worker's device copies (kvstore.integrations.device_copies), checked on
the CPU through a simulated device that runs nothing until it is told to: the real connector
(bind_connector_metadata, start_load_kv, get_finished, wait_for_save) against a real daemon,
its worker's copies swapped for simulated ones after it registered its caches. Each rule is
checked once with the real copies and once with a copier broken on purpose (the copiers of
tests/unit/test_device_copies.py), which the check must catch."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvstore.integrations.device_copies import DeviceCopies, SimDevice, SimStreams
from kvstore.integrations.vllm import KVStoreConnector
from kvstore.integrations.vllm_steps import KVStoreMetadata, LoadSpec, SaveSpec
from kvstore.keys import BlockKey, prefix_keys
from tests.unit.test_device_copies import (
    ReportsLoadsAtOnce,
    SavesUnderTheNextForwardPass,
    SavesWithoutWaitingForTheForwardPass,
)
from tests.vllm.conftest import StoreView
from tests.vllm.harness import BLOCK, LAYERS, vllm_config, worker

SAVED, LOADED = [9, 3, 17, 4], [2, 30, 5, 11]


def _bits(caches: dict[str, torch.Tensor], block_ids: list[int]) -> list[torch.Tensor]:
    return [caches[name][block_ids].view(torch.int32).clone() for name in LAYERS]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _simulated(connector: KVStoreConnector, copier: type[DeviceCopies],
               prefer: str) -> SimDevice:
    device = SimDevice(prefer=prefer)
    connector.worker.copies = copier(SimStreams(device))
    return device


def _save(connector: KVStoreConnector, keys: list[BlockKey], block_ids: list[int]) -> None:
    connector.bind_connector_metadata(KVStoreMetadata(saves=[SaveSpec(keys, block_ids, None)]))
    connector.wait_for_save()
    connector.clear_connector_metadata()
    assert connector.link.flush(10.0)


def _start_load(connector: KVStoreConnector, req_id: str, keys: list[BlockKey],
                block_ids: list[int]) -> None:
    connector.bind_connector_metadata(KVStoreMetadata(loads=[LoadSpec(req_id, keys, block_ids,
                                                                      "dram")]))
    connector.start_load_kv(None)  # type: ignore[arg-type]
    connector.clear_connector_metadata()


def _finished(connector: KVStoreConnector) -> set[str]:
    _, done = connector.get_finished(set())
    return done or set()


def load_reported_only_after_its_copy(store: StoreView, model_dir: Path,
                                      copier: type[DeviceCopies], prefer: str) -> list[str]:
    config = vllm_config(model_dir, store.options())
    saver, saved = worker(config, seed=31)
    keys = prefix_keys(list(range(7, 7 + 4 * BLOCK)), BLOCK, saver.namespace)
    want = _bits(saved, SAVED)
    _save(saver, keys, SAVED)
    saver.shutdown()
    loader, loaded = worker(config)
    device = _simulated(loader, copier, prefer)
    problems = []
    try:
        _start_load(loader, "r1", keys, LOADED)
        deadline = time.monotonic() + 10.0
        while not loader.worker._landing:  # its blocks were read, its copy enqueued
            assert time.monotonic() < deadline, "the load never came back"
            time.sleep(0.005)
        early = _finished(loader)
        if early and not _same(_bits(loaded, LOADED), want):
            problems.append("a load was reported while its blocks in the cache held old bytes")
        device.run()
        while "r1" not in early:
            assert time.monotonic() < deadline, "the load was never reported"
            early |= _finished(loader)
        assert loader.get_block_ids_with_load_errors() == set()
        assert _same(_bits(loaded, LOADED), want)
    finally:
        loader.shutdown()
    return problems


def save_ordered_with_the_forward_passes(store: StoreView, model_dir: Path,
                                         copier: type[DeviceCopies], prefer: str) -> list[str]:
    """A save reads its blocks after the forward pass that writes them, before the next one
    overwrites them."""
    config = vllm_config(model_dir, store.options())
    saver, caches = worker(config)
    device = _simulated(saver, copier, prefer)
    keys = prefix_keys(list(range(11, 11 + 4 * BLOCK)), BLOCK, saver.namespace)
    gen = torch.Generator().manual_seed(5)
    values = {name: torch.rand(caches[name][SAVED].shape, generator=gen) + 1.0
              for name in LAYERS}

    def step() -> None:
        for name in LAYERS:
            caches[name][SAVED] = values[name]

    def next_step() -> None:
        for name in LAYERS:
            caches[name][SAVED] = -1.0

    want = [values[name].view(torch.int32) for name in LAYERS]
    try:
        device.forward(step)
        with device.held():  # the writer's wait for the save runs the device after this
            saver.bind_connector_metadata(KVStoreMetadata(saves=[SaveSpec(keys, SAVED, None)]))
            saver.wait_for_save()
            saver.clear_connector_metadata()
            device.forward(next_step, name="next-step")
        assert saver.link.flush(10.0)
        device.run()
    finally:
        saver.shutdown()
    loader, loaded = worker(config)
    try:
        _start_load(loader, "r2", keys, LOADED)
        deadline = time.monotonic() + 10.0
        while "r2" not in _finished(loader):
            assert time.monotonic() < deadline, "the load was never reported"
            time.sleep(0.005)
        assert loader.get_block_ids_with_load_errors() == set()
        if _same(_bits(loaded, LOADED), want):
            assert device.log == ["forward:step", "copy:save", "forward:next-step"]
            return []
        return [f"the save's copy ran out of order with the forward passes ({device.log})"]
    finally:
        loader.shutdown()


CHECKS = [
    (load_reported_only_after_its_copy, ReportsLoadsAtOnce, "copy"),
    (save_ordered_with_the_forward_passes, SavesWithoutWaitingForTheForwardPass, "copy"),
    (save_ordered_with_the_forward_passes, SavesUnderTheNextForwardPass, "forward"),
]


@pytest.mark.parametrize(("check", "broken", "prefer"), CHECKS,
                         ids=[f"{c.__name__}-{p}" for c, _, p in CHECKS])
def test_the_worker_keeps_the_rule(store: StoreView, model_dir: Path,
                                   check: Callable[..., list[str]],
                                   broken: type[DeviceCopies], prefer: str) -> None:
    assert check(store, model_dir, DeviceCopies, prefer) == []


@pytest.mark.parametrize(("check", "broken", "prefer"), CHECKS,
                         ids=[b.__name__ for _, b, _ in CHECKS])
def test_a_copier_that_breaks_the_rule_is_caught(store: StoreView, model_dir: Path,
                                                 check: Callable[..., list[str]],
                                                 broken: type[DeviceCopies],
                                                 prefer: str) -> None:
    assert check(store, model_dir, broken, prefer) != []
