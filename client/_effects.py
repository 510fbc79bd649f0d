"""What a client verb asks of its transport: the effects that a verb's steps yield.

Each verb is written once, in `ClientBase`, as a generator of steps, and each client runs the
steps with its own transport: redis-py writes each command once and its I/O loop twice, and a
verb here is often a flow of several calls (a shared-memory put reserves, writes, commits and
on failure releases), which only steps let us write once. A step yields one effect; the
transport performs it and sends the result back in at the same `yield`, or throws the failure
in there, so the steps read as plain code: `try`, `except` and `finally` work around a yield as
they would around a call.

    Call(method, request, timeout_s)    one unary gRPC call; a failure is the client's error
    Upload(method, frames, timeout_s)   one client-streaming gRPC call (Put), fed frames
    Open(method, request, timeout_s)    start a server-streaming gRPC call: a `Stream`
    Next(stream)                        the stream's next message, or None at its end
    Offload(fn)                         blocking work: a local-path call on the Unix socket,
                                        a copy through shared memory, the shared-memory decision
    Retried(steps)                      run the steps again, whole, as the client's Retry says
    Report(on_progress, value)          progress handed to the caller's callback

`KVStoreClient` performs every effect on the caller's thread. `AsyncKVStoreClient` awaits the
gRPC calls on its event loop and runs each `Offload` (and the building of each Upload frame) in
a worker thread, so blocking work never holds the loop. Nothing in this module performs
anything.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, TypeVar

T = TypeVar("T")


class Stream(Protocol):
    """A server-streaming call in flight, as the steps see it: they may only cancel it (its
    messages come through `Next`)."""

    def cancel(self) -> Any:
        """Stop the call; its messages are no longer wanted."""


@dataclass(frozen=True, slots=True)
class Call:
    """One unary gRPC call, not retried; its RpcError is raised as the client's error."""

    method: Callable[..., Any]
    request: Any
    timeout_s: float


@dataclass(frozen=True, slots=True)
class Upload:
    """One client-streaming gRPC call fed `frames` (serialized PutRequests, each built as it
    is taken: building one copies the caller's bytes); the response."""

    method: Callable[..., Any]
    frames: Iterator[bytes]
    timeout_s: float


@dataclass(frozen=True, slots=True)
class Open:
    """Start a server-streaming gRPC call; the `Stream` that `Next` reads."""

    method: Callable[..., Any]
    request: Any
    timeout_s: float


@dataclass(frozen=True, slots=True)
class Next:
    """The next message of a stream that `Open` started, None once it has ended; an RpcError
    is raised as the client's error."""

    stream: Stream


@dataclass(frozen=True, slots=True)
class Offload:
    """fn(): work that blocks the thread it runs on (a socket round trip, a copy of many
    bytes, the shared-memory decision); its value."""

    fn: Callable[[], Any]


@dataclass(frozen=True, slots=True)
class Retried:
    """Run the steps that steps() makes, again whole when they fail with what the client's
    `Retry` retries; their value."""

    steps: Callable[[], Steps[Any]]


@dataclass(frozen=True, slots=True)
class Report:
    """on_progress(value), for a progress stream's caller; the asyncio client also awaits
    what it returns when that is a coroutine."""

    on_progress: Callable[[Any], object]
    value: Any


Effect: TypeAlias = Call | Upload | Open | Next | Offload | Retried | Report
Steps: TypeAlias = Generator[Effect, Any, T]
"""A verb's steps: yield effects, are sent each one's result, return the verb's value."""


def one(effect: Effect) -> Steps[Any]:
    """Steps that are this one effect, so that it can be `Retried`."""
    return (yield effect)
