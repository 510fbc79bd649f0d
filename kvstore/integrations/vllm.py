"""vLLM's KV connector for kvstore (docs/vllm.md): vLLM loads it by module path.

    KVTransferConfig(kv_connector="KVStoreConnector",
                     kv_connector_module_path="kvstore.integrations.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"target": "host:50051"})

Scheduler side (the engine core): at `get_num_new_matched_tokens` the keys of the request's
full blocks past vLLM's own prefix-cache hit go out in one Lookup on a loader thread (with a
background Prefetch to L2 of the hit's L3/L4 blocks), and vLLM hears "ask again later" (None)
until the answer is back, so the rest of the batch runs meanwhile. Then `cost.decide` picks
how much of the hit to load (`load_policy`): the leading blocks whose load is estimated to beat
computing them, from vLLM's forward steps (timed by the worker) and the link's load rates per
tier. Answer and decision are kept per request (vLLM asks each step). What is loaded (never
the last token) arrives asynchronously while the batch runs. Each step's metadata carries the
loads to start, the newly full blocks to save, keys included, and what the step computes.

Worker side (`vllm_worker.WorkerSide`): loads into the paged tensors on loader threads, saves
copied out after the forward pass, the blocks that did not arrive (vLLM recomputes them), and
the timings of each forward pass and whole load, which its stats carry to the scheduler side's
`PrefillModel` and `TierRates` (a load its own link already saw is not counted twice). A save
copies its blocks before the step ends, so vLLM may free a finished request's blocks at once
(`request_finished` returns False).

Roles: kv_both loads and saves; kv_producer (a prefill instance) only saves; kv_consumer (a
decode instance) only loads. The store-facing half (keys, lookup, prefetch, loads, the offload
queue, the fail-safe, the load rates) is `StoreLink`, shared with this repository's engine;
one link per process serves both sides, so an outage is logged once per process.
"""

from __future__ import annotations

import logging
import os
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
from kvstore.integrations.cost import Decision, PrefillModel, decide, slowest
from kvstore.integrations.link import Hit, release_link, shared_link
from kvstore.integrations.paged import PagedKV
from kvstore.integrations.settings import (
    cacheable,
    chain_root,
    model_shape,
    namespace_for,
    parse_settings,
)
from kvstore.integrations.vllm_steps import (
    SCHEDULER_FIELDS,
    WORKER_FIELDS,
    KVStoreMetadata,
    KVStoreStats,
    LoadSpec,
    SaveSpec,
)
from kvstore.integrations.vllm_worker import IDLE_WAIT_S, WorkerSide
from kvstore.keys import BlockKey, chain_key

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


# kvstore's tiers as vLLM's hit sources (L4 is a remote store: unspecified, in vLLM's words).
_SOURCES = {"hbm": CacheHitSource.DEVICE, "dram": CacheHitSource.HOST,
            "pending": CacheHitSource.HOST, "nvme": CacheHitSource.DISK}


@dataclass
class _Tracked:
    request: Request
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # leading blocks the store holds, or whose save is scheduled


@dataclass
class _Lookup:
    """One request's Lookup: blocks first.. of its chain; hit is None while it is out.
    decided: the answer made from it, kept for vLLM's later asks of the same first block."""

    first: int
    hit: Hit | None = None
    decided: _Match | None = None


@dataclass
class _Match:
    """What get_num_new_matched_tokens answered, for update_state_after_alloc."""

    first: int
    tiers: list[str] = field(default_factory=list)  # of each block chosen to load
    decision: Decision | None = None


