"""Whole vLLM engines (`vllm.LLM` on the CPU, a tiny random Llama), each in its own process
with its own empty prefix cache, sharing one real daemon: the second engine loads what the
first computed (the bytes, not just a hit count), and its greedy tokens are those of an engine
without the store; with the daemon gone they still are, after one warning."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.integrations.paged import PagedKV
from kvstore.keys import prefix_keys
from kvstore.tools.testing import Daemon
from tests.vllm.conftest import StoreView

BLOCK = 128  # vLLM's CPU default
PROMPT = [3 + (i * 7 + i // 5) % 500 for i in range(700)]  # 5 full blocks and 60 tokens
STORED = 5
Run = Callable[..., tuple[dict[str, Any], str]]


@pytest.fixture(scope="module")
def baseline(model_dir: Path) -> list[list[int]]:
    from tests.vllm.conftest import run_llm

    result, _ = run_llm({"model": str(model_dir), "prompts": [PROMPT], "connector": None})
    return result["tokens"]


def _rows(dump: Path) -> set[bytes]:
    """Every non-zero block of a dumped paged KV cache, as the connector stores blocks."""
    saved = torch.load(dump)
    paged = PagedKV(list(saved["layers"].items()), saved["num_blocks"])
    staged = paged.gather(list(range(paged.num_blocks)))
    return {row.numpy().tobytes() for row in staged if row.any()}


def test_a_fresh_engine_loads_the_bytes_another_computed_and_generates_the_same(
        store: StoreView, model_dir: Path, baseline: list[list[int]], llm_run: Run,
        tmp_path: Path) -> None:
    args = {"model": str(model_dir), "prompts": [PROMPT], "connector": store.options()}
    first, _ = llm_run({**args, "dump_kv": str(tmp_path / "first.pt")})
    store.evict_at_end(first["namespace"])
    assert first["tokens"] == baseline
    assert first["stats"]["offloaded_blocks"] == STORED
    assert first["prefill_steps"] > 0  # the worker's timed forward passes reached the scheduler

    second, _ = llm_run({**args, "dump_kv": str(tmp_path / "second.pt")})
    assert second["tokens"] == baseline
    assert second["cached_tokens"] == [STORED * BLOCK]  # an empty prefix cache: all external
    assert second["stats"]["lookup_hit_blocks"] == STORED
    assert second["stats"]["loaded_blocks"] == STORED
    assert second["stats"]["offloaded_blocks"] == 0  # nothing new to save
    assert second["shared_memory"] is True  # co-located: the loads read the daemon's L2

    keys = prefix_keys(PROMPT[: STORED * BLOCK], BLOCK, second["namespace"])
    with KVStoreClient(store.target, second["namespace"]) as client:
        stored = client.get(keys)
    assert all(block is not None and any(block) for block in stored)
    computed = _rows(tmp_path / "first.pt")
    loaded = _rows(tmp_path / "second.pt")
    for block in stored:
        assert block in computed, "a stored block is not what the first engine computed"
        assert block in loaded, "a stored block is not in the second engine's cache"


def test_with_the_daemon_killed_between_the_runs_the_output_is_unchanged_after_one_warning(
        own_store: Daemon, model_dir: Path, baseline: list[list[int]], llm_run: Run) -> None:
    args = {"model": str(model_dir), "prompts": [PROMPT],
            "connector": {"target": own_store.target, "timeout_s": 0.5}}
    first, _ = llm_run(args)
    assert first["stats"]["offloaded_blocks"] == STORED
    own_store.proc.kill()
    own_store.proc.wait()
    second, stderr = llm_run(args)
    assert second["tokens"] == baseline
    assert second["cached_tokens"] == [0]
    warnings = [line for line in stderr.splitlines() if line.startswith("kvstore:")]
    assert len(warnings) == 1, warnings
    assert "Lookup failed" in warnings[0]


def test_disaggregated_prefill_hands_the_kv_from_a_producer_to_a_consumer(
        store: StoreView, model_dir: Path, baseline: list[list[int]], llm_run: Run) -> None:
    """A prefill engine that only saves, and a decode engine that only loads, run as vLLM
    runs them for users: an engine-core process and a worker process each."""
    connector = store.options()
    prefill, _ = llm_run({"model": str(model_dir), "prompts": [PROMPT], "max_tokens": 1,
                          "connector": connector, "role": "kv_producer"})
    store.evict_at_end(prefill["namespace"])  # the decode engine's too
    assert prefill["stats"]["offloaded_blocks"] == STORED
    assert prefill["stats"]["lookups"] == 0  # a producer never loads
    decode, _ = llm_run({"model": str(model_dir), "prompts": [PROMPT], "connector": connector,
                         "role": "kv_consumer", "inprocess": False})
    assert decode["tokens"] == baseline
    assert decode["cached_tokens"] == [STORED * BLOCK]
