"""How the daemon answers a call that fails: the one map from the store's typed errors to
gRPC status codes (`status_for`) and to the google.rpc.Status sent with them (`described`:
the code, the message and one google.rpc.ErrorInfo, its reason and metadata, in the
`grpc-status-details-bin` trailer; `abort` sends it), error texts cut to a bound (they echo
client input), requests whose bytes do not parse (`decoder`: INVALID_ARGUMENT, never gRPC's
INTERNAL), and the log of client faults, rate-limited (`FaultLog`)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvstore.core.errors import (
    DOMAIN,
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    Reason,
    ResourceExhausted,
    StoreError,
    Unauthenticated,
    Unavailable,
)

log = logging.getLogger("kvstore.daemon.server")
_STATUS = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    Aborted: grpc.StatusCode.ABORTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}


IDLE_SETTING = "server.stream_idle_s"
MAX_MESSAGE_CHARS = 512  # of an error's text: it echoes client input, and goes in metadata


class FaultLog:
    """Client faults (bad input, caps reached) on one INFO line each, at most `per_s` lines
    a second: a barrage of bad requests must not flood the log. Lines left out are counted
    and reported with the next one written."""

    def __init__(self, per_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = 1.0 / per_s
        self._clock = clock
        self._next = 0.0
        self._skipped = 0
        self._lock = threading.Lock()

    def fault(self, method: str, peer: str, code: grpc.StatusCode, message: str) -> None:
        with self._lock:
            now = self._clock()
            if now < self._next:
                self._skipped += 1
                return
            self._next = now + self._interval_s
            skipped, self._skipped = self._skipped, 0
        more = f" ({skipped} more client faults not logged)" if skipped else ""
        log.info("client fault: %s from %s: %s %s%s", method, peer, code.name,
                 message.replace("\n", " "), more)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one place that maps an exception to a gRPC status (and a bounded message)."""
    for cls, code in _STATUS.items():
        if isinstance(exc, cls):
            return code, bounded(str(exc))
    log.error("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, bounded(f"internal error: {type(exc).__name__}: {exc}")


def described(exc: BaseException) -> status_pb2.Status:
    """The google.rpc.Status a failed call is answered with: status_for's code and message,
    and one ErrorInfo (the error's reason and metadata; INTERNAL for anything unexpected)."""
    code, message = status_for(exc)
    if isinstance(exc, StoreError) and code is not grpc.StatusCode.INTERNAL:
        return error_status(code, message, exc.reason, exc.metadata)
    return error_status(code, message, Reason.INTERNAL)


def error_status(code: grpc.StatusCode, message: str, reason: str,
                 metadata: Mapping[str, str] | None = None) -> status_pb2.Status:
    """A google.rpc.Status carrying one ErrorInfo of domain kvstore.v1."""
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN,
                                          metadata=dict(metadata or {})))
    return status_pb2.Status(code=code.value[0], message=message, details=[info])


def code_of(status: status_pb2.Status) -> grpc.StatusCode:
    return _CODES.get(status.code, grpc.StatusCode.UNKNOWN)


def abort(context: grpc.ServicerContext, status: status_pb2.Status) -> NoReturn:
    """End the call with status, its details in the grpc-status-details-bin trailer."""
    context.abort_with_status(rpc_status.to_status(status))
    raise AssertionError("abort_with_status returned")  # it raises; this keeps mypy honest


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def bounded(message: str) -> str:
    """message, cut in the middle to about MAX_MESSAGE_CHARS: an echoed 100 kB id must not
    make an error too large for the status metadata, and the head (the field) and the tail
    (what to do) are what a reader needs."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    half = MAX_MESSAGE_CHARS // 2
    cut = len(message) - 2 * half
    return f"{message[:half]} ...({cut} characters cut)... {message[-half:]}"


@dataclasses.dataclass(frozen=True)
class Undecodable:
    """A request whose bytes do not parse: its deserializer returns this instead of raising,
    because gRPC answers a raising deserializer with INTERNAL and logs a traceback."""

    message: str


def decoder(cls: Any) -> Callable[[bytes], Any]:
    def decode(raw: bytes) -> Any:
        try:
            return cls.FromString(raw)
        except DecodeError as exc:
            return Undecodable(f"{cls.__name__}: the request does not parse ({exc})")
    return decode


def parsed(request: Any) -> Any:
    if isinstance(request, Undecodable):
        raise InvalidArgument(request.message)
    return request
