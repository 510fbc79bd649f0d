"""Bad input to the engine gets a clear error naming the problem, raised before any work
starts: from LLM(...), from generate(...), and from the kvstore-engine CLI (exit 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstore.engine.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError
from kvstore.engine.llm import LLM
from kvstore.engine.sampling import SamplingParams
from tests.engine.models import save_tiny


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = save_tiny(tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=128)
    return LLM(str(path), device="cpu", num_blocks=64)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"seed": -3}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"max_tokens": 2.5}, "max_tokens"),
    ],
)
def test_sampling_values_are_checked(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kwargs)


def test_prompt_longer_than_the_context_fails_before_any_step(llm: LLM) -> None:
    steps: list[object] = []
    with pytest.raises(InvalidRequestError, match=r"prompts\[1\].*max_model_len is 128"):
        llm.generate([[5] * 10, [5] * 200], SamplingParams(max_tokens=4), on_step=steps.append)
    assert steps == []  # the valid first prompt did not start either
    assert not llm.scheduler.has_unfinished


@pytest.mark.parametrize(
    "prompts,match",
    [
        ([[5, 999]], r"prompts\[0\] holds 999"),
        ([[5, -1]], r"prompts\[0\] holds -1"),
        ([[]], "prompt is empty"),
        ([], "prompts is empty"),
        ([3.5], r"prompts\[0\] must be a string or a list"),
        (["hello"], "no tokenizer"),
    ],
)
def test_bad_prompts(llm: LLM, prompts: Any, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(prompts, SamplingParams(max_tokens=2))


def test_a_pool_too_small_for_one_sequence_is_refused(tmp_path: Path) -> None:
    path = save_tiny(tmp_path / "m")
    small = LLM(str(path), device="cpu", num_blocks=2)
    with pytest.raises(InvalidRequestError, match="needs 3 KV blocks; the cache has 2"):
        small.generate([[5] * 30], SamplingParams(max_tokens=10))


def test_sampling_params_count_must_match(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="2 entries for 3 prompts"):
        llm.generate([[5], [6], [7]], [SamplingParams(), SamplingParams()])


def test_missing_and_unsupported_models(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"), device="cpu")
    path = save_tiny(tmp_path / "m")
    config = (path / "config.json").read_text()
    (path / "config.json").write_text(
        config.replace("LlamaForCausalLM", "GPT2LMHeadModel").replace('"llama"', '"gpt2"')
    )
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel|gpt2"):
        LLM(str(path), device="cpu")


def test_engine_options_are_checked(tmp_path: Path) -> None:
    path = save_tiny(tmp_path / "m", max_position_embeddings=128)
    with pytest.raises(InvalidRequestError, match="max_model_len 4096 exceeds"):
        LLM(str(path), device="cpu", max_model_len=4096)
    with pytest.raises(InvalidRequestError, match="dtype"):
        LLM(str(path), device="cpu", dtype="float8")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore.engine.cli", *args],
        capture_output=True, text=True, timeout=120,
    )


def test_cli_names_the_problem_and_exits_2(tmp_path: Path) -> None:
    missing = _cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert missing.returncode == 2
    assert "error:" in missing.stderr and "nope" in missing.stderr
    assert "Traceback" not in missing.stderr
    bad = _cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi",
               "--temperature", "-1")
    assert bad.returncode == 2 and "temperature" in bad.stderr


def test_cli_refuses_attention_sinks_on_a_model_without_a_window(tmp_path: Path) -> None:
    model = save_tiny(tmp_path / "llama", max_position_embeddings=128)
    proc = _cli("generate", "--model", str(model), "--prompt", "hi", "--attention-sinks", "4",
                "--kv-cache-size", "8MiB", "--device", "cpu")
    assert proc.returncode == 2, proc.stderr
    assert "attention_sinks=4" in proc.stderr and "Traceback" not in proc.stderr


def test_a_failed_run_releases_its_blocks(llm: LLM) -> None:
    free = llm.block_manager.num_free_blocks

    def boom(info: object) -> None:
        raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        llm.generate([[5] * 40, [6] * 30], SamplingParams(max_tokens=8), on_step=boom)
    assert not llm.scheduler.has_unfinished
    assert llm.block_manager.num_free_blocks == free
    [out] = llm.generate([[5] * 40], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3
