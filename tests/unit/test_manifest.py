"""The L3 manifest on real files: round trips, a torn tail cut at every byte, a flipped byte,
snapshots and the crash between snapshot and journal reset, geometry changes, overlapping and
out-of-range pages, a hypothesis model, a child killed with SIGKILL mid-append, and a disk
that fills mid-record."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.daemon.manifest import (
    HEADER_BYTES,
    JOURNAL_NAME,
    SNAPSHOT_NAME,
    LoadReport,
    Manifest,
    ManifestRecord,
)
from kvstore.extents import PageRun

REPO = Path(__file__).resolve().parents[2]
PAGE_SIZE = 4096
NUM_PAGES = 1024
KILL_NUM_PAGES = 3 * 2**20  # counter_record(i) takes pages 3i..3i+2, so i < 2**20 never overlap

# --- helpers ---------------------------------------------------------------------------------


def key_of(i: int, salt: bytes = b"k") -> bytes:
    return hashlib.sha256(salt + b"%d" % i).digest()


def rec(i: int, pages: tuple[PageRun, ...] | None = None, namespace: str = "ns") -> ManifestRecord:
    """Object i on pages 4i..4i+1 unless told otherwise; its parent is object i-1."""
    return ManifestRecord(
        namespace=namespace,
        key=key_of(i),
        size_bytes=1000 + i,
        checksum=(i * 0x9E3779B97F4A7C15) % 2**64,
        parent=key_of(i - 1) if i else None,
        pages=pages if pages is not None else (PageRun(4 * i, 2),),
    )


def counter_record(i: int) -> ManifestRecord:
    """The deterministic i-th record the subprocess tests write (size_bytes carries i)."""
    return ManifestRecord(
        namespace=f"child-{i % 3}",
        key=key_of(i, b"child"),
        size_bytes=i,
        checksum=(i * 0x9E3779B97F4A7C15 + 7) % 2**64,
        parent=key_of(i - 1, b"child") if i % 2 else None,
        pages=(PageRun(3 * i, 2), PageRun(3 * i + 2, 1)),
    )


def open_manifest(
    directory: Path, page_size_bytes: int = PAGE_SIZE, num_pages: int = NUM_PAGES
) -> tuple[Manifest, LoadReport]:
    manifest = Manifest(directory, page_size_bytes, num_pages)
    return manifest, manifest.load()


def reload(directory: Path, **geometry: int) -> LoadReport:
    manifest, report = open_manifest(directory, **geometry)
    manifest.close()
    return report


def raw_commit(record: ManifestRecord) -> bytes:
    """A COMMIT frame built from the documented format alone, independent of the module."""
    ns = record.namespace.encode()
    parent = record.parent or bytes(32)
    payload = struct.pack("<BH", 1, len(ns)) + ns
    payload += struct.pack(
        "<32sQQB32sI",
        *(record.key, record.size_bytes, record.checksum, record.parent is not None, parent),
        len(record.pages),
    )
    payload += b"".join(struct.pack("<QI", start, length) for start, length in record.pages)
    return struct.pack("<II", len(payload), zlib.crc32(payload)) + payload


def write_records(directory: Path, records: list[ManifestRecord]) -> list[int]:
    """Commit records; return the journal size before each one and after the last."""
    manifest, _ = open_manifest(directory)
    journal = directory / JOURNAL_NAME
    sizes = [journal.stat().st_size]
    for record in records:
        manifest.commit(record)
        sizes.append(journal.stat().st_size)
    manifest.close()
    return sizes


# --- round trips and format ------------------------------------------------------------------


@pytest.mark.parametrize("sync", [False, True])
def test_commits_and_frees_survive_close_and_reopen(tmp_path: Path, sync: bool) -> None:
    directory = tmp_path / "l3"
    manifest = Manifest(directory, PAGE_SIZE, NUM_PAGES, sync=sync)
    assert manifest.load() == LoadReport(records=[], torn_bytes=0, discarded="")
    for i in range(5):
        manifest.commit(rec(i))
    manifest.free("ns", key_of(1))
    manifest.free("ns", key_of(99))  # unknown: ignored
    manifest.free("other", key_of(2))  # same key, other namespace: ignored
    manifest.commit(rec(0, pages=(PageRun(500, 3), PageRun(600, 1))))  # replaces, moves last
    assert manifest.journal_records == 9
    manifest.close()

    reopened, report = open_manifest(directory)
    assert report == LoadReport(
        records=[rec(2), rec(3), rec(4), rec(0, pages=(PageRun(500, 3), PageRun(600, 1)))],
        torn_bytes=0,
        discarded="",
    )
    assert reopened.journal_records == 9  # replayed records count until a snapshot
    reopened.close()


def test_files_follow_the_documented_format(tmp_path: Path) -> None:
    directory = tmp_path / "l3"
    manifest, _ = open_manifest(directory)
    manifest.commit(rec(3))
    manifest.free("ns", key_of(3))
    manifest.snapshot([rec(5)])
    manifest.close()

    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    snap = (directory / SNAPSHOT_NAME).read_bytes()
    fields = struct.unpack_from("<8sIQQQQ", snap)
    assert fields == (b"KVSSNAP1", 1, 1, PAGE_SIZE, NUM_PAGES, 1)
    assert struct.unpack_from("<I", snap, 44)[0] == zlib.crc32(snap[:44])
    assert snap[HEADER_BYTES:] == raw_commit(rec(5))
    journal = (directory / JOURNAL_NAME).read_bytes()
    assert len(journal) == HEADER_BYTES == 48
    assert struct.unpack_from("<8sIQQQQ", journal) == (b"KVSJRNL1", 1, 1, PAGE_SIZE, NUM_PAGES, 0)


def test_a_commit_is_one_frame_of_the_documented_layout(tmp_path: Path) -> None:
    directory = tmp_path / "l3"
    record = rec(7, pages=(PageRun(9, 1), PageRun(1, 2)), namespace="näme")
    write_records(directory, [record])
    assert (directory / JOURNAL_NAME).read_bytes()[HEADER_BYTES:] == raw_commit(record)


def test_misuse_is_rejected_before_anything_is_written(tmp_path: Path) -> None:
    manifest = Manifest(tmp_path / "l3", PAGE_SIZE, NUM_PAGES)
    with pytest.raises(RuntimeError, match="load"):
        manifest.commit(rec(0))
    manifest.load()
    with pytest.raises(RuntimeError, match="once"):
        manifest.load()
    bad = [
        (rec(0, pages=(PageRun(NUM_PAGES - 1, 2),)), "outside"),
        (rec(0, pages=(PageRun(-1, 1),)), "outside"),
        (rec(0, pages=(PageRun(5, 0),)), "empty"),
        (rec(0, pages=(PageRun(5, 3), PageRun(7, 1))), "overlaps"),
        (ManifestRecord("ns", b"short", 1, 1, None, ()), "32-byte"),
        (ManifestRecord("ns", key_of(0), 1, 2**64, None, ()), "checksum"),
        (ManifestRecord("", key_of(0), 1, 1, None, ()), "namespace"),
    ]
    for record, why in bad:
        with pytest.raises(ValueError, match=why):
            manifest.commit(record)
    assert manifest.journal_records == 0
    assert (tmp_path / "l3" / JOURNAL_NAME).stat().st_size == HEADER_BYTES
    manifest.close()
    with pytest.raises(RuntimeError, match="close"):
        manifest.free("ns", key_of(0))


# --- torn tails and damage -------------------------------------------------------------------


def test_torn_tail_cut_at_every_byte_of_the_last_record(tmp_path: Path) -> None:
    pristine = tmp_path / "pristine"
    records = [rec(i) for i in range(5)]
    sizes = write_records(pristine, records)
    before_last, full = sizes[-2], sizes[-1]
    for cut in range(before_last + 1, full):
        directory = tmp_path / f"cut{cut}"
        shutil.copytree(pristine, directory)
        os.truncate(directory / JOURNAL_NAME, cut)

        manifest, report = open_manifest(directory)
        assert report == LoadReport(records=records[:4], torn_bytes=cut - before_last, discarded="")
        assert (directory / JOURNAL_NAME).stat().st_size == before_last  # the tail is cut off
        manifest.commit(rec(9))
        manifest.close()
        assert reload(directory).records == [*records[:4], rec(9)]


def test_zero_filled_tail_is_torn(tmp_path: Path) -> None:
    """What a power failure can leave on some filesystems: the size grew, the data did not."""
    sizes = write_records(tmp_path, [rec(0), rec(1)])
    with open(tmp_path / JOURNAL_NAME, "ab") as f:
        f.write(bytes(64))
    report = reload(tmp_path)
    assert report == LoadReport(records=[rec(0), rec(1)], torn_bytes=64, discarded="")
    assert (tmp_path / JOURNAL_NAME).stat().st_size == sizes[-1]


@pytest.mark.parametrize("where", ["length", "crc", "type", "payload_middle", "last_byte"])
def test_flipped_byte_in_the_middle_record_drops_it_and_the_rest(
    tmp_path: Path, where: str
) -> None:
    records = [rec(i) for i in range(5)]
    sizes = write_records(tmp_path, records)
    start, end = sizes[2], sizes[3]  # the third of five records
    offset = {
        "length": start,
        "crc": start + 5,
        "type": start + 8,
        "payload_middle": (start + end) // 2,
        "last_byte": end - 1,
    }[where]
    journal = tmp_path / JOURNAL_NAME
    data = bytearray(journal.read_bytes())
    data[offset] ^= 0x40
    journal.write_bytes(bytes(data))

    assert reload(tmp_path) == LoadReport(
        records=[rec(0), rec(1)], torn_bytes=sizes[-1] - start, discarded=""
    )


@pytest.mark.parametrize(
    ("offset", "why"),
    [(0, "snapshot header is damaged"), (HEADER_BYTES + 20, "snapshot is damaged at byte 48")],
)
def test_damaged_snapshot_discards_everything(tmp_path: Path, offset: int, why: str) -> None:
    manifest, _ = open_manifest(tmp_path)
    manifest.snapshot([rec(0), rec(1)])
    manifest.commit(rec(2))
    manifest.close()
    snap = tmp_path / SNAPSHOT_NAME
    data = bytearray(snap.read_bytes())
    data[offset] ^= 0x01
    snap.write_bytes(bytes(data))

    report = reload(tmp_path)
    assert report.records == [] and report.torn_bytes == 0
    assert why in report.discarded
    assert reload(tmp_path) == LoadReport([], 0, "")  # fresh files were started


def test_truncated_snapshot_is_damage_not_a_torn_tail(tmp_path: Path) -> None:
    manifest, _ = open_manifest(tmp_path)
    manifest.snapshot([rec(0), rec(1)])
    manifest.close()
    snap = tmp_path / SNAPSHOT_NAME
    os.truncate(snap, snap.stat().st_size - len(raw_commit(rec(1))))  # a whole record gone
    assert "1/2 read" in reload(tmp_path).discarded


def test_journal_newer_than_snapshot_discards(tmp_path: Path) -> None:
    manifest, _ = open_manifest(tmp_path)
    manifest.snapshot([rec(0)])
    manifest.commit(rec(1))
    manifest.close()
    (tmp_path / SNAPSHOT_NAME).unlink()  # the journal now claims generation 1 of nothing
    report = reload(tmp_path)
    assert report.records == []
    assert "journal generation 1" in report.discarded


@pytest.mark.parametrize(
    ("geometry", "field"),
    [({"page_size_bytes": 8192}, "page_size_bytes"), ({"num_pages": 2048}, "num_pages")],
)
@pytest.mark.parametrize("with_snapshot", [False, True])
def test_geometry_change_discards_with_the_field_named(
    tmp_path: Path, geometry: dict[str, int], field: str, with_snapshot: bool
) -> None:
    manifest, _ = open_manifest(tmp_path)
    manifest.commit(rec(0))
    if with_snapshot:
        manifest.snapshot([rec(0)])
        manifest.commit(rec(1))
    manifest.close()

    report = reload(tmp_path, **geometry)
    assert report.records == []
    old = {"page_size_bytes": PAGE_SIZE, "num_pages": NUM_PAGES}[field]
    assert f"{field} changed from {old} to {geometry[field]}" in report.discarded
    other = ({"page_size_bytes", "num_pages"} - {field}).pop()
    assert other not in report.discarded
    assert reload(tmp_path, **geometry) == LoadReport([], 0, "")  # started fresh, new geometry


# --- snapshots -------------------------------------------------------------------------------


def test_snapshot_then_more_appends_then_reload(tmp_path: Path) -> None:
    manifest, _ = open_manifest(tmp_path)
    for i in range(6):
        manifest.commit(rec(i))
    manifest.free("ns", key_of(2))
    assert manifest.journal_records == 7
    live = [rec(0), rec(1), rec(3), rec(4), rec(5)]
    manifest.snapshot(live)
    assert manifest.journal_records == 0
    assert (tmp_path / JOURNAL_NAME).stat().st_size == HEADER_BYTES
    manifest.free("ns", key_of(0))
    manifest.commit(rec(6))
    manifest.commit(rec(1, pages=(PageRun(900, 1),)))
    assert manifest.journal_records == 3
    manifest.close()

    report = reload(tmp_path)
    assert report == LoadReport(
        records=[rec(3), rec(4), rec(5), rec(6), rec(1, pages=(PageRun(900, 1),))],
        torn_bytes=0,
        discarded="",
    )
    assert not (tmp_path / (SNAPSHOT_NAME + ".tmp")).exists()


def test_crash_between_snapshot_rename_and_journal_reset(tmp_path: Path) -> None:
    manifest, _ = open_manifest(tmp_path)
    for i in range(4):
        manifest.commit(rec(i))
    manifest.free("ns", key_of(0))
    old_journal = (tmp_path / JOURNAL_NAME).read_bytes()
    manifest.snapshot([rec(1), rec(2), rec(3)])
    manifest.close()
    (tmp_path / JOURNAL_NAME).write_bytes(old_journal)  # as if the reset never happened

    manifest, report = open_manifest(tmp_path)
    assert report == LoadReport(records=[rec(1), rec(2), rec(3)], torn_bytes=0, discarded="")
    assert manifest.journal_records == 0
    manifest.commit(rec(4))  # the skipped journal was reset to the snapshot's generation
    manifest.close()
    assert reload(tmp_path).records == [rec(1), rec(2), rec(3), rec(4)]


# --- page validation on load -----------------------------------------------------------------


def test_overlapping_pages_later_commit_wins(tmp_path: Path) -> None:
    a = rec(0, pages=(PageRun(10, 4),))
    b = rec(1, pages=(PageRun(20, 2), PageRun(30, 2)))
    c = rec(2, pages=(PageRun(40, 1),))
    f = rec(5, pages=(PageRun(50, 2),))
    d = rec(3, pages=(PageRun(12, 1), PageRun(31, 5)))  # starts inside a and inside b
    g = rec(6, pages=(PageRun(48, 3),))  # starts before f and covers its first page
    e = rec(4, pages=(PageRun(10, 2), PageRun(20, 2)))  # fits where a and b were
    write_records(tmp_path, [a, b, c, f, d, g, e])
    assert reload(tmp_path).records == [c, d, g, e]


def test_overlap_with_a_snapshot_record_drops_it(tmp_path: Path) -> None:
    manifest, _ = open_manifest(tmp_path)
    manifest.snapshot([rec(0), rec(1)])  # pages 0-1 and 4-5
    manifest.commit(rec(7, pages=(PageRun(5, 1),)))
    manifest.close()
    assert reload(tmp_path).records == [rec(0), rec(7, pages=(PageRun(5, 1),))]


def test_out_of_range_pages_are_dropped_on_load(tmp_path: Path) -> None:
    """commit() refuses such records, so they are written raw, as a bug or bit rot would."""
    write_records(tmp_path, [rec(0), rec(1)])
    beyond = rec(2, pages=(PageRun(NUM_PAGES - 1, 2),))
    replaced = rec(1, pages=(PageRun(NUM_PAGES, 1),))  # a bad new version still ends the old
    with open(tmp_path / JOURNAL_NAME, "ab") as f:
        f.write(raw_commit(beyond) + raw_commit(replaced) + raw_commit(rec(3)))
    assert reload(tmp_path) == LoadReport(records=[rec(0), rec(3)], torn_bytes=0, discarded="")


# --- hypothesis: random operations against a dict model -------------------------------------

NAMESPACES = ("a", "b")
NUM_KEYS = 5
# (operation, namespace index, key index, pages, checksum); only commit uses all of them
OPS = st.tuples(
    st.sampled_from(["commit", "commit", "free", "snapshot", "reopen"]),
    st.integers(0, len(NAMESPACES) - 1),
    st.integers(0, NUM_KEYS - 1),
    st.integers(1, 4),
    st.integers(0, 2**64 - 1),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(OPS, max_size=40))
def test_random_operations_match_a_dict_model(ops: list[tuple[str, int, int, int, int]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "l3"
        manifest, _ = open_manifest(directory)
        model: dict[tuple[str, bytes], ManifestRecord] = {}
        journal_records = 0
        for op, ns, k, num_pages, checksum in ops:
            ident = (NAMESPACES[ns], key_of(k))
            if op == "commit":
                slot = PageRun((ns * NUM_KEYS + k) * 4, num_pages)  # own slot: never overlaps
                record = ManifestRecord(*ident, num_pages * PAGE_SIZE, checksum, None, (slot,))
                manifest.commit(record)
                model.pop(ident, None)
                model[ident] = record
                journal_records += 1
            elif op == "free":
                manifest.free(*ident)
                model.pop(ident, None)
                journal_records += 1
            elif op == "snapshot":
                manifest.snapshot(model.values())
                journal_records = 0
            else:
                manifest.close()
                manifest, report = open_manifest(directory)
                assert report == LoadReport(list(model.values()), 0, "")
            assert manifest.journal_records == journal_records
        manifest.close()
        assert reload(directory) == LoadReport(list(model.values()), 0, "")


def runs_of(pages: set[int]) -> tuple[PageRun, ...]:
    """A set of pages as maximal runs, in page order."""
    runs: list[PageRun] = []
    for page in sorted(pages):
        if runs and runs[-1].start + runs[-1].length == page:
            runs[-1] = PageRun(runs[-1].start, runs[-1].length + 1)
        else:
            runs.append(PageRun(page, 1))
    return tuple(runs)


def overlap(a: tuple[PageRun, ...], b: tuple[PageRun, ...]) -> bool:
    return any(s < t + m and t < s + n for s, n in a for t, m in b)


OVERLAP_OPS = st.tuples(
    st.sampled_from(["commit", "commit", "commit", "free", "snapshot", "reopen"]),
    st.integers(0, 3),
    st.sets(st.integers(0, 15), min_size=1, max_size=5),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(OVERLAP_OPS, max_size=30))
def test_overlaps_resolve_as_a_naive_replay_would(ops: list[tuple[str, int, set[int]]]) -> None:
    """In 16 pages commits overlap often; each must drop the live records it overwrote, in
    the journal and across snapshots and reopens, exactly like a replay that checks them all."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "l3"
        manifest, _ = open_manifest(directory, num_pages=16)
        model: dict[bytes, ManifestRecord] = {}
        for op, k, pages in ops:
            if op == "commit":
                record = rec(k, pages=runs_of(pages))
                manifest.commit(record)
                model.pop(record.key, None)
                for other in [o for o, r in model.items() if overlap(r.pages, record.pages)]:
                    del model[other]
                model[record.key] = record
            elif op == "free":
                manifest.free("ns", key_of(k))
                model.pop(key_of(k), None)
            elif op == "snapshot":
                manifest.snapshot(model.values())
            else:
                manifest.close()
                manifest, report = open_manifest(directory, num_pages=16)
                assert report.records == list(model.values())
        manifest.close()
        assert reload(directory, num_pages=16).records == list(model.values())


