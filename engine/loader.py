"""Checkpoint loading: a Hugging Face folder (config.json + safetensors, single or sharded) or a
GGUF file becomes one `Checkpoint` whose weights carry Hugging Face Llama names and layouts.

This module owns the tensor naming and shape contract (`expected_shapes`), the GGUF name map,
dequantisation and the undoing of llama.cpp's q/k row permutation. Every problem is raised
before any weight is handed out, naming the file and the tensor or field.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import re
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from kvstore.engine.config import ModelConfig
from kvstore.engine.errors import ModelLoadError, UnsupportedModelError
from kvstore.engine.tokenizer import Tokenizer, read_json

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
#: Hugging Face module path inside a layer -> llama.cpp's tensor name inside `blk.N`.
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")


@dataclass
class Checkpoint:
    """A loaded model: its config, its weights under Hugging Face names (lm_head omitted when
    tied), its tokenizer (None when the checkpoint ships none: the engine then takes token ids)."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    format: Literal["hf", "gguf"]
    name: str  #: The folder name or the file stem.


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Load a Hugging Face folder or a `.gguf` file; raises ModelLoadError (or its subclass
    UnsupportedModelError) naming the file and the field or tensor at fault."""
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"{p}: no such file or folder")
    if p.is_dir():
        return _load_hf(p)
    if p.suffix.lower() == ".gguf":
        return _load_gguf(p)
    raise ModelLoadError(
        f"{p}: expected a Hugging Face model folder (config.json + *.safetensors) or a .gguf file"
    )


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the engine needs, by Hugging Face name, with the shape the config implies."""
    c = config
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size)
    }
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (rows, c.hidden_size)
            if c.qkv_bias:
                shapes[f"{p}self_attn.{proj}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, q_rows)
        if c.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        for proj, shape in (
            ("gate", (c.intermediate_size, c.hidden_size)),
            ("up", (c.intermediate_size, c.hidden_size)),
            ("down", (c.hidden_size, c.intermediate_size)),
        ):
            shapes[f"{p}mlp.{proj}_proj.weight"] = shape
            if c.mlp_bias:
                shapes[f"{p}mlp.{proj}_proj.bias"] = shape[:1]
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name for a Hugging Face tensor name, e.g. `model.layers.3.mlp.up_proj.weight`
    -> `blk.3.ffn_up.weight`."""
    m = _LAYER_RE.fullmatch(hf_name)
    if m is not None and m.group(2) in _GGUF_LAYER_NAMES:
        return f"blk.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    module, _, leaf = hf_name.rpartition(".")
    if module in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[module]}.{leaf}"
    raise KeyError(hf_name)


# --- Hugging Face folders -------------------------------------------------------------------


def _load_hf(folder: Path) -> Checkpoint:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder}: no config.json; not a Hugging Face model folder")
    config = ModelConfig.from_hf(read_json(config_path), str(config_path))
    locations, listing = _tensor_locations(folder)
    weights = _read_safetensors(config, locations, listing)
    stored = weights["model.embed_tokens.weight"].dtype
    dtype_name = next((n for n, d in _DTYPES.items() if d == stored), None)
    if dtype_name is None:
        raise UnsupportedModelError(
            f"{locations['model.embed_tokens.weight']}: model.embed_tokens.weight is stored as "
            f"{stored}; the engine loads {', '.join(_DTYPES)}"
        )
    # One dtype for the whole model: the stored one, which config.json may not state.
    weights = {k: v if v.dtype == stored else v.to(stored) for k, v in weights.items()}
    config = dataclasses.replace(config, torch_dtype=dtype_name)
    tokenizer = Tokenizer.from_folder(folder) if (folder / "tokenizer.json").is_file() else None
    return Checkpoint(config, weights, _fitting(tokenizer, config, folder), "hf", folder.name)


def _tensor_locations(folder: Path) -> tuple[dict[str, Path], Path]:
    """Tensor name -> the safetensors file that holds it, from the shard index when present;
    and the file that lists the names (the index, or the single weight file)."""
    index_path = folder / _INDEX
    if index_path.is_file():
        index = read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index_path}: required field `weight_map` is missing")
        locations = {name: folder / str(shard) for name, shard in weight_map.items()}
        for shard in sorted(set(locations.values())):
            if not shard.is_file():
                raise ModelLoadError(f"{index_path}: names shard {shard.name}, which is missing")
        return locations, index_path
    files = (
        [folder / _SINGLE] if (folder / _SINGLE).is_file() else sorted(folder.glob("*.safetensors"))
    )
    if not files:
        hint = (
            " (only .bin weights; convert them to safetensors)" if any(folder.glob("*.bin")) else ""
        )
        raise ModelLoadError(f"{folder}: no *.safetensors weight file{hint}")
    locations = {}
    for file in files:
        with _open_safetensors(file) as f:
            locations.update(dict.fromkeys(f.keys(), file))
    return locations, files[0] if len(files) == 1 else folder


def _read_safetensors(
    config: ModelConfig, locations: dict[str, Path], listing: Path
) -> dict[str, torch.Tensor]:
    shapes = expected_shapes(config)
    by_file: dict[Path, list[str]] = {}
    for name in shapes:
        if name not in locations:
            raise ModelLoadError(f"{listing}: tensor {name} is missing")
        by_file.setdefault(locations[name], []).append(name)
    weights: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        with _open_safetensors(file) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise ModelLoadError(f"{file}: tensor {name} is missing")
                weights[name] = _checked(f.get_tensor(name), name, shapes[name], file)
    return weights


@contextmanager
def _open_safetensors(file: Path) -> Iterator[Any]:
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(file), framework="pt")
    except (OSError, SafetensorError) as e:
        raise ModelLoadError(f"{file}: not a readable safetensors file: {e}") from e
    with handle as f:
        yield f


def _checked(tensor: torch.Tensor, name: str, shape: tuple[int, ...], file: Path) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        raise ModelLoadError(
            f"{file}: tensor {name} has shape {list(tensor.shape)}, expected {list(shape)}"
        )
    return tensor


def _fitting(tokenizer: Tokenizer | None, config: ModelConfig, path: Path) -> Tokenizer | None:
    """The tokenizer, if every id it can produce has an embedding row (models often pad the
    embedding past the vocabulary, never the other way round)."""
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} ids but vocab_size is "
            f"{config.vocab_size}; the tokenizer does not belong to this model"
        )
    return tokenizer


# --- GGUF files -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _GgufTensor:
    """One tensor of a GGUF file: its raw rows (uint8, one row per innermost GGML row) as a
    view of the file mapping, its GGML type and its logical shape (GGML's `ne` reversed)."""

    name: str
    qtype: int
    shape: tuple[int, ...]
    rows: np.ndarray


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, _GgufTensor]]:
    """Metadata (key -> plain value, arrays as lists) and tensors of a GGUF v2/v3 file.
    gguf.GGUFReader builds a numpy view per array element, which takes seconds on a 49k-token
    vocabulary; this reads the header with struct and maps the tensor data once."""
    with open(path, "rb") as fh:
        try:
            data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: not a readable GGUF file: {e}") from e
    try:
        return _parse_gguf(path, data)
    except (struct.error, ValueError, UnicodeDecodeError, KeyError, IndexError) as e:
        raise ModelLoadError(f"{path}: not a valid GGUF file (truncated or corrupt): {e}") from e


