"""bench/trace_families.py: every family is reproducible by seed, valid Mooncake format (read
back through trace_sim's own loader), prefix-consistent (an id stands for its whole prefix),
and has the shape it claims; and each runs through trace_sim's policies end to end."""

from __future__ import annotations

import collections
import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import REPO


def _load(name: str) -> ModuleType:
    # bench scripts import their siblings by bare name, as when run as scripts.
    bench = str(REPO / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module(name)


tf, sim = _load("trace_families"), _load("trace_sim")
GENERATED = ("multiturn", "sysprompt", "rag", "agent")
SMALL = 300  # requests, for the checks that need no long tail


@pytest.fixture(scope="module")
def full() -> dict[str, Any]:
    """Every family at its default size (about 0.3 s each)."""
    return {family: tf.generate(family) for family in tf.FAMILIES}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# --- the block table ---------------------------------------------------------------------------


def test_block_ids_follow_the_whole_prefix() -> None:
    table = tf.BlockTable()
    sys_a = table.chain([("sys-a", 1024), ("doc", 512)])
    assert sys_a == [0, 1, 2]
    assert table.chain([("sys-a", 1024), ("doc", 512)]) == sys_a  # the same prompt, same ids
    # The same document after another system prompt is other blocks, though its tokens match.
    assert table.chain([("sys-b", 1024), ("doc", 512)]) == [3, 4, 5]
    # A partial last block is its own block; filled up by the next turn, it is another one.
    short = table.chain([("sys-a", 1024), ("doc", 200)])
    longer = table.chain([("sys-a", 1024), ("doc", 200), ("answer", 312)])
    assert short[:2] == longer[:2] == sys_a[:2] and len({short[2], longer[2], sys_a[2]}) == 3
    # One block can hold the end of one segment and the start of the next.
    assert table.chain([("x", 100), ("y", 412)]) != table.chain([("x", 100), ("z", 412)])
    assert len(table) == 10


# --- every family ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", GENERATED)
def test_a_family_is_the_same_for_a_seed_and_another_for_another(family: str) -> None:
    one = tf.generate(family, seed=7, num_requests=SMALL)
    assert tf.generate(family, seed=7, num_requests=SMALL) == one
    assert len(one.rows) == SMALL
    assert tf.generate(family, seed=8, num_requests=SMALL).rows != one.rows


def test_the_cli_writes_the_same_trace_in_another_process(tmp_path: Path) -> None:
    # Another process with another string-hash seed: nothing may depend on hash().
    out = tmp_path / "rag.jsonl"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "trace_families.py"), "rag", "--out", str(out),
         "--seed", "3", "--requests", str(SMALL)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"# wrote {out}: rag seed 3, {SMALL} requests, ")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == tf.generate("rag", seed=3, num_requests=SMALL).rows


@pytest.mark.parametrize("family", tf.FAMILIES)
def test_a_family_is_a_mooncake_trace_trace_sim_reads(family: str, full: dict[str, Any],
                                                      tmp_path: Path) -> None:
    trace = full[family]
    path = tmp_path / f"{family}.jsonl"
    tf.write_trace(trace.rows, path)
    requests = sim.load_trace(path)  # its checks: the fields, and enough blocks for the tokens
    assert len(requests) == len(trace.rows) == len(trace.origins) >= 1000
    assert [r.hash_ids for r in requests] == [tuple(row["hash_ids"]) for row in trace.rows]
    for request in requests:  # one id per 512 tokens, the last block maybe partial
        assert len(request.hash_ids) == math.ceil(request.input_length / 512)
        assert request.output_length >= 1
    times = [r.timestamp for r in requests]
    assert times == sorted(times) and times[-1] > times[0]
    distinct = sim.distinct_blocks(requests)
    assert distinct >= 2500 and sum(len(r.hash_ids) for r in requests) >= 4 * distinct / 3
    first_uses = list(dict.fromkeys(h for r in requests for h in r.hash_ids))
    assert first_uses == list(range(distinct))  # numbered from 0 in order of first use


@pytest.mark.parametrize("family", tf.FAMILIES)
def test_an_id_stands_for_its_whole_prefix(family: str, full: dict[str, Any]) -> None:
    # Every id has one parent (the id before it), in every request that holds it: so two
    # requests share an id at a position only if they agree on everything before it.
    parent: dict[int, int | None] = {}
    for n, row in enumerate(full[family].rows):
        ids = row["hash_ids"]
        assert len(set(ids)) == len(ids), (family, n)  # a chain never comes back to itself
        for i, h in enumerate(ids):
            assert parent.setdefault(h, ids[i - 1] if i else None) == (ids[i - 1] if i else None)


# --- the shape each family claims --------------------------------------------------------------


def test_multiturn_turns_re_send_the_conversation(full: dict[str, Any]) -> None:
    trace = full["multiturn"]
    rows, origins = trace.rows, trace.origins
    last_turn: dict[int, int] = {}
    for n, origin in enumerate(origins):
        previous = last_turn.get(origin.session)
        assert origin.extends == (-1 if previous is None else previous)
        last_turn[origin.session] = n
        if previous is None:
            assert origin.step == 0
            continue
        before, now = rows[previous], rows[n]
        assert origin.step == origins[previous].step + 1
        assert now["timestamp"] > before["timestamp"]  # after the answer and a think time
        assert now["input_length"] > before["input_length"] + before["output_length"]
        full_blocks = before["input_length"] // 512  # a partial last block fills up: new id
        assert now["hash_ids"][:full_blocks] == before["hash_ids"][:full_blocks]
        if before["input_length"] % 512:
            assert now["hash_ids"][full_blocks] != before["hash_ids"][full_blocks]
    turns = collections.Counter(o.session for o in origins).values()
    assert sum(t == 1 for t in turns) > len(turns) / 3 and max(turns) >= 20  # heavy-tailed
    spans = collections.defaultdict(list)
    for n, origin in enumerate(origins):
        spans[origin.session].append(n)
    interleaved = sum(s[-1] - s[0] + 1 > len(s) for s in spans.values())
    assert interleaved > len(spans) / 4  # sessions interleave


