"""Sliding-window models with vLLM's hybrid KV-cache manager on, which the connector supports
(`SupportsHMA`): a hybrid (a tiny random Gemma-3: three sliding-window layers, window 32, and
one full-attention layer) and a tiny random Mistral whose every layer slides (window 32). A
fresh engine loads what another computed, and its greedy tokens are those of plain vLLM.
Prompts end one token past a block edge, mid-block, and one token before the next edge."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from kvstore.client import KVStoreClient
from kvstore.integrations.paged import PagedKV
from kvstore.integrations.settings import group_root
from kvstore.integrations.vllm import KVStoreConnector
from kvstore.integrations.vllm_steps import KVStoreMetadata, LoadSpec, SaveSpec
from kvstore.keys import BlockKey, chain_key, namespace_root, prefix_keys
from tests.vllm.conftest import StoreView
from tests.vllm.harness import BLOCK as HARNESS_BLOCK
from tests.vllm.harness import HEAD_DIM, KV_HEADS, LAYERS, matched, request, vllm_config

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


def _group_keys(namespace: str, group: list[Any], tokens: list[int],
                block: int) -> list[BlockKey]:
    """A KV-cache group's chain of a model with several: rooted in the namespace's root and
    the group's (kind, window, layers), as the connector's scheduler reports them."""
    parent = group_root(namespace_root(namespace), str(group[0]), int(group[1]),
                        [int(x) for x in group[2]])
    keys = []
    for i in range(len(tokens) // block):
        parent = chain_key(parent, tokens[i * block:(i + 1) * block])
        keys.append(parent)
    return keys


def test_a_hybrid_model_with_vllms_hybrid_manager_on_loads_and_generates_the_same(
        store: StoreView, gemma_dir: Path, llm_run: Run, tmp_path: Path) -> None:
    plain, _ = llm_run({"model": str(gemma_dir), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
                        "connector": None})
    args = {"model": str(gemma_dir), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "connector": store.options(load_policy="always")}
    first, _ = llm_run({**args, "dump_kv": str(tmp_path / "first.pt")})
    store.evict_at_end(first["namespace"])
    groups = first["group_names"]
    assert first["groups"] == len(groups) > 1  # vLLM kept its hybrid manager on
    assert first["tokens"] == plain["tokens"]
    # Every group's every block the prompts and their new tokens filled: (tokens + 7) // 128
    # per prompt and group (a sliding group's too, saved in the step that fills it).
    assert first["stats"]["offloaded_blocks"] == len(groups) * sum(
        (len(p) + MAX_TOKENS - 1) // BLOCK for p in PROMPTS)

    second, _ = llm_run({**args, "dump_kv": str(tmp_path / "second.pt")})
    assert second["tokens"] == plain["tokens"]
    assert second["cached_tokens"] == [STORED * BLOCK] * len(PROMPTS)
    # A full group loads the hit's 5 blocks, a sliding one (window 32) only the
    # ceil(31 / 128) = 1 block its window needs before the cut: what vLLM allocates.
    needed = [STORED if window == 0 else 1 for _, window, _ in groups]
    assert second["stats"]["loaded_blocks"] == sum(needed) * len(PROMPTS)
    assert second["group_bytes"] == [n * size * len(PROMPTS) for n, size in
                                     zip(needed, second["group_block_bytes"], strict=True)]
    full_bytes = sum(size for (_, window, _), size in
                     zip(groups, second["group_block_bytes"], strict=True) if window == 0)
    assert sum(second["group_bytes"]) < STORED * len(PROMPTS) * full_bytes * len(LAYER_TYPES)

    # The full-attention layer keeps every block until its request ends, and every layer
    # keeps the block that holds the window before the cut; a sliding layer's older blocks
    # were freed as its window moved on (vLLM reuses them), so only those two are compared.
    computed = _slices(tmp_path / "first.pt")
    loaded = _slices(tmp_path / "second.pt")
    with KVStoreClient(store.target, second["namespace"]) as client:
        for prompt in PROMPTS:
            for group in groups:
                keys = _group_keys(second["namespace"], group, prompt[: STORED * BLOCK], BLOCK)
                stored = client.get(keys)
                assert all(block is not None for block in stored)
                layers = sorted(group[2])  # a group's slices, in model order
                width = len(stored[0]) // len(layers)
                for index, block in enumerate(stored):
                    for j, layer in enumerate(layers):
                        if LAYER_TYPES[layer] != "full_attention" and index != STORED - 1:
                            continue
                        part = bytes(block[j * width:(j + 1) * width])
                        assert part in computed[layer], f"block {index} layer {layer}: " \
                            "not what the first engine computed"
                        assert part in loaded[layer], f"block {index} layer {layer}: " \
                            "not in the second engine's cache"
    # Today's one-group keys name none of it: no group shares the model's plain chain.
    with KVStoreClient(store.target, second["namespace"]) as client:
        plain_keys = prefix_keys(PROMPTS[0][: STORED * BLOCK], BLOCK, second["namespace"])
        assert client.get(plain_keys) == [None] * STORED


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
    # One group, today's keys; its window (32 tokens) needs one block before the cut, and
    # only that block is loaded (vLLM holds no other).
    assert second["stats"]["loaded_blocks"] == 1 * len(PROMPTS)
    # The load wrote that block alone, so a stored block's bytes are in the cache only for
    # the last block of each prompt (older ones are neither loaded nor computed).
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


def _hybrid_cache_config(num_blocks: int, window: int = WINDOW) -> KVCacheConfig:
    """The harness's two layers as vLLM's hybrid manager groups them for a hybrid model:
    group 0 the full-attention layer (layer 1), group 1 the sliding-window one (layer 0)."""
    full = FullAttentionSpec(block_size=HARNESS_BLOCK, num_kv_heads=KV_HEADS,
                             head_size=HEAD_DIM, dtype=torch.float32)
    sliding = SlidingWindowSpec(block_size=HARNESS_BLOCK, num_kv_heads=KV_HEADS,
                                head_size=HEAD_DIM, dtype=torch.float32, sliding_window=window)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([LAYERS[1]], full),
                                          KVCacheGroupSpec([LAYERS[0]], sliding)])


def _hybrid_worker(config: Any, seed: int | None) -> tuple[KVStoreConnector,
                                                           dict[str, torch.Tensor]]:
    shape = (32, KV_HEADS, HARNESS_BLOCK, 2 * HEAD_DIM)
    gen = torch.Generator().manual_seed(seed or 0)
    caches = {name: (torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32,
                                   generator=gen).view(torch.float32)
                     if seed is not None else torch.zeros(shape)) for name in LAYERS}
    connector = KVStoreConnector(config, KVConnectorRole.WORKER, _hybrid_cache_config(32))
    connector.register_kv_caches(caches)
    return connector, caches


def test_a_hybrid_load_writes_each_group_at_its_ids_and_reports_a_failure_by_request(
        store: StoreView, model_dir: Path) -> None:
    """Each group's blocks go under the group's own keys, one load per group. vLLM cannot
    take a hybrid model's failed blocks by id (ids repeat across groups: it raises), so a
    request whose loads did not wholly arrive is reported by request, once all its groups'
    loads landed, and recomputed."""
    config = vllm_config(model_dir, store.options())
    saver, saved = _hybrid_worker(config, seed=7)
    tokens = list(range(9, 9 + 4 * HARNESS_BLOCK))
    keys = prefix_keys(tokens, HARNESS_BLOCK, saver.namespace + "/full")
    window_keys = prefix_keys(tokens, HARNESS_BLOCK, saver.namespace + "/sliding")
    assert saver.worker.group_paged[0].names == [LAYERS[1]]  # each group's own layers
    assert saver.worker.group_paged[1].names == [LAYERS[0]]
    saver.bind_connector_metadata(KVStoreMetadata(saves=[  # blocks 2 and 3 never stored
        SaveSpec(keys[:2], [1, 2], None, group=0),
        SaveSpec(window_keys[:2], [5, 6], None, group=1)]))
    saver.wait_for_save()
    saver.clear_connector_metadata()
    assert saver.link.flush(10.0)
    saver.shutdown()

    loader, loaded = _hybrid_worker(config, seed=None)
    assert loader.paged is not None and loader.paged.names == list(LAYERS)  # model order
    # The sliding group holds no block at position 0 (slid out of its window): -1.
    loader.bind_connector_metadata(KVStoreMetadata(loads=[
        LoadSpec("r1", keys, [10, 11, 12, 13], "dram", group=0),
        LoadSpec("r1", window_keys[:2], [-1, 20], "dram", group=1)]))
    loader.start_load_kv(None)  # type: ignore[arg-type]
    loader.clear_connector_metadata()
    deadline = time.monotonic() + 10.0
    while not (results := loader.get_transfer_results(set())).finished_recving:
        assert time.monotonic() < deadline, "the load never finished"
        time.sleep(0.01)
    assert results.finished_recving == {"r1"} and results.failed_recving == {"r1"}
    assert loader.get_block_ids_with_load_errors() == set()
    full, sliding = loaded[LAYERS[1]], loaded[LAYERS[0]]
    assert torch.equal(full[[10, 11]].view(torch.int32),
                       saved[LAYERS[1]][[1, 2]].view(torch.int32))
    assert torch.equal(sliding[20].view(torch.int32), saved[LAYERS[0]][6].view(torch.int32))
    assert not full[[b for b in range(32) if b not in (10, 11)]].any()
    assert not sliding[[b for b in range(32) if b != 20]].any()
    loader.shutdown()


# Hit rule tests: the harness's two layers as a hybrid (group 0 full, group 1 sliding), a
# request of 12 full blocks and 5 tokens (the last token computed: 12 blocks can hit).
HIT_BLOCKS = 12
FULL_GROUP = ["FullAttentionSpec", 0, [1]]


def _sliding_group(window: int) -> list[Any]:
    return ["SlidingWindowSpec", window, [0]]


def _store(target: str, namespace: str, group: list[Any], tokens: list[int],
           blocks: list[int], block_bytes: int) -> None:
    """Put these blocks of a group's chain (random bytes)."""
    keys = _group_keys(namespace, group, tokens, HARNESS_BLOCK)
    with KVStoreClient(target, namespace) as client:
        client.put([keys[i] for i in blocks], [bytes([i]) * block_bytes for i in blocks])


