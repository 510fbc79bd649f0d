"""The Markdown report of bench/soak.py (docs/RELIABILITY.md): table, codes per row,
sparkline, the *_rows and *_section builders, report() and the "How to read this" text."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

from figures import percentile
from soak_attacks import AttackResult, RssSampler
from soak_load import FAULTS, Tally, codes_text

from kvstore.units import MiB


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
            f"```\n{sparkline(rss)}\n```\n\n"
            + table(["t (s)", "phase", "VmRSS MiB", "RssAnon MiB", "RssShmem MiB"], rows))


def attack_rows(results: list[AttackResult]) -> list[list[object]]:
    rows: list[list[object]] = []
    for r in results:
        for probe in ("lookup", "get", "health"):
            q, a = r.quiet[probe], r.attack[probe]
            rows.append([r.name, probe, f"{q.p(0.5):.2f} / {q.p(0.99):.2f}",
                         f"{a.p(0.5):.2f} / {a.p(0.99):.2f}",
                         f"{a.codes.get('OK', 0):,} of {len(a.latency_ms):,}",
                         a.codes.get("DEADLINE_EXCEEDED", 0), a.failures()])
    return rows


def summary_rows(summary: dict[str, Any], clients: Tally, hostile: Tally,
                 rss: RssSampler) -> list[list[object]]:
    end, objects = summary["after"], summary["after"]["objects"]
    rss_values = [s[2] for s in rss.samples]
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
        ["run time", f"{summary['run_s']:.0f} s (soak {summary['soak_s']:.0f} s, attacks "
                     f"{summary['attacks_s']:.0f} s)"],
    ]


def tried_section(summary: dict[str, Any], args: argparse.Namespace) -> str:
    caps = ", ".join(f"`{k}={v}`" for k, v in summary["caps"].items())
    return (
        f"One `kvstore-server` subprocess ({summary['settings_text']}) with L2 in shared "
        "memory, L3 in a temporary folder and L4 on a real `redis-server`, all on loopback. "
        f"Its limits as it reported them (Stats with include_config): {caps}.\n\n"
        f"1. **Seed**: {summary['seeded']} blocks of known content (shake-256 of namespace and "
        "key; sizes from 1 B to 1 MiB in chains of 8, and 64 shared blocks), put with "
        "`KVStoreClient`.\n"
        f"2. **Soak**: {args.clients} client processes (spawned) and one hostile process, "
        f"{summary['requests_asked']:,} requests asked for (10% hostile), at most "
        f"{args.duration_s:.0f} s. Each client mixes put (shared memory / inline), get "
        "(inline), get_into (shared memory), lookup, prefetch and stats, 75% on chains of "
        "its own namespace and 25% on the shared blocks every client re-puts and reads; every "
        "read is checked against the content it must have. The hostile process sends, over "
        "raw byte channels: random bytes to every method, valid requests with bytes flipped "
        "/ set / inserted / deleted / duplicated / cut, Put streams with messages dropped, "
        "repeated or swapped, a header twice or none, data short or long, bogus and 100 kB "
        "Release ids, repeated keys, and Put / Get / Prefetch streams it cancels midway. It "
        "gives back the leases, reservations and pins it is granted (some are left to "
        "expire).\n"
        "3. **Attacks**, one at a time, while a victim process (on `::1`, a client of its "
        "own) probes Lookup (a seed chain), "
        "an inline Get (a 4 KiB seed block) and the `grpc.health.v1` check, each with a 2 s "
        f"deadline: {args.quiet_s:.1f} s of quiet measured just before each attack, then at "
        f"least {args.hold_s:.1f} s under it (the idle-stream attacks are held past "
        "`server.stream_idle_s` when the daemon has one). Then the hog lets go (cancels, "
        "disconnects, unpins) and Stats must show its leases / reservations / pins back at "
        "their pre-attack values.\n"
        "4. **After**: liveness and health, the daemon's own status counts and log, every "
        "block read back, leases and reservations (each must be gone within the 5 s "
        "timeouts configured here), RSS.\n")


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
               "served under attack", "timeouts (2 s)", "failed calls under attack"],
              attack_rows(results)),
        "Why calls were refused (the first message of each code):\n",
        table(["attack", "caller", "code", "message"], why) if why else "none\n",
    ])


def report(summary: dict[str, Any], clients: Tally, hostile: Tally,
           results: list[AttackResult], rss: RssSampler, args: argparse.Namespace) -> str:
    metrics = sorted(summary["after"]["metrics_by_code"].items(), key=lambda x: -int(x[1]))
    return "\n".join([
        "# Reliability: soak and attack run\n",
        "Generated by `python bench/soak.py --report docs/RELIABILITY.md` "
        f"({summary['mode']}) on {summary['machine']}, {summary['date']}. Every figure below "
        "comes from that one run: to change this file, change the script and rerun it.\n",
        "## Summary\n",
        table(["figure", "value"], summary_rows(summary, clients, hostile, rss)),
        "## What was tried\n",
        tried_section(summary, args),
        "## Soak: latency per verb (client side)\n",
        "Latency in ms. `MISS` / `SHORT PREFIX` / `CORRUPT`: the call succeeded but a block "
        "that must be there was not, or had other bytes.\n",
        table(["verb", "calls", "p50 ms", "p99 ms", "statuses by code"], verb_rows(clients)),
        "## Soak: the hostile client\n",
        table(["request", "calls", "p50 ms", "p99 ms", "statuses by code"], verb_rows(hostile)),
        "## The daemon's own count of statuses\n",
        "From `kvstore_rpc_latency_seconds_count{code=...}` at the end: every method, every "
        "phase, set-up and verification included.\n",
        table(["code", "RPCs"], [[c, f"{n:,}"] for c, n in metrics]),
        "## Attacks: the victim under each attack vs. the quiet window before it\n",
        attack_section(results),
        "## Daemon RSS over time\n",
        rss_section(rss.samples),
        HOW_TO_READ,
    ])


HOW_TO_READ = """## How to read this

