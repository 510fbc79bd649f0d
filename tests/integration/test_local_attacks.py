"""The local path and the Attach exchange under attack (a real daemon with a Unix socket, in
both auth modes; the real client as the victim; the attacker a process of its own,
tests/local_attack_tools.py): garbage and mutated frames, every length edge, slow handshakes
and slow frames, session floods, an idle hog, 5-byte headers of max-size frames, descriptors
passed with frames and ticket lines, and tickets across tenants.

Each attack runs against three victims, KVStoreClients on this host: one started before the
attack, one started while it runs, one after it. Their Lookups and Gets must succeed
throughout (over gRPC while the fast path is refused) within CALL_BOUND_S, and each must be on
shared memory and the local path within RECOVERY_S of the attack's end. Which path served a
call is read from the daemon's own count of local requests, taken around the victim's call
while nothing else talks to the socket. After every attack: no Traceback in the daemon's log,
no INTERNAL or UNKNOWN answer, the daemon alive and SERVING.

Both modes share one daemon per mode with the tests of this file only (its settings are its
own): auth off, where every local session is one process's (the attacker is another), and
auth.mode=token with team-a (the victims) and team-b (the other tenant; most attackers).
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import KVStoreClient
from kvstore.daemon import attach
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.tools.testing import Daemon
from tests.helpers import keys, values, wait_until
from tests.integration.test_auth import TOKENS, md, tenants_doc, write_tenants
from tests.local_attack_tools import FAULTS, Attacker

#: Each victim call must answer within this: a healthy call takes milliseconds, even on a
#: loaded 2-core machine beside the rest of the suite; a broken one waits for a stalled
#: session or exchange (seconds) or the client's own timeout (VICTIM_TIMEOUT_S).
CALL_BOUND_S = 3.0
VICTIM_TIMEOUT_S = 10.0
#: The issue's target: a victim started before, during or after any attack is on shared
#: memory and the local path within this long of the attack's end.
RECOVERY_S = 5.0
#: How long each attack is held while its victims call: long enough for several hundred
#: victim calls and for the slow attacks to pass any deadline per recv() (TRICKLE_S), short
#: enough for the file to stay within ~40 s on 2 workers.
HOLD_S = 1.5
#: How late past the daemon's deadline for a whole handshake line (EXCHANGE_TIMEOUT_S) a slow
#: line may still be open: the attacker notices a close at its next byte (TRICKLE_S), and a
#: loaded 2-core machine delays the daemon's timer by tenths of a second.
LINE_SLACK_S = 1.2
#: The issue's target for 6 waves of 5-byte headers of max-size frames: the daemon's own
#: memory (RSS less the shared memory it maps) within this of what it was before.
RSS_SLACK_BYTES = 64 << 20
#: Descriptors the daemon may hold beyond its count before an attack once it is over: the
#: victims' gRPC connections and local sessions, closed asynchronously.
FD_SLACK = 4
#: The settings of this file's two daemons (a 48 MiB L2 no other file asks for, so no other
#: test shares them and their logs are this file's alone).
SETTINGS = ("dram.capacity_bytes=48MiB", "nvme.enabled=false")


# --- the daemons and their modes -------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    """One auth mode's daemon, and who the victims and the attackers are in it."""

    name: str
    daemon: Daemon
    victim_token: str | None  # team-a's token with auth on
    attacker_token: str  # team-b's with auth on; "" (no ticket needed) with auth off
    victim_prefix: str  # of the victims' namespaces: team-a owns "team-a/"
    attacker_namespace: str

    @property
    def socket(self) -> str:
        assert self.daemon.unix_socket is not None
        return str(self.daemon.unix_socket)

    def attacker(self, attack: str, *, token: str | None = None, **options: Any) -> Attacker:
        return Attacker(attack, socket_path=self.socket, target=self.daemon.target,
                        token=self.attacker_token if token is None else token,
                        namespace=self.attacker_namespace, **options)


def _token_settings(root: Path) -> tuple[str, ...]:
    tenants = write_tenants(root / "tenants.yaml", tenants_doc())
    return ("auth.mode=token", f"auth.tenants_file={tenants}", *SETTINGS)


@pytest.fixture(scope="module", params=["off", "token"])
def mode(request: pytest.FixtureRequest, shared_daemon: Callable[..., Daemon],
         tmp_path_factory: pytest.TempPathFactory) -> Mode:
    if request.param == "off":
        d = shared_daemon(*SETTINGS, unix_socket=True)
        return Mode("off", d, None, "", "", "attack-junk")
    return token_mode_of(shared_daemon, tmp_path_factory)


