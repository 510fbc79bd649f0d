"""`PagedKV` told its layout: MLA's latent cache (one vector per token and layer, no K/V
split) is named in the signature, so its blocks never pass for K/V blocks, round-trips bit for
bit like a K/V cache, and a K/V-shaped tensor registered as latent is refused, naming it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvstore.integrations.paged import KV, LATENT, PagedKV  # noqa: E402

NUM_BLOCKS, BLOCK, WIDTH = 12, 16, 576


def _latent(seed: int | None, head_dim_of_one: bool) -> list[tuple[str, torch.Tensor]]:
    """Two layers of [blocks, (1,) block_size, latent width]: the GPU and CPU MLA shapes."""
    shape = (NUM_BLOCKS, 1, BLOCK, WIDTH) if head_dim_of_one else (NUM_BLOCKS, BLOCK, WIDTH)
    gen = torch.Generator().manual_seed(seed or 0)
    return [(f"l{i}", torch.randint(-(2**15), 2**15, shape, dtype=torch.int16,
                                    generator=gen).view(torch.bfloat16)
             if seed is not None else torch.zeros(shape, dtype=torch.bfloat16))
            for i in range(2)]


@pytest.mark.parametrize("head_dim_of_one", [False, True])
def test_latent_blocks_round_trip_bit_exact_into_other_block_ids(head_dim_of_one: bool) -> None:
    source = _latent(3, head_dim_of_one)
    paged = PagedKV(source, NUM_BLOCKS, LATENT)
    assert paged.layout == LATENT
    assert paged.block_bytes == 2 * BLOCK * WIDTH * 2
    rows = paged.gather([7, 2, 9])
    target = _latent(None, head_dim_of_one)
    PagedKV(target, NUM_BLOCKS, LATENT).scatter(rows, [0, 11, 4])
    for (_, got), (_, want) in zip(target, source, strict=True):
        assert torch.equal(got[[0, 11, 4]].view(torch.int16), want[[7, 2, 9]].view(torch.int16))
        assert not got[[1, 2, 3, 5, 6, 7, 8, 9, 10]].view(torch.int16).any()


def test_the_signature_names_the_layout() -> None:
    layers = _latent(1, head_dim_of_one=False)
    assert PagedKV(layers, NUM_BLOCKS, LATENT).signature() == (
        f"latent 2L/torch.bfloat16:{BLOCK}x{WIDTH}")
    assert PagedKV(layers, NUM_BLOCKS, KV).signature() == f"kv 2L/torch.bfloat16:{BLOCK}x{WIDTH}"


def test_a_kv_cache_registered_as_latent_is_refused_naming_the_layer() -> None:
    kv = [("model.layers.0.attn", torch.zeros(NUM_BLOCKS, 2, BLOCK, 128))]  # 2 KV heads
    with pytest.raises(ValueError, match=r"model\.layers\.0\.attn: a latent \(MLA\) block"):
        PagedKV(kv, NUM_BLOCKS, LATENT)
    with pytest.raises(ValueError, match="layout must be one of kv, latent"):
        PagedKV(kv, NUM_BLOCKS, "mla")
