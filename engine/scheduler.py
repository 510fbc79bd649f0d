"""Continuous batching (pure: no torch, no clock, no I/O). Each step picks what the model
computes: running sequences first (decodes, and the rest of chunked prefills), then waiting
sequences in arrival order (FCFS) while a token budget, a sequence limit and the block pool
allow. When a running sequence cannot get a block, the newest running sequence is preempted:
its blocks are freed and it is recomputed later (its finished blocks usually come back as
prefix-cache hits).

With a store, nothing here waits on it. A waiting sequence whose full blocks go past its local
hit is first asked about (`SchedulerOutput.lookups`: the engine starts the Lookup and answers
with `lookup_done`); while the answer is out it keeps its place in the queue and the sequences
behind it may go first. When the answer says to load blocks, they are allocated and the
sequence waits LOADING (`SchedulerOutput.loads`) while the batch keeps stepping; `load_done`
registers the blocks that arrived in the prefix cache and releases the sequence's table, so its
next admission takes them as a local hit and computes the rest, from the first block that did
not arrive. Several sequences load at once; none of it changes a token of the output.

With a sliding window (the block manager's), a sequence needs only the blocks its window and
one step span (admission counts that bound), and a load fills only the blocks the window
covers before its cut.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvstore.engine.block_manager import FREED, BlockManager, PrefixHit
from kvstore.engine.errors import InvalidRequestError
from kvstore.engine.sequence import SeqStatus, Sequence, StoreAnswer
from kvstore.keys import BlockKey

PREEMPTION_MODES = ("recompute", "swap")


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


@dataclass
class LookupPlan:
    """Ask the store how many of keys (blocks first_block.. of seq) it holds."""

    seq: Sequence
    first_block: int
    keys: list[BlockKey]


@dataclass
class LoadPlan:
    """Read keys (blocks first_block.. of seq) from the store into block_ids of the cache."""

    seq: Sequence
    first_block: int
    keys: list[BlockKey]
    block_ids: list[int]


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
    lookups: list[LookupPlan] = field(default_factory=list)
    """Store lookups to start (answered with Scheduler.lookup_done)."""
    loads: list[LoadPlan] = field(default_factory=list)
    """Store loads to start (answered with Scheduler.load_done)."""

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
        store: bool = False,
    ) -> None:
        self.config = config
        self.store = store
        self.store_up = store
        """Whether to ask the store now (the engine clears it while the store is off)."""
        self.blocks = block_manager
        self.block_size = block_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._loads: dict[int, LoadPlan] = {}  # by seq_id: loads in flight
        self._lookups = 0  # lookups in flight
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
        # With a sliding window the blocks that slid out are released as it grows: it needs
        # only those its window and one step span at once. A step may compute up to the
        # whole budget of its tokens (a recompute after a preemption does), so the bound
        # includes one step's worth.
        need = self.blocks.max_blocks_held(
            longest, min(longest, self.config.max_num_batched_tokens))
        total = self.blocks.stats.num_blocks
        if need > total:
            raise InvalidRequestError(
                f"a sequence of {longest} tokens needs {need} KV blocks; the cache has {total} "
                "(raise the KV cache size or lower max_tokens)"
            )

    def add(self, seq: Sequence) -> None:
        self.check(seq.num_prompt_tokens, seq.params.max_tokens)
        seq.status = SeqStatus.WAITING
        self.blocks.extend_keys(seq.block_keys, seq.token_ids)
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def waiting_on_store(self) -> bool:
        """A lookup or a load is in flight: a step that computes nothing may wait for it."""
        return bool(self._lookups or self._loads)

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
            table = self.blocks.allocate(seq.seq_id, seq.num_computed_tokens + num_new)
            while table is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
                table = self.blocks.allocate(seq.seq_id, seq.num_computed_tokens + num_new)
            if table is None:
                break
            out.scheduled.append(ScheduledSeq(seq, num_new, table, self._samples(seq, num_new)))
            budget -= num_new
            index += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if seq.status is SeqStatus.LOADING or seq.store_pending:
                continue  # keeps its place; the sequences behind it may go first
            # A waiting sequence holds no blocks (a preemption or a finished load released
            # them): what it has computed is its local hit.
            hit = self.blocks.find_prefix(seq.block_keys, len(seq))
            ask = self._ask_store(seq, hit, out)
            if ask == "wait":
                continue
            if ask == "full":
                return
            num_new = len(seq) - hit.num_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                return
            num_new = min(num_new, budget)
            table = self.blocks.allocate(seq.seq_id, hit.num_tokens + num_new, hit)
            if table is None:
                return
            self.waiting.remove(seq)
            seq.num_computed_tokens = hit.num_tokens
            seq.store_answer = None  # readmitted after a preemption, it asks again
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = hit.num_tokens
            seq.num_stored_blocks = hit.num_tokens // self.block_size
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new, table, self._samples(seq, num_new)))
            budget -= num_new

    def _ask_store(self, seq: Sequence, hit: PrefixHit, out: SchedulerOutput) -> str:
        """What the store means for a waiting sequence at admission: "admit" (nothing to
        load: compute past the local hit), "wait" (a lookup or a load was started: skip it
        this step), "full" (no room for the blocks to load: stop admitting, FCFS)."""
        first = hit.num_tokens // self.block_size
        last = (len(seq) - 1) // self.block_size  # the last token is always computed
        if not self.store_up or last <= first:
            return "admit"
        answer = seq.store_answer
        if answer is None or answer.first_block > first:  # none yet, or the local hit shrank
            if self._lookups + len(self._loads) >= self.config.max_num_seqs:
                return "full"
            seq.store_pending = True
            self._lookups += 1
            out.lookups.append(LookupPlan(seq, first, seq.block_keys[first:last]))
            return "wait"
        # Blocks past the local hit still to load (the local hit may have grown since).
        count = min(answer.first_block + answer.load_blocks, last) - first
        if count <= 0:
            return "admit"
        if len(self._loads) + len(self.running) >= self.config.max_num_seqs:
            return "full"
        cut = first + count
        table = self.blocks.allocate(seq.seq_id, cut * self.block_size, hit)
        if table is None:
            return "full"
        # Under a sliding window only the blocks the window covers before the cut are
        # loaded (when the sink blocks, if any, are in the local hit already); the others
        # are released at once, and the re-admission's windowed hit does not need them.
        start = first
        if self.blocks.sink_blocks <= first:
            start = min(max(first, self.blocks.window_start(cut * self.block_size)), cut - 1)
        if start > first:
            table = self.blocks.release_out_of_window(seq.seq_id)
        plan = LoadPlan(seq, start, seq.block_keys[start:cut], table[start:cut])
        seq.status = SeqStatus.LOADING
        self._loads[seq.seq_id] = plan
        out.loads.append(plan)
        return "wait"

    def lookup_done(self, seq: Sequence, answer: StoreAnswer) -> None:
        """The answer to a LookupPlan; the decision (answer.load_blocks) is the engine's."""
        self._lookups -= 1
        seq.store_pending = False
        if seq.status is not SeqStatus.WAITING or seq.num_computed_tokens:
            return  # admitted meanwhile (the store went off), or finished
        seq.store_answer = answer
        if seq.num_preemptions == 0:
            seq.num_store_recomputed_tokens = (
                (answer.hit_blocks - answer.load_blocks) * self.block_size)
            seq.store_reason = answer.reason

    def load_done(self, seq: Sequence, arrived: int, nbytes: int = 0) -> None:
        """A LoadPlan finished: its first `arrived` blocks hold their keys' K/V (nbytes: what
        they took from the store, for the request's metrics). They join the prefix cache, the
        table is released (blocks that did not arrive go back to the pool), and the sequence
        waits for admission again, which takes them as a local hit."""
        plan = self._loads.pop(seq.seq_id)
        if arrived:
            self.blocks.cache_full_blocks(
                seq.seq_id, seq.block_keys, (plan.first_block + arrived) * self.block_size)
        self.blocks.free(seq.seq_id)
        if seq.status is not SeqStatus.LOADING:
            return  # finished while loading
        seq.status = SeqStatus.WAITING
        missing = len(plan.keys) - arrived
        if seq.num_preemptions == 0:
            seq.num_store_tokens = arrived * self.block_size
            seq.store_loaded_bytes = nbytes
            seq.num_store_recomputed_tokens += missing * self.block_size
            if missing:
                seq.store_reason = (f"{seq.store_reason}; {missing} blocks did not arrive: "
                                    "computed").lstrip("; ")
        answer = seq.store_answer
        if answer is not None and plan.first_block > answer.first_block and missing:
            # A windowed load that fell short: what did arrive may not make a hit (its
            # window is incomplete), so compute from the local hit rather than ask again.
            seq.store_answer = replace(answer, load_blocks=0)
        elif answer is not None:  # nothing more to load from here
            seq.store_answer = replace(answer, first_block=plan.first_block,
                                       load_blocks=arrived)

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
            # Only the run of blocks it still holds after the last one that slid out of its
            # window (all of them without a window): the store has the older ones already,
            # offloaded as they filled.
            first = next((i + 1 for i in range(len(table) - 1, -1, -1) if table[i] == FREED), 0)
            if first == 0 or first < len(table):
                out.swapped_out.append(BlockRun(keys[first:], table[first:],
                                                keys[first - 1] if first else None))
        self.blocks.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.store_answer = None
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
            self.blocks.cache_full_blocks(seq.seq_id, seq.block_keys, seq.num_computed_tokens)
            self._note_filled(seq, out)
            tokens = sampled.get(seq.seq_id, [])
            if not tokens:
                continue
            seq.output_token_ids.append(tokens[0])
            if len(seq) % self.block_size == 0:
                self.blocks.extend_keys(seq.block_keys, seq.token_ids)
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
        if not self.store:
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
                store_loaded_bytes=parent.store_loaded_bytes,
                num_stored_blocks=parent.num_stored_blocks,
                status=SeqStatus.RUNNING,
                forked=True,
                child_index=offset,
            )
            # Its tokens differ from the parent's only in the last one.
            common = parent.block_keys[: (len(child) - 1) // self.block_size]
            child.block_keys = self.blocks.extend_keys(list(common), child.token_ids)
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
        """End a sequence (also used for stop strings and aborts) and release its blocks; a
        loading sequence's blocks stay its load's until load_done (they are being written)."""
        loading = seq.status is SeqStatus.LOADING
        seq.finish_reason = reason
        seq.status = SeqStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if not loading:
            self.blocks.free(seq.seq_id)
