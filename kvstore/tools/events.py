"""`kvstore-events`: one daemon's block events republished for routers that read stores
directly, and a prefix query over the daemon's Lookup.

    kvstore-events --target HOST:PORT --block-size 16 [--node NAME]
        [--endpoint tcp://*:5557] [--replay-endpoint tcp://*:5558]
        [--mooncake-endpoint tcp://*:5567 [--mooncake-replay-endpoint tcp://*:5568]]
        [--http-host 0.0.0.0 --http-port 8095] [credentials as kvstore-admin's]

It subscribes to the daemon's WatchEvents stream (its tenant's events: with auth on, one
publisher per tenant, run with that tenant's token) and publishes each change on ZMQ:

- in vLLM's KV-event format (`vllm/distributed/kv_events.py`, vLLM 0.32): three frames
  `[topic, seq as 8 bytes big-endian, msgpack KVEventBatch]`, topic
  `kv@node:<node>@<namespace>` (llm-d's `kv@<pod>@<model>`), numbered from 0, with vLLM's
  replay ROUTER socket (a request `[identity, "", start seq]` is answered with every batch
  still held from there, then `["", -1 as 8 bytes, ""]`);
- optionally in Mooncake's KV Events format (RFC #1527, as the Conductor indexer's API
  reference `docs/source/api-reference/http/conductor-indexer.md` of kvcache-ai/Mooncake
  documents it and `mooncake_master` sends it: a batch `[timestamp ms, [event maps], 0]`),
  on a socket of its own with the same replay protocol.

A block's hash on the wire is the int of its kvstore key's last 8 bytes, big-endian (what
vLLM publishes under VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, its default, and llm-d's reading of a
byte hash); token_ids are empty, for the daemon knows keys, not tokens. Media: L1 and L2 are
`CPU` (Mooncake `cpu`), L3 `STORAGE` (`disk`), locality LOCAL; L4 would be `STORAGE` REMOTE,
on a `kv@pool:` topic, which is not published yet (the daemon's stream carries this daemon's
own L4 writes, POOL_STORED, but not other nodes' writes or Redis's expiries). A
block that moves between tiers of different media is a BlockRemoved of the old one and a
BlockStored of the new one; a move within one medium (L1 <-> L2) is not published.

The HTTP side (`/query`, `/health`) answers prefix questions with the daemon's Lookup.
Memory is bounded: the replay buffers (--buffer-steps batches each), the chain parents
remembered to re-announce moved blocks (--max-blocks), and the namespaces known (for
AllBlocksCleared, MAX_NAMESPACES).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import msgspec
import zmq

from kvstore.client import KVStoreClient
from kvstore.client.credentials import TLS, resolve_token
from kvstore.client.errors import (
    InvalidArgument,
    KVStoreError,
    PermissionDenied,
    Unauthenticated,
)
from kvstore.client.results import LookupResult
from kvstore.client.watch import EventCursor, follow_events
from kvstore.keys import KEY_BYTES, InvalidKeyError, check_namespace, prefix_keys
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.tier import MEDIUM_OF_TIER, Medium, Tier
from kvstore.tools import admin_options as opt

logger = logging.getLogger("kvstore.events")

OWN_NAMESPACE = "kvstore-events"
"""The namespace of the client that follows the stream (WatchEvents is the tenant's, whatever
the namespace) and asks Limits and Stats."""
MAX_NAMESPACES = 4096
"""Namespaces remembered for AllBlocksCleared (each is a topic of its own); past it the
longest unused is forgotten and counted."""
MAX_QUERY_KEYS = 65536
"""The most keys (or full blocks of token_ids) one /query may ask about."""
MAX_BODY_BYTES = 8 << 20
"""The largest /query body read."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay's end marker, as vLLM's ZmqEventPublisher.END_SEQ."""


# --- vLLM's wire format: msgspec structs with vLLM's names, fields and options ------------
# Mirrors vllm/distributed/kv_events.py (vLLM 0.32): EventBatch is array-like, each event a
# tagged struct (encoded as a map whose "type" is the class name), defaults omitted.


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of vLLM's KV cache events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# --- what a change means, whatever the format --------------------------------------------


