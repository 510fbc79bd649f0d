"""L2 DRAM tier: shared memory of fixed-size pages, in one segment or one arena per tenant.

Without tenants (auth.mode=off) the pages are one named segment under /dev/shm, mode 0600 and
removed on clean shutdown, which co-located clients attach by name. With tenants each tenant's
page range (kvstore.extents.Arena) is an arena of its own: an anonymous memfd that no name
opens, handed only to that tenant's clients as a file descriptor (kvstore.daemon.attach).
Offsets inside the daemon are over all arenas end to end; `arena_extents` turns them into the
arena and the offsets a client sees. When CUDA is present every arena is registered as pinned
(page-locked) memory, so a GPU can DMA to and from it. This module does I/O on pages it is told
about; which pages belong to what is the index's.
"""

from __future__ import annotations

import bisect
import fcntl
import logging
import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstore.extents import Arena, Extent, PageRun
from kvstore.memory import register_pinned, unregister_pinned
from kvstore.shm import Segment, create_segment, list_segments, remove_stale_segments
from kvstore.tiers.base import Transfer, padded_size

log = logging.getLogger(__name__)

STALE_PREFIX = "kvstore-"  # automatic segment names start so (kvstore/daemon/store.py)


class DramTier:
    """Byte-level access to page runs of the L2 segment; a SlotTier (tiers/base.py)."""

    name = "dram"
    backend = "shm"

    def __init__(
        self, capacity_bytes: int, page_size_bytes: int, shm_name: str, pin_memory: bool,
        arenas: Sequence[Arena] | None = None,
    ) -> None:
        """arenas None: one named segment; else one memfd per arena (pages outside every
        arena are never used)."""
        self.page_size_bytes = page_size_bytes
        self.num_pages = capacity_bytes // page_size_bytes
        self.capacity_bytes = self.num_pages * page_size_bytes
        self._segment: Segment | None = None
        self._parts: list[_Part] = []
        if arenas is None:
            # A daemon that crashed left its segment in /dev/shm (tmpfs: real memory);
            # reclaim those, and this name if a crash left it, before taking more. Whether a
            # segment is stale is decided by its lock alone, never its age, so one left by a
            # kill -9 an instant ago goes too (kvstore/shm.py, create_segment).
            remove_stale_segments({*list_segments(STALE_PREFIX), shm_name})
            self._segment = create_segment(shm_name, self.capacity_bytes)
            self.shm_name = self._segment.name
            array = np.frombuffer(self._segment.view(), dtype=np.uint8)
            self._parts.append(_Part("", 0, array, -1))
        else:
            self.shm_name = ""  # nothing anyone can open by name
            for arena in arenas:
                self._parts.append(_memfd_part(arena, page_size_bytes))
        self._bases = [part.base for part in self._parts]
        self.pinned = pin_memory and all(register_pinned(p.array, "L2 segment")
                                         for p in self._parts)

    def arena_fds(self, name: str) -> list[tuple[str, int, int]]:
        """(arena name, descriptor, size in bytes) of the named tenant's arenas: what its
        clients receive. The descriptors stay the tier's; senders duplicate them."""
        return [(p.name, p.fd, p.array.nbytes) for p in self._parts if p.name == name and p.fd >= 0]

    def arena_extents(self, extents: Sequence[Extent]) -> tuple[str, list[Extent]]:
        """The arena an object's extents lie in, and the extents as offsets in that arena."""
        if not extents:
            return (self._parts[0].name if len(self._parts) == 1 else ""), []
        part = self._part_at(extents[0][0])
        return part.name, [(offset - part.base, n) for offset, n in extents]

    def client_extents(self, blocks: Sequence[Sequence[Extent]]
                       ) -> tuple[str, str, list[list[Extent]]]:
        """(shm_name, arena, extents) as a client sees the blocks of one call: offsets in the
        named segment, or in the one arena they all lie in (a call names one tenant's
        namespace, whose blocks all live in its arena)."""
        if self.shm_name:
            return self.shm_name, "", [list(b) for b in blocks]
        arena = ""
        local: list[list[Extent]] = []
        for block in blocks:
            name, offsets = self.arena_extents(block)
            arena = arena or name
            local.append(offsets)
        return "", arena, local

    def _part_at(self, offset: int) -> _Part:
        return self._parts[bisect.bisect_right(self._bases, offset) - 1]

    def _slice(self, offset: int, length: int) -> np.ndarray:
        part = self._part_at(offset) if len(self._parts) > 1 else self._parts[0]
        start = offset - part.base
        if start < 0 or start + length > part.array.nbytes:
            raise ValueError(f"bytes [{offset}, {offset + length}) lie outside arena "
                             f"{part.name!r}")
        return part.array[start : start + length]

    def extents(self, pages: Sequence[PageRun], size_bytes: int) -> list[Extent]:
        """Byte ranges of the segment that hold an object of size_bytes on pages, in order."""
        out: list[Extent] = []
        remaining = size_bytes
        for start, length in pages:
            if remaining <= 0:
                break
            n = min(length * self.page_size_bytes, remaining)
            out.append((start * self.page_size_bytes, n))
            remaining -= n
        return out

    def write_at(self, extents: Sequence[Extent], offset: int, data: memoryview) -> None:
        """Write data at byte `offset` of the object laid out on extents."""
        src = np.frombuffer(data, dtype=np.uint8)
        done = 0
        for ext_offset, ext_length in extents:
            if offset >= ext_length:
                offset -= ext_length
                continue
            n = min(ext_length - offset, len(src) - done)
            self._slice(ext_offset + offset, n)[:] = src[done : done + n]
            done += n
            offset = 0
            if done == len(src):
                return
        if done != len(src):
            raise ValueError(f"write of {len(src)} bytes runs past the object's pages")

    def views(self, extents: Sequence[Extent]) -> Iterator[memoryview]:
        """Zero-copy views of the object's bytes, extent by extent."""
        for offset, length in extents:
            yield self._slice(offset, length).data

    def buffers(
        self, pages: Sequence[PageRun], size_bytes: int, pad: bool = True
    ) -> list[memoryview]:
        """Zero-copy views of an object's bytes in the segment, run by run: padded_size(size_bytes)
        bytes when pad (what an O_DIRECT or GDS read into these pages needs), else size_bytes."""
        n = padded_size(size_bytes) if pad else size_bytes
        self._check_pages(pages, n)
        return list(self.views(self.extents(pages, n)))

    def write(self, batch: Sequence[Transfer]) -> list[OSError | None]:
        """Copy each transfer's buffers into its pages; one None per transfer (memory copies
        do not fail). Short buffers or pages are misuse: ValueError before anything is copied."""
        for t in batch:
            self._check_transfer(t, for_read=False)
        for t in batch:
            _copy(list(self.views(self.extents(t.pages, t.size_bytes))), t.buffers)
        return [None] * len(batch)

    def read(self, batch: Sequence[Transfer]) -> list[OSError | None]:
        """Copy each transfer's pages into its buffers; one None per transfer."""
        for t in batch:
            self._check_transfer(t, for_read=True)
        for t in batch:
            _copy(t.buffers, list(self.views(self.extents(t.pages, t.size_bytes))))
        return [None] * len(batch)

    def _check_transfer(self, t: Transfer, for_read: bool) -> None:
        self._check_pages(t.pages, t.size_bytes)
        if sum(b.nbytes for b in t.buffers) < t.size_bytes:
            raise ValueError(f"buffers hold fewer than the transfer's {t.size_bytes} bytes")
        if for_read and any(b.readonly for b in t.buffers):
            raise ValueError("a read's buffers must be writable")

    def _check_pages(self, pages: Sequence[PageRun], size_bytes: int) -> None:
        for start, length in pages:
            if start < 0 or length <= 0 or start + length > self.num_pages:
                raise ValueError(f"page run {(start, length)} is outside 0..{self.num_pages}")
        if sum(length for _, length in pages) * self.page_size_bytes < size_bytes:
            raise ValueError(f"pages {tuple(pages)} hold fewer than {size_bytes} bytes")

    def checksum(self, extents: Sequence[Extent]) -> int:
        h = xxhash.xxh3_64()
        for view in self.views(extents):
            h.update(view)
        return h.intdigest()

    def close(self) -> None:
        """Unlink the segment, close the arenas' descriptors (clients that hold a mapping or
        a descriptor keep it until they close it)."""
        for part in self._parts:
            if self.pinned:
                unregister_pinned(part.array.ctypes.data)
            if part.fd >= 0:
                os.close(part.fd)
        self._parts = []
        if self._segment is not None:
            self._segment.close()
            self._segment.unlink()


