"""The connector's `codec` option (docs/codecs.md) with real vLLM engines on the CPU (a tiny
random Llama, each run a fresh process with an empty prefix cache) and one real daemon: the
codec is part of the namespace, so an engine with a codec never loads blocks stored without
it and the reverse; a fresh engine loads fp8 and int4 blocks another stored, decodes them into
its cache (within the codec's error of what was computed) and generates; `none` stays
token-exact. Also the K/V layout of vLLM's CPU backend as the codec reads it, on known
tensors, and the options' errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.integrations.codecs import BlockCodec, CodecError
from kvstore.integrations.paged import LATENT, PagedKV
from kvstore.integrations.settings import (
    SettingsError,
    model_shape,
    namespace_for,
    parse_settings,
)
from kvstore.integrations.vllm_codec import RowCodec
from kvstore.keys import prefix_keys
from tests.vllm.conftest import StoreView
from tests.vllm.harness import vllm_config
from tests.vllm.test_hybrid import gemma_dir  # noqa: F401  (the tiny Gemma-3 fixture)
from tests.vllm.test_mla import mla_dir  # noqa: F401  (the tiny DeepSeek-V2 fixture)

BLOCK = 128  # vLLM's CPU default
PROMPT = [3 + (i * 7 + i // 5) % 500 for i in range(700)]  # 5 full blocks and 60 tokens
STORED = 5
HEADS, DIM = 2, 64  # the tiny Llama's KV heads and head_dim (conftest.model_dir)
Run = Callable[..., tuple[dict[str, Any], str]]


def test_a_bad_codec_is_an_error_naming_the_option(model_dir: Path) -> None:
    with pytest.raises(SettingsError, match=r"kv_connector_extra_config\.codec must be one of"):
        parse_settings({"codec": "fp4"})
    with pytest.raises(SettingsError, match=r"kv_connector_extra_config\.codec"):
        parse_settings({"codec": None})
    shape = model_shape(vllm_config(model_dir, {}), 0)
    raw = namespace_for(parse_settings({"namespace_salt": "s"}), shape)
    assert namespace_for(parse_settings({"namespace_salt": "s", "codec": "none"}), shape) == raw
    assert namespace_for(parse_settings({"namespace_salt": "s", "codec": "fp8"}),
                         shape) == raw + "-codec.fp8.v1"  # as the engine names it
    assert namespace_for(parse_settings({"namespace_salt": "s", "codec": "int4"}),
                         shape) == raw + "-codec.int4.v1"


def test_int4_on_a_latent_cache_is_an_error_naming_codec_and_the_layout(
        model_dir: Path) -> None:
    from dataclasses import replace

    latent = replace(model_shape(vllm_config(model_dir, {}), 0), latent=True)
    with pytest.raises(SettingsError, match=r"codec: int4 does not apply to a latent \(MLA\)"):
        namespace_for(parse_settings({"codec": "int4"}), latent)
    assert namespace_for(parse_settings({"codec": "fp8"}), latent).endswith(
        "/latent-codec.fp8.v1")


def _cpu_cache(blocks: int, seed: int) -> torch.Tensor:
    """One layer as vLLM's CPU backend lays it out: [blocks, kv_heads, block, 2 * head_dim]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((blocks, HEADS, 16, 2 * DIM), generator=gen)


@pytest.mark.parametrize("name", ["fp8", "int4"])
def test_the_cpu_backends_keys_and_values_are_what_the_codec_quantises(name: str) -> None:
    """CPU_ATTN reads a head's [block, 2 * head_dim] as [2 * block, head_dim]: its keys are the
    first half, its values the second. The codec must see those as K and V, in the engine's
    [layers, 2, tokens, heads, head_dim] order, so its encoded blocks are the engine's."""
    layers = [(f"l{i}", _cpu_cache(3, i)) for i in range(2)]
    paged = PagedKV(layers, 3)
    codec = RowCodec(name, paged, ["CPU_ATTN", "CPU_ATTN"], 16)
    rows = paged.gather([2, 0])
    encoded = codec.encode(rows)
    assert encoded.shape == (2, codec.encoded_bytes) and bool(codec.valid(encoded).all())
    # The engine's layout [1, layers, 2, tokens, heads, head_dim], built from the backend's
    # own K/V views: its encoded block is the same bytes.
    engine = BlockCodec(name, (2, 2, 16, HEADS, DIM), torch.float32)
    for row, b in enumerate([2, 0]):
        block = torch.stack([torch.stack([t[b].view(HEADS, 32, DIM)[:, :16].permute(1, 0, 2),
                                          t[b].view(HEADS, 32, DIM)[:, 16:].permute(1, 0, 2)])
                             for _, t in layers]).unsqueeze(0)
        assert torch.equal(encoded[row:row + 1], engine.encode(block.contiguous()))
    decoded = torch.cat([chunk for _, chunk in codec.decode_chunks(encoded)])
    assert decoded.shape == rows.shape
    back = decoded.view(torch.float32).view(2, -1)
    err = (back - rows.view(torch.float32).view(2, -1)).abs().max()
    assert 0 < err < (0.2 if name == "fp8" else 0.5)  # lossy, and close
    # Written back into a cache, a decoded block lands where the block came from.
    out = PagedKV([(n, torch.zeros_like(t)) for n, t in layers], 3)
    out.scatter(decoded, [1, 2])
    assert torch.allclose(out.tensors[0][1], layers[0][1][2], atol=0.5)


