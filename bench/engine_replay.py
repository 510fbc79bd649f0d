"""A Mooncake-format trace scaled to one CPU, for bench/engine_ttft.py: which requests to
replay, their prompts, and the replay itself (one request at a time, in trace order; arrival
times are ignored: a CPU serves far slower than the trace arrives).

Each row has input_length, output_length and hash_ids, one id per 512 prompt tokens; rows that
share leading hash ids share that prefix. Here a hash id becomes `tokens_per_hash` fixed random
tokens, so shared ids stay shared prefixes at a size this machine can compute.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.engine import LLM, SamplingParams

TRACE = Path(__file__).resolve().parent / "traces" / "mooncake_synthetic_trace.jsonl"
TRACE_BLOCK_TOKENS = 512  # tokens per hash id in Mooncake's trace format
Request = tuple[list[int], int]  # (prompt token ids, max tokens)


def trace_slice(path: Path, count: int, how: str, seed: int) -> list[dict[str, Any]]:
    """`count` rows in trace order. "head": the first ones. "groups": whole prefix groups (rows
    with the same first hash id) in a seeded random order until count rows are picked, then
    the first count of those: the trace reuses a prefix ~1,650 requests later (median), far
    past any slice a CPU replays, and its first 40 rows share no prefix at all."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [row for row in rows if row["hash_ids"]]
    if how == "head":
        return rows[:count]
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(row["hash_ids"][0], []).append(i)
    roots = sorted(groups)
    random.Random(seed).shuffle(roots)
    picked: list[int] = []
    for root in roots:
        if len(picked) >= count:
            break
        picked += groups[root]
    return [rows[i] for i in sorted(picked)[:count]]


def requests_of(rows: list[dict[str, Any]], tokens_per_hash: int, max_tokens: int, vocab: int,
                seed: int = 0) -> list[Request]:
    """One request per row: its hash ids' tokens cut to input_length scaled the same way
    (at least one token), its output_length capped at max_tokens."""
    blocks: dict[int, list[int]] = {}

    def tokens_of(hash_id: int) -> list[int]:
        if hash_id not in blocks:
            rng = random.Random(hash_id * 1_000_003 + seed)
            blocks[hash_id] = [rng.randrange(100, vocab - 1) for _ in range(tokens_per_hash)]
        return blocks[hash_id]

    out = []
    for row in rows:
        prompt = [t for h in row["hash_ids"] for t in tokens_of(h)]
        length = min(len(prompt), -(-row["input_length"] * tokens_per_hash // TRACE_BLOCK_TOKENS))
        out.append((prompt[: max(1, length)], max(1, min(row["output_length"], max_tokens))))
    return out


@dataclass
class Replay:
    seconds: float
    requests: int
    prompt_tokens: int
    local_tokens: int  # served by the engine's own prefix cache
    store_tokens: int  # loaded from the store

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.local_tokens - self.store_tokens


def replay(llm: LLM, requests: list[Request]) -> Replay:
    """Serve the requests one after another; the wall time of the whole sequence."""
    outs = []
    start = time.perf_counter()
    for prompt, max_tokens in requests:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs += llm.generate([prompt], params)
    seconds = time.perf_counter() - start
    m = [o.metrics for o in outs]
    store_tokens = sum(x.store_prompt_tokens for x in m)
    return Replay(seconds, len(outs), sum(x.prompt_tokens for x in m),
                  sum(x.cached_prompt_tokens for x in m) - store_tokens, store_tokens)
