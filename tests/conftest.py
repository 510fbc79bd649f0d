"""Shared fixtures: a real kvstore-server subprocess on a free port (kvstore.tools.testing); GPU
tests skip cleanly without CUDA."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstore.tools.testing import Daemon, start_daemon

REPO = Path(__file__).resolve().parents[1]


def _cuda_available() -> bool:
    try:
        import cupy  # type: ignore[import-not-found]

        return bool(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no cupy, no driver, no device: all mean "no GPU here"
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (cupy + driver)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _l3_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A daemon started on embedded defaults (the demo, the start-up failure tests) keeps
    its L3 file under $XDG_CACHE_HOME: point that at a temporary folder, so test runs never
    leave multi-GiB files in the user's ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    yield
    mp.undo()


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []

    def make(*settings: str, env: dict[str, str] | None = None) -> Daemon:
        d = start_daemon(tmp_path, *settings, env=env)
        started.append(d)
        return d

    yield make
    for d in started:
        d.stop()


@pytest.fixture
def daemon(daemon_factory: Callable[..., Daemon]) -> Daemon:
    """A daemon with a small (32 MiB) L2 and 64 KiB pages, and no L3: blocks evicted from L2
    are gone (tests of L3 start their own, see tests/integration/test_tiering.py)."""
    return daemon_factory(
        "dram.capacity_bytes=32MiB", "dram.page_size_bytes=64KiB", "nvme.enabled=false")
