"""Load or recompute: how many of a prompt's hit blocks an engine should load from the store,
and how many it should compute again instead, chosen per request by estimated seconds.

From what: `PrefillModel` fits the seconds of the engine's own forward steps to the tokens and
attention work they computed; `TierRates` learns the seconds per byte of loads from each tier
("pending", "hbm", "dram", "nvme", "remote"), from the engine's own loads and from the daemon's
Stats; `decide` takes the tier of each hit block and picks the cut k that minimises
load(first k blocks) + compute(everything after them).

Two failure modes it avoids:
- loading when loading is slower than recomputing (a disk or a remote pool under load can take
  many times the prefill's seconds): a tier's blocks are loaded only when that is estimated to
  be cheaper;
- never trying a tier again after one slow load: the engine's own estimates count only while
  younger than `stale_s`; past that the daemon's figures for the tier are used, which
  prefetches and other engines keep current, and with none at all the blocks are loaded again,
  which teaches the rates anew.

Pure: no I/O and no threads; the clock is injected (`time.monotonic` is only the default).
Shared by this repo's engine (`engine/connector.py`) and the vLLM connector (`vllm.py`).
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any, TypeVar

import numpy as np

__all__ = ["POLICIES", "TIER_ORDER", "Decision", "PrefillModel", "TierRates", "decide",
           "slowest"]

POLICIES = ("auto", "always", "never")
TIER_ORDER = ("pending", "hbm", "dram", "nvme", "remote")
"""Fastest first; a name not listed counts as slower than all of them."""

PENDING_BYTES_PER_S = 10e9
"""An offload still queued in this process is a memcpy away."""
MIN_STATS_DELTA_BYTES = 64 * 1024
"""A Stats delta smaller than this says more about timer resolution than about the tier."""
_FASTEST_S_PER_BYTE = 1e-12
"""1 TB/s: a floor, so a load that took no longer than the round trip never reads as infinite."""
_MIN_FIT_STEPS = 3
F = TypeVar("F", bound=Callable[..., Any])


_RANKS = {tier: i for i, tier in enumerate(TIER_ORDER)}


def _rank(tier: str) -> int:
    return _RANKS.get(tier, len(TIER_ORDER))


def slowest(tiers: Sequence[str]) -> str:
    """The slowest tier among `tiers` (the first of equals); "pending" for none: a load is as
    slow as its slowest block."""
    return max(tiers, key=_rank, default="pending")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


class PrefillModel:
    """Seconds of one forward step from what it computes, fitted on the engine's own steps:
    t = a*tokens + b*attention + c, where for each sequence in the step with n new tokens after
    c_ctx cached ones, tokens += n and attention += n*(c_ctx + n/2) (the attention work grows with
    context). Least squares over the last `window` steps and, for step sizes (tokens, by power
    of two) larger than any in that window, the last window/32 steps of each size: a long spell
    of decodes or of short chunks does not make it forget what a long prefill costs (it did,
    with only the last prefill steps kept, once short arrivals' chunks filled them). The
    coefficients are kept >= 0 (the best fit on a subset of them when the plain one is not)."""

    def __init__(self, window: int = 256) -> None:
        if window < _MIN_FIT_STEPS:
            raise ValueError(f"window must be >= {_MIN_FIT_STEPS}, got {window!r}")
        self._rows: deque[tuple[int, tuple[float, float, float]]] = deque(maxlen=window)
        self._by_size: dict[int, deque[tuple[int, tuple[float, float, float]]]] = {}
        self._per_size = max(_MIN_FIT_STEPS, window // 32)
        self._seen = 0
        self._coef: tuple[float, float, float] | None = None
        self._max_step_tokens = 0
        self._dirty = False

    def observe(self, chunks: Sequence[tuple[int, int]], seconds: float) -> None:
        """One forward step: (new tokens, cached context tokens before them) per sequence it
        computed, and the step's wall seconds. Steps of zero tokens or seconds <= 0 are ignored."""
        tokens = 0
        attention = 0.0
        for new, context in chunks:
            if new < 0 or context < 0:
                raise ValueError(f"chunks: counts must be >= 0, got {(new, context)!r}")
            tokens += new
            attention += new * (context + new / 2)
        if tokens == 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        row = (self._seen, (float(tokens), attention, float(seconds)))
        self._seen += 1
        self._rows.append(row)
        size = tokens.bit_length()
        if size not in self._by_size:
            self._by_size[size] = deque(maxlen=self._per_size)
        self._by_size[size].append(row)
        self._dirty = True

    @property
    def steps(self) -> int:
        """Observations held (at most `window`, plus older steps larger than those)."""
        return len(self._held())

    def _held(self) -> list[tuple[float, float, float]]:
        if not self._rows:
            return []
        oldest = self._rows[0][0]
        window = [row for _, row in self._rows]
        top = max(int(tokens).bit_length() for tokens, _, _ in window)
        older = [row for size, rows in self._by_size.items() if size > top
                 for i, row in rows if i < oldest]
        return older + window

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """(a s/token, b s/attention unit, c s/step) as fitted now; None before 3 steps."""
        self._refit()
        return self._coef

    def estimate(self, tokens: int, context: int, step_tokens: int) -> float | None:
        """Seconds to prefill `tokens` tokens after `context` cached ones, computed in steps of at
        most step_tokens new tokens each (so ceil(tokens/step_tokens) steps, each paying c, each
        chunk's attention at its own context). 0.0 for tokens <= 0. None when the model cannot
        say: fewer than 3 steps seen, or no step seen that computed at least
        min(tokens, step_tokens) // 4 new tokens (no extrapolating from decodes alone to a long
        prefill)."""
        if context < 0:
            raise ValueError(f"context must be >= 0, got {context!r}")
        out = self.estimates(np.array([tokens]), np.array([context]), step_tokens)
        return None if out is None else float(out[0])

    def estimates(self, tokens: np.ndarray, contexts: np.ndarray,
                  step_tokens: int) -> np.ndarray | None:
        """`estimate` of every (tokens[i], contexts[i]) at once (int arrays, 0.0 where tokens
        <= 0); None when it cannot say for the largest of tokens."""
        if step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {step_tokens!r}")
        t = np.maximum(np.asarray(tokens, dtype=np.int64), 0)
        most = int(t.max(initial=0))
        if most == 0:
            return np.zeros(t.shape)
        self._refit()
        if self._coef is None or self._max_step_tokens < min(most, step_tokens) // 4:
            return None
        a, b, c = self._coef
        # Summed over the chunks, n_i*(ctx_i + n_i/2) telescopes to tokens*(context + tokens/2)
        # however the prefill is split; only the per-step cost c sees the chunking.
        attention = t * (np.asarray(contexts, dtype=np.int64) + t / 2)
        out: np.ndarray = a * t + b * attention + c * -(-t // step_tokens)
        return out

    def _refit(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        held = self._held()
        if len(held) < _MIN_FIT_STEPS:
            self._coef = None
            return
        data = np.array(held, dtype=np.float64)
        self._max_step_tokens = int(data[:, 0].max())
        x = np.column_stack([data[:, 0], data[:, 1], np.ones(len(data))])
        self._coef = _nonnegative_lstsq(x, data[:, 2])


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """min |x@w - y| over w >= 0, for 3 columns: the best of the unconstrained fits on every
    subset of columns whose coefficients all come out >= 0 (that is the constrained optimum,
    which is the plain fit on its own support)."""
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale  # columns of like size: attention units run ~1e9 times tokens
    best = np.zeros(3)
    best_residual = float(y @ y)
    for size in (1, 2, 3):
        for cols in combinations(range(3), size):
            w, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
            if (w < 0).any():
                continue
            r = xs[:, cols] @ w - y
            residual = float(r @ r)
            if residual < best_residual:
                best_residual = residual
                best = np.zeros(3)
                best[list(cols)] = w
    a, b, c = (best / scale).tolist()
    return a, b, c


def _locked(method: F) -> F:
    @functools.wraps(method)
    def call(self: TierRates, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]


class TierRates:
    """Expected seconds to load bytes from each tier. Two sources:
    - own loads, end to end (observe_load: the load's slowest tier, bytes, seconds): an
      exponentially weighted mean of seconds per byte and of a per-load fixed cost is not
      identifiable from one number, so keep EWMA of seconds-per-byte only (weight `alpha` for the
      newest) plus the latency floor `rtt` (below);
    - the daemon's Stats (observe_stats: per tier cumulative (bytes_out, read_seconds)); the rate
      of a tier is delta bytes / delta seconds between two polls (ignore deltas with < 64 KiB or
      <= 0 s; a counter that went down = the daemon restarted: restart the baseline).
    Own observations win while fresh (younger than stale_s); past that, or with none, the
    daemon's recent rate for that tier is used; with neither, estimate returns None.
    observe_rtt(seconds) feeds an EWMA of the store round trip (a Lookup's latency), added once
    per load. Thread-safe: loader threads feed it while the engine's loop asks it."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, stale_s: float = 30.0,
                 alpha: float = 0.3) -> None:
        _positive("stale_s", stale_s)
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self._clock = clock
        self._stale_s = stale_s
        self._alpha = alpha
        self._own: dict[str, tuple[float, float]] = {}  # tier -> (s/byte EWMA, when last fed)
        self._baseline: dict[str, tuple[int, float]] = {}  # tier -> Stats counters a delta starts
        self._daemon: dict[str, float] = {}  # tier -> s/byte from the latest usable delta
        self._rtt_s: float | None = None
        self._lock = threading.Lock()

    @_locked
    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        """One load of ours, end to end; the round trip believed now is taken out of it, as
        estimate adds it back once. Loads of no bytes or no time teach nothing; "pending" is a
        constant, not learnt."""
        if tier == "pending" or nbytes <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        per_byte = max((seconds - (self._rtt_s or 0.0)) / nbytes, _FASTEST_S_PER_BYTE)
        now = self._clock()
        held = self._own.get(tier)
        if held is not None and now - held[1] < self._stale_s:
            # A stale mean does not weigh in: after a quiet spell the tier starts afresh.
            per_byte = self._alpha * per_byte + (1 - self._alpha) * held[0]
        self._own[tier] = (per_byte, now)

    @_locked
    def observe_stats(self, tiers: Mapping[str, tuple[int, float]]) -> None:
        """One poll of the daemon's Stats: tier -> cumulative (bytes_out, read_seconds). The
        baseline stays put until a delta is large enough to trust, so slow trickles add up."""
        for tier, (total_bytes, total_s) in tiers.items():
            base = self._baseline.get(tier)
            if base is None or total_bytes < base[0] or total_s < base[1]:
                self._baseline[tier] = (total_bytes, total_s)  # first poll, or a restart
                continue
            delta_bytes, delta_s = total_bytes - base[0], total_s - base[1]
            if delta_bytes < MIN_STATS_DELTA_BYTES or not delta_s > 0:
                continue
            self._daemon[tier] = max(delta_s / delta_bytes, _FASTEST_S_PER_BYTE)
            self._baseline[tier] = (total_bytes, total_s)

    @_locked
    def observe_rtt(self, seconds: float) -> None:
        """One store round trip (a Lookup's latency)."""
        if not seconds >= 0 or not math.isfinite(seconds):
            return
        held = self._rtt_s
        self._rtt_s = seconds if held is None else self._alpha * seconds + (1 - self._alpha) * held

    def estimate(self, tier: str, nbytes: int) -> float | None:
        """Seconds to load `nbytes` from `tier` in one load; None when nothing current is known."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
        line = self.line(tier)
        return None if line is None else line[0] + nbytes * line[1]

    @_locked
    def line(self, tier: str) -> tuple[float, float] | None:
        """(fixed seconds, seconds per byte) of one load from `tier` believed now, so that a
        load of n bytes is fixed + n * per_byte (`estimate`); None when nothing current is
        known. "pending" pays no round trip."""
        if tier == "pending":
            return 0.0, 1.0 / PENDING_BYTES_PER_S
        per_byte = self._per_byte(tier)
        if per_byte is None:
            return None
        return self._rtt_s or 0.0, per_byte

    @_locked
    def snapshot(self) -> dict[str, float]:
        """Tier -> bytes/s currently believed (for logs and metrics); tiers with no current
        figure are left out."""
        out = {"pending": PENDING_BYTES_PER_S}
        for tier in sorted(self._own.keys() | self._daemon.keys(), key=_rank):
            per_byte = self._per_byte(tier)
            if per_byte is not None:
                out[tier] = 1.0 / per_byte
        return out

    @property
    def rtt_s(self) -> float | None:
        """The store round trip believed now; None before the first."""
        return self._rtt_s

    def _per_byte(self, tier: str) -> float | None:
        held = self._own.get(tier)
        if held is not None and self._clock() - held[1] < self._stale_s:
            return held[0]
        return self._daemon.get(tier)


@dataclass(frozen=True)
class Decision:
    """What to do with one request's hit, and why."""

    load_blocks: int
    """Leading hit blocks to load."""
    recompute_blocks: int
    """Hit blocks after them that the engine will compute instead."""
    reason: str
    """One line for people: what was chosen and the estimates behind it."""
    load_s: float | None = None
    """Estimated seconds of the chosen load (None: not estimated)."""
    compute_s: float | None = None
    """Estimated seconds computing the whole hit adds (compute from the hit's first token minus
    compute from past its last), the figure a load of the whole hit competes with."""


def _fmt(seconds: float) -> str:
    if seconds < 1e-3:
        return f"~{seconds * 1e6:.0f} us"
    if seconds < 10e-3:
        return f"~{seconds * 1e3:.1f} ms"
    if seconds < 1:
        return f"~{seconds * 1e3:.0f} ms"
    return f"~{seconds:.1f} s"


def _check(
    policy: str, block_bytes: int, block_size: int, first_block: int, num_tokens: int,
    step_tokens: int, hit_blocks: int,
) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    for name, value, least in (("block_bytes", block_bytes, 0), ("block_size", block_size, 1),
                               ("first_block", first_block, 0), ("num_tokens", num_tokens, 0),
                               ("step_tokens", step_tokens, 1)):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value!r}")
    if (first_block + hit_blocks) * block_size > num_tokens:
        raise ValueError(f"num_tokens ({num_tokens}) ends before the hit: blocks {first_block}.."
                         f"{first_block + hit_blocks - 1} of {block_size} tokens")


def decide(*, tiers: Sequence[str], block_bytes: int, block_size: int, first_block: int,
           num_tokens: int, policy: str, prefill: PrefillModel, rates: TierRates,
           step_tokens: int) -> Decision:
    """tiers: the tier of each hit block, in chain order (the hit is blocks first_block ..
    first_block+len(tiers)-1 of a sequence of num_tokens tokens; tokens before
    first_block*block_size are already in the engine's cache). Chooses k in 0..len(tiers): load
    the first k hit blocks, compute everything after them, minimising
        load(k) + compute(tokens from (first_block+k)*block_size to num_tokens, after that context)
    where load(0) = 0 and load(k) = rates.estimate(slowest(tiers[:k]), k*block_bytes).
    policy "always": k = len(tiers); "never": k = 0 (reasons say "policy always"/"policy never").
    "auto" with any estimate missing for a k it needs -> load everything, reason "no estimate
    yet (...which one...): loading" (today's behaviour; the first loads teach the rates).
    Ties go to loading more (k larger). len(tiers) == 0 -> Decision(0, 0, "no hit").
    ValueError naming the argument for a bad policy or negative counts (and for a hit that ends
    past num_tokens)."""
    n = len(tiers)
    _check(policy, block_bytes, block_size, first_block, num_tokens, step_tokens, n)
    if n == 0:
        return Decision(0, 0, "no hit")

    contexts = (first_block + np.arange(n + 1)) * block_size  # after k = 0..n loaded blocks
    computes = prefill.estimates(num_tokens - contexts, contexts, step_tokens)
    if policy != "auto":
        hit_s = None if computes is None else float(computes[0] - computes[n])
        if policy == "never":
            return Decision(0, n, f"policy never: recompute {n} blocks", 0.0, hit_s)
        all_s = rates.estimate(slowest(tiers), n * block_bytes)
        return Decision(n, 0, f"policy always: load {n} blocks ({slowest(tiers)})", all_s, hit_s)
    return _auto(tiers, block_bytes, computes, rates)


def _auto(tiers: Sequence[str], block_bytes: int, computes: np.ndarray | None,
          rates: TierRates) -> Decision:
    """decide's "auto", over every k at once: computes[k] is the compute after k loaded blocks
    (None: not known), load(k) one line per slowest tier of tiers[:k], read once."""
    n = len(tiers)
    missing = [] if computes is not None else ["prefill"]
    ranks = [_rank(t) for t in tiers]
    worst = np.maximum.accumulate(ranks)  # worst[k-1]: the rank of the slowest of tiers[:k]
    name: dict[int, str] = {}  # rank -> its first tier in the chain (the slowest's name)
    for tier, rank in zip(tiers, ranks, strict=True):
        name.setdefault(rank, tier)
    loads = np.zeros(n + 1)
    for rank in np.unique(worst).tolist():  # ascending = in chain order (worst only grows)
        line = rates.line(name[rank])
        if line is None:
            missing.append(f"{name[rank]} rate")
            break
        ks = np.flatnonzero(worst == rank) + 1
        loads[ks] = line[0] + (ks * block_bytes) * line[1]
    if missing or computes is None:
        all_s = rates.estimate(slowest(tiers), n * block_bytes)
        hit_s = float(computes[0] - computes[n]) if computes is not None else None
        return Decision(n, 0, f"no estimate yet ({', '.join(missing)}): loading", all_s, hit_s)

    def tier_at(k: int) -> str:
        return name[int(worst[k - 1])]

    costs = loads + computes
    best_k = int(np.flatnonzero(costs == costs.min())[-1])  # ties: load more
    load_s, hit_s = float(loads[best_k]), float(computes[0] - computes[n])
    if best_k == n:
        reason = f"load {n} blocks ({tier_at(n)}) {_fmt(load_s)} vs compute {_fmt(hit_s)}"
    elif best_k == 0:
        reason = (f"recompute {n} blocks: loading ({tier_at(n)}) {_fmt(float(loads[n]))} vs "
                  f"compute {_fmt(hit_s)}")
    else:
        chosen = float(loads[best_k] + computes[best_k] - computes[n])
        reason = (f"load {best_k} ({tier_at(best_k)}), recompute {n - best_k} "
                  f"({slowest(tiers[best_k:])}): {_fmt(chosen)} vs load all "
                  f"{_fmt(float(loads[n]))}, compute all {_fmt(hit_s)}")
    return Decision(best_k, n - best_k, reason, load_s, hit_s)
