"""The daemon's configuration tree: frozen dataclasses, one per section, a docstring per field.

Owns what a setting is (its section, name, type, default and meaning), the flat tables
derived from the tree (KINDS, DEFAULTS: keyed "section.field"), ConfigError, and the
operator-facing dump (config_to_dict, secrets hidden by redact_url). Loading lives in load.py
and the rules a value must satisfy in rules.py. Sizes (fields ending _bytes) are ints of bytes;
durations (fields ending _s) are float seconds.
"""

from __future__ import annotations  # keeps field types as names: KINDS reads them as "int" etc.

import dataclasses
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote_plus, urlsplit, urlunsplit

from kvstore.units import GiB, KiB, MiB

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: Query parameters of remote.url whose value is a secret (names compared in lower case).
SECRET_QUERY_PARAMS = frozenset({"password", "pass", "token", "auth"})


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
    #: Most bytes one Get may return (all its blocks together); must be >= max_object_bytes.
    max_response_bytes: int = 1 * GiB
    max_batch_keys: int = 4096  #: Most keys in one request.
    workers: int = 8  #: RPC worker threads; each streaming transfer in flight holds one.
    #: Most streaming calls (Put, Get, Prefetch, Prewarm) in flight at once; past it, new
    #: ones get RESOURCE_EXHAUSTED. 0 = workers - 2 (at least 1): two threads stay free for
    #: unary calls and the health check.
    max_streams: int = 0
    #: Most streaming calls in flight on one client connection; 0 = max_streams. gRPC shares
    #: one connection among the channels of a process, so this caps a client process.
    max_streams_per_connection: int = 0
    #: A streaming call that waits this long on its client (for the next Put message, or
    #: for the client to take the next Get chunk) is aborted (ABORTED) and its pages freed.
    stream_idle_s: float = 10.0
    grace_s: float = 5.0  #: Shutdown grace period: SIGTERM to exit, drain notice included.
    #: On SIGTERM, how long health says NOT_SERVING (and new data calls get UNAVAILABLE)
    #: before the server stops taking calls, so clients and probes see the drain; part of
    #: grace_s.
    drain_notice_s: float = 1.0
    #: PEM certificate chain the server presents; with tls_key_file, gRPC is served over TLS.
    tls_cert_file: str = ""
    tls_key_file: str = ""  #: PEM private key of tls_cert_file.
    #: PEM CA bundle client certificates must chain to (auth.mode=mtls requires it).
    tls_client_ca_file: str = ""
    #: Path of the daemon's local Unix socket, where co-located clients exchange an Attach
    #: ticket for their tenant's shared-memory arenas and send the hot verbs. "" = none with
    #: auth off; with auth on (where shared memory needs it), kvstore-<port>.sock in
    #: $XDG_RUNTIME_DIR, else in /tmp/kvstore-<uid> (both this user's alone). "off" = none
    #: in any mode (with auth on, clients then move data inline).
    unix_socket: str = ""
    #: TCP port of the data socket, on server.host: engines on other hosts move INLINE Get
    #: and Put bytes there raw (the local path's framing over TCP, TLS when gRPC has it, an
    #: Attach ticket per session; docs/protocol.md). -1 = off (Get and Put stream over
    #: gRPC); 0 = pick a free port (Limits tells clients which).
    data_port: int = -1


@dataclass(frozen=True)
class AuthConfig:
    """Who may call the daemon (section `auth`; docs/security.md)."""

    #: off (every caller is one trusted tenant: a warning at start), token (a bearer token in
    #: each call's metadata) or mtls (the client certificate names the tenant).
    mode: str = "off"
    #: YAML list of tenants: names, token hashes, certificate identities, namespace prefixes,
    #: role and quotas. Required unless mode is off; re-read on SIGHUP.
    tenants_file: str = ""


