"""The hostile process of tests/integration/test_local_attacks.py: attacks on the daemon's Unix
socket (the local path's sessions and the Attach exchange before them), each run in a process
of its own, as a hostile or broken program on the daemon's host would be. A separate process
matters: with auth off the daemon tells local clients apart by their process (SO_PEERCRED),
so an attacker in the test's own process would share its victims' caps.

The attacks (ATTACKS; each a function of the config and the Report it fills):

    garbage         frames of random bytes and mutated valid frames on sessions, and whole
                    frames (header and body) mutated on sessions of their own
    edges           frames of every length edge: 0, 1, 1000, limit-1 and limit on one
                    session (each bigger than the one before), limit+1 and 2**32-1 announced
                    on sessions of their own
    slow_handshake  connections that send their handshake line (a ticket or `HOT ...`) a byte
                    at a time and never end it; each one the daemon closes is reopened
    slow_frames     sessions that send a frame's header, or its body, a byte at a time
    flood           more sessions than the caps, held, plus sessions opened and closed in a
                    loop (auth off: from several processes, forked, as the caps are per
                    process)
    idle_hog        as many sessions as one client may hold, held idle
    big_headers     waves of sessions that each send the 5-byte header of a max-size frame
                    and nothing more, then close
    fds             descriptors (SCM_RIGHTS) sent with frames and with ticket and `HOT`
                    lines
    tickets         (auth on) one tenant's tickets against the other's data; each ticket
                    good once, also when raced

Run as `python -m tests.local_attack_tools '<config JSON>'`, the process prints `started` once
it is connected and attacking, `done` once its finite part is done (a continuous attack: after
its first round), and, after a line `stop` on its stdin (or stdin closing), lets go of
everything, prints `result <JSON>` and exits 0. `Attacker` is the test's side of that.

Only the standard library and the generated messages are imported at the top (no gRPC unless
a ticket is needed, so the flood may fork): the process starts in well under a second.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.tools.testing import code_name, mutate, read_line

REQUEST = struct.Struct("<IB")  # the local path's request header: length, verb
REPLY = struct.Struct("<IBB")  # and its reply's: length, status, flags
LOOKUP, GET, RESERVE, COMMIT, RELEASE = 1, 2, 3, 4, 5
#: gRPC status codes by number, so that the attacker needs no gRPC to name them.
FAULTS = ("INTERNAL", "UNKNOWN")
#: How long the attacker waits for any one answer: far more than a healthy daemon takes
#: on a loaded 2-core machine (milliseconds), far less than the test's own bounds.
REPLY_TIMEOUT_S = 5.0
#: The slow attacks' pace, one byte per connection each TRICKLE_S: slower than any deadline
#: per recv() the daemon has had (2 s on the attach socket, 10 s inside a frame) would
#: catch, if the pace were per recv and not per line or frame.
TRICKLE_S = 0.3



# --- the stop signal and the report --------------------------------------------------------


STOP = threading.Event()  # set when the test says `stop` (or closes our stdin)


def _watch_stdin() -> None:
    for line in sys.stdin:
        if line.strip() == "stop":
            break
    STOP.set()


def say(line: str) -> None:
    print(line, flush=True)


@dataclass
class Report:
    """What an attack saw, sent back as JSON: counts by what happened, and anything else an
    attack measures (lifetimes, outcomes per edge)."""

    counts: Counter[str] = field(default_factory=Counter)
    facts: dict[str, Any] = field(default_factory=dict)
    done_said: bool = False

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] += n

    def done(self) -> None:
        if not self.done_said:
            self.done_said = True
            say("done")

    def as_json(self) -> str:
        return json.dumps({"counts": dict(self.counts), "facts": self.facts})


# --- tickets and raw sessions ----------------------------------------------------------------


class NoTicket(Exception):
    """Attach refused us a ticket (its status name is the message)."""


class Tickets:
    """Handshake tickets: "-" with auth off (no token), else one from Attach, over gRPC with
    the tenant's token (imported only then: a forked flood has none). A ticket whose
    handshake a cap refused is tried again (`spare`): the daemon leaves it good, and a tenant
    holds at most 64 unused tickets, which an attacker that took a fresh one per try would
    use up, shutting its own tenant out of Attach for the tests that follow."""

    def __init__(self, target: str, token: str) -> None:
        self.token = token
        self.spare = ""
        self.channel: Any = None
        if token:
            import grpc

            from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc

            self._error = grpc.RpcError
            self.channel = grpc.insecure_channel(target)
            self.stub = rpc.KVStoreStub(self.channel)
            self.metadata = (("authorization", f"Bearer {token}"),)

    def __call__(self) -> str:
        if not self.token:
            return "-"
        if self.spare:
            ticket, self.spare = self.spare, ""
            return ticket
        try:
            reply = self.stub.Attach(pb.AttachRequest(), metadata=self.metadata,
                                     timeout=REPLY_TIMEOUT_S)
        except self._error as exc:
            raise NoTicket(exc.code().name) from None
        return str(reply.ticket)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()


def connect(path: str, timeout_s: float = REPLY_TIMEOUT_S) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    sock.connect(path)
    return sock



class Session:
    """A hand-written local-path session: the handshake line, the daemon's hello (`hello`
    is {} when it closed instead), then frames."""

    def __init__(self, path: str, ticket: str, fds: list[int] | None = None) -> None:
        self.sock = connect(path)
        line = f"HOT {ticket}\n".encode()
        try:
            if fds:
                socket.send_fds(self.sock, [line], fds)
            else:
                self.sock.sendall(line)
            text = read_line(self.sock)
            self.hello: dict[str, Any] = json.loads(text) if text else {}
        except (OSError, ValueError):
            self.hello = {}

    @property
    def ok(self) -> bool:
        return isinstance(self.hello.get("hot"), dict)

    @property
    def refusal(self) -> str:
        """Why the handshake was refused: the reply's reason, or "closed"."""
        return str(self.hello.get("reason") or ("closed" if not self.hello else "error"))

    @property
    def limit(self) -> int:
        return int(self.hello["hot"]["max_frame_bytes"])

    def send(self, verb: int, body: bytes, fds: list[int] | None = None) -> None:
        data = REQUEST.pack(len(body), verb) + body
        if fds:
            socket.send_fds(self.sock, [data], fds)
        else:
            self.sock.sendall(data)

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
        return (status, body) if body is not None else None

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


