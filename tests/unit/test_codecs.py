"""The block codecs (kvstore.integrations.codecs, docs/codecs.md): `none` round-trips bit for
bit; fp8 and int4 stay within their stated error bound per element for random, constant and
denormal-heavy blocks of every dtype; the exact bit layout of a tiny hand-computed block; a
truncated, corrupted or foreign block is refused, never decoded into garbage."""

from __future__ import annotations

import pytest
import torch

from kvstore.integrations.codecs import (
    HEADER_BYTES,
    MAGIC,
    BlockCodec,
    CodecError,
    codec_for,
    namespace_suffix,
)

SHAPE = (2, 2, 16, 3, 64)  # layers, K/V, block tokens, kv heads, head dim
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KINDS = ("random", "outliers", "constant", "denormal")


def _block(kind: str, dtype: torch.dtype, n: int = 3, shape: tuple[int, ...] = SHAPE,
           seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g)
    if kind == "outliers":  # a few channels far larger than the rest (what KIVI is for)
        x[..., 5] *= 40
        x[..., 0, :, :, :, :] += 7.5
    elif kind == "constant":
        x = torch.full((n, *shape), -2.75)
    elif kind == "denormal":  # the dtype's subnormals and zeros, with a few normal values
        tiny = torch.finfo(dtype).tiny
        x = x * tiny * 0.25
        x[..., ::7] = 0.0
        x[0, 0, 0, 0, 0, 0] = 1.5
    return x.to(dtype)


def _smallest_subnormal(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).tiny * torch.finfo(dtype).eps


def _rounding(dtype: torch.dtype) -> float:
    """Relative error of rounding a decoded float32 value to dtype."""
    return torch.finfo(dtype).eps / 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_none_is_the_raw_bytes(dtype: torch.dtype, kind: str) -> None:
    x = _block(kind, dtype)
    codec = codec_for("none", SHAPE, dtype)
    encoded = codec.encode(x)
    assert encoded.shape == (3, x[0].numel() * x.element_size()) == (3, codec.encoded_bytes)
    assert torch.equal(encoded, x.reshape(3, -1).view(torch.uint8))
    assert codec.valid(encoded).all()
    assert torch.equal(codec.decode(encoded).view(torch.uint8), x.view(torch.uint8))
    assert namespace_suffix("none") == ""


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_fp8_is_within_its_bound(dtype: torch.dtype, kind: str) -> None:
    """|x' - x| <= 2**-4 |x| + 2**-10 * scale, plus rounding to dtype."""
    x = _block(kind, dtype)
    codec = codec_for("fp8", SHAPE, dtype)
    encoded = codec.encode(x)
    assert codec.valid(encoded).all()
    y = codec.decode(encoded)
    assert y.dtype == dtype and y.shape == x.shape
    xf, yf = x.float(), y.float()
    scales = encoded[:, HEADER_BYTES:HEADER_BYTES + 2 * 2 * 16 * 3].float() - 127
    scale = torch.exp2(scales).reshape(3, 2, 2, 16, 3, 1)
    bound = (2.0**-4 * xf.abs() * (1 + 2 * _rounding(dtype)) + 2.0**-10 * scale
             + _rounding(dtype) * yf.abs() + _smallest_subnormal(dtype))
    assert ((yf - xf).abs() <= bound).all()
    # The scale is the smallest power of two that fits each vector's largest value in e4m3.
    amax = xf.abs().amax(dim=-1, keepdim=True)
    fits = amax <= 448 * scale
    tight = (amax > 224 * scale) | (scales.reshape_as(scale) == -127) | (amax == 0)
    assert fits.all() and tight.all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_int4_is_within_its_bound(dtype: torch.dtype, kind: str) -> None:
    """|x' - x| <= scale / 2 per group, plus float16's subnormal step and rounding to dtype."""
    x = _block(kind, dtype)
    codec = codec_for("int4", SHAPE, dtype)
    encoded = codec.encode(x)
    assert codec.valid(encoded).all()
    y = codec.decode(encoded)
    assert y.dtype == dtype and y.shape == x.shape
    xf, yf = x.float(), y.float()
    key_scale = codec._field(encoded, "key_scale").view(torch.float16).float()
    value_scale = codec._field(encoded, "value_scale").view(torch.float16).float()
    # Keys: one scale per (layer, channel) over the block's 16 tokens.
    ks = key_scale.reshape(3, 2, 1, 3, 64)
    # Values: one scale per (layer, token, head) and 32 channels.
    vs = value_scale.reshape(3, 2, 16, 3, 2, 1).expand(3, 2, 16, 3, 2, 32).reshape(
        3, 2, 16, 3, 64)
    scale = torch.stack([ks.expand(3, 2, 16, 3, 64), vs], dim=2)
    slack = 2.0**-24 + 2.0**-20 * xf.abs() + _rounding(dtype) * yf.abs()
    assert ((yf - xf).abs() <= scale / 2 * (1 + 2.0**-8) + slack).all()
    if kind == "constant":  # a constant group is stored exactly (scale 0)
        assert torch.equal(yf, xf)


