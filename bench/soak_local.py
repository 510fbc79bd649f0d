"""The local path and the Attach exchange written by hand, for bench/soak.py's auth-on mode:
who calls as whom (Tenancy: the tenants, their tokens and namespaces, and a gRPC channel that
presents a token), a raw local-path session (LocalSession), and the hostile requests sent on
the daemon's Unix socket (LocalHostile: garbage and mutated frames, frames that grow, ticket
lines that are forged, repeated, too long, slow or carry descriptors).

With auth off the run has one tenant (everyone) and the namespaces it always had; with
auth.mode=token, tenant A owns the seed, half the soak clients and the victim, tenant B the
other half, the hostile process and the hogs, and an admin reads the daemon's whole state.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml

from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.proto.localframe import GET, LOOKUP, RELEASE, REPLY, REQUEST, RESERVE, hello
from kvstore.tools.testing import code_name, mutate, read_line

A, B, ADMIN = "soak-a", "soak-b", "soak-admin"
TOKENS = {A: "soak-token-of-a-0123456789", B: "soak-token-of-b-0123456789",
          ADMIN: "soak-token-of-admin-0123456789"}
#: gRPC status names by number, for the local path's replies.
LOCAL_TIMEOUT_S = 5.0  # of every read on the socket; a hung exchange fails instead of hanging



# --- who calls as whom -----------------------------------------------------------------------


@dataclass(frozen=True)
class Tenancy:
    """The run's tenants and namespaces in one auth mode ("off" or "token"); plain data, so it
    crosses into spawned processes. unix_socket is the daemon's (token mode only)."""

    auth: str = "off"
    unix_socket: str = ""

    @property
    def on(self) -> bool:
        return self.auth != "off"

    def _ns(self, tenant: str, name: str) -> str:
        return f"{tenant}/{name}" if self.on else f"soak-{name}"

    def token(self, tenant: str) -> str | None:
        """The token a caller of `tenant` presents; None with auth off."""
        return TOKENS[tenant] if self.on else None

    def client_tenant(self, index: int) -> str:
        """Soak clients alternate between the two tenants (with auth on)."""
        return A if index % 2 == 0 else B

    @property
    def seed_ns(self) -> str:
        return self._ns(A, "seed")

    def shared_ns(self, tenant: str) -> str:
        """The shared blocks every soak client of a tenant re-puts and reads (one namespace
        for everyone with auth off)."""
        return self._ns(tenant, "shared")

    def shared_namespaces(self) -> dict[str, str]:
        """tenant -> its shared namespace, one entry per distinct namespace."""
        return {A: self.shared_ns(A), B: self.shared_ns(B)} if self.on else {A: self.shared_ns(A)}

    def client_ns(self, index: int) -> str:
        return self._ns(self.client_tenant(index), f"client-{index}")

    @property
    def hog_ns(self) -> str:
        return self._ns(B, "hog")

    @property
    def junk_ns(self) -> str:
        return self._ns(B, "junk")

    def owner(self, namespace: str) -> str:
        """The tenant that owns a namespace of this run."""
        return B if self.on and namespace.startswith(B + "/") else A

    def settings(self, workdir: Path) -> list[str]:
        """The daemon's settings for this mode: auth, the tenants file, the Unix socket."""
        if not self.on:
            return []
        tenants = workdir / "tenants.yaml"
        tenants.write_text(yaml.safe_dump(tenants_doc()))
        return ["auth.mode=token", f"auth.tenants_file={tenants}",
                f"server.unix_socket={self.unix_socket}"]


