"""`KVStoreClient`: the blocking client, one method per verb of `kvstore.v1.KVStore`.

Data moves through the daemon's shared memory when the daemon runs on this host (decided
once, from one Stats call, and with auth on an Attach through its Unix socket) and inline in
the gRPC stream otherwise; `put`, `get` and `get_into` look the same either way. On the
daemon's host the hot verbs (Lookup, the shared-memory Get, Reserve, commit, Release) go over
its Unix socket when it has one: the local path. Every call carries the client's credentials
(`credentials`: a bearer token, TLS). Every RPC is retried on UNAVAILABLE by `Retry` and its
failures surface as the `KVStoreError` tree (UNAUTHENTICATED and PERMISSION_DENIED are never
retried). Thread-safe: share one client per process.

Each verb's steps are `ClientBase`'s; this module is the transport that runs them on the
caller's thread (`_effects` lists what a step may ask).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar, cast

import grpc

from kvstore.keys import BlockKey
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb

from . import results as res
from ._base import ClientBase
from ._effects import Call, Effect, Next, Offload, Open, Report, Retried, Steps, Upload
from ._readtable import InPlace
from ._wire import HEALTH_SERVICE, channel_options
from .credentials import ChannelSecurity
from .errors import from_rpc_error

__all__ = ["KVStoreClient"]

T = TypeVar("T")


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

    # --- the transport: every effect performed on the caller's thread ----------------------

    def _run(self, steps: Steps[T]) -> T:
        """Run a verb's steps to their end; their value."""
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                effect = steps.send(value) if error is None else steps.throw(error)
            except StopIteration as done:
                return cast(T, done.value)
            try:
                value, error = self._perform(effect), None
            except BaseException as exc:  # thrown into the steps, which may handle it
                value, error = None, exc

    def _perform(self, effect: Effect) -> Any:
        match effect:
            case Call(method, request, timeout_s) | Upload(method, request, timeout_s):
                try:
                    return method(request, timeout=timeout_s)
                except grpc.RpcError as exc:
                    raise from_rpc_error(exc) from exc
            case Open(method, request, timeout_s):
                return _Stream(method(request, timeout=timeout_s))
            case Next(stream):
                return cast(_Stream, stream).next()
            case Offload(fn):
                return fn()
            case Retried(steps):
                return self.retry.call(lambda: self._run(steps()))
            case Report(on_progress, value):
                return on_progress(value)
        raise TypeError(f"not an effect: {effect!r}")

    def _blocking(self, steps: Callable[[], Steps[T]]) -> Callable[[], T]:
        return lambda: self._run(steps())

    # --- put, get -------------------------------------------------------------------------

    def put(
        self,
        keys: Sequence[BlockKey],
        values: Sequence[object],
        *,
        parent: BlockKey | None = None,
        independent: bool = False,
        wait: bool = True,
    ) -> res.PutResult:
        """Store one block per key (any contiguous CPU buffer). By default keys form one chain
        (keys[i-1] the parent of keys[i]) whose first block follows `parent`; with
        independent=True they are unrelated. Existing keys are acknowledged, unchanged.

        wait=False, on the daemon's host: the blocks are written into pages the client holds
        ahead (a grant) and their commit is posted, not waited for; the result is
        provisional (`posted`, every key counted as stored). A refused commit is raised by
        the next put, get, get_into or lookup, or by `flush()`, which waits for every posted
        commit. Elsewhere (no local path) it is a put that waits."""
        return self._run(self._put_steps(keys, values, parent, independent, wait))

    def flush(self) -> res.PutResult:
        """Wait for the answer of every commit that `put(..., wait=False)` posted; what they
        stored since the last flush, or the first refusal not raised yet (raised)."""
        return self._run(self._flush_steps())

    def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """Each key's block, or None for a miss (or a block that failed its checksum)."""
        return self._run(self._get_steps(keys))

    def get_into(self, keys: Sequence[BlockKey], buffers: Sequence[object]) -> list[int | None]:
        """Copy each found block into buffers[i] (writable, contiguous, CPU, at least the
        block's size); return the block's size, or None for a miss."""
        return self._run(self._get_into_steps(keys, buffers))

    def get_in_place(self, keys: Sequence[BlockKey]) -> InPlace:
        """The leading keys' blocks where they lie in shared memory, with no copy: read-only
        views of this client's mapping of L2, for a caller that copies them elsewhere
        itself (to a GPU, from pinned pages). Only blocks the read table shows come this way
        (a co-located client with the read table on; none otherwise, and then `get_into`
        is the way); each is checked against its checksum in place when the client
        verifies. The daemon may reuse the pages at any time: once done with the bytes,
        `held()` says how many of the views, from the first, were still their blocks."""
        return self._run(self._get_in_place_steps(keys))

    def pin_shared_memory(self) -> bool:
        """Register this client's mappings of the daemon's memory as CUDA pinned memory (with
        cupy and a CUDA device; each mapping attached later too), so that host-to-device
        copies from `get_in_place` views run by DMA without waiting for the host. Whether a
        mapping is registered now: False before the first data call attached one, without
        cupy or a device, or when the driver refused (logged)."""
        return self._shm.pin_memory()

    # --- control verbs --------------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey], *,
               block_tokens: int = 0) -> res.LookupResult:
        """The longest cached prefix of `keys` (a chain, root first) and each key's tier.
        block_tokens: the tokens each key covers (the engine's block size), so the daemon
        counts prefix hit tokens for its dashboards; 0 counts blocks only."""
        return self._run(self._lookup_steps(keys, block_tokens))

    def prefetch(
        self,
        keys: Sequence[BlockKey],
        *,
        tier: str | None = None,
        deadline_s: float | None = None,
        on_progress: Callable[[res.PrefetchResult], None] | None = None,
    ) -> res.PrefetchResult:
        """Move keys up to `tier` (default: the highest enabled); the final progress."""
        return self._run(self._prefetch_steps(keys, tier, deadline_s, on_progress))

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
        return self._run(self._evict_steps(keys, bytes, all, tier, namespace))

    def pin(self, keys: Sequence[BlockKey]) -> res.PinResult:
        """Keep these entries from eviction until unpinned."""
        return self._run(self._pin_steps(self._stub.Pin, keys))

    def unpin(self, keys: Sequence[BlockKey]) -> res.PinResult:
        """Undo pin: let these entries be evicted again."""
        return self._run(self._pin_steps(self._stub.Unpin, keys))

    def limits(self) -> res.Limits:
        """The daemon's limits and what it offers (the Limits verb), asked once and kept."""
        return self._run(self._limits_steps())

    def stats(self, *, include_config: bool = False, namespace: str | None = None) -> res.Stats:
        """Daemon-wide stats; hits/misses filtered to `namespace` when one is given."""
        return self._run(self._stats_steps(include_config, namespace))

    def drain(self) -> res.DrainResult:
        """Stop the daemon gracefully, as SIGTERM does: health turns NOT_SERVING, new data
        calls get UNAVAILABLE, calls in flight finish, and it exits 0 within
        server.grace_s. Asking again while it drains changes nothing."""
        return self._run(self._drain_steps())

    def hot(self, limit: int = 100) -> res.HotResult:
        """The `limit` most used blocks of this namespace across every daemon sharing the L4
        pool, hottest first. FailedPrecondition when L4 is off."""
        return self._run(self._hot_steps(limit))

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
        return self._run(self._prewarm_steps(bytes, namespaces, on_progress, timeout_s))

    def watch_events(self, from_sequence: int = 0) -> Iterator[pb.WatchEventsResponse]:
        """The block events of the caller's tenant in this daemon (WatchEvents: blocks
        stored, moved to another fastest tier, removed; docs/protocol.md), from
        from_sequence (0: the next one), as the daemon sends them, for as long as the caller
        iterates: closing the iterator cancels the call. Not retried (resume with the next
        sequence); errors surface as `KVStoreError`s, FailedPrecondition when the daemon's
        events are off."""
        call = self._stub.WatchEvents(pb.WatchEventsRequest(from_sequence=from_sequence))
        try:
            yield from call
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise from_rpc_error(exc) from None
        finally:
            call.cancel()

    def health(self, service: str = HEALTH_SERVICE) -> str:
        """The grpc.health.v1 status name: "SERVING", "NOT_SERVING", ..."""
        return self._run(self._health_steps(service))

    def release(self, ids: Sequence[str]) -> res.ReleaseResult:
        """End leases (from Get) or abandon reservations (from Reserve); low-level."""
        return self._run(self._release_steps(ids))

    def close(self) -> None:
        """Wait for posted commits (a refusal is logged), give back held pages, close the
        channel and unmap the segment; idempotent."""
        self._run(self._close_grants_steps())
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


class _Stream:
    """A server-streaming call read on the caller's thread."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self._messages: Iterator[Any] = iter(call)

    def next(self) -> Any:
        """The next message, None at the end; an RpcError raised as the client's error."""
        try:
            return next(self._messages, None)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc

    def cancel(self) -> None:
        self.call.cancel()
