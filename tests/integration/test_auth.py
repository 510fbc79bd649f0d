"""Tenants over real gRPC (a real daemon subprocess, raw stubs): who may call, which
namespaces each tenant may touch, what its role may do, what Stats shows it, SIGHUP
re-reading the tenants file, and TLS (a server certificate, then client certificates) made
in the fixture with `cryptography`.

Tenant A (team-a/) and tenant B (team-b/) are clients; `root` is an admin owning nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from kvstore.client import TLS, AsyncKVStoreClient, KVStoreClient, PermissionDenied, Unauthenticated
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.tools.testing import Daemon, free_port, start_daemon
from tests import helpers
from tests.helpers import open_stub, status_of
from tests.integration.pki import Pki, make_pki

TOKENS = {"team-a": "token-of-a-0123456789", "team-b": "token-of-b-0123456789",
          "root": "token-of-root-0123456789"}
A_NS, B_NS = "team-a/llama", "team-b/llama"
KEY = bytes(range(32))
ABSENT = bytes(range(1, 33))
BLOCK = b"secret of b " * 100
DENIED = grpc.StatusCode.PERMISSION_DENIED
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def tenants_doc(tokens: dict[str, str] = TOKENS, a_identities: tuple[str, ...] = (),
                b_identities: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"tenants": [
        {"name": "team-a", "tokens_sha256": [sha(tokens["team-a"])],
         "identities": list(a_identities), "namespaces": ["team-a/"],
         "quota": {"dram": "8MiB", "pinned": "1MiB"}},
        {"name": "team-b", "tokens_sha256": [sha(tokens["team-b"])],
         "identities": list(b_identities), "namespaces": ["team-b/"]},
        {"name": "root", "tokens_sha256": [sha(tokens["root"])], "role": "admin",
         "identities": ["kvstore-admin"]},
    ]}


def write_tenants(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path


def md(tenant: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),) if tenant else ()


#: The token daemon's settings, less its tenants file.
AUTH = ("auth.mode=token", "dram.capacity_bytes=32MiB", "nvme.enabled=false")


def auth_settings(tenants: Path) -> tuple[str, ...]:
    return (AUTH[0], f"auth.tenants_file={tenants}", *AUTH[1:])


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    """A tenants file of the test's own, which it may rewrite."""
    return write_tenants(tmp_path / "tenants.yaml", tenants_doc())


