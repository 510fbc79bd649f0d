"""The daemon's configuration: one tree of frozen dataclasses, loaded and validated once.

Layers, later wins: defaults < YAML file < KVSTORE_* environment < flags (--set, then named
flags). Sizes (fields ending _bytes) are parsed once from "64GiB"-style strings; durations
(fields ending _s) are float seconds. Every bad value raises ConfigError naming the field as
`section.field`, where the value came from, and what to change. Pure: reads only the YAML file.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from kvstore.daemon.config_tiers import tier_problems
from kvstore.shm import check_shm_name
from kvstore.units import GiB, KiB, MiB, format_size, parse_size

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
ENV_PREFIX = "KVSTORE_"
ENV_CONFIG_FILE = "KVSTORE_CONFIG"
#: KVSTORE_* names that belong to clients and tools, not to the daemon's config.
ENV_CLIENT_NAMES = frozenset({"KVSTORE_TARGET", "KVSTORE_NAMESPACE"})


class ConfigError(ValueError):
    """One or more bad settings; the message has one line per problem."""


@dataclass(frozen=True)
class ServerConfig:
    """The gRPC server and its request limits (section `server`)."""

    host: str = "127.0.0.1"  #: gRPC listen address.
    port: int = 50051  #: gRPC listen port; 0 = pick a free port.
    #: gRPC max send/receive message size; must be >= chunk_bytes + 64 KiB.
    max_message_bytes: int = 8 * MiB
    chunk_bytes: int = 4 * MiB  #: Payload bytes per streamed message.
    max_object_bytes: int = 64 * MiB  #: Largest single block.
    max_batch_keys: int = 4096  #: Most keys in one request.
    workers: int = 8  #: RPC worker threads; each streaming transfer in flight holds one.
    grace_s: float = 5.0  #: Shutdown grace period.


@dataclass(frozen=True)
class DramConfig:
    """The L2 tier: one shared-memory segment (section `dram`)."""

    enabled: bool = True  #: Keep an L2 tier in shared memory.
    capacity_bytes: int = 1 * GiB  #: L2 shared-memory segment size.
    page_size_bytes: int = 64 * KiB  #: Allocation page; a power of two, >= 4 KiB.
    shm_name: str = ""  #: Segment name under /dev/shm; "" = "kvstore-<port>-<pid>".
    pin_memory: bool = True  #: Register the segment as CUDA pinned memory when CUDA is present.


@dataclass(frozen=True)
class HbmConfig:
    """The L1 tier: one arena of GPU memory (section `hbm`)."""

    mode: str = "auto"  #: auto = on when CUDA is present; on = required (start fails without).
    capacity_bytes: int = 0  #: Arena size; 0 = fraction_of_free of the free HBM at start.
    fraction_of_free: float = 0.2  #: Share of free HBM taken when capacity_bytes is 0.
    page_size_bytes: int = 64 * KiB  #: Allocation page; a power of two, >= 4 KiB.
    device: int = 0  #: CUDA device index.


@dataclass(frozen=True)
class NvmeConfig:
    """The L3 tier: one preallocated file of pages on local NVMe, plus its manifest."""

    enabled: bool = True  #: Keep an L3 tier on local disk.
    #: Folder for the L3 file and manifest; "" = $XDG_CACHE_HOME/kvstore/<port> (~/.cache).
    dir: str = ""
    capacity_bytes: int = 4 * GiB  #: L3 file size (preallocated).
    page_size_bytes: int = 64 * KiB  #: Allocation page; a power of two, >= 4 KiB.
    backend: str = "auto"  #: auto (kvikio when an NVIDIA driver is present), kvikio or posix.
    io_threads: int = 4  #: Parallel reads and writes of the POSIX backend.
    #: exclusive: a block lives in one of L2/L3; inclusive: its L3 copy stays after promotion.
    placement: str = "exclusive"
    admit_min_seen: int = 1  #: Demote to L3 only blocks put or read at least this often.
    sync: bool = False  #: fdatasync each manifest record (survives power loss, not only crashes).
    compact_after_records: int = 100_000  #: Snapshot the manifest after this many records.


@dataclass(frozen=True)
class MoverConfig:
    """The background mover: demotion under pressure (section `movers`)."""

    high_watermark: float = 0.90  #: Start demoting when a tier is this full (0..1).
    low_watermark: float = 0.75  #: Demote until the tier is this full.
    batch_bytes: int = 64 * MiB  #: Most bytes demoted per step.
    put_wait_s: float = 0.5  #: How long a put waits for the mover before evicting instead.
    interval_s: float = 0.1  #: How often the mover checks the watermarks when idle.


@dataclass(frozen=True)
class RemoteConfig:
    """The L4 tier: a Redis or Redis Cluster pool shared by every daemon (section `remote`)."""

    #: redis://[user:password@]host:port/db, or rediss:// for TLS; "" = L4 off.
    url: str = ""
    cluster: bool = False  #: The URL names one node of a Redis Cluster.
    username: str = ""  #: ACL user (or in the URL).
    password: str = ""  #: Password (or in the URL); prefer KVSTORE_REMOTE_PASSWORD.
    tls_ca_file: str = ""  #: CA bundle for rediss:// ("" = the system's).
    timeout_s: float = 2.0  #: Socket timeout of every Redis call.
    ttl_s: float = 86400.0  #: How long a block lives in L4; 0 = until Redis evicts it.
    queue_bytes: int = 256 * MiB  #: Write-through backlog; blocks past it are skipped.
    compress: str = "auto"  #: auto (lz4 when it pays), lz4 or none.
    shuffle: bool = True  #: Byte-shuffle 2-byte elements (fp16/bf16) before lz4.
    breaker_backoff_s: float = 1.0  #: First wait after Redis fails; doubles up to 30 s.
    popularity_flush_s: float = 5.0  #: How often block popularity is sent to Redis.
    popularity_half_life_s: float = 3600.0  #: Half-life of the popularity scores.
    prewarm_bytes: int = 0  #: Pull this much of the hottest L4 data into L2/L3 before SERVING.


@dataclass(frozen=True)
class LeaseConfig:
    """Shared-memory read leases and Reserve expiry (section `leases`)."""

    lease_timeout_s: float = 30.0  #: How long a shared-memory read lease lasts without Release.
    #: How long Reserved pages wait for their Put before they are reclaimed.
    reservation_timeout_s: float = 30.0
    sweep_interval_s: float = 0.5  #: How often expired leases and reservations are swept.


@dataclass(frozen=True)
class MetricsConfig:
    """The Prometheus HTTP exporter (section `metrics`)."""

    enabled: bool = True  #: Serve Prometheus metrics over HTTP.
    host: str = "127.0.0.1"  #: Metrics listen address.
    port: int = 9400  #: Metrics listen port; 0 = pick a free port.


@dataclass(frozen=True)
class Config:
    """The whole daemon configuration; build it with load_config()."""

    server: ServerConfig = field(default_factory=ServerConfig)  #: gRPC server and request limits.
    dram: DramConfig = field(default_factory=DramConfig)  #: L2 shared-memory tier.
    hbm: HbmConfig = field(default_factory=HbmConfig)  #: L1 GPU memory tier.
    nvme: NvmeConfig = field(default_factory=NvmeConfig)  #: L3 NVMe tier.
    movers: MoverConfig = field(default_factory=MoverConfig)  #: Demotion between tiers.
    remote: RemoteConfig = field(default_factory=RemoteConfig)  #: L4 Redis pool.
    leases: LeaseConfig = field(default_factory=LeaseConfig)  #: Read leases and reservations.
    metrics: MetricsConfig = field(default_factory=MetricsConfig)  #: Prometheus exporter.
    log_level: str = "INFO"  #: DEBUG, INFO, WARNING or ERROR.


SECTIONS: dict[str, type[Any]] = {
    "server": ServerConfig,
    "dram": DramConfig,
    "hbm": HbmConfig,
    "nvme": NvmeConfig,
    "movers": MoverConfig,
    "remote": RemoteConfig,
    "leases": LeaseConfig,
    "metrics": MetricsConfig,
}


def _settings() -> dict[str, tuple[str, object]]:
    """{"section.field" or top-level "field": (type name, default)} for every setting."""
    fields = [(f"{sec}.", f) for sec, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    fields += [("", f) for f in dataclasses.fields(Config) if f.name not in SECTIONS]
    return {prefix + f.name: (str(f.type), f.default) for prefix, f in fields}


KINDS = {key: kind for key, (kind, _) in _settings().items()}
DEFAULTS = {key: default for key, (_, default) in _settings().items()}
ENV_NAMES = {ENV_PREFIX + path.replace(".", "_").upper(): path for path in KINDS}

# --- converting raw values ---------------------------------------------------------------

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _convert(path: str, raw: object) -> object:
    """raw (YAML scalar or env/flag string) as the field's type; ValueError says what to use."""
    kind = KINDS[path]
    if path.endswith("_bytes"):
        try:
            return parse_size(raw)  # type: ignore[arg-type]
        except (ValueError, TypeError):
            raise ValueError("not a size; use e.g. 64GiB, 512MiB or 4096") from None
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
            return raw.strip().lower() in _TRUE
        raise ValueError("not a boolean; use true or false")
    if kind == "int":
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and re.fullmatch(r"\s*[-+]?\d+\s*", raw):
            return int(raw)
        raise ValueError(f"not an integer; use e.g. {DEFAULTS[path]}")
    if kind == "float":
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        try:
            return float(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(f"not a number of seconds; use e.g. {DEFAULTS[path]}") from None
    if not isinstance(raw, str):
        raise ValueError("not a string; quote it")
    return raw.strip().upper() if path == "log_level" else raw


# --- validation --------------------------------------------------------------------------


def _problems(cfg: Config) -> list[tuple[str, str]]:
    """(path, what is wrong and what to use) for every rule the converted config breaks."""
    s, d, le, m = cfg.server, cfg.dram, cfg.leases, cfg.metrics
    out: list[tuple[str, str]] = []

    def need(ok: bool, path: str, msg: str) -> None:
        if not ok:
            out.append((path, msg))

    for path, port in (("server.port", s.port), ("metrics.port", m.port)):
        need(0 <= port <= 65535, path, "must be 0..65535 (0 = pick a free port)")
    need(bool(s.host.strip()), "server.host", "must not be empty; use e.g. 0.0.0.0")
    need(bool(m.host.strip()), "metrics.host", "must not be empty; use e.g. 0.0.0.0")
    need(s.chunk_bytes >= 64 * KiB, "server.chunk_bytes", "must be >= 64KiB; use e.g. 4MiB")
    need(s.max_message_bytes >= s.chunk_bytes + 64 * KiB, "server.max_message_bytes",
         f"must be >= server.chunk_bytes ({format_size(s.chunk_bytes)}) + 64KiB "
         f"= {s.chunk_bytes + 64 * KiB}; raise it or lower server.chunk_bytes")
    need(s.max_object_bytes > 0, "server.max_object_bytes", "must be > 0; use e.g. 64MiB")
    need(s.max_batch_keys >= 1, "server.max_batch_keys", "must be >= 1; use e.g. 4096")
    need(s.workers >= 1, "server.workers", "must be >= 1; use e.g. 8")
    page = d.page_size_bytes  # its power-of-two rule is with the other tiers' (config_tiers)
    need(not d.enabled or d.capacity_bytes >= page, "dram.capacity_bytes",
         f"must be >= dram.page_size_bytes ({format_size(page)}); use e.g. 1GiB, "
         "or set dram.enabled=false")
    if d.shm_name:
        try:
            check_shm_name(d.shm_name)
        except ValueError as exc:
            out.append(("dram.shm_name", str(exc)))
    need(math.isfinite(s.grace_s) and s.grace_s >= 0, "server.grace_s", "must be >= 0; use e.g. 5")
    for name in ("lease_timeout_s", "reservation_timeout_s", "sweep_interval_s"):
        value = getattr(le, name)
        need(math.isfinite(value) and value > 0, f"leases.{name}", "must be > 0; use e.g. 30")
    need(cfg.log_level in LOG_LEVELS, "log_level", f"must be one of {', '.join(LOG_LEVELS)}")
    return out + tier_problems(cfg)


# --- loading -----------------------------------------------------------------------------

_Raw = dict[str, tuple[object, str]]  # path -> (raw value, where it came from)


def _unknown(key: str, known: Sequence[str], source: str) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(sorted(known))}"
    return f"unknown setting {key!r} (from {source}); {hint}"