def open_session(cfg: dict[str, Any], tickets: Tickets, report: Report,
                 fds: list[int] | None = None) -> Session | None:
    """A session, or None (counted by why) when Attach or the handshake refused it."""
    try:
        ticket = tickets()
    except NoTicket as exc:
        report.count(f"Attach {exc}")
        return None
    try:
        session = Session(cfg["socket"], ticket, fds)
    except OSError as exc:
        report.count(f"connect failed: {type(exc).__name__}")
        return None
    if not session.ok:
        report.count(f"handshake refused: {session.refusal}")
        if session.refusal == "TOO_MANY_SESSIONS" and ticket != "-":
            tickets.spare = ticket
        session.close()
        return None
    report.count("sessions opened")
    return session


def release_grant(session: Session, verb: int, body: bytes, report: Report) -> None:
    """Give back what an OK Reserve or Get granted, so the fuzz holds nothing past its turn
    (with auth off every local session is charged to one client, its victims' too)."""
    try:
        held = (pb.ReserveResponse.FromString(body).reservation_id if verb == RESERVE
                else pb.GetResponse.FromString(body).lease_id if verb == GET else "")
    except Exception:  # an OK reply we cannot read is the daemon's bug, counted
        report.count("unreadable OK reply")
        return
    if held:
        answer = session.call(RELEASE, pb.ReleaseRequest(ids=[held]).SerializeToString())
        report.count("grants released" if answer and answer[0] == 0 else "release failed")


