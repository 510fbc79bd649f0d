"""The floor under kvstore's inline Get: a bare grpc-python server-streaming call.

A server subprocess (this file, run with --serve) answers one request by streaming pre-built,
distinct `bytes` messages of kvstore's chunk size (`server.chunk_bytes`, 4 MiB by default) from a
thread-pool `grpc.server`, with the message-size options the daemon and the client use; the
client side is a sync channel configured as kvstore's client configures its own, and one
call's work is iterating the call and taking each message's bytes. Serializers are identity
functions on both sides, so protobuf costs nothing: what is left is what grpc-python itself
costs to move the bytes, and kvstore's inline Get can be judged against it.

    with GrpcFloor() as floor:
        floor.fetch(32 * MiB)   # one call: 8 messages of 4 MiB

The request is the byte count as ASCII digits; the reply is ceil(total / chunk) messages,
the last one short, built (os.urandom) by the first request of that size: call prepare(total)
or fetch once before timing.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from types import TracebackType
from typing import Any

import grpc

from kvstore.tools.testing import free_port, stop_process
from kvstore.units import MiB

METHOD = "/kvstore.bench.Floor/Stream"
SERVICE = "kvstore.bench.Floor"
DEFAULT_CHUNK_BYTES = 4 * MiB  # kvstore's server.chunk_bytes
SERVER_MAX_MESSAGE_BYTES = 8 * MiB  # kvstore's server.max_message_bytes
CLIENT_MAX_MESSAGE_BYTES = 16 * MiB  # kvstore.client's max_message_bytes
SERVER_WORKERS = 8  # kvstore's server.workers
Options = Sequence[tuple[str, Any]]


def _identity(raw: bytes) -> bytes:
    return raw


def server_options(max_message_bytes: int = SERVER_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """The options the daemon's grpc.server is built with (message sizes, no port reuse)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


def client_options(max_message_bytes: int = CLIENT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """The options kvstore's sync client opens its channel with."""
    from kvstore.client._wire import channel_options

    return list(channel_options(max_message_bytes, sync=True))


# --- the server (a subprocess) ----------------------------------------------------------------


def _keep_freed_buffers() -> None:
    """The allocator policy the daemon and a KVStoreClient set up (kvstore.memory), so that
    grpc's buffers cost the floor what they cost kvstore."""
    try:
        from kvstore.memory import keep_freed_buffers
    except ImportError:  # a tree without it: the daemon does not tune its allocator either
        return
    keep_freed_buffers()


def _serve(port: int, chunk_bytes: int, options: Options) -> None:
    _keep_freed_buffers()
    # The messages of each distinct request size, built once (the first call of a size is its
    # warm-up) and distinct from one another: kvstore streams total_bytes of different pages,
    # so the floor must not send one cache-hot buffer over and over either.
    built: dict[int, list[bytes]] = {}

    def messages(total: int) -> list[bytes]:
        if total not in built:
            sizes = [chunk_bytes] * (total // chunk_bytes)
            if total % chunk_bytes:
                sizes.append(total % chunk_bytes)
            built[total] = [os.urandom(size) for size in sizes]
        return built[total]

    def stream(request: bytes, context: grpc.ServicerContext) -> Any:
        yield from messages(int(request))

    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "Stream": grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=_identity, response_serializer=_identity),
    })
    server = grpc.server(futures.ThreadPoolExecutor(SERVER_WORKERS), options=list(options))
    server.add_generic_rpc_handlers((handler,))
    if server.add_insecure_port(f"127.0.0.1:{port}") != port:
        return  # not bound: no "ready", and the parent tries another port
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("ready", flush=True)
    stop.wait()
    server.stop(0)


# --- the client -------------------------------------------------------------------------------


class GrpcFloor:
    """A bare grpc-python streaming server in a subprocess and a channel to it.

    extra_server_options / extra_client_options are appended to the kvstore-like ones (to try
    a transport setting on the floor itself)."""

    def __init__(
        self,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        *,
        server_max_message_bytes: int = SERVER_MAX_MESSAGE_BYTES,
        client_max_message_bytes: int = CLIENT_MAX_MESSAGE_BYTES,
        extra_server_options: Options = (),
        extra_client_options: Options = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self._server_options = [*server_options(server_max_message_bytes),
                                *extra_server_options]
        self._client_options = [*client_options(client_max_message_bytes),
                                *extra_client_options]
        self._env = env
        self._proc: subprocess.Popen[bytes] | None = None
        self._channel: grpc.Channel | None = None
        self._call: Any = None

    def start(self) -> GrpcFloor:
        _keep_freed_buffers()  # as a KVStoreClient does in its process
        for attempt in range(3):  # a free port can be taken before the server binds it
            port = free_port()
            args = [sys.executable, os.path.abspath(__file__), "--serve", "--port", str(port),
                    "--chunk-bytes", str(self.chunk_bytes),
                    *[f"--option={k}={v}" for k, v in self._server_options]]
            env = {**os.environ, **(self._env or {})}
            self._proc = subprocess.Popen(args, stdout=subprocess.PIPE, env=env)
            assert self._proc.stdout is not None
            if self._proc.stdout.readline().strip() == b"ready":
                break
            self.stop()
            if attempt == 2:
                raise RuntimeError("the grpc floor server did not start")
        self._channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=self._client_options)
        grpc.channel_ready_future(self._channel).result(timeout=10)
        self._call = self._channel.unary_stream(
            METHOD, request_serializer=_identity, response_deserializer=_identity)
        self.fetch(1)  # the connection up and the method resolved before anything is timed
        return self

    def prepare(self, total_bytes: int) -> None:
        """Have the server build the messages of total_bytes (an untimed first fetch)."""
        self.fetch(total_bytes)

    def fetch(self, total_bytes: int) -> None:
        """One call streaming total_bytes in chunk_bytes messages, every message taken."""
        received = 0
        for message in self._call(str(total_bytes).encode()):
            received += len(message)
        if received != total_bytes:
            raise RuntimeError(f"the floor streamed {received} of {total_bytes} bytes")

    def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._proc is not None:
            stop_process(self._proc)
            self._proc = None

    def __enter__(self) -> GrpcFloor:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _option(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    try:
        return key, int(value)
    except ValueError:
        return key, value


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", action="store_true", help="run the server (internal)")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    parser.add_argument("--option", action="append", default=[], type=_option)
    parser.add_argument("--total-bytes", type=int, default=32 * MiB)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if args.serve:
        _serve(args.port, args.chunk_bytes, args.option)
        return
    with GrpcFloor(args.chunk_bytes) as floor:
        floor.prepare(args.total_bytes)
        times = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            floor.fetch(args.total_bytes)
            times.append(time.perf_counter() - began)
    times.sort()
    median = times[len(times) // 2]
    print(f"grpc floor: {args.total_bytes / MiB:.0f} MiB in {median * 1e3:.2f} ms "
          f"(median of {args.repeats}), {args.total_bytes / median / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
