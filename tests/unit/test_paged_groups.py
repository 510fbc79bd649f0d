"""`PagedKV` over a hybrid model's KV-cache groups (vLLM's hybrid manager: sliding-window
layers beside full-attention ones, each group with block ids of its own, here sharing one
buffer as vLLM lays them out): a stored block is every layer's slice of one position in model
order, and a load writes nothing where a group holds no block (-1: slid out of its window)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvstore.integrations.paged import PagedKV  # noqa: E402

NUM_BLOCKS = 16
SHAPE = (NUM_BLOCKS, 2, 8, 32)  # vLLM's CPU layout: [blocks, kv_heads, block_size, K|V dim]


def _hybrid(seed: int | None) -> tuple[list[tuple[str, torch.Tensor]], list[int]]:
    """Layers 0 and 2 sliding (group 0), layer 1 full (group 1), as views of one buffer: the
    layers and each one's group."""
    gen = torch.Generator().manual_seed(seed or 0)
    buf = (torch.randint(-(2**15), 2**15, (2, *SHAPE), dtype=torch.int16, generator=gen)
           if seed is not None else torch.zeros((2, *SHAPE), dtype=torch.int16))
    return [("l0", buf[0]), ("l1", buf[1]), ("l2", buf[0])], [0, 1, 0]


def test_each_group_is_read_and_written_at_its_own_block_ids() -> None:
    source, groups = _hybrid(5)
    paged = PagedKV(source, NUM_BLOCKS, groups=groups)
    assert paged.num_groups == 2 and not paged.direct
    rows = paged.gather([3, 4], more_groups=[[9, 10]])
    (_, s0), (_, s1), _ = source
    width = paged.layer_bytes[0]
    assert rows[0, :width].numpy().tobytes() == s0[3].numpy().tobytes()
    assert rows[0, width:2 * width].numpy().tobytes() == s1[9].numpy().tobytes()
    assert rows[1, 2 * width:].numpy().tobytes() == s0[4].numpy().tobytes()

    target, _ = _hybrid(None)
    # The sliding group holds no block at the first position (it slid out): -1.
    PagedKV(target, NUM_BLOCKS, groups=groups).scatter(rows, [-1, 7], more_groups=[[1, 2]])
    (_, t0), (_, t1), _ = target
    assert torch.equal(t1[[1, 2]], s1[[9, 10]])  # the full group: every position
    assert torch.equal(t0[7], s0[4])  # the sliding group: only the position it holds
    assert not t0[[b for b in range(NUM_BLOCKS) if b != 7]].any()
    assert not t1[[b for b in range(NUM_BLOCKS) if b not in (1, 2)]].any()


def test_block_ids_for_the_wrong_number_of_groups_are_refused() -> None:
    source, groups = _hybrid(1)
    paged = PagedKV(source, NUM_BLOCKS, groups=groups)
    with pytest.raises(ValueError, match="block ids for 1 groups"):
        paged.gather([1, 2])
    with pytest.raises(ValueError, match="positions"):
        paged.gather([1, 2], more_groups=[[3]])
    with pytest.raises(ValueError, match="none empty"):
        PagedKV(source, NUM_BLOCKS, groups=[0, 2, 0])
