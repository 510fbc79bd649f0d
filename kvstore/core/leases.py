"""The index's leases and pins: what holds an entry in place while a reader copies its bytes,
or for as long as a client asks.

    lease -> (the reader copies the bytes) -> release, or Index.expire past its deadline
    set_pinned(True) -> set_pinned(False), or expire_pins past its deadline

A lease holds the entries a read found (`Entry.leases`), a pin one entry (`Entry.pinned`);
either is charged to its client in the index's `Holdings` (which keeps the pin table) and
refunded however it ends. A held entry is not movable, so the eviction order drops it when
it comes up; when a hold ends it is queued again (ranked by its last use) unless another
hold remains.

Leases is a part of the Index, kept in a module of its own because holding entries is a
concept of its own: the Index makes one (`index.leases`) and hands it itself. A lease marks
the entries it holds used through `Index.touch` (a lease is a use), a pin finds its entry
through `Index.get`, either is charged in `Index.holdings`, and an entry whose hold ended is
queued again in the Index's eviction order. The Index itself ends the leases past their
deadline (`Index.expire`, together with the put plans past theirs), and a pin when its entry
is removed. Pure: no clock, deadlines are passed in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvstore.core.records import Entry, Lease
from kvstore.keys import BlockKey
from kvstore.tier import Tier

if TYPE_CHECKING:
    from kvstore.core.index import Index


class Leases:
    """Every live lease by id, and every pin, over the entries of one Index."""

    def __init__(self, index: Index) -> None:
        self._index = index
        self._leases: dict[str, Lease] = {}  # lease id -> lease

    # --- leases ----------------------------------------------------------------------------

    @property
    def num_leases(self) -> int:
        """How many leases are live."""
        return len(self._leases)

    def has_lease(self, lease_id: str) -> bool:
        """Whether a lease of this id is live."""
        return lease_id in self._leases

    def holder_of(self, lease_id: str) -> str | None:
        """The client holding the lease of this id; None when there is none (a put plan's
        client is `Index.plan(id).client`)."""
        lease = self._leases.get(lease_id)
        return lease.client if lease is not None else None

    def lease(self, lease_id: str, namespace: str, keys: Sequence[BlockKey],
              deadline: float, need: Tier | None = None, client: str = "") -> list[Entry | None]:
        """Mark the entries of keys used (`Index.touch`) and hold them for client until the
        lease is released or expires at deadline. Returns each key's entry: None for a miss,
        or for an entry with no copy in tier `need`. No lease is recorded when nothing was
        found."""
        if lease_id in self._leases:
            raise ValueError(f"lease {lease_id!r} exists")
        found = self._index.touch(namespace, keys, need)
        held = [entry for entry in found if entry is not None]
        for entry in held:
            entry.leases += 1
        if held:
            self._leases[lease_id] = Lease(lease_id, held, deadline, client)
            self._index.holdings.change(client, leases=1)
        return found

    def release(self, lease_id: str) -> bool:
        """End the lease of this id: its entries are no longer held by it, and each is
        queued for eviction again unless another hold remains. False when no such lease is
        live."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._index.holdings.change(lease.client, leases=-1)
        for entry in lease.entries:
            entry.leases -= 1
            self._index._order.push(entry)
        return True

    def expired(self, now: float) -> list[str]:
        """The ids of the leases past their deadline (Index.expire releases them)."""
        return [lid for lid, lease in self._leases.items() if lease.deadline <= now]

    # --- pins ------------------------------------------------------------------------------

    def pinned_count(self) -> int:
        """How many entries are pinned."""
        return len(self._index.holdings.pins)

    def set_pinned(self, namespace: str, keys: Iterable[BlockKey], pinned: bool,
                   client: str = "", deadline: float = math.inf) -> tuple[int, int]:
        """Pin the entries of keys for client until deadline, or unpin them. Returns how many
        entries changed and how many keys were not cached. Pinning a key that is pinned
        already renews its pin and charges it to this client."""
        changed = missing = 0
        for key in keys:
            entry = self._index.get(namespace, key)
            if entry is None:
                missing += 1
                continue
            if pinned:
                self._index.holdings.pin(namespace, key, client, entry.size_bytes, deadline)
            else:
                self._index.holdings.unpin(namespace, key)
            if entry.pinned != pinned:
                entry.pinned = pinned
                changed += 1
                self._index._order.push(entry)
        return changed, missing

    def expire_pins(self, now: float) -> list[tuple[str, BlockKey]]:
        """Unpin every key whose pin is past its deadline; returns the (namespace, key) of
        each."""
        expired = self._index.holdings.expired_pins(now)
        for namespace, key in expired:
            self.set_pinned(namespace, [key], False)
        return expired
