"""Trace families: seeded request traces in the Mooncake format, one per workload shape, so an
eviction policy is tuned and tested on more than the one public trace.

    python bench/trace_families.py FAMILY --out PATH [--seed N] [--requests N]

Families (`generate(family, seed, num_requests)`; the defaults are each shape's dataclass):

- `multiturn`: chat sessions arriving at random; each turn re-sends the whole conversation
  (previous prompt + previous answer + the new message); think times between turns;
  turns per session heavy-tailed (most 1-3, a few dozens), and so are message lengths.
- `sysprompt`: a handful of system prompts of varying length, Zipf-popular, each followed by
  a short question seen once.
- `rag`: one system prompt, then k documents of a corpus (Zipf-popular, in random order),
  then a question. A document's blocks hit only after the same whole prefix.
- `agent`: a few agents at once, each re-sending a long tool transcript that grows every
  step (seconds apart), a task now and then forking into two branches of one transcript.
- `synthetic`: the public Mooncake trace in bench/traces/, loaded as it is.

Hash ids come from the tokens, as the store's chained keys do: a prompt is a sequence of
segments (a system prompt, a message, a document), cut into 512-token blocks, and a block's
id is looked up in one table by (its parent block's id, what the block holds: which tokens of
which segments). Two requests share the id at position p only when their prompts agree up to
the end of block p, the same document after another prefix gets other ids, and a partial last
block is a different block once it fills up (the next turn's id at that position differs).
Ids are numbered in order of first use, in timestamp order, from 0.

Defaults are sized for bench/trace_sim.py at six capacities with every policy, Belady
included: 1,200-3,000 requests, 2,800-12,000 distinct blocks and 21,000-43,000 block accesses
per family, 5-8 s each on one core (the store's real index costs about 36 us a block access,
the rest of the policies together about a quarter of that). Pure but for `load_synthetic` and
`write_trace` (files) and the CLI.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import sys
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK_TOKENS = 512
SYNTHETIC_TRACE = Path(__file__).resolve().parent / "traces" / "mooncake_synthetic_trace.jsonl"
MS_PER_OUTPUT_TOKEN = 20.0  # decode time of one output token, for the next turn's timestamp
Segment = tuple[Hashable, int]  # (what the tokens are, how many)
Row = dict[str, Any]  # one Mooncake row: timestamp, input_length, output_length, hash_ids


@dataclass(frozen=True)
class Origin:
    """Where a row came from, for tests and analysis; never written to the trace."""

    session: int = -1  # the conversation or agent branch; -1 for none
    step: int = 0  # turn or step within the session, from 0
    extends: int = -1  # the row whose whole prompt opens this one's (the previous turn), or -1
    parts: tuple[str, ...] = ()  # the shared parts of the prompt, in order: "sys3", "doc17"


@dataclass(frozen=True)
class Trace:
    family: str
    seed: int
    rows: list[Row]  # by timestamp
    origins: list[Origin]  # one per row


@dataclass
class _Draft:
    timestamp_ms: float
    segments: tuple[Segment, ...]
    output_length: int
    origin: Origin
    extends: _Draft | None = field(default=None, repr=False)


# --- hash ids --------------------------------------------------------------------------------


class BlockTable:
    """One id per distinct (parent id, block content): the chained keys of a trace."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, tuple[tuple[Hashable, int, int], ...]], int] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def chain(self, segments: Iterable[Segment]) -> list[int]:
        """The ids of a prompt's blocks: each block's content is (segment, first token,
        end token) of every segment piece in it, and its key includes its parent's id."""
        ids: list[int] = []
        pieces: list[tuple[Hashable, int, int]] = []
        filled = 0
        for what, num_tokens in segments:
            start = 0
            while start < num_tokens:
                take = min(num_tokens - start, BLOCK_TOKENS - filled)
                pieces.append((what, start, start + take))
                start, filled = start + take, filled + take
                if filled == BLOCK_TOKENS:
                    ids.append(self._id(ids, pieces))
                    pieces, filled = [], 0
        if pieces:
            ids.append(self._id(ids, pieces))
        return ids

    def _id(self, ids: list[int], pieces: list[tuple[Hashable, int, int]]) -> int:
        return self._ids.setdefault((ids[-1] if ids else -1, tuple(pieces)), len(self._ids))


