"""L1 HBM tier (kvstore.tiers.hbm).

Everywhere: a missing GPU is a clear HbmUnavailable naming hbm.mode, bad sizing is a
ValueError, and `split_transfer` (how an object's bytes map onto page runs and host buffers)
is checked exactly and against a byte-level model with hypothesis.
On a GPU (marked `gpu`, skipped without CUDA): the tier contract, bit-exact, for odd sizes,
single- and multi-run page lists, a 64-transfer batch, scattered buffers, buffers in a pinned
L2 segment, fraction sizing, device views, CUDA-failure results and close.
"""

from __future__ import annotations

import errno
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.extents import PageRun
from kvstore.tiers.base import Transfer
from kvstore.tiers.hbm import HbmTier, HbmUnavailable, Piece, cuda_available, split_transfer
from tests.conftest import _cuda_available as conftest_sees_gpu

PAGE = 64 << 10
GPU_PRESENT = Path("/dev/nvidia0").exists() or conftest_sees_gpu()
needs_torch_cuda = pytest.mark.skipif(not cuda_available(), reason="torch has no CUDA here")


# --- without a GPU ---------------------------------------------------------------------------


@pytest.mark.skipif(GPU_PRESENT, reason="a GPU is present")
def test_no_gpu_here_means_hbm_unavailable_naming_the_setting() -> None:
    assert cuda_available() is False
    with pytest.raises(HbmUnavailable, match=r"hbm\.mode=off or auto") as info:
        HbmTier(64 << 20, 0.0, PAGE)
    assert "CUDA" in str(info.value)


def test_no_visible_device_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # as if a CUDA build without a device
    assert cuda_available() is False
    with pytest.raises(HbmUnavailable, match=r"no CUDA device is visible.*hbm\.mode=off"):
        HbmTier(64 << 20, 0.0, PAGE)


def test_missing_torch_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    assert cuda_available() is False
    with pytest.raises(HbmUnavailable, match=r"torch is not installed.*hbm\.mode=off"):
        HbmTier(64 << 20, 0.0, PAGE)


