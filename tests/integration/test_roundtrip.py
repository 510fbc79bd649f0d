"""Blocks round-trip bit-exact through a real daemon: inline and through shared memory, with
every kind of caller buffer, across the two paths, across processes, and with the async
client. Re-puts are acknowledged and change nothing; lookup reports the cached prefix.
All of it twice: auth off (one named segment), and auth.mode=token (a tenant's arena)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.client import AsyncKVStoreClient, KVStoreClient, prefix_keys
from kvstore.tools.testing import Daemon, start_daemon
from kvstore.units import MiB

# Page-sized, off-by-one around pages (64 KiB) and 4 KiB, and objects that need two and three
# 4 MiB gRPC messages: the daemon's 8 MiB message limit fails any put that is not split.
SIZES = [1, 7, 4095, 4096, 4097, 65535, 65536, 65537, MiB + 3, 5 * MiB + 7, 9 * MiB - 1]
MODES = [pytest.param(False, id="inline"), pytest.param(True, id="shm")]


TOKEN = "roundtrip-token-0123456789"


@pytest.fixture(scope="module", params=["off", "token"])
def daemon(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The same daemon with auth off, then with auth.mode=token: one admin tenant owning
    every namespace, whose shared memory is its own arena reached through the Unix socket
    (the clients, and the subprocess one, take the token from KVSTORE_TOKEN)."""
    workdir = tmp_path_factory.mktemp("roundtrip")
    settings = ["dram.capacity_bytes=48MiB", "dram.page_size_bytes=64KiB",
                "server.max_object_bytes=16MiB"]
    with pytest.MonkeyPatch.context() as env:
        if request.param == "token":
            tenants = workdir / "tenants.yaml"
            tenants.write_text(json.dumps({"tenants": [{
                "name": "engine", "role": "admin", "namespaces": [""],
                "tokens_sha256": [hashlib.sha256(TOKEN.encode()).hexdigest()]}]}))
            settings += ["auth.mode=token", f"auth.tenants_file={tenants}",
                         f"server.unix_socket={workdir / 'kvstore.sock'}"]
            env.setenv("KVSTORE_TOKEN", TOKEN)
        d = start_daemon(workdir, *settings)
        yield d
        assert d.stop() == 0, d.log()


@pytest.fixture(autouse=True)
def empty_store(daemon: Daemon) -> None:
    """Every test starts with an empty L2, so no put of its own evicts what it reads back."""
    with KVStoreClient(daemon.target, "cleanup", shared_memory=False) as kv:
        kv.evict(all=True, namespace="")
        assert kv.stats().tier("dram").objects == 0  # type: ignore[union-attr]


@pytest.fixture
def ns(request: pytest.FixtureRequest) -> str:
    return f"roundtrip/{request.node.name}"


def payloads(seed: int, sizes: list[int]) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(size) for size in sizes]


def random_keys(seed: int, n: int) -> list[bytes]:
    rng = np.random.default_rng(seed + 1_000_000)
    return [rng.bytes(32) for _ in range(n)]


@pytest.mark.parametrize("shared_memory", MODES)
def test_put_then_get_and_get_into_are_bit_exact(daemon: Daemon, ns: str,
                                                 shared_memory: bool) -> None:
    keys, values = random_keys(1, len(SIZES)), payloads(1, SIZES)
    with KVStoreClient(daemon.target, ns, shared_memory=shared_memory) as kv:
        put = kv.put(keys, values, independent=True)
        assert (put.stored, put.existing, put.evicted) == (len(SIZES), 0, 0)
        assert kv.uses_shared_memory is shared_memory

        assert kv.get(keys) == values

        slack = 13  # bytes past each block that get_into must leave alone
        buffers = [np.full(size + slack, 0xAB, dtype=np.uint8) for size in SIZES]
        assert kv.get_into(keys, buffers) == SIZES
        for buf, value in zip(buffers, values, strict=True):
            assert buf[: len(value)].tobytes() == value
            assert (buf[len(value) :] == 0xAB).all()

        dram = kv.stats().tier("dram")
        assert dram is not None
        assert dram.objects == len(SIZES)
        assert dram.used_bytes == sum(SIZES)


