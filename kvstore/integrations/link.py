"""`StoreLink`: the store-facing half every engine connector shares (this repository's engine,
`engine/connector.py`, and vLLM's, `integrations/vllm.py`), so the rules below are written once.

- Keys: kvstore's own chained keys (`kvstore.keys.chain_key`), which each connector computes
  once per block and passes in, so a hit never depends on an engine's hash settings or seeds.
- Lookup: how many of a chain's blocks the store holds (or an offload in flight here still
  holds), and a Prefetch up to L2 of the hit's blocks that lie lower (L3, L4), started in the
  background so they come up while the request waits for its load. `lookup_async` does the
  Lookup on a loader thread and calls back with the hit.
- Loads: `read` copies blocks into caller-owned rows (blocking), after any Prefetch of theirs
  started here has brought them up; `read_async` does it on a loader thread and calls back
  with how many leading blocks arrived whole. `read_in_place` (and `read_in_place_async`)
  leaves the blocks the daemon's read table shows where they lie in L2 and hands back views
  of their pages, for a connector that copies them to its device itself (from pinned memory:
  a DMA, no staging copy) and then asks whether they held (`Landed.held`).
- Costs: `rates` (kvstore.integrations.cost.TierRates) learns what a load from each tier costs
  here: every whole load, end to end, by the slowest tier it read from; the Lookup round trip;
  and, every few seconds while lookups come, the daemon's per-tier read figures (Stats). The
  connectors decide from it whether loading a hit beats computing it.
- Offload: `offload` takes rows the caller copied (or is copying) out of its KV cache (so the
  cache may reuse the blocks at once) and puts them from a writer thread; while queued they are
  readable by loads and lookups of this link. Rows filled by a device copy still in flight come
  with `ready`, which waits for that copy (`device_copies`): the writer, and loads that read
  queued rows, call it before they read, off the step loop.
- Sharing: `shared_link` gives one process one link per daemon, namespace and options, so a
  scheduler and a worker in one process share its channel and its fail-safe state.
- Fail-safe: the store is an accelerator, never a dependency of correctness. Any store error
  turns the link off (logged once), lookups answer 0 and loads nothing, offloads are dropped,
  and a background thread turns it back on once an authenticated call succeeds again.

Rows are writable uint8 numpy arrays of one block each; tensors stay with the connector, which
knows its cache's layout. One attempt per call: a slow or dead store costs one call at most
timeout_s, once; the reconnect thread does the retrying.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import numpy as np

from kvstore.client import TLS, InPlace, KVStoreClient
from kvstore.client.errors import KVStoreError
from kvstore.client.retry import Retry
from kvstore.integrations.cost import TierRates
from kvstore.keys import BlockKey, namespace_root

logger = logging.getLogger("kvstore.integrations")

R = TypeVar("R")

# Tiers a block must be brought up from before a load reads it at memory speed.
_BELOW_L2 = ("nvme", "remote")
STATS_EVERY_S = 5.0
"""How often, at most, lookups also read the daemon's per-tier figures (one Stats call)."""
LOADERS = 4
"""Loader threads: lookups, prefetches and loads of several requests at once."""


@dataclass
class ConnectorStats:
    """Counters since the link opened (an engine reports deltas of these)."""

    lookups: int = 0
    lookup_hit_blocks: int = 0
    prefetched_blocks: int = 0
    loaded_blocks: int = 0
    loaded_in_place_blocks: int = 0  #: of loaded_blocks: read where they lay in L2 (no copy)
    loaded_bytes: int = 0
    load_failures: int = 0
    offloaded_blocks: int = 0
    offloaded_bytes: int = 0
    offload_dropped_blocks: int = 0
    swapped_out_blocks: int = 0
    prewarmed_blocks: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Hit:
    """What a lookup found: `blocks` leading keys, and the tier of each ("pending" for an
    offload still queued here)."""

    blocks: int
    tiers: list[str]


_MISS = Hit(0, [])


