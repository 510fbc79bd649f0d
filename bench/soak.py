"""Soak and attack run against a real `kvstore-server` subprocess (L2 in shared memory, L3 in a
temporary folder, L4 on a real `redis-server`), all in one run, in each auth mode of --modes
(default both: `off`, then `token`); regenerates docs/RELIABILITY.md with
`python bench/soak.py --report docs/RELIABILITY.md`.

With auth off (the daemon's default) everyone is one tenant and the clients reach the named
L2 segment; the victim calls over raw gRPC. With `token`, the same run again against a daemon
with auth.mode=token, two tenants and a Unix socket (server.unix_socket): tenant A owns the
seed, half the soak clients and the victim, tenant B the other half, the hostile process and
the hogs; every client with shared memory gets its tenant's arena and the local path (the hot
verbs over the socket), the victim included, and the hostile process also sends garbage and
mutated frames on local sessions and abuses the socket's handshake (forged, repeated, long,
slow tickets, descriptors passed). Three more attacks run in that mode: slow handshakes on the
socket, another process of A holding idle local sessions, and waves of 5-byte headers of
max-size frames. Who is whom is bench/soak_local.py's Tenancy.

1. Seed: blocks of known content (shake-256 of namespace and key, so any reader can check
   them) are put with KVStoreClient and remembered.
2. Soak: --clients processes (multiprocessing, spawn) mix put (shared memory and inline),
   get (inline), get_into (shared memory), lookup, prefetch and stats on their own and on
   shared keys, checking every read, while ONE hostile process sends fuzzed requests over
   raw byte channels: random bytes, mutated valid requests, bogus ids, repeated keys, Put
   streams of the wrong shape, streams it cancels midway (and, with auth on, its share on
   the Unix socket). --requests in all (10% hostile), or until --duration-s. The daemon's
   RSS is sampled every second throughout.
3. Attacks, one at a time, while a victim process probes Lookup, an inline Get and the
   grpc.health.v1 check with 2 s deadlines: (a) 64 idle header-only Put streams, (b) 64
   inline Gets of a 48 MiB block nobody reads, (c) a lease storm (shared-memory Gets with
   10-minute leases, never released), (d) Reserves of 8 MiB with 10-minute timeouts until
   refused, (e) a pin storm over 8 MiB blocks. Each is compared with a quiet window
   measured just before it; the hog's statuses are counted, then it lets go (cancels,
   disconnects, unpins) and Stats must show its leases / reservations / pins gone.
4. After: the daemon is alive and SERVING, no INTERNAL or UNKNOWN status (clients, and the
   daemon's own `kvstore_rpc_latency_seconds_count`), every block put reads back bit-exact
   (verified / lost / corrupted), no lease or reservation outlives its timeout, RSS
   start / max / end.

Prints `bench attack_<a>_<probe>_p99: <under attack> ms vs quiet <quiet> ms = <ratio>x`
(ratio < 1: the victim is slower under attack; `token_attack_...` in the auth-on mode), `#`
info lines and, with --json, JSON (one entry per mode under "modes").

This file runs the phases; the load (soak and hostile clients) is in soak_load.py, the hogs
in soak_hogs.py, the victim and the measuring of each attack in soak_attacks.py, and the
Markdown report in soak_report.py.
"""

from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing as mp
import os
import platform
import queue
import re
import socket
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
from figures import Figure, run_main
from soak_attacks import RssSampler, attacks, held, wait_held, watcher
from soak_hogs import HOG_BLOCK, Scale
from soak_load import (
    FAULTS,
    LEASE_TIMEOUT_S,
    SEED_SIZES,
    TIMEOUT_S,
    Results,
    Tally,
    codes_text,
    hostile_client,
    key_of,
    payload,
    shared_blocks,
    soak_client,
)
from soak_local import A, Tenancy
from soak_report import ModeRun, report

from kvstore.client import KVStoreClient
from kvstore.tools.testing import Daemon, start_daemon, start_redis
from kvstore.units import KiB, MiB, parse_size

# --- the daemon's metrics ------------------------------------------------------------------


