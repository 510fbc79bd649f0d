"""The L4 frame codec: round trips, the auto-compression choice, and corruption detection."""

from __future__ import annotations

import struct
from collections.abc import Callable

import lz4.block
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.daemon import blockframe as bf
from kvstore.daemon.blockframe import (
    CODEC_LZ4,
    CODEC_LZ4_SHUFFLE2,
    CODEC_RAW,
    HEADER_BYTES,
    MAGIC,
    VERSION,
    FrameError,
    decode,
    decode_verified,
    decode_view,
    encode,
    encode_parts,
    frame_checksum,
    header_codec,
)

MODES = ("none", "lz4", "auto")
NUM_VALUES = 1 << 20  # 2 MiB of 2-byte values, one realistic KV block group


def codec_of(frame: bytes) -> int:
    return frame[5]


def fp16_values(n: int = NUM_VALUES) -> bytes:
    return np.random.default_rng(0).standard_normal(n).astype(np.float16).tobytes()


def bf16_values(n: int = NUM_VALUES) -> bytes:
    f32 = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    return (f32.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def random_bytes(n: int) -> bytes:
    return np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8).tobytes()


payloads = st.one_of(
    st.binary(max_size=4096),
    # repetitive payloads, so "auto" takes its lz4 branches too
    st.builds(lambda unit, n: unit * n, st.binary(min_size=1, max_size=16), st.integers(1, 600)),
)


@settings(max_examples=300, deadline=None)
@given(payload=payloads, compress=st.sampled_from(MODES), shuffle=st.booleans())
def test_round_trip(payload: bytes, compress: str, shuffle: bool) -> None:
    frame = encode(payload, compress=compress, shuffle=shuffle)
    assert decode(frame) == payload
    assert decode(memoryview(frame)) == payload
    assert frame_checksum(frame) == xxhash.xxh3_64_intdigest(payload)
    if compress == "none":
        assert codec_of(frame) == CODEC_RAW
    if compress == "lz4":
        shuffled = shuffle and len(payload) % 2 == 0
        assert codec_of(frame) == (CODEC_LZ4_SHUFFLE2 if shuffled else CODEC_LZ4)
    if codec_of(frame) != CODEC_RAW and compress == "auto":
        assert len(frame) - HEADER_BYTES < 0.8 * len(payload)


def test_header_layout_is_little_endian_struct() -> None:
    payload = b"0123456789"
    frame = encode(payload, compress="none")
    assert HEADER_BYTES == 24
    magic, version, codec, reserved, raw_bytes, checksum = struct.unpack("<4sBBHQQ", frame[:24])
    assert (magic, version, codec, reserved) == (MAGIC, VERSION, CODEC_RAW, 0)
    assert (raw_bytes, checksum) == (10, xxhash.xxh3_64_intdigest(payload))
    assert frame[24:] == payload


def test_shuffle2_body_is_the_byte_planes_of_the_payload() -> None:
    # the layout is persistent (other daemons read it), so pin it, not just the round trip
    payload = bytes(range(256)) * 8
    frame = encode(payload, compress="lz4")
    assert codec_of(frame) == CODEC_LZ4_SHUFFLE2
    body = lz4.block.decompress(frame[HEADER_BYTES:], uncompressed_size=len(payload))
    assert body == payload[0::2] + payload[1::2]


def test_typed_memoryview_counts_bytes_not_items() -> None:
    values = np.arange(1000, dtype=np.float16)
    frame = encode(values.data)  # a memoryview of format 'e'
    assert frame == encode(values.tobytes())
    assert decode(frame) == values.tobytes()


def test_decode_accepts_a_slice_of_a_larger_buffer() -> None:
    frame = encode(bf16_values(4096))
    assert decode(memoryview(b"junk" + frame + b"tail")[4:-4]) == bf16_values(4096)


def test_bf16_saves_under_a_fifth_so_auto_keeps_it_raw_and_lz4_forces_it() -> None:
    payload = bf16_values()
    assert codec_of(encode(payload)) == CODEC_RAW
    frame = encode(payload, compress="lz4")
    assert codec_of(frame) == CODEC_LZ4_SHUFFLE2
    assert len(frame) < 0.87 * len(payload)  # 0.836 observed with lz4 4.4
    assert decode(frame) == payload


def test_bf16_without_shuffle_does_not_pay() -> None:
    # the high bytes only line up after the shuffle; interleaved, lz4 finds nothing
    assert codec_of(encode(bf16_values(), shuffle=False)) == CODEC_RAW


def test_fp16_normal_values_stay_raw_under_auto_but_round_trip_as_lz4() -> None:
    # fp16's high byte carries 2 mantissa bits (about 5.5 bits of entropy for N(0, 1)):
    # lz4, which only finds repeats, cannot shrink it, so auto must not pay for lz4
    payload = fp16_values()
    assert codec_of(encode(payload)) == CODEC_RAW
    frame = encode(payload, compress="lz4")
    assert codec_of(frame) == CODEC_LZ4_SHUFFLE2
    assert decode(frame) == payload


def test_partly_padded_fp16_block_picks_lz4_over_shuffle() -> None:
    # a block half filled with tokens, the rest zero padding
    payload = fp16_values(NUM_VALUES // 2) + bytes(NUM_VALUES)
    frame = encode(payload)
    assert codec_of(frame) == CODEC_LZ4_SHUFFLE2
    assert len(frame) < 0.6 * len(payload)
    assert decode(frame) == payload


def test_random_bytes_stay_raw_and_only_a_sample_is_compressed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compressed_sizes: list[int] = []
    real_lz4 = bf._lz4

    def spy(data: bytes | memoryview, shuffled: bool) -> bytes:
        compressed_sizes.append(len(data))
        return real_lz4(data, shuffled)

    monkeypatch.setattr(bf, "_lz4", spy)
    payload = random_bytes(8 << 20)
    frame = encode(payload)
    assert codec_of(frame) == CODEC_RAW
    assert len(frame) == HEADER_BYTES + len(payload)
    assert compressed_sizes == [64 * 1024]


def test_auto_keeps_raw_when_the_sample_pays_but_the_whole_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bf, "_sample", lambda view: bytes(64 * 1024))
    payload = random_bytes(1 << 20)
    frame = encode(payload)
    assert codec_of(frame) == CODEC_RAW
    assert decode(frame) == payload


def test_small_compressible_payload_is_compressed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    compressed_sizes: list[int] = []
    real_lz4 = bf._lz4

    def spy(data: bytes | memoryview, shuffled: bool) -> bytes:
        compressed_sizes.append(len(data))
        return real_lz4(data, shuffled)

    monkeypatch.setattr(bf, "_lz4", spy)
    assert codec_of(encode(bytes(32 * 1024))) == CODEC_LZ4_SHUFFLE2
    assert compressed_sizes == [32 * 1024]


def frames_by_codec() -> dict[str, bytes]:
    payload = bf16_values(1024)  # 2 KiB, compressible
    return {
        "raw": encode(payload, compress="none"),
        "lz4": encode(payload, compress="lz4", shuffle=False),
        "lz4_shuffle2": encode(payload, compress="lz4"),
    }


def flipped(frame: bytes, index: int, mask: int) -> bytes:
    damaged = bytearray(frame)
    damaged[index] ^= mask
    return bytes(damaged)


DECODERS = pytest.mark.parametrize("decoder", [decode, decode_view], ids=["decode", "view"])


@DECODERS
@pytest.mark.parametrize("name", ["raw", "lz4", "lz4_shuffle2"])
def test_every_header_byte_flip_is_a_frame_error(
        name: str, decoder: Callable[[bytes], bytes | memoryview]) -> None:
    frame = frames_by_codec()[name]
    for index in range(HEADER_BYTES):
        for mask in (0x01, 0x80, 0xFF):
            with pytest.raises(FrameError):
                decoder(flipped(frame, index, mask))


