"""`AsyncKVStoreClient`: the asyncio twin of `KVStoreClient` over `grpc.aio`.

Same verbs, arguments, results, errors, retry policy and shared-memory fast path as the
blocking client: both inherit their state and every step that is not an RPC from `ClientBase`
and call the same validation, framing and copying functions; only the calls are awaited here.
Create and use it inside one event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2

from kvstore.keys import BlockKey
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb

from . import _requests as rq
from . import results as res
from ._base import ClientBase
from ._buffers import ByteArray
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

__all__ = ["AsyncKVStoreClient"]

T = TypeVar("T")
M = TypeVar("M")  # a response message


class AsyncKVStoreClient(ClientBase):
    """A grpc.aio connection to one kvstore daemon, bound to one namespace."""

    @staticmethod
    def _open_channel(
        target: str, max_message_bytes: int, security: ChannelSecurity | None
    ) -> Any:
        options = channel_options(max_message_bytes, sync=False)
        if security is None:
            return grpc.aio.insecure_channel(target, options=options)
        return grpc.aio.secure_channel(
            target, security.credentials, options=[*options, *security.options]
        )

    # --- plumbing -------------------------------------------------------------------------

    async def _streamed(self, call: Callable[[], AsyncIterable[M]], convert: Callable[[M], T],
                        first: T, on_progress: Callable[[T], object] | None) -> T:
        """See KVStoreClient._streamed; on_progress may be a function or a coroutine one."""
        async def attempt() -> T:
            last = first
            async for message in call():
                last = convert(message)
                if on_progress is not None:
                    outcome = on_progress(last)
                    if asyncio.iscoroutine(outcome):
                        await outcome
            return last

        return await self._rpc(attempt)

    async def _rpc(self, fn: Callable[[], Awaitable[T]]) -> T:
        async def attempt() -> T:
            try:
                return await fn()
            except grpc.RpcError as exc:
                raise from_rpc_error(exc) from exc

        return await self.retry.call_async(attempt)

    async def _segment(self) -> SharedSegment | None:
        return await self._shm.segment_for_async(self._fetch_stats, self._fetch_attach)

    async def _fetch_stats(self) -> pb.StatsResponse:
        request = self._stats_request()
        response: pb.StatsResponse = await self._rpc(
            lambda: self._stub.Stats(request, timeout=self.timeout_s)
        )
        return response

    async def _fetch_attach(self) -> pb.AttachResponse:
        response: pb.AttachResponse = await self._rpc(
            lambda: self._stub.Attach(pb.AttachRequest(), timeout=self.timeout_s)
        )
        return response

    async def _release_quietly(self, ids: list[str]) -> None:
        try:
            await self._stub.Release(pb.ReleaseRequest(ids=ids), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            self._release_failed(ids, from_rpc_error(exc))

    async def _drop_corrupt(self, bad: list[bytes]) -> None:
        for key in bad:
            request = self._corrupt(key)
            try:
                await self._stub.Evict(request, timeout=self.timeout_s)
            except grpc.RpcError as exc:
                self._evict_failed(key, from_rpc_error(exc))

    # --- put ------------------------------------------------------------------------------

    async def put(
        self,
        keys: Sequence[BlockKey],
        values: Sequence[object],
        *,
        parent: BlockKey | None = None,
        independent: bool = False,
    ) -> res.PutResult:
        """See KVStoreClient.put."""
        plan = rq.put_plan(self.namespace, keys, values, parent, independent)
        if not plan.keys:
            return res.PutResult(stored=0, existing=0, evicted=0)
        if await self._segment() is not None:
            try:
                return res.put_result(await self._rpc(lambda: self._put_shm(plan)))
            except FailedPrecondition as exc:
                self._shm.fall_back(exc)
        header = plan.inline_header()
        chunk = self._put_chunk(header) if await self._limits_or_none() else self.chunk_bytes
        response: pb.PutResponse = await self._rpc(
            lambda: self._put(put_frames(header, plan.payloads, chunk), timeout=self.timeout_s)
        )
        return res.put_result(response)

    async def _put_shm(self, plan: rq.PutPlan) -> pb.PutResponse:
        reserved: pb.ReserveResponse = await self._stub.Reserve(
            plan.reserve_request(), timeout=self.timeout_s
        )
        committed = False
        try:
            await self._shm.ensure_arena_async(reserved.arena, self._fetch_attach)
            checksums = self._shm.write_reservation(reserved, plan.payloads)
            frame = plan.commit_request(reserved.reservation_id, checksums).SerializeToString()
            response: pb.PutResponse = await self._put(iter([frame]), timeout=self.timeout_s)
            committed = True
            return response
        finally:
            if not committed and reserved.reservation_id:
                await self._release_quietly([reserved.reservation_id])

    # --- get ------------------------------------------------------------------------------

    async def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """See KVStoreClient.get."""
        key_list = check_keys(keys)
        if not key_list:
            return []
        fetched = await self._fetch(key_list, None)
        out, bad = finish_get(key_list, fetched, self.verify_checksums)
        await self._drop_corrupt(bad)
        return out

    async def get_into(
        self, keys: Sequence[BlockKey], buffers: Sequence[object]
    ) -> list[int | None]:
        """See KVStoreClient.get_into."""
        key_list = check_keys(keys)
        arrays = rq.into_arrays(key_list, buffers)
        if not key_list:
            return []
        fetched = await self._fetch(key_list, arrays)
        out, bad = finish_get_into(key_list, fetched, arrays, self.verify_checksums)
        await self._drop_corrupt(bad)
        return out

    async def _fetch(self, keys: list[bytes], arrays: list[ByteArray] | None) -> Fetched:
        if await self._segment() is not None:
            try:
                return await self._rpc(lambda: self._get_shm(keys, arrays))
            except FailedPrecondition as exc:
                self._shm.fall_back(exc)
        return await self._rpc(lambda: self._get_inline(keys, arrays))

    async def _get_shm(self, keys: list[bytes], arrays: list[ByteArray] | None) -> Fetched:
        call = self._get(self._get_request(keys, True), timeout=self.timeout_s)
        response = only_header([message async for message in call])
        try:
            await self._shm.ensure_arena_async(response.arena, self._fetch_attach)
            return self._shm.read_get(response, len(keys), arrays, self.verify_checksums)
        finally:
            if response.lease_id:
                await self._release_quietly([response.lease_id])

    async def _get_inline(self, keys: list[bytes], arrays: list[ByteArray] | None) -> Fetched:
        call = self._get(self._get_request(keys, False), timeout=self.timeout_s)
        try:
            stream = call.__aiter__()
            try:
                first = await stream.__anext__()
            except StopAsyncIteration:
                raise DataLoss("Get stream ended without a header") from None
            assembler = InlineAssembler.start(first, len(keys), arrays, self.verify_checksums)
            async for message in stream:
                assembler.feed(chunk_of(message))
            return assembler.fetched()
        except BaseException:
            call.cancel()
            raise

    # --- control verbs --------------------------------------------------------------------

    async def lookup(self, keys: Sequence[BlockKey], *,
                     block_tokens: int = 0) -> res.LookupResult:
        """See KVStoreClient.lookup."""
        key_list = check_keys(keys)
        if not key_list:
            return res.LookupResult(prefix_length=0, tiers=[])
        request = rq.lookup_request(self.namespace, key_list, block_tokens)
        response: pb.LookupResponse = await self._rpc(
            lambda: self._stub.Lookup(request, timeout=self.timeout_s)
        )
        return res.lookup_result(response)

    async def prefetch(
        self,
        keys: Sequence[BlockKey],
        *,
        tier: str | None = None,
        deadline_s: float | None = None,
        on_progress: Callable[[res.PrefetchResult], object] | None = None,
    ) -> res.PrefetchResult:
        """See KVStoreClient.prefetch; on_progress may be a plain function or a coroutine
        function."""
        key_list = check_keys(keys)
        request = rq.prefetch_request(self.namespace, key_list, tier, deadline_s)
        timeout_s = rq.prefetch_timeout_s(self.timeout_s, deadline_s)
        if not key_list:
            return res.PrefetchResult(done=0, missing=0, failed=0, total=0)

        return await self._streamed(
            lambda: self._stub.Prefetch(request, timeout=timeout_s), res.prefetch_result,
            res.PrefetchResult(done=0, missing=0, failed=0, total=len(key_list)), on_progress)

    async def evict(
        self,
        keys: Sequence[BlockKey] | None = None,
        *,
        bytes: int = 0,
        all: bool = False,
        tier: str | None = None,
        namespace: str | None = None,
    ) -> res.EvictResult:
        """See KVStoreClient.evict."""
        request = rq.evict_request(self.namespace, keys, bytes, all, tier, namespace)
        response: pb.EvictResponse = await self._rpc(
            lambda: self._stub.Evict(request, timeout=self.timeout_s)
        )
        return res.evict_result(response)

    async def pin(self, keys: Sequence[BlockKey]) -> res.PinResult:
        """See KVStoreClient.pin."""
        return await self._pin(self._stub.Pin, keys)

    async def unpin(self, keys: Sequence[BlockKey]) -> res.PinResult:
        """See KVStoreClient.unpin."""
        return await self._pin(self._stub.Unpin, keys)

    async def _pin(
        self, method: Callable[..., Awaitable[pb.PinResponse]], keys: Sequence[BlockKey]
    ) -> res.PinResult:
        key_list = check_keys(keys)
        if not key_list:
            return res.PinResult(changed=0, missing=0)
        request = pb.PinRequest(namespace=self.namespace, keys=key_list)
        return res.pin_result(await self._rpc(lambda: method(request, timeout=self.timeout_s)))

    async def limits(self) -> res.Limits:
        """See KVStoreClient.limits."""
        if self._limits is None:
            request = pb.LimitsRequest()
            response: pb.LimitsResponse = await self._rpc(
                lambda: self._stub.Limits(request, timeout=self.timeout_s))
            self._keep_limits(response)
        assert self._limits is not None
        return self._limits

    async def _limits_or_none(self) -> res.Limits | None:
        """See KVStoreClient._limits_or_none."""
        if self._limits is None and not self._no_limits:
            try:
                await self.limits()
            except KVStoreError as exc:
                if exc.code is not grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self._no_limits = True
        return self._limits

    async def stats(
        self, *, include_config: bool = False, namespace: str | None = None
    ) -> res.Stats:
        """See KVStoreClient.stats."""
        request = rq.stats_request(include_config, namespace)
        response: pb.StatsResponse = await self._rpc(
            lambda: self._stub.Stats(request, timeout=self.timeout_s)
        )
        return res.stats_result(response)

    async def drain(self) -> res.DrainResult:
        """See KVStoreClient.drain."""
        response: pb.DrainResponse = await self._rpc(
            lambda: self._stub.Drain(pb.DrainRequest(), timeout=self.timeout_s)
        )
        return res.drain_result(response)

    async def hot(self, limit: int = 100) -> res.HotResult:
        """See KVStoreClient.hot."""
        request = rq.hot_request(self.namespace, limit)
        response: pb.HotResponse = await self._rpc(
            lambda: self._stub.Hot(request, timeout=self.timeout_s)
        )
        return res.hot_result(response)

    async def prewarm(
        self,
        bytes: int = 0,
        namespaces: Sequence[str] = (),
        on_progress: Callable[[res.PrewarmResult], object] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> res.PrewarmResult:
        """See KVStoreClient.prewarm; on_progress may be a plain function or a coroutine
        function."""
        request = rq.prewarm_request(bytes, namespaces)
        call_timeout_s = rq.call_timeout_s(self.timeout_s, timeout_s)

        return await self._streamed(
            lambda: self._stub.Prewarm(request, timeout=call_timeout_s), res.prewarm_result,
            res.PrewarmResult(blocks=0, bytes=0, target_bytes=request.bytes, done=False),
            on_progress)

    async def health(self, service: str = HEALTH_SERVICE) -> str:
        """See KVStoreClient.health."""
        request = health_pb2.HealthCheckRequest(service=service)
        response = await self._rpc(lambda: self._health.Check(request, timeout=self.timeout_s))
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

    async def release(self, ids: Sequence[str]) -> res.ReleaseResult:
        """See KVStoreClient.release."""
        request = rq.release_request(ids)
        if not request.ids:
            return res.ReleaseResult(released=0)
        response: pb.ReleaseResponse = await self._rpc(
            lambda: self._stub.Release(request, timeout=self.timeout_s)
        )
        return res.release_result(response)

    async def close(self) -> None:
        """See KVStoreClient.close."""
        if self._begin_close():
            await self._channel.close()

    async def __aenter__(self) -> AsyncKVStoreClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
