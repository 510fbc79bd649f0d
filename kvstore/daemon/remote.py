"""L4: the Redis pool every daemon shares — write-through, reads, popularity and pre-warming,
all behind a circuit breaker so that a Redis outage never stops the local tiers.

Write-through: a committed block is offered to a queue bounded in bytes (`remote.queue_bytes`)
and a put never waits: past the bound the block is skipped and counted. A writer thread takes
batches, asks Redis which blocks it already has (one pipelined EXISTS), and for the rest frames
the bytes in their L2 pages (kvstore.daemon.blockframe: checksummed, lz4 when it pays) and SETs
them with the TTL in one pipeline. A raw frame goes to the socket as its header and a view of
the pages, never joined into a copy, so the entries are held busy (their pages stay put, an
evict skips them) until the SETs return or fail.
Under remote.compress=auto a namespace whose block stayed raw has its next AUTO_SKIP_BLOCKS
blocks written raw without trying lz4 on a sample (the sample cost a quarter of the writer's
time at 256 KiB blocks).

Reads: the store asks `exists` (Lookup) and `fetch` (Get, Prefetch, pre-warm) for keys no local
tier has; fetched blocks are verified (a bad frame is a miss, deleted from Redis) and the store
imports them into L2; pre-warm fetches in runs of about RUN_BYTES, the next run on a helper
thread while the store imports this one. Popularity: reads are counted per namespace and sent
in batches every `remote.popularity_flush_s`, with exponential decay
(`remote.popularity_half_life_s`), so `hot()` ranks what is in use now and a new replica
pre-warms from it.

Figures: the L4 row's objects, used and capacity bytes are the whole pool's (every daemon's
blocks; Redis's used_memory and maxmemory), counted by a census thread (`RedisPool.census`) when
Stats asks and the last count is older than CENSUS_MIN_S, and every CENSUS_EVERY_S anyway. The
operator verbs about L4 itself (hot, pre-warm) answer UNAVAILABLE while Redis is down; the data
path never waits on it.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import TypeVar

from kvstore.core.errors import Reason, Unavailable
from kvstore.core.index import Index
from kvstore.core.records import Entry, PrewarmState
from kvstore.daemon.blockframe import (
    CODEC_RAW,
    FrameError,
    Verified,
    decode_verified,
    encode_parts,
    header_codec,
)
from kvstore.daemon.breaker import Breaker
from kvstore.daemon.config import RemoteConfig
from kvstore.daemon.iometer import IoMeter
from kvstore.keys import BlockKey
from kvstore.tier import Tier, TierStats
from kvstore.tiers.dram import DramTier
from kvstore.tiers.redis_pool import HOT_MAX_MEMBERS, RedisPool, RemoteUnavailable, Value

log = logging.getLogger(__name__)
T = TypeVar("T")

BATCH_BLOCKS = 64  # blocks per write-through or fetch round trip
BATCH_BYTES = 32 << 20
IMPORT_BYTES = 8 << 20  # most bytes pre-warm stores in one internal put
# Pre-warm fetches about this many bytes a round trip while the run before is copied into L2
# (Remote._runs). Pre-warming 32 MiB into a new daemon, 1 MiB runs were the fastest or tied
# with 256 KiB blocks and with 2 MiB ones; 4 and 16 MiB runs and one round trip for all were
# slower at both (docs/operations.md). A Get's fetch stays one round trip: its L2 pages are
# warm, and there the extra round trips cost more than the overlap saved.
RUN_BYTES = 1 << 20
# remote.compress=auto: after a namespace's block stayed raw (lz4 did not save 20% of its
# sample), that many of the namespace's next blocks are written raw untried. A sample costs
# about 0.1 ms (lz4 over a shuffle runs at ~0.5 GB/s), near a third of the time a 256 KiB
# block's SET takes; one model's K/V blocks compress alike, so one try in 16 costs a block
# that would compress at most 15 raw ones. 7 to 31 did alike in bench/l4_bench.py.
AUTO_SKIP_BLOCKS = 15
CENSUS_MIN_S = 5.0  # a Stats (or scrape) asks for a census at most this often
CENSUS_EVERY_S = 60.0  # and one runs this often when nobody asks


class Remote:
    """The daemon's side of L4 (see the module docstring)."""

    def __init__(self, config: RemoteConfig, pool: RedisPool, lock: threading.RLock,
                 index: Index, dram: DramTier, stats: TierStats) -> None:
        self.config = config
        self.pool = pool
        self._store_lock = lock
        self._index = index
        self._dram = dram
        self.stats = stats
        self._stats_lock = threading.Lock()
        self._meter = IoMeter()  # L4's busy seconds: reads and writes may overlap
        self.breaker = Breaker(config.breaker_backoff_s)
        self._cv = threading.Condition()  # guards the queue and the popularity counts
        self._queue: deque[tuple[str, BlockKey, int]] = deque()
        self._queued_bytes = 0
        self._writing = 0  # blocks of the batch being written now
        self._popularity: dict[str, Counter[bytes]] = {}
        self._auto_skips: dict[str, int] = {}  # the writer's: raw blocks left to store untried
        self.queue_dropped = 0  # blocks not written through: the queue was full
        self._stop = threading.Event()
        self._census_wanted = threading.Event()
        self._threads = [
            threading.Thread(target=self._supervise, args=(loop,), name=name, daemon=True)
            for loop, name in ((self._write_forever, "l4-writer"),
                               (self._flush_forever, "l4-popularity"),
                               (self._census_forever, "l4-census"))
        ]
        self.on_failure: Callable[[str], None] = lambda reason: None
        # Told of each batch written to Redis: (namespace, key) pairs (the block events).
        self.on_written: Callable[[list[tuple[str, bytes]]], None] = lambda written: None

    def start(self, on_failure: Callable[[str], None]) -> None:
        """Start the workers (write-through, popularity, census); a worker that fails calls
        on_failure with the reason."""
        self.on_failure = on_failure
        self._guard(self.pool.ping, None)
        for t in self._threads:
            t.start()

    def close(self, drain_s: float = 5.0) -> None:
        """Stop the workers; blocks still queued get up to drain_s to reach Redis first."""
        with self._cv:
            self._cv.wait_for(lambda: not self._queue or self.breaker.state != "closed",
                              drain_s)
            if self._queue:
                log.warning("L4: %d queued blocks not written at shutdown", len(self._queue))
        self._stop.set()
        self._census_wanted.set()
        with self._cv:
            self._cv.notify_all()
        for t in self._threads:
            if t.is_alive():
                t.join()

    @property
    def state(self) -> str:
        """The circuit breaker's state: "closed" while Redis answers, "open" while calls
        skip it, "half-open" while one call tries it again."""
        return self.breaker.state

    def _count(self, **deltas: int) -> None:
        """Add to L4's counters: RPC threads and the workers update them at once."""
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    # --- the breaker -------------------------------------------------------------------------

    def _required(self, call: Callable[[], T], what: str) -> T:
        """call(), for a verb that is about L4 itself: Unavailable (naming what could not be
        done and why) when the breaker is open or Redis fails now."""
        if not self.breaker.allow():
            raise Unavailable(f"{what}: L4 is down ({self.breaker.last_error}); the breaker "
                              f"tries Redis again in {self.breaker.retry_in_s:.1f}s",
                              Reason.REMOTE_DOWN, setting="remote.url")
        failed = object()
        result = self._guard(call, failed)
        if result is failed:
            raise Unavailable(f"{what}: L4 is down ({self.breaker.last_error})",
                              Reason.REMOTE_DOWN, setting="remote.url")
        return result  # type: ignore[return-value]

    def _guard(self, call: Callable[[], T], fallback: T) -> T:
        """call() unless the breaker is open; a Redis failure opens it and gives fallback."""
        if not self.breaker.allow():
            return fallback
        try:
            result = call()
        except RemoteUnavailable as exc:
            was = self.breaker.state
            self.breaker.failure(str(exc))
            self._count(io_errors=1)
            if was == "closed":
                log.warning("L4 unavailable, local tiers keep serving: %s", exc)
            return fallback
        if self.breaker.state != "closed":
            log.info("L4 is back")
        self.breaker.success()
        return result

    # --- write-through -------------------------------------------------------------------------

    def offer(self, namespace: str, blocks: Sequence[tuple[BlockKey, int]]) -> None:
        """Queue committed blocks for L4; never waits. Past remote.queue_bytes a block is
        skipped and counted in admissions_refused."""
        with self._cv:
            for key, size in blocks:
                if self._queued_bytes + size > self.config.queue_bytes:
                    self._count(admissions_refused=1)
                    self.queue_dropped += 1
                    continue
                self._queue.append((namespace, key, size))
                self._queued_bytes += size
            self.stats.queue_depth = len(self._queue) + self._writing
            self._cv.notify_all()

    def _write_forever(self) -> None:
        while not self._stop.is_set():
            with self._cv:
                while not self._queue and not self._stop.is_set():
                    self._cv.wait()
                batch = self._take_batch()
            written = not batch or self._write(batch)
            with self._cv:
                self._writing = 0
                if not written:  # Redis is down: keep the batch, wait for the breaker
                    self._queue.extendleft(reversed(batch))
                    self._queued_bytes += sum(size for _, _, size in batch)
                self.stats.queue_depth = len(self._queue)
            if not written:
                self._stop.wait(max(0.05, self.breaker.retry_in_s))

    def _take_batch(self) -> list[tuple[str, BlockKey, int]]:
        batch: list[tuple[str, BlockKey, int]] = []
        size_sum = 0
        while self._queue and len(batch) < BATCH_BLOCKS and size_sum < BATCH_BYTES:
            item = self._queue.popleft()
            batch.append(item)
            size_sum += item[2]
        self._queued_bytes -= size_sum
        self._writing = len(batch)  # still queued, for queue_depth, until its SETs return
        self.stats.queue_depth = len(self._queue) + self._writing
        self._cv.notify_all()  # close() waits for the queue to empty
        return batch

    def _write(self, batch: list[tuple[str, BlockKey, int]]) -> bool:
        """Write the blocks Redis lacks; False when Redis is unavailable. Their entries stay
        held until the SETs return: a raw frame is sent straight from the entry's L2 pages."""
        present = self._guard(lambda: self.pool.exists([(ns, k) for ns, k, _ in batch]), None)
        if present is None:
            return False
        held = self._hold([(ns, k) for (ns, k, _), there in zip(batch, present, strict=True)
                           if not there])
        try:
            frames = [(e.namespace, bytes(e.key), self._frame(e)) for e in held]
            if frames and not self._guard(partial(self._set, frames), False):
                return False
        finally:
            with self._store_lock:
                for e in held:
                    self._index.moves.done(e)
        if not frames:
            return True
        self._count(bytes_in=sum(e.size_bytes for e in held))
        with self._store_lock:  # the event rings' one writer at a time
            self.on_written([(namespace, key) for namespace, key, _ in frames])
        return True

    def _frame(self, entry: Entry) -> Value:
        """The entry's frame as (header, body): a raw body is a view of the entry's L2 pages,
        sent from there (the entry is held until its SET returns). Under remote.compress=auto
        raw untried while the namespace's last sampled block stayed raw fewer than
        AUTO_SKIP_BLOCKS blocks ago."""
        compress = self.config.compress
        if compress == "auto":
            skips = self._auto_skips.get(entry.namespace, 0)
            if skips > 0:
                self._auto_skips[entry.namespace] = skips - 1
                compress = "none"
        frame = encode_parts(self._bytes_of(entry), compress, self.config.shuffle,
                             entry.checksum)
        if compress == "auto":
            raw = header_codec(frame[0]) == CODEC_RAW
            self._auto_skips[entry.namespace] = AUTO_SKIP_BLOCKS if raw else 0
        return frame

    def _set(self, frames: list[tuple[str, bytes, Value]]) -> bool:
        self._meter.timed(self.stats, "write",
                          lambda: self.pool.set(frames, self.config.ttl_s))
        return True

    def _hold(self, keys: list[tuple[str, BlockKey]]) -> list[Entry]:
        """The entries still in L2, held busy so their pages stay put while being read."""
        held: list[Entry] = []
        with self._store_lock:
            for namespace, key in keys:
                entry = self._index.get(namespace, key)
                if entry is None or Tier.DRAM not in entry.copies:
                    self._count(admissions_refused=1)  # left L2 before it could be written
                    continue
                self._index.moves.hold(entry)
                held.append(entry)
        return held

    def _bytes_of(self, entry: Entry) -> bytes | memoryview:
        """The block's bytes in L2: a view when its pages are one run (the usual case)."""
        views = self._dram.buffers(entry.copies[Tier.DRAM], entry.size_bytes, pad=False)
        return views[0] if len(views) == 1 else b"".join(views)

    # --- reads ---------------------------------------------------------------------------------

    def exists(self, namespace: str, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether L4 holds each key; all False while Redis is down."""
        if not keys:
            return []
        return self._guard(lambda: self.pool.exists([(namespace, k) for k in keys]),
                           [False] * len(keys))

    def fetch(self, namespace: str, keys: Sequence[BlockKey]) -> list[Verified | None]:
        """Each key's payload from L4, verified; None for a miss (or a damaged frame, which
        is deleted from Redis and counted). A payload stored raw is a view into the frame
        Redis sent (blockframe.decode_verified): the importer copies it into L2 once, and
        keeps the checksum its frame was checked against."""
        out: list[Verified | None] = []
        for start in range(0, len(keys), BATCH_BLOCKS):
            chunk = [(namespace, bytes(k)) for k in keys[start : start + BATCH_BLOCKS]]
            missed: list[bytes | memoryview | None] = [None] * len(chunk)
            frames = self._guard(
                partial(self._meter.timed, self.stats, "read", partial(self.pool.get, chunk)),
                missed)
            out.extend(self._decoded(namespace, [k for _, k in chunk], frames))
        return out

    def _decoded(self, namespace: str, keys: list[bytes],
                 frames: list[bytes | memoryview | None]) -> list[Verified | None]:
        out: list[Verified | None] = []
        damaged: list[tuple[str, bytes]] = []
        for key, frame in zip(keys, frames, strict=True):
            if frame is None:
                self._count(misses=1)
                out.append(None)
                continue
            try:
                payload = decode_verified(frame)
            except FrameError as exc:
                log.warning("L4 block %s is damaged (%s); deleted, a miss", key.hex()[:16], exc)
                self._count(checksum_failures=1)
                damaged.append((namespace, key))
                out.append(None)
                continue
            self._count(hits=1, bytes_out=len(payload))
            out.append(payload)
        if damaged:
            self._guard(lambda: self.pool.delete(damaged), 0)
        return out

    # --- popularity ----------------------------------------------------------------------------

    def touch(self, namespace: str, keys: Sequence[BlockKey]) -> None:
        """Count reads of keys towards their popularity (sent in batches)."""
        if not keys:
            return
        with self._cv:
            self._popularity.setdefault(namespace, Counter()).update(bytes(k) for k in keys)

    def _flush_forever(self) -> None:
        every = self.config.popularity_flush_s
        factor = 0.5 ** (every / self.config.popularity_half_life_s)
        while not self._stop.wait(every):
            self.flush_popularity(factor, every)

    def flush_popularity(self, decay_factor: float, every_s: float) -> None:
        """Send the counted reads, then decay every namespace's scores (idle ones too, or
        their stale scores would outrank what is read now when pre-warm ranks across
        namespaces); one daemon per period applies the decay (RedisPool.decay)."""
        with self._cv:
            counts, self._popularity = self._popularity, {}
        for namespace, counted in counts.items():
            scores = {k: float(v) for k, v in counted.items()}
            if not self._guard(partial(self._add_popularity, namespace, scores), False):
                return  # Redis is down: these counts are lost, which only blurs the ranking
        for namespace in self._guard(self.pool.namespaces, []):
            self._guard(partial(self.pool.decay, namespace, decay_factor, every_s), False)

    def _add_popularity(self, namespace: str, scores: dict[bytes, float]) -> bool:
        self.pool.add_popularity(namespace, scores)
        return True

    def prewarm(
        self, target_bytes: int, missing: Callable[[str, Sequence[BlockKey]], list[BlockKey]],
        import_blocks: Callable[[str, Sequence[BlockKey], Sequence[Verified]], int],
        namespaces: Sequence[str] = (),
    ) -> Iterator[PrewarmState]:
        """Fetch the hottest blocks of namespaces (all of them when none are named; ranked
        across namespaces by score) that missing() says no local tier holds, and hand them
        to import_blocks (the store's writer), until target_bytes have arrived. The progress
        is yielded, and logged, after every batch."""
        ranked = sorted(((score, ns, BlockKey(key)) for ns in namespaces or self.namespaces()
                         for key, score in self.hot(ns, HOT_MAX_MEMBERS)), reverse=True)
        # Past here Redis may go down mid-way: what arrived stays, the rest is a miss.
        progress = PrewarmState(target_bytes=target_bytes)
        with ThreadPoolExecutor(1, thread_name_prefix="l4-prewarm") as ahead:
            for start in range(0, len(ranked), BATCH_BLOCKS):
                if progress.bytes >= target_bytes:
                    break
                by_ns: dict[str, list[BlockKey]] = {}
                for _, ns, key in ranked[start : start + BATCH_BLOCKS]:
                    by_ns.setdefault(ns, []).append(key)
                for ns, keys in by_ns.items():
                    for run in self._runs(ahead, ns, missing(ns, keys)):
                        progress.blocks += import_blocks(ns, [k for k, _ in run],
                                                         [p for _, p in run])
                        progress.bytes += sum(len(p) for _, p in run)
                log.info("pre-warm: %d blocks, %d of %d bytes", progress.blocks,
                         progress.bytes, target_bytes)
                yield replace(progress)
        progress.done = True
        yield progress

    def _runs(self, ahead: Executor, namespace: str, keys: Sequence[BlockKey]
              ) -> Iterator[list[tuple[BlockKey, Verified]]]:
        """The hits among keys (fetched as fetch does), in order, in runs of about
        RUN_BYTES, with the next run's fetch already under way on ahead's thread while the
        caller copies this one into L2: the copies, and the first-touch page faults of a new
        daemon's L2, overlap Redis sending the next run, where fetching all first left them
        one after the other. The first run is one key; later ones are sized by the hits so
        far."""
        def fetch(start: int, num_keys: int) -> tuple[int, list[Verified | None]]:
            return start, self.fetch(namespace, keys[start : start + num_keys])

        pending: Future[tuple[int, list[Verified | None]]] | None = (
            ahead.submit(fetch, 0, 1) if keys else None)
        hit_bytes = hit_blocks = 0
        try:
            while pending is not None:
                start, payloads = pending.result()
                end = start + len(payloads)
                hits = [(k, p) for k, p in zip(keys[start:end], payloads, strict=True)
                        if p is not None]
                hit_bytes += sum(len(p) for _, p in hits)
                hit_blocks += len(hits)
                # no hit yet, so no size to go by: double the run
                run = RUN_BYTES * hit_blocks // hit_bytes if hit_bytes else 2 * len(payloads)
                pending = (ahead.submit(fetch, end, max(1, min(BATCH_BLOCKS, run)))
                           if end < len(keys) else None)
                yield from _groups(hits, IMPORT_BYTES)  # each put must fit in L2
        finally:  # the caller stopped early (its import failed): the fetch under way is moot
            if pending is not None:
                pending.cancel()

    def hot(self, namespace: str, limit: int) -> list[tuple[bytes, float]]:
        """The namespace's most popular keys with their scores, highest first (at most
        limit); Unavailable while Redis is down."""
        return self._required(lambda: self.pool.hot(namespace, limit), "hot")

    def namespaces(self) -> list[str]:
        """Every namespace whose reads were counted in L4's popularity; Unavailable while
        Redis is down."""
        return self._required(self.pool.namespaces, "the namespaces of L4's popularity")

    # --- census --------------------------------------------------------------------------------

    def want_census(self) -> None:
        """Ask for a fresh count of the pool (Stats does; it returns the last one)."""
        self._census_wanted.set()

    def _census_forever(self) -> None:
        while not self._stop.is_set():
            counted = self._guard(self.pool.census, None)
            if counted is not None:
                with self._stats_lock:
                    self.stats.objects, self.stats.used_bytes, self.stats.capacity_bytes = \
                        counted
            self._census_wanted.clear()
            if self._stop.wait(CENSUS_MIN_S):
                return
            self._census_wanted.wait(CENSUS_EVERY_S - CENSUS_MIN_S)

    # --- supervision ---------------------------------------------------------------------------

    def _supervise(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except Exception as exc:
            log.exception("an L4 worker failed; marking NOT_SERVING")
            self.on_failure(f"L4 worker: {type(exc).__name__}: {exc}")


def _groups(items: list[tuple[BlockKey, Verified]],
            max_bytes: int) -> Iterator[list[tuple[BlockKey, Verified]]]:
    """The items in order, cut into runs of at most max_bytes of payload; an item larger
    than that goes alone."""
    group: list[tuple[BlockKey, Verified]] = []
    size = 0
    for item in items:
        if group and size + len(item[1]) > max_bytes:
            yield group
            group, size = [], 0
        group.append(item)
        size += len(item[1])
    if group:
        yield group
