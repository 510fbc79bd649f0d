"""Random paged-KV fixtures shared by the kernel tests (CPU reference and GPU parity)."""

from __future__ import annotations

import torch


def random_tables(lens: list[int], block_size: int, num_blocks: int, width: int,
                  gen: torch.Generator) -> torch.Tensor:
    """Distinct random blocks per sequence, in no order; -1 past each sequence's last block."""
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    for s, ctx in enumerate(lens):
        used = -(-ctx // block_size)
        tables[s, :used] = torch.tensor([pool.pop() for _ in range(used)], dtype=torch.int32)
    return tables
