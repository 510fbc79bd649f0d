"""The Markdown report of bench/soak.py (docs/RELIABILITY.md): one run per auth mode
(ModeRun), the summary and the victim's figures of every mode side by side in one table
each, then each mode's details; table, codes per row, sparkline, the *_rows and *_section
builders, report() and the "How to read this" text."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from figures import percentile
from soak_attacks import AttackResult, RssSampler
from soak_load import FAULTS, Tally, codes_text

from kvstore.units import MiB

MODE_NAMES = {"off": "auth off", "token": "auth token (two tenants, local path)"}


@dataclass
class ModeRun:
    """One auth mode's run: what bench/soak.py measured, for the report and the JSON."""

    auth: str
    summary: dict[str, Any]
    clients: Tally
    hostile: Tally
    results: list[AttackResult]
    rss: RssSampler

    @property
    def title(self) -> str:
        return MODE_NAMES.get(self.auth, self.auth)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"



def verb_rows(tally: Tally) -> list[list[object]]:
    return [[verb, f"{len(ms):,}", f"{percentile(ms, 0.5):.2f}", f"{percentile(ms, 0.99):.2f}",
             codes_text(tally.codes[verb])] for verb, ms in sorted(tally.latency_ms.items())]


def mib(n: int) -> str:
    return f"{n / MiB:,.0f}"


def sparkline(values: list[int], width: int = 72) -> str:
    if not values:
        return ""
    step = max(1, math.ceil(len(values) / width))
    points = [max(values[i : i + step]) for i in range(0, len(values), step)]
    low, high, ramp = min(points), max(points), " .:-=+*#%@"
    return "".join(ramp[0 if high == low else int((p - low) / (high - low) * (len(ramp) - 1))]
                   for p in points)


