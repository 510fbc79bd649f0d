"""The worker half of vLLM's kvstore connector (`kvstore.integrations.vllm`), one per GPU (per
tensor-parallel rank). It owns:

- the paged KV tensors vLLM registers (`PagedKV`);
- loads: a load reads its blocks on one of the link's loader threads into a staging buffer and
  enqueues their copy into the cache, or reads them straight into the cache when a block's
  layers lie next to each other in one buffer (on the CPU). A load is reported finished only
  once its copy completed (`device_copies`: its event, asked without waiting). The blocks that
  did not arrive are reported with it, and vLLM recomputes them. A hybrid model's request
  has one load per KV-cache group, and is reported once all of them landed;
- saves: after the forward pass the blocks it filled are copied out on the copy stream (after
  that forward pass; the next one waits for the copy, so vLLM may reuse the blocks at once),
  and the link's writer thread puts them once the copy completed. An MLA model's latent cache
  is the same on every tensor-parallel rank and lives in one namespace for all of them
  (`settings.namespace_for`): rank 0 alone saves it, and every rank loads it;
- the timings the scheduler side's cost model learns from: each forward pass (on rank 0 only,
  since every rank runs the same steps) and each whole load, reported in its connector stats
  with the link's counters;
- a lossy codec (the `codec` option, `vllm_codec`, docs/codecs.md): each group's blocks are
  encoded on the cache's device after the gather of a save, and a load's blocks are checked
  (a block whose header or parameters are not the codec's is counted in `rejected_blocks`,
  logged and recomputed, with every block after it) and decoded there before the scatter.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from kvstore.integrations.device_copies import (
    DONE,
    DeviceCopies,
    Event,
    copies_for,
    host_tensors,
    rows_from,
)
from kvstore.integrations.link import Landed, StoreLink
from kvstore.integrations.paged import KV, LATENT, PagedKV
from kvstore.integrations.vllm_codec import RowCodec
from kvstore.integrations.vllm_steps import (
    IDLE_WAIT_S,
    WORKER_FIELDS,
    CounterDeltas,
    KVStoreMetadata,
    KVStoreStats,
    LoadSpec,
    SaveSpec,
    StepTimer,
    load_origin,
)

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("kvstore.integrations.vllm")


@dataclass(frozen=True)
class _Landing:
    """A load whose blocks were read and whose copy into the cache is enqueued: reported
    finished once `event` completed, with `failed` and, for blocks copied straight from their
    pages in L2, those `moved()` says then had moved meanwhile (`Landed.held`)."""

    req_id: str
    failed: list[int]
    event: Event
    moved: Callable[[], list[int]] | None = None

    def all_failed(self) -> list[int]:
        """The blocks to recompute, asked once event completed."""
        return self.failed if self.moved is None else [*self.moved(), *self.failed]


def _gather(paged: PagedKV, spec: SaveSpec, staging: torch.Tensor,
            codec: RowCodec | None) -> Callable[[], None]:
    """A save's copy: the blocks into staging; with a codec, gathered and encoded on the
    cache's device, so only the encoded bytes cross to the host."""

    def fill() -> None:
        if codec is None:
            paged.gather(spec.block_ids, out=staging)
            return
        raw = torch.empty((len(spec.block_ids), paged.block_bytes), dtype=torch.uint8,
                          device=paged.device)
        staging.copy_(codec.encode(paged.gather(spec.block_ids, out=raw)), non_blocking=True)

    return fill


def _place(paged: PagedKV, staging: torch.Tensor, ids: list[int],
           codec: RowCodec | None) -> Callable[[], None]:
    """A load's copy: staged rows into the cache's blocks ids; with a codec, decoded on the
    cache's device a few blocks at a time (on a CPU), each chunk scattered at once."""

    def place() -> None:
        if codec is None:
            paged.scatter(staging, ids)
            return
        encoded = staging[:len(ids)].to(paged.device, non_blocking=True)
        for start, rows in codec.decode_chunks(encoded):
            paged.scatter(rows, ids[start:start + rows.shape[0]])

    return place


def _place_from(paged: PagedKV, host: list[torch.Tensor], ids: list[int],
                row_bytes: int) -> Callable[[], None]:
    """A load's copy from where its blocks lie (staging rows, or their pages in L2 read in
    place): each copied to the cache's device by itself (a DMA from pinned pages), then
    scattered into the cache's blocks ids."""

    def place() -> None:
        paged.scatter(rows_from(host, row_bytes, paged.device), ids)

    return place


