from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_HBM: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_NVME: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]

class GetMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GET_MODE_INLINE: _ClassVar[GetMode]
    GET_MODE_SHARED_MEMORY: _ClassVar[GetMode]

class BlockEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_EVENT_KIND_UNSPECIFIED: _ClassVar[BlockEventKind]
    BLOCK_EVENT_KIND_STORED: _ClassVar[BlockEventKind]
    BLOCK_EVENT_KIND_MOVED: _ClassVar[BlockEventKind]
    BLOCK_EVENT_KIND_REMOVED: _ClassVar[BlockEventKind]
    BLOCK_EVENT_KIND_CLEARED: _ClassVar[BlockEventKind]
    BLOCK_EVENT_KIND_POOL_STORED: _ClassVar[BlockEventKind]
TIER_UNSPECIFIED: Tier
TIER_HBM: Tier
TIER_DRAM: Tier
TIER_NVME: Tier
TIER_REMOTE: Tier
GET_MODE_INLINE: GetMode
GET_MODE_SHARED_MEMORY: GetMode
BLOCK_EVENT_KIND_UNSPECIFIED: BlockEventKind
BLOCK_EVENT_KIND_STORED: BlockEventKind
BLOCK_EVENT_KIND_MOVED: BlockEventKind
BLOCK_EVENT_KIND_REMOVED: BlockEventKind
BLOCK_EVENT_KIND_CLEARED: BlockEventKind
BLOCK_EVENT_KIND_POOL_STORED: BlockEventKind

class LimitsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LimitsResponse(_message.Message):
    __slots__ = ("contract", "max_message_bytes", "chunk_bytes", "max_batch_keys", "max_object_bytes", "max_response_bytes", "key_bytes", "max_namespace_bytes", "default_lease_ms", "max_lease_ms", "reservation_timeout_ms", "max_pin_ms", "stream_idle_ms", "max_block_tokens", "shared_memory", "unix_socket", "auth_mode", "data_port")
    CONTRACT_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_KEYS_FIELD_NUMBER: _ClassVar[int]
    MAX_OBJECT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_RESPONSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_NAMESPACE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIN_MS_FIELD_NUMBER: _ClassVar[int]
    STREAM_IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    UNIX_SOCKET_FIELD_NUMBER: _ClassVar[int]
    AUTH_MODE_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    contract: str
    max_message_bytes: int
    chunk_bytes: int
    max_batch_keys: int
    max_object_bytes: int
    max_response_bytes: int
    key_bytes: int
    max_namespace_bytes: int
    default_lease_ms: int
    max_lease_ms: int
    reservation_timeout_ms: int
    max_pin_ms: int
    stream_idle_ms: int
    max_block_tokens: int
    shared_memory: bool
    unix_socket: str
    auth_mode: str
    data_port: int
    def __init__(self, contract: _Optional[str] = ..., max_message_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., max_batch_keys: _Optional[int] = ..., max_object_bytes: _Optional[int] = ..., max_response_bytes: _Optional[int] = ..., key_bytes: _Optional[int] = ..., max_namespace_bytes: _Optional[int] = ..., default_lease_ms: _Optional[int] = ..., max_lease_ms: _Optional[int] = ..., reservation_timeout_ms: _Optional[int] = ..., max_pin_ms: _Optional[int] = ..., stream_idle_ms: _Optional[int] = ..., max_block_tokens: _Optional[int] = ..., shared_memory: _Optional[bool] = ..., unix_socket: _Optional[str] = ..., auth_mode: _Optional[str] = ..., data_port: _Optional[int] = ...) -> None: ...