- **Crashes, INTERNAL / UNKNOWN, Tracebacks** must all be 0: a hostile or broken request is
  answered with the status the contract names (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
  FAILED_PRECONDITION, ABORTED, ...), never with a fault. Client-side CANCELLED (by the
  client) is the hostile client hanging up on purpose.
- **lost / corrupted** must be 0: every block put (seed, shared, and every block each soak
  client put) is read back at the end with checksums off in the client, so damage shows as
  damage rather than as a miss. With L4 on, a block L2 and L3 had to drop is still in Redis.
- **Victim p99 under attack vs quiet**: the `bench attack_*` lines print it as a ratio
  (quiet / under attack; below 1 means the victim got slower). A hog may slow the victim; it
  must not starve it: timeouts (2 s) should be 0 and Lookup and health always answer.
  A call that failed counts as the whole 2 s deadline in the percentiles, so a victim whose
  Get is refused at once (RESOURCE_EXHAUSTED while the hog holds the stream slots) shows as
  starved, not as fast; the failures are listed by code, with the daemon's message.
- Every process here runs on one host, over loopback. The daemon tells clients apart by the
  peer's host, so the victim connects over IPv6 loopback (`::1`) and every hog and soak
  client over `127.0.0.1`: two clients, as two hosts or pods would be. Were they one
  client, a refusal the hog earned (a per-client cap) would land on the victim too.
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
  stored would be a leak.
- Figures come from one run on the machine named above (two cores run the daemon, Redis, the
  clients and the hog together): compare runs on the same machine, not across machines.

The bounded, CI-run versions of these checks are the daemon's tests:
`tests/integration/test_stream_caps.py` (idle and unread streams),
`tests/integration/test_hostile_requests.py` (requests a broken client sends),
`tests/integration/test_fuzz.py` (hypothesis fuzzing of every method),
`tests/integration/test_faults.py` and `tests/integration/test_l3_faults.py` (tier and L3
faults). This run is the long, unbounded-by-CI version: more requests, more at once, and
attacks held open.
"""
