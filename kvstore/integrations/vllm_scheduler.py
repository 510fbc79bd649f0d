"""The scheduler half of vLLM's kvstore connector (`kvstore.integrations.vllm`), which runs in
vLLM's engine core. It decides, for each request, what to load from the store and what to save
to it.

- Lookup: when vLLM first asks `get_num_new_matched_tokens` about a request, the keys of the
  request's full blocks past vLLM's own prefix-cache hit go out in one Lookup on a loader
  thread, with a Prefetch to L2 of the hit's blocks that lie in L3 or L4 started in the
  background. Until the answer is back vLLM hears "ask again later" (None), so the rest of the
  batch runs meanwhile.
- Decision: from the answer, `cost.decide` picks how much of the hit to load (`load_policy`):
  the leading blocks whose load is estimated to beat computing them. Its figures are vLLM's
  own forward steps, which the workers time (`PrefillModel`), and the link's load rates per
  tier (`TierRates`). The answer and the decision are kept: vLLM asks again every step until
  it admits the request, and those asks cost nothing.
- Loads: what is chosen (never the request's last token, which vLLM must compute) arrives
  asynchronously while the batch runs; the request waits for it.
- Saves: each step, the blocks the step fills are scheduled for saving, keys included, along
  with what the step computes (for the workers' step timings).

The side keeps one `RequestState` per request: it is created when vLLM first asks about the
request and forgotten when the request finishes.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.integrations.cost import Decision, PrefillModel, decide, slowest
from kvstore.integrations.link import Hit, StoreLink
from kvstore.integrations.settings import cacheable, chain_root
from kvstore.integrations.vllm_steps import (
    IDLE_WAIT_S,
    SCHEDULER_FIELDS,
    CounterDeltas,
    KVStoreMetadata,
    KVStoreStats,
    LoadSpec,
    SaveSpec,
    load_origin,
)
from kvstore.keys import BlockKey, chain_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvstore.integrations.vllm")

# kvstore's tiers as vLLM's hit sources. L4 is a remote store, which vLLM calls unspecified.
_SOURCES = {"hbm": CacheHitSource.DEVICE, "dram": CacheHitSource.HOST,
            "pending": CacheHitSource.HOST, "nvme": CacheHitSource.DISK}


@dataclass
class Match:
    """What `get_num_new_matched_tokens` answered about a request, which
    `update_state_after_alloc` acts on once vLLM admits it."""

    first: int
    """The first block past vLLM's own prefix-cache hit: the answer counts from there."""
    tiers: list[str] = field(default_factory=list)
    """The tier of each block chosen to load."""
    decision: Decision | None = None
    """The load-or-compute decision the answer came from; None when no hit was decided on."""


@dataclass
class Lookup:
    """One Lookup of a request's chain, from block `first` on."""

    first: int
    hit: Hit | None = None
    """What the store holds; None while the Lookup is out. A loader thread sets it."""
    decided: Match | None = None
    """The answer made from the hit. It is kept for vLLM's later asks with the same first
    block, which get the same answer without deciding again."""


@dataclass
class RequestState:
    """All the scheduler side keeps about one request."""

    request: Request
    keys: list[BlockKey] = field(default_factory=list)
    """The keys of the request's chain from its first block on, as far as they were needed.
    They grow with the request, and none is computed twice."""
    lookup: Lookup | None = None
    """The request's Lookup while it waits to be admitted, out or answered. Admission clears
    it, so a request admitted again later (after a preemption) is looked up afresh."""
    match: Match | None = None
    """vLLM's latest answer about the request, until `update_state_after_alloc` takes it."""
    sources: list[str] = field(default_factory=list)
    """The tier of each block in that answer, until vLLM asks which tiers its hit came from."""
    block_ids: list[list[int]] | None = None
    """The request's blocks in vLLM's KV cache, per KV-cache group (one for a model whose
    layers all attend alike); None until vLLM first allocates them."""
    saved: int = 0
    """How many of the request's leading blocks the store holds, or has a save scheduled."""


