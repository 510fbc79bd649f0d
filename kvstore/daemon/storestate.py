"""The state the store shares with its reader and its writer, built once by the store.

A Store (`kvstore.daemon.store`) opens its tiers, builds its index, its tiering and its
counters, and puts them in one StoreState. It hands that same object to its Reader
(`kvstore.daemon.reader`) and its Writer (`kvstore.daemon.writer`), so all three change the
same index under the same lock and count into the same figures, and none of them keeps a
second copy of any piece.

L2 and L4 are the two pieces that change after start-up: the store sets `dram` and `remote`
to None when it closes. So the reader and the writer read them from the state at each call
and never keep them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.core.holdings import Caps
from kvstore.core.index import Index
from kvstore.daemon.config import Config
from kvstore.daemon.remote import Remote
from kvstore.daemon.tiering import Tiering
from kvstore.tier import Tier, TierStats
from kvstore.tiers.dram import DramTier


@dataclass(slots=True)
class StoreState:
    """What a store, its reader and its writer work on. Every change to the index is made
    with `lock` held."""

    config: Config  #: The daemon's settings.
    index: Index  #: Which blocks each tier holds, their leases, pins and plans.
    lock: threading.RLock  #: The one lock that guards the index and the counters.
    tiering: Tiering  #: Loads, demotions and the L3 manifest.
    stats: dict[Tier, TierStats]  #: The per-tier activity counters that Stats reports.
    clock: Callable[[], float]  #: Seconds, for lease, reservation and pin deadlines.
    caps: Caps  #: What one client may hold at once: leases, reservations, pinned bytes.
    dram: DramTier | None  #: L2; None when dram.enabled is false or once the store closed.
    remote: Remote | None  #: L4; None when remote.url is unset, L2 is off, or once closed.

