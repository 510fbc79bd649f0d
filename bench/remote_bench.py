"""The remote data path against the floor a Python socket gives, in one run.

A real `kvstore-server` subprocess with its data socket on (server.data_port=0) and a bare
socket server in Python (this file run with --serve, a subprocess too: pre-built payloads
sent with `sendall`, puts received with `recv_into` into buffers allocated once), both on
loopback TCP, driven from this process. For each object size (default 256 KiB and 2 MiB),
in batches of 16:

- remote_get: `get_into` over the data socket (`kvstore.client._datasocket.DataSocket`;
  checksums verified, the client's default) into the same destination arrays vs the bare
  server's 16 payloads `recv_into` them (target >= 0.8x); remote_get_noverify: the same
  without verifying;
- remote_put: `put` over the data socket (new keys every repeat; the daemon receives into
  its L2 pages and hashes each piece as it lands) vs the bare server `recv_into`-ing the
  same 16 payloads sent with `sendall` (target >= 0.8x);
- grpc_get, grpc_put: the same over gRPC (`KVStoreClient` with shared memory off), the path
  a remote engine takes without the data socket, against the same floor (for reference).

Every figure is warmed up, then ours and the floor run alternately, repeat by repeat, so
background load hits both alike; the median per-batch figure is reported, and a `#` line
gives the median (and quartiles) of the repeats' own ratios, which a busy machine moves
less. Puts' keys are
evicted outside the timing. Prints `bench <name>: <ours> GB/s vs bare socket <floor> GB/s =
<ratio>x` per figure and, with --json, one JSON object.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
from figures import Figure, Op, gbps_figure, paired, percentile, run_main

from kvstore.client._attach import TicketKeeper
from kvstore.client._datasocket import DataSocket
from kvstore.client.sync import KVStoreClient
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.tools.testing import Daemon, start_daemon
from kvstore.units import KiB, MiB, format_size

BATCH = 16
TARGET = ">= 0.8x"
NAMESPACE = "remote-bench"
_ASK = struct.Struct("<BII")  # op (1 get, 2 put), count, size
_GET, _PUT = 1, 2


# --- the bare socket server (a subprocess) -----------------------------------------------------


def _serve(port_file: Path, sizes: list[int]) -> None:
    """Answer one connection: a get sends `count` pre-built payloads of `size` with sendall;
    a put receives count * size bytes with recv_into into a buffer made once, then one byte."""
    payloads = {size: [secrets.token_bytes(size) for _ in range(BATCH)] for size in sizes}
    sink = memoryview(bytearray(max(sizes) * BATCH))
    listener = socket.create_server(("127.0.0.1", 0))
    port_file.write_text(str(listener.getsockname()[1]))
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = bytearray(_ASK.size)
    while _exactly(conn, memoryview(head)):
        op, count, size = _ASK.unpack(head)
        if op == _GET:
            for payload in payloads[size][:count]:
                conn.sendall(payload)
        else:
            _exactly(conn, sink[:count * size])
            conn.sendall(b"\x00")


def _exactly(conn: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        k = conn.recv_into(view[got:])
        if k == 0:
            return False
        got += k
    return True


class BareSocket:
    """A client of the bare server: what a Python socket moves, with no protocol at all."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._ack = memoryview(bytearray(1))

    def get_into(self, arrays: list[npt.NDArray[np.uint8]], size: int) -> None:
        self.sock.sendall(_ASK.pack(_GET, len(arrays), size))
        for array in arrays:
            _exactly(self.sock, array.data[:size])

    def put(self, payloads: list[bytes]) -> None:
        self.sock.sendall(_ASK.pack(_PUT, len(payloads), len(payloads[0])))
        for payload in payloads:
            self.sock.sendall(payload)
        _exactly(self.sock, self._ack)


@contextmanager
def bare_server(sizes: list[int], workdir: Path) -> Iterator[BareSocket]:
    port_file = workdir / "bare.port"
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file),
                             "--sizes", ",".join(map(str, sizes))])
    try:
        for _ in range(600):
            if port_file.exists() and port_file.read_text():
                break
            if proc.poll() is not None:
                raise RuntimeError("the bare socket server exited")
            import time
            time.sleep(0.05)
        bare = BareSocket(int(port_file.read_text()))
        yield bare
        bare.sock.close()
    finally:
        proc.kill()
        proc.wait()


# --- ours --------------------------------------------------------------------------------------


def _keys(n: int) -> list[bytes]:
    return [secrets.token_bytes(32) for _ in range(n)]


