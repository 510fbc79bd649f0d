"""How long a hot block outlives a cold one in the eviction order (`kvstore.core.order`),
chosen by the workload, not by one trace.

A block used again (read, put again, or put again soon after its eviction) gets a head start
of some turnovers of its tier over blocks used once. What head start is best depends on the
workload: on the Mooncake synthetic trace about 8 turnovers beat LRU by 8% in token hits;
on multi-turn conversations, where every turn reuses its own history once and a finished
session's hot blocks are never used again, any head start loses to plain LRU.

So the index runs miniature simulations (Waldspurger et al., "Cache Modeling and
Optimization using Miniature Simulations", ATC '17): a spatially sampled subset of the keys
(hash below a rate, about SAMPLE_ENTRIES of them whatever the cache's size) goes through one
small shadow cache per candidate head start (CANDIDATES: 0, which is LRU, up to 16), each
scaled to the sample (capacity x rate), ranking hot and cold exactly as the real order does.
Each shadow counts its hits, decayed over about DECAY_TURNOVERS turnovers of its own
capacity; the real order uses the candidate with the most recent hits. LRU is a candidate, so
the store follows LRU wherever LRU would do better, and keeps the head start where it pays.

Pure and deterministic: sampling is by a hash of the key, nothing reads a clock. A sampled
use costs about 30 us (four shadows), too much for the request that makes it: the daemon's
HeadStart is `deferred`, so a use only queues the sampled key (a hash and an append) and the
mover thread runs the shadows later (`run_deferred`), a few at a time under the index lock. The
head start then follows the workload a fraction of a second late, which changes nothing:
it moves over thousands of uses.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import xxhash

from kvstore.keys import BlockKey

CANDIDATES = (0.0, 2.0, 8.0, 16.0)  # turnovers of the tier; 0 is plain LRU
START = 8.0  # before any shadow has seen an eviction: the Mooncake-tuned value
# Sampled keys the shadows model, about: every key of a smaller cache. A sampled use costs
# about 10 us (four shadows), so a use costs 10 us x min(1, SAMPLE_ENTRIES / entries); a
# sample of 1/8 of a small cache's keys cost the synthetic trace a third of its gain.
SAMPLE_ENTRIES = 4096
DECAY_TURNOVERS = 16.0  # hits count over about this many turnovers of a shadow
# Deferred uses waiting for the shadows, at most; past it new ones are dropped (a sparser
# sample for a while, nothing worse).
MAX_PENDING = 4 * SAMPLE_ENTRIES
_HASH_RANGE = 1 << 64


class _Shadow:
    """A miniature cache of the sampled keys with one head start."""

    __slots__ = ("turnovers", "cold", "hot", "ghosts", "seq", "hits")

    def __init__(self, turnovers: float) -> None:
        self.turnovers = turnovers
        self.cold: OrderedDict[int, int] = OrderedDict()  # key hash -> touch sequence
        self.hot: OrderedDict[int, int] = OrderedDict()
        self.ghosts: OrderedDict[int, None] = OrderedDict()  # evicted lately
        self.seq = 0
        self.hits = 0.0

    def access(self, h: int, capacity: int, keep: float) -> None:
        self.seq += 1
        hit = h in self.cold or h in self.hot
        self.hits = self.hits * keep + hit
        if h in self.cold:
            del self.cold[h]
            self.hot[h] = self.seq  # used again: hot
        elif h in self.hot:
            self.hot.move_to_end(h)
            self.hot[h] = self.seq
        elif h in self.ghosts:
            del self.ghosts[h]
            self.hot[h] = self.seq  # put again soon after its eviction: hot
        else:
            self.cold[h] = self.seq
        while len(self.cold) + len(self.hot) > capacity:
            self._evict(capacity)

    def _evict(self, capacity: int) -> None:
        cold = next(iter(self.cold.items()), None)
        hot = next(iter(self.hot.items()), None)
        if hot is None or (cold is not None
                           and cold[1] <= hot[1] + self.turnovers * capacity):
            h = self.cold.popitem(last=False)[0] if cold is not None else 0
        else:
            h = self.hot.popitem(last=False)[0]
        self.ghosts[h] = None
        while len(self.ghosts) > 2 * capacity:
            self.ghosts.popitem(last=False)


class HeadStart:
    """The head start the eviction order uses now (`turnovers`), and the shadows that pick
    it. `access` is called for every use of a block (a put or a read)."""

    def __init__(self, candidates: tuple[float, ...] = CANDIDATES,
                 start: float = START, deferred: bool = False) -> None:
        """candidates: the head starts to choose from (one: a fixed head start, no
        shadows); start: the one used first, one of them; deferred: uses wait for
        run_deferred() instead of running the shadows at once."""
        if start not in candidates:
            raise ValueError(f"start {start} is not one of the candidates {candidates}")
        self._shadows = [_Shadow(t) for t in candidates] if len(candidates) > 1 else []
        self._current = next((s for s in self._shadows if s.turnovers == start), None)
        self.turnovers = start
        self._capacity = 0  # the most entries the cache has held: its size, once full
        self._threshold = _HASH_RANGE  # sampled: hash < threshold
        self._deferred = deferred
        self._pending: deque[int] = deque()  # sampled key hashes not yet run (deferred)

    def access(self, key: BlockKey, entries: int) -> None:
        """A use of key while the cache holds `entries` entries."""
        if self._current is None:
            return
        if entries > self._capacity:
            self._capacity = entries
            self._threshold = min(_HASH_RANGE, _HASH_RANGE * SAMPLE_ENTRIES // entries)
        h = xxhash.xxh3_64_intdigest(key)  # keys are digests of their namespace too
        if h >= self._threshold:
            return
        if not self._deferred:
            self._run(h)
        elif len(self._pending) < MAX_PENDING:
            self._pending.append(h)

    @property
    def pending(self) -> int:
        """Deferred uses not yet run."""
        return len(self._pending)

    def run_deferred(self, limit: int) -> int:
        """Run up to `limit` deferred uses through the shadows; how many still wait."""
        pending = self._pending
        for _ in range(min(limit, len(pending))):
            self._run(pending.popleft())
        return len(pending)

    def _run(self, h: int) -> None:
        assert self._current is not None  # only sampled when there are shadows
        capacity = max(1, self._capacity * self._threshold // _HASH_RANGE)
        keep = 1.0 - 1.0 / (DECAY_TURNOVERS * capacity)
        for shadow in self._shadows:
            shadow.access(h, capacity, keep)
        best = max(self._shadows, key=lambda s: s.hits)
        if best.hits > self._current.hits:
            self.turnovers, self._current = best.turnovers, best
