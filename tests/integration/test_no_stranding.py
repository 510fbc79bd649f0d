"""No stranded blocks through a real daemon with an L2 over an L3: every Evict form, a kill -9
that loses the L2 half of chains, and a pinned leaf under pressure each leave every cached
block reachable by a lookup of its prefix (docs/architecture.md, "No block is ever stranded").
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstore.client import KVStoreClient
from kvstore.keys import prefix_keys
from kvstore.tools.testing import Daemon, start_daemon
from kvstore.units import MiB

BLOCK = 16
SETTINGS = ("dram.capacity_bytes=64MiB", "nvme.capacity_bytes=256MiB", "movers.interval_s=0.01")


def chain(n: int, namespace: str, seed: int = 0) -> list[bytes]:
    return prefix_keys([seed * 1000 + i % 997 for i in range(n * BLOCK)], BLOCK, namespace)


def put_chain(kv: KVStoreClient, keys: list[bytes], block: bytes) -> None:
    """In batches of 8 MiB, each naming its parent (as an engine offloads), so the movers
    make room in L2 as the chain goes in."""
    for i in range(0, len(keys), 8):
        kv.put(keys[i:i + 8], [block] * len(keys[i:i + 8]), parent=keys[i - 1] if i else None)


def shape(tiers: list[str | None]) -> str:
    """Run-length form, as in the issue: "nvme x90, dram x37, ..."."""
    runs: list[list[object]] = []
    for tier in tiers:
        if runs and runs[-1][0] == tier:
            runs[-1][1] += 1  # type: ignore[operator]
        else:
            runs.append([tier, 1])
    return ", ".join(f"{t or 'miss'} x{n}" for t, n in runs)


def assert_reachable(kv: KVStoreClient, keys: list[bytes]) -> int:
    """Nothing cached after the first miss: every cached block of the chain is reachable by
    a lookup of its prefix. Returns how many are cached."""
    tiers = kv.lookup(keys).tiers
    hit = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
    assert all(t is None for t in tiers[hit:]), f"stranded: {shape(tiers)}"
    return hit


def settle(kv: KVStoreClient, keys: list[bytes], timeout_s: float = 20.0) -> list[str | None]:
    """The tiers once the movers stopped moving the chain."""
    deadline = time.monotonic() + timeout_s
    last = kv.lookup(keys).tiers
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = kv.lookup(keys).tiers
        if now == last:
            return now
        last = now
    return last


@pytest.fixture
def two_tiers(shared_daemon: Callable[..., Daemon]) -> Daemon:
    """The session's daemon of SETTINGS: each test fills both tiers in a namespace of its own
    (`ns`), which is evicted when it ends, and unpins what it pinned."""
    return shared_daemon(*SETTINGS)


def test_every_evict_form_leaves_the_150_block_chain_reachable(two_tiers: Daemon,
                                                               ns: str) -> None:
    keys = chain(150, ns)
    block = b"\x5a" * MiB
    with KVStoreClient(two_tiers.target, ns) as kv:
        put_chain(kv, keys, block)  # 150 MiB: more than L2, so L3 takes a part
        settle(kv, keys)
        kv.get(keys[127:130])  # read the middle back up: L2 and L3 runs interleave
        tiers = settle(kv, keys)
        assert {"dram", "nvme"} <= set(tiers), shape(tiers)
        assert assert_reachable(kv, keys) == 150

        kv.evict(bytes=10 * MiB)  # pressure from the tail, never a hole in the middle
        assert assert_reachable(kv, keys) == 140

        freed = kv.evict(bytes=10 * MiB, tier="nvme")
        after = assert_reachable(kv, keys)
        assert freed.evicted == 0 or after < 140
        if freed.evicted_bytes < 10 * MiB:  # it said why it stopped short
            assert freed.skipped > 0 and freed.reasons

        rest = kv.evict(all=True, tier="nvme")
        assert_reachable(kv, keys)
        left = Counter(kv.lookup(keys).tiers)
        if left["nvme"]:  # L3 blocks left are the prefix of L2 blocks, and say so
            assert rest.reasons.get("child_in_faster_tier", 0) > 0, rest

        everything = kv.evict(all=True)
        assert everything.skipped == 0
        assert kv.lookup(keys).tiers == [None] * 150


def test_evict_by_key_takes_the_descendants_in_every_tier(two_tiers: Daemon, ns: str) -> None:
    keys = chain(100, ns, seed=1)
    with KVStoreClient(two_tiers.target, ns) as kv:
        put_chain(kv, keys, b"\x11" * MiB)
        settle(kv, keys)
        result = kv.evict([keys[40]])
        assert result.evicted == 60 and result.skipped == 0
        assert kv.lookup(keys).tiers[40:] == [None] * 60
        assert assert_reachable(kv, keys) == 40


def test_a_pinned_leaf_keeps_its_whole_prefix(two_tiers: Daemon, ns: str) -> None:
    keys = chain(20, ns, seed=2)
    with KVStoreClient(two_tiers.target, ns) as kv:
        put_chain(kv, keys, b"\x22" * MiB)
        assert kv.pin([keys[-1]]).changed == 1
        try:
            assert kv.evict([keys[5]]).reasons == {"pinned": 1}  # its tree holds the pin
            for round_ in range(4):  # 4 x 100 MiB of other chains: pressure on both tiers
                other = chain(100, ns, seed=10 + round_)
                put_chain(kv, other, b"\x33" * MiB)
            deadline = time.monotonic() + 20.0
            while (everything := kv.evict(all=True)).skipped > 20:  # moves still in flight
                assert time.monotonic() < deadline, everything
                time.sleep(0.1)
            assert everything.reasons == {"pinned": 1, "has_children": 19}
            assert assert_reachable(kv, keys) == 20
        finally:
            kv.unpin([keys[-1]])  # the `ns` fixture evicts what is left, but never a pin


def test_a_restart_after_kill_9_drops_l3_blocks_whose_prefix_lived_in_l2(
        tmp_path: Path, ns: str) -> None:
    keys = chain(100, ns, seed=3)
    first = start_daemon(tmp_path, *SETTINGS)
    try:
        with KVStoreClient(first.target, ns) as kv:
            put_chain(kv, keys, b"\x44" * MiB)
            tiers = settle(kv, keys)
            assert tiers[0] == "dram" and "nvme" in tiers, shape(tiers)  # head in L2
        first.proc.kill()  # kill -9: L2 is gone, the manifest lists the L3 tail
        first.proc.wait()
    finally:
        first.stop()
    port_dir = next(tmp_path.glob("l3-*"))
    second = start_daemon(tmp_path, *SETTINGS, f"nvme.dir={port_dir}")
    try:
        with KVStoreClient(second.target, ns) as kv:
            assert kv.lookup(keys).tiers == [None] * 100  # nothing stranded was kept
            assert kv.stats().tier("nvme").objects == 0  # type: ignore[union-attr]
        assert "whose prefix is gone" in second.log()
    finally:
        second.stop()
