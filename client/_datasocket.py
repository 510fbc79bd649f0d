"""The data socket: INLINE Get and Put over TCP, for a client on another host than the daemon.

gRPC's Python binding hands every message over as `bytes`, so an inline Get or Put copies
each payload once more on each side than a socket does. When the daemon offers its data
socket (`LimitsResponse.data_port`), a client that is not co-located moves Get and Put
bytes there instead: the local path's framing (`kvstore.proto.localframe`) over TCP, with
TLS when the client's channel has TLS, and the two payload verbs of
`kvstore.proto.dataframe`. A Get's blocks are received straight into the caller's buffers
(`recv_into`), a Put's are sent from the caller's buffers without a copy (`sendmsg` of
views; through TLS, `sendall` of each view).

It is `LocalPath` (client/_localpath.py) with another way in: the same pool of sessions,
the same tickets (auth on: Attach over gRPC, one per session handshake, `TicketKeeper`), the
same pauses after a refusal that passes, and the same fallback: `NoSession` (the daemon
serves none, or refused for good) means gRPC from then on, `NoSessionNow` gRPC for this call.
A session that breaks before any byte of a Get's reply arrived is asked once more on a
fresh one when it was reused (a Get may be asked twice); a Put is not (it may have been
stored): it fails Unavailable, and the client retries the whole put, as it does any call.
A Get whose trailer says its bytes are not the blocks' (TRAILER_VOID; today's daemon ends the
session instead) fails EntryVanished: its bytes are dropped and the call is retried.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from kvstore.proto.dataframe import (
    GET_DATA,
    MAX_IOV,
    PUT_DATA,
    TRAILER_OK,
    TRAILER_VOID,
    advanced,
)
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.localframe import REQUEST

from ._attach import FetchAttach, TicketKeeper
from ._buffers import ByteArray
from ._localpath import LocalPath, NoSession, NoSessionNow, _error, _Session, _Unanswered
from ._pause import TryLater
from ._wire import Fetched, capacities, parse_get_header
from .credentials import TLS
from .errors import EntryVanished, InvalidArgument, Unavailable

logger = logging.getLogger("kvstore.client")


__all__ = ["DataPath", "DataSocket", "NoSession", "NoSessionNow", "data_socket_for",
           "tls_context"]


def tls_context(ca_file: str | None = None, cert_file: str | None = None,
                key_file: str | None = None) -> ssl.SSLContext:
    """The TLS a data socket is opened with, from a client's `TLS` settings
    (client/credentials.py): the PEM roots to trust (None: the system's) and, for
    auth.mode=mtls, the client's certificate chain and key."""
    context = ssl.create_default_context(cafile=ca_file)
    if cert_file is not None and key_file is not None:
        context.load_cert_chain(cert_file, key_file)
    return context


def data_socket_for(target: str, data_port: int, tls: TLS | None,
                    fetch_attach: FetchAttach | None, timeout_s: float) -> DataSocket | None:
    """The client's entry point: the data socket of the daemon at target (a gRPC target as
    the client was given it) when its Limits offer one (data_port), on the same host; None
    when there is none, or target names no host (unix:, a resolver's scheme). tls: the
    client's TLS settings, None for plaintext; fetch_attach: the Attach call with auth on
    (tickets), None with auth off."""
    host = target_host(target)
    if not data_port or host is None:
        return None
    context = None if tls is None else tls_context(tls.ca_file, tls.cert_file, tls.key_file)
    server_name = tls.server_name if tls is not None else None
    return DataSocket(host, data_port, TicketKeeper(fetch_attach), timeout_s, tls=context,
                      server_hostname=server_name)


class DataPath:
    """A client's data-socket state (the narrow entry point client/_base.py calls): what
    the daemon's Limits offer, the DataSocket made from it on first use, and off for good
    after a NoSession (for now after a NoSessionNow: the socket's own pause). Thread-safe
    enough: two threads deciding at once make one socket each and one is kept."""

    def __init__(self, target: str, tls: TLS | None, timeout_s: float) -> None:
        self._target = target
        self._tls = tls
        self._timeout_s = timeout_s
        self._port: int | None = None  # None: Limits not seen yet
        self._auth = False
        self._socket: DataSocket | None = None
        self._off = False

    @property
    def undecided(self) -> bool:
        """Whether Limits still has to be seen (the caller asks it first)."""
        return self._port is None and not self._off

    @property
    def in_use(self) -> bool:
        """Whether a data socket was made and is not off for good."""
        return self._socket is not None and not self._off

    def offered(self, limits: pb.LimitsResponse) -> None:
        """Take in the daemon's Limits: its data_port (0: none), and whether tickets are
        needed (auth_mode not "off")."""
        self._port = int(limits.data_port)
        self._auth = limits.auth_mode not in ("", "off")

    def socket(self, fetch_attach: FetchAttach) -> DataSocket | None:
        """The data socket to move inline Gets and Puts over now, or None (none offered,
        off for good, or paused after a refusal that passes: gRPC then)."""
        if self._off or not self._port:
            return None
        if self._socket is None:
            self._socket = data_socket_for(self._target, self._port, self._tls,
                                           fetch_attach if self._auth else None,
                                           self._timeout_s)
            if self._socket is None:
                self._off = True
                return None
        return self._socket if self._socket.ready() else None

    def failed(self, exc: NoSession) -> None:
        """A call could not have a session: NoSessionNow is for that call only (the socket
        pauses itself); any other NoSession turns the data socket off for good."""
        if isinstance(exc, NoSessionNow):
            return
        logger.info("kvstore: the daemon's data socket is off for this client, inline Get "
                    "and Put use gRPC: %s", exc)
        self._off = True
        self.close()

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()


def target_host(target: str) -> str | None:
    """The host of a gRPC target: host:port, [v6]:port, dns:///host:port, ipv4:/ipv6:
    (the first address); None for unix: and other schemes (no host to reach TCP on)."""
    lowered = target.lower()
    if lowered.startswith("dns:"):
        target = target[4:].lstrip("/")
        if "/" in target:  # dns://authority/host:port
            target = target.split("/", 1)[1]
    elif lowered.startswith(("ipv4:", "ipv6:")):
        target = target[5:].split(",")[0]
    elif "://" in target or lowered.startswith(("unix:", "unix-abstract:", "vsock:")):
        return None
    if target.startswith("["):  # [v6]:port
        return target[1:target.find("]")] or None
    return target.rsplit(":", 1)[0] or None


class DataSocket(LocalPath):
    """Pooled sessions on one daemon's data socket (host:port). Thread-safe.

    tickets: as LocalPath's (auth on: Attach tickets; auth off: "-"). tls: the context to
    open sessions with (when the client's channel has TLS; server_hostname: the name the
    daemon's certificate must carry, by default host), None for plaintext. timeout_s bounds
    each operation of a call."""

    kind = "data"
    passes_fds = False  # a TCP connection passes no descriptors (and TLS cannot peek)

    def __init__(self, host: str, port: int, tickets: TicketKeeper, timeout_s: float,
                 tls: ssl.SSLContext | None = None, server_hostname: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(f"{host}:{port}", tickets, timeout_s, clock)
        self.host = host.strip("[]")
        self.port = port
        self._tls = tls
        self._server_hostname = server_hostname or self.host

    # --- the verbs ------------------------------------------------------------------------

    def get_into(self, namespace: str, keys: list[bytes], arrays: list[ByteArray] | None,
                 verify: bool, lease_timeout_ms: int = 0) -> Fetched:
        """An INLINE Get: the found blocks received into arrays (one writable flat uint8
        array per key; None: into bytes of their own, in Fetched.payloads), hashed as they
        land when verify. NoSession / NoSessionNow when the socket cannot be had (the caller
        uses gRPC); the daemon's errors as the client's."""
        request = pb.GetRequest(namespace=namespace, keys=keys,
                                lease_timeout_ms=lease_timeout_ms)
        body = request.SerializeToString()
        fetched: Fetched = self._data_call(
            GET_DATA, body, (), lambda s: self._receive_get(s, len(keys), arrays, verify),
            resend=True)
        return fetched

    def get(self, namespace: str, keys: list[bytes], verify: bool) -> Fetched:
        """As get_into, each found block's bytes in Fetched.payloads."""
        return self.get_into(namespace, keys, None, verify)

    def put(self, header: pb.PutRequest, payloads: Sequence[Any]) -> pb.PutResponse:
        """An inline Put: header (namespace, keys, sizes, parent_key, independent; checksums
        optional), then each payload sent from its own buffer (one per key, sizes[i] bytes
        each)."""
        views = [_flat(p) for p in payloads]
        if [v.nbytes for v in views] != list(header.sizes):
            raise InvalidArgument("payloads: one per key, of the sizes the header names")
        body = header.SerializeToString()

        def receive(session: _Session) -> pb.PutResponse:
            response: pb.PutResponse = pb.PutResponse.FromString(_reply(session))
            return response

        return self._data_call(PUT_DATA, body, views, receive, resend=False)

    # --- one call -------------------------------------------------------------------------

    def _data_call(self, verb: int, body: bytes, payloads: Sequence[memoryview],
                   receive: Callable[[_Session], Any], resend: bool) -> Any:
        """One request on a pooled session (`LocalPath.exchange`: asked once more on a fresh
        one when a reused one broke unanswered and resend allows it)."""
        return self.exchange(lambda s: self._exchange(s, verb, body, payloads, receive),
                             resend, "Get" if verb == GET_DATA else "Put")

    def _exchange(self, session: _Session, verb: int, body: bytes,
                  payloads: Sequence[memoryview], receive: Callable[[_Session], Any]) -> Any:
        """Send one request (its payloads after it) and take its reply. A daemon error is
        raised with the session pooled again when the stream is still in step, else the
        session is closed: _Unanswered when it broke before any byte of the reply arrived,
        Unavailable when later or on a timeout; NoSessionNow (pooled again) for a request
        over the frame size."""
        if len(body) > session.max_frame_bytes:
            self._give_back(session)
            raise NoSessionNow(f"the request ({len(body)} bytes) is over the data socket's "
                               f"{session.max_frame_bytes}-byte frames")
        session.reply_bytes = 0
        try:
            _send(session.sock, [memoryview(REQUEST.pack(len(body), verb) + body), *payloads])
            return receive(session)
        except _DaemonError as exc:
            self._give_back(session)
            raise exc.error from None
        except (OSError, _Torn) as exc:
            session.close()
            if isinstance(exc, TimeoutError):
                raise Unavailable(f"the data session timed out after {self._timeout_s} s") \
                    from None
            if not session.reply_bytes:
                raise _Unanswered(str(exc)) from None
            raise Unavailable(f"the data session broke: {exc}") from None
        except BaseException:
            session.close()
            raise

    def _receive_get(self, session: _Session, num_keys: int, arrays: list[ByteArray] | None,
                     verify: bool) -> Fetched:
        """A GET_DATA reply: its header, the found blocks into their buffers, its trailer."""
        first = pb.GetResponse.FromString(_reply(session))
        # A header that cannot be taken (DataLoss; ValueError: a block larger than its
        # buffer) is raised as it is; its payloads are left unread, so the session closes.
        header = parse_get_header(first, num_keys, capacities(arrays))
        payloads: list[bytes] = []
        digests: list[int] | None = [] if verify else None
        for i, size in zip(header.found_index, header.sizes, strict=True):
            if arrays is not None:
                target = memoryview(arrays[i])[:size]  # type: ignore[arg-type]
            else:
                target = memoryview(bytearray(size))
            if digests is None:
                _fill(session, target)
            else:
                hasher = xxhash.xxh3_64()
                _fill(session, target, hasher)
                digests.append(hasher.intdigest())
            if arrays is None:
                payloads.append(bytes(target))
        trailer = session.read(1)[0]
        if trailer == TRAILER_VOID:
            raise _DaemonError(EntryVanished(
                "the daemon's lease on the blocks ended while it sent them; ask again"))
        if trailer != TRAILER_OK:
            raise _Torn(f"a Get's trailer is {trailer}, not 0 or 1")
        return Fetched(header=header, payloads=payloads, digests=digests, held=True)

    # --- sessions over TCP ----------------------------------------------------------------

    def _session_of(self, reply: dict[str, Any], sock: socket.socket | None) -> _Session:
        session = super()._session_of(reply, sock)
        return _DataSession(session.sock, session.max_frame_bytes, session.timeout_s)

    def _connect(self) -> socket.socket:
        """A connection to the daemon's data port, TLS on it when asked: TryLater when
        nothing answers now, NoSession when TLS fails (a certificate this client does not
        trust will not change by trying again)."""
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self._timeout_s)
        except OSError as exc:
            raise TryLater(f"no data session on {self.path}: {exc}",
                           ticket_unused=True) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self._server_hostname)
        except ssl.SSLError as exc:
            sock.close()
            raise NoSession(f"no data session on {self.path}: TLS failed: {exc}") from None
        except OSError as exc:
            sock.close()
            raise TryLater(f"no data session on {self.path}: {exc}",
                           ticket_unused=True) from None
        return sock


