"""The scheduler with a windowed block manager and a store: a load fills only the blocks the
window covers before its cut, the re-admission takes the whole cut as a local hit, and a
short windowed load is computed from the local hit without asking the store again."""

from __future__ import annotations

from itertools import count

from kvstore.engine.block_manager import FREED, BlockManager
from kvstore.engine.sampling import SamplingParams
from kvstore.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvstore.engine.sequence import SeqStatus, Sequence, StoreAnswer

BS = 4
_ids = count(100)


def _setup(window: int, sinks: int = 0) -> tuple[Scheduler, BlockManager]:
    blocks = BlockManager(64, BS, "test-ns", window=window, sinks=sinks)
    return Scheduler(SchedulerConfig(), blocks, BS, eos_token_ids=(2,), store=True), blocks


def _seq(n_prompt: int) -> Sequence:
    sid = next(_ids)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    return Sequence(sid, sid, list(range(50, 50 + n_prompt)), params)


def _step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    sampled = {i.seq.seq_id: [7] for i in out.scheduled if i.num_samples}
    s.update(out, sampled, lambda: next(_ids))
    return out


def test_a_windowed_load_fills_only_the_window_before_the_cut() -> None:
    """25 tokens, window 6: the cut is at 24 (6 blocks), whose first computed token
    attends to 19..24, blocks 4 and 5: only those two are loaded of the six the store holds;
    the admission then takes all 24 tokens as a local hit and computes the last one."""
    s, blocks = _setup(window=6)
    b = _seq(25)
    s.add(b)
    out = _step(s)
    assert [(p.first_block, len(p.keys)) for p in out.lookups] == [(0, 6)]
    s.lookup_done(b, StoreAnswer(0, hit_blocks=6, load_blocks=6))
    out = _step(s)
    [load] = out.loads
    assert (load.first_block, load.keys) == (4, b.block_keys[4:6])
    assert blocks.block_table(b.seq_id)[:4] == [FREED] * 4  # never filled, back in the pool
    assert blocks.num_referenced_blocks == 2
    s.load_done(b, 2)
    out = _step(s)
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(b, 1)]
    assert (b.num_cached_tokens, b.num_store_tokens) == (24, 8)
    assert b.is_finished and blocks.num_referenced_blocks == 0


def test_sinks_outside_the_local_hit_load_everything() -> None:
    """With sink blocks to load too, the blocks between them and the window are not worth
    a second range: the whole hit is loaded, as without a window."""
    s, _ = _setup(window=6, sinks=2)
    b = _seq(25)
    s.add(b)
    _step(s)
    s.lookup_done(b, StoreAnswer(0, hit_blocks=6, load_blocks=6))
    [load] = _step(s).loads
    assert (load.first_block, len(load.keys)) == (0, 6)


def test_a_short_windowed_load_is_computed_not_asked_again() -> None:
    s, blocks = _setup(window=6)
    b = _seq(25)
    s.add(b)
    _step(s)
    s.lookup_done(b, StoreAnswer(0, hit_blocks=6, load_blocks=6))
    _step(s)
    s.load_done(b, 1)  # block 4 arrived, block 5 did not: no window is complete
    out = _step(s)
    assert not out.lookups and not out.loads
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(b, 25)]
    assert b.status is SeqStatus.FINISHED or b.num_computed_tokens == 25
    assert "did not arrive" in b.store_reason
    while s.has_unfinished:
        _step(s)
    assert blocks.num_referenced_blocks == 0