@pytest.fixture(scope="module")
def shared_tenants(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tenants file of the module's shared daemon, never rewritten."""
    return write_tenants(tmp_path_factory.mktemp("tenants") / "tenants.yaml", tenants_doc())


@pytest.fixture
def daemon(shared_daemon: Callable[..., Daemon], shared_tenants: Path) -> Iterator[Daemon]:
    """The module's token daemon, shared by its tests: each leaves it empty (the admin
    evicts every namespace), so the next one starts from an empty store. Tests that read
    a tenant's counters or rewrite the tenants file start their own (`own_daemon`)."""
    d = shared_daemon(*auth_settings(shared_tenants))
    yield d
    with grpc.insecure_channel(d.target) as channel:
        rpc.KVStoreStub(channel).Evict(pb.EvictRequest(all=True), metadata=md("root"),
                                       timeout=10)


@pytest.fixture
def own_daemon(daemon_factory: Callable[..., Daemon], tenants_file: Path) -> Daemon:
    """A token daemon of the test's own, on the test's own tenants file."""
    return daemon_factory(*auth_settings(tenants_file))


@pytest.fixture
def stub(daemon: Daemon) -> Iterator[rpc.KVStoreStub]:
    with open_stub(daemon.target) as s:
        yield s


@pytest.fixture
def own_stub(own_daemon: Daemon) -> Iterator[rpc.KVStoreStub]:
    with open_stub(own_daemon.target) as s:
        yield s


def put(stub: rpc.KVStoreStub, tenant: str, namespace: str, key: bytes = KEY,
        data: bytes = BLOCK) -> pb.PutResponse:
    return helpers.put(stub, namespace, [key], [data], metadata=md(tenant))


def data_calls(stub: rpc.KVStoreStub, tenant: str | None, namespace: str,
               key: bytes) -> dict[str, Callable[[], Any]]:
    """Every data verb on (namespace, key), as tenant."""
    m = md(tenant)
    return {
        "Lookup": lambda: stub.Lookup(pb.LookupRequest(namespace=namespace, keys=[key]),
                                      metadata=m, timeout=5),
        "Get": lambda: stub.Get(pb.GetRequest(namespace=namespace, keys=[key]), metadata=m,
                                timeout=5),
        "Get shared": lambda: stub.Get(pb.GetRequest(
            namespace=namespace, keys=[key], mode=pb.GET_MODE_SHARED_MEMORY), metadata=m,
            timeout=5),
        "Prefetch": lambda: stub.Prefetch(pb.PrefetchRequest(namespace=namespace, keys=[key]),
                                          metadata=m, timeout=5),
        "Pin": lambda: stub.Pin(pb.PinRequest(namespace=namespace, keys=[key]), metadata=m,
                                timeout=5),
        "Unpin": lambda: stub.Unpin(pb.PinRequest(namespace=namespace, keys=[key]),
                                    metadata=m, timeout=5),
        "Reserve": lambda: stub.Reserve(pb.ReserveRequest(namespace=namespace, keys=[key],
                                                          sizes=[64]), metadata=m, timeout=5),
        "Put": lambda: stub.Put(iter([pb.PutRequest(namespace=namespace, keys=[key], sizes=[4],
                                                    data=b"evil")]), metadata=m, timeout=5),
        "Evict keys": lambda: stub.Evict(pb.EvictRequest(namespace=namespace, keys=[key]),
                                         metadata=m, timeout=5),
        "Evict all": lambda: stub.Evict(pb.EvictRequest(namespace=namespace, all=True),
                                        metadata=m, timeout=5),
        "Stats": lambda: stub.Stats(pb.StatsRequest(namespace=namespace), metadata=m,
                                    timeout=5),
        "Hot": lambda: stub.Hot(pb.HotRequest(namespace=namespace), metadata=m, timeout=5),
        "Prewarm": lambda: stub.Prewarm(pb.PrewarmRequest(namespaces=[namespace]),
                                        metadata=m, timeout=5),
    }


def test_no_or_unknown_credentials_are_unauthenticated(stub: rpc.KVStoreStub) -> None:
    put(stub, "team-a", A_NS)
    for name, call in data_calls(stub, None, A_NS, KEY).items():
        assert status_of(call)[0] == UNAUTHENTICATED, name
    for metadata in ((("authorization", "Bearer not-a-token"),),
                     (("authorization", TOKENS["team-a"]),),  # no "Bearer"
                     (("authorization", f"Basic {TOKENS['team-a']}"),)):
        code, details = status_of(lambda m=metadata: stub.Lookup(
            pb.LookupRequest(namespace=A_NS, keys=[KEY]), metadata=m, timeout=5))
        assert code == UNAUTHENTICATED, metadata
        assert TOKENS["team-a"] not in details
    for name, call in {"Drain": lambda: stub.Drain(pb.DrainRequest(), timeout=5),
                       "Attach": lambda: stub.Attach(pb.AttachRequest(), timeout=5),
                       "Release": lambda: stub.Release(pb.ReleaseRequest(ids=["x"]),
                                                       timeout=5)}.items():
        assert status_of(call)[0] == UNAUTHENTICATED, name


def test_a_cannot_touch_b_and_the_answer_never_depends_on_the_key(
        stub: rpc.KVStoreStub) -> None:
    assert put(stub, "team-b", B_NS).stored == 1
    present = data_calls(stub, "team-a", B_NS, KEY)
    absent = data_calls(stub, "team-a", B_NS, ABSENT)
    for name in present:
        got, other = status_of(present[name]), status_of(absent[name])
        assert got[0] == DENIED, (name, got)
        assert got == other, name  # same code, same words, key or no key
        assert "team-a/" in got[1] and "team-b/" not in got[1].replace(B_NS, ""), got[1]
    # Timing: interleaved medians of a Lookup for the stored and for an absent key.
    times: dict[bytes, list[float]] = {KEY: [], ABSENT: []}
    for _ in range(40):
        for key in (KEY, ABSENT):
            started = time.perf_counter()
            status_of(lambda k=key: stub.Lookup(pb.LookupRequest(namespace=B_NS, keys=[k]),
                                              metadata=md("team-a"), timeout=5))
            times[key].append(time.perf_counter() - started)
    gap = abs(statistics.median(times[KEY]) - statistics.median(times[ABSENT]))
    assert gap < 0.5e-3, times
    # B's block is untouched, bit-exact, and was never pinned or evicted by A.
    replies = list(stub.Get(pb.GetRequest(namespace=B_NS, keys=[KEY]), metadata=md("team-b")))
    assert b"".join(r.data for r in replies[1:]) == BLOCK
    stats = stub.Stats(pb.StatsRequest(), metadata=md("team-b"))
    assert stats.pinned == 0 and stats.tenant == "team-b"


def test_roles_client_may_not_destroy_admin_may(stub: rpc.KVStoreStub) -> None:
    put(stub, "team-a", A_NS)
    put(stub, "team-b", B_NS)
    client_refused = {
        "Evict every namespace": lambda: stub.Evict(pb.EvictRequest(all=True),
                                                    metadata=md("team-a"), timeout=5),
        "Evict bytes everywhere": lambda: stub.Evict(pb.EvictRequest(bytes=1 << 30),
                                                     metadata=md("team-a"), timeout=5),
        "Drain": lambda: stub.Drain(pb.DrainRequest(), metadata=md("team-a"), timeout=5),
        "Stats config": lambda: stub.Stats(pb.StatsRequest(include_config=True),
                                           metadata=md("team-a"), timeout=5),
    }
    for name, call in client_refused.items():
        code, details = status_of(call)
        assert code == DENIED, name
        assert "admin" in details, details
    # A client may evict within what it owns.
    own = stub.Evict(pb.EvictRequest(namespace=A_NS, keys=[KEY]), metadata=md("team-a"))
    assert own.evicted == 1
    # The admin reads nobody's blocks ...
    assert status_of(data_calls(stub, "root", B_NS, KEY)["Get"])[0] == DENIED
    # ... but sees every tenant and may evict across namespaces.
    stats = stub.Stats(pb.StatsRequest(), metadata=md("root"))
    assert stats.tenant == "root" and stats.auth_mode == "token"
    assert {c.client for c in stats.clients} <= {"team-a", "team-b", "root", ""}
    gone = stub.Evict(pb.EvictRequest(all=True), metadata=md("root"))
    assert gone.evicted == 1  # B's block (A's was gone already)
    assert stub.Lookup(pb.LookupRequest(namespace=B_NS, keys=[KEY]),
                       metadata=md("team-b")).prefix_length == 0


def test_stats_show_a_client_only_its_own_tenant(own_stub: rpc.KVStoreStub) -> None:
    """On a daemon of its own: a tenant's hits, misses and pins count from the start."""
    stub = own_stub
    for i in range(3):
        put(stub, "team-b", B_NS, bytes([i]) * 32)
    put(stub, "team-a", A_NS)
    stub.Lookup(pb.LookupRequest(namespace=B_NS, keys=[bytes([i]) * 32 for i in range(5)]),
                metadata=md("team-b"))
    stub.Pin(pb.PinRequest(namespace=B_NS, keys=[bytes([0]) * 32]), metadata=md("team-b"))
    mine = stub.Stats(pb.StatsRequest(), metadata=md("team-a"))
    dram = next(t for t in mine.tiers if t.tier == pb.TIER_DRAM)
    assert mine.tenant == "team-a"
    assert dram.objects == 1 and dram.used_bytes == len(BLOCK)
    assert dram.capacity_bytes == 8 << 20  # its quota: its arena
    assert (mine.hits, mine.misses, mine.pinned) == (0, 0, 0)  # B's Lookup and pin are B's
    assert dram.hits == dram.bytes_in == 0  # daemon-wide activity stays hidden
    assert {c.client for c in mine.clients} <= {"team-a"}
    theirs = stub.Stats(pb.StatsRequest(), metadata=md("team-b"))
    assert (theirs.hits, theirs.misses, theirs.pinned) == (3, 2, 1)
    assert next(t for t in theirs.tiers if t.tier == pb.TIER_DRAM).objects == 3
    assert mine.shm_name == "" and theirs.shm_name == ""  # no segment opens by name


def test_sighup_revokes_and_adds_tokens(own_daemon: Daemon, own_stub: rpc.KVStoreStub,
                                        tenants_file: Path) -> None:
    daemon, stub = own_daemon, own_stub
    put(stub, "team-a", A_NS)
    fresh = {**TOKENS, "team-a": "rotated-token-of-a-987654321"}
    write_tenants(tenants_file, tenants_doc(fresh))
    os.kill(daemon.proc.pid, signal.SIGHUP)
    lookup = pb.LookupRequest(namespace=A_NS, keys=[KEY])
    deadline = time.monotonic() + 10
    while status_of(lambda: stub.Lookup(lookup, metadata=md("team-a"), timeout=5))[0] \
            != UNAUTHENTICATED:
        assert time.monotonic() < deadline, "the old token still works after SIGHUP"
        time.sleep(0.05)
    rotated = (("authorization", f"Bearer {fresh['team-a']}"),)
    assert stub.Lookup(lookup, metadata=rotated).prefix_length == 1  # its blocks stay
    # A tenant added by SIGHUP may call at once, but gets its arena only at the next start.
    doc = tenants_doc(fresh)
    doc["tenants"].append({"name": "team-c", "tokens_sha256": [sha("token-of-c")],
                           "namespaces": ["team-c/"]})
    write_tenants(tenants_file, doc)
    os.kill(daemon.proc.pid, signal.SIGHUP)
    c = (("authorization", "Bearer token-of-c"),)
    while status_of(lambda: stub.Stats(pb.StatsRequest(), metadata=c, timeout=5))[0] \
            == UNAUTHENTICATED:
        assert time.monotonic() < deadline, "the added tenant is still unknown after SIGHUP"
        time.sleep(0.05)
    code, details = status_of(lambda: stub.Put(iter([pb.PutRequest(
        namespace="team-c/x", keys=[KEY], sizes=[3], data=b"abc")]), metadata=c, timeout=5))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "next restart" in details
    # A bad file keeps the tenants loaded before.
    tenants_file.write_text("tenants: [{name: broken")
    os.kill(daemon.proc.pid, signal.SIGHUP)
    time.sleep(0.5)
    assert stub.Lookup(lookup, metadata=rotated).prefix_length == 1
    assert daemon.proc.poll() is None
    assert "kept the tenants loaded before" in daemon.log()


def test_quota_full_evicts_only_its_own_blocks(stub: rpc.KVStoreStub) -> None:
    b_keys = [bytes([200 + i]) * 32 for i in range(8)]
    block = os.urandom(1 << 20)
    for k in b_keys:
        put(stub, "team-b", B_NS, k, block)
    for i in range(40):  # 40 MiB through A's 8 MiB arena
        put(stub, "team-a", A_NS, bytes([i]) * 32, os.urandom(1 << 20))
    seen = stub.Lookup(pb.LookupRequest(namespace=B_NS, keys=b_keys), metadata=md("team-b"))
    assert list(seen.tiers) == [pb.TIER_DRAM] * 8
    replies = list(stub.Get(pb.GetRequest(namespace=B_NS, keys=b_keys[:1]),
                            metadata=md("team-b")))
    assert b"".join(r.data for r in replies[1:]) == block
    a = stub.Stats(pb.StatsRequest(), metadata=md("team-a"))
    dram = next(t for t in a.tiers if t.tier == pb.TIER_DRAM)
    assert dram.used_bytes <= 8 << 20 and dram.objects >= 1


def test_quotas_that_do_not_fit_stop_the_start(tmp_path: Path) -> None:
    doc = tenants_doc()
    doc["tenants"][1]["quota"] = {"dram": "30MiB"}
    path = write_tenants(tmp_path / "big.yaml", doc)
    # Run to its end: the exit status, not a health check that a port race could answer.
    args = [sys.executable, "-m", "kvstore.daemon.server", "--port", str(free_port()),
            "--metrics-port", str(free_port())]
    for setting in ("auth.mode=token", f"auth.tenants_file={path}", "dram.capacity_bytes=32MiB",
                    "nvme.enabled=false", "hbm.mode=off"):
        args += ["--set", setting]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "quotas for dram" in done.stderr and "team-b" in done.stderr


# --- TLS --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"),
                    {"a": ("engine-a", "spiffe://cluster/ns/a/sa/engine"),
                     "b": ("team-b-engine", None),
                     "stranger": ("nobody", "spiffe://cluster/ns/x/sa/x")})


