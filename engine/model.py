"""The Llama-family decoder in torch: RMSNorm, RoPE, grouped-query attention over the paged KV
cache, SwiGLU MLP, tied or untied embeddings; Qwen2's q/k/v biases. Module and parameter names
are Hugging Face's, so a checkpoint's state dict loads as it is. Attention reads and writes
the cache through the kernels chosen for the device (kvstore.kernels), each layer with its
sliding window (ModelConfig.layer_windows; Mistral's and Qwen2's) and the engine's attention
sinks, if any."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvstore.engine.config import ModelConfig
from kvstore.engine.rope import apply_rope, cos_sin_table
from kvstore.kernels import KernelOps


@dataclass
class AttentionBatch:
    """Where the tokens of one forward pass sit. The first num_decode_tokens tokens are
    decodes (one per sequence, attended by the decode kernel); the rest are prefill chunks."""

    positions: torch.Tensor  # int64 [num_tokens]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # int32 [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor  # int32 [num_decodes]
    prefill_block_tables: torch.Tensor  # int32 [num_prefills, max_blocks]
    prefill_query_start_loc: torch.Tensor  # int32 [num_prefills + 1]
    prefill_context_lens: torch.Tensor  # int32 [num_prefills]
    logits_indices: torch.Tensor  # int64 [num_logits]: tokens whose next-token logits are needed


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 whatever the model dtype, as the reference implementation does.
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        #: This layer's sliding window (None: full attention), and the attention sinks kept
        #: beside it (set by CausalLM.set_attention_sinks; 0 = none, what the model computes).
        self.window = config.window(layer)
        self.sinks = 0
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=config.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        batch: AttentionBatch,
        ops: KernelOps,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        k_cache, v_cache = kv[0], kv[1]
        ops.write_cache(k, v, k_cache, v_cache, batch.slot_mapping)
        decodes = batch.num_decode_tokens
        parts = []
        if decodes:
            parts.append(
                ops.decode_attention(
                    q[:decodes],
                    k_cache,
                    v_cache,
                    batch.decode_block_tables,
                    batch.decode_context_lens,
                    self.scale,
                    window=self.window,
                    sinks=self.sinks,
                )
            )
        if tokens > decodes:
            parts.append(
                ops.prefill_attention(
                    q[decodes:],
                    k_cache,
                    v_cache,
                    batch.prefill_block_tables,
                    batch.prefill_query_start_loc,
                    batch.prefill_context_lens,
                    self.scale,
                    window=self.window,
                    sinks=self.sinks,
                )
            )
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        projected: torch.Tensor = self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))
        return projected


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), *args)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """model.* and lm_head, as in a Hugging Face LlamaForCausalLM checkpoint."""

    rope: torch.Tensor

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("rope", cos_sin_table(config, max_positions, device), persistent=False)

    @classmethod
    def from_weights(
        cls,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
    ) -> CausalLM:
        """Build on the meta device and adopt the checkpoint tensors, so the weights are held
        once (converted to dtype/device), never initialised and then overwritten."""
        with torch.device("meta"):
            model = cls(config, max_positions, torch.device("meta"))
        state = {name: t.to(device=device, dtype=dtype) for name, t in weights.items()}
        if config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        model.load_state_dict(state, strict=True, assign=True)
        model.rope = cos_sin_table(config, max_positions, device)
        return model.eval()

    def set_attention_sinks(self, sinks: int) -> None:
        """Keep the first `sinks` positions attendable beside every layer's sliding window
        (StreamingLLM's attention sinks): an approximation, not what the model computes.
        Layers without a window attend to everything anyway."""
        for layer in self.model.layers:
            attn = layer.self_attn
            assert isinstance(attn, Attention)
            attn.sinks = sinks if attn.window is not None else 0

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: torch.Tensor,
        ops: KernelOps,
    ) -> torch.Tensor:
        """Next-token logits (float32) at batch.logits_indices, writing every token's K/V into
        kv_cache [layers, 2, blocks, block_size, kv_heads, head_dim]."""
        table = self.rope[batch.positions]
        cos, sin = table[:, 0], table[:, 1]
        x = self.model.embed_tokens(input_ids)
        for index, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, kv_cache[index], batch, ops)
        x = self.model.norm(x[batch.logits_indices])
        logits: torch.Tensor = self.lm_head(x)
        return logits.float()
