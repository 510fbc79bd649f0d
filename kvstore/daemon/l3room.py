"""Room for L3 on its filesystem: the reserve the daemon leaves free there, the start-up check
of nvme.capacity_bytes against the free space, and the switch that turns L3 admission off
while the filesystem is short of room.

- `reserve_bytes(size_bytes, configured)`: what the daemon leaves free on a filesystem of that
  size: nvme.reserve_bytes when set, else the automatic reserve (`RESERVE_*`).
- `fitting_capacity_bytes` / `capacity_problem`: the preflight, run by
  `kvstore.daemon.tier_setup` before the L3 file is preallocated. The file and the most its
  manifest can grow to (`manifest_bytes`) may take the free space less the reserve, plus
  whatever an existing L3 file of ours already holds on disk (it is reused in place, so
  those bytes are not taken again). So an L3 that fits never turns admission off by itself.
- `L3Admission`: owned by `kvstore.daemon.tiering`, which tells it of every L3 write that
  fails and lets the mover poll it; it switches the planner's admission rule. Admission goes
  off, with one warning, when a check finds the free space under the reserve (`LOW_SPACE`:
  someone else filled the disk, or a sparse L3 file grew), or when an L3 write (a page of
  the file, a manifest record, a snapshot) fails for want of room (`NO_ROOM`). While it is
  off nothing new goes into L3; reads of what L3 holds, and L2, go on. The mover checks the
  free space at most every `CHECK_INTERVAL_S`; admission comes back on at the first check
  that finds at least `RESUME_FACTOR` times the reserve free and, after a failed write, no
  sooner than its hold-off (`NO_ROOM_BACKOFF`, doubling with each failure in a row: a full
  inode table or a quota looks like free space to statvfs, and must not make it flap).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvstore.backoff import ExponentialBackoff
from kvstore.core.placement import Placement
from kvstore.units import GiB, KiB, MiB, format_size

log = logging.getLogger(__name__)

#: The reserve is 10% of the filesystem, at least 1 GiB, at most a quarter of it. 10%: the
#: Helm chart puts L3 on a hostPath folder, by default on the node's root disk, where
#: kubelet's default hard eviction threshold is nodefs.available < 10%; an L3 that took the
#: disk below it would set off DiskPressure and pod evictions across the node. 1 GiB: on
#: any disk, room for logs, the manifest's snapshot beside its old copy, and an operator's
#: shell. A quarter: under 4 GiB (a test tmpfs, a small volume meant for L3 alone) the
#: 1 GiB floor would leave L3 little or nothing.
RESERVE_FRACTION = 0.10
RESERVE_MIN_BYTES = 1 * GiB
RESERVE_MAX_FRACTION = 0.25
#: Admission comes back on only with this much more than the reserve free, so a filesystem
#: hovering at the reserve does not flip it (and log) at every check.
RESUME_FACTOR = 1.1
#: What one manifest record may take, for sizing the manifest: a COMMIT is 96 bytes, its
#: namespace (up to 256; typically a model name and layout, under 100) and 12 bytes a page
#: run; 256 covers a 128-byte namespace and several runs. A larger one is caught while
#: running: admission goes off at the reserve.
MANIFEST_RECORD_BYTES = 256
CHECK_INTERVAL_S = 1.0  #: a statvfs costs microseconds; a second bounds the disk filling unseen
#: After the n-th failed write in a row admission stays off at least compute(n) seconds.
NO_ROOM_BACKOFF = ExponentialBackoff(base_s=10.0, cap_s=600.0, jitter=False)

NO_ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a write that found no room

LOW_SPACE = "low_space"  # the free space fell under the reserve
NO_ROOM = "no_room"  # an L3 write failed with ENOSPC, EDQUOT or EFBIG
REASONS = (LOW_SPACE, NO_ROOM)


@dataclass(frozen=True, slots=True)
class Space:
    """A filesystem's size and the bytes an unprivileged writer may still take (statvfs's
    f_bavail, which leaves out blocks reserved for root, as kubelet does)."""

    size_bytes: int
    free_bytes: int


def space_of(path: Path) -> Space:
    """The space of the filesystem holding path; OSError when it cannot be read."""
    st = os.statvfs(path)
    return Space(st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)


def allocated_bytes(path: Path) -> int:
    """Bytes a regular file holds on disk (0 when there is none): what reusing it saves."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return 0
    return st.st_blocks * 512 if os.path.isfile(path) else 0


