"""Lossy block codecs for stored K/V (docs/codecs.md): what an engine encodes before a put and
decodes after a get, so the daemon keeps a smaller opaque block in every tier. Pure torch,
vectorised over a batch of blocks, on whatever device the rows are on; no I/O.

A block is one staging row of the engine's layout: [layers, 2 (K, V), block_tokens, kv_heads,
head_dim] in float32, bfloat16 or float16; or, for a latent cache (Multi-head Latent Attention:
one vector per token and layer, no K/V split), [layers, 1, block_tokens, 1, latent width],
which `fp8` encodes (a scale per token and layer) and `int4` refuses. `encode(rows)` takes
[n, *that] and returns [n, encoded_bytes] uint8; `decode(encoded)` gives the rows back in the
source dtype. The codec is part of the namespace (`namespace_suffix`), so encoded and raw
blocks never meet.

Codecs:

- `none`: the raw bytes (no encoding; the namespace is unchanged).
- `fp8`: every (layer, K/V, token, head) vector of head_dim values is stored as float8 e4m3
  (OCP FP8, `torch.float8_e4m3fn`) with one power-of-two scale byte (E8M0, as in the OCP
  microscaling formats): x ~= e4m3 * 2**(s - 127). Per element
  |x' - x| <= 2**-4 * |x| + 2**-10 * 2**(s - 127) (e4m3 keeps 3 mantissa bits; the second term
  is e4m3's subnormal step), plus the rounding of the decoded value to the source dtype.
- `int4`: KIVI's grouping (Liu et al., 2024): keys quantised per channel (a group is one
  channel's values over min(32, block_tokens) tokens), values per token (a group is one token's
  32 channels, or all of head_dim when it is not a multiple of 32); each group is asymmetric
  4-bit, x ~= q * scale + zero with q in 0..15, scale and zero float16 (zero is the group's
  minimum rounded down, scale its range / 15 rounded up). Per element
  |x' - x| <= scale / 2 (+ float16's subnormal step 2**-24 and float32 arithmetic), plus the
  rounding to the source dtype. float16 parameters bound the values int4 can hold to
  |x| < 65504 (K/V never come near).

Encoded row layout (little-endian; every field starts at an even byte):

    0   4 bytes  magic b"KVC1"
    4   1 byte   codec id: 1 fp8, 2 int4
    5   1 byte   source dtype: 1 float32, 2 bfloat16, 3 float16
    6   1 byte   0: K and V; 1: one latent vector per token (MLA)
    7   1 byte   zero
    8   4 x u16  layers, block_tokens, kv_heads, head_dim
    16  fp8:  scales u8 [L, P, T, H]        then codes u8 (e4m3 bits) [L, P, T, H, D]
              (P = 2, or 1 for a latent cache)
        int4: key scale f16 [L, T/Gk, H, D], key zero f16 [L, T/Gk, H, D],
              value scale f16 [L, T, H, D/Gv], value zero f16 [L, T, H, D/Gv],
              key codes [L, T, H, D] then value codes [L, T, H, D], two per byte: element 2i
              in the low nibble, 2i+1 in the high nibble (C order).

`valid(encoded)` checks each row's header (and that its parameters are finite), so a block of
the wrong codec, shape or dtype, or one whose header or parameters were damaged, is rejected
before it is decoded: the caller treats it as a miss. The store's checksum covers the bytes
themselves; a truncated block never has the row's size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["CODECS", "HEADER_BYTES", "BlockCodec", "CodecError", "codec_for", "namespace_suffix"]

CODECS = ("none", "fp8", "int4")
HEADER_BYTES = 16
MAGIC = b"KVC1"
_IDS = {"fp8": 1, "int4": 2}
_DTYPE_IDS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_E4M3_MAX = 448.0
_GROUP = 32
_CPU_CHUNK_ROWS = 4
"""On a CPU, blocks are encoded and decoded a few at a time, so that the temporaries of each
pass stay in cache and are reused (4-7x faster than a whole batch of SmolLM2's 720 KiB
blocks at once); on a GPU, the whole batch in one go."""


def _chunk_rows(device: torch.device, rows: int) -> int:
    return max(1, rows if device.type != "cpu" else _CPU_CHUNK_ROWS)


class CodecError(ValueError):
    """A codec that cannot be used as asked (its name, the block's shape or dtype), or an
    encoded block that is not what this codec wrote; the message names the field."""


@dataclass(frozen=True)
class _Field:
    offset: int
    nbytes: int


class BlockCodec:
    """One codec for one block layout: [layers, 2, block_tokens, kv_heads, head_dim] of dtype
    (or [layers, 1, block_tokens, 1, width] for a latent cache, fp8 only).

    encode/decode run on the rows' device; `encoded_bytes` is the size of one encoded row."""

    def __init__(self, name: str, block_shape: tuple[int, ...], dtype: torch.dtype,
                 option: str = "store_codec") -> None:
        """option: the setting the codec came from, named in errors (the engine's
        `store_codec`, the vLLM connector's `kv_connector_extra_config.codec`)."""
        if name not in CODECS:
            raise CodecError(f"{option} must be one of {CODECS}, got {name!r}")
        if dtype not in _DTYPE_IDS:
            raise CodecError(f"{option} {name}: dtype must be float32, bfloat16 or float16, "
                             f"got {dtype}")
        if len(block_shape) != 5 or block_shape[1] not in (1, 2) or min(block_shape) < 1:
            raise CodecError(f"{option}: a block must be [layers, 2, block_tokens, kv_heads, "
                             f"head_dim] (or [layers, 1, block_tokens, 1, width], a latent "
                             f"cache), got {list(block_shape)}")
        if block_shape[1] == 1 and name == "int4":
            raise CodecError(f"{option} int4 does not apply to a latent (MLA) cache, one "
                             f"vector per token with no K/V split (int4 quantises keys per "
                             f"channel and values per token); fp8 does")
        if block_shape[1] == 1 and block_shape[3] != 1:
            raise CodecError(f"{option}: a latent block has one head, got {list(block_shape)}")
        if max(block_shape) > 0xFFFF:
            raise CodecError(f"{option}: block dimensions must be < 65536, got "
                             f"{list(block_shape)}")
        self.name = name
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        layers, parts, tokens, heads, dim = block_shape
        self.raw_bytes = math.prod(block_shape) * torch.finfo(dtype).bits // 8
        self.key_group = min(_GROUP, tokens)
        self.value_group = _GROUP if dim % _GROUP == 0 else dim
        if name == "int4" and tokens % self.key_group:
            raise CodecError(f"{option} int4: block_size must be at most {_GROUP} or a "
                             f"multiple of {_GROUP} (keys are grouped per {_GROUP} tokens), "
                             f"got {tokens}")
        if name == "int4" and dim % 2:
            raise CodecError(f"{option} int4: head_dim must be even, got {dim}")
        self._fields = self._layout()
        self.encoded_bytes = (self.raw_bytes if name == "none" else
                              HEADER_BYTES + sum(f.nbytes for f in self._fields.values()))
        header = bytearray(MAGIC)
        header += bytes([_IDS.get(name, 0), _DTYPE_IDS[dtype], 2 - parts, 0])
        for size in (layers, tokens, heads, dim):
            header += size.to_bytes(2, "little")
        self.header = bytes(header)
        self._headers: dict[torch.device, torch.Tensor] = {}

    def _layout(self) -> dict[str, _Field]:
        layers, parts, tokens, heads, dim = self.block_shape
        vectors = layers * parts * tokens * heads
        sizes: list[tuple[str, int]] = []
        if self.name == "fp8":
            sizes = [("scales", vectors), ("codes", vectors * dim)]
        elif self.name == "int4":
            key_params = layers * (tokens // self.key_group) * heads * dim * 2
            value_params = layers * tokens * heads * (dim // self.value_group) * 2
            half = layers * tokens * heads * dim // 2
            sizes = [("key_scale", key_params), ("key_zero", key_params),
                     ("value_scale", value_params), ("value_zero", value_params),
                     ("key_codes", half), ("value_codes", half)]
        fields: dict[str, _Field] = {}
        offset = HEADER_BYTES
        for field_name, nbytes in sizes:
            fields[field_name] = _Field(offset, nbytes)
            offset += nbytes
        return fields

    @property
    def ratio(self) -> float:
        """Raw bytes per encoded byte of one block."""
        return self.raw_bytes / self.encoded_bytes

    # -- encode ---------------------------------------------------------------------------
    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, *block_shape] rows of the codec's dtype -> [n, encoded_bytes] uint8 on the same
        device (`none`: the rows' bytes)."""
        if tuple(rows.shape[1:]) != self.block_shape or rows.dtype != self.dtype:
            raise CodecError(f"encode: rows must be [n, {', '.join(map(str, self.block_shape))}]"
                             f" {self.dtype}, got {list(rows.shape)} {rows.dtype}")
        n = rows.shape[0]
        flat = rows.reshape(n, -1)
        if self.name == "none":
            return flat.contiguous().view(torch.uint8)
        out = torch.empty((n, self.encoded_bytes), dtype=torch.uint8, device=rows.device)
        header = self._header_on(rows.device)
        for start in range(0, n, _chunk_rows(rows.device, n)):
            chunk = rows[start:start + _chunk_rows(rows.device, n)].float()
            parts = self._encode_fp8(chunk) if self.name == "fp8" else self._encode_int4(chunk)
            torch.cat([header.expand(chunk.shape[0], HEADER_BYTES), *parts], dim=1,
                      out=out[start:start + chunk.shape[0]])
        return out

    def _header_on(self, device: torch.device) -> torch.Tensor:
        """The header as a uint8 tensor on device (copied there once)."""
        header = self._headers.get(device)
        if header is None:
            header = torch.frombuffer(bytearray(self.header), dtype=torch.uint8).to(device)
            self._headers[device] = header
        return header

    def _encode_fp8(self, x: torch.Tensor) -> list[torch.Tensor]:
        n = x.shape[0]
        amax = x.abs().amax(dim=-1, keepdim=True)
        # The smallest e with amax <= 448 * 2**e, exactly: amax = m * 2**k, m in [0.5, 1);
        # 448 * 2**(k-9) = 0.875 * 2**k.
        mantissa, exponent = torch.frexp(amax)
        e = (exponent - 9 + (mantissa > 0.875).to(exponent.dtype)).clamp(-127, 127)
        scaled = torch.ldexp(x, -e.to(x.dtype)).clamp(-_E4M3_MAX, _E4M3_MAX)
        codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
        scales = (e + 127).to(torch.uint8)
        return [scales.reshape(n, -1), codes.reshape(n, -1)]

    def _encode_int4(self, x: torch.Tensor) -> list[torch.Tensor]:
        n, layers, _, tokens, heads, dim = x.shape
        keys, values = x[:, :, 0], x[:, :, 1]  # [n, L, T, H, D]
        # Keys per channel: groups of key_group tokens of one channel.
        kg = keys.reshape(n, layers, tokens // self.key_group, self.key_group, heads, dim)
        k_scale, k_zero, k_codes = _quantise(kg, dim=3)
        # Values per token: groups of value_group channels of one token.
        vg = values.reshape(n, layers, tokens, heads, dim // self.value_group, self.value_group)
        v_scale, v_zero, v_codes = _quantise(vg, dim=5)
        return [_bytes_of(k_scale), _bytes_of(k_zero), _bytes_of(v_scale), _bytes_of(v_zero),
                _pack(k_codes.reshape(n, -1)), _pack(v_codes.reshape(n, -1))]

    # -- decode ---------------------------------------------------------------------------
    def valid(self, encoded: torch.Tensor) -> torch.Tensor:
        """Per row of [n, encoded_bytes] uint8: whether it is a block this codec wrote (header,
        size, parameters), as a bool [n] on the rows' device. Rows that fail are misses."""
        n = encoded.shape[0]
        if encoded.dtype != torch.uint8 or encoded.dim() != 2:
            raise CodecError(f"encoded rows must be a 2-D uint8 tensor, got "
                             f"{list(encoded.shape)} {encoded.dtype}")
        if encoded.shape[1] != self.encoded_bytes:
            return torch.zeros(n, dtype=torch.bool, device=encoded.device)
        if self.name == "none":
            return torch.ones(n, dtype=torch.bool, device=encoded.device)
        header = self._header_on(encoded.device)
        ok = (encoded[:, :HEADER_BYTES] == header).all(dim=1)
        if self.name == "fp8":
            ok &= (self._field(encoded, "scales") != 255).all(dim=1)
        else:
            for name in ("key_scale", "key_zero", "value_scale", "value_zero"):
                params = self._field(encoded, name).view(torch.float16)
                ok &= torch.isfinite(params).all(dim=1)
                if name.endswith("scale"):  # a scale is never negative
                    ok &= (params >= 0).all(dim=1)
        return ok

    def _check_rows(self, encoded: torch.Tensor) -> None:
        """Rows of another size or dtype are the caller's error (valid() judges the rest)."""
        if encoded.dtype != torch.uint8 or encoded.dim() != 2 \
                or encoded.shape[1] != self.encoded_bytes:
            raise CodecError(f"decode: encoded rows must be [n, {self.encoded_bytes}] uint8, "
                             f"got {list(encoded.shape)} {encoded.dtype}")

    def decode(self, encoded: torch.Tensor) -> torch.Tensor:
        """[n, encoded_bytes] uint8 -> [n, *block_shape] of the codec's dtype, on the rows'
        device. Raises CodecError for rows of the wrong size; check `valid` first for the
        rest (decode does not look at the header, so it stays free of host syncs)."""
        self._check_rows(encoded)
        n = encoded.shape[0]
        if self.name == "none":
            return encoded.contiguous().view(self.dtype).reshape(n, *self.block_shape)
        out = torch.empty((n, *self.block_shape), dtype=self.dtype, device=encoded.device)
        for start, rows in self.decode_chunks(encoded):
            out[start:start + rows.shape[0]] = rows
        return out

    def decode_chunks(self, encoded: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """decode() a few rows at a time on a CPU (all at once on a GPU): (first row, its
        decoded rows) each, so a caller that scatters each chunk where it goes never holds
        the whole batch decoded (on a CPU, 2-4x faster than decode() and a copy)."""
        self._check_rows(encoded)
        n = encoded.shape[0]
        if self.name == "none":
            yield 0, self.decode(encoded)
            return
        step = _chunk_rows(encoded.device, n)
        for start in range(0, n, step):
            chunk = encoded[start:start + step]
            x = self._decode_fp8(chunk) if self.name == "fp8" else self._decode_int4(chunk)
            yield start, x.to(self.dtype)

    def _field(self, encoded: torch.Tensor, name: str) -> torch.Tensor:
        f = self._fields[name]
        return encoded[:, f.offset:f.offset + f.nbytes].contiguous()

    def _decode_fp8(self, encoded: torch.Tensor) -> torch.Tensor:
        n = encoded.shape[0]
        layers, parts, tokens, heads, dim = self.block_shape
        scale = torch.exp2(self._field(encoded, "scales").float() - 127)  # exact powers of 2
        x = self._field(encoded, "codes").view(torch.float8_e4m3fn).float()
        x.view(n, layers * parts * tokens * heads, dim).mul_(scale.unsqueeze(-1))  # in place
        return x.reshape(n, *self.block_shape)

    def _decode_int4(self, encoded: torch.Tensor) -> torch.Tensor:
        n = encoded.shape[0]
        layers, _, tokens, heads, dim = self.block_shape
        kshape = (n, layers, tokens // self.key_group, 1, heads, dim)
        vshape = (n, layers, tokens, heads, dim // self.value_group, 1)

        def param(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return self._field(encoded, name).view(torch.float16).float().reshape(shape)

        kq = _unpack(self._field(encoded, "key_codes")).float()
        vq = _unpack(self._field(encoded, "value_codes")).float()
        keys = kq.reshape(n, layers, tokens // self.key_group, self.key_group, heads, dim)
        keys = keys * param("key_scale", kshape) + param("key_zero", kshape)
        values = vq.reshape(n, layers, tokens, heads, dim // self.value_group, self.value_group)
        values = values * param("value_scale", vshape) + param("value_zero", vshape)
        return torch.stack([keys.reshape(n, layers, tokens, heads, dim),
                            values.reshape(n, layers, tokens, heads, dim)], dim=2)


def _quantise(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit over `dim` of float32 x: (scale f16, zero f16, codes uint8 0..15).
    zero is the minimum rounded down to float16 and scale the range / 15 rounded up, so every
    value lands in 0..15 * scale above zero and the error is at most scale / 2."""
    low = x.amin(dim=dim, keepdim=True)
    high = x.amax(dim=dim, keepdim=True)
    zero = low.to(torch.float16)
    zero = torch.where(zero.float() > low, torch.nextafter(zero, _toward(zero, -math.inf)), zero)
    zero32 = zero.float()
    exact = (high - zero32) / 15
    scale = exact.to(torch.float16)
    scale = torch.where(scale.float() < exact, torch.nextafter(scale, _toward(scale, math.inf)),
                        scale)
    scale32 = scale.float()
    inverse = torch.where(scale32 > 0, 1.0 / scale32, torch.zeros_like(scale32))
    codes = torch.round((x - zero32) * inverse).clamp(0, 15).to(torch.uint8)
    return scale, zero, codes


def _toward(x: torch.Tensor, value: float) -> torch.Tensor:
    return torch.full_like(x, value)


def _bytes_of(params: torch.Tensor) -> torch.Tensor:
    """float16 parameters [n, ...] as their bytes [n, 2 * count]."""
    return params.reshape(params.shape[0], -1).contiguous().view(torch.uint8)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """[n, 2m] values 0..15 -> [n, m] bytes: element 2i low nibble, 2i+1 high nibble."""
    pairs = codes.reshape(codes.shape[0], -1, 2)
    return pairs[:, :, 0] | (pairs[:, :, 1] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of _pack: [n, m] bytes -> [n, 2m] values 0..15."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def namespace_suffix(name: str, option: str = "store_codec") -> str:
    """What codec `name` adds to a namespace: nothing for `none` (raw blocks keep hitting),
    else the codec and its layout version, so a block encoded one way is never read another.
    CodecError naming `option` for a name that is no codec."""
    if name not in CODECS:
        raise CodecError(f"{option} must be one of {CODECS}, got {name!r}")
    return "" if name == "none" else f"-codec.{name}.v1"


def codec_for(name: str, block_shape: tuple[int, ...], dtype: torch.dtype,
              option: str = "store_codec") -> BlockCodec:
    """The codec `name` for blocks of block_shape and dtype (CodecError naming `option` if
    the name or the layout does not fit)."""
    return BlockCodec(name, block_shape, dtype, option)
