"""Long lookups in a big namespace, through a vectorized mirror of each key's fastest tier
(issue 8).

Through the entry dicts a Lookup takes a few cache misses per key, one after the other, once a
namespace outgrows the CPU caches (a dict slot, the key, the Entry for `.tier`): a 1,024-key
chain cost 4x more at 1M blocks than at 10k. So a namespace of MIN_ENTRIES or more also has a
`KeyTable`: its keys' 32 bytes and tier numbers in numpy arrays, a cuckoo hash table, which a
lookup reads for all its keys at once in two gathers whose misses overlap: about flat (2x
faster than the dict at 100k blocks, 3x at 1M, on the 2-core development VM). Its numpy calls
cost ~60 us whatever the size, so short lookups (under MIN_KEYS) and small namespaces, whose
dict is in cache, stay with the dict. (A linear-probing table was as fast on the bench's
counting keys but not on SHA-256 ones, whose probe runs vary: cuckoo probes two slots.)

The Index (`kvstore.core.index`) calls `added`, `changed` and `removed` for every entry
linked, whose fastest tier changed, or removed, from its bookkeeping, which every change of
its entries and their copies goes through. Pure: no I/O, no clock.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

import numpy as np

from kvstore.core.records import Entry
from kvstore.keys import KEY_BYTES, BlockKey
from kvstore.tier import Tier

MIN_KEYS = 128  # keys in a lookup, for the table to be used
MIN_ENTRIES = 1 << 15  # entries in a namespace, for it to have a table (dropped below 1/4)

MIN_CAPACITY = 64
MAX_LOAD = 0.45  # keys per slot: two-choice cuckoo tables fill up near 0.5
MAX_KICKS = 64  # keys moved for one put before the table is laid out afresh instead
_WORDS = struct.Struct("<4Q")
_U64 = np.dtype("<u8")
_MASK64 = (1 << 64) - 1
_TIERS = np.array([None] * (max(Tier) + 1), dtype=object)  # a tier's number -> the Tier
_TIERS[list(Tier)] = list(Tier)
_VIEWS = ("_key_bytes", "_tier_bytes")  # memoryviews, which do not copy
_ZERO_KEY = BlockKey(bytes(KEY_BYTES))  # what an empty slot holds

Tiers = list[Tier | None]


def _rows_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Whether each row of a (a key: 4 words) equals b's: the 4 booleans of a row read as one
    32-bit word, all ones (faster than .all(axis=1), and than comparing bytes)."""
    eq = a == b
    rows: np.ndarray = eq.view(np.uint32)[:, 0] == 0x01010101
    return rows