def _read_yaml(path: Path, named_by: str, raw: _Raw, errors: list[str]) -> None:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(
            f"config file {path} (from {named_by}): cannot read it ({exc.strerror}); "
            f"fix the path or drop {named_by}"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML: {exc}") from None
    if data is None:
        return
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: must be a mapping of sections, not {data!r}")
    top = [*SECTIONS, *(k for k in KINDS if "." not in k)]
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            for name, item in value.items():
                full = f"{key}.{name}"
                if full in KINDS:
                    raw[full] = (item, str(path))
                else:
                    known = [k for k in KINDS if k.startswith(key + ".")]
                    errors.append(_unknown(full, known, str(path)))
        elif key in SECTIONS:
            errors.append(f"{key} (from {path}): must be a mapping of settings, not {value!r}")
        elif key in KINDS:
            raw[key] = (value, str(path))
        else:
            errors.append(_unknown(str(key), top, str(path)))


def _apply_flag(text: str, source: str, raw: _Raw, errors: list[str]) -> None:
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep:
        errors.append(f"{text!r} (from {source}): expected section.field=value")
    elif key not in KINDS:
        errors.append(_unknown(key, list(KINDS), source))
    else:
        raw[key] = (value, source)


def _load(path: str | Path | None, env: Mapping[str, str] | None,
          flags: Sequence[tuple[str, str]], path_flag: str = "path") -> Config:
    """Collect raw values layer by layer (later wins), then convert and validate them."""
    env = os.environ if env is None else env
    raw: _Raw = {}
    errors: list[str] = []
    if path is None and env.get(ENV_CONFIG_FILE):
        path, path_flag = env[ENV_CONFIG_FILE], ENV_CONFIG_FILE
    if path is not None:
        _read_yaml(Path(path), path_flag, raw, errors)
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name == ENV_CONFIG_FILE or name in ENV_CLIENT_NAMES:
            continue
        if name in ENV_NAMES:
            raw[ENV_NAMES[name]] = (value, name)
        else:
            errors.append(_unknown(name, [*ENV_NAMES, ENV_CONFIG_FILE], "the environment"))
    for text, source in flags:
        _apply_flag(text, source, raw, errors)
    return _build(raw, errors)


def _build(raw: _Raw, errors: list[str]) -> Config:
    """Convert and validate raw values; raise one ConfigError for these and earlier problems."""
    values: dict[str, Any] = {}
    for key, (value, source) in raw.items():
        try:
            values[key] = _convert(key, value)
        except ValueError as exc:
            errors.append(f"{key} = {value!r} (from {source}): {exc}")
    if errors:
        raise ConfigError("\n".join(errors))
    sections = {
        name: cls(**{k.split(".", 1)[1]: v for k, v in values.items() if k.startswith(name + ".")})
        for name, cls in SECTIONS.items()
    }
    cfg = Config(**sections, **{k: v for k, v in values.items() if "." not in k})
    for key, msg in _problems(cfg):
        value, source = raw.get(key, (DEFAULTS[key], "default"))
        errors.append(f"{key} = {value!r} (from {source}): {msg}")
    if errors:
        raise ConfigError("\n".join(errors))
    return cfg


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None,
                overrides: Sequence[str] = ()) -> Config:
    """Defaults < YAML file (path, else $KVSTORE_CONFIG) < env (default os.environ) < overrides.

    overrides are "section.field=value" strings, as given to --set.
    """
    return _load(path, env, [(text, "--set") for text in overrides])


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain JSON-ready data; sizes are ints of bytes. Secrets (the Redis
    password, alone or in remote.url) read "***": this goes to operators and their logs."""
    data = dataclasses.asdict(cfg)
    remote = data["remote"]
    if remote["password"]:
        remote["password"] = "***"
    url = urlsplit(remote["url"])
    if url.password:
        user = f"{url.username}:" if url.username else ":"
        remote["url"] = url._replace(netloc=f"{user}***@{url.hostname}"
                                     + (f":{url.port}" if url.port else "")).geturl()
    return data


# --- command line ------------------------------------------------------------------------

_NAMED_FLAGS = {  # argparse dest -> (setting, flag as typed)
    "host": ("server.host", "--host"),
    "port": ("server.port", "--port"),
    "metrics_port": ("metrics.port", "--metrics-port"),
    "dram_capacity": ("dram.capacity_bytes", "--dram-capacity"),
    "log_level": ("log_level", "--log-level"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --config, the common named flags and repeatable --set section.field=value."""
    group = parser.add_argument_group("configuration")
    group.add_argument("--config", metavar="PATH", help="YAML config file (else $KVSTORE_CONFIG)")
    group.add_argument("--host", help="gRPC listen address (server.host)")
    group.add_argument("--port", help="gRPC listen port, 0 = any free (server.port)")
    group.add_argument("--metrics-port", help="Prometheus port, 0 = any free (metrics.port)")
    group.add_argument("--dram-capacity", metavar="SIZE",
                       help="L2 shared-memory size, e.g. 64GiB (dram.capacity_bytes)")
    group.add_argument("--log-level", help=f"one of {', '.join(LOG_LEVELS)} (log_level)")
    group.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                       dest="set_overrides", help="any setting; repeatable")


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Config:
    """Load the config for parsed args: --set overrides first, then the named flags."""
    flags = [(text, "--set") for text in args.set_overrides or ()]
    for dest, (key, flag) in _NAMED_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            flags.append((f"{key}={value}", flag))
    return _load(args.config, env, flags, "--config")
