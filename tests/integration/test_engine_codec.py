"""The engine's store codecs with a real daemon (docs/codecs.md): with store_codec fp8 or int4
an engine loads a prompt's blocks from L2, from L3 and from L4 (a real redis-server, read by a
fresh daemon) and generates, and the K/V it loaded are
exactly the writer's K/V through the codec; a namespace with a codec never hits blocks put
without it, nor the reverse; `none` is today's engine, token for token; a block whose header
was damaged is refused (computed), never decoded."""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.engine.errors import InvalidRequestError
from kvstore.engine.llm import LLM
from kvstore.engine.sampling import SamplingParams
from kvstore.kernels import gather_blocks
from kvstore.keys import prefix_keys
from kvstore.tools.testing import Daemon, start_redis_on
from tests.engine.models import save_tiny

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LOCAL = ("dram.capacity_bytes=32MiB", "dram.page_size_bytes=8KiB", "hbm.mode=off",
         "nvme.enabled=false")
# L3: a 1 MiB L2 of 8 KiB pages, so a flood of other blocks pushes the engine's down.
L3 = ("dram.capacity_bytes=1MiB", "dram.page_size_bytes=8KiB", "hbm.mode=off",
      "nvme.capacity_bytes=16MiB", "nvme.page_size_bytes=8KiB", "movers.interval_s=0.02")
Make = Callable[..., Daemon]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture
def model(tiny: Path, tmp_path: Path) -> Path:
    """The tiny model under a folder name of the test's own: its namespaces are the test's."""
    link = tmp_path / f"llama-{secrets.token_hex(4)}"
    link.symlink_to(tiny, target_is_directory=True)
    return link


@pytest.fixture
def local(shared_daemon: Make) -> Daemon:
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


def _kv_of(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The K/V of prompt's full blocks (but the last token's) from llm's prefix cache."""
    hit = llm.block_manager.find_prefix(prefix_keys(prompt, 16, llm.namespace), len(prompt))
    assert hit.num_tokens == (len(prompt) - 1) // 16 * 16
    return gather_blocks(llm.runner.kv_cache, hit.block_ids)


def _drain_l4(target: str, namespace: str) -> None:
    with KVStoreClient(target, namespace) as kv:
        deadline = time.monotonic() + 15
        while kv.stats().tier("remote").queue_depth:
            assert time.monotonic() < deadline, "L4 write-through never drained"
            time.sleep(0.05)


def _push_to_l3(target: str, namespace: str, keys: Sequence[bytes]) -> None:
    with KVStoreClient(target, "flood") as kv:
        for i in range(8):
            fill = [bytes([i, j]) * 16 for j in range(32)]
            kv.put(fill, [bytes(8192)] * 32, independent=True)
    with KVStoreClient(target, namespace) as kv:
        deadline = time.monotonic() + 15
        while set(kv.lookup(keys).tiers) != {"nvme"}:
            assert time.monotonic() < deadline, kv.lookup(keys).tiers
            time.sleep(0.05)


@pytest.mark.parametrize("tier", ["dram", "nvme", "remote"])
@pytest.mark.parametrize("codec", ["fp8", "int4"])
def test_a_codec_engine_loads_its_blocks_and_generates(
        model: Path, daemon_factory: Make, local: Daemon, engines: Callable[..., LLM],
        tmp_path: Path, codec: str, tier: str) -> None:
    """dram on the shared daemon; nvme on a daemon whose L2 a flood overflows; remote: the
    writer's daemon writes through to a real redis-server and the reader's fresh daemon
    holds nothing but what it reads from there."""
    if tier != "remote":
        _loads_and_generates(model, local if tier == "dram" else daemon_factory(*L3),
                             daemon_factory, engines, codec, tier)
        return
    redis = start_redis_on(tmp_path)
    try:
        l4 = (*LOCAL, f"remote.url={redis.url}", "remote.timeout_s=1")
        _loads_and_generates(model, daemon_factory(*l4), lambda: daemon_factory(*l4),
                             engines, codec, tier)
    finally:
        redis.stop()


