"""The client's exception tree, one class per gRPC status the daemon uses and, under them, one
per ErrorInfo reason a caller branches on; and the functions that turn a failed call into it
(`from_rpc_error`, `from_status`, `from_status_proto`).

Every error carries `.code` (a `grpc.StatusCode`), `.details` (the daemon's message, which
names the offending field), `.reason` (the google.rpc.ErrorInfo reason the daemon sent, "" when
it sent none) and `.metadata` (the ErrorInfo's: "field", "limit", "setting"; `.field`,
`.limit` and `.setting` read them). Branch on the class or `.reason`, never on the text.

    try:
        kv.put(keys, blocks)
    except NoRoom:          # a ResourceExhausted: no room even after eviction
        ...
    except QuotaExceeded as e:   # this client's cap or its tenant's quota (e.setting)
        ...

A RESOURCE_EXHAUSTED without details is gRPC's own refusal of a message over the size limit
(the daemon's server.max_message_bytes, or this channel's receive limit): every error the
daemon makes carries an ErrorInfo, so such a status is read as MESSAGE_TOO_LARGE. Likewise an
ABORTED without details whose message names server.stream_idle_s is STREAM_IDLE (the daemon
ends an idle stream with a cancel, which carries no trailers).

Client-side validation raises the same classes the daemon would (InvalidArgument with reason
INVALID_FIELD), so a malformed call fails the same way whether or not it reached the wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

__all__ = [
    "DOMAIN",
    "Aborted",
    "ChecksumMismatch",
    "DataLoss",
    "DeadlineExceeded",
    "Draining",
    "EntryVanished",
    "FailedPrecondition",
    "FeatureOff",
    "InvalidArgument",
    "KVStoreError",
    "LeaseExpired",
    "MessageTooLarge",
    "NoRoom",
    "NotFound",
    "NotOwner",
    "PermissionDenied",
    "QuotaExceeded",
    "RemoteDown",
    "ReservationExpired",
    "ResourceExhausted",
    "RoleDenied",
    "StreamIdle",
    "TooManySessions",
    "TooManyStreams",
    "Unauthenticated",
    "Unavailable",
    "from_rpc_error",
    "from_status",
    "from_status_proto",
]

DOMAIN = "kvstore.v1"  #: the ErrorInfo domain of the daemon's errors
_DETAILS_KEY = "grpc-status-details-bin"


class KVStoreError(Exception):
    """Base of every error the client raises for a failed request."""

    default_code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    default_reason: ClassVar[str] = ""

    def __init__(self, details: str, code: grpc.StatusCode | None = None, reason: str = "",
                 metadata: Mapping[str, str] | None = None) -> None:
        super().__init__(details)
        self.details = details
        self.code: grpc.StatusCode = code if code is not None else self.default_code
        self.reason: str = reason or self.default_reason
        self.metadata: dict[str, str] = dict(metadata or {})

    @property
    def field(self) -> str | None:
        """The request field at fault ("keys[3]"), when the daemon named one."""
        return self.metadata.get("field")

    @property
    def limit(self) -> str | None:
        """The value of the limit that was the cause, as the daemon wrote it."""
        return self.metadata.get("limit")

    @property
    def setting(self) -> str | None:
        """The daemon setting behind the limit ("clients.max_leases")."""
        return self.metadata.get("setting")

    def __str__(self) -> str:
        return self.details or str(self.code.name)

    def __repr__(self) -> str:
        reason = f", reason={self.reason}" if self.reason else ""
        return f"{type(self).__name__}({self.details!r}, code={self.code.name}{reason})"


class InvalidArgument(KVStoreError, ValueError):
    """Malformed input; the message names the field. Also a ValueError."""

    default_code = grpc.StatusCode.INVALID_ARGUMENT
    default_reason = "INVALID_FIELD"


class LeaseExpired(InvalidArgument):
    """A lease id unknown or expired (Release): its blocks are no longer held for you."""

    default_reason = "LEASE_EXPIRED"


class ReservationExpired(InvalidArgument):
    """A reservation id unknown or expired (a commit): Reserve and write again."""

    default_reason = "RESERVATION_EXPIRED"


class ChecksumMismatch(InvalidArgument):
    """A commit's checksum does not match the bytes written; the reservation is freed."""

    default_reason = "CHECKSUM_MISMATCH"


class ResourceExhausted(KVStoreError):
    """No room even after eviction, or a size limit was hit."""

    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NoRoom(ResourceExhausted):
    """No room even after eviction (pinned and leased blocks stay)."""

    default_reason = "NO_ROOM"


class MessageTooLarge(ResourceExhausted):
    """A message or an answer over a size limit: send or ask for fewer bytes per call."""

    default_reason = "MESSAGE_TOO_LARGE"


class QuotaExceeded(ResourceExhausted):
    """A per-client cap or the tenant's quota (`.setting` names it): release some first."""

    default_reason = "QUOTA_EXCEEDED"


class TooManyStreams(ResourceExhausted):
    """The daemon, this connection or this client has as many streams open as it may."""

    default_reason = "TOO_MANY_STREAMS"


class TooManySessions(ResourceExhausted):
    """The daemon has as many local-path sessions open as it may."""

    default_reason = "TOO_MANY_SESSIONS"


class FailedPrecondition(KVStoreError):
    """A tier or feature that is off (or shared memory required but not co-located)."""

    default_code = grpc.StatusCode.FAILED_PRECONDITION


class FeatureOff(FailedPrecondition):
    """A tier or feature this call needs is off on the daemon (`.setting` turns it on)."""

    default_reason = "FEATURE_OFF"


