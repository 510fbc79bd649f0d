"""The connector inside vLLM's real v1 Scheduler, against a real daemon: what a request waits
for (its Lookup, then its load), what it loads or computes instead, what it saves, what the
workers' timings teach it, and what happens when the store fails."""

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
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from kvstore.client import KVStoreClient
from kvstore.integrations.vllm import KVStoreConnector
from kvstore.integrations.vllm_scheduler import RequestState
from kvstore.integrations.vllm_steps import KVStoreMetadata, KVStoreStats
from kvstore.keys import prefix_keys
from kvstore.tools.testing import Daemon
from tests.vllm.conftest import StoreView
from tests.vllm.harness import (
    BLOCK,
    LAYERS,
    matched,
    request,
    runner_output,
    scheduler,
    vllm_config,
    wait_lookups,
)
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


def _looked_up(sched: Scheduler) -> SchedulerOutput:
    """The step that starts the waiting requests' Lookups (they are skipped: nothing is
    scheduled), then, once the answers are back, the step that admits them."""
    out = sched.schedule()
    assert out.total_num_scheduled_tokens == 0
    wait_lookups(sched.connector)
    sched.update_from_output(out, runner_output([]))
    return sched.schedule()


def test_a_stored_prefix_is_loaded_asynchronously_then_the_request_runs(
        store: StoreView, model_dir: Path) -> None:
    config = vllm_config(model_dir, store.options())
    sched = scheduler(config)
    conn = sched.connector
    assert isinstance(conn, KVStoreConnector)
    work, caches = make_worker(config)
    tokens = _tokens(100)  # 6 full blocks and 4 tokens
    payloads = _put_blocks(store.target, conn.namespace, tokens, 4, work.paged.block_bytes)

    req = request(tokens)
    sched.add_request(req)
    out = sched.schedule()  # the Lookup goes out; the request waits for its answer
    assert req.status == RequestStatus.WAITING and out.total_num_scheduled_tokens == 0
    wait_lookups(conn)
    stats = conn.get_kv_connector_stats()
    assert stats is not None and stats.data["external_hit_tokens"] == 4 * BLOCK
    assert stats.data["lookups"] == 1
    assert conn.get_kv_connector_stats() is None  # an interval's counts, reported once
    sched.update_from_output(out, runner_output([]))
    out = sched.schedule()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not out.scheduled_new_reqs  # the rest of the batch would run; this one waits
    meta = out.kv_connector_metadata
    assert isinstance(meta, KVStoreMetadata) and len(meta.loads) == 1
    load = meta.loads[0]
    assert load.req_id == req.request_id and len(load.block_ids) == 4
    assert load.tier == "dram"  # the daemon's L2: the load teaches its cost

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
        store: StoreView, model_dir: Path, prompt_len: int, stored: int, external: int) -> None:
    config = vllm_config(model_dir, store.options())
    sched = scheduler(config)
    work, _ = make_worker(config)
    tokens = _tokens(prompt_len, seed=prompt_len)
    _put_blocks(store.target, sched.connector.namespace, tokens, stored,
                work.paged.block_bytes)
    req = request(tokens)
    assert sched.connector.get_num_new_matched_tokens(req, 0) == (None, False)  # looking up
    assert matched(sched.connector, req) == (external, True)
    # The answer is kept: asking again costs no Lookup, and a larger local hit takes the rest.
    assert sched.connector.get_num_new_matched_tokens(req, BLOCK) == (
        external - BLOCK, external > BLOCK)
    assert sched.connector.link.stats.lookups == 1


def test_a_miss_gets_zero_and_the_request_runs_once_answered(
        store: StoreView, model_dir: Path) -> None:
    sched = scheduler(vllm_config(model_dir, store.options()))
    req = request(_tokens(100, seed=9))
    sched.add_request(req)
    out = _looked_up(sched)
    assert req.status == RequestStatus.RUNNING
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert out.kv_connector_metadata.loads == []
    assert [len(s.keys) for s in out.kv_connector_metadata.saves] == [6]


