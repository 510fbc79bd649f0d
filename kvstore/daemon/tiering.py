"""Moving blocks between the slot tiers: demotion under pressure, loads (promotion) with
coalescing, and the L3 manifest that lets a restarted daemon re-adopt what L3 held.

What goes where is the planner's (`kvstore.core.placement`: free pages, demotion or eviction;
L3 pages, L3 eviction or a drop; admission; exclusive or inclusive L3); this module executes
its plans: the locking, the I/O, the manifest journal, the counters, waiting for the mover.

With tenants each slot tier is split into arenas (`kvstore.core.index`): the watermarks,
the mover's demotions and waiting for room all apply per arena, and a block demoted out of
its L2 arena lands in the same tenant's L3 arena.

The store's lock guards the index; every method here takes it only to plan and to finish a
move, never around I/O. An entry being moved or loaded is `busy` (`index.moves`,
`kvstore.core.moves`), so neither its copy nor its pages change under the transfer. Order
for crash safety: a block's bytes are written to L3 before its manifest COMMIT record, and a
FREE record is appended before its L3 pages can be handed to anything else; every L3 read is
checked against the block's checksum, so whatever a crash leaves behind is a miss, never
wrong bytes.

A read (`hold_read`, for `kvstore.daemon.reader`) gets every block it found in L2 at once:
L2 pages for all of its L3 blocks are taken together, then its entries are held until it has
leased them, so neither a demotion nor another read's load takes a block from under it; a
read short of room holds nothing while it waits its turn, so reads that together need more
than L2 never hold part of it each while waiting for the rest.

L3 admission also follows the room on L3's filesystem (`kvstore.daemon.l3room`): the mover
checks the free space against the reserve, and an L3 write that finds no room turns
admission off; while it is off the planner admits nothing new to L3.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvstore.core.errors import StartupError
from kvstore.core.index import Index
from kvstore.core.moves import Pages
from kvstore.core.placement import Demotion, Move, Placement, RoomStep
from kvstore.core.records import Entry
from kvstore.daemon.config import Config
from kvstore.daemon.iometer import IoMeter
from kvstore.daemon.l3room import NO_ROOM_ERRNOS, L3Admission
from kvstore.daemon.manifest import Manifest, ManifestRecord
from kvstore.keys import BlockKey
from kvstore.tier import Tier, TierStats
from kvstore.tiers.base import SlotTier, Transfer
from kvstore.tiers.dram import DramTier

log = logging.getLogger(__name__)

#: Blocks one demotion round handles per hold of the store lock. Picking and planning cost
#: about 11 us a block (15,000 blocks of 4 KiB: 160 ms, measured), so a round holds the lock
#: about 3 ms, like a 4,096-key Lookup, whatever the block size; blocks of 256 KiB and more
#: fill movers.batch_bytes (64 MiB) in one round.
DEMOTE_ROUND_BLOCKS = 256

#: How often a read short of L2 room looks again once waiting for the mover is over (or no
#: mover can help): then only an end of what holds L2 (a lease released or expired, a load
#: or a put done) makes room, and most of those notify the waiters at once; the poll catches
#: the rest (leases the sweeper expires, every `leases.sweep_interval_s`, 0.5 s by default)
#: within a tenth of that.
READ_POLL_S = 0.05

_NO_ROOM = NO_ROOM_ERRNOS


class Load:
    """One load of a block into a tier; every reader wanting it waits on the same one."""

    __slots__ = ("_done", "ok")

    def __init__(self) -> None:
        self._done = threading.Event()
        self.ok = False

    def finish(self, ok: bool) -> None:
        """End the load: ok says whether the block is now in the target tier."""
        self.ok = ok
        self._done.set()

    @property
    def done(self) -> bool:
        """Whether the load has finished, well or not."""
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait up to timeout_s (None: for as long as it takes) for the load to finish;
        True once it has, and then `ok` says whether the block is in place."""
        return self._done.wait(timeout_s)


