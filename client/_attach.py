"""The Unix socket exchange that follows Attach: a one-time ticket in, the tenant's
shared-memory arenas out as file descriptors (SCM_RIGHTS), each mapped read-write, whole.

    client -> daemon   the ticket (ASCII, AttachResponse.ticket) and b"\\n"
    daemon -> client   one UTF-8 JSON line, then it closes:
                       {"arenas": [{"name": "<arena>", "size_bytes": N}, ...]}\\n in one
                       sendmsg carrying one descriptor per arena, in the same order; or
                       {"error": "<why>"}\\n with none

Every failure (no socket, refused, timed out, an error reply, a malformed one, a descriptor
that cannot be mapped) is FailedPrecondition saying why, and every descriptor received is
closed, mapped or not: a mapping keeps its own reference to the file.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import socket
import time
from typing import Any

from .errors import FailedPrecondition

logger = logging.getLogger("kvstore.client")

MAX_REPLY_BYTES = 65536
MAX_ARENAS = 16
EXCHANGE_TIMEOUT_S = 5.0


class Arena:
    """One arena mapped from its descriptor; what SharedSegment wraps (name, view, close)."""

    def __init__(self, name: str, buf: mmap.mmap) -> None:
        self.name = name
        self.buf = buf
        self.size_bytes = len(buf)

    def view(self) -> memoryview:
        return memoryview(self.buf)

    def close(self) -> None:
        try:
            self.buf.close()
        except BufferError:  # views still alive keep it mapped until they are collected
            logger.debug("kvstore: arena %s still in use; unmapped later", self.name)

    def __repr__(self) -> str:
        return f"Arena(name={self.name!r}, size_bytes={self.size_bytes})"


def receive_arenas(path: str, ticket: str, *,
                   timeout_s: float = EXCHANGE_TIMEOUT_S) -> list[Arena]:
    """Trade ticket for the arenas on the daemon's Unix socket at path, mapped."""
    data, fds = _exchange(path, ticket, timeout_s)
    try:
        return _map_all(path, _parse(path, data, len(fds)), fds)
    finally:
        for fd in fds:
            os.close(fd)


def _exchange(path: str, ticket: str, timeout_s: float) -> tuple[bytes, list[int]]:
    """Send the ticket; the reply's bytes (up to its newline) and the descriptors it carried."""
    if not ticket or not ticket.isascii() or not ticket.isprintable():
        raise FailedPrecondition(f"Attach returned an unusable ticket {ticket!r}")
    deadline = time.monotonic() + timeout_s
    data = bytearray()
    fds: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(path)
            sock.sendall(ticket.encode("ascii") + b"\n")
            while b"\n" not in data:
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    raise TimeoutError(f"no reply within {timeout_s:g} s")
                sock.settimeout(remaining_s)
                chunk, got, flags, _ = socket.recv_fds(sock, MAX_REPLY_BYTES, MAX_ARENAS)
                fds.extend(got)
                if flags & socket.MSG_CTRUNC:
                    raise FailedPrecondition(
                        f"the daemon's Unix socket {path} passed more than {MAX_ARENAS} "
                        "descriptors")
                if not chunk:
                    break
                data += chunk
                if len(data) > MAX_REPLY_BYTES:
                    raise FailedPrecondition(f"the daemon's Unix socket {path} sent a reply "
                                             f"longer than {MAX_REPLY_BYTES} bytes")
    except BaseException as exc:
        for fd in fds:
            os.close(fd)
        if isinstance(exc, OSError):
            raise FailedPrecondition(
                f"cannot attach through the daemon's Unix socket {path}: {exc}") from None
        raise
    return bytes(data), fds


def _parse(path: str, data: bytes, num_fds: int) -> list[tuple[str, int]]:
    """(name, size_bytes) per arena, in descriptor order; FailedPrecondition for an error
    reply or a malformed one."""
    line, newline, _ = data.partition(b"\n")
    reply: Any = None
    if newline:
        try:
            reply = json.loads(line.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError included
            reply = None
    if not isinstance(reply, dict):
        raise FailedPrecondition(
            f"the daemon's Unix socket {path} sent a malformed reply: {data[:200]!r}")
    if "error" in reply:
        raise FailedPrecondition(
            f"the daemon's Unix socket {path} refused the ticket: {reply['error']}")
    arenas = reply.get("arenas")
    if not isinstance(arenas, list) or not all(
        isinstance(a, dict) and isinstance(a.get("name"), str) and a["name"]
        and isinstance(a.get("size_bytes"), int) for a in arenas
    ):
        raise FailedPrecondition(f"the daemon's Unix socket {path} sent a malformed arena "
                                 f"list: {data[:200]!r}")
    named = [(str(a["name"]), int(a["size_bytes"])) for a in arenas]
    if len(named) != num_fds:
        raise FailedPrecondition(f"the daemon's Unix socket {path} named {len(named)} arenas "
                                 f"but passed {num_fds} descriptors")
    if not named:
        raise FailedPrecondition(f"the daemon's Unix socket {path} passed no arenas")
    if len({name for name, _ in named}) != len(named):
        raise FailedPrecondition(f"the daemon's Unix socket {path} named an arena twice")
    return named


def _map_all(path: str, named: list[tuple[str, int]], fds: list[int]) -> list[Arena]:
    arenas: list[Arena] = []
    try:
        for (name, size_bytes), fd in zip(named, fds, strict=True):
            arenas.append(Arena(name, _map(path, name, size_bytes, fd)))
    except BaseException:
        for arena in arenas:
            arena.close()
        raise
    return arenas


def _map(path: str, name: str, size_bytes: int, fd: int) -> mmap.mmap:
    try:
        file_bytes = os.fstat(fd).st_size
        if file_bytes <= 0 or file_bytes < size_bytes:
            raise ValueError(f"its file holds {file_bytes} bytes, the daemon says {size_bytes}")
        return mmap.mmap(fd, file_bytes, flags=mmap.MAP_SHARED,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError) as exc:
        raise FailedPrecondition(
            f"cannot map arena {name!r} from the daemon's Unix socket {path}: {exc}") from None