def reserve_bytes(size_bytes: int, configured: int = 0) -> int:
    """The bytes the daemon leaves free on a filesystem of size_bytes: configured
    (nvme.reserve_bytes) when set, else the automatic reserve (see RESERVE_*)."""
    if configured:
        return configured
    wanted = max(int(size_bytes * RESERVE_FRACTION), RESERVE_MIN_BYTES)
    return min(wanted, int(size_bytes * RESERVE_MAX_FRACTION))


def manifest_bytes(num_pages: int, journal_records: int) -> int:
    """The most the L3 manifest of num_pages pages can take on disk: a snapshot of one record
    per page (no object is smaller than a page), its next one written beside it while
    compacting, and a journal of journal_records records (nvme.compact_after_records)."""
    return (2 * num_pages + journal_records) * MANIFEST_RECORD_BYTES


def fitting_capacity_bytes(space: Space, reusable_bytes: int, page_size_bytes: int,
                           journal_records: int, configured_reserve: int = 0) -> int:
    """The largest L3 capacity, in whole pages, whose file and manifest (`manifest_bytes`)
    leave the reserve free, counting what an existing L3 file holds as room; never less than
    that file holds (reusing it takes nothing more). configured_reserve: nvme.reserve_bytes
    (0: the automatic reserve)."""
    reserve = reserve_bytes(space.size_bytes, configured_reserve)
    room = reusable_bytes + space.free_bytes - reserve - journal_records * MANIFEST_RECORD_BYTES
    num_pages = max(0, room) // (page_size_bytes + 2 * MANIFEST_RECORD_BYTES)
    return max(num_pages, reusable_bytes // page_size_bytes) * page_size_bytes


def setting_size(size_bytes: int) -> str:
    """size_bytes rounded down to a value for --set that parse_size reads: "170MiB"."""
    if size_bytes >= 100 * GiB:  # rounding to whole GiB loses under 1%
        return f"{size_bytes // GiB}GiB"
    if size_bytes >= MiB:
        return f"{size_bytes // MiB}MiB"
    return f"{size_bytes // KiB}KiB"


def capacity_problem(capacity_bytes: int, page_size_bytes: int, journal_records: int,
                     space: Space, reusable_bytes: int, folder: Path,
                     configured_reserve: int = 0) -> str:
    """Why nvme.capacity_bytes does not fit in folder's filesystem, saying what does; ""
    when it fits. configured_reserve: nvme.reserve_bytes (0: the automatic reserve)."""
    capacity_bytes = capacity_bytes // page_size_bytes * page_size_bytes  # what NvmeTier uses
    fits = fitting_capacity_bytes(space, reusable_bytes, page_size_bytes, journal_records,
                                  configured_reserve)
    if capacity_bytes <= fits:
        return ""
    reserve = reserve_bytes(space.size_bytes, configured_reserve)
    why = ("nvme.reserve_bytes" if configured_reserve else
           "10% of the filesystem, at least 1 GiB, at most a quarter; nvme.reserve_bytes sets it")
    manifest = manifest_bytes(capacity_bytes // page_size_bytes, journal_records)
    held = f", plus {format_size(reusable_bytes)} its L3 file holds" if reusable_bytes else ""
    if fits >= page_size_bytes:
        fix = f"set nvme.capacity_bytes={setting_size(fits)} or less"
    else:
        fix = "no L3 fits there: free some space, or set nvme.enabled=false"
    return (f"nvme.capacity_bytes ({format_size(capacity_bytes)}, and up to "
            f"{format_size(manifest)} for its manifest) does not fit in {folder}: its "
            f"filesystem has {format_size(space.free_bytes)} free of "
            f"{format_size(space.size_bytes)}{held}, and the daemon leaves "
            f"{format_size(reserve)} of it free (the L3 reserve: {why}); {fix}, or point "
            "nvme.dir at a volume with more room (docs/operations.md, \"Sizing L3\")")


@dataclass(frozen=True, slots=True)
class AdmissionState:
    """What the metrics show: whether L3 takes new blocks, and why not."""

    enabled: bool
    reason: str  # "" while enabled, else one of REASONS
    free_bytes: int  # at the last check; -1 before the first
    reserve_bytes: int  # the reserve of that check's filesystem; 0 before the first


class L3Admission:
    """Whether new blocks may go into L3 (see the module docstring), applied to the planner
    (`Placement.admitting`): while off, each demotion takes the planner's own NOT_ADMITTED
    path: the block leaves L2 unwritten, counted in admissions_refused, and nothing is
    written to L3. Inert (always on) without an L3 folder. Thread-safe; the clock is
    injected."""

    def __init__(self, folder: Path | None, placement: Placement,
                 clock: Callable[[], float] = time.monotonic, configured_reserve: int = 0) -> None:
        self.folder = folder  # the L3 folder, whose filesystem is checked; None: no L3
        self._configured_reserve = configured_reserve  # nvme.reserve_bytes; 0: automatic
        self._placement = placement
        self._clock = clock
        self._lock = threading.Lock()
        self._state = AdmissionState(True, "", -1, 0)
        self._next_check = -math.inf
        self._failures = 0  # writes failed for want of room since the last one that worked
        self._hold_until = -math.inf

    @property
    def state(self) -> AdmissionState:
        return self._state

    @property
    def enabled(self) -> bool:
        return self._state.enabled

    def poll(self) -> None:
        """Check the free space of the L3 filesystem when a check is due (at most every
        CHECK_INTERVAL_S). OSError when the folder cannot be checked (it is gone)."""
        if self.folder is not None and self._clock() >= self._next_check:
            self.check(space_of(self.folder))

    def check(self, space: Space) -> None:
        """Switch admission by a free-space check of the L3 filesystem made now."""
        now, reserve = self._clock(), reserve_bytes(space.size_bytes, self._configured_reserve)
        with self._lock:
            self._next_check = now + CHECK_INTERVAL_S
            was = self._state
            if space.free_bytes < reserve:
                enabled, reason = False, LOW_SPACE
            elif was.enabled or (space.free_bytes >= reserve * RESUME_FACTOR
                                 and now >= self._hold_until):
                enabled, reason = True, ""
            else:
                enabled, reason = False, was.reason
            self._set(AdmissionState(enabled, reason, space.free_bytes, reserve))
        if was.enabled and not enabled:
            log.warning("L3 admission off: %s free on the filesystem of %s, under the %s "
                        "reserve; new blocks stay out of L3 (L3 reads and L2 go on) until "
                        "%s is free", format_size(space.free_bytes), self.folder,
                        format_size(reserve), format_size(int(reserve * RESUME_FACTOR)))
        elif enabled and not was.enabled:
            log.info("L3 admission back on: %s free on the filesystem of %s",
                     format_size(space.free_bytes), self.folder)

    def no_room(self, error: OSError) -> bool:
        """Whether a failed L3 write failed for want of room (NO_ROOM_ERRNOS); then
        admission goes off for at least its hold-off."""
        if error.errno not in NO_ROOM_ERRNOS:
            return False
        with self._lock:
            self._failures += 1
            hold_s = NO_ROOM_BACKOFF.compute(self._failures)
            self._hold_until = self._clock() + hold_s
            was = self._state
            self._set(AdmissionState(False, was.reason or NO_ROOM, was.free_bytes,
                                     was.reserve_bytes))
        if was.enabled:
            log.warning("L3 admission off: an L3 write found no room in %s (%s); new blocks "
                        "stay out of L3 (L3 reads and L2 go on; a manifest record lost meanwhile "
                        "is a miss after a restart, never wrong bytes); on again in %.0fs at "
                        "the earliest", self.folder, error.strerror or error, hold_s)
        return True

    def wrote(self) -> None:
        """An L3 write went through: the next failure's hold-off starts from the first."""
        if self._failures:
            with self._lock:
                self._failures = 0

    def _set(self, state: AdmissionState) -> None:
        self._state = state
        self._placement.admitting = state.enabled
