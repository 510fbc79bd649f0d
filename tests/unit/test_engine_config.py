"""ModelConfig parsing: Hugging Face config.json dicts in both RoPE forms (transformers 4's
`rope_theta` + `rope_scaling`, transformers 5's `rope_parameters`), GGUF metadata, and every
bad input naming the file and the field."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvstore.engine.config import ModelConfig, RopeScaling
from kvstore.engine.errors import ModelLoadError, UnsupportedModelError

SRC = "/models/m/config.json"


def llama(**overrides: Any) -> dict[str, Any]:
    """SmolLM2-135M's config.json as transformers 4 wrote it, plus overrides (None deletes)."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000,
        "rope_scaling": None,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    for key, value in overrides.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return cfg


def test_transformers4_llama_config() -> None:
    c = ModelConfig.from_hf(llama(), SRC)
    assert c == ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        rope_scaling=None,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        bos_token_id=1,
        eos_token_ids=(2,),
        torch_dtype="bfloat16",
    )


def test_transformers5_rope_parameters_and_defaults() -> None:
    cfg = llama(
        rope_theta=None,
        rope_scaling=None,
        torch_dtype=None,
        num_key_value_heads=None,
        tie_word_embeddings=None,
        bos_token_id=None,
        eos_token_id=[2, 7, 2],
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
        dtype="float16",
    )
    c = ModelConfig.from_hf(cfg, SRC)
    assert c.rope_theta == 500000.0 and c.rope_scaling is None
    assert c.num_kv_heads == 9  # defaults to num_attention_heads
    assert c.tie_word_embeddings is False  # LlamaConfig's default
    assert c.bos_token_id is None and c.eos_token_ids == (2, 7)
    assert c.torch_dtype == "float16"


def test_rope_theta_defaults_to_10000() -> None:
    assert ModelConfig.from_hf(llama(rope_theta=None), SRC).rope_theta == 10000.0


def test_explicit_head_dim_wins() -> None:
    assert ModelConfig.from_hf(llama(head_dim=32), SRC).head_dim == 32


