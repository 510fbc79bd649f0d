"""The order of the connectors' device copies (kvstore.integrations.device_copies) on real CUDA
streams and events: what tests/unit/test_device_copies.py checks on a simulated device, here
with the GPU kept busy on purpose (`torch.cuda._sleep`, a kernel that spins for a number of
clock cycles) so that a copy out of order would read or report the wrong bytes. Each test takes
well under a second of device time; they run in `make gpu-check`'s ordering stage."""

from __future__ import annotations

import time

import pytest
import torch

from kvstore.engine.connector import Loaded, StoreConnector
from kvstore.engine.scheduler import LoadPlan
from kvstore.integrations.device_copies import CudaStreams, DeviceCopies, copies_for
from kvstore.integrations.paged import PagedKV
from kvstore.kernels import ops_for
from kvstore.keys import prefix_keys
from kvstore.tools.testing import Daemon

pytestmark = pytest.mark.gpu

BLOCK = 16
# [layers, K/V, blocks, block_size, kv_heads, head_dim]: 64 KiB blocks of float32.
SHAPE = (2, 2, 16, BLOCK, 4, 64)
SPIN_CYCLES = 1_000_000_000
"""A spin kernel of this many cycles keeps a stream busy for about 0.5 s at the ~2 GHz clocks
of current data-centre GPUs (H100, H200: 1.98 GHz boost): far longer than a 4-block copy or a
local store read (milliseconds), short enough for the 30 s the ordering stage has."""


def _device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    return torch.device("cuda", torch.cuda.current_device())


def _spin(stream: torch.cuda.Stream | None = None) -> None:
    """Keep a stream (default: the current one, the forward stream) busy for a while."""
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        torch.cuda._sleep(SPIN_CYCLES)


def _blocks(seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand((SHAPE[0], SHAPE[1], 4, *SHAPE[3:]), generator=gen) + 1.0).to(device)


def _connector(daemon: Daemon, ns: str, device: torch.device,
               ) -> tuple[StoreConnector, torch.Tensor]:
    cache = torch.zeros(SHAPE, device=device)
    return StoreConnector(daemon.target, ns, cache, BLOCK, ops_for(device)), cache


def _warm(connector: StoreConnector, cache: torch.Tensor, ns: str) -> None:
    """Two offloads and one load of four blocks before the GPU is kept busy: the first use of
    a size allocates pinned host memory (which may synchronize the device) and compiles and
    loads the kernels; later ones reuse both, as a running engine does. Two offloads, since
    the writer thread holds the last batch it put until it takes the next: the first one's
    staging is then back in torch's pinned-memory cache for the test's own offload."""
    for first in (900, 950):
        keys = prefix_keys(list(range(first, first + 4 * BLOCK)), BLOCK, ns)
        assert connector.offload(keys, [0, 1, 2, 3], None)
        connector.flush(10.0)
    connector.start_load(LoadPlan(None, 0, keys, [4, 5, 6, 7]), "dram")
    [loaded] = connector.poll(timeout_s=10.0)
    assert isinstance(loaded, Loaded) and loaded.arrived == 4
    torch.cuda.synchronize()
    cache.zero_()


def _copy_stream(connector: StoreConnector) -> torch.cuda.Stream:
    streams = connector.copies.streams
    assert isinstance(streams, CudaStreams)
    return streams.copy


def _stored(daemon: Daemon, ns: str, keys: list[bytes], device: torch.device) -> torch.Tensor:
    """What the store holds under keys, loaded back through an immediate-order connector."""
    connector, cache = _connector(daemon, ns, device)
    try:
        connector.start_load(LoadPlan(None, 0, keys, [12, 13, 14, 15]), "dram")
        [loaded] = connector.poll(timeout_s=10.0)
        assert isinstance(loaded, Loaded) and loaded.arrived == 4
        return cache[:, :, 12:16].cpu()
    finally:
        connector.close()


def test_a_load_is_reported_only_once_its_copy_completed(daemon: Daemon, ns: str) -> None:
    device = _device()
    keys = prefix_keys(list(range(4 * BLOCK)), BLOCK, ns)
    want = _blocks(1, device)
    connector, cache = _connector(daemon, ns, device)
    try:
        _warm(connector, cache, ns)
        cache[:, :, 0:4] = want
        assert connector.offload(keys, [0, 1, 2, 3], None)
        connector.flush(10.0)
        assert connector.stats.offloaded_blocks == 12
        _spin(_copy_stream(connector))  # the load's copy queues behind this
        connector.start_load(LoadPlan(None, 0, keys, [8, 9, 10, 11]), "dram")
        deadline = time.monotonic() + 10.0
        while not connector._landing:  # read from the store, its copy enqueued
            assert connector.poll() == [], "a load was reported before its copy ran"
            assert time.monotonic() < deadline, "the load never came back"
            time.sleep(0.001)
        assert not connector._landing[0].event.query()  # the spin still holds the copy back
        assert connector.poll() == []
        assert torch.equal(cache[:, :, 8:12].cpu(), torch.zeros_like(want).cpu())
        [loaded] = connector.poll(timeout_s=10.0)  # idle: waits for that one event
        assert isinstance(loaded, Loaded) and loaded.arrived == 4
        assert torch.equal(cache[:, :, 8:12], want)
    finally:
        connector.close()


