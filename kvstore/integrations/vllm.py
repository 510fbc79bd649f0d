"""vLLM's KV connector for kvstore (docs/vllm.md). vLLM loads it by module path:

    KVTransferConfig(kv_connector="KVStoreConnector",
                     kv_connector_module_path="kvstore.integrations.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"target": "host:50051"})

vLLM builds one connector for its scheduler (in the engine core) and one per worker (per GPU),
each told its role. `KVStoreConnector` reads the options, opens the link to the store and
hands every call to the half of its role, which owns that role's state:

- `vllm_scheduler.SchedulerSide` looks each request's blocks up, decides how much of a hit to
  load rather than compute, and schedules the loads and the saves;
- `vllm_worker.WorkerSide` loads into vLLM's paged KV tensors, saves the blocks each step
  fills, and times the forward passes and the loads for the scheduler side's cost model;
- `vllm_steps` holds what the two exchange each step: the metadata from the scheduler side to
  the workers, and the stats back.

Roles: kv_both loads and saves; kv_producer (a prefill instance) only saves; kv_consumer (a
decode instance) only loads. The store-facing half (keys, lookup, prefetch, loads, the offload
queue, the fail-safe, the load rates) is `StoreLink`, shared with this repository's engine.
One link per process serves both sides when vLLM runs them in one process, so an outage is
logged once per process.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.client.errors import KVStoreError
from kvstore.integrations.link import release_link, shared_link
from kvstore.integrations.paged import PagedKV
from kvstore.integrations.settings import model_shape, namespace_for, parse_settings
from kvstore.integrations.vllm_scheduler import SchedulerSide
from kvstore.integrations.vllm_steps import KVStoreMetadata, KVStoreStats
from kvstore.integrations.vllm_worker import WorkerSide

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvstore.integrations.vllm")

_GROUP_KINDS = (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec)
"""The KV-cache groups the connector stores, by vLLM's spec class: full attention (MLA too)
and sliding-window attention, alone or side by side (a hybrid model under vLLM's hybrid
KV-cache manager). State-space groups (`MambaSpec`: Mamba, gated delta net, short
convolutions) are accepted but not stored (`_check_groups`); others (chunked local attention,
...) are refused at start."""


def _check_groups(kv_cache_config: KVCacheConfig) -> list[str]:
    """Refuse KV-cache groups the connector neither stores nor can run beside, naming them,
    and return the layers that keep a recurrent state (`MambaSpec` groups). Such a model's
    hit would need every state layer's state at the cut, which vLLM keeps only at the end of
    a scheduler step that lands on a block edge (`mamba_cache_mode="align"`), so the connector
    stores nothing for it: storing its attention groups alone would cost writes for hits
    that could never be served."""
    state_layers: list[str] = []
    sizes = set()
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            state_layers += group.layer_names
            continue
        if type(spec) not in _GROUP_KINDS:
            raise ValueError(f"KVStoreConnector stores full and sliding-window attention; "
                             f"layers {group.layer_names[:3]} are {type(spec).__name__}")
        sizes.add(spec.block_size)
    if len(sizes) > 1:
        raise ValueError(f"KVStoreConnector needs one block size across KV cache groups, "
                         f"got {sorted(sizes)}")
    return state_layers


def _backend_names(vllm_config: VllmConfig, kv_caches: dict[str, torch.Tensor]
                   ) -> dict[str, str]:
    """Each registered layer's attention backend (`get_name()`: CPU_ATTN, FLASH_ATTN, ...),
    where vLLM's forward context knows it: a codec needs it to find K and V in a block."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase,
                                         list(kv_caches))
    return {name: layer.get_attn_backend().get_name() for name, layer in layers.items()}


