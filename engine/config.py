"""The engine's model description: `ModelConfig` (shapes, RoPE, special ids, dtype) and
`RopeScaling`, parsed and validated once from a Hugging Face config.json or from GGUF metadata.

Pure: no torch, no I/O. Every bad value raises ModelLoadError naming the file and the field;
a well-formed model the engine cannot run (another architecture, an unsupported RoPE type or
activation, a sliding window on a layout transformers runs without one) raises
UnsupportedModelError naming what it lacks.

Sliding-window attention is read as transformers applies it (`layer_windows`; the family
is model_type's, as AutoModelForCausalLM picks the class by it, else the class named in
`architectures`): Mistral windows every layer with `sliding_window`, as
transformers' Mistral does whatever `use_sliding_window` or `layer_types` say (a
`layer_types` with full-attention layers is refused: transformers' Mistral ignores it, its
Ministral honours it); Qwen2 windows the layers `layer_types` calls "sliding_attention"
(default: those from `max_window_layers` on) when `use_sliding_window` is true (default
false); a Llama config with a `sliding_window` in use is refused, as transformers' Llama
would ignore it.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.engine.errors import ModelLoadError, UnsupportedModelError

#: Hugging Face class name -> the engine's layout. Mistral is Llama with an optional window.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
GGUF_ARCHITECTURES = ("llama", "qwen2")
ROPE_TYPES = ("linear", "llama3", "yarn")
DTYPES = ("float32", "bfloat16", "float16")
_DEFAULT_ROPE_THETA = 10_000.0
_MISSING: Any = object()


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, with the fields transformers' `modeling_rope_utils` reads for the
    three supported types. `None` in an optional field means "the type's default"."""

    rope_type: str  #: "linear", "llama3" or "yarn".
    factor: float  #: Context stretch; for yarn without a factor: max_pos / original.
    low_freq_factor: float | None = None  #: llama3 only.
    high_freq_factor: float | None = None  #: llama3 only.
    #: llama3 and yarn: the pre-training context; defaults to max_position_embeddings.
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None  #: yarn: None = 32.
    beta_slow: float | None = None  #: yarn: None = 1.
    attention_factor: float | None = None  #: yarn: None = derived from factor and mscale.
    mscale: float | None = None  #: yarn.
    mscale_all_dim: float | None = None  #: yarn.
    truncate: bool | None = None  #: yarn: round the correction range; None = True.


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only model the engine can run (Llama or Qwen2 layout)."""

    architecture: str  #: "llama" or "qwen2": decides the weight layout and biases.
    vocab_size: int  #: Rows of the embedding and of lm_head.
    hidden_size: int  #: Width of the residual stream.
    intermediate_size: int  #: Width of the gated MLP.
    num_layers: int  #: Decoder blocks.
    num_heads: int  #: Query heads.
    num_kv_heads: int  #: Key/value heads (GQA); divides num_heads.
    head_dim: int  #: Width of one head.
    rms_norm_eps: float  #: RMSNorm epsilon.
    rope_theta: float  #: RoPE base frequency.
    rope_scaling: RopeScaling | None  #: None = plain RoPE.
    max_position_embeddings: int  #: Longest context the model was trained for.
    tie_word_embeddings: bool  #: lm_head shares the embedding matrix.
    qkv_bias: bool  #: q/k/v projections carry a bias.
    o_bias: bool  #: The output projection carries a bias.
    mlp_bias: bool  #: The MLP projections carry a bias.
    bos_token_id: int | None  #: Beginning-of-sequence id, if the model has one.
    eos_token_ids: tuple[int, ...]  #: Ids that end generation.
    #: The weights' dtype: "float32", "bfloat16" or "float16". The loader sets it from the
    #: stored tensors (config.json may not say); GGUF weights are dequantised to float32.
    torch_dtype: str
    #: Each layer's sliding window in tokens (None: full attention), or () when every layer
    #: attends to the whole context. A query at position p of a windowed layer attends to
    #: positions p - window + 1 .. p (transformers' `kv_idx > q_idx - sliding_window`).
    layer_windows: tuple[int | None, ...] = ()

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, or None for full attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer has the same one, else None: only then can a block
        that slid out of the window be freed (a full-attention layer still reads it)."""
        windows = set(self.layer_windows)
        if len(windows) != 1:
            return None
        return next(iter(windows))

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], source: str) -> ModelConfig:
        """Parse a Hugging Face config.json dict; `source` names the file in errors."""
        if not isinstance(config, Mapping):
            raise ModelLoadError(f"{source}: expected a JSON object, got {type(config).__name__}")
        f = _Fields(config, source)
        architecture = _hf_architecture(config, source)
        _check_hf_features(config, source)
        windows = _hf_windows(config, f, source)
        num_heads = f.integer("num_attention_heads")
        hidden_size = f.integer("hidden_size")
        max_pos = f.integer("max_position_embeddings")
        theta, scaling = _hf_rope(config, source, max_pos)
        attention_bias = f.flag("attention_bias", False)
        qwen2 = architecture == "qwen2"
        return _validated(
            cls(
                architecture=architecture,
                vocab_size=f.integer("vocab_size"),
                hidden_size=hidden_size,
                intermediate_size=f.integer("intermediate_size"),
                num_layers=f.integer("num_hidden_layers"),
                num_heads=num_heads,
                num_kv_heads=f.integer("num_key_value_heads", num_heads),
                head_dim=f.integer("head_dim", hidden_size // num_heads),
                rms_norm_eps=f.number("rms_norm_eps"),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=max_pos,
                tie_word_embeddings=f.flag("tie_word_embeddings", False),
                qkv_bias=True if qwen2 else attention_bias,
                o_bias=False if qwen2 else attention_bias,
                mlp_bias=False if qwen2 else f.flag("mlp_bias", False),
                bos_token_id=f.integer("bos_token_id", None, minimum=0),
                eos_token_ids=_eos_ids(config, source, "eos_token_id"),
                torch_dtype=_hf_dtype(config, source),
                layer_windows=windows,
            ),
            source,
        )

    @classmethod
    def from_gguf(
        cls, metadata: Mapping[str, Any], source: str, *, tie_word_embeddings: bool
    ) -> ModelConfig:
        """Parse GGUF metadata (key -> plain value); `tie_word_embeddings` is True when the file
        has no `output.weight` tensor. Weights come out dequantised, hence float32."""
        f = _Fields(metadata, source)
        arch = f.text("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{source}: general.architecture is {arch!r}; the engine supports "
                f"{', '.join(GGUF_ARCHITECTURES)}"
            )
        hidden_size = f.integer(f"{arch}.embedding_length")
        num_heads = f.integer(f"{arch}.attention.head_count")
        head_dim = f.integer(f"{arch}.attention.key_length", None)
        if head_dim is None:
            head_dim = f.integer(f"{arch}.rope.dimension_count", hidden_size // num_heads)
        max_pos = f.integer(f"{arch}.context_length")
        eos = _eos_ids(metadata, source, "tokenizer.ggml.eos_token_id")
        eot = _eos_ids(metadata, source, "tokenizer.ggml.eot_token_id")
        return _validated(
            cls(
                architecture=arch,
                vocab_size=_gguf_vocab_size(f, metadata, arch),
                hidden_size=hidden_size,
                intermediate_size=f.integer(f"{arch}.feed_forward_length"),
                num_layers=f.integer(f"{arch}.block_count"),
                num_heads=num_heads,
                num_kv_heads=f.integer(f"{arch}.attention.head_count_kv", num_heads),
                head_dim=head_dim,
                rms_norm_eps=f.number(f"{arch}.attention.layer_norm_rms_epsilon"),
                rope_theta=f.number(f"{arch}.rope.freq_base", _DEFAULT_ROPE_THETA),
                rope_scaling=_gguf_rope(f, arch, max_pos),
                max_position_embeddings=max_pos,
                tie_word_embeddings=tie_word_embeddings,
                qkv_bias=arch == "qwen2",
                o_bias=False,
                mlp_bias=False,
                bos_token_id=f.integer("tokenizer.ggml.bos_token_id", None, minimum=0),
                # llama.cpp stops on end-of-turn as well as end-of-text.
                eos_token_ids=eos + tuple(i for i in eot if i not in eos),
                torch_dtype="float32",
            ),
            source,
        )


def gguf_metadata(reader: Any) -> dict[str, Any]:
    """The key/value metadata of a `gguf.GGUFReader` as plain Python values (arrays as lists),
    the form `ModelConfig.from_gguf` and `Tokenizer.from_gguf` read."""
    return {key: field.contents() for key, field in reader.fields.items()}


class _Fields:
    """Typed reads of one flat mapping; every error names `source` and the key. A default of
    `_MISSING` makes the key required; JSON null counts as absent."""

    def __init__(self, data: Mapping[str, Any], source: str, prefix: str = "") -> None:
        self.data, self.source, self.prefix = data, source, prefix

    def _raw(self, key: str, default: Any) -> tuple[bool, Any]:
        """(found, value): value is the default when the key is absent or null."""
        value = self.data.get(key)
        if value is not None:
            return True, value
        if default is _MISSING:
            raise ModelLoadError(f"{self.source}: required field `{self.prefix}{key}` is missing")
        return False, default

    def _bad(self, key: str, value: Any, want: str) -> ModelLoadError:
        return ModelLoadError(
            f"{self.source}: field `{self.prefix}{key}` must be {want}, got {value!r}"
        )

    def integer(self, key: str, default: Any = _MISSING, minimum: int = 1) -> Any:
        found, value = self._raw(key, default)
        if not found:
            return value
        # JSON `true` is a Python bool, which is an int; it is never a size.
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise self._bad(key, value, "an integer")
        if int(value) < minimum:
            raise self._bad(key, value, f">= {minimum}")
        return int(value)

    def number(self, key: str, default: Any = _MISSING, positive: bool = True) -> Any:
        found, value = self._raw(key, default)
        if not found:
            return value
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise self._bad(key, value, "a number")
        if positive and not float(value) > 0:
            raise self._bad(key, value, "> 0")
        return float(value)

    def flag(self, key: str, default: Any = _MISSING) -> Any:
        found, value = self._raw(key, default)
        if found and not isinstance(value, bool):
            raise self._bad(key, value, "true or false")
        return value

    def text(self, key: str, default: Any = _MISSING) -> Any:
        found, value = self._raw(key, default)
        if found and not isinstance(value, str):
            raise self._bad(key, value, "a string")
        return value


def _hf_architecture(config: Mapping[str, Any], source: str) -> str:
    archs = config.get("architectures")
    if archs is not None:
        if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
            raise ModelLoadError(
                f"{source}: field `architectures` must be a non-empty list of class names, "
                f"got {archs!r}"
            )
        for name in archs:
            if name in HF_ARCHITECTURES:
                return HF_ARCHITECTURES[name]
        raise UnsupportedModelError(
            f"{source}: architectures {archs} is not supported; the engine runs "
            f"{', '.join(HF_ARCHITECTURES)}"
        )
    model_type = config.get("model_type")
    if model_type is None:
        raise ModelLoadError(
            f"{source}: required field `architectures` (or `model_type`) is missing"
        )
    if model_type not in _HF_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{source}: model_type {model_type!r} is not supported; the engine runs "
            f"{', '.join(HF_ARCHITECTURES)}"
        )
    return _HF_MODEL_TYPES[model_type]


def _check_hf_features(config: Mapping[str, Any], source: str) -> None:
    """Reject the variants of the supported architectures the engine does not implement."""
    if config.get("quantization_config") is not None:
        method = config["quantization_config"]
        method = method.get("quant_method") if isinstance(method, Mapping) else method
        raise UnsupportedModelError(
            f"{source}: quantization_config ({method}) is not supported; use unquantised "
            "safetensors or a GGUF file"
        )
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported; only 'silu'")
    partial = config.get("partial_rotary_factor", 1.0)
    if partial is not None and partial != 1.0:
        raise UnsupportedModelError(
            f"{source}: partial_rotary_factor={partial!r} is not supported; only 1.0"
        )


LAYER_TYPES = ("full_attention", "sliding_attention")


def _hf_family(config: Mapping[str, Any]) -> str:
    """"mistral", "qwen2" or "llama": whose sliding-window rules apply. transformers'
    AutoModelForCausalLM picks the class by model_type, so that decides; the first supported
    class in `architectures` only when model_type is missing."""
    model_type = config.get("model_type")
    if model_type in _HF_MODEL_TYPES:
        return str(model_type)
    archs = config.get("architectures")
    if isinstance(archs, list):
        for name in archs:
            if name in HF_ARCHITECTURES:
                return {"MistralForCausalLM": "mistral",
                        "Qwen2ForCausalLM": "qwen2"}.get(name, "llama")
    return str(config.get("model_type"))


def _hf_windows(config: Mapping[str, Any], f: _Fields, source: str
                ) -> tuple[int | None, ...]:
    """Each layer's sliding window, as transformers applies it (see the module docstring),
    or () when no layer has one."""
    family = _hf_family(config)
    num_layers: int = f.integer("num_hidden_layers")
    window: int | None = f.integer("sliding_window", None)
    layer_types = config.get("layer_types")
    if layer_types is not None:
        if (not isinstance(layer_types, list) or len(layer_types) != num_layers
                or any(t not in LAYER_TYPES for t in layer_types)):
            raise UnsupportedModelError(
                f"{source}: layer_types {layer_types!r}: need one of {', '.join(LAYER_TYPES)} "
                f"for each of the {num_layers} layers")
    if family == "mistral":
        if window is None:
            return ()
        if layer_types is not None and "full_attention" in layer_types:
            raise UnsupportedModelError(
                f"{source}: layer_types {layer_types!r} with sliding_window={window}: "
                "transformers' Mistral windows every layer whatever layer_types says (its "
                "Ministral does not); only all 'sliding_attention' is supported")
        return (window,) * num_layers
    use = f.flag("use_sliding_window", family != "qwen2")
    if family == "qwen2":
        if window is None or not use:
            return ()
        if layer_types is None:
            first = f.integer("max_window_layers", 28, minimum=0)
            layer_types = ["sliding_attention" if i >= first else "full_attention"
                           for i in range(num_layers)]
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        return windows if any(w is not None for w in windows) else ()
    if (window is not None and use) or (layer_types and "sliding_attention" in layer_types):
        raise UnsupportedModelError(
            f"{source}: sliding_window={window!r}, layer_types={layer_types!r}: transformers' "
            "Llama runs without a window; a windowed checkpoint should name "
            "MistralForCausalLM (sliding-window attention is supported for Mistral and Qwen2)")
    return ()


def _hf_rope(
    config: Mapping[str, Any], source: str, max_pos: int
) -> tuple[float, RopeScaling | None]:
    """RoPE from either form: transformers 4 (`rope_theta` + `rope_scaling`) or transformers 5
    (`rope_parameters`). As in transformers, `rope_scaling` wins when both are present."""
    name = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    params = config.get(name) or {}
    if not isinstance(params, Mapping):
        raise ModelLoadError(f"{source}: field `{name}` must be an object, got {params!r}")
    theta = _Fields(params, source, f"{name}.").number("rope_theta", None)
    if theta is None:
        theta = _Fields(config, source).number("rope_theta", _DEFAULT_ROPE_THETA)
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", 1.0)
    if partial is not None and partial != 1.0:
        raise UnsupportedModelError(
            f"{source}: {name}.partial_rotary_factor={partial!r} is not supported; only 1.0"
        )
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: {name}.rope_type {rope_type!r} is not supported; the engine implements "
            f"default, {', '.join(ROPE_TYPES)}"
        )
    # Phi-3-style configs keep the pre-training length at the top level; transformers prefers it.
    original = config.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings"
    )
    merged = {**params, "original_max_position_embeddings": original or max_pos}
    return theta, _rope_scaling(_Fields(merged, source, f"{name}."), rope_type, max_pos)


