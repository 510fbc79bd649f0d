"""The native helper (kvstore/native): its hashes are python-xxhash's xxh3-64 for every kind of
block (empty, one byte, odd lengths, piece boundaries, several MiB, spans hashed as one
stream), its copies are exact wherever source and destination lie (the 4 KiB-aliased case
too), and its whole read through a read table (kvstore/readtable.py, written by the daemon's
TableWriter) copies what the table shows, rejects what fails its checksum, lies out of bounds
or does not fit, and misses what is absent or changing, as the numpy probe does. The client's
copies (client/_segment.py) give the same bytes and checksums with the helper on and off.

These tests need the library `make native` builds; without it they are skipped, named."""

from __future__ import annotations

import ctypes
import hashlib

import numpy as np
import pytest
import xxhash

from client._buffers import address, writable_array
from client._segment import SharedSegment
from kvstore import native
from kvstore.readtable import (
    HEADER_BYTES,
    SLOT_WORDS,
    W_VERSION,
    Record,
    TableView,
    TableWriter,
    capacity_for,
    namespace_hash,
    table_bytes,
)

pytestmark = pytest.mark.skipif(native.load() is None,
                                reason="the native helper is not built (`make native`)")

# Around xxh3's own boundaries (240 bytes: short inputs; 1 KiB: a block of stripes; 64: a
# stripe), the piece size, and several MiB.
SIZES = [0, 1, 7, 240, 241, 1023, 1024, 1025, 1088, 4095, native.PIECE_BYTES - 1,
         native.PIECE_BYTES, native.PIECE_BYTES + 1, 300_001, 3 * 2**20 + 5]
NS = namespace_hash("team-a/llama")


@pytest.fixture
def lib() -> ctypes.CDLL:
    loaded = native.load()
    assert loaded is not None
    return loaded


@pytest.mark.parametrize("skew", [0, 16, 2048])
def test_each_block_is_copied_exactly_and_hashed_as_xxhash_does(lib: ctypes.CDLL,
                                                                skew: int) -> None:
    rng = np.random.default_rng(skew)
    blocks = [rng.integers(0, 256, size, dtype=np.uint8) for size in SIZES]
    out = [np.zeros(size + skew + 1, np.uint8)[skew:skew + size] for size in SIZES]
    hashes = native.copy_hash(lib, [address(b) for b in blocks], [address(o) for o in out],
                              SIZES, None, True)
    assert hashes is not None
    assert hashes == [xxhash.xxh3_64_intdigest(b.tobytes()) for b in blocks]
    assert all(np.array_equal(o, b) for o, b in zip(out, blocks, strict=True))
    for o in out:
        o.fill(0)
    assert native.copy_hash(lib, [address(b) for b in blocks], [address(o) for o in out],
                            SIZES, None, False) is None
    assert all(np.array_equal(o, b) for o, b in zip(out, blocks, strict=True))


def test_spans_marked_more_are_hashed_as_one_stream(lib: ctypes.CDLL) -> None:
    rng = np.random.default_rng(1)
    source = rng.integers(0, 256, 400_000, dtype=np.uint8)
    dest = np.zeros(400_000, np.uint8)
    cuts = [0, 70_000, 70_001, 200_000, 400_000]  # block A: spans 0-2, block B: span 3
    lengths = [b - a for a, b in zip(cuts, cuts[1:], strict=False)]
    # Scattered: span i lands at the mirror place, so the stream is not one memcpy.
    at = [address(dest) + 400_000 - b for b in cuts[1:]]
    hashes = native.copy_hash(lib, [address(source) + a for a in cuts[:-1]], at, lengths,
                              b"\x01\x01\x00\x00", True)
    assert hashes is not None
    assert hashes == [0, 0, xxhash.xxh3_64_intdigest(source[:200_000].tobytes()),
                               xxhash.xxh3_64_intdigest(source[200_000:].tobytes())]
    assert np.array_equal(dest[:200_000], source[200_000:])