def token_mode_of(shared_daemon: Callable[..., Daemon],
                  tmp_path_factory: pytest.TempPathFactory) -> Mode:
    root = tmp_path_factory.getbasetemp() / "local-attacks"
    root.mkdir(exist_ok=True)
    d = shared_daemon(*_token_settings(root), unix_socket=True)
    return Mode("token", d, TOKENS["team-a"], TOKENS["team-b"], "team-a/", "team-b/junk")


@pytest.fixture(scope="module")
def token_mode(shared_daemon: Callable[..., Daemon],
               tmp_path_factory: pytest.TempPathFactory) -> Mode:
    return token_mode_of(shared_daemon, tmp_path_factory)


# --- the daemon, watched ---------------------------------------------------------------------


def metrics_text(d: Daemon) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics",
                                timeout=5) as response:
        return str(response.read().decode())


def local_requests(d: Daemon) -> dict[str, float]:
    """Requests the daemon answered on local sessions so far, by method."""
    pattern = r'^kvstore_local_requests_total\{method="(\w+)"\} (\S+)$'
    return {m: float(n) for m, n in re.findall(pattern, metrics_text(d), re.M)}


def faults(d: Daemon) -> float:
    """INTERNAL and UNKNOWN answers so far, every method, gRPC and local path alike."""
    pattern = r'^kvstore_rpc_latency_seconds_count\{code="(\w+)",method="\w+"\} (\S+)$'
    return sum(float(n) for c, n in re.findall(pattern, metrics_text(d), re.M) if c in FAULTS)


def proc_status(d: Daemon) -> dict[str, int]:
    text = Path(f"/proc/{d.proc.pid}/status").read_text()
    return {k: int(v) * 1024 for k, v in re.findall(r"^(\w+):\s+(\d+) kB", text, re.M)}


def own_rss(d: Daemon) -> int:
    """The daemon's resident memory less the shared memory it maps: its heap, which a
    buffer kept for five bytes grows, and not the L2 pages the victims' puts touch."""
    status = proc_status(d)
    return status["VmRSS"] - status.get("RssShmem", 0)


def fd_count(d: Daemon) -> int:
    return len(list(Path(f"/proc/{d.proc.pid}/fd").iterdir()))


@dataclass
class Watch:
    """What a test must not have caused: read at its start, checked at its end."""

    daemon: Daemon
    log_offset: int = 0
    faults: float = 0.0

    def __post_init__(self) -> None:
        self.log_offset = self.daemon.log_path.stat().st_size
        self.faults = faults(self.daemon)

    def check(self) -> None:
        assert self.daemon.proc.poll() is None, "the daemon died:\n" + self.daemon.log()[-3000:]
        with open(self.daemon.log_path, errors="replace") as log:
            log.seek(self.log_offset)
            new = log.read()
        assert "Traceback" not in new, f"the daemon logged a Traceback:\n{new[-6000:]}"
        assert faults(self.daemon) == self.faults, "the daemon answered INTERNAL or UNKNOWN"


# --- the victims -----------------------------------------------------------------------------


@dataclass
class Victim:
    """A real client of the victims' tenant on this host, reading blocks put before the
    attack; every call timed and checked."""

    mode: Mode
    namespace: str
    keys: list[bytes]
    values: list[bytes]
    name: str
    calls_ms: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        # read_table=False: a victim's probe is the socket's Lookup and Get, which it counts.
        self.kv = KVStoreClient(self.mode.daemon.target, self.namespace,
                                token=self.mode.victim_token, timeout_s=VICTIM_TIMEOUT_S,
                                read_table=False)

    def _timed(self, call: Callable[[], Any]) -> Any:
        start = time.monotonic()
        try:
            return call()
        finally:
            elapsed = time.monotonic() - start
            self.calls_ms.append(elapsed * 1e3)
            assert elapsed < CALL_BOUND_S, f"the {self.name} victim's call took {elapsed:.1f} s"

    def probe(self) -> None:
        """A Get (the first one decides the fast path) and a Lookup, each checked."""
        got = self._timed(lambda: self.kv.get(self.keys[:2]))
        assert got == self.values[:2], f"the {self.name} victim read other bytes"
        found = self._timed(lambda: self.kv.lookup(self.keys))
        assert found.prefix_length == len(self.keys)

    def on_fast_path(self) -> bool:
        """Whether a probe now goes over the local path, with the blocks in shared memory:
        the daemon counts one more local Lookup and Get for it (nothing else may call the
        socket meanwhile)."""
        before = local_requests(self.mode.daemon)
        self.probe()
        after = local_requests(self.mode.daemon)
        return bool(self.kv.uses_shared_memory) and all(
            after.get(m, 0) > before.get(m, 0) for m in ("Lookup", "Get"))

    def close(self) -> None:
        self.kv.close()


