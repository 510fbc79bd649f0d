"""Many clients at once: the daemon serves RPCs on a thread pool, so puts, reads, lookups
and evictions from several threads interleave inside the store. Every block read back must
still be bit-exact, and nothing may be left leased or reserved."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable

import numpy as np

from kvstore.client import KVStoreClient, prefix_keys
from kvstore.tools.testing import Daemon

BLOCK_BYTES = 96 * 1024


def payload(key: bytes) -> bytes:
    return hashlib.shake_256(key).digest(BLOCK_BYTES)


def worker(target: str, n: int, shared_memory: bool, errors: list[str]) -> None:
    ns = "concurrency"
    try:
        with KVStoreClient(target, ns, shared_memory=shared_memory) as kv:
            for round_ in range(12):
                # A prefix shared by every worker, then blocks of this worker's own.
                tokens = list(range(64)) + [n * 1000 + round_ * 10 + i for i in range(48)]
                keys = prefix_keys(tokens, 16, ns)
                hit = kv.lookup(keys).prefix_length
                kv.put(keys[hit:], [payload(k) for k in keys[hit:]],
                       parent=keys[hit - 1] if hit else None)
                buffers = [np.empty(BLOCK_BYTES, np.uint8) for _ in keys]
                sizes = kv.get_into(keys, buffers)
                for key, size, buf in zip(keys, sizes, buffers, strict=True):
                    # A block may be evicted by another worker's puts (a miss), never wrong.
                    if size is not None and bytes(buf) != payload(key):
                        errors.append(f"worker {n}: block {key.hex()[:12]} came back wrong")
                if round_ % 4 == 3:
                    kv.evict(bytes=BLOCK_BYTES * 4)
    except Exception as exc:  # reported by the test below, with the worker that hit it
        errors.append(f"worker {n}: {type(exc).__name__}: {exc}")


def test_concurrent_clients_read_only_exact_blocks(
    daemon_factory: Callable[..., Daemon],
) -> None:
    # Six threads of one host are one client, whose six streams and puts in flight (half of
    # this tiny L2) pass the per-client caps: lifted, since what is tested is interleaving.
    daemon = daemon_factory("dram.capacity_bytes=4MiB", "dram.page_size_bytes=32KiB",
                            "clients.max_reserved_share=1", "clients.max_streams=6")
    errors: list[str] = []
    threads = [threading.Thread(target=worker, args=(daemon.target, n, n % 2 == 0, errors))
               for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, "\n".join(errors)
    with KVStoreClient(daemon.target, "concurrency") as kv:
        stats = kv.stats()
    assert stats.leases == 0 and stats.reservations == 0
    dram = stats.tier("dram")
    assert dram is not None and dram.evictions > 0  # the small tier was under real pressure
