"""kvstore-events (kvstore.tools.events) on real daemons: the daemon's WatchEvents stream
republished on a real ZMQ PUB socket in vLLM's KV-event format (topic kv@node:<node>@<ns>,
8-byte big-endian sequence, a msgpack KVEventBatch), a demotion as BlockRemoved(CPU) +
BlockStored(STORAGE) in its chain, an eviction as BlockRemoved; the replay ROUTER answering
from a sequence; the Mooncake (RFC #1527) format; /query answering as Lookup does, and bad
queries answered 400 naming the field; a tenant's publisher seeing only its namespaces.

The relay's bookkeeping across reconnects and daemon restarts is driven with real
WatchEventsResponse messages (a restart gets a new port, which a publisher does not follow)."""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvstore.client import KVStoreClient, prefix_keys
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.tools.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Change,
    KVEventBatch,
    NodePublisher,
    Relay,
    Settings,
    Translator,
    block_hash,
    main,
)
from kvstore.tools.testing import Daemon, free_port
from tests.helpers import blocks, wait_until
from tests.integration.test_auth import TOKENS, auth_settings, tenants_doc, write_tenants

SMALL = ("dram.capacity_bytes=2MiB", "dram.page_size_bytes=64KiB", "nvme.capacity_bytes=16MiB",
         "nvme.page_size_bytes=64KiB", "movers.interval_s=0.02")
BLOCK_SIZE = 16
NODE = "n1"
PROBE = Change("cleared", "probe")
"""What the fixture publishes until a subscriber hears it; subscribers keep no probe frame."""


