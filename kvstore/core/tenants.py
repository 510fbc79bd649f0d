"""Tenants' rules: who a credential is, which namespaces it owns, what its role may do, and
how each slot tier's pages are split into one arena per tenant. Pure: parsing a loaded YAML
document and answering questions about it; reading the file, hashing what a caller sent
and gRPC are kvstore.daemon.auth's.

A tenant owns namespace *prefixes*: "team-a/" owns "team-a/llama-8b/tp0". With auth off the
daemon has one tenant, OPEN, owning everything with role admin and no quota; its single arena
per tier is the whole tier, as before tenants existed.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.core.errors import PermissionDenied, Reason
from kvstore.extents import Arena
from kvstore.units import format_size, parse_size

__all__ = ["OPEN", "Arena", "Tenant", "Tenants", "TenantsError", "parse_tenants", "split_tier"]

ROLES = ("client", "admin")
#: Quota keys and the slot tier each caps ("pinned" caps pinned bytes, counted in L2).
QUOTA_TIERS = {"hbm": "hbm", "dram": "dram", "nvme": "nvme"}
QUOTA_KEYS = (*QUOTA_TIERS, "pinned")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_HEX64_RE = re.compile(r"[0-9a-f]{64}")
_TENANT_FIELDS = ("name", "tokens_sha256", "identities", "namespaces", "role", "quota")


@dataclass(frozen=True)
class Tenant:
    """One authenticated identity: what it owns and may do."""

    name: str
    namespaces: tuple[str, ...] = ()  # owned prefixes
    role: str = "client"
    tokens_sha256: tuple[str, ...] = ()
    identities: tuple[str, ...] = ()
    quota: Mapping[str, int] = field(default_factory=dict)  # QUOTA_KEYS -> bytes

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    def owns(self, namespace: str) -> bool:
        return any(namespace.startswith(p) for p in self.namespaces)

    def check_namespace(self, namespace: str, field_name: str = "namespace") -> None:
        """PermissionDenied unless the tenant owns namespace; the message names only this
        tenant's own prefixes, never another's."""
        if not self.owns(namespace):
            owned = ", ".join(repr(p) for p in self.namespaces) or "none"
            raise PermissionDenied(
                f"{field_name} {namespace!r}: tenant {self.name!r} owns the namespace "
                f"prefixes {owned}", Reason.NOT_OWNER, field=field_name)

    def check_admin(self, what: str) -> None:
        if not self.admin:
            raise PermissionDenied(f"{what} needs role admin; tenant {self.name!r} is "
                                   f"{self.role}", Reason.ROLE_DENIED)


#: Everything, for auth.mode=off: one trusted tenant (the name "" marks it).
OPEN = Tenant(name="", namespaces=("",), role="admin")


class TenantsError(ValueError):
    """A tenants file that cannot be used; one line per problem, each naming its field."""


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Tenants:
    """The tenants of one tenants file, indexed by credential."""

    def __init__(self, tenants: Sequence[Tenant]) -> None:
        self.tenants = tuple(tenants)
        self._by_name = {t.name: t for t in tenants}
        self._by_hash = {h: t for t in tenants for h in t.tokens_sha256}
        self._by_identity = {i: t for t in tenants for i in t.identities}

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self.tenants)

    def named(self, name: str) -> Tenant | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return [t.name for t in self.tenants]

    def by_token(self, token: str) -> Tenant | None:
        digest = token_sha256(token)
        tenant = self._by_hash.get(digest)
        # The dict lookup is on the digest, not the token: its timing says nothing about
        # which tokens exist. Compare once more in constant time all the same.
        if tenant is None or not any(hmac.compare_digest(digest, h)
                                     for h in tenant.tokens_sha256):
            return None
        return tenant

    def by_identity(self, identities: Iterable[str]) -> Tenant | None:
        for identity in identities:
            tenant = self._by_identity.get(identity)
            if tenant is not None:
                return tenant
        return None

    def owner_of(self, namespace: str) -> Tenant | None:
        """The tenant owning namespace (prefixes never nest: at most one does)."""
        for tenant in self.tenants:
            if tenant.owns(namespace):
                return tenant
        return None

    def holders(self) -> list[Tenant]:
        """The tenants that own namespaces: each gets an arena in every slot tier."""
        return [t for t in self.tenants if t.namespaces]


def parse_tenants(doc: Any, source: str = "tenants file") -> Tenants:
    """Tenants from a loaded YAML document ({"tenants": [...]}); TenantsError naming every
    bad field (as tenants[1].quota.dram) otherwise."""
    errors: list[str] = []
    if not isinstance(doc, Mapping) or not isinstance(doc.get("tenants"), list):
        raise TenantsError(f"{source}: must be a mapping with a list `tenants`")
    unknown = sorted(set(doc) - {"tenants"})
    if unknown:
        errors.append(f"{source}: unknown key {unknown[0]!r} (only `tenants`)")
    tenants: list[Tenant] = []
    for i, raw in enumerate(doc["tenants"]):
        where = f"tenants[{i}]"
        tenant = _tenant(raw, where, errors)
        if tenant is not None:
            tenants.append(tenant)
    _unique(tenants, errors)
    if not tenants and not errors:
        errors.append(f"{source}: `tenants` is empty; with auth on nobody could call")
    if errors:
        # Each problem once, in the order found: a credential listed twice, say, is one
        # mistake, not two lines of the same text.
        lines = dict.fromkeys(e if e.startswith(source) else f"{source}: {e}" for e in errors)
        raise TenantsError("\n".join(lines))
    return Tenants(tenants)


def _strings(raw: Any, where: str, errors: list[str]) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
        errors.append(f"{where}: must be a list of strings")
        return ()
    return tuple(raw)


def _tenant(raw: Any, where: str, errors: list[str]) -> Tenant | None:
    if not isinstance(raw, Mapping):
        errors.append(f"{where}: must be a mapping")
        return None
    for key in raw:
        if key not in _TENANT_FIELDS:
            errors.append(f"{where}.{key}: unknown field (fields: {', '.join(_TENANT_FIELDS)})")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        errors.append(f"{where}.name: {name!r} must be 1-63 letters, digits, '.', '_' or '-', "
                      "beginning with a letter or digit")
        return None
    where = f"{where} ({name})"
    hashes = _strings(raw.get("tokens_sha256"), f"{where}.tokens_sha256", errors)
    for h in hashes:
        if not _HEX64_RE.fullmatch(h):
            errors.append(f"{where}.tokens_sha256: {h[:12]!r}... is not 64 lower-case hex "
                          "digits (the SHA-256 of the token: printf %s TOKEN | sha256sum)")
    identities = _strings(raw.get("identities"), f"{where}.identities", errors)
    namespaces = _strings(raw.get("namespaces"), f"{where}.namespaces", errors)
    role = raw.get("role", "client")
    if role not in ROLES:
        errors.append(f"{where}.role: {role!r} must be one of {', '.join(ROLES)}")
    if not hashes and not identities:
        errors.append(f"{where}: has neither tokens_sha256 nor identities; nobody could be it")
    if not namespaces and role != "admin":
        errors.append(f"{where}.namespaces: a client tenant must own at least one prefix")
    quota = _quota(raw.get("quota"), f"{where}.quota", errors)
    return Tenant(name, namespaces, str(role), hashes, identities, quota)


def _quota(raw: Any, where: str, errors: list[str]) -> dict[str, int]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        errors.append(f"{where}: must be a mapping of {', '.join(QUOTA_KEYS)} to sizes")
        return {}
    quota: dict[str, int] = {}
    for key, value in raw.items():
        if key not in QUOTA_KEYS:
            errors.append(f"{where}.{key}: unknown (quotas: {', '.join(QUOTA_KEYS)})")
            continue
        try:
            quota[key] = parse_size(value)
        except ValueError as exc:
            errors.append(f"{where}.{key}: {exc}")
    return quota


def _unique(tenants: Sequence[Tenant], errors: list[str]) -> None:
    seen: dict[str, str] = {}
    for t in tenants:
        if t.name in seen:
            errors.append(f"tenant name {t.name!r} appears twice")
        seen[t.name] = t.name
    for kind in ("tokens_sha256", "identities"):
        owner: dict[str, str] = {}
        for t in tenants:
            for v in t.tokens_sha256 if kind == "tokens_sha256" else t.identities:
                if v in owner and owner[v] != t.name:
                    errors.append(f"tenants {owner[v]!r} and {t.name!r} share one of their "
                                  f"{kind}: a credential must name one tenant")
                owner[v] = t.name
    _disjoint(tenants, errors)


#: The way out of an overlap, said in its error: the rule lived only in this module, and the
#: guide's own example (an admin owning "") was refused with no hint of it.
_DISJOINT_FIX = ("give each tenant prefixes of its own that end in a separator ('team-a/'); "
                 "an admin that acts across every namespace (Evict, Stats, Hot, Prewarm, "
                 "Drain) lists no namespaces: leave out its `namespaces`")


def _disjoint(tenants: Sequence[Tenant], errors: list[str]) -> None:
    """Prefixes of two tenants must not nest: "a/" and "a/b/" would let the owner of "a/" name
    the other's namespaces as its own. One line per tenant whose prefix covers others' (an
    admin owning "" overlaps every tenant: one line naming them all, not one per prefix)."""
    owned = [(p, t.name) for t in tenants for p in t.namespaces]
    covered: dict[tuple[str, str], list[str]] = {}  # (prefix, its tenant) -> others inside
    for i, (p, a) in enumerate(owned):
        for q, b in owned[i + 1:]:
            if a == b or not (p.startswith(q) or q.startswith(p)):
                continue
            # The shorter prefix is the one that covers (equal ones: the first tenant's).
            wide, narrow = ((q, b), (p, a)) if len(q) < len(p) else ((p, a), (q, b))
            inside = covered.setdefault(wide, [])
            other = f"{narrow[0]!r} of tenant {narrow[1]!r}"
            if other not in inside:
                inside.append(other)
    for (prefix, name), inside in covered.items():
        whole = " (a prefix of every namespace)" if prefix == "" else ""
        errors.append(f"tenant {name!r} owns the namespace prefix {prefix!r}{whole}, "
                      f"overlapping namespace prefixes {', '.join(inside)}: no namespace may "
                      f"belong to two tenants; {_DISJOINT_FIX}")


# --- arenas ---------------------------------------------------------------------------------

def split_tier(tier: str, num_pages: int, page_size: int,
               tenants: Sequence[Tenant]) -> list[Arena]:
    """One arena per tenant owning namespaces: its quota for the tier (rounded down to
    pages) or, without one, an equal share of what the quotas leave. TenantsError naming the
    tenant and tier when the quotas do not fit, or the rest leaves a tenant no page."""
    if not tenants:
        return []
    key = next(k for k, v in QUOTA_TIERS.items() if v == tier)
    fixed = {t.name: t.quota[key] // page_size for t in tenants if key in t.quota}
    total = sum(fixed.values())
    if total > num_pages:
        biggest = max(fixed, key=lambda n: fixed[n])
        raise TenantsError(
            f"quotas for {tier} add up to {format_size(total * page_size)}, over the tier's "
            f"{format_size(num_pages * page_size)} (tenant {biggest!r} asks "
            f"{format_size(fixed[biggest] * page_size)}); lower quota.{key} or grow the tier")
    for name, pages in fixed.items():
        if pages == 0:
            raise TenantsError(f"tenant {name!r}: quota.{key} is under one {tier} page "
                               f"({format_size(page_size)})")
    rest = [t.name for t in tenants if key not in t.quota]
    share = (num_pages - total) // len(rest) if rest else 0
    if rest and share == 0:
        raise TenantsError(
            f"tenant {rest[0]!r} has no quota.{key} and the quotas leave "
            f"{format_size((num_pages - total) * page_size)} of {tier} to share among "
            f"{len(rest)} tenants: under a page each; give it a quota.{key}")
    arenas: list[Arena] = []
    first = 0
    for t in tenants:
        pages = fixed.get(t.name, share)
        arenas.append(Arena(t.name, first, pages))
        first += pages
    return arenas
