"""Transformers as the oracle: greedy continuation and logits of a token list, computed by
transformers' own forward pass on the same checkpoint."""

from __future__ import annotations

from typing import Any

import torch


def load_hf(path: str, **kwargs: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers with its own KV cache; never stops at an end token,
    as our runs with ignore_eos=True do not."""
    ids = torch.tensor([prompt])
    out = model(ids, use_cache=True)
    past = out.past_key_values
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]]), cache=past, use_cache=True)
        past = out.past_key_values
    return tokens


@torch.inference_mode()
def hf_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0].float()
