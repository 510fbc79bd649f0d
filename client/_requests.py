"""Validating a verb's arguments and building its request, once for both clients.

Each function raises the exception the daemon would (InvalidArgument naming the field) or,
for caller buffers, ValueError naming `values[i]` / `buffers[i]`, so a bad call fails before
it reaches the wire. Keys are checked and encoded once per call and handed to the proto
constructors as lists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb

from ._buffers import ByteArray, readable_view, writable_array
from ._wire import (
    check_key,
    check_keys,
    check_namespace_arg,
    tier_value,
)
from .errors import InvalidArgument

_MAX_UINT32 = 2**32 - 1
_MAX_UINT64 = 2**64 - 1
# Extra RPC time beyond a prefetch deadline, so the daemon's final progress message arrives.
PREFETCH_GRACE_S = 1.0


@dataclass(frozen=True)
class PutPlan:
    """A checked put: keys, one flat byte view per value, and the chain information."""

    namespace: str
    keys: list[bytes]
    payloads: list[memoryview]
    sizes: list[int]
    parent_key: bytes
    independent: bool

    def inline_header(self) -> pb.PutRequest:
        return pb.PutRequest(
            namespace=self.namespace,
            keys=self.keys,
            sizes=self.sizes,
            parent_key=self.parent_key,
            independent=self.independent,
        )

    def reserve_request(self) -> pb.ReserveRequest:
        return pb.ReserveRequest(
            namespace=self.namespace,
            keys=self.keys,
            sizes=self.sizes,
            parent_key=self.parent_key,
            independent=self.independent,
        )

    def commit_request(self, reservation_id: str, checksums: list[int]) -> pb.PutRequest:
        """The single PutRequest that commits a written reservation, with the checksums the
        writer computed as it wrote (one per key)."""
        return pb.PutRequest(
            namespace=self.namespace, reservation_id=reservation_id, checksums=checksums
        )


def put_plan(
    namespace: str,
    keys: Sequence[bytes],
    values: Sequence[object],
    parent: bytes | None,
    independent: bool,
) -> PutPlan:
    key_list = check_keys(keys)
    if isinstance(values, (bytes, bytearray, memoryview, str)):
        raise InvalidArgument("values must be a sequence with one value per key, not one value")
    value_list = list(values)
    if len(value_list) != len(key_list):
        raise InvalidArgument(f"values has {len(value_list)} entries for {len(key_list)} keys")
    payloads = [readable_view(v, f"values[{i}]") for i, v in enumerate(value_list)]
    for i, payload in enumerate(payloads):
        if not payload.nbytes:
            raise InvalidArgument(
                f"sizes[{i}] is 0 (values[{i}] is empty); a block holds at least one byte"
            )
    parent_key = b"" if parent is None else bytes(check_key(parent, "parent_key"))
    return PutPlan(
        namespace=namespace,
        keys=key_list,
        payloads=payloads,
        sizes=[p.nbytes for p in payloads],
        parent_key=parent_key,
        independent=bool(independent),
    )


def into_arrays(keys: Sequence[bytes], buffers: Sequence[object]) -> list[ByteArray]:
    """One writable flat uint8 array per buffer, else ValueError naming buffers[i]."""
    if isinstance(buffers, (bytes, bytearray, memoryview)):
        raise InvalidArgument("buffers must be a sequence with one buffer per key")
    buffer_list = list(buffers)
    if len(buffer_list) != len(keys):
        raise InvalidArgument(f"buffers has {len(buffer_list)} entries for {len(keys)} keys")
    return [writable_array(b, f"buffers[{i}]") for i, b in enumerate(buffer_list)]


def get_request(
    namespace: str, keys: list[bytes], shared_memory: bool, verify_checksums: bool,
    again: bool = False,
) -> pb.GetRequest:
    """A shared-memory read by a client that verifies checksums takes no lease, which saves
    the Release round trip: a block the daemon moves while it is copied (demoted under L2
    pressure, its pages reused) fails its checksum. Those blocks are then read `again`, with
    a lease, and only one that fails under the lease is a miss (and evicted, see
    `_wire.reread_indexes`). A client that does not verify always leases."""
    if not shared_memory:
        return pb.GetRequest(namespace=namespace, keys=keys, mode=pb.GET_MODE_INLINE)
    return pb.GetRequest(
        namespace=namespace, keys=keys, mode=pb.GET_MODE_SHARED_MEMORY,
        no_lease=verify_checksums and not again,
    )


def lookup_request(namespace: str, keys: list[bytes], block_tokens: int) -> pb.LookupRequest:
    """block_tokens: tokens per key, counted by the daemon's prefix hit-token metrics."""
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or not (
            0 <= block_tokens <= _MAX_UINT32):
        raise InvalidArgument(f"block_tokens must be an int >= 0 (tokens per key), "
                              f"got {block_tokens!r}")
    return pb.LookupRequest(namespace=namespace, keys=keys, block_tokens=block_tokens)


