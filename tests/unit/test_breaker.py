"""kvstore.daemon.breaker: exact state sequences under a fake clock."""

from __future__ import annotations

import threading

import pytest

from kvstore.daemon.breaker import Breaker


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_closed_allows_everything_and_success_keeps_it_closed(clock: FakeClock) -> None:
    b = Breaker(1.0, clock=clock)
    assert (b.state, b.failures, b.last_error, b.retry_in_s) == ("closed", 0, "", 0.0)
    for _ in range(3):
        assert b.allow()
        b.success()
    assert (b.state, b.failures) == ("closed", 0)


def test_a_failure_opens_and_refuses_until_the_backoff_has_passed(clock: FakeClock) -> None:
    b = Breaker(1.0, clock=clock)
    b.failure("connection refused")
    assert (b.state, b.failures, b.last_error) == ("open", 1, "connection refused")
    assert b.retry_in_s == 1.0
    assert not b.allow()
    clock.advance(0.999)
    assert not b.allow()
    assert b.retry_in_s == pytest.approx(0.001)
    clock.advance(0.001)
    assert b.retry_in_s == 0.0
    # the wait is over: exactly one probe goes, the next caller is refused
    assert b.allow()
    assert b.state == "half-open"
    assert not b.allow()
    assert not b.allow()


def test_probe_success_closes_and_resets_the_backoff(clock: FakeClock) -> None:
    b = Breaker(1.0, clock=clock)
    b.failure("down")
    clock.advance(1.0)
    assert b.allow()
    b.failure("still down")  # backoff 2 s now
    clock.advance(2.0)
    assert b.allow()
    b.success()
    assert (b.state, b.retry_in_s, b.failures) == ("closed", 0.0, 2)
    assert b.last_error == "still down"  # kept for the operator after recovery
    assert b.allow() and b.allow()
    b.failure("down again")  # a new outage starts from the first backoff, not 4 s
    assert b.retry_in_s == 1.0


def test_backoff_doubles_per_consecutive_failure_up_to_the_cap(clock: FakeClock) -> None:
    b = Breaker(1.0, max_backoff_s=5.0, clock=clock)
    waits = []
    b.failure("x")
    for _ in range(6):
        waits.append(b.retry_in_s)
        clock.advance(b.retry_in_s - 0.01)
        assert not b.allow()  # not a moment early
        clock.advance(0.01)
        assert b.allow()  # the probe
        b.failure("x")
    assert waits == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    assert b.failures == 7


def test_failures_while_open_count_but_do_not_extend_the_wait(clock: FakeClock) -> None:
    """Calls that were already in flight when Redis went away all fail; one outage is one
    step of backoff, not one per thread."""
    b = Breaker(1.0, clock=clock)
    b.failure("a")
    clock.advance(0.5)
    b.failure("b")
    b.failure("c")
    assert (b.state, b.failures, b.last_error) == ("open", 3, "c")
    assert b.retry_in_s == 0.5
    clock.advance(0.5)
    assert b.allow()
    b.failure("probe failed")
    assert b.retry_in_s == 2.0  # the second consecutive step, not the fourth


def test_a_lost_probe_is_replaced_after_one_backoff(clock: FakeClock) -> None:
    b = Breaker(1.0, clock=clock)
    b.failure("down")
    clock.advance(1.0)
    assert b.allow()  # the probe goes and never reports
    clock.advance(0.99)
    assert not b.allow()
    assert b.retry_in_s == pytest.approx(0.01)
    clock.advance(0.01)
    assert b.allow()  # a new probe
    assert b.state == "half-open"
    b.success()
    assert b.state == "closed"


def test_success_while_open_closes(clock: FakeClock) -> None:
    b = Breaker(1.0, clock=clock)
    b.failure("blip")
    b.success()  # a call that started earlier got through: Redis is there
    assert (b.state, b.retry_in_s) == ("closed", 0.0)
    assert b.allow()


def test_only_one_of_many_threads_becomes_the_probe(clock: FakeClock) -> None:
    b = Breaker(1.0, clock=clock)
    b.failure("down")
    clock.advance(1.0)
    start = threading.Barrier(16)
    allowed: list[bool] = []

    def worker() -> None:
        start.wait()
        allowed.append(b.allow())

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(allowed) == [False] * 15 + [True]


@pytest.mark.parametrize(("backoff_s", "max_backoff_s"), [(0.0, 30.0), (-1.0, 30.0), (2.0, 1.0)])
def test_bad_settings_are_refused(backoff_s: float, max_backoff_s: float) -> None:
    with pytest.raises(ValueError, match="backoff_s"):
        Breaker(backoff_s, max_backoff_s)
