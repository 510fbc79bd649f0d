"""`make gpu-check` cannot drift from the project (scripts/gpu_env.py): every dependency the
package declares is either in the GPU image or carried, nothing the image has is carried over
it, the carried grpcio and protobuf are the versions the committed stubs demand, every
third-party import of the package is declared, the named GPU test files are every file with a
`gpu` test, the preflight's imports run, and scripts/gpu_check.sh stops at a failed preflight
with each stage's status and its logs."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.conftest import REPO

tomllib = pytest.importorskip("tomllib")


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_env", REPO / "scripts" / "gpu_env.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_env = _load()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PACKAGE_DIRS = ("kvstore", "tiers", "client", "kernels", "engine", "proto")
# Import names whose distribution is named otherwise (and cannot be looked up here: the GPU
# ones are not installed on a CPU machine).
DISTRIBUTION_OF = {"cupy": "cupy-cuda13x", "kvikio": "kvikio-cu13", "yaml": "pyyaml",
                   "google": "protobuf", "grpc": "grpcio", "grpc_health": "grpcio-health-checking",
                   "grpc_reflection": "grpcio-reflection", "prometheus_client": "prometheus-client"}


def _runtime_requirements() -> list[Requirement]:
    """What the GPU machine runs: the package's dependencies and its engine and gpu extras."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    specs = PYPROJECT["project"]["dependencies"] + extras["engine"] + extras["gpu"]
    return [Requirement(s) for s in specs]


def test_every_runtime_dependency_is_in_the_image_or_carried() -> None:
    have = gpu_env.IMAGE | set(gpu_env.CARRY)
    missing = [str(r) for r in _runtime_requirements() if gpu_env.canonical(r.name) not in have]
    assert not missing, f"add these to IMAGE (if the GPU image has them) or CARRY: {missing}"


def test_nothing_the_image_has_is_carried_over_it() -> None:
    both = gpu_env.IMAGE & set(gpu_env.CARRY)
    assert not both, f"carried copies would shadow the image's own: {sorted(both)}"
    for stack in ("pytest", "pluggy", "iniconfig", "hypothesis"):
        assert stack in gpu_env.IMAGE and stack not in gpu_env.CARRY


def test_carried_pins_meet_the_declared_ranges() -> None:
    for req in _runtime_requirements():
        pin = gpu_env.CARRY.get(gpu_env.canonical(req.name))
        if pin is not None:
            assert req.specifier.contains(pin), f"CARRY {req.name}=={pin} is outside {req}"


def _stub_versions() -> tuple[str, str]:
    """(grpcio, protobuf) versions the committed stubs refuse to run below."""
    stubs = REPO / "proto" / "kvstore" / "v1"
    grpc_text = (stubs / "kvstore_pb2_grpc.py").read_text()
    grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_text)
    pb_text = (stubs / "kvstore_pb2.py").read_text()
    pb_version = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", pb_text)
    assert grpc_version and pb_version
    return grpc_version.group(1), ".".join(pb_version.groups())


