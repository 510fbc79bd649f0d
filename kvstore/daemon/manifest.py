"""Crash-safe manifest of the L3 NVMe tier: which objects its page file holds, on which pages.

A restarted daemon (even after ``kill -9``) re-adopts what this records. It owns two files in
its directory (mode 0700), each replaced only by writing ``<name>.tmp``, fsync and rename:
``manifest.snap``, the live set as COMMITs, and ``manifest.journal``, COMMITs and FREEs since.

Format, little-endian. Header, 48 bytes: ``8s magic b"KVSSNAP1" | b"KVSJRNL1", u32 version,
u64 generation, u64 page_size_bytes, u64 num_pages, u64 record_count (snapshot; journal 0),
u32 zlib.crc32 of the 44 bytes before``. Record: ``u32 payload length, u32 zlib.crc32 of the
payload, payload``. COMMIT payload: ``u8 1, u16 n + n bytes of utf-8 namespace, 32s key, u64
size_bytes, u64 checksum, u8 has_parent + 32s parent (zeros if none), u32 run count, then (u64
start, u32 length) per run``. FREE payload: ``u8 2, u16 n + namespace, 32s key``.

Load replays the journal only if its generation equals the snapshot's (0 without one); an older
one means a crash between snapshot rename and journal reset, its records already in the
snapshot: skipped. Replay stops at the first short, bad-crc or undecodable record and truncates
that torn tail. A damaged snapshot or header, a newer journal or changed geometry discard all;
records with pages outside the file, or overlapped by a later commit, are dropped.

Durability: an append is one ``os.write`` to an O_APPEND descriptor, fsynced only with
``sync=True`` (``os.fdatasync``): page-cache writes survive ``kill -9``, the crash this is built
for. A power failure may lose or tear the last appends, or keep a COMMIT whose pages never reached
the disk: the torn tail is dropped here, each object's xxh3-64 checksum catches the rest.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvstore.extents import PageRun
from kvstore.keys import KEY_BYTES, check_key, check_namespace

log = logging.getLogger(__name__)

SNAPSHOT_NAME = "manifest.snap"
JOURNAL_NAME = "manifest.journal"
FORMAT_VERSION = 1
COMMIT = 1
FREE = 2

_SNAP_MAGIC = b"KVSSNAP1"
_JOURNAL_MAGIC = b"KVSJRNL1"
_HEADER = struct.Struct("<8sIQQQQ")  # then the u32 crc32 of these bytes
_CRC = struct.Struct("<I")
HEADER_BYTES = _HEADER.size + _CRC.size
_FRAME = struct.Struct("<II")
_TYPE_NS = struct.Struct("<BH")
_COMMIT_BODY = struct.Struct("<32sQQB32sI")
_RUN = struct.Struct("<QI")
_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1

_Ident = tuple[str, bytes]  # (namespace, key): what a COMMIT replaces and a FREE names


@dataclass(frozen=True, slots=True)
class ManifestRecord:
    """One object the page file holds, and the pages that hold it."""

    namespace: str
    key: bytes  # 32 bytes
    size_bytes: int
    checksum: int  # unsigned 64-bit xxh3-64 of the payload
    parent: bytes | None  # 32 bytes or None
    pages: tuple[PageRun, ...]


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What load() recovered."""

    records: list[ManifestRecord]  # live objects, in journal order
    torn_bytes: int  # bytes dropped from the journal tail
    discarded: str  # "" or why the whole manifest was discarded


class _Discard(Exception):
    """The manifest on disk cannot be trusted as a whole; the message says why."""


def _frame(payload: bytes) -> bytes:
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def _encode_commit(r: ManifestRecord) -> bytes:
    namespace = r.namespace.encode("utf-8")
    parent = bytes(KEY_BYTES) if r.parent is None else r.parent
    body = _COMMIT_BODY.pack(r.key, r.size_bytes, r.checksum, bool(r.parent), parent, len(r.pages))
    runs = b"".join(_RUN.pack(start, length) for start, length in r.pages)
    return _TYPE_NS.pack(COMMIT, len(namespace)) + namespace + body + runs


