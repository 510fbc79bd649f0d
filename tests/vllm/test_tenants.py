"""The connector on a shared daemon with auth on: it passes its tenant's token, its namespace
lies under the tenant's prefix, and credentials the daemon refuses cost one warning and no
hit, without flapping back on."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

from kvstore.client import KVStoreClient
from kvstore.tools.testing import Daemon
from tests.vllm.harness import (
    BLOCK,
    matched,
    request,
    runner_output,
    scheduler,
    vllm_config,
    wait_lookups,
    worker,
)

if TYPE_CHECKING:
    from tests.conftest import SharedDaemons

TOKENS = {"team-a": "vllm-token-of-a-0123456789", "team-b": "vllm-token-of-b-0123456789"}


@pytest.fixture(scope="session")
def tenants_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    doc = {"tenants": [{"name": name, "namespaces": [f"{name}/"],
                        "tokens_sha256": [hashlib.sha256(token.encode()).hexdigest()]}
                       for name, token in TOKENS.items()]}
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def shared(shared_daemon: SharedDaemons, tenants_file: Path) -> Daemon:
    """A daemon with auth on, the tenants team-a and team-b, and a Unix socket for the shared
    memory attach; the tests of this module share it, each in namespaces of its own (its
    `ns` as the namespace salt)."""
    return shared_daemon("auth.mode=token", f"auth.tenants_file={tenants_file}",
                         "dram.capacity_bytes=64MiB", "nvme.enabled=false", unix_socket=True)


@pytest.fixture
def evicted_as_a(shared: Daemon) -> Iterator[set[str]]:
    """Namespaces to evict, with team-a's token, when the test ends."""
    namespaces: set[str] = set()
    yield namespaces
    for namespace in namespaces:
        with KVStoreClient(shared.target, namespace, token=TOKENS["team-a"]) as client:
            client.evict(all=True)


def test_a_tenant_saves_and_hits_under_its_prefix_and_another_sees_nothing(
        shared: Daemon, ns: str, evicted_as_a: set[str], model_dir: Path,
        tmp_path: Path) -> None:
    token_file = tmp_path / "a.token"
    token_file.write_text(TOKENS["team-a"])
    a = {"target": shared.target, "token_file": str(token_file), "namespace_prefix": "team-a/",
         "namespace_salt": ns}
    sched_a = scheduler(vllm_config(model_dir, a))
    evicted_as_a.add(sched_a.connector.namespace)
    assert sched_a.connector.namespace.startswith("team-a/vllm/")
    work, _ = worker(vllm_config(model_dir, a), seed=4)
    tokens = [5 + i % 300 for i in range(3 * BLOCK + 2)]
    req = request(tokens)
    sched_a.add_request(req)
    out = sched_a.schedule()  # the Lookup (a miss) goes out
    wait_lookups(sched_a.connector)
    sched_a.update_from_output(out, runner_output([]))
    out = sched_a.schedule()
    work.bind_connector_metadata(out.kv_connector_metadata)
    work.wait_for_save()
    assert work.link.flush(10.0) and work.link.stats.offloaded_blocks == 3
    assert work.link.client.uses_shared_memory  # the tenant's own arena, by Attach

    fresh = scheduler(vllm_config(model_dir, a))
    assert matched(fresh.connector, request(tokens)) == (3 * BLOCK, True)
    b = {"target": shared.target, "token": TOKENS["team-b"], "namespace_prefix": "team-b/",
         "namespace_salt": ns}
    other = scheduler(vllm_config(model_dir, b))
    assert matched(other.connector, request(tokens)) == (0, False)


def test_refused_credentials_cost_one_warning_and_stay_off(
        shared: Daemon, ns: str, model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvstore")
    squatter = {"target": shared.target, "token": TOKENS["team-b"],
                "namespace_prefix": "team-a/", "namespace_salt": ns, "reconnect_s": 0.05}
    sched = scheduler(vllm_config(model_dir, squatter))
    tokens = [9 + i % 200 for i in range(2 * BLOCK + 1)]
    for _ in range(3):
        assert matched(sched.connector, request(tokens)) == (0, False)
    time.sleep(0.5)  # ten probes: each is refused, so the connector stays off
    assert not sched.connector.link.available
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("kvstore")]
    assert len(messages) == 1 and "owns the namespace prefixes 'team-b/'" in messages[0]
    sched.shutdown()  # its link stops probing the daemon, which other tests go on using
