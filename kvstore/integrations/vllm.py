"""vLLM's KV connector for kvstore (docs/vllm.md): vLLM loads it by module path.

    KVTransferConfig(kv_connector="KVStoreConnector",
                     kv_connector_module_path="kvstore.integrations.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"target": "host:50051"})

Scheduler side (the engine core): at `get_num_new_matched_tokens` the keys of the request's
full blocks past vLLM's own prefix-cache hit, one Lookup, and a background Prefetch to L2 of
the hit's L3/L4 blocks; the hit (always leaving the last token to compute) is loaded
asynchronously, so the request waits for its blocks while the rest of the batch runs. Each
step's metadata carries the loads to start and the newly full blocks to save, keys included:
the worker needs no token ids.

Worker side: `register_kv_caches` learns the layout (`PagedKV`); loads read the blocks on a
loader thread (through shared memory when co-located) into a staging buffer and scatter them
into the paged tensors, or straight into the cache when a block's layers lie contiguous; saves
copy the newly full blocks out after the forward pass (`wait_for_save`) and put them from a
writer thread. Blocks that did not arrive are reported by `get_block_ids_with_load_errors`,
and vLLM recomputes them. Because a save copies its blocks before the step ends, vLLM may free
a finished request's blocks at once (`request_finished` returns False): nothing it frees is
still being read.

Roles: kv_both loads and saves; kv_producer (a prefill instance) only saves; kv_consumer (a
decode instance) only loads. The store-facing half (keys, lookup, prefetch, loads, the offload
queue, the fail-safe) is `StoreLink`, shared with this repository's engine; one link per
process serves both sides, so an outage is logged once per process.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.client.errors import KVStoreError
from kvstore.integrations.link import release_link, shared_link
from kvstore.integrations.paged import PagedKV
from kvstore.integrations.settings import ModelShape, namespace_for, parse_settings
from kvstore.keys import BlockKey, chain_key, namespace_root

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvstore.integrations.vllm")


@dataclass
class LoadSpec:
    req_id: str
    keys: list[BlockKey]
    block_ids: list[int]


@dataclass
class SaveSpec:
    keys: list[BlockKey]
    block_ids: list[int]
    parent: BlockKey | None


@dataclass
class KVStoreMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    idle: bool = False
    """The step computes nothing (every request waits, for its load say)."""


class KVStoreStats(KVConnectorStats):
    """Counters of one interval, summed across workers and the scheduler."""

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


# What each side reports (one link may serve both in one process: no field twice).
_SCHEDULER_FIELDS = ("lookups", "lookup_hit_blocks", "prefetched_blocks")
_WORKER_FIELDS = ("loaded_blocks", "loaded_bytes", "load_failures", "offloaded_blocks",
                  "offloaded_bytes", "offload_dropped_blocks", "errors")


# kvstore's tiers as vLLM's hit sources (L4 is a remote store: unspecified, in vLLM's words).
_SOURCES = {"hbm": CacheHitSource.DEVICE, "dram": CacheHitSource.HOST,
            "pending": CacheHitSource.HOST, "nvme": CacheHitSource.DISK}


@dataclass
class _Tracked:
    request: Request
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0
    """Leading blocks the store holds, or whose save is scheduled."""


_IDLE_WAIT_S = 0.01

def _model_shape(vllm_config: VllmConfig, tp_rank: int) -> ModelShape:
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    kv_dtype = cc.cache_dtype if cc.cache_dtype != "auto" else str(mc.dtype).removeprefix(
        "torch.")
    layout = getattr(cc, "kv_cache_layout", None)
    return ModelShape(
        model=str(mc.model), revision=mc.revision, kv_dtype=kv_dtype,
        num_layers=mc.get_num_layers(pc), num_kv_heads=mc.get_num_kv_heads(pc),
        head_dim=mc.get_head_size(), block_size=cc.block_size,
        kv_layout=str(getattr(layout, "name", layout) or "default"),
        tp_rank=tp_rank, tp_size=pc.tensor_parallel_size)


def _root(namespace: str, request: Request) -> BlockKey:
    """A chain's root: the namespace's, or one derived from what else the request's K/V depend
    on: its LoRA adapter, and vLLM's `cache_salt` (which keeps vLLM's own prefix cache apart
    per salt). Requests share store blocks only when all of these match."""
    root = namespace_root(namespace)
    lora = request.lora_request
    # An adapter by name and path (its id is a per-server number): a miss across servers that
    # keep one adapter at different paths, never a hit across two adapters of one name.
    extra = [f"lora:{lora.lora_name}:{lora.lora_path}" if lora is not None else "",
             f"cache_salt:{request.cache_salt}" if request.cache_salt else ""]
    if not any(extra):
        return root
    return BlockKey(hashlib.sha256(root + "\0".join(extra).encode()).digest())


def _cacheable(request: Request) -> bool:
    """Whether token ids alone name the request's K/V: not with images or audio (their
    placeholder tokens are the same for every image) or prompt embeddings."""
    return not request.mm_features and request.prompt_embeds is None


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # no distributed state: a single process, rank 0
        return 0


class KVStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = parse_settings(transfer.kv_connector_extra_config)
        groups = kv_cache_config.kv_cache_groups
        if len(groups) > 1:
            raise ValueError(f"KVStoreConnector supports one KV cache group (full attention); "
                             f"this model has {len(groups)} (a hybrid model)")
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("KVStoreConnector does not support pipeline parallelism")
        if role == KVConnectorRole.SCHEDULER and transfer.kv_load_failure_policy != "recompute":
            # A store is a cache: a block that fails to load is recomputed, never an error.
            # The scheduler reads the policy after it builds its connector.
            logger.info("kvstore: kv_load_failure_policy %r -> 'recompute' (a failed load "
                        "is a miss)", transfer.kv_load_failure_policy)
            transfer.kv_load_failure_policy = "recompute"
        self.block_size = vllm_config.cache_config.block_size
        self.loads = self.settings.load and transfer.is_kv_consumer
        self.saves = self.settings.offload and transfer.is_kv_producer
        # The scheduler looks up under rank 0's namespace; every rank saves and loads its own.
        rank = _tp_rank() if role == KVConnectorRole.WORKER else 0
        self.namespace = namespace_for(self.settings, _model_shape(vllm_config, rank))
        opts = self.settings
        try:  # one link per process serves both sides when vLLM runs them in one
            self.link = shared_link(
                opts.target, self.namespace, self.block_size, timeout_s=opts.timeout_s,
                reconnect_s=opts.reconnect_s, max_pending_batches=opts.max_pending_batches,
                shared_memory=opts.shared_memory, token=opts.token, tls=opts.tls,
                unix_socket=opts.unix_socket)
        except KVStoreError as exc:
            raise ValueError(f"kv_connector_extra_config: {exc}") from None
        self._reported: dict[str, int] = {}
        # Scheduler side.
        self._tracked: dict[str, _Tracked] = {}
        self._keys: dict[str, list[BlockKey]] = {}
        self._matched: dict[str, tuple[int, int]] = {}
        self._sources: dict[str, list[str]] = {}
        self._loads: list[LoadSpec] = []
        # Worker side.
        self.paged: PagedKV | None = None
        self._lock = threading.Lock()
        self._load_done = threading.Condition(self._lock)
        self._loads_in_flight = 0
        self._finished_loads: set[str] = set()
        self._load_errors: set[int] = set()
        logger.info("kvstore: %s connector on %s, namespace %s (load %s, save %s)",
                    role.name.lower(), self.settings.target, self.namespace, self.loads,
                    self.saves)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, not a lost hand-off

    # -- scheduler side -------------------------------------------------------------------
    def _keys_of(self, request: Request, num_blocks: int) -> list[BlockKey]:
        """The chain's first num_blocks keys, extended incrementally as the request grows."""
        keys = self._keys.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        bs = self.block_size
        parent = keys[-1] if keys else _root(self.namespace, request)
        for i in range(len(keys), num_blocks):
            parent = chain_key(parent, tokens[i * bs:(i + 1) * bs])
            keys.append(parent)
        return keys[:num_blocks]

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        first = num_computed_tokens // self.block_size
        self._matched[request.request_id] = (first, 0)
        max_blocks = (request.num_tokens - 1) // self.block_size  # the last token is computed
        if not self.loads or max_blocks <= first or not _cacheable(request):
            return 0, False
        keys = self._keys_of(request, max_blocks)[first:]
        hit = self.link.lookup(keys, prefetch=True)
        self._matched[request.request_id] = (first, hit.blocks)
        self._sources[request.request_id] = hit.tiers
        return hit.blocks * self.block_size, hit.blocks > 0

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The hit's tokens by the tier each block was found in."""
        tiers = self._sources.pop(request.request_id, [])
        counts: dict[CacheHitSource, int] = {}
        for tier in tiers[: num_external_tokens // self.block_size]:
            source = _SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            counts[source] = counts.get(source, 0) + self.block_size
        if sum(counts.values()) != num_external_tokens:  # vLLM trimmed the hit: unsplit
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return counts

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        tracked = self._tracked.setdefault(request.request_id, _Tracked(request))
        tracked.block_ids = list(blocks.get_block_ids()[0])
        matched = self._matched.pop(request.request_id, None)
        if matched is None:  # the second call, after an async load: more blocks only
            return
        first, _ = matched
        count = num_external_tokens // self.block_size
        if count:
            keys = self._keys_of(request, first + count)[first:]
            self._loads.append(LoadSpec(request.request_id, keys,
                                        tracked.block_ids[first:first + count]))
        tracked.saved = first + count

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVStoreMetadata(loads=self._loads,
                               idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._loads = []
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                self._save(meta, tracked, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                tracked.block_ids.extend(new_ids[0])
            self._save(meta, tracked, cached.num_computed_tokens[i], scheduler_output)
        return meta

    def _save(self, meta: KVStoreMetadata, tracked: _Tracked, num_computed: int,
              scheduler_output: SchedulerOutput) -> None:
        """Schedule the blocks this step fills (their tokens all known) for saving."""
        request = tracked.request
        if not self.saves or not _cacheable(request):
            return
        scheduled = scheduler_output.num_scheduled_tokens.get(request.request_id, 0)
        full = min(num_computed + scheduled, request.num_tokens) // self.block_size
        full = min(full, len(tracked.block_ids))
        if full <= tracked.saved:
            return
        keys = self._keys_of(request, full)
        start = tracked.saved
        meta.saves.append(SaveSpec(keys[start:full], tracked.block_ids[start:full],
                                   keys[start - 1] if start else None))
        tracked.saved = full

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # A save copies its blocks out during its own step, so none is read after this.
        self._tracked.pop(request.request_id, None)
        self._keys.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        self._sources.pop(request.request_id, None)
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """A block that failed to load is recomputed by vLLM: save it again from there."""
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for tracked in self._tracked.values():
            for index, block in enumerate(tracked.block_ids[:tracked.saved]):
                if block in invalid:
                    tracked.saved = index
                    break

    # -- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = [n for g in self._kv_cache_config.kv_cache_groups for n in g.layer_names
                 if n in kv_caches]
        self.paged = PagedKV([(n, kv_caches[n]) for n in names],
                             self._kv_cache_config.num_blocks)
        logger.info("kvstore: %d layers, %d-byte blocks, %s", len(names),
                    self.paged.block_bytes,
                    "loads straight into the cache" if self.paged.direct else "staged loads")

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreMetadata)
        for spec in meta.loads:
            self._start_load(spec)

    def _start_load(self, spec: LoadSpec) -> None:
        paged = self.paged
        if paged is None:
            raise RuntimeError("KVStoreConnector: a load before register_kv_caches")
        staging = None if paged.direct else paged.staging(len(spec.keys))
        rows = paged.direct_rows(spec.block_ids) if staging is None else paged.rows(staging)

        def done(arrived: int) -> None:
            try:
                if staging is not None and arrived:
                    paged.scatter(staging, spec.block_ids[:arrived])
            except Exception:
                logger.exception("kvstore: scattering %d loaded blocks failed", arrived)
                arrived = 0
            with self._lock:
                self._load_errors.update(spec.block_ids[arrived:])
                self._finished_loads.add(spec.req_id)
                self._loads_in_flight -= 1
                self._load_done.notify_all()

        with self._lock:
            self._loads_in_flight += 1
        self.link.read_async(spec.keys, rows, done)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish before their request is scheduled (they are asynchronous)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # saved all layers at once, after the forward pass (wait_for_save)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata() or self.paged is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreMetadata)
        for spec in meta.saves:
            if not self.link.available:
                self.link.offload(spec.keys, [], spec.parent)  # counted as dropped
                continue
            staging = self.paged.gather(spec.block_ids)
            self.link.offload(spec.keys, self.paged.rows(staging), spec.parent)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        meta = self._connector_metadata
        idle = isinstance(meta, KVStoreMetadata) and meta.idle
        with self._lock:
            if idle and self._loads_in_flight and not self._finished_loads:
                # Nothing to compute until a load lands: wait for it here rather than let
                # vLLM's loop spin through empty steps, which starves the loader thread of
                # the GIL (measured: hits 2-5x slower). Bounded, so a request arriving now
                # is scheduled at most _IDLE_WAIT_S late.
                self._load_done.wait(_IDLE_WAIT_S)
            done, self._finished_loads = self._finished_loads, set()
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # -- metrics and life -----------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        names = _SCHEDULER_FIELDS if self.role == KVConnectorRole.SCHEDULER else _WORKER_FIELDS
        now = self.link.stats.as_dict()
        delta = {n: now[n] - self._reported.get(n, 0) for n in names}
        self._reported.update({n: now[n] for n in names})
        if "lookup_hit_blocks" in delta:
            delta["external_hit_tokens"] = delta.pop("lookup_hit_blocks") * self.block_size
        return KVStoreStats(data=delta) if any(delta.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KVStoreStats(data=dict(data or {}))

    def shutdown(self) -> None:
        link, self.link = self.link, None  # type: ignore[assignment]
        if link is not None:
            release_link(link)