# --- fuzz ------------------------------------------------------------------------------------



def templates(namespace: str, rng: random.Random) -> dict[int, bytes]:
    """A valid request of each local verb, in the attacker's own namespace."""
    keys = [rng.randbytes(32) for _ in range(3)]
    return {verb: message.SerializeToString() for verb, message in {
        LOOKUP: pb.LookupRequest(namespace=namespace, keys=keys),
        GET: pb.GetRequest(namespace=namespace, keys=keys[:2], mode=pb.GET_MODE_SHARED_MEMORY,
                           lease_timeout_ms=1000),
        RESERVE: pb.ReserveRequest(namespace=namespace, keys=keys[:1], sizes=[100],
                                   timeout_ms=1000, independent=True),
        COMMIT: pb.PutRequest(namespace=namespace, reservation_id="bogus", checksums=[1]),
        RELEASE: pb.ReleaseRequest(ids=["bogus"]),
    }.items()}


def _garbage_body(rng: random.Random, valid: dict[int, bytes]) -> tuple[int, bytes]:
    verb = rng.randrange(256) if rng.random() < 0.1 else rng.choice(list(valid))
    shape = rng.random()
    if shape < 0.6 and verb in valid:
        return verb, mutate(valid[verb], rng)
    if shape < 0.87:
        return verb, rng.randbytes(rng.randint(1, 512))
    if shape < 0.9:  # bigger than any frame before it on the session, and than 64 KiB
        return verb, rng.randbytes(rng.randint(64 << 10, 1 << 20))
    return verb, b""


def _mutated_frame(cfg: dict[str, Any], tickets: Tickets, report: Report,
                   rng: random.Random, valid: dict[int, bytes]) -> None:
    """A whole frame, header included, mutated, on a session of its own that the attacker
    then half-closes: whatever length the header now announces, the daemon sees the end."""
    session = open_session(cfg, tickets, report)
    if session is None:
        return
    verb = rng.choice(list(valid))
    raw = mutate(REQUEST.pack(len(valid[verb]), verb) + valid[verb], rng)
    try:
        # A valid frame first: the mutated one is not the session's first, as a broken
        # client's is not.
        session.sock.sendall(REQUEST.pack(len(valid[LOOKUP]), LOOKUP) + valid[LOOKUP] + raw)
        session.sock.shutdown(socket.SHUT_WR)
        while (answer := session.reply()) is not None:
            report.count(f"mutated frame: {code_name(answer[0])}")
    except OSError as exc:  # the daemon cut the session: counted, as an answer would be
        report.count(f"mutated frame: {type(exc).__name__}")
    report.count("mutated frames")
    session.close()


def garbage(cfg: dict[str, Any], report: Report) -> None:
    rng = random.Random(cfg.get("seed", 1))
    valid = templates(cfg["namespace"], rng)
    tickets = Tickets(cfg["target"], cfg["token"])
    session: Session | None = None
    frames, min_frames = 0, int(cfg.get("min_frames", 2000))
    while not STOP.is_set() and frames < 50_000:
        if frames >= min_frames:
            report.done()
        frames += 1
        if rng.random() < 0.05:
            _mutated_frame(cfg, tickets, report, rng, valid)
            continue
        if session is None:
            session = open_session(cfg, tickets, report)
            if session is None:
                time.sleep(0.01)
                continue
        verb, body = _garbage_body(rng, valid)
        answer = session.call(verb, body)
        report.count("frames")
        if answer is None:
            report.count("sessions the daemon closed")
            session.close()
            session = None
            continue
        report.count(f"reply {code_name(answer[0])}")
        if answer[0] == 0:
            release_grant(session, verb, answer[1], report)
    if session is not None:
        session.close()
    tickets.close()
    report.facts["frames"] = frames


# --- length edges ----------------------------------------------------------------------------


