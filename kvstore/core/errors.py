"""Typed errors of the daemon core; the servicer maps each to one gRPC status code
(docs/architecture.md, "The error model") and one google.rpc.ErrorInfo: a `reason` a client
branches on and `metadata` naming what is at fault ("field", "limit", "setting"). The
reasons are the wire contract's (the header of proto/kvstore/v1/kvstore.proto); each class
has a default, and a raise site that means another passes it."""

from __future__ import annotations

from typing import ClassVar

DOMAIN = "kvstore.v1"  #: ErrorInfo.domain of every error the daemon sends


class Reason:
    """ErrorInfo reasons, by the status code they come with."""

    # INVALID_ARGUMENT
    INVALID_FIELD = "INVALID_FIELD"
    CHECKSUM_MISMATCH = "CHECKSUM_MISMATCH"
    LEASE_EXPIRED = "LEASE_EXPIRED"  # a lease id unknown or expired
    RESERVATION_EXPIRED = "RESERVATION_EXPIRED"  # a reservation id unknown or expired
    # RESOURCE_EXHAUSTED
    NO_ROOM = "NO_ROOM"  # no room even after eviction
    MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"  # a message or an answer over a size limit
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"  # a client cap or a tenant's quota
    TOO_MANY_STREAMS = "TOO_MANY_STREAMS"
    TOO_MANY_SESSIONS = "TOO_MANY_SESSIONS"
    # FAILED_PRECONDITION
    FEATURE_OFF = "FEATURE_OFF"
    # ABORTED
    ENTRY_VANISHED = "ENTRY_VANISHED"  # gone mid-operation: retry
    STREAM_IDLE = "STREAM_IDLE"
    # UNAVAILABLE
    DRAINING = "DRAINING"
    REMOTE_DOWN = "REMOTE_DOWN"
    # UNAUTHENTICATED, PERMISSION_DENIED
    UNAUTHENTICATED = "UNAUTHENTICATED"
    NOT_OWNER = "NOT_OWNER"
    ROLE_DENIED = "ROLE_DENIED"
    # INTERNAL
    INTERNAL = "INTERNAL"


class StoreError(Exception):
    """Base of every error the store raises on purpose.

    reason: the ErrorInfo reason (default: the class's). field: the request field at fault
    ("keys[3]"); limit: the limit's value; setting: the daemon setting behind the limit
    ("server.max_batch_keys"). The message is the text a person reads; it is never parsed."""

    default_reason: ClassVar[str] = Reason.INTERNAL

    def __init__(self, message: str, reason: str = "", *, field: str = "",
                 limit: int | float | str | None = None, setting: str = "") -> None:
        super().__init__(message)
        self.reason = reason or self.default_reason
        self.metadata: dict[str, str] = {}
        if field:
            self.metadata["field"] = field
        if limit is not None:
            self.metadata["limit"] = str(limit)
        if setting:
            self.metadata["setting"] = setting


class InvalidArgument(StoreError):
    """Malformed input; the message names the field."""

    default_reason = Reason.INVALID_FIELD


class ResourceExhausted(StoreError):
    """No room even after eviction, or a request larger than a limit allows."""

    default_reason = Reason.NO_ROOM


class FailedPrecondition(StoreError):
    """A tier or feature that is off."""

    default_reason = Reason.FEATURE_OFF


class Aborted(StoreError):
    """An entry vanished mid-operation; retrying may succeed."""

    default_reason = Reason.ENTRY_VANISHED


class Unavailable(StoreError):
    """Starting, draining or a backend down."""

    default_reason = Reason.DRAINING


class Unauthenticated(StoreError):
    """A call with no credentials, or credentials no tenant has."""

    default_reason = Reason.UNAUTHENTICATED


class PermissionDenied(StoreError):
    """The caller's tenant does not own the namespace, or its role may not use the verb."""

    default_reason = Reason.NOT_OWNER


class StartupError(Exception):
    """The daemon cannot start (a port is taken, shared memory is short, the L3 folder is in
    use); the message says what to change."""
