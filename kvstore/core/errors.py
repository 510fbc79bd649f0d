"""Typed errors of the daemon core; the servicer maps each to one gRPC status code
(docs/architecture.md, "The error model")."""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error the store raises on purpose."""


class InvalidArgument(StoreError):
    """Malformed input; the message names the field."""


class ResourceExhausted(StoreError):
    """No room even after eviction, or a request larger than a limit allows."""


class FailedPrecondition(StoreError):
    """A tier or feature that is off."""


class Aborted(StoreError):
    """An entry vanished mid-operation; retrying may succeed."""


class Unavailable(StoreError):
    """Starting, draining or a backend down."""


class Unauthenticated(StoreError):
    """A call with no credentials, or credentials no tenant has."""


class PermissionDenied(StoreError):
    """The caller's tenant does not own the namespace, or its role may not use the verb."""


class StartupError(Exception):
    """The daemon cannot start (a port is taken, shared memory is short, the L3 folder is in
    use); the message says what to change."""
