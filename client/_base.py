"""`ClientBase`: what `KVStoreClient` and `AsyncKVStoreClient` share, which is everything but
the transport. Each verb is written here once, as steps (`_effects`): its arguments checked,
its request built, its path chosen (the local path, shared memory, or inline gRPC), its
response converted. A client's public method only runs those steps with its transport, as
redis-py writes each command once (`commands/core.py`) and only the I/O loop twice
(`retry.py` and `asyncio/retry.py`).

Also here: the constructor and its checks (a target without a port gets 50051: `_target`),
the credentials (`credentials`: the token bound to every call's metadata, TLS for the
channel), the stubs over the channel each subclass opens, the shared-memory decision
(`ShmState`, one per client), the warnings both log, `uses_shared_memory`, `uses_local_path`
and the repr. Verb arguments are checked and requests built in `_requests`, wire framing in
`_wire`, results in `results`.
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.keys import BlockKey
from kvstore.memory import keep_freed_buffers
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.proto.localframe import COMMIT, GET, LOOKUP, RELEASE, RESERVE

from . import _requests as rq
from . import results as res
from ._buffers import ByteArray
from ._datasocket import DataPath, DataSocket
from ._effects import Call, Next, Offload, Open, Report, Retried, Steps, Upload, one
from ._grants import Grants
from ._localpath import NoSession
from ._readtable import InPlace
from ._segment import SharedSegment, only_header
from ._shm import ShmState
from ._target import with_default_port
from ._wire import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    FRAME_SLACK_BYTES,
    GET_METHOD,
    PUT_METHOD,
    Fetched,
    InlineAssembler,
    check_client_args,
    check_keys,
    check_keys_joined,
    chunk_of,
    decode_get_response,
    finish_get,
    finish_get_into,
    identity,
    merge_reread,
    put_frames,
    reread_indexes,
)
from .credentials import (
    TLS,
    ChannelSecurity,
    bearer_metadata,
    channel_security,
    resolve_tls,
    resolve_token,
    resolve_unix_socket,
    with_metadata,
)
from .errors import DataLoss, FailedPrecondition, InvalidArgument, KVStoreError
from .retry import Retry

logger = logging.getLogger("kvstore.client")

T = TypeVar("T")
M = TypeVar("M")  # a response message
R = TypeVar("R")  # a per-key result of a Get: the block's bytes (get) or its size (get_into)


class ClientBase(ABC):
    """A connection to one kvstore daemon, bound to one namespace; see the subclasses."""

    def __init__(
        self,
        target: str,
        namespace: str,
        *,
        shared_memory: bool | None = None,
        retry: Retry | None = None,
        timeout_s: float = 30.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        verify_checksums: bool = True,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        token: str | None = None,
        tls: TLS | bool | None = None,
        unix_socket: str | None = None,
        read_table: bool = True,
    ) -> None:
        """shared_memory: None uses the daemon's shared memory when co-located, False never,
        True requires it (FailedPrecondition on the first data call when it cannot be used).

        token: sent as `authorization: Bearer <token>` on every call; None reads env
        KVSTORE_TOKEN, else the file named by KVSTORE_TOKEN_FILE. tls: a `TLS`, True (the
        system roots) or False (plaintext); None is TLS from KVSTORE_TLS_CA_FILE,
        KVSTORE_TLS_CERT_FILE, KVSTORE_TLS_KEY_FILE and KVSTORE_TLS_SERVER_NAME when the CA or
        the cert is set, else plaintext. unix_socket: the daemon's Unix socket (for Attach)
        as this process sees it; None reads KVSTORE_UNIX_SOCKET, else the daemon's own path.
        Files are read here: a bad token or an unreadable file is InvalidArgument naming it.

        read_table: on the daemon's host, look up and read L2 blocks through the read table
        the daemon publishes (dram.read_table), with no round trip, when it offers one;
        False: every lookup and read asks the daemon (docs/local-path.md).

        target: host:port, [v6]:port, dns:///host:port, unix:PATH or any gRPC target; one
        without a port means port 50051, the daemon's default (see `_target`)."""
        self.namespace = check_client_args(namespace, chunk_bytes, max_message_bytes, timeout_s)
        self.target = with_default_port(target)
        keep_freed_buffers()  # once per process: bulk copies into fresh buffers run at speed
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self.max_message_bytes = max_message_bytes
        self.verify_checksums = verify_checksums
        self.retry = retry if retry is not None else Retry()
        secret = resolve_token(token)
        settings = resolve_tls(tls)
        socket_path = resolve_unix_socket(unix_socket)
        security = channel_security(settings) if settings is not None else None
        metadata = bearer_metadata(secret) if secret is not None else ()
        self._channel = with_metadata(
            self._open_channel(self.target, max_message_bytes, security), metadata
        )
        self._stub = pb_grpc.KVStoreStub(self._channel)
        # Put and Get bypass the generated serializers for their bulk bytes (see _wire).
        self._put = self._channel.stream_unary(
            PUT_METHOD,
            request_serializer=identity,
            response_deserializer=pb.PutResponse.FromString,
        )
        self._get = self._channel.unary_stream(
            GET_METHOD,
            request_serializer=pb.GetRequest.SerializeToString,
            response_deserializer=decode_get_response,
        )
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._shm = ShmState(shared_memory, socket_path, timeout_s, read_table=read_table)
        self._daemon_limits: res.Limits | None = None  # the daemon's, asked once (Limits)
        # Inline Gets and Puts over the daemon's data socket when its Limits offer one
        # (client/_datasocket.py), gRPC otherwise.
        self._data = DataPath(self.target, settings, timeout_s)
        # Puts from a grant (client/_grants.py), on the local path it was made on; off for
        # good when the daemon does not know the verb.
        self._grants: Grants | None = None
        self._grants_off = False
        self._closed = False

    # --- the transport, which each subclass is ---------------------------------------------

    @staticmethod
    @abstractmethod
    def _open_channel(
        target: str, max_message_bytes: int, security: ChannelSecurity | None
    ) -> Any:
        """The channel the stubs run on: grpc's blocking one, or grpc.aio's; TLS with
        security, else plaintext."""

    @abstractmethod
    def _blocking(self, steps: Callable[[], Steps[T]]) -> Callable[[], T]:
        """A function that runs the steps steps() makes to their end, blocking the thread
        that calls it, and returns their value: what `ShmState` is handed for its Stats and
        Attach calls, since it runs on the caller's thread (the blocking client) or in a
        worker thread (the asyncio client, whose steps then run on its event loop)."""

    # --- steps every verb takes -----------------------------------------------------------

    def _unary(self, method: Callable[..., Any], request: Any,
               timeout_s: float | None = None) -> Steps[Any]:
        """One unary gRPC call, retried; its response. What this client read through the
        read table is taken in by the daemon first (ShmState.reports_in)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        yield from self._reports_in()
        return (yield Retried(lambda: one(Call(method, request, timeout))))

    def _reports_in(self) -> Steps[None]:
        """Before a call over gRPC: the reads through the table reported and taken in."""
        if self._shm.reports_pending:
            yield Offload(self._shm.reports_in)

    def _progress(self, method: Callable[..., Any], request: Any, timeout_s: float,
                  convert: Callable[[Any], T], first: T,
                  on_progress: Callable[[T], object] | None) -> Steps[T]:
        """A progress stream (Prefetch, Prewarm): each message converted and reported; the
        last one returned (first when the stream is empty). Retried whole, as any call."""
        def attempt() -> Steps[T]:
            yield from self._reports_in()
            stream = yield Open(method, request, timeout_s)
            last = first
            try:
                while (message := (yield Next(stream))) is not None:
                    last = convert(message)
                    if on_progress is not None:
                        yield Report(on_progress, last)
            except BaseException:
                stream.cancel()
                raise
            return last

        final: T = yield Retried(attempt)
        return final

    def _local_first(self, verb: int, request: Any, response_type: type[M],
                     over_grpc: Callable[[], Steps[M]]) -> Steps[M]:
        """A hot verb over the local path when it is open, else (or once it cannot be had)
        over gRPC; not retried here (the caller retries the whole flow)."""
        local = self._shm.local
        if local is not None:
            try:
                response: M = yield Offload(partial(local.call, verb, request, response_type))
                return response
            except NoSession as exc:  # for this call only, or (not NoSessionNow) for good
                self._shm.local_off(exc)
        return (yield from over_grpc())

    # --- the shared-memory path -----------------------------------------------------------

    def _segment(self) -> Steps[SharedSegment | None]:
        """The shared memory to use, None for inline: decided by the first data call, and
        tried again by the first after a pause when a refusal that passes turned it off (see
        ShmState), off the event loop."""
        shm = self._shm
        if shm.needs_decision():
            fetch_stats = self._blocking(self._fetch_stats)
            fetch_attach = self._blocking(self._fetch_attach)
            yield Offload(partial(shm.segment_for, fetch_stats, fetch_attach))
        return shm.active

    def _fetch_stats(self) -> Steps[pb.StatsResponse]:
        """The Stats call the shared-memory decision is made from."""
        return (yield from self._unary(self._stub.Stats, pb.StatsRequest(namespace=self.namespace)))

    def _fetch_attach(self) -> Steps[pb.AttachResponse]:
        return (yield from self._unary(self._stub.Attach, pb.AttachRequest()))

    def _ensure_arena(self, name: str) -> Steps[None]:
        """Before a response's arena is used: one re-Attach when it is not held (see
        ShmState.ensure_arena)."""
        if self._shm.needs_attach(name):
            fetch_attach = self._blocking(self._fetch_attach)
            yield Offload(partial(self._shm.ensure_arena, name, fetch_attach))

    def _release_lease(self, lease_id: str) -> Steps[None]:
        """End a Get's lease without waiting for the answer when the local path is open (the
        answer is read before the session's next one); else a Release call."""
        local = self._shm.local
        if local is not None:
            yield Offload(partial(local.post, RELEASE, pb.ReleaseRequest(ids=[lease_id])))
        else:
            yield from self._release_quietly([lease_id])

    def _release_quietly(self, ids: list[str]) -> Steps[None]:
        """Release, once; a failure is logged (the daemon expires what it holds)."""
        try:
            yield Call(self._stub.Release, pb.ReleaseRequest(ids=ids), self.timeout_s)
        except KVStoreError as exc:
            logger.warning("kvstore: Release(%s) failed, the daemon will expire it: %s",
                           ids, exc)

    def _drop_corrupt(self, bad: list[bytes]) -> Steps[None]:
        """Evict each block that failed its checksum on a read the daemon held (now a
        miss), logging it: its bytes are damaged, and the engine's next put stores a good
        copy only once this one is gone."""
        for key in bad:
            logger.warning(
                "kvstore: checksum mismatch for key %s in namespace %r on a read under the "
                "daemon's lease (the block is damaged); treating it as a miss and evicting it",
                key.hex(),
                self.namespace,
            )
            request = pb.EvictRequest(namespace=self.namespace, keys=[key])
            try:
                yield Call(self._stub.Evict, request, self.timeout_s)
            except KVStoreError as exc:
                logger.warning("kvstore: evicting corrupt key %s failed: %s", key.hex(), exc)

    # --- put ------------------------------------------------------------------------------

    def _put_steps(self, keys: Sequence[BlockKey], values: Sequence[object],
                   parent: BlockKey | None, independent: bool,
                   wait: bool = True) -> Steps[res.PutResult]:
        self._raise_posted()
        plan = rq.put_plan(self.namespace, keys, values, parent, independent)
        if not plan.keys:
            return res.PutResult(stored=0, existing=0, evicted=0)
        if (yield from self._segment()) is not None:
            try:
                # Posted puts write into a grant; a put that waits reserves (measured: on a
                # 2-core host a waited put from a grant was no faster, since the daemon plans
                # the grant while the client copies; docs/local-path.md).
                granted: res.PutResult | None = None if wait else (yield Retried(
                    lambda: self._put_granted(plan)))
                if granted is not None:
                    return granted
                return res.put_result((yield Retried(lambda: self._put_shm(plan))))
            except FailedPrecondition as exc:
                self._shm.fall_back(exc)
        header = plan.inline_header()
        data = yield from self._data_socket()
        if data is not None:
            try:
                return res.put_result((yield Retried(lambda: one(Offload(
                    partial(data.put, header, plan.payloads))))))
            except NoSession as exc:
                self._data.failed(exc)
        chunk = self._put_chunk(header, (yield from self._limits_steps()))
        response = yield Retried(lambda: one(Upload(
            self._put, put_frames(header, plan.payloads, chunk), self.timeout_s)))
        return res.put_result(response)

    def _raise_posted(self) -> None:
        """A data call (put, get, get_into, lookup) first raises the refusal of a commit that
        an earlier put(..., wait=False) posted, once: the caller learns of it on its next
        call, as it would have from the put itself. Never blocks: answers not read yet are
        read by the next call on their session, or by flush()."""
        grants = self._grants
        if grants is not None:
            grants.posted.raise_failure()

    def _grants_now(self) -> Grants | None:
        """The grants of the local path open now; None when puts cannot take one (no local
        path, or a daemon without the verb)."""
        local = self._shm.local
        if local is None or self._grants_off:
            return None
        grants = self._grants
        if grants is None or grants.local is not local:
            if grants is not None:
                grants.close(0.0)
            grants = self._grants = Grants(local, self.namespace, wait_s=self.timeout_s)
        return grants

    def _put_granted(self, plan: rq.PutPlan) -> Steps[res.PutResult | None]:
        """A put into granted pages (client/_grants.py): written, then its commit posted (the
        result counts every key as stored, provisionally: flush() gives the daemon's
        answers). None when no grant can take it: the caller reserves."""
        grants = self._grants_now()
        if grants is None:
            return None
        try:
            placed = yield Offload(partial(grants.place, plan))
        except NoSession as exc:
            self._shm.local_off(exc)
            return None
        except InvalidArgument as exc:
            if exc.field != "verb":
                raise
            logger.info("kvstore: the daemon grants no pages (%s); puts reserve theirs", exc)
            self._grants_off = True
            return None
        if placed is None:
            return None
        yield from self._ensure_arena(placed[0].arena)
        body = yield Offload(partial(grants.write, plan, placed, self._shm.segment_named))
        yield Offload(partial(grants.commit, body))
        return res.PutResult(stored=len(plan.keys), existing=0, evicted=0, posted=True)

    def _flush_steps(self) -> Steps[res.PutResult]:
        """Wait for every posted commit's answer: what they stored, or the first failure."""
        grants = self._grants
        if grants is None:
            return res.PutResult(stored=0, existing=0, evicted=0)
        stored, existing, evicted = yield Offload(partial(grants.flush, self.timeout_s))
        return res.PutResult(stored=stored, existing=existing, evicted=evicted)

    def _close_grants_steps(self) -> Steps[None]:
        """Before closing: posted commits answered (a failure logged), grants given back."""
        grants, self._grants = self._grants, None
        if grants is not None and not self._closed:
            yield Offload(partial(grants.close, self.timeout_s))

    def _put_shm(self, plan: rq.PutPlan) -> Steps[pb.PutResponse]:
        """Reserve, write into the reserved pages, commit; a reservation not committed is
        released."""
        request = plan.reserve_request()
        reserved = yield from self._local_first(
            RESERVE, request, pb.ReserveResponse,
            lambda: one(Call(self._stub.Reserve, request, self.timeout_s)))
        committed = False
        try:
            yield from self._ensure_arena(reserved.arena)
            checksums = yield Offload(
                partial(self._shm.write_reservation, reserved, plan.payloads))
            commit = plan.commit_request(reserved.reservation_id, checksums)
            response = yield from self._local_first(
                COMMIT, commit, pb.PutResponse,
                lambda: one(Upload(self._put, iter([commit.SerializeToString()]),
                                   self.timeout_s)))
            committed = True
            return response
        finally:
            if not committed and reserved.reservation_id:
                yield from self._release_quietly([reserved.reservation_id])

    def _put_chunk(self, header: pb.PutRequest, limits: res.Limits) -> int:
        """Data bytes per inline Put message: chunk_bytes, at most the daemon's chunk_bytes,
        and small enough that the first message (header and data) fits its
        max_message_bytes."""
        room = limits.max_message_bytes - header.ByteSize() - FRAME_SLACK_BYTES
        return max(1, min(self.chunk_bytes, limits.chunk_bytes, int(room)))

    # --- get ------------------------------------------------------------------------------

    def _get_steps(self, keys: Sequence[BlockKey]) -> Steps[list[bytes | None]]:
        self._raise_posted()
        key_list = check_keys(keys)
        if not key_list:
            return []
        verify = self.verify_checksums
        return (yield from self._read(
            key_list, None, lambda k, fetched, _: finish_get(k, fetched, verify)))

    def _get_into_steps(self, keys: Sequence[BlockKey],
                        buffers: Sequence[object]) -> Steps[list[int | None]]:
        self._raise_posted()
        key_list = check_keys(keys)
        arrays = rq.into_arrays(key_list, buffers)
        if not key_list:
            return []
        verify = self.verify_checksums

        def finish(keys_read: list[bytes], fetched: Fetched, arrays_read: list[ByteArray] | None
                   ) -> tuple[list[int | None], list[bytes]]:
            assert arrays_read is not None  # the buffers of the keys read, as _read passes
            return finish_get_into(keys_read, fetched, arrays_read, verify)

        return (yield from self._read(key_list, arrays, finish))

    def _get_in_place_steps(self, keys: Sequence[BlockKey]) -> Steps[InPlace]:
        self._raise_posted()
        key_list = check_keys(keys)
        if not key_list or not self._shm.read_table or len(set(key_list)) != len(key_list):
            return InPlace([])
        if (yield from self._segment()) is None:
            return InPlace([])
        tables = self._shm.tables
        if tables is None:
            return InPlace([])
        in_place: InPlace = yield Offload(partial(
            tables.in_place, self.namespace, key_list, self.verify_checksums,
            self._shm.report_post()))
        return in_place

    def _read(
        self, keys: list[bytes], arrays: list[ByteArray] | None,
        finish: Callable[[list[bytes], Fetched, list[ByteArray] | None],
                         tuple[list[R | None], list[bytes]]],
    ) -> Steps[list[R | None]]:
        """The blocks read through the read table where it shows them and their copies
        hold (client/_readtable.py); the others asked of the daemon (`_ask`)."""
        tables = None
        if self._shm.read_table and len(set(keys)) == len(keys):  # repeats: the daemon says
            if (yield from self._segment()) is not None:
                tables = self._shm.tables
        if tables is None:
            return (yield from self._ask(keys, arrays, finish))
        out: list[R | None] = yield Offload(partial(
            tables.read, self.namespace, keys, arrays, self.verify_checksums,
            self._shm.report_post()))
        rest = [i for i, got in enumerate(out) if got is None]
        if rest:
            asked = yield from self._ask([keys[i] for i in rest],
                                         None if arrays is None else [arrays[i] for i in rest],
                                         finish)
            merge_reread(out, rest, asked)
        return out

    def _ask(
        self, keys: list[bytes], arrays: list[ByteArray] | None,
        finish: Callable[[list[bytes], Fetched, list[ByteArray] | None],
                         tuple[list[R | None], list[bytes]]],
    ) -> Steps[list[R | None]]:
        """The blocks fetched and judged by their checksums (finish: finish_get or
        finish_get_into): per key, its result or None. Blocks that failed their checksum on
        a read the daemon did not hold (a verifying client's shared-memory Get, unleased) are
        read once more, under a lease, and only those that fail again are evicted; those of
        a held read are evicted at once (see `reread_indexes`)."""
        fetched = yield from self._fetch(keys, arrays)
        out, bad = finish(keys, fetched, arrays)
        again = reread_indexes(fetched, out)
        if again:
            # Normal under L2 pressure (a block demoted between the daemon's reply and the
            # copy), so not a warning; a block that fails under the lease too is one.
            logger.debug("kvstore: %d of %d blocks failed their checksum on an unleased "
                         "shared-memory read (moved by the daemon while copied); reading "
                         "them again under a lease", len(again), len(keys))
            keys_again = [keys[i] for i in again]
            arrays_again = None if arrays is None else [arrays[i] for i in again]
            fetched = yield from self._fetch(keys_again, arrays_again, again=True)
            out_again, bad = finish(keys_again, fetched, arrays_again)
            merge_reread(out, again, out_again)
        yield from self._drop_corrupt(bad)
        return out

    def _fetch(self, keys: list[bytes], arrays: list[ByteArray] | None,
               again: bool = False) -> Steps[Fetched]:
        """The blocks through shared memory when it is in use, else inline; again: a re-read
        of blocks that failed their checksum unleased, which takes a lease (see _read)."""
        if (yield from self._segment()) is not None:
            try:
                through_shm: Fetched = yield Retried(lambda: self._get_shm(keys, arrays, again))
                return through_shm
            except FailedPrecondition as exc:
                self._shm.fall_back(exc)
        data = yield from self._data_socket()
        if data is not None:
            try:
                remote: Fetched = yield Retried(lambda: one(Offload(partial(
                    data.get_into, self.namespace, keys, arrays, self.verify_checksums))))
                return remote
            except NoSession as exc:
                self._data.failed(exc)
        inline: Fetched = yield Retried(lambda: self._get_inline(keys, arrays))
        return inline

    def _data_socket(self) -> Steps[DataSocket | None]:
        """The daemon's data socket for an inline Get or Put, when its Limits offer one and
        it takes this client now; None: gRPC."""
        if self._data.undecided:
            yield from self._limits_steps()
        return self._data.socket(self._blocking(self._fetch_attach))

    def _get_shm(self, keys: list[bytes], arrays: list[ByteArray] | None,
                 again: bool = False) -> Steps[Fetched]:
        request = self._get_request(keys, True, again)
        response = yield from self._local_first(
            GET, request, pb.GetResponse, lambda: self._get_header(request))
        try:
            yield from self._ensure_arena(response.arena)
            fetched: Fetched = yield Offload(partial(
                self._shm.read_get, response, len(keys), arrays, self.verify_checksums))
            # The daemon says whether it leased what it found: a lease id, or none.
            return fetched if response.lease_id else dataclasses.replace(fetched, held=False)
        finally:
            if response.lease_id:
                yield from self._release_lease(response.lease_id)

    def _get_request(self, keys: list[bytes], shared_memory: bool,
                     again: bool = False) -> pb.GetRequest:
        return rq.get_request(self.namespace, keys, shared_memory, self.verify_checksums, again)

    def _get_header(self, request: pb.GetRequest) -> Steps[pb.GetResponse]:
        """A shared-memory Get over gRPC: the one message it answers."""
        stream = yield Open(self._get, request, self.timeout_s)
        messages = []
        while (message := (yield Next(stream))) is not None:
            messages.append(message)
        return only_header(messages)

    def _get_inline(self, keys: list[bytes], arrays: list[ByteArray] | None) -> Steps[Fetched]:
        request = self._get_request(keys, False)
        stream = yield Open(self._get, request, self.timeout_s)
        try:
            first = yield Next(stream)
            if first is None:
                raise DataLoss("Get stream ended without a header")
            assembler: InlineAssembler = yield Offload(partial(
                InlineAssembler.start, first, len(keys), arrays, self.verify_checksums))
            while (message := (yield Next(stream))) is not None:
                yield Offload(partial(assembler.feed, chunk_of(message)))
            return assembler.fetched()
        except BaseException:
            stream.cancel()
            raise

    # --- control verbs --------------------------------------------------------------------

    def _lookup_steps(self, keys: Sequence[BlockKey],
                      block_tokens: int) -> Steps[res.LookupResult]:
        self._raise_posted()
        key_list, joined = check_keys_joined(keys)  # the join: the table's probe reads it
        if not key_list:
            return res.LookupResult(prefix_length=0, tiers=[])
        tables = self._shm.tables if self._shm.read_table else None
        if tables is None:
            return (yield from self._lookup_asked(key_list, block_tokens))
        local = yield Offload(partial(tables.lookup, self.namespace, key_list, block_tokens,
                                      self._shm.report_post(), joined))
        if local is None:
            return (yield from self._lookup_asked(key_list, block_tokens))
        found, tiers = local
        if found == len(key_list):
            return res.LookupResult(prefix_length=found, tiers=tiers)
        # The daemon answers from the first key the table does not show on (L3, L4, or a
        # block the table leaves out), authoritatively.
        rest = yield from self._lookup_asked(key_list[found:], block_tokens)
        return res.LookupResult(prefix_length=found + rest.prefix_length,
                                tiers=[*tiers, *rest.tiers])

    def _lookup_asked(self, key_list: list[bytes],
                      block_tokens: int) -> Steps[res.LookupResult]:
        """A Lookup answered by the daemon."""
        request = rq.lookup_request(self.namespace, key_list, block_tokens)
        # Over the local path once a data call has opened it (with the shared memory).
        response = yield Retried(lambda: self._local_first(
            LOOKUP, request, pb.LookupResponse,
            lambda: one(Call(self._stub.Lookup, request, self.timeout_s))))
        return res.lookup_result(response)

    def _prefetch_steps(
        self, keys: Sequence[BlockKey], tier: str | None, deadline_s: float | None,
        on_progress: Callable[[res.PrefetchResult], object] | None,
    ) -> Steps[res.PrefetchResult]:
        key_list = check_keys(keys)
        request = rq.prefetch_request(self.namespace, key_list, tier, deadline_s)
        timeout_s = rq.prefetch_timeout_s(self.timeout_s, deadline_s)
        if not key_list:
            return res.PrefetchResult(done=0, missing=0, failed=0, total=0)
        return (yield from self._progress(
            self._stub.Prefetch, request, timeout_s, res.prefetch_result,
            res.PrefetchResult(done=0, missing=0, failed=0, total=len(key_list)), on_progress))

    def _evict_steps(self, keys: Sequence[BlockKey] | None, size_bytes: int, evict_all: bool,
                     tier: str | None, namespace: str | None) -> Steps[res.EvictResult]:
        request = rq.evict_request(self.namespace, keys, size_bytes, evict_all, tier, namespace)
        return res.evict_result((yield from self._unary(self._stub.Evict, request)))

    def _pin_steps(self, method: Callable[..., Any],
                   keys: Sequence[BlockKey]) -> Steps[res.PinResult]:
        """Pin or Unpin (the method) these keys."""
        key_list = check_keys(keys)
        if not key_list:
            return res.PinResult(changed=0, missing=0)
        request = pb.PinRequest(namespace=self.namespace, keys=key_list)
        return res.pin_result((yield from self._unary(method, request)))

    def _limits_steps(self) -> Steps[res.Limits]:
        """The daemon's limits, asked once and kept; a warning when this client cannot
        receive the inline Get messages it sends."""
        if self._daemon_limits is None:
            response = yield from self._unary(self._stub.Limits, pb.LimitsRequest())
            self._data.offered(response)
            limits = res.limits_result(response)
            if limits.chunk_bytes + FRAME_SLACK_BYTES > self.max_message_bytes:
                logger.warning(
                    "the daemon sends inline Get messages of up to %d bytes, over this "
                    "client's max_message_bytes %d: pass max_message_bytes=%d or more",
                    limits.chunk_bytes, self.max_message_bytes, limits.max_message_bytes)
            self._daemon_limits = limits
        return self._daemon_limits

    def _stats_steps(self, include_config: bool, namespace: str | None) -> Steps[res.Stats]:
        request = rq.stats_request(include_config, namespace)
        return res.stats_result((yield from self._unary(self._stub.Stats, request)))

    def _drain_steps(self) -> Steps[res.DrainResult]:
        return res.drain_result((yield from self._unary(self._stub.Drain, pb.DrainRequest())))

    def _hot_steps(self, limit: int) -> Steps[res.HotResult]:
        request = rq.hot_request(self.namespace, limit)
        return res.hot_result((yield from self._unary(self._stub.Hot, request)))

    def _prewarm_steps(
        self, size_bytes: int, namespaces: Sequence[str],
        on_progress: Callable[[res.PrewarmResult], object] | None, timeout_s: float | None,
    ) -> Steps[res.PrewarmResult]:
        request = rq.prewarm_request(size_bytes, namespaces)
        call_timeout_s = rq.call_timeout_s(self.timeout_s, timeout_s)
        return (yield from self._progress(
            self._stub.Prewarm, request, call_timeout_s, res.prewarm_result,
            res.PrewarmResult(blocks=0, bytes=0, target_bytes=request.bytes, done=False),
            on_progress))

    def _health_steps(self, service: str) -> Steps[str]:
        request = health_pb2.HealthCheckRequest(service=service)
        response = yield from self._unary(self._health.Check, request)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

    def _release_steps(self, ids: Sequence[str]) -> Steps[res.ReleaseResult]:
        request = rq.release_request(ids)
        if not request.ids:
            return res.ReleaseResult(released=0)
        return res.release_result((yield from self._unary(self._stub.Release, request)))

    # --- state ----------------------------------------------------------------------------

    @property
    def uses_shared_memory(self) -> bool | None:
        """True/False once decided (after the first data call), None before."""
        return self._shm.in_use

    @property
    def uses_local_path(self) -> bool:
        """Whether the hot verbs (Lookup, shared-memory Get, Reserve, commit, Release) go over
        the daemon's Unix socket now rather than gRPC: False before the first data call, on
        another host, and while the local path is off for now (a refusal that passes: it is
        tried again after a pause of at most a few seconds)."""
        return self._shm.local is not None

    @property
    def uses_data_socket(self) -> bool:
        """Whether inline Gets and Puts go over the daemon's data socket (server.data_port,
        offered in Limits: docs/protocol.md) rather than gRPC: known after the first inline
        Get or Put; False after a refusal that does not pass."""
        return self._data.in_use

    def _begin_close(self) -> bool:
        """Mark the client closed and drop the segment; False when it already was."""
        if self._closed:
            return False
        self._closed = True
        self._shm.close()
        self._data.close()
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(target={self.target!r}, namespace={self.namespace!r})"
