"""Following a daemon's block events (WatchEvents) for as long as it takes: across dropped
streams, reconnects and daemon restarts.

`client.watch_events(from_sequence)` is one stream: it ends when the connection does. A
follower that must not lose track (the vLLM connector's `StoreWatch`, kvstore-events'
`Relay`) reconnects, asks again from the first event the daemon still holds, and skips what
it already handled; a new `daemon_id` means a new daemon run, whose sequence starts again at 1
and whose blocks are not the old run's. `EventCursor` is that bookkeeping, pure;
`follow_events` is the loop around a client that feeds it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .errors import FailedPrecondition, KVStoreError

logger = logging.getLogger("kvstore.client")


@dataclass
class Advance:
    """What one WatchEvents response brings a follower."""

    events: list[Any]
    """The events not handled before, in order (kvstore.v1.BlockEvent)."""
    new_run: bool
    """The response is from another daemon run than the one followed (True on the first
    response too): what the follower learnt from the old run no longer holds."""
    first: bool
    """The first response the follower has seen (then new_run is True too)."""
    missed: int
    """Events lost before these: the daemon no longer held them when asked (its buffer
    overflowed while nobody read, or between two streams)."""


@dataclass
class EventCursor:
    """Where a follower stands: the daemon run it follows and the last sequence handled."""

    daemon_id: str = ""
    last_sequence: int = 0
    missed: int = 0
    """Events lost in all (see `Advance.missed`)."""
    _started: bool = field(default=False, repr=False)

    def advance(self, response: Any) -> Advance:
        """Take one WatchEventsResponse: its events past the last handled, and what was lost
        in between. A new run counts the events its daemon had dropped before the first one
        sent (`dropped`); within a run, a gap in the sequence is events lost between two
        streams."""
        events = list(response.events)
        first = not self._started
        new_run = first or response.daemon_id != self.daemon_id
        missed = 0
        if new_run:
            self._started = True
            self.daemon_id = response.daemon_id
            self.last_sequence = 0
            missed = response.dropped
        else:
            events = [e for e in events if e.sequence > self.last_sequence]
        if events:
            gap = events[0].sequence - self.last_sequence - 1
            if gap > 0 and self.last_sequence:
                missed += gap
            self.last_sequence = events[-1].sequence
        self.missed += missed
        return Advance(events, new_run, first, missed)


def follow_events(open_stream: Callable[[int], Iterator[Any]],
                  handle: Callable[[Any], None], stopping: threading.Event, *,
                  name: str, retry_s: tuple[float, float] = (0.2, 5.0),
                  stop_when_off: bool = False,
                  connected: threading.Event | None = None) -> None:
    """Follow the stream until `stopping` is set: open it with `open_stream(1)` (from the
    first event the daemon holds: the cursor skips what was handled), hand each response to
    `handle`, and open it again after a backoff from retry_s[0] doubling up to retry_s[1]
    when it ends or fails. `connected` is set while a stream delivers and cleared when it
    ends. A daemon whose events are off (FailedPrecondition) ends the loop when
    stop_when_off, else is asked again like any failure; a closed channel (ValueError from
    grpc) always ends it. A fault in `handle` is logged and the stream followed again."""
    backoff_s = retry_s[0]
    while not stopping.is_set():
        delivered = [False]
        try:
            _deliver(open_stream(1), handle, connected, delivered)
        except FailedPrecondition as exc:
            if stop_when_off:
                logger.info("%s: the daemon's block events are off (%s)", name, exc)
                return
            logger.warning("%s: the daemon's block events are off (%s)", name, exc)
        except KVStoreError as exc:
            logger.warning("%s: the event stream ended (%s)", name, exc)
        except ValueError as exc:  # grpc: the channel is closed, its owner is closing
            logger.debug("%s: %s: not followed any more", name, exc)
            return
        except _HandleFailed:
            logger.exception("%s: handling an event failed", name)
        if connected is not None:
            connected.clear()
        if delivered[0]:
            backoff_s = retry_s[0]
        logger.debug("%s: following again in %.1fs", name, backoff_s)
        stopping.wait(backoff_s)
        backoff_s = min(retry_s[1], backoff_s * 2)


class _HandleFailed(Exception):
    """The caller's handle raised (the cause): a fault of the follower, not of the stream."""


def _deliver(stream: Iterator[Any], handle: Callable[[Any], None],
             connected: threading.Event | None, delivered: list[bool]) -> None:
    """Hand each response of one stream to handle; delivered[0] tells whether any came."""
    for response in stream:
        delivered[0] = True
        if connected is not None:
            connected.set()
        try:
            handle(response)
        except Exception as exc:
            raise _HandleFailed from exc
