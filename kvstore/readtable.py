"""The read table: where each of an arena's L2 blocks lies, published by the daemon into
shared memory its tenant's clients map read-only, so that a co-located client finds and
copies L2 blocks without a round trip to the daemon (docs/local-path.md, "Reads through the
table").

This module is the layout both sides share, and nothing else: pure (numpy over a buffer it is
handed; no I/O). The daemon writes a table through `TableWriter` (kvstore/daemon/readtable.py
makes the memory and keeps it in step with its index); a client reads one through
`TableView` (client/_readtable.py maps it). The daemon is the only writer and never reads the
table back: every decision it makes comes from its own index and from the private mirror a
TableWriter keeps, so whatever a client does with its mapping cannot change the daemon.

    header    HEADER_BYTES: u64 words, see the H_* indexes (magic, capacity, hash constants)
    slots     capacity x SLOT_WORDS u64: version, key (4 words), namespace hash,
              location (arena offset << 8 | tier; tier 0: an empty slot), length in bytes
    sums      capacity x u64: the writer's xxh3-64 of the block (its checksum)

A key lies in one of two home slots (two-choice cuckoo hashing, as kvstore/core/keytable.py;
the hash has random odd multipliers, so keys cannot be chosen to collide), so a reader probes
all its keys at once in two numpy gathers. Each slot is a seqlock: the writer makes its
version odd, writes the slot and its sum, then makes the version even again (one higher than
before the change). A reader reads the version, the slot and the sum, and the version again,
and takes the slot only when both reads are equal and even. Before a block's pages can be
given to anyone else, its slot's version has moved on (the daemon withdraws the slot under the
same lock hold that frees the pages, and pages are handed out only under that lock), so a
reader that re-reads the version after copying the bytes and finds it unchanged copied bytes
nobody rewrote meanwhile. Versions only grow (64 bits), so a version seen twice is the same
change. The ordering this relies on (stores seen in program order, loads not passed by later
loads) is x86-64's; on weaker memory models the checksum is the remaining guard.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import xxhash

from kvstore.keys import KEY_BYTES

MAGIC = 0x3130_5442_5452_564B  # b"KVRTBT01" read as a little-endian u64
HEADER_BYTES = 4096  # the slots start on their own page
SLOT_WORDS = 8
SLOT_BYTES = SLOT_WORDS * 8
MAX_LOAD = 0.45  # entries per slot at most: a two-choice cuckoo table fills near 0.5
MIN_CAPACITY = 64
MAX_KICKS = 128  # keys moved for one insert before the last one moved is left out

# Header words.
H_MAGIC, H_CAPACITY, H_SHIFT, H_MULT, H_NS_MULT, H_MIX, H_ARENA_BYTES = 0, 1, 2, 3, 7, 8, 9
# Slot words.
W_VERSION, W_KEY, W_NS, W_LOC, W_LENGTH = 0, 1, 5, 6, 7

_MASK64 = (1 << 64) - 1
_U64 = np.dtype("<u8")
_WORDS = struct.Struct("<4Q")
_U64_FIELD = struct.Struct("<Q")
_SLOT_BODY = struct.Struct(f"<{KEY_BYTES}sQQQ")  # a slot after its version: key, ns, loc, length
_EMPTY_SLOT = bytes(SLOT_BYTES - 8)

Ident = tuple[int, bytes]  # (namespace hash, key)


@functools.lru_cache(maxsize=4096)
def namespace_hash(namespace: str) -> int:
    """The 64-bit tag that stands for a namespace in the table (a namespace's keys share it;
    equal tags of two namespaces of one tenant could only confuse that tenant's own reads,
    which the checksum and the key catch)."""
    return xxhash.xxh3_64_intdigest(namespace.encode("utf-8"))


def capacity_for(max_entries: int) -> int:
    """Slots for a table that holds up to max_entries at most MAX_LOAD full: a power of two."""
    room = max(MIN_CAPACITY, int(max_entries / MAX_LOAD) + 1)
    return 1 << (room - 1).bit_length()


def table_bytes(capacity: int) -> int:
    """The bytes a table of capacity slots takes: header, slots and sums."""
    return HEADER_BYTES + capacity * (SLOT_BYTES + 8)


class Record(NamedTuple):
    """Where one block lies in its arena, as a slot says it (a tuple: made once per block
    the daemon stores, under its lock, where a dataclass cost a microsecond more)."""

    offset: int
    length: int
    tier: int
    checksum: int


class _Layout:
    """The three arrays over a table's bytes."""

    def __init__(self, buf: memoryview | np.ndarray, capacity: int) -> None:
        raw = np.frombuffer(buf, dtype=np.uint8)
        if raw.nbytes < table_bytes(capacity):
            raise ValueError(f"the table's memory holds {raw.nbytes} bytes, under the "
                             f"{table_bytes(capacity)} of {capacity} slots")
        self.header = raw[:HEADER_BYTES].view(_U64)
        end = HEADER_BYTES + capacity * SLOT_BYTES
        self.slots = raw[HEADER_BYTES:end].view(_U64).reshape(capacity, SLOT_WORDS)
        self.sums = raw[end:end + capacity * 8].view(_U64)
        self.capacity = capacity


