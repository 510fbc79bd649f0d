"""The scheduler half of vLLM's kvstore connector (`kvstore.integrations.vllm`), which runs in
vLLM's engine core. It decides, for each request, what to load from the store and what to save
to it.

- Lookup: when vLLM first asks `get_num_new_matched_tokens` about a request, the keys of the
  request's full blocks past vLLM's own prefix-cache hit go out in one Lookup on a loader
  thread, with a Prefetch to L2 of the hit's blocks that lie in L3 or L4 started in the
  background. Until the answer is back vLLM hears "ask again later" (None), so the rest of the
  batch runs meanwhile. A model with several KV-cache groups (vLLM's hybrid manager) keeps one
  key chain per group, and its hit is the longest cut every group serves (`_find`): a full
  group needs every block before the cut, a sliding group only its window's.
- Decision: from the answer, `cost.decide` picks how much of the hit to load (`load_policy`):
  the leading blocks whose load is estimated to beat computing them. Its figures are vLLM's
  own forward steps, which the workers time (`PrefillModel`), and the link's load rates per
  tier (`TierRates`). The answer and the decision are kept: vLLM asks again every step until
  it admits the request, and those asks cost nothing.
- Loads: what is chosen (never the request's last token, which vLLM must compute) arrives
  asynchronously while the batch runs; the request waits for it.
- Saves: each step, the blocks the step fills are scheduled for saving, keys included, along
  with what the step computes (for the workers' step timings).
- Events: when vLLM publishes KV events, the blocks saved and loaded are announced as vLLM
  `BlockStored` events (`vllm_events`), so routers learn what the store holds.

The side keeps one `RequestState` per request: it is created when vLLM first asks about the
request and forgotten when the request finishes.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import SlidingWindowSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.integrations.cost import Decision, PrefillModel, decide, slowest
from kvstore.integrations.link import Hit, StoreLink
from kvstore.integrations.settings import cacheable, chain_root, group_root
from kvstore.integrations.vllm_events import StoreEvents, StoreWatch
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
    from vllm.distributed.kv_events import KVCacheEvent
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
class Found:
    """What the store can serve of a request, every KV-cache group together (`_find`)."""

    cut: int
    """The hit ends before this block (an index in the request's chain)."""
    tiers: list[str]
    """Per block from the Lookup's first up to the cut, the slowest tier a group loads it
    from ("pending", the cheapest, where no group loads it: a sliding group's block before
    its window, in a model with no full-attention group)."""


@dataclass
class Lookup:
    """One Lookup of a request's chain, from block `first` on."""

    first: int
    hit: Found | None = None
    """What the store holds; None while the Lookup is out. A loader thread sets it."""
    decided: Match | None = None
    """The answer made from the hit. It is kept for vLLM's later asks with the same first
    block, which get the same answer without deciding again."""


@dataclass
class RequestState:
    """All the scheduler side keeps about one request."""

    request: Request
    keys: list[list[BlockKey]] = field(default_factory=list)
    """Per KV-cache group, the keys of the request's chain from its first block on, as far
    as they were needed. They grow with the request, and none is computed twice."""
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


def _group_bytes(kv_cache_config: KVCacheConfig) -> list[int]:
    """Per KV-cache group, the bytes of one stored block on one rank: a page of every layer
    of the group."""
    return [int(g.kv_cache_spec.page_size_bytes) * len(g.layer_names)
            for g in kv_cache_config.kv_cache_groups]


def _window_blocks(spec: Any, block_size: int) -> int:
    """How many blocks before a cut a group needs for a hit there: 0 for "all of them" (full
    attention); for a sliding window of w tokens, the ceil((w - 1) / block_size) blocks that
    vLLM's `SlidingWindowManager.find_longest_cache_hit` asks for (the token at the cut sees
    the w - 1 tokens before it)."""
    if not isinstance(spec, SlidingWindowSpec):
        return 0
    return -(-(int(spec.sliding_window) - 1) // block_size)


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
        groups = kv_cache_config.kv_cache_groups
        self.group_bytes = _group_bytes(kv_cache_config)
        self.block_bytes = sum(self.group_bytes)
        """The bytes of one block position, every group's layers: what a full hit loads."""
        self.windows = [_window_blocks(g.kv_cache_spec, self.block_size) for g in groups]
        """Per group, the blocks before a cut it loads: 0 for all (`_window_blocks`)."""
        # Several groups: each keeps its own chain, rooted in its kind, window and layers, so
        # no two groups share a key. One group keeps the request's root (today's keys).
        self._group_names = [] if len(groups) <= 1 else [
            (type(g.kv_cache_spec).__name__, int(getattr(g.kv_cache_spec, "sliding_window",
                                                          0) or 0),
             sorted(extract_layer_index(n) for n in g.layer_names)) for g in groups]
        # Full groups are looked up first: they fix the longest cut, which the sliding ones
        # can only shorten.
        self._order = sorted(range(len(self.windows)), key=lambda g: self.windows[g] != 0)
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
        events = vllm_config.kv_events_config
        self.events = (StoreEvents(kv_cache_config, self.block_size)
                       if events is not None and events.enable_kv_cache_events else None)
        """The blocks saved and loaded, and the daemon's changes to them, as vLLM KV events
        (`vllm_events`), when vLLM publishes KV events; None otherwise."""
        self._watch = StoreWatch(link, self.events) if self.events is not None else None
        self._recomputed_by_choice_tokens = 0

    def _state(self, request: Request) -> RequestState:
        """The request's state, created on vLLM's first ask about the request."""
        state = self._requests.get(request.request_id)
        if state is None:
            state = RequestState(request)
            with self._answered:
                self._requests[request.request_id] = state
        return state

    def _keys_of(self, state: RequestState, num_blocks: int, group: int = 0) -> list[BlockKey]:
        """The first num_blocks keys of the request's chain in a KV-cache group. The keys
        computed before are kept, so each call computes only the keys it adds."""
        while len(state.keys) < len(self.windows):
            state.keys.append([])
        keys = state.keys[group]
        tokens = state.request.all_token_ids
        bs = self.block_size
        if keys:
            parent = keys[-1]
        else:
            parent = chain_root(self.link.namespace, state.request)
            if self._group_names:
                parent = group_root(parent, *self._group_names[group])
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
        keys = [self._keys_of(state, max_blocks, g) for g in range(len(self.windows))]
        lead = self._order[0]
        start = self._start(lead, first, max_blocks)

        def done(hit: Hit) -> None:  # on a loader thread
            try:
                found = self._find(keys, first, max_blocks, hit)
            except Exception:  # a bug here must not strand the request waiting for its answer
                logger.exception("kvstore: the hit of %d blocks failed", max_blocks - first)
                found = Found(first, [])
            with self._answered:
                looked.hit = found
                self._fresh_answers += 1
                self._answered.notify_all()

        with self._answered:
            state.lookup = looked
        self.link.lookup_async(keys[lead][start:max_blocks], done, prefetch=True)

    def _start(self, group: int, first: int, cut: int) -> int:
        """The first block a group loads for a hit from first to cut: first for a full
        group, the window's first block before the cut for a sliding one."""
        window = self.windows[group]
        return first if window == 0 else max(first, cut - window)

    def _find(self, keys: list[list[BlockKey]], first: int, last: int, lead_hit: Hit) -> Found:
        """The longest hit from first up to last that every group can serve, as vLLM's hybrid
        prefix cache decides it: a full group needs every block before the cut, a sliding one
        only its window's blocks just before the cut. lead_hit: the Lookup of the first
        group in `_order`. Runs on a loader thread; the other groups' Lookups run here."""
        cut = last
        tiers: dict[tuple[int, int], str] = {}
        for group in self._order:
            if self.windows[group]:
                break  # the full groups come first in _order
            hit = lead_hit if group == self._order[0] else self.link.lookup(
                keys[group][first:cut], prefetch=True)
            tiers.update({(group, first + i): t for i, t in enumerate(hit.tiers)})
            cut = min(cut, first + hit.blocks)
        settled = not any(self.windows)
        while not settled and cut > first:
            # A missing block in a window moves the cut to it: any cut between it and the
            # old one has a window that holds it. Every group is asked again until none
            # moves the cut.
            settled = True
            for group in [g for g in self._order if self.windows[g]]:
                start = self._start(group, first, cut)
                if start >= cut:
                    continue
                if group == self._order[0] and cut == last:
                    hit = lead_hit
                else:
                    hit = self.link.lookup(keys[group][start:cut], prefetch=True)
                tiers.update({(group, start + i): t for i, t in enumerate(hit.tiers)})
                if hit.blocks < cut - start:
                    cut = start + hit.blocks
                    settled = False
                    break
        per_block = []
        for index in range(first, max(cut, first)):
            loading = [tiers.get((g, index), "") for g in range(len(self.windows))
                       if self._start(g, first, cut) <= index]
            per_block.append(slowest(loading) if loading else "pending")
        return Found(max(cut, first), per_block)

    def _decide(self, request: Request, looked_from: int, hit: Found, first: int) -> Match:
        """The answer to give from a hit that a Lookup from block looked_from found, for the
        blocks from first on."""
        tiers = hit.tiers[first - looked_from:] if first < hit.cut else []
        count = len(tiers)
        # The bytes a block really loads, on average: sliding groups load their window only.
        loaded = sum(nbytes * (hit.cut - self._start(g, first, hit.cut))
                     for g, nbytes in enumerate(self.group_bytes))
        choice = decide(tiers=tiers, block_bytes=max(1, loaded // max(1, count)),
                        block_size=self.block_size, first_block=first,
                        num_tokens=request.num_tokens, policy=self.policy,
                        prefill=self.prefill, rates=self.link.rates,
                        step_tokens=self.step_tokens)
        load = choice.load_blocks
        if 0 < load < count and any(self.windows):
            # A shorter cut needs other window blocks, which were not looked up: the hit
            # is taken whole or not at all.
            load = 0
        return Match(first, tiers[:load], choice)

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
            cut, tier = first + count, slowest(match.tiers[:count])
            for group, ids in enumerate(state.block_ids):
                start = self._start(group, first, cut)
                if start < cut:  # what vLLM allocated: it nulls a window's older blocks
                    self._loads.append(LoadSpec(
                        request.request_id, self._keys_of(state, cut, group)[start:],
                        _held(ids[start:cut]), tier, group=group))
                    self._announce(request, first, start, cut, group, match.tiers,
                                   self._keys_of(state, cut, group))
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
        step); should one not, that group's block stays unsaved. Each group's blocks go
        under its own keys."""
        request = state.request
        if not self.saves or not cacheable(request):
            return
        scheduled = scheduler_output.num_scheduled_tokens.get(request.request_id, 0)
        full = min(num_computed + scheduled, request.num_tokens) // self.block_size
        full = min(full, *(len(g) for g in block_ids))
        if full <= state.saved:
            return
        start = state.saved
        state.saved = full
        for group, ids in enumerate(block_ids):
            keys = self._keys_of(state, full, group)
            index = start
            while index < full:  # each run of held blocks, in one save
                if ids[index] == _NULL_BLOCK:
                    index += 1
                    continue
                end = next((i for i in range(index, full) if ids[i] == _NULL_BLOCK), full)
                meta.saves.append(SaveSpec(keys[index:end], ids[index:end],
                                           keys[index - 1] if index else None, group=group))
                if self.events is not None:  # a save lands in L2
                    self.events.stored(request, index, end, group, "dram", keys[index:end])
                index = end

    def _announce(self, request: Request, first: int, start: int, cut: int, group: int,
                  tiers: list[str], keys: list[BlockKey]) -> None:
        """Announce a group's loaded blocks start..cut-1 (vllm_events), one event per run
        of blocks found in one tier; tiers[i] is the tier of block first + i, keys[i] the
        key of block i."""
        if self.events is None:
            return
        while start < cut:
            tier = tiers[start - first]
            end = next((i for i in range(start, cut) if tiers[i - first] != tier), cut)
            self.events.stored(request, start, end, group, tier, keys[start:end])
            start = end

    def close(self) -> None:
        """Stop following the daemon's event stream (before the link closes)."""
        if self._watch is not None:
            self._watch.close()

    def take_events(self) -> list[KVCacheEvent]:
        """The KV events since vLLM last took them (none when vLLM publishes none)."""
        return self.events.take() if self.events is not None else []

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