@DECODERS
@pytest.mark.parametrize("name", ["raw", "lz4", "lz4_shuffle2"])
def test_a_body_byte_flip_never_yields_wrong_bytes(
        name: str, decoder: Callable[[bytes], bytes | memoryview]) -> None:
    payload = bf16_values(1024)
    frame = frames_by_codec()[name]
    num_errors = num_flips = 0
    for index in range(HEADER_BYTES, len(frame)):
        for mask in (0x01, 0xFF):
            num_flips += 1
            try:
                decoded = decoder(flipped(frame, index, mask))
            except FrameError:
                num_errors += 1
                continue
            # lz4 can spell the same output two ways (a match one byte shorter followed by
            # a literal that repeats it); such a flip is not corruption of the data
            assert name != "raw" and decoded == payload
    assert num_errors >= num_flips - 4


@pytest.mark.parametrize("name", ["raw", "lz4", "lz4_shuffle2"])
def test_truncated_or_extended_frames_are_frame_errors(name: str) -> None:
    frame = frames_by_codec()[name]
    for size in (0, 1, 4, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 1, len(frame) // 2):
        with pytest.raises(FrameError):
            decode(frame[:size])
    with pytest.raises(FrameError):
        decode(frame[:-1])
    with pytest.raises(FrameError):
        decode(frame + b"\x00")


def test_decode_view_of_a_raw_frame_is_a_view_of_the_frame_itself() -> None:
    payload = bf16_values(4096)
    frame = bytearray(encode(payload, compress="none"))
    view = decode_view(memoryview(frame))
    assert isinstance(view, memoryview) and view.obj is frame and bytes(view) == payload
    frame[HEADER_BYTES] ^= 0xFF  # no copy was made: the view sees the frame change
    assert view[0] == payload[0] ^ 0xFF


@pytest.mark.parametrize("name", ["lz4", "lz4_shuffle2"])
def test_decode_view_of_a_compressed_frame_is_its_payload(name: str) -> None:
    frame = frames_by_codec()[name]
    assert codec_of(frame) != CODEC_RAW
    assert decode_view(frame) == decode(frame) == bf16_values(1024)


@pytest.mark.parametrize("name", ["raw", "lz4", "lz4_shuffle2"])
def test_decode_verified_keeps_the_checksum_the_payload_matched(name: str) -> None:
    frame = frames_by_codec()[name]
    got = decode_verified(frame)
    assert got.data == bf16_values(1024) and len(got) == len(got.data)
    assert got.checksum == xxhash.xxh3_64_intdigest(bf16_values(1024)) == frame_checksum(frame)
    damaged = bytearray(frame)
    damaged[-1] ^= 0x01
    with pytest.raises(FrameError):
        decode_verified(bytes(damaged))


def test_short_frame_says_truncated() -> None:
    with pytest.raises(FrameError, match="truncated"):
        frame_checksum(encode(b"payload")[: HEADER_BYTES - 1])


def test_wrong_magic_future_version_unknown_codec_and_reserved_are_named() -> None:
    frame = bytearray(encode(b"some payload bytes"))
    cases = [
        (0, b"KVS3", "bad magic"),
        (4, bytes([VERSION + 1]), "version 2"),
        (5, bytes([3]), "unknown codec 3"),
        (5, bytes([255]), "unknown codec 255"),
        (6, b"\x01\x00", "reserved"),
    ]
    for offset, value, message in cases:
        damaged = bytearray(frame)
        damaged[offset : offset + len(value)] = value
        for call in (decode, frame_checksum):
            with pytest.raises(FrameError, match=message):
                call(bytes(damaged))


def test_impossible_lz4_length_is_rejected_before_allocating() -> None:
    frame = bytearray(encode(bytes(4096), compress="lz4"))
    frame[8:16] = struct.pack("<Q", 1 << 62)
    with pytest.raises(FrameError, match="impossible"):
        decode(bytes(frame))


def test_odd_length_with_shuffle_codec_is_rejected() -> None:
    frame = bytearray(encode(bytes(4096), compress="lz4"))
    frame[8:16] = struct.pack("<Q", 4095)
    with pytest.raises(FrameError, match="odd raw length"):
        decode(bytes(frame))


@pytest.mark.parametrize("compress", MODES)
def test_frame_checksum_is_the_payload_xxh3(compress: str) -> None:
    payload = bf16_values(8192)
    assert frame_checksum(encode(payload, compress=compress)) == xxhash.xxh3_64_intdigest(payload)


def test_a_given_checksum_is_used_and_a_wrong_one_fails_decode() -> None:
    payload = bf16_values(8192)
    right = xxhash.xxh3_64_intdigest(payload)
    assert encode(payload, checksum=right) == encode(payload)
    wrong = encode(payload, checksum=right ^ 1)
    assert frame_checksum(wrong) == right ^ 1
    with pytest.raises(FrameError, match="checksum mismatch"):
        decode(wrong)


def test_misuse_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="compress must be one of"):
        encode(b"x", compress="zstd")
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        encode(b"x", checksum=-1)
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        encode(b"x", checksum=1 << 64)
    assert issubclass(FrameError, ValueError)


