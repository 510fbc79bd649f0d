"""Helpers the test files share: waiting for a condition, making keys and blocks, a raw gRPC
Put, reading a daemon's Prometheus metrics, and a hand-framed local-path session.

Fixtures live in tests/conftest.py; what starts and stops processes lives in
kvstore/tools/testing.py. These are plain functions and one class, imported by name.
"""

from __future__ import annotations

import json
import secrets
import socket
import struct
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import Message
from prometheus_client.parser import text_string_to_metric_families

from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.tools.testing import Daemon

MiB = 1 << 20
#: The page size of the shared default daemon (tests/conftest.py's `daemon`).
PAGE = 64 << 10

#: A scrape of /metrics: each sample's value by its name and its labels (sorted pairs).
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


# --- waiting ----------------------------------------------------------------------------


def wait_until(check: Callable[[], bool], what: str = "the condition", timeout_s: float = 10.0,
               pause_s: float = 0.02) -> float:
    """Call check every pause_s seconds until it returns true, and return the monotonic time
    at which it first did. Fail the test, naming `what`, when it has not after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(pause_s)
    return time.monotonic()


# --- keys and blocks ----------------------------------------------------------------------


def keys(n: int, seed: int | None = None) -> list[bytes]:
    """n block keys of 32 bytes: fresh random ones, or with a seed the same ones every run
    (and never the bytes that `values` makes from the same seed)."""
    if seed is None:
        return [secrets.token_bytes(32) for _ in range(n)]
    rng = np.random.default_rng([seed, 0])
    return [rng.bytes(32) for _ in range(n)]


def values(sizes: Sequence[int], seed: int | None = None) -> list[bytes]:
    """One block of random bytes per size: fresh ones, or with a seed the same ones every
    run."""
    if seed is None:
        return [secrets.token_bytes(size) for size in sizes]
    rng = np.random.default_rng([seed, 1])
    return [rng.bytes(size) for size in sizes]


def blocks(n: int, size: int = PAGE, seed: int | None = None) -> tuple[list[bytes], list[bytes]]:
    """n keys and n blocks of `size` random bytes, made by `keys` and `values`."""
    return keys(n, seed), values([size] * n, seed)


def block_map(n: int, size: int = PAGE, seed: int | None = None) -> dict[bytes, bytes]:
    """n blocks of `size` random bytes by their keys, made by `blocks`."""
    return dict(zip(*blocks(n, size, seed), strict=True))


def sized_blocks(sizes: Sequence[int], seed: int | None = None
                 ) -> tuple[list[bytes], list[bytes]]:
    """A key and a block of random bytes for each size, made by `keys` and `values`."""
    return keys(len(sizes), seed), values(sizes, seed)


# --- raw gRPC -----------------------------------------------------------------------------


@contextmanager
def open_stub(target: str, max_message_bytes: int = 0) -> Iterator[rpc.KVStoreStub]:
    """A KVStore stub on a fresh insecure channel to target, closed on exit. max_message_bytes
    raises gRPC's send and receive limits (4 MiB by default) when a test moves bigger
    messages."""
    options = [] if max_message_bytes == 0 else [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes)]
    with grpc.insecure_channel(target, options=options) as channel:
        yield rpc.KVStoreStub(channel)


def put(stub: rpc.KVStoreStub, namespace: str, keys: Sequence[bytes],
        values: Sequence[bytes], *, chunk_bytes: int = 0,
        metadata: Sequence[tuple[str, str]] = (), timeout_s: float = 10.0,
        **fields: object) -> pb.PutResponse:
    """One Put stream written by hand: the header (namespace, keys, sizes and any other
    PutRequest `fields`, such as independent=True or parent_key) carries all the data when
    chunk_bytes is 0; otherwise the header goes alone and the data follows in messages of
    chunk_bytes bytes."""
    data = b"".join(values)
    header = pb.PutRequest(namespace=namespace, keys=list(keys),
                           sizes=[len(v) for v in values], **fields)  # type: ignore[arg-type]
    if chunk_bytes == 0:
        header.data = data
        messages = [header]
    else:
        messages = [header, *(pb.PutRequest(data=data[i : i + chunk_bytes])
                              for i in range(0, len(data), chunk_bytes))]
    response: pb.PutResponse = stub.Put(iter(messages), metadata=list(metadata),
                                        timeout=timeout_s)
    return response


def status_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    """The status code and details call() ends with (OK and "" when it succeeds); a streamed
    answer is read to its end first, since a stream's error comes while it is read."""
    try:
        answer = call()
        if isinstance(answer, Iterator):
            list(answer)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    """The status code call() ends with, as status_of reads it."""
    return status_of(call)[0]


# --- metrics ------------------------------------------------------------------------------


def scrape(daemon: Daemon) -> Samples:
    """Every sample the daemon's Prometheus endpoint exposes now."""
    url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(source: Daemon | Samples, name: str, **labels: str) -> float:
    """One sample's value, by its name and exactly these labels, from a daemon (scraped now)
    or from an earlier scrape; 0.0 when no such sample is exposed (a counter that has not
    counted yet has none)."""
    samples = scrape(source) if isinstance(source, Daemon) else source
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


# --- the local path by hand ---------------------------------------------------------------


class RawSession:
    """A local-path session written by hand, as a client in another language would write one:
    the line `HOT <ticket>` on the daemon's Unix socket, the daemon's JSON hello line back,
    then frames (a little-endian u32 body length and a u8 verb, then the body; a reply has a
    u32 length, a u8 status and a u8 flags byte). `hello` is {} when the daemon closed the
    socket instead of answering."""

    def __init__(self, path: str | Path, ticket: str = "-", timeout_s: float = 10.0) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(timeout_s)
        self.s.connect(str(path))
        self.s.sendall(f"HOT {ticket}\n".encode())
        line = b""
        while not line.endswith(b"\n"):
            chunk = self.s.recv(1)
            if not chunk:
                break
            line += chunk
        self.hello: dict[str, Any] = json.loads(line) if line else {}

    def send(self, verb: int, body: bytes) -> None:
        """Send one frame, without waiting for its reply."""
        self.s.sendall(struct.pack("<IB", len(body), verb) + body)

    def reply(self) -> tuple[int, int, bytes]:
        """The next reply: (status, flags, body)."""
        length, status, flags = struct.unpack("<IBB", self._exactly(6))
        return status, flags, self._exactly(length)

    def call(self, verb: int, message: Message) -> tuple[int, int, bytes]:
        """Send a message as one frame and read its reply: (status, flags, body)."""
        self.send(verb, message.SerializeToString())
        return self.reply()

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.s.recv(n - len(data))
            if not chunk:
                raise ConnectionError("the daemon closed the session")
            data += chunk
        return data

    def close(self) -> None:
        self.s.close()

    def __enter__(self) -> RawSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
