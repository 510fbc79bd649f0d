"""The benchmark smoke tests' shared run: `@pytest.mark.bench("store_bench", ...)` names the
bench scripts a test reads; bench/run_all.py --quick runs once per session, in the background
from the moment the tests start, for every script the selected tests name; those tests run
last, and the `bench_run` fixture waits for the run to end (tests/e2e/bench_run.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.e2e import bench_run as shared
from tests.e2e.bench_run import BenchRun

_STARTED = pytest.StashKey[subprocess.Popen[bytes]]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "bench(*scripts): the test reads these bench/run_all.py scripts' output "
        "from the session's one quick run (the bench_run fixture)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that read the shared run go last, so the rest of the session runs while the
    run does, instead of a worker waiting for it at its first smoke test."""
    items.sort(key=_reads_the_run)


def _reads_the_run(item: pytest.Item) -> bool:
    return "bench_run" in getattr(item, "fixturenames", ())


def _scripts(session: pytest.Session) -> list[str]:
    """The scripts the selected tests that read the run name; deselected ones (`-m 'not
    slow'`, `-k`) run none."""
    return shared.scripts_named(m for item in session.items if _reads_the_run(item)
                                for m in item.iter_markers("bench"))


def _folder(config: pytest.Config) -> Path:
    # A hook gets no fixtures: tmp_path_factory is read where pytest keeps it on the config.
    factory: pytest.TempPathFactory = config._tmp_path_factory  # type: ignore[attr-defined]
    return shared.session_folder(factory.getbasetemp())


def _start(session: pytest.Session) -> None:
    """Start the shared run unless this session's run (another xdist worker's) has begun."""
    scripts = _scripts(session)
    if scripts and _STARTED not in session.config.stash:
        proc = shared.start(_folder(session.config), scripts)
        if proc is not None:
            session.config.stash[_STARTED] = proc


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    """As the tests start; --collect-only runs none."""
    if not session.config.option.collectonly:
        _start(session)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Leave no run behind: wait for it, since another worker may still need it, unless the
    session was interrupted or told to stop (-x), when nothing will read it."""
    proc = session.config.stash.get(_STARTED, None)
    if proc is None:
        return
    if exitstatus == pytest.ExitCode.INTERRUPTED or session.shouldstop or session.shouldfail:
        shared.stop(proc)
    else:
        proc.wait()


@pytest.fixture(scope="session")
def bench_run(request: pytest.FixtureRequest) -> BenchRun:
    """The session's one `bench/run_all.py --quick` run of every script its selected tests
    mark with `bench`, shared by them (and by every xdist worker of the session), once it has
    ended."""
    _start(request.session)  # started already, unless a plugin ran the tests without the loop
    return shared.wait(_folder(request.config), _scripts(request.session),
                       request.config.stash.get(_STARTED, None))