class Extent(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class BlockLocation(_message.Message):
    __slots__ = ("extents",)
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    extents: _containers.RepeatedCompositeFieldContainer[Extent]
    def __init__(self, extents: _Optional[_Iterable[_Union[Extent, _Mapping]]] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("namespace", "keys", "sizes", "data", "reservation_id", "parent_key", "independent", "checksums")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    INDEPENDENT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    reservation_id: str
    parent_key: bytes
    independent: bool
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., sizes: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., reservation_id: _Optional[str] = ..., parent_key: _Optional[bytes] = ..., independent: _Optional[bool] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "existing", "evicted")
    STORED_FIELD_NUMBER: _ClassVar[int]
    EXISTING_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    existing: int
    evicted: int
    def __init__(self, stored: _Optional[int] = ..., existing: _Optional[int] = ..., evicted: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace", "keys", "mode", "lease_timeout_ms", "no_lease")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    NO_LEASE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    mode: GetMode
    lease_timeout_ms: int
    no_lease: bool
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., mode: _Optional[_Union[GetMode, str]] = ..., lease_timeout_ms: _Optional[int] = ..., no_lease: _Optional[bool] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("found", "sizes", "checksums", "data", "lease_id", "locations", "shm_name", "lease_expires_in_ms", "arena")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    found: _containers.RepeatedScalarFieldContainer[bool]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    lease_id: str
    locations: _containers.RepeatedCompositeFieldContainer[BlockLocation]
    shm_name: str
    lease_expires_in_ms: int
    arena: str
    def __init__(self, found: _Optional[_Iterable[bool]] = ..., sizes: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., lease_id: _Optional[str] = ..., locations: _Optional[_Iterable[_Union[BlockLocation, _Mapping]]] = ..., shm_name: _Optional[str] = ..., lease_expires_in_ms: _Optional[int] = ..., arena: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "keys", "block_tokens")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    block_tokens: int
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., block_tokens: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix_length", "tiers")
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    prefix_length: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, prefix_length: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("namespace", "keys", "target_tier", "deadline_ms")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TARGET_TIER_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    target_tier: Tier
    deadline_ms: int
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., target_tier: _Optional[_Union[Tier, str]] = ..., deadline_ms: _Optional[int] = ...) -> None: ...

class PrefetchProgress(_message.Message):
    __slots__ = ("done", "missing", "failed", "total", "prefix_length", "deadline_exceeded")
    DONE_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_EXCEEDED_FIELD_NUMBER: _ClassVar[int]
    done: int
    missing: int
    failed: int
    total: int
    prefix_length: int
    deadline_exceeded: bool
    def __init__(self, done: _Optional[int] = ..., missing: _Optional[int] = ..., failed: _Optional[int] = ..., total: _Optional[int] = ..., prefix_length: _Optional[int] = ..., deadline_exceeded: _Optional[bool] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("namespace", "keys", "sizes", "timeout_ms", "parent_key", "independent")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    INDEPENDENT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    timeout_ms: int
    parent_key: bytes
    independent: bool
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., sizes: _Optional[_Iterable[int]] = ..., timeout_ms: _Optional[int] = ..., parent_key: _Optional[bytes] = ..., independent: _Optional[bool] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "exists", "locations", "shm_name", "expires_in_ms", "arena")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    exists: _containers.RepeatedScalarFieldContainer[bool]
    locations: _containers.RepeatedCompositeFieldContainer[BlockLocation]
    shm_name: str
    expires_in_ms: int
    arena: str
    def __init__(self, reservation_id: _Optional[str] = ..., exists: _Optional[_Iterable[bool]] = ..., locations: _Optional[_Iterable[_Union[BlockLocation, _Mapping]]] = ..., shm_name: _Optional[str] = ..., expires_in_ms: _Optional[int] = ..., arena: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("namespace", "keys", "bytes", "all", "tier")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    bytes: int
    all: bool
    tier: Tier
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., bytes: _Optional[int] = ..., all: _Optional[bool] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted", "evicted_bytes", "skipped", "skipped_pinned", "skipped_leased", "skipped_loading", "skipped_child_in_faster_tier", "skipped_has_children")
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_PINNED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_LEASED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_LOADING_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_CHILD_IN_FASTER_TIER_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_HAS_CHILDREN_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    evicted_bytes: int
    skipped: int
    skipped_pinned: int
    skipped_leased: int
    skipped_loading: int
    skipped_child_in_faster_tier: int
    skipped_has_children: int
    def __init__(self, evicted: _Optional[int] = ..., evicted_bytes: _Optional[int] = ..., skipped: _Optional[int] = ..., skipped_pinned: _Optional[int] = ..., skipped_leased: _Optional[int] = ..., skipped_loading: _Optional[int] = ..., skipped_child_in_faster_tier: _Optional[int] = ..., skipped_has_children: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("changed", "missing")
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    changed: int
    missing: int
    def __init__(self, changed: _Optional[int] = ..., missing: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("namespace", "include_config")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    include_config: bool
    def __init__(self, namespace: _Optional[str] = ..., include_config: _Optional[bool] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "enabled", "capacity_bytes", "used_bytes", "objects", "hits", "misses", "bytes_in", "bytes_out", "evictions", "page_size_bytes", "free_pages", "largest_free_run_pages", "backend", "promotions", "demotions", "admissions_refused", "checksum_failures", "io_errors", "queue_depth", "read_seconds", "write_seconds", "state")
    TIER_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    LARGEST_FREE_RUN_PAGES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    ADMISSIONS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    IO_ERRORS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    READ_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WRITE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    enabled: bool
    capacity_bytes: int
    used_bytes: int
    objects: int
    hits: int
    misses: int
    bytes_in: int
    bytes_out: int
    evictions: int
    page_size_bytes: int
    free_pages: int
    largest_free_run_pages: int
    backend: str
    promotions: int
    demotions: int
    admissions_refused: int
    checksum_failures: int
    io_errors: int
    queue_depth: int
    read_seconds: float
    write_seconds: float
    state: str
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., enabled: _Optional[bool] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., objects: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., evictions: _Optional[int] = ..., page_size_bytes: _Optional[int] = ..., free_pages: _Optional[int] = ..., largest_free_run_pages: _Optional[int] = ..., backend: _Optional[str] = ..., promotions: _Optional[int] = ..., demotions: _Optional[int] = ..., admissions_refused: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., io_errors: _Optional[int] = ..., queue_depth: _Optional[int] = ..., read_seconds: _Optional[float] = ..., write_seconds: _Optional[float] = ..., state: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "shm_name", "shm_size_bytes", "host_id", "leases", "reservations", "pinned", "version", "config_json", "hits", "misses", "prewarm", "clients", "draining", "auth_mode", "tenant", "unix_socket")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PREWARM_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    AUTH_MODE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    UNIX_SOCKET_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    shm_name: str
    shm_size_bytes: int
    host_id: str
    leases: int
    reservations: int
    pinned: int
    version: str
    config_json: str
    hits: int
    misses: int
    prewarm: PrewarmProgress
    clients: _containers.RepeatedCompositeFieldContainer[ClientHoldings]
    draining: bool
    auth_mode: str
    tenant: str
    unix_socket: str
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., shm_name: _Optional[str] = ..., shm_size_bytes: _Optional[int] = ..., host_id: _Optional[str] = ..., leases: _Optional[int] = ..., reservations: _Optional[int] = ..., pinned: _Optional[int] = ..., version: _Optional[str] = ..., config_json: _Optional[str] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., prewarm: _Optional[_Union[PrewarmProgress, _Mapping]] = ..., clients: _Optional[_Iterable[_Union[ClientHoldings, _Mapping]]] = ..., draining: _Optional[bool] = ..., auth_mode: _Optional[str] = ..., tenant: _Optional[str] = ..., unix_socket: _Optional[str] = ...) -> None: ...

class ClientHoldings(_message.Message):
    __slots__ = ("client", "leases", "reservations", "reserved_bytes", "pins", "pinned_bytes")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    client: str
    leases: int
    reservations: int
    reserved_bytes: int
    pins: int
    pinned_bytes: int
    def __init__(self, client: _Optional[str] = ..., leases: _Optional[int] = ..., reservations: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., pins: _Optional[int] = ..., pinned_bytes: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("already_draining", "streams_in_flight", "grace_s")
    ALREADY_DRAINING_FIELD_NUMBER: _ClassVar[int]
    STREAMS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    already_draining: bool
    streams_in_flight: int
    grace_s: float
    def __init__(self, already_draining: _Optional[bool] = ..., streams_in_flight: _Optional[int] = ..., grace_s: _Optional[float] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("ticket", "unix_socket", "expires_in_ms")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    UNIX_SOCKET_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    ticket: str
    unix_socket: str
    expires_in_ms: int
    def __init__(self, ticket: _Optional[str] = ..., unix_socket: _Optional[str] = ..., expires_in_ms: _Optional[int] = ...) -> None: ...

class HotRequest(_message.Message):
    __slots__ = ("namespace", "limit")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    limit: int
    def __init__(self, namespace: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class HotResponse(_message.Message):
    __slots__ = ("keys", "scores")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., scores: _Optional[_Iterable[float]] = ...) -> None: ...

class PrewarmRequest(_message.Message):
    __slots__ = ("bytes", "namespaces")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    namespaces: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, bytes: _Optional[int] = ..., namespaces: _Optional[_Iterable[str]] = ...) -> None: ...

class PrewarmProgress(_message.Message):
    __slots__ = ("blocks", "bytes", "target_bytes", "done")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TARGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    bytes: int
    target_bytes: int
    done: bool
    def __init__(self, blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., target_bytes: _Optional[int] = ..., done: _Optional[bool] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("from_sequence",)
    FROM_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    from_sequence: int
    def __init__(self, from_sequence: _Optional[int] = ...) -> None: ...

class BlockEvent(_message.Message):
    __slots__ = ("sequence", "kind", "namespace", "key", "tier", "from_tier", "parent")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    FROM_TIER_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    kind: BlockEventKind
    namespace: str
    key: bytes
    tier: Tier
    from_tier: Tier
    parent: bytes
    def __init__(self, sequence: _Optional[int] = ..., kind: _Optional[_Union[BlockEventKind, str]] = ..., namespace: _Optional[str] = ..., key: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ..., from_tier: _Optional[_Union[Tier, str]] = ..., parent: _Optional[bytes] = ...) -> None: ...

class WatchEventsResponse(_message.Message):
    __slots__ = ("events", "dropped", "daemon_id")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    DAEMON_ID_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[BlockEvent]
    dropped: int
    daemon_id: str
    def __init__(self, events: _Optional[_Iterable[_Union[BlockEvent, _Mapping]]] = ..., dropped: _Optional[int] = ..., daemon_id: _Optional[str] = ...) -> None: ...
