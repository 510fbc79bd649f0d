"""Demotion, promotion, admission, placement, prefetch and re-adoption on a real store: a real
shared-memory L2 and a real L3 file with its manifest, in this process so that each mover
step is taken by the test (`tiering.step()`) and every expectation is exact.

L2 is 16 pages of 64 KiB and every block is one page, so "15 blocks" is 94% full: over the
0.9 high watermark, and one step demotes down to the 0.75 low watermark, which is 4 blocks
(15/16 - 0.75 = 0.1875 of 1 MiB, rounded up to whole blocks).
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.core.errors import FailedPrecondition
from kvstore.daemon.collectors import LOADS_COALESCED
from kvstore.daemon.config import load_config
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.store import Store
from kvstore.keys import BlockKey
from kvstore.tier import Tier

PAGE = 64 << 10
NS = "tiering"


def key(name: str) -> BlockKey:
    return BlockKey(np.random.default_rng(list(name.encode())).bytes(32))


def value(name: str, size: int = PAGE) -> bytes:
    return np.random.default_rng([*name.encode(), 1]).bytes(size)


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[Callable[..., Store]]:
    opened: list[Store] = []

    def make(*settings: str, l3: str = "l3",
             clock: Callable[[], float] = time.monotonic) -> Store:
        config = load_config(env={}, overrides=[
            f"nvme.dir={tmp_path / l3}", "dram.capacity_bytes=1MiB", "dram.page_size_bytes=64KiB",
            "nvme.capacity_bytes=2MiB", "nvme.page_size_bytes=64KiB", "server.port=0",
            "dram.pin_memory=false", *settings,
        ])
        store = Store(config, clock)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def put(store: Store, names: list[str], chain: bool = False, size: int = PAGE) -> None:
    session = store.writer.begin_put(NS, [key(n) for n in names], [size] * len(names),
                                     independent=not chain)
    for n in names:
        store.writer.write(session, memoryview(value(n, size)))
    store.writer.commit(session)


def get(store: Store, names: list[str]) -> list[bytes | None]:
    """Each block's bytes (None for a miss), copied out under a lease."""
    result = store.reader.read(NS, [key(n) for n in names], 5.0)
    dram = store.state.dram
    assert dram is not None
    extents = iter(result.extents)
    out: list[bytes | None] = []
    for entry in result.entries:
        out.append(None if entry is None else b"".join(dram.views(next(extents))))
    if any(e is not None for e in result.entries):
        store.reader.release([result.lease_id])
    return out


def tiers(store: Store, names: list[str]) -> list[str | None]:
    _, found = store.lookup(NS, [key(n) for n in names])
    return [t.label if t is not None else None for t in found]


def stat(store: Store, tier: str, field: str) -> int:
    (row,) = [t for t in store.stats().tiers if t.tier == tier]
    return int(getattr(row, field))


def loads_coalesced(store: Store) -> float:
    """Loads joined instead of started, as a scrape of the store's metrics shows them."""
    metrics = Metrics()
    metrics.watch_store(store)
    text = metrics.render().decode()
    (line,) = [row for row in text.splitlines() if row.startswith(f"{LOADS_COALESCED} ")]
    return float(line.split()[1])


def fill(store: Store) -> list[str]:
    """15 independent one-page blocks, oldest first: one over the high watermark."""
    names = [f"b{i:02}" for i in range(15)]
    put(store, names)
    return names


# --- demotion -------------------------------------------------------------------------------


def test_a_step_demotes_the_least_recently_used_blocks_down_to_the_low_watermark(
    make_store: Callable[..., Store],
) -> None:
    store = make_store()
    names = fill(store)
    get(store, ["b00"])  # now the most recently used
    assert store.tiering.step() == 4 * PAGE
    assert tiers(store, names) == [
        "dram", "nvme", "nvme", "nvme", "nvme", *["dram"] * 10]
    assert stat(store, "dram", "demotions") == 4
    assert (stat(store, "nvme", "objects"), stat(store, "nvme", "bytes_in")) == (4, 4 * PAGE)
    assert stat(store, "dram", "evictions") == 0
    assert store.tiering.step() == 0  # 11 of 16 pages: under the high watermark


def test_a_chain_is_demoted_leaf_first_and_its_parents_follow_in_the_same_step(
    make_store: Callable[..., Store],
) -> None:
    store = make_store()
    put(store, ["c0", "c1", "c2"], chain=True)  # the oldest blocks, c0 the root
    put(store, [f"i{i:02}" for i in range(12)])
    store.tiering.step()
    # c2 is the only leaf of the chain; once it is in L3, c1 is a leaf of L2, then c0.
    assert tiers(store, ["c0", "c1", "c2", "i00", "i01"]) == [
        "nvme", "nvme", "nvme", "nvme", "dram"]


