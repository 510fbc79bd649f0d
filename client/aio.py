"""`AsyncKVStoreClient`: the asyncio twin of `KVStoreClient` over `grpc.aio`.

Same verbs, arguments, results, errors, retry policy and paths as the blocking client (the
local path, shared memory, inline gRPC): both run the steps `ClientBase` writes once for each
verb, and only the transport is this module's. It awaits the gRPC calls on the event loop and
runs blocking work in a worker thread, so the loop is never held: a local-path call on the
Unix socket, a copy through shared memory or of an inline Get's data, the building of each
Put frame, and the shared-memory decision (whose Stats and Attach it sends back to the loop).
Create and use it inside one event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar, cast

import grpc
import grpc.aio

from kvstore.keys import BlockKey
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb

from . import results as res
from ._base import ClientBase
from ._effects import Call, Effect, Next, Offload, Open, Report, Retried, Steps, Upload
from ._readtable import InPlace
from ._wire import HEALTH_SERVICE, channel_options
from .credentials import ChannelSecurity
from .errors import from_rpc_error

__all__ = ["AsyncKVStoreClient"]

T = TypeVar("T")


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

    # --- the transport: gRPC awaited on the loop, blocking work in a worker thread ---------

    async def _run(self, steps: Steps[T]) -> T:
        """Run a verb's steps to their end; their value."""
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                effect = steps.send(value) if error is None else steps.throw(error)
            except StopIteration as done:
                return cast(T, done.value)
            try:
                value, error = await self._perform(effect), None
            except BaseException as exc:  # thrown into the steps, which may handle it
                value, error = None, exc

    async def _perform(self, effect: Effect) -> Any:
        match effect:
            case Call(method, request, timeout_s):
                return await _mapped(method(request, timeout=timeout_s))
            case Upload(method, frames, timeout_s):
                return await _mapped(method(_built_off_loop(frames), timeout=timeout_s))
            case Open(method, request, timeout_s):
                return _Stream(method(request, timeout=timeout_s))
            case Next(stream):
                return await cast(_Stream, stream).next()
            case Offload(fn):
                return await asyncio.to_thread(fn)
            case Retried(steps):
                return await self.retry.call_async(lambda: self._run(steps()))
            case Report(on_progress, value):
                outcome = on_progress(value)
                if asyncio.iscoroutine(outcome):
                    await outcome
                return None
        raise TypeError(f"not an effect: {effect!r}")

    def _blocking(self, steps: Callable[[], Steps[T]]) -> Callable[[], T]:
        loop = asyncio.get_running_loop()

        def run() -> T:
            if _running_loop() is loop:  # it would wait on the very loop that must run it
                raise RuntimeError("a blocking call of the asyncio client on its own loop")
            return asyncio.run_coroutine_threadsafe(self._run(steps()), loop).result()

        return run

    # --- put, get -------------------------------------------------------------------------

    async def put(
        self,
        keys: Sequence[BlockKey],
        values: Sequence[object],
        *,
        parent: BlockKey | None = None,
        independent: bool = False,
        wait: bool = True,
    ) -> res.PutResult:
        """See KVStoreClient.put."""
        return await self._run(self._put_steps(keys, values, parent, independent, wait))

    async def flush(self) -> res.PutResult:
        """See KVStoreClient.flush."""
        return await self._run(self._flush_steps())

    async def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """See KVStoreClient.get."""
        return await self._run(self._get_steps(keys))

    async def get_into(
        self, keys: Sequence[BlockKey], buffers: Sequence[object]
    ) -> list[int | None]:
        """See KVStoreClient.get_into."""
        return await self._run(self._get_into_steps(keys, buffers))

    async def get_in_place(self, keys: Sequence[BlockKey]) -> InPlace:
        """See KVStoreClient.get_in_place."""
        return await self._run(self._get_in_place_steps(keys))

    async def pin_shared_memory(self) -> bool:
        """See KVStoreClient.pin_shared_memory."""
        return self._shm.pin_memory()

    # --- control verbs --------------------------------------------------------------------

    async def lookup(self, keys: Sequence[BlockKey], *,
                     block_tokens: int = 0) -> res.LookupResult:
        """See KVStoreClient.lookup."""
        return await self._run(self._lookup_steps(keys, block_tokens))

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
        return await self._run(self._prefetch_steps(keys, tier, deadline_s, on_progress))

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
        return await self._run(self._evict_steps(keys, bytes, all, tier, namespace))

    async def pin(self, keys: Sequence[BlockKey]) -> res.PinResult:
        """See KVStoreClient.pin."""
        return await self._run(self._pin_steps(self._stub.Pin, keys))

    async def unpin(self, keys: Sequence[BlockKey]) -> res.PinResult:
        """See KVStoreClient.unpin."""
        return await self._run(self._pin_steps(self._stub.Unpin, keys))

    async def limits(self) -> res.Limits:
        """See KVStoreClient.limits."""
        return await self._run(self._limits_steps())

    async def stats(
        self, *, include_config: bool = False, namespace: str | None = None
    ) -> res.Stats:
        """See KVStoreClient.stats."""
        return await self._run(self._stats_steps(include_config, namespace))

    async def drain(self) -> res.DrainResult:
        """See KVStoreClient.drain."""
        return await self._run(self._drain_steps())

    async def hot(self, limit: int = 100) -> res.HotResult:
        """See KVStoreClient.hot."""
        return await self._run(self._hot_steps(limit))

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
        return await self._run(self._prewarm_steps(bytes, namespaces, on_progress, timeout_s))

    async def watch_events(self, from_sequence: int = 0
                           ) -> AsyncIterator[pb.WatchEventsResponse]:
        """See KVStoreClient.watch_events: an async iterator; closing it cancels the call."""
        call = self._stub.WatchEvents(pb.WatchEventsRequest(from_sequence=from_sequence))
        try:
            async for response in call:
                yield response
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise from_rpc_error(exc) from None
        finally:
            call.cancel()

    async def health(self, service: str = HEALTH_SERVICE) -> str:
        """See KVStoreClient.health."""
        return await self._run(self._health_steps(service))

    async def release(self, ids: Sequence[str]) -> res.ReleaseResult:
        """See KVStoreClient.release."""
        return await self._run(self._release_steps(ids))

    async def close(self) -> None:
        """See KVStoreClient.close."""
        await self._run(self._close_grants_steps())
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


class _Stream:
    """A server-streaming grpc.aio call, read on the event loop."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self._messages: AsyncIterator[Any] = call.__aiter__()

    async def next(self) -> Any:
        """The next message, None at the end; an RpcError raised as the client's error."""
        try:
            return await self._messages.__anext__()
        except StopAsyncIteration:
            return None
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc

    def cancel(self) -> None:
        self.call.cancel()


async def _mapped(call: Any) -> Any:
    """The awaited call's response; an RpcError raised as the client's error."""
    try:
        return await call
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from exc


async def _built_off_loop(frames: Iterator[bytes]) -> AsyncIterator[bytes]:
    """The frames, each built (the caller's bytes copied into it) in a worker thread."""
    end = object()
    while (frame := await asyncio.to_thread(next, frames, end)) is not end:
        yield cast(bytes, frame)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
