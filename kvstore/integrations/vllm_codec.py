"""A lossy block codec (`codecs`, docs/codecs.md) between vLLM's paged KV cache and the store:
the vLLM connector's `codec` option. The worker gathers a KV-cache group's blocks as it does
without a codec (`PagedKV` rows: each layer's slice in its tensor's element order), and this
module turns such rows into the codec's blocks, [layers, 2 (K, V), block_tokens, kv_heads,
head_dim], and back, so that an encoded block is laid out as the engine's are.

Where K and V sit in a layer's slice is the attention backend's choice. vLLM's logical layer
view is [blocks, kv_heads, block_tokens, content]; for K/V attention the content is
2 x head_dim, read two ways:

- `CPU_ATTN` (vLLM's CPU backend) views each head's [block_tokens, 2 * head_dim] as
  [2 * block_tokens, head_dim] and splits it in halves: a head's keys, then its values
  ([kv_heads, 2, block_tokens, head_dim]);
- `FLASH_ATTN` splits the content itself: per token its key, then its value
  ([kv_heads, block_tokens, 2, head_dim]).

A latent cache (Multi-head Latent Attention, `paged.LATENT`: [block_tokens, width] per layer,
after dimensions of 1) is one vector per token: `fp8` scales each, `int4` does not apply.
Other backends are refused at registration, naming the option and the backend.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from kvstore.integrations.codecs import BlockCodec, CodecError, codec_for
from kvstore.integrations.paged import LATENT, PagedKV

OPTION = "kv_connector_extra_config.codec"
HALVES = "halves"
"""Per head, all the block's keys then all its values (vLLM's CPU backend)."""
PER_TOKEN = "per_token"
"""Per head and token, its key then its value (FlashAttention)."""
BACKEND_ORDERS = {"CPU_ATTN": HALVES, "FLASH_ATTN": PER_TOKEN}


class RowCodec:
    """One KV-cache group's codec: encodes `PagedKV` rows ([n, block_bytes] uint8) into
    [n, encoded_bytes] uint8 and decodes them back, on the rows' device."""

    def __init__(self, name: str, paged: PagedKV, backends: Sequence[str | None],
                 block_size: int) -> None:
        """name: the codec (not `none`); paged: the group's layers; backends: each layer's
        attention backend name (vLLM's `get_name()`, None when unknown); block_size: tokens
        per block. CodecError, naming the option, when the codec cannot apply."""
        dtypes = {t.dtype for t in paged.tensors}
        shapes = {tuple(s) for s in paged.shapes}
        if len(dtypes) != 1 or len(shapes) != 1:
            raise CodecError(f"{OPTION} {name}: the layers of a KV-cache group must share one "
                             f"dtype and block shape, got {sorted(map(str, dtypes))} "
                             f"{sorted(shapes)}")
        self.dtype = next(iter(dtypes))
        shape = next(iter(shapes))
        layers = len(paged.tensors)
        self.order: str | None = None
        if paged.layout == LATENT:
            block = (layers, 1, block_size, 1, shape[-1])
            if shape[-2] != block_size:
                raise CodecError(f"{OPTION} {name}: a latent block of {block_size} tokens, "
                                 f"got {list(shape)}")
        else:
            order = {BACKEND_ORDERS.get(b or "") for b in backends}
            if len(order) != 1 or None in order:
                raise CodecError(f"{OPTION} {name}: needs the K/V layout of the attention "
                                 f"backend; known: {', '.join(BACKEND_ORDERS)}, got "
                                 f"{sorted({str(b) for b in backends})}")
            self.order = order.pop()
            if len(shape) != 3 or shape[1] != block_size or shape[2] % 2:
                raise CodecError(f"{OPTION} {name}: a layer's block must be [kv_heads, "
                                 f"{block_size}, 2 * head_dim], got {list(shape)}")
            block = (layers, 2, block_size, shape[0], shape[2] // 2)
        self.codec: BlockCodec = codec_for(name, block, self.dtype, OPTION)
        self.block_bytes = paged.block_bytes
        if self.codec.raw_bytes != self.block_bytes or math.prod(block) * \
                self.dtype.itemsize != self.block_bytes:
            raise CodecError(f"{OPTION} {name}: {self.block_bytes}-byte rows are not blocks "
                             f"of {list(block)} {self.dtype}")

    @property
    def encoded_bytes(self) -> int:
        return self.codec.encoded_bytes

    def _blocks(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [n, block_bytes] uint8 -> blocks [n, L, 2, T, H, D] of the cache's dtype."""
        n = rows.shape[0]
        layers, parts, tokens, heads, dim = self.codec.block_shape
        x = rows.view(self.dtype)
        if self.order is None:  # latent: [L, T, W] is [L, 1, T, 1, W] already
            return x.reshape(n, *self.codec.block_shape)
        if self.order == HALVES:
            return x.reshape(n, layers, heads, 2, tokens, dim).permute(0, 1, 3, 4, 2, 5)
        return x.reshape(n, layers, heads, tokens, 2, dim).permute(0, 1, 4, 3, 2, 5)

    def _rows(self, blocks: torch.Tensor) -> torch.Tensor:
        """The inverse of _blocks: [n, L, 2, T, H, D] -> [n, block_bytes] uint8."""
        n = blocks.shape[0]
        if self.order == HALVES:
            blocks = blocks.permute(0, 1, 4, 2, 3, 5)
        elif self.order == PER_TOKEN:
            blocks = blocks.permute(0, 1, 4, 3, 2, 5)
        return blocks.contiguous().view(torch.uint8).reshape(n, self.block_bytes)

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, block_bytes] uint8 rows -> [n, encoded_bytes] uint8, on the rows' device."""
        return self.codec.encode(self._blocks(rows).contiguous())

    def valid(self, encoded: torch.Tensor) -> torch.Tensor:
        """Per encoded row, whether it is a block this codec wrote (`BlockCodec.valid`)."""
        return self.codec.valid(encoded)

    def decode_chunks(self, encoded: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, its decoded rows [m, block_bytes] uint8) a few rows at a time on a
        CPU, all at once on a GPU (`BlockCodec.decode_chunks`)."""
        for start, blocks in self.codec.decode_chunks(encoded):
            yield start, self._rows(blocks)