def _outcome(session: Session, length: int, body_bytes: int, report: Report) -> str:
    """Send a LOOKUP frame announcing `length` with body_bytes of it (zeros, which do not
    parse as a LookupRequest); what came back: a status name, or "closed"."""
    try:
        session.sock.sendall(REQUEST.pack(length, LOOKUP))
        if body_bytes:
            session.sock.sendall(bytes(body_bytes))
        if body_bytes < length:
            session.sock.shutdown(socket.SHUT_WR)
    except OSError:
        return "closed"
    answer = session.reply()
    outcome = "closed" if answer is None else code_name(answer[0])
    report.count(f"edge {length}: {outcome}")
    return outcome


def edges(cfg: dict[str, Any], report: Report) -> None:
    tickets = Tickets(cfg["target"], cfg["token"])
    outcomes: dict[str, str] = {}
    session = open_session(cfg, tickets, report)
    assert session is not None, f"no session for the edges: {report.counts}"
    limit = session.limit
    report.facts["limit"] = limit
    # Each frame bigger than the one before, on one session: the buffer grows under the
    # frames already served (a session used to die on any frame larger than its first).
    for name, length in (("0", 0), ("1", 1), ("1000", 1000), ("limit-1", limit - 1),
                         ("limit", limit)):
        outcomes[name] = _outcome(session, length, length, report)
        if outcomes[name] == "closed":
            session.close()
            session = open_session(cfg, tickets, report)
            assert session is not None
    session.close()
    for name, length, sent in (("limit+1", limit + 1, limit + 1),
                               ("2**32-1", 2**32 - 1, 1000)):
        fresh = open_session(cfg, tickets, report)
        assert fresh is not None
        outcomes[name] = _outcome(fresh, length, sent, report)
        if name == "limit+1" and outcomes[name] != "closed":
            after = fresh.call(LOOKUP, pb.LookupRequest(namespace=cfg["namespace"],
                                                        keys=[bytes(32)]).SerializeToString())
            outcomes["after limit+1"] = "closed" if after is None else code_name(after[0])
        fresh.close()
    report.facts["outcomes"] = outcomes
    tickets.close()
    report.done()
    STOP.wait()


# --- slow attacks ----------------------------------------------------------------------------


@dataclass
class Slow:
    """One connection fed a byte at a time; its life as the attacker saw it."""

    sock: socket.socket
    data: bytes
    opened: float
    sent: int = 0

    def __post_init__(self) -> None:
        # Non-blocking: with a timeout set, Python polls for the whole timeout before a
        # recv, MSG_DONTWAIT or not.
        self.sock.setblocking(False)

    def feed(self) -> bool:
        """Send the next byte; False once the daemon answered (a refusal, sent before it
        closes) or closed the connection."""
        try:
            if self.sent < len(self.data):
                self.sock.send(self.data[self.sent : self.sent + 1])
                self.sent += 1
            # An open connection the daemon has said nothing on has nothing to read.
            self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        except OSError:  # EPIPE, ECONNRESET: closed
            return False
        return False  # an answer, or the end of the stream


def _trickle(make: Callable[[], Slow | None], count: int, report: Report,
             reopen: bool) -> None:
    """Keep `count` slow connections fed until STOP; each the daemon closes is timed and
    (reopen) replaced."""
    slow = [s for s in (make() for _ in range(count)) if s is not None]
    lifetimes: list[float] = []
    report.done()
    while not STOP.wait(TRICKLE_S):
        for s in list(slow):
            if not s.feed():
                lifetimes.append(time.monotonic() - s.opened)
                s.sock.close()
                slow.remove(s)
                report.count("answered or closed by the daemon")
                if reopen and (fresh := make()) is not None:
                    slow.append(fresh)
    now = time.monotonic()
    report.facts["closed_after_s"] = sorted(round(t, 2) for t in lifetimes)
    report.facts["open_at_stop_s"] = sorted(round(now - s.opened, 2) for s in slow)
    for s in slow:
        s.sock.close()