def test_a_lookup_error_gets_zero_and_one_warning(
        own_store: Daemon, model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    sched = scheduler(vllm_config(model_dir, {"target": own_store.target, "timeout_s": 0.5}))
    own_store.stop()
    caplog.set_level(logging.WARNING, logger="kvstore")
    reqs = [request(_tokens(100, seed=s)) for s in (1, 2, 3)]
    for req in reqs:
        sched.add_request(req)
    # The first request's Lookup goes out and fails at once (the connection is refused); a
    # request asked after that failure gets 0 without a Lookup (the link is off) and runs in
    # this step, one asked before it runs in the next.
    out = sched.schedule()
    assert reqs[0].request_id not in out.num_scheduled_tokens
    admitted = list(out.scheduled_new_reqs)
    wait_lookups(sched.connector)
    sched.update_from_output(out, runner_output(
        [r for r in reqs if r.request_id in out.num_scheduled_tokens]))
    admitted += sched.schedule().scheduled_new_reqs
    assert sorted(r.req_id for r in admitted) == sorted(r.request_id for r in reqs)
    assert all(r.num_computed_tokens == 0 for r in admitted)
    warnings = [r for r in caplog.records if r.name.startswith("kvstore")]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "Lookup failed" in warnings[0].getMessage()


def test_a_frozen_store_costs_one_timeout_then_answers_zero_at_once(
        own_store: Daemon, model_dir: Path) -> None:
    config = vllm_config(model_dir, {"target": own_store.target, "timeout_s": 0.5,
                                     "reconnect_s": 0.2})
    sched = scheduler(config)
    conn = sched.connector
    work, _ = make_worker(config)
    tokens = _tokens(64, seed=4)
    _put_blocks(own_store.target, conn.namespace, tokens, 3, work.paged.block_bytes)
    os.kill(own_store.proc.pid, signal.SIGSTOP)
    try:
        req = request(tokens)
        started = time.monotonic()
        assert conn.get_num_new_matched_tokens(req, 0) == (None, False)
        asked = time.monotonic() - started  # the scheduler never waits on the store
        assert matched(conn, req) == (0, False)
        first = time.monotonic() - started
        started = time.monotonic()
        assert conn.get_num_new_matched_tokens(request(tokens), 0) == (0, False)
        second = time.monotonic() - started
    finally:
        os.kill(own_store.proc.pid, signal.SIGCONT)
    assert asked < 0.05 and first < 3.0 and second < 0.05, (asked, first, second)
    deadline = time.monotonic() + 10.0
    while not conn.link.available and time.monotonic() < deadline:
        time.sleep(0.05)
    assert matched(conn, request(tokens)) == (3 * BLOCK, True)


def test_a_block_that_fails_to_load_is_recomputed_from_there(
        store: StoreView, model_dir: Path) -> None:
    config = vllm_config(model_dir, store.options())
    sched = scheduler(config)
    work, _ = make_worker(config)
    tokens = _tokens(100, seed=6)
    _put_blocks(store.target, sched.connector.namespace, tokens, 4, work.paged.block_bytes)
    req = request(tokens)
    sched.add_request(req)
    out = _looked_up(sched)
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


def test_saves_follow_the_blocks_each_step_fills(store: StoreView, model_dir: Path) -> None:
    config = vllm_config(model_dir, store.options(), max_batched=64)
    sched = scheduler(config)
    work, caches = make_worker(config, seed=11)
    tokens = _tokens(100, seed=7)
    req = request(tokens, max_tokens=20)
    sched.add_request(req)
    out = sched.schedule()  # the Lookup (a miss) goes out: nothing runs yet
    wait_lookups(sched.connector)
    sched.update_from_output(out, runner_output([]))
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
        store: StoreView, model_dir: Path) -> None:
    tokens = _tokens(80, seed=8)
    producer = scheduler(vllm_config(model_dir, store.options(), role="kv_producer"))
    work, _ = make_worker(vllm_config(model_dir, store.options()))
    _put_blocks(store.target, producer.connector.namespace, tokens, 4, work.paged.block_bytes)
    assert producer.connector.get_num_new_matched_tokens(request(tokens), 0) == (0, False)

    consumer = scheduler(vllm_config(model_dir, store.options(), role="kv_consumer"))
    req = request(_tokens(80, seed=10))
    consumer.add_request(req)
    out = consumer.schedule()
    assert out.kv_connector_metadata.saves == []


def test_requests_with_different_cache_salts_share_no_blocks(
        store: StoreView, model_dir: Path) -> None:
    config = vllm_config(model_dir, store.options())
    sched = scheduler(config)
    work, _ = make_worker(config, seed=3)
    tokens = _tokens(70, seed=12)
    first = request(tokens, cache_salt="tenant-a")
    sched.add_request(first)
    out = _looked_up(sched)
    work.bind_connector_metadata(out.kv_connector_metadata)
    work.wait_for_save()
    assert work.link.flush(10.0)
    conn = sched.connector
    assert matched(conn, request(tokens, cache_salt="tenant-a")) == (4 * BLOCK, True)
    assert matched(conn, request(tokens, cache_salt="tenant-b")) == (0, False)
    assert matched(conn, request(tokens)) == (0, False)


def test_each_lora_adapter_roots_its_own_chains(store: StoreView, model_dir: Path) -> None:
    conn = scheduler(vllm_config(model_dir, store.options())).connector
    tokens = _tokens(40, seed=13)

    def first_key(lora: LoRARequest | None) -> bytes:
        return conn.scheduler._keys_of(RequestState(request(tokens, lora=lora)), 1)[0]

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


