"""A client's lookup through a read table (client/_readtable.py TableReads.lookup), over a
real table in a memfd written by the daemon's TableWriter and mapped read-only as a client
maps it: the prefix and each key's tier name, the same with the native probe and with numpy,
for one tier, mixed tiers, a miss, another namespace, a retired table, a lookup longer than
the rows a thread keeps, and lookups on many threads at once."""

from __future__ import annotations

import hashlib
import mmap
import os
import secrets
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore import native, shm
from kvstore.client._readtable import PROBE_ROWS_KEPT, MappedTable, TableReads
from kvstore.client._segment import SharedSegment
from kvstore.client.results import TIER_NAMES
from kvstore.readtable import Record, TableWriter, capacity_for, namespace_hash, table_bytes

NAMESPACE = "team-a/llama"
NS = namespace_hash(NAMESPACE)
DRAM, NVME = 2, 3  # tier numbers as a location word holds them


def keys(n: int, salt: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{salt}{i}".encode()).digest() for i in range(n)]


@pytest.fixture(params=["native", "numpy"])
def helper(request: pytest.FixtureRequest) -> Iterator[str]:
    """The lookup's probe with the native helper (kvstore/native), then with numpy."""
    was = native.LIB
    if request.param == "native" and native.load() is None:
        pytest.skip("the native helper is not built (`make native`)")
    native.use_native(request.param == "native")
    yield str(request.param)
    native.LIB = was


class Table:
    """A table the writer fills, mapped read-only from its memfd, and an L2 segment."""

    def __init__(self, max_entries: int) -> None:
        capacity = capacity_for(max_entries)
        size = table_bytes(capacity)
        self.fd = os.memfd_create("kvstore-test-table")
        os.ftruncate(self.fd, size)
        self._memory = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
        self.writer = TableWriter(memoryview(self._memory), capacity, 1 << 30,
                                  np.random.default_rng(7))
        self._arena = shm.create_segment(f"kvstore-test-{os.getpid()}-{secrets.token_hex(4)}",
                                         1 << 20)
        self.segment = SharedSegment(self._arena)
        self.reads = TableReads(MappedTable("arena", self.fd, size), self.segment)

    def put(self, ks: list[bytes], tier: int = DRAM, namespace: int = NS) -> None:
        for i, k in enumerate(ks):
            self.writer.put((namespace, k), Record(offset=i * 4096, length=100, tier=tier,
                                                   checksum=i))

    def lookup(self, ks: list[bytes]) -> tuple[int, list[str | None]] | None:
        found: tuple[int, list[str | None]] | None = self.reads.lookup(NAMESPACE, ks, 16, None)
        return found

    def close(self) -> None:
        self.reads.close()
        self.segment.close()
        self._arena.unlink()
        self._arena.close()
        del self.writer  # its arrays export the mapping until they go
        self._memory.close()
        os.close(self.fd)


@pytest.fixture
def table() -> Iterator[Table]:
    t = Table(PROBE_ROWS_KEPT * 3)
    yield t
    t.close()


def test_a_cached_chain_is_found_whole_with_its_tier(helper: str, table: Table) -> None:
    ks = keys(1024)
    table.put(ks)
    assert table.lookup(ks) == (1024, [TIER_NAMES[DRAM]] * 1024)
    assert table.reads.reports.pending  # the lookup's count waits to be reported


def test_keys_joined_by_the_caller_are_probed_as_given(helper: str, table: Table) -> None:
    ks = keys(40)
    table.put(ks[:30])
    joined = b"".join(ks)
    assert table.reads.lookup(NAMESPACE, ks, 16, None, joined) == (30, [TIER_NAMES[DRAM]] * 30)
    # The probe reads the joined bytes, not the list: a caller's join is what it answers.
    others = b"".join(keys(40, salt="never put"))
    assert table.reads.lookup(NAMESPACE, ks, 16, None, others) == (0, [])


def test_the_prefix_stops_at_the_first_key_the_table_does_not_show(helper: str,
                                                                    table: Table) -> None:
    ks = keys(50)
    table.put(ks[:20] + ks[21:])
    assert table.lookup(ks) == (20, [TIER_NAMES[DRAM]] * 20)
    assert table.lookup(keys(3, salt="never put")) == (0, [])
    assert table.lookup([]) == (0, [])


def test_mixed_tiers_are_named_key_by_key(helper: str, table: Table) -> None:
    ks = keys(10)
    table.put(ks[:4], tier=DRAM)
    table.put(ks[4:7], tier=NVME)
    table.put(ks[7:], tier=DRAM)
    names = [TIER_NAMES[DRAM]] * 4 + [TIER_NAMES[NVME]] * 3 + [TIER_NAMES[DRAM]] * 3
    assert table.lookup(ks) == (10, names)
    assert TIER_NAMES[DRAM] != TIER_NAMES[NVME]


def test_another_namespaces_keys_are_misses(helper: str, table: Table) -> None:
    ks = keys(8)
    table.put(ks, namespace=namespace_hash("team-b/llama"))
    assert table.lookup(ks) == (0, [])


def test_keys_that_are_not_32_bytes_each_are_not_probed(helper: str, table: Table) -> None:
    ks = keys(4)
    table.put(ks)
    assert table.lookup([ks[0], ks[1][:16]]) is None


def test_a_retired_table_is_not_read(helper: str, table: Table) -> None:
    ks = keys(4)
    table.put(ks)
    table.writer.retire()
    assert table.lookup(ks) is None


def test_a_lookup_longer_than_the_kept_rows_is_found_whole(helper: str, table: Table) -> None:
    ks = keys(PROBE_ROWS_KEPT * 2 + 3)
    table.put(ks)
    assert table.lookup(ks) == (len(ks), [TIER_NAMES[DRAM]] * len(ks))
    short = ks[:5]
    assert table.lookup(short) == (5, [TIER_NAMES[DRAM]] * 5)  # kept rows still right after


def test_lookups_on_many_threads_each_get_their_own_answer(helper: str, table: Table) -> None:
    ks = keys(3000)
    table.put(ks)
    wrong: list[tuple[int, object]] = []
    start = threading.Barrier(6)

    def worker(t: int) -> None:
        start.wait()
        for round_ in range(200):
            n = 1 + (t * 997 + round_ * 131) % len(ks)
            hole = n // 2  # every other round a miss at its middle, so prefixes differ
            asked = ks[:n] if round_ % 2 else [*ks[:hole], b"\x01" * 32, *ks[hole + 1:n]]
            want = n if round_ % 2 else hole
            got = table.lookup(asked)
            if got != (want, [TIER_NAMES[DRAM]] * want):
                wrong.append((t, got))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []
