"""Sampling parameters (validated on construction, each error naming its field) and the
sampler that turns one row of logits into token ids: greedy, temperature, top-k, top-p,
seeded per request."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.engine.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 picks the most likely token (greedy); higher flattens the distribution."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability adds up to top_p (0 < top_p <= 1)."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    max_tokens: int = 16
    """Generate at most this many tokens per sequence."""
    stop: tuple[str, ...] = ()
    """Strings that end generation; the returned text stops before the first one."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation besides the model's end-of-sequence ids."""
    ignore_eos: bool = False
    """Keep generating past the model's end-of-sequence token (benchmarks)."""
    seed: int | None = None
    """Makes sampling repeatable: the same seed gives the same tokens."""
    n: int = 1
    """Sequences to sample per prompt; they share the prompt's KV blocks (copy-on-write)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p, low=0.0, low_open=True, high=1.0)
        _check_int("top_k", self.top_k, low=0)
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("n", self.n, low=1)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise InvalidRequestError(f"stop must hold non-empty strings, got {text!r}")
        for token in self.stop_token_ids:
            _check_int("stop_token_ids", token, low=0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_number(
    name: str, value: object, *, low: float, low_open: bool = False, high: float | None = None
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}")
    if value < low or (low_open and value == low) or (high is not None and value > high):
        bound = f"({low}, {high}]" if low_open else f">= {low}"
        if high is not None and not low_open:
            bound = f"[{low}, {high}]"
        raise InvalidRequestError(f"{name} must be in {bound}, got {value!r}")


def _check_int(name: str, value: object, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise InvalidRequestError(f"{name} must be >= {low}, got {value}")


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def sample_row(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    num_samples: int = 1,
) -> list[int]:
    """Token ids drawn from one row of float32 logits [vocab]; several draws share one
    filtered distribution (the first tokens of an n > 1 request)."""
    if params.greedy:
        return [int(torch.argmax(logits).item())] * num_samples
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    draws = torch.multinomial(probs, num_samples, replacement=True, generator=generator)
    return [int(t) for t in draws.tolist()]


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    num_samples: Sequence[int],
) -> list[list[int]]:
    """One list of token ids per row of logits [rows, vocab]."""
    if all(p.greedy for p in params):
        best = torch.argmax(logits, dim=-1).tolist()
        return [[int(t)] * k for t, k in zip(best, num_samples, strict=True)]
    return [
        sample_row(logits[i], p, g, k)
        for i, (p, g, k) in enumerate(zip(params, generators, num_samples, strict=True))
    ]