def tenants_doc() -> dict[str, Any]:
    def sha(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    return {"tenants": [
        {"name": A, "tokens_sha256": [sha(TOKENS[A])], "namespaces": [A + "/"]},
        {"name": B, "tokens_sha256": [sha(TOKENS[B])], "namespaces": [B + "/"]},
        {"name": ADMIN, "tokens_sha256": [sha(TOKENS[ADMIN])], "role": "admin"},
    ]}


class _Details(collections.namedtuple(
        "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                     "compression")), grpc.ClientCallDetails):
    """A call's details with the bearer token added (gRPC's interceptors take this shape)."""


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call of a raw channel, as the client
    library does, so the hostile process and the hogs call as their tenant."""

    def __init__(self, token: str) -> None:
        self.metadata = (("authorization", f"Bearer {token}"),)

    def _with(self, details: grpc.ClientCallDetails) -> _Details:
        return _Details(details.method, details.timeout,
                        [*(details.metadata or ()), *self.metadata], details.credentials,
                        details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with(details), requests)


def open_channel(target: str, token: str | None,
                 options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
    """An insecure channel to target that presents token (none with auth off)."""
    channel = grpc.insecure_channel(target, options=options or [])
    return grpc.intercept_channel(channel, _Bearer(token)) if token else channel


# --- the local path by hand -------------------------------------------------------------------



class LocalSession:
    """One hand-written session on the daemon's Unix socket: `HOT <ticket>`, the hello line
    (`hello` {} when the daemon closed instead), then frames."""

    def __init__(self, path: str, ticket: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(LOCAL_TIMEOUT_S)
        self.hello: dict[str, Any] = {}
        try:
            self.sock.connect(path)
            self.sock.sendall(hello(ticket))
            line = read_line(self.sock)
            self.hello = json.loads(line) if line else {}
        except (OSError, ValueError):
            self.hello = {}

    @property
    def ok(self) -> bool:
        return isinstance(self.hello.get("hot"), dict)

    @property
    def refusal(self) -> str:
        return str(self.hello.get("reason") or ("closed" if not self.hello else "error"))

    @property
    def limit(self) -> int:
        return int(self.hello["hot"]["max_frame_bytes"])

    def send(self, verb: int, body: bytes) -> None:
        self.sock.sendall(REQUEST.pack(len(body), verb) + body)

    def reply(self) -> tuple[int, bytes] | None:
        """The next reply's (status, body); None when the daemon closed the session."""
        try:
            head = self._exactly(REPLY.size)
            if head is None:
                return None
            length, status, _ = REPLY.unpack(head)
            body = self._exactly(length)
        except OSError:
            return None
        return None if body is None else (status, body)

    def call(self, verb: int, body: bytes) -> tuple[int, bytes] | None:
        try:
            self.send(verb, body)
        except OSError:
            return None
        return self.reply()

    def _exactly(self, n: int) -> bytes | None:
        data = bytearray()
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                return None
            data += chunk
        return bytes(data)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()



class LocalHostile:
    """The hostile process's requests on the daemon's Unix socket, as tenant B (its tickets
    from Attach on `stub`). Each case returns the code it is tallied under."""

    def __init__(self, path: str, stub: rpc.KVStoreStub, namespace: str,
                 rng: random.Random) -> None:
        self.path, self.stub, self.rng = path, stub, rng
        keys = [rng.randbytes(32) for _ in range(3)]
        self.templates = {verb: m.SerializeToString() for verb, m in {
            LOOKUP: pb.LookupRequest(namespace=namespace, keys=keys),
            GET: pb.GetRequest(namespace=namespace, keys=keys[:2],
                               mode=pb.GET_MODE_SHARED_MEMORY, lease_timeout_ms=1000),
            RESERVE: pb.ReserveRequest(namespace=namespace, keys=keys[:1], sizes=[100],
                                       timeout_ms=1000, independent=True),
            RELEASE: pb.ReleaseRequest(ids=["bogus"]),
        }.items()}
        self.cases: dict[str, Callable[[], str]] = {
            "local frames (garbage, mutated, growing)": self.frames,
            "local frame, mutated header": self.mutated_header,
            "ticket line (forged)": lambda: self.line(b"forged-ticket-0123456789\n"),
            "HOT line (forged ticket)": lambda: self.line(b"HOT forged-ticket\n"),
            "ticket line (257+ bytes)": lambda: self.line(b"x" * 300 + b"\n"),
            "ticket line (random bytes, no newline)": self.random_line,
            "ticket line (slow, cut short)": self.slow_line,
            "ticket line with descriptors": self.line_with_fds,
            "ticket used twice": self.ticket_twice,
        }
        self.weights = (40, 10, 8, 8, 6, 8, 4, 8, 8)

    def step(self) -> tuple[str, Callable[[], str]]:
        name = self.rng.choices(list(self.cases), self.weights)[0]
        return name, self.cases[name]

    def ticket(self) -> str:
        return str(self.stub.Attach(pb.AttachRequest(), timeout=LOCAL_TIMEOUT_S).ticket)

    def session(self) -> LocalSession:
        session = LocalSession(self.path, self.ticket())
        if not session.ok:
            session.close()
            raise ConnectionRefusedError(f"session refused: {session.refusal}")
        return session

    def frames(self) -> str:
        """1-20 frames on one session: mutated valid ones, random bytes, now and then one
        bigger than all before it (64 KiB to 1 MiB); what the last one got."""
        session = self.session()
        code = "OK"
        try:
            for _ in range(self.rng.randint(1, 20)):
                verb = self.rng.choice(list(self.templates))
                shape = self.rng.random()
                body = (mutate(self.templates[verb], self.rng) if shape < 0.6
                        else self.rng.randbytes(self.rng.randint(64 << 10, 1 << 20))
                        if shape < 0.7 else self.rng.randbytes(self.rng.randint(0, 300)))
                answer = session.call(verb, body)
                if answer is None:
                    return "session closed by the daemon"
                code = code_name(answer[0])
                if answer[0] == 0:
                    self._release(session, verb, answer[1])
        finally:
            session.close()
        return code

    def _release(self, session: LocalSession, verb: int, body: bytes) -> None:
        """Give back what an OK reply granted (the run checks nothing is left held)."""
        held = (pb.ReserveResponse.FromString(body).reservation_id if verb == RESERVE
                else pb.GetResponse.FromString(body).lease_id if verb == GET else "")
        if held:
            session.call(RELEASE, pb.ReleaseRequest(ids=[held]).SerializeToString())

    def mutated_header(self) -> str:
        """A valid frame, then one mutated whole (its header too), then the end of the
        stream: the daemon answers what it can read and ends the session."""
        session = self.session()
        lookup = self.templates[LOOKUP]
        raw = mutate(REQUEST.pack(len(lookup), LOOKUP) + lookup, self.rng)
        try:
            session.sock.sendall(REQUEST.pack(len(lookup), LOOKUP) + lookup + raw)
            session.sock.shutdown(socket.SHUT_WR)
            codes = []
            while (answer := session.reply()) is not None:
                codes.append(code_name(answer[0]))
        finally:
            session.close()
        return codes[-1] if len(codes) > 1 else "ended after the valid frame"

    def _exchange(self, send: Callable[[socket.socket], None]) -> str:
        """Connect, send, read the answer line: "answered" (a JSON line), or "closed"."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(LOCAL_TIMEOUT_S)
            sock.connect(self.path)
            send(sock)
            data, fds, _, _ = socket.recv_fds(sock, 65536, 16)
            for fd in fds:
                os.close(fd)
        if not data:
            return "closed"
        reply = json.loads(data.partition(b"\n")[0])
        return "refused: " + str(reply.get("reason", "?")) if "error" in reply else "answered"

    def line(self, data: bytes) -> str:
        return self._exchange(lambda sock: sock.sendall(data))

    def random_line(self) -> str:
        def send(sock: socket.socket) -> None:
            sock.sendall(self.rng.randbytes(self.rng.randint(1, 200)).replace(b"\n", b""))
            sock.shutdown(socket.SHUT_WR)

        return self._exchange(send)

    def slow_line(self) -> str:
        """A ticket line a byte every 0.1 s, given up after 3 bytes (a slowloris that a
        soak can afford: the long one is an attack of its own)."""
        def send(sock: socket.socket) -> None:
            for b in b"abc":
                sock.send(bytes([b]))
                time.sleep(0.1)
            sock.shutdown(socket.SHUT_WR)

        return self._exchange(send)

    def line_with_fds(self) -> str:
        """A real ticket (traded for the arenas) or a forged one, with descriptors passed
        alongside: the daemon must not keep them."""
        line = (self.ticket() if self.rng.random() < 0.5 else "forged").encode() + b"\n"
        r, w = os.pipe()
        try:
            return self._exchange(lambda sock: socket.send_fds(sock, [line], [r, w]))
        finally:
            os.close(r)
            os.close(w)

    def ticket_twice(self) -> str:
        """A ticket for a session, then the same one for the arenas: the second must be
        refused."""
        ticket = self.ticket()
        first = LocalSession(self.path, ticket)
        first.close()
        if not first.ok:
            return f"first use refused: {first.refusal}"
        second = self.line(ticket.encode() + b"\n")
        return "second use " + ("refused" if second.startswith("refused") else "ACCEPTED")


# --- the local hogs' building blocks -------------------------------------------------------------


def hold_sessions(path: str, tickets: Callable[[], str], count: int
                  ) -> tuple[list[LocalSession], collections.Counter[str]]:
    """Open up to `count` sessions; those the daemon gave, and why the others were not. A
    ticket a cap refused stays good and is tried again: a fresh one per try would use up the
    tenant's 64 unused tickets and shut it out of Attach for 30 s."""
    held: list[LocalSession] = []
    codes: collections.Counter[str] = collections.Counter()
    spare = ""
    for _ in range(count):
        try:
            ticket, spare = spare or tickets(), ""
        except grpc.RpcError as exc:
            codes[f"Attach {exc.code().name}"] += 1
            continue
        session = LocalSession(path, ticket)
        if session.ok:
            held.append(session)
            codes["session opened"] += 1
        else:
            codes[f"refused: {session.refusal}"] += 1
            if session.refusal == "TOO_MANY_SESSIONS":
                spare = ticket
            session.close()
    return held, codes


def still_open(sock: socket.socket) -> bool:
    """Whether the daemon still holds its end and has said nothing (read without taking
    anything): a connection it answered (a refusal line, sent before it closes) or closed
    is over."""
    try:
        sock.setblocking(False)
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


#: One byte per connection each TRICKLE_S: slower than any deadline per recv() would catch,
#: if the daemon's deadlines were per recv and not per line or frame.
TRICKLE_S = 0.3