def measure_size(size: int, daemon: Daemon, bare: BareSocket, data: DataSocket,
                 grpc_client: KVStoreClient, repeats: int, warmup: int) -> list[Figure]:
    batch_bytes = size * BATCH
    payloads = [secrets.token_bytes(size) for _ in range(BATCH)]
    arrays = [np.zeros(size, dtype=np.uint8) for _ in range(BATCH)]
    keys = _keys(BATCH)
    data.put(pb.PutRequest(namespace=NAMESPACE, keys=keys, sizes=[size] * BATCH), payloads)
    label = format_size(size).replace(".0 ", "").replace(" ", "")
    bare_get = Op(lambda _: bare.get_into(arrays, size))
    bare_put = Op(lambda _: bare.put(payloads))

    def get(verify: bool) -> Op:
        return Op(lambda _: data.get_into(NAMESPACE, keys, arrays, verify))

    def put_op(put: Any) -> Op:
        return Op(lambda fresh: put(fresh), setup=lambda: _keys(BATCH),
                  teardown=lambda fresh: grpc_client.evict(fresh))

    def put_socket(fresh: list[bytes]) -> None:
        data.put(pb.PutRequest(namespace=NAMESPACE, keys=fresh, sizes=[size] * BATCH,
                               independent=True), payloads)

    def put_grpc(fresh: list[bytes]) -> None:
        grpc_client.put(fresh, payloads, independent=True)

    figures = []
    runs = [
        (f"remote_get_{label}", get(True), bare_get, TARGET),
        (f"remote_get_noverify_{label}", get(False), bare_get, ""),
        (f"remote_put_{label}", put_op(put_socket), bare_put, TARGET),
        (f"grpc_get_{label}", Op(lambda _: grpc_client.get_into(keys, arrays)), bare_get, ""),
        (f"grpc_put_{label}", put_op(put_grpc), bare_put, ""),
    ]
    for name, ours, base, target in runs:
        ours_s, base_s = paired(ours, base, repeats, warmup)
        figure = gbps_figure(name, batch_bytes, ours_s, "bare socket", base_s, target)
        # Each repeat times ours and the floor back to back: their ratio, repeat by repeat,
        # drifts less with the machine's load than the two medians do.
        pairs = sorted(b / o for o, b in zip(ours_s, base_s, strict=True))
        figure.extra["paired_ratios"] = pairs
        print(figure.line(), flush=True)
        print(f"# {name}: paired ratio median {statistics.median(pairs):.2f}x (quartiles "
              f"{percentile(pairs, 0.25):.2f}-{percentile(pairs, 0.75):.2f}x, "
              f"{len(pairs)} pairs)", flush=True)
        figures.append(figure)
    return figures


def data_port(daemon: Daemon) -> int:
    """The daemon's data socket, as its Limits offer it."""
    with grpc.insecure_channel(daemon.target) as channel:
        port = int(pb_grpc.KVStoreStub(channel).Limits(pb.LimitsRequest()).data_port)
    if not port:
        raise RuntimeError("the daemon offers no data socket (LimitsResponse.data_port 0)")
    return port


def run(args: argparse.Namespace) -> tuple[list[Figure], dict[str, Any]]:
    sizes = [int(s) for s in args.sizes.split(",")]
    figures: list[Figure] = []
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="remote-")))
        daemon = start_daemon(workdir, "server.data_port=0",
                              f"dram.capacity_bytes={args.dram_bytes}")
        stack.callback(daemon.stop)
        bare = stack.enter_context(bare_server(sizes, workdir))
        grpc_client = stack.enter_context(KVStoreClient(daemon.target, NAMESPACE,
                                                        shared_memory=False))
        data = DataSocket("127.0.0.1", data_port(daemon), TicketKeeper(), 30.0)
        stack.callback(data.close)
        for size in sizes:
            figures += measure_size(size, daemon, bare, data, grpc_client, args.repeats,
                                    args.warmup)
    return figures, {"batch": BATCH, "sizes": sizes, "repeats": args.repeats,
                     "cpus": os.cpu_count()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=f"{256 * KiB},{2 * MiB}")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dram-bytes", default="1GiB")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 5 repeats, 1 warm-up (figures too noisy to judge)")
    parser.add_argument("--json", nargs="?", const=True, default=None, type=Path)
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup = 5, 1
    if args.serve is not None:
        _serve(args.serve, [int(s) for s in args.sizes.split(",")])
        return 0
    return run_main(args, run, printed=True)


if __name__ == "__main__":
    sys.exit(main())
