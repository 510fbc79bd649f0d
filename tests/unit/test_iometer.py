"""IoMeter: queue depth while batches run, and busy time as the union of overlapping
batches (so bytes / seconds is the tier's bandwidth, not one stream's)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kvstore.daemon.iometer import IoMeter
from kvstore.tier import TierStats
from kvstore.tiers.base import Transfer

ONE = [Transfer((), 1, [memoryview(b"x")])]


def test_overlapping_batches_count_their_union_and_the_queue_depth() -> None:
    meter, stats = IoMeter(), TierStats("nvme", True)
    both_in = threading.Barrier(3)
    depths: list[int] = []

    def move(batch: Sequence[Transfer]) -> list[OSError | None]:
        both_in.wait()  # both batches are in flight together
        time.sleep(0.2)
        return [None] * len(batch)

    threads = [threading.Thread(target=meter.run, args=(stats, "read", move, ONE * 2))
               for _ in range(2)]
    for t in threads:
        t.start()
    both_in.wait()
    depths.append(stats.queue_depth)
    for t in threads:
        t.join()
    assert depths == [4] and stats.queue_depth == 0
    assert 0.2 <= stats.read_seconds < 0.39  # one 0.2 s interval, not two added up
    assert stats.write_seconds == 0.0


def test_a_failing_batch_still_leaves_the_books_straight() -> None:
    meter, stats = IoMeter(), TierStats("nvme", True)

    def move(batch: Sequence[Transfer]) -> list[OSError | None]:
        raise RuntimeError("device gone")

    try:
        meter.run(stats, "write", move, ONE)
    except RuntimeError:
        assert stats.queue_depth == 0 and stats.write_seconds > 0
    else:
        raise AssertionError("the error must reach the caller")
