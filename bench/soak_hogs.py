"""The hogs of bench/soak.py's phase 3: each Attack puts one kind of hostile load on the
daemon (idle Put streams, unread Gets, a lease storm, Reserve until full, a pin storm),
counts what the daemon answers it, and lets go; Scale sizes them all."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import grpc
from soak_load import (
    HOG_NS,
    OWN_CONNECTION,
    SEED_NS,
    TIMEOUT_S,
    code_of,
    codes_text,
    details_of,
    key_of,
)

from kvstore.client import KVStoreClient, KVStoreError
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.units import MiB, format_size

UNREAD_BLOCK = 48 * MiB  # far more than gRPC buffers for a reader that does not read
HOG_BLOCK = 8 * MiB
HOG_STREAMS, HOG_CONNECTIONS = 64, 8


class Attack:
    """A hog: prepare() untimed before the quiet window, start() puts the hog in place,
    let_go() is what the hog does when it stops (cancel, disconnect, unpin), clean_up()
    what the run does when the daemon did not free the hog's resources by then."""

    name = ""
    let_go_words = ""
    describe = ""  # formatted with the Scale's fields

    def __init__(self, target: str, scale: Scale) -> None:
        self.target, self.scale = target, scale
        self.what = self.describe.format(**asdict(scale))
        self.codes: Counter[str] = Counter()
        self.details: dict[str, str] = {}  # code -> the first refusal's message
        self.channels: list[grpc.Channel] = []

    def count(self, code: str, exc: BaseException | None = None) -> None:
        self.codes[code] += 1
        if exc is not None:
            self.details.setdefault(code, details_of(exc))

    def connect(self, n: int) -> list[grpc.Channel]:
        new = [grpc.insecure_channel(self.target, options=OWN_CONNECTION) for _ in range(n)]
        self.channels += new
        return new

    def disconnect(self) -> None:
        for channel in self.channels:
            channel.close()
        self.channels = []

    def prepare(self, kv: KVStoreClient) -> None:
        """Untimed set-up (the blocks the hog uses)."""

    def start(self) -> None:
        raise NotImplementedError

    def hold_s(self) -> float:
        return self.scale.hold_s

    def let_go(self) -> None:
        self.disconnect()

    def clean_up(self) -> str:
        """'' when there is nothing the run can do."""
        return ""


class IdleStreams(Attack):
    """Streams that sit idle: held past server.stream_idle_s when the daemon has one (up to
    30 s), to see what it does with them."""

    def hold_s(self) -> float:
        idle_s = self.scale.stream_idle_s
        return max(self.scale.hold_s, idle_s + 2.0 if 0 < idle_s <= 30 else 0.0)


class IdlePuts(IdleStreams):
    name, let_go_words = "idle_puts", "the hog cancelled"
    describe = (f"{HOG_STREAMS} Put streams on {HOG_CONNECTIONS} connections that send a header "
            "(one key, sizes [1000], independent) and then nothing")

    def start(self) -> None:
        self.release = threading.Event()
        self.calls: list[grpc.Future] = []
        for i, channel in enumerate(self.connect(HOG_CONNECTIONS) * 8):
            header = pb.PutRequest(namespace=HOG_NS, keys=[key_of("idle", i)], sizes=[1000],
                                   independent=True)
            self.calls.append(rpc.KVStoreStub(channel).Put.future(
                self._idle(header), timeout=120))
        time.sleep(1.0)  # refusals come back at once

    def _idle(self, header: pb.PutRequest) -> Iterator[pb.PutRequest]:
        yield header
        self.release.wait(120)

    def let_go(self) -> None:
        for call in self.calls:
            if call.done():
                exc = call.exception()
                self.count(code_of(exc) if exc else "OK", exc)
            else:
                self.codes["held open until the hog cancelled"] += 1
                call.cancel()
        self.release.set()
        self.disconnect()


class UnreadGets(IdleStreams):
    name, let_go_words = "unread_gets", "the hog cancelled"
    describe = (f"{HOG_STREAMS} inline Gets of a {format_size(UNREAD_BLOCK)} block on "
            f"{HOG_CONNECTIONS} connections; the hog reads the header, then nothing")

    def prepare(self, kv: KVStoreClient) -> None:
        self.key = key_of("unread")
        with KVStoreClient(self.target, HOG_NS) as hog:
            hog.put([self.key], [bytes(UNREAD_BLOCK)])

    def start(self) -> None:
        self.calls: list[Any] = []
        lock = threading.Lock()

        def open_one(channel: grpc.Channel) -> None:
            call = rpc.KVStoreStub(channel).Get(pb.GetRequest(namespace=HOG_NS,
                                                              keys=[self.key]), timeout=120)
            try:
                next(call)
            except Exception as exc:  # refused: counted by code
                with lock:
                    self.count(code_of(exc), exc)
                return
            with lock:
                self.calls.append(call)

        threads = [threading.Thread(target=open_one, args=(ch,), daemon=True)
                   for ch in self.connect(HOG_CONNECTIONS) * 8]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)

    def let_go(self) -> None:
        for call in self.calls:
            if call.done():  # the daemon ended it (an idle-stream limit)
                self.count(call.code().name)
                self.details.setdefault(call.code().name, str(call.details()))
            else:
                self.codes["header read, then left unread (not ended on the hog's side)"] += 1
                call.cancel()
        self.disconnect()