def slow_handshake(cfg: dict[str, Any], report: Report) -> None:
    """Connections to the attach socket that send a handshake line a byte at a time and never
    its end: half a ticket-like line, half a `HOT` line, each shorter than the line limit."""
    rng = random.Random(cfg.get("seed", 1))

    def make() -> Slow | None:
        try:
            sock = connect(cfg["socket"])
        except OSError:
            report.count("connect failed")
            return None
        report.count("connections")
        line = ("HOT " if rng.random() < 0.5 else "") + rng.randbytes(90).hex()
        return Slow(sock, line[:200].encode(), time.monotonic())

    _trickle(make, int(cfg.get("connections", 16)), report, reopen=True)


def slow_frames(cfg: dict[str, Any], report: Report) -> None:
    """Sessions that trickle a frame: half its 5-byte header, half a header announcing 1000
    bytes and then the body, a byte at a time."""
    tickets = Tickets(cfg["target"], cfg["token"])
    body = pb.LookupRequest(namespace=cfg["namespace"], keys=[bytes(32)] * 30)
    frame = REQUEST.pack(body.ByteSize(), LOOKUP) + body.SerializeToString()
    made = 0

    def make() -> Slow | None:
        nonlocal made
        session = open_session(cfg, tickets, report)
        if session is None:
            return None
        made += 1
        if made % 2:
            return Slow(session.sock, frame, time.monotonic())
        session.sock.sendall(frame[: REQUEST.size])
        return Slow(session.sock, frame[REQUEST.size :], time.monotonic())

    _trickle(make, int(cfg.get("sessions", 40)), report, reopen=False)
    tickets.close()


# --- floods and hogs -------------------------------------------------------------------------


def hold_sessions(cfg: dict[str, Any], tickets: Tickets, report: Report,
                  count: int) -> list[Session]:
    held = []
    for _ in range(count):
        session = open_session(cfg, tickets, report)
        if session is not None:
            held.append(session)
    return held


def _forked_holders(cfg: dict[str, Any], processes: int, per_process: int
                    ) -> list[tuple[int, int]]:
    """Fork `processes` children that each open per_process sessions and hold them until
    their pipe closes; (pid, write end) each. Auth off only (no gRPC in this process)."""
    children: list[tuple[int, int]] = []
    for _ in range(processes):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: hold, wait for the pipe to close, report by exit code
            for _, earlier in children:  # an older sibling's pipe must close when we do not
                os.close(earlier)
            os.close(write_end)
            held = hold_sessions(cfg, Tickets("", ""), Report(), per_process)
            os.read(read_end, 1)
            for s in held:
                s.close()
            os._exit(min(len(held), 250))
        os.close(read_end)
        children.append((pid, write_end))
    return children


def flood(cfg: dict[str, Any], report: Report) -> None:
    tickets = Tickets(cfg["target"], cfg["token"])
    children = [] if cfg["token"] else _forked_holders(cfg, int(cfg.get("processes", 8)), 36)
    held = hold_sessions(cfg, tickets, report, int(cfg.get("sessions", 40)))
    churn = 0
    while churn < int(cfg.get("churn", 200)) and not STOP.is_set():
        churn += 1
        session = open_session(cfg, tickets, report)
        if session is not None:
            session.close()
    report.facts["churned"] = churn
    report.done()
    STOP.wait()
    for s in held:
        s.close()
    for _, write_end in children:
        os.close(write_end)
    opened = 0
    for pid, _ in children:
        _, status = os.waitpid(pid, 0)
        opened += os.waitstatus_to_exitcode(status)
    report.facts["held by forked processes"] = opened
    tickets.close()