@pytest.mark.parametrize("shared_memory", MODES)
def test_every_buffer_kind_goes_in_and_comes_back(daemon: Daemon, ns: str,
                                                  shared_memory: bool) -> None:
    size = 3 * 65536 + 16  # four rows of float32, not a multiple of the page size
    keys = random_keys(2, 4)
    raw = payloads(2, [size] * 4)
    values: list[object] = [
        np.frombuffer(raw[0], dtype=np.uint8).copy(),
        np.frombuffer(raw[1], dtype=np.float32).reshape(4, -1).copy(),  # 2-D, not bytes
        bytearray(raw[2]),
        memoryview(bytearray(raw[3])),
    ]
    with KVStoreClient(daemon.target, ns, shared_memory=shared_memory) as kv:
        assert kv.put(keys, values, independent=True).stored == 4
        as_u8 = np.zeros(size, dtype=np.uint8)
        as_f32 = np.zeros((4, size // 16), dtype=np.float32)
        as_bytearray = bytearray(size)
        backing = bytearray(size + 100)
        as_memoryview = memoryview(backing)[:size]
        buffers: list[object] = [as_u8, as_f32, as_bytearray, as_memoryview]
        assert kv.get_into(keys, buffers) == [size] * 4
    assert as_u8.tobytes() == raw[0]
    assert as_f32.tobytes() == raw[1]
    assert bytes(as_bytearray) == raw[2]
    assert bytes(backing[:size]) == raw[3]
    assert bytes(backing[size:]) == bytes(100)


@pytest.mark.parametrize("shared_memory", MODES)
def test_torch_cpu_tensors_round_trip(daemon: Daemon, ns: str, shared_memory: bool) -> None:
    torch = pytest.importorskip("torch")
    keys = random_keys(3, 2)
    src = [torch.randn(8, 1000, dtype=torch.float32), torch.randn(3, 333).to(torch.bfloat16)]
    with KVStoreClient(daemon.target, ns, shared_memory=shared_memory) as kv:
        assert kv.put(keys, src, independent=True).stored == 2
        dst = [torch.zeros_like(t) for t in src]
        assert kv.get_into(keys, dst) == [t.numel() * t.element_size() for t in src]
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("put_shm", "get_shm"), [(True, False), (False, True)],
                         ids=["put-shm-get-inline", "put-inline-get-shm"])
def test_the_two_paths_read_each_others_blocks(daemon: Daemon, ns: str, put_shm: bool,
                                               get_shm: bool) -> None:
    sizes = [1, 65537, 5 * MiB + 7]
    keys, values = random_keys(4, 3), payloads(4, sizes)
    with KVStoreClient(daemon.target, ns, shared_memory=put_shm) as writer, \
            KVStoreClient(daemon.target, ns, shared_memory=get_shm) as reader:
        assert writer.put(keys, values, independent=True).stored == 3
        assert reader.get(keys) == values
        buffers = [bytearray(s) for s in sizes]
        assert reader.get_into(keys, buffers) == sizes
        assert [bytes(b) for b in buffers] == values
        assert (writer.uses_shared_memory, reader.uses_shared_memory) == (put_shm, get_shm)


CHILD = r"""
import hashlib, json, sys
import numpy as np
from kvstore.client import KVStoreClient

target, namespace, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
read_keys = [bytes.fromhex(k) for k in sys.argv[4].split(",")]
read_sizes = [int(s) for s in sys.argv[5].split(",")]
put_keys = [bytes.fromhex(k) for k in sys.argv[6].split(",")]
put_sizes = [int(s) for s in sys.argv[7].split(",")]
rng = np.random.default_rng(seed)
values = [rng.bytes(size) for size in put_sizes]
with KVStoreClient(target, namespace, shared_memory=True) as kv:
    buffers = [np.empty(size, dtype=np.uint8) for size in read_sizes]
    got = kv.get_into(read_keys, buffers)
    put = kv.put(put_keys, values, independent=True)
    print(json.dumps({
        "got": got,
        "sha256": [hashlib.sha256(b.tobytes()).hexdigest() for b in buffers],
        "stored": put.stored,
        "shm": kv.uses_shared_memory,
    }))
"""


def test_blocks_cross_process_boundaries_through_shared_memory(daemon: Daemon, ns: str) -> None:
    """This process puts through shared memory and a child process reads; the child puts
    through shared memory and this process reads, on both paths."""
    mine_sizes, child_sizes = [4097, 2 * MiB + 1], [1, 65536, 4 * MiB + 5]
    mine_keys, mine = random_keys(5, 2), payloads(5, mine_sizes)
    child_keys, child_values = random_keys(6, 3), payloads(6, child_sizes)
    with KVStoreClient(daemon.target, ns, shared_memory=True) as kv:
        assert kv.put(mine_keys, mine, independent=True).stored == 2
        child = subprocess.run(
            [sys.executable, "-c", CHILD, daemon.target, ns, "6",
             ",".join(k.hex() for k in mine_keys), ",".join(map(str, mine_sizes)),
             ",".join(k.hex() for k in child_keys), ",".join(map(str, child_sizes))],
            capture_output=True, text=True, timeout=60,
        )
        assert child.returncode == 0, child.stderr
        report = json.loads(child.stdout)
        assert report == {
            "got": mine_sizes,
            "sha256": [hashlib.sha256(v).hexdigest() for v in mine],
            "stored": 3,
            "shm": True,
        }
        assert kv.get(child_keys) == child_values
        assert kv.uses_shared_memory is True
    with KVStoreClient(daemon.target, ns, shared_memory=False) as inline:
        assert inline.get(child_keys) == child_values


@pytest.mark.parametrize("shared_memory", MODES)
def test_async_client_round_trip(daemon: Daemon, ns: str, shared_memory: bool) -> None:
    sizes = [1, 4097, 65536, 5 * MiB + 7]
    keys, values = random_keys(7, 4), payloads(7, sizes)
    missing = random_keys(8, 1)[0]

    async def scenario() -> None:
        async with AsyncKVStoreClient(daemon.target, ns, shared_memory=shared_memory) as kv:
            put = await kv.put(keys, values, independent=True)
            assert (put.stored, put.existing) == (4, 0)
            assert kv.uses_shared_memory is shared_memory
            assert await kv.get([*keys, missing]) == [*values, None]
            buffers = [np.zeros(s, dtype=np.uint8) for s in sizes] + [np.zeros(8, np.uint8)]
            assert await kv.get_into([*keys, missing], buffers) == [*sizes, None]
            assert [b.tobytes() for b in buffers[:-1]] == values
            again = await kv.put(keys[:2], [b"x", b"y"], independent=True)
            assert (again.stored, again.existing) == (0, 2)
            assert await kv.get(keys[:2]) == values[:2]
            assert (await kv.lookup(keys)).tiers == ["dram"] * 4

    asyncio.run(scenario())


@pytest.mark.parametrize("shared_memory", MODES)
def test_reput_of_an_existing_key_is_acknowledged_and_changes_nothing(
    daemon: Daemon, ns: str, shared_memory: bool
) -> None:
    a, b, c = random_keys(9, 3)
    first = payloads(9, [65536, 100])
    with KVStoreClient(daemon.target, ns, shared_memory=shared_memory) as kv:
        put = kv.put([a, b], first)
        assert (put.stored, put.existing) == (2, 0)
        # Different bytes, and even a different size, under the same keys: ignored.
        again = kv.put([a, b, c], [b"\x00" * 65536, b"other", b"new"])
        assert (again.stored, again.existing) == (1, 2)
        assert kv.get([a, b, c]) == [*first, b"new"]
        dram = kv.stats().tier("dram")
        assert dram is not None
        assert (dram.objects, dram.used_bytes) == (3, 65536 + 100 + 3)


def test_lookup_reports_the_longest_cached_prefix_and_each_tier(daemon: Daemon, ns: str) -> None:
    tokens = list(range(16 * 6 + 5))  # six full blocks and a partial one
    keys = prefix_keys(tokens, 16, ns)
    assert len(keys) == 6
    with KVStoreClient(daemon.target, ns) as kv:
        assert kv.lookup(keys).prefix_length == 0
        assert kv.put(keys[:4], payloads(10, [1000] * 4)).stored == 4

        result = kv.lookup(keys)
        assert result.prefix_length == 4
        assert result.tiers == ["dram"] * 4 + [None] * 2

        # Evicting block 1 takes its descendants 2 and 3: they could never be reached.
        assert kv.evict([keys[1]]).evicted == 3
        result = kv.lookup(keys)
        assert result.prefix_length == 1
        assert result.tiers == ["dram", None, None, None, None, None]

        # A chain may start anywhere: an engine that holds blocks 0 and 1 itself puts 2..3.
        assert kv.put(keys[2:4], payloads(11, [1000] * 2), parent=keys[1]).stored == 2
        assert kv.lookup(keys).tiers == ["dram", None, "dram", "dram", None, None]
        assert kv.lookup(keys[2:4]).prefix_length == 2
        assert kv.lookup([keys[1], keys[0]]).prefix_length == 0
        assert kv.lookup([]).prefix_length == 0


@pytest.mark.parametrize("shared_memory", MODES)
def test_a_miss_is_none_and_leaves_its_buffer_alone(daemon: Daemon, ns: str,
                                                    shared_memory: bool) -> None:
    present, missing = random_keys(11, 2)
    value = payloads(11, [70000])[0]
    with KVStoreClient(daemon.target, ns, shared_memory=shared_memory) as kv:
        assert kv.get([missing]) == [None]
        assert kv.get([missing, present]) == [None, None]
        assert kv.put([present], [value]).stored == 1
        assert kv.get([missing, present]) == [None, value]
        untouched = np.full(70000, 7, dtype=np.uint8)
        filled = np.zeros(70000, dtype=np.uint8)
        assert kv.get_into([missing, present], [untouched, filled]) == [None, 70000]
        assert (untouched == 7).all()
        assert filled.tobytes() == value
        assert kv.get_into([missing], [bytearray(10)]) == [None]
