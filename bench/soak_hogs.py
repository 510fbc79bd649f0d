"""The hogs of bench/soak.py's phase 3: each Attack puts one kind of hostile load on the
daemon (idle Put streams, unread Gets, a lease storm, Reserve until full, a pin storm; with
auth on also slow handshakes on the Unix socket, idle local sessions and 5-byte headers of
max-size frames), counts what the daemon answers it, and lets go; Scale sizes them all. The
hogs call as tenant B with auth on (the idle local sessions as A, the victim's own tenant)."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import grpc
from soak_load import (
    OWN_CONNECTION,
    TIMEOUT_S,
    code_of,
    codes_text,
    details_of,
    key_of,
    shared_blocks,
)
from soak_local import (
    TRICKLE_S,
    A,
    B,
    LocalSession,
    Tenancy,
    hold_sessions,
    open_channel,
    still_open,
)

from kvstore.client import KVStoreClient, KVStoreError
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.proto.localframe import LOOKUP, REQUEST
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

    def __init__(self, target: str, scale: Scale, tenancy: Tenancy) -> None:
        self.target, self.scale, self.tenancy = target, scale, tenancy
        self.ns, self.token = tenancy.hog_ns, tenancy.token(B)
        self.what = self.describe.format(**asdict(scale))
        self.codes: Counter[str] = Counter()
        self.details: dict[str, str] = {}  # code -> the first refusal's message
        self.channels: list[grpc.Channel] = []

    def count(self, code: str, exc: BaseException | None = None) -> None:
        self.codes[code] += 1
        if exc is not None:
            self.details.setdefault(code, details_of(exc))

    def connect(self, n: int) -> list[grpc.Channel]:
        new = [open_channel(self.target, self.token, OWN_CONNECTION) for _ in range(n)]
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
            header = pb.PutRequest(namespace=self.ns, keys=[key_of("idle", i)], sizes=[1000],
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
        with KVStoreClient(self.target, self.ns, token=self.token) as hog:
            hog.put([self.key], [bytes(UNREAD_BLOCK)])

    def start(self) -> None:
        self.calls: list[Any] = []
        lock = threading.Lock()

        def open_one(channel: grpc.Channel) -> None:
            call = rpc.KVStoreStub(channel).Get(pb.GetRequest(namespace=self.ns,
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
    describe = ("{leases} shared-memory Gets of small blocks with lease_timeout_ms=600000, "
                "never released (4 threads)")

    def prepare(self, kv: KVStoreClient) -> None:
        if self.tenancy.on:  # its own tenant's: the seed is A's
            self.read_ns = self.tenancy.shared_ns(B)
            self.keys = [k for k, _ in shared_blocks()[:8]]
        else:  # the 1-byte seed blocks
            self.read_ns = self.tenancy.seed_ns
            self.keys = [key_of(self.read_ns, i) for i in range(0, 64, 8)]
        self.ids: list[str] = []

    def start(self) -> None:
        (channel,) = self.connect(1)
        stub, lock = rpc.KVStoreStub(channel), threading.Lock()

        def storm(n: int) -> None:
            for i in range(n):
                request = pb.GetRequest(namespace=self.read_ns,
                                        keys=[self.keys[i % len(self.keys)]],
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
        return release_all(self.target, self.tenancy, self.ids)


def release_all(target: str, tenancy: Tenancy, ids: list[str]) -> str:
    released: Counter[str] = Counter()
    with KVStoreClient(target, tenancy.hog_ns, token=tenancy.token(B)) as kv:
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
            request = pb.ReserveRequest(namespace=self.ns, keys=[key_of("reserve", i)],
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
        return release_all(self.target, self.tenancy, self.ids)


class PinStorm(Attack):
    name, let_go_words = "pin_storm", "the hog unpinned"
    describe = ("Pin, over and over, of {pin_blocks} blocks of " + format_size(HOG_BLOCK)
                + " (one at a time and all at once) for the whole hold")

    def prepare(self, kv: KVStoreClient) -> None:
        self.keys = [key_of("pin", i) for i in range(self.scale.pin_blocks)]
        with KVStoreClient(self.target, self.ns, token=self.token) as hog:
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
                    self.stub.Pin(pb.PinRequest(namespace=self.ns, keys=keys), timeout=TIMEOUT_S)
                    self.count("OK")
                except grpc.RpcError as exc:
                    self.count(code_of(exc), exc)

    def let_go(self) -> None:
        self.stop.set()
        self.thread.join()
        try:
            self.stub.Unpin(pb.PinRequest(namespace=self.ns, keys=self.keys), timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            self.count(f"Unpin {code_of(exc)}", exc)
        self.disconnect()


# --- the local path's hogs (auth on: the daemon has a Unix socket) ----------------------------


SLOW_CONNECTIONS = 16  # twice the exchanges the attach socket used to serve at once
IDLE_SESSIONS = 40  # past the 32 local sessions one client (a tenant) may hold
WAVE_SESSIONS = 31  # the wave: one short of a client's 32 sessions


class LocalHog(Attack):
    """A hog on the daemon's Unix socket, run on a thread of its own until let go."""

    def tickets_of(self, tenant: str) -> Callable[[], str]:
        """Fresh Attach tickets of a tenant, one per call."""
        (channel,) = self.connect_as(tenant)
        stub = rpc.KVStoreStub(channel)
        return lambda: str(stub.Attach(pb.AttachRequest(), timeout=TIMEOUT_S).ticket)

    def connect_as(self, tenant: str) -> list[grpc.Channel]:
        channel = open_channel(self.target, self.tenancy.token(tenant), OWN_CONNECTION)
        self.channels.append(channel)
        return [channel]

    def start(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        time.sleep(0.5)  # in place

    def run(self) -> None:
        raise NotImplementedError

    def let_go(self) -> None:
        self.stop.set()
        self.thread.join(30)
        self.disconnect()


class SlowHandshakes(LocalHog):
    name, let_go_words = "slow_handshakes", "the hog hung up"
    describe = (f"{SLOW_CONNECTIONS} connections to the Unix socket (no credential needed) "
                f"that send a ticket or `HOT` line a byte every {TRICKLE_S} s and never its "
                "end; each one the daemon closes is reopened")

    def run(self) -> None:
        rng = random.Random(7)
        slow: list[tuple[socket.socket, bytes, float]] = []

        def open_one() -> None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.tenancy.unix_socket)
            except OSError as exc:
                self.count(f"connect {type(exc).__name__}")
                sock.close()
                return
            sock.setblocking(False)
            line = (("HOT " if rng.random() < 0.5 else "") + rng.randbytes(90).hex())[:200]
            slow.append((sock, line.encode(), time.monotonic()))

        for _ in range(SLOW_CONNECTIONS):
            open_one()
        sent = 0
        while not self.stop.wait(TRICKLE_S):
            for entry in list(slow):
                sock, line, opened = entry
                try:
                    sock.send(line[sent % len(line) : sent % len(line) + 1])
                except OSError as exc:
                    self.count("a trickled byte refused", exc)
                if not still_open(sock):
                    self.count("answered or closed by the daemon within "
                               + _bucket(time.monotonic() - opened))
                    sock.close()
                    slow.remove(entry)
                    open_one()
            sent += 1
        for sock, _, _ in slow:
            self.count("held open until the hog hung up")
            sock.close()


