"""The scheduler over a real block manager, step by step, with the sampled tokens supplied by
the test: FCFS admission under the token budget, chunked prefill beside decodes, preemption
of the newest sequence when blocks run out, forks for n > 1, and every finish reason."""

from __future__ import annotations

from itertools import count

import pytest

from kvstore.engine.block_manager import BlockManager
from kvstore.engine.errors import InvalidRequestError
from kvstore.engine.sampling import SamplingParams
from kvstore.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvstore.engine.sequence import SeqStatus, Sequence

BS = 4


def _setup(num_blocks: int = 64, **config: int | bool) -> tuple[Scheduler, BlockManager]:
    blocks = BlockManager(num_blocks, BS, "test-ns")
    return Scheduler(SchedulerConfig(**config), blocks, BS, eos_token_ids=(2,)), blocks  # type: ignore[arg-type]


_ids = count(100)


def _seq(n_prompt: int, *, first: int = 10, **params: object) -> Sequence:
    p = SamplingParams(temperature=0.0, **params)  # type: ignore[arg-type]
    sid = next(_ids)
    return Sequence(sid, sid, list(range(first, first + n_prompt)), p)


def _step(s: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[Sequence]]:
    out = s.schedule()
    sampled = {i.seq.seq_id: [token + k for k in range(i.num_samples)]
               for i in out.scheduled if i.num_samples}
    _, finished = s.update(out, sampled, lambda: next(_ids))
    return out, finished


def _plan(out: SchedulerOutput) -> list[tuple[int, int, int]]:
    return [(i.seq.seq_id, i.num_new_tokens, i.num_samples) for i in out.scheduled]


def test_fcfs_admission_stops_at_the_token_budget_without_chunking() -> None:
    s, _ = _setup(max_num_batched_tokens=25, enable_chunked_prefill=False)
    a, b, c = _seq(10), _seq(10), _seq(10, first=50)
    for seq in (a, b, c):
        s.add(seq)
    out, _ = _step(s)
    assert _plan(out) == [(a.seq_id, 10, 1), (b.seq_id, 10, 1)]
    assert list(s.waiting) == [c]
    out, _ = _step(s)
    # Decodes go first, then c's whole prompt fits in the 23 tokens left.
    assert _plan(out) == [(a.seq_id, 1, 1), (b.seq_id, 1, 1), (c.seq_id, 10, 1)]


def test_chunked_prefill_runs_beside_decodes() -> None:
    s, _ = _setup(max_num_batched_tokens=16)
    short, long = _seq(3), _seq(40, first=60)
    s.add(short)
    s.add(long)
    out, _ = _step(s)
    assert _plan(out) == [(short.seq_id, 3, 1), (long.seq_id, 13, 0)]
    out, _ = _step(s)
    assert _plan(out) == [(short.seq_id, 1, 1), (long.seq_id, 15, 0)]
    out, _ = _step(s)
    assert _plan(out) == [(short.seq_id, 1, 1), (long.seq_id, 12, 1)]
    assert long.num_computed_tokens == 40 and long.output_token_ids == [7]


def test_prefix_hit_skips_cached_blocks_and_is_counted() -> None:
    s, _ = _setup()
    first = _seq(10, max_tokens=1)
    s.add(first)
    _step(s)
    assert first.is_finished
    again = _seq(10, max_tokens=1)
    s.add(again)
    out, _ = _step(s)
    # Two full blocks (8 tokens) come from the cache; the last 2 are computed.
    assert _plan(out) == [(again.seq_id, 2, 1)]
    assert again.num_cached_tokens == 8


def test_newest_running_sequence_is_preempted_and_recomputed() -> None:
    s, blocks = _setup(num_blocks=5)
    old, new = _seq(8, max_tokens=8), _seq(8, first=40, max_tokens=8)
    s.add(old)
    s.add(new)
    _step(s)  # 2 blocks each; 1 free
    new_blocks = blocks.block_table(new.seq_id)
    out, _ = _step(s)  # both need a third block for token 9: old gets the last free one...
    assert out.preempted == [new]
    assert _plan(out) == [(old.seq_id, 1, 1)]
    assert list(s.waiting) == [new] and new.status is SeqStatus.WAITING
    assert new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert [blocks.refcount(b) for b in new_blocks] == [0, 0]


