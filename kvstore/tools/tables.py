"""The tables and views `kvstore-admin` prints, built from the client's results; no I/O.

    stats_view     per-tier table, movement/health table, what each client holds, and the
                   summary (also the demos' view)
    lookup_table   one row per key: its tier, or a miss
    hot_table      the hottest L4 blocks and their scores
    prewarm_columns  the columns of prewarm's progress bar

L4's "on" cell shows its circuit breaker: up, down or probing. L4's capacity is Redis's
maxmemory; a Redis without one (maxmemory 0, its default) shows "unlimited", not "0 B". The
summary opens with the daemon's auth mode and the caller's tenant, and warns in red when auth
is off. Keys are shown whole (64 hex digits: what `lookup`, `pin` and `evict --key` take).
Sizes and bandwidths use one family of units, binary (kvstore.units.format_size: KiB, MiB,
GiB; MiB/s).
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group
from rich.progress import BarColumn, ProgressColumn, Task, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from kvstore.client import Stats, TierStats
from kvstore.keys import KEY_BYTES, BlockKey
from kvstore.units import format_size

AUTH_OFF_WARNING = "auth is OFF: any caller may read or evict every namespace"
# L4's circuit breaker states as the stats table shows them.
_BREAKER_CELLS = {"closed": "[green]up", "open": "[red]down", "half-open": "[yellow]probing"}


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def _bandwidth(rate_bytes_s: float) -> str:
    """ "774.7 MiB/s" or "6.0 GiB/s" (the units of every size shown); "-" untimed."""
    if rate_bytes_s <= 0:
        return "-"
    return f"{format_size(int(rate_bytes_s))}/s"


def _capacity(t: TierStats) -> tuple[str, str]:
    """The capacity and used% cells of an enabled tier. Only L4 has none: a Redis without
    maxmemory reports 0, which is no limit rather than no room."""
    if t.capacity_bytes == 0:
        return "unlimited", "-"
    return format_size(t.capacity_bytes), _percent(t.used_fraction)


def _tier_table(stats: Stats, target: str) -> Table:
    """One row per tier: how it moves bytes, capacity, use, hits."""
    table = Table(title=f"kvstore {stats.version or '?'} at {target}", title_justify="left")
    for column in ("tier", "on", "backend"):
        table.add_column(column, no_wrap=True)
    for column in ("capacity", "used", "used%", "objects", "hits", "misses", "hit%", "evicted"):
        table.add_column(column, justify="right", no_wrap=True)
    for t in stats.tiers:
        on = t.enabled
        capacity, used_percent = _capacity(t) if on else ("-", "-")
        table.add_row(
            t.tier,
            (_BREAKER_CELLS.get(t.state, t.state) or "yes") if on else "no",
            t.backend or "-",
            capacity,
            format_size(t.used_bytes) if on else "-",
            used_percent,
            f"{t.objects:,}",
            f"{t.hits:,}",
            f"{t.misses:,}",
            _percent(t.hit_rate),
            f"{t.evictions:,}",
        )
    return table


# (column, TierStats attribute): block counts and the transfers in flight now
_MOVEMENT_COUNTS = (
    ("promoted", "promotions"),
    ("demoted", "demotions"),
    ("refused", "admissions_refused"),
    ("checksum fail", "checksum_failures"),
    ("io errors", "io_errors"),
    ("queue", "queue_depth"),
)


def _movement_table(stats: Stats) -> Table:
    """Enabled tiers only: blocks moved between tiers, refusals, errors, queue and bandwidth."""
    table = Table("tier", title="movement and health", title_justify="left")
    for column in [name for name, _ in _MOVEMENT_COUNTS] + ["read", "write"]:
        table.add_column(column, justify="right", no_wrap=True)
    for t in (t for t in stats.tiers if t.enabled):
        table.add_row(
            t.tier,
            *(f"{getattr(t, attr):,}" for _, attr in _MOVEMENT_COUNTS),
            _bandwidth(t.read_bandwidth_bytes_s),
            _bandwidth(t.write_bandwidth_bytes_s),
        )
    return table


def stats_view(stats: Stats, target: str) -> Group:
    """The per-tier table, the movement/health table and the summary, as one renderable."""
    summary = Table(show_header=False, box=None, padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    lookups = stats.hits + stats.misses
    hit_rate = _percent(stats.hits / lookups if lookups else None)
    shm = f"{stats.shm_name} ({format_size(stats.shm_size_bytes)})" if stats.shm_name else "none"
    rows = [
        ("leases", f"{stats.leases:,}"),
        ("reservations", f"{stats.reservations:,}"),
        ("pinned", f"{stats.pinned:,}"),
        ("lookup hits / misses", f"{stats.hits:,} / {stats.misses:,} ({hit_rate})"),
        ("shm segment", shm),
        *([("unix socket", stats.unix_socket)] if stats.unix_socket else []),
        ("host", stats.host_id or "?"),
        ("version", stats.version or "?"),
    ]
    if (p := stats.prewarm) is not None:
        rows.append(("pre-warm", f"{p.blocks:,} blocks, {format_size(p.bytes)} of "
                     f"{format_size(p.target_bytes)}" + ("" if p.done else " (running)")))
    rows[:0] = _auth_rows(stats)
    if stats.draining:
        rows.insert(0, ("state", "[red]draining[/] (stopping: new data calls are refused)"))
    for name, value in rows:
        summary.add_row(name, value)
    parts = [_tier_table(stats, target), _movement_table(stats)]
    if stats.clients:
        parts.append(_clients_table(stats))
    return Group(*parts, summary)


def _auth_rows(stats: Stats) -> list[tuple[str, str]]:
    """The auth mode, and with auth on the caller's tenant."""
    if stats.auth_mode == "off":
        return [("auth", f"[bold red]{AUTH_OFF_WARNING}[/]")]
    return [("auth", stats.auth_mode), ("tenant", stats.tenant or "-")]


