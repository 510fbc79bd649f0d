"""One sequence being generated: its tokens, how many of them are in the KV cache, and why it
finished. Pure data, shared by the scheduler (which moves it between queues) and the runner
(which feeds its tokens to the model)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvstore.engine.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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
    num_stored_blocks: int = 0
    """Leading full blocks already in the store (offloaded, or loaded from it)."""
    store_match: tuple[int, int] | None = None
    """While waiting: (local hit tokens, tokens the store holds past them) from the last
    Lookup, so a head that cannot be admitted yet does not ask the store every step."""
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
