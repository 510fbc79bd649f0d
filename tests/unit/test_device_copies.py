"""The order of the connectors' device copies (kvstore.integrations.device_copies), checked on
the CPU through a simulated device that runs nothing until it is told to, driving the engine's
real StoreConnector against a real daemon. Each rule is checked by a function that returns
what went wrong; each is run once with the real copies (nothing goes wrong) and once with a
copier broken on purpose in the way the rule forbids (the check sees it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.engine.connector import Loaded, StoreConnector
from kvstore.engine.scheduler import LoadPlan
from kvstore.integrations.device_copies import (
    DONE,
    DeviceCopies,
    Event,
    ImmediateStreams,
    SimDevice,
    SimEvent,
    SimStreams,
)
from kvstore.integrations.link import StoreLink
from kvstore.kernels import reference
from kvstore.keys import BlockKey, prefix_keys
from kvstore.tools.testing import Daemon

BLOCK = 4
# [layers, K/V, blocks, block_size, kv_heads, head_dim]: 512-byte blocks, 16 of them.
SHAPE = (2, 2, 16, BLOCK, 1, 8)


# -- copiers broken on purpose, one per rule ---------------------------------------------------

class ReportsLoadsAtOnce(DeviceCopies):
    """Broken: a load's copy is enqueued, but the event handed back is complete at once (as
    if a load were reported when its bytes were read, not when they reached the cache)."""

    def load(self, staging: torch.Tensor, place: Callable[[], object]) -> Event:
        super().load(staging, place)
        return DONE


class ReusesStagingAtOnce(DeviceCopies):
    """Broken: a pooled staging buffer is handed out again while a copy still reads it."""

    def _reusable(self, event: Event) -> bool:
        return True


class SavesWithoutWaitingForTheForwardPass(DeviceCopies):
    """Broken: a save's copy does not wait for the forward pass that writes its blocks."""

    def save(self, fill: Callable[[], object], staging: torch.Tensor) -> Event:
        event = self.streams.on_copy(fill, keep=(staging,), name="save")
        self.streams.forward_waits(event)
        return event


class SavesUnderTheNextForwardPass(DeviceCopies):
    """Broken: the next forward pass does not wait for a save's copy of its blocks."""

    def save(self, fill: Callable[[], object], staging: torch.Tensor) -> Event:
        after = self.streams.forward_event()
        return self.streams.on_copy(fill, after=after, keep=(staging,), name="save")


class SavesReadyAtOnce(DeviceCopies):
    """Broken: the link is told a save's rows are ready before its copy ran."""

    def save(self, fill: Callable[[], object], staging: torch.Tensor) -> Event:
        super().save(fill, staging)
        return DONE


# -- helpers -------------------------------------------------------------------------------

