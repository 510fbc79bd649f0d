"""The connector on a shared daemon with auth on: it passes its tenant's token, its namespace
lies under the tenant's prefix, and credentials the daemon refuses cost one warning and no
hit, without flapping back on."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvstore.tools.testing import Daemon, start_daemon
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

TOKENS = {"team-a": "vllm-token-of-a-0123456789", "team-b": "vllm-token-of-b-0123456789"}


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[Daemon]:
    doc = {"tenants": [{"name": name, "namespaces": [f"{name}/"],
                        "tokens_sha256": [hashlib.sha256(token.encode()).hexdigest()]}
                       for name, token in TOKENS.items()]}
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(doc))
    daemon = start_daemon(tmp_path, "auth.mode=token", f"auth.tenants_file={path}",
                          f"server.unix_socket={tmp_path / 'kv.sock'}",
                          "dram.capacity_bytes=64MiB", "nvme.enabled=false")
    yield daemon
    daemon.stop()


def test_a_tenant_saves_and_hits_under_its_prefix_and_another_sees_nothing(
        shared: Daemon, model_dir: Path, tmp_path: Path) -> None:
    token_file = tmp_path / "a.token"
    token_file.write_text(TOKENS["team-a"])
    a = {"target": shared.target, "token_file": str(token_file), "namespace_prefix": "team-a/"}
    sched_a = scheduler(vllm_config(model_dir, a))
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
    b = {"target": shared.target, "token": TOKENS["team-b"], "namespace_prefix": "team-b/"}
    other = scheduler(vllm_config(model_dir, b))
    assert matched(other.connector, request(tokens)) == (0, False)


def test_refused_credentials_cost_one_warning_and_stay_off(
        shared: Daemon, model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvstore")
    squatter = {"target": shared.target, "token": TOKENS["team-b"],
                "namespace_prefix": "team-a/", "reconnect_s": 0.05}
    sched = scheduler(vllm_config(model_dir, squatter))
    tokens = [9 + i % 200 for i in range(2 * BLOCK + 1)]
    for _ in range(3):
        assert matched(sched.connector, request(tokens)) == (0, False)
    time.sleep(0.5)  # ten probes: each is refused, so the connector stays off
    assert not sched.connector.link.available
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("kvstore")]
    assert len(messages) == 1 and "owns the namespace prefixes 'team-b/'" in messages[0]
