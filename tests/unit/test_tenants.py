"""The tenants file's rules (kvstore.core.tenants): parsing with errors that name the field,
credentials to tenants, namespace ownership, and the split of a tier into arenas."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from kvstore.core.errors import PermissionDenied
from kvstore.core.tenants import OPEN, TenantsError, parse_tenants, split_tier
from kvstore.extents import Arena

H = {name: hashlib.sha256(name.encode()).hexdigest() for name in ("ta", "tb", "root")}


def doc(*tenants: dict[str, Any]) -> dict[str, Any]:
    return {"tenants": list(tenants)}


A = {"name": "team-a", "tokens_sha256": [H["ta"]], "namespaces": ["team-a/"],
     "quota": {"dram": "4MiB", "nvme": 1 << 30, "pinned": "1MiB"}}
B = {"name": "team-b", "tokens_sha256": [H["tb"]], "identities": ["spiffe://x/b"],
     "namespaces": ["team-b/", "shared-b/"]}
ROOT = {"name": "root", "tokens_sha256": [H["root"]], "role": "admin"}


def test_credentials_name_their_tenant() -> None:
    tenants = parse_tenants(doc(A, B, ROOT))
    assert tenants.by_token("ta").name == "team-a"  # type: ignore[union-attr]
    assert tenants.by_token("tb").name == "team-b"  # type: ignore[union-attr]
    assert tenants.by_token("nope") is None and tenants.by_token("") is None
    assert tenants.by_identity(["CN-other", "spiffe://x/b"]).name == "team-b"  # type: ignore[union-attr]
    assert tenants.by_identity(["spiffe://x/a"]) is None
    assert tenants.owner_of("team-b/llama") is tenants.by_token("tb")
    assert tenants.owner_of("team-c/llama") is None
    assert [t.name for t in tenants.holders()] == ["team-a", "team-b"]  # root owns nothing
    assert tenants.by_token("ta").quota == {"dram": 4 << 20, "nvme": 1 << 30,  # type: ignore[union-attr]
                                            "pinned": 1 << 20}


def test_namespace_checks_name_only_the_callers_prefixes() -> None:
    a = parse_tenants(doc(A, B)).by_token("ta")
    assert a is not None
    a.check_namespace("team-a/x")
    with pytest.raises(PermissionDenied) as info:
        a.check_namespace("team-b/x")
    assert "'team-a/'" in str(info.value) and "shared-b" not in str(info.value)
    with pytest.raises(PermissionDenied, match="role admin"):
        a.check_admin("Drain")
    OPEN.check_namespace("anything")
    OPEN.check_admin("Drain")


@pytest.mark.parametrize(("tenants", "words"), [
    ([{**A, "name": "bad name"}], "tenants[0].name"),
    ([{**A, "tokens_sha256": ["abc"]}], "tokens_sha256"),
    ([{**A, "role": "root"}], "role"),
    ([{**A, "quota": {"dram": "lots"}}], "quota.dram"),
    ([{**A, "quota": {"gpu": "1GiB"}}], "quota.gpu"),
    ([{**A, "colour": "red"}], "colour"),
    ([{**A, "tokens_sha256": [], "identities": []}], "nobody could be it"),
    ([{**A, "namespaces": []}], "namespaces"),
    ([A, {**B, "name": "team-a"}], "appears twice"),
    ([A, {**B, "tokens_sha256": [H["ta"]]}], "share one of their tokens_sha256"),
    ([A, {**B, "namespaces": ["team-a/sub/"]}], "overlapping namespace prefixes"),
    ([A, {**B, "namespaces": ["team"]}], "overlapping namespace prefixes"),
    ([], "empty"),
])
def test_bad_files_name_the_field(tenants: list[dict[str, Any]], words: str) -> None:
    with pytest.raises(TenantsError, match=words.replace("[", r"\[").replace("]", r"\]")):
        parse_tenants(doc(*tenants))


def test_not_a_tenants_document() -> None:
    for bad in (None, [], {"tenant": []}, {"tenants": "x"}):
        with pytest.raises(TenantsError, match="list `tenants`"):
            parse_tenants(bad)


def test_split_gives_quotas_then_equal_shares() -> None:
    tenants = parse_tenants(doc(A, B, {**B, "name": "team-c", "tokens_sha256": [],
                                       "identities": ["c"], "namespaces": ["team-c/"]}))
    arenas = split_tier("dram", 100, 1 << 20, tenants.holders())
    assert arenas == [Arena("team-a", 0, 4), Arena("team-b", 4, 48), Arena("team-c", 52, 48)]
    assert split_tier("nvme", 2048, 1 << 20, tenants.holders())[0] == Arena("team-a", 0, 1024)


def test_split_refuses_what_does_not_fit() -> None:
    tenants = parse_tenants(doc(A, {**B, "quota": {"dram": "8MiB"}}))
    with pytest.raises(TenantsError, match="quotas for dram add up to 12.0 MiB.*team-b"):
        split_tier("dram", 10, 1 << 20, tenants.holders())
    crowded = parse_tenants(doc(A, B))
    with pytest.raises(TenantsError, match="team-b.*no quota.dram"):
        split_tier("dram", 4, 1 << 20, crowded.holders())
    with pytest.raises(TenantsError, match="under one dram page"):
        split_tier("dram", 100, 8 << 20, crowded.holders())


def test_an_admin_owning_every_namespace_is_refused_once_with_the_way_out() -> None:
    """docs/security.md once gave its admin `namespaces: [""]` beside client tenants: refused,
    with one line per overlapping prefix and no word of the fix. Now one line names every
    tenant it overlaps and says what to write instead."""
    ops = {**ROOT, "namespaces": [""]}
    wide_a = {**A, "namespaces": ["team-a/", "team-a-eval/"]}
    with pytest.raises(TenantsError) as info:
        parse_tenants(doc(wide_a, B, ops))
    lines = str(info.value).splitlines()
    assert len(lines) == 1, lines
    assert "tenant 'root' owns the namespace prefix '' (a prefix of every namespace)" in lines[0]
    for inside in ("'team-a/' of tenant 'team-a'", "'team-a-eval/' of tenant 'team-a'",
                   "'team-b/' of tenant 'team-b'", "'shared-b/' of tenant 'team-b'"):
        assert inside in lines[0]
    assert "an admin that acts across every namespace" in lines[0]
    assert "lists no namespaces" in lines[0]
    # The way out works: the same admin without namespaces loads, owns nothing, is an admin.
    root = parse_tenants(doc(wide_a, B, ROOT)).named("root")
    assert root is not None and root.admin and root.namespaces == ()
    # Alone, an admin may still own "" (nobody to overlap): the chart's default tenant does.
    assert parse_tenants(doc(ops)).owner_of("any/thing") is not None


def test_one_mistake_is_one_line() -> None:
    """Two tenants sharing two token hashes are one mistake: said once, not once a hash."""
    shared = [H["ta"], H["tb"]]
    with pytest.raises(TenantsError) as info:
        parse_tenants(doc({**A, "tokens_sha256": shared}, {**B, "tokens_sha256": shared}))
    lines = str(info.value).splitlines()
    assert lines == ["tenants file: tenants 'team-a' and 'team-b' share one of their "
                     "tokens_sha256: a credential must name one tenant"]
