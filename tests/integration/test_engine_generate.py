"""The engine against transformers on the same checkpoint: greedy generations match token for
token (one request, a batch of different lengths, chunked prefill, prefix caching, forced
preemption, n > 1 forks), and the logits of a prompt are close."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.engine.llm import LLM
from kvstore.engine.model import AttentionBatch
from kvstore.engine.sampling import SamplingParams
from tests.engine.models import save_random, save_tiny
from tests.engine.oracle import hf_greedy, hf_logits, load_hf

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def oracle(tiny: Path) -> Any:
    return load_hf(str(tiny))


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


def _llm(path: Path, **kw: Any) -> LLM:
    kw.setdefault("num_blocks", 256)
    return LLM(str(path), device="cpu", **kw)


def test_one_request_matches_transformers_greedy(tiny: Path, oracle: Any) -> None:
    prompt = _prompt(37, seed=1)
    [out] = _llm(tiny).generate([prompt], GREEDY)
    assert out.outputs[0].token_ids == hf_greedy(oracle, prompt, 24)
    assert out.outputs[0].finish_reason == "length"
    assert out.metrics.prompt_tokens == 37 and out.metrics.generated_tokens == 24
    assert out.metrics.ttft_s > 0 and out.metrics.tpot_s > 0


def test_batch_of_different_lengths_matches(tiny: Path, oracle: Any) -> None:
    prompts = [_prompt(n, seed=n) for n in (3, 16, 17, 64, 150)]
    outs = _llm(tiny).generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(oracle, prompt, 24)


def test_chunked_prefill_beside_decodes_matches(tiny: Path, oracle: Any) -> None:
    # A 32-token budget cuts the 200-token prompt into 7 chunks while the short ones decode.
    prompts = [_prompt(5, seed=7), _prompt(200, seed=8), _prompt(9, seed=9)]
    llm = _llm(tiny, max_num_batched_tokens=32)
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(oracle, prompt, 24)


def test_prefix_cache_serves_the_second_run(tiny: Path, oracle: Any) -> None:
    prompt = _prompt(70, seed=3)
    llm = _llm(tiny)
    [first] = llm.generate([prompt], GREEDY)
    [second] = llm.generate([prompt], GREEDY)
    assert first.metrics.cached_prompt_tokens == 0
    # 4 full blocks of 16; a whole-prompt hit is never taken, the last token is recomputed.
    assert second.metrics.cached_prompt_tokens == 64
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert first.outputs[0].token_ids == hf_greedy(oracle, prompt, 24)
    diverged = prompt[:40] + _prompt(30, seed=4)
    [third] = llm.generate([diverged], GREEDY)
    assert third.metrics.cached_prompt_tokens == 32
    assert third.outputs[0].token_ids == hf_greedy(oracle, diverged, 24)


def test_prefix_caching_off_caches_nothing(tiny: Path) -> None:
    prompt = _prompt(70, seed=3)
    llm = _llm(tiny, enable_prefix_caching=False)
    llm.generate([prompt], GREEDY)
    [again] = llm.generate([prompt], GREEDY)
    assert again.metrics.cached_prompt_tokens == 0


def test_preemption_by_a_tiny_pool_still_matches(tiny: Path, oracle: Any) -> None:
    # 6 sequences of up to 60 + 24 tokens want 6 * 6 blocks; 14 blocks force recomputes.
    prompts = [_prompt(40 + 4 * i, seed=20 + i) for i in range(6)]
    llm = _llm(tiny, num_blocks=14)
    outs = llm.generate(prompts, GREEDY)
    assert sum(o.metrics.preemptions for o in outs) > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(oracle, prompt, 24)


def test_forks_share_then_copy_on_write(tiny: Path, oracle: Any) -> None:
    # Greedy n=3: every fork must equal the oracle; a copy-on-write bug (one child writing
    # into a block another still reads) would make them diverge.
    prompt = _prompt(21, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=3)
    llm = _llm(tiny)
    [out] = llm.generate([prompt], params)
    want = hf_greedy(oracle, prompt, 12)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.token_ids for c in out.outputs] == [want] * 3
    assert out.metrics.generated_tokens == 36


def test_seeded_sampling_repeats_and_forks_differ(tiny: Path) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, seed=11, n=2,
                            ignore_eos=True)
    llm = _llm(tiny)
    prompt = _prompt(10, seed=6)
    [a] = llm.generate([prompt], params)
    [b] = llm.generate([prompt], params)
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert a.outputs[0].token_ids != a.outputs[1].token_ids


def test_logits_close_to_transformers(tiny: Path, oracle: Any) -> None:
    prompt = _prompt(45, seed=2)
    llm = _llm(tiny)
    runner = llm.runner
    n = len(prompt)
    blocks = list(range(-(-n // 16)))
    table = torch.tensor([blocks], dtype=torch.int32)
    batch = AttentionBatch(
        positions=torch.arange(n),
        slot_mapping=torch.arange(n),
        num_decode_tokens=0,
        decode_block_tables=torch.zeros((0, 1), dtype=torch.int32),
        decode_context_lens=torch.zeros(0, dtype=torch.int32),
        prefill_block_tables=table,
        prefill_query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        prefill_context_lens=torch.tensor([n], dtype=torch.int32),
        logits_indices=torch.arange(n),
    )
    ours = runner.model(torch.tensor(prompt), batch, runner.kv_cache, runner.ops)
    torch.testing.assert_close(ours, hf_logits(oracle, prompt), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("qwen2", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                       "rope_theta": 10000.0}}),
        ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64}}),
        ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                       "original_max_position_embeddings": 128}}),
    ],
    ids=["qwen2", "tied", "rope-linear", "rope-llama3", "rope-yarn"],
)
def test_variants_match_transformers(
    tmp_path: Path, arch: str, overrides: dict[str, Any]
) -> None:
    path = save_tiny(tmp_path / arch, arch=arch, **overrides)
    oracle = load_hf(str(path))
    prompts = [_prompt(150, seed=30), _prompt(12, seed=31)]
    outs = _llm(path).generate(prompts, SamplingParams(temperature=0.0, max_tokens=10,
                                                       ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(oracle, prompt, 10)


def test_checkpoint_written_without_transformers_matches(tmp_path: Path) -> None:
    # The GPU tests use save_random (no transformers there); check it here against the oracle.
    path = save_random(tmp_path / "random")
    prompt = _prompt(40, seed=12)
    [out] = _llm(path).generate([prompt], GREEDY)
    assert out.outputs[0].token_ids == hf_greedy(load_hf(str(path)), prompt, 24)