def test_llama3_scaling_transformers4_form_with_type_key() -> None:
    scaling = {
        "type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    c = ModelConfig.from_hf(llama(rope_theta=500000.0, rope_scaling=scaling), SRC)
    assert c.rope_theta == 500000.0
    assert c.rope_scaling == RopeScaling(
        "llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )


def test_yarn_transformers5_form_fills_transformers_defaults() -> None:
    params = {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4, "beta_fast": 16}
    c = ModelConfig.from_hf(llama(rope_scaling=None, rope_parameters=params), SRC)
    assert c.rope_theta == 1e6
    # original_max_position_embeddings defaults to max_position_embeddings, as in transformers.
    assert c.rope_scaling == RopeScaling(
        "yarn", factor=4.0, original_max_position_embeddings=8192, beta_fast=16.0
    )


def test_yarn_without_factor_uses_context_ratio() -> None:
    params = {"rope_type": "yarn", "original_max_position_embeddings": 2048, "mscale": 0.707}
    c = ModelConfig.from_hf(llama(rope_parameters=params), SRC)
    assert c.rope_scaling is not None
    assert c.rope_scaling.factor == 4.0 and c.rope_scaling.mscale == 0.707


def test_linear_scaling() -> None:
    c = ModelConfig.from_hf(llama(rope_scaling={"rope_type": "linear", "factor": 2.0}), SRC)
    assert c.rope_scaling == RopeScaling("linear", factor=2.0)


def test_rope_scaling_wins_over_rope_parameters_like_transformers() -> None:
    cfg = llama(
        rope_scaling={"type": "linear", "factor": 3.0},
        rope_parameters={"rope_type": "default", "rope_theta": 1.0},
    )
    assert ModelConfig.from_hf(cfg, SRC).rope_scaling == RopeScaling("linear", factor=3.0)


def test_qwen2_biases_and_unused_sliding_window() -> None:
    cfg = llama(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        sliding_window=32768,
        use_sliding_window=False,
        layer_types=["full_attention"] * 30,
        attention_bias=True,
    )
    c = ModelConfig.from_hf(cfg, SRC)
    assert (c.architecture, c.qkv_bias, c.o_bias, c.mlp_bias) == ("qwen2", True, False, False)


def test_llama_attention_and_mlp_bias() -> None:
    c = ModelConfig.from_hf(llama(attention_bias=True, mlp_bias=True), SRC)
    assert (c.qkv_bias, c.o_bias, c.mlp_bias) == (True, True, True)


def test_mistral_without_sliding_window_is_llama() -> None:
    cfg = llama(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    assert ModelConfig.from_hf(cfg, SRC).architecture == "llama"


def test_full_attention_models_have_no_windows() -> None:
    c = ModelConfig.from_hf(llama(), SRC)
    assert c.layer_windows == () and c.window(3) is None and c.uniform_window is None


def test_mistral_windows_every_layer_as_transformers_does() -> None:
    """transformers' Mistral applies sliding_window to every layer, use_sliding_window or
    not."""
    for extra in ({}, {"use_sliding_window": False},
                  {"layer_types": ["sliding_attention"] * 30}):
        cfg = llama(architectures=["MistralForCausalLM"], model_type="mistral",
                    sliding_window=32, **extra)
        c = ModelConfig.from_hf(cfg, SRC)
        assert c.layer_windows == (32,) * 30 and c.window(0) == 32 and c.uniform_window == 32


def test_qwen2_windows_follow_use_sliding_window_and_layer_types() -> None:
    base = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "sliding_window": 16}
    assert ModelConfig.from_hf(llama(**base), SRC).layer_windows == ()  # default: off
    mixed = ["full_attention", "sliding_attention"] * 15
    c = ModelConfig.from_hf(llama(**base, use_sliding_window=True, layer_types=mixed), SRC)
    assert c.layer_windows == (None, 16) * 15 and c.uniform_window is None
    # Without layer_types, transformers windows the layers from max_window_layers on.
    c = ModelConfig.from_hf(llama(**base, use_sliding_window=True, max_window_layers=28), SRC)
    assert c.layer_windows == (None,) * 28 + (16, 16)


def test_model_type_decides_the_window_rules_as_automodel_does() -> None:
    """AutoModelForCausalLM builds the class of model_type: a Llama-named checkpoint of
    model_type mistral is run as Mistral, windowed; without model_type the class decides."""
    cfg = llama(model_type="mistral", sliding_window=32)
    assert ModelConfig.from_hf(cfg, SRC).layer_windows == (32,) * 30
    cfg = llama(architectures=["MistralForCausalLM"], model_type=None, sliding_window=32)
    assert ModelConfig.from_hf(cfg, SRC).layer_windows == (32,) * 30


def test_a_bad_sliding_window_is_named() -> None:
    cfg = llama(architectures=["MistralForCausalLM"], sliding_window=0)
    with pytest.raises(ModelLoadError, match="sliding_window"):
        ModelConfig.from_hf(cfg, SRC)


def test_model_type_alone_is_enough() -> None:
    assert ModelConfig.from_hf(llama(architectures=None), SRC).architecture == "llama"


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
        ({"architectures": None, "model_type": "gemma"}, "gemma"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
        ({"rope_parameters": {"rope_type": "longrope"}}, "rope_parameters.rope_type"),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 2, "partial_rotary_factor": 0.5}},
            "partial_rotary_factor",
        ),
        ({"sliding_window": 4096}, "sliding_window"),  # transformers' Llama ignores it
        ({"layer_types": ["sliding_attention"] * 30}, "layer_types"),
        ({"layer_types": ["chunked_attention"] * 30}, "layer_types"),
        ({"layer_types": ["full_attention"] * 29}, "layer_types"),
        (
            {
                "architectures": ["MistralForCausalLM"],
                "model_type": "mistral",
                "sliding_window": 64,
                "layer_types": ["full_attention", "sliding_attention"] * 15,
            },
            "Ministral",
        ),
        ({"torch_dtype": "float8_e4m3fn"}, "torch_dtype"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config (awq)"),
    ],
)
def test_unsupported_models_name_what_is_missing(overrides: dict[str, Any], needle: str) -> None:
    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_hf(llama(**overrides), SRC)
    assert needle in str(e.value) and SRC in str(e.value)