CPU = MEDIUM_OF_TIER[Tier.DRAM]


def block_hash(key: bytes) -> int:
    """A key's hash on the wire: its last 8 bytes as a big-endian int (vLLM's
    maybe_convert_block_hash with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, its default)."""
    return int.from_bytes(key[-8:], "big")


@dataclass(slots=True)
class Change:
    """One published change: blocks of one namespace stored in, removed from, or (cleared)
    every block forgotten. hashes of a "stored" change form a chain, the first following
    `parent` (None: a chain's root, or a parent not known when `root` is False)."""

    kind: str  # "stored", "removed", "cleared"
    namespace: str
    medium: Medium | None = None
    hashes: list[int] = field(default_factory=list)
    parent: int | None = None
    root: bool = False


class Translator:
    """The daemon's events (kvstore.v1.BlockEvent) as `Change`s. Remembers, bounded, each
    held block's parent (to re-announce a moved block in its chain) and the namespaces it
    announced (AllBlocksCleared goes to each one's topic)."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._parents: OrderedDict[int, int | None] = OrderedDict()
        self.namespaces: OrderedDict[str, None] = OrderedDict()
        self.forgotten_parents = 0
        """Parents forgotten because more than max_blocks blocks were held."""
        self.forgotten_namespaces = 0
        """Namespaces forgotten because more than MAX_NAMESPACES were announced: a later
        AllBlocksCleared does not reach their topics."""

    def translate(self, events: Iterable[Any]) -> list[Change]:
        """The changes of one response's events, in order; consecutive stores of one chain
        (same namespace and medium, each the child of the one before) merged into one."""
        changes: list[Change] = []
        for event in events:
            for change in self._one(event):
                last = changes[-1] if changes else None
                if (last is not None and change.kind == "stored" and last.kind == "stored"
                        and last.namespace == change.namespace and last.medium == change.medium
                        and change.parent == last.hashes[-1]):
                    last.hashes.extend(change.hashes)
                else:
                    changes.append(change)
        return changes

    def clear(self) -> list[Change]:
        """AllBlocksCleared for every namespace announced; the parents forgotten."""
        self._parents.clear()
        return [Change("cleared", ns) for ns in self.namespaces]

    def _one(self, event: Any) -> list[Change]:
        if event.kind == pb.BLOCK_EVENT_KIND_CLEARED:
            return self.clear()
        if event.kind == pb.BLOCK_EVENT_KIND_POOL_STORED:
            return []  # L4 writes: a `kv@pool:` topic is not published yet (module docstring)
        ns = event.namespace
        self._note(ns)
        h = block_hash(event.key)
        tier = Tier(event.tier) if event.tier in Tier._value2member_map_ else Tier.DRAM
        medium = MEDIUM_OF_TIER[tier]
        if event.kind == pb.BLOCK_EVENT_KIND_STORED:
            parent = block_hash(event.parent) if event.parent else None
            self._remember(h, parent)
            return [Change("stored", ns, medium, [h], parent, root=parent is None)]
        if event.kind == pb.BLOCK_EVENT_KIND_REMOVED:
            self._parents.pop(h, None)
            return [Change("removed", ns, medium, [h])]
        if event.kind == pb.BLOCK_EVENT_KIND_MOVED:
            old = MEDIUM_OF_TIER.get(Tier(event.from_tier), CPU) if event.from_tier else CPU
            if old == medium:
                return []
            known = h in self._parents
            parent = self._parents.get(h)
            return [Change("removed", ns, old, [h]),
                    Change("stored", ns, medium, [h], parent, root=known and parent is None)]
        logger.warning("kvstore-events: an event of unknown kind %d skipped", event.kind)
        return []

    def _remember(self, h: int, parent: int | None) -> None:
        self._parents[h] = parent
        self._parents.move_to_end(h)
        while len(self._parents) > self.max_blocks:
            self._parents.popitem(last=False)
            self.forgotten_parents += 1

    def _note(self, namespace: str) -> None:
        self.namespaces[namespace] = None
        self.namespaces.move_to_end(namespace)
        while len(self.namespaces) > MAX_NAMESPACES:
            self.namespaces.popitem(last=False)
            self.forgotten_namespaces += 1


# --- the two formats ---------------------------------------------------------------------


def topic_of(node: str, namespace: str) -> bytes:
    """`kv@node:<node>@<namespace>`: llm-d reads `kv@<pod>@<model>` from a vLLM topic."""
    return f"kv@node:{node}@{namespace}".encode()


def _runs(changes: Sequence[Change]) -> Iterable[list[Change]]:
    """Consecutive changes of one namespace (one batch, one topic, each)."""
    run: list[Change] = []
    for change in changes:
        if run and run[-1].namespace != change.namespace:
            yield run
            run = []
        run.append(change)
    if run:
        yield run


class VllmFormat:
    """Changes as vLLM KVEventBatch frames, one batch per run of one namespace."""

    def __init__(self, node: str, block_size: int) -> None:
        self.node = node
        self.block_size = block_size
        self._encoder = msgspec.msgpack.Encoder()

    def event(self, change: Change) -> BlockStored | BlockRemoved | AllBlocksCleared:
        if change.kind == "cleared":
            return AllBlocksCleared()
        assert change.medium is not None
        hashes: list[int | bytes] = list(change.hashes)
        if change.kind == "removed":
            return BlockRemoved(block_hashes=hashes, medium=change.medium.vllm,
                                locality=change.medium.locality)
        return BlockStored(block_hashes=hashes, parent_block_hash=change.parent, token_ids=[],
                           block_size=self.block_size, lora_id=None,
                           medium=change.medium.vllm, lora_name=None,
                           locality=change.medium.locality)

    def encode(self, changes: Sequence[Change]) -> list[tuple[bytes, bytes]]:
        now = time.time()
        return [(topic_of(self.node, run[0].namespace),
                 self._encoder.encode(KVEventBatch(ts=now, events=[self.event(c) for c in run],
                                                   data_parallel_rank=0)))
                for run in _runs(changes)]


class MooncakeFormat:
    """Changes as Mooncake KV Events (RFC #1527) batches: `[timestamp ms, [event maps], 0]`,
    each event map with the envelope of conductor-indexer.md ("KV Events API") in the order
    mooncake_master writes it. The namespace is the `additional_salt` (it seeds the chain,
    as a salt does); model_name is left nil (the indexer's /register supplies it)."""

    def __init__(self, node: str, block_size: int, tenant: str) -> None:
        self.node = node
        self.block_size = block_size
        self.tenant = tenant or "default"
        self.event_id = 0
        self._encoder = msgspec.msgpack.Encoder()

    def _envelope(self, kind: str, namespace: str, medium: str | None,
                  now_ms: int) -> dict[str, Any]:
        self.event_id += 1
        return {"event_id": self.event_id, "timestamp": now_ms, "event_type": kind,
                "model_name": None, "block_size": self.block_size,
                "additional_salt": namespace, "lora_name": None, "tenant_id": self.tenant,
                "backend_id": self.node, "medium": medium, "dp_rank": None}

    def events(self, change: Change, now_ms: int) -> list[dict[str, Any]]:
        if change.kind == "cleared":  # a stream is per medium too: clear each one
            return [self._envelope("cleared", change.namespace, m, now_ms)
                    for m in ("cpu", "disk")]
        assert change.medium is not None
        event = self._envelope(change.kind, change.namespace, change.medium.mooncake, now_ms)
        event["seq_hashes"] = list(change.hashes)
        if change.kind == "removed":
            event["base_block_idx"] = None
        else:
            event["base_block_idx"] = 0 if change.root else None
            event["parent_hash"] = change.parent
            event["token_ids"] = None
        return [event]

    def encode(self, changes: Sequence[Change]) -> list[tuple[bytes, bytes]]:
        now_ms = int(time.time() * 1000)
        return [(topic_of(self.node, run[0].namespace),
                 self._encoder.encode([now_ms, [e for c in run for e in self.events(c, now_ms)],
                                       0]))
                for run in _runs(changes)]


# --- ZMQ: PUB and replay ROUTER, as vLLM's ZmqEventPublisher ------------------------------


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule (ZmqEventPublisher._is_bind_endpoint): bind a wildcard, ipc or inproc
    address; connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqPublisher:
    """One PUB socket (and its replay ROUTER, always bound): frames numbered from 0, the last
    buffer_steps kept for replay. Its sockets are used from one thread only (`Publishing`)."""

    def __init__(self, context: zmq.Context[Any], endpoint: str, replay_endpoint: str | None,
                 encode: Callable[[Sequence[Change]], list[tuple[bytes, bytes]]],
                 buffer_steps: int, hwm: int = 100_000) -> None:
        self.encode = encode
        self.pub = context.socket(zmq.PUB)
        self.pub.set_hwm(hwm)
        if is_bind_endpoint(endpoint):
            self.pub.bind(endpoint)
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:  # a router's bound SUB socket (llm-d's scorer listens so)
            self.pub.connect(endpoint)
            self.endpoint = endpoint
        self.replay: zmq.Socket[Any] | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint:
            self.replay = context.socket(zmq.ROUTER)
            self.replay.bind(replay_endpoint)
            self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_steps)
        self.next_seq = 0
        self.bad_replay_requests = 0
        """Replay requests ignored for their shape (not `[identity, "", start]`)."""

    def publish(self, changes: Sequence[Change]) -> None:
        for topic, payload in self.encode(changes):
            seq = self.next_seq
            self.next_seq += 1
            self.pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, topic, payload))

    def serve_replay(self) -> None:
        """Answer one waiting replay request: `[identity, "", start seq]` -> each held batch
        from start as `[identity, "", topic, seq, payload]`, then the end marker."""
        assert self.replay is not None
        frames = self.replay.recv_multipart()
        if len(frames) != 3:
            self.bad_replay_requests += 1
            logger.warning("kvstore-events: a replay request of %d frames ignored (3 expected)",
                           len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, topic, payload in list(self._buffer):
            if seq >= first:
                self.replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"),
                                            payload))
        self.replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)


