"""client/watch.py: the cursor a WatchEvents follower keeps, and the loop around a stream
(driven here by generator functions that behave as client.watch_events does: yield
responses, then end or raise the client's errors)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from kvstore.client.errors import FailedPrecondition, Unavailable
from kvstore.client.watch import EventCursor, follow_events
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb


def _response(daemon_id: str, *sequences: int, dropped: int = 0) -> Any:
    return pb.WatchEventsResponse(daemon_id=daemon_id, dropped=dropped, events=[
        pb.BlockEvent(sequence=s, kind=pb.BLOCK_EVENT_KIND_STORED) for s in sequences])


def test_the_cursor_skips_what_was_handled_and_counts_what_was_lost() -> None:
    cursor = EventCursor()
    first = cursor.advance(_response("d1", 1, 2, 3))
    assert first.first and first.new_run and [e.sequence for e in first.events] == [1, 2, 3]
    again = cursor.advance(_response("d1", 2, 3, 4))  # a reconnect asks from 1 again
    assert not again.new_run and [e.sequence for e in again.events] == [4]
    gap = cursor.advance(_response("d1", 9))
    assert gap.missed == 4 and cursor.last_sequence == 9
    restart = cursor.advance(_response("d2", 40, dropped=39))
    assert restart.new_run and not restart.first and restart.missed == 39
    assert cursor.daemon_id == "d2" and cursor.missed == 43


def test_follow_events_reconnects_and_survives_a_faulty_handler() -> None:
    stopping, connected = threading.Event(), threading.Event()
    opened: list[int] = []
    seen: list[int] = []

    def stream(from_sequence: int) -> Iterator[Any]:
        opened.append(from_sequence)
        yield _response("d1", len(opened))
        if len(opened) == 1:
            raise Unavailable("the daemon went away")
        if len(opened) == 3:
            stopping.set()

    def handle(response: Any) -> None:
        seen.append(response.events[0].sequence)
        assert connected.is_set()
        if len(seen) == 2:
            raise RuntimeError("a fault of the follower")

    follow_events(stream, handle, stopping, name="test", retry_s=(0.001, 0.002),
                  connected=connected)
    assert opened == [1, 1, 1] and seen == [1, 2, 3] and not connected.is_set()


def test_follow_events_stops_when_events_are_off_only_if_asked() -> None:
    stopping = threading.Event()
    calls: list[int] = []

    def off(from_sequence: int) -> Iterator[Any]:
        calls.append(from_sequence)
        if len(calls) == 3:
            stopping.set()
        raise FailedPrecondition("events are off")
        yield  # a generator, as client.watch_events

    follow_events(off, lambda r: None, stopping, name="test", stop_when_off=True)
    assert calls == [1]
    follow_events(off, lambda r: None, stopping := threading.Event(), name="test",
                  retry_s=(0.001, 0.001))
    assert len(calls) == 3  # asked again until stopped
