"""Backoff as small value objects, in the shape of redis-py's `redis/backoff.py`: how long to
wait before the next try, given how many tries have failed so far.

The one place exponential backoff is written. The client's `Retry` sleeps
`backoff.compute(failures)` between tries; the daemon's L4 circuit breaker
(`kvstore.daemon.breaker`) waits `compute(consecutive failures)` before its next probe. Pure:
no I/O, no clock; jitter draws from an injectable `random.Random`.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

__all__ = [
    "AbstractBackoff",
    "ConstantBackoff",
    "ExponentialBackoff",
    "NoBackoff",
]

# 2.0**62 is still a finite float; beyond ~1024 the power would overflow, so the exponent is
# capped long before (the result is capped at cap_s anyway).
_MAX_EXPONENT = 62


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
        exponent = min(max(failures - 1, 0), _MAX_EXPONENT)
        return float(min(self.cap_s, self.base_s * (2.0**exponent)))

    def compute(self, failures: int) -> float:
        ceiling = self.ceiling(failures)
        return self.rng.uniform(0.0, ceiling) if self.jitter else ceiling
