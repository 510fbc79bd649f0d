"""Phase 3 of bench/soak.py: the daemon watched (RssSampler; the leases, reservations and pins
it holds), the victim process and the Window of its calls, and run_attack / attacks, which
measure the victim under each hog (bench/soak_hogs.py) against a quiet window just before
it. victim is the target of a spawned process.

With auth off the victim calls over raw gRPC, as it always has. With auth on it is tenant A's
KVStoreClient, on A's arena and the local path, and every second it also starts a fresh
client and notes which path that one got: a hog that shuts newcomers out of the fast path
shows there, even when the long-lived client keeps its own."""

from __future__ import annotations

import math
import multiprocessing as mp
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from multiprocessing import synchronize
from pathlib import Path
from typing import TypeAlias

import grpc
from figures import percentile
from grpc_health.v1 import health_pb2, health_pb2_grpc
from soak_hogs import (
    LOCAL_HOGS,
    Attack,
    IdlePuts,
    LeaseStorm,
    PinStorm,
    ReserveFull,
    Scale,
    UnreadGets,
)
from soak_load import OWN_CONNECTION, Results, code_of, details_of
from soak_local import ADMIN, A, Tenancy

from kvstore.client import KVStoreClient
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.tools.testing import Daemon
from kvstore.units import KiB

PROBE_TIMEOUT_S = 2.0  # of the victim's calls
FRESH_EVERY_S = 1.0  # auth on: how often the victim starts a fresh client and notes its path
# A victim's call: t, probe, ms, code, why, path ("" with auth off).
Sample: TypeAlias = tuple[float, str, float, str, str, str]


# --- the daemon, watched -----------------------------------------------------------------------