def prefetch_request(
    namespace: str, keys: list[bytes], tier: str | None, deadline_s: float | None
) -> pb.PrefetchRequest:
    deadline_ms = 0
    if deadline_s is not None:
        if not deadline_s > 0:
            raise InvalidArgument(f"deadline_s must be positive, got {deadline_s}")
        deadline_ms = min(_MAX_UINT32, max(1, math.ceil(deadline_s * 1000)))
    return pb.PrefetchRequest(
        namespace=namespace,
        keys=keys,
        target_tier=tier_value(tier, "tier"),
        deadline_ms=deadline_ms,
    )


def prefetch_timeout_s(timeout_s: float, deadline_s: float | None) -> float:
    if deadline_s is None:
        return timeout_s
    return max(timeout_s, deadline_s + PREFETCH_GRACE_S)


def evict_request(
    client_namespace: str,
    keys: Sequence[bytes] | None,
    size_bytes: int,
    evict_all: bool,
    tier: str | None,
    namespace: str | None,
) -> pb.EvictRequest:
    ns = client_namespace if namespace is None else namespace
    if ns != "":
        check_namespace_arg(ns, "namespace")
    key_list = [] if keys is None else check_keys(keys)
    if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes < 0:
        raise InvalidArgument(f"bytes must be a non-negative integer, got {size_bytes!r}")
    if not key_list and not size_bytes and not evict_all:
        raise InvalidArgument("evict needs keys, bytes or all")
    if key_list and ns == "":
        raise InvalidArgument(
            "namespace: evicting keys needs a namespace ('' means every namespace and only "
            "goes with bytes or all)"
        )
    return pb.EvictRequest(
        namespace=ns,
        keys=key_list,
        bytes=size_bytes,
        all=bool(evict_all),
        tier=tier_value(tier, "tier"),
    )


def stats_request(include_config: bool, namespace: str | None) -> pb.StatsRequest:
    ns = "" if namespace is None else namespace
    if ns != "":
        check_namespace_arg(ns, "namespace")
    return pb.StatsRequest(namespace=ns, include_config=bool(include_config))


def release_request(ids: Sequence[str]) -> pb.ReleaseRequest:
    if isinstance(ids, str):
        raise InvalidArgument("ids must be a sequence of lease or reservation ids, not one id")
    id_list = list(ids)
    for i, one in enumerate(id_list):
        if not isinstance(one, str) or not one:
            raise InvalidArgument(f"ids[{i}] must be a non-empty string, got {one!r}")
    return pb.ReleaseRequest(ids=id_list)


def call_timeout_s(default_s: float, timeout_s: float | None) -> float:
    """A per-call timeout override (for long streams), else the client's."""
    if timeout_s is None:
        return default_s
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise InvalidArgument(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    return float(timeout_s)


def hot_request(namespace: str, limit: int) -> pb.HotRequest:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= _MAX_UINT32:
        raise InvalidArgument(f"limit must be a positive integer, got {limit!r}")
    return pb.HotRequest(namespace=namespace, limit=limit)


def prewarm_request(size_bytes: int, namespaces: Sequence[str]) -> pb.PrewarmRequest:
    """bytes 0 is the daemon's remote.prewarm_bytes; no namespaces is every namespace."""
    if (
        isinstance(size_bytes, bool)
        or not isinstance(size_bytes, int)
        or not 0 <= size_bytes <= _MAX_UINT64
    ):
        raise InvalidArgument(f"bytes must be a non-negative integer, got {size_bytes!r}")
    if isinstance(namespaces, (str, bytes)):
        raise InvalidArgument("namespaces must be a sequence of namespaces, not one namespace")
    names = list(namespaces)
    for i, ns in enumerate(names):
        if not isinstance(ns, str):
            raise InvalidArgument(f"namespaces[{i}] must be a string, got {type(ns).__name__}")
        check_namespace_arg(ns, f"namespaces[{i}]")
    return pb.PrewarmRequest(bytes=size_bytes, namespaces=names)