def rpc_counts(daemon: Daemon) -> dict[tuple[str, str], float]:
    """(method, code) -> RPCs answered, from the daemon's Prometheus endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics",
                                  timeout=TIMEOUT_S).read().decode()
    pattern = r'kvstore_rpc_latency_seconds_count\{code="(\w+)",method="(\w+)"\} (\S+)'
    return {(m, c): float(n) for c, m, n in re.findall(pattern, text)}


def longest_stream_wait_s(daemon: Daemon) -> dict[str, float]:
    """Per streaming method, the bound of the smallest bucket of the daemon's
    kvstore_stream_longest_wait_seconds histogram that holds every finished stream: no
    stream waited longer on its client than that (the figure server.stream_idle_s is set
    against). inf when some waited past the largest bucket."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics",
                                  timeout=TIMEOUT_S).read().decode()
    pattern = r'kvstore_stream_longest_wait_seconds_bucket\{le="([^"]+)",method="(\w+)"\} (\S+)'
    buckets: dict[str, list[tuple[float, float]]] = {}
    for le, method, n in re.findall(pattern, text):
        buckets.setdefault(method, []).append((float(le), float(n)))
    out = {}
    for method, rows in buckets.items():
        rows.sort()
        total = rows[-1][1]
        if total:
            out[method] = next(le for le, n in rows if n == total)
    return out


# --- phases 1, 2 and 4 ------------------------------------------------------------------------


def seed(target: str, tenancy: Tenancy) -> list[tuple[str, bytes, int]]:
    """The seed chains (16 x 8 blocks of SEED_SIZES, tenant A's) and each tenant's shared
    keys, put and returned."""
    blocks: list[tuple[str, bytes, int]] = []
    seed_ns = tenancy.seed_ns
    with KVStoreClient(target, seed_ns, token=tenancy.token(A)) as kv:
        for chain in range(16):
            keys = [key_of(seed_ns, chain * 8 + i) for i in range(8)]
            values = [payload(seed_ns, k, n) for k, n in zip(keys, SEED_SIZES, strict=True)]
            if kv.put(keys, values).stored != len(keys):
                raise RuntimeError("the seed put did not store every block")
            blocks += [(seed_ns, k, len(v)) for k, v in zip(keys, values, strict=True)]
    for tenant, shared_ns in tenancy.shared_namespaces().items():
        with KVStoreClient(target, shared_ns, token=tenancy.token(tenant)) as kv:
            pairs = shared_blocks()
            kv.put([k for k, _ in pairs], [payload(shared_ns, k, n) for k, n in pairs],
                   independent=True)
            blocks += [(shared_ns, k, n) for k, n in pairs]
    return blocks


