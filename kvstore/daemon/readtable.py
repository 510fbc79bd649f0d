"""The daemon's read tables: one per L2 arena, published in step with the index, handed to
the arena's tenant's clients read-only (docs/local-path.md, "Reads through the table").

Each table is a memfd of its own (kvstore/readtable.py lays it out), mapped writable here
only, then sealed: it cannot grow or shrink, and no new writable mapping or write() of it
can ever be made (F_SEAL_FUTURE_WRITE), whoever holds a descriptor, however it was opened.
Clients get a descriptor opened read-only through /proc/self/fd besides, so mapping it
writable fails twice over. A client may map a private copy-on-write copy and scribble on
that: it changes nothing anyone else sees.

The index calls `added`, `changed` and `removed` from its bookkeeping (kvstore/core/index.py),
which every change of an entry's copies goes through, under the store lock that also guards
page allocation. So a block's slot is withdrawn (its version moved on) in the same lock hold
that frees its L2 pages, before anyone can be handed those pages, and written after its
bytes are in place (a block becomes an entry only once written). The daemon never reads a
table back: its index decides everything, and the TableWriter keeps its own mirror.

Only blocks whose L2 copy is one run of pages are published (nearly all: the page allocator
hands out runs); the rest, and the keys a full table leaves out, read as misses in the
table, which the client asks the daemon about.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
from collections.abc import Sequence

import numpy as np

from kvstore.core.records import Entry
from kvstore.extents import Arena
from kvstore.readtable import (
    Record,
    TableWriter,
    capacity_for,
    namespace_hash,
    table_bytes,
)
from kvstore.tier import Tier

log = logging.getLogger(__name__)

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1
_DRAM = Tier.DRAM


class _Table:
    """One arena's table: its memfd, the daemon's writable mapping, and its writer."""

    def __init__(self, arena: Arena, page_size_bytes: int, rng: np.random.Generator) -> None:
        self.arena = arena
        self.base_page = arena.first_page
        capacity = capacity_for(arena.num_pages)  # each block takes a page at least
        self.size_bytes = table_bytes(capacity)
        self.fd = os.memfd_create(f"kvstore-table-{arena.name}",
                                  os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size_bytes)
            self._map = mmap.mmap(self.fd, self.size_bytes, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                        | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        except BaseException:
            os.close(self.fd)
            raise
        self.writer = TableWriter(memoryview(self._map), capacity,
                                  arena.num_pages * page_size_bytes, rng)

    def read_only_fd(self) -> int:
        """A new descriptor of the table opened read-only (the caller closes it)."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        self.writer.retire()  # clients still mapping it find nothing from now on
        os.close(self.fd)
        try:
            self._map.close()
        except BufferError:  # the writer's arrays still view it: unmapped when collected
            log.debug("read table %r still viewed; unmapped later", self.arena.name)


class ReadTables:
    """The read tables of every L2 arena, kept in step with the index through its hooks."""

    def __init__(self, arenas: Sequence[Arena], page_size_bytes: int,
                 seed: int | None = None) -> None:
        """arenas: L2's (the one arena "" over every page when tiers are not split)."""
        rng = np.random.default_rng(seed)
        self._page_size = page_size_bytes
        self._tables: dict[str, _Table] = {}
        try:
            for arena in arenas:
                self._tables[arena.name] = _Table(arena, page_size_bytes, rng)
        except BaseException:
            self.close()
            raise

    def fds(self, arena: str) -> list[tuple[str, int, int]]:
        """(arena name, a read-only descriptor the caller closes, table bytes) of the named
        arena's table; none when it has none."""
        table = self._tables.get(arena)
        return [] if table is None else [(arena, table.read_only_fd(), table.size_bytes)]

    # --- the index's hooks (called under the store lock) -----------------------------------

    def added(self, entry: Entry) -> None:
        """entry was cached: published when it has a copy in L2."""
        self._show(entry)

    def changed(self, entry: Entry, before: Tier) -> None:
        """A copy of entry was added or dropped: published as it lies now, or withdrawn
        when its L2 copy went."""
        self._show(entry)

    def removed(self, entry: Entry) -> None:
        """entry is no longer cached (its pages are freed right after)."""
        table = self._tables.get(entry.arena)
        if table is not None:
            table.writer.remove((namespace_hash(entry.namespace), entry.key))

    def _show(self, entry: Entry) -> None:
        table = self._tables.get(entry.arena)
        if table is None:
            return
        ident = (namespace_hash(entry.namespace), entry.key)
        runs = entry.copies.get(_DRAM)
        if runs is None or len(runs) != 1 or len(entry.key) != 32:
            table.writer.remove(ident)
            return
        offset = (runs[0][0] - table.base_page) * self._page_size
        table.writer.put(ident, Record(offset, entry.size_bytes, entry.tier.value,
                                       entry.checksum))

    def close(self) -> None:
        for table in self._tables.values():
            table.close()
        self._tables = {}