class Aborted(KVStoreError):
    """An entry vanished mid-read; retrying the call usually succeeds."""

    default_code = grpc.StatusCode.ABORTED


class EntryVanished(Aborted):
    """An entry (or the call's lease or put) went mid-operation: retry the call."""

    default_reason = "ENTRY_VANISHED"


class StreamIdle(Aborted):
    """The stream sent or took nothing for server.stream_idle_s and was ended."""

    default_reason = "STREAM_IDLE"


class Unavailable(KVStoreError):
    """The daemon is unreachable, starting or draining; the client retries these."""

    default_code = grpc.StatusCode.UNAVAILABLE


class Draining(Unavailable):
    """The daemon is stopping: retry on another replica or after its restart."""

    default_reason = "DRAINING"


class RemoteDown(Unavailable):
    """L4's Redis is unreachable (a verb about L4 itself: Hot, Prewarm)."""

    default_reason = "REMOTE_DOWN"


class NotFound(KVStoreError):
    """A named object (lease, reservation, service) does not exist."""

    default_code = grpc.StatusCode.NOT_FOUND


class DeadlineExceeded(KVStoreError):
    """The call's deadline passed before it completed."""

    default_code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(KVStoreError):
    """Missing or invalid credentials."""

    default_code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(KVStoreError):
    """Valid credentials that may not do this."""

    default_code = grpc.StatusCode.PERMISSION_DENIED


class NotOwner(PermissionDenied):
    """The caller's tenant does not own the namespace (`.field` names which)."""

    default_reason = "NOT_OWNER"


class RoleDenied(PermissionDenied):
    """The caller's role (client) may not use this verb or option (admin only)."""

    default_reason = "ROLE_DENIED"


class DataLoss(KVStoreError):
    """Stored or transferred bytes are inconsistent (the daemon, or a malformed response)."""

    default_code = grpc.StatusCode.DATA_LOSS


_BY_CODE: dict[grpc.StatusCode, type[KVStoreError]] = {
    cls.default_code: cls
    for cls in (
        InvalidArgument,
        ResourceExhausted,
        FailedPrecondition,
        Aborted,
        Unavailable,
        NotFound,
        DeadlineExceeded,
        Unauthenticated,
        PermissionDenied,
        DataLoss,
    )
}

_BY_REASON: dict[tuple[grpc.StatusCode, str], type[KVStoreError]] = {
    (cls.default_code, cls.default_reason): cls
    for cls in (LeaseExpired, ReservationExpired, ChecksumMismatch, NoRoom, MessageTooLarge,
                QuotaExceeded, TooManyStreams, TooManySessions, FeatureOff, EntryVanished,
                StreamIdle, Draining, RemoteDown, NotOwner, RoleDenied)
}

_BY_VALUE: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def error_for(code: grpc.StatusCode, details: str, reason: str = "",
              metadata: Mapping[str, str] | None = None) -> KVStoreError:
    """The KVStoreError of a status code and ErrorInfo reason: the reason's class where the
    tree has one, else the code's (an unknown reason is kept in `.reason`)."""
    if not reason and code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        reason = "MESSAGE_TOO_LARGE"  # gRPC's own size refusal: the daemon's all carry one
    elif not reason and code is grpc.StatusCode.ABORTED and "server.stream_idle_s" in details:
        reason = "STREAM_IDLE"  # the idle reaper's cancel carries no trailers
    cls = _BY_REASON.get((code, reason)) or _BY_CODE.get(code, KVStoreError)
    error = cls(details, code, reason, metadata)
    if not reason:
        error.reason = ""  # nothing was sent: do not make one up from the class's default
    return error


def _error_info(status: status_pb2.Status) -> error_details_pb2.ErrorInfo | None:
    """The status's ErrorInfo of domain kvstore.v1 (else its first ErrorInfo), if any."""
    found: list[error_details_pb2.ErrorInfo] = []
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            found.append(info)
    return next((i for i in found if i.domain == DOMAIN), found[0] if found else None)


def _status_of(e: Any) -> status_pb2.Status | None:
    """The google.rpc.Status in a failed call's grpc-status-details-bin trailer, if any
    (a sync call's or an aio AioRpcError's)."""
    trailing = getattr(e, "trailing_metadata", None)
    try:
        metadata = trailing() if callable(trailing) else None
    except Exception:  # a call object that cannot give its trailers has none to read
        return None
    for key, value in metadata or ():
        if key == _DETAILS_KEY and isinstance(value, bytes):
            try:
                return status_pb2.Status.FromString(value)
            except DecodeError:
                return None
    return None


def from_rpc_error(e: grpc.RpcError) -> KVStoreError:
    """The KVStoreError for a failed call; unmapped codes give the KVStoreError base."""
    code_fn = getattr(e, "code", None)
    details_fn = getattr(e, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    if not details:
        details = f"{code.name.lower()}: {e!s}" if str(e) else code.name
    status = _status_of(e)
    info = _error_info(status) if status is not None else None
    if info is None:
        return error_for(code, str(details))
    return error_for(code, str(details), info.reason, dict(info.metadata))


def from_status(value: int, details: str, reason: str = "",
                metadata: Mapping[str, str] | None = None) -> KVStoreError:
    """The KVStoreError for a status code given as its number (the local path's replies)."""
    code = _BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)
    return error_for(code, details or code.name, reason, metadata)


def from_status_proto(status: status_pb2.Status) -> KVStoreError:
    """The KVStoreError for a google.rpc.Status (the local path's error replies)."""
    info = _error_info(status)
    if info is None:
        return from_status(status.code, status.message)
    return from_status(status.code, status.message, info.reason, dict(info.metadata))
