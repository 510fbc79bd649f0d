"""A random Llama checkpoint (config.json + model.safetensors) written without transformers:
for tests on machines that lack it, and for benchmarks that need a model of a given size
rather than a trained one."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_random_llama(
    folder: Path,
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    max_position_embeddings: int,
    seed: int = 0,
) -> Path:
    """Write the checkpoint into folder and return it. Weights are small Gaussians (norms 1),
    with a sharper lm_head so greedy decoding does not hinge on near-ties."""
    head_dim = hidden_size // num_heads
    kv = num_kv_heads * head_dim
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    weights = {"model.embed_tokens.weight": rand(vocab_size, hidden_size, scale=1.0),
               "model.norm.weight": torch.ones(hidden_size),
               "lm_head.weight": rand(vocab_size, hidden_size, scale=0.4)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        weights |= {p + "input_layernorm.weight": torch.ones(hidden_size),
                    p + "post_attention_layernorm.weight": torch.ones(hidden_size),
                    p + "self_attn.q_proj.weight": rand(num_heads * head_dim, hidden_size),
                    p + "self_attn.k_proj.weight": rand(kv, hidden_size),
                    p + "self_attn.v_proj.weight": rand(kv, hidden_size),
                    p + "self_attn.o_proj.weight": rand(hidden_size, num_heads * head_dim),
                    p + "mlp.gate_proj.weight": rand(intermediate_size, hidden_size),
                    p + "mlp.up_proj.weight": rand(intermediate_size, hidden_size),
                    p + "mlp.down_proj.weight": rand(hidden_size, intermediate_size)}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
              "vocab_size": vocab_size, "hidden_size": hidden_size,
              "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
              "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
              "max_position_embeddings": max_position_embeddings}
    (folder / "config.json").write_text(json.dumps(config))
    return folder