def _block_bytes(kv_cache_config: KVCacheConfig) -> int:
    """One stored block's bytes on one rank: every layer's page."""
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        return 0
    return int(groups[0].kv_cache_spec.page_size_bytes) * len(groups[0].layer_names)


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
        self.policy = self.settings.load_policy
        self.block_bytes = _block_bytes(kv_cache_config)
        self.step_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.prefill = PrefillModel()  # vLLM's forward steps, timed by the workers
        # The scheduler looks up under rank 0's namespace; every rank saves and loads its own.
        self._rank = _tp_rank() if role == KVConnectorRole.WORKER else 0
        self.namespace = namespace_for(self.settings, model_shape(vllm_config, self._rank))
        opts = self.settings
        try:  # one link per process serves both sides when vLLM runs them in one
            self.link = shared_link(
                opts.target, self.namespace, self.block_size, timeout_s=opts.timeout_s,
                reconnect_s=opts.reconnect_s, max_pending_batches=opts.max_pending_batches,
                shared_memory=opts.shared_memory, token=opts.token, tls=opts.tls,
                unix_socket=opts.unix_socket)
        except KVStoreError as exc:
            raise ValueError(f"kv_connector_extra_config: {exc}") from None
        # Which link timed a load: the scheduler's rates take a worker's load only when its
        # own link did not already learn from it.
        self._origin = f"{os.getpid()}:{id(self.link)}"
        self._reported: dict[str, int] = {}
        # Scheduler side.
        self._tracked: dict[str, _Tracked] = {}
        self._keys: dict[str, list[BlockKey]] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._answered = threading.Condition()  # guards _lookups' hits, set on loader threads
        self._fresh_answers = 0
        self._matched: dict[str, _Match] = {}
        self._sources: dict[str, list[str]] = {}
        self._loads: list[LoadSpec] = []
        self._recomputed_by_choice_tokens = 0
        self.worker = WorkerSide(self.link, self._rank, self._origin)
        logger.info("kvstore: %s connector on %s, namespace %s (load %s, save %s, policy %s)",
                    role.name.lower(), self.settings.target, self.namespace, self.loads,
                    self.saves, self.policy)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, not a lost hand-off

    # -- scheduler side -------------------------------------------------------------------
    def _keys_of(self, request: Request, num_blocks: int) -> list[BlockKey]:
        """The chain's first num_blocks keys, extended incrementally as the request grows."""
        keys = self._keys.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        bs = self.block_size
        parent = keys[-1] if keys else chain_root(self.namespace, request)
        for i in range(len(keys), num_blocks):
            parent = chain_key(parent, tokens[i * bs:(i + 1) * bs])
            keys.append(parent)
        return keys[:num_blocks]

    @property
    def pending_lookups(self) -> int:
        """Lookups out now, their answers not back yet."""
        with self._answered:
            return sum(1 for looked in self._lookups.values() if looked.hit is None)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM asks every step until the request is admitted. The first ask starts a Lookup
        of the full blocks past num_computed_tokens and answers None ("ask again later"), as
        does every ask while it is out; then the tokens to load, as `decide` chooses from the
        answer (the part of it past num_computed_tokens). An answer serves every ask until the
        request is admitted; one that starts past num_computed_tokens is asked again."""
        req_id = request.request_id
        first = num_computed_tokens // self.block_size
        self._matched[req_id] = _Match(first)
        self._sources.pop(req_id, None)
        max_blocks = (request.num_tokens - 1) // self.block_size  # the last token is computed
        if (not self.loads or max_blocks <= first or not cacheable(request)
                or request.skip_reading_prefix_cache):
            return 0, False
        with self._answered:
            looked = self._lookups.get(req_id)
            hit = looked.hit if looked is not None else None
        if looked is None or first < looked.first:
            if not self.link.available:
                return 0, False  # a turned-off link answers a miss at once
            self._lookup(request, first, max_blocks)
            return None, False
        if hit is None:
            return None, False
        match = looked.decided  # decided once: vLLM asks every step while the request waits
        if match is None or match.first != first:
            tiers = hit.tiers[first - looked.first:hit.blocks]
            choice = decide(tiers=tiers, block_bytes=self.block_bytes,
                            block_size=self.block_size, first_block=first,
                            num_tokens=request.num_tokens, policy=self.policy,
                            prefill=self.prefill, rates=self.link.rates,
                            step_tokens=self.step_tokens)
            match = looked.decided = _Match(first, tiers[:choice.load_blocks], choice)
        self._matched[req_id] = match
        self._sources[req_id] = match.tiers
        return len(match.tiers) * self.block_size, bool(match.tiers)

    def _lookup(self, request: Request, first: int, max_blocks: int) -> None:
        """Start the Lookup of blocks first..max_blocks-1; its answer lands in _lookups."""
        looked = _Lookup(first)

        def done(hit: Hit) -> None:  # on a loader thread
            with self._answered:
                looked.hit = hit
                self._fresh_answers += 1
                self._answered.notify_all()

        with self._answered:
            self._lookups[request.request_id] = looked
        self.link.lookup_async(self._keys_of(request, max_blocks)[first:], done, prefetch=True)

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
        req_id = request.request_id
        tracked = self._tracked.setdefault(req_id, _Tracked(request))
        tracked.block_ids = list(blocks.get_block_ids()[0])
        matched = self._matched.pop(req_id, None)
        if matched is None:  # the second call, after an async load: more blocks only
            return
        with self._answered:  # admitted: a later admission (after a preemption) asks afresh
            self._lookups.pop(req_id, None)
        first, count = matched.first, num_external_tokens // self.block_size
        saved = first + count
        choice = matched.decision
        if choice is not None and (choice.load_blocks or choice.recompute_blocks):
            logger.debug("kvstore: %s: %s", req_id, choice.reason)
            self._recomputed_by_choice_tokens += choice.recompute_blocks * self.block_size
            if count == choice.load_blocks:  # the store holds them: computed, not saved again
                saved += choice.recompute_blocks
        if count:
            keys = self._keys_of(request, first + count)[first:]
            self._loads.append(LoadSpec(req_id, keys, tracked.block_ids[first:first + count],
                                        slowest(matched.tiers[:count])))
        tracked.saved = saved

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        idle = scheduler_output.total_num_scheduled_tokens == 0
        self._await_lookup(IDLE_WAIT_S if idle else 0.0)
        meta = KVStoreMetadata(loads=self._loads, idle=idle)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            meta.chunks.append((scheduled.get(new.req_id, 0), new.num_computed_tokens))
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                self._save(meta, tracked, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            meta.chunks.append((scheduled.get(req_id, 0), cached.num_computed_tokens[i]))
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

    def _await_lookup(self, timeout_s: float) -> None:
        """In a step that computes nothing while lookups are out and none came back since the
        last step, wait for one (at most timeout_s) rather than let vLLM's loop spin through
        empty steps, which starves the loader threads of the GIL. Bounded, so a request
        arriving now is scheduled at most IDLE_WAIT_S late."""
        with self._answered:
            if timeout_s > 0 and not self._fresh_answers and any(
                    looked.hit is None for looked in self._lookups.values()):
                self._answered.wait(timeout_s)
            self._fresh_answers = 0

    def _save(self, meta: KVStoreMetadata, tracked: _Tracked, num_computed: int,
              scheduler_output: SchedulerOutput) -> None:
        """Schedule the blocks this step fills (their tokens all known) for saving."""
        request = tracked.request
        if not self.saves or not cacheable(request):
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
        req_id = request.request_id
        self._tracked.pop(req_id, None)
        self._keys.pop(req_id, None)
        self._matched.pop(req_id, None)
        self._sources.pop(req_id, None)
        with self._answered:  # a lookup still out answers into nothing
            self._lookups.pop(req_id, None)
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' timings teach the cost model; a block that failed to load is
        recomputed by vLLM: save it again from there."""
        self._learn(connector_output.kv_connector_stats)
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for tracked in self._tracked.values():
            for index, block in enumerate(tracked.block_ids[:tracked.saved]):
                if block in invalid:
                    tracked.saved = index
                    break

    def _learn(self, stats: KVConnectorStats | None) -> None:
        """Feed the workers' forward steps to `prefill` and their loads to the link's rates,
        and take both out of the stats (vLLM logs the counters that remain)."""
        data = getattr(stats, "data", None)
        if not isinstance(data, dict):
            return
        for chunks, seconds in data.pop("steps", None) or []:
            self.prefill.observe([(int(n), int(c)) for n, c in chunks], float(seconds))
        for origin, tier, nbytes, seconds in data.pop("loads", None) or []:
            if origin != self._origin:  # else this process's link timed it already
                self.link.rates.observe_load(str(tier), int(nbytes), float(seconds))

    # -- worker side (vllm_worker.WorkerSide) ---------------------------------------------
    @property
    def paged(self) -> PagedKV | None:
        return self.worker.paged

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register(kv_caches, self._kv_cache_config)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """vLLM binds the step's metadata just before the forward pass: the step's clock
        starts here and stops at wait_for_save, right after it."""
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

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors()

    # -- metrics and life -----------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The counters of the interval since the last call; a worker adds its timed steps
        (`steps`: [chunks, seconds]) and whole loads (`loads`: [origin, tier, bytes,
        seconds]) for the scheduler side's cost model."""
        scheduler = self.role == KVConnectorRole.SCHEDULER
        names = SCHEDULER_FIELDS if scheduler else WORKER_FIELDS
        now = {**self.link.stats.as_dict(),
               "recomputed_by_choice_tokens": self._recomputed_by_choice_tokens}
        data: dict[str, Any] = {n: now[n] - self._reported.get(n, 0) for n in names}
        self._reported.update({n: now[n] for n in names})
        if "lookup_hit_blocks" in data:
            data["external_hit_tokens"] = data.pop("lookup_hit_blocks") * self.block_size
        if not scheduler:
            data |= self.worker.timings()
        return KVStoreStats(data=data) if any(data.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KVStoreStats(data=dict(data or {}))

    def shutdown(self) -> None:
        link, self.link = self.link, None  # type: ignore[assignment]
        if link is not None:
            release_link(link)