class KeyTable:
    """One namespace's keys (32 bytes each) -> tier number, in numpy arrays: a cuckoo hash
    table, so that a key lies in one of its two home slots or is not held, and a lookup
    reads the first home of every key, then the second of those not found there (a put
    that finds both taken moves their keys on to their other homes; a table too full, or a
    put moving too many, lays every key out afresh). Empty slots hold zeros."""

    def __init__(self, rng: np.random.Generator, words: np.ndarray | None = None,
                 tiers: np.ndarray | None = None) -> None:
        """rng: draws the multipliers; words, tiers: keys to start with (rows of 4
        little-endian words) and their tiers."""
        self._rng = rng
        if words is None or tiers is None:
            words, tiers = np.zeros((0, 4), _U64), np.zeros(0, np.int8)
        self._layout(words, tiers)

    def __len__(self) -> int:
        return self._live

    def __getstate__(self) -> dict[str, object]:  # copies (an Index may be deep-copied)
        return {k: v for k, v in self.__dict__.items() if k not in _VIEWS}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._views()

    def put(self, key: BlockKey, tier: int) -> None:
        """key's tier is now tier (a key new or held already); key is 32 bytes."""
        first, second = homes = self._home(key)
        slot = self._slot(key, homes)
        if slot >= 0:
            self._tier_bytes[slot] = tier
            return
        if self._live + 1 > MAX_LOAD * self._capacity:
            self._relayout(key, tier)
            return
        self._live += 1
        tiers = self._tier_bytes
        slot = first if not tiers[first] else second
        for _ in range(MAX_KICKS):  # while the slot is taken, its key moves to its other home
            if not tiers[slot]:
                self._set(slot, key, tier)
                return
            moved, moved_tier = self._key_at(slot), tiers[slot]
            self._set(slot, key, tier)
            key, tier = moved, moved_tier
            first, second = self._home(key)
            slot = second if slot == first else first
        self._relayout(key, tier)  # key: the one left without a slot

    def discard(self, key: BlockKey) -> None:
        """key is no longer held (or never was)."""
        slot = self._slot(key, self._home(key))
        if slot < 0:
            return
        self._set(slot, _ZERO_KEY, 0)
        self._live -= 1
        if self._capacity > MIN_CAPACITY and 16 * self._live < self._capacity:
            self._relayout()

    def lookup(self, keys: Sequence[BlockKey]) -> tuple[int, Tiers] | None:
        """(longest held prefix, each key's Tier or None), probed for all keys at once; None
        when the keys are not all 32 bytes long (then ask the dict). Keys are BlockKeys, as
        the store's request checks make them (`kvstore.keys.check_keys`): only their total
        length is checked here."""
        try:
            joined = b"".join(keys)
        except TypeError:
            return None
        if len(joined) != KEY_BYTES * len(keys):
            return None
        if not joined:
            return 0, []
        words = np.frombuffer(joined, _U64).reshape(-1, 4)
        hashes = self._hashes(words)
        # A key at its first home, else at its second, else not held. An empty slot holds
        # zeros and tier 0: the zero key "found" there is a miss too.
        first = self._first(hashes)
        found = self._tiers.take(first) * _rows_equal(self._keys.take(first, axis=0), words)
        rest = np.flatnonzero(found == 0)
        if rest.size:
            second = self._second(hashes.take(rest))
            found[rest] = self._tiers.take(second) * _rows_equal(
                self._keys.take(second, axis=0), words.take(rest, axis=0))
        missed = found == 0
        prefix = int(missed.argmax())
        tier_list: Tiers = _TIERS.take(found).tolist()
        return prefix if missed[prefix] else len(found), tier_list

    # --- layout ----------------------------------------------------------------------------

    # A key's hash: sum(word * multiplier) mod 2**64 over its four words (random odd
    # multipliers: keys cannot be chosen to collide). Its first home is the hash's top bits,
    # its second those of hash * another multiplier (a bijection: only keys of the same hash,
    # 2**-64 apart, share both homes).

    def _hashes(self, words: np.ndarray) -> np.ndarray:
        hashes: np.ndarray = words @ self._dot  # numpy's integer matmul wraps around
        return hashes

    def _first(self, hashes: np.ndarray) -> np.ndarray:
        homes: np.ndarray = (hashes >> self._np_shift).view(np.int64)
        return homes

    def _second(self, hashes: np.ndarray) -> np.ndarray:
        homes: np.ndarray = ((hashes * self._np_mix) >> self._np_shift).view(np.int64)
        return homes

    def _home(self, key: bytes) -> tuple[int, int]:
        w0, w1, w2, w3 = _WORDS.unpack(key)
        m0, m1, m2, m3, mix = self._mult
        h = (w0 * m0 + w1 * m1 + w2 * m2 + w3 * m3) & _MASK64
        return h >> self._shift, (h * mix & _MASK64) >> self._shift

    def _key_at(self, slot: int) -> BlockKey:
        return BlockKey(self._key_bytes[slot * KEY_BYTES:(slot + 1) * KEY_BYTES].tobytes())

    def _set(self, slot: int, key: BlockKey, tier: int) -> None:
        self._key_bytes[slot * KEY_BYTES:(slot + 1) * KEY_BYTES] = key
        self._tier_bytes[slot] = tier

    def _slot(self, key: BlockKey, homes: tuple[int, int]) -> int:
        """key's slot (one of its homes), or -1."""
        tiers, keys = self._tier_bytes, self._key_bytes
        for slot in homes:
            if tiers[slot] and keys[slot * KEY_BYTES:(slot + 1) * KEY_BYTES] == key:  # type: ignore[comparison-overlap]
                return slot
        return -1

    def _relayout(self, key: BlockKey | None = None, tier: int = 0) -> None:
        """Lay the keys held out afresh (and key too, when given)."""
        held = np.flatnonzero(self._tiers)
        words, tiers = self._keys.take(held, axis=0), self._tiers.take(held)
        if key is not None:
            words = np.concatenate([words, np.frombuffer(key, _U64).reshape(1, 4)])
            tiers = np.concatenate([tiers, np.array([tier], np.int8)])
        self._layout(words, tiers)

    def _layout(self, words: np.ndarray, tiers: np.ndarray) -> None:
        """New arrays holding these keys, at most MAX_LOAD full, with fresh multipliers (and
        twice the slots, until every key finds one of its homes)."""
        room = max(MIN_CAPACITY, int(len(words) / MAX_LOAD) + 1)
        capacity = 1 << (room - 1).bit_length()
        for _ in range(8):  # distinct keys fail to fit with odds of about 1 in capacity
            self._capacity, self._shift = capacity, 64 - (capacity.bit_length() - 1)
            multipliers = self._rng.integers(0, 2**64, 5, dtype=np.uint64) | np.uint64(1)
            self._mult = [int(m) for m in multipliers]
            self._dot, self._np_mix = multipliers[:4], multipliers[4]
            self._np_shift = np.uint64(self._shift)
            hashes = self._hashes(words)
            owner = _place(np.stack([self._first(hashes), self._second(hashes)], 1), capacity)
            if owner is not None:
                break
            capacity *= 2
        else:
            raise ValueError(f"{len(words)} keys do not fit a cuckoo table: keys repeated?")
        # Each slot takes its key's row; an empty one (owner -1) the zero row appended.
        self._keys = np.concatenate([words, np.zeros((1, 4), _U64)]).take(owner, axis=0)
        self._tiers = np.concatenate([tiers.astype(np.int8), np.zeros(1, np.int8)]).take(owner)
        self._live = len(words)
        self._views()

    def _views(self) -> None:
        """The arrays as memoryviews, for put and discard: faster than numpy per item."""
        self._key_bytes = self._keys.data.cast("B")
        self._tier_bytes = self._tiers.data


