"""Multi-head Latent Attention (a tiny random DeepSeek-V2) through the connector: the latent
cache (one vector per token and layer, no K/V split) is stored once, under a namespace every
tensor-parallel rank shares, and a fresh engine loads exactly the bytes another computed.

vLLM's CPU MLA path is not deterministic from run to run here (two runs without any store
differ in greedy tokens), so the proof is bytes, layer by layer, not tokens."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

from kvstore.client import KVStoreClient
from kvstore.integrations.link import release_link, shared_link
from kvstore.integrations.paged import LATENT, PagedKV
from kvstore.integrations.settings import model_shape, namespace_for, parse_settings
from kvstore.integrations.vllm import KVStoreConnector
from kvstore.integrations.vllm_steps import KVStoreMetadata, LoadSpec, SaveSpec
from kvstore.integrations.vllm_worker import WorkerSide
from kvstore.keys import prefix_keys
from tests.vllm.conftest import StoreView
from tests.vllm.harness import BLOCK, vllm_config

LATENT_WIDTH = 512 + 64  # kv_lora_rank + qk_rope_head_dim: what vLLM's MLA caches hold
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
CPU_BLOCK = 16  # vLLM's CPU MLA backend compiles its decode kernel for 16 only
PROMPT = [3 + (i * 7 + i // 5) % 500 for i in range(300)]  # 18 full blocks and 12 tokens
STORED = 18
Run = Callable[..., tuple[dict[str, Any], str]]


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random DeepSeek-V2 (2 dense layers: no experts, no q LoRA):
    the smallest head dims vLLM's CPU_MLA backend accepts (kv_lora_rank 512,
    qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV2Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512,
        q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        n_group=1, topk_group=1,
        max_position_embeddings=4096, tie_word_embeddings=False, torch_dtype="float32")
    folder = tmp_path_factory.mktemp("deepseek") / "tiny"
    DeepseekV2ForCausalLM(config).save_pretrained(folder)
    return folder


def _layer_slices(dump: Path) -> tuple[PagedKV, list[set[bytes]]]:
    """A dumped latent cache, and per layer the bytes of each of its non-zero blocks."""
    saved = torch.load(dump)
    assert saved["layout"] == LATENT
    paged = PagedKV(list(saved["layers"].items()), saved["num_blocks"], LATENT)
    staged = paged.gather(list(range(paged.num_blocks))).numpy()
    return paged, [{row[off:off + size].tobytes() for row in staged if row.any()}
                   for off, size in zip(paged.offsets, paged.layer_bytes, strict=True)]


def test_a_fresh_engine_loads_the_latent_bytes_another_computed_layer_by_layer(
        store: StoreView, mla_dir: Path, llm_run: Run, tmp_path: Path) -> None:
    # "always": the whole hit is loaded, whatever the cost model would choose on this machine.
    # 4 new tokens: the KV of 303 tokens, so no generated token fills a block of its own.
    args = {"model": str(mla_dir), "prompts": [PROMPT], "max_tokens": 4,
            "connector": store.options(load_policy="always")}
    first, _ = llm_run({**args, "dump_kv": str(tmp_path / "first.pt")})
    store.evict_at_end(first["namespace"])
    assert "/latent/" in first["namespace"]  # one copy for every rank
    assert first["stats"]["offloaded_blocks"] == STORED

    second, _ = llm_run({**args, "dump_kv": str(tmp_path / "second.pt")})
    assert second["cached_tokens"] == [STORED * CPU_BLOCK]  # an empty prefix cache: external
    assert second["stats"]["loaded_blocks"] == STORED
    assert second["stats"]["offloaded_blocks"] == 0

    keys = prefix_keys(PROMPT[: STORED * CPU_BLOCK], CPU_BLOCK, second["namespace"])
    with KVStoreClient(store.target, second["namespace"]) as client:
        stored = client.get(keys)
    paged, computed = _layer_slices(tmp_path / "first.pt")
    _, loaded = _layer_slices(tmp_path / "second.pt")
    # vLLM's CPU MLA backend keeps a head dimension of 1 in front of [block_size, width].
    assert paged.signature() == f"latent 2L/torch.float32:1x{CPU_BLOCK}x{LATENT_WIDTH}"
    assert paged.block_bytes == 2 * CPU_BLOCK * LATENT_WIDTH * 4
    for index, block in enumerate(stored):
        assert block is not None and len(block) == paged.block_bytes
        for layer, (off, size) in enumerate(zip(paged.offsets, paged.layer_bytes,
                                                strict=True)):
            part = bytes(block[off:off + size])
            assert any(part), f"block {index} layer {layer}: stored as zeros"
            assert part in computed[layer], (
                f"block {index} layer {layer}: not what the first engine computed")
            assert part in loaded[layer], (
                f"block {index} layer {layer}: not in the second engine's latent cache")


def test_every_rank_of_any_size_shares_one_latent_namespace(mla_dir: Path,
                                                            model_dir: Path) -> None:
    settings = parse_settings({"namespace_salt": "s"})
    shape = model_shape(vllm_config(mla_dir, {}), 0)
    assert shape.latent and (shape.num_kv_heads, shape.head_dim) == (1, LATENT_WIDTH)
    ns = namespace_for(settings, shape)
    assert ns.endswith("/latent/s")
    assert namespace_for(settings, replace(shape, tp_rank=1, tp_size=2)) == ns
    assert namespace_for(settings, replace(shape, tp_rank=3, tp_size=8)) == ns
    # A K/V model's blocks stay per rank, named as before.
    kv = model_shape(vllm_config(model_dir, {}), 0)
    assert not kv.latent and namespace_for(settings, kv).endswith("/tp0of1/s")
    assert namespace_for(settings, replace(kv, tp_rank=1, tp_size=2)).endswith("/tp1of2/s")


def _mla_cache_config(num_blocks: int) -> KVCacheConfig:
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=LATENT_WIDTH,
                            dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


def _latent_caches(num_blocks: int, seed: int | None) -> dict[str, torch.Tensor]:
    """Per layer [blocks, block_size, latent width], as vLLM's GPU MLA backends lay it out:
    random bits (NaNs and all) when seed is given, else zeros."""
    shape = (num_blocks, BLOCK, LATENT_WIDTH)
    gen = torch.Generator().manual_seed(seed or 0)
    return {name: (torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32,
                                 generator=gen).view(torch.float32)
                   if seed is not None else torch.zeros(shape)) for name in LAYERS}


def _wait_loaded(side: WorkerSide, req_id: str, timeout_s: float = 10.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if req_id in side.finished(None):
            return side.load_errors()
        time.sleep(0.01)
    raise AssertionError(f"{req_id}: its load never finished")


def test_rank_0_alone_saves_the_latent_cache_and_another_rank_loads_it(
        store: StoreView, mla_dir: Path) -> None:
    """The worker halves of two tensor-parallel ranks (rank 1's built as the connector
    builds it, with its rank given, since this machine runs TP 1): the same save reaches
    both, rank 1 puts nothing, and rank 1 loads rank 0's blocks bit for bit."""
    num_blocks, ids = 32, [9, 3, 17, 4]
    config = vllm_config(mla_dir, store.options())
    rank0 = KVStoreConnector(config, KVConnectorRole.WORKER, _mla_cache_config(num_blocks))
    store.evict_at_end(rank0.namespace)
    saved = _latent_caches(num_blocks, seed=35)
    rank0.register_kv_caches(saved)
    assert rank0.paged is not None and rank0.paged.layout == LATENT
    namespace = namespace_for(parse_settings(store.options()), model_shape(config, 1))
    assert namespace == rank0.namespace
    link1 = shared_link(store.target, namespace, BLOCK, timeout_s=2.0)
    try:
        rank1 = WorkerSide(link1, rank=1)
        loaded = _latent_caches(num_blocks, seed=None)
        rank1.register(loaded, _mla_cache_config(num_blocks))
        keys = prefix_keys(list(range(5, 5 + len(ids) * BLOCK)), BLOCK, namespace)
        meta = KVStoreMetadata(saves=[SaveSpec(keys, ids, None)])
        rank1.save(meta)  # the same step's metadata reaches every rank
        assert link1.flush(10.0)
        assert link1.stats.offloaded_blocks == 0
        with KVStoreClient(store.target, namespace) as client:
            assert client.get(keys) == [None] * len(ids)
        rank0.bind_connector_metadata(meta)
        rank0.wait_for_save()
        rank0.clear_connector_metadata()
        assert rank0.link.flush(10.0)
        assert rank0.link.stats.offloaded_blocks == len(ids)

        into = [2, 30, 5, 11]
        rank1.start_load(LoadSpec("r1", keys, into, "dram"))
        assert _wait_loaded(rank1, "r1") == set()
        for name in LAYERS:
            assert torch.equal(loaded[name][into].view(torch.int32),
                               saved[name][ids].view(torch.int32)), name
        assert link1.stats.loaded_bytes == len(ids) * 2 * BLOCK * LATENT_WIDTH * 4
    finally:
        release_link(link1)
        rank0.shutdown()