@dataclass(frozen=True)
class Landed:
    """What `read_in_place` read: `arrived` leading blocks, each in `sources[i]`: its row
    (copied there), or a read-only view of its pages in L2 where it lay (the blocks
    first_in_place .. first_in_place + len(in_place.views) - 1, when in_place has views). The
    daemon may reuse those pages at any moment: `held()`, asked once the caller has copied
    the sources elsewhere, is how many of the arrived blocks still are theirs."""

    arrived: int
    sources: list[np.ndarray]
    in_place: InPlace | None = None
    first_in_place: int = 0

    @property
    def in_place_blocks(self) -> int:
        return 0 if self.in_place is None else len(self.in_place.views)

    def held(self) -> int:
        if self.in_place is None or not self.in_place.views:
            return self.arrived
        kept = self.in_place.held()
        return self.arrived if kept == len(self.in_place.views) else self.first_in_place + kept


def _filled() -> None:
    """The `ready` of rows that are already filled."""


@dataclass
class _Batch:
    keys: list[BlockKey]
    rows: list[np.ndarray]
    parent: BlockKey | None
    ready: Callable[[], object] = _filled


class StoreLink:
    def __init__(
        self,
        target: str,
        namespace: str,
        block_size: int,
        *,
        timeout_s: float = 2.0,
        reconnect_s: float = 1.0,
        max_pending_batches: int = 64,
        shared_memory: bool | None = None,
        token: str | None = None,
        tls: TLS | bool | None = None,
        unix_socket: str | None = None,
    ) -> None:
        """Raises KVStoreError when the client cannot be built (a malformed token, an
        unreadable certificate file): configuration the caller names to its user."""
        self.namespace = namespace
        self.block_size = block_size
        self.stats = ConnectorStats()
        self.client = KVStoreClient(target, namespace, timeout_s=timeout_s,
                                    retry=Retry(attempts=1), shared_memory=shared_memory,
                                    token=token, tls=tls, unix_socket=unix_socket)
        self._up = threading.Event()
        self._up.set()
        self._closing = threading.Event()
        self._reconnect_s = reconnect_s
        self._lock = threading.Lock()
        # Offloads in flight, readable by loads once their rows are ready.
        self._pending: dict[BlockKey, tuple[np.ndarray, Callable[[], object]]] = {}
        self._queue: queue.Queue[_Batch | None] = queue.Queue(maxsize=max_pending_batches)
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload", daemon=True)
        self._writer.start()
        self._loader = ThreadPoolExecutor(max_workers=LOADERS, thread_name_prefix="kv-load")
        self._watcher: threading.Thread | None = None
        self.rates = TierRates()
        self._raising: dict[BlockKey, threading.Event] = {}  # keys a Prefetch brings up now
        self._stats_due = 0.0

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    # -- availability ---------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return self._up.is_set()

    def _failed(self, what: str, exc: BaseException) -> None:
        self._count(errors=1)
        with self._lock:
            if not self._up.is_set():
                return
            self._up.clear()
            logger.warning("kvstore: %s failed (%s); recomputing until the store is back",
                           what, exc)
            if self._closing.is_set():
                return
            self._watcher = threading.Thread(target=self._reconnect, name="kv-reconnect",
                                             daemon=True)
            self._watcher.start()

    def _reconnect(self) -> None:
        # A Lookup, not the health check: it is authenticated and namespace-checked, so
        # credentials the daemon refuses keep the link off instead of flapping it.
        probe = [namespace_root(self.namespace)]
        while not self._closing.wait(self._reconnect_s):
            try:
                self.client.lookup(probe)
            except KVStoreError as exc:
                logger.debug("kvstore: still unreachable: %s", exc)
                continue
            logger.warning("kvstore: the store answers again; using it")
            self._up.set()
            return

    # -- lookup -------------------------------------------------------------------------
    def lookup(self, keys: Sequence[BlockKey], *, prefetch: bool = False) -> Hit:
        """How many leading keys the store (or an offload queued here) holds; none when the
        link is off or the Lookup fails. prefetch: bring the hit's L3/L4 blocks up to L2 in
        the background."""
        if not keys or not self.available:
            return _MISS
        self._count(lookups=1)
        with self._lock:
            pending = 0
            while pending < len(keys) and keys[pending] in self._pending:
                pending += 1
        start = time.perf_counter()
        try:
            result = self.client.lookup(keys, block_tokens=self.block_size)
        except KVStoreError as exc:
            self._failed("Lookup", exc)
            return _MISS
        self.rates.observe_rtt(time.perf_counter() - start)
        found = int(result.prefix_length)
        if prefetch and found > pending:
            below = [key for key, tier in zip(keys[:found], result.tiers, strict=False)
                     if tier in _BELOW_L2]
            if below:
                raised = threading.Event()
                with self._lock:
                    for key in below:
                        self._raising[key] = raised
                self._loader.submit(self._prefetch, below, raised)
        with self._lock:  # lookups run on several loader threads: one poll per period
            now = time.monotonic()
            poll = now >= self._stats_due
            if poll:
                self._stats_due = now + STATS_EVERY_S
        if poll:
            self._loader.submit(self._read_stats)
        hit = max(found, pending)
        self._count(lookup_hit_blocks=hit)
        tiers = ["pending"] * pending + [t or "" for t in result.tiers[pending:hit]]
        return Hit(hit, tiers)

    def lookup_async(self, keys: Sequence[BlockKey], done: Callable[[Hit], None], *,
                     prefetch: bool = True) -> Future[None]:
        """lookup() on a loader thread, then done(hit) there; done is called exactly once
        (with a miss if the lookup itself raised)."""

        def run() -> None:
            hit = _MISS
            try:
                hit = self.lookup(keys, prefetch=prefetch)
            except Exception:  # a bug here must not strand the request waiting for its answer
                logger.exception("kvstore: lookup of %d blocks failed", len(keys))
            done(hit)

        return self._loader.submit(run)

    def _prefetch(self, keys: list[BlockKey], raised: threading.Event) -> None:
        try:
            result = self.client.prefetch(keys, tier="dram")
            self._count(prefetched_blocks=int(result.done))
        except KVStoreError as exc:
            logger.debug("kvstore: prefetch of %d blocks failed: %s", len(keys), exc)
        finally:
            with self._lock:
                for key in keys:
                    if self._raising.get(key) is raised:
                        del self._raising[key]
            raised.set()

    def _read_stats(self) -> None:
        try:
            stats = self.client.stats()
        except KVStoreError as exc:
            logger.debug("kvstore: no per-tier figures (%s)", exc)
            return
        self.rates.observe_stats({t.tier: (int(t.bytes_out), float(t.read_seconds))
                                  for t in stats.tiers if t.enabled})

    # -- loads ----------------------------------------------------------------------------
    def read(self, keys: Sequence[BlockKey], rows: Sequence[np.ndarray], *,
             tier: str = "") -> int:
        """Copy keys' blocks into rows (one block each, its exact size); returns how many
        leading rows arrived whole. The rest must be recomputed by the caller. Waits (at most
        the call timeout) for a Prefetch of these keys started here to bring them up first.
        tier: the slowest tier they were found in; a whole load teaches `rates` its cost."""
        return self._read(keys, rows, tier, in_place=False).arrived

    def loads_in_place(self, device_type: str) -> bool:
        """Whether a connector whose cache is on device_type reads loads in place
        (`read_in_place`): on a GPU, where the copy to the device from pinned pages is a DMA
        with no staging copy on the host; the client then pins its mappings of L2 (each as it
        attaches). On the CPU a copy from the pages costs what staging does."""
        if device_type != "cuda":
            return False
        self.client.pin_shared_memory()
        return True

    def read_in_place(self, keys: Sequence[BlockKey], rows: Sequence[np.ndarray], *,
                      tier: str = "") -> Landed:
        """As read, but the blocks the store's read table shows in L2 are not copied: their
        sources are views of their pages (`KVStoreClient.get_in_place`) for the caller to copy
        from itself (to a device, from pinned memory), then ask `held()`. Offloads still
        queued here, and blocks the table does not show, are copied into rows as by read."""
        return self._read(keys, rows, tier, in_place=True)

    def _read(self, keys: Sequence[BlockKey], rows: Sequence[np.ndarray], tier: str,
              in_place: bool) -> Landed:
        if not keys:
            return Landed(0, [])
        start = time.perf_counter()
        self._await_prefetch(keys)
        arrived = self._from_pending(keys, rows)
        sources = list(rows[:arrived])
        got, first = None, arrived
        if in_place and arrived < len(keys) and self.available:
            try:
                got = self.client.get_in_place(keys[arrived:])
            except KVStoreError as exc:
                self._failed("Get", exc)
            for view, row in zip(got.views if got is not None else [], rows[arrived:],
                                 strict=False):
                if view.nbytes != row.nbytes:
                    break
                sources.append(view)
                arrived += 1
            if got is not None and arrived - first < len(got.views):
                got.views[arrived - first:] = []  # of another size: read again, into rows
        if arrived < len(keys) and self.available:
            try:
                sizes = self.client.get_into(keys[arrived:], rows[arrived:])
            except KVStoreError as exc:
                self._failed("Get", exc)
                sizes = []
            for row, size in zip(rows[arrived:], sizes, strict=False):
                if size != row.nbytes:
                    break
                sources.append(row)
                arrived += 1
        loaded = sum(r.nbytes for r in rows[:arrived])
        landed = Landed(arrived, sources, got, first)
        self._count(loaded_blocks=arrived, loaded_bytes=loaded,
                    loaded_in_place_blocks=landed.in_place_blocks,
                    load_failures=int(arrived < len(keys)))
        if tier and arrived == len(keys):
            self.rates.observe_load(tier, loaded, time.perf_counter() - start)
        return landed

    def _await_prefetch(self, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            events = {id(e): e for e in (self._raising.get(k) for k in keys) if e is not None}
        deadline = time.monotonic() + self.client.timeout_s
        for event in events.values():
            event.wait(max(0.0, deadline - time.monotonic()))

    def read_async(self, keys: Sequence[BlockKey], rows: Sequence[np.ndarray],
                   done: Callable[[int], None], *, tier: str = "") -> Future[None]:
        """read() on a loader thread, then done(arrived) there. done is called exactly once,
        with 0 if the read itself raised."""
        return self._on_loader(keys, lambda: self.read(keys, rows, tier=tier), done, 0)

    def read_in_place_async(self, keys: Sequence[BlockKey], rows: Sequence[np.ndarray],
                            done: Callable[[Landed], None], *,
                            tier: str = "") -> Future[None]:
        """read_in_place() on a loader thread, then done(landed) there, exactly once
        (nothing landed if the read itself raised)."""
        return self._on_loader(keys, lambda: self.read_in_place(keys, rows, tier=tier), done,
                               Landed(0, []))

    def _on_loader(self, keys: Sequence[BlockKey], read: Callable[[], R],
                   done: Callable[[R], None], nothing: R) -> Future[None]:
        def run() -> None:
            result = nothing
            try:
                result = read()
            except Exception:  # a bug here must not strand the request waiting for its load
                logger.exception("kvstore: load of %d blocks failed", len(keys))
            done(result)

        return self._loader.submit(run)

    def _from_pending(self, keys: Sequence[BlockKey], rows: Sequence[np.ndarray]) -> int:
        """Copy the leading keys still queued for offload into rows; how many. Each queued
        row is read only after its copy out of the device completed (its `ready`), waited for
        outside the lock, so the step loop's offloads never wait on a device copy."""
        with self._lock:
            found: list[tuple[np.ndarray, Callable[[], object]]] = []
            for key, row in zip(keys, rows, strict=True):
                queued = self._pending.get(key)
                if queued is None or queued[0].nbytes != row.nbytes:
                    break
                found.append(queued)
        for ready in {id(ready): ready for _, ready in found}.values():
            ready()
        for (data, _), row in zip(found, rows, strict=False):
            row[:] = data
        return len(found)

    # -- offload --------------------------------------------------------------------------
    def offload(self, keys: Sequence[BlockKey], rows: Sequence[np.ndarray],
                parent: BlockKey | None, ready: Callable[[], object] = _filled) -> bool:
        """Put rows (copies the caller owns no more) under keys in the background; parent is
        the key before keys[0] in its chain; ready: waits until the rows are filled (a device
        copy into them may still be in flight), called before anything here reads them. False
        when they were dropped (link off, queue full): a dropped offload is a future miss,
        never an error."""
        if not keys:
            return True
        if not self.available:
            self._count(offload_dropped_blocks=len(keys))
            return False
        batch = _Batch(list(keys), list(rows), parent, ready)
        with self._lock:
            for key, row in zip(keys, rows, strict=True):
                self._pending[key] = (row, ready)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self._forget_pending(batch.keys)
            self._count(offload_dropped_blocks=len(keys))
            return False
        return True

    def _forget_pending(self, keys: list[BlockKey]) -> None:
        """Loads and lookups of this link stop finding these keys among the offloads in
        flight: their put has reached the store, or they were dropped."""
        with self._lock:
            for key in keys:
                self._pending.pop(key, None)

    def _write_loop(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:  # close(): counted done, so a later flush finds nothing queued
                self._queue.task_done()
                return
            keys = batch.keys
            try:
                if self.available:
                    batch.ready()  # the device copy into the rows has completed
                    self.client.put(keys, batch.rows, parent=batch.parent)
                    self._count(offloaded_blocks=len(keys),
                                offloaded_bytes=sum(r.nbytes for r in batch.rows))
                else:
                    self._count(offload_dropped_blocks=len(keys))
            except KVStoreError as exc:
                self._count(offload_dropped_blocks=len(keys))
                self._failed("Put", exc)
            except Exception:  # a failed device copy: these blocks are dropped, the writer lives
                logger.exception("kvstore: offload of %d blocks failed", len(keys))
                self._count(offload_dropped_blocks=len(keys))
            finally:
                self._forget_pending(keys)
                self._queue.task_done()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued offload reached the store (or was dropped); False when
        timeout_s passed first."""
        done = threading.Event()

        def wait() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        return done.wait(timeout_s)

    # -- pre-warm -------------------------------------------------------------------------
    def prewarm(self, num_bytes: int = 0) -> int:
        """Ask the daemon to pull this namespace's hottest L4 blocks into its local tiers, so
        the first requests hit. Returns the blocks brought in (0 when L4 is off)."""
        try:
            result = self.client.prewarm(num_bytes, [self.namespace], timeout_s=60.0)
        except KVStoreError as exc:
            logger.info("kvstore: no pre-warm (%s)", exc)
            return 0
        self._count(prewarmed_blocks=int(result.blocks))
        return int(result.blocks)

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued offloads (up to timeout_s), stop the threads, disconnect. A second
        call does nothing."""
        if self._closing.is_set():
            return
        self._closing.set()
        self.flush(timeout_s=timeout_s)
        self._queue.put(None)
        self._writer.join(timeout=timeout_s)
        self._loader.shutdown(wait=True, cancel_futures=False)
        self.client.close()


# Links shared within a process, by everything they were opened with, and how many hold each.
_shared: dict[tuple[Any, ...], tuple[StoreLink, int]] = {}
_shared_lock = threading.Lock()


def shared_link(target: str, namespace: str, block_size: int, **options: Any) -> StoreLink:
    """The process's one StoreLink for these arguments (options: StoreLink's keywords, all
    hashable), opened on first use; each holder gives it back with release_link."""
    key = (target, namespace, block_size, tuple(sorted(options.items())))
    with _shared_lock:
        link, holders = _shared.get(key, (None, 0))
        if link is None:
            link = StoreLink(target, namespace, block_size, **options)
        _shared[key] = (link, holders + 1)
        return link


def release_link(link: StoreLink) -> None:
    """One holder of a shared_link is done with it; the last one closes it."""
    with _shared_lock:
        for key, (held, holders) in list(_shared.items()):
            if held is link:
                if holders > 1:
                    _shared[key] = (held, holders - 1)
                    return
                del _shared[key]
    link.close()
