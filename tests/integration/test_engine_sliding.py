"""Sliding-window attention in the included engine, against transformers on the same tiny
random Mistral checkpoint (every layer windowed, as transformers' Mistral does): greedy
generations match token for token past the window, for prompts shorter and longer than it,
with chunked prefill, with prefix caching serving a second run, and in a batch; a long
generation holds only the window's blocks; attention sinks stream past the context length
with bounded blocks; a windowed model's blocks go through the store."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.engine.errors import InvalidRequestError
from kvstore.engine.llm import LLM
from kvstore.engine.sampling import SamplingParams
from kvstore.keys import prefix_keys
from kvstore.tools.testing import Daemon
from tests.engine.models import TINY, save_tiny
from tests.engine.oracle import hf_greedy, load_hf

# A window that is not a multiple of the 16-token block: its start moves through blocks.
WINDOW = 24
BLOCK = 16


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny") / "mistral", arch="mistral",
                     sliding_window=WINDOW, num_hidden_layers=3)


@pytest.fixture(scope="module")
def oracle(mistral: Path) -> Any:
    return load_hf(str(mistral))


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


def _llm(path: Path, **kw: Any) -> LLM:
    kw.setdefault("num_blocks", 128)
    return LLM(str(path), device="cpu", **kw)


def test_the_window_changes_what_transformers_generates(mistral: Path, oracle: Any,
                                                        tmp_path: Path) -> None:
    """The oracle really windows: the same weights without a window generate otherwise
    (else the tests below could not tell a windowed engine from a full one)."""
    full = save_tiny(tmp_path / "full", arch="mistral", sliding_window=None,
                     num_hidden_layers=3)
    prompt = _prompt(60, seed=1)
    assert hf_greedy(load_hf(str(full)), prompt, 30) != hf_greedy(oracle, prompt, 30)


@pytest.mark.parametrize("length", [5, WINDOW - 1, WINDOW, WINDOW + 1, 47, 90])
def test_generation_past_the_window_matches_transformers(mistral: Path, oracle: Any,
                                                         length: int) -> None:
    prompt = _prompt(length, seed=length)
    [out] = _llm(mistral).generate([prompt], _greedy(40))
    assert out.outputs[0].token_ids == hf_greedy(oracle, prompt, 40)


def test_batch_with_chunked_prefill_matches(mistral: Path, oracle: Any) -> None:
    # A 20-token budget cuts the 100-token prompt into chunks (some shorter than the
    # window, each starting inside the window of the one before) beside the decodes.
    prompts = [_prompt(7, seed=2), _prompt(100, seed=3), _prompt(33, seed=4)]
    outs = _llm(mistral, max_num_batched_tokens=20).generate(prompts, _greedy(30))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(oracle, prompt, 30)


def test_prefix_cache_serves_a_windowed_model(mistral: Path, oracle: Any) -> None:
    prompt = _prompt(75, seed=5)
    llm = _llm(mistral)
    [first] = llm.generate([prompt], _greedy(30))
    [second] = llm.generate([prompt], _greedy(30))
    assert first.outputs[0].token_ids == hf_greedy(oracle, prompt, 30)
    assert second.metrics.cached_prompt_tokens == 64  # 4 full blocks; the rest computed
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    diverged = prompt[:40] + _prompt(30, seed=6)
    [third] = llm.generate([diverged], _greedy(30))
    assert third.metrics.cached_prompt_tokens == 32
    assert third.outputs[0].token_ids == hf_greedy(oracle, diverged, 30)


def test_a_hit_with_its_early_blocks_evicted_still_serves(mistral: Path, oracle: Any) -> None:
    """In a 10-block pool, a second prompt evicts the first one's earliest blocks (they slid
    out first, so they are the least recently used); the first prompt again still hits 96
    tokens, as only the window before the cut (blocks 4 and 5) is needed, and its tokens
    equal transformers'."""
    first, other = _prompt(100, seed=13), _prompt(80, seed=14)
    llm = _llm(mistral, num_blocks=10, max_num_batched_tokens=32)
    llm.generate([first], _greedy(5))
    llm.generate([other], _greedy(5))
    keys = prefix_keys(first, BLOCK, llm.namespace)
    cached = [llm.block_manager.find_prefix(keys[: i + 1], BLOCK * (i + 1) + 1).num_tokens > 0
              for i in range(len(keys))]
    assert llm.block_manager.stats.evictions > 0 and not cached[0]
    [again] = llm.generate([first], _greedy(20))
    assert again.metrics.cached_prompt_tokens == 96
    assert again.outputs[0].token_ids == hf_greedy(oracle, first, 20)