class Subscriber:
    """A router's SUB socket on the publisher, every frame kept and decoded on a thread."""

    def __init__(self, endpoint: str, topic: bytes = b"") -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic)
        self._socket.connect(endpoint.replace("0.0.0.0", "127.0.0.1"))
        self.frames: list[list[bytes]] = []
        self.heard = False
        """Whether any frame arrived, a probe included."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(50):
                frames = self._socket.recv_multipart()
                if not frames[0].endswith(b"@probe"):
                    self.frames.append(frames)
                self.heard = True

    def batches(self) -> list[KVEventBatch]:
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        return [decoder.decode(f[2]) for f in list(self.frames)]

    def events(self) -> list[Any]:
        return [e for b in self.batches() for e in b.events]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._socket.close(linger=0)
        self._context.term()


def _endpoint() -> str:
    """A wildcard address: bound, as vLLM binds one (any other address is connected to)."""
    return f"tcp://*:{free_port()}"


@pytest.fixture
def publish() -> Iterator[Callable[..., tuple[NodePublisher, Subscriber]]]:
    """Start a publisher on a daemon with a subscriber connected before the first event."""
    opened: list[tuple[NodePublisher, Subscriber]] = []

    def start(d: Daemon, topic: bytes = b"", **extra: Any) -> tuple[NodePublisher, Subscriber]:
        settings = Settings(target=d.target, block_size=BLOCK_SIZE, node=NODE,
                            endpoint=_endpoint(), replay_endpoint=_endpoint(),
                            http_host="127.0.0.1", http_port=0, **extra)
        publisher = NodePublisher(settings)
        sub = Subscriber(publisher.vllm.endpoint, topic)
        # A SUB socket hears a PUB only once its subscription has arrived: wait for it with a
        # probe the subscriber must see, before any event is published.
        def heard() -> bool:
            publisher.vllm.publish([PROBE])
            return sub.heard

        wait_until(heard, "the subscription to arrive", timeout_s=10, pause_s=0.05)
        opened.append((publisher.start(), sub))
        return opened[-1]

    yield start
    for publisher, sub in opened:
        sub.close()
        publisher.stop()


def _stored(events: list[Any]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def _removed(events: list[Any]) -> list[BlockRemoved]:
    return [e for e in events if isinstance(e, BlockRemoved)]


def test_a_chain_arrives_as_vllm_batches_on_its_namespace_topic(
        daemon_factory: Callable[..., Daemon],
        publish: Callable[..., tuple[NodePublisher, Subscriber]]) -> None:
    d = daemon_factory(*SMALL)
    publisher, sub = publish(d)
    keys, values = blocks(6, size=1024)
    with KVStoreClient(d.target, "chain") as kv:
        kv.put(keys, values)  # one chain: each key's parent is the one before
    wait_until(lambda: sum(len(e.block_hashes) for e in _stored(sub.events())) == 6,
               "6 blocks announced")
    frames = list(sub.frames)
    first = int.from_bytes(frames[0][1], "big")
    assert [int.from_bytes(f[1], "big") for f in frames] == list(
        range(first, first + len(frames)))
    assert all(len(f) == 3 and len(f[1]) == 8 for f in frames)
    stored_topics = {f[0] for f, b in zip(frames, sub.batches(), strict=True)
                     if any(isinstance(e, BlockStored) for e in b.events)}
    assert stored_topics == {b"kv@node:n1@chain"}
    stored = _stored(sub.events())
    assert [h for e in stored for h in e.block_hashes] == [block_hash(k) for k in keys]
    assert stored[0].parent_block_hash is None
    depth: dict[int | bytes, int] = {block_hash(k): i for i, k in enumerate(keys)}
    for e in stored[1:]:  # each later batch continues the chain where the last one ended
        assert e.parent_block_hash == block_hash(keys[depth[e.block_hashes[0]] - 1])
    assert {(e.medium, e.locality, e.block_size, tuple(e.token_ids)) for e in stored} == {
        ("CPU", "LOCAL", BLOCK_SIZE, ())}
    assert all(b.data_parallel_rank == 0 for b in sub.batches())
    assert block_hash(keys[0]) == int.from_bytes(keys[0][-8:], "big")


def test_a_demotion_is_removed_from_cpu_and_stored_on_storage_and_eviction_removes(
        daemon_factory: Callable[..., Daemon],
        publish: Callable[..., tuple[NodePublisher, Subscriber]]) -> None:
    d = daemon_factory(*SMALL)
    publisher, sub = publish(d)
    keys, values = blocks(48, size=64 * 1024)  # 3 MiB: more than L2's 2 MiB
    with KVStoreClient(d.target, "moves") as kv:
        kv.put(keys[:8], values[:8])  # a chain
        for i in range(8, 48, 8):
            kv.put(keys[i:i + 8], values[i:i + 8], independent=True)
        wait_until(lambda: any(e.medium == "STORAGE" for e in _stored(sub.events())),
                   "a block re-announced on STORAGE")
        events = sub.events()
        moved = {h for e in _stored(events) if e.medium == "STORAGE" for h in e.block_hashes}
        removed_cpu = {h for e in _removed(events) if e.medium == "CPU" for h in e.block_hashes}
        assert moved <= removed_cpu  # each move: BlockRemoved(CPU) before BlockStored(STORAGE)
        order = [(type(e).__name__, e.medium, h) for e in events
                 if isinstance(e, (BlockStored, BlockRemoved)) for h in e.block_hashes]
        for h in moved:
            assert order.index(("BlockRemoved", "CPU", h)) < order.index(
                ("BlockStored", "STORAGE", h))
        chain = {block_hash(k): block_hash(keys[i - 1]) if i else None
                 for i, k in enumerate(keys[:8])}
        for e in _stored(events):  # a moved chain block keeps its parent
            if e.medium == "STORAGE" and e.block_hashes[0] in chain:
                assert e.parent_block_hash == chain[e.block_hashes[0]]
        assert all(e.locality == "LOCAL" for e in _stored(events) + _removed(events))
        kv.evict(keys[8:16])
    evicted = {block_hash(k) for k in keys[8:16]}
    wait_until(lambda: evicted <= {h for e in _removed(sub.events()) for h in e.block_hashes
                                   if e.medium == "STORAGE" or h not in moved},
               "the 8 evicted blocks removed")


def test_a_plain_address_is_connected_to_as_vllm_connects_to_a_routers_sub(
        daemon_factory: Callable[..., Daemon]) -> None:
    """llm-d's scorer binds its SUB socket and engines connect to it: an --endpoint without a
    wildcard is connected to, as vLLM's publisher does."""
    d = daemon_factory(*SMALL)
    context = zmq.Context()
    router = context.socket(zmq.SUB)
    router.setsockopt(zmq.SUBSCRIBE, b"kv@")
    address = f"tcp://127.0.0.1:{free_port()}"
    router.bind(address)
    publisher = NodePublisher(Settings(target=d.target, block_size=BLOCK_SIZE, node=NODE,
                                       endpoint=address, replay_endpoint=None,
                                       http_port=-1)).start()
    try:
        keys, values = blocks(2, size=1024)

        def heard() -> bool:
            publisher.publishing.queue.put([PROBE])
            return bool(router.poll(50))

        wait_until(heard, "the publisher to connect", pause_s=0.1)
        with KVStoreClient(d.target, "connected") as kv:
            kv.put(keys, values)
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        hashes: list[int | bytes] = []
        while len(hashes) < 2:
            assert router.poll(10_000), "no batch within 10 s"
            topic, _, payload = router.recv_multipart()
            if topic == b"kv@node:n1@connected":
                hashes += [h for e in decoder.decode(payload).events
                           if isinstance(e, BlockStored) for h in e.block_hashes]
        assert hashes == [block_hash(k) for k in keys]
        assert publisher.vllm.endpoint == address and publisher.vllm.replay is None
    finally:
        publisher.stop()
        router.close(linger=0)
        context.term()