def keys(n: int, salt: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{salt}{i}".encode()).digest() for i in range(n)]


class Arena:
    """A read table over an arena of blocks, both in plain memory, as the daemon writes them."""

    def __init__(self, sizes: list[int], seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.arena = np.zeros(64 * 2**20, np.uint8)
        capacity = capacity_for(len(sizes) + 8)
        self.memory = np.zeros(table_bytes(capacity), np.uint8)
        self.writer = TableWriter(self.memory.data, capacity, self.arena.nbytes, rng)
        self.keys = keys(len(sizes), str(seed))
        self.blocks = []
        offset = 0
        for key, size in zip(self.keys, sizes, strict=True):
            block = rng.integers(0, 256, size, dtype=np.uint8)
            self.arena[offset:offset + size] = block
            self.writer.put((NS, key), Record(offset, size, 2,
                                              xxhash.xxh3_64_intdigest(block.tobytes())))
            self.blocks.append(block)
            offset += -(-max(size, 1) // 65536) * 65536
        self.view = TableView(self.memory.data)

    def read(self, lib: ctypes.CDLL, ks: list[bytes], out: list[np.ndarray],
             verify: bool = True) -> list[int]:
        n = len(ks)
        io = np.zeros((8, n), np.int64)
        io[0] = [address(o) for o in out]
        io[1] = [o.nbytes for o in out]
        at = io.ctypes.data
        args = native.TableArgs(self.view)
        copied = lib.kv_table_read(args.table, args.params, NS, b"".join(ks), n,
                                   address(self.arena), self.arena.nbytes, at, at + 8 * n,
                                   verify,
                                   *(at + 8 * n * row for row in range(2, 8)))
        got: list[int] = io[7].tolist()
        assert copied == sum(g >= 0 for g in got)
        return got


def test_a_read_through_the_table_copies_what_it_shows(lib: ctypes.CDLL) -> None:
    sizes = [1, 4096, 70_000, 2**20 + 3]
    arena = Arena(sizes)
    out = [np.zeros(s, np.uint8) for s in sizes]
    assert arena.read(lib, arena.keys, out) == sizes
    assert all(np.array_equal(o, b) for o, b in zip(out, arena.blocks, strict=True))
    # The same slots, found by the native probe as by the numpy one.
    probe = arena.view.probe(NS, arena.keys)
    assert probe is not None and probe.prefix() == len(sizes)


def test_what_does_not_hold_is_rejected_and_what_is_absent_is_missed(lib: ctypes.CDLL) -> None:
    sizes = [5000] * 5
    arena = Arena(sizes, seed=3)
    arena.arena[65536 + 17] ^= 0xFF  # block 1's bytes no longer match its checksum
    arena.writer.put((NS, arena.keys[2]), Record(arena.arena.nbytes - 100, 5000, 2, 0))
    rows = arena.memory[HEADER_BYTES:].view(np.uint64)
    probe = arena.view.probe(NS, arena.keys)
    assert probe is not None
    rows[int(probe.slots[4]) * SLOT_WORDS + W_VERSION] += np.uint64(1)  # caught mid-change
    out = [np.zeros(5000, np.uint8) for _ in sizes]
    out[3] = np.zeros(4999, np.uint8)  # too small for block 3
    absent = keys(1, "absent")
    got = arena.read(lib, [*arena.keys, *absent], [*out, np.zeros(10, np.uint8)])
    assert got == [5000, -2, -2, -2, -1, -1]
    assert np.array_equal(out[0], arena.blocks[0])
    # Unverified, the damaged block is copied as it lies (the checksum is the only guard).
    assert arena.read(lib, arena.keys[1:2], out[1:2], verify=False) == [5000]


def test_a_damaged_hash_shift_is_refused_when_the_table_is_opened() -> None:
    arena = Arena([100])
    arena.memory[16:24] = 0  # the header's H_SHIFT word: 0
    with pytest.raises(ValueError, match="hash shift"):
        TableView(arena.memory.data)


@pytest.mark.parametrize("on", [True, False], ids=["native", "numpy"])
def test_the_segment_copies_the_same_bytes_and_sums_either_way(on: bool) -> None:
    class Memory:  # what SharedSegment needs of an attached segment
        name = "test"

        def __init__(self) -> None:
            self.bytes = bytearray(8 * 2**20)

        def view(self) -> memoryview:
            return memoryview(self.bytes)

        def close(self) -> None:
            pass

    was = native.LIB
    try:
        assert native.use_native(on) is on
        segment = SharedSegment(Memory())
        rng = np.random.default_rng(7)
        payloads = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 300_001, 2**20)]
        spans = [[], [(5, 1)], [(65536, 100_000), (1_000_000, 200_001)],
                 [(2 * 2**20, 2**19), (4 * 2**20, 2**19)]]
        sums = segment.write_many([(s, p.data) for s, p in zip(spans, payloads,
                                                                       strict=True)])
        assert sums == [xxhash.xxh3_64_intdigest(p.tobytes()) for p in payloads]
        out = [writable_array(np.zeros(p.size, np.uint8), "out") for p in payloads]
        assert segment.read_many(list(zip(spans, out, strict=True)), digest=True) == sums
        assert all(np.array_equal(o, p) for o, p in zip(out, payloads, strict=True))
        assert segment.read_into(spans[2], out[2], digest=True) == sums[2]
        assert segment.write(spans[3], payloads[3].data) == sums[3]
        segment.close()
    finally:
        native.LIB = was


def test_the_native_probe_finds_what_the_numpy_probe_finds(lib: ctypes.CDLL) -> None:
    arena = Arena([100] * 6, seed=5)
    chain = [*arena.keys[:4], *keys(1, "absent"), *arena.keys[4:]]
    rows = np.zeros((5, len(chain)), np.uint64)
    at, args, n = rows.ctypes.data, native.TableArgs(arena.view), len(chain)
    found = lib.kv_probe(args.table, args.params, NS, b"".join(chain), n,
                         *(at + 8 * n * row for row in range(5)))
    probe = arena.view.probe(NS, chain)
    assert probe is not None and found == probe.prefix() == 4
    assert rows[0].astype(np.int64).tolist() == probe.slots.tolist()
    hit = probe.slots >= 0
    for row, column in enumerate((probe.versions, probe.locs, probe.lengths, probe.sums)):
        assert rows[row + 1][hit].tolist() == column[hit].tolist()


def test_the_environment_can_turn_the_helper_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_KVSTORE_NATIVE", "1")
    assert native.load() is None
    monkeypatch.setenv("NO_KVSTORE_NATIVE", "0")
    assert native.load() is not None
