"""The slot-tier contract (tiers/base.py), run over every tier this machine has: L2 DRAM, L3
NVMe through POSIX on the real disk (O_DIRECT), on /dev/shm (tmpfs), with O_DIRECT refused
(the buffered fallback older tmpfs kernels force), and L1 HBM and L3 through kvikio where a
GPU is lent.

Each tier must give back exactly the bytes it was given, for any size and any page layout,
whatever shape the host buffers have, one result per transfer."""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.extents import PageRun
from kvstore.tiers import nvme
from kvstore.tiers.base import SlotTier, Transfer, padded_size
from kvstore.tiers.dram import DramTier
from kvstore.tiers.nvme import NvmeTier

PAGE = 16 << 10
CAPACITY = 1 << 20  # 64 pages
SIZES = [1, 4095, 4096, 4097, PAGE, PAGE + PAGE // 2, 3 * PAGE + 17]
MULTI_RUN = (PageRun(5, 1), PageRun(2, 2), PageRun(9, 2))  # out of order: offsets go back


def _pages_for(size_bytes: int, layout: str) -> tuple[PageRun, ...]:
    if layout == "multi-run":
        return MULTI_RUN
    return (PageRun(20, -(-size_bytes // PAGE)),)


def _refuse_o_direct(real_open: Callable[..., int]) -> Callable[..., int]:
    def fake_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    return fake_open


def _make_tier(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SlotTier:
    if kind == "dram":
        return DramTier(CAPACITY, PAGE, f"kvstore-test-{secrets.token_hex(4)}", pin_memory=False)
    if kind == "nvme-posix-disk":
        return NvmeTier(tmp_path / "l3" / "pages.bin", CAPACITY, PAGE, backend="posix")
    if kind == "nvme-posix-tmpfs":
        path = Path("/dev/shm") / f"kvs-test-l3-{secrets.token_hex(4)}.bin"
        return NvmeTier(path, CAPACITY, PAGE, backend="posix")
    if kind == "nvme-posix-buffered":
        with monkeypatch.context() as m:
            m.setattr(nvme.os, "open", _refuse_o_direct(os.open))
            tier = NvmeTier(tmp_path / "pages.bin", CAPACITY, PAGE, backend="posix")
        assert not tier.direct
        return tier
    if kind == "hbm":
        from kvstore.tiers.hbm import HbmTier, cuda_unavailable_reason

        reason = cuda_unavailable_reason()
        if reason is not None:
            pytest.skip(reason)
        return HbmTier(CAPACITY, 0.2, PAGE)
    assert kind == "nvme-kvikio"
    pytest.importorskip("kvikio")
    if nvme._load_kvikio() is None:
        pytest.skip("kvikio is installed but there is no NVIDIA driver with a GPU")
    return NvmeTier(tmp_path / "pages.bin", CAPACITY, PAGE, backend="kvikio")


NVME_KINDS = [
    "nvme-posix-disk",
    "nvme-posix-tmpfs",
    "nvme-posix-buffered",
    pytest.param("nvme-kvikio", marks=pytest.mark.gpu),
]


def _opened(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SlotTier]:
    t = _make_tier(kind, tmp_path, monkeypatch)
    try:
        yield t
    finally:
        t.close()
        if isinstance(t, NvmeTier) and str(t.path).startswith("/dev/shm/"):
            t.path.unlink()


@pytest.fixture(params=["dram", *NVME_KINDS, pytest.param("hbm", marks=pytest.mark.gpu)])
def tier(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[SlotTier]:
    yield from _opened(request.param, tmp_path, monkeypatch)


@pytest.fixture(params=NVME_KINDS)
def nvme_tier(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[SlotTier]:
    """The L3 tier alone, over each of its backends (the only tier with I/O counters)."""
    yield from _opened(request.param, tmp_path, monkeypatch)


def _random(size_bytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size_bytes, dtype=np.uint8)


def _aligned_empty(size_bytes: int) -> np.ndarray:
    """Zeroed host memory starting on a 4 KiB boundary, padded to whole 4 KiB blocks."""
    n = padded_size(size_bytes)
    raw = np.zeros(n + 4096, np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start : start + n]


def _host(size_bytes: int, kind: str) -> np.ndarray:
    """Empty host buffer: exact-size (unaligned) or 4 KiB-aligned and padded."""
    return _aligned_empty(size_bytes) if kind == "aligned" else np.zeros(size_bytes, np.uint8)


def _scatter(buf: np.ndarray, cuts: list[int]) -> list[memoryview]:
    """buf as several memoryviews, split at cuts (offsets past the end are dropped)."""
    edges = [0, *(c for c in cuts if 0 < c < len(buf)), len(buf)]
    return [memoryview(buf[a:b]) for a, b in zip(edges[:-1], edges[1:], strict=True)]


@pytest.mark.parametrize("layout", ["single-run", "multi-run"])
@pytest.mark.parametrize("size_bytes", SIZES)
@pytest.mark.parametrize("buffers", ["exact", "aligned"])
def test_write_then_read_is_bit_exact(
    tier: SlotTier, size_bytes: int, layout: str, buffers: str
) -> None:
    pages = _pages_for(size_bytes, layout)
    src = _host(size_bytes, buffers)
    src[:size_bytes] = _random(size_bytes)
    assert tier.write([Transfer(pages, size_bytes, [memoryview(src)])]) == [None]
    dst = _host(size_bytes, buffers)
    assert tier.read([Transfer(pages, size_bytes, [memoryview(dst)])]) == [None]
    assert np.array_equal(dst[:size_bytes], src[:size_bytes])


def test_a_batch_returns_one_none_per_transfer(tier: SlotTier) -> None:
    sizes = [1 + 2_999 * i for i in range(20)]  # up to ~57 KB: 1 to 4 pages each
    pages, next_page = [], 0
    for size_bytes in sizes:
        n = -(-size_bytes // PAGE)
        pages.append((PageRun(next_page, n),))
        next_page += n
    payloads = [_random(s, seed=i) for i, s in enumerate(sizes)]
    writes = [
        Transfer(p, s, [memoryview(d)]) for p, s, d in zip(pages, sizes, payloads, strict=True)
    ]
    assert tier.write(writes) == [None] * len(sizes)
    outs = [np.zeros(s, np.uint8) for s in sizes]
    reads = [Transfer(p, s, [memoryview(o)]) for p, s, o in zip(pages, sizes, outs, strict=True)]
    assert tier.read(reads) == [None] * len(sizes)
    for out, payload in zip(outs, payloads, strict=True):
        assert np.array_equal(out, payload)


@pytest.mark.parametrize("buffers", ["exact", "aligned"])
def test_scattered_buffers_on_both_sides(tier: SlotTier, buffers: str) -> None:
    size_bytes = 3 * PAGE + 17
    src = _host(size_bytes, buffers)
    src[:size_bytes] = _random(size_bytes, seed=7)
    dst = _host(size_bytes, buffers)
    # Unaligned cuts force the buffered path; 4 KiB cuts keep O_DIRECT eligible.
    cuts = [4096, 5 * 4096, 6 * 4096] if buffers == "aligned" else [1000, 20_001, 20_002, 40_000]
    assert tier.write([Transfer(MULTI_RUN, size_bytes, _scatter(src, [777, 33_333]))]) == [None]
    assert tier.read([Transfer(MULTI_RUN, size_bytes, _scatter(dst, cuts))]) == [None]
    assert np.array_equal(dst[:size_bytes], src[:size_bytes])


def test_reading_into_l2_pages_round_trips(tier: SlotTier) -> None:
    """The store's path: an object moves between the tier and its pages in the L2 segment."""
    size_bytes = 2 * PAGE + 5
    l2 = DramTier(CAPACITY, PAGE, f"kvstore-test-{secrets.token_hex(4)}", pin_memory=False)
    try:
        src_pages, dst_pages = (PageRun(0, 3),), (PageRun(10, 1), PageRun(4, 2))
        src = l2.buffers(src_pages, size_bytes)
        np.frombuffer(src[0], np.uint8)[:size_bytes] = _random(size_bytes, seed=3)
        assert tier.write([Transfer(MULTI_RUN, size_bytes, src)]) == [None]
        dst = l2.buffers(dst_pages, size_bytes)
        assert tier.read([Transfer(MULTI_RUN, size_bytes, dst)]) == [None]
        got = b"".join(bytes(v) for v in l2.buffers(dst_pages, size_bytes, pad=False))
        assert got == bytes(src[0][:size_bytes])
        del src, dst
    finally:
        l2.close()


def test_overwritten_pages_read_back_the_new_bytes(tier: SlotTier) -> None:
    size_bytes = 2 * PAGE + 123
    old, new = _random(size_bytes, seed=1), _random(size_bytes, seed=2)
    assert tier.write([Transfer(MULTI_RUN, size_bytes, [memoryview(old)])]) == [None]
    assert tier.write([Transfer(MULTI_RUN, size_bytes, [memoryview(new)])]) == [None]
    out = np.zeros(size_bytes, np.uint8)
    assert tier.read([Transfer(MULTI_RUN, size_bytes, [memoryview(out)])]) == [None]
    assert np.array_equal(out, new)


def test_misuse_raises_before_moving_anything(tier: SlotTier) -> None:
    data = memoryview(_random(PAGE + 1))
    with pytest.raises(ValueError):  # buffers shorter than size_bytes
        tier.write([Transfer((PageRun(0, 2),), PAGE + 2, [data])])
    with pytest.raises(ValueError):  # pages too small for the object
        tier.write([Transfer((PageRun(0, 1),), PAGE + 1, [data])])
    with pytest.raises(ValueError):  # pages past the end of the tier
        tier.write([Transfer((PageRun(tier.num_pages - 1, 2),), PAGE + 1, [data])])
    with pytest.raises(ValueError):  # a read into read-only memory
        tier.read([Transfer((PageRun(0, 2),), PAGE + 1, [memoryview(bytes(PAGE + 1))])])


def test_nvme_counters_move(nvme_tier: SlotTier) -> None:
    tier = nvme_tier
    assert isinstance(tier, NvmeTier)
    size_bytes = 4097
    aligned = _aligned_empty(size_bytes)
    exact = np.zeros(size_bytes, np.uint8)
    pages = (PageRun(1, 1),)
    assert tier.write([Transfer(pages, size_bytes, [memoryview(exact)])] * 2) == [None, None]
    assert tier.read([Transfer(pages, size_bytes, [memoryview(aligned)])]) == [None]
    assert (tier.writes, tier.reads, tier.io_errors, tier.queue_depth) == (2, 1, 0, 0)
    assert tier.bytes_written == 2 * size_bytes  # unaligned: exactly size_bytes each
    # Aligned and padded host memory goes O_DIRECT, which moves whole 4 KiB blocks.
    assert tier.bytes_read == (padded_size(size_bytes) if tier.direct else size_bytes)