def idle_hog(cfg: dict[str, Any], report: Report) -> None:
    tickets = Tickets(cfg["target"], cfg["token"])
    held = hold_sessions(cfg, tickets, report, int(cfg.get("sessions", 32)))
    report.facts["held"] = len(held)
    report.done()
    STOP.wait()
    # Were they still open at the end? (A daemon may reap idle sessions near a cap.)
    report.facts["closed by the daemon"] = sum(
        1 for s in held if Slow(s.sock, b"", 0.0, 0).feed() is False)
    for s in held:
        s.close()
    tickets.close()


def big_headers(cfg: dict[str, Any], report: Report) -> None:
    """Waves of sessions, each sending the 5-byte header of a frame of max_frame_bytes and
    nothing more; held WAVE_HOLD_S (long enough for a daemon that zeroes the buffer up front
    to have done it), then closed."""
    tickets = Tickets(cfg["target"], cfg["token"])
    for _ in range(int(cfg.get("waves", 6))):
        wave = hold_sessions(cfg, tickets, report, int(cfg.get("sessions", 31)))
        for s in wave:
            try:
                s.sock.sendall(REQUEST.pack(s.limit, LOOKUP))
                report.count("headers sent")
            except OSError:
                report.count("closed before the header")
        time.sleep(float(cfg.get("wave_hold_s", 0.3)))
        for s in wave:
            s.close()
        time.sleep(0.05)
    tickets.close()
    report.done()
    STOP.wait()


# --- descriptors -------------------------------------------------------------------------------


def _descriptors() -> list[int]:
    """Descriptors worth passing: a 1 MiB memfd, both ends of a pipe, /dev/null."""
    memfd = os.memfd_create("attack")
    os.ftruncate(memfd, 1 << 20)
    pipe = os.pipe()
    return [memfd, *pipe, os.open("/dev/null", os.O_RDONLY)]


def fds(cfg: dict[str, Any], report: Report) -> None:
    tickets = Tickets(cfg["target"], cfg["token"])
    mine = _descriptors()
    lookup = pb.LookupRequest(namespace=cfg["namespace"], keys=[bytes(32)]).SerializeToString()
    rounds = 0
    while rounds < int(cfg.get("min_rounds", 5)) or not STOP.is_set():
        rounds += 1
        session = open_session(cfg, tickets, report, fds=mine[: 1 + rounds % 4])
        if session is not None:
            for i in range(10):
                try:
                    session.send(LOOKUP, lookup if i % 2 else b"\xff" * 40, mine[: 1 + i % 4])
                except OSError:
                    report.count("send failed")
                    break
                answer = session.reply()
                report.count("frame with fds: " + ("closed" if answer is None
                                                  else code_name(answer[0])))
            session.close()
        for line in _ticket_lines(tickets, report):
            _send_line_with_fds(cfg["socket"], line, mine, report)
        if rounds == int(cfg.get("min_rounds", 5)):
            report.done()
        if rounds > 500:
            break
    for fd in mine:
        os.close(fd)
    report.facts["rounds"] = rounds
    tickets.close()


def _ticket_lines(tickets: Tickets, report: Report) -> Iterator[bytes]:
    yield b"forged-ticket\n"
    yield b"HOT forged-ticket\n"
    try:
        ticket = tickets()
    except NoTicket as exc:
        report.count(f"Attach {exc}")
        return
    if ticket != "-":
        yield ticket.encode() + b"\n"  # a real ticket, traded for the arenas


def _send_line_with_fds(path: str, line: bytes, mine: list[int], report: Report) -> None:
    try:
        with connect(path) as sock:
            socket.send_fds(sock, [line], mine)
            data, got, _, _ = socket.recv_fds(sock, 65536, 16)
            for fd in got:
                os.close(fd)
            report.count("ticket line with fds: " + ("answered" if data else "closed"))
    except OSError as exc:
        report.count(f"ticket line with fds: {type(exc).__name__}")


# --- tickets across tenants ------------------------------------------------------------------


