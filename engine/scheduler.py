"""Continuous batching (pure: no torch, no clock). Each step picks what the model computes:
running sequences first (decodes, and the rest of chunked prefills), then waiting sequences in
arrival order (FCFS) while a token budget, a sequence limit and the block pool allow. When a
running sequence cannot get a block, the newest running sequence is preempted: its blocks are
freed and it is recomputed later (its finished blocks usually come back as prefix-cache hits).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

from kvstore.engine.block_manager import BlockManager
from kvstore.engine.errors import InvalidRequestError
from kvstore.engine.sequence import SeqStatus, Sequence
from kvstore.keys import BlockKey

PREEMPTION_MODES = ("recompute", "swap")


class PrefixSource(Protocol):
    """Where blocks past the local prefix cache can come from (the store connector)."""

    def matched_tokens(self, token_ids: Seq[int], local_tokens: int) -> int:
        """Tokens past local_tokens (a block multiple) it can load, in whole blocks, leaving
        at least the last token to compute."""
        ...


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    """Sequences in one step at most."""
    max_num_batched_tokens: int = 2048
    """Tokens computed in one step at most (the per-step token budget)."""
    max_model_len: int = 2048
    """Prompt plus generated tokens of one sequence at most."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so decodes keep running beside them."""
    preemption_mode: str = "recompute"
    """What a preempted sequence's blocks do: "recompute" (dropped) or "swap" (written to the
    store, loaded back on resume; what the store cannot give back is recomputed)."""

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise InvalidRequestError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    """Tokens computed this step, starting at seq.num_computed_tokens."""
    block_table: list[int]
    num_samples: int
    """Tokens to sample after this step: 0 for a prefill chunk that does not reach the end of
    the known tokens, n for a request's first token, else 1."""
    load_first_block: int = 0
    load_num_blocks: int = 0
    """Blocks load_first_block.. of the table to load from the store before the forward pass,
    instead of computing them (already counted in seq.num_computed_tokens)."""


