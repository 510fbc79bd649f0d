"""What a client proves to the daemon: a bearer token, TLS (server-verified, or mutual with a
client certificate), and where the daemon's Unix socket is; read once, when a client is built.

    token   `authorization: Bearer <token>` on every call (auth.mode=token). Explicit, else
            env KVSTORE_TOKEN, else the file named by KVSTORE_TOKEN_FILE (stripped).
    tls     `TLS(ca_file, cert_file, key_file, server_name)`, True for the system roots, False
            for plaintext; None: TLS from the KVSTORE_TLS_* variables when CA or cert is set.
    socket  the daemon's Unix socket for Attach; explicit, else KVSTORE_UNIX_SOCKET, else what
            the daemon says (its pod may mount the folder at another path).

The token travels as call metadata, not as grpc call credentials, which grpc refuses on an
insecure channel (a loopback daemon, or a mesh that does the TLS). It is bound to each
multi-callable once (`with_metadata`): a keyword merge per call, where a grpc interceptor
builds new call details and wraps every call in Python (on a loopback Lookup: about 10 µs a
call with the token, against about 35 µs through an interceptor).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from .errors import InvalidArgument

__all__ = [
    "ENV_TLS_CA_FILE",
    "ENV_TLS_CERT_FILE",
    "ENV_TLS_KEY_FILE",
    "ENV_TLS_SERVER_NAME",
    "ENV_TOKEN",
    "ENV_TOKEN_FILE",
    "ENV_UNIX_SOCKET",
    "TLS",
    "ChannelSecurity",
    "bearer_metadata",
    "channel_security",
    "read_token_file",
    "resolve_token",
    "resolve_tls",
    "resolve_unix_socket",
    "tls_settings",
    "with_metadata",
]

ENV_TOKEN = "KVSTORE_TOKEN"
ENV_TOKEN_FILE = "KVSTORE_TOKEN_FILE"
ENV_TLS_CA_FILE = "KVSTORE_TLS_CA_FILE"
ENV_TLS_CERT_FILE = "KVSTORE_TLS_CERT_FILE"
ENV_TLS_KEY_FILE = "KVSTORE_TLS_KEY_FILE"
ENV_TLS_SERVER_NAME = "KVSTORE_TLS_SERVER_NAME"
ENV_UNIX_SOCKET = "KVSTORE_UNIX_SOCKET"

Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class TLS:
    """A TLS channel to the daemon. With no field set: the system roots verify the daemon.
    cert_file and key_file together make it mutual TLS (auth.mode=mtls: the certificate
    names the tenant)."""

    ca_file: str | None = None
    """PEM roots that sign the daemon's certificate; None: the system roots."""
    cert_file: str | None = None
    """PEM client certificate chain (with key_file)."""
    key_file: str | None = None
    """PEM private key of cert_file."""
    server_name: str | None = None
    """The name to verify the daemon's certificate against, when it is not the target's host
    (grpc.ssl_target_name_override)."""

    def __post_init__(self) -> None:
        for name in ("ca_file", "cert_file", "key_file", "server_name"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidArgument(f"tls.{name} must be a non-empty string or None, "
                                      f"got {value!r}")
        if (self.cert_file is None) != (self.key_file is None):
            given, missing = (("cert_file", "key_file") if self.key_file is None
                              else ("key_file", "cert_file"))
            raise InvalidArgument(f"tls.{given} is set but tls.{missing} is not: a client "
                                  "certificate needs both its chain and its private key")


@dataclass(frozen=True)
class ChannelSecurity:
    """What grpc.secure_channel takes: the credentials and the channel options they need."""

    credentials: grpc.ChannelCredentials
    options: tuple[tuple[str, str], ...] = ()


def _check_token(token: str, field: str) -> str:
    token = token.strip()
    if not token:
        raise InvalidArgument(f"{field}: the token is empty")
    if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
        raise InvalidArgument(f"{field}: a token is printable ASCII with no whitespace inside")
    return token


def read_token_file(path: str, field: str = ENV_TOKEN_FILE) -> str:
    """The token in a file (surrounding whitespace dropped), else InvalidArgument naming
    field and path."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{field}: cannot read token file {path!r}: {exc}") from None
    return _check_token(text, f"{field} ({path})")


def resolve_token(token: str | None, env: Mapping[str, str] = os.environ) -> str | None:
    """The token to send: token, else KVSTORE_TOKEN, else KVSTORE_TOKEN_FILE's contents;
    None when none is given. InvalidArgument naming `token` for a malformed one."""
    if token is not None:
        if not isinstance(token, str):
            raise InvalidArgument(f"token must be a string or None, got {type(token).__name__}")
        return _check_token(token, "token")
    if env.get(ENV_TOKEN):
        return _check_token(env[ENV_TOKEN], f"token (from {ENV_TOKEN})")
    if env.get(ENV_TOKEN_FILE):
        return read_token_file(env[ENV_TOKEN_FILE], f"token (from {ENV_TOKEN_FILE})")
    return None


def resolve_tls(tls: TLS | bool | None, env: Mapping[str, str] = os.environ) -> TLS | None:
    """The TLS settings to use, None for plaintext: tls itself, True as TLS(), False as
    plaintext; None reads KVSTORE_TLS_* (TLS when the CA or the cert file is set)."""
    if isinstance(tls, TLS):
        return tls
    if tls is True:
        return TLS()
    if tls is False:
        return None
    if tls is not None:
        raise InvalidArgument(f"tls must be a TLS, a bool or None, got {type(tls).__name__}")
    if not (env.get(ENV_TLS_CA_FILE) or env.get(ENV_TLS_CERT_FILE)):
        return None
    try:
        return TLS(
            ca_file=env.get(ENV_TLS_CA_FILE) or None,
            cert_file=env.get(ENV_TLS_CERT_FILE) or None,
            key_file=env.get(ENV_TLS_KEY_FILE) or None,
            server_name=env.get(ENV_TLS_SERVER_NAME) or None,
        )
    except InvalidArgument as exc:
        raise InvalidArgument(f"{exc} (from the KVSTORE_TLS_* variables)") from None


def tls_settings(
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
    server_name: str | None = None,
    env: Mapping[str, str] = os.environ,
) -> TLS | None:
    """What command-line --tls-* flags mean: TLS from the paths given, each one not given
    read from its KVSTORE_TLS_* variable; with none given, resolve_tls(None)."""
    given = (ca_file, cert_file, key_file, server_name)
    if all(value is None for value in given):
        return resolve_tls(None, env)
    names = (ENV_TLS_CA_FILE, ENV_TLS_CERT_FILE, ENV_TLS_KEY_FILE, ENV_TLS_SERVER_NAME)
    ca, cert, key, name = (value or env.get(var) or None
                           for value, var in zip(given, names, strict=True))
    return TLS(ca_file=ca, cert_file=cert, key_file=key, server_name=name)


def resolve_unix_socket(unix_socket: str | None,
                        env: Mapping[str, str] = os.environ) -> str | None:
    """The Unix socket path that overrides the daemon's: unix_socket, else
    KVSTORE_UNIX_SOCKET; None to use the path the daemon reports."""
    if unix_socket is not None:
        if not isinstance(unix_socket, str) or not unix_socket:
            raise InvalidArgument(f"unix_socket must be a non-empty path or None, "
                                  f"got {unix_socket!r}")
        return unix_socket
    return env.get(ENV_UNIX_SOCKET) or None


def _read_pem(path: str | None, field: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise InvalidArgument(f"tls.{field}: cannot read {path!r}: {exc}") from None


def channel_security(tls: TLS) -> ChannelSecurity:
    """Read tls's files into grpc channel credentials; InvalidArgument naming the field and
    path of a file that cannot be read."""
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read_pem(tls.ca_file, "ca_file"),
        private_key=_read_pem(tls.key_file, "key_file"),
        certificate_chain=_read_pem(tls.cert_file, "cert_file"),
    )
    options = (() if tls.server_name is None
               else (("grpc.ssl_target_name_override", tls.server_name),))
    return ChannelSecurity(credentials, options)


def bearer_metadata(token: str) -> Metadata:
    """The call metadata that carries token (auth.mode=token)."""
    return (("authorization", f"Bearer {token}"),)


class _MetadataChannel:
    """A channel whose multi-callables send `metadata` on every call; all else is the
    channel's own (close, channel_ready, ...)."""

    def __init__(self, channel: Any, metadata: Metadata) -> None:
        self._channel = channel
        self._metadata = metadata

    def _bound(self, factory: str, method: str, *args: Any, **kwargs: Any) -> Any:
        callable_ = getattr(self._channel, factory)(method, *args, **kwargs)
        return functools.partial(callable_, metadata=self._metadata)

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._bound("unary_unary", method, *args, **kwargs)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._bound("unary_stream", method, *args, **kwargs)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._bound("stream_unary", method, *args, **kwargs)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._bound("stream_stream", method, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._channel, name)


def with_metadata(channel: Any, metadata: Metadata) -> Any:
    """channel, every call of whose stubs carries metadata (nothing to bind: channel)."""
    return _MetadataChannel(channel, metadata) if metadata else channel
