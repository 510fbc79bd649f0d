"""What an offline GPU machine has, what `make gpu-check` must carry to it, and the checks that
run there before the first test.

The GPU machine (an image with CUDA, torch, cupy and a test stack, and no package index)
runs `scripts/gpu_check.sh` over a copy of the source tree. This module is the one place that
says what that needs:

- IMAGE: the distributions the project takes from the image as they are (never carried: a
  carried copy would shadow the image's own test stack and plugins);
- CARRY: the exact wheels the image lacks, or has too old for the generated gRPC stubs;
- PREFLIGHT_IMPORTS and GPU_TEST_FILES: what the preflight imports and what pytest runs.

Commands (Python 3.10+, standard library only, so each runs before anything is installed):

  gpu_env.py wheels DIR       download CARRY into a clean DIR for the GPU machine's Python and
                              platform tags, then check every carried wheel's requirements are
                              met by IMAGE or CARRY (run where pip reaches an index)
  gpu_env.py preflight        print the versions of torch, CUDA, cupy, grpcio, protobuf and
                              kvikio, import PREFLIGHT_IMPORTS, and exit 2 naming what is
                              missing; `--no-gpu` skips the device checks (the CPU test does)
  gpu_env.py test-files       print GPU_TEST_FILES, one a line (for the shell script)

A unit test (tests/unit/test_gpu_env.py) keeps these lists true to pyproject.toml, the stubs
and the test suite.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The GPU machine's interpreter and the platform tags its wheels must match (manylinux_2_28
# first: kvikio, libkvikio and rapids-logger publish no older tag).
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
TARGET_ENV = {"python_version": PYTHON_VERSION, "python_full_version": f"{PYTHON_VERSION}.3",
              "implementation_name": "cpython", "platform_python_implementation": "CPython",
              "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
              "platform_machine": "x86_64", "extra": ""}

# Distributions the image ships and the project uses as they are (read off the image's
# package list, 2026-11). grpcio and protobuf are there too, but older than the committed
# stubs accept, so they are carried instead and are not listed here.
IMAGE = frozenset({
    # runtime
    "numpy", "pyyaml", "rich", "xxhash", "prometheus-client", "typing-extensions",
    "packaging", "requests", "tqdm",
    # engine and GPU
    "torch", "triton", "cupy-cuda13x", "cuda-toolkit", "cuda-pathfinder", "nvidia-cufile",
    "safetensors", "tokenizers", "jinja2", "markupsafe",
    # tests: the image's own stack (pytest, what it and hypothesis need, pytest-timeout for
    # per-test limits), never shadowed by carried copies
    "pytest", "pluggy", "iniconfig", "pytest-timeout", "hypothesis", "attrs",
    "sortedcontainers",
})

# Exactly what the image lacks, pinned: one wheel each, from a clean folder.
CARRY = {
    "grpcio": "1.85.1",  # the stubs' GRPC_GENERATED_VERSION
    "protobuf": "7.35.1",  # the stubs' gencode version
    "grpcio-health-checking": "1.85.1",
    "grpcio-reflection": "1.85.1",
    "grpcio-status": "1.85.1",  # errors' google.rpc.ErrorInfo details
    "googleapis-common-protos": "1.76.0",
    "lz4": "4.4.5",
    "redis": "8.1.0",
    "hiredis": "3.5.0",
    "gguf": "0.19.0",
    "kvikio-cu13": "26.10.0",
    "libkvikio-cu13": "26.10.0",
    "rapids-logger": "0.3.0",
    "pyzmq": "27.3.0",  # kvstore-events' sockets
    "msgspec": "0.23.0",  # kvstore-events' vLLM-format frames
}

# The modules whose import chains the GPU run needs; a failure here stops the run before
# pytest would turn it into "0 tests ran".
PREFLIGHT_IMPORTS = (
    "grpc", "google.protobuf", "kvstore.proto.kvstore.v1.kvstore_pb2_grpc", "kvstore.tools.testing",
    "kvstore.client", "kvstore.daemon.server", "kvstore.tiers.hbm", "kvstore.tiers.dram",
    "kvstore.tiers.nvme", "triton", "kvstore.kernels.gpu", "kvstore.integrations.device_copies",
    "kvstore.engine.llm",
)

# Every test file with a test marked `gpu` (the unit test checks this against the suite).
GPU_TEST_FILES = (
    "tests/integration/test_gpu_pinned.py",
    "tests/integration/test_hbm.py",
    "tests/integration/test_tier_contract.py",
    "tests/integration/test_gpu_kernels.py",
    "tests/integration/test_device_copies_cuda.py",
    "tests/integration/test_engine_cuda.py",
)


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


# --- wheels ----------------------------------------------------------------------------------


def _requirements(wheel: Path) -> list[str]:
    """The names the wheel requires on the GPU machine (CPython 3.12, Linux x86-64): its
    Requires-Dist whose markers hold there, extras' requirements left out."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip always carries a copy
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[assignment]
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    names = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(TARGET_ENV):
                names.append(canonical(req.name))
    return names