def test_an_l3_hit_is_promoted_to_l2_bit_exact_and_leaves_l3_when_exclusive(
    make_store: Callable[..., Store],
) -> None:
    store = make_store()
    names = fill(store)
    store.tiering.step()
    assert get(store, ["b00", "b01"]) == [value("b00"), value("b01")]
    assert tiers(store, ["b00", "b01", "b02"]) == ["dram", "dram", "nvme"]
    assert stat(store, "dram", "promotions") == 2
    assert stat(store, "nvme", "objects") == 2
    assert (stat(store, "nvme", "hits"), stat(store, "dram", "misses")) == (2, 2)
    assert get(store, names) == [value(n) for n in names]


def test_inclusive_placement_keeps_the_l3_copy_so_a_second_demotion_writes_nothing(
    make_store: Callable[..., Store],
) -> None:
    store = make_store("nvme.placement=inclusive")
    names = fill(store)
    store.tiering.step()
    assert get(store, ["b00"]) == [value("b00")]
    assert tiers(store, ["b00"]) == ["dram"]
    assert stat(store, "nvme", "objects") == 4  # b00 still has its L3 copy
    get(store, names[4:])  # b00 is the least recently used again
    put(store, [f"x{i}" for i in range(3)])  # 15 of 16 pages again
    written = stat(store, "nvme", "bytes_in")
    store.tiering.step()
    assert tiers(store, ["b00"]) == ["nvme"]
    # b00 went back for free; only the other three demoted blocks were written.
    assert stat(store, "nvme", "bytes_in") == written + 3 * PAGE


def test_admission_refuses_blocks_seen_fewer_times_than_admit_min_seen(
    make_store: Callable[..., Store],
) -> None:
    store = make_store("nvme.admit_min_seen=2")
    names = fill(store)
    get(store, ["b01"])  # seen twice: a put and a read
    get(store, names[4:])  # keep these recent, so the step takes b00..b03
    store.tiering.step()
    assert tiers(store, ["b00", "b01", "b02", "b03"]) == [None, "nvme", None, None]
    assert stat(store, "nvme", "admissions_refused") == 3
    assert stat(store, "dram", "evictions") == 3


def test_a_full_l3_evicts_its_least_recently_used_blocks_for_newer_ones(
    make_store: Callable[..., Store],
) -> None:
    store = make_store("nvme.capacity_bytes=256KiB")  # 4 pages
    fill(store)
    store.tiering.step()  # b00..b03 fill L3
    put(store, ["y0", "y1", "y2", "y3"])
    store.tiering.step()  # b04..b07 replace them
    assert tiers(store, ["b00", "b03", "b04", "b07"]) == [None, None, "nvme", "nvme"]
    assert stat(store, "nvme", "evictions") == 4
    assert get(store, ["b04", "b07"]) == [value("b04"), value("b07")]


def test_pinned_and_leased_blocks_stay_in_l2(make_store: Callable[..., Store]) -> None:
    store = make_store()
    names = fill(store)
    store.set_pinned(NS, [key("b00")], True)
    lease = store.reader.read(NS, [key("b01")], 5.0)
    store.tiering.step()
    assert tiers(store, names[:6]) == ["dram", "dram", "nvme", "nvme", "nvme", "nvme"]
    store.reader.release([lease.lease_id])


# --- loads and prefetch ---------------------------------------------------------------------


def test_two_loads_of_one_block_share_one_read(make_store: Callable[..., Store]) -> None:
    store = make_store()
    fill(store)
    store.tiering.step()
    with store.state.lock:  # both ask before the load can start
        entry = store.index.get(NS, key("b00"))
        assert entry is not None
        first = store.tiering.load(entry, Tier.DRAM)
        second = store.tiering.load(entry, Tier.DRAM)
    assert first is second and loads_coalesced(store) == 1
    assert first.wait(5) and first.ok
    assert stat(store, "nvme", "bytes_out") == PAGE  # one read
    assert get(store, ["b00"]) == [value("b00")]


def test_a_get_waits_for_the_prefetch_loading_its_block(make_store: Callable[..., Store]) -> None:
    size = 8 << 20  # long enough to read that the Get arrives while it is in flight
    store = make_store("dram.capacity_bytes=32MiB", "nvme.capacity_bytes=64MiB")
    put(store, ["big"], size=size)
    put(store, [f"f{i}" for i in range(3)], size=size)  # 32 of 32 MiB
    store.tiering.step()
    assert tiers(store, ["big"]) == ["nvme"]
    progress = store.prefetch(NS, [key("big")], Tier.DRAM)
    next(progress)  # the load has started
    assert get(store, ["big"]) == [value("big", size)]
    assert list(progress)[-1].done == 1
    assert loads_coalesced(store) == 1
    assert stat(store, "nvme", "bytes_out") == size


def chain_in_l3(store: Store, n: int) -> list[str]:
    names = [f"p{i:02}" for i in range(n)]
    put(store, names, chain=True)
    put(store, [f"z{i:02}" for i in range(15 - n)])
    store.tiering.step()
    assert tiers(store, names) == ["nvme"] * n
    return names