@dataclass(slots=True)
class HeldRead:
    """What one read holds from `Tiering.hold_read` until `Tiering.release_read`: its
    entries, held busy so that none of them leaves L2 (or is evicted) before the read leases
    them, and the loads bringing those cached only in L3 into L2, by key. Empty when the read
    needs no load (every entry it found is in L2) or when its time to wait for room ran out;
    then `short` counts the blocks it found only in L3 and could not load."""

    entries: list[Entry] = field(default_factory=list)
    loads: dict[BlockKey, Load] = field(default_factory=dict)
    short: int = 0


class Tiering:
    """The demotions, loads and L3 manifest of one store (see the module docstring). It
    shares the store's lock, index and counters."""

    def __init__(self, config: Config, index: Index, lock: threading.RLock,
                 tiers: dict[Tier, SlotTier], manifest: Manifest | None,
                 stats: dict[Tier, TierStats]) -> None:
        self.config = config
        self.index = index
        self.tiers = tiers
        self.manifest = manifest
        self.stats = stats
        self.placement = Placement(index, tiers, config.nvme.admit_min_seen,
                                   inclusive=config.nvme.placement == "inclusive")
        self.room = threading.Condition(lock)  # notified whenever pages are freed
        self.wake = threading.Event()  # asks the mover for a step now
        self._loads: dict[tuple[str, BlockKey, Tier], Load] = {}
        self.loads_coalesced = 0  # loads joined instead of started (a Prometheus counter)
        self.mover_running = False  # set by the mover: whether waiting for room can help
        self._compact_at = config.nvme.compact_after_records  # journal records
        # whether L3 takes new blocks, by the room on its filesystem; inert without L3
        self.l3_admission = L3Admission(manifest.directory if manifest is not None else None,
                                        self.placement,
                                        configured_reserve=config.nvme.reserve_bytes)
        self.meter = IoMeter()
        # free pages each waiting put or load needs, by tier and arena
        self._waiting: dict[tuple[Tier, str], list[int]] = {}
        self._read_queue: deque[object] = deque()  # reads waiting for L2 room, in turn
        self._arena_pages = {t: {a: index.arena_usage(t, a)[3] for a in index.arena_names(t)}
                             for t in tiers}
        threads = 2 * config.nvme.io_threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="load")

    def close(self) -> None:
        """Let the loads queued or in flight finish, then stop their threads."""
        self._pool.shutdown(wait=True, cancel_futures=False)

    @property
    def dram(self) -> DramTier:
        """L2, as the DramTier it is: loads from L3 read into its pages."""
        tier = self.tiers[Tier.DRAM]
        assert isinstance(tier, DramTier)
        return tier

    # --- start-up --------------------------------------------------------------------------

    def adopt(self) -> int:
        """Re-adopt the blocks the L3 manifest lists, as a restarted daemon does, then
        compact the manifest; return how many were adopted. A block whose pages now lie
        outside its tenant's arena is dropped."""
        if self.manifest is None:
            return 0
        try:
            report = self.manifest.load()
        except OSError as exc:
            if exc.errno not in _NO_ROOM:
                raise
            raise StartupError(f"cannot write the L3 manifest in {self.manifest.directory}: "
                               f"{exc.strerror}; free space there (nvme.dir)") from exc
        if report.discarded:
            log.warning("L3 manifest discarded: %s; L3 starts empty", report.discarded)
        if report.torn_bytes:
            log.warning("L3 manifest: ignored a torn tail of %d bytes", report.torn_bytes)
        adopted = orphans = 0
        with self.room:
            for r in report.records:
                if self.index.moves.adopt(r.namespace, BlockKey(r.key), r.size_bytes, r.checksum,
                                    BlockKey(r.parent) if r.parent else None, Tier.NVME,
                                    r.pages) is not None:
                    adopted += 1
            # A block whose prefix is gone (it lived only in L2 before a crash) could never
            # be found again by a lookup: dropped, with its descendants.
            orphans = len(self.index.drop_orphans())
            adopted -= orphans
        if orphans:
            log.warning("L3: dropped %d re-adopted blocks whose prefix is gone", orphans)
        if self.manifest.journal_records or adopted < len(report.records):
            self._compact()  # on a full disk the journal stays as it is: it is still valid
        self.l3_admission.poll()
        log.info("L3: re-adopted %d blocks from the manifest", adopted)
        return adopted

    def _records(self) -> list[ManifestRecord]:
        return [_record(e) for e in self.index.entries(Tier.NVME)]

    # --- pressure ----------------------------------------------------------------------------

    def fullness(self, tier: Tier, arena: str | None = None) -> float:
        """How full tier's arena is (one the tier does not have: 1.0), or with arena None its
        fullest arena: the mover has work once that passes the high watermark."""
        if arena is not None:
            num_pages = self._arena_pages[tier].get(arena, 0)
            return 1.0 - self.index.free_pages(tier, arena) / num_pages if num_pages else 1.0
        return max(self.fullness(tier, a) for a in self._arena_pages[tier])

    def wait_for_room(self, tier: Tier, num_pages: int, timeout_s: float,
                      arena: str = "") -> bool:
        """Ask the mover for room and wait up to timeout_s for num_pages free pages in
        tier's arena; the caller holds the lock, which the wait releases. Returns False at
        once when no mover can free pages there, or when the arena could never hold that
        many."""
        if (not self.mover_running or not self.placement.can_demote(tier)
                or num_pages > self._arena_pages[tier].get(arena, 0)):
            return False
        waiting = self._waiting.setdefault((tier, arena), [])
        waiting.append(num_pages)
        self.wake.set()
        try:
            return self.room.wait_for(
                lambda: self.index.free_pages(tier, arena) >= num_pages, timeout_s)
        finally:
            waiting.remove(num_pages)

    def step(self) -> int:
        """One mover step: demote from every arena of every tier above its high watermark
        down towards its low watermark (or until a waiting put or load fits). Returns the
        bytes moved."""
        self.l3_admission.poll()  # a folder that cannot be checked raises: the mover fails
        moved = 0
        # Without L3 there is nowhere to demote L2 blocks to: puts evict on demand instead.
        for tier in (t for t in (Tier.HBM, Tier.DRAM) if self.placement.can_demote(t)):
            for arena in self._arena_pages[tier]:
                want = self._want_bytes(tier, arena)
                if want > 0:
                    moved += self._demote(tier, want, arena)
        if self.manifest is not None and self.manifest.journal_records >= self._compact_at:
            self._compact()
        return moved

    def _compact(self) -> None:
        assert self.manifest is not None
        every = self.config.nvme.compact_after_records
        with self.room:
            try:
                self.manifest.snapshot(self._records())
                self._compact_at = every
            except OSError as exc:
                if exc.errno not in _NO_ROOM:
                    raise  # the folder is gone or broken: the mover fails loudly
                self._compact_at = self.manifest.journal_records + every
                self.l3_admission.no_room(exc)  # retried after `every` more records

    def _want_bytes(self, tier: Tier, arena: str) -> int:
        """Bytes to demote from tier's arena now: down to the low watermark once past the
        high one, or enough for what a waiting put or load needs, at most movers.batch_bytes."""
        mv = self.config.movers
        page_bytes: int = self.tiers[tier].page_size_bytes
        fullness = self.fullness(tier, arena)
        want = 0
        if fullness >= mv.high_watermark:
            capacity_bytes = self._arena_pages[tier][arena] * page_bytes
            want = int((fullness - mv.low_watermark) * capacity_bytes) + 1
        short = (max(self._waiting.get((tier, arena), [0]), default=0)
                 - self.index.free_pages(tier, arena))
        return min(mv.batch_bytes, max(want, short * page_bytes))

    # --- demotion ----------------------------------------------------------------------------

    def _demote(self, tier: Tier, want_bytes: int, arena: str) -> int:
        """Move about want_bytes out of tier's arena in eviction order, each block where the
        planner says, in rounds of at most DEMOTE_ROUND_BLOCKS blocks. Returns the bytes
        picked."""
        moved = 0
        while moved < want_bytes:
            picked = self._demote_round(tier, want_bytes - moved, arena)
            if not picked:
                break
            moved += picked
        return moved

    def _demote_round(self, tier: Tier, want_bytes: int, arena: str) -> int:
        """One round of _demote: pick and plan under the lock, write L3 outside it, finish
        under it again; waiting puts are woken at its end. Returns the bytes picked."""
        with self.room:
            picked = self.index.moves.pick(tier, want_bytes, DEMOTE_ROUND_BLOCKS, arena)
            writes = [d for d in (self._plan_demotion(e, tier) for e in picked)
                      if d.move is Move.WRITE]
            batch = [Transfer(d.pages, d.entry.size_bytes,
                              self.dram.buffers(d.entry.copies[Tier.DRAM], d.entry.size_bytes))
                     for d in writes]
        errors = self._io(Tier.NVME, "write", batch) if batch else []
        with self.room:
            for demotion, error in zip(writes, errors, strict=True):
                self._finish_demotion(demotion, error)
            self.room.notify_all()
        return sum(e.size_bytes for e in picked)

    def _plan_demotion(self, entry: Entry, tier: Tier) -> Demotion:
        """The planner's move for entry, counted in the tiers' figures; the caller holds the
        lock. The blocks it evicts from L3 are journaled as freed before their pages are
        written."""
        demotion = self.placement.demote(entry, tier)
        if demotion.move is Move.DROP:
            if demotion.left:
                self.stats[tier].demotions += 1
        elif demotion.move is Move.WRITE:
            self.journal_free(demotion.l3_evicted)
        else:  # not admitted, or no room in L3: it left L2 unwritten
            self.stats[Tier.NVME].admissions_refused += 1
        return demotion

    def _finish_demotion(self, demotion: Demotion, error: OSError | None) -> None:
        """Commit a demotion's L3 copy to the manifest, or count why it failed (error is
        the L3 write's), and let the planner finish the move; the caller holds the lock."""
        entry = demotion.entry
        if error is None:
            try:
                self._journal_commit(entry, demotion.pages)
            except OSError as exc:
                error = exc
        if error is None:
            self.stats[Tier.NVME].bytes_in += entry.size_bytes
            self.stats[Tier.DRAM].demotions += 1
            self.l3_admission.wrote()
        else:
            self.stats[Tier.NVME].admissions_refused += 1
            if not self.l3_admission.no_room(error):  # no room: admission off, one warning
                self.stats[Tier.NVME].io_errors += 1
                log.warning("L3 write failed, block not admitted: %s", error)
        # A reader may have leased it meanwhile: then the next step drops its L2 copy.
        self.placement.finish_demotion(demotion, written=error is None)

    # --- reads: every block of a Get in L2 at once --------------------------------------------

    def hold_read(self, namespace: str, keys: Sequence[BlockKey], until: float) -> HeldRead:
        """Make every cached block of one read stay in, or come into, L2 until the read has
        leased them; the caller holds the lock, which waiting releases.

        The read's L2 pages are taken all at once, for every block it needs loaded from L3
        (a load already in flight is joined and needs none), and only then are its entries
        held: a read holds nothing while it waits, so reads whose blocks together exceed L2
        take turns instead of each holding part of L2 while waiting for the rest. The pages
        are free ones, or those the mover frees by demoting; reads short of room queue, and
        the first in the queue takes its pages as soon as they are free, so a read needing
        many pages is not passed for ever by reads needing few. Only when no mover can
        demote (it stopped, or there is no L3) is room made by evicting unheld blocks, the
        read's own spared: with a mover, those blocks would be demoted rather than lost.
        While room cannot be had (L2 held by leases, loads, puts and pins) the read waits
        for what holds it to end, until `until` (a time.monotonic() reading); then it holds
        nothing and the caller serves what L2 has.

        Blocks past the longest prefix of keys whose blocks fit together in what pins leave
        of their L2 arena are neither held nor loaded: a read larger than L2 gets its prefix
        at once rather than waiting for room that cannot come. The caller waits for the
        loads, leases, and then calls release_read()."""
        if Tier.DRAM not in self.tiers:
            return HeldRead()
        turn: object | None = None  # this read's place in the queue, once it waits
        pinned: dict[str, int] | None = None  # L2 pages pinned, by arena, once it is short
        try:
            while True:
                cached = [e for k in keys if (e := self.index.get(namespace, k)) is not None]
                if all(e.tier <= Tier.DRAM for e in cached):
                    return HeldRead()  # the usual case: every block it found is in L2
                found = self._fitting(cached, pinned or {})
                below = [e for e in found if e.tier > Tier.DRAM]
                if not below:
                    return HeldRead()  # its L3 blocks lie past what L2 can take at once
                joined = {e.key: ld for e in below if (ld := self._load_of(e)) is not None}
                fresh = [e for e in below if e.key not in joined]
                evict = not (self.mover_running and self.placement.can_demote(Tier.DRAM))
                first = not self._read_queue or self._read_queue[0] is turn
                pages = self._read_pages(fresh, found, evict) if first or not fresh else None
                if pages is not None:
                    return self._start_read(found, joined, fresh, pages)
                if pinned is None:  # short of room: never wait for what pins keep
                    pinned = self._pinned_pages()
                    if pinned:
                        continue
                if time.monotonic() >= until:
                    return HeldRead(short=len(fresh))
                if turn is None:
                    turn = object()
                    self._read_queue.append(turn)
                self._wait_read_room(fresh, until, evict, turn)
        finally:
            if turn is not None:
                self._read_queue.remove(turn)
                self.room.notify_all()  # the next in the queue may go now

    def _start_read(self, found: list[Entry], joined: dict[BlockKey, Load],
                    fresh: Sequence[Entry], pages: Sequence[Pages]) -> HeldRead:
        """Hold a read's entries and start its loads into the pages taken for them."""
        for entry in found:
            self.index.moves.hold(entry)
        self.loads_coalesced += len(joined)
        loads = dict(joined)
        for entry, got in zip(fresh, pages, strict=True):
            loads[entry.key] = self._start_load(entry, Tier.DRAM, got)
        return HeldRead(found, loads)

    def release_read(self, held: HeldRead) -> None:
        """End what hold_read() held, once the read leased its entries; the caller holds
        the lock."""
        for entry in held.entries:
            self.index.moves.done(entry)
        self.holds_ended()

    def holds_ended(self) -> None:
        """Leases or holds of L2 entries just ended (the caller holds the lock): when reads
        wait for L2 room, wake them, and the mover, which may now demote those entries."""
        if self._read_queue:
            self.wake.set()
            self.room.notify_all()

    def _fitting(self, cached: Sequence[Entry], pinned: dict[str, int]) -> list[Entry]:
        """The longest prefix of a read's cached entries whose blocks fit together in their
        L2 arenas, less the pages pinned there (pinned: by arena; a pinned block of the read
        already in L2 needs no room of its own)."""
        room = {a: n - pinned.get(a, 0) for a, n in self._arena_pages[Tier.DRAM].items()}
        for i, entry in enumerate(cached):
            if not (entry.pinned and Tier.DRAM in entry.copies):
                room[entry.arena] = room.get(entry.arena, 0) - self.index.pages_per_object(
                    Tier.DRAM, entry.size_bytes)
                if room[entry.arena] < 0:
                    return list(cached[:i])
        return list(cached)

    def _pinned_pages(self) -> dict[str, int]:
        """The L2 pages pinned blocks take, by arena. Counted only for a read short of room,
        as it walks every pin."""
        pinned: dict[str, int] = {}
        for namespace, key in self.index.holdings.pins:
            entry = self.index.get(namespace, key)
            if entry is not None and Tier.DRAM in entry.copies:
                pinned[entry.arena] = pinned.get(entry.arena, 0) + self.index.pages_per_object(
                    Tier.DRAM, entry.size_bytes)
        return pinned

    def _load_of(self, entry: Entry) -> Load | None:
        """The load in flight bringing entry into L2 (or through it into L1), if any."""
        return (self._loads.get((entry.namespace, entry.key, Tier.DRAM))
                or self._loads.get((entry.namespace, entry.key, Tier.HBM)))

    def _read_pages(self, fresh: Sequence[Entry], found: Sequence[Entry],
                    evict: bool) -> list[Pages] | None:
        """L2 pages for each of fresh, all or none: free ones, or with evict, freed by
        evicting unheld blocks other than found (a read's own); the caller holds the
        lock."""
        need = self._pages_by_arena(fresh)
        short = [a for a, n in need.items() if self.index.free_pages(Tier.DRAM, a) < n]
        if short and not evict:
            return None
        if short:
            for entry in found:  # held while room is made, so that it is not theirs
                self.index.moves.hold(entry)
            try:
                for arena in short:
                    if self.index.make_room(Tier.DRAM, need[arena], arena) is None:
                        return None
            finally:
                for entry in found:
                    self.index.moves.done(entry)
        pages = [self.index.moves.alloc(Tier.DRAM, e.size_bytes, e.arena) for e in fresh]
        assert all(p is not None for p in pages), "the pages were free or made free"
        return [p for p in pages if p is not None]

    def _wait_read_room(self, fresh: Sequence[Entry], until: float, evict: bool,
                        turn: object) -> None:
        """Wait until `until` at most for the room fresh need in L2, with the mover asked
        for it; the caller holds the lock, which the wait releases. The wait ends once this
        read is first in the queue and its pages are free; with evict (no mover can demote),
        at whatever may have made room (a hold ended, pages freed), and after READ_POLL_S
        at most, for the read to try eviction again."""
        need = self._pages_by_arena(fresh)
        arena = max(need, key=lambda a: need[a] - self.index.free_pages(Tier.DRAM, a))
        timeout_s = max(0.0, until - time.monotonic())
        waiting = self._waiting.setdefault((Tier.DRAM, arena), [])
        waiting.append(need[arena])
        self.wake.set()
        try:
            if evict:
                self.room.wait(min(timeout_s, READ_POLL_S))
            else:
                self.room.wait_for(lambda: self._read_queue[0] is turn and all(
                    self.index.free_pages(Tier.DRAM, a) >= n for a, n in need.items()),
                    timeout_s)
        finally:
            waiting.remove(need[arena])

    def _pages_by_arena(self, entries: Iterable[Entry]) -> dict[str, int]:
        need: dict[str, int] = {}
        for entry in entries:
            need[entry.arena] = need.get(entry.arena, 0) + self.index.pages_per_object(
                Tier.DRAM, entry.size_bytes)
        return need

    # --- loads (promotion) -------------------------------------------------------------------

    def load(self, entry: Entry, target: Tier) -> Load:
        """Bring entry up to target (DRAM or HBM), or join the load already doing so; the
        caller holds the lock. The entry stays busy until the load finishes."""
        load = self._loads.get((entry.namespace, entry.key, target))
        if load is not None:
            self.loads_coalesced += 1
            return load
        return self._start_load(entry, target)

    def _start_load(self, entry: Entry, target: Tier, pages: Pages | None = None) -> Load:
        """Start loading entry into target, into pages of L2 taken for it already (a
        read's, hold_read) or, with pages None, into pages found when the load runs (_room);
        the caller holds the lock."""
        key = (entry.namespace, entry.key, target)
        load = self._loads[key] = Load()
        self.index.moves.hold(entry)
        self._pool.submit(self._run_load, entry, target, key, load, pages)
        return load

    def _run_load(self, entry: Entry, target: Tier, key: tuple[str, BlockKey, Tier],
                  load: Load, pages: Pages | None) -> None:
        ok = False
        try:
            if Tier.DRAM in entry.copies:
                ok = True
                if pages is not None:
                    with self.room:
                        self.index.moves.free(Tier.DRAM, pages)
            else:
                ok = self._load_l3(entry, pages)
            if ok and target == Tier.HBM and Tier.HBM not in entry.copies:
                ok = self._load_l1(entry)
        except Exception:
            log.exception("load of a block into %s failed", target.label)
        finally:
            with self.room:
                del self._loads[key]
                self.index.moves.done(entry)
                self.room.notify_all()
            load.finish(ok)

    def _room(self, tier: Tier, size_bytes: int, arena: str = "") -> Pages | None:
        """Pages in tier's arena for a load, where the planner says: free pages; else, when
        it says demote, the pages the mover frees (waited for at most movers.put_wait_s);
        else pages freed by eviction. None when none can be had."""
        with self.room:
            got = self.placement.alloc(tier, size_bytes, arena=arena)
            if got.room.step is RoomStep.DEMOTE:
                self.wait_for_room(tier, got.room.num_pages, self.config.movers.put_wait_s,
                                   arena)
                got = self.placement.alloc(tier, size_bytes, demoted=True, arena=arena)
            return got.pages

    def _load_l3(self, entry: Entry, pages: Pages | None = None) -> bool:
        """Load a block from L3 into L2, reading straight into its new L2 pages (those
        given, else found by _room), and check the bytes against the block's checksum.
        Pages that do not become its copy are freed."""
        if pages is None and Tier.NVME in entry.copies:
            pages = self._room(Tier.DRAM, entry.size_bytes, entry.arena)
        if pages is None:
            return False
        placed = False
        try:
            if Tier.NVME not in entry.copies:
                return False
            buffers = self.dram.buffers(pages, entry.size_bytes)
            [error] = self._io(Tier.NVME, "read", [
                Transfer(entry.copies[Tier.NVME], entry.size_bytes, buffers)])
            intact = error is None and self.dram.checksum(
                self.dram.extents(pages, entry.size_bytes)) == entry.checksum
            with self.room:
                if not intact:
                    self._drop_damaged(entry, error)
                    return False
                if self.placement.promote(entry, Tier.DRAM, pages):
                    self.journal_free([entry])  # its L3 copy went (exclusive placement)
                placed = True
                self.index.touch(entry.namespace, [entry.key])  # most recently used
                self.stats[Tier.NVME].bytes_out += entry.size_bytes
                self.stats[Tier.DRAM].promotions += 1
            return True
        finally:
            if not placed:
                with self.room:
                    self.index.moves.free(Tier.DRAM, pages)

    def _drop_damaged(self, entry: Entry, error: OSError | None) -> None:
        stats = self.stats[Tier.NVME]
        if error is not None:
            stats.io_errors += 1
            log.warning("L3 read failed; block dropped: %s", error)
        else:
            stats.checksum_failures += 1
            log.warning("L3 block failed its checksum; dropped (a miss, never wrong bytes)")
        removed = self.index.moves.discard(entry)  # with its descendants: none is stranded
        self.journal_free(e for e in removed if Tier.NVME in e.copies)

    def _load_l1(self, entry: Entry) -> bool:
        """Load a block from L2 into L1 through its pinned L2 pages, which stay put because
        the entry is busy meanwhile."""
        pages = self._room(Tier.HBM, entry.size_bytes, entry.arena)
        if pages is None:
            return False
        buffers = self.dram.buffers(entry.copies[Tier.DRAM], entry.size_bytes)
        [error] = self._io(Tier.HBM, "write", [Transfer(pages, entry.size_bytes, buffers)])
        with self.room:
            if error is not None:
                self.index.moves.free(Tier.HBM, pages)
                self.stats[Tier.HBM].io_errors += 1
                return False
            self.placement.promote(entry, Tier.HBM, pages)
            self.stats[Tier.HBM].promotions += 1
            self.stats[Tier.HBM].bytes_in += entry.size_bytes
        return True

    # --- I/O and the journal -----------------------------------------------------------------

    def _io(self, tier: Tier, op: str, batch: Sequence[Transfer]) -> list[OSError | None]:
        slot = self.tiers[tier]
        return self.meter.run(self.stats[tier], op, slot.write if op == "write" else slot.read,
                              batch)

    def _journal_commit(self, entry: Entry, pages: Pages) -> None:
        if self.manifest is not None:
            self.manifest.commit(_record(entry, pages))

    def journal_free(self, entries: Iterable[Entry]) -> None:
        """Journal the entries' L3 pages as freed, before they can be reused. A FREE that
        cannot be written is logged: a stale COMMIT then points at reused pages, which the
        checksum turns into a miss."""
        if self.manifest is None:
            return
        for entry in entries:
            try:
                self.manifest.free(entry.namespace, entry.key)
            except OSError as exc:
                if not self.l3_admission.no_room(exc):
                    log.warning("L3 manifest: cannot record a free (%s); checksums guard the "
                                "reuse", exc)


def _record(entry: Entry, pages: Pages | None = None) -> ManifestRecord:
    return ManifestRecord(entry.namespace, entry.key, entry.size_bytes, entry.checksum,
                          entry.parent, pages if pages is not None else entry.copies[Tier.NVME])