def exchange(path: str, ticket: str) -> tuple[dict[str, Any], list[int]]:
    """Trade a ticket for arenas: the JSON reply and the descriptors that came with it."""
    with connect(path) as sock:
        sock.sendall(ticket.encode() + b"\n")
        data, got, _, _ = socket.recv_fds(sock, 65536, 16)
    try:
        reply = json.loads(data.partition(b"\n")[0]) if data else {}
    except ValueError:
        reply = {"malformed": data[:100].decode(errors="replace")}
    return reply, got


def tickets_attack(cfg: dict[str, Any], report: Report) -> None:
    """Tenant A (cfg token) against tenant B (cfg other_token, other_namespace)."""
    import grpc

    from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc

    a, b = Tickets(cfg["target"], cfg["token"]), Tickets(cfg["target"], cfg["other_token"])
    path, b_ns = cfg["socket"], cfg["other_namespace"]
    facts = report.facts
    secret, key = os.urandom(64 * 1024), os.urandom(32)
    with grpc.insecure_channel(cfg["target"]) as channel:
        stub = rpc.KVStoreStub(channel)
        md_b = (("authorization", f"Bearer {cfg['other_token']}"),)
        stub.Put(iter([pb.PutRequest(namespace=b_ns, keys=[key], sizes=[len(secret)],
                                     data=secret, independent=True)]), metadata=md_b,
                 timeout=REPLY_TIMEOUT_S)
        head = next(iter(stub.Get(pb.GetRequest(namespace=b_ns, keys=[key],
                                                mode=pb.GET_MODE_SHARED_MEMORY,
                                                lease_timeout_ms=30_000),
                                  metadata=md_b, timeout=REPLY_TIMEOUT_S)))
        facts.update(_a_maps_only_its_arena(path, a(), secret))
        facts.update(_a_session_on_b(path, a(), b_ns, key, head.lease_id))
        facts["b released its own lease"] = stub.Release(
            pb.ReleaseRequest(ids=[head.lease_id]), metadata=md_b,
            timeout=REPLY_TIMEOUT_S).released
    facts.update(_good_once(path, a))
    facts["raced"] = _race(path, a())
    b_ticket = b()
    facts["b's ticket, one char changed, for a session"] = Session(
        path, _flip(b_ticket)).refusal
    facts["b's ticket after that"] = "ok" if Session(path, b_ticket).ok else "refused"
    a.close()
    b.close()
    report.done()
    STOP.wait()


def _flip(ticket: str) -> str:
    return ticket[:-1] + ("A" if ticket[-1] != "A" else "B")


def _a_maps_only_its_arena(path: str, ticket: str, secret: bytes) -> dict[str, Any]:
    reply, got = exchange(path, ticket)
    names = [a["name"] for a in reply.get("arenas", [])]
    found = False
    for fd in got:
        with mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ) as m:
            found = found or m.find(secret[:4096]) >= 0
        os.close(fd)
    return {"a's arenas": names, "b's secret in what a maps": found}


def _a_session_on_b(path: str, ticket: str, b_ns: str, key: bytes,
                    b_lease: str) -> dict[str, Any]:
    session = Session(path, ticket)
    out: dict[str, Any] = {"a's session": "ok" if session.ok else session.refusal}
    for verb, message in ((LOOKUP, pb.LookupRequest(namespace=b_ns, keys=[key])),
                          (GET, pb.GetRequest(namespace=b_ns, keys=[key],
                                              mode=pb.GET_MODE_SHARED_MEMORY)),
                          (RESERVE, pb.ReserveRequest(namespace=b_ns, keys=[key],
                                                      sizes=[10])),
                          (RELEASE, pb.ReleaseRequest(ids=[b_lease]))):
        answer = session.call(verb, message.SerializeToString())
        out[f"a's verb {verb} on b"] = "closed" if answer is None else code_name(answer[0])
    session.close()
    return out