def _replay(endpoint: str, start: int) -> list[list[bytes]]:
    """vLLM's replay protocol from a DEALER: send ["", start], read to the end marker."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint.replace("0.0.0.0", "127.0.0.1"))
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        frames: list[list[bytes]] = []
        while True:
            assert dealer.poll(10_000), "no replay answer within 10 s"
            message = dealer.recv_multipart()
            if message[2] == END_SEQ:
                assert message == [b"", b"", END_SEQ, b""]
                return frames
            frames.append(message[1:])
    finally:
        dealer.close(linger=0)
        context.term()


def test_the_replay_socket_resends_held_batches_from_a_sequence(
        daemon_factory: Callable[..., Daemon],
        publish: Callable[..., tuple[NodePublisher, Subscriber]]) -> None:
    d = daemon_factory(*SMALL)
    publisher, sub = publish(d)
    keys, values = blocks(5, size=1024)
    with KVStoreClient(d.target, "replay") as kv:
        for i in range(5):
            kv.put(keys[i:i + 1], values[i:i + 1], independent=True)
    wait_until(lambda: len(_stored(sub.events())) >= 5, "5 stores")
    live = list(sub.frames)
    assert publisher.vllm.replay_endpoint is not None
    everything = _replay(publisher.vllm.replay_endpoint, 0)
    assert everything[-len(live):] == live  # the same frames, byte for byte
    assert [int.from_bytes(f[1], "big") for f in everything] == list(range(len(everything)))
    later = _replay(publisher.vllm.replay_endpoint, len(everything) - 2)
    assert later == everything[-2:]
    assert _replay(publisher.vllm.replay_endpoint, 10**6) == []


def test_the_mooncake_socket_sends_rfc_1527_event_maps(
        daemon_factory: Callable[..., Daemon],
        publish: Callable[..., tuple[NodePublisher, Subscriber]]) -> None:
    d = daemon_factory(*SMALL)
    publisher, _ = publish(d, mooncake_endpoint=_endpoint())
    assert publisher.mooncake is not None
    sub = Subscriber(publisher.mooncake.endpoint)
    try:
        def heard() -> bool:
            publisher.publishing.queue.put([PROBE])
            return sub.heard

        wait_until(heard, "the Mooncake subscription", pause_s=0.2)
        keys, values = blocks(3, size=1024)
        with KVStoreClient(d.target, "mc") as kv:
            kv.put(keys, values)
        def decoded() -> list[Any]:
            return [msgspec.msgpack.decode(f[2]) for f in list(sub.frames)]

        wait_until(lambda: sum(len(e.get("seq_hashes", [])) for b in decoded() for e in b[1]
                               if e["event_type"] == "stored") == 3, "3 stored blocks")
        batches = decoded()
        assert all(len(b) == 3 and isinstance(b[0], int) and b[2] == 0 for b in batches)
        stored = [e for b in batches for e in b[1] if e["event_type"] == "stored"]
        assert [h for e in stored for h in e["seq_hashes"]] == [block_hash(k) for k in keys]
        first = stored[0]
        assert first["base_block_idx"] == 0 and first["parent_hash"] is None
        assert {(e["medium"], e["backend_id"], e["tenant_id"], e["additional_salt"],
                 e["block_size"]) for e in stored} == {("cpu", NODE, "default", "mc", BLOCK_SIZE)}
        ids = [e["event_id"] for b in batches for e in b[1]]
        assert ids == list(range(ids[0], ids[0] + len(ids)))
        assert set(first) >= {"event_id", "timestamp", "event_type", "model_name", "lora_name",
                              "dp_rank", "token_ids"}
    finally:
        sub.close()


def _http(publisher: NodePublisher, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    url = f"http://127.0.0.1:{publisher.http_port}{path}"
    data = None if body is None else (body if isinstance(body, bytes)
                                      else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_query_answers_as_lookup_does(
        daemon_factory: Callable[..., Daemon],
        publish: Callable[..., tuple[NodePublisher, Subscriber]]) -> None:
    d = daemon_factory(*SMALL, "server.max_batch_keys=4")
    publisher, _ = publish(d)
    tokens = list(range(1000, 1000 + 10 * BLOCK_SIZE + 5))  # 10 full blocks and 5 tokens
    keys = prefix_keys(tokens, BLOCK_SIZE, "q")
    values = blocks(7, size=1024)[1]
    with KVStoreClient(d.target, "q") as kv:
        kv.put(keys[:4], values[:4])
        kv.put(keys[4:7], values[4:7], parent=keys[3])
        parts = [kv.lookup(keys[i:i + 4]) for i in range(0, 10, 4)]  # 4 keys a Lookup
    expected_tiers = [t for p in parts for t in p.tiers]
    assert [p.prefix_length for p in parts] == [4, 3, 0]
    by_tokens = _http(publisher, "/query", {"namespace": "q", "token_ids": tokens,
                                            "block_size": BLOCK_SIZE})
    by_keys = _http(publisher, "/query", {"namespace": "q", "keys": [k.hex() for k in keys]})
    by_get = _http(publisher, "/query?namespace=q&block_size=16&token_ids="
                   + ",".join(map(str, tokens)))
    for status, answer in (by_tokens, by_keys, by_get):
        assert status == 200
        assert answer["prefix_length"] == 7  # across Lookups of 4 keys
        assert answer["tiers"] == expected_tiers
        assert answer["hits"] == {"hbm": 0, "dram": 7, "nvme": 0, "remote": 0}
        assert answer["node"] == NODE and answer["blocks"] == 10
    assert by_tokens[1]["longest_matched"] == 7 * BLOCK_SIZE
    assert by_keys[1]["longest_matched"] is None
    status, health = _http(publisher, "/health")
    assert status == 200 and health["auth_mode"] == "off" and health["daemon_id"]


@pytest.mark.parametrize(("body", "field"), [
    ({"keys": []}, "namespace"),
    ({"namespace": "q"}, "keys or token_ids"),
    ({"namespace": "q", "keys": ["zz"]}, "keys[0]"),
    ({"namespace": "q", "keys": ["ab" * 31]}, "keys[0]"),
    ({"namespace": "q", "token_ids": [1, 2]}, "block_size"),
    ({"namespace": "q", "token_ids": [1, "x"], "block_size": 2}, "token_ids"),
    ({"namespace": "q", "token_ids": [2**33] * 2, "block_size": 2}, "token_ids"),
    ({"namespace": "q", "keys": [], "block_size": -1}, "block_size"),
    ({"namespace": "", "keys": []}, "namespace"),
    (b"{not json", "body"),
    ([1, 2], "body"),
])
def test_a_bad_query_is_400_naming_the_field(
        shared_daemon: Callable[..., Daemon],
        publish: Callable[..., tuple[NodePublisher, Subscriber]], body: Any,
        field: str) -> None:
    publisher, _ = publish(shared_daemon("nvme.enabled=false"))
    status, answer = _http(publisher, "/query", body)
    assert status == 400
    assert answer["error"].startswith(field + ":"), answer


def test_a_tenants_publisher_sees_only_its_namespaces(
        daemon_factory: Callable[..., Daemon],
        publish: Callable[..., tuple[NodePublisher, Subscriber]], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    d = daemon_factory(*auth_settings(write_tenants(tmp_path / "t.yaml", tenants_doc())))
    with caplog.at_level(logging.WARNING, "kvstore.events"):
        publisher, sub = publish(d, token=TOKENS["team-a"])
    assert publisher.auth_mode == "token" and publisher.tenant == "team-a"
    assert "auth is off" not in caplog.text
    keys, values = blocks(4, size=1024)
    with KVStoreClient(d.target, "team-b/m", token=TOKENS["team-b"]) as kv:
        kv.put(keys[:2], values[:2], independent=True)
    with KVStoreClient(d.target, "team-a/m", token=TOKENS["team-a"]) as kv:
        kv.put(keys[2:], values[2:], independent=True)
    wait_until(lambda: len(_stored(sub.events())) >= 2, "team-a's 2 blocks")
    assert {f[0] for f in sub.frames} == {b"kv@node:n1@team-a/m"}
    assert {h for e in _stored(sub.events()) for h in e.block_hashes} == {
        block_hash(k) for k in keys[2:]}
    status, answer = _http(publisher, "/query", {"namespace": "team-b/m",
                                                 "keys": [keys[0].hex()]})
    assert status == 403 and "Lookup" in answer["error"]


def test_auth_off_is_warned_of(shared_daemon: Callable[..., Daemon],
                               publish: Callable[..., tuple[NodePublisher, Subscriber]],
                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "kvstore.events"):
        publish(shared_daemon("nvme.enabled=false"))
    assert "auth is off" in caplog.text


# --- the relay's bookkeeping, fed real WatchEventsResponse messages ----------------------


def _response(daemon_id: str, *events: tuple[int, int, str, bytes], dropped: int = 0) -> Any:
    return pb.WatchEventsResponse(daemon_id=daemon_id, dropped=dropped, events=[
        pb.BlockEvent(sequence=s, kind=k, namespace=ns, key=key, tier=pb.TIER_DRAM)
        for s, k, ns, key in events])


def test_the_relay_skips_what_it_sent_and_clears_on_a_new_daemon() -> None:
    out: list[list[Change]] = []
    relay = Relay(None, Translator(max_blocks=4), out.append)
    stored = pb.BLOCK_EVENT_KIND_STORED
    k = [bytes([i]) * 32 for i in range(6)]
    relay.handle(_response("d1", (1, pb.BLOCK_EVENT_KIND_CLEARED, "", b""),
                           (2, stored, "a", k[0]), (3, stored, "b", k[1])))
    assert [c.kind for c in out[0]] == ["stored", "stored"]  # no namespace known yet
    out.clear()
    relay.handle(_response("d1", (2, stored, "a", k[0]), (3, stored, "b", k[1]),
                           (4, stored, "a", k[2])))  # a reconnect replays from 1
    assert [(c.namespace, c.hashes) for c in out[0]] == [("a", [block_hash(k[2])])]
    out.clear()
    relay.handle(_response("d1", (9, stored, "a", k[3])))
    assert relay.cursor.missed == 4 and relay.cursor.last_sequence == 9
    out.clear()
    relay.handle(_response("d2", (40, stored, "c", k[4]), dropped=39))  # another daemon run
    assert sorted((c.kind, c.namespace) for c in out[0][:2]) == [("cleared", "a"),
                                                                 ("cleared", "b")]
    assert [(c.kind, c.namespace) for c in out[0][2:]] == [("stored", "c")]
    assert relay.cursor.daemon_id == "d2" and relay.cursor.last_sequence == 40
    assert relay.cursor.missed == 4 + 39  # the new run's first 39 events were no longer held


def test_the_translator_forgets_parents_past_its_bound() -> None:
    translator = Translator(max_blocks=2)
    keys = [bytes([i]) * 32 for i in range(4)]
    events = [pb.BlockEvent(sequence=i + 1, kind=pb.BLOCK_EVENT_KIND_STORED, namespace="n",
                            key=k, tier=pb.TIER_DRAM, parent=keys[i - 1] if i else b"")
              for i, k in enumerate(keys)]
    changes = translator.translate(events)
    assert len(changes) == 1 and changes[0].hashes == [block_hash(k) for k in keys]
    assert translator.forgotten_parents == 2
    moved = translator.translate([pb.BlockEvent(
        sequence=5, kind=pb.BLOCK_EVENT_KIND_MOVED, namespace="n", key=keys[0],
        tier=pb.TIER_NVME, from_tier=pb.TIER_DRAM)])
    assert [(c.kind, c.medium.vllm if c.medium else None, c.parent, c.root)
            for c in moved] == [("removed", "CPU", None, False), ("stored", "STORAGE", None,
                                                                  False)]
    kept = translator.translate([pb.BlockEvent(
        sequence=6, kind=pb.BLOCK_EVENT_KIND_MOVED, namespace="n", key=keys[3],
        tier=pb.TIER_NVME, from_tier=pb.TIER_DRAM)])
    assert kept[1].parent == block_hash(keys[2])
    assert translator.translate([pb.BlockEvent(  # L2 -> L1: the same medium, nothing said
        sequence=7, kind=pb.BLOCK_EVENT_KIND_MOVED, namespace="n", key=keys[3],
        tier=pb.TIER_HBM, from_tier=pb.TIER_DRAM)]) == []
    assert [type(e).__name__ for e in [AllBlocksCleared()]] == ["AllBlocksCleared"]


def test_token_and_token_file_together_are_a_usage_error(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("secret\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--block-size", "16", "--token", "secret", "--token-file", str(token_file)])
    assert exit_info.value.code == 2
    assert "--token-file: not allowed with argument --token" in capsys.readouterr().err