class CountingSource:
    """A PrefixSource that holds `tokens` past any local hit and counts the questions."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.asked: list[int] = []  # the local hit of each question

    def matched_tokens(self, token_ids: list[int], local_tokens: int) -> int:
        self.asked.append(local_tokens)
        return self.tokens


def test_a_blocked_head_asks_the_store_once_not_every_step() -> None:
    source = CountingSource(BS)
    blocks = BlockManager(5, BS, "test-ns")
    s = Scheduler(SchedulerConfig(), blocks, BS, eos_token_ids=(2,), external=source)
    running, waiting = _seq(12, max_tokens=4), _seq(12, first=40, max_tokens=2)
    s.add(running)
    _step(s)  # running: 3 blocks for 12 tokens, then a fourth for token 13
    assert source.asked == [0]
    s.add(waiting)  # needs 3 blocks (one loaded from the store); at most 2 are free
    steps_blocked = 0
    while waiting in s.waiting:
        _step(s)
        steps_blocked += 1
    assert steps_blocked >= 3  # it waited for running to finish
    assert source.asked == [0, 0]  # one question while it waited, not one per step
    assert waiting.num_store_tokens == BS and waiting.store_match is None


def test_max_num_seqs_caps_the_batch() -> None:
    s, _ = _setup(max_num_seqs=2)
    seqs = [_seq(3, first=10 * i + 10) for i in range(3)]
    for seq in seqs:
        s.add(seq)
    out, _ = _step(s)
    assert [i.seq for i in out.scheduled] == seqs[:2]


@pytest.mark.parametrize(
    "params,token,reason",
    [
        ({}, 2, "stop"),  # the model's end-of-sequence id
        ({"stop_token_ids": (9,)}, 9, "stop"),
        ({"max_tokens": 1}, 5, "length"),
    ],
)
def test_finish_reasons_free_the_blocks(params: dict[str, object], token: int, reason: str) -> None:
    s, blocks = _setup()
    seq = _seq(6, **params)
    s.add(seq)
    _, finished = _step(s, token=token)
    assert finished == [seq] and seq.finish_reason == reason
    assert not s.has_unfinished and blocks.num_free_blocks == 64


def test_ignore_eos_and_max_model_len() -> None:
    s, _ = _setup(max_model_len=8)
    seq = _seq(6, ignore_eos=True, max_tokens=100)
    s.add(seq)
    _step(s, token=2)
    assert not seq.is_finished
    _, finished = _step(s, token=2)
    assert finished == [seq] and seq.finish_reason == "length" and len(seq) == 8


def test_n_samples_fork_and_copy_on_write() -> None:
    s, blocks = _setup()
    parent = _seq(6, n=3, max_tokens=4)
    s.add(parent)
    out, _ = _step(s)
    assert _plan(out) == [(parent.seq_id, 6, 3)]
    children = [q for q in s.running if q is not parent]
    assert [c.output_token_ids for c in [parent, *children]] == [[7], [8], [9]]
    shared = blocks.block_table(parent.seq_id)
    assert all(blocks.block_table(c.seq_id) == shared for c in children)
    assert blocks.refcount(shared[-1]) == 3
    out, _ = _step(s)
    # Token 7 goes into the half-full second block: two of the three get copies of it.
    assert len(out.copies) == 2 and {src for src, _ in out.copies} == {shared[-1]}
    tables = [blocks.block_table(q.seq_id) for q in (parent, *children)]
    assert len({t[-1] for t in tables}) == 3 and all(t[0] == shared[0] for t in tables)


def test_requests_that_can_never_run_are_refused() -> None:
    s, _ = _setup(num_blocks=4, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="empty"):
        s.check(0, 4)
    with pytest.raises(InvalidRequestError, match="max_model_len is 64"):
        s.check(64, 4)
    with pytest.raises(InvalidRequestError, match="needs 5 KV blocks; the cache has 4"):
        s.check(10, 10)
    with pytest.raises(InvalidRequestError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
