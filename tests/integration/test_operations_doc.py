"""docs/operations.md as a reader copies it: its YAML configs load, its shell commands run
(.venv's binaries first on PATH), every block says what it is, and the start line it shows
has the shape a real bare daemon prints. tests/e2e/test_docs_run.py runs every doc's blocks
as well; this file holds the operations guide to the daemon its defaults describe."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstore import __version__
from kvstore.daemon.config import load_config
from kvstore.tools.testing import Daemon
from tests.docs_blocks import LANGUAGES, SHOWN, Block, find_blocks

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "operations.md"


def blocks(lang: str) -> list[Block]:
    return [b for b in find_blocks(DOC, REPO) if LANGUAGES.get(b.lang) == lang and not b.skip]


def test_every_block_of_the_guide_says_what_it_is() -> None:
    unsaid = [b.line for b in find_blocks(DOC, REPO) if b.lang not in (*LANGUAGES, SHOWN)]
    assert unsaid == [], f"blocks without a language at lines {unsaid}"


@pytest.mark.parametrize("block", blocks("yaml"), ids=lambda b: f"line{b.line}")
def test_the_guides_configs_load(block: Block, tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(block.text)
    load_config(path, env={})


def test_the_guides_size_example_reads_as_it_says(tmp_path: Path) -> None:
    (block,) = [b for b in blocks("yaml") if "queue_bytes: 64MB" in b.text]
    path = tmp_path / "config.yaml"
    path.write_text(block.text)
    cfg = load_config(path, env={})
    assert cfg.remote.queue_bytes == 64_000_000
    assert cfg.dram.capacity_bytes == 512 << 20


@pytest.mark.parametrize("block", blocks("shell"), ids=lambda b: f"line{b.line}")
def test_the_guides_commands_run(block: Block, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.text], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    if "--version" in block.text:
        assert done.stdout == f"kvstore-server {__version__}\n"


def masked(line: str) -> str:
    """The start line with what differs between hosts and runs replaced by names."""
    line = re.sub(r"\b\d+(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB)\b", "SIZE", line)
    line = re.sub(r"kvstore-\d+-[0-9a-f]+", "SEGMENT", line)
    line = re.sub(r"in /\S+/kvstore/\d+,", "in FOLDER,", line)
    line = re.sub(r"\b\d+\.\d+\.\d+ listening", "VERSION listening", line)
    return re.sub(r"\d+", "N", line)


def test_the_start_line_the_guide_shows_is_what_a_bare_daemon_prints(
        daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    (shown,) = [line for b in find_blocks(DOC, REPO) if b.lang == SHOWN
                for line in b.text.splitlines() if " listening on " in line]
    cache = tmp_path / "cache"
    d = daemon_factory("dram.capacity_bytes=8MiB", "hbm.mode=off", "nvme.dir=",
                       env={"XDG_CACHE_HOME": str(cache)})
    (printed,) = [line for line in d.log().splitlines()
                  if line.startswith("kvstore-server ") and " listening on " in line]
    assert masked(printed) == masked(shown)
