"""Validation rules of the tier sections of the config (hbm, nvme, movers, remote, and every
tier's page size); the rest of the rules and the loading live in kvstore.daemon.config. Pure."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kvstore.units import KiB

if TYPE_CHECKING:
    from kvstore.daemon.config import Config


def tier_problems(cfg: Config) -> list[tuple[str, str]]:
    """(setting, what is wrong and what to use) for the hbm, nvme, movers and remote rules."""
    h, n, mv = cfg.hbm, cfg.nvme, cfg.movers
    out: list[tuple[str, str]] = []

    def need(ok: bool, path: str, msg: str) -> None:
        if not ok:
            out.append((path, msg))

    need(h.mode in ("auto", "on", "off"), "hbm.mode", "must be auto, on or off")
    need(0 < h.fraction_of_free <= 0.9, "hbm.fraction_of_free", "must be in (0, 0.9]; use 0.2")
    need(h.device >= 0, "hbm.device", "must be >= 0")
    for path, page in (("dram.page_size_bytes", cfg.dram.page_size_bytes),
                       ("hbm.page_size_bytes", h.page_size_bytes),
                       ("nvme.page_size_bytes", n.page_size_bytes)):
        need(page >= 4 * KiB and page & (page - 1) == 0, path,
             "must be a power of two >= 4KiB; use e.g. 64KiB")
    need(not n.enabled or n.capacity_bytes >= n.page_size_bytes, "nvme.capacity_bytes",
         "must be >= nvme.page_size_bytes; use e.g. 64GiB, or set nvme.enabled=false")
    need(n.backend in ("auto", "kvikio", "posix"), "nvme.backend", "must be auto, kvikio or posix")
    need(1 <= n.io_threads <= 256, "nvme.io_threads", "must be 1..256; use e.g. 4")
    need(n.placement in ("exclusive", "inclusive"), "nvme.placement",
         "must be exclusive or inclusive")
    need(n.admit_min_seen >= 1, "nvme.admit_min_seen", "must be >= 1 (1 = admit every block)")
    need(n.compact_after_records >= 1, "nvme.compact_after_records", "must be >= 1")
    need(0 < mv.low_watermark < mv.high_watermark <= 1, "movers.low_watermark",
         "must satisfy 0 < movers.low_watermark < movers.high_watermark <= 1; use 0.75 and 0.9")
    need(mv.batch_bytes >= 1, "movers.batch_bytes", "must be > 0; use e.g. 64MiB")
    for name in ("put_wait_s", "interval_s"):
        value = getattr(mv, name)
        need(math.isfinite(value) and value >= 0, f"movers.{name}", "must be >= 0")
    r = cfg.remote
    need(not r.url or r.url.startswith(("redis://", "rediss://")), "remote.url",
         "must start with redis:// or rediss:// (or be empty: L4 off)")
    need(r.compress in ("auto", "lz4", "none"), "remote.compress", "must be auto, lz4 or none")
    for name in ("timeout_s", "breaker_backoff_s", "popularity_flush_s",
                 "popularity_half_life_s"):
        value = getattr(r, name)
        need(math.isfinite(value) and value > 0, f"remote.{name}", "must be > 0")
    need(math.isfinite(r.ttl_s) and r.ttl_s >= 0, "remote.ttl_s", "must be >= 0 (0 = no TTL)")
    return out