# --- frames as parts (the write-through sends them unjoined) ----------------------------------

# Frames the encoder wrote before encode_parts existed (commit f5336bc): whatever the writer
# sends now must stay byte for byte what older daemons wrote and read, both ways.
OLD_RAW = bytes(range(64))
OLD_PACKED = b"\x00\x3c" * 48 + bytes(range(32))  # fp16 1.0 repeated, then a tail
OLD_FRAMES = {
    ("none", True, OLD_RAW): "4b56533401000000400000000000000055edb08990eb8761"
    "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
    "202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f",
    ("lz4", False, OLD_PACKED): "4b5653340101000080000000000000003c8579136aa4f4fa"
    "2f003c02004cf0100102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f",
    ("lz4", True, OLD_PACKED): "4b5653340102000080000000000000003c8579136aa4f4fa"
    "1f0001001dff01020406080a0c0e10121416181a1c1e3c01001cf00101030507090b0d0f1113151719"
    "1b1d1f",
}


@pytest.mark.parametrize("mode", sorted(OLD_FRAMES, key=str))
def test_frames_written_by_the_old_encoder_decode_and_are_still_what_is_written(
        mode: tuple[str, bool, bytes]) -> None:
    compress, shuffle, payload = mode
    old = bytes.fromhex(OLD_FRAMES[mode])
    assert decode(old) == payload and bytes(decode_view(old)) == payload
    header, body = encode_parts(payload, compress, shuffle)
    assert header + bytes(body) == encode(payload, compress, shuffle) == old
    assert header_codec(header) == codec_of(old)


@settings(max_examples=200, deadline=None)
@given(payload=payloads, compress=st.sampled_from(MODES), shuffle=st.booleans())
def test_parts_joined_are_the_frame(payload: bytes, compress: str, shuffle: bool) -> None:
    header, body = encode_parts(payload, compress, shuffle)
    assert len(header) == HEADER_BYTES
    assert header + bytes(body) == encode(payload, compress, shuffle)
    assert header_codec(header) in (CODEC_RAW, CODEC_LZ4, CODEC_LZ4_SHUFFLE2)


def test_a_raw_body_is_a_view_of_the_payload_not_a_copy() -> None:
    """The write-through sends a raw block's body from its L2 pages: encode_parts must hand
    back a view of the payload, so a change to the payload shows in the body."""
    payload = bytearray(random_bytes(4096))
    header, body = encode_parts(memoryview(payload), "none")
    assert isinstance(body, memoryview) and header_codec(header) == CODEC_RAW
    payload[0] ^= 0xFF
    assert body[0] == payload[0]
    header, body = encode_parts(bytes(payload), "auto")  # random bytes stay raw under auto
    assert isinstance(body, memoryview) and header_codec(header) == CODEC_RAW
