"""What travels between the two halves of vLLM's kvstore connector (`kvstore.integrations.vllm`)
each step, and how each half reports its counters.

- The step's metadata goes from the scheduler side to the workers: the loads to start, the
  newly full blocks to save (with their keys, so the workers need no token ids), and what the
  step computes.
- The connector stats go from the workers to the scheduler side: each interval's counters,
  and the worker's timings of its forward passes and of its loads, which the scheduler side's
  load-or-recompute rule learns from.
- The worker's step timer measures those forward passes.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvstore.keys import BlockKey

if TYPE_CHECKING:
    from kvstore.integrations.link import StoreLink

IDLE_WAIT_S = 0.01
"""A step that computes nothing waits at most this long for a Lookup (on the scheduler side)
or a load (on a worker) to come back, rather than let vLLM's loop spin through empty steps."""


@dataclass
class LoadSpec:
    """One request's load: the workers read these keys' blocks into these blocks of vLLM's
    KV cache, and report the request as finished loading when they have arrived or failed."""

    req_id: str
    keys: list[BlockKey]
    block_ids: list[int]
    tier: str = ""
    """The slowest tier the blocks were found in: a whole load teaches that tier's cost."""
    group: int = 0
    """The KV-cache group the blocks belong to (vLLM's hybrid manager keeps several, each
    stored under its own keys). A request's load is one spec per group that loads anything;
    block_ids may hold -1 where the group holds no block (a sliding window's that slid out)."""


@dataclass
class SaveSpec:
    """Blocks of vLLM's KV cache that the step fills: the workers copy them out after the
    forward pass and put them under these keys."""

    keys: list[BlockKey]
    block_ids: list[int]
    parent: BlockKey | None
    """The key before keys[0] in its chain; None when keys[0] is the chain's first block."""
    group: int = 0
    """The KV-cache group the blocks belong to, each stored under its own keys."""


@dataclass
class KVStoreMetadata(KVConnectorMetadata):
    """One step's work for the workers, built by the scheduler side."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    idle: bool = False
    """The step computes nothing: every request is waiting, for its load for example."""
    chunks: list[tuple[int, int]] = field(default_factory=list)
    """What the step computes: (scheduled tokens, tokens computed before them) per request."""


class KVStoreStats(KVConnectorStats):
    """One interval's counters, summed across the workers and the scheduler side. The
    list-valued entries (the worker's timings, `steps` and `loads`) are concatenated instead;
    the scheduler side takes them out before vLLM logs the rest."""

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


# The counters each side reports: the link's, and the scheduler side's own count of the hit
# tokens it chose to compute. One link may serve both sides in one process, so no counter is
# reported by both.
SCHEDULER_FIELDS = ("lookups", "lookup_hit_blocks", "prefetched_blocks",
                     "recomputed_by_choice_tokens")
WORKER_FIELDS = ("loaded_blocks", "loaded_bytes", "load_failures", "offloaded_blocks",
                  "offloaded_bytes", "offload_dropped_blocks", "errors")


class CounterDeltas:
    """What a set of cumulative counters grew by since the last report: each side's connector
    stats carry one interval's counts, while the link counts from the moment it opened."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self._names = names
        self._reported: dict[str, int] = {}

    def take(self, now: Mapping[str, int]) -> dict[str, int]:
        """The named counters' growth since the last take (since zero, the first time)."""
        grown = {name: now[name] - self._reported.get(name, 0) for name in self._names}
        self._reported.update({name: now[name] for name in self._names})
        return grown


def load_origin(link: StoreLink) -> str:
    """Names the link that timed a load, in the `loads` a worker reports. When vLLM runs both
    sides in one process they share one link, which learnt the load's cost already: the
    scheduler side takes a reported load into its rates only when it came from another link."""
    return f"{os.getpid()}:{id(link)}"


class StepTimer:
    """Times the worker's forward passes, each with what it computed. On the CPU it reads
    perf_counter. On CUDA it records a pair of events per step and reads them back once the
    end event has passed: it never synchronizes, so the forward pass is not held up."""

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
