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
from kvstore.engine.sequence import SeqStatus, Sequence, StoreAnswer
from kvstore.keys import prefix_keys

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


def _store_setup(num_blocks: int = 64, **config: int | bool) -> tuple[Scheduler, BlockManager]:
    blocks = BlockManager(num_blocks, BS, "test-ns")
    return Scheduler(SchedulerConfig(**config), blocks, BS, eos_token_ids=(2,),  # type: ignore[arg-type]
                     store=True), blocks


def _until_done(s: Scheduler, seq: Sequence, limit: int = 100) -> list[SchedulerOutput]:
    outs = []
    while not seq.is_finished:
        outs.append(_step(s)[0])
        assert len(outs) < limit
    return outs


def test_a_loading_request_does_not_delay_running_decodes() -> None:
    alone, _ = _store_setup()
    a = _seq(4, max_tokens=8)  # no full block past the last token: never asks the store
    alone.add(a)
    steps_alone = len(_until_done(alone, a))

    s, blocks = _store_setup()
    a, b = _seq(4, max_tokens=8), _seq(14, first=50, max_tokens=2)
    s.add(a)
    _step(s)
    s.add(b)
    out, _ = _step(s)  # b: a lookup goes out, nothing of b is computed, a decodes
    assert [(p.seq, p.first_block, len(p.keys)) for p in out.lookups] == [(b, 0, 3)]
    assert _plan(out) == [(a.seq_id, 1, 1)]
    s.lookup_done(b, StoreAnswer(0, hit_blocks=3, load_blocks=3, reason="test"))
    out, _ = _step(s)  # b: its 3 blocks are allocated and loaded, a decodes
    [load] = out.loads
    assert (load.seq, load.first_block, load.keys) == (b, 0, b.block_keys[:3])
    assert b.status is SeqStatus.LOADING and _plan(out) == [(a.seq_id, 1, 1)]
    for _ in range(3):  # the load takes a while: a keeps stepping alone
        out, _ = _step(s)
        assert _plan(out) == [(a.seq_id, 1, 1)] and not out.loads and not out.lookups
    s.load_done(b, 3)
    assert b.status is SeqStatus.WAITING and blocks.refcount(load.block_ids[0]) == 0
    out, _ = _step(s)  # b joins with its 12 loaded tokens as a local hit: computes 2
    assert _plan(out) == [(a.seq_id, 1, 1), (b.seq_id, 2, 1)]
    assert blocks.block_table(b.seq_id)[:3] == load.block_ids
    assert (b.num_cached_tokens, b.num_store_tokens, b.num_store_recomputed_tokens) == (12, 12, 0)
    steps = 7 + len(_until_done(s, a))
    assert steps == steps_alone  # a finished in as many steps as without b


def test_two_loading_requests_complete_independently() -> None:
    s, _ = _store_setup()
    b, c = _seq(9, first=50, max_tokens=1), _seq(13, first=80, max_tokens=1)
    s.add(b)
    s.add(c)
    out, _ = _step(s)
    assert [p.seq for p in out.lookups] == [b, c] and out.is_empty
    assert s.waiting_on_store
    s.lookup_done(c, StoreAnswer(0, 3, 3))
    s.lookup_done(b, StoreAnswer(0, 2, 2))
    out, _ = _step(s)
    assert [(p.seq, len(p.block_ids)) for p in out.loads] == [(b, 2), (c, 3)]
    s.load_done(c, 3)  # c's load lands first: c goes while b still loads
    out, _ = _step(s)
    assert _plan(out) == [(c.seq_id, 1, 1)] and b.status is SeqStatus.LOADING
    assert c.is_finished
    s.load_done(b, 2)
    out, _ = _step(s)
    assert _plan(out) == [(b.seq_id, 1, 1)] and b.num_store_tokens == 8
    assert not s.waiting_on_store and not s.has_unfinished


@pytest.mark.parametrize("arrived", [0, 1])
def test_a_load_that_fails_is_computed_from_the_first_missing_block(arrived: int) -> None:
    s, blocks = _store_setup()
    b = _seq(13, first=50, max_tokens=1)
    s.add(b)
    _step(s)
    s.lookup_done(b, StoreAnswer(0, 3, 3, reason="load 3"))
    out, _ = _step(s)
    [load] = out.loads
    s.load_done(b, arrived)
    out, _ = _step(s)  # no second load of what did not arrive: computed now
    assert not out.loads and not out.lookups
    assert _plan(out) == [(b.seq_id, 13 - arrived * BS, 1)]
    assert (b.num_store_tokens, b.num_store_recomputed_tokens) == (arrived * BS,
                                                                  (3 - arrived) * BS)
    assert "did not arrive" in b.store_reason
    assert b.is_finished and blocks.num_free_blocks == 64  # none leaked