@dataclass
class _Part:
    """One mapped arena: bytes [base, base + array.nbytes) of the tier's offsets."""

    name: str
    base: int
    array: np.ndarray
    fd: int  # the memfd (-1 for the named segment)


def _memfd_part(arena: Arena, page_size_bytes: int) -> _Part:
    size = arena.num_pages * page_size_bytes
    fd = os.memfd_create(f"kvstore-arena-{arena.name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        # Whoever holds the descriptor may map and write it, but never resize it: a client
        # shrinking its arena would make the daemon's next touch of those pages a SIGBUS.
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        buf = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return _Part(arena.name, arena.first_page * page_size_bytes,
                 np.frombuffer(buf, dtype=np.uint8), fd)


def _copy(dst: Sequence[memoryview], src: Sequence[memoryview]) -> None:
    """Copy the bytes of src (concatenated) onto the start of dst (concatenated), stopping at
    whichever ends first."""
    dst_arrays = [np.frombuffer(d, dtype=np.uint8) for d in dst]
    src_arrays = [np.frombuffer(s, dtype=np.uint8) for s in src]
    di = si = d_off = s_off = 0
    while di < len(dst_arrays) and si < len(src_arrays):
        d, s = dst_arrays[di], src_arrays[si]
        n = min(len(d) - d_off, len(s) - s_off)
        d[d_off : d_off + n] = s[s_off : s_off + n]
        d_off += n
        s_off += n
        if d_off == len(d):
            di, d_off = di + 1, 0
        if s_off == len(s):
            si, s_off = si + 1, 0
