"""The tier hierarchy through a real daemon and real gRPC: puts under sustained pressure
demote instead of evicting, Prefetch streams progress and honours its deadline, Get promotes
L3 hits, and the L1 and mover settings fail loudly where they must."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import FailedPrecondition, KVStoreClient
from kvstore.client.results import TierStats
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.tools.testing import Daemon, free_port
from tests.helpers import blocks, wait_until

SMALL = ("dram.capacity_bytes=2MiB", "dram.page_size_bytes=64KiB", "nvme.capacity_bytes=16MiB",
         "nvme.page_size_bytes=64KiB", "movers.interval_s=0.02")


@pytest.fixture
def small(shared_daemon: Callable[..., Daemon]) -> Daemon:
    """The session's daemon of SMALL tiers, emptied before each test: the tests here fill
    both tiers and read what the tiers hold."""
    d = shared_daemon(*SMALL)
    with KVStoreClient(d.target, "tiering-daemon", shared_memory=False) as kv:
        kv.evict(all=True, namespace="")
        wait_until(lambda: all(t.objects == 0 for t in tiers(kv)), "an empty store")
    return d


def tiers(kv: KVStoreClient) -> tuple[TierStats, TierStats]:
    """The daemon's L2 and L3 rows."""
    s = kv.stats()
    dram, nvme = s.tier("dram"), s.tier("nvme")
    assert dram is not None and nvme is not None
    return dram, nvme


def test_sustained_puts_demote_to_l3_instead_of_evicting(small: Daemon, ns: str) -> None:
    keys, values = blocks(96, seed=1)  # three times L2
    with KVStoreClient(small.target, ns) as kv:
        was_dram, was_nvme = tiers(kv)  # its counters are the session's: read as deltas
        for i in range(0, 96, 8):
            result = kv.put(keys[i : i + 8], values[i : i + 8], independent=True)
            assert (result.stored, result.evicted) == (8, 0)
        dram, nvme = tiers(kv)
        assert (dram.evictions, nvme.evictions) == (was_dram.evictions, was_nvme.evictions)
        assert dram.demotions - was_dram.demotions == nvme.objects > 0
        assert dram.objects + nvme.objects == 96
        assert nvme.backend == "posix"
        for i in range(0, 96, 8):  # L3 hits come back through L2, bit-exact
            assert kv.get(keys[i : i + 8]) == values[i : i + 8]
        assert tiers(kv)[0].promotions > dram.promotions


def test_prefetch_streams_progress_and_get_then_finds_l2(small: Daemon, ns: str) -> None:
    keys, values = blocks(40, seed=2)
    with KVStoreClient(small.target, ns) as kv:
        kv.put(keys[:8], values[:8])  # a chain of 8, then pressure pushes it to L3
        for i in range(8, 40, 8):
            kv.put(keys[i : i + 8], values[i : i + 8], independent=True)
        wait_until(lambda: kv.lookup(keys[:8]).tiers == ["nvme"] * 8, "the chain in L3")
        seen: list[int] = []
        result = kv.prefetch([*keys[:8], b"\x01" * 32], tier="dram",
                             on_progress=lambda p: seen.append(p.prefix_length))
        assert (result.done, result.missing, result.failed, result.total) == (8, 1, 0, 9)
        assert (result.prefix_length, result.deadline_exceeded) == (8, False)
        assert seen == sorted(seen) and seen[-1] == 8 and len(seen) > 1
        assert kv.lookup(keys[:8]).tiers == ["dram"] * 8
        assert kv.get(keys[:8]) == values[:8]