def _tp_rank() -> int:
    """This process's tensor-parallel rank."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # no distributed state: a single process, rank 0
        return 0


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's connector object for one role. It refuses what it does not support (chunked
    local attention, pipeline or decode context parallelism), opens the link, and hands each
    call to its role's half (`scheduler` or `worker`). It supports vLLM's hybrid KV-cache
    manager (`SupportsHMA`): a model with sliding-window and full-attention layers keeps
    vLLM's memory savings, and each KV-cache group is stored under its own keys, so a hit
    loads a sliding group's window only. A model with state-space layers runs with nothing
    loaded or saved (`_check_groups`)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = parse_settings(transfer.kv_connector_extra_config)
        self.state_layers = _check_groups(kv_cache_config)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("KVStoreConnector does not support pipeline parallelism")
        if getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) > 1:
            # Each rank's block then holds every n-th token of the block (interleaved), not
            # a prefix's whole block, which neither the keys nor the latent namespace name.
            raise ValueError("KVStoreConnector does not support decode context parallelism "
                             "(decode_context_parallel_size > 1)")
        if role == KVConnectorRole.SCHEDULER and transfer.kv_load_failure_policy != "recompute":
            # A store is a cache: a block that fails to load is recomputed, never an error.
            # The scheduler reads the policy after it builds its connector.
            logger.info("kvstore: kv_load_failure_policy %r -> 'recompute' (a failed load "
                        "is a miss)", transfer.kv_load_failure_policy)
            transfer.kv_load_failure_policy = "recompute"
        loads = self.settings.load and transfer.is_kv_consumer and not self.state_layers
        saves = self.settings.offload and transfer.is_kv_producer and not self.state_layers
        if self.state_layers and role == KVConnectorRole.SCHEDULER:
            logger.warning(
                "kvstore: %d layers keep a recurrent state (%s, ...), which the store does "
                "not hold; a hit needs every layer's state at the cut, so this model neither "
                "loads from nor saves to the store, and runs as it would without it",
                len(self.state_layers), ", ".join(self.state_layers[:2]))
        # The scheduler looks up under rank 0's namespace; every rank saves and loads its own.
        rank = _tp_rank() if role == KVConnectorRole.WORKER else 0
        self.namespace = namespace_for(self.settings, model_shape(vllm_config, rank))
        opts = self.settings
        try:  # one link per process serves both sides when vLLM runs them in one
            self.link = shared_link(
                opts.target, self.namespace, vllm_config.cache_config.block_size,
                timeout_s=opts.timeout_s, reconnect_s=opts.reconnect_s,
                max_pending_batches=opts.max_pending_batches,
                shared_memory=opts.shared_memory, token=opts.token, tls=opts.tls,
                unix_socket=opts.unix_socket)
        except KVStoreError as exc:
            raise ValueError(f"kv_connector_extra_config: {exc}") from None
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self.link, vllm_config, kv_cache_config,
                                            loads=loads, saves=saves,
                                            policy=opts.load_policy)
        else:
            self._worker = WorkerSide(self.link, rank, codec=opts.codec)
        logger.info("kvstore: %s connector on %s, namespace %s (load %s, save %s, policy %s)",
                    role.name.lower(), opts.target, self.namespace, loads, saves,
                    opts.load_policy)

    @property
    def scheduler(self) -> SchedulerSide:
        """The scheduler's half; a scheduler-side call on a worker's connector is a bug."""
        if self._scheduler is None:
            raise RuntimeError("KVStoreConnector: a scheduler-side call on a worker's connector")
        return self._scheduler

    @property
    def worker(self) -> WorkerSide:
        """The worker's half; a worker-side call on the scheduler's connector is a bug."""
        if self._worker is None:
            raise RuntimeError("KVStoreConnector: a worker-side call on the scheduler's "
                               "connector")
        return self._worker

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, not a lost hand-off

    # -- scheduler side (vllm_scheduler.SchedulerSide) ------------------------------------
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        return self.scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # False: vLLM may free the blocks at once, since a save copies its blocks out during
        # its own step and none is read after this.
        self.scheduler.request_finished(request)
        return False, None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """request_finished, for vLLM's hybrid KV-cache manager: each group's blocks may be
        freed at once, for the same reason."""
        self.scheduler.request_finished(request)
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The blocks saved to and loaded from the store since the last call, as vLLM
        `BlockStored` events (`vllm_events`), which vLLM publishes with its own."""
        return self.scheduler.take_events()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    # -- worker side (vllm_worker.WorkerSide) ---------------------------------------------
    @property
    def paged(self) -> PagedKV | None:
        """The worker's paged KV tensors, once vLLM has registered them."""
        return self.worker.paged

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.state_layers:
            return  # nothing is loaded or saved (_check_groups), so no layout is needed
        self.worker.register(kv_caches, self._kv_cache_config,
                             backends=_backend_names(self._vllm_config, kv_caches))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """vLLM binds the step's metadata just before the forward pass: the step's clock
        starts here, and stops at wait_for_save, right after the forward pass."""
        super().bind_connector_metadata(connector_metadata)
        self.worker.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreMetadata)
        for spec in meta.loads:
            self.worker.start_load(spec)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish before their request is scheduled (they are asynchronous)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # saved all layers at once, after the forward pass (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        self.worker.save(meta if isinstance(meta, KVStoreMetadata) else None)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        return None, self.worker.finished(self._connector_metadata) or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The loads that landed, with those of a hybrid model that failed (by request: vLLM
        cannot take a hybrid model's failed blocks by id, and recomputes such a request)."""
        landed = self.worker.finished(self._connector_metadata)
        return KVConnectorTransferResults(finished_recving=landed,
                                          failed_recving=self.worker.failed_loads())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors()

    # -- metrics and life -----------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The counts of the interval since the last call. A worker adds its timed steps
        (`steps`: [chunks, seconds]) and whole loads (`loads`: [origin, tier, bytes,
        seconds]), which the scheduler side's cost model learns from."""
        if self._scheduler is not None:
            return self._scheduler.stats()
        return self.worker.stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KVStoreStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        link, self.link = self.link, None  # type: ignore[assignment]
        if link is not None:
            release_link(link)
