"""The engine's side of the store (docs/engine.md): ask `Lookup` how much of a new prompt the
store holds, load those blocks into the paged KV cache instead of computing them (swap-in),
offload blocks as they fill (in the background: the step loop never waits on the store), swap
a preempted sequence's blocks out, and pre-warm from the L4 hot set at start.

The store-facing half (keys, lookup, loads, the offload queue, the fail-safe) is
`kvstore.integrations.link.StoreLink`, shared with the vLLM connector; this module adds the
tensors: a staging buffer (pinned when the cache is on a GPU) and the kernels' gather and
scatter. The store is an accelerator, never a dependency of correctness: any store error turns
the link off (logged once), the engine keeps serving by recomputing, and the link turns itself
back on once the daemon answers again. Blocks that fail to load are recomputed from the first
failure on.

One stored block = every layer's K and V of one engine block, contiguous
([layers, 2, block_size, kv_heads, head_dim], gather_blocks' staging row), under the block's
chained key in the engine's namespace.

Credentials for a daemon with auth on are the client's: token, tls and unix_socket given here
(EngineConfig.store_token, store_tls, store_unix_socket), else the variables KVStoreClient
reads (KVSTORE_TOKEN or KVSTORE_TOKEN_FILE, KVSTORE_TLS_CA_FILE / _CERT_FILE / _KEY_FILE /
_SERVER_NAME, KVSTORE_UNIX_SOCKET). A malformed token or an unreadable certificate file is
InvalidRequestError at start; credentials the daemon refuses (UNAUTHENTICATED,
PERMISSION_DENIED) are store errors like any other: the engine recomputes and logs why.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvstore.client import TLS
from kvstore.client.errors import KVStoreError
from kvstore.engine.errors import InvalidRequestError
from kvstore.integrations.link import ConnectorStats, StoreLink
from kvstore.kernels import KernelOps
from kvstore.kernels.reference import staging_shape
from kvstore.keys import BlockKey

__all__ = ["ConnectorStats", "StoreConnector"]


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
    ) -> None:
        self.namespace = namespace
        self.block_size = block_size
        self.kv_cache = kv_cache
        self.ops = ops
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

    # -- admission: lookup and swap-in ----------------------------------------------------
    def keys_for(self, token_ids: Sequence[int], num_blocks: int) -> list[BlockKey]:
        return self.link.keys_for(token_ids, num_blocks)

    def matched_tokens(self, token_ids: Sequence[int], local_tokens: int) -> int:
        """How many tokens past local_tokens (a block multiple) the store holds for this
        prefix, leaving at least the last token to compute. 0 when the store is off."""
        max_blocks = (len(token_ids) - 1) // self.block_size
        first = local_tokens // self.block_size
        if max_blocks <= first:
            return 0
        # A chain may start anywhere: ask only for the blocks past the local hit.
        keys = self.keys_for(token_ids, max_blocks)[first:]
        return self.link.lookup(keys, prefetch=True).blocks * self.block_size

    def load(self, token_ids: Sequence[int], first_block: int, block_ids: Sequence[int]) -> int:
        """Load blocks first_block.. of token_ids' chain into block_ids of the KV cache; returns
        how many leading blocks arrived whole (the rest must be recomputed)."""
        if not block_ids:
            return 0
        keys = self.keys_for(token_ids, first_block + len(block_ids))[first_block:]
        staging = self._staging(len(keys))
        arrived = self.link.read(keys, _byte_rows(staging))
        if arrived:
            ids = torch.tensor(list(block_ids[:arrived]), dtype=torch.int64)
            self.ops.scatter_blocks(staging[:arrived], self.kv_cache,
                                    ids.to(self.kv_cache.device))
        return arrived

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
