"""Who is calling: the tenants file, each call's credentials, and the server's TLS.

`Auth` owns the tenants (read at start, re-read on SIGHUP: a bad file keeps the old tenants
and logs why) and turns a call's credentials into its Caller's tenant: the bearer token in its
`authorization` metadata (auth.mode=token) or the identities of its client certificate
(auth.mode=mtls: the subject CN and every SAN). With auth.mode=off every caller is OPEN.
`server_credentials` builds gRPC's TLS credentials, re-reading the certificate files when they
change, so a rotated certificate is served without a restart. The rules are kvstore.core.tenants'.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml

from kvstore.core.errors import StartupError, Unauthenticated
from kvstore.core.tenants import OPEN, Tenant, Tenants, TenantsError, parse_tenants
from kvstore.daemon.admission import client_of
from kvstore.daemon.config import Config

log = logging.getLogger(__name__)

BEARER = "bearer "
#: auth_context properties that name a client certificate's identities (grpc core's).
IDENTITY_PROPERTIES = ("x509_common_name", "x509_subject_alternative_name", "peer_uri",
                       "peer_spiffe_id")


@dataclass(frozen=True, slots=True)
class Caller:
    """Who makes a call: its tenant, and the client its holdings are charged to (the tenant
    with auth on, else the peer host)."""

    tenant: Tenant
    client: str

    def data(self, namespace: str) -> None:
        """A data verb (put, get, lookup, prefetch, reserve, pin): the tenant must own the
        namespace, whatever its role."""
        self.tenant.check_namespace(namespace)

    def operate(self, namespace: str, field_name: str = "namespace") -> None:
        """An operator's verb on a namespace (evict, stats, hot, prewarm): its owner, or an
        admin."""
        if not self.tenant.admin:
            self.tenant.check_namespace(namespace, field_name)


def read_tenants(path: str) -> Tenants:
    """The tenants of the file at path; TenantsError saying what is wrong."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise TenantsError(f"auth.tenants_file {path}: cannot be read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise TenantsError(f"auth.tenants_file {path}: not YAML: {exc}") from None
    return parse_tenants(doc, f"auth.tenants_file {path}")


class Auth:
    """The daemon's tenants and how a call's credentials name one of them. Thread-safe."""

    def __init__(self, config: Config) -> None:
        self.mode = config.auth.mode
        self.path = config.auth.tenants_file
        self.tenants = Tenants([])
        if self.on:
            try:
                self.tenants = read_tenants(self.path)
            except TenantsError as exc:
                raise StartupError(str(exc)) from None
        else:
            log.warning("auth.mode is off: every caller may read, write and evict every "
                        "namespace (set auth.mode=token or mtls for a shared daemon)")

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def reload(self) -> bool:
        """Re-read the tenants file (SIGHUP); keep the old tenants when it is bad. Tenants
        added or removed, or quotas changed, take their arenas only at the next start."""
        if not self.on:
            return False
        try:
            fresh = read_tenants(self.path)
        except TenantsError as exc:
            log.error("SIGHUP: kept the tenants loaded before: %s", exc)
            return False
        before = {t.name: dict(t.quota) for t in self.tenants.holders()}
        after = {t.name: dict(t.quota) for t in fresh.holders()}
        if before != after:
            log.warning("SIGHUP: tenants or quotas changed; their arenas change at the next "
                        "restart (until then a new tenant cannot store blocks)")
        self.tenants = fresh  # one assignment: a call sees the old tenants or the new
        log.info("SIGHUP: re-read %d tenants from %s", len(fresh.tenants), self.path)
        return True

    def caller(self, context: grpc.ServicerContext) -> Caller:
        """Who makes this call; Unauthenticated when its credentials name no tenant."""
        if not self.on:
            return Caller(OPEN, client_of(context.peer()))
        tenant = self._tenant(context)
        return Caller(tenant, tenant.name)

    def _tenant(self, context: grpc.ServicerContext) -> Tenant:
        tenants = self.tenants
        if self.mode == "mtls":
            tenant = tenants.by_identity(_identities(context))
            if tenant is None:
                raise Unauthenticated("the client certificate names no tenant (auth.mode=mtls: "
                                      "its subject CN or a SAN must be in a tenant's identities)")
            return tenant
        token = _bearer(context.invocation_metadata() or ())
        if token is None:
            raise Unauthenticated("no credentials: auth.mode=token needs metadata "
                                  "'authorization: Bearer <token>' on every call")
        tenant = tenants.by_token(token)
        if tenant is None:
            raise Unauthenticated("the token names no tenant (unknown or revoked)")
        return tenant

    def arena_of(self, namespace: str) -> str | None:
        """The arena of namespace's blocks: its owner's (auth on), or the one arena."""
        if not self.on:
            return ""
        owner = self.tenants.owner_of(namespace)
        return owner.name if owner is not None else None


def _bearer(metadata: Any) -> str | None:
    for key, value in metadata:
        if key == "authorization" and isinstance(value, str) and \
                value[:len(BEARER)].lower() == BEARER:
            return value[len(BEARER):].strip()
    return None


def _identities(context: grpc.ServicerContext) -> list[str]:
    props = context.auth_context() or {}
    out: list[str] = []
    for name in IDENTITY_PROPERTIES:
        for value in props.get(name, ()):
            out.append(value.decode(errors="replace") if isinstance(value, bytes) else value)
    return out


def _read(path: str, setting: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise StartupError(f"{setting} {path}: cannot be read: {exc.strerror}") from None


def server_credentials(config: Config) -> grpc.ServerCredentials | None:
    """TLS for the gRPC port (None: plaintext), client certificates required with mtls. The
    files are re-read whenever one of them changes (checked at each new handshake)."""
    s = config.server
    if not s.tls_cert_file:
        if config.auth.mode == "token":
            log.warning("auth.mode=token without TLS: tokens cross the network in clear "
                        "(set server.tls_cert_file and server.tls_key_file)")
        return None
    files = [(s.tls_key_file, "server.tls_key_file"), (s.tls_cert_file, "server.tls_cert_file")]
    if s.tls_client_ca_file:
        files.append((s.tls_client_ca_file, "server.tls_client_ca_file"))

    def stamp() -> tuple[float, ...]:
        try:
            return tuple(os.stat(path).st_mtime for path, _ in files)
        except OSError:
            return ()

    def load() -> Any:
        key, cert = _read(s.tls_key_file, files[0][1]), _read(s.tls_cert_file, files[1][1])
        ca = _read(s.tls_client_ca_file, files[2][1]) if s.tls_client_ca_file else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    loaded = [stamp()]

    def fetch() -> Any:
        now = stamp()
        if not now or now == loaded[0]:
            return None  # unchanged (or mid-rotation: keep serving the old ones)
        try:
            fresh = load()
        except StartupError as exc:
            log.error("TLS files changed but cannot be read; serving the old ones: %s", exc)
            return None
        loaded[0] = now
        log.info("TLS certificate files changed; serving the new ones")
        return fresh

    return grpc.dynamic_ssl_server_credentials(
        load(), fetch, require_client_authentication=config.auth.mode == "mtls")
