"""kvstore client library: `KVStoreClient` (blocking) and `AsyncKVStoreClient` (asyncio), the
key helpers, result types, the exception tree and retry policy.

    import numpy as np
    from kvstore.client import KVStoreClient, prefix_keys

    tokens = list(range(64))  # a prompt's token ids: 4 blocks of 16 tokens
    keys = prefix_keys(tokens, block_size=16, namespace="llama3-8b/tp0")
    blocks = [np.full(4096, i, np.uint8) for i in range(len(keys))]  # one KV block per key
    buffers = [np.empty(4096, np.uint8) for _ in keys]  # writable, CPU, a block each
    with KVStoreClient("127.0.0.1:50051", "llama3-8b/tp0") as kv:
        kv.put(keys, blocks)
        sizes = kv.get_into(keys, buffers)  # bytes per key, None for a miss

README.md's "Using it" has the whole example, with real block sizes.

With auth on, pass `token=` (or set KVSTORE_TOKEN / KVSTORE_TOKEN_FILE) and, for TLS or mTLS,
`tls=TLS(ca_file, cert_file, key_file)` (or the KVSTORE_TLS_* variables); see `credentials`.
"""

from __future__ import annotations

from kvstore.keys import BlockKey, prefix_keys

from ._readtable import InPlace
from .aio import AsyncKVStoreClient
from .credentials import TLS
from .errors import (
    Aborted,
    ChecksumMismatch,
    DataLoss,
    DeadlineExceeded,
    Draining,
    EntryVanished,
    FailedPrecondition,
    FeatureOff,
    InvalidArgument,
    KVStoreError,
    LeaseExpired,
    MessageTooLarge,
    NoRoom,
    NotFound,
    NotOwner,
    PermissionDenied,
    QuotaExceeded,
    RemoteDown,
    ReservationExpired,
    ResourceExhausted,
    RoleDenied,
    StreamIdle,
    TooManySessions,
    TooManyStreams,
    Unauthenticated,
    Unavailable,
    from_rpc_error,
    from_status,
)
from .results import (
    ClientHoldings,
    DrainResult,
    EvictResult,
    HotResult,
    LookupResult,
    PinResult,
    PrefetchResult,
    PrewarmResult,
    PutResult,
    ReleaseResult,
    Stats,
    TierStats,
)
from .retry import (
    AbstractBackoff,
    ConstantBackoff,
    ExponentialBackoff,
    NoBackoff,
    Retry,
)
from .sync import KVStoreClient

__all__ = [
    "Aborted",
    "AbstractBackoff",
    "AsyncKVStoreClient",
    "BlockKey",
    "ChecksumMismatch",
    "ClientHoldings",
    "ConstantBackoff",
    "DataLoss",
    "DeadlineExceeded",
    "DrainResult",
    "Draining",
    "EntryVanished",
    "EvictResult",
    "ExponentialBackoff",
    "FailedPrecondition",
    "FeatureOff",
    "HotResult",
    "InPlace",
    "InvalidArgument",
    "KVStoreClient",
    "KVStoreError",
    "LeaseExpired",
    "LookupResult",
    "MessageTooLarge",
    "NoBackoff",
    "NoRoom",
    "NotFound",
    "NotOwner",
    "PermissionDenied",
    "PinResult",
    "PrefetchResult",
    "PrewarmResult",
    "PutResult",
    "QuotaExceeded",
    "ReleaseResult",
    "RemoteDown",
    "ReservationExpired",
    "ResourceExhausted",
    "Retry",
    "RoleDenied",
    "Stats",
    "StreamIdle",
    "TLS",
    "TierStats",
    "TooManySessions",
    "TooManyStreams",
    "Unauthenticated",
    "Unavailable",
    "from_rpc_error",
    "from_status",
    "prefix_keys",
]