def _moved(landed: Landed, ids: list[int]) -> list[int]:
    """The blocks (of ids, the arrived ones) that moved while copied from their pages in L2,
    and every one after them: to recompute."""
    return [b for b in ids[landed.held():] if b >= 0]


class WorkerSide:
    """What one worker's connector does and keeps: its loads, saves and timings."""

    def __init__(self, link: StoreLink, rank: int, copies: DeviceCopies | None = None,
                 codec: str = "none") -> None:
        """copies: how copies reach the cache's device (default: `copies_for` the device of
        the caches registered; tests give a simulated device); codec: how blocks are stored
        (the `codec` option: `none` raw, `fp8` or `int4` encoded, `vllm_codec`)."""
        self.link = link
        self.codec_name = codec
        self.codecs: list[RowCodec | None] = []
        """Per KV-cache group, its codec (None: raw rows)."""
        self.rejected_blocks = 0
        """Loaded blocks the codec refused (not its header or parameters): recomputed."""
        self.paged: PagedKV | None = None
        """Every layer, in model order, with its group: what the cache holds (for a look)."""
        self.group_paged: list[PagedKV] = []
        """One `PagedKV` per KV-cache group, its layers in model order: what loads and saves
        copy, each group's blocks under its own keys."""
        self.copies = copies
        self.in_place = False
        """Whether loads copy the blocks the store's read table shows straight from their
        pages in L2 to the cache's device (`StoreLink.read_in_place`): on by `register` for
        a cache on a GPU, whose client pins its mappings of L2; staged otherwise."""
        self.origin = load_origin(link)
        """Names this worker's link in the loads it reports (`vllm_steps.load_origin`)."""
        self._rank = rank
        self._reported = CounterDeltas(WORKER_FIELDS)
        self._timer: StepTimer | None = None
        self._lock = threading.Lock()
        self._load_done = threading.Condition(self._lock)
        self._loads_in_flight = 0
        self._landing: list[_Landing] = []  # loads whose copy may still be in flight
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()  # requests, for several KV-cache groups
        # Per request, its group loads not landed yet, and whether one of them fell short:
        # a request is reported finished once all its groups' loads landed.
        self._open_loads: dict[str, int] = {}
        self._short_loads: set[str] = set()
        self.loaded_group_bytes: list[int] = []
        """Per KV-cache group, the bytes its loads brought in since registration."""
        self._reported_group_bytes: list[int] = []
        self._load_times: list[tuple[str, str, int, float]] = []

    def register(self, kv_caches: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig,
                 backends: dict[str, str] | None = None) -> None:
        """Learn the layout of vLLM's KV cache: one paged tensor per layer, K/V or MLA's
        latent vectors (`paged.LATENT`), in one KV-cache group or (a hybrid model) several.
        Each group gets its own `PagedKV` (`group_paged`): a stored block is one group's
        layers, in model order (by layer index), under that group's keys. One group keeps
        vLLM's order, so the blocks of a model stored before groups existed here still hit.
        `paged` holds every layer with its group, for a look at the whole cache. backends:
        each layer's attention backend name, which a codec needs to find K and V in a block
        (`vllm_codec`)."""
        groups = kv_cache_config.kv_cache_groups
        group_of = {n: i for i, g in enumerate(groups) for n in g.layer_names if n in kv_caches}
        names = list(group_of)
        if len(groups) > 1:
            names.sort(key=extract_layer_index)
        latent = bool(groups) and all(isinstance(g.kv_cache_spec, MLAAttentionSpec)
                                      for g in groups)
        layout = LATENT if latent else KV
        self.paged = PagedKV([(n, kv_caches[n]) for n in names], kv_cache_config.num_blocks,
                             layout, groups=[group_of[n] for n in names])
        self.group_paged = [self.paged] if len(groups) == 1 else [
            PagedKV([(n, kv_caches[n]) for n in names if group_of[n] == g],
                    kv_cache_config.num_blocks, layout) for g in range(len(groups))]
        self.loaded_group_bytes = [0] * len(self.group_paged)
        self._reported_group_bytes = [0] * len(self.group_paged)
        block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.codecs = [None if self.codec_name == "none" else RowCodec(
            self.codec_name, p, [(backends or {}).get(n) for n in p.names], block_size)
            for p in self.group_paged]
        if self.copies is None:
            self.copies = copies_for(self.paged.device)
        self.in_place = self.link.loads_in_place(self.paged.device.type)
        if self._rank == 0:  # every rank runs the same steps: one reports them
            self._timer = StepTimer(cuda=self.paged.device.type == "cuda")
        logger.info("kvstore: %d layers, %d-byte blocks (%s), %s%s", len(names),
                    self.paged.block_bytes, self.paged.signature(),
                    "loads straight into the cache" if self.paged.direct
                    and self.codecs == [None] else "staged loads",
                    "".join(f", codec {c.codec.name}: {c.encoded_bytes}-byte blocks"
                            for c in self.codecs[:1] if c is not None))

    def row_bytes(self, group: int) -> int:
        """The bytes of one stored block of a group: encoded when there is a codec."""
        codec = self.codecs[group]
        return codec.encoded_bytes if codec is not None else self.group_paged[group].block_bytes

    def _accepted(self, group: int, staging: torch.Tensor, arrived: int) -> int:
        """How many of the arrived rows lead up to the first the codec refuses (all of them
        without a codec); refused ones are counted and logged, and recomputed instead."""
        codec = self.codecs[group]
        if codec is None or not arrived:
            return arrived
        ok = codec.valid(staging[:arrived]).cpu()
        good = int(ok.int().argmin()) if not bool(ok.all()) else arrived
        if good < arrived:
            with self._lock:
                self.rejected_blocks += arrived - good
            logger.warning("kvstore: %d loaded blocks are not %s blocks of this layout; "
                           "recomputing them", arrived - good, codec.codec.name)
        return good

    def begin_step(self, meta: object) -> None:
        """The forward pass is about to run: its clock starts."""
        if self._timer is not None and isinstance(meta, KVStoreMetadata) and meta.chunks:
            self._timer.start(meta.chunks)

    def start_load(self, spec: LoadSpec) -> None:
        """Start one request's load on a loader thread; `finished` reports it once its copy
        into the cache completed, and `load_errors` the blocks that did not arrive."""
        copies = self.copies
        if not self.group_paged or copies is None:
            raise RuntimeError("KVStoreConnector: a load before register_kv_caches")
        paged = self.group_paged[spec.group]
        codec = self.codecs[spec.group]
        row_bytes = self.row_bytes(spec.group)
        # A sliding window's position it does not hold (-1) goes through staging: skipped.
        staging = (None if paged.direct and codec is None and min(spec.block_ids, default=0) >= 0
                   else copies.take(len(spec.keys), (row_bytes,), torch.uint8))
        rows = paged.direct_rows(spec.block_ids) if staging is None else paged.rows(staging)
        begun = time.perf_counter()

        def done(landed: Landed) -> None:
            # From the start of the load to its arrival, as the request waits for it.
            seconds = time.perf_counter() - begun
            event: Event = DONE
            arrived, moved = landed.arrived, None
            if staging is not None and arrived:
                arrived = self._accepted(spec.group, staging, arrived)
            unread = not arrived  # no copy will read the staging: free for the next load now
            try:
                if staging is not None and arrived and landed.in_place_blocks:
                    ids = spec.block_ids[:arrived]
                    host = host_tensors(landed.sources[:arrived])
                    event = copies.load(staging, _place_from(paged, host, ids, row_bytes),
                                        keep=host)
                    moved = partial(_moved, landed, ids)
                elif staging is not None and arrived:
                    ids = spec.block_ids[:arrived]
                    event = copies.load(staging, _place(paged, staging, ids, codec))
            except Exception:
                logger.exception("kvstore: scattering %d loaded blocks failed", arrived)
                arrived, moved = 0, None
            if staging is not None and unread:  # (a failed copy's staging is not pooled:
                # part of that copy may still be in flight)
                copies.give_back(staging, DONE)
            with self._lock:
                if spec.tier and arrived == len(spec.keys):
                    self._load_times.append((self.origin, spec.tier, arrived * row_bytes,
                                             seconds))
                failed = [b for b in spec.block_ids[arrived:] if b >= 0]
                self.loaded_group_bytes[spec.group] += arrived * row_bytes
                self._landing.append(_Landing(spec.req_id, failed, event, moved))
                self._loads_in_flight -= 1
                self._load_done.notify_all()

        with self._lock:
            self._loads_in_flight += 1
            self._open_loads[spec.req_id] = self._open_loads.get(spec.req_id, 0) + 1
        if self.in_place and staging is not None and codec is None:
            self.link.read_in_place_async(spec.keys, rows, done, tier=spec.tier)
        else:
            self.link.read_async(spec.keys, rows, lambda arrived: done(Landed(arrived, [])),
                                 tier=spec.tier)

    def save(self, meta: KVStoreMetadata | None) -> None:
        """After the forward pass (its clock stops): copy the blocks it filled out on the copy
        stream, after that forward pass, and put them from the writer thread once copied.
        A latent cache is saved by rank 0 only: every rank holds the same bytes under the same
        keys."""
        if self._timer is not None:
            self._timer.stop()
        copies = self.copies
        if meta is None or not self.group_paged or copies is None:
            return
        if self.group_paged[0].layout == LATENT and self._rank != 0:
            return
        for spec in meta.saves:
            paged = self.group_paged[spec.group]
            if not self.link.available:
                self.link.offload(spec.keys, [], spec.parent)  # counted as dropped
                continue
            staging = copies.staging(len(spec.block_ids), (self.row_bytes(spec.group),),
                                     torch.uint8)
            event = copies.save(_gather(paged, spec, staging, self.codecs[spec.group]),
                                staging)
            self.link.offload(spec.keys, paged.rows(staging), spec.parent,
                              ready=event.synchronize)

    def finished(self, meta: object) -> set[str]:
        """The requests whose loads landed (their copy into the cache completed) since the
        last call."""
        idle = isinstance(meta, KVStoreMetadata) and meta.idle
        with self._lock:
            if idle and self._loads_in_flight and not self._landing:
                # Nothing to compute until a load lands: wait for it here rather than let
                # vLLM's loop spin through empty steps, which starves the loader thread of
                # the GIL (measured: hits 2-5x slower). Bounded, so a request arriving now
                # is scheduled at most IDLE_WAIT_S late.
                self._load_done.wait(IDLE_WAIT_S)
            landing = list(self._landing)
        if idle and landing and not any(x.event.query() for x in landing):
            # Idle, and only copies in flight: wait for the oldest one's event (that copy
            # alone, never the whole device), off the lock so loader threads go on.
            landing[0].event.synchronize()
        landed = [x for x in landing if x.event.query()]
        done: set[str] = set()
        with self._lock:
            self._landing = [x for x in self._landing if x not in landed]
            for x in landed:
                failed = x.all_failed()
                if failed and len(self.group_paged) > 1:
                    # Block ids repeat across groups, so vLLM takes a hybrid model's load
                    # failures by request (it recomputes the whole request), never by block.
                    self._short_loads.add(x.req_id)
                else:
                    self._load_errors.update(failed)
                left = self._open_loads.get(x.req_id, 1) - 1
                if left > 0:  # another group's load of the request is still on its way
                    self._open_loads[x.req_id] = left
                    continue
                self._open_loads.pop(x.req_id, None)
                done.add(x.req_id)
                if x.req_id in self._short_loads:
                    self._short_loads.discard(x.req_id)
                    self._failed_loads.add(x.req_id)
        return done

    def failed_loads(self) -> set[str]:
        """The requests (of a model with several KV-cache groups) whose load did not wholly
        arrive since the last call: vLLM recomputes them. They are reported finished too."""
        with self._lock:
            failed, self._failed_loads = self._failed_loads, set()
        return failed

    def load_errors(self) -> set[int]:
        """The blocks that failed to load since the last call: vLLM recomputes them."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def stats(self) -> KVStoreStats | None:
        """The worker's connector stats for the interval since the last call: the link's
        counters that the worker reports, and its timings (`_timings`); None when all are
        empty."""
        data: dict[str, Any] = {**self._reported.take(self.link.stats.as_dict()),
                                **self._timings()}
        if len(self.loaded_group_bytes) > 1:  # a hybrid model: what each group's hits loaded
            with self._lock:
                now = list(self.loaded_group_bytes)
            for group, nbytes in enumerate(now):
                data[f"loaded_bytes_group{group}"] = nbytes - self._reported_group_bytes[group]
            self._reported_group_bytes = now
        return KVStoreStats(data=data) if any(data.values()) else None

    def _timings(self) -> dict[str, Any]:
        """The forward passes (`steps`: [chunks, seconds]) and whole loads (`loads`: [origin,
        tier, bytes, seconds]) timed since the last call. An entry with nothing in it is left
        out."""
        steps = self._timer.take() if self._timer is not None else []
        with self._lock:
            loads, self._load_times = self._load_times, []
        return {name: value for name, value in (("steps", steps), ("loads", loads)) if value}
