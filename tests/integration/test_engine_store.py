"""The engine with a real kvstore daemon: prompts found in the store are loaded instead of
computed and the tokens do not change (and each request's metrics count the bytes loaded);
a second engine process hits what the first wrote;
preemption by swap gives the tokens of a run without preemption; a fresh daemon pre-warmed
from L4 serves the first request; a daemon killed mid-run costs nothing but speed."""

from __future__ import annotations

import json
import logging
import random
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.engine.errors import InvalidRequestError
from kvstore.engine.llm import LLM
from kvstore.engine.random_model import save_random_llama
from kvstore.engine.sampling import SamplingParams
from kvstore.kernels import gather_blocks
from kvstore.keys import prefix_keys
from kvstore.tools.slowlink import SlowLink
from kvstore.tools.testing import Daemon, RedisServer, start_redis_on
from tests.conftest import REPO
from tests.engine.models import TINY, save_tiny

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LOCAL = ("dram.capacity_bytes=32MiB", "dram.page_size_bytes=8KiB", "hbm.mode=off",
         "nvme.enabled=false")
Make = Callable[..., Daemon]
# One stored block of the tiny Llama as the engine runs it on the CPU (float32): every
# layer's K and V of 16 tokens, worked out from the checkpoint's shape, not the engine's.
BLOCK_BYTES = (TINY["num_hidden_layers"] * 2 * 16 * TINY["num_key_value_heads"]
               * (TINY["hidden_size"] // TINY["num_attention_heads"]) * 4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture
def model(tiny: Path, tmp_path: Path) -> Path:
    """The module's model under a folder name of the test's own (a link): the engine names
    its store namespace after the folder, so engines of different tests never share blocks
    on a shared daemon."""
    link = tmp_path / f"llama-{secrets.token_hex(4)}"
    link.symlink_to(tiny, target_is_directory=True)
    return link


@pytest.fixture
def local(shared_daemon: Make) -> Daemon:
    """The shared daemon with LOCAL settings, for tests that neither stop it nor need it
    empty: each test's engines use namespaces of their own (`model`)."""
    return shared_daemon(*LOCAL)


@pytest.fixture
def engines(request: pytest.FixtureRequest) -> Iterator[Callable[..., LLM]]:
    made: list[LLM] = []

    def make(path: Path, **kw: Any) -> LLM:
        kw.setdefault("num_blocks", 256)
        llm = LLM(str(path), device="cpu", **kw)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.close()
    if "local" in request.fixturenames:  # the shared daemon: take this test's blocks out
        d: Daemon = request.getfixturevalue("local")
        for namespace in {llm.namespace for llm in made}:
            with KVStoreClient(d.target, namespace, shared_memory=False) as kv:
                kv.evict(all=True)


def _prompts(count: int = 3, length: int = 70, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(length + 9 * i)] for i in range(count)]


def _tokens(outs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# L3: a 1 MiB L2 of 8 KiB pages, so a flood of other blocks pushes the engine's down.
L3 = ("dram.capacity_bytes=1MiB", "dram.page_size_bytes=8KiB", "hbm.mode=off",
      "nvme.capacity_bytes=16MiB", "nvme.page_size_bytes=8KiB", "movers.interval_s=0.02")


def _push_to_l3(target: str, namespace: str, keys: list[bytes]) -> None:
    with KVStoreClient(target, "flood") as kv:
        for i in range(8):
            fill = [bytes([i, j]) * 16 for j in range(32)]
            kv.put(fill, [bytes(8192)] * 32, independent=True)
    with KVStoreClient(target, namespace) as kv:
        deadline = time.monotonic() + 15
        while set(kv.lookup(keys).tiers) != {"nvme"}:
            assert time.monotonic() < deadline, kv.lookup(keys).tiers
            time.sleep(0.05)


def _drain_l4(target: str, namespace: str) -> None:
    with KVStoreClient(target, namespace) as kv:
        deadline = time.monotonic() + 15
        while kv.stats().tier("remote").queue_depth:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "L4 write-through never drained"
            time.sleep(0.05)


def test_a_prefix_from_dram_equals_recompute(
    model: Path, local: Daemon, daemon_factory: Make, engines: Callable[..., LLM]
) -> None:
    _prefix_from_tier(model, local, daemon_factory, engines, "dram", LOCAL)


@pytest.mark.parametrize("tier", ["nvme", "remote"])
def test_prefix_from_the_store_equals_recompute(
    tiny: Path, daemon_factory: Make, engines: Callable[..., LLM], tmp_path: Path, tier: str
) -> None:
    """On daemons of their own: the nvme case floods L2 to push the blocks down, the remote
    case reads them from a fresh daemon."""
    redis = start_redis_on(tmp_path) if tier == "remote" else None
    try:
        settings = L3
        if redis is not None:
            settings = (*LOCAL, f"remote.url={redis.url}", "remote.timeout_s=1")
        d = daemon_factory(*settings)
        _prefix_from_tier(tiny, d, daemon_factory, engines, tier, settings)
    finally:
        if redis is not None:
            redis.stop()


def test_a_closed_engine_closes_again_at_once(
        model: Path, local: Daemon, engines: Callable[..., LLM]) -> None:
    """close() waits for the queued offloads; afterwards nothing is left to wait for, so a
    second close (a `with` block, then its owner's) returns at once instead of waiting out
    the flush timeout."""
    llm = engines(model, store=local.target)
    llm.generate(_prompts(count=1), GREEDY)
    llm.close()
    assert llm.connector is not None and llm.connector.stats.offloaded_blocks > 0
    assert llm.connector.link.flush(timeout_s=0)  # nothing queued, the close's own included
    llm.close()


def _prefix_from_tier(tiny: Path, d: Daemon, daemon_factory: Make,
                      engines: Callable[..., LLM], tier: str, settings: tuple[str, ...]) -> None:
    prompts = _prompts()
    want = _tokens(engines(tiny).generate(prompts, GREEDY))  # no store at all
    writer = engines(tiny, store=d.target)
    written = writer.generate(prompts, GREEDY)
    assert _tokens(written) == want
    assert [o.metrics.store_loaded_bytes for o in written] == [0, 0, 0]  # nothing to load
    writer.close()  # waits for the offloads
    assert writer.connector is not None and writer.connector.stats.offloaded_blocks > 0
    keys = [k for p in prompts for k in prefix_keys(p, 16, writer.namespace)]
    if tier == "nvme":
        _push_to_l3(d.target, writer.namespace, keys)
    if tier == "remote":
        _drain_l4(d.target, writer.namespace)
        d = daemon_factory(*settings)  # a fresh daemon: only Redis has the blocks
    with KVStoreClient(d.target, writer.namespace) as kv:
        assert set(kv.lookup(keys).tiers) == {tier}

    reader = engines(tiny, store=d.target)
    outs = reader.generate(prompts, GREEDY)
    assert _tokens(outs) == want
    # Every full prompt block but the last token's comes from the store, none computed.
    assert [o.metrics.store_prompt_tokens for o in outs] == [(len(p) - 1) // 16 * 16
                                                             for p in prompts]
    assert [o.metrics.cached_prompt_tokens for o in outs] == [o.metrics.store_prompt_tokens
                                                              for o in outs]
    # The bytes: every block that arrived, each all 2 layers' K and V (8 KiB here).
    assert reader.dtype == torch.float32 and BLOCK_BYTES == 8192
    assert [o.metrics.store_loaded_bytes for o in outs] == [(len(p) - 1) // 16 * BLOCK_BYTES
                                                            for p in prompts]
    # Greedy tokens of a random model barely depend on far context: check the loaded K/V
    # themselves, bit for bit, against the blocks the writer computed.
    for prompt in prompts:
        assert torch.equal(_kv_of(reader, prompt), _kv_of(writer, prompt))


def _kv_of(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The K/V of prompt's full blocks (but the last token's) from llm's prefix cache."""
    hit = llm.block_manager.find_prefix(prefix_keys(prompt, 16, llm.namespace), len(prompt))
    assert hit.num_tokens == (len(prompt) - 1) // 16 * 16
    return gather_blocks(llm.runner.kv_cache, hit.block_ids)


_CHILD = """
import json, sys
from kvstore.engine.llm import LLM
from kvstore.engine.sampling import SamplingParams
model, target, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
with LLM(model, device="cpu", num_blocks=64, store=target) as llm:
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
print(json.dumps({"tokens": out.outputs[0].token_ids,
                  "store": out.metrics.store_prompt_tokens}))
"""


def test_a_second_engine_process_hits_what_the_first_wrote(
    model: Path, local: Daemon
) -> None:
    d = local
    prompt = _prompts(1, length=100)[0]

    def run() -> dict[str, Any]:
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(model), d.target,
                               json.dumps(prompt)], capture_output=True, text=True,
                              timeout=120, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        result: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
        return result

    first, second = run(), run()
    assert first["store"] == 0
    assert second["store"] == 96
    assert second["tokens"] == first["tokens"]


def test_preemption_by_swap_matches_no_preemption(
    model: Path, local: Daemon, engines: Callable[..., LLM]
) -> None:
    d = local
    prompts = _prompts(3, length=40, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)
    want = _tokens(engines(model).generate(prompts, params))
    # 16 blocks, and each sequence grows to 130-148 tokens (9 or 10 blocks): any two running
    # at once must preempt one, however the store's answers stagger their admission (with
    # shorter sequences whether a preemption happened depended on that timing). The local
    # cache evicts a preempted sequence's blocks before it resumes, so they come back from
    # the store.
    swap = engines(model, store=d.target, num_blocks=16, preemption_mode="swap",
                   enable_prefix_caching=True)
    outs = swap.generate(prompts, params)
    assert _tokens(outs) == want
    assert sum(o.metrics.preemptions for o in outs) > 0
    stats = swap.connector.stats if swap.connector else None
    assert stats is not None and stats.swapped_out_blocks > 0 and stats.loaded_blocks > 0


def test_a_block_lost_before_its_load_is_recomputed(
    model: Path, local: Daemon, engines: Callable[..., LLM]
) -> None:
    d = local
    [prompt] = _prompts(1, length=100, seed=5)
    writer = engines(model, store=d.target)
    want = _tokens(writer.generate([prompt], GREEDY))
    writer.close()
    reader = engines(model, store=d.target)
    assert reader.connector is not None
    keys = prefix_keys(prompt, 16, reader.namespace)
    start_load = reader.connector.start_load

    def evict_third_then_load(plan: Any, tier: str = "") -> None:
        # Lookup said 6 blocks; block 2 (and with it 3.., its descendants) leaves the store
        # before the load reads it.
        with KVStoreClient(d.target, reader.namespace) as kv:
            assert kv.evict(keys=[keys[2]]).evicted >= 4
            assert kv.lookup(keys).tiers == ["dram", "dram", None, None, None, None]
        start_load(plan, tier)

    reader.connector.start_load = evict_third_then_load  # type: ignore[method-assign]
    [out] = reader.generate([prompt], GREEDY)
    assert out.outputs[0].token_ids == want[0]
    assert out.metrics.store_prompt_tokens == 32  # blocks 0 and 1 arrived; 2.. recomputed
    assert out.metrics.store_loaded_bytes == 2 * BLOCK_BYTES  # what arrived, not the plan's 6
    assert reader.connector.stats.load_failures == 1


@pytest.fixture
def co_located(shared_daemon: Make) -> Daemon:
    """The shared daemon with LOCAL settings and its Unix socket: the engine's client reads
    L2 through the daemon's read table (what loads in place need)."""
    return shared_daemon(*LOCAL, unix_socket=True)


def test_loads_in_place_give_the_tokens_of_loads_through_staging(
    model: Path, co_located: Daemon, engines: Callable[..., LLM]
) -> None:
    prompts = _prompts(3, length=70, seed=21)
    writer = engines(model, store=co_located.target)
    want = _tokens(writer.generate(prompts, GREEDY))
    writer.close()
    reader = engines(model, store=co_located.target)
    assert reader.connector is not None and not reader.connector.in_place  # off on a CPU
    reader.connector.in_place = True
    outs = reader.generate(prompts, GREEDY)
    assert _tokens(outs) == want
    stats = reader.connector.stats
    assert stats.loaded_blocks == sum(o.metrics.store_prompt_tokens for o in outs) // 16 > 0
    assert stats.loaded_in_place_blocks == stats.loaded_blocks  # every one from its pages


def test_a_block_moved_while_copied_in_place_is_recomputed(
    model: Path, co_located: Daemon, engines: Callable[..., LLM]
) -> None:
    [prompt] = _prompts(1, length=100, seed=23)
    writer = engines(model, store=co_located.target)
    want = _tokens(writer.generate([prompt], GREEDY))
    writer.close()
    reader = engines(model, store=co_located.target)
    assert reader.connector is not None
    reader.connector.in_place = True
    keys = prefix_keys(prompt, 16, reader.namespace)
    read_in_place = reader.connector.link.read_in_place

    def evict_third_after_reading(*args: Any, **kw: Any) -> Any:
        # The six blocks are read in place; then block 2 (and 3.., its descendants) leaves
        # the store before the engine asks whether they held.
        landed = read_in_place(*args, **kw)
        assert landed.in_place_blocks == 6
        with KVStoreClient(co_located.target, reader.namespace) as kv:
            assert kv.evict(keys=[keys[2]]).evicted >= 4
        return landed

    reader.connector.link.read_in_place = evict_third_after_reading  # type: ignore[method-assign]
    [out] = reader.generate([prompt], GREEDY)
    assert out.outputs[0].token_ids == want[0]
    assert out.metrics.store_prompt_tokens == 32  # blocks 0 and 1 held; 2.. recomputed


def test_a_daemon_killed_mid_run_costs_only_speed(
    tiny: Path, daemon_factory: Make, engines: Callable[..., LLM],
    caplog: pytest.LogCaptureFixture,
) -> None:
    d = daemon_factory(*LOCAL)
    prompts = _prompts(4, length=50, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = _tokens(engines(tiny).generate(prompts, params))
    llm = engines(tiny, store=d.target, store_timeout_s=1.0, max_num_seqs=2)
    steps = 0

    def kill_at_step_3(info: object) -> None:
        nonlocal steps
        steps += 1
        if steps == 3:
            d.proc.kill()
            d.proc.wait()

    caplog.set_level(logging.WARNING, logger="kvstore.engine.connector")
    start = time.monotonic()
    outs = llm.generate(prompts, params, on_step=kill_at_step_3)
    assert _tokens(outs) == want
    assert time.monotonic() - start < 30
    assert llm.connector is not None and not llm.connector.available
    failures = [r for r in caplog.records if "recomputing until the store is back" in r.message]
    assert len(failures) == 1


def test_a_fresh_daemon_prewarmed_from_l4_serves_the_first_request(
    tiny: Path, daemon_factory: Make, engines: Callable[..., LLM], tmp_path: Path
) -> None:
    server: RedisServer = start_redis_on(tmp_path)
    try:
        l4 = (*LOCAL, f"remote.url={server.url}", "remote.popularity_flush_s=0.1",
              "remote.timeout_s=1")
        a = daemon_factory(*l4)
        [prompt] = _prompts(1, length=100, seed=9)
        writer = engines(tiny, store=a.target)
        want = _tokens(writer.generate([prompt], GREEDY))
        writer.close()
        keys = prefix_keys(prompt, 16, writer.namespace)
        with KVStoreClient(a.target, writer.namespace) as kv:
            deadline = time.monotonic() + 15
            while kv.stats().tier("remote").queue_depth and time.monotonic() < deadline:
                time.sleep(0.05)
            for _ in range(3):  # reads make the blocks hot in L4's popularity
                kv.get(keys)
            while not set(keys[:6]) <= set(kv.hot(100).keys):
                assert time.monotonic() < deadline, "the blocks never became hot"
                time.sleep(0.05)

        b = daemon_factory(*l4)
        fresh = engines(tiny, store=b.target, prewarm_bytes=8 << 20)
        assert fresh.connector is not None and fresh.connector.stats.prewarmed_blocks >= 6
        with KVStoreClient(b.target, writer.namespace) as kv:
            assert kv.lookup(keys[:6]).tiers == ["dram"] * 6
        [out] = fresh.generate([prompt], GREEDY)
        assert out.outputs[0].token_ids == want[0]
        assert out.metrics.store_prompt_tokens == 96
    finally:
        server.stop()


def test_swap_needs_a_store(tiny: Path) -> None:
    with pytest.raises(InvalidRequestError, match="needs a store"):
        LLM(str(tiny), device="cpu", preemption_mode="swap")
    with pytest.raises(InvalidRequestError, match="preemption_mode"):
        LLM(str(tiny), device="cpu", preemption_mode="sometimes")



@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model whose prefill of a few hundred tokens costs far more than loading its K/V from
    a local daemon (tens of ms against ~1 ms), and far less than a 1 s round trip: a machine
    busy with other tests slows computing and not the link's delay, and a 0.5 s round trip
    let it flip the choice under two test workers."""
    return save_random_llama(
        tmp_path_factory.mktemp("wide") / "llama", vocab_size=512, hidden_size=512,
        intermediate_size=1408, num_layers=4, num_heads=8, num_kv_heads=2,
        max_position_embeddings=2048)


def _generate(llm: LLM, prompt: list[int]) -> Any:
    [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    return out


@pytest.mark.parametrize("delay_s", [0.0, 1.0])
def test_the_cost_rule_loads_from_a_fast_tier_and_recomputes_from_a_slow_one(
    wide: Path, daemon_factory: Make, engines: Callable[..., LLM], tmp_path: Path,
    delay_s: float,
) -> None:
    redis = start_redis_on(tmp_path)
    try:
        with SlowLink("127.0.0.1", redis.port, delay_s) as link:
            _cost_rule(wide, daemon_factory, engines, redis.url, link.url, delay_s)
    finally:
        redis.stop()


def _cost_rule(wide: Path, daemon_factory: Make, engines: Callable[..., LLM], direct: str,
               slowed: str, delay_s: float) -> None:
    l4 = (*LOCAL, "remote.timeout_s=5")
    writer_d = daemon_factory(*l4, f"remote.url={direct}")
    rng = random.Random(11)
    warm, *prompts = [[rng.randrange(3, 500) for _ in range(400)] for _ in range(4)]
    writer = engines(wide, store=writer_d.target)
    want = [_generate(writer, p).outputs[0].token_ids for p in prompts]
    writer.close()
    _drain_l4(writer_d.target, writer.namespace)
    # The reader's daemon reaches the same Redis through a link that holds every reply.
    reader_d = daemon_factory(*l4, f"remote.url={slowed}")
    reader = engines(wide, store=reader_d.target, store_timeout_s=10.0)
    _generate(reader, warm)  # a prefill of its own: the rule knows what computing costs
    first, second, third = (_generate(reader, p) for p in prompts)
    assert [o.outputs[0].token_ids for o in (first, second, third)] == want
    # Nothing known yet about L4 here: the first hit is loaded, and teaches the rule.
    assert first.metrics.store_prompt_tokens == 384, first.metrics
    assert first.metrics.store_decision.startswith("no estimate yet")
    for out in (second, third):
        m = out.metrics
        if delay_s:  # loading would take longer than computing: computed, and said why
            assert (m.store_prompt_tokens, m.store_recomputed_tokens) == (0, 384), m
            assert m.store_decision.startswith("recompute") and "remote" in m.store_decision
        else:
            assert (m.store_prompt_tokens, m.store_recomputed_tokens) == (384, 0), m
            assert m.store_decision.startswith("load") and "remote" in m.store_decision


def test_store_load_policy_never_looks_up_but_computes(
    model: Path, local: Daemon, engines: Callable[..., LLM]
) -> None:
    d = local
    [prompt] = _prompts(1, length=100, seed=13)
    writer = engines(model, store=d.target)
    want = _tokens(writer.generate([prompt], GREEDY))
    writer.close()
    never = engines(model, store=d.target, store_load_policy="never")
    [out] = never.generate([prompt], GREEDY)
    assert out.outputs[0].token_ids == want[0]
    assert (out.metrics.store_prompt_tokens, out.metrics.store_recomputed_tokens) == (0, 96)
    assert out.metrics.store_decision.startswith("policy never")
    with pytest.raises(InvalidRequestError, match="store_load_policy"):
        engines(model, store=d.target, store_load_policy="sometimes")
    with pytest.raises(InvalidRequestError, match="enable_prefix_caching"):
        engines(model, store=d.target, enable_prefix_caching=False)