def test_a_latent_cache_takes_fp8_per_token_and_refuses_int4() -> None:
    gen = torch.Generator().manual_seed(0)
    layers = [(f"l{i}", torch.randn((3, 1, 16, 576), generator=gen)) for i in range(2)]
    paged = PagedKV(layers, 3, LATENT)
    codec = RowCodec("fp8", paged, [None, None], 16)
    assert codec.codec.block_shape == (2, 1, 16, 1, 576)
    rows = paged.gather([0, 1, 2])
    decoded = torch.cat([c for _, c in codec.decode_chunks(codec.encode(rows))])
    x, y = rows.view(torch.float32), decoded.view(torch.float32)
    assert ((y - x).abs() <= x.abs() / 16 + 2**-6).all()
    with pytest.raises(CodecError, match=r"kv_connector_extra_config\.codec int4 does not "
                                         r"apply to a latent \(MLA\) cache"):
        RowCodec("int4", paged, [None, None], 16)


def test_an_unknown_attention_backend_is_an_error_naming_codec_and_it() -> None:
    paged = PagedKV([("l0", _cpu_cache(2, 0))], 2)
    with pytest.raises(CodecError, match=r"kv_connector_extra_config\.codec fp8: needs the K/V "
                                         r"layout of the attention backend.*TRITON_ATTN"):
        RowCodec("fp8", paged, ["TRITON_ATTN"], 16)


@pytest.fixture(scope="module")
def baseline(model_dir: Path) -> list[list[int]]:
    from tests.vllm.conftest import run_llm

    result, _ = run_llm({"model": str(model_dir), "prompts": [PROMPT], "connector": None})
    return result["tokens"]


def _cache(dump: Path) -> torch.Tensor:
    """A dumped cache's non-zero blocks as rows [n, layers * heads * block * 2 * head_dim]."""
    saved = torch.load(dump)
    paged = PagedKV(list(saved["layers"].items()), saved["num_blocks"])
    rows = paged.gather(list(range(paged.num_blocks))).view(torch.float32)
    return rows[rows.abs().sum(dim=1) > 0]