class TableWriter:
    """The daemon's side of one table: it writes slots and never reads the shared memory back
    (its own mirror says which slot holds what). Not thread-safe: the daemon calls it under
    its store lock, the lock that also guards the pages it describes."""

    def __init__(self, buf: memoryview | np.ndarray, capacity: int, arena_bytes: int,
                 rng: np.random.Generator) -> None:
        """buf: writable memory of at least table_bytes(capacity) bytes, zeroed; capacity: a
        power of two; arena_bytes: the size of the arena the offsets lie in."""
        if capacity < 1 or capacity & (capacity - 1):
            raise ValueError(f"capacity {capacity} is not a power of two")
        self._mem = _Layout(buf, capacity)
        self.capacity = capacity
        self._shift = 64 - (capacity.bit_length() - 1)
        mult = [int(m) | 1 for m in rng.integers(0, 2**64, 6, dtype=np.uint64)]
        self._mult, self._ns_mult, self._mix = mult[:4], mult[4], mult[5]
        header = self._mem.header
        header[H_CAPACITY], header[H_SHIFT] = capacity, self._shift
        header[H_MULT:H_MULT + 4] = self._mult
        header[H_NS_MULT], header[H_MIX], header[H_ARENA_BYTES] = self._ns_mult, self._mix, \
            arena_bytes
        header[H_MAGIC] = MAGIC  # last: a reader that sees the magic sees the rest
        # Slots are written with struct into the bytes (a few numpy scalar stores a slot cost
        # more than the whole write): where the slots and the sums start.
        self._bytes = memoryview(buf).cast("B") if isinstance(buf, memoryview) else \
            memoryview(buf.data).cast("B")
        self._slots_at = HEADER_BYTES
        self._sums_at = HEADER_BYTES + capacity * SLOT_BYTES
        self._versions = [0] * capacity  # the mirror of each slot's version
        self._at: list[tuple[Ident, Record] | None] = [None] * capacity
        self._slot_of: dict[Ident, int] = {}
        self.left_out = 0  # inserts that found no slot (their key reads as a miss)

    def __len__(self) -> int:
        return len(self._slot_of)

    def retire(self) -> None:
        """The daemon stops: readers from now on find nothing (the magic goes), and ask the
        daemon, which a restarted daemon answers from its own memory."""
        self._mem.header[H_MAGIC] = 0

    def put(self, ident: Ident, record: Record) -> None:
        """Publish where ident's block lies now (a new block, or one whose place or tier
        changed): its slot is rewritten under its seqlock."""
        slot = self._slot_of.get(ident)
        if slot is not None:
            held = self._at[slot]
            if held is None or held[1] != record:  # unchanged: readers keep their copies
                self._write(slot, ident, record)
            return
        first, second = self._homes(ident)
        for home in (first, second):
            if self._at[home] is None:
                self._write(home, ident, record)
                return
        self._kick(first, ident, record)

    def remove(self, ident: Ident) -> None:
        """ident's block is no longer where the table says (evicted, moved, or its pages are
        about to be freed): its slot is emptied, its version moved on."""
        slot = self._slot_of.pop(ident, None)
        if slot is None:
            return
        self._at[slot] = None
        at = self._begin(slot)
        self._bytes[at + 8:at + SLOT_BYTES] = _EMPTY_SLOT
        _U64_FIELD.pack_into(self._bytes, self._sums_at + slot * 8, 0)
        self._end(slot, at)

    def _kick(self, slot: int, ident: Ident, record: Record) -> None:
        """Place ident where a key lies already, moving that key to its other home, and so
        on; after MAX_KICKS moves the key left without a slot is left out (a miss)."""
        for _ in range(MAX_KICKS):
            held = self._at[slot]
            self._write(slot, ident, record)
            if held is None:
                return
            ident, record = held  # _write took it out of _slot_of
            first, second = self._homes(ident)
            slot = second if slot == first else first
        self.left_out += 1  # ident is no longer in the table: readers ask the daemon

    def _write(self, slot: int, ident: Ident, record: Record) -> None:
        old = self._at[slot]
        if old is not None and old[0] != ident:
            del self._slot_of[old[0]]
        self._at[slot] = (ident, record)
        self._slot_of[ident] = slot
        ns, key = ident
        at = self._begin(slot)
        _SLOT_BODY.pack_into(self._bytes, at + 8, key, ns, record.offset << 8 | record.tier,
                             record.length)
        _U64_FIELD.pack_into(self._bytes, self._sums_at + slot * 8, record.checksum)
        self._end(slot, at)

    def _begin(self, slot: int) -> int:
        """Make slot's version odd: readers from now on reject it. The slot's byte offset."""
        at = self._slots_at + slot * SLOT_BYTES
        self._versions[slot] += 1
        _U64_FIELD.pack_into(self._bytes, at, self._versions[slot])
        return at

    def _end(self, slot: int, at: int) -> None:
        """Make slot's version even again, one step on from before the change."""
        self._versions[slot] += 1
        _U64_FIELD.pack_into(self._bytes, at, self._versions[slot])

    def _homes(self, ident: Ident) -> tuple[int, int]:
        ns, key = ident
        w0, w1, w2, w3 = _WORDS.unpack(key)
        m0, m1, m2, m3 = self._mult
        h = (w0 * m0 + w1 * m1 + w2 * m2 + w3 * m3 + ns * self._ns_mult) & _MASK64
        return h >> self._shift, (h * self._mix & _MASK64) >> self._shift


