"""Sliding-window attention in the included engine, against transformers on the same tiny
random Mistral checkpoint (every layer windowed, as transformers' Mistral does): greedy
generations match token for token past the window, for prompts shorter and longer than it,
with chunked prefill, with prefix caching serving a second run, and in a batch."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvstore.engine.llm import LLM
from kvstore.engine.sampling import SamplingParams
from tests.engine.models import save_tiny
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