def _wheel_name(wheel: Path) -> str:
    return canonical(wheel.name.split("-", 1)[0])


def unmet(wheels: list[Path]) -> list[str]:
    """'wheel needs X' for every requirement neither the image nor the carried wheels meet,
    and 'two wheels of X' for duplicates (pip refuses the whole install then)."""
    problems = []
    names = [_wheel_name(w) for w in wheels]
    problems += [f"two wheels of {n}" for n in sorted({n for n in names if names.count(n) > 1})]
    have = set(IMAGE) | set(names)
    for wheel in wheels:
        problems += [f"{wheel.name} needs {req}, which neither the image nor .whl has"
                     for req in _requirements(wheel) if req not in have]
    return problems


def download_wheels(dest: Path) -> int:
    if dest.exists():
        shutil.rmtree(dest)  # a stale second version of any wheel makes pip refuse them all
    dest.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
           "--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp",
           *(f"--platform={p}" for p in PLATFORMS), "-d", str(dest),
           *(f"{name}=={version}" for name, version in CARRY.items())]
    if subprocess.run(cmd).returncode != 0:
        print("gpu-wheels: pip download failed (above)", file=sys.stderr)
        return 1
    wheels = sorted(dest.glob("*.whl"))
    missing = sorted(set(CARRY) - {_wheel_name(w) for w in wheels})
    problems = [f"no wheel for {n}" for n in missing] + unmet(wheels)
    for p in problems:
        print(f"gpu-wheels: {p}", file=sys.stderr)
    size = sum(w.stat().st_size for w in wheels)
    print(f"gpu-wheels: {len(wheels)} wheels, {size / 2**20:.1f} MiB in {dest}"
          f" (carry it: the device run must name it)")
    return 1 if problems else 0


# --- preflight -------------------------------------------------------------------------------


def _version(module: str) -> str:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # reported, not raised: every version line should print
        return f"missing ({type(exc).__name__}: {exc})"
    return str(getattr(mod, "__version__", "?"))


def preflight(gpu: bool) -> int:
    """Versions, then every import; with gpu, also a CUDA device seen by torch and cupy.
    Returns 0, or 2 with one 'preflight: FAIL ...' line per problem."""
    problems = []
    print(f"preflight: python {sys.version.split()[0]} at {sys.executable}")
    for module in ("torch", "triton", "cupy", "grpc", "google.protobuf", "kvikio", "numpy"):
        print(f"preflight: {module} {_version(module)}")
    try:
        import torch

        print(f"preflight: torch CUDA {torch.version.cuda}, available "
              f"{torch.cuda.is_available()}")
        if gpu and not torch.cuda.is_available():
            problems.append("torch sees no CUDA device")
        elif gpu:
            print(f"preflight: device {torch.cuda.get_device_name(0)}")
    except ImportError as exc:
        problems.append(f"torch does not import: {exc}")
    if gpu:
        try:
            import cupy

            print(f"preflight: cupy sees {cupy.cuda.runtime.getDeviceCount()} device(s), "
                  f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}")
        except Exception as exc:  # ImportError or a CUDA runtime error: both stop the GPU tests
            problems.append(f"cupy cannot reach a device: {type(exc).__name__}: {exc}")
    for module in PREFLIGHT_IMPORTS:
        try:
            importlib.import_module(module)
        except Exception as exc:  # name the module and the error, then go on to the next
            problems.append(f"import {module}: {type(exc).__name__}: {exc}")
    try:
        import kvikio  # noqa: F401  (optional: its tier contract and figure skip without it)
    except Exception as exc:
        print(f"preflight: WARN kvikio does not import ({type(exc).__name__}: {exc}); "
              "the kvikio tier contract and kvikio_read will skip")
    if importlib.util.find_spec("pytest_timeout") is None:
        print("preflight: WARN pytest-timeout is missing: no per-test time limit")
    for p in problems:
        print(f"preflight: FAIL {p}")
    print(f"preflight: {'FAIL' if problems else 'ok'}")
    return 2 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("wheels").add_argument("dest", type=Path)
    pre = sub.add_parser("preflight")
    pre.add_argument("--no-gpu", action="store_true", help="imports and versions only")
    sub.add_parser("test-files")
    args = parser.parse_args(argv)
    if args.command == "wheels":
        return download_wheels(args.dest)
    if args.command == "preflight":
        return preflight(gpu=not args.no_gpu)
    print("\n".join(GPU_TEST_FILES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