def test_carried_grpc_and_protobuf_are_what_the_stubs_demand() -> None:
    grpc_version, pb_version = _stub_versions()
    assert gpu_env.CARRY["grpcio"] == grpc_version
    assert gpu_env.CARRY["protobuf"] == pb_version
    for name in ("grpcio-health-checking", "grpcio-reflection"):
        assert gpu_env.CARRY[name] == grpc_version
    # The declared floors are the stubs' too, so pip never installs a runtime they refuse.
    floors = {gpu_env.canonical(r.name): r.specifier for r in _runtime_requirements()}
    for name, version in (("grpcio", grpc_version), ("protobuf", pb_version)):
        lowest = [s.version for s in floors[name] if s.operator == ">="]
        assert lowest and Version(lowest[0]) == Version(version), (name, floors[name])


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level third-party module -> the package files importing it (ast, not grep)."""
    found: dict[str, set[str]] = {}
    for folder in PACKAGE_DIRS:
        for path in (REPO / folder).rglob("*.py"):
            if "_pb2" in path.name:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "kvstore":
                        found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_third_party_import_is_declared_and_reaches_the_gpu_machine() -> None:
    import importlib.metadata

    dists = importlib.metadata.packages_distributions()
    declared = {gpu_env.canonical(r.name) for r in _runtime_requirements()}
    test_only = {gpu_env.canonical(r) for r in ("grpcio-tools",)}  # proto/generate.py
    # vLLM's connector runs inside vLLM, not on the GPU check's image: declared, not carried.
    in_vllm = {gpu_env.canonical(Requirement(r).name)
               for r in PYPROJECT["project"]["optional-dependencies"]["vllm"]}
    imports = _third_party_imports()
    assert {"torch", "grpc", "redis", "cupy", "kvikio"} <= set(imports)  # the scan works
    problems = []
    for top, files in sorted(imports.items()):
        name = DISTRIBUTION_OF.get(top) or (dists.get(top) or [top])[0]
        dist = gpu_env.canonical(name)
        if dist in test_only or dist in in_vllm:
            continue
        if dist not in declared:
            problems.append(f"{top} ({dist}), imported by {sorted(files)}, is not declared")
        elif dist not in gpu_env.IMAGE | set(gpu_env.CARRY):
            problems.append(f"{top} ({dist}) is neither in the GPU image nor carried")
    assert not problems, problems


def _marks_gpu(path: Path) -> bool:
    """Whether the file uses `pytest.mark.gpu` (as code, not in a string)."""
    return any(isinstance(node, ast.Attribute) and node.attr == "gpu"
               and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"
               for node in ast.walk(ast.parse(path.read_text())))


def test_the_gpu_test_files_are_every_file_with_a_gpu_test() -> None:
    marked = {str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
              if _marks_gpu(p)}
    assert "tests/integration/test_hbm.py" in marked
    assert set(gpu_env.GPU_TEST_FILES) == marked
    out = subprocess.run([sys.executable, "scripts/gpu_env.py", "test-files"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == list(gpu_env.GPU_TEST_FILES)


def test_preflight_imports_everything_here() -> None:
    r = subprocess.run([sys.executable, "scripts/gpu_env.py", "preflight", "--no-gpu"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    for line in ("preflight: torch ", "preflight: grpc 1.", "preflight: google.protobuf ",
                 "preflight: kvikio ", "preflight: ok"):
        assert line in r.stdout, r.stdout


def _wheel(folder: Path, name: str, version: str, *requires: str) -> Path:
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", meta)
    return path


def test_unmet_names_missing_requirements_and_duplicate_wheels(tmp_path: Path) -> None:
    wheels = [
        _wheel(tmp_path, "redis", "8.1.0", "async-timeout>=4; python_full_version < '3.11.3'"),
        _wheel(tmp_path, "gguf", "0.19.0", "numpy>=1.17", "tqdm", "sphinx; extra == 'docs'"),
        _wheel(tmp_path, "lz4", "4.4.5", "no-such-dist>=1"),
        _wheel(tmp_path, "lz4", "4.4.4"),
    ]
    problems = gpu_env.unmet(wheels)
    assert problems == ["two wheels of lz4",
                        "lz4-4.4.5-py3-none-any.whl needs no-such-dist, which neither the image "
                        "nor .whl has"]


def test_gpu_check_stops_at_a_failed_preflight_and_says_so(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable,
           "GPU_CHECK_WHEELS": str(tmp_path / "none"), "GPU_CHECK_INSTALL": "0",
           "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 1, r.stdout + r.stderr
    summary = (tmp_path / "gpu-check.txt").read_text()
    assert "preflight: FAIL torch sees no CUDA device" in summary
    for line in ("setup: ok", "preflight: FAILED (exit 2)", "kernels: not run",
                 "ordering: not run", "engine: not run", "tiers: not run",
                 "gpu_bench: not run", "kernel_bench: not run"):
        assert f"   {line}\n" in summary, summary
    assert "run 'make gpu-wheels'" in (tmp_path / "setup.log").read_text()
    assert summary in r.stdout.replace("\r", "")  # what the device tool's tail shows