def test_codec_namespaces_never_mix_and_fp8_and_int4_loads_generate(
        store: StoreView, model_dir: Path, baseline: list[list[int]], llm_run: Run,
        tmp_path: Path) -> None:
    def run(codec: str, tag: str) -> dict[str, Any]:
        result, _ = llm_run({"model": str(model_dir), "prompts": [PROMPT],
                             "dump_kv": str(tmp_path / f"{tag}.pt"),
                             "connector": store.options(codec=codec, load_policy="always")})
        store.evict_at_end(result["namespace"])
        return result

    raw = run("none", "raw")  # stores raw blocks
    assert raw["stats"]["offloaded_blocks"] == STORED
    fp8 = run("fp8", "fp8-first")  # the raw blocks are not its: computes, stores its own
    assert fp8["namespace"] == raw["namespace"] + "-codec.fp8.v1"
    assert fp8["cached_tokens"] == [0] and fp8["stats"]["lookup_hit_blocks"] == 0
    assert fp8["stats"]["offloaded_blocks"] == STORED
    assert fp8["tokens"] == baseline  # computed, not loaded: exact

    keys = prefix_keys(PROMPT[: STORED * BLOCK], BLOCK, fp8["namespace"])
    with KVStoreClient(store.target, fp8["namespace"]) as client:
        stored = client.get(keys)
    raw_bytes = 2 * HEADS * BLOCK * 2 * DIM * 4
    assert all(b is not None and len(b) == 16 + raw_bytes // 4 // 64 * 65 for b in stored)
    assert all(bytes(b[:5]) == b"KVC1\x01" for b in stored if b is not None)

    loaded = run("fp8", "fp8-second")  # a fresh engine loads and decodes them
    assert loaded["cached_tokens"] == [STORED * BLOCK]
    assert loaded["stats"]["loaded_blocks"] == STORED
    assert len(loaded["tokens"][0]) == 8
    computed, decoded = _cache(tmp_path / "raw.pt"), _cache(tmp_path / "fp8-second.pt")
    for row in decoded[:STORED]:  # each loaded block is within fp8's error of a computed one
        best = (computed - row).abs().amax(dim=1).argmin()
        assert ((row - computed[best]).abs() <= computed[best].abs() / 16 + 2**-6).all()
    assert not any(torch.equal(row, c) for row in decoded[:STORED] for c in computed)

    again = run("none", "raw-second")  # raw blocks still hit, and stay token-exact
    assert again["cached_tokens"] == [STORED * BLOCK]
    assert again["tokens"] == baseline

    int4 = run("int4", "int4-first")  # neither the raw nor the fp8 blocks
    assert int4["cached_tokens"] == [0] and int4["stats"]["offloaded_blocks"] == STORED
    int4_loaded = run("int4", "int4-second")
    assert int4_loaded["cached_tokens"] == [STORED * BLOCK]
    assert int4_loaded["stats"]["loaded_blocks"] == STORED
    assert len(int4_loaded["tokens"][0]) == 8


def test_a_hybrid_model_stores_each_group_through_fp8_and_a_fresh_engine_loads_it(
        store: StoreView, gemma_dir: Path, llm_run: Run) -> None:  # noqa: F811
    """Gemma-3 under vLLM's hybrid manager (sliding and full-attention groups): each group's
    blocks go through its own codec, and a fresh engine loads and decodes them."""
    from tests.vllm.test_hybrid import MAX_TOKENS, PROMPTS
    from tests.vllm.test_hybrid import STORED as HYBRID_STORED

    args = {"model": str(gemma_dir), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "connector": store.options(codec="fp8", load_policy="always")}
    first, _ = llm_run(args)
    store.evict_at_end(first["namespace"])
    assert first["namespace"].endswith("-codec.fp8.v1") and first["groups"] > 1
    second, _ = llm_run(args)
    assert second["cached_tokens"] == [HYBRID_STORED * BLOCK] * len(PROMPTS)
    groups = second["group_names"]
    needed = [HYBRID_STORED if window == 0 else 1 for _, window, _ in groups]
    assert second["stats"]["loaded_blocks"] == sum(needed) * len(PROMPTS)
    # What each group's loads moved: encoded blocks, 65 bytes per 64 float32 values + 16.
    encoded = [16 + raw // 4 // 64 * 65 for raw in second["group_block_bytes"]]
    assert second["group_bytes"] == [n * size * len(PROMPTS)
                                     for n, size in zip(needed, encoded, strict=True)]
    assert all(len(t) == MAX_TOKENS for t in second["tokens"])


def test_an_mla_model_stores_its_latent_cache_through_fp8_and_a_fresh_engine_loads_it(
        store: StoreView, mla_dir: Path, llm_run: Run) -> None:  # noqa: F811
    from tests.vllm.test_mla import CPU_BLOCK, LATENT_WIDTH
    from tests.vllm.test_mla import PROMPT as MLA_PROMPT
    from tests.vllm.test_mla import STORED as MLA_STORED

    args = {"model": str(mla_dir), "prompts": [MLA_PROMPT], "max_tokens": 4,
            "connector": store.options(codec="fp8", load_policy="always")}
    first, _ = llm_run(args)
    store.evict_at_end(first["namespace"])
    assert "/latent/" in first["namespace"]
    assert first["namespace"].endswith("-codec.fp8.v1")
    assert first["stats"]["offloaded_blocks"] == MLA_STORED
    second, _ = llm_run(args)
    assert second["cached_tokens"] == [MLA_STORED * CPU_BLOCK]
    assert second["stats"]["loaded_blocks"] == MLA_STORED
    # 2 layers x 16 tokens x 576 latent values, one scale byte per token and layer.
    assert second["group_bytes"] == [MLA_STORED * (16 + 2 * CPU_BLOCK * (LATENT_WIDTH + 1))]
    assert len(second["tokens"][0]) == 4
