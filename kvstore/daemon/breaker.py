"""A circuit breaker for one remote dependency (L4 Redis); its clock is passed in.

closed    -- normal: every call is allowed.
open      -- the dependency failed: calls are refused until `retry_at`; the wait starts at
             `backoff_s` and doubles with each consecutive failure, up to `max_backoff_s`.
half-open -- the wait is over: exactly one caller (the probe) is allowed; its success closes
             the breaker and resets the backoff, its failure opens it again for twice as long.

A probe that never reports (its caller died) would leave the breaker half-open forever, so
a probe's turn lasts one backoff period; after that the next caller becomes the probe.
A failure reported while already open (a call that started before the breaker opened) is
counted but does not extend the wait: one outage seen by many threads is one failure.
The waits are `kvstore.backoff.ExponentialBackoff` (the client's retry policy), without jitter.
Thread-safe: the daemon's RPC threads and the L4 workers share one breaker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvstore.backoff import ExponentialBackoff

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half-open"


class Breaker:
    """See the module docstring."""

    def __init__(self, backoff_s: float, max_backoff_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not backoff_s > 0:
            raise ValueError(f"backoff_s must be > 0, got {backoff_s}")
        if max_backoff_s < backoff_s:
            raise ValueError(f"max_backoff_s ({max_backoff_s}) must be >= backoff_s ({backoff_s})")
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        # No jitter: one breaker per daemon, and its waits stay exact for operators and tests.
        self._waits = ExponentialBackoff(base_s=backoff_s, cap_s=max_backoff_s, jitter=False)
        self._clock = clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._consecutive = 0  # failures since the last success
        self._failures = 0  # failures ever
        self._last_error = ""
        self._retry_at = 0.0  # open: when the probe may go; half-open: when its turn ends

    @property
    def state(self) -> str:
        return self._state

    @property
    def failures(self) -> int:
        """Failures reported since the breaker was made."""
        return self._failures

    @property
    def last_error(self) -> str:
        """The reason of the latest failure ("" when none yet); kept after recovery."""
        return self._last_error

    @property
    def retry_in_s(self) -> float:
        """Seconds until allow() would say yes again; 0 when closed."""
        if self._state == CLOSED:
            return 0.0
        return max(0.0, self._retry_at - self._clock())

    def _backoff(self) -> float:
        """The wait after the current run of consecutive failures."""
        return self._waits.compute(self._consecutive)

    def allow(self) -> bool:
        """Whether a call may go now; in half-open, yes only for the probe."""
        with self._lock:
            if self._state == CLOSED:
                return True
            now = self._clock()
            if now < self._retry_at:
                return False
            self._state = HALF_OPEN
            self._retry_at = now + self._backoff()
            return True

    def success(self) -> None:
        with self._lock:
            self._state = CLOSED
            self._consecutive = 0
            self._retry_at = 0.0

    def failure(self, reason: str) -> None:
        with self._lock:
            self._failures += 1
            self._last_error = reason
            if self._state == OPEN:
                return
            self._consecutive += 1
            self._state = OPEN
            self._retry_at = self._clock() + self._backoff()
