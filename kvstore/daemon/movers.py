"""The supervised background mover: demotes blocks when a tier passes its high watermark.

It wakes every `movers.interval_s`, or at once when a put or load is short of room
(`Tiering.wake`), and steps until nothing is over its watermark. If a step raises, the
mover logs why, calls `on_failure` (the server marks health NOT_SERVING) and stops: it never
dies silently, and puts then fall back to evicting after `movers.put_wait_s`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvstore.daemon.tiering import Tiering

log = logging.getLogger(__name__)


class Mover:
    """The thread that runs the tiering's steps (see the module docstring)."""

    def __init__(self, tiering: Tiering, interval_s: float,
                 on_failure: Callable[[str], None],
                 after_round: Callable[[], None] = lambda: None) -> None:
        """after_round runs the index's deferred bookkeeping; the mover calls it after each round
        of steps, so that work stays off the requests' path. on_failure is called with the
        reason when a step raises."""
        self._tiering = tiering
        self._after_round = after_round
        self._interval_s = interval_s
        self._on_failure = on_failure
        self._stop = threading.Event()
        self.failure = ""  # why the mover stopped, when it failed
        self._thread = threading.Thread(target=self._run, name="mover", daemon=True)

    def start(self) -> None:
        """Start the thread; from now on puts and loads may wait for it to make room."""
        self._tiering.mover_running = True
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for its step in progress to end; puts and loads no
        longer wait for it."""
        self._tiering.mover_running = False
        self._stop.set()
        self._tiering.wake.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        wake = self._tiering.wake
        while not self._stop.is_set():
            wake.wait(self._interval_s)
            wake.clear()
            try:
                while not self._stop.is_set() and self._tiering.step():
                    pass
                self._after_round()
            except Exception as exc:
                self._tiering.mover_running = False
                self.failure = f"{type(exc).__name__}: {exc}"
                log.exception("the tier mover failed; marking NOT_SERVING")
                self._on_failure(self.failure)
                return
