"""Every rule a converted config must satisfy, in one place: ranges, allowed values, cross-field
limits, and the tiers' page sizes.

problems(cfg, chosen) returns (setting, what is wrong and what to use) for each rule broken; load.py
adds the value and where it came from, and raises one ConfigError for them all. The order of
the list is the order of the lines an operator reads. Pure.

A value out of its own range is blamed on its own setting, with the range. A rule between two
settings (server.chunk_bytes and server.max_message_bytes, the two watermarks, ...) is checked
only once both are in range, and is blamed on the one the operator chose (`chosen`: the
settings given in a file, the environment or a flag), worded for that setting; when both or
neither were chosen, on the first of the pair.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from kvstore.daemon.config.schema import LOG_LEVELS, Config
from kvstore.shm import check_shm_name
from kvstore.units import KiB, format_size

Problem = tuple[str, str]  # (setting as "section.field", what is wrong and what to use)


class _Problems(list[Problem]):
    def __init__(self, chosen: Collection[str]) -> None:
        super().__init__()
        self.chosen = chosen

    def need(self, ok: bool, path: str, msg: str) -> None:
        if not ok:
            self.append((path, msg))

    def between(self, ok: bool, *alternatives: Problem) -> None:
        """A rule between settings: one problem, on the first alternative's setting that the
        operator chose (else the first), each alternative worded for its own setting."""
        if ok:
            return
        chosen = [a for a in alternatives if a[0] in self.chosen]
        self.append(chosen[0] if chosen else alternatives[0])

    def fine(self, *paths: str) -> bool:
        """No problem was found for any of paths so far (a rule between them then applies)."""
        return not any(path in paths for path, _ in self)


def problems(cfg: Config, chosen: Collection[str] = ()) -> list[Problem]:
    """(setting, what is wrong and what to use) for every rule the converted config breaks;
    chosen: the settings the operator gave (those a rule between two settings blames)."""
    out = _Problems(chosen)
    _server(cfg, out)
    _dram(cfg, out)
    _durations(cfg, out)
    out.need(cfg.log_level in LOG_LEVELS, "log_level", f"must be one of {', '.join(LOG_LEVELS)}")
    _hbm(cfg, out)
    _page_sizes(cfg, out)
    _nvme(cfg, out)
    _movers(cfg, out)
    _remote(cfg, out)
    _clients(cfg, out)
    _auth(cfg, out)
    return list(out)


def _server(cfg: Config, out: _Problems) -> None:
    s, m = cfg.server, cfg.metrics
    for path, port in (("server.port", s.port), ("metrics.port", m.port)):
        out.need(0 <= port <= 65535, path, "must be 0..65535 (0 = pick a free port)")
    out.need(-1 <= s.data_port <= 65535, "server.data_port",
             "must be -1..65535 (-1 = off, 0 = pick a free port)")
    out.need(bool(s.host.strip()), "server.host", "must not be empty; use e.g. 0.0.0.0")
    out.need(bool(m.host.strip()), "metrics.host", "must not be empty; use e.g. 0.0.0.0")
    out.need(cfg.events.buffer_events >= 0, "events.buffer_events",
             "must be >= 0 (0 = events off); use e.g. 65536")
    out.need(s.chunk_bytes >= 64 * KiB, "server.chunk_bytes", "must be >= 64KiB; use e.g. 4MiB")
    if out.fine("server.chunk_bytes"):
        floor = s.chunk_bytes + 64 * KiB
        out.between(
            s.max_message_bytes >= floor,
            ("server.max_message_bytes",
             f"must be >= server.chunk_bytes ({format_size(s.chunk_bytes)}) + 64KiB = "
             f"{_size_at_least(floor)}; "
             "raise it or lower server.chunk_bytes"),
            ("server.chunk_bytes",
             f"must be <= server.max_message_bytes ({format_size(s.max_message_bytes)}) - "
             f"64KiB = {_size_at_most(max(s.max_message_bytes - 64 * KiB, 0))}: a chunk and "
             "its message "
             "header must fit in one message; lower it or raise server.max_message_bytes"))
    out.need(s.max_object_bytes > 0, "server.max_object_bytes", "must be > 0; use e.g. 64MiB")
    if out.fine("server.max_object_bytes"):
        out.between(
            s.max_response_bytes >= s.max_object_bytes,
            ("server.max_response_bytes",
             f"must be >= server.max_object_bytes ({format_size(s.max_object_bytes)}): a Get "
             "returns at least one block; raise it (e.g. 1GiB) or lower "
             "server.max_object_bytes"),
            ("server.max_object_bytes",
             f"must be <= server.max_response_bytes ({format_size(s.max_response_bytes)}): a "
             "Get returns at least one block; lower it or raise server.max_response_bytes"))
    out.need(s.max_batch_keys >= 1, "server.max_batch_keys", "must be >= 1; use e.g. 4096")
    out.need(s.workers >= 1, "server.workers", "must be >= 1; use e.g. 8")
    out.need(s.max_streams >= 0, "server.max_streams",
             "must be >= 0 (0 = server.workers - 2, at least 1); use e.g. 6")
    if out.fine("server.workers", "server.max_streams"):
        out.between(
            s.max_streams < s.workers,
            ("server.max_streams",
             f"must be 0 or less than server.workers ({s.workers}): a thread must stay free "
             f"for unary calls; use at most {s.workers - 1}, or raise server.workers"),
            ("server.workers",
             f"must be more than server.max_streams ({s.max_streams}): a thread must stay "
             f"free for unary calls; use at least {s.max_streams + 1}, or lower "
             "server.max_streams"))
    out.need(s.max_streams_per_connection >= 0, "server.max_streams_per_connection",
             "must be >= 0 (0 = server.max_streams); use e.g. 4")
    out.need(math.isfinite(s.stream_idle_s) and s.stream_idle_s > 0, "server.stream_idle_s",
             "must be > 0; use e.g. 10")


def _size_at_least(size_bytes: int) -> str:
    """size_bytes for a person and, exactly or rounded up, as a value to set: "4.1 MiB
    (4160KiB)". A limit an operator must meet is read and copied, never counted in bytes."""
    return f"{format_size(size_bytes)} ({-(-size_bytes // KiB)}KiB)"


