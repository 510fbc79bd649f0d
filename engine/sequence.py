"""One sequence being generated: its tokens, how many of them are in the KV cache, and why it
finished. Pure data, shared by the scheduler (which moves it between queues) and the runner
(which feeds its tokens to the model)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvstore.engine.sampling import SamplingParams
from kvstore.keys import BlockKey


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"
    """Waiting while its store hit is read into the KV cache (it holds those blocks)."""
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class StoreAnswer:
    """What the store holds of a waiting sequence past its local hit, and what to do with it."""

    first_block: int
    """The local hit, in blocks, the lookup started after."""
    hit_blocks: int
    """Blocks past first_block the store holds."""
    load_blocks: int
    """Of those, the leading blocks to load (the rest are recomputed: cheaper, by cost)."""
    reason: str = ""
    """Why, in a few words (the request's metrics carry it)."""
    tier: str = ""
    """The slowest tier the blocks to load lie in."""


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Leading tokens whose K/V are in the cache (computed or served from the prefix cache)."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache or the store at first admission."""
    num_store_tokens: int = 0
    """Of those, the tokens loaded from the store."""
    store_loaded_bytes: int = 0
    """The bytes those loaded blocks took from the store (blocks x the connector's block
    bytes; under a sliding window only the window's blocks are loaded)."""
    num_store_recomputed_tokens: int = 0
    """Prompt tokens the store held that were computed instead (loading them was slower)."""
    store_reason: str = ""
    """Why those tokens were loaded or computed (the load-or-recompute decision)."""
    num_stored_blocks: int = 0
    """Leading full blocks already in the store (offloaded, or loaded from it)."""
    block_keys: list[BlockKey] = field(default_factory=list)
    """The chained keys of its full blocks, computed once each as its tokens become known."""
    store_answer: StoreAnswer | None = None
    """While waiting: the last Lookup's answer, so a sequence that cannot be admitted yet does
    not ask the store every step."""
    store_pending: bool = False
    """A Lookup for it is in flight."""
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    forked: bool = False
    """True once this sequence's first tokens were sampled (n > 1 children exist by then)."""
    child_index: int = 0
    """Which of the request's n samples this is (0 for the first)."""
    first_token_s: float | None = None
    last_token_s: float | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