@dataclass
class BlockRun:
    """Full blocks of one sequence leaving the engine's cache for the store."""

    keys: list[BlockKey]
    block_ids: list[int]
    parent: BlockKey | None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    """Copy-on-write (src, dst) block pairs to copy before the forward pass."""
    preempted: list[Sequence] = field(default_factory=list)
    swapped_out: list[BlockRun] = field(default_factory=list)
    """Preempted sequences' blocks, to copy out before this step's forward pass reuses them."""
    filled: list[BlockRun] = field(default_factory=list)
    """Blocks that became full in this step (set by update), to offload."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        block_size: int,
        eos_token_ids: tuple[int, ...] = (),
        external: PrefixSource | None = None,
    ) -> None:
        self.config = config
        self.external = external
        self.blocks = block_manager
        self.block_size = block_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- admission ------------------------------------------------------------------------
    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Raise InvalidRequestError when a prompt can never be served: longer than the
        context, or needing more blocks than the whole pool."""
        if prompt_len == 0:
            raise InvalidRequestError("prompt is empty; give at least one token")
        limit = self.config.max_model_len
        if prompt_len >= limit:
            raise InvalidRequestError(
                f"prompt is {prompt_len} tokens; max_model_len is {limit}, which must leave "
                "room for at least one generated token"
            )
        if (
            not self.config.enable_chunked_prefill
            and prompt_len > self.config.max_num_batched_tokens
        ):
            raise InvalidRequestError(
                f"prompt is {prompt_len} tokens, more than max_num_batched_tokens "
                f"({self.config.max_num_batched_tokens}) with chunked prefill off"
            )
        longest = min(prompt_len + max_tokens, limit)
        need = -(-longest // self.block_size)
        total = self.blocks.stats.num_blocks
        if need > total:
            raise InvalidRequestError(
                f"a sequence of {longest} tokens needs {need} KV blocks; the cache has {total} "
                "(raise the KV cache size or lower max_tokens)"
            )

    def add(self, seq: Sequence) -> None:
        self.check(seq.num_prompt_tokens, seq.params.max_tokens)
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.copies = self.blocks.take_copies()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(len(seq) - seq.num_computed_tokens, budget)
            table = self.blocks.allocate(
                seq.seq_id, seq.token_ids, seq.num_computed_tokens + num_new
            )
            while table is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
                table = self.blocks.allocate(
                    seq.seq_id, seq.token_ids, seq.num_computed_tokens + num_new
                )
            if table is None:
                break
            out.scheduled.append(ScheduledSeq(seq, num_new, table, self._samples(seq, num_new)))
            budget -= num_new
            index += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hit = None
            loaded = 0
            if seq.num_computed_tokens == 0:
                hit = self.blocks.find_prefix(seq.token_ids)
                loaded = self._store_match(seq, hit.num_tokens)
                seq.num_computed_tokens = hit.num_tokens + loaded
            num_new = len(seq) - seq.num_computed_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                self._undo_hit(seq, hit)
                break
            num_new = min(num_new, budget)
            table = self.blocks.allocate(
                seq.seq_id, seq.token_ids, seq.num_computed_tokens + num_new, hit
            )
            if table is None:
                self._undo_hit(seq, hit)
                break
            self.waiting.popleft()
            seq.store_match = None  # readmitted after a preemption, it asks again
            if hit is not None:
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = hit.num_tokens + loaded
                    seq.num_store_tokens = loaded
                seq.num_stored_blocks = seq.num_computed_tokens // self.block_size
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            item = ScheduledSeq(seq, num_new, table, self._samples(seq, num_new))
            if loaded and hit is not None:
                item.load_first_block = hit.num_tokens // self.block_size
                item.load_num_blocks = loaded // self.block_size
            out.scheduled.append(item)
            budget -= num_new

    def _store_match(self, seq: Sequence, local_tokens: int) -> int:
        """Tokens the store holds past the local hit. A waiting head that cannot be admitted
        yet keeps its answer while its local hit stays the same, instead of one Lookup per
        step; a stale answer costs nothing wrong, as loads recompute what did not arrive."""
        if self.external is None:
            return 0
        loaded: int
        if seq.store_match is not None and seq.store_match[0] == local_tokens:
            loaded = seq.store_match[1]
        else:
            loaded = self.external.matched_tokens(seq.token_ids, local_tokens)
            seq.store_match = (local_tokens, loaded)
        return loaded

    @staticmethod
    def _undo_hit(seq: Sequence, hit: object) -> None:
        if hit is not None:
            seq.num_computed_tokens = 0

    def _samples(self, seq: Sequence, num_new: int) -> int:
        if seq.num_computed_tokens + num_new < len(seq):
            return 0
        if not seq.forked and not seq.output_token_ids:
            return int(seq.params.n)
        return 1

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        # The victim is the newest running sequence, never one already scheduled this step.
        self.running.remove(seq)
        if self.config.preemption_mode == "swap":
            keys = self.blocks.keys_of(seq.seq_id)
            table = self.blocks.block_table(seq.seq_id)[: len(keys)]
            out.swapped_out.append(BlockRun(keys, table, None))
        self.blocks.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    # -- after the forward pass -----------------------------------------------------------
    def update(
        self,
        out: SchedulerOutput,
        sampled: dict[int, list[int]],
        new_seq_id: Callable[[], int],
    ) -> tuple[list[Sequence], list[Sequence]]:
        """Record one step: computed tokens, sampled tokens, forks, and finished sequences.
        Returns (sequences that got a token this step incl. new forks, finished sequences)."""
        stepped: list[Sequence] = []
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.blocks.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            self._note_filled(seq, out)
            tokens = sampled.get(seq.seq_id, [])
            if not tokens:
                continue
            seq.output_token_ids.append(tokens[0])
            stepped.append(seq)
            if len(tokens) > 1:
                stepped.extend(self._fork(seq, tokens[1:], new_seq_id))
            seq.forked = True
        finished = [seq for seq in stepped if self._check_finished(seq)]
        for seq in finished:
            self.finish(seq, seq.finish_reason or "stop")
        return stepped, finished

    def _note_filled(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Record seq's blocks that became full (and keyed) since the last offload."""
        if self.external is None:
            return
        done = seq.num_stored_blocks
        num_keys = self.blocks.num_keys(seq.seq_id)  # most steps fill no block: copy nothing
        if num_keys <= done:
            return
        keys = self.blocks.keys_of(seq.seq_id, max(0, done - 1))
        parent = keys.pop(0) if done else None
        table = self.blocks.block_table(seq.seq_id)[done:num_keys]
        out.filled.append(BlockRun(keys, table, parent))
        seq.num_stored_blocks = num_keys

    def _fork(
        self, parent: Sequence, tokens: list[int], new_seq_id: Callable[[], int]
    ) -> list[Sequence]:
        children = []
        for offset, token in enumerate(tokens, start=1):
            child = Sequence(
                seq_id=new_seq_id(),
                request_id=parent.request_id,
                prompt_token_ids=parent.prompt_token_ids,
                params=parent.params,
                output_token_ids=parent.output_token_ids[:-1] + [token],
                num_computed_tokens=parent.num_computed_tokens,
                num_cached_tokens=parent.num_cached_tokens,
                num_store_tokens=parent.num_store_tokens,
                num_stored_blocks=parent.num_stored_blocks,
                status=SeqStatus.RUNNING,
                forked=True,
                child_index=offset,
            )
            self.blocks.fork(parent.seq_id, child.seq_id)
            self.running.append(child)
            children.append(child)
        return children

    def _check_finished(self, seq: Sequence) -> bool:
        last = seq.output_token_ids[-1]
        params = seq.params
        if not params.ignore_eos and last in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif last in params.stop_token_ids:
            seq.finish_reason = "stop"
        elif (
            len(seq.output_token_ids) >= params.max_tokens or len(seq) >= self.config.max_model_len
        ):
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (also used for stop strings and aborts) and release its blocks."""
        seq.finish_reason = reason
        seq.status = SeqStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id)
