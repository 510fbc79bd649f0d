"""The index's leases and pins: what holds an entry in place while a reader copies its bytes,
or for as long as a client asks.

    lease -> (the reader copies the bytes) -> release, or Index.expire past its deadline
    set_pinned(True) -> set_pinned(False), or expire_pins past its deadline

A lease holds the entries a read found (`Entry.leases`), a pin one entry (`Entry.pinned`);
either is charged to its client in the index's `Holdings` (which keeps the pin table) and
refunded however it ends. A held entry is not movable, so the eviction order drops it when
it comes up; when a hold ends it is queued again (ranked by its last use) unless another
hold remains. The Index owns one (`index.leases`) and hands it only what it needs: the
Holdings, `Index.touch` (a lease is a use), `Index.get`, and its eviction order's `push`.
The Index itself ends leases past their deadline (`Index.expire`, with the plans), and a
pin with its entry's removal. Pure: no clock, deadlines are passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from kvstore.core.holdings import Holdings
from kvstore.core.records import Entry, Lease
from kvstore.keys import BlockKey
from kvstore.tier import Tier

Touch = Callable[[str, Sequence[BlockKey], Tier | None], list[Entry | None]]


class Leases:
    """Every live lease by id, and every pin, over the entries of one Index."""

    def __init__(self, holdings: Holdings, touch: Touch,
                 get: Callable[[str, BlockKey], Entry | None],
                 requeue: Callable[[Entry], None]) -> None:
        """touch(namespace, keys, need): the index's use of keys; get: its entry lookup;
        requeue: queue an entry again once it may be evictable (EvictionOrder.push)."""
        self._holdings = holdings
        self._touch = touch
        self._get = get
        self._requeue = requeue
        self._leases: dict[str, Lease] = {}

    # --- leases ----------------------------------------------------------------------------

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def has_lease(self, lease_id: str) -> bool:
        return lease_id in self._leases

    def holder_of(self, lease_id: str) -> str | None:
        """The client holding the lease of this id; None when there is none (a put plan's
        client is `Index.plan(id).client`)."""
        lease = self._leases.get(lease_id)
        return lease.client if lease is not None else None

    def lease(self, lease_id: str, namespace: str, keys: Sequence[BlockKey],
              deadline: float, need: Tier | None = None, client: str = "") -> list[Entry | None]:
        """Index.touch() the entries of keys and hold them until release/expiry (no lease is
        recorded when nothing was found)."""
        if lease_id in self._leases:
            raise ValueError(f"lease {lease_id!r} exists")
        found = self._touch(namespace, keys, need)
        held = [entry for entry in found if entry is not None]
        for entry in held:
            entry.leases += 1
        if held:
            self._leases[lease_id] = Lease(lease_id, held, deadline, client)
            self._holdings.change(client, leases=1)
        return found

    def release(self, lease_id: str) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._holdings.change(lease.client, leases=-1)
        for entry in lease.entries:
            entry.leases -= 1
            self._requeue(entry)
        return True

    def expired(self, now: float) -> list[str]:
        """The ids of the leases past their deadline (Index.expire releases them)."""
        return [lid for lid, lease in self._leases.items() if lease.deadline <= now]

    # --- pins ------------------------------------------------------------------------------

    def pinned_count(self) -> int:
        return len(self._holdings.pins)

    def set_pinned(self, namespace: str, keys: Iterable[BlockKey], pinned: bool,
                   client: str = "", deadline: float = math.inf) -> tuple[int, int]:
        """Pin (for client, until deadline) or unpin; (changed, missing). Pinning a pinned
        key renews it, and charges it to this client."""
        changed = missing = 0
        for key in keys:
            entry = self._get(namespace, key)
            if entry is None:
                missing += 1
                continue
            if pinned:
                self._holdings.pin(namespace, key, client, entry.size_bytes, deadline)
            else:
                self._holdings.unpin(namespace, key)
            if entry.pinned != pinned:
                entry.pinned = pinned
                changed += 1
                self._requeue(entry)
        return changed, missing

    def expire_pins(self, now: float) -> list[tuple[str, BlockKey]]:
        """Unpin the pins past their deadline; their (namespace, key)s."""
        expired = self._holdings.expired_pins(now)
        for namespace, key in expired:
            self.set_pinned(namespace, [key], False)
        return expired
