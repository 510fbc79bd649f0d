"""load_checkpoint against transformers as the oracle: tiny random Llama and Qwen2 folders
(tied and untied, sharded and not, bf16, with biases) must give exactly transformers' state
dict; GGUF files written here with gguf.GGUFWriter, q/k permuted as llama.cpp does, must give
back the Hugging Face weights; the real SmolLM2 GGUF must match transformers' GGUF loader; and
every malformed input raises ModelLoadError naming the file and the tensor or field."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from kvstore.engine.errors import ModelLoadError, UnsupportedModelError
from kvstore.engine.loader import Checkpoint, gguf_tensor_name, load_checkpoint
from tests.engine.models import save_tiny, smollm2_gguf

VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama"},
    "llama-tied-sharded": {"arch": "llama", "tie_word_embeddings": True, "max_shard_size": "100KB"},
    "llama-biases": {"arch": "llama", "attention_bias": True, "mlp_bias": True},
    "qwen2-sharded": {"arch": "qwen2", "max_shard_size": "100KB"},
    "qwen2-tied": {"arch": "qwen2", "tie_word_embeddings": True},
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    made = {
        name: save_tiny(root / name, seed=i, **kw) for i, (name, kw) in enumerate(VARIANTS.items())
    }
    from transformers import AutoModelForCausalLM

    # bf16 as a real checkpoint has it: transformers casts and saves, config says bfloat16.
    model = AutoModelForCausalLM.from_pretrained(made["llama"]).to(torch.bfloat16)
    model.save_pretrained(root / "llama-bf16")
    made["llama-bf16"] = root / "llama-bf16"
    return made


def hf_state_dict(folder: Path, dtype: Any = "auto", **kwargs: Any) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
    return dict(model.state_dict())


def assert_same_weights(ckpt: Checkpoint, expected: dict[str, torch.Tensor]) -> None:
    names = set(expected) - ({"lm_head.weight"} if ckpt.config.tie_word_embeddings else set())
    assert set(ckpt.weights) == names
    for name, tensor in ckpt.weights.items():
        assert tensor.dtype == expected[name].dtype, name
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("variant", [*VARIANTS, "llama-bf16"])
def test_hf_folder_matches_transformers(folders: dict[str, Path], variant: str) -> None:
    ckpt = load_checkpoint(folders[variant])
    assert (ckpt.format, ckpt.name, ckpt.tokenizer) == ("hf", variant, None)
    assert ckpt.config.architecture == variant.split("-")[0]
    assert ckpt.config.tie_word_embeddings == ("tied" in variant)
    assert ckpt.config.torch_dtype == ("bfloat16" if "bf16" in variant else "float32")
    assert_same_weights(ckpt, hf_state_dict(folders[variant]))


def test_sharded_folder_really_is_sharded(folders: dict[str, Path]) -> None:
    assert len(list(folders["qwen2-sharded"].glob("*.safetensors"))) > 1
    assert (folders["qwen2-sharded"] / "model.safetensors.index.json").is_file()


# --- bad Hugging Face folders ---------------------------------------------------------------


def copy(folders: dict[str, Path], variant: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folders[variant], tmp_path / variant))


def rewrite_tensor(folder: Path, name: str, change: Callable[[torch.Tensor], Any]) -> None:
    file = folder / "model.safetensors"
    tensors = load_file(file)
    new = change(tensors.pop(name))
    if new is not None:
        tensors[name] = new
    save_file(tensors, file)


def load_error(path: Path, error: type[Exception] = ModelLoadError) -> str:
    with pytest.raises(error) as e:
        load_checkpoint(path)
    return str(e.value)


def test_missing_path(tmp_path: Path) -> None:
    assert "no such file or folder" in load_error(tmp_path / "nope")


def test_folder_without_config(tmp_path: Path) -> None:
    assert "no config.json" in load_error(tmp_path)


def test_not_a_model_file(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    assert ".gguf" in load_error(tmp_path / "weights.bin")


def test_broken_config_json_names_file_and_line(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = copy(folders, "llama", tmp_path)
    (folder / "config.json").write_text('{\n  "vocab_size": 256,\n  "hidden_size": ,\n}\n')
    message = load_error(folder)
    assert "config.json" in message and "line 3" in message


def test_unsupported_architecture(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = copy(folders, "llama", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    assert "GPT2LMHeadModel" in load_error(folder, UnsupportedModelError)


def test_config_missing_field(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = copy(folders, "llama", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["num_hidden_layers"]
    (folder / "config.json").write_text(json.dumps(config))
    message = load_error(folder)
    assert "`num_hidden_layers`" in message and "config.json" in message


def test_no_safetensors(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = copy(folders, "llama", tmp_path)
    (folder / "model.safetensors").unlink()
    assert "no *.safetensors" in load_error(folder)


def test_index_names_missing_shard(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = copy(folders, "qwen2-sharded", tmp_path)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    message = load_error(folder)
    assert shard.name in message and "model.safetensors.index.json" in message


def test_broken_index_json(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = copy(folders, "qwen2-sharded", tmp_path)
    (folder / "model.safetensors.index.json").write_text("{\n\n  weight_map: {}\n}")
    message = load_error(folder)
    assert "model.safetensors.index.json" in message and "line 3" in message


def test_missing_tensor_names_tensor_and_file(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = copy(folders, "llama", tmp_path)
    rewrite_tensor(folder, "model.layers.1.mlp.up_proj.weight", lambda t: None)
    message = load_error(folder)
    assert "model.layers.1.mlp.up_proj.weight" in message and "model.safetensors" in message


def test_missing_tensor_in_a_shard(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = copy(folders, "qwen2-sharded", tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = "model.layers.0.self_attn.q_proj.bias"
    shard = folder / index["weight_map"][name]
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard)
    message = load_error(folder)
    assert name in message and shard.name in message


def test_wrong_shape_names_tensor_and_shapes(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = copy(folders, "llama", tmp_path)
    rewrite_tensor(folder, "model.layers.0.self_attn.k_proj.weight", lambda t: t[:16].clone())
    message = load_error(folder)
    assert "model.layers.0.self_attn.k_proj.weight" in message
    assert "[16, 64]" in message and "[32, 64]" in message


def test_corrupt_safetensors(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = copy(folders, "llama", tmp_path)
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    assert "model.safetensors" in load_error(folder)


def test_extra_tensors_are_ignored(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = copy(folders, "llama", tmp_path)
    inv_freq = torch.ones(8)
    rewrite_tensor(folder, "model.norm.weight", lambda t: t)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = inv_freq
    save_file(tensors, folder / "model.safetensors")
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in load_checkpoint(folder).weights


# --- GGUF files written here ------------------------------------------------------------------


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    path: Path,
    state: dict[str, torch.Tensor],
    *,
    arch: str = "llama",
    quant: dict[str, GGMLQuantizationType] | None = None,
    drop: tuple[str, ...] = (),
    extra: dict[str, np.ndarray] | None = None,
    raw: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
    tie: bool = False,
) -> Path:
    """A GGUF of a tiny model (TINY's sizes) as llama.cpp's converter writes it."""
    writer = GGUFWriter(path, arch)
    writer.add_block_count(2)
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(256)
    if arch == "llama":
        writer.add_rope_dimension_count(16)
    for name, tensor in state.items():
        if tie and name == "lm_head.weight":
            continue
        data = tensor.float().numpy()
        gname = gguf_tensor_name(name)
        if gname in drop:
            continue
        if arch == "llama" and ".attn_q." in gname:
            data = llama_cpp_permute(data, 4, 4)
        elif arch == "llama" and ".attn_k." in gname:
            data = llama_cpp_permute(data, 4, 2)
        qtype = (quant or {}).get(gname)
        if qtype is None:
            writer.add_tensor(gname, np.ascontiguousarray(data))
        else:
            writer.add_tensor(gname, quantize(data, qtype), raw_dtype=qtype)
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    for name, (blocks, qtype) in (raw or {}).items():
        writer.add_tensor(name, blocks, raw_dtype=qtype)
    _finish(writer)
    return path


@pytest.fixture(scope="module")
def llama_state(folders: dict[str, Path]) -> dict[str, torch.Tensor]:
    return hf_state_dict(folders["llama"])


@pytest.mark.parametrize("tie", [False, True])
def test_gguf_recovers_hf_llama_weights_exactly(
    llama_state: dict[str, torch.Tensor], tmp_path: Path, tie: bool
) -> None:
    ckpt = load_checkpoint(write_gguf(tmp_path / "tiny.gguf", llama_state, tie=tie))
    assert (ckpt.format, ckpt.name, ckpt.config.tie_word_embeddings) == ("gguf", "tiny", tie)
    assert ckpt.config.num_kv_heads == 2 and ckpt.config.head_dim == 16
    assert ckpt.tokenizer is None  # no tokenizer.ggml.* metadata
    assert_same_weights(ckpt, llama_state)


def test_gguf_matches_transformers_gguf_loader(
    llama_state: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", llama_state)
    expected = hf_state_dict(tmp_path, dtype=torch.float32, gguf_file=path.name)
    assert_same_weights(load_checkpoint(path), expected)


def test_gguf_qwen2_keeps_layout_and_biases(folders: dict[str, Path], tmp_path: Path) -> None:
    state = hf_state_dict(folders["qwen2-sharded"])
    ckpt = load_checkpoint(write_gguf(tmp_path / "q.gguf", state, arch="qwen2"))
    assert ckpt.config.qkv_bias and "model.layers.1.self_attn.v_proj.bias" in ckpt.weights
    assert_same_weights(ckpt, state)


def test_gguf_quantized_tensors_are_dequantised(
    llama_state: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    q8, q41, f16 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.F16
    quant = {"blk.0.ffn_up.weight": q8, "blk.1.attn_q.weight": q41, "blk.1.ffn_down.weight": f16}
    ckpt = load_checkpoint(write_gguf(tmp_path / "q.gguf", llama_state, quant=quant))
    for gname, qtype in quant.items():
        hf_name = next(n for n in llama_state if gguf_tensor_name(n) == gname)
        original = llama_state[hf_name].numpy()
        stored = llama_cpp_permute(original, 4, 4) if "attn_q" in gname else original
        roundtrip = dequantize(quantize(stored, qtype), qtype)
        if "attn_q" in gname:  # the loader undoes the permutation after dequantising
            roundtrip = roundtrip.reshape(4, 8, 2, 64).swapaxes(1, 2).reshape(64, 64)
        got = ckpt.weights[hf_name]
        assert got.dtype == torch.float32 and tuple(got.shape) == original.shape
        assert np.array_equal(got.numpy(), roundtrip), gname
        assert np.allclose(got.numpy(), original, atol=0.02), gname


def test_gguf_missing_tensor(llama_state: dict[str, torch.Tensor], tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", llama_state, drop=("blk.1.ffn_up.weight",))
    message = load_error(path)
    assert "blk.1.ffn_up.weight" in message and "m.gguf" in message


def test_gguf_wrong_shape(llama_state: dict[str, torch.Tensor], tmp_path: Path) -> None:
    state = dict(llama_state)
    state["model.layers.0.mlp.gate_proj.weight"] = state["model.layers.0.mlp.gate_proj.weight"][:96]
    message = load_error(write_gguf(tmp_path / "s.gguf", state))
    assert "blk.0.ffn_gate.weight" in message and "[96, 64]" in message and "[128, 64]" in message


def test_gguf_unsupported_quant_type(llama_state: dict[str, torch.Tensor], tmp_path: Path) -> None:
    q81 = GGMLQuantizationType.Q8_1  # gguf.quants has no dequantiser for it
    # 128 rows of 64 values: two 32-value blocks of 40 bytes each per row.
    raw = {"blk.0.ffn_up.weight": (np.zeros((128, 2 * 40), dtype=np.uint8), q81)}
    path = write_gguf(tmp_path / "q.gguf", llama_state, drop=tuple(raw), raw=raw)
    message = load_error(path, UnsupportedModelError)
    assert "blk.0.ffn_up.weight" in message and "Q8_1" in message


def test_gguf_unexpected_bias_is_refused(
    llama_state: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    extra = {"blk.0.attn_q.bias": np.zeros(64, dtype=np.float32)}
    message = load_error(
        write_gguf(tmp_path / "b.gguf", llama_state, extra=extra), UnsupportedModelError
    )
    assert "blk.0.attn_q.bias" in message


def test_gguf_rope_freqs_is_refused(llama_state: dict[str, torch.Tensor], tmp_path: Path) -> None:
    extra = {"rope_freqs.weight": np.ones(8, dtype=np.float32)}
    message = load_error(
        write_gguf(tmp_path / "r.gguf", llama_state, extra=extra), UnsupportedModelError
    )
    assert "rope_freqs.weight" in message


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    writer = GGUFWriter(tmp_path / "g.gguf", "gpt2")
    writer.add_block_count(1)
    _finish(writer)
    assert "general.architecture" in load_error(tmp_path / "g.gguf", UnsupportedModelError)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    assert "x.gguf" in load_error(tmp_path / "x.gguf")


def test_truncated_gguf(llama_state: dict[str, torch.Tensor], tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf", llama_state)
    path.write_bytes(path.read_bytes()[:200])
    assert "t.gguf" in load_error(path)


def _finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# --- the real SmolLM2 GGUF ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> Checkpoint:
    return load_checkpoint(smollm2_gguf())


def test_smollm2_gguf_loads(smollm2: Checkpoint) -> None:
    c = smollm2.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert c.tie_word_embeddings and "lm_head.weight" not in smollm2.weights
    assert smollm2.tokenizer is not None and smollm2.tokenizer.eos_token_ids == (2,)
    assert all(t.dtype == torch.float32 for t in smollm2.weights.values())


def test_smollm2_gguf_few_tensors_match_transformers_processing(smollm2: Checkpoint) -> None:
    """gguf.GGUFReader + transformers' LlamaTensorProcessor (what from_pretrained(gguf_file=)
    runs for llama) give the same tensors as the loader."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    reader = GGUFReader(smollm2_gguf())
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    names = {
        "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
        "blk.7.attn_k.weight": "model.layers.7.self_attn.k_proj.weight",
        "blk.29.ffn_down.weight": "model.layers.29.mlp.down_proj.weight",
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
    }
    for tensor in reader.tensors:
        if tensor.name in names:
            expected = processor.process(dequantize(tensor.data, tensor.tensor_type), tensor.name)
            got = smollm2.weights[names[tensor.name]].numpy()
            assert np.array_equal(got, expected.weights), tensor.name


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers_state_dict(smollm2: Checkpoint) -> None:
    path = smollm2_gguf()
    expected = hf_state_dict(path.parent, dtype=torch.float32, gguf_file=path.name)
    assert_same_weights(smollm2, expected)
