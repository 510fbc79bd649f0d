"""kernels/csrc/*.cu compile with nvcc (to PTX for sm_80 and sm_90), so a broken kernel fails
CI without a GPU; the entry points kernels/cuda.py launches are all there, the register
arrays stay in registers, and the sources include nothing NVRTC (cupy, at run time) lacks."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvstore.kernels import cuda

SOURCES = sorted(cuda.CSRC_DIR.glob("*.cu"))
ARCHS = ("sm_80", "sm_90")
# Headers NVRTC ships (cupy adds the CUDA include path); anything else may be host-only.
NVRTC_HEADERS = {"cuda_fp16.h", "cuda_bf16.h"}

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="nvcc is not on PATH: the CUDA sources are not compiled")


def nvcc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nvcc", "-std=c++17", *args], capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.fixture(scope="module")
def ptx(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], str]:
    """PTX text by (source name, arch), compiled once for the module."""
    out_dir = tmp_path_factory.mktemp("ptx")
    compiled = {}
    for source in SOURCES:
        for arch in ARCHS:
            target = out_dir / f"{source.stem}.{arch}.ptx"
            proc = nvcc("--ptx", f"-arch={arch}", "-o", str(target), str(source))
            assert proc.returncode == 0, f"nvcc {arch} {source.name}:\n{proc.stderr}"
            compiled[source.name, arch] = target.read_text()
    return compiled


def test_sources_are_the_ones_loaded() -> None:
    assert [s.name for s in SOURCES] == sorted(cuda.SOURCES)


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_every_launched_kernel_is_an_entry_point(ptx: dict[tuple[str, str], str],
                                                 arch: str) -> None:
    entries = set()
    for source in SOURCES:
        entries |= set(re.findall(r"\.visible \.entry (\w+)\(", ptx[source.name, arch]))
    assert sorted(entries) == sorted(cuda.kernel_names())


@needs_nvcc
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_no_spills_or_local_memory_on_sm90(source: Path, tmp_path: Path) -> None:
    """The per-lane arrays are indexed only by unrolled constants: a spill or a local-memory
    array here would make the decode kernel several times slower."""
    proc = nvcc("--cubin", "-arch=sm_90", "-Xptxas", "-warn-spills,-warn-lmem-usage",
                "-o", str(tmp_path / "out.cubin"), str(source))
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr.lower(), proc.stderr


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_includes_only_what_nvrtc_ships(source: Path) -> None:
    included = set(re.findall(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', source.read_text(), re.M))
    assert included <= NVRTC_HEADERS, f"{source.name} includes {included - NVRTC_HEADERS}"
