"""The daemon's event rings (kvstore/daemon/events.py) without a daemon: a reader racing a
writer sees every sequence once and in order, a ring that overflowed reports the gap, a
namespace no tenant owns keeps nothing, and a waiting reader wakes for a new event."""

from __future__ import annotations

import threading
import time

from kvstore.core.records import Entry
from kvstore.daemon.events import EventLog, Kind
from kvstore.tier import Tier


def entry(namespace: str, i: int) -> Entry:
    return Entry(namespace, i.to_bytes(32, "big"), 1024, {Tier.DRAM: ()}, 0, None)


def test_a_reader_racing_the_writer_sees_every_sequence_once_in_order() -> None:
    log = EventLog(1 << 20, lambda ns: "")
    done = threading.Event()

    def write() -> None:
        for i in range(50_000):
            log.added(entry("ns", i))
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    seen: list[int] = []
    sequence = 1
    while not (done.is_set() and sequence > 50_001):
        batch = log.read("", sequence, 4096, 0.05)
        assert batch.dropped == 0
        seen += [e.sequence for e in batch.events]
        sequence = seen[-1] + 1 if seen else sequence
    writer.join()
    assert seen == list(range(1, 50_002))


def test_an_overflowed_ring_reports_the_gap_and_goes_on() -> None:
    log = EventLog(4, lambda ns: "t")
    for i in range(10):  # CLEARED is 1; these are 2..11; the ring keeps 8..11
        log.added(entry("ns", i))
    batch = log.read("t", 3, 100, 0)
    assert batch.dropped == 5 and [e.sequence for e in batch.events] == [8, 9, 10, 11]
    assert batch.events[-1].key == (9).to_bytes(32, "big")
    assert log.read("t", 12, 100, 0).events == []


def test_unowned_namespaces_keep_nothing_and_tenants_have_their_own_numbers() -> None:
    owners = {"a/x": "a", "b/x": "b"}
    log = EventLog(16, owners.get)
    for ns in ("a/x", "b/x", "nobody/x", "a/x"):
        log.added(entry(ns, 0))
    assert [(e.sequence, e.kind, e.namespace) for e in log.read("a", 1, 10, 0).events] == [
        (1, Kind.CLEARED, ""), (2, Kind.STORED, "a/x"), (3, Kind.STORED, "a/x")]
    assert [e.namespace for e in log.read("b", 2, 10, 0).events] == ["b/x"]


def test_a_waiting_reader_wakes_for_the_next_event() -> None:
    log = EventLog(16, lambda ns: "")
    log.added(entry("ns", 0))  # sequences 1, 2
    woke: list[float] = []

    def read() -> None:
        start = time.monotonic()
        batch = log.read("", 3, 10, 5.0)
        woke.append(time.monotonic() - start)
        assert [e.kind for e in batch.events] == [Kind.MOVED]

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.1)
    moved = entry("ns", 0)
    moved.copies = {Tier.NVME: ()}
    moved.tier = Tier.NVME
    log.changed(moved, Tier.DRAM)
    reader.join(5)
    assert woke and woke[0] < 2.0