def _size_at_most(size_bytes: int) -> str:
    """size_bytes for a person and, exactly or rounded down, as a value to set: "7.9 MiB
    (8128KiB)"."""
    return f"{format_size(size_bytes)} ({size_bytes // KiB}KiB)"


def _dram(cfg: Config, out: _Problems) -> None:
    d = cfg.dram
    _capacity(out, "dram", d.enabled, d.capacity_bytes, d.page_size_bytes, "1GiB")
    out.need(d.verify_commits in ("sample", "all", "none"), "dram.verify_commits",
             "must be sample, all or none")
    if d.shm_name:
        try:
            check_shm_name(d.shm_name)
        except ValueError as exc:
            out.append(("dram.shm_name", str(exc)))


def _capacity(out: _Problems, tier: str, enabled: bool, capacity_bytes: int,
              page_size_bytes: int, example: str) -> None:
    """A tier holds at least one page (checked once its page size is itself valid)."""
    if not enabled or not _page_ok(page_size_bytes):
        return
    out.between(
        capacity_bytes >= page_size_bytes,
        (f"{tier}.capacity_bytes",
         f"must be >= {tier}.page_size_bytes ({format_size(page_size_bytes)}); use e.g. "
         f"{example}, or set {tier}.enabled=false"),
        (f"{tier}.page_size_bytes",
         f"must be <= {tier}.capacity_bytes ({format_size(capacity_bytes)}): the tier holds "
         f"at least one page; lower it or raise {tier}.capacity_bytes"))


def _durations(cfg: Config, out: _Problems) -> None:
    """The server's grace period and the lease timers (the tiers' timers are with their tier)."""
    grace_s = cfg.server.grace_s
    out.need(math.isfinite(grace_s) and grace_s >= 0, "server.grace_s", "must be >= 0; use e.g. 5")
    notice_s = cfg.server.drain_notice_s
    out.need(math.isfinite(notice_s) and notice_s >= 0, "server.drain_notice_s",
             "must be >= 0; use e.g. 1")
    if out.fine("server.grace_s", "server.drain_notice_s"):
        out.between(
            notice_s <= grace_s,
            ("server.drain_notice_s",
             f"must be at most server.grace_s ({grace_s:g}): the notice is part of the grace "
             "period; lower it or raise server.grace_s"),
            ("server.grace_s",
             f"must be at least server.drain_notice_s ({notice_s:g}): the notice is part of "
             "the grace period; raise it or lower server.drain_notice_s"))
    for name, example in (("lease_timeout_s", 30), ("reservation_timeout_s", 30),
                          ("sweep_interval_s", 0.5)):
        value = getattr(cfg.leases, name)
        out.need(math.isfinite(value) and value > 0, f"leases.{name}",
                 f"must be > 0; use e.g. {example}")


def _hbm(cfg: Config, out: _Problems) -> None:
    h = cfg.hbm
    out.need(h.mode in ("auto", "on", "off"), "hbm.mode", "must be auto, on or off")
    out.need(0 < h.fraction_of_free <= 0.9, "hbm.fraction_of_free",
             "must be in (0, 0.9]; use 0.2")
    out.need(h.device >= 0, "hbm.device", "must be >= 0")


def _page_ok(page_size_bytes: int) -> bool:
    return page_size_bytes >= 4 * KiB and page_size_bytes & (page_size_bytes - 1) == 0


def _page_sizes(cfg: Config, out: _Problems) -> None:
    for path, page in (("dram.page_size_bytes", cfg.dram.page_size_bytes),
                       ("hbm.page_size_bytes", cfg.hbm.page_size_bytes),
                       ("nvme.page_size_bytes", cfg.nvme.page_size_bytes)):
        out.need(_page_ok(page), path, "must be a power of two >= 4KiB; use e.g. 64KiB")


