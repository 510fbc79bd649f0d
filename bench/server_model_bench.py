"""Which gRPC server model should the daemon use? Measures grpc.aio against a thread-pool
server on the same servicer shape (a 1,024-key Lookup; a Get that streams 32 x 2 MiB in
4 MiB messages), the client in another process, in one run.

Prints `bench server_model_<figure>: aio <x> vs threads <y> = <ratio>x`. The result that chose
grpc.aio for kvstore/server.py is in docs/operations.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from typing import Any

import grpc

from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc

CHUNK_BYTES = 4 << 20
BLOCK_BYTES = 2 << 20
BLOCKS = 32
BLOB = b"x" * (BLOCK_BYTES * BLOCKS)
OPTIONS = [
    ("grpc.max_send_message_length", 16 << 20),
    ("grpc.max_receive_message_length", 16 << 20),
]
TIERS = [pb.TIER_DRAM] * 1024


def _chunks() -> Iterator[pb.GetResponse]:
    view = memoryview(BLOB)
    yield pb.GetResponse(found=[True] * BLOCKS, sizes=[BLOCK_BYTES] * BLOCKS)
    for offset in range(0, len(BLOB), CHUNK_BYTES):
        yield pb.GetResponse(data=bytes(view[offset : offset + CHUNK_BYTES]))


class ThreadServicer(rpc.KVStoreServicer):
    def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        return pb.LookupResponse(prefix_length=len(request.keys), tiers=TIERS[: len(request.keys)])

    def Get(self, request: pb.GetRequest, context: Any) -> Iterator[pb.GetResponse]:
        yield from _chunks()


class AioServicer(rpc.KVStoreServicer):
    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        return pb.LookupResponse(prefix_length=len(request.keys), tiers=TIERS[: len(request.keys)])

    async def Get(self, request: pb.GetRequest, context: Any) -> AsyncIterator[pb.GetResponse]:
        for message in _chunks():
            yield message


def _client(port: int, lookups: int, gets: int) -> dict[str, float]:
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as channel:
        stub = rpc.KVStoreStub(channel)
        keys = [bytes(32)] * 1024
        latencies = []
        for _ in range(lookups):
            start = time.perf_counter()
            stub.Lookup(pb.LookupRequest(namespace="bench", keys=keys))
            latencies.append(time.perf_counter() - start)
        latencies.sort()
        received = 0
        start = time.perf_counter()
        for _ in range(gets):
            for message in stub.Get(pb.GetRequest(namespace="bench", keys=keys[:BLOCKS])):
                received += len(message.data)
        elapsed = time.perf_counter() - start
    return {
        "lookup_p50_ms": latencies[len(latencies) // 2] * 1e3,
        "lookup_p99_ms": latencies[int(len(latencies) * 0.99)] * 1e3,
        "get_gbps": received / elapsed / 1e9,
    }


def _run_client(port: int, lookups: int, gets: int) -> dict[str, float]:
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(_client, (port, lookups, gets))


def measure_threads(lookups: int, gets: int) -> dict[str, float]:
    server = grpc.server(futures.ThreadPoolExecutor(8), options=OPTIONS)
    rpc.add_KVStoreServicer_to_server(ThreadServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        return _run_client(port, lookups, gets)
    finally:
        server.stop(0)


async def _measure_aio(lookups: int, gets: int) -> dict[str, float]:
    server = grpc.aio.server(options=OPTIONS)
    rpc.add_KVStoreServicer_to_server(AioServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        return await asyncio.to_thread(_run_client, port, lookups, gets)
    finally:
        await server.stop(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lookups", type=int, default=300)
    parser.add_argument("--gets", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    threads = measure_threads(args.lookups, args.gets)
    aio = asyncio.run(_measure_aio(args.lookups, args.gets))
    for figure, unit, lower_is_better in (
        ("lookup_p50_ms", "ms", True), ("lookup_p99_ms", "ms", True), ("get_gbps", "GB/s", False),
    ):
        ours, base = aio[figure], threads[figure]
        ratio = base / ours if lower_is_better else ours / base
        print(f"bench server_model_{figure}: aio {aio[figure]:.3f} {unit} vs threads "
              f"{threads[figure]:.3f} {unit} = {ratio:.2f}x")
    if args.json:
        print(json.dumps({"aio": aio, "threads": threads}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
