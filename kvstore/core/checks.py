"""Request checks: every field a request carries, checked before anything is touched.

Pure functions that raise InvalidArgument with a message naming the field (and the setting
to change, where a limit is configurable). The store calls them first in every verb, so a bad
request never reaches the index or a tier. The rules for keys and namespaces live in
`kvstore.keys`; here their errors only become the daemon's InvalidArgument.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvstore.core.errors import FailedPrecondition, InvalidArgument, Reason
from kvstore.keys import (
    BlockKey,
    InvalidKeyError,
    check_key,
    check_keys,
    check_namespace,
    namespace_root,
)
from kvstore.tier import Tier
from kvstore.units import format_size

T = TypeVar("T")


def _checked(check: Callable[[], T]) -> T:
    """check(), its InvalidKeyError raised as the daemon's InvalidArgument (same message)."""
    try:
        return check()
    except InvalidKeyError as exc:
        # Its message opens with the field it names ("keys[3] is 31 bytes; ...").
        message = str(exc)
        limit = re.search(r"the limit is (\d+)", message)
        raise InvalidArgument(message, field=message.split(" ", 1)[0],
                              limit=limit.group(1) if limit else None) from exc


def namespace(name: str) -> str:
    return _checked(lambda: check_namespace(name))


def keys(name: str, raw: Sequence[bytes], max_batch_keys: int) -> list[BlockKey]:
    """The namespace and the keys of one request."""
    if len(raw) > max_batch_keys:
        raise InvalidArgument(
            f"keys has {len(raw)} entries; the limit is {max_batch_keys} (server.max_batch_keys)",
            field="keys", limit=max_batch_keys, setting="server.max_batch_keys")
    namespace(name)
    checked = list(raw)
    return _checked(lambda: check_keys(checked, "keys"))


def sizes(keys: Sequence[BlockKey], raw: Sequence[int], max_object_bytes: int) -> list[int]:
    if len(raw) != len(keys):
        raise InvalidArgument(f"sizes has {len(raw)} entries; keys has {len(keys)}",
                              field="sizes")
    for i, size in enumerate(raw):
        if size <= 0:
            raise InvalidArgument(f"sizes[{i}] is {size}; a block holds at least one byte",
                                  field=f"sizes[{i}]")
        if size > max_object_bytes:
            raise InvalidArgument(
                f"sizes[{i}] is {format_size(size)}; the limit is "
                f"{format_size(max_object_bytes)} (server.max_object_bytes)",
                field=f"sizes[{i}]", limit=max_object_bytes, setting="server.max_object_bytes")
    return list(raw)


def chain_parents(
    namespace: str, keys: Sequence[BlockKey], parent: bytes, independent: bool
) -> list[BlockKey | None]:
    """Each key's parent: keys[i-1] (parent_key for keys[0]), or none for independent keys.
    The namespace root as parent_key means what an empty one does: the chain starts here
    (the root is no block, so as a parent it would never be cached)."""
    first: BlockKey | None = None
    if parent:
        first = _checked(lambda: check_key(parent, "parent_key"))
        if first == namespace_root(namespace):
            first = None
    if independent:
        return [None] * len(keys)
    if len(set(keys)) != len(keys) or (first is not None and first in keys):
        raise InvalidArgument(
            "keys: a chained put names a block twice (in keys or as parent_key), which "
            "would make it its own ancestor; set independent for unrelated blocks",
            field="keys")
    return [first, *keys[:-1]]


def distinct(keys: Sequence[BlockKey], verb: str) -> None:
    """A read names each key once: a repeated key would multiply the work (and the bytes a
    Get returns) without adding anything, so it is refused rather than served once."""
    if len(set(keys)) == len(keys):
        return
    first: dict[BlockKey, int] = {}
    for i, key in enumerate(keys):
        if key in first:
            raise InvalidArgument(f"keys[{i}] repeats keys[{first[key]}]: a {verb} names each "
                                  "key once", field=f"keys[{i}]")
        first[key] = i


def switch(tier: Tier) -> str:
    """The setting that turns tier on."""
    return {Tier.HBM: "hbm.mode", Tier.REMOTE: "remote.url"}.get(tier, f"{tier.label}.enabled")


def evict_modes(keys: bool, min_bytes: int, everything: bool, tier: Tier | None,
                enabled: bool) -> None:
    """An Evict names exactly one of keys, bytes or all, and a tier that is on (enabled)
    where it names one; L4 only by keys (it has no eviction order: its keys expire)."""
    if sum([keys, min_bytes > 0, everything]) != 1:
        raise InvalidArgument("give exactly one of keys, bytes or all", field="keys")
    if tier is not None and not enabled:
        raise FailedPrecondition(f"tier {tier.label} is not enabled", Reason.FEATURE_OFF,
                                 field="tier", setting=switch(tier))
    if tier == Tier.REMOTE and not keys:
        raise FailedPrecondition("tier remote: L4 blocks expire after remote.ttl_s and "
                                 "cannot be evicted by bytes or all; name their keys",
                                 field="tier", setting="remote.ttl_s")