def test_a_save_reads_the_cache_after_the_forward_pass_that_wrote_it(daemon: Daemon,
                                                                     ns: str) -> None:
    device = _device()
    keys = prefix_keys(list(range(100, 100 + 4 * BLOCK)), BLOCK, ns)
    want = _blocks(2, device)
    connector, cache = _connector(daemon, ns, device)
    try:
        _warm(connector, cache, ns)
        _spin()  # a long forward pass ...
        cache[:, :, 0:4] = want  # ... that writes the blocks at its end
        begun = time.perf_counter()
        assert connector.offload(keys, [0, 1, 2, 3], None)
        assert time.perf_counter() - begun < 0.25  # the step loop did not wait for the spin
        connector.flush(10.0)
        assert connector.stats.offloaded_blocks == 12
    finally:
        connector.close()
    assert torch.equal(_stored(daemon, ns, keys, device), want.cpu())


def test_the_next_forward_pass_waits_for_a_save_of_its_blocks(daemon: Daemon, ns: str) -> None:
    device = _device()
    keys = prefix_keys(list(range(200, 200 + 4 * BLOCK)), BLOCK, ns)
    want = _blocks(3, device)
    connector, cache = _connector(daemon, ns, device)
    try:
        _warm(connector, cache, ns)
        cache[:, :, 0:4] = want
        _spin(_copy_stream(connector))  # the save's copy queues behind this
        assert connector.offload(keys, [0, 1, 2, 3], None)
        cache[:, :, 0:4] = -1.0  # the next forward pass reuses the blocks at once
        connector.flush(10.0)
        assert connector.stats.offloaded_blocks == 12
        torch.cuda.current_stream().synchronize()
        assert bool((cache[:, :, 0:4] == -1.0).all())  # it did run, after the save
    finally:
        connector.close()
    assert torch.equal(_stored(daemon, ns, keys, device), want.cpu())


def test_pinned_staging_is_handed_out_again_only_after_its_copy() -> None:
    device = _device()
    copies = copies_for(device)
    assert isinstance(copies.streams, CudaStreams)
    cache = torch.zeros((8, 1024), device=device)
    first = copies.take(4, (1024,), torch.float32)
    assert first.is_pinned()
    first.fill_(7.0)
    _spin(copies.streams.copy)
    event = copies.load(first, lambda: cache[:4].copy_(first, non_blocking=True))
    assert not event.query()
    second = copies.take(4, (1024,), torch.float32)
    assert second.data_ptr() != first.data_ptr()  # first is still under its copy
    event.synchronize()
    assert bool((cache[:4] == 7.0).all())
    assert copies.take(4, (1024,), torch.float32).data_ptr() == first.data_ptr()


def test_paged_layers_on_cuda_go_out_and_back_through_pinned_staging() -> None:
    """vLLM's layer tensors (PagedKV) on CUDA: a save after a long forward pass, and a load
    back into other blocks, through the copies the worker uses."""
    device = _device()
    layers = [(f"layer{i}", torch.zeros((32, 2, BLOCK, 128), device=device)) for i in range(2)]
    paged = PagedKV(layers, 32)
    copies: DeviceCopies = copies_for(device)
    values = [torch.rand((4, 2, BLOCK, 128), device=device) + 1.0 for _ in layers]
    _spin()
    for (_, tensor), value in zip(layers, values, strict=True):
        tensor[[1, 5, 9, 13]] = value  # the forward pass writes them at its end
    staging = copies.staging(4, (paged.block_bytes,), torch.uint8)
    saved = copies.save(lambda: paged.gather([1, 5, 9, 13], out=staging), staging)
    for _, tensor in layers:
        tensor[[1, 5, 9, 13]] = -1.0  # the next forward pass: waits for the save
    saved.synchronize()
    rows = copies.take(4, (paged.block_bytes,), torch.uint8)
    rows.copy_(staging)
    loaded = copies.load(rows, lambda: paged.scatter(rows, [2, 6, 10, 14]))
    loaded.synchronize()
    for (_, tensor), value in zip(layers, values, strict=True):
        assert torch.equal(tensor[[2, 6, 10, 14]], value)
        assert bool((tensor[[1, 5, 9, 13]] == -1.0).all())