def _good_once(path: str, a: Tickets) -> dict[str, Any]:
    """Each way a used ticket can be tried again: session then exchange, exchange then
    session, session twice, exchange twice."""
    out: dict[str, Any] = {}
    t = a()
    out["session"] = "ok" if Session(path, t).ok else "refused"
    out["then exchange"] = "arenas" if "arenas" in exchange(path, t)[0] else "refused"
    t = a()
    reply, got = exchange(path, t)
    for fd in got:
        os.close(fd)
    out["exchange"] = "arenas" if "arenas" in reply else "refused"
    out["then session"] = "ok" if Session(path, t).ok else "refused"
    out["then exchange again"] = "arenas" if "arenas" in exchange(path, t)[0] else "refused"
    out["then session again"] = "ok" if Session(path, t).ok else "refused"
    return out


def _race(path: str, ticket: str, racers: int = 8) -> dict[str, int]:
    """One ticket on `racers` connections at once, half sessions and half exchanges: how
    many got what."""
    results: Counter[str] = Counter()
    start = threading.Barrier(racers)

    def one(i: int) -> None:
        start.wait()
        if i % 2:
            results["session" if Session(path, ticket).ok else "refused"] += 1
        else:
            reply, got = exchange(path, ticket)
            for fd in got:
                os.close(fd)
            results["arenas" if "arenas" in reply else "refused"] += 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return dict(results)


ATTACKS: dict[str, Callable[[dict[str, Any], Report], None]] = {
    "garbage": garbage, "edges": edges, "slow_handshake": slow_handshake,
    "slow_frames": slow_frames, "flood": flood, "idle_hog": idle_hog,
    "big_headers": big_headers, "fds": fds, "tickets": tickets_attack,
}


def main(argv: list[str]) -> int:
    cfg = json.loads(argv[0])
    threading.Thread(target=_watch_stdin, daemon=True).start()
    report = Report()
    say("started")
    try:
        ATTACKS[cfg["attack"]](cfg, report)
    finally:
        report.done()
        say("result " + report.as_json())
    return 0


# --- the test's side -------------------------------------------------------------------------


class Attacker:
    """One attack in a process of its own. Made, it returns once the process is attacking;
    `done` is set once the attack's finite part is done (a hog: in place); `stop` makes it
    let go and returns its report."""

    def __init__(self, attack: str, *, socket_path: str | Path, target: str, token: str = "",
                 namespace: str = "attack-junk", **options: Any) -> None:
        cfg = {"attack": attack, "socket": str(socket_path), "target": target,
               "token": token, "namespace": namespace, **options}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.local_attack_tools", json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=Path(__file__).resolve().parents[1])
        self.started, self.done, self.ended = (threading.Event(), threading.Event(),
                                               threading.Event())
        self.result: dict[str, Any] | None = None
        threading.Thread(target=self._read, daemon=True).start()
        self._wait(self.started, "started", 30.0)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            word, _, rest = line.strip().partition(" ")
            if word == "started":
                self.started.set()
            elif word == "done":
                self.done.set()
            elif word == "result":
                self.result = json.loads(rest)
        self.ended.set()

    def _wait(self, event: threading.Event, word: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not event.wait(0.05):
            if self.ended.is_set() and not event.is_set():
                self.proc.wait(5)
                stderr = self.proc.stderr.read() if self.proc.stderr else ""
                raise AssertionError(f"the attacker exited ({self.proc.returncode}) before "
                                     f"saying {word!r}:\n{stderr}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the attacker did not say {word!r} within {timeout_s} s")

    def wait_done(self, timeout_s: float = 30.0) -> None:
        self._wait(self.done, "done", timeout_s)

    def stop(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Tell it to let go; its report ({"counts": ..., "facts": ...})."""
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.write("stop\n")
            self.proc.stdin.close()
        try:
            self._wait(self.ended, "result", timeout_s)
            self.proc.wait(timeout_s)
        finally:
            self.kill()
        if self.result is None or self.proc.returncode != 0:
            stderr = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"the attacker exited {self.proc.returncode} without its "
                                 f"report:\n{stderr}")
        return self.result

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
