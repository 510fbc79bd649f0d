"""State-space hybrids (Mamba, gated delta net and short-convolution layers beside attention
layers, as in Jamba, Bamba, Qwen3-Next): vLLM starts them with the connector on (it supports
vLLM's hybrid KV-cache manager), and the connector stores nothing for them, saying so at start.
A hit would need every state layer's recurrent state at the cut, which vLLM keeps only where a
scheduler step ends on a block edge (`mamba_cache_mode="align"`); on vLLM 0.32's CPU backend
its own prefix cache does not hit on such a model either, so state storage is untested here.

The model: a tiny random Qwen3-Next (two gated-delta-net layers, two full-attention layers),
in bfloat16, which vLLM's CPU gated-delta-net kernel requires (with 128-wide heads)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

from kvstore.integrations.vllm import KVStoreConnector
from tests.vllm.conftest import StoreView
from tests.vllm.harness import BLOCK, HEAD_DIM, KV_HEADS, LAYERS, matched, request, vllm_config

CPU_BLOCK = 128  # vLLM's CPU default
PROMPT = [3 + (i * 7 + i // 5) % 500 for i in range(2 * CPU_BLOCK + 5)]
Run = Callable[..., tuple[dict[str, Any], str]]


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-Next, 4 layers (linear, full, linear, full), 4 experts, bfloat16."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        layer_types=["linear_attention", "full_attention"] * 2,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=2048,
        tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("qwen3next") / "tiny"
    Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


def test_a_state_space_group_turns_loads_and_saves_off_and_says_so(
        store: StoreView, model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Beside a full-attention group, a state group: the connector starts, warns naming the
    state layers, and neither loads nor saves."""
    config = vllm_config(model_dir, store.options())
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                             dtype=torch.float32)
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,))
    kv_config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([LAYERS[0]], full), KVCacheGroupSpec([LAYERS[1]], mamba)])
    with caplog.at_level(logging.WARNING, logger="kvstore.integrations.vllm"):
        conn = KVStoreConnector(config, KVConnectorRole.SCHEDULER, kv_config)
    assert LAYERS[1] in caplog.text and "recurrent state" in caplog.text
    assert (conn.scheduler.loads, conn.scheduler.saves) == (False, False)
    tokens = [5 + (i * 13) % 400 for i in range(3 * BLOCK + 1)]
    assert matched(conn, request(tokens)) == (0, False)
    conn.shutdown()


def test_a_qwen3_next_model_runs_with_the_connector_as_without_it(
        store: StoreView, qwen3_next_dir: Path, llm_run: Run) -> None:
    """vLLM starts the model with the connector on (loading and saving, as a kv_both engine
    would), generates what plain vLLM generates, and saves and loads nothing."""
    args = {"model": str(qwen3_next_dir), "dtype": "bfloat16", "prompts": [PROMPT, PROMPT],
            "max_tokens": 6}
    plain, _ = llm_run({**args, "connector": None})
    run, log = llm_run({**args, "connector": store.options()})
    assert "recurrent state" in log
    assert run["tokens"] == plain["tokens"]
    assert run["groups"] is None  # no layout registered
    assert (run["stats"]["offloaded_blocks"], run["stats"]["loaded_blocks"]) == (0, 0)