class RssSampler:
    """The daemon's /proc/<pid>/status VmRSS, RssAnon and RssShmem every interval_s, labelled
    with the phase the run is in."""

    def __init__(self, pid: int, interval_s: float = 1.0) -> None:
        self.pid, self.interval_s, self.phase = pid, interval_s, "start"
        self.t0 = time.monotonic()
        self.samples: list[tuple[float, str, int, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.sample()
        self._thread.start()

    def sample(self) -> None:
        try:
            text = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return  # the daemon is gone: the end of the run reports that
        kib = {m[0]: int(m[1]) * KiB for m in re.findall(r"^(\w+):\s+(\d+) kB", text, re.M)}
        self.samples.append((time.monotonic() - self.t0, self.phase, kib.get("VmRSS", 0),
                             kib.get("RssAnon", 0), kib.get("RssShmem", 0)))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def window_mib(self, attack_start: float, attack_end: float) -> tuple[float, float, float]:
        """VmRSS in MiB: the last sample before the attack (in its quiet window, or before),
        the largest while it ran, and the last one taken (just after it let go)."""
        def at(t: float) -> float:
            return t - self.t0

        before = [s[2] for s in self.samples if s[0] < at(attack_start)]
        during = [s[2] for s in self.samples if at(attack_start) <= s[0] <= at(attack_end)]
        last = self.samples[-1][2]
        mib = 1 << 20
        return ((before[-1] if before else last) / mib,
                max(during or [last]) / mib, last / mib)



def held(kv: KVStoreClient) -> tuple[int, int, int]:
    stats = kv.stats()
    return stats.leases, stats.reservations, stats.pinned


def wait_held(kv: KVStoreClient, at_most: tuple[int, int, int], timeout_s: float
              ) -> float | None:
    """Seconds until leases, reservations and pins are each back to at_most; None if not
    within timeout_s."""
    start = time.monotonic()
    while True:
        if all(n <= m for n, m in zip(held(kv), at_most, strict=True)):
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            return None
        time.sleep(0.1)


# --- phase 3: the victim and the attacks --------------------------------------------------------


def victim(target: str, lookup_keys: list[bytes], get_key: bytes, get_value: bytes,
           stop: synchronize.Event, out: Results, tenancy: Tenancy) -> None:
    """A spawned process (so the hogs' threads do not slow it down): Lookup, a Get and the
    health check in turn, 2 s deadlines, on its own connection, until stop is set. Samples
    are (monotonic start, probe, latency ms, code, details, path): CLOCK_MONOTONIC is
    system-wide."""
    samples: list[Sample] = []
    with ExitStack() as stack:
        channel = stack.enter_context(grpc.insecure_channel(target, options=OWN_CONNECTION))
        health = health_pb2_grpc.HealthStub(channel)

        def check() -> str:
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
            return "OK" if reply.status == health_pb2.HealthCheckResponse.SERVING else "NOT SERVING"

        kv: KVStoreClient | None = None
        if tenancy.on:
            kv = stack.enter_context(KVStoreClient(target, tenancy.seed_ns,
                                                   token=tenancy.token(A),
                                                   timeout_s=PROBE_TIMEOUT_S))
            lookup, get = _client_probes(kv, lookup_keys, get_key, get_value)
            get()  # the first data call opens the fast path
        else:
            lookup, get = _raw_probes(rpc.KVStoreStub(channel), tenancy.seed_ns, lookup_keys,
                                      get_key, get_value)
        out.put({"ready": True})
        next_fresh = time.monotonic()
        while not stop.is_set():
            for name, probe in (("lookup", lookup), ("get", get), ("health", check)):
                samples.append(_sample(name, probe, kv))
            if tenancy.on and time.monotonic() >= next_fresh:
                next_fresh = time.monotonic() + FRESH_EVERY_S
                samples.append(_fresh(target, tenancy, get_key, get_value))
            time.sleep(0.01)
    out.put({"samples": samples})


def _sample(name: str, probe: Callable[[], str], kv: KVStoreClient | None) -> Sample:
    start, details = time.monotonic(), ""
    try:
        code = probe()
    except Exception as exc:  # recorded by code, never dropped
        code, details = code_of(exc), details_of(exc)
    return (start, name, (time.monotonic() - start) * 1e3, code, details,
            path_of(kv) if kv is not None else "")


def _raw_probes(stub: rpc.KVStoreStub, namespace: str, lookup_keys: list[bytes],
                get_key: bytes, get_value: bytes) -> tuple[Callable[[], str], Callable[[], str]]:
    def lookup() -> str:
        reply = stub.Lookup(pb.LookupRequest(namespace=namespace, keys=lookup_keys),
                            timeout=PROBE_TIMEOUT_S)
        return "OK" if reply.prefix_length == len(lookup_keys) else "SHORT PREFIX"

    def get() -> str:
        replies = list(stub.Get(pb.GetRequest(namespace=namespace, keys=[get_key]),
                                timeout=PROBE_TIMEOUT_S))
        return "OK" if b"".join(r.data for r in replies) == get_value else "CORRUPT"

    return lookup, get


def _client_probes(kv: KVStoreClient, lookup_keys: list[bytes], get_key: bytes,
                   get_value: bytes) -> tuple[Callable[[], str], Callable[[], str]]:
    def lookup() -> str:
        found = kv.lookup(lookup_keys).prefix_length
        return "OK" if found == len(lookup_keys) else "SHORT PREFIX"

    def get() -> str:
        return "OK" if kv.get([get_key]) == [get_value] else "CORRUPT"

    return lookup, get


def _fresh(target: str, tenancy: Tenancy, get_key: bytes, get_value: bytes) -> Sample:
    """A client started now: one Get, timed, and the path it got."""
    with KVStoreClient(target, tenancy.seed_ns, token=tenancy.token(A),
                       timeout_s=PROBE_TIMEOUT_S) as fresh:
        _, get = _client_probes(fresh, [], get_key, get_value)
        return _sample("fresh", get, fresh)


def path_of(kv: KVStoreClient) -> str:
    """The way a client's calls go now: its hot verbs over the local path or gRPC, its
    blocks through shared memory or inline."""
    return (("local path" if kv.uses_local_path else "gRPC")
            + (" + shared memory" if kv.uses_shared_memory else " + inline"))


@dataclass
class Window:
    """The victim's calls of one probe in one window of time."""

    latency_ms: list[float]
    codes_in_order: list[str]
    details: dict[str, str]  # code -> the message of the first call that failed with it
    paths: Counter[str] = field(default_factory=Counter)  # auth on: calls by path

    @classmethod
    def of(cls, samples: list[Sample], probe: str, start: float, end: float) -> Window:
        mine = [s for s in samples if s[1] == probe and start <= s[0] < end]
        details: dict[str, str] = {}
        for _, _, _, code, text, _ in mine:
            if text:
                details.setdefault(code, text)
        return cls([s[2] for s in mine], [s[3] for s in mine], details,
                   Counter(s[5] for s in mine if s[5]))

    def on_local_path(self) -> str:
        """"n of m" calls over the local path with shared memory; "-" with auth off."""
        total = sum(self.paths.values())
        fast = self.paths.get("local path + shared memory", 0)
        return f"{fast} of {total}" if total else "-"

    @property
    def codes(self) -> Counter[str]:
        return Counter(self.codes_in_order)

    def p(self, q: float) -> float:
        """The q-quantile of the time to a served answer: a call that failed (refused, timed
        out, wrong) counts as the whole 2 s deadline, since the victim went without."""
        served = [ms if code == "OK" else PROBE_TIMEOUT_S * 1e3
                  for ms, code in zip(self.latency_ms, self.codes_in_order, strict=True)]
        return percentile(served, q) if served else math.nan

    def failures(self) -> str:
        bad = {c: n for c, n in self.codes.items() if c != "OK"}
        return ", ".join(f"{c} {n}" for c, n in sorted(bad.items())) or "none"


@dataclass
class AttackResult:
    name: str
    what: str
    hog_codes: dict[str, int]
    hog_details: dict[str, str]
    quiet: dict[str, Window]
    attack: dict[str, Window]
    before: tuple[int, int, int]
    during: tuple[int, int, int]  # once the hog is in place
    held_at_end: tuple[int, int, int]  # at the end of the hold, before the hog lets go
    after: tuple[int, int, int]
    freed: str
    hold_s: float
    rss_mib: tuple[float, float, float] = (0.0, 0.0, 0.0)  # before, max during, after


def settle(kv: KVStoreClient, timeout_s: float = 15.0) -> None:
    """Until no tier has transfers in flight (the L4 write-through of a prepared block), so
    the quiet window is quiet."""
    deadline = time.monotonic() + timeout_s
    while any(t.queue_depth for t in kv.stats().tiers) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # and the copies and frees after it


def run_attack(attack: Attack, kv: KVStoreClient, rss: RssSampler
               ) -> tuple[AttackResult, tuple[float, float, float]]:
    """Prepare, measure a quiet window, attack, let go; the result and the window times."""
    rss.phase = f"attack {attack.name}"
    attack.prepare(kv)
    settle(kv)
    before = held(kv)
    quiet_start = time.monotonic()
    time.sleep(attack.scale.quiet_s)
    attack_start = time.monotonic()
    attack.start()
    during = held(kv)
    time.sleep(max(0.0, attack_start + attack.hold_s() - time.monotonic()))
    attack_end = time.monotonic()
    held_at_end = held(kv)
    attack.let_go()
    freed_s = wait_held(kv, before, 3.0)
    if freed_s is not None:
        freed = f"yes, {freed_s:.1f} s after {attack.let_go_words}"
    else:
        how = attack.clean_up()
        again = wait_held(kv, before, 10.0) if how else None
        freed = (f"not within 3 s after {attack.let_go_words}; "
                 + (f"after {how}: {'yes' if again is not None else 'no'}" if how else "no"))
    rss.sample()  # the daemon's memory once the hog let go
    result = AttackResult(attack.name, attack.what, dict(attack.codes), attack.details, {}, {},
                          before, during, held_at_end,
                          held(kv), freed, attack_end - attack_start,
                          rss.window_mib(attack_start, attack_end))
    return result, (quiet_start, attack_start, attack_end)


def victim_target(daemon: Daemon) -> str:
    """Where the victim connects: over IPv6 loopback when the host has it, so that it is
    another client than the hogs on 127.0.0.1 (the daemon's caps are per peer host)."""
    return f"[::1]:{daemon.port}" if socket.has_ipv6 else daemon.target


def watcher(target: str, tenancy: Tenancy) -> KVStoreClient:
    """The run's own client for the daemon's holdings: daemon-wide (the admin's view) with
    auth on."""
    if tenancy.on:
        return KVStoreClient(target, ADMIN, shared_memory=False, token=tenancy.token(ADMIN))
    return KVStoreClient(target, tenancy.hog_ns, shared_memory=False)


PROBES = ("lookup", "get", "health", "fresh")


def attacks(daemon: Daemon, scale: Scale, rss: RssSampler, lookup_keys: list[bytes],
            get_key: bytes, get_value: bytes, tenancy: Tenancy) -> list[AttackResult]:
    ctx = mp.get_context("spawn")
    out: Results = ctx.Queue()
    stop = ctx.Event()
    proc = ctx.Process(target=victim, args=(victim_target(daemon), lookup_keys, get_key,
                                            get_value, stop, out, tenancy))
    proc.start()
    out.get(timeout=60)
    results, windows = [], []
    hogs = (IdlePuts, UnreadGets, LeaseStorm, ReserveFull, PinStorm)
    with watcher(daemon.target, tenancy) as kv:
        for cls in hogs + (LOCAL_HOGS if tenancy.on else ()):
            attack = cls(daemon.target, scale, tenancy)
            result, times = run_attack(attack, kv, rss)
            print(f"# attack {result.name}: hog {result.hog_codes}; freed: {result.freed}",
                  flush=True)
            results.append(result)
            windows.append(times)
        kv.evict(all=True, namespace=tenancy.hog_ns)  # the hogs' blocks
    stop.set()
    samples = out.get(timeout=120)["samples"]
    proc.join(30)
    for result, (quiet_start, attack_start, attack_end) in zip(results, windows, strict=True):
        for probe in PROBES:
            result.quiet[probe] = Window.of(samples, probe, quiet_start, attack_start)
            result.attack[probe] = Window.of(samples, probe, attack_start, attack_end)
    return results
