"""bench/trace_sim.py: prefix-aware hit counting, the three policies on hand-made traces with
exact hits, and on random prefix-consistent traces Belady never below LRU or the store,
and the store (the real index) never evicting a parent while its child is cached."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.tier import Tier
from tests.conftest import REPO


def _load() -> ModuleType:
    # bench scripts import their siblings (figures) by bare name, as when run as scripts.
    bench = str(REPO / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module("trace_sim")


sim = _load()
pol = importlib.import_module("sim_policies")  # on the path _load set
A, B, C, D, X, Y = 1, 2, 3, 4, 5, 6


def req(*ids: int, input_length: int | None = None) -> object:
    length = 512 * len(ids) if input_length is None else input_length
    return sim.Request(0.0, length, 1, tuple(ids))


def hits_per_request(policy_cls: type, capacity: int, requests: Sequence[object]) -> list[int]:
    policy = policy_cls(capacity, requests)
    return [len(policy.access(r, q.hash_ids))  # type: ignore[attr-defined]
            for r, q in enumerate(requests)]


# --- hand-made traces --------------------------------------------------------------------------


def test_partial_last_block_counts_its_real_tokens() -> None:
    request = req(A, B, input_length=1000)
    assert [request.block_tokens(i) for i in range(2)] == [512, 488]  # type: ignore[attr-defined]
    trace = [request, request]
    [result] = sim.simulate(trace, [4], {"lru": pol.LruPolicy})
    assert (result.blocks, result.block_hits) == (4, 2)
    assert (result.tokens, result.token_hits) == (2000, 1000)
    assert result.token_hit_rate == pytest.approx(0.5)


def test_lru_evicts_the_parent_belady_keeps_and_the_store_keeps_the_parent() -> None:
    # Capacity 2. After [A, B] and [C]: LRU drops A (oldest), so B is useless at request 2;
    # the store drops leaf B and keeps parent A; Belady never caches C (never used again).
    trace = [req(A, B), req(C), req(A, B)]
    assert hits_per_request(pol.LruPolicy, 2, trace) == [0, 0, 0]
    assert hits_per_request(sim.StorePolicy, 2, trace) == [0, 0, 1]
    assert hits_per_request(pol.BeladyPolicy, 2, trace) == [0, 0, 2]


def test_hits_are_the_cached_prefix_only() -> None:
    # B is cached at request 3 but A is not, so B is no hit (as in the store's Lookup).
    trace = [req(A, B), req(X), req(Y), req(A, B)]
    policy = pol.LruPolicy(3)
    for r in range(3):
        policy.access(r, trace[r].hash_ids)  # type: ignore[attr-defined]
    assert policy.cached_blocks() == {B, X, Y}
    assert policy.access(3, trace[3].hash_ids) == []  # type: ignore[attr-defined]


def test_a_request_longer_than_the_cache_keeps_its_prefix() -> None:
    trace = [req(A, B, C, D), req(A, B, C, D)]
    for cls in (pol.LruPolicy, sim.StorePolicy, pol.BeladyPolicy):
        assert hits_per_request(cls, 2, trace) == [0, 2], cls.__name__


def test_the_store_with_l3_demotes_instead_of_evicting_and_loads_hits_back() -> None:
    # L2 of 2, L3 of 4. [C, D] pushes [A, B] down to L3 (one L2 alone would lose them);
    # the next [A, B] hits there and loads them back into L2, demoting C and D.
    trace = [req(A, B), req(C, D), req(A, B), req(A, B), req(C, D)]
    store = sim.StorePolicy(2, trace, l3_blocks=4)
    hits = [store.access(r, q.hash_ids) for r, q in enumerate(trace)]  # type: ignore[attr-defined]
    assert hits == [[], [], ["nvme", "nvme"], ["dram", "dram"], ["nvme", "nvme"]]
    assert store.cached_blocks() == {C, D}  # L2; A and B are in L3 again
    index = store.index
    assert {int.from_bytes(e.key, "big") for e in index.entries(Tier.NVME)} == {A, B}
    assert hits_per_request(sim.StorePolicy, 2, trace) == [0, 0, 0, 2, 0]  # L2 alone


def test_simulate_with_l3_reports_hits_per_tier() -> None:
    trace = [req(A, B), req(C, D), req(A, B), req(A, B)]
    results = {r.policy: r for r in sim.simulate(trace, [2], l3_factor=2.0)}
    store = results["store"]
    assert store.capacity_blocks == 6 and results["lru"].capacity_blocks == 6
    assert store.tier_token_hits == {"nvme": 1024, "dram": 1024}
    assert store.token_hits == 2048 == results["lru"].token_hits  # 6 blocks hold them all


def test_belady_prefers_the_child_on_a_tie() -> None:
    # A, B and C are never used again (a tie); the deeper B goes, never its parent A.
    trace = [req(A, B), req(C)]
    policy = pol.BeladyPolicy(2, trace)
    policy.access(0, trace[0].hash_ids)  # type: ignore[attr-defined]
    policy.access(1, trace[1].hash_ids)  # type: ignore[attr-defined]
    assert policy.cached_blocks() == {A, C}


def test_next_uses() -> None:
    trace = [req(A, B), req(C), req(A)]
    assert pol.next_uses(trace) == [[2, 3], [3], [3]]


def test_remaining_uses_counts_later_requests() -> None:
    trace = [req(A, B), req(A), req(C), req(A, B)]
    assert pol.remaining_uses(trace) == [[2, 1], [1], [0], [0, 0]]


def test_the_frequency_oracle_keeps_the_block_used_more_often_later() -> None:
    # Capacity 1. After [A] and [B], A has two more uses and B one: B goes, so A hits
    # twice; LRU drops A for B and hits once; Belady also hits A twice.
    trace = [req(A), req(B), req(A), req(A), req(B)]
    assert hits_per_request(pol.FrequencyOraclePolicy, 1, trace) == [0, 0, 1, 1, 0]
    assert hits_per_request(pol.LruPolicy, 1, trace) == [0, 0, 0, 1, 0]
    assert hits_per_request(pol.BeladyPolicy, 1, trace) == [0, 0, 1, 1, 0]


def test_the_frequency_oracle_is_blind_to_when() -> None:
    # Capacity 1. After [A] and [B], A has three more uses and B two, but B's come first:
    # the oracle keeps A and misses B twice (3 hits); Belady keeps B, then A (4 hits).
    trace = [req(A), req(B), req(B), req(B), req(A), req(A), req(A)]
    assert hits_per_request(pol.FrequencyOraclePolicy, 1, trace) == [0, 0, 0, 0, 1, 1, 1]
    assert hits_per_request(pol.BeladyPolicy, 1, trace) == [0, 0, 1, 1, 0, 1, 1]


def test_capacities_resolve_fractions_and_absolute_numbers() -> None:
    assert sim.resolve_capacities("0.05,0.1,300", 1000) == [
        ("5pct", 50), ("10pct", 100), ("300blocks", 300)]
    assert sim.resolve_capacities("0.025", 1000) == [("2_5pct", 25)]
    with pytest.raises(ValueError, match="positive"):
        sim.resolve_capacities("0", 10)
    with pytest.raises(ValueError, match="'ten' is not a number"):
        sim.resolve_capacities("0.1,ten", 10)


@pytest.mark.parametrize(("row", "message"), [
    ('{"timestamp": 0, "input_length": 10, "output_length": 1', "not JSON"),
    ("[1, 2]", "a row must be a JSON object"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "hash_ids must be"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": []}',
     "hash_ids must be"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, -2]}',
     "hash_ids must be"),
    ('{"timestamp": "now", "input_length": 10, "output_length": 1, "hash_ids": [1]}',
     "timestamp must be a number"),
    ('{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": [1]}',
     "input_length must be a number >= 0"),
    ('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}', "output_length must be"),
    ('{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}',
     "input_length 1025 needs more than the 2 blocks"),
])
def test_a_malformed_row_is_named_by_line_and_field(tmp_path: Path, row: str,
                                                    message: str) -> None:
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    trace = tmp_path / "trace.jsonl"
    trace.write_text(f"{good}\n\n{row}\n")
    with pytest.raises(sim.TraceError, match=f"trace.jsonl:3: {message}"):
        sim.load_trace(trace)


def test_main_answers_a_bad_trace_or_capacity_with_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    for argv, message in [
        (["--trace", str(tmp_path / "missing.jsonl")], "cannot read trace"),
        (["--trace", str(empty)], "empty.jsonl: no requests"),
        (["--trace", str(empty), "--requests", "0"], "--requests must be >= 1"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            sim.main(argv)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(SystemExit):
        sim.main(["--trace", str(trace), "--capacities", "0.1,-3"])
    assert "--capacities: capacity '-3' must be a positive number" in capsys.readouterr().err


def test_load_trace_and_main_print_house_lines(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"timestamp": t, "input_length": 1000, "output_length": 2, "hash_ids": [A, B]}
            for t in range(3)] + [{"timestamp": 9, "input_length": 512, "output_length": 1,
                                   "hash_ids": [C]}]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert sim.load_trace(trace)[3] == sim.Request(9.0, 512, 1, (C,))
    report = tmp_path / "report.json"
    assert sim.main(["--trace", str(trace), "--capacities", "0.5,2", "--json", str(report)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("bench ")]
    assert [ln.split(":")[0] for ln in lines] == [
        "bench sim_tokens_50pct", "bench sim_vs_lru_50pct",
        "bench sim_tokens_2blocks", "bench sim_vs_lru_2blocks"]
    assert " ratio vs belady " in lines[0] and " ratio vs lru " in lines[1]
    figures = json.loads(report.read_text())["figures"]
    assert figures["sim_tokens_2blocks"]["ours"] == pytest.approx(2000 / 3512)  # 2 of 3 [A, B] hit

    assert sim.main(["--trace", str(trace), "--capacities", "1", "--l3", "1"]) == 0
    out = capsys.readouterr().out
    assert "# capacity 1blocks = 1 blocks of dram + 1 of nvme (one cache of 2" in out
    assert "#   store token hits by tier: dram " in out
    assert "bench sim_tokens_1blocks_l3x1: " in out and "(target" not in out


# --- random prefix-consistent traces -----------------------------------------------------------

# A request is a path from the root of a small tree: its blocks are the path's prefixes, so a
# block's parent is the same in every request (as with real prefix hashes).
paths = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5), min_size=1, max_size=25)


def tree_trace(choices: list[list[int]]) -> tuple[list[object], dict[int, int | None]]:
    ids: dict[tuple[int, ...], int] = {}
    parent: dict[int, int | None] = {}
    trace: list[object] = []
    for path in choices:
        blocks = []
        for depth in range(1, len(path) + 1):
            node = ids.setdefault(tuple(path[:depth]), len(ids))
            parent[node] = blocks[-1] if blocks else None
            blocks.append(node)
        trace.append(req(*blocks))
    return trace, parent


@settings(max_examples=60, deadline=None)
@given(choices=paths, capacity=st.integers(1, 8))
def test_belady_is_never_below_lru_or_the_store(choices: list[list[int]], capacity: int) -> None:
    trace, _ = tree_trace(choices)
    results = {r.policy: r for r in sim.simulate(trace, [capacity])}
    assert list(results) == ["lru", "store", "freq_oracle", "belady"]
    belady = results.pop("belady")
    for other in results.values():  # full blocks only, so tokens follow blocks
        assert belady.block_hits >= other.block_hits and belady.token_hits >= other.token_hits


@settings(max_examples=60, deadline=None)
@given(choices=paths, capacity=st.integers(1, 8))
def test_store_and_belady_never_keep_a_child_without_its_parent(
    choices: list[list[int]], capacity: int
) -> None:
    trace, parent = tree_trace(choices)
    policies = [sim.StorePolicy(capacity, trace), pol.BeladyPolicy(capacity, trace),
                sim.StorePolicy(capacity, trace, l3_blocks=2 * capacity)]
    for n, policy in enumerate(policies):
        for r, request in enumerate(trace):
            policy.access(r, request.hash_ids)
            cached = policy.cached_blocks()
            if n == 2:  # L2 and L3 together hold whole prefixes
                cached = {int.from_bytes(e.key, "big") for e in policy.index.entries()}
            assert len(cached) <= capacity * (3 if n == 2 else 1)
            orphans = {b for b in cached if parent[b] is not None and parent[b] not in cached}
            assert not orphans, (type(policy).__name__, n, r)