@pytest.fixture(scope="module")
def tls_daemon(tmp_path_factory: pytest.TempPathFactory, shared_tenants: Path,
               pki: Pki) -> Iterator[Daemon]:
    """A token daemon that speaks only TLS, shared by the module's TLS tests (a shared
    daemon is waited for without TLS, so this one is the module's own)."""
    d = start_daemon(tmp_path_factory.mktemp("tls"), *auth_settings(shared_tenants),
                     f"server.tls_cert_file={pki.server_cert}",
                     f"server.tls_key_file={pki.server_key}", credentials=pki.credentials())
    yield d
    d.stop()


@pytest.fixture
def tls(tls_daemon: Daemon, pki: Pki) -> Iterator[Daemon]:
    """The TLS daemon, emptied by the admin after the test."""
    yield tls_daemon
    with grpc.secure_channel(tls_daemon.target, pki.credentials()) as channel:
        rpc.KVStoreStub(channel).Evict(pb.EvictRequest(all=True), metadata=md("root"),
                                       timeout=10)


def test_token_over_tls(tls: Daemon, pki: Pki) -> None:
    with grpc.secure_channel(tls.target, pki.credentials()) as channel:
        s = rpc.KVStoreStub(channel)
        assert put(s, "team-a", A_NS).stored == 1
        assert status_of(lambda: s.Lookup(pb.LookupRequest(namespace=A_NS, keys=[KEY]),
                                          timeout=5))[0] == UNAUTHENTICATED
    with grpc.insecure_channel(tls.target) as plain:  # no TLS: no answer at all
        code, _ = status_of(lambda: rpc.KVStoreStub(plain).Lookup(
            pb.LookupRequest(namespace=A_NS, keys=[KEY]), metadata=md("team-a"),
            timeout=3))
        assert code == grpc.StatusCode.UNAVAILABLE