def test_a_hit_waits_for_its_lookup_while_a_short_request_runs_then_loads_and_runs(
        store: StoreView, model_dir: Path) -> None:
    config = vllm_config(model_dir, store.options())
    sched = scheduler(config)
    conn = sched.connector
    work, _ = make_worker(config)
    tokens = _tokens(100, seed=14)
    _put_blocks(store.target, conn.namespace, tokens, 4, work.paged.block_bytes)
    hit, short = request(tokens, max_tokens=8), request(_tokens(10, seed=15), max_tokens=8)
    sched.add_request(hit)
    sched.add_request(short)  # under one block: nothing to look up

    out = sched.schedule()  # 1: the hit's Lookup goes out, the short one runs
    assert (hit.status, short.status) == (RequestStatus.WAITING, RequestStatus.RUNNING)
    assert [r.req_id for r in out.scheduled_new_reqs] == [short.request_id]
    assert out.kv_connector_metadata.loads == []
    wait_lookups(conn)
    sched.update_from_output(out, runner_output([short]))

    out = sched.schedule()  # 2: answered: the hit loads while the short one decodes
    assert (hit.status, short.status) == (RequestStatus.WAITING_FOR_REMOTE_KVS,
                                          RequestStatus.RUNNING)
    assert list(out.num_scheduled_tokens) == [short.request_id]
    [load] = out.kv_connector_metadata.loads
    assert load.req_id == hit.request_id and len(load.keys) == 4
    work.bind_connector_metadata(out.kv_connector_metadata)
    work.start_load_kv(None)  # type: ignore[arg-type]
    work.clear_connector_metadata()
    _wait_loads(work, hit.request_id)
    sched.update_from_output(out, runner_output([short], finished_recving={hit.request_id}))

    out = sched.schedule()  # 3: loaded: the hit computes the rest beside the short one
    assert (hit.status, short.status) == (RequestStatus.RUNNING, RequestStatus.RUNNING)
    assert out.num_scheduled_tokens == {short.request_id: 1, hit.request_id: 100 - 4 * BLOCK}
    assert conn.link.stats.lookups == 1  # vLLM asked twice; one Lookup


def _fed(conn: KVStoreConnector, seconds_per_token: float = 2e-3) -> None:
    """Teach the connector's prefill model a few steps of a fixed cost per token."""
    for tokens in (64, 128, 256):
        conn.scheduler.prefill.observe([(tokens, 0)], tokens * seconds_per_token)


def test_policy_never_looks_the_hit_up_loads_nothing_and_counts_it(
        store: StoreView, model_dir: Path) -> None:
    config = vllm_config(model_dir, store.options(load_policy="never"))
    sched = scheduler(config)
    conn = sched.connector
    work, _ = make_worker(config)
    tokens = _tokens(100, seed=16)
    _put_blocks(store.target, conn.namespace, tokens, 4, work.paged.block_bytes)
    req = request(tokens)
    sched.add_request(req)
    out = _looked_up(sched)
    assert req.status == RequestStatus.RUNNING
    assert out.kv_connector_metadata.loads == []
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    # The four blocks are computed, not saved again: the store holds them.
    assert [len(s.keys) for s in out.kv_connector_metadata.saves] == [2]
    assert conn.link.stats.lookup_hit_blocks == 4  # the hit was looked up and counted
    stats = conn.get_kv_connector_stats()  # the interval since the scheduler took the last
    assert stats is not None and stats.data["recomputed_by_choice_tokens"] == 4 * BLOCK


def test_policy_always_loads_even_from_a_tier_believed_slow(
        store: StoreView, model_dir: Path) -> None:
    config = vllm_config(model_dir, store.options(load_policy="always"))
    conn = scheduler(config).connector
    work, _ = make_worker(config)
    tokens = _tokens(100, seed=17)
    _put_blocks(store.target, conn.namespace, tokens, 4, work.paged.block_bytes)
    _fed(conn)
    conn.link.rates.observe_load("dram", conn.scheduler.block_bytes, 1e4)
    assert matched(conn, request(tokens)) == (4 * BLOCK, True)


