"""The client's exception tree, one class per gRPC status the daemon uses, and the one
function that turns a `grpc.RpcError` into it.

Every error carries `.code` (a `grpc.StatusCode`) and `.details` (the daemon's message, which
names the offending field). Client-side validation raises the same classes the daemon would,
so a malformed call fails the same way whether or not it reached the wire.
"""

from __future__ import annotations

import grpc

__all__ = [
    "Aborted",
    "DataLoss",
    "DeadlineExceeded",
    "FailedPrecondition",
    "InvalidArgument",
    "KVStoreError",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "from_rpc_error",
]


class KVStoreError(Exception):
    """Base of every error the client raises for a failed request."""

    default_code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(details)
        self.details = details
        self.code: grpc.StatusCode = code if code is not None else self.default_code

    def __str__(self) -> str:
        return self.details or str(self.code.name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.details!r}, code={self.code.name})"


class InvalidArgument(KVStoreError, ValueError):
    """Malformed input; the message names the field. Also a ValueError."""

    default_code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(KVStoreError):
    """No room even after eviction, or a size limit was hit."""

    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(KVStoreError):
    """A tier or feature that is off (or shared memory required but not co-located)."""

    default_code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(KVStoreError):
    """An entry vanished mid-read; retrying the call usually succeeds."""

    default_code = grpc.StatusCode.ABORTED


class Unavailable(KVStoreError):
    """The daemon is unreachable, starting or draining; the client retries these."""

    default_code = grpc.StatusCode.UNAVAILABLE


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
    cls = _BY_CODE.get(code, KVStoreError)
    return cls(str(details), code)


_BY_VALUE: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def from_status(value: int, details: str) -> KVStoreError:
    """The KVStoreError for a status code given as its number (the local path's replies)."""
    code = _BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)
    return _BY_CODE.get(code, KVStoreError)(details or code.name, code)
