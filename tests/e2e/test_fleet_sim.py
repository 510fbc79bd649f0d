"""bench/fleet_sim.py: its quick run in the session's shared bench run prints every figure in
the house format; every request is served once and hits no more than its prompt, under every
policy; on a trace built so that only a router that follows the replicas' caches can hit,
prefix-aware routing beats round robin; the router's view is exactly what the replicas
announced (the store's blocks per medium, the pool's blocks), and a block cached without an
announcement draws no request; bad flags exit 2 naming the flag."""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import pytest

from kvstore.tier import Tier
from tests.conftest import REPO
from tests.e2e.bench_run import BenchRun
from tests.e2e.house_format import check_report, printed_figures

SCRIPT = REPO / "bench" / "fleet_sim.py"
TRACE = REPO / "bench" / "traces" / "mooncake_synthetic_trace.jsonl"


def _load() -> ModuleType:
    # bench scripts import their siblings (figures, sim_store) by bare name.
    bench = str(REPO / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module("fleet_sim")


fleet = _load()
trace_sim = importlib.import_module("trace_sim")  # on the path _load set
sim_store = importlib.import_module("sim_store")


def request(timestamp: float, ids: Sequence[int], output_length: int = 8) -> Any:
    return trace_sim.Request(timestamp, 512 * len(ids), output_length, tuple(ids))


def drive(requests: Sequence[Any], policy: str, config: Any,
          utilization: float = 0.5) -> tuple[Any, Any, list[int]]:
    """The fleet after every request, as fleet_sim.simulate runs it; its result; and the
    replica each request was sent to."""
    f = fleet.Fleet(config, policy)
    times = fleet.arrival_times_ms(requests, config.costs, config.replicas, utilization)
    sent = [f.arrive(r, at_ms) for r, at_ms in zip(requests, times, strict=True)]
    return f, f.finish(), sent


def public_trace(n: int) -> list[Any]:
    requests: list[Any] = trace_sim.load_trace(TRACE)[:n]
    return requests


# --- the shared quick run -----------------------------------------------------------------------


@pytest.mark.bench("fleet_sim")
def test_quick_run_reports_every_figure_in_house_format(bench_run: BenchRun) -> None:
    run = bench_run.script("fleet_sim")
    run.assert_ok()
    assert all(line.startswith(("bench ", "#")) for line in run.lines), run.lines
    expected = {f"fleet_{name}_n{n}" for n in (4, 16)
                for name in ("hit_rate", "local_hit_rate", "prefill_saved", "imbalance")}
    check_report(run.report["figures"], printed_figures(run.lines), expected)
    figures = run.report["figures"]
    # The benchmark's sizes (L2 5%, L4 50%) at 16 replicas carry the targets.
    assert figures["fleet_hit_rate_n16"]["target"] == ">= 1.5x"
    assert figures["fleet_imbalance_n16"]["target"] == "<= 1.25 ratio"
    assert figures["fleet_hit_rate_n4"]["target"] == ""
    rows = [line for line in run.lines if line.startswith("# | 4 |")
            or line.startswith("# | 16 |")]
    assert len(rows) == 2 * len(fleet.POLICY_NAMES), rows
    setup = run.report["setup"]
    assert setup["requests"] == 600 and setup["l2_pct"] == 5.0 and setup["l4_pct"] == 50.0
    assert {r["policy"] for r in setup["results"]} == set(fleet.POLICY_NAMES)
    assert [row["lambda"] for row in setup["sweep"]] == [0.5, 2.0]


# --- invariants -----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "session_affinity",
                                    "prefix_aware"])