@dataclass
class Scene:
    """One attack's victims and what was measured around it."""

    mode: Mode
    namespace: str
    keys: list[bytes]
    values: list[bytes]
    watch: Watch
    victims: list[Victim] = field(default_factory=list)

    def victim(self, name: str) -> Victim:
        v = Victim(self.mode, self.namespace, self.keys, self.values, name)
        self.victims.append(v)
        return v

    def close(self) -> None:
        for v in self.victims:
            v.close()


@pytest.fixture
def scene(mode: Mode, ns: str) -> Iterator[Scene]:
    yield from _scene(mode, ns)


@pytest.fixture
def token_scene(token_mode: Mode, ns: str) -> Iterator[Scene]:
    yield from _scene(token_mode, ns)


def _scene(mode: Mode, ns: str) -> Iterator[Scene]:
    """The blocks the victims read (put by the first victim, which is then on the fast path:
    the precondition of every attack), and the watch on the daemon from before it."""
    watch = Watch(mode.daemon)
    namespace = mode.victim_prefix + ns
    s = Scene(mode, namespace, keys(4), values([64 << 10] * 4), watch)
    first = s.victim("before")
    first.kv.put(s.keys, s.values)
    assert first.on_fast_path(), "a victim is not on the local path before any attack"
    try:
        yield s
    finally:
        s.close()
        if mode.victim_token is not None:
            with grpc.insecure_channel(mode.daemon.target) as channel:
                rpc.KVStoreStub(channel).Evict(pb.EvictRequest(all=True), metadata=md("root"),
                                               timeout=10)


def attack_with_victims(scene: Scene, attacker: Attacker, *, path_during: bool = False,
                        hold_s: float = HOLD_S) -> dict[str, Any]:
    """Hold the attack (at least hold_s, and until its finite part is done) while the
    victim from before it and one started during it call; stop it; a victim started after
    it; every victim on the fast path within RECOVERY_S of its end. path_during: the
    victim started during the attack must be on the fast path before the attack ends (the
    attack is one the daemon's caps keep from it: another tenant's, or another process's
    within its own cap). The attacker's report."""
    before = scene.victims[0]
    started = time.monotonic()
    during: Victim | None = None
    fast_during = False
    try:
        while not (attacker.done.is_set() and time.monotonic() - started >= hold_s):
            assert time.monotonic() - started < 60, "the attack never got in place"
            before.probe()
            if during is None and (attacker.done.is_set() or time.monotonic() - started > 0.5):
                during = scene.victim("during")
            if during is not None:
                if path_during and not fast_during:
                    fast_during = during.on_fast_path()
                else:
                    during.probe()
        report = attacker.stop()
    finally:
        attacker.kill()
    ended = time.monotonic()
    assert during is not None
    if path_during:
        assert fast_during, (f"the victim started during the {scene.mode.name} attack did not "
                             f"get the local path and shared memory while it ran")
    after = scene.victim("after")
    for v in (before, during, after):
        wait_until(v.on_fast_path, f"the {v.name} victim on the local path and shared memory",
                   timeout_s=max(0.5, RECOVERY_S - (time.monotonic() - ended)), pause_s=0.05)
    assert not [c for c in report["counts"] if any(f in c for f in FAULTS)], report
    assert before.kv.health() == "SERVING"
    scene.watch.check()
    return report


# --- the attacks -----------------------------------------------------------------------------


def test_garbage_and_mutated_frames(mode: Mode, scene: Scene) -> None:
    report = attack_with_victims(scene, mode.attacker("garbage", seed=32, min_frames=2000))
    counts = report["counts"]
    assert report["facts"]["frames"] >= 2000
    assert counts.get("reply INVALID_ARGUMENT", 0) > 100, counts  # the fuzz reached the decoder
    assert counts.get("mutated frames", 0) > 20, counts


def test_every_length_edge(mode: Mode, scene: Scene) -> None:
    report = attack_with_victims(scene, mode.attacker("edges"))
    outcomes = report["facts"]["outcomes"]
    # Each bigger than the one before, on one session: each answered, none ending it.
    for edge in ("0", "1", "1000", "limit-1", "limit"):
        assert outcomes[edge] not in ("closed", *FAULTS), (edge, outcomes)
    assert outcomes["limit+1"] == "RESOURCE_EXHAUSTED", outcomes
    assert outcomes["2**32-1"] in ("RESOURCE_EXHAUSTED", "closed"), outcomes
    # A real client's frames grow too: a 32k-token prompt's Lookup and Get (2,048 keys)
    # after small ones, on the session the small ones used.
    victim = scene.victims[0]
    many = keys(2048)
    start = time.monotonic()
    assert victim.kv.lookup(many).prefix_length == 0
    assert victim.kv.get(many) == [None] * len(many)
    assert time.monotonic() - start < CALL_BOUND_S
    scene.watch.check()


