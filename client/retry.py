"""`Retry`: how the client repeats a failed call, in the shape of redis-py's `retry.py`.

`Retry(backoff, attempts, retry_on)` runs a zero-argument callable up to `attempts` times,
sleeping `backoff.compute(failures)` seconds between tries, and re-raises anything not in
`retry_on` at once. The client retries on `Unavailable` only: every verb is safe to repeat
(values are immutable, so a Put stream is simply sent again whole). The backoff value objects
live in `kvstore.backoff` (shared with the daemon's L4 breaker) and are re-exported here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from kvstore.backoff import AbstractBackoff, ConstantBackoff, ExponentialBackoff, NoBackoff

from .errors import Unavailable

__all__ = [
    "AbstractBackoff",
    "ConstantBackoff",
    "ExponentialBackoff",
    "NoBackoff",
    "Retry",
]

T = TypeVar("T")


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