class LeaseStorm(Attack):
    name, let_go_words = "lease_storm", "the hog disconnected"
    describe = ("{leases} shared-memory Gets of seed blocks with lease_timeout_ms=600000, "
                "never released (4 threads)")

    def prepare(self, kv: KVStoreClient) -> None:
        self.keys = [key_of(SEED_NS, i) for i in range(0, 64, 8)]  # the 1-byte seed blocks
        self.ids: list[str] = []

    def start(self) -> None:
        (channel,) = self.connect(1)
        stub, lock = rpc.KVStoreStub(channel), threading.Lock()

        def storm(n: int) -> None:
            for i in range(n):
                request = pb.GetRequest(namespace=SEED_NS, keys=[self.keys[i % len(self.keys)]],
                                        mode=pb.GET_MODE_SHARED_MEMORY, lease_timeout_ms=600_000)
                error: Exception | None = None
                try:
                    head = next(iter(stub.Get(request, timeout=TIMEOUT_S)))
                    code = "OK (lease kept)" if head.lease_id else "OK (no lease)"
                except Exception as exc:  # refused: counted by code
                    head, code, error = None, code_of(exc), exc
                with lock:
                    self.count(code, error)
                    if head is not None and head.lease_id:
                        self.ids.append(head.lease_id)

        threads = [threading.Thread(target=storm, args=(self.scale.leases // 4,))
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def clean_up(self) -> str:
        return release_all(self.target, self.ids)


def release_all(target: str, ids: list[str]) -> str:
    released: Counter[str] = Counter()
    with KVStoreClient(target, HOG_NS) as kv:
        for i in range(0, len(ids), 256):
            try:
                kv.release(ids[i : i + 256])
                released["OK"] += 1
            except KVStoreError as exc:  # some expired meanwhile: INVALID_ARGUMENT
                released[exc.code.name] += 1
    return f"an explicit Release of the {len(ids)} ids (Release calls: {codes_text(released)})"


class ReserveFull(Attack):
    name, let_go_words = "reserve_full", "the hog disconnected"
    describe = (f"Reserves of {format_size(HOG_BLOCK)} (timeout_ms=600000), one after another, "
            "until three in a row are refused")

    def start(self) -> None:
        (channel,) = self.connect(1)
        stub, refused = rpc.KVStoreStub(channel), 0
        self.ids: list[str] = []
        for i in range(self.scale.reserves):
            request = pb.ReserveRequest(namespace=HOG_NS, keys=[key_of("reserve", i)],
                                        sizes=[HOG_BLOCK], timeout_ms=600_000, independent=True)
            try:
                self.ids.append(stub.Reserve(request, timeout=TIMEOUT_S).reservation_id)
                self.count("OK")
                refused = 0
            except grpc.RpcError as exc:
                self.count(code_of(exc), exc)
                refused += 1
                if refused == 3:
                    break

    def clean_up(self) -> str:
        return release_all(self.target, self.ids)


class PinStorm(Attack):
    name, let_go_words = "pin_storm", "the hog unpinned"
    describe = ("Pin, over and over, of {pin_blocks} blocks of " + format_size(HOG_BLOCK)
                + " (one at a time and all at once) for the whole hold")

    def prepare(self, kv: KVStoreClient) -> None:
        self.keys = [key_of("pin", i) for i in range(self.scale.pin_blocks)]
        with KVStoreClient(self.target, HOG_NS) as hog:
            for key in self.keys:
                hog.put([key], [bytes(HOG_BLOCK)], independent=True)

    def start(self) -> None:
        (channel,) = self.connect(1)
        self.stub, self.stop = rpc.KVStoreStub(channel), threading.Event()
        self.thread = threading.Thread(target=self._storm, daemon=True)
        self.thread.start()
        time.sleep(0.5)

    def _storm(self) -> None:
        while not self.stop.is_set():
            for keys in [[k] for k in self.keys] + [self.keys]:
                try:
                    self.stub.Pin(pb.PinRequest(namespace=HOG_NS, keys=keys), timeout=TIMEOUT_S)
                    self.count("OK")
                except grpc.RpcError as exc:
                    self.count(code_of(exc), exc)

    def let_go(self) -> None:
        self.stop.set()
        self.thread.join()
        try:
            self.stub.Unpin(pb.PinRequest(namespace=HOG_NS, keys=self.keys), timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            self.count(f"Unpin {code_of(exc)}", exc)
        self.disconnect()


@dataclass(frozen=True)
class Scale:
    quiet_s: float
    hold_s: float
    leases: int
    reserves: int
    pin_blocks: int
    stream_idle_s: float  # the daemon's server.stream_idle_s; 0 when it has none
