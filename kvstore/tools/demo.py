"""`make demo-store`: start kvstore-server on embedded defaults, drive a demo workload, show stats.

The workload is what an inference engine does with the store: requests share a few system
prompts, each request's blocks get chained prefix keys, the engine asks `lookup` for the
longest cached prefix, loads those blocks with `get_into` (checking they are bit-exact) and
"computes" and `put`s the rest. The daemon gets a small L2 (`--dram-capacity`, 32 MiB) so
the run shows the tier hierarchy at work: cold prefixes are demoted to the L3 file and loaded
back when a request needs them again. At the end it prints per-tier stats and the hit rate,
then stops the daemon (which removes its shared-memory segment; L3 stays, and the next run
starts with what it held).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import socket
import subprocess
import sys

import numpy as np
from rich.console import Console
from rich.progress import Progress

from kvstore.client import KVStoreClient, KVStoreError, prefix_keys
from kvstore.tools.tables import stats_view
from kvstore.tools.testing import free_port, wait_serving

DEFAULT_PORT, DEFAULT_METRICS_PORT = 50051, 9400
BLOCK_SIZE = 16  # tokens per block
NAMESPACE = "demo-llama/bf16/L8-H8-D128/bs16/tp0"


def pick_port(wanted: int) -> int:
    """wanted if it is free, else (or for 0) a free one."""
    if not wanted:
        return free_port()
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", wanted))
        except OSError:  # busy
            return free_port()
    return wanted


def block_payload(key: bytes, size_bytes: int) -> np.ndarray:
    """The K/V bytes an engine would compute for a block: deterministic in its key."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size_bytes, dtype=np.uint8)


def _workload(num_requests: int, rng: random.Random) -> list[list[int]]:
    """Token lists: 6 system prompts of 4-12 blocks, each request adds 1-6 blocks of its own."""
    prompts = [[rng.randrange(32000) for _ in range(BLOCK_SIZE * rng.randint(4, 12))]
               for _ in range(6)]
    requests = []
    for _ in range(num_requests):
        own = [rng.randrange(32000) for _ in range(BLOCK_SIZE * rng.randint(1, 6) + 5)]
        requests.append(rng.choice(prompts) + own)
    return requests


def run_workload(kv: KVStoreClient, num_requests: int, block_bytes: int, console: Console) -> None:
    rng = random.Random(7)
    loaded = computed = 0
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("requests", total=num_requests)
        for tokens in _workload(num_requests, rng):
            keys = prefix_keys(tokens, BLOCK_SIZE, NAMESPACE)
            hit = kv.lookup(keys, block_tokens=BLOCK_SIZE).prefix_length
            buffers = [np.empty(block_bytes, dtype=np.uint8) for _ in range(hit)]
            sizes = kv.get_into(keys[:hit], buffers)
            for key, size, buf in zip(keys[:hit], sizes, buffers, strict=True):
                if size != block_bytes or not np.array_equal(buf, block_payload(key, block_bytes)):
                    raise SystemExit(f"demo: block {key.hex()[:16]} came back wrong")
            new = [block_payload(k, block_bytes) for k in keys[hit:]]
            if new:
                kv.put(keys[hit:], new, parent=keys[hit - 1] if hit else None)
            loaded += hit
            computed += len(new)
            progress.advance(task)
    total = loaded + computed
    console.print(
        f"{num_requests} requests, {total} blocks of {block_bytes // 1024} KiB: "
        f"{loaded} loaded from the store, {computed} computed and stored "
        f"(prefix reuse {loaded / total:.0%}); every loaded block verified bit-exact; "
        f"shared memory: {'yes' if kv.uses_shared_memory else 'no'}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--block-bytes", type=int, default=256 << 10)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 = any free port")
    parser.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT)
    parser.add_argument("--dram-capacity", default="32MiB",
                        help="the daemon's L2 size; small, so blocks move to L3 and back")
    args = parser.parse_args(argv)
    console = Console(width=max(100, Console().width))
    port, metrics_port = pick_port(args.port), pick_port(args.metrics_port)
    if (args.port, args.metrics_port) != (port, metrics_port) and args.port and args.metrics_port:
        console.print(f"[yellow]ports {args.port}/{args.metrics_port} busy; using {port} and "
                      f"{metrics_port}[/]")
    cmd = [sys.executable, "-m", "kvstore.daemon.server", "--port", str(port),
           "--metrics-port", str(metrics_port), "--dram-capacity", args.dram_capacity]
    console.print(f"[bold]starting[/] {' '.join(['kvstore-server', *cmd[3:]])}")
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_serving(f"127.0.0.1:{port}", server)
        with KVStoreClient(f"127.0.0.1:{port}", NAMESPACE) as kv:
            run_workload(kv, args.requests, args.block_bytes, console)
            console.print(stats_view(kv.stats(), f"127.0.0.1:{port}"))
    except (KVStoreError, RuntimeError) as exc:
        console.print(f"[red]demo failed: {exc}[/]")
        return 1
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(30)
        console.print(f"kvstore-server stopped (exit {code})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