def _rope_scaling(f: _Fields, rope_type: str, max_pos: int) -> RopeScaling:
    if rope_type == "linear":
        return RopeScaling("linear", factor=f.number("factor"))
    original = f.integer("original_max_position_embeddings")
    if rope_type == "llama3":
        return RopeScaling(
            "llama3",
            factor=f.number("factor"),
            low_freq_factor=f.number("low_freq_factor"),
            high_freq_factor=f.number("high_freq_factor"),
            original_max_position_embeddings=original,
        )
    truncate = f.data.get("truncate")
    if truncate is not None and not isinstance(truncate, bool):
        raise f._bad("truncate", truncate, "true or false")
    return RopeScaling(
        "yarn",
        factor=f.number("factor", max_pos / original),
        original_max_position_embeddings=original,
        beta_fast=f.number("beta_fast", None),
        beta_slow=f.number("beta_slow", None),
        attention_factor=f.number("attention_factor", None),
        mscale=f.number("mscale", None, positive=False),
        mscale_all_dim=f.number("mscale_all_dim", None, positive=False),
        truncate=truncate,
    )


def _gguf_rope(f: _Fields, arch: str, max_pos: int) -> RopeScaling | None:
    key = f"{arch}.rope.scaling.type"
    rope_type = f.text(key, None)
    if rope_type in (None, "none"):
        # Older converters wrote only a linear factor.
        linear = f.number(f"{arch}.rope.scale_linear", None)
        return None if linear in (None, 1.0) else RopeScaling("linear", factor=linear)
    if rope_type == "linear":
        return RopeScaling("linear", factor=f.number(f"{arch}.rope.scaling.factor"))
    if rope_type == "yarn":
        return RopeScaling(
            "yarn",
            factor=f.number(f"{arch}.rope.scaling.factor"),
            original_max_position_embeddings=f.integer(
                f"{arch}.rope.scaling.original_context_length", max_pos
            ),
            beta_fast=f.number(f"{arch}.rope.scaling.yarn_beta_fast", None),
            beta_slow=f.number(f"{arch}.rope.scaling.yarn_beta_slow", None),
        )
    raise UnsupportedModelError(
        f"{f.source}: {key} {rope_type!r} is not supported; the engine implements "
        "none, linear, yarn"
    )