class Publishing(threading.Thread):
    """The thread that owns the ZMQ sockets: publishes the changes queued for it and
    answers replay requests between them."""

    def __init__(self, publishers: list[ZmqPublisher], max_queue: int = 10_000) -> None:
        super().__init__(name="kvstore-events-publish", daemon=True)
        self.publishers = publishers
        self.queue: queue.Queue[list[Change]] = queue.Queue(maxsize=max_queue)
        self.stopping = threading.Event()
        self.failures = 0
        self._poller = zmq.Poller()
        for p in publishers:
            if p.replay is not None:
                self._poller.register(p.replay, zmq.POLLIN)

    def run(self) -> None:
        while not (self.stopping.is_set() and self.queue.empty()):
            for sock, _ in self._poller.poll(0):
                for p in self.publishers:
                    if p.replay is sock:
                        self._safely(p.serve_replay)
            try:
                changes = self.queue.get(timeout=0.05)
            except queue.Empty:
                continue
            for p in self.publishers:
                self._safely(functools.partial(p.publish, changes))
        for p in self.publishers:
            p.close()

    def _safely(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # a send or a replay that failed: said and counted, the thread goes on
            self.failures += 1
            logger.exception("kvstore-events: publishing failed (%d so far)", self.failures)


# --- the daemon's side: WatchEvents, and Lookup for /query -------------------------------


class Relay(threading.Thread):
    """Follows the daemon's WatchEvents stream (`follow_events`) and queues its changes for
    `Publishing`. Reconnects with a backoff; on reconnect it asks again from sequence 1 and
    skips what it already published (`EventCursor`), so nothing between is lost while the
    daemon still holds it. A new daemon_id (a daemon restart, or this program's first
    response) clears every namespace announced before."""

    def __init__(self, open_stream: Callable[[int], Iterator[Any]] | None,
                 translator: Translator, out: Callable[[list[Change]], None]) -> None:
        super().__init__(name="kvstore-events-watch", daemon=True)
        self.open_stream = open_stream
        self.translator = translator
        self.out = out
        self.cursor = EventCursor()
        """The daemon run followed, the last sequence relayed, the events missed."""
        self.failures = 0
        """Responses that could not be relayed (a fault of this program, logged)."""
        self.connected = threading.Event()
        self.stopping = threading.Event()

    def run(self) -> None:
        assert self.open_stream is not None
        follow_events(self.open_stream, self._counted, self.stopping, name="kvstore-events",
                      connected=self.connected)

    def _counted(self, response: Any) -> None:
        try:
            self.handle(response)
        except Exception:
            self.failures += 1
            raise

    def handle(self, response: Any) -> None:
        advance = self.cursor.advance(response)
        changes: list[Change] = []
        if advance.new_run:
            if not advance.first:
                logger.info("kvstore-events: a new daemon run (%s): clearing",
                            response.daemon_id)
            if not (advance.events and advance.events[0].kind == pb.BLOCK_EVENT_KIND_CLEARED):
                changes.extend(self.translator.clear())  # a CLEARED event clears by itself
        if advance.missed:
            logger.warning("kvstore-events: %d events missed (the daemon no longer held "
                           "them): routers may hold stale blocks", advance.missed)
        changes.extend(self.translator.translate(advance.events))
        if changes:
            self.out(changes)

    def stop(self) -> None:
        """Stop following; the stream in progress ends when its client closes."""
        self.stopping.set()


class QueryError(Exception):
    """A /query that cannot be answered: its HTTP status and a message naming the field."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_query(body: dict[str, Any]) -> tuple[str, list[bytes], int]:
    """A /query's namespace, keys and block size (0: not given) from its JSON (or query
    string) fields: `namespace` and either `keys` (hex) or `token_ids` with `block_size`."""
    namespace = body.get("namespace")
    if not isinstance(namespace, str):
        raise QueryError(400, "namespace: a string is required")
    try:
        check_namespace(namespace)
    except InvalidKeyError as exc:
        raise QueryError(400, f"namespace: {exc}") from None
    block_size = body.get("block_size", 0)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 0:
        raise QueryError(400, f"block_size: a positive int is expected, got {block_size!r}")
    if ("keys" in body) == ("token_ids" in body):
        raise QueryError(400, "keys or token_ids: give exactly one of them")
    if "keys" in body:
        return namespace, _hex_keys(body["keys"]), block_size
    tokens = body["token_ids"]
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise QueryError(400, "token_ids: a list of ints is expected")
    if not block_size:
        raise QueryError(400, "block_size: required with token_ids")
    if len(tokens) // block_size > MAX_QUERY_KEYS:
        raise QueryError(400, f"token_ids: more than {MAX_QUERY_KEYS} blocks")
    try:
        return namespace, list(prefix_keys(tokens, block_size, namespace)), block_size
    except InvalidKeyError as exc:
        raise QueryError(400, f"token_ids: {exc}") from None


def _hex_keys(keys: Any) -> list[bytes]:
    if not isinstance(keys, list):
        raise QueryError(400, "keys: a list of hex strings is expected")
    if len(keys) > MAX_QUERY_KEYS:
        raise QueryError(400, f"keys: more than {MAX_QUERY_KEYS}")
    out = []
    for i, text in enumerate(keys):
        try:
            raw = bytes.fromhex(text)
        except (TypeError, ValueError):
            raise QueryError(400, f"keys[{i}]: not a hex string") from None
        if len(raw) != KEY_BYTES:
            raise QueryError(400, f"keys[{i}]: {len(raw)} bytes; keys are {KEY_BYTES}")
        out.append(raw)
    return out


class Query:
    """/query over the daemon's Lookup: the longest cached prefix and its blocks per tier."""

    def __init__(self, client_for: Callable[[str], KVStoreClient], max_batch_keys: int,
                 node: str) -> None:
        self.client_for = client_for
        self.max_batch_keys = max(1, max_batch_keys)
        self.node = node

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        namespace, keys, block_size = parse_query(body)
        tiers: list[str | None] = []
        prefix = 0
        for start in range(0, len(keys), self.max_batch_keys):
            chunk = keys[start:start + self.max_batch_keys]
            reply = self._lookup(namespace, chunk, block_size)
            tiers.extend(reply.tiers)
            if prefix == start:
                prefix += reply.prefix_length
        hits = {t.label: 0 for t in Tier}
        for name in tiers[:prefix]:
            if name is not None:
                hits[name] += 1
        return {"node": self.node, "namespace": namespace, "blocks": len(keys),
                "prefix_length": prefix,
                "longest_matched": prefix * block_size if block_size else None,
                "hits": hits, "tiers": tiers}

    def _lookup(self, namespace: str, keys: list[bytes], block_size: int) -> LookupResult:
        try:
            return self.client_for(namespace).lookup(keys, block_tokens=block_size)
        except KVStoreError as err:
            status = (400 if isinstance(err, InvalidArgument) else
                      403 if isinstance(err, PermissionDenied) else
                      401 if isinstance(err, Unauthenticated) else 503)
            raise QueryError(status, f"the daemon's Lookup: {err}") from None


