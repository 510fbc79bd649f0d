"""The model runner: turns one scheduler step into tensors (token ids, positions, slot mapping,
block tables), applies copy-on-write copies, runs the model over the paged KV cache and
samples the next tokens. It owns the KV cache tensor and each sequence's random generator."""

from __future__ import annotations

import torch

from kvstore.engine.model import AttentionBatch, CausalLM
from kvstore.engine.sampling import make_generator, sample
from kvstore.engine.scheduler import ScheduledSeq, SchedulerOutput
from kvstore.kernels import KernelOps


def kv_cache_shape(model: CausalLM, num_blocks: int, block_size: int) -> tuple[int, ...]:
    c = model.config
    return (c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        ops: KernelOps,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.ops = ops
        self.block_size = block_size
        self.device = device
        self.kv_cache = torch.zeros(
            kv_cache_shape(model, num_blocks, block_size), dtype=dtype, device=device
        )
        self._generators: dict[int, torch.Generator | None] = {}

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def _generator(self, item: ScheduledSeq) -> torch.Generator | None:
        seq = item.seq
        if seq.seq_id not in self._generators:
            seed = seq.params.seed
            # The i-th of a request's n samples draws from its own stream of the same seed.
            child_seed = None if seed is None else seed + 7919 * seq.child_index
            self._generators[seq.seq_id] = make_generator(child_seed, self.device)
        return self._generators[seq.seq_id]

    def execute(self, out: SchedulerOutput) -> dict[int, list[int]]:
        """Run one step; returns the sampled token ids of each sequence that samples."""
        if out.copies:
            self._copy(out.copies)
        if not out.scheduled:
            return {}
        decodes: list[ScheduledSeq] = []  # one new token that samples: the decode kernel
        prefills: list[ScheduledSeq] = []
        for item in out.scheduled:
            (decodes if item.num_new_tokens == 1 and item.num_samples else prefills).append(item)
        ordered = decodes + prefills
        input_ids, batch = self._prepare(decodes, prefills)
        logits = self.model(input_ids, batch, self.kv_cache, self.ops)
        sampling = [s for s in ordered if s.num_samples]
        tokens = sample(
            logits,
            [s.seq.params for s in sampling],
            [self._generator(s) for s in sampling],
            [s.num_samples for s in sampling],
        )
        return {s.seq.seq_id: t for s, t in zip(sampling, tokens, strict=True)}

    def _copy(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write copies, in order: one batched copy when no destination is also a
        source (the kernels read all sources first), else one pair at a time."""
        sources = {s for s, _ in copies}
        batches = [copies] if not sources & {d for _, d in copies} else [[c] for c in copies]
        for batch in batches:
            src = torch.tensor([s for s, _ in batch], dtype=torch.int64, device=self.device)
            dst = torch.tensor([d for _, d in batch], dtype=torch.int64, device=self.device)
            self.ops.copy_blocks(self.kv_cache, src, dst)

    def _prepare(
        self, decodes: list[ScheduledSeq], prefills: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, AttentionBatch]:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        query_start = [0]
        for index, item in enumerate(decodes + prefills):
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = item.block_table
            size = self.block_size
            slots.extend(table[p // size] * size + p % size for p in range(start, end))
            if item.num_samples:
                logits_indices.append(len(ids) - 1)
            if index >= len(decodes):
                query_start.append(query_start[-1] + item.num_new_tokens)
        batch = AttentionBatch(
            positions=self._long(positions),
            slot_mapping=self._long(slots),
            num_decode_tokens=len(decodes),
            decode_block_tables=self._tables(decodes),
            decode_context_lens=self._int([s.seq.num_computed_tokens + 1 for s in decodes]),
            prefill_block_tables=self._tables(prefills),
            prefill_query_start_loc=self._int(query_start),
            prefill_context_lens=self._int(
                [s.seq.num_computed_tokens + s.num_new_tokens for s in prefills]
            ),
            logits_indices=self._long(logits_indices),
        )
        return self._long(ids), batch

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _int(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    def _tables(self, items: list[ScheduledSeq]) -> torch.Tensor:
        width = max((len(s.block_table) for s in items), default=0)
        rows = [s.block_table + [-1] * (width - len(s.block_table)) for s in items]
        return torch.tensor(rows, dtype=torch.int32, device=self.device).reshape(len(items), width)