def _bucket(seconds: float) -> str:
    return next(f"{b} s" for b in (1, 2, 3, 5, 10, 30, 60, 1e9) if seconds <= b)


class IdleSessions(LocalHog):
    name, let_go_words = "idle_sessions", "the hog closed them"
    describe = (f"{IDLE_SESSIONS} local sessions opened by another process of the victim's "
                "own tenant (A), held idle")

    def run(self) -> None:
        held, codes = hold_sessions(self.tenancy.unix_socket, self.tickets_of(A),
                                    IDLE_SESSIONS)
        for code, n in codes.items():
            self.codes[code] += n
        self.stop.wait()
        for session in held:
            if not still_open(session.sock):
                self.count("closed by the daemon while idle")
            session.close()


class BigHeaders(LocalHog):
    name, let_go_words = "big_headers", "the hog closed the last wave"
    describe = (f"waves of {WAVE_SESSIONS} local sessions that each send the 5-byte header "
                "of a max-size frame and nothing more, held 0.3 s, then closed")

    def run(self) -> None:
        tickets = self.tickets_of(B)
        while not self.stop.is_set():
            wave, codes = hold_sessions(self.tenancy.unix_socket, tickets, WAVE_SESSIONS)
            for code, n in codes.items():
                if code != "session opened":
                    self.codes[code] += n
            self.count("waves")
            for session in wave:
                self._header(session)
            self.stop.wait(0.3)
            for session in wave:
                session.close()

    def _header(self, session: LocalSession) -> None:
        try:
            session.sock.sendall(REQUEST.pack(session.limit, LOOKUP))
            self.count("5-byte headers sent")
        except OSError as exc:
            self.count(f"header not sent: {type(exc).__name__}")


LOCAL_HOGS: tuple[type[Attack], ...] = (SlowHandshakes, IdleSessions, BigHeaders)


@dataclass(frozen=True)
class Scale:
    quiet_s: float
    hold_s: float
    leases: int
    reserves: int
    pin_blocks: int
    stream_idle_s: float  # the daemon's server.stream_idle_s; 0 when it has none