def _nvme(cfg: Config, out: _Problems) -> None:
    n = cfg.nvme
    _capacity(out, "nvme", n.enabled, n.capacity_bytes, n.page_size_bytes, "64GiB")
    out.need(n.backend in ("auto", "kvikio", "posix"), "nvme.backend",
             "must be auto, kvikio or posix")
    out.need(1 <= n.io_threads <= 256, "nvme.io_threads", "must be 1..256; use e.g. 4")
    out.need(n.placement in ("exclusive", "inclusive"), "nvme.placement",
             "must be exclusive or inclusive")
    out.need(n.admit_min_seen >= 1, "nvme.admit_min_seen",
             "must be >= 1 (1 = admit every block)")
    out.need(n.compact_after_records >= 1, "nvme.compact_after_records",
             "must be >= 1; use e.g. 100000")


def _movers(cfg: Config, out: _Problems) -> None:
    mv = cfg.movers
    high, low = mv.high_watermark, mv.low_watermark
    out.need(0 < high <= 1, "movers.high_watermark",
             "must be in (0, 1]: a share of the tier's capacity; use e.g. 0.9")
    out.need(0 < low < 1, "movers.low_watermark",
             "must be in (0, 1): a share of the tier's capacity; use e.g. 0.75")
    if out.fine("movers.high_watermark", "movers.low_watermark"):
        out.between(
            low < high,
            ("movers.low_watermark",
             f"must be below movers.high_watermark ({high:g}): the mover demotes from the "
             "high watermark down to the low one; lower it or raise movers.high_watermark"),
            ("movers.high_watermark",
             f"must be above movers.low_watermark ({low:g}): the mover demotes from the "
             "high watermark down to the low one; raise it or lower movers.low_watermark"))
    out.need(mv.batch_bytes >= 1, "movers.batch_bytes", "must be > 0; use e.g. 64MiB")
    out.need(math.isfinite(mv.put_wait_s) and mv.put_wait_s >= 0, "movers.put_wait_s",
             "must be >= 0 (0 = evict at once); use e.g. 0.5")
    out.need(math.isfinite(mv.interval_s) and mv.interval_s > 0, "movers.interval_s",
             "must be > 0 (0 would keep the mover spinning); use e.g. 0.1")


def _remote(cfg: Config, out: _Problems) -> None:
    r = cfg.remote
    out.need(not r.url or r.url.startswith(("redis://", "rediss://")), "remote.url",
             "must start with redis:// or rediss:// (or be empty: L4 off)")
    out.need(r.compress in ("auto", "lz4", "none"), "remote.compress",
             "must be auto, lz4 or none")
    for name in ("timeout_s", "breaker_backoff_s", "popularity_flush_s",
                 "popularity_half_life_s"):
        value = getattr(r, name)
        out.need(math.isfinite(value) and value > 0, f"remote.{name}", "must be > 0")
    out.need(math.isfinite(r.ttl_s) and r.ttl_s >= 0, "remote.ttl_s",
             "must be >= 0 (0 = no TTL)")


def _clients(cfg: Config, out: _Problems) -> None:
    c = cfg.clients
    for name in ("max_leases", "max_reservations"):
        out.need(getattr(c, name) >= 1, f"clients.{name}", "must be >= 1; use e.g. 256")
    out.need(c.max_streams >= 0, "clients.max_streams",
             "must be >= 0 (0 = server.max_streams less a quarter); use e.g. 4")
    for name in ("max_reserved_share", "max_pinned_share"):
        value = getattr(c, name)
        out.need(0 < value <= 1, f"clients.{name}",
                 "must be in (0, 1] (a share of dram.capacity_bytes; 1 = no cap); use e.g. 0.5")
    out.need(math.isfinite(c.max_pin_s) and c.max_pin_s > 0, "clients.max_pin_s",
             "must be > 0; use e.g. 3600")


AUTH_MODES = ("off", "token", "mtls")


def _auth(cfg: Config, out: _Problems) -> None:
    a, s = cfg.auth, cfg.server
    out.need(a.mode in AUTH_MODES, "auth.mode", f"must be one of {', '.join(AUTH_MODES)}")
    out.need(a.mode == "off" or bool(a.tenants_file), "auth.tenants_file",
             f"auth.mode={a.mode} needs a tenants file (docs/security.md)")
    out.need(bool(s.tls_cert_file) == bool(s.tls_key_file),
             "server.tls_key_file" if s.tls_cert_file else "server.tls_cert_file",
             "server.tls_cert_file and server.tls_key_file go together")
    if a.mode == "mtls":
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
            out.need(bool(getattr(s, name)), f"server.{name}", "auth.mode=mtls needs it")
    out.need(not s.tls_client_ca_file or bool(s.tls_cert_file), "server.tls_client_ca_file",
             "client certificates need TLS: set server.tls_cert_file and server.tls_key_file")