def test_a_hit_the_decision_recomputes_is_not_loaded() -> None:
    s, _ = _store_setup()
    b = _seq(13, first=50, max_tokens=1)
    s.add(b)
    _step(s)
    s.lookup_done(b, StoreAnswer(0, 3, 1, reason="recompute 2 blocks (remote)"))
    out, _ = _step(s)
    [load] = out.loads
    assert len(load.keys) == 1
    s.load_done(b, 1)
    out, _ = _step(s)
    assert _plan(out) == [(b.seq_id, 9, 1)]
    assert (b.num_store_tokens, b.num_store_recomputed_tokens) == (BS, 2 * BS)
    assert b.store_reason == "recompute 2 blocks (remote)"


def test_a_sequence_finished_while_loading_keeps_its_blocks_until_the_load_lands() -> None:
    s, blocks = _store_setup()
    b = _seq(13, first=50, max_tokens=1)
    s.add(b)
    _step(s)
    s.lookup_done(b, StoreAnswer(0, 3, 3))
    [load] = _step(s)[0].loads
    s.finish(b, "abort")
    assert all(blocks.refcount(i) == 1 for i in load.block_ids)  # still being written
    s.load_done(b, 3)
    assert blocks.num_free_blocks == 64 and not s.has_unfinished


def test_a_blocked_head_asks_the_store_once_not_every_step() -> None:
    s, blocks = _store_setup(num_blocks=5)
    running, waiting = _seq(12, max_tokens=4), _seq(12, first=40, max_tokens=2)
    s.add(running)
    out, _ = _step(s)
    assert [p.seq for p in out.lookups] == [running]
    s.lookup_done(running, StoreAnswer(0, 0, 0))
    _step(s)  # running: 3 blocks for 12 tokens, then a fourth for token 13
    s.add(waiting)  # needs 3 blocks (one loaded from the store); at most 2 are free
    lookups = 0
    steps_blocked = 0
    while waiting.status is not SeqStatus.RUNNING:
        out, _ = _step(s)
        lookups += len(out.lookups)
        if out.lookups:
            s.lookup_done(waiting, StoreAnswer(0, 1, 1))
        for load in out.loads:
            s.load_done(load.seq, len(load.keys))
        steps_blocked += 1
    assert steps_blocked >= 3  # it waited for running to finish
    assert lookups == 1  # one question while it waited, not one per step
    assert waiting.num_store_tokens == BS and waiting.store_answer is None


def test_each_block_is_hashed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvstore.engine.block_manager as bm

    calls = 0
    real = bm.chain_key

    def counted(parent: bytes, tokens: list[int]) -> bytes:
        nonlocal calls
        calls += 1
        return real(parent, tokens)  # type: ignore[arg-type]

    monkeypatch.setattr(bm, "chain_key", counted)
    s, _ = _store_setup(num_blocks=8, max_num_batched_tokens=8)
    seqs = [_seq(13, first=50, max_tokens=9), _seq(10, first=80, max_tokens=7, n=2)]
    for seq in seqs:
        s.add(seq)
    everyone = {q.seq_id: q for q in seqs}
    while s.has_unfinished:  # lookups, loads, chunked prefill, decodes, a fork, preemption
        out = s.schedule()
        for p in out.lookups:
            s.lookup_done(p.seq, StoreAnswer(p.first_block, len(p.keys), len(p.keys)))
        for load in out.loads:
            s.load_done(load.seq, len(load.keys) - 1)
        sampled = {i.seq.seq_id: [7 + k for k in range(i.num_samples)]
                   for i in out.scheduled if i.num_samples}
        stepped, _ = s.update(out, sampled, lambda: next(_ids))
        everyone.update((q.seq_id, q) for q in stepped)
    [child] = [q for q in everyone.values() if q.child_index]
    assert s.num_preemptions > 0
    # One hash per full block of each sequence's tokens; the fork shares its parent's keys
    # but for the blocks from the one holding the token where they part.
    parted = (seqs[1].num_prompt_tokens + 1 - 1) // BS
    assert calls == sum(len(q) // BS for q in seqs) + len(child) // BS - parted
    assert all(q.block_keys == prefix_keys(q.token_ids, BS, "test-ns")
               for q in everyone.values())


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