# --- real crashes: SIGKILL mid-append, and a disk that fills mid-record ----------------------

CHILD_APPENDS = """
import sys
from pathlib import Path
from kvstore.daemon.manifest import Manifest
from tests.unit.test_manifest import KILL_NUM_PAGES, counter_record

manifest = Manifest(Path(sys.argv[1]), 4096, KILL_NUM_PAGES)
manifest.load()
for i in range(2**20):
    manifest.commit(counter_record(i))
    if i % 3 == 2:
        freed = counter_record(i - 1)
        manifest.free(freed.namespace, freed.key)
"""


def child_live_set(last: int, freed_after_last: bool) -> list[ManifestRecord]:
    """What the child's manifest holds after committing 0..last (and the free that follows
    commit `last`, when there is one and it happened)."""
    live: dict[int, ManifestRecord] = {}
    for i in range(last + 1):
        live[i] = counter_record(i)
        if i % 3 == 2 and (i < last or freed_after_last):
            del live[i - 1]
    return list(live.values())


def run_child(script: str, directory: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", script, str(directory)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_sigkill_mid_append_loses_nothing_but_the_tail(tmp_path: Path) -> None:
    directory = tmp_path / "l3"
    child = run_child(CHILD_APPENDS, directory)
    journal = directory / JOURNAL_NAME
    deadline = time.monotonic() + 60
    while not (journal.exists() and journal.stat().st_size > 256 * 1024):
        assert child.poll() is None, child.communicate()[1].decode()
        assert time.monotonic() < deadline, "the child never wrote 256 KiB of journal"
        time.sleep(0.01)
    time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    _, stderr = child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL, stderr.decode()
    assert stderr == b""

    manifest, report = open_manifest(directory, num_pages=KILL_NUM_PAGES)
    assert report.discarded == ""
    assert report.records, "the child wrote at least 256 KiB before it was killed"
    last = max(record.size_bytes for record in report.records)
    candidates = [child_live_set(last, False), child_live_set(last, True)]
    assert report.records in candidates  # exactly the state after some prefix of its appends
    manifest.commit(counter_record(last + 1))
    manifest.close()
    assert reload(directory, num_pages=KILL_NUM_PAGES).records[-1] == counter_record(last + 1)


CHILD_FILLS_DISK = """
import os, resource, signal, sys
from pathlib import Path
from kvstore.daemon.manifest import Manifest
from tests.unit.test_manifest import KILL_NUM_PAGES, counter_record

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # exceeding RLIMIT_FSIZE then fails with EFBIG
directory = Path(sys.argv[1])
manifest = Manifest(directory, 4096, KILL_NUM_PAGES)
manifest.load()
limit = (directory / "manifest.journal").stat().st_size + 1000  # a few records, then mid-record
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
for i in range(100):
    try:
        manifest.commit(counter_record(i))
    except OSError as exc:
        print(exc.errno, i, (directory / "manifest.journal").stat().st_size)
        break
"""


def test_a_full_disk_raises_and_leaves_no_partial_record(tmp_path: Path) -> None:
    directory = tmp_path / "l3"
    child = run_child(CHILD_FILLS_DISK, directory)
    stdout, stderr = child.communicate(timeout=60)
    assert child.returncode == 0, stderr.decode()
    error, failed_at, size_bytes = (int(x) for x in stdout.split())
    assert error == errno.EFBIG
    assert 0 < failed_at < 100
    sizes = write_records(tmp_path / "reference", [counter_record(i) for i in range(failed_at)])
    assert size_bytes == sizes[-1]  # the partial record was cut off again

    report = reload(directory, num_pages=KILL_NUM_PAGES)
    assert report == LoadReport([counter_record(i) for i in range(failed_at)], 0, "")
