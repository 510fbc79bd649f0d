"""Try again later: how the same-host paths (the shared memory, `ShmState`; the local
sessions, `LocalPath`) tell a refusal that passes from one that does not, and how long a path
that is off for now stays off.

A daemon under load or under attack refuses for a while and then serves again: its session
caps are reached, its Unix socket closes a connection without an answer (its handshakes are
all taken) or answers too late, Attach is out of tickets for the tenant (RESOURCE_EXHAUSTED)
or unreachable for a moment, its socket is not there yet while it restarts. Such a refusal
turns a path off for now (`TryLater`): calls go inline or over gRPC without waiting, and once
the `Pause` has passed the next data call tries again. Only what cannot change while this
client lives turns a path off for good: the daemon on another host or kernel, no segment and
no socket, FEATURE_OFF, an answer that is not the protocol.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from kvstore.backoff import ExponentialBackoff

from .errors import (
    DeadlineExceeded,
    FailedPrecondition,
    KVStoreError,
    ResourceExhausted,
    Unavailable,
)

#: The first pause after a refusal. A cap reached by a burst of a few hundred milliseconds
#: (an engine's threads all opening sessions at once) has passed by then; a try costs the
#: daemon one Stats call and one exchange on its socket, so four a second from one client is
#: nothing to it.
FIRST_PAUSE_S = 0.25
#: The longest pause (before jitter, which draws it from [half, all] of this). The issue's
#: target is shared memory and the local path back within 5 s of an attack ending: the try
#: after the end comes at most this long after it, and the next data call then gets back on
#: with one exchange and one handshake (milliseconds), so 3 s leaves 2 s for the client's
#: next data call and a loaded host. Longer pauses save a refused client nothing worth it (a
#: try during an attack is one closed connection, with the same ticket).
MAX_PAUSE_S = 3.0

#: ErrorInfo reasons of a refusal that passes: a cap (sessions, streams, a quota of pending
#: things) or a daemon stopping. A refusal at a cap leaves its ticket good (the daemon only
#: looks at it, `Tickets.peek`), so the ticket is kept for the next try.
PASSING_REASONS = frozenset({"TOO_MANY_SESSIONS", "TOO_MANY_STREAMS", "QUOTA_EXCEEDED",
                             "DRAINING"})
#: The reason the daemon gives for an unknown, used or expired ticket.
BAD_TICKET_REASON = "UNAUTHENTICATED"


class TryLater(FailedPrecondition):
    """A refusal that passes: the path is off for now, not for good. ticket_unused: the
    Attach ticket sent with the attempt was not redeemed (the connection closed or timed out
    before an answer, or the daemon refused at a cap), so it may serve the next try."""

    def __init__(self, details: str, *, ticket_unused: bool = False) -> None:
        super().__init__(details)
        self.ticket_unused = ticket_unused


class TicketRefused(TryLater):
    """The daemon did not know the ticket (unknown, used or expired): a fresh one may do."""


def passes(exc: KVStoreError) -> bool:
    """Whether a failure on the way to a same-host path passes: a `TryLater`, or an RPC
    (Attach, Stats) that was unavailable, too slow or refused at a cap."""
    return isinstance(exc, (TryLater, Unavailable, DeadlineExceeded, ResourceExhausted))


def refusal_passes(reason: object) -> bool:
    """Whether a refusal line's ErrorInfo reason is one that passes (see PASSING_REASONS)."""
    return isinstance(reason, str) and (reason in PASSING_REASONS
                                        or reason.startswith("TOO_MANY_"))


class Pause:
    """How long a path that is off for now stays off: FIRST_PAUSE_S after the first refusal,
    doubling with each refusal in a row up to MAX_PAUSE_S, each drawn from [half, all] of
    that ("equal jitter": clients refused together do not all come back together, and none
    comes back at once). Not thread-safe: its owner guards it; reading `until_s` (one
    attribute) is safe anywhere.

    clock is time.monotonic unless a test passes its own; rng draws the jitter."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._backoff = ExponentialBackoff(base_s=FIRST_PAUSE_S, cap_s=MAX_PAUSE_S,
                                           jitter=False)
        #: Refusals in a row since the path last worked; 0 while it is on.
        self.failures = 0
        #: When the path may be tried again; None while it is on, or off for good.
        self.until_s: float | None = None
        self._since_s = 0.0

    def off(self) -> bool:
        """Whether the path is off now, its pause not yet passed."""
        until_s = self.until_s
        return until_s is not None and self._clock() < until_s

    def due(self) -> bool:
        """Whether the path is off for now and its pause has passed: time to try again."""
        until_s = self.until_s
        return until_s is not None and self._clock() >= until_s

    def fail(self) -> float:
        """One more refusal: the path is off from now for the seconds returned."""
        now = self._clock()
        if not self.failures:
            self._since_s = now
        self.failures += 1
        ceiling_s = self._backoff.ceiling(self.failures)
        pause_s = self._rng.uniform(ceiling_s / 2, ceiling_s)
        self.until_s = now + pause_s
        return pause_s

    def clear(self) -> float | None:
        """The path works (or is off for good): no pause. The seconds it had been off for
        now, None when it was not."""
        off_s = self._clock() - self._since_s if self.failures else None
        self.failures, self.until_s = 0, None
        return off_s