def _finish(family: str, seed: int, drafts: list[_Draft], num_requests: int) -> Trace:
    """The first num_requests drafts by timestamp, as rows with ids numbered in that order."""
    order = sorted(range(len(drafts)), key=lambda i: (drafts[i].timestamp_ms, i))[:num_requests]
    kept = [drafts[i] for i in order]
    row_of = {id(d): n for n, d in enumerate(kept)}
    table = BlockTable()
    rows: list[Row] = []
    origins: list[Origin] = []
    for d in kept:
        rows.append({"timestamp": round(d.timestamp_ms),
                     "input_length": sum(n for _, n in d.segments),
                     "output_length": d.output_length, "hash_ids": table.chain(d.segments)})
        extends = row_of.get(id(d.extends), -1) if d.extends is not None else -1
        origins.append(Origin(d.origin.session, d.origin.step, extends, d.origin.parts))
    return Trace(family, seed, rows, origins)


class _Window:
    """Whether the first n drafts by timestamp are all drafted: true once n of them arrive no
    later than a time that only grows (every later draft arrives after it)."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._pending: list[float] = []
        self._arrived = 0

    def add(self, drafts: Iterable[_Draft]) -> None:
        for d in drafts:
            heapq.heappush(self._pending, d.timestamp_ms)

    def full(self, now_ms: float) -> bool:
        while self._pending and self._pending[0] <= now_ms:
            heapq.heappop(self._pending)
            self._arrived += 1
        return self._arrived >= self._n


# --- distributions ---------------------------------------------------------------------------


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))


def _heavy_count(rng: random.Random, shape: float, most: int, least: int = 1) -> int:
    """least, least + 1, ... with a Pareto tail: P(>= n) ~ (n / least) ** -shape, at most
    `most`."""
    return min(most, int(least * rng.paretovariate(shape)))


def _zipf(num_items: int, s: float) -> list[float]:
    """Cumulative Zipf weights of items 0..num_items-1 (item 0 the most popular)."""
    cum, total = [], 0.0
    for k in range(num_items):
        total += 1.0 / (k + 1) ** s
        cum.append(total)
    return cum


def _next_ms(now_ms: float, output_tokens: int, wait_s: float) -> float:
    return now_ms + output_tokens * MS_PER_OUTPUT_TOKEN + wait_s * 1000.0


# --- families --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Multiturn:
    requests: int = 3000  # turns in the trace: ~8,300 distinct blocks, ~27,000 accesses
    sessions_per_s: float = 0.5  # new conversations a second (Poisson)
    turns_shape: float = 1.1  # Pareto tail of turns per session: half one turn, 2% >= 20
    max_turns: int = 60
    first_tokens: int = 800  # median tokens of a session's first message (lognormal, s=1.2)
    message_tokens: int = 200  # median of a later user message (lognormal, s=1.0)
    answer_tokens: int = 300  # median answer (output_length; lognormal, s=0.7)
    think_s: float = 30.0  # median think time after an answer (lognormal, s=1.0)
    max_context_tokens: int = 32768  # a conversation ends before its prompt passes this


def multiturn(seed: int, shape: Multiturn) -> Trace:
    rng = random.Random(seed)
    window, drafts = _Window(shape.requests), []
    now_ms, session = 0.0, 0
    while not window.full(now_ms):
        now_ms += rng.expovariate(shape.sessions_per_s) * 1000.0
        segments: tuple[Segment, ...] = ()
        message = _lognormal(rng, shape.first_tokens, 1.2, 4, 16000)
        t_ms, previous = now_ms, None
        turns = []
        for turn in range(_heavy_count(rng, shape.turns_shape, shape.max_turns)):
            segments += ((("user", session, turn), message),)
            if sum(n for _, n in segments) > shape.max_context_tokens:
                break
            answer = _lognormal(rng, shape.answer_tokens, 0.7, 1, 4000)
            previous = _Draft(t_ms, segments, answer, Origin(session, turn), previous)
            turns.append(previous)
            segments += ((("answer", session, turn), answer),)
            t_ms = _next_ms(t_ms, answer, rng.lognormvariate(math.log(shape.think_s), 1.0))
            message = _lognormal(rng, shape.message_tokens, 1.0, 1, 8000)
        window.add(turns)
        drafts += turns
        session += 1
    return _finish("multiturn", seed, drafts, shape.requests)


@dataclass(frozen=True)
class Sysprompt:
    requests: int = 3000  # ~3,800 distinct blocks, ~34,000 accesses
    prompts: int = 10  # distinct system prompts
    zipf_s: float = 1.0  # their popularity: in a phase the first ~34% of requests, the last 3%
    phases: int = 4  # popularity drifts: each phase deals the ranks out to the prompts anew
    min_prompt_tokens: int = 1000  # system prompt lengths, log-uniform between these
    max_prompt_tokens: int = 16000
    question_tokens: int = 150  # median question (lognormal, s=0.8), each seen once
    answer_tokens: int = 200
    requests_per_s: float = 5.0


def sysprompt(seed: int, shape: Sysprompt) -> Trace:
    rng = random.Random(seed)
    lo, hi = math.log(shape.min_prompt_tokens), math.log(shape.max_prompt_tokens)
    lengths = [round(math.exp(rng.uniform(lo, hi))) for _ in range(shape.prompts)]
    cum = _zipf(shape.prompts, shape.zipf_s)
    drafts, now_ms, ranked, phase = [], 0.0, list(range(shape.prompts)), -1
    for n in range(shape.requests):
        if n * shape.phases // shape.requests != phase:  # a phase begins
            phase = n * shape.phases // shape.requests
            rng.shuffle(ranked)
        now_ms += rng.expovariate(shape.requests_per_s) * 1000.0
        [k] = rng.choices(ranked, cum_weights=cum)
        question = _lognormal(rng, shape.question_tokens, 0.8, 2, 4000)
        segments = (("sys", k), lengths[k]), (("question", n), question)
        drafts.append(_Draft(now_ms, segments, _lognormal(rng, shape.answer_tokens, 0.7, 1, 2000),
                             Origin(parts=(f"sys{k}",))))
    return _finish("sysprompt", seed, drafts, shape.requests)


@dataclass(frozen=True)
class Rag:
    requests: int = 2500  # ~11,800 distinct blocks, ~21,000 accesses
    documents: int = 400  # the corpus
    zipf_s: float = 1.1  # document popularity: the top one in ~60% of requests, 19% first
    min_docs: int = 3  # documents per request, uniform between these
    max_docs: int = 5
    system_tokens: int = 1200
    doc_tokens: int = 600  # median document (lognormal, s=0.6)
    question_tokens: int = 60  # median question (lognormal, s=0.6), each seen once
    answer_tokens: int = 250
    requests_per_s: float = 5.0


def rag(seed: int, shape: Rag) -> Trace:
    rng = random.Random(seed)
    lengths = [_lognormal(rng, shape.doc_tokens, 0.6, 100, 4000) for _ in range(shape.documents)]
    cum = _zipf(shape.documents, shape.zipf_s)
    drafts, now_ms = [], 0.0
    for n in range(shape.requests):
        now_ms += rng.expovariate(shape.requests_per_s) * 1000.0
        docs: list[int] = []
        k = rng.randint(shape.min_docs, shape.max_docs)
        while len(docs) < k:  # k distinct documents, by popularity, in the order drawn
            [d] = rng.choices(range(shape.documents), cum_weights=cum)
            if d not in docs:
                docs.append(d)
        segments = ((("sys",), shape.system_tokens), *((("doc", d), lengths[d]) for d in docs),
                    (("question", n), _lognormal(rng, shape.question_tokens, 0.6, 2, 1000)))
        drafts.append(_Draft(now_ms, segments, _lognormal(rng, shape.answer_tokens, 0.7, 1, 2000),
                             Origin(parts=("sys", *(f"doc{d}" for d in docs)))))
    return _finish("rag", seed, drafts, shape.requests)


@dataclass(frozen=True)
class Agent:
    requests: int = 1200  # steps: ~2,800 distinct blocks, ~43,000 accesses
    concurrent: int = 4  # agents running at once, each task after the last
    system_prompts: int = 2  # agent frameworks: instructions and tool schemas, shared
    system_tokens: int = 4000  # median (lognormal, s=0.3)
    task_tokens: int = 300  # median task description (lognormal, s=0.8)
    min_steps: int = 4  # steps per task branch: Pareto from this (median 8) until the context
    steps_shape: float = 1.0
    max_steps: int = 100
    call_tokens: int = 120  # median tool call, the step's output (lognormal, s=0.6)
    result_tokens: int = 300  # median tool result appended after it (lognormal, s=1.2)
    tool_s: float = 2.0  # median tool latency (lognormal, s=1.0)
    fork_p: float = 0.05  # chance a step forks a second branch of the same transcript
    max_context_tokens: int = 40000


def _agent_task(rng: random.Random, shape: Agent, start_ms: float, task: int,
                system_lengths: Sequence[int], branches: Iterator[int]) -> list[_Draft]:
    """One task's steps, every branch of it, each branch numbered by `branches`."""
    k = rng.randrange(shape.system_prompts)
    opening: tuple[Segment, ...] = ((("agent-sys", k), system_lengths[k]),
                                    (("task", task), _lognormal(rng, shape.task_tokens, 0.8, 10,
                                                                4000)))
    todo: list[tuple[tuple[Segment, ...], float, _Draft | None]] = [(opening, start_ms, None)]
    drafts: list[_Draft] = []
    while todo:
        segments, t_ms, previous = todo.pop()
        branch = next(branches)
        for step in range(_heavy_count(rng, shape.steps_shape, shape.max_steps, shape.min_steps)):
            if sum(n for _, n in segments) > shape.max_context_tokens:
                break
            call = _lognormal(rng, shape.call_tokens, 0.6, 5, 2000)
            previous = _Draft(t_ms, segments, call, Origin(branch, step, parts=(f"agent-sys{k}",)),
                              previous)
            drafts.append(previous)
            if rng.random() < shape.fork_p:  # a sibling re-sends this transcript, goes its way
                todo.append((segments, t_ms + 1.0, previous))
            result = _lognormal(rng, shape.result_tokens, 1.2, 5, 16000)
            segments += (("call", branch, step), call), (("result", branch, step), result)
            t_ms = _next_ms(t_ms, call, rng.lognormvariate(math.log(shape.tool_s), 1.0))
    return drafts