class Clients:
    """A KVStoreClient per namespace (a client is bound to one): the one kvstore-events
    follows the stream and asks Limits with, and those /query asks Lookup with, made on
    first use and the least recently used closed past `limit`. gRPC shares one connection
    to a target among them."""

    def __init__(self, make: Callable[[str], KVStoreClient], limit: int = 64) -> None:
        self.make = make
        self.limit = limit
        self._clients: OrderedDict[str, KVStoreClient] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, namespace: str) -> KVStoreClient:
        with self._lock:
            client = self._clients.get(namespace)
            if client is None:
                client = self._clients[namespace] = self.make(namespace)
                while len(self._clients) > self.limit:
                    self._clients.popitem(last=False)[1].close()
            self._clients.move_to_end(namespace)
            return client

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()


# --- HTTP -------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    """GET/POST /query and GET /health; `http_server` binds query and health."""

    server_version = "kvstore-events"
    query: Query
    health: Callable[[], tuple[int, dict[str, Any]]]

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        url = urlsplit(self.path)
        if url.path == "/health":
            self._send(*type(self).health())
        elif url.path == "/query":
            self._query(url.query)
        else:
            self._send(404, {"error": f"no such path {url.path!r}: /query, /health"})

    def do_POST(self) -> None:  # noqa: N802
        if urlsplit(self.path).path != "/query":
            self._send(404, {"error": "POST is for /query"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self._send(413, {"error": f"body: more than {MAX_BODY_BYTES} bytes"})
            return
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError as exc:
            self._send(400, {"error": f"body: not JSON ({exc})"})
            return
        if not isinstance(body, dict):
            self._send(400, {"error": "body: a JSON object is expected"})
            return
        self._query(body)

    def _query(self, body: dict[str, Any] | str) -> None:
        try:
            fields = _query_string(body) if isinstance(body, str) else body
            self._send(200, self.query.answer(fields))
        except QueryError as exc:
            self._send(exc.status, {"error": str(exc)})

    def _send(self, status: int, doc: dict[str, Any]) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        logger.debug("kvstore-events http: " + format, *args)


def http_server(host: str, port: int, query: Query,
                health: Callable[[], tuple[int, dict[str, Any]]]) -> ThreadingHTTPServer:
    """The /query and /health server on host:port (0: a free port), one thread a request."""
    handler = type("Handler", (_Handler,), {"query": query, "health": staticmethod(health)})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def _query_string(text: str) -> dict[str, Any]:
    """GET /query's fields: namespace, keys=HEX,HEX or token_ids=1,2,3, block_size=N."""
    fields = {k: v[-1] for k, v in parse_qs(text).items()}
    out: dict[str, Any] = {}
    if "namespace" in fields:
        out["namespace"] = fields["namespace"]
    if "keys" in fields:
        out["keys"] = [k for k in fields["keys"].split(",") if k]
    for name in ("token_ids", "block_size"):
        if name in fields:
            try:
                values = [int(t) for t in fields[name].split(",") if t]
            except ValueError:
                raise QueryError(400, f"{name}: not a comma-separated list of ints") from None
            out[name] = values if name == "token_ids" else (values[0] if values else 0)
    return out


# --- the whole publisher -----------------------------------------------------------------


@dataclass
class Settings:
    """What one kvstore-events serves (the command line's options)."""

    target: str
    """The daemon, host:port (no port: 50051)."""
    block_size: int
    """Tokens per block, the engines': BlockStored.block_size and /query's token counts."""
    node: str = field(default_factory=socket.gethostname)
    """This node's name in topics (kv@node:<node>@<ns>) and Mooncake's backend_id."""
    endpoint: str = "tcp://*:5557"
    """The vLLM-format PUB address: bound (wildcard, ipc, inproc) or connected to."""
    replay_endpoint: str | None = "tcp://*:5558"
    """Its replay ROUTER address, bound; None: no replay."""
    mooncake_endpoint: str | None = None
    """The Mooncake-format (RFC #1527) PUB address; None: not published."""
    mooncake_replay_endpoint: str | None = None
    """Its replay ROUTER address; None: no replay."""
    http_host: str = "0.0.0.0"
    """The /query and /health server's address."""
    http_port: int = 8095
    """Its port; 0: any free port; -1: no HTTP server."""
    buffer_steps: int = 10_000
    """Batches kept for replay, per socket."""
    max_blocks: int = 1 << 18
    """Blocks whose chain parent is remembered (about 160 bytes each)."""
    token: str | None = None
    """The bearer token (auth.mode token); None: none."""
    tls: TLS | None = None
    """TLS to the daemon; None: plaintext."""


class NodePublisher:
    """kvstore-events as an object: start() connects, binds and serves; stop() ends it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.clients = Clients(functools.partial(
            KVStoreClient, settings.target, shared_memory=False, read_table=False,
            token=settings.token, tls=settings.tls if settings.tls is not None else False,
            timeout_s=10.0))
        own = self.clients(OWN_NAMESPACE)
        try:
            limits = own.limits()
            self.tenant = own.stats().tenant
        except BaseException:
            self.clients.close()
            raise
        self.target = own.target
        self.auth_mode = limits.auth_mode
        if self.auth_mode == "off":
            logger.warning("kvstore-events: the daemon's auth is off: every namespace's "
                           "blocks are published, to anyone who reaches %s",
                           settings.endpoint)
        self.translator = Translator(settings.max_blocks)
        self._context: zmq.Context[Any] = zmq.Context()
        self.vllm = ZmqPublisher(self._context, settings.endpoint, settings.replay_endpoint,
                                 VllmFormat(settings.node, settings.block_size).encode,
                                 settings.buffer_steps)
        publishers = [self.vllm]
        self.mooncake: ZmqPublisher | None = None
        if settings.mooncake_endpoint:
            fmt = MooncakeFormat(settings.node, settings.block_size, self.tenant)
            self.mooncake = ZmqPublisher(self._context, settings.mooncake_endpoint,
                                         settings.mooncake_replay_endpoint, fmt.encode,
                                         settings.buffer_steps)
            publishers.append(self.mooncake)
        self.publishing = Publishing(publishers)
        self.relay = Relay(own.watch_events, self.translator, self._enqueue)
        self.query = Query(self.clients, limits.max_batch_keys, settings.node)
        self.http: ThreadingHTTPServer | None = None
        if settings.http_port >= 0 and settings.http_host:
            self.http = http_server(settings.http_host, settings.http_port, self.query,
                                    self.health)
        self.dropped = 0

    @property
    def http_port(self) -> int:
        return self.http.server_address[1] if self.http is not None else 0

    def start(self) -> NodePublisher:
        self.publishing.start()
        self.relay.start()
        if self.http is not None:
            threading.Thread(target=self.http.serve_forever, name="kvstore-events-http",
                             daemon=True).start()
        return self

    def _enqueue(self, changes: list[Change]) -> None:
        try:
            self.publishing.queue.put(changes, timeout=5.0)
        except queue.Full:
            self.dropped += len(changes)
            logger.error("kvstore-events: the publishing queue is full: %d changes dropped",
                         self.dropped)

    def health(self) -> tuple[int, dict[str, Any]]:
        """200 while the daemon's stream is followed, else 503; the figures either way."""
        up = self.relay.connected.is_set()
        return (200 if up else 503), {
            "status": "ok" if up else "not connected", "target": self.target,
            "auth_mode": self.auth_mode, "daemon_id": self.relay.cursor.daemon_id,
            "last_sequence": self.relay.cursor.last_sequence,
            "missed": self.relay.cursor.missed,
            "published_batches": self.vllm.next_seq, "dropped": self.dropped,
            "failures": self.relay.failures + self.publishing.failures,
            "forgotten_parents": self.translator.forgotten_parents,
            "forgotten_namespaces": self.translator.forgotten_namespaces,
            "bad_replay_requests": sum(p.bad_replay_requests for p in self.publishing.publishers)}

    def stop(self) -> None:
        self.relay.stop()
        self.clients.close()  # cancels the stream the relay waits on
        self.relay.join(10)
        self.publishing.stopping.set()
        self.publishing.join(10)
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
        self._context.term()


# --- the command line --------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstore-events",
        description="Republish one daemon's block events in vLLM's (and Mooncake's) ZMQ "
                    "KV-event format, and answer prefix queries over its Lookup.")
    p.add_argument("--target", default=os.environ.get(opt.ENV_TARGET) or opt.DEFAULT_TARGET,
                   help=f"the daemon (env {opt.ENV_TARGET}, default {opt.DEFAULT_TARGET})")
    p.add_argument("--block-size", type=opt.positive_int, required=True,
                   help="tokens per block, as the engines' (BlockStored.block_size)")
    p.add_argument("--node", default=socket.gethostname(),
                   help="this node's name in topics (kv@node:NAME@NS) and backend_id")
    p.add_argument("--endpoint", default="tcp://*:5557",
                   help="vLLM-format PUB address: bound when it has a wildcard (*) or is "
                        "ipc:// or inproc://, else connected to (a router's SUB), as vLLM does")
    p.add_argument("--replay-endpoint", default="tcp://*:5558",
                   help="its replay ROUTER address ('' for none)")
    p.add_argument("--mooncake-endpoint", default=None,
                   help="Mooncake-format (RFC #1527) PUB address; none by default")
    p.add_argument("--mooncake-replay-endpoint", default=None, help="its replay address")
    p.add_argument("--http-host", default="0.0.0.0", help="the /query server's address")
    p.add_argument("--http-port", type=int, default=8095, help="its port (-1: no server)")
    p.add_argument("--buffer-steps", type=opt.positive_int, default=10_000,
                   help="batches kept for replay, per socket")
    p.add_argument("--max-blocks", type=opt.positive_int, default=1 << 18,
                   help="blocks whose chain parent is remembered to re-announce moves "
                        "(about 160 bytes each)")
    opt.add_credential_flags(p.add_argument_group("credentials (auth.mode token or mtls)"),
                             default=None)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    creds = opt.credentials(args)  # --tls-* flags, else the KVSTORE_TLS_* variables
    tls = creds["tls"] if isinstance(creds["tls"], TLS) else None
    token = resolve_token(creds["token"])  # the flag, else KVSTORE_TOKEN(_FILE)
    return Settings(target=args.target, block_size=args.block_size, node=args.node,
                    endpoint=args.endpoint, replay_endpoint=args.replay_endpoint or None,
                    mooncake_endpoint=args.mooncake_endpoint,
                    mooncake_replay_endpoint=args.mooncake_replay_endpoint,
                    http_host=args.http_host, http_port=args.http_port,
                    buffer_steps=args.buffer_steps, max_blocks=args.max_blocks,
                    token=token, tls=tls)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    opt.check_credentials(parser, args)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s")
    try:
        publisher = NodePublisher(settings_from(args))
    except (KVStoreError, zmq.ZMQError, OSError) as exc:
        print(f"kvstore-events: {exc}", file=sys.stderr)
        return 2
    publisher.start()
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    logger.info("kvstore-events: %s -> vLLM %s (replay %s)%s, /query on port %d",
                publisher.target, publisher.vllm.endpoint, publisher.vllm.replay_endpoint,
                f", Mooncake {publisher.mooncake.endpoint}" if publisher.mooncake else "",
                publisher.http_port)
    done.wait()
    publisher.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
