"""Accounting of tier I/O: queue depth and the wall time a tier is busy reading or writing.

Batches run outside the store lock and may overlap; busy time counts the union of their
intervals, so bytes moved / busy seconds is the tier's bandwidth, not one stream's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvstore.tier import TierStats
from kvstore.tiers.base import Transfer

T = TypeVar("T")


class IoMeter:
    """Counts the queue depth and busy time of the tiers' I/O into their TierStats.
    Thread-safe: batches of one tier may run on several threads at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[tuple[int, str], int] = {}  # (id of the stats, op) -> batches
        self._busy_since: dict[tuple[int, str], float] = {}

    def run(self, stats: TierStats, op: str,
            move: Callable[[Sequence[Transfer]], list[OSError | None]],
            batch: Sequence[Transfer]) -> list[OSError | None]:
        """Run move(batch) and return what it returns. The batch counts in stats' queue
        depth while it runs, and its time in the busy seconds of op ("read" or "write")."""
        if not batch:
            return []
        with self._lock:
            stats.queue_depth += len(batch)
        try:
            return self.timed(stats, op, lambda: move(batch))
        finally:
            with self._lock:
                stats.queue_depth -= len(batch)

    def timed(self, stats: TierStats, op: str, call: Callable[[], T]) -> T:
        """Run call() and return what it returns, its time counted in stats' busy seconds
        for op ("read" or "write"); time when another call of the same op already runs is
        counted once."""
        busy = (id(stats), op)
        with self._lock:
            if not self._in_flight.get(busy):
                self._busy_since[busy] = time.perf_counter()
            self._in_flight[busy] = self._in_flight.get(busy, 0) + 1
        try:
            return call()
        finally:
            with self._lock:
                self._in_flight[busy] -= 1
                if not self._in_flight[busy]:
                    elapsed = time.perf_counter() - self._busy_since[busy]
                    if op == "write":
                        stats.write_seconds += elapsed
                    else:
                        stats.read_seconds += elapsed
