"""Placement: where a load or a put gets its pages, and where a block goes when it leaves a tier.

One planner for the daemon (`kvstore.daemon.tiering` executes its plans with I/O) and the trace
simulator (`bench/sim_store.py` executes them without), so both follow the same rules. Pure: it
changes only the index (`kvstore.core.index`: make_room; its moves, `kvstore.core.moves`: alloc,
done, add_copy, drop_copy, free) and returns small frozen plans saying what happened and what
I/O the executor must still do.

Decisions, each within one arena of the tier (a tenant's pages, `kvstore.core.index`; a
tier without tenants is the one arena ""):

- `room(tier, num_pages, demoted, arena)`: where num_pages for a load or a put come from: the
  arena's free pages (FREE); else, when the tier demotes to a tier below by writing (L2 with
  an L3), from demotion first (DEMOTE: the daemon waits for its mover, the simulator demotes
  at once; then ask again with demoted=True); else, once demoted, or when num_pages exceed
  the arena's capacity, from eviction in eviction order (EVICT, which refuses what cannot fit).
- `alloc(tier, size_bytes, demoted, arena)`: that room taken for one object: its pages (free,
  or freed by evicting the arena's own blocks; the evicted entries are reported), or None
  when the step is DEMOTE or nothing more can be evicted.
- `demote(entry, tier)`: where a block picked to leave tier (`Moves.pick`) goes. A block with
  a copy below drops this copy (DROP: an L1 copy, which L2 always holds too; an L2 copy of a
  block L3 holds). A block seen fewer than `admit_min_seen` times is not admitted to L3 and
  leaves L2 unwritten (NOT_ADMITTED). Else it takes L3 pages of its own arena: free ones,
  else those of L3 victims of that arena, in eviction order (WRITE; the victims are reported,
  for the daemon to journal their FREE records before the pages are written); else it leaves
  L2 (NO_ROOM).
- `finish_demotion(demotion, written)`: after a WRITE: the L3 copy joins the block and its L2
  copy goes (unless a reader took it meanwhile); a failed write frees the L3 pages and the
  block leaves L2.
- `promote(entry, tier, pages)`: a finished load's copy joins the block; with exclusive
  placement (the default) an L2 copy replaces the L3 one, whose FREE the daemon journals.
- `can_demote(tier)`: whether pages of tier can be freed by moving blocks down rather than
  evicting them: L1 (its copies drop; L2 holds every L1 block), and L2 when an L3 is below.

Pinned, leased and busy entries are never chosen: the index's eviction order skips them.
A refused room is `pages=None`; an exception means misuse.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from kvstore.core.index import Index
from kvstore.core.moves import Pages
from kvstore.core.records import Entry
from kvstore.tier import Tier


class RoomStep(Enum):
    """Where the pages of a load or a put come from."""

    FREE = "free"  # the free pages suffice
    DEMOTE = "demote"  # short: demote out of the tier first, then ask again with demoted=True
    EVICT = "evict"  # short, and nothing (more) to demote: evict in eviction order


@dataclass(frozen=True, slots=True)
class Room:
    """The room decision for num_pages in tier."""

    tier: Tier
    step: RoomStep
    num_pages: int  # pages needed
    short_pages: int  # of those, how many are not free now (0 when FREE)


@dataclass(frozen=True, slots=True)
class Allocation:
    """Room taken for one object: its pages, and the entries whose copy in the tier went."""

    room: Room
    pages: Pages | None  # None: demote first (room.step is DEMOTE), or nothing more to evict
    evicted: tuple[Entry, ...] = ()  # in eviction order; some may keep a copy elsewhere


class Move(Enum):
    """What became of a block picked to leave a tier."""

    DROP = "drop"  # a copy below holds it: this copy goes, nothing is written
    WRITE = "write"  # admitted: write it to `pages` of L3, then finish_demotion
    NOT_ADMITTED = "not_admitted"  # seen fewer than admit_min_seen times, or admission off:
    # leaves L2 unwritten
    NO_ROOM = "no_room"  # L3 cannot make room: leaves L2 unwritten


@dataclass(frozen=True, slots=True)
class Demotion:
    """One demotion decision and the I/O it leaves to the executor."""

    entry: Entry
    tier: Tier  # the tier it leaves
    move: Move
    pages: Pages = ()  # WRITE: the L3 pages to write the block to
    l3_evicted: tuple[Entry, ...] = ()  # WRITE: L3 victims evicted for pages, in eviction order
    left: bool = False  # whether its copy in tier went already (False for WRITE until finished)


class Placement:
    """The placement rules over one index (see the module docstring)."""

    def __init__(self, index: Index, tiers: Iterable[Tier], admit_min_seen: int = 1,
                 inclusive: bool = False) -> None:
        if admit_min_seen < 1:
            raise ValueError(f"admit_min_seen must be >= 1, got {admit_min_seen}")
        self._index = index
        self._tiers = frozenset(tiers)  # the index's slot tiers
        self.admit_min_seen = admit_min_seen
        # Off while L3's filesystem is short of room (kvstore.daemon.l3room): nothing is
        # admitted, every demotion leaves L2 unwritten.
        self.admitting = True
        self.inclusive = inclusive  # a promoted block keeps its L3 copy

    def can_demote(self, tier: Tier) -> bool:
        """Whether moving blocks down (not evicting them) can free pages in tier."""
        if tier not in self._tiers:
            return False
        return tier == Tier.HBM or (tier == Tier.DRAM and Tier.NVME in self._tiers)

    # --- room for a load or a put ------------------------------------------------------------

    def room(self, tier: Tier, num_pages: int, demoted: bool = False, arena: str = "") -> Room:
        """Where num_pages in tier's arena come from: FREE, else DEMOTE (unless demoted
        already, or they can never fit), else EVICT. Changes nothing."""
        short_pages = max(0, num_pages - self._index.free_pages(tier, arena))
        if not short_pages:
            step = RoomStep.FREE
        # Demoting an L1 copy only drops it, which evicting it does at once: L1 never waits.
        elif (not demoted and tier != Tier.HBM and self.can_demote(tier)
              and num_pages <= self._index.arena_usage(tier, arena)[3]):
            step = RoomStep.DEMOTE
        else:
            step = RoomStep.EVICT
        return Room(tier, step, num_pages, short_pages)

    def alloc(self, tier: Tier, size_bytes: int, demoted: bool = False,
              arena: str = "") -> Allocation:
        """Pages in tier's arena for one object of size_bytes, as room() decides: free ones,
        or (EVICT) freed by evicting in eviction order, all or nothing; none yet when it says
        DEMOTE."""
        room = self.room(tier, self._index.pages_per_object(tier, size_bytes), demoted, arena)
        if room.step is RoomStep.DEMOTE:
            return Allocation(room, None)
        evicted: list[Entry] = []
        if room.step is RoomStep.EVICT:
            made = self._index.make_room(tier, room.num_pages, arena)
            if made is None:
                return Allocation(room, None)
            evicted = made
        pages = self._index.moves.alloc(tier, size_bytes, arena)
        assert pages is not None, "the pages were free or made free"
        return Allocation(room, pages, tuple(evicted))

    # --- demotion ------------------------------------------------------------------------------

    def demote(self, entry: Entry, tier: Tier = Tier.DRAM) -> Demotion:
        """Where entry, picked to leave tier (by Moves.pick, so busy), goes; see Move. A WRITE
        keeps it busy until finish_demotion; any other move is done with it."""
        if entry.busy <= 0 or tier not in entry.copies:
            raise ValueError("demote() takes an entry picked from the tier (Moves.pick)")
        if tier == Tier.HBM or (tier == Tier.DRAM and Tier.NVME in entry.copies):
            return Demotion(entry, tier, Move.DROP, left=self._leave(entry, tier, evicted=False))
        if not (tier == Tier.DRAM and self.can_demote(tier)):
            raise ValueError(f"no tier below {tier.label} to demote to")
        if not self.admitting or entry.seen < self.admit_min_seen:
            left = self._leave(entry, tier, evicted=True)
            return Demotion(entry, tier, Move.NOT_ADMITTED, left=left)
        got = self.alloc(Tier.NVME, entry.size_bytes, arena=entry.arena)
        if got.pages is None:
            return Demotion(entry, tier, Move.NO_ROOM, left=self._leave(entry, tier, evicted=True))
        return Demotion(entry, tier, Move.WRITE, got.pages, got.evicted)

    def finish_demotion(self, demotion: Demotion, written: bool) -> bool:
        """After the write of a WRITE demotion (written: it succeeded): the L3 copy joins the
        block, or the L3 pages are freed and the block leaves L2 unwritten. True when its L2
        copy went; False when a reader holds it now (the next demotion of it drops it)."""
        if demotion.move is not Move.WRITE:
            raise ValueError(f"only a WRITE demotion is finished, not {demotion.move.value}")
        entry = demotion.entry
        if not written:
            self._index.moves.free(Tier.NVME, demotion.pages)
            return self._leave(entry, demotion.tier, evicted=True)
        self._index.moves.add_copy(entry, Tier.NVME, demotion.pages)
        return self._leave(entry, demotion.tier, evicted=False)

    def _leave(self, entry: Entry, tier: Tier, evicted: bool) -> bool:
        """The picked entry is done; its copy in tier goes unless someone holds it now."""
        self._index.moves.done(entry)
        if not entry.movable:
            return False
        self._index.moves.drop_copy(entry, tier, evicted=evicted)
        return True

    # --- promotion -----------------------------------------------------------------------------

    def promote(self, entry: Entry, tier: Tier, pages: Pages) -> bool:
        """A load's new copy of entry on pages of tier (from alloc() in entry.arena) joins
        it. True when that freed its L3 copy (exclusive placement: an L2 copy replaces it;
        journal the FREE)."""
        self._index.moves.add_copy(entry, tier, pages)
        if tier == Tier.DRAM and not self.inclusive and Tier.NVME in entry.copies:
            self._index.moves.drop_copy(entry, Tier.NVME)
            return True
        return False