@pytest.mark.parametrize(
    ("capacity_bytes", "fraction", "page_size_bytes", "message"),
    [
        (64 << 20, 0.0, 0, "page_size_bytes"),
        (-1, 0.5, PAGE, "capacity_bytes"),
        (0, 0.0, PAGE, "fraction"),
        (0, 0.95, PAGE, "fraction"),
    ],
)
def test_bad_sizing_is_a_value_error_before_any_cuda_call(
    capacity_bytes: int, fraction: float, page_size_bytes: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        HbmTier(capacity_bytes, fraction, page_size_bytes)


# --- split_transfer: pure --------------------------------------------------------------------


def test_split_one_run_one_buffer_is_one_piece() -> None:
    assert split_transfer([PageRun(3, 2)], 5000, [8192], 4096) == [Piece(3 * 4096, 0, 0, 5000)]


def test_split_cuts_where_runs_and_buffers_end() -> None:
    # Object of 10,000 bytes on runs (5, 1) then (1, 2) of 4 KiB pages; host buffers of
    # 3,000, 0 and 9,000 bytes. Device stream: [20480, 24576) then [4096, 12288).
    pieces = split_transfer([PageRun(5, 1), PageRun(1, 2)], 10_000, [3000, 0, 9000], 4096)
    assert pieces == [
        Piece(20480, 0, 0, 3000),  # buffer 0 ends
        Piece(23480, 2, 0, 1096),  # run (5, 1) ends; the empty buffer 1 is skipped
        Piece(4096, 2, 1096, 5904),  # the object ends inside run (1, 2)
    ]


def test_split_of_nothing_is_nothing() -> None:
    assert split_transfer([], 0, [], 4096) == []
    assert split_transfer([PageRun(0, 1)], 0, [10], 4096) == []


def test_split_rejects_short_pages_and_short_buffers() -> None:
    with pytest.raises(ValueError, match="pages hold 4096 bytes"):
        split_transfer([PageRun(0, 1)], 4097, [8192], 4096)
    with pytest.raises(ValueError, match="buffers hold 100 bytes"):
        split_transfer([PageRun(0, 1)], 101, [60, 40], 4096)
    with pytest.raises(ValueError, match="size_bytes"):
        split_transfer([PageRun(0, 1)], -1, [1], 4096)


def test_split_moves_exactly_the_object_bytes_in_order() -> None:
    # Imported here: the lent GPU machine may lack hypothesis, and the GPU tests of this
    # module must still collect there.
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @st.composite
    def layouts(draw: Any) -> tuple[list[PageRun], int, list[int], int]:
        page_size = draw(st.sampled_from([1, 7, 16]))
        num_pages = draw(st.integers(0, 12))
        order = draw(st.permutations(range(12)))[:num_pages]  # distinct pages, any order
        runs: list[PageRun] = []
        for page in order:  # neighbours in stream order merge into runs, as an allocator's
            if runs and runs[-1].start + runs[-1].length == page:
                runs[-1] = PageRun(runs[-1].start, runs[-1].length + 1)
            else:
                runs.append(PageRun(page, 1))
        size = draw(st.integers(0, num_pages * page_size))
        buffers = draw(st.lists(st.integers(0, 3 * page_size), max_size=6))
        buffers.append(max(0, size - sum(buffers)) + draw(st.integers(0, 5)))
        return runs, size, buffers, page_size

    @hypothesis.given(layouts())
    def check(layout: tuple[list[PageRun], int, list[int], int]) -> None:
        runs, size, buffer_lengths, page_size = layout
        # Model: the object's byte i lives at device_offsets[i] and at host position i of
        # the concatenated buffers.
        device_offsets = [s * page_size + k for s, n in runs for k in range(n * page_size)]
        buffer_starts = np.cumsum([0, *buffer_lengths]).tolist()
        moved: list[tuple[int, int]] = []  # (device offset, host position) per byte
        for piece in split_transfer(runs, size, buffer_lengths, page_size):
            assert piece.length > 0
            assert piece.buffer_offset + piece.length <= buffer_lengths[piece.buffer_index]
            for k in range(piece.length):
                host = buffer_starts[piece.buffer_index] + piece.buffer_offset + k
                moved.append((piece.device_offset + k, host))
        assert moved == [(device_offsets[i], i) for i in range(size)]

    check()


# --- on a GPU --------------------------------------------------------------------------------


def _random(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


@pytest.fixture
def tier() -> Iterator[HbmTier]:
    hbm = HbmTier(64 << 20, 0.0, PAGE)  # 1,024 pages
    yield hbm
    hbm.close()


def _round_trip(hbm: HbmTier, transfers: list[tuple[tuple[PageRun, ...], np.ndarray]]) -> None:
    """Write each payload to its pages, read it back into fresh buffers, compare bytes."""
    batch = [Transfer(pages, len(data), [memoryview(data)]) for pages, data in transfers]
    assert hbm.write(batch) == [None] * len(batch)
    outs = [np.zeros(len(data), dtype=np.uint8) for _, data in transfers]
    back = [Transfer(pages, len(data), [memoryview(out)])
            for (pages, data), out in zip(transfers, outs, strict=True)]
    assert hbm.read(back) == [None] * len(back)
    for (_, data), out in zip(transfers, outs, strict=True):
        assert np.array_equal(out, data)


SIZES = [1, 4095, 4096, PAGE, 3 * PAGE + 17]
LAYOUTS = {
    "one-run": lambda n: (PageRun(10, n),),
    "multi-run": lambda n: tuple(PageRun(500 - 7 * i, 1) for i in range(n)),
}


@pytest.mark.gpu
@needs_torch_cuda
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("size", SIZES)
def test_round_trip_is_bit_exact(tier: HbmTier, size: int, layout: str) -> None:
    num_pages = -(-size // PAGE)
    pages = LAYOUTS[layout](num_pages)
    data = _random(size, size)
    _round_trip(tier, [(pages, data)])
    on_device = b"".join(v.cpu().numpy().tobytes() for v in tier.device_view(pages, size))
    assert on_device == data.tobytes()
    assert (tier.writes, tier.bytes_written, tier.reads, tier.bytes_read) == (1, size, 1, size)


@pytest.mark.gpu
@needs_torch_cuda
def test_a_batch_of_64_transfers(tier: HbmTier) -> None:
    transfers = []
    for i in range(64):
        size = 1 + i * 9001
        num_pages = -(-size // PAGE)
        pages = tuple(PageRun(1023 - 16 * i - k, 1) for k in range(num_pages))  # reversed
        transfers.append((pages, _random(size, i)))
    _round_trip(tier, transfers)
    assert tier.writes == tier.reads == 64
    assert tier.bytes_written == tier.bytes_read == sum(len(d) for _, d in transfers)


@pytest.mark.gpu
@needs_torch_cuda
def test_scattered_buffers_both_ways(tier: HbmTier) -> None:
    size = 5 * PAGE + 333
    data = _random(size, 7)
    pages = (PageRun(40, 2), PageRun(3, 1), PageRun(100, 3))
    cuts = [0, 1, 4097, 2 * PAGE + 5, size]
    sources = [memoryview(data[a:b].tobytes()) for a, b in zip(cuts, cuts[1:], strict=False)]
    assert tier.write([Transfer(pages, size, sources)]) == [None]
    # Targets of other uneven sizes, one of them longer than the rest of the object.
    targets = [bytearray(100), bytearray(PAGE), bytearray(3 * PAGE), bytearray(2 * PAGE)]
    assert tier.read([Transfer(pages, size, [memoryview(t) for t in targets])]) == [None]
    assert b"".join(targets)[:size] == data.tobytes()
    assert not any(b"".join(targets)[size:])  # nothing past the object was written


@pytest.mark.gpu
@needs_torch_cuda
def test_buffers_in_a_pinned_l2_segment() -> None:
    pytest.importorskip("cupy", reason="pinning the L2 segment takes cupy")
    import torch

    from kvstore.tiers.dram import DramTier

    l2 = DramTier(16 << 20, PAGE, f"kvstore-hbmtest-{secrets.token_hex(4)}", pin_memory=True)
    hbm = HbmTier(16 << 20, 0.0, PAGE)
    sources: list[memoryview] = []  # views into the segment: released before it closes
    try:
        assert l2.pinned, "cupy could not register the L2 segment as pinned memory"
        size = 6 * PAGE + 4321
        data = _random(size, 11)
        # The object on L2 pages 200-202 then 17-20, as views of the segment itself.
        segment = l2._buf
        cuts = [(200 * PAGE, 3 * PAGE), (17 * PAGE, size - 3 * PAGE)]
        sources.extend(segment.data[at : at + n] for at, n in cuts)
        segment[200 * PAGE : 203 * PAGE] = data[: 3 * PAGE]
        segment[17 * PAGE : 17 * PAGE + size - 3 * PAGE] = data[3 * PAGE :]
        assert torch.frombuffer(sources[0], dtype=torch.uint8).is_pinned()
        hbm_pages = (PageRun(30, 5), PageRun(2, 2))
        assert hbm.write([Transfer(hbm_pages, size, sources)]) == [None]
        for view in sources:
            view[:] = b"\0" * len(view)
        assert hbm.read([Transfer(hbm_pages, size, sources)]) == [None]
        assert b"".join(bytes(v) for v in sources) == data.tobytes()
    finally:
        sources.clear()
        hbm.close()
        l2.close()


@pytest.mark.gpu
@needs_torch_cuda
def test_sized_by_a_fraction_of_free_hbm() -> None:
    import torch

    free_bytes, _ = torch.cuda.mem_get_info(0)
    page = 1 << 20
    hbm = HbmTier(0, 0.05, page)
    try:
        assert hbm.capacity_bytes == hbm.num_pages * page
        assert hbm.capacity_bytes % page == 0
        wanted = free_bytes * 0.05
        assert wanted - page - (256 << 20) < hbm.capacity_bytes <= wanted
        assert torch.cuda.mem_get_info(0)[0] <= free_bytes - hbm.capacity_bytes + (64 << 20)
    finally:
        hbm.close()


@pytest.mark.gpu
@needs_torch_cuda
def test_device_view_work_is_ordered_before_a_read(tier: HbmTier) -> None:
    pages = (PageRun(5, 1), PageRun(9, 1))
    _round_trip(tier, [(pages, _random(PAGE + 10, 3))])
    for view in tier.device_view(pages, PAGE + 10):
        view.fill_(0xAB)  # on the caller's current stream, not the tier's
    out = bytearray(PAGE + 10)
    assert tier.read([Transfer(pages, PAGE + 10, [memoryview(out)])]) == [None]
    assert out == b"\xab" * (PAGE + 10)


@pytest.mark.gpu
@needs_torch_cuda
def test_misuse_raises_before_moving_bytes(tier: HbmTier) -> None:
    good = Transfer((PageRun(0, 1),), 10, [memoryview(bytearray(10))])
    with pytest.raises(ValueError, match="outside"):
        tier.write([good, Transfer((PageRun(1023, 2),), 10, [memoryview(b"x" * 10)])])
    with pytest.raises(ValueError, match="read-only"):
        tier.read([Transfer((PageRun(0, 1),), 10, [memoryview(b"x" * 10)])])
    with pytest.raises(ValueError, match="buffers hold"):
        tier.write([Transfer((PageRun(0, 1),), 10, [memoryview(b"x" * 9)])])
    assert (tier.writes, tier.reads) == (0, 0)


@pytest.mark.gpu
@needs_torch_cuda
def test_a_cuda_failure_is_an_eio_result_per_transfer(
    tier: HbmTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    def failing_synchronize(self: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    data = [_random(100, i) for i in range(3)]
    batch = [Transfer((PageRun(i, 1),), 100, [memoryview(d)]) for i, d in enumerate(data)]
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", failing_synchronize)
    results = tier.write(batch)
    monkeypatch.undo()
    torch.cuda.synchronize()  # the copies were queued; let them land before `data` goes
    assert all(isinstance(r, OSError) and r.errno == errno.EIO for r in results)
    assert all("illegal memory access" in str(r) for r in results)
    assert (tier.writes, tier.bytes_written) == (0, 0)


@pytest.mark.gpu
@needs_torch_cuda
def test_close_is_idempotent_and_final() -> None:
    hbm = HbmTier(8 << 20, 0.0, PAGE)
    assert (hbm.name, hbm.backend, hbm.num_pages, hbm.capacity_bytes) == (
        "hbm", "cuda", 128, 8 << 20)
    hbm.close()
    hbm.close()
    with pytest.raises(ValueError, match="closed"):
        hbm.write([])
    with pytest.raises(ValueError, match="closed"):
        hbm.device_view([PageRun(0, 1)], 1)