def soak(target: str, args: argparse.Namespace, tenancy: Tenancy
         ) -> tuple[Tally, Tally, list[Any], list[int]]:
    """The soak clients and the hostile one, in spawned processes: their tallies, every
    block the clients put, and each process's exit code."""
    ctx = mp.get_context("spawn")
    out: Results = ctx.Queue()
    hostile_requests = max(1, args.requests // 10)
    per_client = (args.requests - hostile_requests) // args.clients
    procs = [ctx.Process(target=soak_client,
                         args=(i, target, per_client, args.duration_s, out, tenancy))
             for i in range(args.clients)]
    procs.append(ctx.Process(target=hostile_client,
                             args=(target, hostile_requests, args.duration_s, out, tenancy)))
    for p in procs:
        p.start()
    clients, hostile, blocks = Tally(), Tally(), []
    deadline = time.monotonic() + args.duration_s + 120
    for _ in procs:
        while True:
            try:
                result = out.get(timeout=1.0)
                break
            except queue.Empty:
                if time.monotonic() > deadline or not any(p.is_alive() for p in procs):
                    raise RuntimeError("a soak process died before reporting") from None
        (clients if result["role"] == "client" else hostile).merge(result["tally"])
        blocks += result["blocks"]
    for p in procs:
        p.join(30)
    return clients, hostile, blocks, [p.exitcode if p.exitcode is not None else -1
                                      for p in procs]


def verify(target: str, blocks: list[tuple[str, bytes, int]], tenancy: Tenancy
           ) -> dict[str, int]:
    """Every block put reads back as put (each namespace by its own tenant): verified, lost
    (a miss) or corrupted (other bytes). Checksums are not verified by the client here, so
    damage shows as damage."""
    by_ns: dict[str, dict[bytes, int]] = {}
    for ns, key, size in blocks:
        by_ns.setdefault(ns, {})[key] = size
    counts: Counter[str] = Counter()
    for ns, sizes in by_ns.items():
        keys = list(sizes)
        with KVStoreClient(target, ns, shared_memory=False, verify_checksums=False,
                           token=tenancy.token(tenancy.owner(ns))) as kv:
            for i in range(0, len(keys), 64):
                batch = keys[i : i + 64]
                for key, got in zip(batch, kv.get(batch), strict=True):
                    counts["lost" if got is None else "verified"
                           if got == payload(ns, key, sizes[key]) else "corrupted"] += 1
    return {k: counts[k] for k in ("verified", "lost", "corrupted")}


def after(daemon: Daemon, blocks: list[tuple[str, bytes, int]], tenancy: Tenancy
          ) -> dict[str, Any]:
    """The end state: alive, SERVING, blocks intact, nothing left held, the daemon's own
    count of statuses, its log."""
    log = daemon.log()
    end: dict[str, Any] = {
        "alive": daemon.proc.poll() is None, "tracebacks": log.count("Traceback"),
        "error_lines": sum(" ERROR " in line for line in log.splitlines())}
    if not end["alive"]:
        return end | {"health": "DEAD", "objects": {"verified": 0, "lost": len(blocks),
                                                    "corrupted": 0},
                      "leases": -1, "reservations": -1, "pinned": -1, "settled_s": None,
                      "metrics_by_code": {}, "config": {}, "checksum_failures": 0}
    end["objects"] = verify(daemon.target, blocks, tenancy)
    with watcher(daemon.target, tenancy) as kv:
        end["health"] = kv.health()
        end["settled_s"] = wait_held(kv, (0, 0, 0), LEASE_TIMEOUT_S + 5.0)
        end["leases"], end["reservations"], end["pinned"] = held(kv)
        stats = kv.stats(include_config=True)
    metrics: Counter[str] = Counter()
    for (_, code), n in rpc_counts(daemon).items():
        metrics[code] += int(n)
    return end | {"metrics_by_code": dict(metrics), "config": stats.config() or {},
                  "checksum_failures": sum(t.checksum_failures for t in stats.tiers)}


# --- main ------------------------------------------------------------------------------------


def machine() -> str:
    cpu = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
    mem = re.search(r"MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text())
    return (f"{platform.node()} ({os.cpu_count()} CPUs, {cpu[1].strip() if cpu else '?'}, "
            f"{int(mem[1]) * KiB / (1 << 30) if mem else 0:.0f} GiB RAM, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
            f"grpcio {grpc.__version__})")


def size_text(n: int) -> str:
    return f"{n // MiB}MiB" if n % MiB == 0 else str(n)


def daemon_settings(args: argparse.Namespace, redis_url: str) -> list[str]:
    host = ["server.host=[::]"] if socket.has_ipv6 else []  # IPv4 and IPv6 loopback both
    quick = ["server.stream_idle_s=3"] if args.quick else []  # the idle-stream hogs' hold
    return [*host, f"dram.capacity_bytes={size_text(args.l2)}", "dram.page_size_bytes=4KiB",
            f"nvme.capacity_bytes={size_text(args.l3)}", "nvme.page_size_bytes=4KiB",
            f"remote.url={redis_url}", f"leases.lease_timeout_s={LEASE_TIMEOUT_S}",
            f"leases.reservation_timeout_s={LEASE_TIMEOUT_S}", "leases.sweep_interval_s=0.5",
            "log_level=WARNING", *quick, *args.set]


def settings_text(settings: list[str], workdir: Path) -> str:
    """The settings as the report shows them: no Redis URL, temporary paths as <tmp>."""
    return ", ".join(f"`{s.replace(str(workdir), '<tmp>')}`" for s in settings
                     if not s.startswith("remote."))


def caps_of(config: dict[str, Any]) -> dict[str, Any]:
    """The daemon's stream limits and per-client caps (whichever of them it has)."""
    server = config.get("server", {})
    caps = {f"server.{k}": server[k] for k in ("workers", "max_streams",
                                               "max_streams_per_connection", "stream_idle_s")
            if k in server}
    caps |= {f"clients.{k}": v for k, v in config.get("clients", {}).items()}
    caps |= {f"leases.{k}": v for k, v in config.get("leases", {}).items()}
    return caps


def figures_of(run: ModeRun) -> list[Figure]:
    prefix = "" if run.auth == "off" else f"{run.auth}_"
    return [Figure(f"{prefix}attack_{r.name}_{probe}_p99", r.attack[probe].p(0.99), "quiet",
                   r.quiet[probe].p(0.99), "ms", lower_is_better=True,
                   extra={"timeouts": r.attack[probe].codes.get("DEADLINE_EXCEEDED", 0),
                          "codes": dict(r.attack[probe].codes), "hog_codes": r.hog_codes,
                          "freed": r.freed, "rss_mib": r.rss_mib,
                          "victim_paths": dict(r.attack[probe].paths)})
            for r in run.results for probe in ("lookup", "get", "health")]


def run(args: argparse.Namespace) -> tuple[list[Figure], dict[str, Any]]:
    started = time.monotonic()
    runs = [run_mode(args, auth) for auth in args.modes]
    if args.report:
        args.report.write_text(report(runs, args, {
            "mode": "--quick" if args.quick else f"--requests {args.requests}",
            "modes": ",".join(args.modes), "machine": machine(),
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "run_s": time.monotonic() - started}))
        print(f"# wrote {args.report}", flush=True)
    return [f for r in runs for f in figures_of(r)], {"modes": {r.auth: setup_of(r)
                                                              for r in runs}}


def setup_of(run: ModeRun) -> dict[str, Any]:
    """A mode's JSON: its summary less the daemon's config, and its raw counts."""
    summary, end = run.summary, run.summary["after"]
    setup = {k: v for k, v in summary.items() if k != "after"}
    return setup | {"after": {k: v for k, v in end.items() if k != "config"},
                    "requests": run.clients.requests() + run.hostile.requests(),
                    "client_codes": dict(run.clients.by_code()),
                    "hostile_codes": dict(run.hostile.by_code()),
                    "rss_bytes": [s[2] for s in run.rss.samples]}


def run_mode(args: argparse.Namespace, auth: str) -> ModeRun:
    """The whole run (seed, soak, attacks, after) in one auth mode, against a daemon and a
    Redis of its own."""
    print(f"# == auth {auth}", flush=True)
    started = time.monotonic()
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-")))
        tenancy = Tenancy(auth, str(workdir / "kv.sock") if auth != "off" else "")
        redis = start_redis(workdir)
        stack.callback(redis.stop)
        settings = daemon_settings(args, redis.url) + tenancy.settings(workdir)
        daemon = start_daemon(workdir, *settings)
        stack.callback(daemon.stop)
        rss = RssSampler(daemon.proc.pid)
        with watcher(daemon.target, tenancy) as kv:
            config = kv.stats(include_config=True).config() or {}
        scale = Scale(args.quiet_s, args.hold_s, args.leases, 2 * args.l2 // HOG_BLOCK + 8,
                      max(2, 3 * args.l2 // HOG_BLOCK // 4),
                      float(config.get("server", {}).get("stream_idle_s", 0)))
        rss.phase = "seed"
        blocks = seed(daemon.target, tenancy)
        seeded = len(blocks)
        print(f"# seeded {len(blocks)} blocks; soak: {args.clients} clients + 1 hostile",
              flush=True)
        rss.phase = "soak"
        soak_start = time.monotonic()
        clients, hostile, put, exits = soak(daemon.target, args, tenancy)
        soak_s = time.monotonic() - soak_start
        stream_wait = longest_stream_wait_s(daemon)  # before the attacks idle on purpose
        blocks += put
        print(f"# soak: {clients.requests():,} client + {hostile.requests():,} hostile requests "
              f"in {soak_s:.0f} s; {codes_text(clients.by_code())}", flush=True)
        attacks_start = time.monotonic()
        lookup_keys = [key_of(tenancy.seed_ns, 8 + i) for i in range(8)]
        results = attacks(daemon, scale, rss, lookup_keys, lookup_keys[2],
                          payload(tenancy.seed_ns, lookup_keys[2], SEED_SIZES[2]), tenancy)
        attacks_s = time.monotonic() - attacks_start
        rss.phase = "after"
        end = after(daemon, blocks, tenancy)
        rss.stop()
    client_faults = sum(t.by_code().get(c, 0) for t in (clients, hostile) for c in FAULTS)
    client_faults += sum(n for r in results for c, n in r.hog_codes.items() if c in FAULTS)
    summary = {
        "auth": auth, "settings_text": settings_text(settings, workdir),
        "seeded": seeded, "requests_asked": args.requests,
        "client_faults": client_faults, "after": end, "caps": caps_of(end["config"]),
        "run_s": time.monotonic() - started, "soak_s": soak_s, "attacks_s": attacks_s,
        "exit_codes": exits, "stream_wait": stream_wait,
    }
    print_summary(summary, clients, hostile)
    return ModeRun(auth, summary, clients, hostile, results, rss)


def print_summary(summary: dict[str, Any], clients: Tally, hostile: Tally) -> None:
    end = summary["after"]
    print(f"# requests: {clients.requests() + hostile.requests():,} (clients "
          f"{clients.requests():,}, hostile {hostile.requests():,}); daemon RPCs "
          f"{sum(end['metrics_by_code'].values()):,}: {codes_text(end['metrics_by_code'])}")
    print(f"# crashes {0 if end['alive'] else 1}; INTERNAL/UNKNOWN: clients "
          f"{summary['client_faults']}, daemon metrics "
          f"{sum(end['metrics_by_code'].get(c, 0) for c in FAULTS)}; objects {end['objects']}; "
          f"left held: leases {end['leases']}, reservations {end['reservations']}, pins "
          f"{end['pinned']}; tracebacks {end['tracebacks']}", flush=True)


def modes_arg(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in ("off", "token") for m in modes):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of off and token")
    return modes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100_000,
                        help="soak requests in all, 10%% of them hostile (default 100000)")
    parser.add_argument("--duration-s", type=float, default=240.0,
                        help="stop the soak after this long even if --requests are not sent")
    parser.add_argument("--clients", type=int, default=4, help="soak client processes")
    parser.add_argument("--leases", type=int, default=4000, help="Gets of the lease storm")
    parser.add_argument("--quiet-s", type=float, default=3.0, help="quiet window per attack")
    parser.add_argument("--hold-s", type=float, default=5.0, help="how long each hog holds")
    parser.add_argument("--l2", type=parse_size, default=256 * MiB, help="L2 capacity")
    parser.add_argument("--l3", type=parse_size, default=1024 * MiB, help="L3 capacity")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="more daemon settings (e.g. clients.max_leases=1000); repeatable")
    parser.add_argument("--modes", type=modes_arg, default=["off", "token"],
                        help="auth modes to run, in order, comma-separated (default off,token)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 5000 requests, 500 leases, short windows, idle "
                             "streams aborted after 3 s (overrides)")
    parser.add_argument("--report", type=Path, help="write the Markdown report here")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="also write one JSON object to PATH")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.leases, args.quiet_s, args.hold_s = 5000, 500, 1.5, 2.0
    if args.requests < args.clients + 1 or args.clients < 1 or args.leases < 4:
        parser.error("--clients >= 1, --requests > --clients, --leases >= 4")
    return run_main(args, run)


if __name__ == "__main__":
    sys.exit(main())