def test_a_long_generation_holds_the_window_s_blocks(mistral: Path, oracle: Any) -> None:
    """300 tokens would take 19 blocks; the pool has 6 and the sequence holds at most
    ceil(24 / 16) + 1 = 3 at any decode step (a 32-token prefill chunk and the window
    before it: 5), and its tokens still equal transformers'."""
    prompt = _prompt(40, seed=8)
    llm = _llm(mistral, num_blocks=6, max_num_batched_tokens=32)
    held: list[int] = []
    [out] = llm.generate([prompt], _greedy(260),
                         on_step=lambda _: held.append(llm.block_manager.num_referenced_blocks))
    assert out.outputs[0].token_ids == hf_greedy(oracle, prompt, 260)
    bound = -(-WINDOW // BLOCK) + 1
    decode_steps = held[2:]
    assert max(decode_steps) <= bound and decode_steps.count(bound) > 0
    assert max(held[:2]) <= llm.block_manager.max_blocks_held(300, 32) == 5


def test_without_a_window_a_long_generation_does_not_fit(tmp_path: Path) -> None:
    """The 6-block pool above is too small for the same request on a full-attention model:
    the bound is the window's doing."""
    full = save_tiny(tmp_path / "full", arch="mistral", sliding_window=None)
    with pytest.raises(InvalidRequestError, match="needs 19 KV blocks"):
        _llm(full, num_blocks=6, max_num_batched_tokens=32).generate(
            [_prompt(40, seed=8)], _greedy(260))


@pytest.fixture(scope="module")
def short_context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights with a 64-token context, windowed and not."""
    folder = tmp_path_factory.mktemp("short")
    save_tiny(folder / "full", arch="mistral", sliding_window=None,
              max_position_embeddings=64)
    return save_tiny(folder / "windowed", arch="mistral", sliding_window=WINDOW,
                     max_position_embeddings=64)


SINKS = 4


def test_attention_sinks_stream_past_the_context_with_bounded_blocks(
        short_context: Path) -> None:
    """With 4 sinks, a 64-token-context model generates 4 x 64 tokens holding at most
    1 + ceil(24 / 16) + 1 = 4 blocks (5 in the pool: what a 16-token step needs). Up to
    position window + sinks - 1 the sinks and the window cover the whole context, so the
    first tokens equal the full-attention model's (transformers'); after that they are the
    approximation's own, and differ from the windowed model's."""
    prompt = _prompt(10, seed=9)
    llm = _llm(short_context, num_blocks=5, attention_sinks=SINKS, max_model_len=4 * 64,
               max_num_batched_tokens=16)
    held: list[int] = []
    [out] = llm.generate([prompt], _greedy(4 * 64 - 10),
                         on_step=lambda _: held.append(llm.block_manager.num_referenced_blocks))
    tokens = out.outputs[0].token_ids
    assert len(tokens) == 4 * 64 - 10 and out.outputs[0].finish_reason == "length"
    assert max(held) <= 1 + -(-WINDOW // BLOCK) + 1
    exact = WINDOW + SINKS - len(prompt) + 1  # tokens sampled by queries that see everything
    full = hf_greedy(load_hf(str(short_context.parent / "full")), prompt, exact + 10)
    assert tokens[:exact] == full[:exact]
    windowed = hf_greedy(load_hf(str(short_context)), prompt, 60)
    assert tokens[:60] != windowed


def test_attention_sinks_need_a_window_and_change_the_namespace(short_context: Path) -> None:
    with pytest.raises(InvalidRequestError, match="needs a model with a sliding window"):
        _llm(short_context.parent / "full", attention_sinks=2)
    with pytest.raises(InvalidRequestError, match="max_position_embeddings"):
        _llm(short_context, max_model_len=65)
    plain = _llm(short_context).namespace
    assert _llm(short_context, attention_sinks=2).namespace == plain + "-sinks2"


def test_preemption_and_forks_with_released_blocks_match(mistral: Path, oracle: Any) -> None:
    """Six sequences in a 9-block pool are preempted (5 times) and recomputed while their
    early blocks are released: their tokens equal a roomy pool's run without preemption
    (the tests above tie that to transformers; one is checked against it here too). Greedy
    n = 3 forks share tables with released entries and copy on write."""
    prompts = [_prompt(30 + 7 * i, seed=30 + i) for i in range(6)]
    llm = _llm(mistral, num_blocks=9, max_num_batched_tokens=32)
    outs = llm.generate(prompts, _greedy(50))
    assert sum(o.metrics.preemptions for o in outs) > 0
    roomy = _llm(mistral).generate(prompts, _greedy(50))
    assert sum(o.metrics.preemptions for o in roomy) == 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    assert outs[-1].outputs[0].token_ids == hf_greedy(oracle, prompts[-1], 50)
    assert llm.block_manager.num_referenced_blocks == 0
    prompt = _prompt(29, seed=40)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, n=3)
    [out] = _llm(mistral, num_blocks=16).generate([prompt], params)
    assert [c.token_ids for c in out.outputs] == [hf_greedy(oracle, prompt, 30)] * 3


def test_qwen2_with_mixed_layers_matches_and_keeps_its_blocks(tmp_path: Path) -> None:
    """Qwen2 windows only the layers from max_window_layers on: the full layer still reads
    every block, so none is released."""
    path = save_tiny(tmp_path / "qwen2", arch="qwen2", use_sliding_window=True,
                     sliding_window=WINDOW, max_window_layers=1, num_hidden_layers=2)
    llm = _llm(path)
    assert llm.model_config.layer_windows == (None, WINDOW)
    prompt = _prompt(50, seed=12)
    held: list[int] = []
    [out] = llm.generate([prompt], _greedy(40),
                         on_step=lambda _: held.append(llm.block_manager.num_referenced_blocks))
    assert out.outputs[0].token_ids == hf_greedy(load_hf(str(path)), prompt, 40)
    assert max(held) == 6  # ceil(90 / 16): every block of the sequence


LOCAL = ("dram.capacity_bytes=32MiB", "dram.page_size_bytes=8KiB", "hbm.mode=off",
         "nvme.enabled=false")


def test_a_windowed_model_through_the_store_matches_transformers(
        mistral: Path, oracle: Any, daemon_factory: Callable[..., Daemon]) -> None:
    """A writer with an 8-block pool offloads every block as it fills (before it slides out
    of the window and is released); a fresh reader hits 64 and 80 prompt tokens in the
    store but loads only the blocks the window covers before each cut (2 of 4, 2 of 5), says
    so in its request metrics (tokens and bytes), and generates transformers' tokens. (The
    lookup still needs every block up to the cut in the store, as for full attention.)"""
    d = daemon_factory(*LOCAL)
    prompts = [_prompt(75, seed=10), _prompt(90, seed=11)]
    want = [hf_greedy(oracle, p, 40) for p in prompts]
    writer = _llm(mistral, store=d.target, num_blocks=8, max_num_batched_tokens=32)
    assert [o.outputs[0].token_ids for o in writer.generate(prompts, _greedy(40))] == want
    writer.close()  # waits for the offloads
    assert writer.connector is not None and writer.connector.stats.offloaded_blocks >= 2 * 7
    reader = _llm(mistral, store=d.target)
    try:
        outs = reader.generate(prompts, _greedy(40))
    finally:
        reader.close()
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.metrics.cached_prompt_tokens for o in outs] == [64, 80]
    # Cut 64: the window of token 64 is 41..64, blocks 2 and 3; cut 80: 57..80, blocks 3, 4.
    assert [o.metrics.store_prompt_tokens for o in outs] == [32, 32]
    # The bytes: the window's 2 blocks each, not the hit's 4 and 5. One block is every
    # layer's K and V of 16 tokens: 3 layers x 2 x 16 x 2 kv heads x 16 dims x 4 bytes
    # (float32 on the CPU), worked out from the checkpoint's shape, not the engine's.
    block_bytes = 3 * 2 * BLOCK * TINY["num_key_value_heads"] * (
        TINY["hidden_size"] // TINY["num_attention_heads"]) * 4
    assert reader.dtype == torch.float32 and block_bytes == 12288
    loaded = [o.metrics.store_loaded_bytes for o in outs]
    assert loaded == [2 * block_bytes, 2 * block_bytes]
    hit = [o.metrics.cached_prompt_tokens // BLOCK * block_bytes for o in outs]
    assert hit == [4 * block_bytes, 5 * block_bytes] and loaded[0] < hit[0] and loaded[1] < hit[1]
    assert reader.connector is not None and reader.connector.stats.loaded_blocks == 4