def test_mtls_the_certificate_names_the_tenant(tmp_path: Path, pki: Pki) -> None:
    path = write_tenants(tmp_path / "mtls.yaml", tenants_doc(
        a_identities=("spiffe://cluster/ns/a/sa/engine",), b_identities=("team-b-engine",)))
    d = start_daemon(tmp_path, "auth.mode=mtls", f"auth.tenants_file={path}",
                     f"server.tls_cert_file={pki.server_cert}",
                     f"server.tls_key_file={pki.server_key}",
                     f"server.tls_client_ca_file={pki.ca}", "nvme.enabled=false",
                     credentials=pki.credentials("a"))
    other = make_pki(tmp_path, {"a": ("engine-a", "spiffe://cluster/ns/a/sa/engine")})
    try:
        with grpc.secure_channel(d.target, pki.credentials("a")) as ca, \
                grpc.secure_channel(d.target, pki.credentials("b")) as cb:
            a, b = rpc.KVStoreStub(ca), rpc.KVStoreStub(cb)
            assert put(b, "", B_NS).stored == 1  # no token: the certificate is the tenant
            assert a.Stats(pb.StatsRequest()).tenant == "team-a"  # by its SAN URI
            assert b.Stats(pb.StatsRequest()).tenant == "team-b"  # by its CN
            assert status_of(data_calls(a, None, B_NS, KEY)["Get"])[0] == DENIED
        with grpc.secure_channel(d.target, pki.credentials("stranger")) as cs:
            code, _ = status_of(lambda: rpc.KVStoreStub(cs).Stats(pb.StatsRequest(), timeout=5))
            assert code == UNAUTHENTICATED  # a good certificate naming no tenant
        for creds in (pki.credentials(), other.credentials("a")):  # none; another CA's
            # (the second trusts the other CA for the server too, so it fails either way)
            with grpc.secure_channel(d.target, creds) as cx:
                code, _ = status_of(lambda c=cx: rpc.KVStoreStub(c).Stats(pb.StatsRequest(),
                                                                         timeout=3))
                assert code == grpc.StatusCode.UNAVAILABLE
        foreign = grpc.ssl_channel_credentials(
            pki.ca.read_bytes(), other.clients["a"][1].read_bytes(),
            other.clients["a"][0].read_bytes())  # trusts the server, its own cert from elsewhere
        with grpc.secure_channel(d.target, foreign) as cf:
            code, _ = status_of(lambda: rpc.KVStoreStub(cf).Stats(pb.StatsRequest(), timeout=3))
            assert code == grpc.StatusCode.UNAVAILABLE
    finally:
        d.stop()