@dataclass(slots=True)
class Probe:
    """What a probe found for each key: its slot (-1: not in the table, or changing), and the
    slot's version, location word, length and sum as read under the seqlock."""

    slots: np.ndarray
    versions: np.ndarray
    locs: np.ndarray
    lengths: np.ndarray
    sums: np.ndarray

    def prefix(self) -> int:
        """How many keys from the first are found."""
        missed = self.slots < 0
        return int(missed.argmax()) if missed.any() else len(missed)


class TableView:
    """A client's read-only view of one table. Every read is a seqlock read (see the module's
    docstring); what a view returns may be stale by the time the caller uses it, which is why
    `unchanged` is asked after the copy."""

    def __init__(self, buf: memoryview | np.ndarray) -> None:
        raw = np.frombuffer(buf, dtype=np.uint8)
        if raw.nbytes < HEADER_BYTES:
            raise ValueError(f"a read table of {raw.nbytes} bytes has no header")
        header = raw[:HEADER_BYTES].view(_U64)
        if int(header[H_MAGIC]) != MAGIC:
            raise ValueError("the memory is not a read table (no magic)")
        capacity = int(header[H_CAPACITY])
        if capacity < 1 or capacity & (capacity - 1) or raw.nbytes < table_bytes(capacity):
            raise ValueError(f"a read table of {raw.nbytes} bytes claims {capacity} slots")
        self._mem = _Layout(buf, capacity)
        self._header = header
        self.capacity = capacity
        self._shift = np.uint64(int(header[H_SHIFT]))
        self._dot = header[H_MULT:H_MULT + 4].copy()
        self._ns_mult = int(header[H_NS_MULT])
        self._mix = header[H_MIX].copy()
        if int(self._shift) != 64 - (capacity.bit_length() - 1):
            raise ValueError(f"a read table of {capacity} slots claims a hash shift of "
                             f"{int(self._shift)}")
        #: The address of the table's first byte, and its hash constants as checked here
        #: (capacity, shift, the four key multipliers, the namespace multiplier, the mix),
        #: for a native probe (kvstore/native) that reads them from nowhere else.
        self.address = int(raw.ctypes.data)
        self.params = (capacity, int(self._shift), *(int(m) for m in self._dot),
                       self._ns_mult, int(self._mix))

    def probe(self, ns: int, keys: Sequence[bytes], joined: bytes | None = None) -> Probe | None:
        """Every key's slot, probed at once; None when the keys are not all 32 bytes, or
        the table is retired (ask the daemon). joined: the keys back to back, when the
        caller has them."""
        if joined is None:
            joined = b"".join(keys)
        if len(joined) != KEY_BYTES * len(keys) or not self.live:
            return None
        words = np.frombuffer(joined, _U64).reshape(-1, 4)
        # uint64 arrays wrap around silently (numpy warns about scalars only).
        hashes = words @ self._dot + np.uint64(ns * self._ns_mult & _MASK64)
        first = (hashes >> self._shift).view(np.int64)
        found = self._read(first, words, ns)
        rest = np.flatnonzero(found.slots < 0)
        if rest.size:
            second = ((hashes.take(rest) * self._mix) >> self._shift).view(np.int64)
            again = self._read(second, words.take(rest, axis=0), ns)
            for name in Probe.__slots__:
                getattr(found, name)[rest] = getattr(again, name)
        return found

    @property
    def live(self) -> bool:
        """Whether the daemon still publishes the table (it retires it when it stops)."""
        return int(self._header[H_MAGIC]) == MAGIC

    def unchanged(self, slots: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """Whether each slot's version is still the one probed (after the bytes were copied:
        then nobody rewrote them meanwhile)."""
        ok: np.ndarray = self._version_of(slots) == versions
        return ok

    def _version_of(self, slots: np.ndarray) -> np.ndarray:
        """The slots' versions, gathered where they lie (a take of the version column would
        copy the whole strided column first)."""
        versions: np.ndarray = self._mem.slots[slots, W_VERSION]
        return versions

    def _read(self, slots: np.ndarray, words: np.ndarray, ns: int) -> Probe:
        """The slots' contents for these keys under the seqlock; a slot that does not hold
        its key, or changed while read, is -1."""
        before = self._version_of(slots)
        rows = self._mem.slots.take(slots, axis=0)
        sums = self._mem.sums.take(slots)
        after = self._version_of(slots)
        same = (rows[:, W_KEY:W_KEY + 4] == words).view(np.uint32)[:, 0] == 0x01010101
        locs = rows[:, W_LOC]
        # Equal and even versions, the namespace, a tier (0: empty), in one pass each.
        ok = same & (rows[:, W_NS] == np.uint64(ns)) & (before == after) \
            & ((before & np.uint64(1)) == 0) & (locs.astype(np.uint8) != 0)
        return Probe(np.where(ok, slots, -1), before, locs, rows[:, W_LENGTH], sums)


def tier_bytes(locs: np.ndarray) -> bytes:
    """The tier numbers in location words, one byte each (a location word's low byte is its
    tier): what a lookup names its tiers from, with no array of Python ints made."""
    return locs.astype(np.uint8).tobytes()


def offsets_of(locs: np.ndarray) -> np.ndarray:
    """The arena offsets in location words."""
    out: np.ndarray = (locs >> np.uint64(8)).astype(np.int64)
    return out