def _blocks(seed: int) -> torch.Tensor:
    """Four blocks' worth of values, distinct per seed and never zero."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand((SHAPE[0], SHAPE[1], 4, *SHAPE[3:]), generator=gen) + 1.0


def _keys(ns: str, seed: int) -> list[BlockKey]:
    return prefix_keys([seed * 100 + i for i in range(4 * BLOCK)], BLOCK, ns)


def _sim(copier: type[DeviceCopies] = DeviceCopies,
         prefer: str = "copy") -> tuple[DeviceCopies, SimDevice]:
    device = SimDevice(prefer=prefer)
    return copier(SimStreams(device)), device


def _connector(daemon: Daemon, ns: str, copies: DeviceCopies | None = None,
               ) -> tuple[StoreConnector, torch.Tensor]:
    cache = torch.zeros(SHAPE)
    return StoreConnector(daemon.target, ns, cache, BLOCK, reference,
                          copies=copies), cache


def _store(daemon: Daemon, ns: str, seed: int) -> tuple[list[BlockKey], torch.Tensor]:
    """Put four blocks (values of `seed`) into the store through an immediate connector."""
    keys, want = _keys(ns, seed), _blocks(seed)
    connector, cache = _connector(daemon, ns)
    try:
        cache[:, :, 0:4] = want
        assert connector.offload(keys, [0, 1, 2, 3], None)
        connector.flush(10.0)
        assert connector.stats.offloaded_blocks == 4
    finally:
        connector.close()
    return keys, want


def _stored(daemon: Daemon, ns: str, keys: list[BlockKey]) -> torch.Tensor | None:
    """What the store holds under keys, as four blocks; None for a miss."""
    with KVStoreClient(daemon.target, ns, shared_memory=False) as kv:
        values = kv.get(keys)
    if any(v is None for v in values):
        return None
    flat = torch.frombuffer(bytearray(b"".join(v for v in values if v)), dtype=torch.float32)
    rows = flat.reshape(4, SHAPE[0], SHAPE[1], *SHAPE[3:])
    return rows.permute(1, 2, 0, 3, 4, 5)


def _until(what: Callable[[], bool], message: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, message
        time.sleep(0.005)


def _loads(connector: StoreConnector, count: int) -> list[Loaded]:
    """Poll until `count` loads were reported (the device has run by then)."""
    loaded: list[Loaded] = []
    deadline = time.monotonic() + 10.0
    while len(loaded) < count:
        assert time.monotonic() < deadline, f"{len(loaded)} of {count} loads reported"
        loaded += [e for e in connector.poll(0.1) if isinstance(e, Loaded)]
    return loaded


# -- the checks: what went wrong, [] when nothing did -------------------------------------------

def load_reported_only_after_its_copy(daemon: Daemon, ns: str,
                                      copies: DeviceCopies, device: SimDevice) -> list[str]:
    """A load is reported only once its copy into the cache ran; then the cache holds it."""
    keys, want = _store(daemon, ns, seed=1)
    connector, cache = _connector(daemon, ns, copies)
    problems = []
    try:
        connector.start_load(LoadPlan(None, 0, keys, [8, 9, 10, 11]), "dram")
        early: list[Loaded] = []

        def came_back() -> bool:  # reported, or known to the connector and not reported
            early.extend(e for e in connector.poll() if isinstance(e, Loaded))
            return bool(early or connector._landing)

        _until(came_back, "the load never came back")
        assert device.enqueued["copy"] == 1
        if early and not torch.equal(cache[:, :, 8:12], want):
            problems.append("a load was reported while its blocks in the cache held old bytes")
        device.run()
        [loaded] = early or _loads(connector, 1)
        assert loaded.arrived == 4
        assert torch.equal(cache[:, :, 8:12], want)  # the copy did run, eventually
    finally:
        connector.close()
    return problems


def staging_reused_only_after_its_copy(daemon: Daemon, ns: str,
                                       copies: DeviceCopies, device: SimDevice) -> list[str]:
    """A second load's staging is not the buffer a first load's pending copy reads."""
    keys_a, want_a = _store(daemon, ns, seed=2)
    keys_b, want_b = _store(daemon, ns, seed=3)
    connector, cache = _connector(daemon, ns, copies)
    try:
        # Each load's copy is enqueued and its staging given back (to be re-used once the copy
        # ran) before it comes back to the connector (`_landing`, once polled).
        connector.start_load(LoadPlan(None, 0, keys_a, [4, 5, 6, 7]), "dram")
        _until(lambda: not connector.poll() and len(connector._landing) == 1,
               "load A never came back")
        connector.start_load(LoadPlan(None, 0, keys_b, [8, 9, 10, 11]), "dram")
        _until(lambda: not connector.poll() and len(connector._landing) == 2,
               "load B never came back")
        assert device.enqueued["copy"] == 2
        device.run()
        assert sorted(e.arrived for e in _loads(connector, 2)) == [4, 4]
        assert torch.equal(cache[:, :, 8:12], want_b)
        if torch.equal(cache[:, :, 4:8], want_a):
            return []
        if torch.equal(cache[:, :, 4:8], want_b):
            return ["load A's staging was re-used by load B under A's copy: A got B's bytes"]
        return ["load A's blocks hold neither A's bytes nor B's"]
    finally:
        connector.close()


def save_reads_after_the_forward_pass(daemon: Daemon, ns: str,
                                      copies: DeviceCopies, device: SimDevice) -> list[str]:
    """An offload reads its blocks after the forward pass that writes them (the device runs
    copies first whenever the waits allow)."""
    keys, want = _keys(ns, 4), _blocks(4)
    connector, cache = _connector(daemon, ns, copies)
    try:
        device.forward(lambda: cache[:, :, 0:4].copy_(want))
        assert connector.offload(keys, [0, 1, 2, 3], None)
        connector.flush(10.0)
        device.run()
    finally:
        connector.close()
    stored = _stored(daemon, ns, keys)
    assert stored is not None
    if torch.equal(stored, want):
        assert device.log == ["forward:step", "copy:save"]
        return []
    return [f"the save read the cache before the forward pass wrote it ({device.log})"]


def save_done_before_the_next_forward_pass(daemon: Daemon, ns: str,
                                           copies: DeviceCopies, device: SimDevice) -> list[str]:
    """The forward pass after an offload does not overwrite its blocks under the copy (the
    device runs the forward stream first whenever the waits allow)."""
    keys, want = _keys(ns, 5), _blocks(5)
    connector, cache = _connector(daemon, ns, copies)
    try:
        device.forward(lambda: cache[:, :, 0:4].copy_(want))
        with device.held():  # the writer's wait for the save runs the device after this
            assert connector.offload(keys, [0, 1, 2, 3], None)
            device.forward(lambda: cache[:, :, 0:4].fill_(-1.0), name="next-step")
        connector.flush(10.0)
        device.run()
    finally:
        connector.close()
    stored = _stored(daemon, ns, keys)
    assert stored is not None
    if torch.equal(stored, want):
        assert device.log == ["forward:step", "copy:save", "forward:next-step"]
        return []
    return [f"the next forward pass overwrote the blocks under the save ({device.log})"]


def writer_puts_rows_after_the_save(daemon: Daemon, ns: str,
                                    copies: DeviceCopies, device: SimDevice) -> list[str]:
    """The link's writer puts a save's rows only after its copy ran (nothing else runs the
    device here: the writer's wait for the save's event is what does)."""
    keys, want = _keys(ns, 8), _blocks(8)
    connector, cache = _connector(daemon, ns, copies)
    try:
        device.forward(lambda: cache[:, :, 0:4].copy_(want))
        assert connector.offload(keys, [0, 1, 2, 3], None)
        connector.flush(10.0)
    finally:
        connector.close()
    device.run()
    stored = _stored(daemon, ns, keys)
    if stored is None or not torch.equal(stored, want):
        return ["the writer put the rows before their save's copy ran"]
    return []


def rows_read_after_the_save(daemon: Daemon, ns: str,
                             copies: DeviceCopies, device: SimDevice) -> list[str]:
    """The link's writer, and a load that finds the blocks still queued, read a save's rows
    only after its copy ran."""
    keys, want = _keys(ns, 6), _blocks(6)
    connector, cache = _connector(daemon, ns, copies)
    problems = []
    try:
        device.forward(lambda: cache[:, :, 0:4].copy_(want))
        assert connector.offload(keys, [0, 1, 2, 3], None)
        connector.start_load(LoadPlan(None, 0, keys, [12, 13, 14, 15]), "pending")
        _until(lambda: device.enqueued["copy"] == 2, "the load's copy was never enqueued")
        device.run()
        [loaded] = _loads(connector, 1)
        if loaded.arrived != 4 or not torch.equal(cache[:, :, 12:16], want):
            problems.append("a load read the queued rows before their save's copy ran")
        connector.flush(10.0)
    finally:
        connector.close()
    stored = _stored(daemon, ns, keys)
    if stored is None or not torch.equal(stored, want):
        problems.append("the writer put the rows before their save's copy ran")
    return problems


CHECKS = [
    (load_reported_only_after_its_copy, ReportsLoadsAtOnce, "copy"),
    (staging_reused_only_after_its_copy, ReusesStagingAtOnce, "copy"),
    (save_reads_after_the_forward_pass, SavesWithoutWaitingForTheForwardPass, "copy"),
    (save_done_before_the_next_forward_pass, SavesUnderTheNextForwardPass, "forward"),
    (writer_puts_rows_after_the_save, SavesReadyAtOnce, "copy"),
    (rows_read_after_the_save, SavesReadyAtOnce, "copy"),
]


@pytest.mark.parametrize(("check", "broken", "prefer"), CHECKS,
                         ids=[check.__name__ for check, _, _ in CHECKS])
def test_the_connector_keeps_the_rule(daemon: Daemon, ns: str, check: Callable[..., list[str]],
                                      broken: type[DeviceCopies], prefer: str) -> None:
    copies, device = _sim(DeviceCopies, prefer)
    assert check(daemon, ns, copies, device) == []
    assert device.pending() == 0


@pytest.mark.parametrize(("check", "broken", "prefer"), CHECKS,
                         ids=[f"{broken.__name__}-{check.__name__}" for check, broken, _ in CHECKS])
def test_a_copier_that_breaks_the_rule_is_caught(daemon: Daemon, ns: str,
                                                 check: Callable[..., list[str]],
                                                 broken: type[DeviceCopies], prefer: str) -> None:
    copies, device = _sim(broken, prefer)
    assert check(daemon, ns, copies, device) != []


# -- the module's own pieces -------------------------------------------------------------------

def test_the_immediate_streams_run_every_copy_at_once() -> None:
    copies = DeviceCopies(ImmediateStreams())
    ran: list[str] = []
    staging = copies.take(3, (8,), torch.uint8)
    assert copies.load(staging, lambda: ran.append("load")) is DONE
    assert copies.save(lambda: ran.append("save"), staging) is DONE
    assert ran == ["load", "save"]
    assert copies.take(3, (8,), torch.uint8).data_ptr() == staging.data_ptr()  # pooled


def test_a_pooled_staging_buffer_is_handed_out_again_once_its_copy_ran() -> None:
    copies, device = _sim()
    first = copies.take(3, (8,), torch.uint8)
    assert first.shape == (3, 8)
    copies.load(first, lambda: None)
    second = copies.take(4, (8,), torch.uint8)  # the same capacity (4 rows): not the first
    assert second.data_ptr() != first.data_ptr()
    device.run()
    assert copies.take(2, (8,), torch.uint8).data_ptr() != first.data_ptr()  # 2 rows: another size
    assert copies.take(4, (8,), torch.uint8).data_ptr() == first.data_ptr()


def test_the_simulated_device_keeps_waits_and_reports_a_wait_that_never_ends() -> None:
    device = SimDevice(prefer="copy")
    streams = SimStreams(device)
    order: list[str] = []
    device.forward(lambda: order.append("forward"))
    after = streams.forward_event()
    copied = streams.on_copy(lambda: order.append("copy"), after=after, name="save")
    assert not copied.query() and order == []
    copied.synchronize()  # a host waiting on the event runs the device up to it
    assert order == ["forward", "copy"] and copied.query()
    assert device.log == ["forward:step", "copy:save"]
    with pytest.raises(RuntimeError, match="can never complete"):
        SimEvent(device, "never recorded").synchronize()
    with pytest.raises(ValueError, match="prefer"):
        SimDevice(prefer="sideways")


def test_a_load_waits_for_queued_rows_to_be_ready(daemon: Daemon, ns: str) -> None:
    """StoreLink alone: rows offloaded with a `ready` that has not returned are read by
    neither the writer nor a load until it does."""
    link = StoreLink(daemon.target, ns, BLOCK)
    gate = threading.Event()
    keys = _keys(ns, 7)
    rows = [np.zeros(64, dtype=np.uint8) for _ in keys]
    try:
        assert link.offload(keys, rows, None, ready=gate.wait)
        out = [np.zeros(64, dtype=np.uint8) for _ in keys]
        got: list[int] = []
        reader = threading.Thread(target=lambda: got.append(link.read(keys, out)))
        reader.start()
        reader.join(0.3)
        assert reader.is_alive() and link.stats.offloaded_blocks == 0  # both wait for ready
        for i, row in enumerate(rows):
            row[:] = i + 1  # the "copy" fills the rows, then says so
        gate.set()
        reader.join(10.0)
        assert got == [4] and [int(r[0]) for r in out] == [1, 2, 3, 4]
        assert link.flush(10.0) and link.stats.offloaded_blocks == 4
    finally:
        link.close()


def test_a_load_gives_its_staging_back_once_whether_it_arrived_or_not(daemon: Daemon,
                                                                      ns: str) -> None:
    """The immediate connector's loads: each staging buffer goes back to the pool once, so
    two loads never share one."""
    keys, want = _store(daemon, ns, seed=9)
    connector, cache = _connector(daemon, ns)
    try:
        for block_ids, load_keys, arrived in (([8, 9, 10, 11], keys, 4),
                                              ([12, 13, 14, 15], _keys(ns, 10), 0)):
            connector.start_load(LoadPlan(None, 0, load_keys, block_ids), "dram")
            [loaded] = _loads(connector, 1)
            assert loaded.arrived == arrived
            assert len(connector.copies._pool) == 1
        assert torch.equal(cache[:, :, 8:12], want)
        first = connector.copies.take(4, connector._row_shape, cache.dtype)
        second = connector.copies.take(4, connector._row_shape, cache.dtype)
        assert first.data_ptr() != second.data_ptr()
    finally:
        connector.close()
