"""The engine on a GPU (marked `gpu`, skipped without CUDA): with the kernels ops_for picks there
(the Triton ones, kvstore/kernels/gpu.py, checked first), float32 greedy tokens equal the CPU
reference run's (itself checked against transformers), through chunked prefill, prefix
caching and copy-on-write forks; bfloat16 runs and agrees on the first tokens; the store
connector stages a CUDA cache's blocks through pinned host memory (torch's, no cupy), out to
a real daemon and back, bit-exact. No transformers needed."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvstore.engine.connector import Loaded, Looked, StoreConnector
from kvstore.engine.llm import LLM
from kvstore.engine.sampling import SamplingParams
from kvstore.engine.scheduler import LoadPlan, LookupPlan
from kvstore.engine.sequence import Sequence
from kvstore.kernels import ops_for
from kvstore.keys import prefix_keys
from kvstore.tools.testing import Daemon
from tests.conftest import DEFAULT_SETTINGS
from tests.engine.models import save_random

pytestmark = pytest.mark.gpu


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 17, 64, 150, 300)]


def _run(path: Path, device: str, dtype: str = "float32", n: int = 1) -> list[list[list[int]]]:
    llm = LLM(str(path), device=device, dtype=dtype, num_blocks=128, max_num_batched_tokens=128)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=n)
    outs = llm.generate(_prompts(), params)
    outs += llm.generate(_prompts()[3:], params)  # prefix-cache hits this time
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_the_engine_on_cuda_runs_the_triton_kernels() -> None:
    """Else the tests below would compare the reference with itself, and pass."""
    from kvstore.kernels import _OPS, gpu

    _OPS.clear()
    assert ops_for("cuda") is gpu


def test_cuda_float32_matches_the_cpu_reference(tmp_path: Path) -> None:
    path = save_random(tmp_path / "m")
    assert _run(path, "cuda") == _run(path, "cpu")


def test_cuda_forks_match_the_cpu_reference(tmp_path: Path) -> None:
    path = save_random(tmp_path / "m")
    assert _run(path, "cuda", n=3) == _run(path, "cpu", n=3)


def test_cuda_bfloat16_runs_and_starts_like_float32(tmp_path: Path) -> None:
    path = save_random(tmp_path / "m")
    bf16 = _run(path, "cuda", dtype="bfloat16")
    fp32 = _run(path, "cpu")
    first = [seqs[0][:3] for seqs in bf16], [seqs[0][:3] for seqs in fp32]
    assert sum(a == b for a, b in zip(*first, strict=True)) >= len(fp32) - 1


def test_connector_stages_a_cuda_cache_through_pinned_memory_bit_exact(daemon: Daemon) -> None:
    dev = torch.device("cuda")
    # [layers, K/V, blocks, block_size, kv_heads, head_dim]; random bits, NaNs and all.
    kv = torch.randint(-(2**15), 2**15, (2, 2, 12, 16, 2, 64), dtype=torch.int16, device=dev)
    kv = kv.view(torch.bfloat16)
    connector = StoreConnector(daemon.target, "gpu-staging", kv, 16, ops_for(dev))
    try:
        staging = connector.copies.take(4, *connector._stored_row())
        assert staging.is_pinned() and staging.device.type == "cpu"
        tokens = [3 + i % 250 for i in range(4 * 16 + 1)]
        seq = Sequence(1, 1, tokens, SamplingParams())
        keys = prefix_keys(tokens, 16, "gpu-staging")
        want = kv[:, :, [1, 3, 5, 7]].view(torch.int16).cpu()
        assert connector.offload(keys, [1, 3, 5, 7], None)
        connector.flush(timeout_s=10.0)
        assert connector.stats.offloaded_blocks == 4
        connector.start_lookup(LookupPlan(seq, 0, keys))
        [looked] = connector.poll(timeout_s=10.0)
        assert isinstance(looked, Looked) and looked.hit.blocks == 4
        kv[:, :, 8:12] = 0.0  # where the blocks come back: zeros, unlike the random bits
        connector.start_load(LoadPlan(seq, 0, keys, [8, 9, 10, 11]), "dram")
        [loaded] = connector.poll(timeout_s=10.0)
        assert isinstance(loaded, Loaded) and loaded.arrived == 4
        torch.cuda.synchronize()
        assert torch.equal(kv[:, :, 8:12].view(torch.int16).cpu(), want)
        assert connector.stats.load_failures == 0 and connector.available
    finally:
        connector.close()


def test_connector_loads_a_cuda_cache_in_place_from_pinned_pages_bit_exact(
        shared_daemon: Callable[..., Daemon]) -> None:
    """Co-located (the daemon's Unix socket, its read table): a CUDA cache's loads copy each
    block to the device straight from its pages in L2, registered as pinned memory in the
    client when cupy is installed, bit-exact, with no staging copy."""
    d = shared_daemon(*DEFAULT_SETTINGS, unix_socket=True)
    dev = torch.device("cuda")
    kv = torch.randint(-(2**15), 2**15, (2, 2, 12, 16, 2, 64), dtype=torch.int16, device=dev)
    kv = kv.view(torch.bfloat16)
    connector = StoreConnector(d.target, "gpu-in-place", kv, 16, ops_for(dev))
    try:
        assert connector.in_place  # on by default on a GPU
        tokens = [5 + i % 250 for i in range(4 * 16 + 1)]
        seq = Sequence(1, 1, tokens, SamplingParams())
        keys = prefix_keys(tokens, 16, "gpu-in-place")
        want = kv[:, :, [0, 2, 4, 6]].view(torch.int16).cpu()
        assert connector.offload(keys, [0, 2, 4, 6], None)
        connector.flush(timeout_s=10.0)
        kv[:, :, 8:12] = 0.0
        connector.start_load(LoadPlan(seq, 0, keys, [8, 9, 10, 11]), "dram")
        [loaded] = connector.poll(timeout_s=10.0)
        assert isinstance(loaded, Loaded) and loaded.arrived == 4
        torch.cuda.synchronize()
        assert torch.equal(kv[:, :, 8:12].view(torch.int16).cpu(), want)
        assert connector.stats.loaded_in_place_blocks == 4
        shm = connector.link.client._shm
        mapped = [s for s in (shm.segment, *shm.arenas.values()) if s is not None]
        assert mapped
        if importlib.util.find_spec("cupy") is not None:
            assert all(s.pinned for s in mapped)
    finally:
        connector.close()
