"""KV events for routers: the blocks this engine saved to the store or loaded from it, as
vLLM's own `BlockStored` events, which the connector hands to vLLM (`take_events`) and vLLM's
KV-event publisher sends with its own (`--kv-events-config`). A router that already subscribes
to the engine (llm-d's precise prefix-cache scorer, Dynamo's KV router) then learns which of
the engine's prefixes the store holds, and on which medium, with no change on its side.

Each event names its blocks by vLLM's own block hashes (`request.block_hashes`, converted as
vLLM converts them for its events), carries the blocks' token ids (a router that rebuilds its
own keys needs them, the first block of a chain above all), the parent block's hash, the
KV-cache group and its kind. The medium says where the store holds the blocks: `CPU` for its
GPU and DRAM tiers (L1, L2), `STORAGE` for NVMe (L3) and the shared pool (L4), the pool with
locality `REMOTE` (other nodes read it too) and the rest `LOCAL`. A save lands in L2 (or L1),
so saved blocks are `CPU`; loaded blocks carry the tier their hit was found in.

The store's own removals (eviction, demotion) are not announced here: they are the daemon's
to report. Until a router hears of them, a block it thinks the store holds may be a miss,
which costs a lookup, never a wrong answer. Pure: no I/O; vLLM's event classes only.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvstore.integrations.vllm")

MAX_EVENTS = 10_000
"""Events kept between two `take_events` calls (vLLM takes them every step, so a few steps'
worth at most in practice); past it the oldest are dropped and counted, as vLLM's own
publisher drops past its queue size."""

_MEDIUM = {"hbm": (MEDIUM_CPU, "LOCAL"), "dram": (MEDIUM_CPU, "LOCAL"),
           "pending": (MEDIUM_CPU, "LOCAL"), "nvme": (MEDIUM_STORAGE, "LOCAL"),
           "remote": (MEDIUM_STORAGE, "REMOTE")}
"""A store tier's label -> (vLLM's medium, its locality). "pending" is a block still being
written to L2."""


class StoreEvents:
    """The events of one scheduler-side connector, kept until vLLM takes them."""

    def __init__(self, kv_cache_config: KVCacheConfig, block_size: int,
                 max_events: int = MAX_EVENTS) -> None:
        self.block_size = block_size
        groups = kv_cache_config.kv_cache_groups
        self._kinds = [get_kv_cache_spec_kind(g.kv_cache_spec).value for g in groups]
        self._windows = [get_kv_cache_spec_sliding_window(g.kv_cache_spec) for g in groups]
        self._events: deque[KVCacheEvent] = deque(maxlen=max_events)
        self.dropped = 0
        """Events dropped, the oldest first, because vLLM did not take them in time."""

    def stored(self, request: Request, first: int, end: int, group: int, tier: str) -> None:
        """Announce that the store holds blocks first..end-1 of request's chain in a
        KV-cache group, in tier (a label: "dram", "nvme", ...). Blocks vLLM has no hash
        for (past its hashes, as for a block size it hashes differently) are left out."""
        hashes: Sequence[bytes] = request.block_hashes
        end = min(end, len(hashes))
        if first >= end:
            return
        medium, locality = _MEDIUM.get(tier, (MEDIUM_STORAGE, None))
        bs = self.block_size
        lora = request.lora_request
        if len(self._events) == self._events.maxlen:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("kvstore: %d KV events dropped: vLLM did not take them in "
                               "time", self.dropped)
        self._events.append(BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in hashes[first:end]],
            parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first else None,
            token_ids=list(request.all_token_ids[first * bs:end * bs]),
            block_size=bs,
            lora_id=lora.adapter_id if lora else None,
            medium=medium,
            lora_name=lora.name if lora else None,
            group_idx=group,
            kv_cache_spec_kind=self._kinds[group],
            kv_cache_spec_sliding_window=self._windows[group],
            locality=locality,
        ))

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first."""
        events = list(self._events)
        self._events.clear()
        return events
