"""Prefetch: bring a prefix chain of blocks up to a target tier, reporting as keys get ready.

Keys are loaded in key order (root first) with up to `window` loads in flight, through the
same coalescing loads as Get (kvstore.daemon.tiering), so a key that a Get or another Prefetch is
already loading is waited for, not read twice. Progress is yielded whenever the caller would
otherwise wait, and at the end. At the deadline the last message carries the ready prefix
and `deadline_exceeded`; loads not yet started are never started. When `cancelled()` turns
true (the client went away) the generator stops starting loads and returns.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from kvstore.core.index import Index
from kvstore.daemon.tiering import Load, Tiering
from kvstore.keys import BlockKey
from kvstore.tier import Tier

_POLL_S = 0.05  # how often a wait looks at the deadline and the caller


@dataclass(slots=True)
class PrefetchProgress:
    """How far a Prefetch has come, as each progress message reports it."""

    done: int = 0  # keys now in the target tier or above
    missing: int = 0  # keys in no tier
    failed: int = 0  # keys that could not be moved (no room, read error)
    total: int = 0  # keys asked for
    prefix_length: int = 0  # keys[0:prefix_length] are all in the target tier
    deadline_exceeded: bool = False

    def count(self, outcome: str) -> None:
        """Count the next key in order: "done", "missing" or "failed"."""
        if outcome == "done":
            # in the ready prefix when every key before it is
            self.prefix_length += self.prefix_length == self.done + self.missing + self.failed
            self.done += 1
        elif outcome == "missing":
            self.missing += 1
        else:
            self.failed += 1


def prefetch(
    lock: threading.RLock, index: Index, tiering: Tiering, namespace: str,
    keys: Sequence[BlockKey], target: Tier, deadline: float | None,
    cancelled: Callable[[], bool], clock: Callable[[], float], window: int,
) -> Iterator[PrefetchProgress]:
    """Bring keys up to target, in key order, with at most window loads in flight; yield
    the progress whenever the next key is not there yet, and once at the end. Past deadline
    (a clock() reading) no load is started and the last progress says deadline_exceeded;
    once cancelled() is true it returns without a last message. The caller has checked the
    keys."""
    progress = PrefetchProgress(total=len(keys))
    pending: deque[str | Load] = deque()  # per key, in order: "done", "missing" or a load
    started = 0
    while started < len(keys) or pending:
        if deadline is None or clock() < deadline:  # past it, no load is started
            with lock:
                while started < len(keys) and len(pending) < window:
                    pending.append(_start(index, tiering, namespace, keys[started], target))
                    started += 1
        if not pending:
            break
        head = pending[0]
        if isinstance(head, Load):
            if not head.done:
                yield replace(progress)
            while not head.wait(_wait_s(deadline, clock)):
                if cancelled():
                    return
                if deadline is not None and clock() >= deadline:
                    progress.deadline_exceeded = True
                    yield progress
                    return
            head = "done" if head.ok else "failed"
        pending.popleft()
        progress.count(head)
        if cancelled():
            return
    progress.deadline_exceeded = started < len(keys)
    yield progress


def _start(index: Index, tiering: Tiering, namespace: str, key: BlockKey,
           target: Tier) -> str | Load:
    """Start prefetching key; the caller holds the lock. "missing" when no tier holds it,
    "done" when it is in target or above (it is touched, as it is needed soon), else the
    load that brings it up."""
    entry = index.get(namespace, key)
    if entry is None:
        return "missing"
    if entry.tier <= target:
        index.touch(namespace, [key])  # first in the eviction order's queue to stay: needed soon
        return "done"
    return tiering.load(entry, target)


def _wait_s(deadline: float | None, clock: Callable[[], float]) -> float:
    """How long to wait for a load before looking at the deadline and the caller again."""
    if deadline is None:
        return _POLL_S
    return max(0.0, min(_POLL_S, deadline - clock()))
