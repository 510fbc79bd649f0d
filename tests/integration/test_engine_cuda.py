"""The engine on a GPU (marked `gpu`, skipped without CUDA): with the CUDA kernels picked by
ops_for, float32 greedy tokens equal the CPU reference run's (itself checked against
transformers), through chunked prefill, prefix caching and copy-on-write forks; bfloat16 runs
and agrees on the first tokens. No transformers needed: the GPU machine lacks it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvstore.engine.llm import LLM
from kvstore.engine.sampling import SamplingParams
from tests.engine.models import save_random

pytestmark = pytest.mark.gpu


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 17, 64, 150, 300)]


def _run(path: Path, device: str, dtype: str = "float32", n: int = 1) -> list[list[list[int]]]:
    llm = LLM(str(path), device=device, dtype=dtype, num_blocks=128, max_num_batched_tokens=128)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=n)
    outs = llm.generate(_prompts(), params)
    outs += llm.generate(_prompts()[3:], params)  # prefix-cache hits this time
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_cuda_float32_matches_the_cpu_reference(tmp_path: Path) -> None:
    path = save_random(tmp_path / "m")
    assert _run(path, "cuda") == _run(path, "cpu")


def test_cuda_forks_match_the_cpu_reference(tmp_path: Path) -> None:
    path = save_random(tmp_path / "m")
    assert _run(path, "cuda", n=3) == _run(path, "cpu", n=3)


def test_cuda_bfloat16_runs_and_starts_like_float32(tmp_path: Path) -> None:
    path = save_random(tmp_path / "m")
    bf16 = _run(path, "cuda", dtype="bfloat16")
    fp32 = _run(path, "cpu")
    first = [seqs[0][:3] for seqs in bf16], [seqs[0][:3] for seqs in fp32]
    assert sum(a == b for a, b in zip(*first, strict=True)) >= len(fp32) - 1
