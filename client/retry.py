"""Retry and backoff as small value objects, in the shape of redis-py's `redis/backoff.py`.

`Retry(backoff, attempts, retry_on)` runs a zero-argument callable up to `attempts` times,
sleeping `backoff.compute(failures)` seconds between tries, and re-raises anything not in
`retry_on` at once. The client retries on `Unavailable` only: every verb is safe to repeat
(values are immutable, so a Put stream is simply sent again whole).
"""

from __future__ import annotations

import asyncio
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from .errors import Unavailable

__all__ = [
    "AbstractBackoff",
    "ConstantBackoff",
    "ExponentialBackoff",
    "NoBackoff",
    "Retry",
]

T = TypeVar("T")


class AbstractBackoff(ABC):
    """How long to wait before the next try, given how many tries have failed so far."""

    @abstractmethod
    def compute(self, failures: int) -> float:
        """Seconds to sleep after the `failures`-th failure (1 after the first)."""


@dataclass(frozen=True)
class NoBackoff(AbstractBackoff):
    """Retry immediately."""

    def compute(self, failures: int) -> float:
        return 0.0


@dataclass(frozen=True)
class ConstantBackoff(AbstractBackoff):
    """The same pause before every retry."""

    backoff_s: float = 0.1

    def __post_init__(self) -> None:
        if self.backoff_s < 0:
            raise ValueError(f"backoff_s must be >= 0, got {self.backoff_s}")

    def compute(self, failures: int) -> float:
        return self.backoff_s


@dataclass(frozen=True)
class ExponentialBackoff(AbstractBackoff):
    """base_s * 2**(failures-1), capped at cap_s; with jitter, uniform in [0, that] ("full
    jitter"), so clients that failed together do not retry together."""

    base_s: float = 0.05
    cap_s: float = 2.0
    jitter: bool = True
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.base_s < 0 or self.cap_s < 0:
            raise ValueError(f"base_s and cap_s must be >= 0, got {self.base_s}, {self.cap_s}")

    def ceiling(self, failures: int) -> float:
        """The pause before jitter is applied."""
        exponent = min(max(failures - 1, 0), 62)  # keeps 2**exponent a finite float
        return float(min(self.cap_s, self.base_s * (2.0**exponent)))

    def compute(self, failures: int) -> float:
        ceiling = self.ceiling(failures)
        return self.rng.uniform(0.0, ceiling) if self.jitter else ceiling


@dataclass(frozen=True)
class Retry:
    """Run a callable up to `attempts` times in all, retrying on the `retry_on` exceptions."""

    backoff: AbstractBackoff = field(default_factory=ExponentialBackoff)
    attempts: int = 3
    retry_on: tuple[type[BaseException], ...] = (Unavailable,)

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int):
            raise TypeError(f"attempts must be an int, got {type(self.attempts).__name__}")
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1 (1 means no retry), got {self.attempts}")

    def call(
        self,
        fn: Callable[[], T],
        *,
        sleep: Callable[[float], None] = time.sleep,
    ) -> T:
        """fn(), retried; the last failure propagates once attempts are spent."""
        failures = 0
        while True:
            try:
                return fn()
            except self.retry_on:
                failures += 1
                if failures >= self.attempts:
                    raise
                sleep(self.backoff.compute(failures))

    async def call_async(
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> T:
        """await fn(), retried; the coroutine twin of call()."""
        failures = 0
        while True:
            try:
                return await fn()
            except self.retry_on:
                failures += 1
                if failures >= self.attempts:
                    raise
                await sleep(self.backoff.compute(failures))