def test_auto_recomputes_a_hit_whose_tier_is_slower_than_computing_it(
        store: StoreView, model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = vllm_config(model_dir, store.options())
    sched = scheduler(config)
    conn = sched.connector
    work, _ = make_worker(config)
    # The scheduler's figure of a block is the worker's.
    assert conn.scheduler.block_bytes == work.paged.block_bytes
    tokens = _tokens(100, seed=18)
    _put_blocks(store.target, conn.namespace, tokens, 4, work.paged.block_bytes)
    _fed(conn)
    conn.link.rates.observe_load("dram", conn.scheduler.block_bytes, 1e4)  # 10^4 s a block
    caplog.set_level(logging.DEBUG, logger="kvstore.integrations.vllm")
    req = request(tokens)
    sched.add_request(req)
    out = _looked_up(sched)
    assert req.status == RequestStatus.RUNNING and out.kv_connector_metadata.loads == []
    assert out.num_scheduled_tokens[req.request_id] == 100
    stats = conn.get_kv_connector_stats()
    assert stats is not None and stats.data["recomputed_by_choice_tokens"] == 4 * BLOCK
    [reason] = [r.getMessage() for r in caplog.records if req.request_id in r.getMessage()]
    assert "recompute 4 blocks: loading (dram)" in reason


def test_auto_loads_a_hit_whose_tier_is_faster_than_computing_it(
        store: StoreView, model_dir: Path) -> None:
    config = vllm_config(model_dir, store.options())
    conn = scheduler(config).connector
    work, _ = make_worker(config)
    tokens = _tokens(100, seed=19)
    _put_blocks(store.target, conn.namespace, tokens, 4, work.paged.block_bytes)
    _fed(conn, seconds_per_token=10e-3)  # 64 tokens: ~0.6 s to compute
    conn.link.rates.observe_load("dram", 1 << 30, 0.1)  # 10 GB/s
    assert matched(conn, request(tokens)) == (4 * BLOCK, True)


def test_a_waiting_request_keeps_its_decision_until_its_first_block_moves(
        store: StoreView, model_dir: Path) -> None:
    # vLLM asks every step while a request waits: deciding again each time would cost
    # O(hit blocks) per waiting request per step, and could flip the answer it gave.
    config = vllm_config(model_dir, store.options())
    conn = scheduler(config).connector
    work, _ = make_worker(config)
    tokens = _tokens(100, seed=20)
    _put_blocks(store.target, conn.namespace, tokens, 4, work.paged.block_bytes)
    _fed(conn, seconds_per_token=10e-3)
    conn.link.rates.observe_load("dram", 1 << 30, 0.1)  # fast: load
    req = request(tokens)
    assert matched(conn, req) == (4 * BLOCK, True)
    conn.link.rates.observe_load("dram", conn.scheduler.block_bytes, 1e4)  # now slow
    assert conn.get_num_new_matched_tokens(req, 0) == (4 * BLOCK, True)  # kept
    # A block came from vLLM's own prefix cache meanwhile: the rest is decided afresh.
    assert conn.get_num_new_matched_tokens(req, BLOCK) == (0, False)


def test_the_workers_forward_steps_and_loads_reach_the_schedulers_cost_model(
        store: StoreView, model_dir: Path) -> None:
    config = vllm_config(model_dir, store.options())
    sched = scheduler(config)
    conn = sched.connector
    work, _ = make_worker(config)
    req = request(_tokens(40, seed=20))
    sched.add_request(req)
    out = _looked_up(sched)
    meta = out.kv_connector_metadata
    assert meta.chunks == [(40, 0)]
    work.bind_connector_metadata(meta)  # the step's clock starts
    time.sleep(0.02)  # the forward pass
    work.wait_for_save()  # ... and stops
    work.clear_connector_metadata()
    stats = work.get_kv_connector_stats()
    assert stats is not None
    [(chunks, seconds)] = stats.data["steps"]
    assert chunks == [(40, 0)] and 0.02 <= seconds < 1.0
    # A load timed by another process's link teaches this one; one timed by this process's
    # own link (the scheduler shares it here) was learnt already.
    stats.data["loads"] = [("elsewhere:1", "nvme", 1 << 20, 0.5),
                           (work.worker.origin, "remote", 1 << 20, 0.5)]
    assert conn.scheduler.prefill.steps == 0
    sched.update_from_output(out, runner_output([req], stats=stats))
    assert conn.scheduler.prefill.steps == 1
    nvme = conn.link.rates.estimate("nvme", 1 << 20)
    assert nvme is not None and 0.4 < nvme <= 0.5
    assert conn.link.rates.estimate("remote", 1 << 20) is None
    assert "steps" not in stats.data and "loads" not in stats.data  # vLLM logs the rest


def test_stats_sum_counters_and_concatenate_timings() -> None:
    ours = KVStoreStats(data={"loaded_blocks": 1, "steps": [([(8, 0)], 0.1)]})
    ours.aggregate(KVStoreStats(data={"loaded_blocks": 2, "steps": [([(4, 8)], 0.2)],
                                      "errors": 1}))
    assert ours.data == {"loaded_blocks": 3, "steps": [([(8, 0)], 0.1), ([(4, 8)], 0.2)],
                         "errors": 1}
    assert ours.reduce() == {"loaded_blocks": 3, "errors": 1}