def agent(seed: int, shape: Agent) -> Trace:
    rng = random.Random(seed)
    lengths = [_lognormal(rng, shape.system_tokens, 0.3, 500, 16000)
               for _ in range(shape.system_prompts)]
    slots = [(rng.uniform(0.0, 5000.0), slot) for slot in range(shape.concurrent)]
    heapq.heapify(slots)
    window, drafts, branches, task = _Window(shape.requests), [], itertools.count(), 0
    while not window.full(slots[0][0]):
        start_ms, slot = heapq.heappop(slots)
        steps = _agent_task(rng, shape, start_ms, task, lengths, branches)
        window.add(steps)
        drafts += steps
        task += 1
        heapq.heappush(slots, (max((d.timestamp_ms for d in steps), default=start_ms) + 1000.0,
                                slot))
    return _finish("agent", seed, drafts, shape.requests)


def load_synthetic(num_requests: int | None = None, path: Path = SYNTHETIC_TRACE) -> Trace:
    """The public trace's rows as they are (the first num_requests of them)."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()][:num_requests]
    return Trace("synthetic", 0, rows, [Origin() for _ in rows])


SHAPES: dict[str, type] = {"multiturn": Multiturn, "sysprompt": Sysprompt, "rag": Rag,
                           "agent": Agent}
_GENERATORS: dict[str, Callable[[int, Any], Trace]] = {
    "multiturn": multiturn, "sysprompt": sysprompt, "rag": rag, "agent": agent}
FAMILIES = (*SHAPES, "synthetic")


def generate(family: str, seed: int = 0, num_requests: int | None = None) -> Trace:
    """The family's trace with its default shape, num_requests requests if given (synthetic:
    its first num_requests, whatever the seed). Same family, seed and size: same trace."""
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if family == "synthetic":
        return load_synthetic(num_requests)
    if family not in SHAPES:
        raise ValueError(f"unknown trace family {family!r}; one of {', '.join(FAMILIES)}")
    shape = SHAPES[family]() if num_requests is None else SHAPES[family](requests=num_requests)
    return _GENERATORS[family](seed, shape)


def write_trace(rows: Sequence[Row], path: Path) -> None:
    """rows as a Mooncake-format .jsonl file, one JSON object a line."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=FAMILIES)
    parser.add_argument("--out", type=Path, required=True, help="the .jsonl file to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=None,
                        help="requests in the trace (default: the family's own)")
    args = parser.parse_args(argv)
    if args.requests is not None and args.requests < 1:
        parser.error(f"--requests must be >= 1, got {args.requests}")
    trace = generate(args.family, args.seed, args.requests)
    write_trace(trace.rows, args.out)
    distinct = len({h for row in trace.rows for h in row["hash_ids"]})
    print(f"# wrote {args.out}: {args.family} seed {args.seed}, {len(trace.rows)} requests, "
          f"{distinct} distinct blocks, "
          f"{sum(len(row['hash_ids']) for row in trace.rows)} block accesses")
    return 0


if __name__ == "__main__":
    sys.exit(main())