def settle(store: Store) -> None:
    """Wait (up to 5 s) until no load is in flight, so what was started has landed."""
    deadline = time.monotonic() + 5
    while store.tiering._loads and time.monotonic() < deadline:
        time.sleep(0.01)


def test_prefetch_loads_in_prefix_order_and_reports_each_key(
    make_store: Callable[..., Store],
) -> None:
    store = make_store("movers.low_watermark=0.5")
    names = chain_in_l3(store, 4)
    reports = list(store.prefetch(NS, [key(n) for n in [*names, "absent"]], Tier.DRAM))
    last = reports[-1]
    assert (last.done, last.missing, last.failed, last.total) == (4, 1, 0, 5)
    assert (last.prefix_length, last.deadline_exceeded) == (4, False)
    assert [r.prefix_length for r in reports] == sorted(r.prefix_length for r in reports)
    assert tiers(store, names) == ["dram"] * 4
    assert get(store, names) == [value(n) for n in names]
    gap_first = list(store.prefetch(NS, [key(n) for n in ["absent", *names]], Tier.DRAM))[-1]
    assert (gap_first.done, gap_first.missing, gap_first.prefix_length) == (4, 1, 0)


def test_prefetch_stops_at_its_deadline_with_the_ready_prefix(
    make_store: Callable[..., Store],
) -> None:
    store = make_store("movers.low_watermark=0.5")
    names = chain_in_l3(store, 6)
    reports = list(store.prefetch(NS, [key(n) for n in names], Tier.DRAM, deadline_s=1e-6))
    last = reports[-1]
    assert last.deadline_exceeded and last.prefix_length < 6
    ready = tiers(store, names)[: last.prefix_length]
    assert ready == ["dram"] * last.prefix_length


def test_prefetch_starts_no_load_once_its_deadline_has_passed(
    make_store: Callable[..., Store],
) -> None:
    now = [0.0]
    store = make_store("movers.low_watermark=0.5", clock=lambda: now[0])
    names = chain_in_l3(store, 6)
    progress = store.prefetch(NS, [key(n) for n in names], Tier.DRAM, deadline_s=1.0)
    now[0] = 2.0  # the deadline passes before the first load could start
    last = list(progress)[-1]
    assert (last.deadline_exceeded, last.done, last.prefix_length) == (True, 0, 0)
    settle(store)
    assert tiers(store, names) == ["nvme"] * 6
    assert stat(store, "dram", "promotions") == 0


def test_prefetch_stops_starting_loads_when_the_caller_goes_away(
    make_store: Callable[..., Store],
) -> None:
    store = make_store("movers.low_watermark=0.5", "nvme.io_threads=1")  # 2 loads in flight
    names = chain_in_l3(store, 7)
    gone = threading.Event()
    progress = store.prefetch(NS, [key(n) for n in names], Tier.DRAM, cancelled=gone.is_set)
    next(progress)
    gone.set()
    assert list(progress) == []
    settle(store)
    assert stat(store, "dram", "promotions") <= 3  # the window, not the chain of 7


def test_prefetch_to_a_tier_that_is_off_is_refused(make_store: Callable[..., Store]) -> None:
    store = make_store()
    with pytest.raises(FailedPrecondition, match="hbm"):
        store.prefetch(NS, [key("a")], Tier.HBM)


# --- restart --------------------------------------------------------------------------------


def test_a_restarted_store_re_adopts_what_l3_held(make_store: Callable[..., Store]) -> None:
    store = make_store()
    names = fill(store)
    store.tiering.step()
    store.close()
    again = make_store()
    assert again.adopted == 4
    assert tiers(again, names) == ["nvme"] * 4 + [None] * 11  # L2 died with the process
    assert get(again, names[:4]) == [value(n) for n in names[:4]]


def test_blocks_evicted_from_l3_stay_gone_after_a_restart(
    make_store: Callable[..., Store],
) -> None:
    store = make_store()
    names = fill(store)
    store.tiering.step()
    store.evict(NS, [key("b00")], 0, False, None)  # by key: every copy
    assert store.evict("", [], 0, True, Tier.NVME).evicted == 3  # the rest of L3
    store.close()
    again = make_store()
    assert again.adopted == 0
    assert tiers(again, names[:4]) == [None] * 4


def test_a_failing_mover_reports_why(make_store: Callable[..., Store], tmp_path: Path) -> None:
    store = make_store("nvme.compact_after_records=1", "movers.interval_s=0.01")
    failures: list[str] = []
    store.start(failures.append)
    shutil.rmtree(tmp_path / "l3")  # the manifest snapshot now cannot be written
    fill(store)
    deadline = time.monotonic() + 5
    while not failures and time.monotonic() < deadline:
        time.sleep(0.01)
    assert failures and "Error" in failures[0]
