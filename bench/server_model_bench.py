"""Which gRPC server model should the daemon use? Measures grpc.aio against a thread-pool
server on the same servicer shape (a 1,024-key Lookup; a Get that streams 32 x 2 MiB in
4 MiB messages). Each server runs in its own process and the client alternates between them
round by round, so the machine's drift hits both alike.

Prints `bench server_model_<figure>: aio <x> vs threads <y> = <ratio>x`. The results that chose
the thread pool for kvstore/daemon/server.py are in docs/operations.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
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
MODELS = ("threads", "aio")


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


def _serve(model: str, ports: Any) -> None:
    """Run one server model in this (spawned) process until it is terminated."""
    if model == "threads":
        server = grpc.server(futures.ThreadPoolExecutor(8), options=OPTIONS)
        rpc.add_KVStoreServicer_to_server(ThreadServicer(), server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        server.wait_for_termination()
        return

    async def serve_aio() -> None:
        server = grpc.aio.server(options=OPTIONS)
        rpc.add_KVStoreServicer_to_server(AioServicer(), server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve_aio())


def measure(rounds: int, lookups_per_round: int) -> dict[str, dict[str, float]]:
    """Both servers run at once, each in its own process; the client alternates between
    them round by round, so drift in the machine's speed hits both alike."""
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    procs = {m: ctx.Process(target=_serve, args=(m, ports), daemon=True) for m in MODELS}
    stubs: dict[str, Any] = {}
    channels = []
    try:
        for model, proc in procs.items():
            proc.start()
            channel = grpc.insecure_channel(f"127.0.0.1:{ports.get(timeout=30)}", options=OPTIONS)
            channels.append(channel)
            stubs[model] = rpc.KVStoreStub(channel)
        keys = [bytes(32)] * 1024
        lookup = pb.LookupRequest(namespace="bench", keys=keys)
        get = pb.GetRequest(namespace="bench", keys=keys[:BLOCKS])
        latencies: dict[str, list[float]] = {m: [] for m in MODELS}
        get_s: dict[str, list[float]] = {m: [] for m in MODELS}
        for stub in stubs.values():  # warm up
            stub.Lookup(lookup)
            sum(len(m.data) for m in stub.Get(get))
        for _ in range(rounds):
            for model, stub in stubs.items():
                for _ in range(lookups_per_round):
                    start = time.perf_counter()
                    stub.Lookup(lookup)
                    latencies[model].append(time.perf_counter() - start)
                start = time.perf_counter()
                received = sum(len(m.data) for m in stub.Get(get))
                get_s[model].append(time.perf_counter() - start)
        out = {}
        for model in MODELS:
            lat = sorted(latencies[model])
            out[model] = {
                "lookup_p50_ms": lat[len(lat) // 2] * 1e3,
                "lookup_p99_ms": lat[int(len(lat) * 0.99)] * 1e3,
                "get_gbps": received / statistics.median(get_s[model]) / 1e9,
            }
        return out
    finally:
        for channel in channels:
            channel.close()
        for proc in procs.values():
            proc.terminate()
            proc.join(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--lookups", type=int, default=50, help="lookups per server per round")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = measure(args.rounds, args.lookups)
    threads, aio = results["threads"], results["aio"]
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