class _DataSession(_Session):
    """A session on the data socket, which posts nothing: an idle one with anything to
    read was closed by the daemon (the end of the stream, or a TLS close). A look that never
    waits, and works through TLS (which cannot peek)."""

    def alive(self) -> bool:
        try:
            if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
                return False
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable


class _Torn(Exception):
    """The reply is not the protocol: the session is out of step and closes."""


class _DaemonError(Exception):
    """An error the daemon answered, with the session still in step."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _reply(session: _Session) -> bytes:
    """The next reply's message, read as the local path reads one (the closing flag kept on
    the session); a daemon error raised (_DaemonError)."""
    status, body = session.next_reply()
    if status:
        raise _DaemonError(_error(status, body))
    return body


def _fill(session: _Session, view: memoryview, hasher: Any = None) -> None:
    """view filled from the session's socket (the reply's bytes counted on the session);
    with hasher, each piece hashed the moment it lands, while it is in cache (hashing a
    2 MiB block after it arrived reads it back from memory)."""
    got, n, sock = 0, view.nbytes, session.sock
    while got < n:
        k = sock.recv_into(view[got:] if got else view)
        if k == 0:
            raise ConnectionError("the daemon closed the data session")
        if hasher is not None:
            hasher.update(view[got:got + k])
        got += k
        session.reply_bytes += k


def _send(sock: socket.socket, views: list[memoryview]) -> None:
    """views sent in order: gathered (sendmsg, no copy) in plaintext, one by one via TLS."""
    if isinstance(sock, ssl.SSLSocket):
        for view in views:
            sock.sendall(view)
        return
    pending = [v for v in views if v.nbytes]
    while pending:
        pending = advanced(pending, sock.sendmsg(pending[:MAX_IOV]))


def _flat(payload: Any) -> memoryview:
    """A payload as a flat byte view (no copy)."""
    view = payload if isinstance(payload, memoryview) else memoryview(payload)
    if view.format != "B" or view.ndim != 1:
        with contextlib.suppress(TypeError):
            return view.cast("B")
        raise InvalidArgument("payloads: each must be a contiguous buffer")
    return view
