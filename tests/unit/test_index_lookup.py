"""Index.lookup through the namespaces' key tables (kvstore.core.keytable): the same answers
as the entries give, whatever changed them.

A hypothesis state machine drives the public Index API (puts, refused puts that evict and
restore, reads, evictions by key and in order, demotions, promotions into L2 and L1, damaged
copies, re-adoptions, orphan drops) with the tables switched on for every namespace and tiny
(so that keys collide, move between their homes and the tables are laid out afresh), and
after every step checks each lookup against a recomputation from the entries. Then the
table alone against a dict, and scenarios at the real thresholds.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstore.core import keytable
from kvstore.core.index import Index
from kvstore.core.keytable import KeyTable
from kvstore.core.pages import PageAllocator
from kvstore.keys import BlockKey
from kvstore.tier import Tier
from tests.unit.test_index import FAR, PAGE_BYTES, key

H, D, N = Tier.HBM, Tier.DRAM, Tier.NVME
PAGES = {H: 3, D: 6, N: 12}
NAMESPACES = ("ns", "other")
# A tree of names: a parent is the name without its last letter ("ab" is "a"'s child).
UNIVERSE = ["a", "ab", "abc", "abcd", "abd", "ac", "acd", "b", "bc", "bcd", "bd", "c", "cd",
            "\x00" * 32]  # the last: the zero key, which an empty slot's bytes equal
ZERO = "\x00" * 32
_plans = itertools.count()


def parent_of(n: str) -> str | None:
    return None if n == ZERO else n[:-1] or None


def path(n: str) -> list[str]:
    return [n] if n == ZERO else [n[: i + 1] for i in range(len(n))]


def expected(index: Index, namespace: str,
             keys: Sequence[BlockKey]) -> tuple[int, list[Tier | None]]:
    """The lookup recomputed from scratch: each entry's fastest copy."""
    tiers = {e.key: min(e.copies) for e in index.entries() if e.namespace == namespace}
    found: list[Tier | None] = [tiers.get(k) for k in keys]
    return next((i for i, t in enumerate(found) if t is None), len(found)), found


def small_tables() -> ExitStack:
    """Tables for every namespace of 4 entries or more, used for every lookup, laid out in
    4 slots at first (keys collide and move between their homes)."""
    stack = ExitStack()
    for name, value in (("MIN_ENTRIES", 4), ("MIN_KEYS", 1), ("MIN_CAPACITY", 4)):
        stack.enter_context(mock.patch.object(keytable, name, value))
    return stack


class TableLookups:
    """Counts the lookups tables answered (not passed back to the dict), while patched in."""

    def __init__(self) -> None:
        self.answered = 0

    def patch(self) -> Any:
        original = KeyTable.lookup

        def lookup(table: KeyTable, keys: Sequence[BlockKey]) -> Any:
            found = original(table, keys)
            self.answered += found is not None
            return found

        return mock.patch.object(KeyTable, "lookup", lookup)


class LookupMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.patches = small_tables()
        self.spy = TableLookups()
        self.patches.enter_context(self.spy.patch())
        self.index = self.fresh()

    def teardown(self) -> None:
        self.patches.close()

    @staticmethod
    def fresh() -> Index:
        return Index({t: PageAllocator(n) for t, n in PAGES.items()},
                     {t: PAGE_BYTES for t in PAGES})

    def pick(self, data: st.DataObject) -> Any:
        found = list(self.index.entries())
        return data.draw(st.sampled_from(found)) if found else None

    # --- rules ---------------------------------------------------------------------------

    @rule(ns=st.sampled_from(NAMESPACES), leaf=st.sampled_from(UNIVERSE),
          tier=st.sampled_from([D, N]), evict=st.booleans())
    def put(self, ns: str, leaf: str, tier: Tier, evict: bool) -> None:
        """The chain from the root to leaf, whatever of it is cached already (a put of a
        cached key is a use); a put that cannot fit evicts, then restores what it evicted."""
        keys = [key(n) for n in path(leaf)]
        parents = [key(p) if (p := parent_of(n)) else None for n in path(leaf)]
        plan = self.index.prepare_store(f"p{next(_plans)}", ns, keys, [PAGE_BYTES] * len(keys),
                                        parents, tier, FAR, evict=evict)
        if plan is not None:
            self.index.complete_store(plan.plan_id, [7] * len(plan.blocks), success=True)

    @rule(ns=st.sampled_from(NAMESPACES), leaf=st.sampled_from(UNIVERSE))
    def abandoned_put(self, ns: str, leaf: str) -> None:
        keys = [key(n) for n in path(leaf)]
        plan = self.index.prepare_store(f"p{next(_plans)}", ns, keys, [PAGE_BYTES] * len(keys),
                                        [None] * len(keys), D, FAR)
        if plan is not None:
            self.index.complete_store(plan.plan_id, None, success=False)

    @rule(ns=st.sampled_from(NAMESPACES), names=st.lists(st.sampled_from(UNIVERSE), max_size=3))
    def read(self, ns: str, names: list[str]) -> None:
        self.index.touch(ns, [key(n) for n in names])

    @rule(ns=st.sampled_from(NAMESPACES), names=st.lists(st.sampled_from(UNIVERSE), max_size=2))
    def evict_keys(self, ns: str, names: list[str]) -> None:
        self.index.evict_keys(ns, [key(n) for n in names])

    @rule(tier=st.sampled_from([H, D, N]), min_bytes=st.none() | st.integers(1, 400))
    def evict_in_order(self, tier: Tier, min_bytes: int | None) -> None:
        self.index.evict_in_order(tier, min_bytes)

    @rule(source=st.sampled_from([D, H]), count=st.integers(1, 3))
    def demote(self, source: Tier, count: int) -> None:
        """The mover: pick copies (leaf first); an L2 one is copied to L3 and dropped, an L1
        one dropped (its L2 copy stays)."""
        for e in self.index.moves.pick(source, count * PAGE_BYTES, count):
            pages = self.index.moves.alloc(N, e.size_bytes, e.arena) if source == D else None
            if pages is not None and N not in e.copies:
                self.index.moves.add_copy(e, N, pages)
            elif pages is not None:
                self.index.moves.free(N, pages)
            if source == H or N in e.copies:
                self.index.moves.drop_copy(e, source)
            self.index.moves.done(e)

    @rule(data=st.data(), into=st.sampled_from([D, H]))
    def promote(self, data: st.DataObject, into: Tier) -> None:
        """A load into L2 (from L3), or a copy into L1 (of an L2 block): the slower copy stays."""
        e = self.pick(data)
        if e is None or into in e.copies or (into == H and D not in e.copies):
            return
        self.index.moves.hold(e)
        pages = self.index.moves.alloc(into, e.size_bytes, e.arena)
        if pages is not None:
            self.index.moves.add_copy(e, into, pages)
        self.index.moves.done(e)

    @rule(data=st.data(), tier=st.sampled_from([H, D, N]))
    def drop_copy(self, data: st.DataObject, tier: Tier) -> None:
        """A copy evicted by hand (the last one takes the entry with it)."""
        e = self.pick(data)
        if e is not None and tier in e.copies and e.droppable_from(tier):
            self.index.moves.drop_copy(e, tier, evicted=True)

    @rule(data=st.data())
    def discard(self, data: st.DataObject) -> None:
        e = self.pick(data)
        if e is not None and e.movable:
            self.index.moves.discard(e)

    @rule()
    def restart(self) -> None:
        """L2 and L1 are gone; L3 copies are re-adopted, orphans dropped."""
        kept = [(e.namespace, e.key, e.parent, e.copies[N]) for e in self.index.entries()
                if N in e.copies]
        self.index = self.fresh()
        for ns, k, parent, pages in kept:
            self.index.moves.adopt(ns, k, PAGE_BYTES, 7, parent, N, pages)
        self.index.drop_orphans()

    # --- the invariant -------------------------------------------------------------------

    @invariant()
    def lookups_match_the_entries(self) -> None:
        for ns in NAMESPACES:
            lists = [[key(n) for n in UNIVERSE], [key(n) for n in reversed(UNIVERSE)],
                     *([key(n) for n in path(leaf)] for leaf in UNIVERSE),
                     [key("zz"), *(key(n) for n in UNIVERSE)]]
            before = self.spy.answered
            for keys in lists:
                assert self.index.lookup(ns, keys) == expected(self.index, ns, keys)
            held = sum(e.namespace == ns for e in self.index.entries())
            if held >= keytable.MIN_ENTRIES:  # a table answered them, not the dict
                assert self.spy.answered == before + len(lists)


LookupMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                           deadline=None)
test_lookups_follow_every_change_of_the_entries = LookupMachine.TestCase


# --- the table alone -------------------------------------------------------------------------


def digest(i: int) -> BlockKey:
    return BlockKey(hashlib.sha256(i.to_bytes(8, "little")).digest())


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 4)), max_size=300),
       kicks=st.sampled_from([1, 64]))
def test_a_table_answers_as_a_dict_would(ops: list[tuple[int, int]], kicks: int) -> None:
    """Puts (tier 1..4) and discards (tier 0) of 61 keys, the zero key among them, in a table
    of 4 slots at first: keys move between their homes (one move at most with kicks=1, then
    the table is laid out afresh), it grows and shrinks; every key answers as in a dict."""
    keys = [BlockKey(bytes(32)), *(digest(i) for i in range(60))]
    with mock.patch.object(keytable, "MIN_CAPACITY", 4), \
            mock.patch.object(keytable, "MAX_KICKS", kicks):
        table = KeyTable(np.random.default_rng(0))
        model: dict[BlockKey, Tier] = {}
        for i, tier in ops:
            if tier:
                table.put(keys[i], tier)
                model[keys[i]] = Tier(tier)
            else:
                table.discard(keys[i])
                model.pop(keys[i], None)
            assert len(table) == len(model)
        found = table.lookup(keys)
    tiers = [model.get(k) for k in keys]
    assert found == (next((i for i, t in enumerate(tiers) if t is None), len(tiers)), tiers)


def test_a_table_passes_lists_it_cannot_read_back_to_the_dict() -> None:
    """Keys not adding up to 32 bytes each, or not bytes (keys the store checked are
    32-byte BlockKeys: the table does not check them one by one)."""
    table = KeyTable(np.random.default_rng(0))
    table.put(digest(1), D)
    assert table.lookup([digest(1), BlockKey(b"short")]) is None
    assert table.lookup(["not bytes"]) is None  # type: ignore[list-item]
    assert table.lookup([digest(1), digest(2)]) == (1, [D, None])
    assert table.lookup([]) == (0, [])


def test_a_table_refuses_a_key_three_times_over() -> None:
    """Three copies of a key cannot share its two homes, whatever the multipliers (an Index
    never hands a table a key twice)."""
    words = np.frombuffer(digest(1) * 3, "<u8").reshape(-1, 4)
    with pytest.raises(ValueError, match="repeated"):
        KeyTable(np.random.default_rng(0), words, np.full(3, 2, np.int8))


# --- the real thresholds ---------------------------------------------------------------------


CHAIN = 1024


def chains(index: Index, count: int, ns: str = "ns", start: int = 0) -> Iterator[list[BlockKey]]:
    """Store count chains of CHAIN digests (one put each) in DRAM; yield each."""
    for c in range(count):
        keys = [digest(start + c * CHAIN + i) for i in range(CHAIN)]
        plan = index.prepare_store(f"c{start}-{c}", ns, keys, [1] * CHAIN,
                                   [None, *keys[:-1]], D, FAR)
        assert plan is not None
        index.complete_store(plan.plan_id, [0] * CHAIN, success=True)
        yield keys


