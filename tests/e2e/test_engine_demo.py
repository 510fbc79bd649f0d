"""`make run`'s engine demo end to end: it starts its own daemon, runs SmolLM2-135M through a
multi-turn chat and a shared-system-prompt batch with the store and without, and the answers
must be identical while later turns load their history from the store."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.engine.models import smollm2_gguf

pytestmark = pytest.mark.slow


def test_engine_demo_loads_history_from_the_store_and_answers_the_same() -> None:
    smollm2_gguf()  # skips without the model wheel
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore.engine.demo", "--max-tokens", "8",
         "--port", "0", "--metrics-port", "0"],  # not the defaults: `make run` may be running
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"{out}\n{proc.stderr}"
    assert "answers identical with and without the store: yes" in out
    rows = re.findall(r"│\s+(\d)\s+│\s+(\d+)\s+│\s+(\d+)\s+│\s+\d+ ms", out)
    assert [turn for turn, _, _ in rows] == ["1", "2", "3", "4"]
    from_store = [int(loaded) for _, _, loaded in rows]
    assert from_store[0] == 0 and all(n > 0 for n in from_store[1:])
    assert re.search(r"batch of 5: [1-9]\d* of \d+ prompt tokens loaded from the store", out)
    assert "kvstore-server stopped (exit 0)" in out