def test_sysprompt_requests_open_with_a_few_skewed_system_prompts(
        full: dict[str, Any]) -> None:
    rows = full["sysprompt"].rows
    firsts = collections.Counter(row["hash_ids"][0] for row in rows)
    assert len(firsts) <= tf.Sysprompt.prompts  # every first block is a system prompt's
    counts = sorted(firsts.values(), reverse=True)
    assert counts[0] > 3 * counts[-1]  # popularity is skewed
    # After the system prompt, a question seen once: its blocks are in no other request.
    uses = collections.Counter(h for row in rows for h in row["hash_ids"])
    assert all(uses[row["hash_ids"][-1]] == 1 for row in rows)


def test_rag_hot_documents_recur_and_hit_only_after_the_same_prefix(
        full: dict[str, Any]) -> None:
    trace = full["rag"]
    docs = collections.Counter(d for o in trace.origins for d in o.parts[1:])
    top, top_count = docs.most_common(1)[0]
    assert top_count > len(trace.rows) / 3 and len(docs) > 100  # a few hot, a long tail
    # The top document second, after two different first documents: the two requests share
    # only the system prompt's full blocks, not one block of the document.
    system_blocks = tf.Rag.system_tokens // 512
    second: dict[str, list[int]] = {}
    for row, origin in zip(trace.rows, trace.origins, strict=True):
        if origin.parts[2] == top:
            second.setdefault(origin.parts[1], row["hash_ids"])
    assert len(second) >= 2
    a, b = list(second.values())[:2]
    assert common_prefix(a, b) == system_blocks


def test_agent_transcripts_grow_are_re_sent_and_fork(full: dict[str, Any]) -> None:
    trace = full["agent"]
    rows, origins = trace.rows, trace.origins
    children = collections.Counter(o.extends for o in origins if o.extends >= 0)
    for n, origin in enumerate(origins):
        if origin.extends < 0:
            continue
        before, now = rows[origin.extends], rows[n]
        full_blocks = before["input_length"] // 512
        assert now["hash_ids"][:full_blocks] == before["hash_ids"][:full_blocks]
        assert now["input_length"] >= before["input_length"]
    forks = [n for n, count in children.items() if count == 2]
    assert forks and max(children.values()) == 2  # now and then two branches of one transcript
    lengths = [row["input_length"] for row in rows]
    assert sorted(lengths)[len(lengths) // 2] > 8000  # long contexts
    assert len({o.parts for o in origins}) <= tf.Agent.system_prompts


# --- end to end through trace_sim --------------------------------------------------------------


@pytest.mark.parametrize("family", tf.FAMILIES)
def test_a_tiny_family_runs_through_every_policy(family: str) -> None:
    trace = tf.generate(family, num_requests=120)
    requests = [sim.request_from_row(row, f"{family}:{n}") for n, row in enumerate(trace.rows)]
    [(_, capacity)] = sim.resolve_pcts("10", sim.distinct_blocks(requests))
    results = {r.policy: r for r in sim.simulate(requests, [capacity])}
    assert list(results) == ["lru", "store", "freq_oracle", "belady"]
    belady = results.pop("belady")
    assert belady.block_hits > 0
    for other in results.values():
        assert belady.block_hits >= other.block_hits, other.policy


def test_trace_sim_family_prints_a_figure_per_family_and_capacity(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "report.json"
    argv = ["--family", "all", "--requests", "150", "--capacity-pcts", "10,40",
            "--json", str(report)]
    assert sim.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    lines = [ln for ln in out if ln.startswith("bench ")]
    assert [ln.split(":")[0] for ln in lines] == [
        f"bench sim_vs_lru_{f}_{pct}pct" for f in tf.FAMILIES for pct in (10, 40)]
    assert all(" ratio vs lru " in ln for ln in lines)
    targets = {ln.split(":")[0]: ln.rsplit("(target ", 1)[1] for ln in lines}
    assert targets["bench sim_vs_lru_synthetic_10pct"] == ">= 1.08x)"
    assert targets["bench sim_vs_lru_synthetic_40pct"] == ">= 1.00x)"
    assert targets["bench sim_vs_lru_agent_10pct"] == ">= 1.00x)"
    table = [ln for ln in out if ln.startswith("# | ")]
    assert table[0].startswith("# | trace | capacity | blocks | lru | store | freq_oracle ")
    assert len(table) == 1 + 2 * len(tf.FAMILIES) and table[1].startswith("# | multiturn | 10pct")
    saved = json.loads(report.read_text())
    figure = saved["figures"]["sim_vs_lru_rag_40pct"]
    assert set(figure["token_hit_rates"]) == {"lru", "store", "freq_oracle", "belady"}
    assert figure["ours"] == figure["token_hit_rates"]["store"]
    assert saved["setup"]["families"]["agent"]["requests"] == 150
    assert saved["setup"]["seed"] == 0


def test_trace_sim_answers_flags_that_clash_with_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in [
        (["--family", "rag", "--trace", "x.jsonl"], "--trace and --family: give one"),
        (["--family", "rag", "--capacities", "0.1", "--capacity-pcts", "10"],
         "--capacities and --capacity-pcts: give one"),
        (["--family", "rag", "--capacity-pcts", "0"], "--capacity-pcts: capacity '0' must be"),
        (["--family", "nope"], "invalid choice: 'nope'"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            sim.main(argv)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
