"""The health check has threads of its own (kvstore.daemon.server.health_handlers): with every
worker of a real gRPC server busy and more calls queued behind them, Check still answers at
once, where the stock grpc-health registration waits in the queue and times out."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore.daemon.server import health_handlers

SERVING = health_pb2.HealthCheckResponse.SERVING


def serve(register: Callable[[grpc.Server, health.HealthServicer], None],
          release: threading.Event, busy: threading.Event) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(1))  # one worker, soon busy

    def block(request: bytes, context: grpc.ServicerContext) -> bytes:
        busy.set()
        release.wait(10)
        return b""

    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.Slow", {"Block": grpc.unary_unary_rpc_method_handler(block)}),))
    servicer = health.HealthServicer()
    servicer.set("", SERVING)
    register(server, servicer)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def check_with_workers_busy(register: Callable[[grpc.Server, health.HealthServicer], None]
                            ) -> int:
    release, busy = threading.Event(), threading.Event()
    server, port = serve(register, release, busy)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            calls = [ch.unary_unary("/t.Slow/Block").future(b"", timeout=10) for _ in range(3)]
            try:
                # The worker is taken before Check is sent (on a loaded machine the Check
                # could otherwise reach the one worker first, and the stock one would pass).
                assert busy.wait(5), "the slow call never started"
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                             timeout=1)
                return int(reply.status)
            finally:
                release.set()
                for call in calls:
                    call.result()
    finally:
        server.stop(None)


@pytest.fixture
def pool() -> Iterator[futures.ThreadPoolExecutor]:
    with futures.ThreadPoolExecutor(2) as p:
        yield p


def test_check_answers_while_every_worker_is_busy(pool: futures.ThreadPoolExecutor) -> None:
    assert check_with_workers_busy(
        lambda server, s: server.add_generic_rpc_handlers((health_handlers(s, pool),))
    ) == SERVING


def test_the_stock_registration_waits_behind_the_workers() -> None:
    with pytest.raises(grpc.RpcError) as info:
        check_with_workers_busy(
            lambda server, s: health_pb2_grpc.add_HealthServicer_to_server(s, server))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
