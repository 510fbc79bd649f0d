"""vLLM's own pieces, real, on the CPU: its v1 Scheduler driven step by step (as vLLM's
tests/v1/kv_connector/unit/utils.py drives it), its KV-cache configs, and whole `vllm.LLM`
engines in their own processes (run_llm.py). These tests run in the vLLM virtualenv
(.venv-vllm, `make test` builds it); elsewhere vLLM is not importable and they are not
collected.

The tests share one daemon (`store`), each in namespaces of its own; a test that stops,
freezes or kills its daemon starts one of its own (`own_store`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from kvstore.client import KVStoreClient
from kvstore.integrations.settings import ModelShape, model_shape, namespace_for, parse_settings
from kvstore.tools.testing import Daemon

if TYPE_CHECKING:
    from tests.conftest import SharedDaemons

HERE = Path(__file__).resolve().parent

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama vLLM's CPU backend runs (head_dim 64, 2 layers, 2 KV heads)."""
    from kvstore.engine.random_model import save_random_llama

    return save_random_llama(tmp_path_factory.mktemp("llama") / "tiny", vocab_size=512,
                             hidden_size=256, intermediate_size=512, num_layers=2,
                             num_heads=4, num_kv_heads=2, max_position_embeddings=4096)


#: The daemon these tests use: a 256 MiB L2 and no L3.
STORE_SETTINGS = ("dram.capacity_bytes=256MiB", "nvme.enabled=false")


@dataclass
class StoreView:
    """The session's shared daemon as one test sees it. The connector options from `options`
    carry the test's own `namespace_salt`, so every namespace the test's connectors use is its
    own: no other test's blocks are found in it, and it is evicted when the test ends."""

    daemon: Daemon
    salt: str
    namespaces: set[str] = field(default_factory=set)
    """The namespaces to evict when the test ends."""

    @property
    def target(self) -> str:
        return self.daemon.target

    def options(self, **extra: Any) -> dict[str, Any]:
        """kv_connector_extra_config for a connector of this test, with the extra options."""
        return {"target": self.daemon.target, "namespace_salt": self.salt, **extra}

    def evict_at_end(self, namespace: str) -> None:
        """Evict this namespace too when the test ends: one an engine run used (run_llm.py),
        whose model shape is not the harness's."""
        self.namespaces.add(namespace)


@pytest.fixture(scope="session")
def harness_shape(model_dir: Path) -> ModelShape:
    """The model shape of every connector the harness builds (rank 0): with the connector
    options, it names the connector's namespace."""
    from tests.vllm.harness import vllm_config

    return model_shape(vllm_config(model_dir, {}), 0)


@pytest.fixture
def store(shared_daemon: SharedDaemons, ns: str,
          harness_shape: ModelShape) -> Iterator[StoreView]:
    """The session's shared daemon (STORE_SETTINGS), seen through the test's own namespaces
    (`StoreView`). The harness's connectors' namespace and those given to evict_at_end are
    evicted when the test ends."""
    view = StoreView(shared_daemon(*STORE_SETTINGS), ns)
    yield view
    view.namespaces.add(namespace_for(parse_settings(view.options()), harness_shape))
    for namespace in view.namespaces:
        with KVStoreClient(view.target, namespace, shared_memory=False) as client:
            client.evict(all=True)


@pytest.fixture
def own_store(daemon_factory: Callable[..., Daemon]) -> Daemon:
    """A daemon of the test's own (STORE_SETTINGS), stopped when the test ends: for a test
    that stops, freezes or kills it."""
    return daemon_factory(*STORE_SETTINGS)


def run_llm(args: dict[str, Any], timeout_s: float = 300.0) -> tuple[dict[str, Any], str]:
    """One vllm.LLM run in a fresh process (run_llm.py): its result and its stderr."""
    proc = subprocess.run([sys.executable, str(HERE / "run_llm.py"), json.dumps(args)],
                          capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "PYTHONPATH": str(HERE.parents[1])})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise AssertionError(f"run_llm failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
    return json.loads(lines[-1].removeprefix("RESULT ")), proc.stderr


@pytest.fixture
def llm_run() -> Callable[..., tuple[dict[str, Any], str]]:
    return run_llm
