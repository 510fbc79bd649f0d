"""`ClientBase`: the state and the steps `KVStoreClient` and `AsyncKVStoreClient` share, so
that each writes only its control flow (blocking calls, or awaited ones), as redis-py's
`retry.py` and `asyncio/retry.py` share a base.

Shared here: the constructor and its checks (a target without a port gets 50051: `_target`),
the credentials (`credentials`: the token bound to every call's metadata, TLS for the
channel), the stubs over the channel each subclass opens, the shared-memory decision
(`ShmState`, one per client), the requests the data path builds, the warnings both log,
`uses_shared_memory` and the repr. Verb arguments are checked and
requests built in `_requests`, wire framing in `_wire`, results in `results`.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any

from grpc_health.v1 import health_pb2_grpc

from kvstore.memory import keep_freed_buffers
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

from . import _requests as rq
from . import results as res
from ._shm import ShmState
from ._target import with_default_port
from ._wire import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    FRAME_SLACK_BYTES,
    GET_METHOD,
    PUT_METHOD,
    check_client_args,
    decode_get_response,
    identity,
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
from .errors import KVStoreError
from .retry import Retry

logger = logging.getLogger("kvstore.client")


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
        self._shm = ShmState(shared_memory, socket_path, timeout_s)
        self._limits: res.Limits | None = None  # the daemon's, asked once (Limits)
        self._no_limits = False  # the daemon predates the Limits verb
        self._closed = False

    @staticmethod
    @abstractmethod
    def _open_channel(
        target: str, max_message_bytes: int, security: ChannelSecurity | None
    ) -> Any:
        """The channel the stubs run on: grpc's blocking one, or grpc.aio's; TLS with
        security, else plaintext."""

    def _put_chunk(self, header: pb.PutRequest) -> int:
        """Data bytes per inline Put message: chunk_bytes, at most the daemon's chunk_bytes,
        and small enough that the first message (header and data) fits its
        max_message_bytes (from Limits once asked; a daemon without the verb: chunk_bytes)."""
        limits = self._limits
        if limits is None or not limits.chunk_bytes:
            return self.chunk_bytes
        room = limits.max_message_bytes - header.ByteSize() - FRAME_SLACK_BYTES
        return max(1, min(self.chunk_bytes, limits.chunk_bytes, int(room)))

    def _keep_limits(self, response: pb.LimitsResponse | None) -> res.Limits | None:
        """Cache the daemon's limits (None: it predates the verb) and check this client can
        receive its inline Get messages."""
        if response is None:
            return None
        limits = res.limits_result(response)
        if limits.chunk_bytes + FRAME_SLACK_BYTES > self.max_message_bytes:
            logger.warning(
                "the daemon sends inline Get messages of up to %d bytes, over this client's "
                "max_message_bytes %d: pass max_message_bytes=%d or more",
                limits.chunk_bytes, self.max_message_bytes, limits.max_message_bytes)
        self._limits = limits
        return limits

    @property
    def uses_shared_memory(self) -> bool | None:
        """True/False once decided (after the first data call), None before."""
        return self._shm.in_use

    def _begin_close(self) -> bool:
        """Mark the client closed and drop the segment; False when it already was."""
        if self._closed:
            return False
        self._closed = True
        self._shm.close()
        return True

    def _stats_request(self) -> pb.StatsRequest:
        """The Stats call the shared-memory decision is made from."""
        return pb.StatsRequest(namespace=self.namespace)

    def _get_request(self, keys: list[bytes], shared_memory: bool) -> pb.GetRequest:
        return rq.get_request(self.namespace, keys, shared_memory, self.verify_checksums)

    def _corrupt(self, key: bytes) -> pb.EvictRequest:
        """Log a block that failed its checksum; the request that evicts it."""
        logger.warning(
            "kvstore: checksum mismatch for key %s in namespace %r; treating it as a miss "
            "and evicting it",
            key.hex(),
            self.namespace,
        )
        return pb.EvictRequest(namespace=self.namespace, keys=[key])

    @staticmethod
    def _evict_failed(key: bytes, exc: KVStoreError) -> None:
        logger.warning("kvstore: evicting corrupt key %s failed: %s", key.hex(), exc)

    @staticmethod
    def _release_failed(ids: list[str], exc: KVStoreError) -> None:
        logger.warning("kvstore: Release(%s) failed, the daemon will expire it: %s", ids, exc)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(target={self.target!r}, namespace={self.namespace!r})"
