"""Eviction in a real daemon with a 16-page L2 (1 MiB of 64 KiB pages), one page per block:
leaf-first LRU order, hot blocks (read again) outliving cold ones, pins, the three evict
modes, and namespace isolation. Each test names its blocks with letters and asserts exactly
which are still cached after every step. Each test has its own namespace: the index
remembers keys it removed lately and a key put again soon after is hot, so names reused
across tests would carry that over."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.client import FailedPrecondition, KVStoreClient, ResourceExhausted
from kvstore.tools.testing import Daemon, start_daemon
from tests.conftest import SIXTEEN_PAGES

PAGE = 64 << 10
NUM_PAGES = 16


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A 16-page daemon of this module's own (clients.max_pinned_share=1: the one client
    here pins the whole tier on purpose), emptied before each test by empty_store. Not the
    session's shared one: the eviction order learns from the workload (the head start of
    blocks used again, kvstore.core.headstart), so what other modules' tests did on a shared
    daemon changed which block went first here (test_leases.py before this file failed two
    tests)."""
    d = start_daemon(tmp_path_factory.mktemp("eviction"), *SIXTEEN_PAGES)
    yield d
    d.stop()


@pytest.fixture(autouse=True)
def empty_store(daemon: Daemon) -> None:
    with KVStoreClient(daemon.target, "cleanup", shared_memory=False) as kv:
        kv.evict(all=True, namespace="")
        s = kv.stats()
        dram = s.tier("dram")
        assert dram is not None
        assert (dram.objects, dram.free_pages, s.pinned, s.leases) == (0, NUM_PAGES, 0, 0)


@pytest.fixture
def kv(daemon: Daemon, ns: str) -> Iterator[KVStoreClient]:
    with KVStoreClient(daemon.target, ns, shared_memory=False) as client:
        yield client


class Blocks:
    """Blocks named by strings; the key and one page of bytes derive from the name."""

    def key(self, name: str) -> bytes:
        return np.random.default_rng(list(name.encode())).bytes(32)

    def value(self, name: str) -> bytes:
        return np.random.default_rng([*name.encode(), 1]).bytes(PAGE)

    def put(self, kv: KVStoreClient, names: str | list[str], *, independent: bool = False,
            parent: str | None = None) -> int:
        """Put the blocks (a chain unless independent); the number the daemon evicted."""
        names = list(names) if isinstance(names, str) else names
        result = kv.put([self.key(n) for n in names], [self.value(n) for n in names],
                        independent=independent,
                        parent=None if parent is None else self.key(parent))
        assert (result.stored, result.existing) == (len(names), 0)
        return result.evicted

    def cached(self, kv: KVStoreClient, names: list[str]) -> list[str]:
        tiers = kv.lookup([self.key(n) for n in names]).tiers
        return [n for n, t in zip(names, tiers, strict=True) if t == "dram"]

    def touch(self, kv: KVStoreClient, names: str) -> None:
        assert kv.get([self.key(n) for n in names]) == [self.value(n) for n in names]


B = Blocks()
FILLERS = [f"f{i}" for i in range(11)]


def test_full_tier_evicts_least_recently_used_leaves_first(kv: KVStoreClient) -> None:
    B.put(kv, "DE", independent=True)  # D and E are the least recently used
    B.put(kv, "ABC")  # chain A -> B -> C
    assert B.put(kv, FILLERS, independent=True) == 0  # 16 of 16 pages used
    assert kv.stats().tier("dram").free_pages == 0  # type: ignore[union-attr]
    everything = [*"ABCDE", *FILLERS]

    # A is older than C, but A and B have cached children: the chain goes from its leaf.
    expected_gone = ["D", "E", "C", "B", "A", "f0"]
    for i, victim in enumerate(expected_gone):
        assert B.put(kv, [f"g{i}"]) == 1, f"put g{i} should evict exactly {victim}"
        survivors = [n for n in everything if n not in expected_gone[: i + 1]]
        assert B.cached(kv, everything) == survivors, f"after put g{i}"

    evictions = kv.stats().tier("dram").evictions  # type: ignore[union-attr]
    assert B.put(kv, "HI") == 2  # a chain of two needs two pages: f1, f2 go
    assert B.cached(kv, everything) == FILLERS[3:]
    assert kv.stats().tier("dram").evictions == evictions + 2  # type: ignore[union-attr]