def _loads_and_generates(model: Path, d: Daemon, fresh: Callable[[], Daemon],
                         engines: Callable[..., LLM], codec: str, tier: str) -> None:
    prompts = _prompts()
    writer = engines(model, store=d.target, store_codec=codec)
    assert writer.namespace.endswith(f"-codec.{codec}.v1")
    writer.generate(prompts, GREEDY)
    writer.close()
    assert writer.connector is not None and writer.connector.codec is not None
    encoded = writer.connector.codec.encoded_bytes
    assert writer.connector.block_bytes == encoded < writer.connector.codec.raw_bytes / 2
    keys = [k for p in prompts for k in prefix_keys(p, 16, writer.namespace)]
    if tier == "nvme":
        _push_to_l3(d.target, writer.namespace, keys)
    if tier == "remote":
        _drain_l4(d.target, writer.namespace)
        d = fresh()  # only Redis has the blocks
    with KVStoreClient(d.target, writer.namespace) as kv:
        assert set(kv.lookup(keys).tiers) == {tier}
        stored = kv.get(keys[:1])[0]
        assert stored is not None and len(stored) == encoded  # the daemon holds the encoding

    reader = engines(model, store=d.target, store_codec=codec, store_load_policy="always")
    outs = reader.generate(prompts, GREEDY)
    assert [len(t) for t in _tokens(outs)] == [12, 12, 12]
    blocks = [(len(p) - 1) // 16 for p in prompts]
    assert [o.metrics.store_prompt_tokens for o in outs] == [b * 16 for b in blocks]
    assert [o.metrics.store_loaded_bytes for o in outs] == [b * encoded for b in blocks]
    # What the reader loaded is exactly the writer's K/V through the codec, and close to it.
    codec_ = writer.connector.codec
    for prompt in prompts:
        computed = _kv_of(writer, prompt)
        loaded = _kv_of(reader, prompt)
        assert torch.equal(loaded, codec_.decode(codec_.encode(computed)))
        assert not torch.equal(loaded, computed)  # lossy: this is not the raw K/V
        assert (loaded - computed).abs().max() < 0.1 * computed.abs().max()


def test_codec_and_raw_namespaces_never_meet(
        model: Path, local: Daemon, engines: Callable[..., LLM]) -> None:
    """Blocks put without a codec are not found by an fp8 engine, blocks put with fp8 are not
    found by an engine without one nor by an int4 one; each finds its own."""
    d = local
    [raw_prompt, fp8_prompt] = _prompts(2, seed=3)
    raw = engines(model, store=d.target)
    raw.generate([raw_prompt], GREEDY)
    raw.close()
    fp8 = engines(model, store=d.target, store_codec="fp8")
    fp8.generate([fp8_prompt], GREEDY)
    fp8.close()
    assert len({raw.namespace, fp8.namespace}) == 2

    def loaded(codec: str, prompt: list[int]) -> int:
        reader = engines(model, store=d.target, store_codec=codec, store_load_policy="always")
        [out] = reader.generate([prompt], GREEDY)
        return int(out.metrics.store_prompt_tokens)

    assert loaded("fp8", raw_prompt) == 0
    assert loaded("none", fp8_prompt) == 0
    assert loaded("int4", fp8_prompt) == 0
    assert loaded("fp8", fp8_prompt) == 64
    assert loaded("none", raw_prompt) == 64


def test_none_is_todays_engine_token_for_token(
        model: Path, local: Daemon, engines: Callable[..., LLM]) -> None:
    """store_codec="none" keeps the namespace blocks were stored under before codecs existed,
    loads them bit for bit and generates the tokens a run without a store does."""
    prompts = _prompts(seed=7)
    want = _tokens(engines(model).generate(prompts, GREEDY))
    writer = engines(model, store=local.target)  # the default: no codec named
    assert _tokens(writer.generate(prompts, GREEDY)) == want
    writer.close()
    reader = engines(model, store=local.target, store_codec="none", store_load_policy="always")
    assert reader.namespace == writer.namespace and "codec" not in reader.namespace
    assert reader.connector is not None and reader.connector.codec is None
    outs = reader.generate(prompts, GREEDY)
    assert _tokens(outs) == want
    assert [o.metrics.store_prompt_tokens for o in outs] == [(len(p) - 1) // 16 * 16
                                                             for p in prompts]
    for prompt in prompts:
        assert torch.equal(_kv_of(reader, prompt), _kv_of(writer, prompt))


def test_a_damaged_block_is_refused_and_computed(
        model: Path, local: Daemon, engines: Callable[..., LLM]) -> None:
    """Block 2 of a prompt is replaced by the same bytes with its header's dtype byte changed
    (what a block of another engine's layout would carry): the reader loads blocks 0 and 1,
    refuses block 2 and computes it and the rest, and generates what the writer did."""
    d = local
    [prompt] = _prompts(1, length=100, seed=5)
    writer = engines(model, store=d.target, store_codec="fp8")
    want = _tokens(writer.generate([prompt], GREEDY))
    writer.close()
    keys = prefix_keys(prompt, 16, writer.namespace)
    with KVStoreClient(d.target, writer.namespace) as kv:
        [block] = kv.get(keys[2:3])
        assert block is not None
        assert kv.evict(keys=[keys[2]]).evicted >= 4  # block 2 and its descendants
        damaged = bytearray(block)
        damaged[5] ^= 0x03  # float32 -> float16
        kv.put([keys[2]], [bytes(damaged)], parent=keys[1])
        assert kv.lookup(keys).tiers == ["dram", "dram", "dram", None, None, None]
    reader = engines(model, store=d.target, store_codec="fp8", store_load_policy="always")
    [out] = reader.generate([prompt], GREEDY)
    assert reader.connector is not None and reader.connector.rejected_blocks == 1
    assert out.metrics.store_prompt_tokens == 32
    # Blocks 0 and 1 went through fp8, so only near-equal tokens can be asked of a tiny
    # random model; its sharpened head makes them equal here.
    assert out.outputs[0].token_ids == want[0]


def test_bad_codec_options_name_the_field(tiny: Path) -> None:
    with pytest.raises(InvalidRequestError, match="store_codec must be one of"):
        LLM(str(tiny), device="cpu", num_blocks=64, store="localhost:1", store_codec="zstd")
    with pytest.raises(InvalidRequestError, match="store_codec 'fp8' needs a store"):
        LLM(str(tiny), device="cpu", num_blocks=64, store_codec="fp8")
