"""What `LLM.generate` returns: per request its completions (text, token ids, why they ended)
and metrics (TTFT, TPOT, prompt tokens served from the prefix cache or the store, the bytes
loaded from it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.engine.sequence import Sequence as Seq

if TYPE_CHECKING:
    from kvstore.engine.tokenizer import Tokenizer

Prompt = str | list[int]


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str | None
    """Decoded text (None without a tokenizer), cut before the first stop string."""
    token_ids: list[int]
    finish_reason: str
    """"stop" (end-of-sequence token, stop token or stop string) or "length"."""


@dataclass(frozen=True)
class RequestMetrics:
    prompt_tokens: int
    cached_prompt_tokens: int
    """Prompt tokens served from the prefix cache or the store instead of computed."""
    store_prompt_tokens: int
    """Of those, the tokens loaded from the store."""
    store_recomputed_tokens: int
    """Prompt tokens the store held that the engine computed instead (loading was expected
    to be slower), or that did not arrive."""
    store_decision: str
    """Why the store's tokens were loaded or computed ("" when the store held none)."""
    generated_tokens: int
    ttft_s: float
    """Arrival to the first generated token."""
    tpot_s: float
    """Mean time between generated tokens after the first (0 for one token)."""
    latency_s: float
    preemptions: int
    store_loaded_bytes: int = 0
    """The bytes the store's hit loaded for this request: the blocks that arrived from the
    store times the connector's block bytes (one block is every layer's K and V of
    block_size tokens). The engine keeps all its layers in one KV-cache group, so this one
    number is that group's (vLLM's connector counts per group). Under a sliding window only
    the blocks the window covers before the cut are loaded, which can be fewer than the hit
    has (0 without a load)."""


@dataclass(frozen=True)
class RequestOutput:
    request_id: int
    prompt: Prompt
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics


def stop_index(text: str, stops: Sequence[str]) -> int | None:
    """Where the earliest stop string starts in text, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def build_output(
    request_id: int,
    prompt: Prompt,
    seqs: list[Seq],
    arrival_s: float,
    tokenizer: Tokenizer | None,
) -> RequestOutput:
    seqs = sorted(seqs, key=lambda s: s.child_index)
    outputs = []
    for seq in seqs:
        text = None
        if tokenizer is not None:
            text = tokenizer.decode(seq.output_token_ids)
            cut = stop_index(text, seq.params.stop)
            if cut is not None:
                text = text[:cut]
        outputs.append(
            CompletionOutput(
                seq.child_index, text, list(seq.output_token_ids), seq.finish_reason or "length"
            )
        )
    first = min(s.first_token_s or arrival_s for s in seqs)
    last = max(s.last_token_s or arrival_s for s in seqs)
    longest = max(len(s.output_token_ids) for s in seqs)
    head = seqs[0]
    metrics = RequestMetrics(
        prompt_tokens=head.num_prompt_tokens,
        cached_prompt_tokens=head.num_cached_tokens,
        store_prompt_tokens=head.num_store_tokens,
        store_loaded_bytes=head.store_loaded_bytes,
        store_recomputed_tokens=head.num_store_recomputed_tokens,
        store_decision=head.store_reason,
        generated_tokens=sum(len(s.output_token_ids) for s in seqs),
        ttft_s=first - arrival_s,
        tpot_s=(last - first) / (longest - 1) if longest > 1 else 0.0,
        latency_s=last - arrival_s,
        preemptions=sum(s.num_preemptions for s in seqs),
    )
    return RequestOutput(request_id, prompt, list(head.prompt_token_ids), outputs, metrics)
