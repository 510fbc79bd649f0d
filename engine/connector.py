"""The engine's side of the store (docs/engine.md). Nothing here blocks the step loop on the
store: lookups and loads run on the link's loader threads and come back as events the engine
collects between steps (`poll`), so a request whose prefix the store holds waits for its blocks
while the rest of the batch keeps stepping; offloads of blocks as they fill go from a writer
thread; a preempted sequence's blocks are swapped out the same way; the L4 hot set can be
pre-warmed at start.

Each hit is loaded only when loading it is expected to be faster than computing it
(`decide`: the engine's own prefill rate against what loads from each tier cost here, see
kvstore.integrations.cost), unless the policy says always or never.

The store-facing half (lookups, loads, the offload queue, the fail-safe) is
`kvstore.integrations.link.StoreLink`, shared with the vLLM connector; this module adds the
tensors: staging buffers (pinned when the cache is on a GPU) and the kernels' gather and
scatter, run through `kvstore.integrations.device_copies` in its stated order: a load's copy
into the cache runs on a copy stream and is reported (`poll`) only once its event completed; an
offload's copy out of the cache waits for the forward pass that wrote the blocks, and the link's
writer reads the rows only once that copy completed. On the CPU every copy runs at once.

The store is an accelerator, never a dependency of correctness: any store error turns the link
off (logged once), the engine keeps serving by recomputing, and the link turns itself
back on once the daemon answers again. Blocks that fail to load are recomputed from the first
failure on.

One stored block = every layer's K and V of one engine block, contiguous
([layers, 2, block_size, kv_heads, head_dim], gather_blocks' staging row), under the block's
chained key in the engine's namespace. Keys come with the sequence (computed once per block).
With a lossy codec (EngineConfig.store_codec, kvstore.integrations.codecs, docs/codecs.md) the
stored block is that row encoded: encoded on the cache's device before the copy out, decoded
there after the copy in; a loaded block whose header or parameters are not the codec's is a
miss (recomputed from there on), never decoded. The codec is in the namespace (the engine adds
it), so encoded and raw blocks never meet.

Credentials for a daemon with auth on are the client's: token, tls and unix_socket given here
(EngineConfig.store_token, store_tls, store_unix_socket), else the variables KVStoreClient
reads (KVSTORE_TOKEN or KVSTORE_TOKEN_FILE, KVSTORE_TLS_CA_FILE / _CERT_FILE / _KEY_FILE /
_SERVER_NAME, KVSTORE_UNIX_SOCKET). A malformed token or an unreadable certificate file is
InvalidRequestError at start; credentials the daemon refuses (UNAUTHENTICATED,
PERMISSION_DENIED) are store errors like any other: the engine recomputes and logs why.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.client import TLS
from kvstore.client.errors import KVStoreError
from kvstore.engine.errors import InvalidRequestError
from kvstore.engine.scheduler import LoadPlan, LookupPlan
from kvstore.engine.sequence import StoreAnswer
from kvstore.integrations.codecs import BlockCodec, CodecError, codec_for
from kvstore.integrations.cost import POLICIES, PrefillModel, decide, slowest
from kvstore.integrations.device_copies import (
    DONE,
    DeviceCopies,
    Event,
    copies_for,
    device_ids,
    host_tensors,
    rows_from,
)
from kvstore.integrations.link import ConnectorStats, Hit, Landed, StoreLink
from kvstore.kernels import KernelOps
from kvstore.kernels.reference import staging_shape
from kvstore.keys import BlockKey

__all__ = ["ConnectorStats", "Looked", "Loaded", "StoreConnector"]

logger = logging.getLogger("kvstore.engine")


@dataclass(frozen=True)
class Looked:
    """A lookup came back: what the store holds of plan.keys."""

    plan: LookupPlan
    hit: Hit


@dataclass(frozen=True)
class Loaded:
    """A load came back: its first `arrived` blocks are in the KV cache."""

    plan: LoadPlan
    arrived: int


@dataclass(frozen=True)
class _Landing:
    """A load whose blocks were read and whose copy into the cache is enqueued: reported as
    `loaded` once `event` completed, with as many blocks as `held()` says then still were
    theirs when some were copied straight from their pages in L2 (`Landed.held`)."""

    loaded: Loaded
    event: Event
    held: Callable[[], int] | None = None

    def result(self) -> Loaded:
        """What landed, asked once event completed."""
        if self.held is None:
            return self.loaded
        held = self.held()
        if held >= self.loaded.arrived:
            return self.loaded
        logger.info("kvstore: %d of %d blocks read in place moved while copied; computing "
                    "them", self.loaded.arrived - held, self.loaded.arrived)
        return Loaded(self.loaded.plan, held)


def _byte_rows(staging: torch.Tensor) -> list[np.ndarray]:
    """One writable uint8 numpy view per staged block (bfloat16 has no numpy dtype)."""
    flat = staging.reshape(staging.shape[0], -1).view(torch.uint8)
    return [row.numpy() for row in flat]


class StoreConnector:
    def __init__(
        self,
        target: str,
        namespace: str,
        kv_cache: torch.Tensor,
        block_size: int,
        ops: KernelOps,
        *,
        timeout_s: float = 2.0,
        max_pending_batches: int = 64,
        reconnect_s: float = 1.0,
        token: str | None = None,
        tls: TLS | bool | None = None,
        unix_socket: str | None = None,
        load_policy: str = "auto",
        prefill: PrefillModel | None = None,
        step_tokens: int = 2048,
        copies: DeviceCopies | None = None,
        codec: str = "none",
    ) -> None:
        """load_policy: "auto" (load a hit when that is faster than computing it), "always",
        "never"; prefill: the engine's own step timings (it observes every forward pass);
        step_tokens: most tokens one step computes (the scheduler's budget); copies: how
        copies reach the cache's device (default: `copies_for` its device; tests give a
        simulated device); codec: how blocks are stored (`none`: the raw rows; `fp8`, `int4`:
        lossy, see docs/codecs.md); the namespace must already name it."""
        if load_policy not in POLICIES:
            raise InvalidRequestError(
                f"store_load_policy must be one of {POLICIES}, got {load_policy!r}")
        self.namespace = namespace
        self.block_size = block_size
        self.kv_cache = kv_cache
        self.ops = ops
        self.load_policy = load_policy
        self.prefill = prefill or PrefillModel()
        self.step_tokens = step_tokens
        self._row_shape = staging_shape(kv_cache, 1)[1:]
        self.codec: BlockCodec | None = None
        """The lossy codec blocks are stored with; None: raw rows."""
        if codec != "none":
            try:
                self.codec = codec_for(codec, tuple(self._row_shape), kv_cache.dtype)
            except CodecError as exc:
                raise InvalidRequestError(str(exc)) from None
        self.block_bytes = (self.codec.encoded_bytes if self.codec is not None else
                            int(np.prod(staging_shape(kv_cache, 1))) * kv_cache.element_size())
        """Bytes of one stored block: every layer's K and V of one engine block (all layers are
        one KV-cache group here, windowed or not), encoded when there is a codec."""
        self.rejected_blocks = 0
        """Loaded blocks the codec refused (not its header or parameters): recomputed."""
        self._rejected_lock = threading.Lock()  # loads are checked on the loader threads
        self.copies = copies or copies_for(kv_cache.device)
        self._events: queue.SimpleQueue[Looked | _Landing] = queue.SimpleQueue()
        self._landing: list[_Landing] = []  # loads whose copy may still be in flight
        try:
            self.link = StoreLink(target, namespace, block_size, timeout_s=timeout_s,
                                  reconnect_s=reconnect_s,
                                  max_pending_batches=max_pending_batches, token=token,
                                  tls=tls, unix_socket=unix_socket)
        except KVStoreError as exc:  # a malformed token, an unreadable certificate: config
            raise InvalidRequestError(f"store {target}: {exc}") from None
        self.in_place = self.link.loads_in_place(kv_cache.device.type)
        """Whether loads copy the blocks the store's read table shows straight from their
        pages in L2 into the cache (`StoreLink.read_in_place`): on a GPU; off on the CPU
        unless set."""

    @property
    def stats(self) -> ConnectorStats:
        return self.link.stats

    @property
    def available(self) -> bool:
        return self.link.available

    # -- admission: lookups and loads, in the background ---------------------------------
    def start_lookup(self, plan: LookupPlan) -> None:
        """Ask how many of plan.keys the store holds (and prefetch the hit's L3/L4 blocks to
        L2); the answer comes back as a Looked event."""
        self.link.lookup_async(plan.keys, lambda hit: self._events.put(Looked(plan, hit)))

    def decide(self, looked: Looked) -> StoreAnswer:
        """How much of a hit to load: the leading blocks whose load is expected to beat
        computing them (or all / none, by policy)."""
        plan, hit = looked.plan, looked.hit
        choice = decide(tiers=hit.tiers, block_bytes=self.block_bytes,
                        block_size=self.block_size, first_block=plan.first_block,
                        num_tokens=len(plan.seq), policy=self.load_policy,
                        prefill=self.prefill, rates=self.link.rates,
                        step_tokens=self.step_tokens)
        return StoreAnswer(plan.first_block, hit.blocks, choice.load_blocks, choice.reason,
                           slowest(hit.tiers[: choice.load_blocks]))

    def start_load(self, plan: LoadPlan, tier: str = "") -> None:
        """Read plan.keys into plan.block_ids of the KV cache: a loader thread reads them into
        staging and enqueues the copy into the cache; `poll` reports a Loaded event with the
        blocks that arrived once that copy completed. With `in_place` (and no codec) the
        blocks the store's read table shows are copied into the cache straight from their
        pages in L2, not through staging."""
        staging = self.copies.take(len(plan.keys), *self._stored_row())
        rows = _byte_rows(staging)

        def done(landed: Landed) -> None:
            self._place_landed(plan, staging, landed)

        if self.in_place and self.codec is None:
            self.link.read_in_place_async(plan.keys, rows, done, tier=tier)
        else:
            self.link.read_async(plan.keys, rows, lambda arrived: done(Landed(arrived, [])),
                                 tier=tier)

    def _place_landed(self, plan: LoadPlan, staging: torch.Tensor, landed: Landed) -> None:
        """On the loader thread: the blocks that arrived into the cache, on the copy stream
        (from staging, or from the sources landed names when some lay in place), and the
        Loaded event queued for once that copy completed."""
        event: Event = DONE
        try:
            arrived = self._decodable(staging, landed.arrived)
        except Exception:  # a codec bug must not strand the request: compute the blocks
            logger.exception("kvstore: checking %d loaded blocks failed", landed.arrived)
            arrived = 0
        unread = not arrived  # no copy will read the staging: free for the next load now
        held = None
        try:
            if arrived and landed.in_place_blocks:
                sources = host_tensors(landed.sources[:arrived])
                ids = plan.block_ids[:arrived]
                event = self.copies.load(staging, lambda: self._place_from(sources, ids),
                                         keep=sources)
                held = landed.held
            elif arrived:
                rows, ids = staging[:arrived], plan.block_ids[:arrived]
                event = self.copies.load(staging, lambda: self._place(rows, ids))
        except Exception:  # blocks that cannot be placed are blocks to compute
            logger.exception("kvstore: placing %d loaded blocks failed", arrived)
            arrived, held = 0, None
        if unread:  # (a failed copy's staging is not pooled: part of it may be in flight)
            self.copies.give_back(staging, DONE)
        self._events.put(_Landing(Loaded(plan, arrived), event, held))

    def _stored_row(self) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and dtype of one staged row as stored: the cache's block, or its
        encoding."""
        if self.codec is None:
            return tuple(self._row_shape), self.kv_cache.dtype
        return (self.codec.encoded_bytes,), torch.uint8

    def _decodable(self, staging: torch.Tensor, arrived: int) -> int:
        """How many of the arrived rows lead up to the first the codec refuses (all of them
        without a codec); refused ones are counted and logged, and computed instead."""
        if self.codec is None or not arrived:
            return arrived
        ok = self.codec.valid(staging[:arrived])
        good = int(ok.cumprod(0).sum())
        if good < arrived:
            with self._rejected_lock:
                self.rejected_blocks += arrived - good
            logger.warning("kvstore: %d loaded blocks are not %s blocks of this layout; "
                           "computing them", arrived - good, self.codec.name)
        return good

    def _place(self, rows: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Staged rows into the cache's blocks (on the copy stream): the host-to-device copy
        does not wait for the host (rows are pinned on a GPU), decoded there with a codec,
        then the kernels' scatter."""
        device = self.kv_cache.device
        rows = rows.to(device, non_blocking=True)
        if self.codec is None:
            self.ops.scatter_blocks(rows, self.kv_cache, device_ids(block_ids, device))
            return
        for start, decoded in self.codec.decode_chunks(rows):  # a few at a time on a CPU
            ids = block_ids[start:start + decoded.shape[0]]
            self.ops.scatter_blocks(decoded, self.kv_cache, device_ids(ids, device))

    def _place_from(self, sources: list[torch.Tensor], block_ids: Sequence[int]) -> None:
        """Blocks into the cache's blocks (on the copy stream) from where they lie: each
        copied to the device by itself (`rows_from`: from pinned pages a DMA, with no
        staging copy on the host), then the kernels' scatter."""
        device = self.kv_cache.device
        rows = rows_from(sources, self.block_bytes, device)
        typed = rows.view(self.kv_cache.dtype).reshape(len(sources), *self._row_shape)
        self.ops.scatter_blocks(typed, self.kv_cache, device_ids(block_ids, device))

    def poll(self, timeout_s: float = 0.0) -> list[Looked | Loaded]:
        """The lookups and loads that came back (a load once its copy into the cache has
        completed, asked without waiting); waits up to timeout_s for the first. A step loop
        that waits here is idle: when only loads whose copy is in flight are left, it waits
        for the oldest one's event (that copy alone, never the whole device)."""
        events: list[Looked | Loaded] = []
        self._drain(events, 0.0)
        if timeout_s > 0 and not events and not self._landed():
            if not self._landing:
                self._drain(events, timeout_s)
            if not events and self._landing and not self._landed():
                self._landing[0].event.synchronize()
        landed = [landing for landing in self._landing if landing.event.query()]
        if landed:
            self._landing = [landing for landing in self._landing if landing not in landed]
            events.extend(landing.result() for landing in landed)
        return events

    def _landed(self) -> bool:
        """Whether a load's copy into the cache has completed (asked, never waited for)."""
        return any(landing.event.query() for landing in self._landing)

    def _drain(self, events: list[Looked | Loaded], timeout_s: float) -> None:
        """Take what came back from the loader threads: lookups into events, loads into
        _landing; waits up to timeout_s for the first."""
        try:
            item: Looked | _Landing | None = (self._events.get(timeout=timeout_s)
                                              if timeout_s > 0 else self._events.get_nowait())
        except queue.Empty:
            return
        while item is not None:
            if isinstance(item, _Landing):
                self._landing.append(item)
            else:
                events.append(item)
            try:
                item = self._events.get_nowait()
            except queue.Empty:
                item = None

    # -- offload and swap-out -------------------------------------------------------------
    def offload(self, keys: Sequence[BlockKey], block_ids: Sequence[int],
                parent: BlockKey | None) -> bool:
        """Copy the blocks out of the KV cache (after the forward pass enqueued so far; the
        next one waits for the copy, so the cache may reuse the blocks at once) and put them
        in the background. False when they were dropped (store off, queue full)."""
        if not keys:
            return True
        if not self.link.available:
            return self.link.offload(keys, [], parent)  # counted as dropped
        staging = self._staging(len(keys))
        ids = list(block_ids)
        event = self.copies.save(lambda: self._fill(staging, ids), staging)
        return self.link.offload(keys, _byte_rows(staging), parent, ready=event.synchronize)

    def _staging(self, count: int) -> torch.Tensor:
        """A save's staging: the link's writer holds it until it has put the rows (pinned when
        the cache is on a GPU)."""
        return self.copies.staging(count, *self._stored_row())

    def _fill(self, staging: torch.Tensor, block_ids: list[int]) -> None:
        """The cache's blocks into staging (on the copy stream): gathered on the cache's
        device, then one copy to the host that does not wait for it (staging is pinned on a
        GPU); on the CPU, gathered straight into staging. With a codec, encoded first."""
        ids = device_ids(block_ids, self.kv_cache.device)
        if self.codec is not None:  # encoded on the cache's device: fewer bytes to copy out
            encoded = self.codec.encode(self.ops.gather_blocks(self.kv_cache, ids))
            staging.copy_(encoded, non_blocking=True)
        elif staging.device == self.kv_cache.device:
            self.ops.gather_blocks(self.kv_cache, ids, out=staging)
        else:
            staging.copy_(self.ops.gather_blocks(self.kv_cache, ids), non_blocking=True)

    def swap_out(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> bool:
        """A preempted sequence's full blocks, before its block ids are reused."""
        stored = self.offload(keys, block_ids, None)
        if stored:
            self.stats.swapped_out_blocks += len(keys)
        return stored

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every queued offload reached the store (or was dropped)."""
        self.link.flush(timeout_s)

    # -- pre-warm -------------------------------------------------------------------------
    def prewarm(self, num_bytes: int = 0) -> int:
        """Ask the daemon to pull this namespace's hottest L4 blocks into its local tiers, so
        the first requests hit. Returns the blocks brought in (0 when L4 is off)."""
        return self.link.prewarm(num_bytes)

    def close(self) -> None:
        self.link.close()
