"""The daemon's block events, for routers (the WatchEvents verb, docs/routing.md): each
tenant's blocks stored, moved to another fastest tier, removed, or written to the L4 pool,
numbered 1, 2, ... per tenant and daemon run, the first event of each stream CLEARED.

The index tells `EventLog` of every entry it links, whose fastest tier changes, or that it
removes (`kvstore.core.index.Published`), and L4's writer of every batch Redis took, all
under the store's lock; each becomes one event appended to its tenant's ring of the last
`capacity` events. That is all the data path pays: no I/O, no wake-up unless a subscriber
waits. A subscriber reads from a sequence number of its
own; the ring never waits for it, so one that falls behind by more than the ring, or asks for a
sequence no longer held, is told how many events it missed and goes on from the oldest held.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import IntEnum

from kvstore.core.records import Entry
from kvstore.tier import Tier

LINGER_S = 0.02
"""How long a stream waits after sending a batch before it reads the next: at most 50
batches a second per subscriber, whatever the rate of puts (vLLM's own publisher sends once
per engine step, tens of milliseconds)."""


class Kind(IntEnum):
    """What happened to a block, numbered as `kvstore.v1.BlockEventKind`."""

    STORED = 1
    MOVED = 2
    REMOVED = 3
    CLEARED = 4
    POOL_STORED = 5


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """One event of a tenant's stream. `tier` is the block's fastest tier now (STORED,
    MOVED), the one it left (REMOVED), or REMOTE (POOL_STORED); `from_tier` the one before a
    MOVED; 0 otherwise."""

    sequence: int
    kind: Kind
    namespace: str = ""
    key: bytes = b""
    tier: int = 0
    from_tier: int = 0
    parent: bytes = b""


@dataclass(frozen=True, slots=True)
class EventBatch:
    """What a subscriber gets at once: events in sequence order, after `dropped` it missed;
    `daemon_id` names the daemon run (as `kvstore.v1.WatchEventsResponse`)."""

    events: list[BlockEvent]
    dropped: int = 0
    daemon_id: str = ""


_Raw = tuple[int, int, str, bytes, int, int, bytes]
"""An event as the ring keeps it: (sequence, kind, namespace, key, tier, from_tier, parent),
made into a `BlockEvent` only when a subscriber reads it."""


class _Ring:
    """One tenant's last `capacity` events, each in the slot of its sequence modulo the
    capacity, and the next sequence to hand out. Its one writer is the store's thread of the
    moment (under the store's lock). A reader takes a batch slot by slot, by sequence, with
    no lock: a slot read is one GIL-atomic list access, and an event overwritten meanwhile
    shows another sequence, so a batch costs its own length, never the ring's."""

    __slots__ = ("slots", "next_sequence")

    def __init__(self, capacity: int) -> None:
        self.slots: list[_Raw | None] = [None] * capacity
        self.next_sequence = 1

    def append(self, kind: int, namespace: str = "", key: bytes = b"", tier: int = 0,
               from_tier: int = 0, parent: bytes = b"") -> None:
        sequence = self.next_sequence
        self.slots[sequence % len(self.slots)] = (sequence, kind, namespace, key, tier,
                                                  from_tier, parent)
        self.next_sequence = sequence + 1  # after the slot: a reader never sees it unwritten

    def take(self, sequence: int, limit: int) -> tuple[list[_Raw], int]:
        """At most limit events from `sequence` on, and how many before the first of them
        (from `sequence`) the ring no longer holds. A slot overwritten while the batch is read
        ends the batch there if it is not the first; if it is, the batch starts again past
        what was overwritten."""
        capacity = len(self.slots)
        while True:
            end = self.next_sequence
            first = max(sequence, end - capacity, 1)
            out: list[_Raw] = []
            for s in range(first, min(end, first + limit)):
                raw = self.slots[s % capacity]
                if raw is None or raw[0] != s:
                    break
                out.append(raw)
            if out or first >= end:
                return out, first - sequence
            # the first slot was overwritten while we read: the writer lapped us, read again


class EventLog:
    """Every tenant's ring, fed by the index (it is the index's `published` mirror, beside
    or instead of the read tables) and read by WatchEvents streams."""

    def __init__(self, capacity: int, tenant_of: Callable[[str], str | None]) -> None:
        """capacity: events kept per tenant (> 0). tenant_of: the tenant owning a namespace
        ("" for everyone with auth off; None for a namespace no tenant owns, whose events
        are not kept). A namespace's tenant is looked up once, when its first event comes
        (a tenants file reloaded later does not move a namespace's events)."""
        self.capacity = capacity
        self.daemon_id = uuid.uuid4().hex
        """One value per daemon run, in every batch: a subscriber seeing it change forgets."""
        self._tenant_of = tenant_of
        self._by_namespace: dict[str, _Ring | None] = {}  # None: no tenant owns it
        self._rings: dict[str, _Ring] = {}
        self._lock = threading.Condition()
        self._waiting = 0

    # --- the index's side (under the store's lock) ---------------------------------------

    def added(self, entry: Entry) -> None:
        self._emit(entry.namespace, Kind.STORED, entry.key, entry.tier, 0, entry.parent or b"")

    def changed(self, entry: Entry, before: Tier) -> None:
        if entry.tier != before:
            self._emit(entry.namespace, Kind.MOVED, entry.key, entry.tier, before)

    def removed(self, entry: Entry) -> None:
        self._emit(entry.namespace, Kind.REMOVED, entry.key, entry.tier)

    def pool_written(self, written: list[tuple[str, bytes]]) -> None:
        """This daemon wrote these (namespace, key) blocks to the L4 pool (its writer
        thread, after Redis took them; under the store's lock, as every writer of the
        rings)."""
        for namespace, key in written:
            self._emit(namespace, Kind.POOL_STORED, key, Tier.REMOTE)

    def _emit(self, namespace: str, kind: int, key: bytes, tier: int, from_tier: int = 0,
              parent: bytes = b"") -> None:
        """One event: an append to its tenant's ring, and a wake-up only if a subscriber
        waits."""
        try:
            ring = self._by_namespace[namespace]
        except KeyError:
            ring = self._namespace_ring(namespace)
        if ring is None:
            return
        ring.append(kind, namespace, key, tier, from_tier, parent)
        if self._waiting:
            with self._lock:
                self._lock.notify_all()

    def _namespace_ring(self, namespace: str) -> _Ring | None:
        """The ring of namespace's tenant, looked up on its first event."""
        tenant = self._tenant_of(namespace)
        with self._lock:
            ring = self._ring(tenant) if tenant is not None else None
            self._by_namespace[namespace] = ring
        return ring

    def _ring(self, tenant: str) -> _Ring:
        """The tenant's ring, made on first use with its CLEARED event (held: _lock)."""
        ring = self._rings.get(tenant)
        if ring is None:
            ring = self._rings[tenant] = _Ring(self.capacity)
            ring.append(Kind.CLEARED)
        return ring

    # --- subscribers --------------------------------------------------------------------

    def read(self, tenant: str, sequence: int, limit: int, timeout_s: float) -> EventBatch:
        """The tenant's events from `sequence` on (at most limit), waiting up to timeout_s
        for the first; `dropped` counts those before the oldest held that sequence asked
        for. An empty batch: nothing new within timeout_s."""
        with self._lock:
            ring = self._ring(tenant)
            if ring.next_sequence <= sequence:
                self._waiting += 1
                try:
                    self._lock.wait_for(lambda: ring.next_sequence > sequence, timeout_s)
                finally:
                    self._waiting -= 1
        held, dropped = ring.take(max(sequence, 1), limit)
        batch = [BlockEvent(s, Kind(k), n, key, t, f, p) for s, k, n, key, t, f, p in held]
        return EventBatch(batch, dropped, self.daemon_id)

    def next_sequence(self, tenant: str) -> int:
        """The sequence the tenant's next event will have."""
        with self._lock:
            return self._ring(tenant).next_sequence

    def stream(self, tenant: str, from_sequence: int, active: Callable[[], bool],
               limit: int = 1024, poll_s: float = 0.5,
               linger_s: float = LINGER_S) -> Iterator[EventBatch]:
        """The tenant's batches from from_sequence (0: from the next event) for as long as
        active() holds; an idle stream sends nothing. After each batch it waits linger_s, so
        that a busy store's events go out in batches, not one wake-up each."""
        sequence = from_sequence or self.next_sequence(tenant)
        while active():
            batch = self.read(tenant, sequence, limit, poll_s)
            if batch.events or batch.dropped:
                sequence = (batch.events[-1].sequence + 1 if batch.events
                            else sequence + batch.dropped)
                yield batch
                time.sleep(linger_s)
