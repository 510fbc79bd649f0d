"""The engine's side of the store (docs/engine.md): ask `Lookup` how much of a new prompt the
store holds, load those blocks into the paged KV cache instead of computing them (swap-in),
offload blocks as they fill (in the background: the step loop never waits on the store), swap
a preempted sequence's blocks out, and pre-warm from the L4 hot set at start.

The store is an accelerator, never a dependency of correctness: any store error turns the
connector off (logged once), the engine keeps serving by recomputing, and a background thread
turns it back on once the daemon answers its health check again. Blocks that fail to load are
recomputed from the first failure on.

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

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.client import TLS, KVStoreClient
from kvstore.client.errors import KVStoreError
from kvstore.client.retry import Retry
from kvstore.engine.errors import InvalidRequestError
from kvstore.kernels import KernelOps
from kvstore.kernels.reference import staging_shape
from kvstore.keys import BlockKey, prefix_keys

logger = logging.getLogger("kvstore.engine.connector")



@dataclass
class _Batch:
    keys: list[BlockKey]
    rows: list[np.ndarray]
    parent: BlockKey | None


@dataclass
class ConnectorStats:
    lookups: int = 0
    lookup_hit_blocks: int = 0
    loaded_blocks: int = 0
    load_failures: int = 0
    offloaded_blocks: int = 0
    offload_dropped_blocks: int = 0
    swapped_out_blocks: int = 0
    prewarmed_blocks: int = 0
    errors: int = 0


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
        self.stats = ConnectorStats()
        # One attempt: a slow or dead store must cost a step at most timeout_s, once; the
        # reconnect thread does the retrying.
        try:
            self.client = KVStoreClient(target, namespace, timeout_s=timeout_s,
                                        retry=Retry(attempts=1), token=token, tls=tls,
                                        unix_socket=unix_socket)
        except KVStoreError as exc:  # a malformed token, an unreadable certificate: config
            raise InvalidRequestError(f"store {target}: {exc}") from None
        self._up = threading.Event()
        self._up.set()
        self._closing = threading.Event()
        self._reconnect_s = reconnect_s
        self._lock = threading.Lock()
        self._pending: dict[BlockKey, np.ndarray] = {}  # offloads in flight, readable by loads
        self._queue: queue.Queue[_Batch | None] = queue.Queue(maxsize=max_pending_batches)
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload", daemon=True)
        self._writer.start()
        self._watcher: threading.Thread | None = None

    # -- availability ---------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return self._up.is_set()

    def _failed(self, what: str, exc: BaseException) -> None:
        self.stats.errors += 1
        with self._lock:
            if not self._up.is_set():
                return
            self._up.clear()
            logger.warning("kvstore: %s failed (%s); recomputing until the store is back",
                           what, exc)
            if self._closing.is_set():
                return
            self._watcher = threading.Thread(target=self._reconnect, name="kv-reconnect",
                                             daemon=True)
            self._watcher.start()

    def _reconnect(self) -> None:
        while not self._closing.wait(self._reconnect_s):
            try:
                if self.client.health() == "SERVING":
                    logger.warning("kvstore: the store answers again; using it")
                    self._up.set()
                    return
            except KVStoreError as exc:
                logger.debug("kvstore: still unreachable: %s", exc)

    # -- admission: lookup and swap-in ----------------------------------------------------
    def keys_for(self, token_ids: Sequence[int], num_blocks: int) -> list[BlockKey]:
        return prefix_keys(token_ids[: num_blocks * self.block_size], self.block_size,
                           self.namespace)

    def matched_tokens(self, token_ids: Sequence[int], local_tokens: int) -> int:
        """How many tokens past local_tokens (a block multiple) the store holds for this
        prefix, leaving at least the last token to compute. 0 when the store is off."""
        max_blocks = (len(token_ids) - 1) // self.block_size
        first = local_tokens // self.block_size
        if not self.available or max_blocks <= first:
            return 0
        # A chain may start anywhere: ask only for the blocks past the local hit.
        keys = self.keys_for(token_ids, max_blocks)[first:]
        self.stats.lookups += 1
        with self._lock:
            pending = 0
            while pending < len(keys) and keys[pending] in self._pending:
                pending += 1
        try:
            found = int(self.client.lookup(keys).prefix_length)
        except KVStoreError as exc:
            self._failed("Lookup", exc)
            found = 0
        hit = max(found, pending)
        self.stats.lookup_hit_blocks += hit
        return hit * self.block_size

    def load(self, token_ids: Sequence[int], first_block: int, block_ids: Sequence[int]) -> int:
        """Load blocks first_block.. of token_ids' chain into block_ids of the KV cache; returns
        how many leading blocks arrived whole (the rest must be recomputed)."""
        if not block_ids:
            return 0
        keys = self.keys_for(token_ids, first_block + len(block_ids))[first_block:]
        staging = self._staging(len(keys))
        rows = _byte_rows(staging)
        arrived = self._from_pending(keys, rows)
        if arrived < len(keys) and self.available:
            try:
                sizes = self.client.get_into(keys[arrived:], rows[arrived:])
            except KVStoreError as exc:
                self._failed("Get", exc)
                sizes = []
            want = rows[0].nbytes
            for size in sizes:
                if size != want:
                    break
                arrived += 1
        if arrived < len(keys):
            self.stats.load_failures += 1
        if arrived:
            ids = torch.tensor(list(block_ids[:arrived]), dtype=torch.int64)
            self.ops.scatter_blocks(staging[:arrived], self.kv_cache,
                                    ids.to(self.kv_cache.device))
        self.stats.loaded_blocks += arrived
        return arrived

    def _from_pending(self, keys: list[BlockKey], rows: list[np.ndarray]) -> int:
        with self._lock:
            count = 0
            for key, row in zip(keys, rows, strict=True):
                data = self._pending.get(key)
                if data is None:
                    break
                row[:] = data
                count += 1
        return count

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
        if not self.available:
            self.stats.offload_dropped_blocks += len(keys)
            return False
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self.kv_cache.device)
        staging = self._staging(len(keys))
        self.ops.gather_blocks(self.kv_cache, ids, out=staging)
        rows = _byte_rows(staging)
        batch = _Batch(list(keys), rows, parent)
        with self._lock:
            for key, row in zip(keys, rows, strict=True):
                self._pending[key] = row
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self._settle(batch.keys)
            self.stats.offload_dropped_blocks += len(keys)
            return False
        return True

    def swap_out(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> bool:
        """A preempted sequence's full blocks, before its block ids are reused."""
        stored = self.offload(keys, block_ids, None)
        if stored:
            self.stats.swapped_out_blocks += len(keys)
        return stored

    def _settle(self, keys: list[BlockKey]) -> None:
        with self._lock:
            for key in keys:
                self._pending.pop(key, None)

    def _write_loop(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            keys = batch.keys
            try:
                if self.available:
                    self.client.put(keys, batch.rows, parent=batch.parent)
                    self.stats.offloaded_blocks += len(keys)
                else:
                    self.stats.offload_dropped_blocks += len(keys)
            except KVStoreError as exc:
                self.stats.offload_dropped_blocks += len(keys)
                self._failed("Put", exc)
            finally:
                self._settle(keys)
                self._queue.task_done()

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every queued offload reached the store (or was dropped)."""
        done = threading.Event()

        def wait() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        done.wait(timeout_s)

    # -- pre-warm -------------------------------------------------------------------------
    def prewarm(self, num_bytes: int = 0) -> int:
        """Ask the daemon to pull this namespace's hottest L4 blocks into its local tiers, so
        the first requests hit. Returns the blocks brought in (0 when L4 is off)."""
        try:
            result = self.client.prewarm(num_bytes, [self.namespace], timeout_s=60.0)
        except KVStoreError as exc:
            logger.info("kvstore: no pre-warm (%s)", exc)
            return 0
        self.stats.prewarmed_blocks += result.blocks
        return int(result.blocks)

    def close(self) -> None:
        self._closing.set()
        self.flush(timeout_s=10.0)
        self._queue.put(None)
        self._writer.join(timeout=10.0)
        self.client.close()
