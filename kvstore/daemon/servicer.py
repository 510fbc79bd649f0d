"""The KVStore servicer: the gRPC face of the daemon. It decodes each request, calls the
store (its reader for Get and Release, its writer for Put, the store itself for the rest),
and encodes the reply.

It is thin on purpose. Who is calling and what it may touch is decided first
(`kvstore.daemon.auth`: a Caller's tenant owns the namespace, or its role allows the verb).
Every error is mapped to a status code and its ErrorInfo reason in one function,
`kvstore.daemon.faults.described`. Put and Get move their bulk bytes as raw frames
(`kvstore.proto.frames`), so the servicer is registered through
`kvstore.daemon.methods.handlers()` instead of the generated add_KVStoreServicer_to_server.
The hot verbs' logic is shared with the local socket (`kvstore.daemon.verbs`); the servicer
also owns the streams' admission caps, the drain, and the Attach tickets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from kvstore import __version__
from kvstore.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    Reason,
    Unavailable,
)
from kvstore.core.records import ReadResult, StoreStats
from kvstore.daemon.admission import Stream, StreamSlots, client_stream_cap
from kvstore.daemon.attach import ATTACH_TICKET_S, Tickets
from kvstore.daemon.auth import Caller
from kvstore.daemon.config import config_to_dict
from kvstore.daemon.datasocket import DataSessions
from kvstore.daemon.events import EventBatch
from kvstore.daemon.faults import FaultLog, abort, code_of, described, parsed
from kvstore.daemon.localpath import LocalSessions
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.store import Store
from kvstore.daemon.tier_setup import l3_dir
from kvstore.daemon.verbs import Verbs
from kvstore.proto.frames import data_frame
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.shm import host_id
from kvstore.tier import Tier

log = logging.getLogger("kvstore.daemon.server")


def _tier(value: int, field: str) -> Tier | None:
    if value == pb.TIER_UNSPECIFIED:
        return None
    try:
        return Tier(value)
    except ValueError as exc:
        raise InvalidArgument(f"{field} {value} is not a tier", field=field) from exc


def _put_data(msg: pb.PutRequest | memoryview) -> memoryview:
    """The bytes of a Put's later message: a data-only frame as it is (not copied), or a
    PutRequest that carries data and no header field."""
    if isinstance(msg, memoryview):
        return msg
    header = [f.name for f, _ in msg.ListFields() if f.name != "data"]
    if header:
        raise InvalidArgument(f"{header[0]}: only the first PutRequest carries a header; "
                              "later ones carry data alone", field=header[0])
    return memoryview(msg.data)


class KVStoreServicer:
    """Every verb of kvstore.v1.KVStore over one store, called by gRPC from its worker
    threads, many at once."""

    def __init__(self, store: Store, metrics: Metrics,
                 drain: Callable[[], None] = lambda: None) -> None:
        """drain() begins a graceful stop (the Drain verb), as SIGTERM does."""
        self.store = store
        self._drain = drain
        self.metrics = metrics
        self.config = store.config
        self.host_id = host_id()
        self.draining = threading.Event()  # set on SIGTERM: new data calls are refused
        self.slots = StreamSlots(self.config)  # streams in flight, capped
        self.faults = FaultLog()
        self.auth = store.auth
        self.verbs = Verbs(store)
        self.tickets = Tickets()  # Attach's, redeemed on the Unix socket (kvstore.daemon.attach)
        # The hot verbs on the Unix socket, for co-located clients (server.unix_socket).
        self.local = LocalSessions(self.verbs, self.auth, self.tickets, metrics, self.faults,
                                   self.draining, self.config.server.max_message_bytes)
        # The same over TCP for engines on other hosts (server.data_port; the port it got is
        # set once it is bound, 0 while there is none).
        self.data = DataSessions(self.verbs, self.auth, self.tickets, metrics, self.faults,
                                 self.draining, self.config.server.max_message_bytes)
        self.data_port = 0

    def _admit(self, request: Any, method: str) -> Any:
        """The request, parsed, if the daemon takes new calls of this method: while draining
        only Release (readers must let go), Stats, Limits and Drain are."""
        if self.draining.is_set() and method not in ("Release", "Stats", "Drain", "Limits"):
            raise Unavailable("the daemon is draining (it is stopping): retry on another "
                              "replica or after its restart", Reason.DRAINING)
        return parsed(request)

    def _fail(self, context: grpc.ServicerContext, method: str, exc: Exception,
              started: float, stream: Stream | None = None) -> None:
        if stream is not None and stream.aborted:  # idle: the reaper told the client why
            self.metrics.observe_rpc(method, "ABORTED", time.perf_counter() - started)
            abort(context, stream.idle_status())
        if not context.is_active():  # the client went away: a cancellation, not a fault
            self.metrics.observe_rpc(method, "CANCELLED", time.perf_counter() - started)
            context.abort(grpc.StatusCode.CANCELLED, "the client cancelled the call")
        status = described(exc)
        code = code_of(status)
        self.metrics.observe_rpc(method, code.name, time.perf_counter() - started)
        if code is not grpc.StatusCode.INTERNAL:  # a bug is logged with its traceback instead
            self.faults.fault(method, context.peer(), code, status.message)
        abort(context, status)

    def _ok(self, method: str, started: float) -> None:
        self.metrics.observe_rpc(method, "OK", time.perf_counter() - started)

    def Put(self, request_iterator: Iterator[pb.PutRequest | memoryview],
            context: grpc.ServicerContext) -> pb.PutResponse:
        started = time.perf_counter()
        stream = None
        slot = contextlib.ExitStack()
        ended = threading.Event()
        context.add_callback(ended.set)  # on the call's end, a client's cancel included
        try:
            caller = self.auth.caller(context)
            stream = slot.enter_context(self.slots.held(context.peer(), context, caller.client))
            messages = stream.receive(request_iterator)
            first = self._put_header(next(messages, None))
            caller.data(first.namespace)
            if first.reservation_id:
                if next(messages, None) is not None:
                    raise InvalidArgument("PutRequest: a commit (reservation_id) is one "
                                          "message; the bytes are in shared memory",
                                          field="data")
                response = self.verbs.commit(caller, first)
            else:
                response = self._put_inline(first, messages, stream.client, ended)
            self._ok("Put", started)
            return response
        except Exception as exc:
            self._fail(context, "Put", exc, started, stream)
            raise
        finally:
            slot.close()
            if stream is not None:
                self.metrics.observe_stream("Put", stream.longest_wait_s, stream.aborted)

    def _put_header(self, first: pb.PutRequest | memoryview | None) -> pb.PutRequest:
        """The first message of a Put, which must be a header (keys and sizes, or a
        reservation id), once the daemon admits the call."""
        first = self._admit(first, "Put")
        if first is None:
            raise InvalidArgument("PutRequest: the stream carried no message")
        if isinstance(first, memoryview):
            raise InvalidArgument("PutRequest: the stream began with data and no header",
                                  field="namespace")
        return first

    def _put_inline(self, first: pb.PutRequest, messages: Iterator[pb.PutRequest | memoryview],
                    client: str, ended: threading.Event) -> pb.PutResponse:
        """A Put whose bytes come in the stream: planned from the header, written as each
        message arrives, and committed once the stream ends. Any failure gives the planned
        pages back."""
        if first.checksums:
            raise InvalidArgument("checksums: only a commit (reservation_id) carries the "
                                  "writer's checksums; inline bytes are checksummed as "
                                  "they arrive", field="checksums")
        writer = self.store.writer
        session = writer.begin_put(first.namespace, first.keys, first.sizes, first.parent_key,
                                   first.independent, client)
        try:
            if first.data:
                writer.write(session, memoryview(first.data))
            for msg in map(parsed, messages):
                writer.write(session, _put_data(msg))
            if session.received_bytes < session.total_bytes:
                # Short of its bytes: gRPC may end the stream of a client that cancelled
                # before it marks the call cancelled; give the cancel a moment to land,
                # so it counts as CANCELLED and not as a client fault.
                ended.wait(0.05)
            result = writer.commit(session)
        except BaseException:
            writer.abort(session.plan_id)
            raise
        return pb.PutResponse(stored=result.stored, existing=result.existing,
                              evicted=result.evicted)

    def Get(self, request: pb.GetRequest,
            context: grpc.ServicerContext) -> Iterator[pb.GetResponse | bytes]:
        started = time.perf_counter()
        slot = contextlib.ExitStack()
        try:
            caller = self.auth.caller(context)
            stream = slot.enter_context(self.slots.held(context.peer(), context, caller.client))
            request = self._admit(request, "Get")
            caller.data(request.namespace)
            shared, timeout_s, leased = self.verbs.get_options(request)
            result = self.store.reader.read(request.namespace, request.keys, timeout_s,
                                            leased, stream.client, inline=not shared,
                                            deadline_s=context.time_remaining())
        except Exception as exc:
            slot.close()
            self._fail(context, "Get", exc, started)
            raise
        try:
            with slot:
                yield from stream.send(
                    self._get_reply(result, shared, timeout_s, leased, started, context))
        except GeneratorExit:  # gRPC stopped sending: the client left, or the reaper ended it
            code = "ABORTED" if stream.aborted else "CANCELLED"
            self.metrics.observe_rpc("Get", code, time.perf_counter() - started)
            raise
        finally:
            self.metrics.observe_stream("Get", stream.longest_wait_s, stream.aborted)

    def _get_reply(self, result: ReadResult, shared: bool, timeout_s: float, leased: bool,
                   started: float, context: grpc.ServicerContext
                   ) -> Iterator[pb.GetResponse | bytes]:
        if shared:
            head = self.verbs.shared_reply(result, timeout_s, leased)
            self._ok("Get", started)
            yield head
            return
        head = self.verbs.header(result)
        hits = head.sizes
        try:
            # Data messages are pre-framed bytes (kvstore.proto.frames): one copy out of
            # shared memory, none by protobuf. The header goes alone, so the client parses
            # only it and takes every chunk as a view (merged, protobuf copied the chunk).
            yield head

            def frame(views: list[memoryview], size: int) -> bytes:
                framed: bytes = data_frame(b"", views, size)
                return framed

            yield from self.store.reader.chunks(result, self.config.server.chunk_bytes, frame)
            self._ok("Get", started)
        except Exception as exc:
            self._fail(context, "Get", exc, started)
        finally:
            if hits:
                with contextlib.suppress(InvalidArgument):  # expired mid-stream: reported above
                    self.store.reader.release([result.lease_id])

    def _unary(self, method: str, context: grpc.ServicerContext,
               fn: Callable[[Caller], Any], request: Any) -> Any:
        started = time.perf_counter()
        try:
            caller = self.auth.caller(context)
            self._admit(request, method)
            response = fn(caller)
        except Exception as exc:
            self._fail(context, method, exc, started)
            raise
        self._ok(method, started)
        return response

    def Lookup(self, request: pb.LookupRequest,
               context: grpc.ServicerContext) -> pb.LookupResponse:
        return self._unary("Lookup", context,
                           lambda caller: self.verbs.lookup(caller, request), request)

    def _streamed(self, method: str, context: grpc.ServicerContext,
                  progress: Callable[[Caller], Iterator[Any]], message: type[Any],
                  request: Any, to_message: Callable[[Any], Any] | None = None
                  ) -> Iterator[Any]:
        """A progress stream (Prefetch, Prewarm, WatchEvents): each step as `message` (same
        field names), or as to_message makes it, its errors mapped like any call's."""
        convert = to_message or (lambda step: message(**dataclasses.asdict(step)))
        started = time.perf_counter()
        stream = None
        try:
            caller = self.auth.caller(context)
            with self.slots.held(context.peer(), context, caller.client) as stream:
                self._admit(request, method)
                for step in stream.send(progress(caller)):
                    yield convert(step)
        except GeneratorExit:  # gRPC stopped sending: the client left, or the reaper ended it
            code = "ABORTED" if stream is not None and stream.aborted else "CANCELLED"
            self.metrics.observe_rpc(method, code, time.perf_counter() - started)
            raise
        except Exception as exc:
            self._fail(context, method, exc, started, stream)
            raise
        finally:
            if stream is not None:
                self.metrics.observe_stream(method, stream.longest_wait_s, stream.aborted)
        self._ok(method, started)

    def Prefetch(self, request: pb.PrefetchRequest,
                 context: grpc.ServicerContext) -> Iterator[pb.PrefetchProgress]:
        def progress(caller: Caller) -> Iterator[Any]:
            caller.data(request.namespace)
            target = _tier(request.target_tier, "target_tier")
            deadline_s = request.deadline_ms / 1000 if request.deadline_ms else None
            return self.store.prefetch(request.namespace, request.keys, target, deadline_s,
                                       cancelled=lambda: not context.is_active())
        return self._streamed("Prefetch", context, progress, pb.PrefetchProgress, request)

    def Hot(self, request: pb.HotRequest, context: grpc.ServicerContext) -> pb.HotResponse:
        def run(caller: Caller) -> pb.HotResponse:
            caller.operate(request.namespace)
            hot = self.store.hot(request.namespace, request.limit)
            return pb.HotResponse(keys=[k for k, _ in hot], scores=[s for _, s in hot])
        return self._unary("Hot", context, run, request)

    def Prewarm(self, request: pb.PrewarmRequest,
                context: grpc.ServicerContext) -> Iterator[pb.PrewarmProgress]:
        def progress(caller: Caller) -> Iterator[Any]:
            namespaces = list(request.namespaces)
            for i, namespace in enumerate(namespaces):
                caller.operate(namespace, f"namespaces[{i}]")
            if not namespaces and not caller.tenant.admin:  # every namespace it owns
                namespaces = [n for n in self.store.remote_namespaces()
                              if caller.tenant.owns(n)]
                if not namespaces:
                    return iter(())
            return self.store.prewarm(request.bytes, namespaces)
        return self._streamed("Prewarm", context, progress, pb.PrewarmProgress, request)

    def WatchEvents(self, request: pb.WatchEventsRequest,
                    context: grpc.ServicerContext) -> Iterator[pb.WatchEventsResponse]:
        """The caller's tenant's block events (kvstore.daemon.events), from
        request.from_sequence, until the caller leaves."""
        def batches(caller: Caller) -> Iterator[Any]:
            if self.store.events is None:
                raise FailedPrecondition("block events are off (events.buffer_events is 0)",
                                         setting="events.buffer_events")
            tenant = caller.tenant.name if self.auth.on else ""
            return self.store.events.stream(tenant, request.from_sequence, context.is_active)
        return self._streamed("WatchEvents", context, batches, pb.WatchEventsResponse,
                              request, _events_response)

    def Reserve(self, request: pb.ReserveRequest,
                context: grpc.ServicerContext) -> pb.ReserveResponse:
        return self._unary("Reserve", context,
                           lambda caller: self.verbs.reserve(caller, request), request)

    def Release(self, request: pb.ReleaseRequest,
                context: grpc.ServicerContext) -> pb.ReleaseResponse:
        return self._unary("Release", context,
                           lambda caller: self.verbs.release(caller, request), request)

    def Evict(self, request: pb.EvictRequest,
              context: grpc.ServicerContext) -> pb.EvictResponse:
        def run(caller: Caller) -> pb.EvictResponse:
            if request.namespace:
                caller.operate(request.namespace)
            else:
                caller.tenant.check_admin("Evict across every namespace (namespace empty)")
            r = self.store.evict(request.namespace, request.keys, request.bytes, request.all,
                                 _tier(request.tier, "tier"))
            k = r.skipped
            return pb.EvictResponse(
                evicted=r.evicted, evicted_bytes=r.evicted_bytes, skipped=k.total,
                skipped_pinned=k.pinned, skipped_leased=k.leased, skipped_loading=k.loading,
                skipped_child_in_faster_tier=k.child_in_faster_tier,
                skipped_has_children=k.has_children)
        return self._unary("Evict", context, run, request)

    def Pin(self, request: pb.PinRequest,
            context: grpc.ServicerContext) -> pb.PinResponse:
        def run(caller: Caller) -> pb.PinResponse:
            caller.data(request.namespace)
            changed, missing = self.store.set_pinned(request.namespace, request.keys, True,
                                                     caller.client)
            return pb.PinResponse(changed=changed, missing=missing)
        return self._unary("Pin", context, run, request)

    def Unpin(self, request: pb.PinRequest,
              context: grpc.ServicerContext) -> pb.PinResponse:
        def run(caller: Caller) -> pb.PinResponse:
            caller.data(request.namespace)
            changed, missing = self.store.set_pinned(request.namespace, request.keys, False)
            return pb.PinResponse(changed=changed, missing=missing)
        return self._unary("Unpin", context, run, request)

    def Stats(self, request: pb.StatsRequest,
              context: grpc.ServicerContext) -> pb.StatsResponse:
        def run(caller: Caller) -> pb.StatsResponse:
            if request.namespace:
                caller.operate(request.namespace)
            if request.include_config:
                caller.tenant.check_admin("Stats include_config")
            tenant = caller.tenant if self.auth.on else None
            return self._stats_response(self.store.stats(request.namespace, tenant),
                                        request.include_config, caller)
        return self._unary("Stats", context, run, request)

    def Drain(self, request: pb.DrainRequest,
              context: grpc.ServicerContext) -> pb.DrainResponse:
        def run(caller: Caller) -> pb.DrainResponse:
            caller.tenant.check_admin("Drain")
            already = self.draining.is_set()
            log.info("Drain asked by %s%s", context.peer(), " (already draining)" if already
                     else "")
            response = pb.DrainResponse(already_draining=already,
                                        streams_in_flight=self.slots.in_flight,
                                        grace_s=self.config.server.grace_s)
            self._drain()
            return response
        return self._unary("Drain", context, run, request)

    def Attach(self, request: pb.AttachRequest,
               context: grpc.ServicerContext) -> pb.AttachResponse:
        def run(caller: Caller) -> pb.AttachResponse:
            socket_path = self.config.server.unix_socket
            if not self.auth.on:
                raise FailedPrecondition("auth.mode is off: attach the named segment "
                                         "(StatsResponse.shm_name) instead", setting="auth.mode")
            dram = self.store.state.dram
            if dram is None or not (socket_path or self.data_port):
                raise FailedPrecondition("shared memory needs the dram tier and "
                                         "server.unix_socket (the data socket: "
                                         "server.data_port); move data inline",
                                         setting="server.unix_socket"
                                         if dram is not None else "dram.enabled")
            if not dram.arena_fds(caller.tenant.name):
                raise FailedPrecondition(f"tenant {caller.tenant.name!r} owns no namespace, so "
                                         "it has no shared-memory arena",
                                         setting="auth.tenants_file")
            return pb.AttachResponse(ticket=self.tickets.issue(caller.tenant.name),
                                     unix_socket=socket_path,
                                     expires_in_ms=int(ATTACH_TICKET_S * 1000))
        return self._unary("Attach", context, run, request)

    def Limits(self, request: pb.LimitsRequest,
               context: grpc.ServicerContext) -> pb.LimitsResponse:
        def run(caller: Caller) -> pb.LimitsResponse:
            limits = self.verbs.limits()
            limits.data_port = self.data_port if limits.shared_memory else 0
            return limits
        return self._unary("Limits", context, run, request)

    def _stats_response(self, s: StoreStats, include_config: bool,
                        caller: Caller) -> pb.StatsResponse:
        l2_on = self.store.state.dram is not None  # the Unix socket serves L2's clients
        tiers = [
            pb.TierStats(**{**dataclasses.asdict(t), "tier": Tier[t.tier.upper()].value})
            for t in s.tiers
        ]
        return pb.StatsResponse(
            tiers=tiers, shm_name=s.shm_name, shm_size_bytes=s.shm_size_bytes,
            host_id=self.host_id, leases=s.leases, reservations=s.reservations, pinned=s.pinned,
            version=__version__,
            hits=s.hits, misses=s.misses,
            config_json=json.dumps(self._config_in_effect(s)) if include_config else "",
            prewarm=pb.PrewarmProgress(**dataclasses.asdict(s.prewarm)) if s.prewarm else None,
            clients=[pb.ClientHoldings(client=client, **dataclasses.asdict(held))
                     for client, held in self.store.holdings().items()
                     if caller.tenant.admin or client == caller.client],
            draining=self.draining.is_set(),
            auth_mode=self.auth.mode, tenant=caller.tenant.name,
            unix_socket=self.config.server.unix_socket if l2_on else "",
        )

    def _config_in_effect(self, s: StoreStats) -> dict[str, Any]:
        """config_to_dict with what the daemon chose where the settings left it the choice
        ("", auto or 0): the segment it created, the L1 it found, the L3 backend and folder
        it opened, the stream caps it derived."""
        data = config_to_dict(self.config)
        rows = {t.tier: t for t in s.tiers}
        hbm, nvme = rows["hbm"], rows["nvme"]
        data["hbm"]["mode"] = "on" if hbm.enabled else "off"
        if hbm.enabled:
            data["hbm"]["capacity_bytes"] = hbm.capacity_bytes
        if self.store.state.dram is not None:
            data["dram"]["shm_name"] = self.store.state.dram.shm_name
        if nvme.enabled:
            data["nvme"]["backend"] = nvme.backend
            data["nvme"]["dir"] = str(l3_dir(self.config))
        data["server"]["max_streams"] = self.slots.limit
        data["server"]["max_streams_per_connection"] = self.slots.per_connection
        data["clients"]["max_streams"] = client_stream_cap(self.config)
        return data


def _events_response(batch: EventBatch) -> pb.WatchEventsResponse:
    """A batch of block events as the wire has it, field by field (a batch holds up to 1,024
    events: no generic dict on the way)."""
    return pb.WatchEventsResponse(
        events=[pb.BlockEvent(sequence=e.sequence, kind=e.kind, namespace=e.namespace,
                              key=e.key, tier=e.tier, from_tier=e.from_tier, parent=e.parent)
                for e in batch.events],
        dropped=batch.dropped, daemon_id=batch.daemon_id)
