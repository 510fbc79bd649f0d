"""Shared fixtures: a real kvstore-server subprocess on a free port (kvstore.tools.testing); GPU
tests skip cleanly without CUDA."""

from __future__ import annotations

import importlib.util
import re
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstore.client import KVStoreClient
from kvstore.tools.testing import Daemon, start_daemon

REPO = Path(__file__).resolve().parents[1]


def _cuda_available() -> bool:
    """A CUDA device that torch or cupy reaches. Torch alone runs the engine's Triton kernels,
    the device copies and L1; the tests that need cupy (pinning the L2 segment) skip on
    their own without it."""
    if importlib.util.find_spec("torch") is not None:  # the engine's extra brings it
        import torch

        if torch.cuda.is_available():
            return True
    try:
        import cupy  # type: ignore[import-not-found]

        return bool(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no cupy, no driver, no device: all mean "no GPU here"
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch or cupy, and a driver)")
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
    """A factory of daemons of the test's own, stopped when it ends: for tests of start-up,
    signals, drain, crashes or restarts, of settings no other test shares, and of daemon-wide
    state (totals across namespaces, a full tier, metrics that cannot be read as a delta)."""
    started: list[Daemon] = []

    def make(*settings: str, env: dict[str, str] | None = None) -> Daemon:
        d = start_daemon(tmp_path, *settings, env=env)
        started.append(d)
        return d

    yield make
    for d in started:
        d.stop()


class SharedDaemons:
    """The daemons a session shares, one per distinct list of settings, each started on first
    use in a folder of its own and stopped at the session's end. A test that stops its daemon
    or fills a tier must use daemon_factory instead: a shared daemon that has exited fails
    the next test that asks for it, rather than being quietly replaced."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._started: dict[tuple[tuple[str, ...], bool], Daemon] = {}
        # One client per shared daemon for the evictions at each test's end: opening a
        # channel per test and daemon was most of what a test's teardown cost.
        self._evictors: dict[str, KVStoreClient] = {}

    def __call__(self, *settings: str, unix_socket: bool = False) -> Daemon:
        """The shared daemon with these settings (their order counts: a later --set wins),
        started now if none is yet. With unix_socket it also serves the local path, on a
        socket in its folder (Daemon.unix_socket)."""
        key = (settings, unix_socket)
        found = self._started.get(key)
        if found is None:
            workdir = self._root / f"d{len(self._started)}"
            workdir.mkdir()
            extra = (f"server.unix_socket={workdir / 'kv.sock'}",) if unix_socket else ()
            found = self._started[key] = start_daemon(workdir, *settings, *extra)
        if found.proc.poll() is not None:
            raise RuntimeError(
                f"the shared daemon {settings} exited ({found.proc.returncode}): a test that "
                f"stops its daemon must start its own (daemon_factory):\n{found.log()}")
        return found

    def evict_namespace(self, namespace: str) -> None:
        """Evict everything in `namespace` from every running shared daemon that takes calls
        without credentials (one with auth or TLS on is the test's to clean)."""
        for settings, d in self._started.items():
            if d.proc.poll() is None and not any(_needs_credentials(s) for s in settings[0]):
                kv = self._evictors.get(d.target)
                if kv is None:
                    kv = self._evictors[d.target] = KVStoreClient(
                        d.target, "tests-evictor", shared_memory=False)
                kv.evict(all=True, namespace=namespace)

    def stop_all(self) -> None:
        """Stop every shared daemon; each must exit 0 (a clean drain), or the session fails
        with the logs of those that did not."""
        for kv in self._evictors.values():
            kv.close()
        failed = [d.log() for d in self._started.values() if d.stop() != 0]
        assert not failed, "a shared daemon did not exit 0:\n" + "\n".join(failed)


def _needs_credentials(setting: str) -> bool:
    return (setting.startswith(("auth.mode=", "server.tls_"))
            and setting != "auth.mode=off")


@pytest.fixture(scope="session")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedDaemons]:
    """`shared_daemon(*settings)`: a daemon shared by every test of the session (of the xdist
    worker, under xdist) that asks for the same settings; each test works in a namespace of
    its own (the `ns` fixture) and leaves nothing behind."""
    daemons = SharedDaemons(tmp_path_factory.mktemp("shared-daemons"))
    yield daemons
    daemons.stop_all()


#: The shared default daemon's settings: a small (32 MiB) L2 of 64 KiB pages and no L3, so
#: blocks evicted from L2 are gone (tests of L3 start their own).
DEFAULT_SETTINGS = ("dram.capacity_bytes=32MiB", "dram.page_size_bytes=64KiB",
                    "nvme.enabled=false")


@pytest.fixture
def daemon(shared_daemon: SharedDaemons) -> Daemon:
    """The session's shared default daemon (DEFAULT_SETTINGS). Other tests use it at the same
    time or before: work in the test's namespace (`ns`), and read daemon-wide figures as
    deltas or per namespace."""
    return shared_daemon(*DEFAULT_SETTINGS)


#: The settings of the daemon for tests that read the whole daemon's figures: an 8 MiB L2 of
#: 64 KiB pages and a small L3.
WHOLE_SETTINGS = ("dram.capacity_bytes=8MiB", "dram.page_size_bytes=64KiB")


#: The settings of the daemon for tests that count pages: a 16-page L2 (1 MiB of 64 KiB
#: pages) and no L3; leases of 2 s (short, yet long enough to observe a lease on a loaded
#: 2-core machine), swept every 0.1 s, and reservations of 30 s; one client may pin the whole
#: tier. The tests that use it empty it first, as whole_daemon does.
SIXTEEN_PAGES = ("nvme.enabled=false", "dram.capacity_bytes=1MiB", "dram.page_size_bytes=64KiB",
                 "clients.max_pinned_share=1", "leases.lease_timeout_s=2",
                 "leases.sweep_interval_s=0.1", "leases.reservation_timeout_s=30")


@pytest.fixture
def whole_daemon(shared_daemon: SharedDaemons) -> Daemon:
    """A shared daemon (WHOLE_SETTINGS) emptied for the test: every namespace is evicted
    before it starts. For tests that read daemon-wide figures (objects, used bytes, the
    admin's stats table): the tests of one session run one at a time, so each starts on an
    empty store. What a test pins it must unpin, since eviction spares pinned blocks."""
    d = shared_daemon(*WHOLE_SETTINGS)
    with KVStoreClient(d.target, "whole-daemon", shared_memory=False) as kv:
        kv.evict(all=True, namespace="")
    return d


@pytest.fixture
def ns(request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace no other test uses ("t-<test name>-<random>"). When the test ends, whatever
    it left in that namespace is evicted from every shared daemon (when the test used `daemon`
    or `shared_daemon`; a daemon of its own is stopped anyway)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:80]
    namespace = f"t-{name}-{secrets.token_hex(4)}"
    yield namespace
    if "shared_daemon" in request.fixturenames:
        shared: SharedDaemons = request.getfixturevalue("shared_daemon")
        shared.evict_namespace(namespace)