@dataclass(frozen=True)
class DramConfig:
    """The L2 tier: one shared-memory segment (section `dram`)."""

    enabled: bool = True  #: Keep an L2 tier in shared memory.
    capacity_bytes: int = 1 * GiB  #: L2 shared-memory segment size.
    page_size_bytes: int = 64 * KiB  #: Allocation page; a power of two, >= 4 KiB.
    shm_name: str = ""  #: Segment name under /dev/shm; "" = "kvstore-<port>-<pid>".
    pin_memory: bool = True  #: Register the segment as CUDA pinned memory when CUDA is present.
    #: What a commit of a reservation with the writer's checksums re-reads: sample (one
    #: random block of each commit: a lying or broken writer is caught in a few commits),
    #: all (every block: one more pass over the bytes) or none. A commit without checksums
    #: is always checksummed whole.
    verify_commits: str = "sample"
    #: Publish, per arena, a table of where each L2 block lies, which co-located clients map
    #: read-only and read L2 blocks through without a round trip (docs/local-path.md, "Reads
    #: through the table"); false: every read asks the daemon.
    read_table: bool = True


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
    #: Folder for the L3 file and manifest, kept across restarts (re-adopted); "" = scratch
    #: in $XDG_CACHE_HOME/kvstore/<port> (~/.cache), removed when the daemon stops.
    dir: str = ""
    #: L3 file size (preallocated). 2 GiB by default: twice the default L2, so a bare start
    #: on a laptop gets a real L3 (three times L2's blocks in all, with exclusive placement)
    #: without taking a large share of a small disk; a node with NVMe for it sets its size
    #: (the Helm chart always does).
    capacity_bytes: int = 2 * GiB
    page_size_bytes: int = 64 * KiB  #: Allocation page; a power of two, >= 4 KiB.
    backend: str = "auto"  #: auto (kvikio when an NVIDIA driver is present), kvikio or posix.
    io_threads: int = 4  #: Parallel reads and writes of the POSIX backend.
    #: exclusive: a block lives in one of L2/L3; inclusive: its L3 copy stays after promotion.
    placement: str = "exclusive"
    admit_min_seen: int = 1  #: Demote to L3 only blocks put or read at least this often.
    sync: bool = False  #: fdatasync each manifest record (survives power loss, not only crashes).
    compact_after_records: int = 100_000  #: Snapshot the manifest after this many records.
    #: Free space left on nvme.dir's filesystem; 0 = 10% of it, >= 1 GiB, <= a quarter.
    reserve_bytes: int = 0


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
class ClientConfig:
    """What one client may hold at once (section `clients`); past a cap, RESOURCE_EXHAUSTED
    naming it. A client is the caller's tenant with auth on; with auth off it is the
    peer host over gRPC (all processes of one host together) and the peer process on the
    local path (docs/local-path.md)."""

    max_leases: int = 1024  #: Live read leases (shared-memory Gets not yet Released).
    #: Streaming calls in flight; 0 = server.max_streams less a quarter (at least one), so
    #: one client never takes every stream slot from the others.
    max_streams: int = 0
    #: Live reservations and inline Puts in flight.
    max_reservations: int = 256
    #: Their bytes together, as a share of dram.capacity_bytes (1 = no cap); a client
    #: holding none may always make one, however large.
    max_reserved_share: float = 0.5
    #: Bytes of pinned blocks, as a share of dram.capacity_bytes (1 = no cap).
    max_pinned_share: float = 0.5
    #: A pin ends after this long unless the block is pinned again (which renews it).
    max_pin_s: float = 3600.0


@dataclass(frozen=True)
class MetricsConfig:
    """The Prometheus HTTP exporter (section `metrics`)."""

    enabled: bool = True  #: Serve Prometheus metrics over HTTP.
    host: str = "127.0.0.1"  #: Metrics listen address.
    port: int = 9400  #: Metrics listen port; 0 = pick a free port.


@dataclass(frozen=True)
class EventsConfig:
    """Block events for routers, the WatchEvents verb (section `events`)."""

    #: Events kept per tenant for subscribers to read and replay (docs/routing.md); a
    #: subscriber that falls further behind is told how many it missed. 0 turns events off.
    buffer_events: int = 65536


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
    clients: ClientConfig = field(default_factory=ClientConfig)  #: What one client may hold.
    auth: AuthConfig = field(default_factory=AuthConfig)  #: Tenants and their credentials.
    metrics: MetricsConfig = field(default_factory=MetricsConfig)  #: Prometheus exporter.
    events: EventsConfig = field(default_factory=EventsConfig)  #: Block events for routers.
    log_level: str = "INFO"  #: DEBUG, INFO, WARNING or ERROR.


SECTIONS: dict[str, type[Any]] = {
    "server": ServerConfig,
    "dram": DramConfig,
    "hbm": HbmConfig,
    "nvme": NvmeConfig,
    "movers": MoverConfig,
    "remote": RemoteConfig,
    "leases": LeaseConfig,
    "clients": ClientConfig,
    "auth": AuthConfig,
    "metrics": MetricsConfig,
    "events": EventsConfig,
}


def _settings() -> dict[str, tuple[str, object]]:
    """{"section.field" or top-level "field": (type name, default)} for every setting."""
    fields = [(f"{sec}.", f) for sec, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    fields += [("", f) for f in dataclasses.fields(Config) if f.name not in SECTIONS]
    return {prefix + f.name: (str(f.type), f.default) for prefix, f in fields}


#: "section.field" (or a top-level "field") -> its type's name: "int", "bool", "str", ...
KINDS = {key: kind for key, (kind, _) in _settings().items()}
#: "section.field" (or a top-level "field") -> its default value.
DEFAULTS = {key: default for key, (_, default) in _settings().items()}


def redact_url(url: str) -> str:
    """url with each secret in it replaced by "***": the password of `user:password@` (or
    `:password@`), and the value of every query parameter named password, pass, token or auth
    (in any case). Everything else, the other parameters and their order included, is kept as
    written; a URL without secrets comes back unchanged. Pure."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    netloc = f"{user}:***@{hostport}" if at and password else parts.netloc
    query = "&".join(_redact_param(param) for param in parts.query.split("&"))
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def _redact_param(param: str) -> str:
    """One `name=value` of a query string, its value "***" when the name is a secret's."""
    name, _, value = param.partition("=")
    secret = bool(value) and unquote_plus(name).lower() in SECRET_QUERY_PARAMS
    return f"{name}=***" if secret else param


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain JSON-ready data; sizes are ints of bytes. Secrets (remote.password,
    and any in remote.url: see redact_url) read "***": this goes to operators and their logs."""
    data = dataclasses.asdict(cfg)
    remote = data["remote"]
    if remote["password"]:
        remote["password"] = "***"
    remote["url"] = redact_url(remote["url"])
    return data
