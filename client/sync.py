"""`KVStoreClient`: the blocking client, one method per verb of `kvstore.v1.KVStore`.

Data moves through the daemon's shared memory when the daemon runs on this host (decided
once, from one Stats call, and with auth on an Attach through its Unix socket) and inline in
the gRPC stream otherwise; `put`, `get` and `get_into` look the same either way. Every call
carries the client's credentials (`credentials`: a bearer token, TLS). Every RPC is retried
on UNAVAILABLE by `Retry` and its failures surface as the `KVStoreError` tree
(UNAUTHENTICATED and PERMISSION_DENIED are never retried). Thread-safe: share one client per
process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2

from kvstore.keys import BlockKey
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.localframe import COMMIT, GET, LOOKUP, RELEASE, RESERVE

from . import _requests as rq
from . import results as res
from ._base import ClientBase
from ._buffers import ByteArray
from ._localpath import NoSession
from ._segment import SharedSegment, only_header
from ._wire import (
    HEALTH_SERVICE,
    Fetched,
    InlineAssembler,
    channel_options,
    check_keys,
    chunk_of,
    finish_get,
    finish_get_into,
    put_frames,
)
from .credentials import ChannelSecurity
from .errors import DataLoss, FailedPrecondition, KVStoreError, from_rpc_error

__all__ = ["KVStoreClient"]

T = TypeVar("T")
M = TypeVar("M")  # a response message


class KVStoreClient(ClientBase):
    """A connection to one kvstore daemon, bound to one namespace."""

    @staticmethod
    def _open_channel(
        target: str, max_message_bytes: int, security: ChannelSecurity | None
    ) -> Any:
        options = channel_options(max_message_bytes, sync=True)
        if security is None:
            return grpc.insecure_channel(target, options=options)
        return grpc.secure_channel(
            target, security.credentials, options=[*options, *security.options]
        )

    # --- plumbing -------------------------------------------------------------------------

    def _streamed(self, call: Callable[[], Iterable[M]], convert: Callable[[M], T], first: T,
                  on_progress: Callable[[T], None] | None) -> T:
        """A progress stream (Prefetch, Prewarm): each message converted and reported; the
        last one returned (first when the stream is empty). Retried whole, as any call."""
        def attempt() -> T:
            last = first
            for message in call():
                last = convert(message)
                if on_progress is not None:
                    on_progress(last)
            return last

        return self._rpc(attempt)

    def _rpc(self, fn: Callable[[], T]) -> T:
        def attempt() -> T:
            try:
                return fn()
            except grpc.RpcError as exc:
                raise from_rpc_error(exc) from exc

        return self.retry.call(attempt)

    def _segment(self) -> SharedSegment | None:
        return self._shm.segment_for(self._fetch_stats, self._fetch_attach)

    def _hot(self, verb: int, request: Any, response_type: type[M],
             over_grpc: Callable[[], M]) -> M:
        """A hot verb over the local path when it is open, else (or once it cannot be had)
        over gRPC; not retried here (the caller's _rpc retries the whole step)."""
        local = self._shm.local
        if local is not None:
            try:
                return local.call(verb, request, response_type)
            except NoSession as exc:
                self._shm.local_off(exc)
        return over_grpc()

    def _release_lease(self, lease_id: str) -> None:
        """End a Get's lease without waiting for the answer when the local path is open (the
        answer is read before the session's next one); else a Release call."""
        local = self._shm.local
        if local is not None:
            local.post(RELEASE, pb.ReleaseRequest(ids=[lease_id]))
        else:
            self._release_quietly([lease_id])

    def _fetch_stats(self) -> pb.StatsResponse:
        request = self._stats_request()
        response: pb.StatsResponse = self._rpc(
            lambda: self._stub.Stats(request, timeout=self.timeout_s)
        )
        return response

    def _fetch_attach(self) -> pb.AttachResponse:
        response: pb.AttachResponse = self._rpc(
            lambda: self._stub.Attach(pb.AttachRequest(), timeout=self.timeout_s)
        )
        return response

    def _release_quietly(self, ids: list[str]) -> None:
        try:
            self._stub.Release(pb.ReleaseRequest(ids=ids), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            self._release_failed(ids, from_rpc_error(exc))

    def _drop_corrupt(self, bad: list[bytes]) -> None:
        for key in bad:
            request = self._corrupt(key)
            try:
                self._stub.Evict(request, timeout=self.timeout_s)
            except grpc.RpcError as exc:
                self._evict_failed(key, from_rpc_error(exc))

    # --- put ------------------------------------------------------------------------------

    def put(
        self,
        keys: Sequence[BlockKey],
        values: Sequence[object],
        *,
        parent: BlockKey | None = None,
        independent: bool = False,
    ) -> res.PutResult:
        """Store one block per key (any contiguous CPU buffer). By default keys form one chain
        (keys[i-1] the parent of keys[i]) whose first block follows `parent`; with
        independent=True they are unrelated. Existing keys are acknowledged, unchanged."""
        plan = rq.put_plan(self.namespace, keys, values, parent, independent)
        if not plan.keys:
            return res.PutResult(stored=0, existing=0, evicted=0)
        if self._segment() is not None:
            try:
                return res.put_result(self._rpc(lambda: self._put_shm(plan)))
            except FailedPrecondition as exc:
                self._shm.fall_back(exc)
        header = plan.inline_header()
        chunk = self._put_chunk(header) if self._limits_or_none() else self.chunk_bytes
        response: pb.PutResponse = self._rpc(
            lambda: self._put(
                put_frames(header, plan.payloads, chunk), timeout=self.timeout_s
            )
        )
        return res.put_result(response)

    def _put_shm(self, plan: rq.PutPlan) -> pb.PutResponse:
        request = plan.reserve_request()
        reserved = self._hot(RESERVE, request, pb.ReserveResponse,
                             lambda: self._stub.Reserve(request, timeout=self.timeout_s))
        committed = False
        try:
            self._shm.ensure_arena(reserved.arena, self._fetch_attach)
            checksums = self._shm.write_reservation(reserved, plan.payloads)
            commit = plan.commit_request(reserved.reservation_id, checksums)
            response = self._hot(COMMIT, commit, pb.PutResponse, lambda: self._put(
                iter([commit.SerializeToString()]), timeout=self.timeout_s))
            committed = True
            return response
        finally:
            if not committed and reserved.reservation_id:
                self._release_quietly([reserved.reservation_id])

    # --- get ------------------------------------------------------------------------------

    def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """Each key's block, or None for a miss (or a block that failed its checksum)."""
        key_list = check_keys(keys)
        if not key_list:
            return []
        fetched = self._fetch(key_list, None)
        out, bad = finish_get(key_list, fetched, self.verify_checksums)
        self._drop_corrupt(bad)
        return out

    def get_into(self, keys: Sequence[BlockKey], buffers: Sequence[object]) -> list[int | None]:
        """Copy each found block into buffers[i] (writable, contiguous, CPU, at least the
        block's size); return the block's size, or None for a miss."""
        key_list = check_keys(keys)
        arrays = rq.into_arrays(key_list, buffers)
        if not key_list:
            return []
        fetched = self._fetch(key_list, arrays)
        out, bad = finish_get_into(key_list, fetched, arrays, self.verify_checksums)
        self._drop_corrupt(bad)
        return out

    def _fetch(self, keys: list[bytes], arrays: list[ByteArray] | None) -> Fetched:
        if self._segment() is not None:
            try:
                return self._rpc(lambda: self._get_shm(keys, arrays))
            except FailedPrecondition as exc:
                self._shm.fall_back(exc)
        return self._rpc(lambda: self._get_inline(keys, arrays))

    def _get_shm(self, keys: list[bytes], arrays: list[ByteArray] | None) -> Fetched:
        request = self._get_request(keys, True)
        response = self._hot(GET, request, pb.GetResponse, lambda: only_header(
            list(self._get(request, timeout=self.timeout_s))))
        try:
            self._shm.ensure_arena(response.arena, self._fetch_attach)
            return self._shm.read_get(response, len(keys), arrays, self.verify_checksums)
        finally:
            if response.lease_id:
                self._release_lease(response.lease_id)

    def _get_inline(self, keys: list[bytes], arrays: list[ByteArray] | None) -> Fetched:
        call = self._get(self._get_request(keys, False), timeout=self.timeout_s)
        try:
            stream = iter(call)
            first = next(stream, None)
            if first is None:
                raise DataLoss("Get stream ended without a header")
            assembler = InlineAssembler.start(first, len(keys), arrays, self.verify_checksums)
            for message in stream:
                assembler.feed(chunk_of(message))
            return assembler.fetched()
        except BaseException:
            call.cancel()
            raise

    # --- control verbs --------------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey], *,
               block_tokens: int = 0) -> res.LookupResult:
        """The longest cached prefix of `keys` (a chain, root first) and each key's tier.
        block_tokens: the tokens each key covers (the engine's block size), so the daemon
        counts prefix hit tokens for its dashboards; 0 counts blocks only."""
        key_list = check_keys(keys)
        if not key_list:
            return res.LookupResult(prefix_length=0, tiers=[])
        request = rq.lookup_request(self.namespace, key_list, block_tokens)
        # Over the local path once a data call has opened it (with the shared memory).
        response: pb.LookupResponse = self._rpc(lambda: self._hot(
            LOOKUP, request, pb.LookupResponse,
            lambda: self._stub.Lookup(request, timeout=self.timeout_s)))
        return res.lookup_result(response)

    def prefetch(
        self,
        keys: Sequence[BlockKey],
        *,
        tier: str | None = None,
        deadline_s: float | None = None,
        on_progress: Callable[[res.PrefetchResult], None] | None = None,
    ) -> res.PrefetchResult:
        """Move keys up to `tier` (default: the highest enabled); the final progress."""
        key_list = check_keys(keys)
        request = rq.prefetch_request(self.namespace, key_list, tier, deadline_s)
        timeout_s = rq.prefetch_timeout_s(self.timeout_s, deadline_s)
        if not key_list:
            return res.PrefetchResult(done=0, missing=0, failed=0, total=0)

        return self._streamed(
            lambda: self._stub.Prefetch(request, timeout=timeout_s), res.prefetch_result,
            res.PrefetchResult(done=0, missing=0, failed=0, total=len(key_list)), on_progress)

    def evict(
        self,
        keys: Sequence[BlockKey] | None = None,
        *,
        bytes: int = 0,
        all: bool = False,
        tier: str | None = None,
        namespace: str | None = None,
    ) -> res.EvictResult:
        """Evict the named keys, at least `bytes` bytes (in eviction order, leaf first), or
        `all`, from `tier` (default every tier). namespace None is the client's; "" every
        namespace."""
        request = rq.evict_request(self.namespace, keys, bytes, all, tier, namespace)
        response: pb.EvictResponse = self._rpc(
            lambda: self._stub.Evict(request, timeout=self.timeout_s)
        )
        return res.evict_result(response)

    def pin(self, keys: Sequence[BlockKey]) -> res.PinResult:
        """Keep these entries from eviction until unpinned."""
        return self._pin(self._stub.Pin, keys)

    def unpin(self, keys: Sequence[BlockKey]) -> res.PinResult:
        """Undo pin: let these entries be evicted again."""
        return self._pin(self._stub.Unpin, keys)

    def _pin(
        self, method: Callable[..., pb.PinResponse], keys: Sequence[BlockKey]
    ) -> res.PinResult:
        key_list = check_keys(keys)
        if not key_list:
            return res.PinResult(changed=0, missing=0)
        request = pb.PinRequest(namespace=self.namespace, keys=key_list)
        return res.pin_result(self._rpc(lambda: method(request, timeout=self.timeout_s)))

    def limits(self) -> res.Limits:
        """The daemon's limits and what it offers (the Limits verb), asked once and kept."""
        if self._limits is None:
            request = pb.LimitsRequest()
            response: pb.LimitsResponse = self._rpc(
                lambda: self._stub.Limits(request, timeout=self.timeout_s))
            self._keep_limits(response)
        assert self._limits is not None
        return self._limits

    def _limits_or_none(self) -> res.Limits | None:
        """limits(), or None from a daemon that predates the verb (UNIMPLEMENTED)."""
        if self._limits is None and not self._no_limits:
            try:
                self.limits()
            except KVStoreError as exc:
                if exc.code is not grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self._no_limits = True
        return self._limits

    def stats(self, *, include_config: bool = False, namespace: str | None = None) -> res.Stats:
        """Daemon-wide stats; hits/misses filtered to `namespace` when one is given."""
        request = rq.stats_request(include_config, namespace)
        response: pb.StatsResponse = self._rpc(
            lambda: self._stub.Stats(request, timeout=self.timeout_s)
        )
        return res.stats_result(response)

    def drain(self) -> res.DrainResult:
        """Stop the daemon gracefully, as SIGTERM does: health turns NOT_SERVING, new data
        calls get UNAVAILABLE, calls in flight finish, and it exits 0 within
        server.grace_s. Asking again while it drains changes nothing."""
        response: pb.DrainResponse = self._rpc(
            lambda: self._stub.Drain(pb.DrainRequest(), timeout=self.timeout_s)
        )
        return res.drain_result(response)

    def hot(self, limit: int = 100) -> res.HotResult:
        """The `limit` most used blocks of this namespace across every daemon sharing the L4
        pool, hottest first. FailedPrecondition when L4 is off."""
        request = rq.hot_request(self.namespace, limit)
        response: pb.HotResponse = self._rpc(
            lambda: self._stub.Hot(request, timeout=self.timeout_s)
        )
        return res.hot_result(response)

    def prewarm(
        self,
        bytes: int = 0,
        namespaces: Sequence[str] = (),
        on_progress: Callable[[res.PrewarmResult], None] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> res.PrewarmResult:
        """Pull the hottest L4 blocks into the local tiers until `bytes` are local (0: the
        daemon's remote.prewarm_bytes), from `namespaces` (empty: every one); the final
        progress. timeout_s bounds the whole stream (default: the client's timeout_s).
        FailedPrecondition when L4 is off."""
        request = rq.prewarm_request(bytes, namespaces)
        call_timeout_s = rq.call_timeout_s(self.timeout_s, timeout_s)

        return self._streamed(
            lambda: self._stub.Prewarm(request, timeout=call_timeout_s), res.prewarm_result,
            res.PrewarmResult(blocks=0, bytes=0, target_bytes=request.bytes, done=False),
            on_progress)

    def health(self, service: str = HEALTH_SERVICE) -> str:
        """The grpc.health.v1 status name: "SERVING", "NOT_SERVING", ..."""
        request = health_pb2.HealthCheckRequest(service=service)
        response = self._rpc(lambda: self._health.Check(request, timeout=self.timeout_s))
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

    def release(self, ids: Sequence[str]) -> res.ReleaseResult:
        """End leases (from Get) or abandon reservations (from Reserve); low-level."""
        request = rq.release_request(ids)
        if not request.ids:
            return res.ReleaseResult(released=0)
        response: pb.ReleaseResponse = self._rpc(
            lambda: self._stub.Release(request, timeout=self.timeout_s)
        )
        return res.release_result(response)

    def close(self) -> None:
        """Close the channel and unmap the segment; idempotent."""
        if self._begin_close():
            self._channel.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