def _clients_table(stats: Stats) -> Table:
    """One row per client holding something: its leases, reservations and pins."""
    table = Table("client", "leases", "reservations", "reserved", "pins", "pinned",
                  title="held by clients (caps: the clients.* settings)", title_justify="left")
    for c in stats.clients:
        table.add_row(c.client or "(daemon)", f"{c.leases:,}", f"{c.reservations:,}",
                      format_size(c.reserved_bytes), f"{c.pins:,}", format_size(c.pinned_bytes))
    return table


def _keyed_table(*columns: str, title: str | None = None) -> Table:
    """A table whose "key" column always holds a whole key: never cut, never wrapped."""
    table = Table(title=title, title_justify="left")
    for column in columns:
        if column == "key":
            table.add_column(column, no_wrap=True, min_width=2 * KEY_BYTES)
        else:
            table.add_column(column, no_wrap=True, justify="right" if column != "tier" else
                             "left")
    return table


def lookup_table(keys: Sequence[BlockKey], tiers: Sequence[str | None]) -> Table:
    """One row per key, in order: its index, hex and the tier that holds it (or a miss)."""
    table = _keyed_table("#", "key", "tier")
    for i, (key, tier) in enumerate(zip(keys, tiers, strict=True)):
        table.add_row(str(i), key.hex(), tier or "[dim]miss[/]")
    return table


def hot_table(namespace: str, pairs: Sequence[tuple[BlockKey, float]]) -> Table:
    """The hottest blocks first: index, the whole key, score."""
    table = _keyed_table("#", "key", "score", title=f"hottest in {namespace!r}")
    for i, (key, score) in enumerate(pairs):
        table.add_row(str(i), key.hex(), f"{score:,.2f}")
    return table


class _SizeColumn(ProgressColumn):
    """ "12.0 MiB of 64.0 MiB  310.2 MiB/s": the bytes so far, the target, the rate."""

    def render(self, task: Task) -> Text:
        done = format_size(int(task.completed))
        total = f" of {format_size(int(task.total))}" if task.total else ""
        speed = task.finished_speed or task.speed
        rate = f"  {format_size(int(speed))}/s" if speed else ""
        return Text(f"{done}{total}{rate}")


def prewarm_columns() -> tuple[ProgressColumn, ...]:
    """prewarm's progress bar: label, bar, sizes and rate (binary units), time taken."""
    return (TextColumn("prewarm"), BarColumn(), _SizeColumn(), TimeElapsedColumn())