def test_prefetch_past_its_deadline_returns_the_ready_prefix(small: Daemon, ns: str) -> None:
    keys, values = blocks(40, seed=3)
    with KVStoreClient(small.target, ns) as kv:
        kv.put(keys[:16], values[:16])
        for i in range(16, 40, 8):
            kv.put(keys[i : i + 8], values[i : i + 8], independent=True)
        wait_until(lambda: kv.lookup(keys[:16]).tiers[:8] == ["nvme"] * 8, "the head in L3")
        result = kv.prefetch(keys[:16], tier="dram", deadline_s=0.001)
        assert result.deadline_exceeded and result.prefix_length < 16
        tiers = kv.lookup(keys[:16]).tiers
        assert tiers[: result.prefix_length] == ["dram"] * result.prefix_length


def test_prefetch_to_l1_without_a_gpu_is_a_failed_precondition(small: Daemon, ns: str) -> None:
    keys, _ = blocks(1, seed=4)
    with KVStoreClient(small.target, ns) as kv, pytest.raises(FailedPrecondition, match="hbm"):
        kv.prefetch(keys, tier="hbm")


def test_demanding_l1_without_cuda_stops_the_daemon_with_the_setting_named(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torch")
    from kvstore.tiers.hbm import cuda_available

    if cuda_available():
        pytest.skip("this host has CUDA: hbm.mode=on starts")
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.daemon.server", "--port", str(free_port()), "--set",
         "hbm.mode=on", "--set", f"nvme.dir={tmp_path}", "--set", "metrics.enabled=false"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2
    assert "hbm.mode" in done.stderr and "cannot start" in done.stderr


def test_a_mover_that_fails_marks_the_daemon_not_serving(
    daemon_factory: Callable[..., Daemon], tmp_path: Path,
) -> None:
    l3 = tmp_path / "mover-l3"
    d = daemon_factory(*SMALL, f"nvme.dir={l3}", "nvme.compact_after_records=1")
    keys, values = blocks(32, seed=5)
    with KVStoreClient(d.target, "mover") as kv:
        assert kv.health() == "SERVING"
        shutil.rmtree(l3)  # the manifest can no longer be snapshotted
        for i in range(0, 32, 8):
            kv.put(keys[i : i + 8], values[i : i + 8], independent=True)
        wait_until(lambda: kv.health() == "NOT_SERVING", "health NOT_SERVING")
    assert "the tier mover failed" in d.log()


def test_a_prefetch_the_client_cancels_stops_loading(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Over real gRPC: cancel the stream after its first message; the daemon starts no more
    loads (at most the few in flight finish), so most of the chain stays in L3."""
    d = daemon_factory("dram.capacity_bytes=16MiB", "dram.page_size_bytes=64KiB",
                       "nvme.capacity_bytes=64MiB", "nvme.page_size_bytes=64KiB",
                       "movers.interval_s=0.02", "movers.low_watermark=0.25",
                       "nvme.io_threads=1")
    rng = np.random.default_rng(6)
    keys = [rng.bytes(32) for _ in range(32)]
    values = [rng.bytes(512 << 10) for _ in range(32)]
    with KVStoreClient(d.target, "cancel") as kv:
        kv.put(keys[:12], values[:12])  # the chain: 6 MiB
        for i in range(12, 32, 4):  # 10 MiB of fillers fill L2: the mover demotes the chain
            kv.put(keys[i : i + 4], values[i : i + 4], independent=True)
        wait_until(lambda: kv.lookup(keys[:12]).tiers == ["nvme"] * 12, "the chain in L3")
        before = kv.stats().tier("dram").promotions  # type: ignore[union-attr]
        stub = pb_grpc.KVStoreStub(kv._channel)
        call = stub.Prefetch(pb.PrefetchRequest(namespace="cancel", keys=keys[:12],
                                                target_tier=pb.TIER_DRAM), timeout=30)
        next(call)
        call.cancel()
        time.sleep(0.5)  # whatever was in flight lands; nothing new may start
        promoted = kv.stats().tier("dram").promotions - before  # type: ignore[union-attr]
        assert 0 < promoted < 12
        assert kv.lookup(keys[:12]).tiers.count("nvme") == 12 - promoted
