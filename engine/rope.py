"""Rotary position embeddings: the inverse frequencies of the default, linear, Llama 3 and
YaRN variants (the same formulas as transformers' modeling_rope_utils, so a checkpoint gives
the same logits here and there), and the cos/sin table the model indexes by position."""

from __future__ import annotations

import math

import torch

from kvstore.engine.config import ModelConfig, RopeScaling


def inv_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim // 2], attention factor applied to cos and sin)."""
    dim = config.head_dim
    base = config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (base**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3(inv_freq, scaling, config), 1.0
    if scaling.rope_type == "yarn":
        return _yarn(config, scaling)
    raise ValueError(f"rope_scaling.rope_type {scaling.rope_type!r} is not supported")


def _original_context(scaling: RopeScaling, config: ModelConfig) -> int:
    original = scaling.original_max_position_embeddings
    return int(original) if original else config.max_position_embeddings


def _llama3(inv_freq: torch.Tensor, scaling: RopeScaling, config: ModelConfig) -> torch.Tensor:
    factor = scaling.factor
    low_freq_factor = scaling.low_freq_factor or 1.0
    high_freq_factor = scaling.high_freq_factor or 4.0
    old_context_len = _original_context(scaling, config)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(config: ModelConfig, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    dim = config.head_dim
    base = config.rope_theta
    original = _original_context(scaling, config)
    factor = scaling.factor or config.max_position_embeddings / original
    attention_factor = scaling.attention_factor
    if attention_factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, scaling.mscale) / _yarn_mscale(
                factor, scaling.mscale_all_dim
            )
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.beta_fast or 32
    beta_slow = scaling.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return float(dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base)))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def cos_sin_table(config: ModelConfig, max_positions: int, device: torch.device) -> torch.Tensor:
    """[max_positions, 2, head_dim] float32: cos and sin of every position, already scaled."""
    inv_freq, attention_factor = inv_frequencies(config)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    table = torch.stack((emb.cos() * attention_factor, emb.sin() * attention_factor), dim=1)
    return table.to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated in the half-split (GPT-NeoX) layout that Hugging Face
    checkpoints use; cos/sin [tokens, head_dim] in float32."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    return x * cos + rotated * sin
