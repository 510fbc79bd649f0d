"""Test certificates for TLS and mTLS, made with the `cryptography` package (a test extra):
a throwaway CA, a server certificate for 127.0.0.1 and localhost, and client certificates
with the subject CN and SAN URI a test names."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    """A throwaway CA and what it signed, as PEM files: the server's certificate (for
    127.0.0.1 and localhost) and one client certificate per name given."""

    ca: Path
    server_cert: Path
    server_key: Path
    clients: dict[str, tuple[Path, Path]]  # name -> (certificate, key)

    def credentials(self, client: str | None = None) -> grpc.ChannelCredentials:
        """Channel credentials trusting this CA, presenting a client's certificate if named."""
        cert = key = None
        if client is not None:
            cert, key = (p.read_bytes() for p in self.clients[client])
        return grpc.ssl_channel_credentials(self.ca.read_bytes(), key, cert)


def make_pki(workdir: Path, clients: dict[str, tuple[str, str | None]]) -> Pki:
    """A CA, a server certificate and client certificates with the `cryptography` package:
    clients maps a file name to (subject CN, SAN URI or None)."""
    d = workdir / f"pki-{os.urandom(3).hex()}"
    d.mkdir()
    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def save(stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
             ) -> tuple[Path, Path]:
        crt, pem = d / f"{stem}.crt", d / f"{stem}.key"
        crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pem.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
        return crt, pem

    def build(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
              signer: ec.EllipticCurvePrivateKey, ca: bool,
              extensions: list[tuple[x509.ExtensionType, bool]]) -> x509.Certificate:
        b = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(issuer)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=2))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        for ext, critical in extensions:
            b = b.add_extension(ext, critical=critical)
        return b.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = build("kvstore test CA", ca_key, name("kvstore test CA"), ca_key, True, [])
    ca_path, _ = save("ca", ca_cert, ca_key)
    server_key = ec.generate_private_key(ec.SECP256R1())
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                       x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    server_cert = build("localhost", server_key, ca_cert.subject, ca_key, False, [
        (san, False), (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)])
    server_paths = save("server", server_cert, server_key)
    out: dict[str, tuple[Path, Path]] = {}
    for stem, (cn, uri) in clients.items():
        key = ec.generate_private_key(ec.SECP256R1())
        exts: list[tuple[x509.ExtensionType, bool]] = [
            (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)]
        if uri:
            exts.append((x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]),
                         False))
        out[stem] = save(stem, build(cn, key, ca_cert.subject, ca_key, False, exts), key)
    return Pki(ca_path, *server_paths, out)