def _hybrid_scheduler(config: Any, window: int) -> KVStoreConnector:
    return KVStoreConnector(config, KVConnectorRole.SCHEDULER,
                            _hybrid_cache_config(256, window))


@pytest.mark.parametrize(("window", "needed"), [
    (9 * HARNESS_BLOCK, 9), (9 * HARNESS_BLOCK + 1, 9), (9 * HARNESS_BLOCK + 2, 10)])
def test_a_sliding_group_needs_only_its_windows_blocks_before_the_cut(
        store: StoreView, model_dir: Path, window: int, needed: int) -> None:
    """Windows past a block edge (w - 1 = 9 blocks; one token less; one more), wider than
    128 tokens: a sliding group needs ceil((w - 1) / block) blocks before the cut, as vLLM's
    SlidingWindowManager. Its older blocks evicted, the hit is whole, and its load moves only
    the window's blocks; one window block short, it cuts the hit to nothing."""
    config = vllm_config(model_dir, store.options())
    conn = _hybrid_scheduler(config, window)
    namespace, sched = conn.namespace, conn.scheduler
    tokens = [5 + (i * 13) % 400 for i in range(HIT_BLOCKS * HARNESS_BLOCK + 5)]
    size = HARNESS_BLOCK * KV_HEADS * 2 * HEAD_DIM * 4  # one layer's block, float32
    assert sched.group_bytes == [size, size]
    _store(store.target, namespace, FULL_GROUP, tokens, list(range(HIT_BLOCKS)), size)
    # The sliding chain's old blocks are gone: only the window's (and one fewer, first).
    _store(store.target, namespace, _sliding_group(window), tokens,
           list(range(HIT_BLOCKS - needed + 1, HIT_BLOCKS)), size)
    assert matched(conn, request(tokens)) == (0, False)

    _store(store.target, namespace, _sliding_group(window), tokens, [HIT_BLOCKS - needed],
           size)
    req = request(tokens)
    assert matched(conn, req) == (HIT_BLOCKS * HARNESS_BLOCK, True)
    ids = [list(range(1, HIT_BLOCKS + 2)),
           [0] * (HIT_BLOCKS - needed) + list(range(100, 100 + needed + 1))]
    blocks = KVCacheBlocks(tuple([KVCacheBlock(b) for b in g] for g in ids))
    conn.update_state_after_alloc(req, blocks, HIT_BLOCKS * HARNESS_BLOCK)
    loads = sched._loads
    assert [(spec.group, len(spec.keys)) for spec in loads] == [(0, HIT_BLOCKS), (1, needed)]
    assert loads[0].block_ids == ids[0][:HIT_BLOCKS]
    assert loads[1].block_ids == list(range(100, 100 + needed))
    assert loads[1].keys == _group_keys(namespace, _sliding_group(window), tokens,
                                        HARNESS_BLOCK)[HIT_BLOCKS - needed:HIT_BLOCKS]
    conn.shutdown()


def test_a_full_groups_missing_block_cuts_the_hit_there(
        store: StoreView, model_dir: Path) -> None:
    config = vllm_config(model_dir, store.options())
    window = 2 * HARNESS_BLOCK + 1  # 2 blocks before the cut
    conn = _hybrid_scheduler(config, window)
    tokens = [7 + (i * 17) % 400 for i in range(HIT_BLOCKS * HARNESS_BLOCK + 5)]
    size = conn.scheduler.group_bytes[0]
    _store(store.target, conn.namespace, FULL_GROUP, tokens,
           [i for i in range(HIT_BLOCKS) if i != 7], size)
    _store(store.target, conn.namespace, _sliding_group(window), tokens,
           list(range(HIT_BLOCKS)), size)
    assert matched(conn, request(tokens)) == (7 * HARNESS_BLOCK, True)
    conn.shutdown()