def test_every_request_is_served_once_and_hits_at_most_its_prompt(policy: str) -> None:
    requests = public_trace(300)
    distinct = trace_sim.distinct_blocks(requests)
    # An L3 twice L2's size, so demotions and loads from L3 happen too.
    config = fleet.FleetConfig(4, l2_blocks=distinct // 20, l4_blocks=distinct // 2,
                               l3_blocks=distinct // 10)
    _, result, sent = drive(requests, policy, config)
    assert result.served == [1] * len(requests)
    assert len(result.latencies_ms) == len(requests)
    assert all(0 <= hit <= tokens for hit, tokens in
               zip(result.request_hit_tokens, result.request_tokens, strict=True))
    assert result.tokens == sum(result.request_tokens)
    assert result.token_hits == sum(result.request_hit_tokens) <= result.tokens
    assert result.token_hits > 0  # the trace repeats prefixes: some hit, whatever the routing
    assert result.requests_per_replica == [sent.count(r) for r in range(4)]
    assert result.imbalance >= 1.0
    assert 0 < result.prefill_ms < result.recompute_ms
    if policy == "round_robin":
        assert sent == [i % 4 for i in range(len(requests))]
        assert result.imbalance == 1.0
    if policy == "session_affinity":  # one replica per session (the first hash id)
        by_session: dict[int, set[int]] = {}
        for r, replica in zip(requests, sent, strict=True):
            by_session.setdefault(r.hash_ids[0], set()).add(replica)
        assert all(len(replicas) == 1 for replicas in by_session.values())


def conversations(sessions: int, turns: int, base_blocks: int) -> list[Any]:
    """Round after round, every session's next turn: session s re-sends its base blocks and
    every turn's message so far, one block a turn."""
    rows: list[Any] = []
    for t in range(turns):
        for s in range(sessions):
            base = [1000 * (s + 1) + b for b in range(base_blocks)]
            rows.append(request(len(rows), base + [1000 * (s + 1) + 500 + k
                                                   for k in range(t + 1)]))
    return rows


def test_prefix_aware_routing_wins_where_only_the_caches_can_tell() -> None:
    # 7 sessions over 4 replicas: round robin sends a session's turns to every replica in
    # turn, each replica's L2 (40 blocks) holds about two sessions, and there is no L4, so a
    # turn hits only where the router sent that session before.
    requests = conversations(sessions=7, turns=6, base_blocks=12)
    config = fleet.FleetConfig(4, l2_blocks=40, l4_blocks=0)
    results = {p: drive(requests, p, config, utilization=0.1)[1] for p in fleet.POLICY_NAMES}
    prefix, rr = results["prefix_aware"], results["round_robin"]
    rates = {p: r.token_hit_rate for p, r in results.items()}
    # Every turn after a session's first finds its whole prefix: the ceiling of any routing.
    assert prefix.token_hit_rate == pytest.approx(fleet.ceiling_hit_rate(requests)), rates
    assert prefix.token_hit_rate > 0.5
    assert rr.token_hit_rate <= prefix.token_hit_rate / 1.5, rates
    assert results["least_loaded"].token_hit_rate < prefix.token_hit_rate, rates
    assert prefix.tier_hit_rate(fleet.L4) == rr.tier_hit_rate(fleet.L4) == 0
    assert prefix.imbalance <= 2.0


# --- the router sees only what was announced ----------------------------------------------------


def test_the_router_knows_exactly_what_the_replicas_and_the_pool_announced() -> None:
    requests = public_trace(400)
    distinct = trace_sim.distinct_blocks(requests)
    config = fleet.FleetConfig(3, l2_blocks=distinct // 20, l4_blocks=distinct // 4,
                               l3_blocks=distinct // 20)
    f, _, _ = drive(requests, "prefix_aware", config)
    evicted = 0
    for r, replica in enumerate(f.replicas):
        index = replica.store.index
        # Each block the replica holds, with its fastest tier: what its events said.
        held = {fleet.block_id(e.key): e.tier for e in index.entries()}
        assert f.router.views[r] == held
        assert set(held.values()) == {Tier.DRAM, Tier.NVME}  # demotions were announced too
        evicted += sum(index.evictions.values())
    assert evicted > 0  # and removals, not only stores
    assert len(f.router.pool) == len(f.pool) and all(b in f.pool for b in f.router.pool)
    assert len(f.pool) == config.l4_blocks  # full, so it evicted too


def test_a_block_cached_without_an_announcement_draws_no_request() -> None:
    ids = [7, 8, 9, 10]
    config = fleet.FleetConfig(3, l2_blocks=16, l4_blocks=0)
    for announced in (False, True):
        f = fleet.Fleet(config, "prefix_aware")
        replica = f.replicas[1]
        if not announced:  # the index tells no event log of its changes
            replica.store.index.published = None
        replica.store.access(0, ids)  # replica 1 caches the prefix, outside the router
        assert replica.store.index.lookup("sim", [sim_store.block_key(i) for i in ids])[0] == 4
        events, replica.cursor = fleet.read_events(replica.events, replica.cursor)
        f.router.apply(1, events)
        # Every replica idle and sent nothing: without the events, ties go to replica 0.
        chosen = f.arrive(request(0, ids), 0.0)
        assert chosen == (1 if announced else 0)
    # The router is built from events alone: it holds no store, index, log or replica.
    assert not any(isinstance(v, fleet.Replica | fleet.StorePolicy | fleet.EventLog)
                   for v in vars(f.router).values())


# --- the command line -----------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "named"), [
    (["--replicas", "4,0"], "--replicas"),
    (["--l4-pct", "120"], "--l4-pct"),
    (["--load-ms", "1,2"], "--load-ms"),
    (["--trace", "/nonexistent/trace.jsonl"], "cannot read trace"),
])
def test_bad_flags_exit_2_naming_what_to_fix(args: list[str], named: str) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert named in proc.stderr and "Traceback" not in proc.stderr
