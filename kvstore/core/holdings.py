"""Who holds what: each client's live leases, put plans (reservations) and pins, and the caps
that keep one client from holding the store at everyone else's expense.

A client is the caller's identity: its peer host until authentication lands (the tenants
issue replaces it with the tenant). The index keeps these books: a lease, plan or pin is
charged to its client when it is made and refunded however it ends (release, commit,
abort, expiry, the entry's removal), so the figures cannot drift. Whoever makes one asks
`Holdings.check` first, holding the same lock. Pure: no clock, deadlines are passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvstore.core.errors import Reason, ResourceExhausted
from kvstore.keys import BlockKey
from kvstore.units import format_size


@dataclass(slots=True)
class Holding:
    """What one client holds now."""

    leases: int = 0
    reservations: int = 0  # put plans: Reserves not yet committed, inline Puts in flight
    reserved_bytes: int = 0
    pins: int = 0
    pinned_bytes: int = 0

    def empty(self) -> bool:  # asked at every lease and release: no reflection
        return not (self.leases or self.reservations or self.reserved_bytes or self.pins
                    or self.pinned_bytes)


@dataclass(frozen=True, slots=True)
class Caps:
    """The most one client may hold at once (math.inf: no cap)."""

    leases: float = math.inf
    reservations: float = math.inf
    reserved_bytes: float = math.inf
    pinned_bytes: float = math.inf

    @staticmethod
    def of_shares(leases: int, reservations: int, reserved_share: float, pinned_share: float,
                  l2_bytes: int) -> Caps:
        """Caps whose byte caps are the given shares of L2's l2_bytes; a share of 1 or more,
        or no L2 (l2_bytes 0), is no cap."""
        def share(value: float) -> float:
            return math.inf if value >= 1 or not l2_bytes else value * l2_bytes
        return Caps(leases, reservations, share(reserved_share), share(pinned_share))


@dataclass(slots=True)
class Pin:
    client: str
    size_bytes: int
    deadline: float  # unpinned by expire() after it, unless pinned again


class Holdings:
    """Each client's Holding, and every pin (by namespace and key) with its client."""

    def __init__(self) -> None:
        self._by_client: dict[str, Holding] = {}
        self.pins: dict[tuple[str, BlockKey], Pin] = {}

    def of(self, client: str) -> Holding:
        """A copy of what client holds (all zero for one that holds nothing)."""
        held = self._by_client.get(client)
        return replace(held) if held is not None else Holding()

    def all(self) -> dict[str, Holding]:
        """A copy of every client's holding, by client."""
        return {client: replace(held) for client, held in sorted(self._by_client.items())}

    def change(self, client: str, *, leases: int = 0, reservations: int = 0,
               reserved_bytes: int = 0) -> None:
        """Add these to what client holds (negative figures: take them away)."""
        held = self._by_client.setdefault(client, Holding())
        held.leases += leases
        held.reservations += reservations
        held.reserved_bytes += reserved_bytes
        self._forget_if_empty(client, held)

    def check(self, client: str, caps: Caps, *, leases: int = 0, reservations: int = 0,
              reserved_bytes: int = 0, pinned_bytes: int = 0) -> None:
        """ResourceExhausted, naming the setting, if client taking this much more would hold
        more than caps allow. A client holding no reservation may always make one, however
        large (a put as large as L2 still works for a lone client); the daemon's own work
        (client "": L4 imports) is not capped."""
        if not client:
            return
        held = self._by_client.get(client, Holding())
        if leases and held.leases + leases > caps.leases:
            raise ResourceExhausted(
                f"this client ({client}) holds {held.leases} leases, the most one client may "
                "(clients.max_leases): Release some, or let them expire", Reason.QUOTA_EXCEEDED,
                limit=caps.leases, setting="clients.max_leases")
        if reservations and held.reservations + reservations > caps.reservations:
            raise ResourceExhausted(
                f"this client ({client}) has {held.reservations} reservations and puts in "
                "flight, the most one client may (clients.max_reservations): commit or "
                "release some first", Reason.QUOTA_EXCEEDED, limit=caps.reservations,
                setting="clients.max_reservations")
        if (reserved_bytes and held.reservations  # a client with none may always take one
                and held.reserved_bytes + reserved_bytes > caps.reserved_bytes):
            raise ResourceExhausted(
                f"sizes: {format_size(reserved_bytes)} more would make this client ({client}) "
                f"hold {format_size(held.reserved_bytes + reserved_bytes)} of reservations and "
                f"puts in flight, over {format_size(int(caps.reserved_bytes))} "
                "(clients.max_reserved_share of dram.capacity_bytes)", Reason.QUOTA_EXCEEDED,
                field="sizes", limit=int(caps.reserved_bytes),
                setting="clients.max_reserved_share")
        if pinned_bytes and held.pinned_bytes + pinned_bytes > caps.pinned_bytes:
            raise ResourceExhausted(
                f"keys: pinning {format_size(pinned_bytes)} more would make this client "
                f"({client}) pin {format_size(held.pinned_bytes + pinned_bytes)}, over "
                f"{format_size(int(caps.pinned_bytes))} (clients.max_pinned_share of "
                "dram.capacity_bytes): unpin some first", Reason.QUOTA_EXCEEDED, field="keys",
                limit=int(caps.pinned_bytes), setting="clients.max_pinned_share")

    # --- pins ------------------------------------------------------------------------------

    def pin(self, namespace: str, key: BlockKey, client: str, size_bytes: int,
            deadline: float) -> bool:
        """Pin the key for client until deadline (a pin of another client's passes to this
        one, a pin of its own is renewed); True when it was not pinned before."""
        old = self.pins.get((namespace, key))
        if old is not None:
            self._charge_pin(old.client, -1, -old.size_bytes)
        self.pins[(namespace, key)] = Pin(client, size_bytes, deadline)
        self._charge_pin(client, 1, size_bytes)
        return old is None

    def unpin(self, namespace: str, key: BlockKey) -> bool:
        """Unpin the key and refund its client; True when the key was pinned."""
        old = self.pins.pop((namespace, key), None)
        if old is None:
            return False
        self._charge_pin(old.client, -1, -old.size_bytes)
        return True

    def expired_pins(self, now: float) -> list[tuple[str, BlockKey]]:
        """The (namespace, key) of every pin past its deadline."""
        return [nk for nk, pin in self.pins.items() if pin.deadline <= now]

    def pinned_by(self, namespace: str, key: BlockKey) -> str | None:
        """The client that pinned the key; None when it is not pinned."""
        pin = self.pins.get((namespace, key))
        return pin.client if pin is not None else None

    def _charge_pin(self, client: str, pins: int, size_bytes: int) -> None:
        held = self._by_client.setdefault(client, Holding())
        held.pins += pins
        held.pinned_bytes += size_bytes
        self._forget_if_empty(client, held)

    def _forget_if_empty(self, client: str, held: Holding) -> None:
        if held.empty():
            del self._by_client[client]