def test_slow_handshakes_shut_nobody_out(mode: Mode, scene: Scene) -> None:
    # Held past the deadline of a whole handshake line, so that every slow line is cut by it
    # at least once: a deadline per recv() never cuts a line sent a byte each TRICKLE_S.
    deadline_s = attach.EXCHANGE_TIMEOUT_S
    report = attack_with_victims(scene, mode.attacker("slow_handshake", connections=16),
                                 path_during=True, hold_s=deadline_s + 2.0)
    assert report["counts"].get("connections", 0) >= 16, report
    lived = report["facts"]["closed_after_s"] + report["facts"]["open_at_stop_s"]
    assert max(lived) <= deadline_s + LINE_SLACK_S, (
        f"a slow handshake line was held {max(lived)} s, past the {deadline_s} s deadline")


def test_slow_frames(mode: Mode, scene: Scene) -> None:
    report = attack_with_victims(scene, mode.attacker("slow_frames", sessions=40),
                                 path_during=True)
    assert report["counts"]["sessions opened"] >= 16, report


def test_session_floods_past_the_caps(mode: Mode, scene: Scene) -> None:
    # Auth off: nine processes of 36 sessions each, past the daemon-wide cap, whose refusals
    # may reach the victim while they hold (its path is checked after). Auth on: the other
    # tenant, past its own cap, which must not reach team-a at all.
    report = attack_with_victims(scene, mode.attacker("flood", sessions=40, churn=200),
                                 path_during=mode.name == "token")
    refused = sum(n for c, n in report["counts"].items() if c.startswith("handshake refused"))
    assert refused > 0, report  # past the caps indeed


def test_idle_sessions_of_one_process(mode: Mode, scene: Scene) -> None:
    # Auth off: another process holds as many sessions as one client may, idle; the victims'
    # process is another client. Auth on: another process of the victims' own tenant does,
    # which may crowd them out while it holds but never for longer.
    token = mode.victim_token or ""
    report = attack_with_victims(scene, mode.attacker("idle_hog", sessions=32, token=token),
                                 path_during=mode.name == "off")
    assert report["facts"]["held"] >= 16, report


def test_five_byte_headers_of_max_frames_keep_no_memory(mode: Mode, scene: Scene) -> None:
    before = own_rss(mode.daemon)
    report = attack_with_victims(scene, mode.attacker("big_headers", waves=6, sessions=31,
                                                      wave_hold_s=0.2), path_during=True)
    assert report["counts"].get("headers sent", 0) >= 6 * 16, report
    wait_until(lambda: own_rss(mode.daemon) <= before + RSS_SLACK_BYTES,
               f"the daemon's RSS back within 64 MiB of {before >> 20} MiB "
               f"(now {own_rss(mode.daemon) >> 20} MiB)", timeout_s=RECOVERY_S)


def test_descriptors_passed_with_frames_and_ticket_lines(mode: Mode, scene: Scene) -> None:
    before = fd_count(mode.daemon)
    report = attack_with_victims(scene, mode.attacker("fds", min_rounds=5))
    assert report["facts"]["rounds"] >= 5
    for v in scene.victims[1:]:
        v.close()
    wait_until(lambda: fd_count(mode.daemon) <= before + FD_SLACK,
               f"the daemon's descriptors back to {before} (+{FD_SLACK})", timeout_s=RECOVERY_S)


def test_tickets_across_tenants(token_mode: Mode, token_scene: Scene) -> None:
    report = attack_with_victims(token_scene, token_mode.attacker(
        "tickets", token=TOKENS["team-a"], other_token=TOKENS["team-b"],
        other_namespace="team-b/secrets"))
    facts = report["facts"]
    assert facts["a's arenas"] == ["team-a"]
    assert facts["b's secret in what a maps"] is False
    assert facts["a's session"] == "ok"
    for verb in (1, 2, 3):  # Lookup, Get, Reserve in B's namespace
        assert facts[f"a's verb {verb} on b"] == "PERMISSION_DENIED", facts
    assert facts["b released its own lease"] == 1  # A's Release of it did nothing
    assert (facts["session"], facts["then exchange"]) == ("ok", "refused")
    assert (facts["exchange"], facts["then session"], facts["then exchange again"],
            facts["then session again"]) == ("arenas", "refused", "refused", "refused")
    assert sum(facts["raced"].values()) == 8 and facts["raced"].get("refused") == 7, facts
    assert facts["b's ticket, one char changed, for a session"] != "ok"
    assert facts["b's ticket after that"] == "ok"  # a forged try burns no real ticket


def test_the_daemon_after_every_attack(mode: Mode) -> None:
    """Run last in each mode (pytest orders a file's tests as written): nothing the attacks
    did shows in the whole log, the fault counts or the health."""
    d = mode.daemon
    assert d.proc.poll() is None
    log = d.log()
    assert log.count("Traceback") == 0, log[-6000:]
    assert faults(d) == 0
    with grpc.insecure_channel(d.target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
