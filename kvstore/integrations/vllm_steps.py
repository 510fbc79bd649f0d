"""What travels between vLLM's scheduler side and its workers each step, for the kvstore
connector (`kvstore.integrations.vllm`): the step's metadata, scheduler to workers (the loads
to start, the blocks to save, keys included, and what the step computes), and the connector
stats, workers to scheduler (counters, and the worker's timings of its forward passes and
loads, which the scheduler's load-or-recompute rule learns from); and the worker's step timer.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvstore.keys import BlockKey


@dataclass
class LoadSpec:
    req_id: str
    keys: list[BlockKey]
    block_ids: list[int]
    tier: str = ""
    """The slowest tier the blocks were found in: a whole load teaches that tier's cost."""


@dataclass
class SaveSpec:
    keys: list[BlockKey]
    block_ids: list[int]
    parent: BlockKey | None


@dataclass
class KVStoreMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    idle: bool = False
    """The step computes nothing (every request waits, for its load say)."""
    chunks: list[tuple[int, int]] = field(default_factory=list)
    """What the step computes: (scheduled tokens, tokens computed before them) per request."""


class KVStoreStats(KVConnectorStats):
    """Counters of one interval, summed across workers and the scheduler; list-valued entries
    (the worker's timings, `steps` and `loads`) are concatenated, and taken out by the
    scheduler side before vLLM logs the rest."""

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            held = self.data.get(name)
            if isinstance(value, list):
                self.data[name] = [*(held or []), *value]
            else:
                self.data[name] = (held or 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if not isinstance(v, list)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


# What each side reports (one link may serve both in one process: no field twice).
SCHEDULER_FIELDS = ("lookups", "lookup_hit_blocks", "prefetched_blocks",
                     "recomputed_by_choice_tokens")
WORKER_FIELDS = ("loaded_blocks", "loaded_bytes", "load_failures", "offloaded_blocks",
                  "offloaded_bytes", "offload_dropped_blocks", "errors")


class StepTimer:
    """The worker's forward passes, timed with what each computed: perf_counter on the CPU; on
    CUDA a pair of events per step, read back once the end event has passed (never a
    synchronize, so the forward pass is not held up)."""

    def __init__(self, cuda: bool) -> None:
        self._cuda = cuda
        self._open: tuple[list[tuple[int, int]], Any] | None = None
        self._timed: deque[tuple[list[tuple[int, int]], Any, Any]] = deque(maxlen=64)
        self._done: list[tuple[list[tuple[int, int]], float]] = []

    def _mark(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def start(self, chunks: list[tuple[int, int]]) -> None:
        self._open = (chunks, self._mark())

    def stop(self) -> None:
        if self._open is None:
            return
        chunks, begun = self._open
        self._open = None
        ended = self._mark()
        if self._cuda:
            self._timed.append((chunks, begun, ended))
        else:
            self._done.append((chunks, ended - begun))

    def take(self) -> list[tuple[list[tuple[int, int]], float]]:
        """The steps timed since the last take (on CUDA: those whose end has passed)."""
        while self._timed and self._timed[0][2].query():
            chunks, begun, ended = self._timed.popleft()
            self._done.append((chunks, begun.elapsed_time(ended) / 1e3))
        done, self._done = self._done, []
        return done
