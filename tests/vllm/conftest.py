"""vLLM's own pieces, real, on the CPU: its v1 Scheduler driven step by step (as vLLM's
tests/v1/kv_connector/unit/utils.py drives it), its KV-cache configs, and whole `vllm.LLM`
engines in their own processes (run_llm.py). These tests run in the vLLM virtualenv
(.venv-vllm, `make test` builds it); elsewhere vLLM is not importable and they are not
collected.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.tools.testing import Daemon, start_daemon

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


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Daemon]:
    """A daemon with a 256 MiB L2 and no L3."""
    daemon = start_daemon(tmp_path, "dram.capacity_bytes=256MiB", "nvme.enabled=false")
    yield daemon
    daemon.stop()


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
