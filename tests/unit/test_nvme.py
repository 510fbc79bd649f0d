"""The L3 NVMe tier's own behaviour (tiers/nvme.py): how an object's bytes are laid onto page
runs, the file it keeps (layout, mode, reuse, resize, preallocation, its sparse fallback, and
no partial file after a failed preallocation),
short reads as per-transfer errors, and the backend choice. The byte-moving contract shared
with the other tiers is tests/integration/test_tier_contract.py."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest

from kvstore.extents import PageRun
from kvstore.tiers import nvme
from kvstore.tiers.base import Transfer
from kvstore.tiers.nvme import NvmeTier, split_iovecs

PAGE = 8192
REPO = Path(__file__).resolve().parents[2]


def _layout(segments: list[nvme.Segment]) -> list[tuple[int, list[bytes]]]:
    return [(offset, [bytes(b) for b in iov]) for offset, iov in segments]


# --- split_iovecs: the object's byte stream laid onto its page runs -------------------------


def test_one_buffer_on_one_run_is_one_segment() -> None:
    data = memoryview(bytes(range(100)))
    assert _layout(split_iovecs((PageRun(3, 1),), 4096, [data], 100)) == [(3 * 4096, [bytes(data)])]


def test_runs_split_the_stream_at_page_boundaries_in_run_order() -> None:
    # pages ((5, 1), (2, 2)) of 4 bytes: stream bytes 0-3 go to offset 20, 4-11 to offset 8.
    data = memoryview(b"abcdefghijkl")
    segments = split_iovecs((PageRun(5, 1), PageRun(2, 2)), 4, [data], 12)
    assert _layout(segments) == [(20, [b"abcd"]), (8, [b"efghijkl"])]


def test_buffer_edges_and_run_edges_interleave() -> None:
    bufs = [memoryview(b"ab"), memoryview(b""), memoryview(b"cdefg"), memoryview(b"hij")]
    segments = split_iovecs((PageRun(0, 1), PageRun(7, 2)), 4, bufs, 10)
    assert _layout(segments) == [(0, [b"ab", b"cd"]), (28, [b"efg", b"hij"])]


def test_only_size_bytes_are_laid_out_and_unused_runs_are_dropped() -> None:
    bufs = [memoryview(b"abcdef"), memoryview(b"ghij")]
    segments = split_iovecs((PageRun(1, 1), PageRun(9, 1), PageRun(4, 3)), 4, bufs, 5)
    assert _layout(segments) == [(4, [b"abcd"]), (36, [b"e"])]


def test_segments_are_views_not_copies() -> None:
    target = bytearray(8)
    segments = split_iovecs((PageRun(0, 1), PageRun(3, 1)), 4, [memoryview(target)], 8)
    segments[1][1][0][:] = b"WXYZ"
    assert target == b"\0\0\0\0WXYZ"


def test_wide_items_are_split_in_bytes() -> None:
    words = np.arange(4, dtype=np.uint32)  # 16 bytes, itemsize 4
    segments = split_iovecs((PageRun(4, 1), PageRun(0, 2)), 6, [memoryview(words)], 16)
    assert _layout(segments) == [(24, [words.tobytes()[:6]]), (0, [words.tobytes()[6:]])]
    segments = split_iovecs((PageRun(0, 3),), 6, [memoryview(words)], 16)
    assert _layout(segments) == [(0, [words.tobytes()])]


def test_short_buffers_or_pages_are_misuse() -> None:
    with pytest.raises(ValueError, match="buffers"):
        split_iovecs((PageRun(0, 4),), 4, [memoryview(b"abc"), memoryview(b"de")], 6)
    with pytest.raises(ValueError, match="pages"):
        split_iovecs((PageRun(0, 1), PageRun(2, 1)), 4, [memoryview(bytes(9))], 9)


# --- the file -----------------------------------------------------------------------------


def test_the_file_is_created_private_preallocated_and_laid_out_by_page(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "dir" / "l3.bin"
    tier = NvmeTier(path, 16 * PAGE + 100, PAGE, backend="posix")
    try:
        assert (tier.num_pages, tier.capacity_bytes) == (16, 16 * PAGE)
        st = os.stat(path)
        assert st.st_mode & 0o777 == 0o600 and st.st_size == 16 * PAGE
        assert not tier.sparse and st.st_blocks * 512 >= 16 * PAGE
        data = np.random.default_rng(0).integers(0, 256, 2 * PAGE + 10, dtype=np.uint8)
        pages = (PageRun(5, 1), PageRun(2, 2))
        assert tier.write([Transfer(pages, data.size, [memoryview(data)])]) == [None]
    finally:
        tier.close()
    raw = path.read_bytes()
    assert raw[5 * PAGE : 6 * PAGE] == data[:PAGE].tobytes()
    assert raw[2 * PAGE : 3 * PAGE + 10] == data[PAGE:].tobytes()


def test_reopening_an_existing_file_keeps_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "l3.bin"
    data = np.random.default_rng(1).integers(0, 256, 3 * PAGE, dtype=np.uint8)
    pages = (PageRun(7, 3),)
    first = NvmeTier(path, 16 * PAGE, PAGE, backend="posix")
    assert first.write([Transfer(pages, data.size, [memoryview(data)])]) == [None]
    first.close()
    inode = os.stat(path).st_ino
    again = NvmeTier(path, 16 * PAGE, PAGE, backend="posix")
    try:
        out = np.zeros_like(data)
        assert again.read([Transfer(pages, data.size, [memoryview(out)])]) == [None]
        assert np.array_equal(out, data) and os.stat(path).st_ino == inode
    finally:
        again.close()


def test_a_file_of_the_wrong_size_is_resized(tmp_path: Path) -> None:
    path = tmp_path / "l3.bin"
    path.write_bytes(b"x" * 12_345)
    NvmeTier(path, 4 * PAGE, PAGE, backend="posix").close()
    assert path.stat().st_size == 4 * PAGE


def test_failed_preallocation_leaves_a_sparse_file_and_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(nvme.os, "posix_fallocate", refuse)
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.nvme"):
        tier = NvmeTier(tmp_path / "l3.bin", 4 * PAGE, PAGE, backend="posix")
    try:
        assert tier.sparse and "sparse" in caplog.text
        data = memoryview(b"still works" * 100)
        assert tier.write([Transfer((PageRun(1, 1),), len(data), [data])]) == [None]
    finally:
        tier.close()


# Run inside a private mount namespace: a 1 MiB tmpfs under an 8 MiB L3 file.
_TINY_TMPFS_SCRIPT = textwrap.dedent("""
    import errno, json, logging, os, subprocess, sys
    from pathlib import Path
    from kvstore.extents import PageRun
    from kvstore.tiers import nvme
    from kvstore.tiers.base import Transfer
    from kvstore.tiers.nvme import NvmeTier

    mnt = Path(sys.argv[1])
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")

    def free():
        st = os.statvfs(mnt)
        return st.f_bavail * st.f_frsize

    def open_tier(name):
        try:
            NvmeTier(mnt / name, 8 << 20, 64 << 10, backend="posix").close()
        except OSError as exc:
            return exc.errno
        return None

    report, empty = {}, free()
    # A new file that cannot be preallocated is removed again.
    report["new"] = [open_tier("new.bin"), (mnt / "new.bin").exists(), free() == empty]
    # An existing one is cut back to its old size, its bytes as they were.
    old = bytes(range(256)) * 256
    (mnt / "old.bin").write_bytes(old)
    held = free()
    report["grown"] = [open_tier("old.bin"), (mnt / "old.bin").read_bytes() == old,
                       free() == held]
    (mnt / "old.bin").unlink()
    # tmpfs preallocates; a filesystem that cannot at all (EOPNOTSUPP) keeps the file sparse,
    # and then a write that finds no room fails alone. Transfers of one batch run in parallel,
    # so the one that succeeds rewrites a page already written: it needs no new room whichever
    # of the two runs first.
    def cannot(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")
    nvme.os.posix_fallocate = cannot
    tier = NvmeTier(mnt / "l3.bin", 8 << 20, 64 << 10, backend="posix")
    small, big = bytes(range(256)) * 256, b"\\1" * (2 << 20)
    first = tier.write([Transfer((PageRun(0, 1),), len(small), [memoryview(bytes(len(small)))])])
    assert first == [None], first
    results = tier.write([
        Transfer((PageRun(0, 1),), len(small), [memoryview(small)]),
        Transfer((PageRun(64, 32),), len(big), [memoryview(big)]),
    ])
    out = bytearray(len(small))
    back = tier.read([Transfer((PageRun(0, 1),), len(out), [memoryview(out)])])
    report.update({"sparse": tier.sparse, "results": [r and r.errno for r in results],
                   "back": back == [None] and out == small, "io_errors": tier.io_errors})
    print(json.dumps(report))
    tier.close()
""")


def test_preallocation_fails_for_real_on_a_tiny_tmpfs_and_leaves_nothing_behind(
        tmp_path: Path) -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1) to mount a private tmpfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cmd = [unshare, "-m"] if os.geteuid() == 0 else [unshare, "-rm"]
    probe = subprocess.run([*cmd, "mount", "-t", "tmpfs", "tmpfs", str(mnt)], capture_output=True)
    if probe.returncode:
        pytest.skip(f"cannot mount a private tmpfs here: {probe.stderr.decode().strip()}")
    proc = subprocess.run(
        [*cmd, sys.executable, "-c", _TINY_TMPFS_SCRIPT, str(mnt)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    # [errno, file left, free space as before]
    assert report["new"] == [errno.ENOSPC, False, True]
    assert report["grown"] == [errno.ENOSPC, True, True]  # [errno, bytes kept, free as before]
    assert report["sparse"] and "WARNING" in proc.stderr and "sparse" in proc.stderr
    assert report["results"] == [None, errno.ENOSPC]  # the object that found no room fails alone
    assert report["back"] and report["io_errors"] == 1


# --- I/O errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("aligned", [False, True], ids=["buffered", "o-direct"])
def test_a_short_read_is_an_error_for_that_transfer_alone(tmp_path: Path, aligned: bool) -> None:
    path = tmp_path / "l3.bin"
    tier = NvmeTier(path, 16 * PAGE, PAGE, backend="posix")
    try:
        rng = np.random.default_rng(2)
        payloads = [rng.integers(0, 256, 2 * PAGE, dtype=np.uint8) for _ in range(3)]
        pages = [(PageRun(0, 2),), (PageRun(2, 2),), (PageRun(10, 2),)]
        writes = [
            Transfer(p, 2 * PAGE, [memoryview(d)]) for p, d in zip(pages, payloads, strict=True)
        ]
        assert tier.write(writes) == [None] * 3
        os.truncate(path, 3 * PAGE + 100)  # cuts the second object short, the third away
        outs = [_aligned(2 * PAGE) if aligned else np.zeros(2 * PAGE, np.uint8) for _ in pages]
        results = tier.read(
            [Transfer(p, 2 * PAGE, [memoryview(o)]) for p, o in zip(pages, outs, strict=True)]
        )
        assert results[0] is None and np.array_equal(outs[0], payloads[0])
        for error in results[1:]:
            assert isinstance(error, OSError) and error.errno == errno.EIO
            assert "short read" in str(error)
        assert (tier.reads, tier.io_errors, tier.queue_depth) == (1, 2, 0)
    finally:
        tier.close()


def _aligned(size_bytes: int) -> np.ndarray:
    raw = np.zeros(size_bytes + 4096, np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start : start + size_bytes]


# --- construction and backends ----------------------------------------------------------------


@pytest.mark.parametrize("page_size_bytes", [0, 1000, 4096 + 512, -4096])
def test_page_size_must_be_a_multiple_of_4096(tmp_path: Path, page_size_bytes: int) -> None:
    with pytest.raises(ValueError, match="page_size_bytes"):
        NvmeTier(tmp_path / "l3.bin", 1 << 20, page_size_bytes)
    assert not (tmp_path / "l3.bin").exists()


def test_bad_backend_or_capacity_or_threads_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nvme.backend"):
        NvmeTier(tmp_path / "l3.bin", 1 << 20, PAGE, backend="spdk")
    with pytest.raises(ValueError, match="capacity"):
        NvmeTier(tmp_path / "l3.bin", PAGE - 1, PAGE)
    with pytest.raises(ValueError, match="io_threads"):
        NvmeTier(tmp_path / "l3.bin", 1 << 20, PAGE, io_threads=0)


def test_kvikio_without_a_driver_says_to_use_posix(tmp_path: Path) -> None:
    if nvme._load_kvikio() is not None:
        pytest.skip("this host has kvikio and an NVIDIA driver")
    with pytest.raises(RuntimeError, match="nvme.backend=posix"):
        NvmeTier(tmp_path / "l3.bin", 1 << 20, PAGE, backend="kvikio")


def test_auto_picks_posix_without_a_driver(tmp_path: Path) -> None:
    if nvme._load_kvikio() is not None:
        pytest.skip("this host has kvikio and an NVIDIA driver")
    tier = NvmeTier(tmp_path / "l3.bin", 1 << 20, PAGE)
    tier.close()
    assert (tier.name, tier.backend) == ("nvme", "posix")


def test_o_direct_refused_falls_back_to_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def no_direct(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(nvme.os, "open", no_direct)
    tier = NvmeTier(tmp_path / "l3.bin", 1 << 20, PAGE, backend="posix")
    try:
        assert not tier.direct
        data = _aligned(PAGE)
        data[:] = 7
        assert tier.write([Transfer((PageRun(3, 1),), PAGE, [memoryview(data)])]) == [None]
        assert tier.bytes_written == PAGE
    finally:
        tier.close()


def test_close_is_idempotent_and_a_closed_tier_refuses_work(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path / "l3.bin", 1 << 20, PAGE, backend="posix")
    tier.close()
    tier.close()
    with pytest.raises(ValueError, match="closed"):
        tier.read([Transfer((PageRun(0, 1),), 1, [memoryview(bytearray(1))])])


# --- the kvikio backend's plumbing, against a stand-in CuFile (the real one needs a GPU) ----


class _FakeFuture:
    def __init__(self, done: int | Exception) -> None:
        self._done = done

    def get(self) -> int:
        if isinstance(self._done, Exception):
            raise self._done
        return self._done


class _FakeCuFile:
    """kvikio.CuFile's host-buffer surface: pread/pwrite(buf, size, file_offset) -> future."""

    fail_reads = False

    def __init__(self, path: Path, flags: str) -> None:
        assert flags == "r+"
        self._fd = os.open(path, os.O_RDWR)

    def pread(self, buf: np.ndarray, size: int, file_offset: int) -> _FakeFuture:
        if self.fail_reads:
            return _FakeFuture(RuntimeError("cuFile error: input/output error"))
        return _FakeFuture(os.preadv(self._fd, [memoryview(buf)[:size]], file_offset))

    def pwrite(self, buf: np.ndarray, size: int, file_offset: int) -> _FakeFuture:
        return _FakeFuture(os.pwritev(self._fd, [memoryview(buf)[:size]], file_offset))

    def close(self) -> None:
        os.close(self._fd)


@pytest.fixture
def fake_kvikio(monkeypatch: pytest.MonkeyPatch) -> type[_FakeCuFile]:
    module = types.ModuleType("kvikio")  # no cufile_driver: GDS reads as unavailable
    module.CuFile = _FakeCuFile  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvikio", module)
    monkeypatch.setattr(nvme, "_load_kvikio", lambda: module)
    return _FakeCuFile


def test_kvikio_backend_lays_bytes_out_like_posix(
    tmp_path: Path, fake_kvikio: type[_FakeCuFile]
) -> None:
    path = tmp_path / "l3.bin"
    tier = NvmeTier(path, 16 * PAGE, PAGE, backend="kvikio")
    try:
        assert (tier.backend, tier.direct) == ("kvikio-compat", False)
        data = np.random.default_rng(4).integers(0, 256, 2 * PAGE + 3, dtype=np.uint8)
        pages = (PageRun(9, 1), PageRun(1, 2))
        bufs = [memoryview(data[:100]), memoryview(data[100:])]
        assert tier.write([Transfer(pages, data.size, bufs)]) == [None]
        raw = path.read_bytes()
        assert raw[9 * PAGE : 10 * PAGE] + raw[PAGE : 2 * PAGE + 3] == data.tobytes()
        out = np.zeros_like(data)
        assert tier.read([Transfer(pages, data.size, [memoryview(out)])]) == [None]
        assert np.array_equal(out, data)
        os.truncate(path, PAGE + 10)
        (error,) = tier.read([Transfer(pages, data.size, [memoryview(out)])])
        assert isinstance(error, OSError) and "short read" in str(error)
        fake_kvikio.fail_reads = True
        (error,) = tier.read([Transfer(pages, data.size, [memoryview(out)])])
        assert isinstance(error, OSError) and error.errno == errno.EIO
        assert (tier.writes, tier.reads, tier.io_errors) == (1, 1, 2)
    finally:
        fake_kvikio.fail_reads = False
        tier.close()