@pytest.fixture(scope="module")
def big() -> tuple[Index, list[list[BlockKey]]]:
    """A namespace just at MIN_ENTRIES (so it has a table), in an index with room for more."""
    index = Index({D: PageAllocator(2 * keytable.MIN_ENTRIES), N: PageAllocator(4 * CHAIN)},
                  {D: 1, N: 1})
    return index, list(chains(index, keytable.MIN_ENTRIES // CHAIN))


def test_a_big_namespace_answers_long_lookups_from_its_table(
        big: tuple[Index, list[list[BlockKey]]]) -> None:
    index, stored = big
    spy = TableLookups()
    with spy.patch():
        for keys in stored[:3]:
            assert index.lookup("ns", keys) == (CHAIN, [D] * CHAIN)
            wire = [BlockKey(bytes(bytearray(k))) for k in keys]  # equal, not the same objects
            assert index.lookup("ns", wire) == (CHAIN, [D] * CHAIN)
        mixed = [*stored[0][:300], digest(10**9), *stored[1][:500]]
        assert index.lookup("ns", mixed) == expected(index, "ns", mixed)
        assert spy.answered == 7
        short = stored[2][: keytable.MIN_KEYS - 1]
        assert index.lookup("ns", short) == (len(short), [D] * len(short))  # the dict's
        assert index.lookup("elsewhere", stored[0]) == (0, [None] * CHAIN)
        assert spy.answered == 7


def test_evictions_moves_and_growth_reach_the_table(
        big: tuple[Index, list[list[BlockKey]]]) -> None:
    index, stored = copy.deepcopy(big)
    original, _ = big
    evicted, _ = index.evict_keys("ns", [stored[0][512]])  # and its 511 descendants
    assert len(evicted) == 512
    for e in index.moves.pick(D, 64, 64):  # 64 leaves of the other chains, down to L3
        pages = index.moves.alloc(N, e.size_bytes)
        assert pages is not None
        index.moves.add_copy(e, N, pages)
        index.moves.drop_copy(e, D)
        index.moves.done(e)
    grown = list(chains(index, 2, start=10**6))
    probes = [stored[0], stored[1], *grown, [*stored[0][:10], *grown[0][:10]]]
    for keys in probes:
        assert index.lookup("ns", keys) == expected(index, "ns", keys)
    assert index.lookup("ns", stored[0])[0] == 512
    assert sum(t == N for keys in stored for t in index.lookup("ns", keys)[1]) == 64
    assert original.lookup("ns", stored[0]) == (CHAIN, [D] * CHAIN)  # the copy's own table


def test_a_key_not_32_bytes_long_sends_its_namespace_to_the_dict() -> None:
    with small_tables():
        index = Index({D: PageAllocator(64)}, {D: 1})
        keys = [digest(i) for i in range(8)]
        for k in [*keys, BlockKey(b"odd")]:
            plan = index.prepare_store(f"{k!r}", "ns", [k], [1], [None], D, FAR)
            assert plan is not None
            index.complete_store(plan.plan_id, [0], success=True)
        probe = [*keys, BlockKey(b"odd"), digest(99)]
        assert index.lookup("ns", probe) == (9, [D] * 9 + [None])
        index.evict_keys("ns", [BlockKey(b"odd")])
        for i in range(8, 16):  # at 16 entries (a power of two) the table is back
            plan = index.prepare_store(f"x{i}", "ns", [digest(i)], [1], [None], D, FAR)
            assert plan is not None
            index.complete_store(plan.plan_id, [0], success=True)
        spy = TableLookups()
        with spy.patch():
            probe = [digest(i) for i in range(17)]
            assert index.lookup("ns", probe) == (16, [D] * 16 + [None])
        assert spy.answered == 1