def _decode(payload: bytes) -> ManifestRecord | _Ident:
    """A COMMIT as a record, a FREE as its identity; ValueError or struct.error if malformed."""
    kind, namespace_bytes = _TYPE_NS.unpack_from(payload)
    at = _TYPE_NS.size + namespace_bytes
    namespace = payload[_TYPE_NS.size : at].decode("utf-8")
    if kind == FREE:
        if len(payload) != at + KEY_BYTES:
            raise ValueError("FREE record has the wrong length")
        return namespace, payload[at:]
    if kind != COMMIT:
        raise ValueError(f"unknown record type {kind}")
    key, size_bytes, checksum, has_parent, parent, num_runs = _COMMIT_BODY.unpack_from(payload, at)
    at += _COMMIT_BODY.size
    if len(payload) != at + num_runs * _RUN.size or has_parent > 1:
        raise ValueError("COMMIT record has a bad length or parent flag")
    runs = tuple(PageRun(s, n) for s, n in _RUN.iter_unpack(payload[at:]))
    parent = parent if has_parent else None
    return ManifestRecord(namespace, key, size_bytes, checksum, parent, runs)


def _scan(data: bytes, offset: int) -> tuple[list[ManifestRecord | _Ident], int]:
    """The records from offset up to the first short, bad-crc or undecodable one; its offset."""
    entries: list[ManifestRecord | _Ident] = []
    while offset + _FRAME.size <= len(data):
        length, crc = _FRAME.unpack_from(data, offset)
        start = offset + _FRAME.size
        payload = data[start : start + length]
        if len(payload) != length or zlib.crc32(payload) != crc:
            break
        try:
            entries.append(_decode(payload))
        except (ValueError, struct.error):
            break
        offset = start + length
    return entries, offset


def _pages_problem(pages: tuple[PageRun, ...], num_pages: int) -> str:
    """What is wrong with the runs (outside [0, num_pages), overlapping each other), or ""."""
    end = 0
    for start, length in sorted(pages):
        if start < 0 or not 1 <= length <= min(num_pages - start, _U32_MAX):
            return f"page run ({start}, {length}) is empty or outside pages [0, {num_pages})"
        if start < end:
            return f"page run ({start}, {length}) overlaps another run of the same record"
        end = start + length
    return ""