def test_a_parent_outlives_its_child_even_when_it_is_older(kv: KVStoreClient) -> None:
    B.put(kv, "P")
    B.put(kv, "Q", parent="P")  # P -> Q, Q stored later than P
    B.put(kv, [f"f{i}" for i in range(14)], independent=True)
    B.touch(kv, "Q")  # the child is the most recently used block of all, and hot
    assert B.put(kv, ["g0"]) == 1
    assert B.cached(kv, ["P", "Q", "f0"]) == ["P", "Q"]  # f0 went: P still has a child
    assert kv.evict(bytes=13 * PAGE).evicted == 13  # f1..f13
    assert B.cached(kv, ["P", "Q", "g0"]) == ["P", "Q", "g0"]
    assert kv.evict(bytes=1).evicted == 1
    assert B.cached(kv, ["P", "Q", "g0"]) == ["P", "Q"]  # g0, used once, before hot Q
    assert kv.evict(bytes=1).evicted == 1
    assert B.cached(kv, ["P", "Q"]) == ["P"]  # the leaf Q, not its older parent
    assert kv.evict(bytes=1).evicted == 1
    assert B.cached(kv, ["P"]) == []


def test_a_parent_stored_after_its_cached_child_still_outlives_it(kv: KVStoreClient) -> None:
    B.put(kv, "D", parent="C")  # a child stored before its parent ...
    B.put(kv, "C")  # ... which arrives later
    B.put(kv, "AB")  # A -> B
    B.touch(kv, "BD")  # recency now: C, A, B, D; A and C are parents of cached blocks
    # One at a time: B (the oldest leaf), then A (a leaf now, older than D), D, C.
    for survivors in (["A", "C", "D"], ["C", "D"], ["C"], []):
        assert kv.evict(bytes=1).evicted == 1
        assert B.cached(kv, list("ABCD")) == survivors


def test_pinned_blocks_survive_pressure_and_a_fully_pinned_tier_refuses_puts(
    kv: KVStoreClient,
) -> None:
    old = [f"k{i}" for i in range(16)]
    B.put(kv, old, independent=True)
    pinned = old[:8]  # the eight least recently used
    assert kv.pin([B.key(n) for n in pinned]).changed == 8
    assert kv.pin([B.key(n) for n in pinned[:2]]).changed == 0  # already pinned
    assert kv.pin([B.key("nope")]).missing == 1
    assert kv.stats().pinned == 8

    new = [f"n{i}" for i in range(8)]
    assert B.put(kv, new, independent=True) == 8
    assert B.cached(kv, old + new) == pinned + new  # k8..k15 went instead of k0..k7

    assert kv.pin([B.key(n) for n in new]).changed == 8  # now all 16 pages are pinned
    with pytest.raises(ResourceExhausted) as info:
        B.put(kv, ["x"])
    message = str(info.value)
    assert "sizes need 1 pages (64.0 KiB)" in message, message
    assert "dram.capacity_bytes" in message, message
    with pytest.raises(ResourceExhausted, match=r"sizes need 2 pages \(128.0 KiB\)"):
        kv.put([B.key("y")], [b"\x01" * (PAGE + 1)])
    assert B.cached(kv, old + new) == pinned + new
    everything = kv.evict(all=True)
    assert (everything.evicted, everything.skipped) == (0, 16)

    assert kv.unpin([B.key(n) for n in pinned[:3]]).changed == 3
    assert kv.stats().pinned == 13
    assert B.put(kv, ["x"]) == 1
    assert B.cached(kv, pinned[:3]) == pinned[1:3]  # k0, the oldest unpinned, went

    unpinned = kv.unpin([B.key(n) for n in pinned + new])  # k0 is gone, k1 and k2 unpinned
    assert (unpinned.changed, unpinned.missing) == (13, 1)
    assert kv.stats().pinned == 0
    everything = kv.evict(all=True)
    assert (everything.evicted, everything.evicted_bytes, everything.skipped) == (
        16, 16 * PAGE, 0)


def test_evict_by_keys_by_bytes_and_all(kv: KVStoreClient) -> None:
    B.put(kv, "ABC")  # A -> B -> C
    B.put(kv, "D")
    # keys: exactly these; a missing key is not an error; B's child C stays.
    # keys: these and their cached descendants (C without B could never be found by a lookup
    # of its prefix); a missing key is not an error.
    result = kv.evict([B.key("B"), B.key("missing")])
    assert (result.evicted, result.evicted_bytes, result.skipped) == (2, 2 * PAGE, 0)
    assert B.cached(kv, list("ABCD")) == ["A", "D"]
    B.touch(kv, "A")

    # bytes: at least that many, LRU leaf-first. D, then A (no cached child now).
    result = kv.evict(bytes=PAGE + 1)
    assert (result.evicted, result.evicted_bytes, result.skipped) == (2, 2 * PAGE, 0)
    assert B.cached(kv, list("ABCD")) == []

    # all: everything evictable; a pinned block and the parent it keeps are skipped, each
    # by its reason.
    B.put(kv, "EFG")  # E -> F -> G
    B.put(kv, "H")
    assert kv.pin([B.key("F")]).changed == 1
    result = kv.evict(all=True, tier="dram")
    assert (result.evicted, result.evicted_bytes, result.skipped) == (2, 2 * PAGE, 2)
    assert result.reasons == {"pinned": 1, "has_children": 1}
    assert B.cached(kv, list("EFGH")) == ["E", "F"]
    assert kv.unpin([B.key("F")]).changed == 1
    result = kv.evict(all=True)
    assert (result.evicted, result.skipped) == (2, 0)

    with pytest.raises(FailedPrecondition, match="nvme"):
        kv.evict(all=True, tier="nvme")