def _place(homes: np.ndarray, capacity: int, max_rounds: int = 1000) -> np.ndarray | None:
    """Each slot's key (its row in homes; -1: empty), every key in one of its two homes; None
    when that takes more than max_rounds. All keys at once, in rounds: every key without a
    slot writes itself into its current home; a key that lost that race, or whose slot was
    taken, tries its other home in the next round (as on GPUs, Alcantara et al. 2009)."""
    owner = np.full(capacity, -1, np.int64)
    side = np.zeros(len(homes), np.int64)
    pending = np.arange(len(homes))
    for _ in range(max_rounds):
        if not pending.size:
            return owner
        slots = homes[pending, side[pending]]
        evicted = owner[slots]
        owner[slots] = pending  # one of the keys writing the same slot gets it
        lost = pending[owner[slots] != pending]
        pending = np.concatenate([lost, np.unique(evicted[evicted >= 0])])
        side[pending] ^= 1
    return None


class KeyTiers:
    """The tables of the namespaces big enough, kept from the Index's entry dicts, and
    lookups through them or through the dicts."""

    def __init__(self, entries: Mapping[str, Mapping[BlockKey, Entry]],
                 seed: int | None = None) -> None:
        """entries: the Index's (namespace -> key -> entry), read when a table is built;
        seed: of the hash multipliers (random by default)."""
        self._entries = entries
        self._rng = np.random.default_rng(seed)
        self._tables: dict[str, KeyTable] = {}

    def added(self, entry: Entry) -> None:
        """entry was added to entries. A namespace without a table gets one when it reaches
        MIN_ENTRIES (or, while one of its keys is not 32 bytes long, tries again at every
        power of two above)."""
        size = len(self._entries.get(entry.namespace, ()))
        if entry.namespace in self._tables:
            self._put(entry)
        elif size >= MIN_ENTRIES and size & (size - 1) == 0:
            self._build(entry.namespace)

    def changed(self, entry: Entry, before: Tier) -> None:
        """A copy of entry was added or dropped: its fastest tier was before."""
        if entry.tier != before and entry.namespace in self._tables:
            self._put(entry)

    def removed(self, entry: Entry) -> None:
        """entry was removed from entries."""
        table = self._tables.get(entry.namespace)
        if table is not None:
            table.discard(entry.key)
            if 4 * len(table) < MIN_ENTRIES:
                del self._tables[entry.namespace]

    def lookup(self, namespace: str, keys: Sequence[BlockKey]) -> tuple[int, Tiers]:
        """(longest cached prefix of keys, each key's tier: None for a miss)."""
        table = self._tables.get(namespace)
        found = table.lookup(keys) if table is not None and len(keys) >= MIN_KEYS else None
        if found is not None:
            return found
        get = self._entries.get(namespace, {}).get
        tiers = [e.tier if e is not None else None for e in map(get, keys)]
        try:
            return tiers.index(None), tiers
        except ValueError:
            return len(tiers), tiers

    def _put(self, entry: Entry) -> None:
        if len(entry.key) == KEY_BYTES:
            self._tables[entry.namespace].put(entry.key, entry.tier)
        else:  # not a BlockKey: the namespace is looked up in the dict from now on
            del self._tables[entry.namespace]

    def _build(self, namespace: str) -> None:
        bucket = self._entries[namespace]
        joined = b"".join(bucket)
        if len(joined) != KEY_BYTES * len(bucket):
            return  # a key that is not a BlockKey: stay with the dict
        tiers = np.fromiter((e.tier for e in bucket.values()), np.int8, len(bucket))
        words = np.frombuffer(joined, _U64).reshape(-1, 4)
        self._tables[namespace] = KeyTable(self._rng, words, tiers)