def rss_section(samples: list[tuple[float, str, int, int, int]]) -> str:
    rss = [s[2] for s in samples]
    picks = sorted({0, len(samples) - 1, rss.index(max(rss)),
                    *(i for i in range(1, len(samples)) if samples[i][1] != samples[i - 1][1]),
                    *range(0, len(samples), max(1, len(samples) // 10))})
    rows = [[f"{samples[i][0]:.0f}", samples[i][1], mib(samples[i][2]), mib(samples[i][3]),
             mib(samples[i][4])] for i in picks]
    return (f"VmRSS, one character per {max(1, math.ceil(len(rss) / 72))} s sample(s), "
            f"{mib(min(rss))} MiB (` `) to {mib(max(rss))} MiB (`@`):\n\n"
            f"```text\n{sparkline(rss)}\n```\n\n"
            + table(["t (s)", "phase", "VmRSS MiB", "RssAnon MiB", "RssShmem MiB"], rows))


def attack_rows(results: list[AttackResult]) -> list[list[object]]:
    rows: list[list[object]] = []
    for r in results:
        for probe in ("lookup", "get", "health", "fresh"):
            q, a = r.quiet.get(probe), r.attack.get(probe)
            if q is None or a is None or not (q.latency_ms or a.latency_ms):
                continue
            rows.append([r.name, probe, f"{q.p(0.5):.2f} / {q.p(0.99):.2f}",
                         f"{a.p(0.5):.2f} / {a.p(0.99):.2f}",
                         f"{a.codes.get('OK', 0):,} of {len(a.latency_ms):,}",
                         a.codes.get("DEADLINE_EXCEEDED", 0), a.on_local_path(),
                         a.failures()])
    return rows


def summary_rows(run: ModeRun) -> list[list[object]]:
    summary, clients, hostile = run.summary, run.clients, run.hostile
    end, objects = summary["after"], summary["after"]["objects"]
    rss_values = [s[2] for s in run.rss.samples]
    soak_codes = clients.by_code()
    return [
        ["requests sent by the soak clients", f"{clients.requests():,}"],
        ["requests sent by the hostile client", f"{hostile.requests():,}"],
        ["RPCs the daemon answered (its metrics, every phase)",
         f"{sum(end['metrics_by_code'].values()):,}"],
        ["daemon crashes", 0 if end["alive"] else 1],
        ["soak processes that exited non-zero", sum(1 for c in summary["exit_codes"] if c)],
        ["health at the end", end["health"]],
        ["INTERNAL / UNKNOWN answers seen by clients", summary["client_faults"]],
        ["INTERNAL / UNKNOWN answers in the daemon's metrics",
         sum(end["metrics_by_code"].get(c, 0) for c in FAULTS)],
        ["Tracebacks / ERROR lines in the daemon log",
         f"{end['tracebacks']} / {end['error_lines']}"],
        ["objects verified / lost / corrupted at the end",
         f"{objects['verified']:,} / {objects['lost']:,} / {objects['corrupted']:,}"],
        ["soak reads that missed / came back wrong (MISS, SHORT PREFIX / CORRUPT)",
         f"{soak_codes.get('MISS', 0) + soak_codes.get('SHORT PREFIX', 0)} / "
         f"{soak_codes.get('CORRUPT', 0)}"],
        ["checksum failures the tiers counted", end["checksum_failures"]],
        ["leases / reservations / pins left at the end",
         f"{end['leases']} / {end['reservations']} / {end['pinned']}"],
        ["longest wait of a soak stream on its client (histogram bound, by method)",
         ", ".join(f"{m} <= {s:g} s" for m, s in sorted(summary["stream_wait"].items()))
         or "-"],
        ["daemon VmRSS start / max / end (MiB)",
         f"{mib(rss_values[0])} / {mib(max(rss_values))} / {mib(rss_values[-1])}"],
        ["victim calls on the local path with shared memory, under attack",
         _on_local_path(run.results, ("lookup", "get"))],
        ["fresh victim clients that got the local path and shared memory, under attack",
         _on_local_path(run.results, ("fresh",))],
        ["run time", f"{summary['run_s']:.0f} s (soak {summary['soak_s']:.0f} s, attacks "
                     f"{summary['attacks_s']:.0f} s)"],
    ]


def _on_local_path(results: list[AttackResult], probes: tuple[str, ...]) -> str:
    fast = total = 0
    for r in results:
        for probe in probes:
            window = r.attack.get(probe)
            if window is not None:
                total += sum(window.paths.values())
                fast += window.paths.get("local path + shared memory", 0)
    return f"{fast:,} of {total:,}" if total else "- (no local path: no Unix socket)"


def both_modes_summary(runs: list[ModeRun]) -> str:
    """The summary of every mode, a column each, row by row."""
    columns = [summary_rows(r) for r in runs]
    rows = [[label, *(c[i][1] for c in columns)] for i, (label, _) in enumerate(columns[0])]
    return table(["figure", *(r.title for r in runs)], rows)


def both_modes_victim(runs: list[ModeRun]) -> str:
    """The victim's p99 quiet vs under attack and the daemon's RSS, every attack of every
    mode, side by side ("-" where a mode has no such attack)."""
    names = list(dict.fromkeys(r.name for run in runs for r in run.results))
    by_mode = [{r.name: r for r in run.results} for run in runs]
    headers = ["attack", "probe"]
    for run in runs:
        headers += [f"{run.auth}: p99 quiet → under attack (ms)",
                    f"{run.auth}: failed under attack"]
    rows = []
    for name in names:
        for probe in ("lookup", "get", "health", "fresh"):
            row: list[object] = [name, probe]
            seen = False
            for results in by_mode:
                r = results.get(name)
                window = r.attack.get(probe) if r else None
                if r is None or window is None or not window.latency_ms:
                    row += ["-", "-"]
                    continue
                seen = True
                row += [f"{r.quiet[probe].p(0.99):.2f} → {window.p(0.99):.2f}",
                        window.failures()]
            if seen:
                rows.append(row)
    rss = [[name, *(_rss_cell(results.get(name)) for results in by_mode)] for name in names]
    return "\n".join([
        table(headers, rows),
        "Daemon VmRSS (MiB) around each attack: the last sample before it → the largest while "
        "it held → just after it let go.\n",
        table(["attack", *(f"{run.auth}: RSS before → during → after" for run in runs)], rss)])


def _rss_cell(r: AttackResult | None) -> str:
    if r is None:
        return "-"
    before, during, after = r.rss_mib
    return f"{before:,.0f} → {during:,.0f} → {after:,.0f}"


def tried_section(runs: list[ModeRun], args: argparse.Namespace) -> str:
    first = runs[0].summary
    token = any(r.auth == "token" for r in runs)
    return (
        f"The same run in each mode ({', '.join(r.title for r in runs)}), each against one "
        "`kvstore-server` subprocess of its own (settings in each mode's section) with L2 in "
        "shared memory, L3 in a temporary folder and L4 on a real `redis-server`, all on "
        "loopback.\n\n"
        f"1. **Seed**: {' / '.join(str(r.summary['seeded']) for r in runs)} blocks ("
        f"{', '.join(r.auth for r in runs)}) of known content (shake-256 of namespace and key; "
        "sizes from 1 B to 1 MiB in chains of 8, and 64 shared blocks per tenant), put with "
        "`KVStoreClient`.\n"
        f"2. **Soak**: {args.clients} client processes (spawned) and one hostile process, "
        f"{first['requests_asked']:,} requests asked for (10% hostile), at most "
        f"{args.duration_s:.0f} s. Each client mixes put (shared memory / inline), get "
        "(inline), get_into (shared memory), lookup, prefetch and stats, 75% on chains of "
        "its own namespace and 25% on the shared blocks every client (of its tenant) re-puts "
        "and reads; every read is checked against the content it must have. The hostile "
        "process sends, over raw byte channels: random bytes to every method, valid requests "
        "with bytes flipped / set / inserted / deleted / duplicated / cut, Put streams with "
        "messages dropped, repeated or swapped, a header twice or none, data short or long, "
        "bogus and 100 kB Release ids, repeated keys, and Put / Get / Prefetch streams it "
        "cancels midway. It gives back the leases, reservations and pins it is granted "
        "(some are left to expire).\n"
        "3. **Attacks**, one at a time, while a victim process (on `::1`, a client of its "
        "own) probes Lookup (a seed chain), a Get (a 4 KiB seed block) and the "
        "`grpc.health.v1` check, each with a 2 s deadline: "
        f"{args.quiet_s:.1f} s of quiet measured just before each attack, then at least "
        f"{args.hold_s:.1f} s under it (the idle-stream attacks are held past "
        "`server.stream_idle_s` when the daemon has one). Then the hog lets go (cancels, "
        "disconnects, unpins) and Stats must show its leases / reservations / pins back at "
        "their pre-attack values.\n"
        "4. **After**: liveness and health, the daemon's own status counts and log, every "
        "block read back, leases and reservations (each must be gone within the 5 s "
        "timeouts configured here), RSS.\n"
        + (TOKEN_TRIED if token else ""))


TOKEN_TRIED = """
**With auth on** (`auth.mode=token`, `server.unix_socket`): tenant A owns the seed, the
soak clients 0 and 2 and the victim; tenant B the soak clients 1 and 3, the hostile process
and every hog; an admin token reads the daemon-wide figures. Every client with shared memory
trades an Attach ticket for its tenant's arena on the Unix socket and sends its hot verbs
(Lookup, shared-memory Get, Reserve, commit, Release) over local sessions there; the victim
is tenant A's `KVStoreClient` on that path, and every second it also starts a fresh client
and notes the path that one got. A third of the hostile process's requests go to the Unix
socket: 1-20 frames per session of mutated valid requests and random bytes (now and then one
of 64 KiB-1 MiB, bigger than every frame before it), a frame mutated header and all before
the stream ends, ticket lines forged, of 300 bytes, of random bytes, sent a byte at a time,
carrying descriptors (SCM_RIGHTS), and a ticket used twice; some gRPC calls carry no token
or a wrong one. Three more attacks: `slow_handshakes` (16 connections, no credential needed,
that send a handshake line a byte every 0.3 s and never end it), `idle_sessions` (another
process of the victim's own tenant opening 40 local sessions and leaving them idle) and
`big_headers` (waves of 31 sessions of tenant B that each send the 5-byte header of a
max-size frame and nothing more).
"""


def attack_section(results: list[AttackResult]) -> str:
    why = [[r.name, "hog", code, f"`{text}`"] for r in results
           for code, text in r.hog_details.items()]
    why += [[r.name, f"victim {probe}", code, f"`{text}`"] for r in results
            for probe in ("lookup", "get", "health")
            for code, text in r.attack[probe].details.items()]
    return "\n".join([
        table(["attack", "what the hog does", "held", "hog's statuses by code",
               "leases / reservations / pins: before → hog in place → end of hold → after",
               "freed"],
              [[r.name, r.what, f"{r.hold_s:.0f} s", codes_text(r.hog_codes),
                " → ".join("/".join(map(str, h)) for h in
                           (r.before, r.during, r.held_at_end, r.after)), r.freed]
               for r in results]),
        "Leases, reservations and pins are daemon-wide counts from Stats: the victim's own "
        "Get in flight can show as one lease.\n",
        "Victim latency: p50 / p99 in ms of the time to a served answer; a call that "
        "failed (refused, timed out, wrong answer) counts as the whole 2 s deadline.\n",
        table(["attack", "probe", "quiet p50 / p99", "under attack p50 / p99",
               "served under attack", "timeouts (2 s)", "on the local path under attack",
               "failed calls under attack"],
              attack_rows(results)),
        "Why calls were refused (the first message of each code):\n",
        table(["attack", "caller", "code", "message"], why) if why else "none\n",
    ])


def report(runs: list[ModeRun], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    parts = [
        "# Reliability: soak and attack run\n",
        f"Generated by `python bench/soak.py --modes {meta['modes']} --report "
        f"docs/RELIABILITY.md` ({meta['mode']}) on {meta['machine']}, {meta['date']}, in "
        f"{meta['run_s']:.0f} s. Every figure below comes from that one run, one daemon per "
        "auth mode: to change this file, change the script and rerun it.\n",
        "## Summary\n",
        both_modes_summary(runs),
        "## What was tried\n",
        tried_section(runs, args),
        "## Attacks: the victim's p99, quiet vs under attack, every mode\n",
        "p99 in ms of the time to a served answer (a call that failed counts as the whole "
        "2 s deadline); `fresh` is a client the victim started during the window (auth on): "
        "its first Get, from its start to its answer.\n",
        both_modes_victim(runs),
    ]
    for run in runs:
        parts += mode_sections(run)
    parts.append(HOW_TO_READ)
    return "\n".join(parts)


def mode_sections(run: ModeRun) -> list[str]:
    metrics = sorted(run.summary["after"]["metrics_by_code"].items(), key=lambda x: -int(x[1]))
    return [
        f"## {run.title[0].upper()}{run.title[1:]}\n",
        f"Settings: {run.summary['settings_text']}. Its limits as it reported them (Stats "
        f"with include_config): {', '.join(f'`{k}={v}`' for k, v in run.summary['caps'].items())}"
        ".\n",
        "### Soak: latency per verb (client side)\n",
        "Latency in ms. `MISS` / `SHORT PREFIX` / `CORRUPT`: the call succeeded but a block "
        "that must be there was not, or had other bytes.\n",
        table(["verb", "calls", "p50 ms", "p99 ms", "statuses by code"],
              verb_rows(run.clients)),
        "### Soak: the hostile client\n",
        table(["request", "calls", "p50 ms", "p99 ms", "statuses by code"],
              verb_rows(run.hostile)),
        "### The daemon's own count of statuses\n",
        "From `kvstore_rpc_latency_seconds_count{code=...}` at the end: every method, every "
        "phase, set-up and verification included (local-path requests are counted there "
        "too).\n",
        table(["code", "RPCs"], [[c, f"{n:,}"] for c, n in metrics]),
        "### Attacks: the victim under each attack vs. the quiet window before it\n",
        attack_section(run.results),
        "### Daemon RSS over time\n",
        rss_section(run.rss.samples),
    ]


HOW_TO_READ = """## How to read this

- **Crashes, INTERNAL / UNKNOWN, Tracebacks** must all be 0, in every mode: a hostile or
  broken request is answered with the status the contract names (INVALID_ARGUMENT,
  RESOURCE_EXHAUSTED, FAILED_PRECONDITION, ABORTED, UNAUTHENTICATED, ...), never with a
  fault; on the Unix socket, a frame that cannot be read whole ends its session, and only
  that one. Client-side CANCELLED (by the client) is the hostile client hanging up on
  purpose. A Traceback in the log is a thread of the daemon that died on what a client
  sent.
- **lost / corrupted** must be 0: every block put (seed, shared, and every block each soak
  client put) is read back at the end with checksums off in the client, so damage shows as
  damage rather than as a miss. With L4 on, a block L2 and L3 had to drop is still in Redis.
- **Victim p99 under attack vs quiet**: the `bench attack_*` lines (`bench token_attack_*`
  with auth on) print it as a ratio (quiet / under attack; below 1 means the victim got
  slower). A hog may slow the victim; it must not starve it: timeouts (2 s) should be 0 and
  Lookup and health always answer. A call that failed counts as the whole 2 s deadline in
  the percentiles, so a victim whose Get is refused at once (RESOURCE_EXHAUSTED while the
  hog holds the stream slots) shows as starved, not as fast; the failures are listed by
  code, with the daemon's message.
- **The local path** (auth on): "on the local path under attack" counts the victim's calls
  made while its hot verbs went over the Unix socket and its blocks through its tenant's
  arena; `fresh` rows are clients the victim started during the window, and how many of them
  got that path. A hog may send a newcomer over gRPC for a moment (its calls still succeed);
  it must not keep it there after the hog is gone: a client refused a session or an arena
  tries again later, it does not stay off for life.
- Every process here runs on one host, over loopback. With auth off the daemon tells gRPC
  clients apart by the peer's host, so the victim connects over IPv6 loopback (`::1`) and
  every hog and soak client over `127.0.0.1`: two clients, as two hosts or pods would be.
  Were they one client, a refusal the hog earned (a per-client cap) would land on the victim
  too. With auth on a client is its tenant: the hogs are tenant B, the victim tenant A
  (but for `idle_sessions`, another process of A's own).
- **freed**: once the hog cancels, disconnects or unpins, its leases, reservations and pins
  should go back to the pre-attack count without help; "end of hold" shows what the daemon
  already let go by itself (an idle-stream limit) while the hog still held on. Where the
  daemon cannot see the hog go (unary Gets and Reserves with 10-minute timeouts), the run
  releases the ids itself and says so; per-client caps (`clients.*`) bound how much one
  client can hold meanwhile.
- **RSS**: VmRSS includes the touched pages of the L2 shared-memory segment (RssShmem),
  which grow with the data held. RssAnon is the daemon's own heap: it grows with the index
  as the soak stores blocks, and with the buffers an attack makes the daemon allocate (the
  48 MiB block of the unread Gets); CPython and glibc seldom hand freed heap back, so a
  plateau after an attack is expected, while a climb that goes on when nothing new is
  stored would be a leak, and so would memory that five bytes (`big_headers`) made the
  daemon take and keep.
- Figures come from one run on the machine named above (two cores run the daemon, Redis, the
  clients and the hog together): compare runs on the same machine, not across machines.

The bounded, CI-run versions of these checks are the daemon's tests:
`tests/integration/test_stream_caps.py` (idle and unread streams),
`tests/integration/test_hostile_requests.py` (requests a broken client sends),
`tests/integration/test_fuzz.py` (hypothesis fuzzing of every method),
`tests/integration/test_local_attacks.py` (the local path and the Unix socket under attack,
both auth modes, with victims started before, during and after each attack),
`tests/integration/test_faults.py` and `tests/integration/test_l3_faults.py` (tier and L3
faults). This run is the long, unbounded-by-CI version: more requests, more at once, and
attacks held open.
"""