_NULL_BLOCK = 0
"""The block id vLLM's block pool gives the null block: the place of a sliding window's
blocks that slid out (and were freed), which a group no longer holds."""


def _block_bytes(kv_cache_config: KVCacheConfig) -> int:
    """The bytes of one stored block on one rank: one page of every layer of every group."""
    return sum(int(g.kv_cache_spec.page_size_bytes) * len(g.layer_names)
               for g in kv_cache_config.kv_cache_groups)


def _held(block_ids: list[int]) -> list[int]:
    """Block ids as a load writes them: -1 where the group holds no block (vLLM's null)."""
    return [-1 if b == _NULL_BLOCK else b for b in block_ids]


class SchedulerSide:
    """What the scheduler's connector does and keeps. vLLM calls it from its engine core's one
    scheduler thread; only the Lookups' answers arrive on the link's loader threads."""

    def __init__(self, link: StoreLink, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 *, loads: bool, saves: bool, policy: str) -> None:
        """`loads` and `saves` say whether this connector loads hits and saves blocks, as its
        role and options allow; `policy` is its `load_policy`."""
        self.link = link
        self.loads = loads
        self.saves = saves
        self.policy = policy
        self.block_size = link.block_size
        self.block_bytes = _block_bytes(kv_cache_config)
        self.step_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.prefill = PrefillModel()
        """vLLM's forward steps, timed by the workers: what computing tokens costs."""
        self._origin = load_origin(link)
        self._reported = CounterDeltas(SCHEDULER_FIELDS)
        self._requests: dict[str, RequestState] = {}
        # Guards the Lookups' hits, which loader threads set, the count of answers since the
        # last step, and changes to _requests, which pending_lookups reads.
        self._answered = threading.Condition()
        self._fresh_answers = 0
        self._loads: list[LoadSpec] = []  # the loads to start in the next step
        self._recomputed_by_choice_tokens = 0

    def _state(self, request: Request) -> RequestState:
        """The request's state, created on vLLM's first ask about the request."""
        state = self._requests.get(request.request_id)
        if state is None:
            state = RequestState(request)
            with self._answered:
                self._requests[request.request_id] = state
        return state

    def _keys_of(self, state: RequestState, num_blocks: int) -> list[BlockKey]:
        """The first num_blocks keys of the request's chain. The keys computed before are
        kept, so each call computes only the keys it adds."""
        keys = state.keys
        tokens = state.request.all_token_ids
        bs = self.block_size
        parent = keys[-1] if keys else chain_root(self.link.namespace, state.request)
        for i in range(len(keys), num_blocks):
            parent = chain_key(parent, tokens[i * bs:(i + 1) * bs])
            keys.append(parent)
        return keys[:num_blocks]

    @property
    def pending_lookups(self) -> int:
        """How many Lookups are out now, their answers not back yet."""
        with self._answered:
            return sum(1 for state in self._requests.values()
                       if state.lookup is not None and state.lookup.hit is None)

    # -- admission ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM asks this every step until it admits the request. The first ask starts a
        Lookup of the request's full blocks past num_computed_tokens and answers None ("ask
        again later"), and so does every ask while the Lookup is out. Once it is back the
        answer is the number of tokens to load, as `decide` chooses them from the part of the
        hit past num_computed_tokens. That answer serves every later ask until the request is
        admitted. A Lookup that started past num_computed_tokens (vLLM's own prefix hit
        shrank) is started again from there."""
        state = self._state(request)
        first = num_computed_tokens // self.block_size
        state.match = Match(first)
        state.sources = []
        max_blocks = (request.num_tokens - 1) // self.block_size  # the last token is computed
        if (not self.loads or max_blocks <= first or not cacheable(request)
                or request.skip_reading_prefix_cache):
            return 0, False
        with self._answered:
            looked = state.lookup
            hit = looked.hit if looked is not None else None
        if looked is None or first < looked.first:
            if not self.link.available:
                return 0, False  # a turned-off link answers a miss at once
            self._lookup(state, first, max_blocks)
            return None, False
        if hit is None:
            return None, False
        match = looked.decided  # decided once: vLLM asks every step while the request waits
        if match is None or match.first != first:
            match = looked.decided = self._decide(request, looked.first, hit, first)
        state.match = match
        state.sources = match.tiers
        return len(match.tiers) * self.block_size, bool(match.tiers)

    def _lookup(self, state: RequestState, first: int, max_blocks: int) -> None:
        """Start the Lookup of the request's blocks first to max_blocks - 1. Its answer lands
        in the request's state (or in nothing, if the request has finished by then)."""
        looked = Lookup(first)

        def done(hit: Hit) -> None:  # on a loader thread
            with self._answered:
                looked.hit = hit
                self._fresh_answers += 1
                self._answered.notify_all()

        with self._answered:
            state.lookup = looked
        self.link.lookup_async(self._keys_of(state, max_blocks)[first:], done, prefetch=True)

    def _decide(self, request: Request, looked_from: int, hit: Hit, first: int) -> Match:
        """The answer to give from a hit that a Lookup from block looked_from found, for the
        blocks from first on."""
        tiers = hit.tiers[first - looked_from:hit.blocks]
        choice = decide(tiers=tiers, block_bytes=self.block_bytes, block_size=self.block_size,
                        first_block=first, num_tokens=request.num_tokens, policy=self.policy,
                        prefill=self.prefill, rates=self.link.rates,
                        step_tokens=self.step_tokens)
        return Match(first, tiers[:choice.load_blocks], choice)

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The hit's tokens by the tier each block was found in."""
        state = self._requests.get(request.request_id)
        tiers: list[str] = []
        if state is not None:
            tiers, state.sources = state.sources, []
        counts: dict[CacheHitSource, int] = {}
        for tier in tiers[: num_external_tokens // self.block_size]:
            source = _SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            counts[source] = counts.get(source, 0) + self.block_size
        if sum(counts.values()) != num_external_tokens:  # vLLM trimmed the hit: unsplit
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return counts

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks. On admission, the tokens it took from the
        answer (num_external_tokens) become a load for the next step, and the blocks the store
        holds already are not saved again."""
        state = self._state(request)
        state.block_ids = [list(g) for g in blocks.get_block_ids()]
        match, state.match = state.match, None
        if match is None:  # the second call, after an async load: more blocks only
            return
        with self._answered:  # admitted: a later admission (after a preemption) asks afresh
            state.lookup = None
        first, count = match.first, num_external_tokens // self.block_size
        saved = first + count
        choice = match.decision
        if choice is not None and (choice.load_blocks or choice.recompute_blocks):
            logger.debug("kvstore: %s: %s", request.request_id, choice.reason)
            self._recomputed_by_choice_tokens += choice.recompute_blocks * self.block_size
            if count == choice.load_blocks:  # the store holds them: computed, not saved again
                saved += choice.recompute_blocks
        if count:
            keys = self._keys_of(state, first + count)[first:]
            ids = [_held(g[first:first + count]) for g in state.block_ids]
            self._loads.append(LoadSpec(request.request_id, keys, ids[0],
                                        slowest(match.tiers[:count]), more_groups=ids[1:]))
        state.saved = saved

    # -- each step ------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreMetadata:
        """The step's work for the workers: the loads admission started, the blocks the
        step fills, to save, and what the step computes."""
        idle = scheduler_output.total_num_scheduled_tokens == 0
        self._await_lookup(IDLE_WAIT_S if idle else 0.0)
        meta = KVStoreMetadata(loads=self._loads, idle=idle)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            meta.chunks.append((scheduled.get(new.req_id, 0), new.num_computed_tokens))
            state = self._requests.get(new.req_id)
            if state is not None and state.block_ids is not None:
                state.block_ids = [list(g) for g in new.block_ids]
                self._save(meta, state, state.block_ids, new.num_computed_tokens,
                           scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            meta.chunks.append((scheduled.get(req_id, 0), cached.num_computed_tokens[i]))
            state = self._requests.get(req_id)
            if state is None or state.block_ids is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = ([list(g) for g in new_ids] if new_ids
                                   else [[] for _ in state.block_ids])
            elif new_ids:
                for held, added in zip(state.block_ids, new_ids, strict=True):
                    held.extend(added)
            self._save(meta, state, state.block_ids, cached.num_computed_tokens[i],
                       scheduler_output)
        return meta

    def _await_lookup(self, timeout_s: float) -> None:
        """In a step that computes nothing, while Lookups are out and none has come back since
        the last step, wait for one (at most timeout_s). Otherwise vLLM's loop would spin
        through empty steps, which starves the loader threads of the GIL. The wait is bounded,
        so a request arriving now is scheduled at most IDLE_WAIT_S late."""
        with self._answered:
            if timeout_s > 0 and not self._fresh_answers and any(
                    state.lookup is not None and state.lookup.hit is None
                    for state in self._requests.values()):
                self._answered.wait(timeout_s)
            self._fresh_answers = 0

    def _save(self, meta: KVStoreMetadata, state: RequestState, block_ids: list[list[int]],
              num_computed: int, scheduler_output: SchedulerOutput) -> None:
        """Schedule for saving the request's blocks that this step fills, whose tokens are
        then all known. block_ids: the request's blocks in vLLM's KV cache, per group. Every
        group holds a block the step fills (a sliding window frees it only in a later
        step); should one not, the save stops before it, and those blocks stay unsaved."""
        request = state.request
        if not self.saves or not cacheable(request):
            return
        scheduled = scheduler_output.num_scheduled_tokens.get(request.request_id, 0)
        full = min(num_computed + scheduled, request.num_tokens) // self.block_size
        full = min(full, *(len(g) for g in block_ids))
        if full <= state.saved:
            return
        keys = self._keys_of(state, full)
        start = state.saved
        state.saved = full
        end = next((i for i in range(start, full) if any(g[i] == _NULL_BLOCK
                                                          for g in block_ids)), full)
        if end > start:
            meta.saves.append(SaveSpec(keys[start:end], block_ids[0][start:end],
                                       keys[start - 1] if start else None,
                                       more_groups=[g[start:end] for g in block_ids[1:]]))

    def request_finished(self, request: Request) -> None:
        """The request is done: its state goes. A save copies its blocks out during its own
        step, so vLLM may free them at once; a Lookup still out answers into nothing."""
        with self._answered:
            self._requests.pop(request.request_id, None)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' timings teach the cost model. A block that failed to load is
        recomputed by vLLM, so the request's saves start again from it."""
        self._learn(connector_output.kv_connector_stats)
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for state in self._requests.values():
            for index in range(state.saved):
                if any(index < len(g) and g[index] in invalid for g in state.block_ids or []):
                    state.saved = index
                    break

    def _learn(self, stats: KVConnectorStats | None) -> None:
        """Feed the workers' forward steps to `prefill` and their loads to the link's rates,
        and take both out of the stats, so that vLLM logs only the counters."""
        data = getattr(stats, "data", None)
        if not isinstance(data, dict):
            return
        for chunks, seconds in data.pop("steps", None) or []:
            self.prefill.observe([(int(n), int(c)) for n, c in chunks], float(seconds))
        for origin, tier, nbytes, seconds in data.pop("loads", None) or []:
            if origin != self._origin:  # else this process's link timed it already
                self.link.rates.observe_load(str(tier), int(nbytes), float(seconds))

    # -- metrics --------------------------------------------------------------------------
    def stats(self) -> KVStoreStats | None:
        """The scheduler side's connector stats for the interval since the last call; None
        when every count is zero."""
        now = {**self.link.stats.as_dict(),
               "recomputed_by_choice_tokens": self._recomputed_by_choice_tokens}
        data: dict[str, Any] = self._reported.take(now)
        data["external_hit_tokens"] = data.pop("lookup_hit_blocks") * self.block_size
        return KVStoreStats(data=data) if any(data.values()) else None
