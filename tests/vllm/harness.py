"""vLLM's scheduler and a worker-side connector, built the way vLLM's own connector unit tests
build them (tests/v1/kv_connector/unit/utils.py in vLLM's repository), on a local model folder
and the CPU: no hub, no GPU."""

from __future__ import annotations

import time
from itertools import count
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvstore.integrations.vllm import KVStoreConnector

BLOCK = 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
KV_HEADS, HEAD_DIM = 2, 64
_ids = count(1)
init_none_hash(sha256)


def vllm_config(model: Path, extra: dict[str, Any], role: str = "kv_both",
                prefix_caching: bool = True, max_batched: int = 4096) -> VllmConfig:
    model_config = ModelConfig(model=str(model), dtype="float32", seed=0,
                               skip_tokenizer_init=True)
    cache = CacheConfig(block_size=BLOCK, cache_dtype="auto",
                        enable_prefix_caching=prefix_caching)
    cache.kv_cache_layout = "LBHNC"  # vLLM resolves it before it builds connectors
    return VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_batched,
                                         max_model_len=4096, enable_chunked_prefill=True,
                                         is_encoder_decoder=False,
                                         disable_hybrid_kv_cache_manager=True),
        cache_config=cache,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVStoreConnector", kv_role=role,
            kv_connector_module_path="kvstore.integrations.vllm",
            kv_connector_extra_config=extra),
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                             dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


def scheduler(config: VllmConfig, num_blocks: int = 256) -> Scheduler:
    config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(vllm_config=config, kv_cache_config=kv_cache_config(num_blocks),
                     structured_output_manager=StructuredOutputManager(config),
                     block_size=BLOCK, log_stats=True)


def worker(config: VllmConfig, num_blocks: int = 256, seed: int | None = None
           ) -> tuple[KVStoreConnector, dict[str, torch.Tensor]]:
    """A worker-side connector over paged tensors in vLLM's CPU layout: per layer
    [blocks, kv_heads, block_size, K|V head_dim]; random bits when seed is given, else zeros."""
    shape = (num_blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM)
    gen = torch.Generator().manual_seed(seed or 0)
    caches = {name: (torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32,
                                   generator=gen).view(torch.float32)
                     if seed is not None else torch.zeros(shape))
              for name in LAYERS}
    connector = KVStoreConnector(config, KVConnectorRole.WORKER, kv_cache_config(num_blocks))
    connector.register_kv_caches(caches)
    return connector, caches


def request(tokens: list[int], max_tokens: int = 4, cache_salt: str | None = None,
            lora: LoRARequest | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    params.update_from_generation_config({}, 2)
    return Request(request_id=f"req-{next(_ids)}", prompt_token_ids=tokens,
                   sampling_params=params, pooling_params=None, cache_salt=cache_salt,
                   lora_request=lora,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def matched(connector: KVStoreConnector, req: Request, computed: int = 0,
            timeout_s: float = 10.0) -> tuple[int | None, bool]:
    """get_num_new_matched_tokens asked as vLLM asks it, again each step while it answers None
    (its Lookup is out), until it answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = connector.get_num_new_matched_tokens(req, computed)
        if answer[0] is not None or time.monotonic() > deadline:
            return answer
        time.sleep(0.005)


def wait_lookups(connector: KVStoreConnector, timeout_s: float = 10.0) -> None:
    """Until every Lookup the connector started has come back."""
    deadline = time.monotonic() + timeout_s
    while connector.scheduler.pending_lookups:
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{connector.scheduler.pending_lookups} lookups never came back")
        time.sleep(0.005)


def runner_output(requests: list[Request], *, finished_recving: set[str] | None = None,
                  invalid_block_ids: set[int] | None = None, token: int = 7,
                  stats: KVConnectorStats | None = None) -> ModelRunnerOutput:
    """What the model runner returns for one step: one sampled token per running request,
    and what the worker-side connector reported."""
    ids = [r.request_id for r in requests]
    connector = None
    if finished_recving is not None or invalid_block_ids is not None or stats is not None:
        connector = KVConnectorOutput(finished_recving=finished_recving,
                                      invalid_block_ids=invalid_block_ids or set(),
                                      kv_connector_stats=stats)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[token] for _ in ids],
                             kv_connector_output=connector)
