"""What block events (the WatchEvents verb) cost the store: two real daemons, one with events
on (the default `events.buffer_events`, and a subscriber reading every event, as a router
would) and one with them off (`events.buffer_events=0`), driven alternately from this process
with the same co-located puts and gets (shared memory, batches of 16, new keys each put).

Prints, per size, `events_put_<size>` and `events_get_<size>`: GB/s with events on vs off
(target >= 0.98x: events cost at most 2%), and a `#` line with the events the subscriber
received (each put announces its blocks, each eviction after it their removal).
"""

from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from figures import Figure, Op, gbps_figure, paired, run_main

from kvstore.client import KVStoreClient
from kvstore.tools.testing import start_daemon
from kvstore.units import KiB, MiB, parse_size

PAGE_BYTES = 64 * KiB
TARGET = ">= 0.98x"


@contextmanager
def daemon(workdir: Path, name: str, capacity_bytes: int, *settings: str) -> Iterator[str]:
    """A daemon with its Unix socket (the local path); yields its target."""
    folder = workdir / name
    folder.mkdir()
    d = start_daemon(folder, f"dram.capacity_bytes={capacity_bytes}",
                     f"dram.page_size_bytes={PAGE_BYTES}", "nvme.enabled=false",
                     f"dram.shm_name=kvstore-events-bench-{name}-{secrets.token_hex(3)}",
                     f"server.unix_socket={folder / 'kvstore.sock'}", "log_level=WARNING",
                     *settings)
    try:
        yield d.target
    finally:
        d.stop()


class Subscriber:
    """Reads every event of a daemon's stream on a thread, as a router would."""

    def __init__(self, target: str) -> None:
        self.kv = KVStoreClient(target, "bench-watch")
        self.events = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for response in self.kv.watch_events():  # ends when close() closes the channel
            self.events += len(response.events)

    def close(self) -> None:
        self.kv.close()
        self.thread.join(10)


def put_op(kv: KVStoreClient, values: list[bytes]) -> Op:
    """Puts of new keys, evicted after the timing."""
    def setup() -> list[bytes]:
        return [secrets.token_bytes(32) for _ in values]
    return Op(run=lambda keys: kv.put(keys, values, independent=True), setup=setup,
              teardown=lambda keys: kv.evict(keys))


def get_op(kv: KVStoreClient, keys: list[bytes], buffers: list[np.ndarray]) -> Op:
    return Op(run=lambda _: kv.get_into(keys, buffers))


def run(args: argparse.Namespace) -> tuple[list[Figure], dict[str, Any]]:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    capacity = max(sizes) * args.batch * 4 + 64 * MiB
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        on = stack.enter_context(daemon(workdir, "on", capacity))
        off = stack.enter_context(daemon(workdir, "off", capacity, "events.buffer_events=0"))
        subscriber = Subscriber(on)
        stack.callback(subscriber.close)
        kv_on = stack.enter_context(KVStoreClient(on, "bench"))
        kv_off = stack.enter_context(KVStoreClient(off, "bench"))
        for size in sizes:
            label = f"{size // KiB}k" if size < MiB else f"{size // MiB}m"
            values = [secrets.token_bytes(size) for _ in range(args.batch)]
            ours_s, base_s = paired(put_op(kv_on, values), put_op(kv_off, values),
                                    args.repeats, args.warmup)
            figures.append(gbps_figure(f"events_put_{label}", size * args.batch, ours_s,
                                       "events off", base_s, TARGET))
            keys = [secrets.token_bytes(32) for _ in values]
            kv_on.put(keys, values, independent=True)
            kv_off.put(keys, values, independent=True)
            buffers = [np.empty(size, np.uint8) for _ in values]
            ours_s, base_s = paired(get_op(kv_on, keys, buffers),
                                    get_op(kv_off, keys, buffers), args.repeats, args.warmup)
            figures.append(gbps_figure(f"events_get_{label}", size * args.batch, ours_s,
                                       "events off", base_s, TARGET))
        print(f"# the subscriber received {subscriber.events} events", flush=True)
    return figures, {"batch": args.batch, "repeats": args.repeats, "sizes": sizes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="256KiB,2MiB")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="few repeats (tests)")
    parser.add_argument("--json", nargs="?", const=True, default=False)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup = 5, 1
    return run_main(args, run)


if __name__ == "__main__":
    sys.exit(main())
