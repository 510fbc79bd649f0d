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

The store's own changes come from the daemon's event stream (WatchEvents), which
`StoreWatch` follows on a thread of its own: a block announced here that the daemon removes
becomes a `BlockRemoved` of its medium; one whose fastest tier moves to another medium (L2 to
L3) a `BlockRemoved` of the old medium and a `BlockStored` of the new, without token ids (a
router keeps those of the first announcement). To map the daemon's keys back to vLLM's hashes
the connector remembers the last `MAX_KNOWN` blocks it announced; a removal of an older one
is not announced, and until a router hears of a removal, a block it thinks the store holds
may be a miss, which costs a lookup, never a wrong answer.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import (
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

from kvstore.client.watch import EventCursor, follow_events
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.tier import MEDIUM_OF_TIER, Tier, tier_name

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from kvstore.integrations.link import StoreLink

logger = logging.getLogger("kvstore.integrations.vllm")

MAX_EVENTS = 10_000
"""Events kept between two `take_events` calls (vLLM takes them every step, so a few steps'
worth at most in practice); past it the oldest are dropped and counted, as vLLM's own
publisher drops past its queue size."""

def _medium(tier: str) -> tuple[str, str | None]:
    """A store tier's label -> (vLLM's medium, its locality), as `MEDIUM_OF_TIER` says; a
    "pending" block is still being written to L2; an unknown label is storage, locality
    unsaid."""
    known = Tier.__members__.get(("dram" if tier == "pending" else tier).upper())
    if known is None:
        return MEDIUM_STORAGE, None
    medium = MEDIUM_OF_TIER[known]
    return medium.vllm, medium.locality

MAX_KNOWN = 100_000
"""Blocks announced whose daemon key -> vLLM hash the connector remembers, the most recent
first (about 200 bytes each), to announce their removal."""

_MOVED, _REMOVED, _CLEARED = (pb.BLOCK_EVENT_KIND_MOVED, pb.BLOCK_EVENT_KIND_REMOVED,
                              pb.BLOCK_EVENT_KIND_CLEARED)


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
        # daemon key -> (vLLM's hash, group, medium, locality), the latest announced last
        self._known: OrderedDict[bytes, tuple[Any, int, str, str | None]] = OrderedDict()
        self._lock = threading.Lock()  # _known: the scheduler's thread and StoreWatch's

    def stored(self, request: Request, first: int, end: int, group: int, tier: str,
               keys: Sequence[bytes]) -> None:
        """Announce that the store holds blocks first..end-1 of request's chain in a
        KV-cache group, in tier (a label: "dram", "nvme", ...), under the daemon's keys
        (keys[i] is block first + i's). Blocks vLLM has no hash for (past its hashes, as for
        a block size it hashes differently) are left out."""
        hashes: Sequence[bytes] = request.block_hashes
        end = min(end, len(hashes))
        if first >= end:
            return
        medium, locality = _medium(tier)
        bs = self.block_size
        lora = request.lora_request
        converted = [maybe_convert_block_hash(h) for h in hashes[first:end]]
        with self._lock:
            for key, block_hash in zip(keys, converted, strict=False):
                self._known[key] = (block_hash, group, medium, locality)
                self._known.move_to_end(key)
            while len(self._known) > MAX_KNOWN:
                self._known.popitem(last=False)
        self._append(BlockStored(
            block_hashes=converted,
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

    def _append(self, event: KVCacheEvent) -> None:
        if len(self._events) == self._events.maxlen:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("kvstore: %d KV events dropped: vLLM did not take them in "
                               "time", self.dropped)
        self._events.append(event)

    def store_changed(self, kind: int, key: bytes, tier: int) -> None:
        """What the daemon's event stream says of a block (kvstore.v1.BlockEvent: kind,
        key, its fastest tier now or, removed, the one it left): announced as vLLM events
        when the connector announced the block and its medium changed."""
        with self._lock:
            known = self._known.get(key)
            if known is None:
                return
            block_hash, group, medium, locality = known
            if kind == _REMOVED:
                del self._known[key]
            else:
                label = tier_name(tier) or ""
                new_medium, new_locality = _medium(label)
                if kind != _MOVED or new_medium == medium:
                    return
                self._known[key] = (block_hash, group, new_medium, new_locality)
        self._append(BlockRemoved(block_hashes=[block_hash], medium=medium, group_idx=group,
                                  locality=locality))
        if kind == _MOVED:
            self._append(BlockStored(
                block_hashes=[block_hash], parent_block_hash=None, token_ids=[],
                block_size=self.block_size, lora_id=None, medium=new_medium, lora_name=None,
                group_idx=group, kv_cache_spec_kind=self._kinds[group],
                kv_cache_spec_sliding_window=self._windows[group], locality=new_locality))

    def store_cleared(self) -> None:
        """The daemon restarted: every block announced is announced removed (a router then
        forgets it; the blocks the daemon re-adopted from L3 hit as before, unannounced)."""
        with self._lock:
            known, self._known = self._known, OrderedDict()
        for block_hash, group, medium, locality in known.values():
            self._append(BlockRemoved(block_hashes=[block_hash], medium=medium,
                                      group_idx=group, locality=locality))

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first."""
        events: list[KVCacheEvent] = []
        while self._events:  # popleft: StoreWatch may append meanwhile
            events.append(self._events.popleft())
        return events


class StoreWatch:
    """Follows the daemon's event stream (WatchEvents) for the link's namespace on a thread
    of its own (`follow_events`) and hands each change to `StoreEvents.store_changed`;
    reconnects while the link is open, skipping events already handled (`EventCursor`). A
    new daemon run clears what was announced of the old one. A daemon whose events are off
    is left alone after one log line."""

    RETRY_S = (1.0, 5.0)

    def __init__(self, link: StoreLink, events: StoreEvents) -> None:
        self.link = link
        self.events = events
        self.cursor = EventCursor()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        follow_events(self.link.client.watch_events, self.handle, self._stop,
                      name="kvstore: event stream", retry_s=self.RETRY_S, stop_when_off=True)

    def handle(self, response: Any) -> None:
        """One response's changes of the link's namespace, as `StoreEvents` announces them.
        What came before this connector's first response is about blocks it never announced;
        a later daemon run's first response clears every block announced before."""
        advance = self.cursor.advance(response)
        if advance.new_run and not advance.first:
            self.events.store_cleared()
        for event in advance.events:
            if event.kind != _CLEARED and event.namespace == self.link.namespace:
                self.events.store_changed(event.kind, event.key, event.tier)

    def close(self) -> None:
        """Stop following the stream; the thread ends once the link's channel closes (which
        cancels the call it waits on), or at its next event."""
        self._stop.set()