#: GGUF value type -> struct code; 8 (string) and 9 (array) are read apart.
_GGUF_SCALARS = dict(enumerate("BbHhIif?")) | {10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _Cursor:
    """Little-endian reads from a buffer at a moving offset."""

    def __init__(self, data: Any) -> None:
        self.data, self.pos = data, 0

    def scalar(self, code: str) -> Any:
        (value,) = struct.unpack_from("<" + code, self.data, self.pos)
        self.pos += struct.calcsize(code)
        return value

    def string(self) -> str:
        size = self.scalar("Q")
        text = bytes(self.data[self.pos : self.pos + size]).decode("utf-8")
        self.pos += size
        return text

    def value(self, vtype: int) -> Any:
        if vtype == _GGUF_STRING:
            return self.string()
        if vtype != _GGUF_ARRAY:
            return self.scalar(_GGUF_SCALARS[vtype])
        item_type, count = self.scalar("I"), self.scalar("Q")
        if item_type in _GGUF_SCALARS:
            dtype = np.dtype("<" + _GGUF_SCALARS[item_type])
            items = np.frombuffer(self.data, dtype, count, self.pos)
            self.pos += dtype.itemsize * count
            return items.tolist()
        return [self.value(item_type) for _ in range(count)]


def _parse_gguf(path: Path, data: Any) -> tuple[dict[str, Any], dict[str, _GgufTensor]]:
    from gguf.constants import GGML_QUANT_SIZES

    c = _Cursor(data)
    if bytes(data[:4]) != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (no GGUF magic)")
    c.pos = 4
    version = c.scalar("I")
    if version not in (2, 3):
        raise UnsupportedModelError(f"{path}: GGUF version {version} (or big-endian) unsupported")
    num_tensors, num_kv = c.scalar("Q"), c.scalar("Q")
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = c.string()
        metadata[key] = c.value(c.scalar("I"))
    infos = []
    for _ in range(num_tensors):
        name = c.string()
        ne = [c.scalar("Q") for _ in range(c.scalar("I"))]
        infos.append((name, ne, c.scalar("I"), c.scalar("Q")))
    align = metadata.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0:
        raise ModelLoadError(f"{path}: general.alignment={align!r} must be a positive integer")
    start = -(-c.pos // align) * align
    tensors = {}
    for name, ne, qtype, offset in infos:
        sizes = GGML_QUANT_SIZES.get(qtype)  # IntEnum keys: a plain int finds them
        if sizes is None:
            raise UnsupportedModelError(f"{path}: tensor {name} has unknown GGML type {qtype}")
        block, block_bytes = sizes
        if not ne or ne[0] % block:
            raise ModelLoadError(f"{path}: tensor {name} has shape {ne}, not whole GGML blocks")
        row_bytes = ne[0] // block * block_bytes
        rows = int(np.prod(ne[1:], dtype=np.int64))
        raw = np.frombuffer(data, np.uint8, rows * row_bytes, start + offset)
        shape = tuple(reversed(ne))
        tensors[name] = _GgufTensor(name, qtype, shape, raw.reshape(*shape[:-1], row_bytes))
    return metadata, tensors


def _load_gguf(path: Path) -> Checkpoint:
    metadata, tensors = read_gguf(path)
    config = ModelConfig.from_gguf(
        metadata, str(path), tie_word_embeddings="output.weight" not in tensors
    )
    if "rope_freqs.weight" in tensors:
        # llama.cpp bakes llama3 RoPE scaling into this tensor; ignoring it would be silently wrong.
        raise UnsupportedModelError(
            f"{path}: tensor rope_freqs.weight (per-dimension RoPE factors) is not supported"
        )
    _check_gguf_names(path, tensors, config)
    shapes = expected_shapes(config)
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        arrays = pool.map(
            lambda n: _gguf_tensor(path, tensors[gguf_tensor_name(n)], shapes[n], config), shapes
        )
        weights = dict(zip(shapes, arrays, strict=True))
    tokenizer = None
    if "tokenizer.ggml.model" in metadata:
        tokenizer = Tokenizer.from_gguf(metadata, str(path))
    return Checkpoint(config, weights, _fitting(tokenizer, config, path), "gguf", path.stem)


def _check_gguf_names(path: Path, tensors: dict[str, _GgufTensor], config: ModelConfig) -> None:
    wanted = {gguf_tensor_name(name): name for name in expected_shapes(config)}
    for gguf_name, hf_name in wanted.items():
        if gguf_name not in tensors:
            raise ModelLoadError(f"{path}: tensor {gguf_name} ({hf_name}) is missing")
    layer_leaves = set(_GGUF_LAYER_NAMES.values())
    for gguf_name in sorted(tensors):
        m = re.fullmatch(r"blk\.\d+\.(\w+)\.(weight|bias)", gguf_name)
        if m is not None and m.group(1) in layer_leaves and gguf_name not in wanted:
            # A bias the metadata does not announce would be dropped: silently wrong output.
            raise UnsupportedModelError(
                f"{path}: tensor {gguf_name} is not part of the {config.architecture} layout "
                "the metadata describes"
            )


def _gguf_tensor(
    path: Path, info: _GgufTensor, shape: tuple[int, ...], config: ModelConfig
) -> torch.Tensor:
    """One tensor dequantised to float32, in Hugging Face layout: GGML's `ne` reversed is
    [out_features, in_features], as in Hugging Face."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    if info.shape != shape:
        raise ModelLoadError(
            f"{path}: tensor {info.name} has shape {list(info.shape)}, expected {list(shape)}"
        )
    qtype = GGMLQuantizationType(info.qtype)
    try:
        values = dequantize(info.rows, qtype)
    except NotImplementedError as e:
        raise UnsupportedModelError(
            f"{path}: tensor {info.name} has type {qtype.name}, which cannot be dequantised"
        ) from e
    # F32 comes back as a read-only view of the file mapping; torch needs its own copy.
    values = np.array(values, dtype=np.float32, copy=True).reshape(shape)
    if config.architecture == "llama" and (".attn_q." in info.name or ".attn_k." in info.name):
        # transformers' LlamaTensorProcessor: q uses num_heads, k num_kv_heads.
        heads = config.num_heads if ".attn_q." in info.name else config.num_kv_heads
        values = _unpermute_rows(values, heads)
    return torch.from_numpy(np.ascontiguousarray(values))


def _unpermute_rows(values: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's permute (convert_hf_to_gguf.py LlamaModel.permute), which interleaves
    the two halves of each head's rows for GGML's interleaved RoPE; HF rotates halves."""
    half = values.shape[0] // num_heads // 2
    w = values.reshape(num_heads, half, 2, *values.shape[1:])
    return w.swapaxes(2, 1).reshape(values.shape)