def test_int4_keys_are_per_channel_and_values_per_token() -> None:
    """One key channel a thousand times larger than the others costs only that channel
    precision (KIVI's reason for per-channel keys); one loud value token costs only that
    token's group."""
    x = _block("random", torch.float32, n=1)
    x[:, :, 0, :, :, 7] *= 1000  # key channel 7
    x[:, :, 1, 3, :, :] *= 1000  # value token 3
    codec = codec_for("int4", SHAPE, torch.float32)
    err = (codec.decode(codec.encode(x)) - x).abs()
    quiet_keys = torch.ones(64, dtype=torch.bool)
    quiet_keys[7] = False
    assert err[:, :, 0, :, :, quiet_keys].max() < 0.6
    assert err[:, :, 1, :3].max() < 0.6 and err[:, :, 1, 4:].max() < 0.6


def test_the_fp8_bit_layout_of_a_tiny_block() -> None:
    """One layer, one token, one head, head_dim 2: K = [1, -0.5], V = [448, 3]. K's largest
    value 1 needs scale 2**-8 (1 <= 448 * 2**-8 = 1.75): codes 256 and -128 in e4m3; V's 448
    needs scale 2**0: 448 is e4m3 0x7E, 3 is 0x44 (exponent 8, mantissa 0b100)."""
    x = torch.tensor([1.0, -0.5, 448.0, 3.0]).reshape(1, 1, 2, 1, 1, 2)
    codec = codec_for("fp8", (1, 2, 1, 1, 2), torch.float32)
    encoded = codec.encode(x)
    header = MAGIC + bytes([1, 1, 0, 0, 1, 0, 1, 0, 1, 0, 2, 0])
    # 256 = 2**8 -> e4m3 exponent field 8+7=15, mantissa 0: 0x78; -128 -> 0xF0.
    want = header + bytes([127 - 8, 127]) + bytes([0x78, 0xF0, 0x7E, 0x44])
    assert encoded.shape == (1, len(want)) and bytes(encoded[0].tolist()) == want
    assert torch.equal(codec.decode(encoded), x)


def test_the_int4_bit_layout_of_a_tiny_block() -> None:
    """One layer, 2 tokens, one head, head_dim 2. Keys [[0, 1], [3, 2]] per channel: channel
    0 spans 0..3 (zero 0, scale 3/15 rounded up in float16, codes 0 and 15), channel 1 spans
    1..2 (zero 1, scale 1/15 rounded up). Values [[0, 1.5], [4, 4]] per token:
    token 0 spans 0..1.5 (codes 0, 15), token 1 is constant 4 (scale 0, zero 4, codes 0)."""
    keys = [[0.0, 1.0], [3.0, 2.0]]
    values = [[0.0, 1.5], [4.0, 4.0]]
    x = torch.tensor([keys, values]).reshape(1, 1, 2, 2, 1, 2)
    codec = codec_for("int4", (1, 2, 2, 1, 2), torch.float32)
    encoded = codec.encode(x)

    def f16(*values: float) -> bytes:
        return torch.tensor(values, dtype=torch.float16).view(torch.uint8).numpy().tobytes()

    def up(value: float) -> float:  # value rounded up to float16
        half = torch.tensor(value, dtype=torch.float16)
        if half.float() < value:
            half = torch.nextafter(half, torch.tensor(float("inf"), dtype=torch.float16))
        return float(half)

    k_scale = f16(up(3.0 / 15), up(1.0 / 15))
    header = MAGIC + bytes([2, 1, 0, 0, 1, 0, 2, 0, 1, 0, 2, 0])
    # Key codes (tokens x channels, C order): [0, 0], [15, 15] -> bytes 0x00, 0xFF.
    # Value codes: [0, 15], [0, 0] -> 0xF0, 0x00.
    want = (header + k_scale + f16(0.0, 1.0) + f16(up(1.5 / 15), 0.0)
            + f16(0.0, 4.0) + bytes([0x00, 0xFF]) + bytes([0xF0, 0x00]))
    assert bytes(encoded[0].tolist()) == want
    y = codec.decode(encoded)
    assert torch.allclose(y, x, atol=0.002) and y[0, 0, 1, 1].eq(4.0).all()