class _LiveSet:
    """Replay state: live records in journal order and every page run a valid COMMIT wrote."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.bad_pages = self.overlapped = self._seq = 0
        self._live: dict[_Ident, tuple[int, ManifestRecord]] = {}  # ident -> (seq, record)
        self._writes: list[tuple[int, int, int]] = []  # (start, end, seq) of each valid run

    def apply(self, entries: Iterable[ManifestRecord | _Ident]) -> None:
        for entry in entries:
            if not isinstance(entry, ManifestRecord):
                self._live.pop(entry, None)  # a FREE of an unknown key is a no-op
                continue
            self._live.pop((entry.namespace, entry.key), None)  # replaced, even by a bad one
            if _pages_problem(entry.pages, self.num_pages):
                self.bad_pages += 1
                continue
            self._seq += 1
            self._writes.extend((start, start + n, self._seq) for start, n in entry.pages)
            self._live[(entry.namespace, entry.key)] = (self._seq, entry)

    def survivors(self) -> list[ManifestRecord]:
        """Live records no later commit overlapped, in one sweep of the runs by start page."""
        live_seqs = {seq for seq, _ in self._live.values()}
        newest: list[tuple[int, int]] = []  # (-seq, end) of runs started so far; lazy expiry
        exposed: list[tuple[int, int]] = []  # (seq, end) of live runs not yet overwritten
        overwritten: set[int] = set()
        for start, end, seq in sorted(self._writes):
            while newest and newest[0][1] <= start:
                heapq.heappop(newest)
            if seq in live_seqs:
                if newest and -newest[0][0] > seq:  # a newer run covers this one's first page
                    overwritten.add(seq)
                heapq.heappush(exposed, (seq, end))
            while exposed and (exposed[0][1] <= start or exposed[0][0] < seq):
                older, older_end = heapq.heappop(exposed)
                if older_end > start:  # this newer run starts inside an older live one
                    overwritten.add(older)
            heapq.heappush(newest, (-seq, end))
        self.overlapped = len(overwritten)
        return [record for seq, record in self._live.values() if seq not in overwritten]


def _write_atomically(path: Path, chunks: Iterable[bytes]) -> None:
    """Write chunks to path.tmp, fsync, rename over path, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb", opener=lambda p, flags: os.open(p, flags, 0o600)) as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Manifest:
    """The journal and snapshot of one L3 page file. Not thread-safe: one owner appends."""

    def __init__(
        self, directory: Path, page_size_bytes: int, num_pages: int, sync: bool = False
    ) -> None:
        if page_size_bytes <= 0 or num_pages <= 0:
            raise ValueError(
                f"page_size_bytes ({page_size_bytes}) and num_pages ({num_pages}) must be > 0"
            )
        self._dir = Path(directory)
        self._snap_path = self._dir / SNAPSHOT_NAME
        self._journal_path = self._dir / JOURNAL_NAME
        self._page_size_bytes = page_size_bytes
        self._num_pages = num_pages
        self._sync = sync
        self._fd: int | None = None
        self._loaded = self._closed = False
        self._generation = self._journal_size_bytes = self._journal_records = 0
        self._pending_truncate = False  # a failed append left bytes rollback could not cut

    @property
    def directory(self) -> Path:
        """The folder holding the manifest (and the L3 file beside it)."""
        return self._dir

    @property
    def journal_records(self) -> int:
        """Records in the journal since the last snapshot, those load() replayed included."""
        return self._journal_records

    def load(self) -> LoadReport:
        """Recover the live set from disk and open the journal for appends. Call once."""
        if self._loaded or self._closed:
            raise RuntimeError("Manifest.load() is called once, before any append")
        self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        discarded = ""
        try:
            live, torn_bytes = self._recover()
        except _Discard as discard:
            discarded = str(discard)
            log.warning("manifest %s discarded, L3 starts empty: %s", self._dir, discarded)
            self._generation = 0
            self._snap_path.unlink(missing_ok=True)
            self._reset_journal()
            live, torn_bytes = _LiveSet(self._num_pages), 0
        self._loaded = True
        records = live.survivors()
        dropped = (live.bad_pages, live.overlapped)
        if torn_bytes or any(dropped):
            what = "cut a %d-byte torn tail, dropped %d bad-page and %d overlapped records"
            log.warning("manifest %s: " + what, self._dir, torn_bytes, *dropped)
        return LoadReport(records, torn_bytes, discarded)

    def commit(self, record: ManifestRecord) -> None:
        """Append a COMMIT: record's pages now hold it, replacing any earlier version."""
        self._validate(record)
        self._append(_encode_commit(record))

    def free(self, namespace: str, key: bytes) -> None:
        """Append a FREE: the object no longer holds its pages."""
        encoded = check_namespace(namespace).encode("utf-8")
        self._append(_TYPE_NS.pack(FREE, len(encoded)) + encoded + check_key(key))

    def snapshot(self, live: Iterable[ManifestRecord]) -> None:
        """Compact: write `live` as the next-generation snapshot, then start an empty journal."""
        if not self._loaded or self._closed:
            raise RuntimeError("snapshot() needs an open manifest: load() first, not after close()")
        records = list(live)
        for record in records:
            self._validate(record)
        header = self._header(_SNAP_MAGIC, self._generation + 1, len(records))
        frames = (_frame(_encode_commit(record)) for record in records)
        _write_atomically(self._snap_path, itertools.chain([header], frames))
        self._generation += 1
        self._close_fd()  # the old journal must not grow; an append retries a failed reset
        self._reset_journal()

    def close(self) -> None:
        """Close the journal; idempotent. Appends after close are misuse."""
        self._closed = True
        self._close_fd()

    def _recover(self) -> tuple[_LiveSet, int]:
        """The live set and the torn tail's size; _Discard when nothing can be trusted."""
        live = _LiveSet(self._num_pages)
        snap = self._snap_path.read_bytes() if self._snap_path.exists() else None
        if snap is not None:
            self._generation, count = self._check_header(snap, _SNAP_MAGIC, "snapshot")
            entries, end = _scan(snap, HEADER_BYTES)
            if end != len(snap) or len(entries) != count:
                raise _Discard(f"snapshot is damaged at byte {end} ({len(entries)}/{count} read)")
            live.apply(entries)
        journal = self._journal_path.read_bytes() if self._journal_path.exists() else b""
        if not journal and snap is not None:
            raise _Discard("the journal is missing or empty but a snapshot exists")
        generation = self._check_header(journal, _JOURNAL_MAGIC, "journal")[0] if journal else -1
        if generation > self._generation:
            raise _Discard(f"journal generation {generation} > snapshot's {self._generation}")
        if generation < self._generation:  # a first start, or its records are in the snapshot
            self._reset_journal()
            return live, 0
        entries, end = _scan(journal, HEADER_BYTES)
        live.apply(entries)
        self._open_journal(end, len(entries))
        return live, len(journal) - end

    def _check_header(self, data: bytes, magic: bytes, name: str) -> tuple[int, int]:
        """(generation, record_count) of a sound header of today's geometry, else _Discard."""
        if len(data) < HEADER_BYTES:
            raise _Discard(f"{name} header is short: {len(data)} of {HEADER_BYTES} bytes")
        found, version, generation, page_size_bytes, num_pages, count = _HEADER.unpack_from(data)
        (crc,) = _CRC.unpack_from(data, _HEADER.size)
        if found != magic or crc != zlib.crc32(data[: _HEADER.size]):
            raise _Discard(f"{name} header is damaged (bad magic or crc)")
        if version != FORMAT_VERSION:
            raise _Discard(f"{name} format version is {version}, not {FORMAT_VERSION}")
        changed = [
            f"{field} changed from {was} to {now}"
            for field, was, now in [
                ("page_size_bytes", page_size_bytes, self._page_size_bytes),
                ("num_pages", num_pages, self._num_pages),
            ]
            if was != now
        ]
        if changed:
            raise _Discard(f"{name} geometry: " + "; ".join(changed))
        return generation, count

    def _header(self, magic: bytes, generation: int, record_count: int) -> bytes:
        fields = _HEADER.pack(
            magic, FORMAT_VERSION, generation, self._page_size_bytes, self._num_pages, record_count
        )
        return fields + _CRC.pack(zlib.crc32(fields))

    def _reset_journal(self) -> int:
        """Replace the journal, atomically, with an empty one of the current generation."""
        _write_atomically(self._journal_path, [self._header(_JOURNAL_MAGIC, self._generation, 0)])
        self._pending_truncate = False
        return self._open_journal(HEADER_BYTES, 0)

    def _open_journal(self, good_size_bytes: int, num_records: int) -> int:
        """Open the journal for appends, cutting anything past its last good record."""
        self._close_fd()
        if self._journal_path.stat().st_size != good_size_bytes:
            os.truncate(self._journal_path, good_size_bytes)  # made durable by the next fsync
        self._fd = fd = os.open(self._journal_path, os.O_WRONLY | os.O_APPEND)
        self._journal_size_bytes = good_size_bytes
        self._journal_records = num_records
        return fd

    def _close_fd(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def _append(self, payload: bytes) -> None:
        """Append one record; on OSError cut any partial record off again, then raise."""
        if not self._loaded or self._closed:
            raise RuntimeError("appends need an open manifest: load() first, not after close()")
        # the descriptor is None only after a snapshot whose journal reset failed
        fd = self._reset_journal() if self._fd is None else self._fd
        data = memoryview(_frame(payload))
        try:
            if self._pending_truncate:
                os.ftruncate(fd, self._journal_size_bytes)
                self._pending_truncate = False
            written = os.write(fd, data)
            while written < len(data):  # the disk filled mid-record; the next write says why
                written += os.write(fd, data[written:])
            if self._sync:
                os.fdatasync(fd)
        except OSError:
            self._pending_truncate = True  # until the cut below lands; it raises if it fails
            os.ftruncate(fd, self._journal_size_bytes)
            self._pending_truncate = False
            raise
        self._journal_size_bytes += len(data)
        self._journal_records += 1

    def _validate(self, record: ManifestRecord) -> None:
        check_namespace(record.namespace)
        check_key(record.key)
        if record.parent is not None:
            check_key(record.parent, "parent")
        for field, value in (("size_bytes", record.size_bytes), ("checksum", record.checksum)):
            if not 0 <= value <= _U64_MAX:
                raise ValueError(f"{field} must fit in an unsigned 64-bit integer, got {value}")
        problem = _pages_problem(record.pages, self._num_pages)
        if problem:
            raise ValueError(f"record {record.key.hex()[:16]}: {problem}")
