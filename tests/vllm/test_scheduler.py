"""The connector inside vLLM's real v1 Scheduler, against a real daemon: what a request waits
for, what it loads, what it saves, and what happens when the store fails."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm.lora.request import LoRARequest
from vllm.v1.request import RequestStatus

from kvstore.client import KVStoreClient
from kvstore.integrations.vllm import KVStoreConnector, KVStoreMetadata
from kvstore.keys import prefix_keys
from kvstore.tools.testing import Daemon
from tests.vllm.harness import BLOCK, LAYERS, request, runner_output, scheduler, vllm_config
from tests.vllm.harness import worker as make_worker


def _tokens(n: int, seed: int = 1) -> list[int]:
    return [3 + (i * 37 + seed * 101) % 500 for i in range(n)]


def _wait_loads(connector: KVStoreConnector, req_id: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, done = connector.get_finished(set())
        if done and req_id in done:
            return
        time.sleep(0.01)
    raise AssertionError(f"{req_id}: its load never finished")


def _block_bytes(caches: dict[str, torch.Tensor], block_id: int) -> bytes:
    return b"".join(caches[name][block_id].contiguous().view(torch.uint8).numpy().tobytes()
                    for name in LAYERS)


def _put_blocks(target: str, namespace: str, tokens: list[int], num_blocks: int,
                block_bytes: int) -> list[bytes]:
    keys = prefix_keys(tokens[: num_blocks * BLOCK], BLOCK, namespace)
    rng = np.random.default_rng(5)
    payloads = [rng.integers(0, 256, block_bytes, dtype=np.uint8).tobytes() for _ in keys]
    with KVStoreClient(target, namespace) as client:
        client.put(keys, payloads)
    return payloads


def test_a_stored_prefix_is_loaded_asynchronously_then_the_request_runs(
        store: Daemon, model_dir: Path) -> None:
    config = vllm_config(model_dir, {"target": store.target})
    sched = scheduler(config)
    conn = sched.connector
    assert isinstance(conn, KVStoreConnector)
    work, caches = make_worker(config)
    tokens = _tokens(100)  # 6 full blocks and 4 tokens
    payloads = _put_blocks(store.target, conn.namespace, tokens, 4, work.paged.block_bytes)

    req = request(tokens)
    sched.add_request(req)
    out = sched.schedule()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not out.scheduled_new_reqs  # the rest of the batch would run; this one waits
    meta = out.kv_connector_metadata
    assert isinstance(meta, KVStoreMetadata) and len(meta.loads) == 1
    load = meta.loads[0]
    assert load.req_id == req.request_id and len(load.block_ids) == 4
    stats = conn.get_kv_connector_stats()
    assert stats is not None and stats.data["external_hit_tokens"] == 4 * BLOCK
    assert stats.data["lookups"] == 1
    assert conn.get_kv_connector_stats() is None  # an interval's counts, reported once

    work.bind_connector_metadata(meta)
    work.start_load_kv(None)  # type: ignore[arg-type]
    work.clear_connector_metadata()
    _wait_loads(work, req.request_id)
    assert work.get_block_ids_with_load_errors() == set()
    for block_id, payload in zip(load.block_ids, payloads, strict=True):
        assert _block_bytes(caches, block_id) == payload

    sched.update_from_output(out, runner_output([], finished_recving={req.request_id}))
    out = sched.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == [req.request_id]
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4 * BLOCK
    assert out.num_scheduled_tokens[req.request_id] == 100 - 4 * BLOCK
    # The two blocks computed here are saved; the four loaded ones are not saved again.
    saves = out.kv_connector_metadata.saves
    assert [len(s.keys) for s in saves] == [2]
    assert saves[0].parent == load.keys[-1]


@pytest.mark.parametrize(("prompt_len", "stored", "external"),
                         [(97, 6, 6 * BLOCK), (96, 6, 5 * BLOCK), (40, 1, BLOCK)])
def test_the_hit_always_leaves_the_last_prompt_token_to_compute(
        store: Daemon, model_dir: Path, prompt_len: int, stored: int, external: int) -> None:
    config = vllm_config(model_dir, {"target": store.target})
    sched = scheduler(config)
    work, _ = make_worker(config)
    tokens = _tokens(prompt_len, seed=prompt_len)
    _put_blocks(store.target, sched.connector.namespace, tokens, stored,
                work.paged.block_bytes)
    req = request(tokens)
    assert sched.connector.get_num_new_matched_tokens(req, 0) == (external, True)


def test_a_miss_gets_zero_and_the_request_runs_at_once(store: Daemon, model_dir: Path) -> None:
    sched = scheduler(vllm_config(model_dir, {"target": store.target}))
    req = request(_tokens(100, seed=9))
    sched.add_request(req)
    out = sched.schedule()
    assert req.status == RequestStatus.RUNNING
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert out.kv_connector_metadata.loads == []
    assert [len(s.keys) for s in out.kv_connector_metadata.saves] == [6]


def test_a_lookup_error_gets_zero_and_one_warning(
        store: Daemon, model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    sched = scheduler(vllm_config(model_dir, {"target": store.target, "timeout_s": 0.5}))
    store.stop()
    caplog.set_level(logging.WARNING, logger="kvstore")
    reqs = [request(_tokens(100, seed=s)) for s in (1, 2, 3)]
    for req in reqs:
        sched.add_request(req)
    out = sched.schedule()
    assert sorted(r.req_id for r in out.scheduled_new_reqs) == sorted(
        r.request_id for r in reqs)
    assert all(r.num_computed_tokens == 0 for r in out.scheduled_new_reqs)
    warnings = [r for r in caplog.records if r.name.startswith("kvstore")]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "Lookup failed" in warnings[0].getMessage()


def test_a_frozen_store_costs_one_timeout_then_answers_zero_at_once(
        store: Daemon, model_dir: Path) -> None:
    config = vllm_config(model_dir, {"target": store.target, "timeout_s": 0.5,
                                     "reconnect_s": 0.2})
    sched = scheduler(config)
    conn = sched.connector
    work, _ = make_worker(config)
    tokens = _tokens(64, seed=4)
    _put_blocks(store.target, conn.namespace, tokens, 3, work.paged.block_bytes)
    os.kill(store.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert conn.get_num_new_matched_tokens(request(tokens), 0) == (0, False)
        first = time.monotonic() - started
        started = time.monotonic()
        assert conn.get_num_new_matched_tokens(request(tokens), 0) == (0, False)
        second = time.monotonic() - started
    finally:
        os.kill(store.proc.pid, signal.SIGCONT)
    assert first < 3.0 and second < 0.05, (first, second)
    deadline = time.monotonic() + 10.0
    while not conn.link.available and time.monotonic() < deadline:
        time.sleep(0.05)
    assert conn.get_num_new_matched_tokens(request(tokens), 0) == (3 * BLOCK, True)


def test_a_block_that_fails_to_load_is_recomputed_from_there(
        store: Daemon, model_dir: Path) -> None:
    config = vllm_config(model_dir, {"target": store.target})
    sched = scheduler(config)
    work, _ = make_worker(config)
    tokens = _tokens(100, seed=6)
    _put_blocks(store.target, sched.connector.namespace, tokens, 4, work.paged.block_bytes)
    req = request(tokens)
    sched.add_request(req)
    out = sched.schedule()
    load = out.kv_connector_metadata.loads[0]
    with KVStoreClient(store.target, sched.connector.namespace) as client:
        client.evict([load.keys[2]])  # gone between the Lookup and the load
    work.bind_connector_metadata(out.kv_connector_metadata)
    work.start_load_kv(None)  # type: ignore[arg-type]
    _wait_loads(work, req.request_id)
    errors = work.get_block_ids_with_load_errors()
    assert errors == set(load.block_ids[2:])
    sched.update_from_output(out, runner_output([], finished_recving={req.request_id},
                                                invalid_block_ids=errors))
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 2 * BLOCK
    assert out.num_scheduled_tokens[req.request_id] == 100 - 2 * BLOCK
    # What failed to load is computed here, so it is saved again.
    assert [len(s.keys) for s in out.kv_connector_metadata.saves] == [4]


def test_saves_follow_the_blocks_each_step_fills(store: Daemon, model_dir: Path) -> None:
    config = vllm_config(model_dir, {"target": store.target}, max_batched=64)
    sched = scheduler(config)
    work, caches = make_worker(config, seed=11)
    tokens = _tokens(100, seed=7)
    req = request(tokens, max_tokens=20)
    sched.add_request(req)
    saved: list[tuple[bytes, int]] = []
    for _ in range(14):  # a chunked prefill (64 tokens a step, 2 steps), then 12 decodes
        out = sched.schedule()
        meta = out.kv_connector_metadata
        for spec in meta.saves:
            saved += list(zip(spec.keys, spec.block_ids, strict=True))
        work.bind_connector_metadata(meta)
        work.wait_for_save()
        work.clear_connector_metadata()
        running = [r for r in sched.running if r.request_id in out.num_scheduled_tokens]
        sched.update_from_output(out, runner_output(running))
    assert work.link.flush(10.0)
    all_tokens = req.all_token_ids
    want = prefix_keys(all_tokens[: len(saved) * BLOCK], BLOCK, sched.connector.namespace)
    assert [key for key, _ in saved] == want and len(saved) == 7  # 112 computed: 7 blocks
    with KVStoreClient(store.target, sched.connector.namespace) as client:
        got = client.get([key for key, _ in saved])
    assert got == [_block_bytes(caches, block_id) for _, block_id in saved]


def test_roles_a_producer_never_loads_a_consumer_never_saves(
        store: Daemon, model_dir: Path) -> None:
    tokens = _tokens(80, seed=8)
    producer = scheduler(vllm_config(model_dir, {"target": store.target}, role="kv_producer"))
    work, _ = make_worker(vllm_config(model_dir, {"target": store.target}))
    _put_blocks(store.target, producer.connector.namespace, tokens, 4, work.paged.block_bytes)
    assert producer.connector.get_num_new_matched_tokens(request(tokens), 0) == (0, False)

    consumer = scheduler(vllm_config(model_dir, {"target": store.target}, role="kv_consumer"))
    req = request(_tokens(80, seed=10))
    consumer.add_request(req)
    out = consumer.schedule()
    assert out.kv_connector_metadata.saves == []


def test_requests_with_different_cache_salts_share_no_blocks(
        store: Daemon, model_dir: Path) -> None:
    config = vllm_config(model_dir, {"target": store.target})
    sched = scheduler(config)
    work, _ = make_worker(config, seed=3)
    tokens = _tokens(70, seed=12)
    first = request(tokens, cache_salt="tenant-a")
    sched.add_request(first)
    out = sched.schedule()
    work.bind_connector_metadata(out.kv_connector_metadata)
    work.wait_for_save()
    assert work.link.flush(10.0)
    conn = sched.connector
    assert conn.get_num_new_matched_tokens(request(tokens, cache_salt="tenant-a"), 0) == (
        4 * BLOCK, True)
    assert conn.get_num_new_matched_tokens(request(tokens, cache_salt="tenant-b"), 0) == (
        0, False)
    assert conn.get_num_new_matched_tokens(request(tokens), 0) == (0, False)


def test_each_lora_adapter_roots_its_own_chains(store: Daemon, model_dir: Path) -> None:
    conn = scheduler(vllm_config(model_dir, {"target": store.target})).connector
    tokens = _tokens(40, seed=13)

    def first_key(lora: LoRARequest | None) -> bytes:
        return conn._keys_of(request(tokens, lora=lora), 1)[0]

    roots = {first_key(None), first_key(LoRARequest("sql", 1, "/adapters/sql")),
             first_key(LoRARequest("sql", 1, "/adapters/sql-v2")),
             first_key(LoRARequest("chat", 1, "/adapters/sql"))}
    assert len(roots) == 4
    assert first_key(LoRARequest("sql", 7, "/adapters/sql")) == first_key(
        LoRARequest("sql", 1, "/adapters/sql"))  # the id is a per-server number


def test_a_bad_option_fails_at_start_naming_the_key(model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.timeout_s"):
        scheduler(vllm_config(model_dir, {"timeout_s": -1}))
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.tagret: unknown"):
        scheduler(vllm_config(model_dir, {"tagret": "x:1"}))