def test_encoded_sizes_and_ratios() -> None:
    """SmolLM2-135M's block (30 layers, 3 kv heads of 64, 16 tokens): fp8 stores 1 + 64 bytes
    per 64 values, int4 32 bytes of codes per 64 values plus float16 scale and zero per key
    channel (16 tokens) and per 32 value channels."""
    shape = (30, 2, 16, 3, 64)
    fp8 = codec_for("fp8", shape, torch.bfloat16)
    assert fp8.encoded_bytes == 16 + 30 * 2 * 16 * 3 * 65
    assert fp8.ratio > 1.95 and codec_for("fp8", shape, torch.float32).ratio > 3.9
    int4 = codec_for("int4", shape, torch.bfloat16)
    assert int4.encoded_bytes == 16 + 30 * 192 * 4 + 30 * 16 * 3 * 2 * 4 + 30 * 2 * 16 * 192 // 2
    assert codec_for("int4", shape, torch.float32).ratio > 5.8


@pytest.mark.parametrize("name", ["fp8", "int4"])
def test_truncated_corrupted_and_foreign_blocks_are_refused(name: str) -> None:
    x = _block("random", torch.bfloat16)
    codec = codec_for(name, SHAPE, torch.bfloat16)
    encoded = codec.encode(x)
    with pytest.raises(CodecError, match="encoded rows"):
        codec.decode(encoded[:, :-1])
    assert not codec.valid(encoded[:, :-1]).any()  # a truncated row is never a block
    bad = encoded.clone()
    bad[0, 2] ^= 0x01  # the magic
    bad[1, 9] ^= 0x01  # the block's layer count
    assert codec.valid(bad).tolist() == [False, False, True]
    # Damaged parameters: an E8M0 NaN scale, a float16 NaN scale.
    params = encoded.clone()
    params[0, HEADER_BYTES:HEADER_BYTES + 2] = 0xFF
    assert codec.valid(params).tolist() == [False, True, True]
    # A block of the same size written for another dtype or codec is not this codec's.
    other = codec_for(name, SHAPE, torch.float16).encode(x.to(torch.float16))
    assert other.shape == encoded.shape and not codec.valid(other).any()
    raw = torch.zeros(3, codec.encoded_bytes, dtype=torch.uint8)
    assert not codec.valid(raw).any()


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(CodecError, match="store_codec must be one of"):
        codec_for("zstd", SHAPE, torch.float32)
    with pytest.raises(CodecError, match="store_codec must be one of"):
        namespace_suffix("fp4")
    with pytest.raises(CodecError, match="dtype"):
        codec_for("fp8", SHAPE, torch.float64)
    with pytest.raises(CodecError, match="block_size"):
        BlockCodec("int4", (2, 2, 48, 3, 64), torch.float32)
    with pytest.raises(CodecError, match="encode: rows"):
        codec_for("fp8", SHAPE, torch.float32).encode(_block("random", torch.bfloat16))


def test_namespaces_differ_per_codec() -> None:
    suffixes = {namespace_suffix(name) for name in ("none", "fp8", "int4")}
    assert suffixes == {"", "-codec.fp8.v1", "-codec.int4.v1"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["fp8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_gpu_encodes_and_decodes_the_same_bytes_as_the_cpu(name: str,
                                                              dtype: torch.dtype) -> None:
    """The engine encodes on its cache's device: a block encoded on a GPU loads on a CPU
    engine and the reverse, so the bytes must not depend on where they were made."""
    x = _block("outliers", dtype)
    codec = codec_for(name, SHAPE, dtype)
    on_cpu = codec.encode(x)
    on_gpu = codec.encode(x.cuda())
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), on_cpu)
    assert codec.valid(on_gpu).all()
    assert torch.equal(codec.decode(on_gpu).cpu(), codec.decode(on_cpu))


@pytest.mark.parametrize("name", ["none", "fp8", "int4"])
def test_decode_chunks_cover_every_row_once(name: str) -> None:
    """On a CPU rows go through a few at a time (9 rows: 4, 4, 1); the chunks are decode()'s
    rows, in order, each once, and encode() of a batch equals encode() row by row."""
    x = _block("outliers", torch.bfloat16, n=9)
    codec = codec_for(name, SHAPE, torch.bfloat16)
    encoded = codec.encode(x)
    assert torch.equal(encoded, torch.cat([codec.encode(x[i:i + 1]) for i in range(9)]))
    chunks = list(codec.decode_chunks(encoded))
    assert [start for start, _ in chunks] == ([0] if name == "none" else [0, 4, 8])
    assert torch.equal(torch.cat([rows for _, rows in chunks]), codec.decode(encoded))
