"""Sliding-window models with vLLM's hybrid KV-cache manager on, which the connector supports
(`SupportsHMA`): a hybrid (a tiny random Gemma-3: three sliding-window layers, window 32, and
one full-attention layer) and a tiny random Mistral whose every layer slides (window 32). A
fresh engine loads what another computed, and its greedy tokens are those of plain vLLM.
Prompts end one token past a block edge, mid-block, and one token before the next edge."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.integrations.paged import PagedKV
from kvstore.keys import prefix_keys
from tests.vllm.conftest import StoreView

BLOCK = 128  # vLLM's CPU default
WINDOW = 32
LAYER_TYPES = ["sliding_attention"] * 3 + ["full_attention"]
# Distinct prompts (no prefix shared within a run) of 5 full blocks and 1, 60 and 127 tokens.
PROMPTS = [[3 + (i * 7 + i // 5 + 101 * p) % 500 for i in range(5 * BLOCK + extra)]
           for p, extra in enumerate((1, 60, 127))]
STORED = 5  # per prompt: the last token is computed, so the 6th block never loads
MAX_TOKENS = 8
Run = Callable[..., tuple[dict[str, Any], str]]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma-3 text, 4 layers (sliding, sliding, sliding, full), window 32, head_dim 64: what
    vLLM's CPU attention runs, small enough for a test."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        max_position_embeddings=4096, tie_word_embeddings=True, torch_dtype="float32")
    folder = tmp_path_factory.mktemp("gemma3") / "tiny"
    Gemma3ForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mistral, 2 layers, every one sliding (window 32), head_dim 64."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=WINDOW,
        max_position_embeddings=4096, tie_word_embeddings=False, torch_dtype="float32")
    folder = tmp_path_factory.mktemp("mistral") / "tiny"
    MistralForCausalLM(config).save_pretrained(folder)
    return folder


def _slices(dump: Path) -> list[set[bytes]]:
    """Per layer, the bytes of each non-zero block of a dumped paged KV cache."""
    saved = torch.load(dump)
    paged = PagedKV(list(saved["layers"].items()), saved["num_blocks"], saved["layout"])
    staged = paged.gather(list(range(paged.num_blocks))).numpy()
    return [{row[off:off + size].tobytes() for row in staged if row[off:off + size].any()}
            for off, size in zip(paged.offsets, paged.layer_bytes, strict=True)]


def test_a_hybrid_model_with_vllms_hybrid_manager_on_loads_and_generates_the_same(
        store: StoreView, gemma_dir: Path, llm_run: Run, tmp_path: Path) -> None:
    plain, _ = llm_run({"model": str(gemma_dir), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
                        "connector": None})
    args = {"model": str(gemma_dir), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "connector": store.options(load_policy="always")}
    first, _ = llm_run({**args, "dump_kv": str(tmp_path / "first.pt")})
    store.evict_at_end(first["namespace"])
    assert first["groups"] > 1  # vLLM kept its hybrid manager on for the connector
    assert first["tokens"] == plain["tokens"]
    # Every block the prompts and their new tokens filled: (tokens + 7) // 128 per prompt.
    assert first["stats"]["offloaded_blocks"] == sum(
        (len(p) + MAX_TOKENS - 1) // BLOCK for p in PROMPTS)

    second, _ = llm_run({**args, "dump_kv": str(tmp_path / "second.pt")})
    assert second["tokens"] == plain["tokens"]
    assert second["cached_tokens"] == [STORED * BLOCK] * len(PROMPTS)
    assert second["stats"]["loaded_blocks"] == STORED * len(PROMPTS)

    # The full-attention layer keeps every block until its request ends, and every layer
    # keeps the block that holds the window before the cut; a sliding layer's older blocks
    # were freed as its window moved on (vLLM reuses them), so only those two are compared.
    computed = _slices(tmp_path / "first.pt")
    loaded = _slices(tmp_path / "second.pt")
    with KVStoreClient(store.target, second["namespace"]) as client:
        for prompt in PROMPTS:
            keys = prefix_keys(prompt[: STORED * BLOCK], BLOCK, second["namespace"])
            stored = client.get(keys)
            assert all(block is not None for block in stored)
            width = len(stored[0]) // len(LAYER_TYPES)  # the layers' slices, in model order
            for index, block in enumerate(stored):
                for layer, kind in enumerate(LAYER_TYPES):
                    if kind == "full_attention" or index == STORED - 1:
                        part = bytes(block[layer * width:(layer + 1) * width])
                        assert part in computed[layer], f"block {index} layer {layer}: " \
                            "not what the first engine computed"
                        assert part in loaded[layer], f"block {index} layer {layer}: " \
                            "not in the second engine's cache"


def test_a_model_whose_every_layer_slides_loads_only_the_window_and_generates_the_same(
        store: StoreView, mistral_dir: Path, llm_run: Run, tmp_path: Path) -> None:
    plain, _ = llm_run({"model": str(mistral_dir), "prompts": PROMPTS,
                        "max_tokens": MAX_TOKENS, "connector": None})
    args = {"model": str(mistral_dir), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "connector": store.options(load_policy="always")}
    first, _ = llm_run(args)
    store.evict_at_end(first["namespace"])
    assert first["groups"] == 1
    assert first["tokens"] == plain["tokens"]
    second, _ = llm_run({**args, "dump_kv": str(tmp_path / "second.pt")})
    assert second["tokens"] == plain["tokens"]
    assert second["cached_tokens"] == [STORED * BLOCK] * len(PROMPTS)
    assert second["stats"]["loaded_blocks"] == STORED * len(PROMPTS)
    # vLLM holds only the window's block of each hit: the loads wrote that block alone (its
    # null block for the others is skipped), so a stored block's bytes are in the cache
    # only for the last block of each prompt (older ones are neither loaded nor computed).
    loaded = _slices(tmp_path / "second.pt")
    with KVStoreClient(store.target, second["namespace"]) as client:
        for prompt in PROMPTS:
            stored = client.get(prefix_keys(prompt[: STORED * BLOCK], BLOCK,
                                            second["namespace"]))
            width = len(stored[0]) // len(loaded)
            for index, block in enumerate(stored):
                present = [bytes(block[i * width:(i + 1) * width]) in loaded[i]
                           for i in range(len(loaded))]
                assert present == [index == STORED - 1] * len(loaded), index