def test_a_full_quota_demotes_into_its_own_l3_arena(tmp_path: Path) -> None:
    doc = tenants_doc()
    doc["tenants"][0]["quota"] = {"dram": "8MiB", "nvme": "16MiB"}
    path = write_tenants(tmp_path / "l3.yaml", doc)
    d = start_daemon(tmp_path, "auth.mode=token", f"auth.tenants_file={path}",
                     "dram.capacity_bytes=32MiB", "nvme.capacity_bytes=64MiB")
    try:
        with grpc.insecure_channel(d.target) as channel:
            s = rpc.KVStoreStub(channel)
            b_keys = [bytes([200 + i]) * 32 for i in range(8)]
            for k in b_keys:
                put(s, "team-b", B_NS, k, os.urandom(1 << 20))
            a_keys = [bytes([i]) * 32 for i in range(40)]
            for k in a_keys:  # 40 MiB: 8 fit A's L2 arena, 16 its L3 arena
                put(s, "team-a", A_NS, k, os.urandom(1 << 20))
            seen = s.Lookup(pb.LookupRequest(namespace=B_NS, keys=b_keys),
                            metadata=md("team-b"))
            assert list(seen.tiers) == [pb.TIER_DRAM] * 8  # B never moved
            a = s.Stats(pb.StatsRequest(), metadata=md("team-a"))
            by_tier = {t.tier: t for t in a.tiers}
            assert by_tier[pb.TIER_NVME].capacity_bytes == 16 << 20
            assert 0 < by_tier[pb.TIER_NVME].used_bytes <= 16 << 20  # demoted, in its arena
            assert by_tier[pb.TIER_DRAM].used_bytes <= 8 << 20
            b = s.Stats(pb.StatsRequest(), metadata=md("team-b"))
            assert {t.tier: t.objects for t in b.tiers}[pb.TIER_NVME] == 0
    finally:
        d.stop()


