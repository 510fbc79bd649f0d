"""Per-client holdings through a real Index: every lease, plan and pin is charged to its
client when made and refunded however it ends, and Holdings.check refuses past a cap,
naming the setting."""

from __future__ import annotations

import pytest

from kvstore.core.errors import ResourceExhausted
from kvstore.core.holdings import Caps, Holding
from kvstore.core.index import Index
from kvstore.core.pages import PageAllocator
from kvstore.keys import BlockKey
from kvstore.tier import Tier

NS = "ns"
PAGE = 100
A, B = "ipv4:10.0.0.1", "ipv4:10.0.0.2"


def key(n: int) -> BlockKey:
    return BlockKey(bytes([n]) * 32)


def index_with(*numbers: int) -> Index:
    index = Index({Tier.DRAM: PageAllocator(16)}, {Tier.DRAM: PAGE})
    for n in numbers:
        plan = index.prepare_store(f"seed-{n}", NS, [key(n)], [PAGE], [None], Tier.DRAM, 1e9)
        assert plan is not None
        index.complete_store(plan.plan_id, [0], success=True)
    return index


def test_a_lease_is_charged_to_its_client_until_released_or_expired() -> None:
    index = index_with(1, 2)
    index.leases.lease("l1", NS, [key(1), key(2)], deadline=10.0, client=A)
    index.leases.lease("l2", NS, [key(1)], deadline=20.0, client=A)
    index.leases.lease("l3", NS, [key(9)], deadline=20.0, client=B)  # a miss: no lease, no charge
    assert index.holdings.of(A) == Holding(leases=2)
    assert index.holdings.of(B) == Holding()
    index.leases.release("l1")
    assert index.holdings.of(A).leases == 1
    index.expire(now=25.0)
    assert index.holdings.all() == {}


def test_a_plan_is_charged_with_its_bytes_until_committed_aborted_or_expired() -> None:
    index = index_with(1)
    # key(1) is stored already: only the two new blocks are reserved
    plan = index.prepare_store("p", NS, [key(1), key(2), key(3)], [PAGE, 50, 250],
                               [None] * 3, Tier.DRAM, 10.0, client=A)
    assert plan is not None
    assert index.holdings.of(A) == Holding(reservations=1, reserved_bytes=300)
    index.complete_store("p", [0, 0], success=True)
    assert index.holdings.of(A) == Holding()
    for pid, deadline in (("q", 10.0), ("r", 30.0)):
        assert index.prepare_store(pid, NS, [key(4 + len(pid))], [PAGE], [None], Tier.DRAM,
                                   deadline, client=B) is not None
    index.complete_store("r", None, success=False)
    assert index.holdings.of(B).reservations == 1
    index.expire(now=20.0)
    assert index.holdings.all() == {}


def test_pins_pass_to_the_last_pinner_renew_and_expire() -> None:
    index = index_with(1, 2)
    assert index.leases.set_pinned(NS, [key(1), key(2), key(9)], True, A, deadline=10.0) == (2, 1)
    assert index.holdings.of(A) == Holding(pins=2, pinned_bytes=200)
    assert index.leases.set_pinned(NS, [key(2)], True, B, deadline=30.0) == (0, 0)  # renewed by B
    assert index.holdings.of(A) == Holding(pins=1, pinned_bytes=100)
    assert index.holdings.of(B) == Holding(pins=1, pinned_bytes=100)
    assert index.leases.expire_pins(now=20.0) == [(NS, key(1))]
    assert index.get(NS, key(1)).pinned is False  # type: ignore[union-attr]
    assert index.holdings.of(A) == Holding() and index.leases.pinned_count() == 1
    assert index.leases.set_pinned(NS, [key(2)], False) == (1, 0)  # anyone may unpin
    assert index.holdings.all() == {} and index.leases.pinned_count() == 0


def test_a_pinned_entry_removed_as_damaged_takes_its_pin_along() -> None:
    index = index_with(1)
    index.leases.set_pinned(NS, [key(1)], True, A, deadline=10.0)
    entry = index.get(NS, key(1))
    assert entry is not None
    index.moves.discard(entry)
    assert index.leases.pinned_count() == 0 and index.holdings.all() == {}


@pytest.mark.parametrize(("take", "setting"), [
    ({"leases": 1}, "clients.max_leases"),
    ({"reservations": 1}, "clients.max_reservations"),
    ({"reserved_bytes": 101}, "clients.max_reserved_share"),
    ({"pinned_bytes": 1}, "clients.max_pinned_share"),
])
def test_check_refuses_past_each_cap_naming_it(take: dict[str, int], setting: str) -> None:
    index = index_with(1)
    index.leases.lease("l", NS, [key(1)], deadline=10.0, client=A)
    index.leases.set_pinned(NS, [key(1)], True, A, deadline=10.0)
    assert index.prepare_store("p", NS, [key(2)], [PAGE], [None], Tier.DRAM, 10.0,
                               client=A) is not None
    caps = Caps(leases=1, reservations=1, reserved_bytes=200, pinned_bytes=100)
    with pytest.raises(ResourceExhausted, match=setting.replace(".", r"\.")):
        index.holdings.check(A, caps, **take)
    index.holdings.check(B, caps, **take)  # another client holds nothing yet
    index.holdings.check("", caps, **take)  # the daemon's own work is not capped


def test_a_client_without_reservations_may_make_one_of_any_size() -> None:
    index = index_with()
    caps = Caps(reserved_bytes=100)
    index.holdings.check(A, caps, reservations=1, reserved_bytes=1000)
    assert index.prepare_store("p", NS, [key(1)], [50], [None], Tier.DRAM, 10.0,
                               client=A) is not None
    with pytest.raises(ResourceExhausted, match="clients.max_reserved_share"):
        index.holdings.check(A, caps, reservations=1, reserved_bytes=51)
