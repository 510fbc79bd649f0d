"""The daemon's address as the client dials it: a target without a port gets the daemon's
default port, 50051 (gRPC itself would dial 443, where no kvstore daemon listens).

    "host" -> "host:50051"             "host:6000"      unchanged
    "[::1]" or "::1" -> "[::1]:50051"  "[::1]:6000"     unchanged
    "dns:///host" -> "dns:///host:50051" (also dns://AUTHORITY/host and dns:host)
    "ipv4:10.0.0.1,10.0.0.2:7000" -> "ipv4:10.0.0.1:50051,10.0.0.2:7000" (and ipv6:)
    "unix:/run/kv.sock", "unix-abstract:kv", "vsock:3:50051", "xds:///name"   unchanged

A port that is not a number from 1 to 65535 is InvalidArgument naming the target.
"""

from __future__ import annotations

import ipaddress

from .errors import InvalidArgument

DEFAULT_PORT = 50051
# Schemes whose addresses carry no TCP port of ours: passed through as they are.
_AS_IS = ("unix:", "unix-abstract:", "vsock:")


def with_default_port(target: str, field: str = "target") -> str:
    """target with DEFAULT_PORT added where it names a host and no port (see the module)."""
    if not isinstance(target, str) or not target.strip():
        raise InvalidArgument(f"{field} must be a daemon address such as host:{DEFAULT_PORT}, "
                              f"got {target!r}")
    target = target.strip()
    lowered = target.lower()
    if lowered.startswith(_AS_IS):
        return target
    if lowered.startswith("dns:"):
        rest = target[4:]
        prefix = "dns:"
        if rest.startswith("//"):  # dns://[authority]/host[:port]
            slash = rest.find("/", 2)
            if slash < 0:
                raise InvalidArgument(f"{field} {target!r}: dns:// needs a host after the "
                                      "authority (dns:///host:port)")
            prefix, rest = prefix + rest[: slash + 1], rest[slash + 1 :]
        return prefix + _host_port(rest, target, field)
    for scheme in ("ipv4:", "ipv6:"):
        if lowered.startswith(scheme):
            addresses = target[len(scheme):].split(",")
            return scheme + ",".join(_host_port(a, target, field) for a in addresses)
    if "://" in target:  # another resolver (xds:///, google-c2p:///): it knows its ports
        return target
    return _host_port(target, target, field)


def _host_port(address: str, target: str, field: str) -> str:
    """One host[:port] with the default port added when it has none."""
    if address.startswith("["):  # [v6] or [v6]:port
        end = address.find("]")
        if end < 0:
            raise InvalidArgument(f"{field} {target!r}: '[' without its ']'")
        host, rest = address[: end + 1], address[end + 1 :]
        if not rest:
            return f"{host}:{DEFAULT_PORT}"
        if not rest.startswith(":"):
            raise InvalidArgument(f"{field} {target!r}: expected ':port' after {host}")
        return f"{host}:{_port(rest[1:], target, field)}"
    if address.count(":") > 1:  # a bare IPv6 address: a port would need brackets
        try:
            ipaddress.IPv6Address(address)
        except ValueError:
            raise InvalidArgument(f"{field} {target!r} is not host:port; write an IPv6 "
                                  "address in brackets: [addr]:port") from None
        return f"[{address}]:{DEFAULT_PORT}"
    host, colon, port = address.partition(":")
    if not host:
        raise InvalidArgument(f"{field} {target!r} names no host")
    if not colon:
        return f"{host}:{DEFAULT_PORT}"
    return f"{host}:{_port(port, target, field)}"


def _port(text: str, target: str, field: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise InvalidArgument(f"{field} {target!r}: port {text!r} is not a number from 1 to "
                              "65535")
    return int(text)