def _gguf_vocab_size(f: _Fields, metadata: Mapping[str, Any], arch: str) -> int:
    size: int | None = f.integer(f"{arch}.vocab_size", None)
    if size is not None:
        return size
    tokens = metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, (list, tuple)) and tokens:
        return len(tokens)
    raise ModelLoadError(
        f"{f.source}: neither `{arch}.vocab_size` nor `tokenizer.ggml.tokens` gives the vocab size"
    )


def _eos_ids(data: Mapping[str, Any], source: str, key: str) -> tuple[int, ...]:
    value = data.get(key)
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            raise ModelLoadError(
                f"{source}: field `{key}` must be a token id or a list of them, got {value!r}"
            )
    return tuple(dict.fromkeys(int(v) for v in values))


def _hf_dtype(config: Mapping[str, Any], source: str) -> str:
    key = "dtype" if "dtype" in config else "torch_dtype"
    dtype = config.get(key) or "float32"
    if dtype not in DTYPES:
        raise UnsupportedModelError(
            f"{source}: {key} {dtype!r} is not supported; the engine loads {', '.join(DTYPES)}"
        )
    return str(dtype)


def _validated(config: ModelConfig, source: str) -> ModelConfig:
    if config.num_heads % config.num_kv_heads:
        raise ModelLoadError(
            f"{source}: num_attention_heads={config.num_heads} is not a multiple of "
            f"num_key_value_heads={config.num_kv_heads}"
        )
    if config.head_dim < 2 or config.head_dim % 2:
        raise ModelLoadError(f"{source}: head_dim={config.head_dim} must be even and >= 2 for RoPE")
    if config.bos_token_id is not None and config.bos_token_id >= config.vocab_size:
        raise ModelLoadError(
            f"{source}: bos_token_id={config.bos_token_id} is outside "
            f"vocab_size={config.vocab_size}"
        )
    bad_eos = [i for i in config.eos_token_ids if i >= config.vocab_size]
    if bad_eos:
        raise ModelLoadError(
            f"{source}: eos_token_id {bad_eos} is outside vocab_size={config.vocab_size}"
        )
    return config
