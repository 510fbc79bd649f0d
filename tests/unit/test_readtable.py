"""The read table's layout (kvstore/readtable.py): a writer and a view over the same bytes, as
the daemon and a client share them. Every key put is found where it was put, a key removed or
changed is seen to have changed by a reader who probed it before (the seqlock), a slot caught
mid-change reads as a miss, and the writer never takes what the shared bytes say for its own
decisions."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvstore.readtable import (
    HEADER_BYTES,
    MAX_LOAD,
    SLOT_WORDS,
    W_LOC,
    W_VERSION,
    Record,
    TableView,
    TableWriter,
    capacity_for,
    namespace_hash,
    offsets_of,
    table_bytes,
    tier_bytes,
)

NS = namespace_hash("team-a/llama")


def keys(n: int, salt: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{salt}{i}".encode()).digest() for i in range(n)]


def table(max_entries: int, seed: int = 0) -> tuple[TableWriter, TableView, bytearray]:
    capacity = capacity_for(max_entries)
    memory = bytearray(table_bytes(capacity))
    writer = TableWriter(memoryview(memory), capacity, 1 << 30, np.random.default_rng(seed))
    return writer, TableView(memoryview(memory)), memory


def record(i: int) -> Record:
    return Record(offset=i * 65536, length=1000 + i, tier=2, checksum=0xABC000 + i)


def test_every_key_put_is_found_with_its_record_and_the_prefix_stops_at_a_miss() -> None:
    writer, view, _ = table(1000)
    ks = keys(400)
    for i, k in enumerate(ks):
        writer.put((NS, k), record(i))
    probe = view.probe(NS, ks)
    assert probe is not None and probe.prefix() == 400 and writer.left_out == 0
    assert offsets_of(probe.locs).tolist() == [i * 65536 for i in range(400)]
    assert probe.lengths.tolist() == [1000 + i for i in range(400)]
    assert probe.sums.tolist() == [0xABC000 + i for i in range(400)]
    assert set(tier_bytes(probe.locs)) == {2}
    writer.remove((NS, ks[7]))
    again = view.probe(NS, ks)
    assert again is not None and again.prefix() == 7
    assert (again.slots >= 0).sum() == 399  # the keys after the hole are still shown


def test_namespaces_and_foreign_keys_are_misses() -> None:
    writer, view, _ = table(100)
    ks = keys(10)
    for i, k in enumerate(ks):
        writer.put((NS, k), record(i))
    other = view.probe(namespace_hash("team-b/llama"), ks)
    assert other is not None and other.prefix() == 0 and (other.slots < 0).all()
    foreign = view.probe(NS, keys(10, salt="x"))
    assert foreign is not None and (foreign.slots < 0).all()
    assert view.probe(NS, [b"short"]) is None  # not a 32-byte key: ask the daemon


def test_a_change_after_a_probe_is_seen_and_an_unchanged_put_moves_nothing() -> None:
    writer, view, _ = table(100)
    k = keys(3)
    for i, key in enumerate(k):
        writer.put((NS, key), record(i))
    probe = view.probe(NS, k)
    assert probe is not None
    assert view.unchanged(probe.slots, probe.versions).all()
    writer.put((NS, k[0]), record(0))  # the same record: readers keep their copies
    assert view.unchanged(probe.slots, probe.versions).all()
    writer.put((NS, k[1]), Record(7 * 65536, 5, 2, 1))  # moved
    writer.remove((NS, k[2]))  # evicted: its pages may be reused next
    assert view.unchanged(probe.slots, probe.versions).tolist() == [True, False, False]
    writer.put((NS, k[2]), record(2))  # back, even in the same place: a new version
    assert view.unchanged(probe.slots, probe.versions).tolist() == [True, False, False]


def test_a_slot_caught_mid_change_is_a_miss() -> None:
    writer, view, memory = table(100)
    k = keys(2)
    for i, key in enumerate(k):
        writer.put((NS, key), record(i))
    probe = view.probe(NS, k)
    assert probe is not None and probe.prefix() == 2
    slots = np.frombuffer(memory, np.uint64, offset=HEADER_BYTES).reshape(-1, SLOT_WORDS)
    slot = int(probe.slots[0])
    slots[slot, W_VERSION] += 1  # odd: the writer is between its two version stores
    mid = view.probe(NS, k)
    assert mid is not None and mid.prefix() == 0 and mid.slots[1] >= 0
    assert not view.unchanged(probe.slots[:1], probe.versions[:1]).any()


def test_a_table_filled_to_its_load_keeps_every_key_findable_or_left_out() -> None:
    n = 5000
    writer, view, _ = table(n, seed=3)
    assert n / writer.capacity <= MAX_LOAD
    ks = keys(n)
    for i, k in enumerate(ks):
        writer.put((NS, k), record(i))
    probe = view.probe(NS, ks)
    assert probe is not None
    found = probe.slots >= 0
    assert len(writer) + writer.left_out == n and int(found.sum()) == len(writer)
    assert writer.left_out <= n // 100  # two-choice hashing under half full: next to none
    # What is shown is exact: each found key's record is its own.
    idx = np.flatnonzero(found)
    assert (probe.lengths[idx] == 1000 + idx).all()
    for k in ks:
        writer.remove((NS, k))
    empty = view.probe(NS, ks)
    assert empty is not None and (empty.slots < 0).all() and len(writer) == 0


def test_the_writer_never_decides_from_the_shared_bytes() -> None:
    """Scribbling over the table's slots (as no client can, but as a bug might) changes what
    readers see until the next write of each slot, and never what the writer does."""
    writer, view, memory = table(100)
    ks = keys(20)
    for i, k in enumerate(ks):
        writer.put((NS, k), record(i))
    slots = np.frombuffer(memory, np.uint64, offset=HEADER_BYTES).reshape(-1, SLOT_WORDS)
    slots[:, 1:] = 0xFF  # every key, location and length garbage; versions left alone
    slots[:, W_LOC] = 0
    assert len(writer) == 20
    for i, k in enumerate(ks):  # rewritten: the writer's own mirror says where each lies
        writer.put((NS, k), Record(i * 65536 + 1, 1, 2, 0))
    probe = view.probe(NS, ks)
    assert probe is not None and probe.prefix() == 20
    assert offsets_of(probe.locs).tolist() == [i * 65536 + 1 for i in range(20)]


def test_a_view_refuses_memory_that_is_no_table() -> None:
    with pytest.raises(ValueError, match="magic"):
        TableView(memoryview(bytearray(HEADER_BYTES)))
    with pytest.raises(ValueError, match="no header"):
        TableView(memoryview(bytearray(16)))
    _, _, memory = table(100)
    with pytest.raises(ValueError, match="claims"):
        TableView(memoryview(memory)[: HEADER_BYTES + 64])


def test_a_retired_table_answers_nothing() -> None:
    writer, view, _ = table(100)
    k = keys(2)
    for i, key in enumerate(k):
        writer.put((NS, key), record(i))
    assert view.live and view.probe(NS, k) is not None
    writer.retire()  # the daemon stops
    assert not view.live and view.probe(NS, k) is None