def test_unsupported_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM.*Qwen2ForCausalLM"):
        ModelConfig.from_hf(llama(architectures=["PhiForCausalLM"]), SRC)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"hidden_size": None}, "`hidden_size`"),
        ({"vocab_size": None}, "`vocab_size`"),
        ({"num_hidden_layers": None}, "`num_hidden_layers`"),
        ({"max_position_embeddings": None}, "`max_position_embeddings`"),
        ({"rms_norm_eps": None}, "`rms_norm_eps`"),
        ({"architectures": None, "model_type": None}, "`architectures`"),
        ({"hidden_size": "576"}, "`hidden_size`"),
        ({"num_attention_heads": 0}, "`num_attention_heads`"),
        ({"intermediate_size": 1536.0}, "`intermediate_size`"),
        ({"num_hidden_layers": True}, "`num_hidden_layers`"),
        ({"rms_norm_eps": -1.0}, "`rms_norm_eps`"),
        ({"rope_theta": "big"}, "`rope_theta`"),
        ({"tie_word_embeddings": "yes"}, "`tie_word_embeddings`"),
        ({"eos_token_id": "2"}, "`eos_token_id`"),
        ({"bos_token_id": -1}, "`bos_token_id`"),
        ({"architectures": "LlamaForCausalLM"}, "`architectures`"),
        ({"rope_scaling": {"rope_type": "linear"}}, "`rope_scaling.factor`"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "`rope_scaling.low_freq_factor`",
        ),
        ({"rope_parameters": {"rope_type": "yarn", "factor": "x"}}, "`rope_parameters.factor`"),
        ({"rope_parameters": {"rope_theta": -5}}, "`rope_parameters.rope_theta`"),
        ({"rope_parameters": "default"}, "`rope_parameters`"),
    ],
)
def test_bad_fields_are_named(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ModelLoadError) as e:
        ModelConfig.from_hf(llama(**overrides), SRC)
    assert not isinstance(e.value, UnsupportedModelError)
    assert field in str(e.value) and SRC in str(e.value)


def test_heads_not_divisible_by_kv_heads() -> None:
    with pytest.raises(ModelLoadError, match="num_attention_heads=9.*num_key_value_heads=4"):
        ModelConfig.from_hf(llama(num_key_value_heads=4), SRC)


def test_eos_outside_vocab() -> None:
    with pytest.raises(ModelLoadError, match="eos_token_id"):
        ModelConfig.from_hf(llama(eos_token_id=[2, 49152]), SRC)


def test_not_an_object() -> None:
    with pytest.raises(ModelLoadError, match="JSON object"):
        ModelConfig.from_hf([1, 2], SRC)  # type: ignore[arg-type]


# --- GGUF metadata ---------------------------------------------------------------------------

GGUF_SRC = "/models/smollm2.gguf"


def smollm2_metadata(**overrides: Any) -> dict[str, Any]:
    """SmolLM2-135M-Instruct.Q4_1.gguf's metadata, as read from the real file."""
    meta: dict[str, Any] = {
        "general.architecture": "llama",
        "llama.block_count": 30,
        "llama.context_length": 8192,
        "llama.embedding_length": 576,
        "llama.feed_forward_length": 1536,
        "llama.attention.head_count": 9,
        "llama.attention.head_count_kv": 3,
        "llama.rope.freq_base": 100000.0,
        "llama.attention.layer_norm_rms_epsilon": 9.999999747378752e-06,
        "llama.vocab_size": 49152,
        "llama.rope.dimension_count": 64,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    for key, value in overrides.items():
        key = key.replace("__", ".")
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    return meta


def test_gguf_smollm2() -> None:
    c = ModelConfig.from_gguf(smollm2_metadata(), GGUF_SRC, tie_word_embeddings=True)
    # The same model as its Hugging Face config.json, dequantised to float32; GGUF stores the
    # epsilon as a float32.
    hf = ModelConfig.from_hf(llama(torch_dtype="float32"), SRC)
    assert c == dataclasses.replace(hf, rms_norm_eps=9.999999747378752e-06)


def test_gguf_defaults_and_vocab_from_tokens() -> None:
    meta = smollm2_metadata(
        llama__vocab_size=None,
        llama__attention__head_count_kv=None,
        llama__rope__freq_base=None,
        llama__rope__dimension_count=None,
        tokenizer__ggml__bos_token_id=None,
        tokenizer__ggml__eot_token_id=5,
        **{"tokenizer.ggml.tokens": ["t"] * 100},
    )
    c = ModelConfig.from_gguf(meta, GGUF_SRC, tie_word_embeddings=False)
    assert c.vocab_size == 100 and c.num_kv_heads == 9 and c.head_dim == 64
    assert c.rope_theta == 10000.0 and c.bos_token_id is None
    assert c.eos_token_ids == (2, 5) and c.tie_word_embeddings is False


def test_gguf_qwen2_has_qkv_bias() -> None:
    meta = {k.replace("llama.", "qwen2."): v for k, v in smollm2_metadata().items()}
    meta["general.architecture"] = "qwen2"
    c = ModelConfig.from_gguf(meta, GGUF_SRC, tie_word_embeddings=True)
    assert (c.architecture, c.qkv_bias, c.o_bias) == ("qwen2", True, False)


def test_gguf_rope_scaling() -> None:
    yarn = smollm2_metadata(
        llama__rope__scaling__type="yarn",
        llama__rope__scaling__factor=4.0,
        llama__rope__scaling__original_context_length=2048,
    )
    c = ModelConfig.from_gguf(yarn, GGUF_SRC, tie_word_embeddings=True)
    assert c.rope_scaling == RopeScaling("yarn", 4.0, original_max_position_embeddings=2048)
    linear = smollm2_metadata(llama__rope__scaling__type="linear", llama__rope__scaling__factor=2.0)
    c = ModelConfig.from_gguf(linear, GGUF_SRC, tie_word_embeddings=True)
    assert c.rope_scaling == RopeScaling("linear", 2.0)
    none = smollm2_metadata(llama__rope__scaling__type="none")
    assert ModelConfig.from_gguf(none, GGUF_SRC, tie_word_embeddings=True).rope_scaling is None


@pytest.mark.parametrize(
    ("overrides", "needle", "error"),
    [
        ({"general__architecture": "gpt2"}, "general.architecture", UnsupportedModelError),
        (
            {"llama__rope__scaling__type": "longrope"},
            "llama.rope.scaling.type",
            UnsupportedModelError,
        ),
        ({"general__architecture": None}, "`general.architecture`", ModelLoadError),
        ({"llama__block_count": None}, "`llama.block_count`", ModelLoadError),
        ({"llama__embedding_length": "576"}, "`llama.embedding_length`", ModelLoadError),
        (
            {"llama__attention__layer_norm_rms_epsilon": None},
            "layer_norm_rms_epsilon",
            ModelLoadError,
        ),
        ({"llama__context_length": None}, "`llama.context_length`", ModelLoadError),
        ({"llama__vocab_size": None}, "tokenizer.ggml.tokens", ModelLoadError),
        ({"llama__attention__head_count_kv": 2}, "num_key_value_heads=2", ModelLoadError),
        ({"tokenizer__ggml__eos_token_id": 1 << 20}, "eos_token_id", ModelLoadError),
    ],
)
def test_gguf_bad_metadata_is_named(
    overrides: dict[str, Any], needle: str, error: type[Exception]
) -> None:
    with pytest.raises(error) as e:
        ModelConfig.from_gguf(smollm2_metadata(**overrides), GGUF_SRC, tie_word_embeddings=True)
    assert needle in str(e.value) and GGUF_SRC in str(e.value)
