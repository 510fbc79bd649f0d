"""Who may import whom, read from every module's imports (ast, so imports inside functions
and TYPE_CHECKING blocks count too). Arrows point down; nothing points back up:

  kvstore.daemon  -> kvstore.core, kvstore.tiers, kvstore.proto, the shared kvstore modules
  kvstore.core    -> the shared kvstore modules only; no I/O, threads or clock reads
  kvstore.tools   -> kvstore.client (and the shared modules)
  kvstore.client  -> kvstore.proto and the shared modules
  kvstore.engine  -> kvstore.client, kvstore.integrations, kvstore.kernels, kvstore.tools (its
                     demo), shared modules
  kvstore.integrations -> kvstore.client and the shared modules (and vLLM, torch)
  kvstore.tiers   -> the shared modules
  shared modules  -> (kvstore/*.py: keys, units, shm, tier, extents, ...) nothing of kvstore

A failure names the module, the forbidden import and the rule it breaks.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

SUBPACKAGES = ("core", "daemon", "tools", "tiers", "client", "engine", "kernels", "proto",
               "integrations")
IO_AND_THREADS = ("os", "io", "socket", "subprocess", "asyncio", "mmap", "fcntl", "signal",
                  "pathlib", "shutil", "tempfile", "logging", "threading", "concurrent", "time")
HEAVY = ("grpc", "grpc_health", "grpc_reflection", "redis", "torch", "kvikio", "cupy",
         "triton")


def _within(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _sub(*names: str) -> tuple[str, ...]:
    return tuple(f"kvstore.{n}" for n in names)


# (the importing side, what it must not import, why)
RULES: list[tuple[str, tuple[str, ...], str]] = [
    ("kvstore.core", _sub("daemon", "tools", "tiers", "client", "engine", "kernels", "proto",
                          "integrations")
     + HEAVY + IO_AND_THREADS, "the core is pure: no I/O, threads, clock reads or wire"),
    ("kvstore.daemon", _sub("tools", "client", "engine", "kernels", "integrations"),
     "the daemon speaks the wire contract; it never uses its own client or tools"),
    ("kvstore.tools", _sub("core", "daemon", "tiers", "engine", "kernels", "integrations"),
     "tools go through the client, as any operator would"),
    ("kvstore.client", _sub("core", "daemon", "tools", "tiers", "engine", "kernels",
                            "integrations"),
     "the client speaks only the wire contract"),
    ("kvstore.engine", _sub("core", "daemon", "tiers"),
     "the engine reaches the store through the client only"),
    ("kvstore.integrations", _sub("core", "daemon", "tools", "tiers", "engine", "kernels"),
     "a connector reaches the store through the client only, and knows no engine of ours"),
    ("kvstore.kernels", _sub("core", "daemon", "tools", "tiers", "client", "engine",
                             "integrations"),
     "kernels know tensors, not the store"),
    ("kvstore.tiers", _sub("core", "daemon", "tools", "client", "engine", "kernels",
                           "integrations"),
     "a tier moves bytes; the index, in the daemon, decides what goes where"),
    ("kvstore.proto", _sub(*(s for s in SUBPACKAGES if s != "proto")),
     "the wire contract depends on nothing"),
]


def _package_dirs() -> dict[str, Path]:
    text = (REPO / "pyproject.toml").read_text()
    section = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    return {name: REPO / folder
            for name, folder in re.findall(r'^"([\w.]+)"\s*=\s*"([^"]+)"', section, re.M)}


def modules() -> Iterator[tuple[str, Path]]:
    """(module name, file) of every module of the distribution, as imported."""
    dirs = _package_dirs()
    for package, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if "_pb2" in path.name:
                continue
            name = ".".join((package, *parts))
            nested = [p for p in dirs if p != package and _within(name, p)]
            if package == "kvstore" and nested:
                continue  # a folder mapped as its own package (none today)
            yield name.removesuffix(".__init__"), path


def imports(module: str, source: str, is_package: bool) -> Iterator[tuple[str, int]]:
    """(absolute module name, line) of every import in source; relative imports resolved."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            yield base, node.lineno
            if base == "kvstore":  # `from kvstore import core` imports kvstore.core
                for alias in node.names:
                    yield f"{base}.{alias.name}", node.lineno


def violations(module: str, source: str, is_package: bool = False) -> list[str]:
    shared = module.count(".") <= 1 and not _within(module, *_sub(*SUBPACKAGES))
    rules = RULES + ([("kvstore", _sub(*SUBPACKAGES),
                       "the shared modules are what everything imports: they import none of it")]
                     if shared else [])
    found = []
    for side, forbidden, why in rules:
        if side != "kvstore" and not _within(module, side):
            continue
        for name, line in imports(module, source, is_package):
            bad = [f for f in forbidden if _within(name, f)]
            if bad:
                found.append(f"{module}:{line} imports {name}: {why}")
    return found


def test_every_module_keeps_to_the_arrows() -> None:
    found = [v for name, path in modules()
             for v in violations(name, path.read_text(), path.name == "__init__.py")]
    assert not found, "\n".join(found)


def test_the_walk_sees_every_part() -> None:
    names = {name for name, _ in modules()}
    for expected in ("kvstore.keys", "kvstore.core.index", "kvstore.daemon.store",
                     "kvstore.tools.admin", "kvstore.tiers.dram", "kvstore.client.sync",
                     "kvstore.engine.connector", "kvstore.kernels.gpu", "kvstore.proto.frames"):
        assert expected in names


@pytest.mark.parametrize(("module", "source", "forbidden"), [
    ("kvstore.core.index", "from kvstore.daemon.store import Store", "kvstore.daemon.store"),
    ("kvstore.core.index", "def f():\n    import torch", "torch"),
    ("kvstore.core.pages", "import threading", "threading"),
    ("kvstore.core.pages", "from ..daemon import tiering", "kvstore.daemon"),
    ("kvstore.tiers.dram", "from kvstore.daemon.config import Config", "kvstore.daemon.config"),
    ("kvstore.tiers.dram", "from kvstore.core.pages import PageAllocator", "kvstore.core.pages"),
    ("kvstore.client.sync", "from kvstore import core", "kvstore.core"),
    ("kvstore.engine.llm", "from kvstore.core.index import Index", "kvstore.core.index"),
    ("kvstore.engine.llm", "from kvstore.daemon.store import Store", "kvstore.daemon.store"),
    ("kvstore.keys", "from kvstore.client import KVStoreClient", "kvstore.client"),
    ("kvstore.daemon.store", "from kvstore.client import KVStoreClient", "kvstore.client"),
])
def test_a_forbidden_import_is_named(module: str, source: str, forbidden: str) -> None:
    [found] = violations(module, source)
    assert found.startswith(f"{module}:") and f" imports {forbidden}: " in found


def test_allowed_imports_pass() -> None:
    assert violations("kvstore.daemon.store", "from kvstore.core.index import Index") == []
    assert violations("kvstore.core.index", "from kvstore.keys import BlockKey") == []
    assert violations("kvstore.engine.connector", "from kvstore.client import KVStoreClient") == []
    assert violations("kvstore.daemon.breaker", "import threading\nimport time") == []