def test_namespaces_are_isolated(daemon: Daemon) -> None:
    with KVStoreClient(daemon.target, "tenant-a", shared_memory=False) as a, \
            KVStoreClient(daemon.target, "tenant-b", shared_memory=False) as b:
        key = B.key("same")
        assert a.put([key], [b"from a"]).stored == 1
        assert b.put([key], [b"from b"]).stored == 1  # a distinct entry, not "existing"
        assert a.get([key]) == [b"from a"]
        assert b.get([key]) == [b"from b"]
        assert a.stats(namespace="tenant-a").tier("dram").objects == 1  # type: ignore[union-attr]
        assert a.stats().tier("dram").objects == 2  # type: ignore[union-attr]

        # b's blocks are older, yet a byte eviction in a's namespace takes only a's.
        B.put(b, ["b1"])
        B.put(a, ["a1"])
        result = a.evict(bytes=1)
        assert result.evicted == 1
        assert a.lookup([key, B.key("a1")]).tiers == ["dram", None]  # a1: used once
        assert b.lookup([key, B.key("b1")]).tiers == ["dram", "dram"]

        result = a.evict(all=True)
        assert (result.evicted, result.skipped) == (1, 0)
        assert a.lookup([key]).tiers == [None]
        assert b.get([key]) == [b"from b"]
        assert b.evict([key]).evicted == 1
        assert b.lookup([B.key("b1")]).tiers == ["dram"]
        assert a.evict([B.key("b1")]).evicted == 0  # b1 is b's, not a's


# --- chain information survives the shared-memory put path ----------------------------------


def test_independent_put_through_shared_memory_stores_unrelated_blocks(
    daemon: Daemon, kv: KVStoreClient, ns: str,
) -> None:
    with KVStoreClient(daemon.target, ns, shared_memory=True) as shm:
        B.put(shm, "XY", independent=True)
        assert shm.uses_shared_memory is True
    assert kv.evict(bytes=1).evicted == 1
    assert B.cached(kv, ["X", "Y"]) == ["Y"]  # X is least recently used and has no child


def test_put_with_parent_through_shared_memory_links_to_the_parent(
    daemon: Daemon, kv: KVStoreClient, ns: str,
) -> None:
    B.put(kv, "P")
    with KVStoreClient(daemon.target, ns, shared_memory=True) as shm:
        B.put(shm, "Q", parent="P")
        assert shm.uses_shared_memory is True
    assert kv.evict(bytes=1).evicted == 1
    assert B.cached(kv, ["P", "Q"]) == ["P"]  # the leaf goes first, though P is older


# --- bugs ---------------------------------------------------------------------------------


def test_put_through_shared_memory_reports_what_it_evicted(
    daemon: Daemon, kv: KVStoreClient, ns: str,
) -> None:
    B.put(kv, [f"k{i}" for i in range(16)], independent=True)
    before = kv.stats().tier("dram").evictions  # type: ignore[union-attr]
    with KVStoreClient(daemon.target, ns, shared_memory=True) as shm:
        result = shm.put([B.key("x")], [B.value("x")])
        assert shm.uses_shared_memory is True
    assert kv.stats().tier("dram").evictions == before + 1  # type: ignore[union-attr]
    assert B.cached(kv, ["k0"]) == []
    assert result.evicted == 1


def test_a_put_refused_for_lack_of_room_evicts_nothing(kv: KVStoreClient) -> None:
    old = [f"k{i}" for i in range(16)]
    B.put(kv, old, independent=True)
    assert kv.pin([B.key(n) for n in old[:8]]).changed == 8
    evictions = kv.stats().tier("dram").evictions  # type: ignore[union-attr]
    with pytest.raises(ResourceExhausted, match="sizes need 12 pages"):
        kv.put([B.key("big")], [b"\x02" * (12 * PAGE)])  # fits the tier, not its 8 free pages
    try:
        assert kv.stats().tier("dram").evictions == evictions  # type: ignore[union-attr]
        assert B.cached(kv, old) == old
    finally:
        kv.unpin([B.key(n) for n in old[:8]])