def test_a_reservation_is_committed_only_by_its_tenant(stub: rpc.KVStoreStub) -> None:
    reserved = stub.Reserve(pb.ReserveRequest(namespace=B_NS, keys=[KEY], sizes=[64]),
                            metadata=md("team-b"))
    for namespace, code in ((B_NS, DENIED), (A_NS, grpc.StatusCode.INVALID_ARGUMENT)):
        commit = pb.PutRequest(namespace=namespace, reservation_id=reserved.reservation_id)
        assert status_of(lambda c=commit: stub.Put(iter([c]), metadata=md("team-a"),
                                                 timeout=5))[0] == code
        assert status_of(lambda: stub.Release(pb.ReleaseRequest(
            ids=[reserved.reservation_id]), metadata=md("team-a"), timeout=5))[0] == \
            grpc.StatusCode.INVALID_ARGUMENT
    assert stub.Put(iter([pb.PutRequest(namespace=B_NS,
                                        reservation_id=reserved.reservation_id)]),
                    metadata=md("team-b")).stored == 1


def test_the_client_raises_the_errors_of_its_tree(daemon: Daemon, tls: Daemon,
                                                  pki: Pki) -> None:
    with KVStoreClient(daemon.target, B_NS, token=TOKENS["team-a"]) as kv:
        with pytest.raises(PermissionDenied) as denied:
            kv.lookup([KEY])
        assert "team-a/" in str(denied.value)
    with KVStoreClient(daemon.target, A_NS, token="wrong-token") as kv:
        with pytest.raises(Unauthenticated):
            kv.put([KEY], [BLOCK])

    async def async_round_trip() -> bytes | None:
        async with AsyncKVStoreClient(daemon.target, A_NS, token=TOKENS["team-a"]) as akv:
            await akv.put([KEY], [BLOCK])
            return (await akv.get([KEY]))[0]

    assert asyncio.run(async_round_trip()) == BLOCK
    with KVStoreClient(tls.target, A_NS, token=TOKENS["team-a"],
                       tls=TLS(ca_file=str(pki.ca))) as kv:
        kv.put([KEY], [BLOCK])
        assert kv.get([KEY]) == [BLOCK]
        assert kv.stats().tenant == "team-a"
