"""How `kvstore-admin` reports a failed request: one line on stderr, and its exit code.

    error: <STATUS_NAME>: <the daemon's message>

With --json the line is one JSON object instead, still on stderr (stdout keeps only results,
so a script's `json.loads(stdout)` never mistakes an error for an answer), on one line:

    {"code": "NOT_FOUND", "reason": "KEYS_MISSING", "message": "...", "exit_code": 1}

`code` is the gRPC status name (INVALID_ARGUMENT for a command-line mistake), `reason` the
daemon's google.rpc.ErrorInfo reason or the CLI's own (UNREACHABLE, USAGE, KEYS_MISSING; ""
when there is none), `message` the same words as the plain line, `exit_code` the process's.

Exit codes: 0 success, 1 a request failed or the daemon could not do it (FAILED_PRECONDITION
for L4 off, UNAVAILABLE from the daemon itself for L4 down or a drain, DEADLINE_EXCEEDED for a
prewarm past --max-time, NOT_FOUND, PERMISSION_DENIED ...), 2 the daemon could not be reached
(or the command line was wrong). An UNAVAILABLE or DEADLINE_EXCEEDED answer is ambiguous (the
daemon's own, or gRPC's for a daemon it cannot reach): a quick health check tells them apart.
"""

from __future__ import annotations

import json
import sys

import grpc

from kvstore.client import DeadlineExceeded, KVStoreClient, KVStoreError, Unavailable
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb

EXIT_OK, EXIT_FAILED, EXIT_UNREACHABLE = 0, 1, 2
EXIT_USAGE = 2  # a command-line mistake: argparse's code, which "unreachable" shares
_PROBE_TIMEOUT_S = 3.0
# The health services the daemon registers: "" (the whole server) and the KVStore service.
HEALTH_SERVICES = ("", pb.DESCRIPTOR.services_by_name["KVStore"].full_name)


# Set once the command line says --json (before parsing ends, for a usage error too).
_as_json = False
#: The CLI's own reasons, for errors that did not come from the daemon.
REASON_UNREACHABLE = "UNREACHABLE"
REASON_USAGE = "USAGE"
REASON_KEYS_MISSING = "KEYS_MISSING"


def use_json(enabled: bool) -> None:
    """Print every later error as a JSON object (--json) or as the plain line."""
    global _as_json
    _as_json = enabled


def print_error(status: str, message: str, reason: str = "",
                exit_code: int = EXIT_FAILED) -> None:
    """The one error line on stderr: `error: STATUS: message` (newlines folded), or with
    --json the object of the module docstring."""
    text = " ".join(message.split())
    if _as_json:
        line = json.dumps({"code": status, "reason": reason, "message": text,
                           "exit_code": exit_code})
    else:
        line = f"error: {status}: {text}" if text else f"error: {status}"
    print(line, file=sys.stderr, flush=True)


def usage_error(prog: str, message: str) -> str:
    """A command-line mistake (exit 2): the text argparse's exit prints."""
    if _as_json:
        return json.dumps({"code": "INVALID_ARGUMENT", "reason": REASON_USAGE,
                           "message": f"{prog}: {message}", "exit_code": EXIT_USAGE})
    return f"{prog}: error: {message} (usage: {prog} --help)"


def server_message(exc: KVStoreError) -> str:
    """The daemon's own words: the gRPC details when the error came from a call (the client
    words a status that came without details as the whole RpcError; that is dropped here)."""
    cause = exc.__cause__
    if isinstance(cause, grpc.RpcError):
        details: object = cause.details() if callable(getattr(cause, "details", None)) else None
        return str(details) if details else ""
    return str(exc.details)


def explain(exc: KVStoreError, command: str, service: str = "") -> str:
    """server_message, or the CLI's words for a status the daemon sent without any."""
    message = server_message(exc)
    if message:
        return message
    if exc.code is grpc.StatusCode.NOT_FOUND and command == "health":
        known = " and ".join(repr(s) for s in HEALTH_SERVICES)
        return f"the daemon has no health service {service!r} (it serves {known})"
    return ""


def reachable(client: KVStoreClient) -> bool:
    """Whether the daemon answers a health check now (whatever it says)."""
    timeout_s, client.timeout_s = client.timeout_s, min(client.timeout_s, _PROBE_TIMEOUT_S)
    try:
        client.health()
        return True
    except (Unavailable, DeadlineExceeded):
        return False
    except KVStoreError:
        return True  # it answered, with an error
    finally:
        client.timeout_s = timeout_s


def report(exc: KVStoreError, client: KVStoreClient, command: str, service: str = "") -> int:
    """Print exc as one line; the exit code (module docstring)."""
    status = exc.code.name
    message = explain(exc, command, service)
    if isinstance(exc, Unavailable | DeadlineExceeded) and not reachable(client):
        print_error(status, f"the kvstore daemon at {client.target} is unreachable"
                    + (f": {message}" if message else ""), REASON_UNREACHABLE,
                    EXIT_UNREACHABLE)
        return EXIT_UNREACHABLE
    print_error(status, message, exc.reason)
    return EXIT_FAILED
