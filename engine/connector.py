"""The engine's side of the store (docs/engine.md). Nothing here blocks the step loop on the
store: lookups and loads run on the link's loader threads and come back as events the engine
collects between steps (`poll`), so a request whose prefix the store holds waits for its blocks
while the rest of the batch keeps stepping; offloads of blocks as they fill go from a writer
thread; a preempted sequence's blocks are swapped out the same way; the L4 hot set can be
pre-warmed at start.

Each hit is loaded only when loading it is expected to be faster than computing it
(`decide`: the engine's own prefill rate against what loads from each tier cost here, see
kvstore.integrations.cost), unless the policy says always or never.

The store-facing half (lookups, loads, the offload queue, the fail-safe) is
`kvstore.integrations.link.StoreLink`, shared with the vLLM connector; this module adds the
tensors: a staging buffer (pinned when the cache is on a GPU) and the kernels' gather and
scatter. The store is an accelerator, never a dependency of correctness: any store error turns
the link off (logged once), the engine keeps serving by recomputing, and the link turns itself
back on once the daemon answers again. Blocks that fail to load are recomputed from the first
failure on.

One stored block = every layer's K and V of one engine block, contiguous
([layers, 2, block_size, kv_heads, head_dim], gather_blocks' staging row), under the block's
chained key in the engine's namespace. Keys come with the sequence (computed once per block).

Credentials for a daemon with auth on are the client's: token, tls and unix_socket given here
(EngineConfig.store_token, store_tls, store_unix_socket), else the variables KVStoreClient
reads (KVSTORE_TOKEN or KVSTORE_TOKEN_FILE, KVSTORE_TLS_CA_FILE / _CERT_FILE / _KEY_FILE /
_SERVER_NAME, KVSTORE_UNIX_SOCKET). A malformed token or an unreadable certificate file is
InvalidRequestError at start; credentials the daemon refuses (UNAUTHENTICATED,
PERMISSION_DENIED) are store errors like any other: the engine recomputes and logs why.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.client import TLS
from kvstore.client.errors import KVStoreError
from kvstore.engine.errors import InvalidRequestError
from kvstore.engine.scheduler import LoadPlan, LookupPlan
from kvstore.engine.sequence import StoreAnswer
from kvstore.integrations.cost import POLICIES, PrefillModel, decide, slowest
from kvstore.integrations.link import ConnectorStats, Hit, StoreLink
from kvstore.kernels import KernelOps
from kvstore.kernels.reference import staging_shape
from kvstore.keys import BlockKey

__all__ = ["ConnectorStats", "Looked", "Loaded", "StoreConnector"]

logger = logging.getLogger("kvstore.engine")


@dataclass(frozen=True)
class Looked:
    """A lookup came back: what the store holds of plan.keys."""

    plan: LookupPlan
    hit: Hit


@dataclass(frozen=True)
class Loaded:
    """A load came back: its first `arrived` blocks are in the KV cache."""

    plan: LoadPlan
    arrived: int


def _byte_rows(staging: torch.Tensor) -> list[np.ndarray]:
    """One writable uint8 numpy view per staged block (bfloat16 has no numpy dtype)."""
    flat = staging.reshape(staging.shape[0], -1).view(torch.uint8)
    return [row.numpy() for row in flat]


class StoreConnector:
    def __init__(
        self,
        target: str,
        namespace: str,
        kv_cache: torch.Tensor,
        block_size: int,
        ops: KernelOps,
        *,
        timeout_s: float = 2.0,
        max_pending_batches: int = 64,
        reconnect_s: float = 1.0,
        token: str | None = None,
        tls: TLS | bool | None = None,
        unix_socket: str | None = None,
        load_policy: str = "auto",
        prefill: PrefillModel | None = None,
        step_tokens: int = 2048,
    ) -> None:
        """load_policy: "auto" (load a hit when that is faster than computing it), "always",
        "never"; prefill: the engine's own step timings (it observes every forward pass);
        step_tokens: most tokens one step computes (the scheduler's budget)."""
        if load_policy not in POLICIES:
            raise InvalidRequestError(
                f"store_load_policy must be one of {POLICIES}, got {load_policy!r}")
        self.namespace = namespace
        self.block_size = block_size
        self.kv_cache = kv_cache
        self.ops = ops
        self.load_policy = load_policy
        self.prefill = prefill or PrefillModel()
        self.step_tokens = step_tokens
        self.block_bytes = int(np.prod(staging_shape(kv_cache, 1))) * kv_cache.element_size()
        self._events: queue.SimpleQueue[Looked | Loaded] = queue.SimpleQueue()
        try:
            self.link = StoreLink(target, namespace, block_size, timeout_s=timeout_s,
                                  reconnect_s=reconnect_s,
                                  max_pending_batches=max_pending_batches, token=token,
                                  tls=tls, unix_socket=unix_socket)
        except KVStoreError as exc:  # a malformed token, an unreadable certificate: config
            raise InvalidRequestError(f"store {target}: {exc}") from None

    @property
    def stats(self) -> ConnectorStats:
        return self.link.stats

    @property
    def available(self) -> bool:
        return self.link.available

    # -- admission: lookups and loads, in the background ---------------------------------
    def start_lookup(self, plan: LookupPlan) -> None:
        """Ask how many of plan.keys the store holds (and prefetch the hit's L3/L4 blocks to
        L2); the answer comes back as a Looked event."""
        self.link.lookup_async(plan.keys, lambda hit: self._events.put(Looked(plan, hit)))

    def decide(self, looked: Looked) -> StoreAnswer:
        """How much of a hit to load: the leading blocks whose load is expected to beat
        computing them (or all / none, by policy)."""
        plan, hit = looked.plan, looked.hit
        choice = decide(tiers=hit.tiers, block_bytes=self.block_bytes,
                        block_size=self.block_size, first_block=plan.first_block,
                        num_tokens=len(plan.seq), policy=self.load_policy,
                        prefill=self.prefill, rates=self.link.rates,
                        step_tokens=self.step_tokens)
        return StoreAnswer(plan.first_block, hit.blocks, choice.load_blocks, choice.reason,
                           slowest(hit.tiers[: choice.load_blocks]))

    def start_load(self, plan: LoadPlan, tier: str = "") -> None:
        """Read plan.keys into plan.block_ids of the KV cache on a loader thread (staged,
        then scattered there); comes back as a Loaded event with the blocks that arrived."""
        staging = self._staging(len(plan.keys))

        def done(arrived: int) -> None:
            try:
                if arrived:
                    ids = torch.tensor(plan.block_ids[:arrived], dtype=torch.int64)
                    self.ops.scatter_blocks(staging[:arrived], self.kv_cache,
                                            ids.to(self.kv_cache.device))
            except Exception:  # blocks that cannot be placed are blocks to compute
                logger.exception("kvstore: placing %d loaded blocks failed", arrived)
                arrived = 0
            self._events.put(Loaded(plan, arrived))

        self.link.read_async(plan.keys, _byte_rows(staging), done, tier=tier)

    def poll(self, timeout_s: float = 0.0) -> list[Looked | Loaded]:
        """The lookups and loads that came back; waits up to timeout_s for the first."""
        events: list[Looked | Loaded] = []
        try:
            events.append(self._events.get(timeout=timeout_s) if timeout_s > 0
                          else self._events.get_nowait())
        except queue.Empty:
            return events
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                return events

    def _staging(self, count: int) -> torch.Tensor:
        pin = self.kv_cache.device.type == "cuda"
        return torch.empty(staging_shape(self.kv_cache, count), dtype=self.kv_cache.dtype,
                           pin_memory=pin)

    # -- offload and swap-out -------------------------------------------------------------
    def offload(self, keys: Sequence[BlockKey], block_ids: Sequence[int],
                parent: BlockKey | None) -> bool:
        """Copy the blocks out of the KV cache now (so the cache may reuse them at once) and
        put them in the background. False when they were dropped (store off, queue full)."""
        if not keys:
            return True
        if not self.link.available:
            return self.link.offload(keys, [], parent)  # counted as dropped
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self.kv_cache.device)
        staging = self._staging(len(keys))
        self.ops.gather_blocks(self.kv_cache, ids, out=staging)
        return self.link.offload(keys, _byte_rows(staging), parent)

    def swap_out(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> bool:
        """A preempted sequence's full blocks, before its block ids are reused."""
        stored = self.offload(keys, block_ids, None)
        if stored:
            self.stats.swapped_out_blocks += len(keys)
        return stored

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every queued offload reached the store (or was dropped)."""
        self.link.flush(timeout_s)

    # -- pre-warm -------------------------------------------------------------------------
    def prewarm(self, num_bytes: int = 0) -> int:
        """Ask the daemon to pull this namespace's hottest L4 blocks into its local tiers, so
        the first requests hit. Returns the blocks brought in (0 when L4 is off)."""
        return self.link.prewarm(num_bytes)

    def close(self) -> None:
        self.link.close()
