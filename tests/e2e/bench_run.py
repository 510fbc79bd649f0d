"""One `bench/run_all.py --quick` run that the benchmark smoke tests share.

Each smoke test used to run its bench script itself, and test_run_all.py ran store_bench and
trace_sim again through the runner. Now the session runs the runner once, for the scripts
the selected tests name with `@pytest.mark.bench(...)` (tests/e2e/conftest.py), and each test
reads what its script printed and its JSON report from the files the runner keeps beside its
report (<out>/<date>/<script>.out, .err and .json). No script runs twice in a session.

The run starts in the background as the session's tests start (`start`), so the other tests
run meanwhile instead of waiting behind it, and runs two scripts at once (JOBS); a smoke test
waits for it to end (`wait`). Under pytest-xdist every worker tries to start it, in a folder
all workers of the session share: the first to claim the folder starts it, and every worker
reads the same files. This module is also what runs in the background (`python -m
tests.e2e.bench_run FOLDER SCRIPT...`): it runs the runner and writes how it ended to
FOLDER/run.json.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from tests.conftest import REPO

#: What the runner may take beyond the sum of its scripts' time limits (its start, the plots).
RUNNER_SLACK_S = 120
#: Scripts the shared run runs at once (run_all --jobs). One at a time, the run was the
#: session's last thing to end: the workers, done with every other test, waited on it with a
#: core idle. Its figures are smoke sizes, checked rather than measured, so two may share.
JOBS = 2


def run_all_module() -> ModuleType:
    """bench/run_all.py, imported (bench/ is not a package)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        return importlib.import_module("run_all")
    finally:
        sys.path.remove(str(REPO / "bench"))


@dataclass(frozen=True)
class ScriptRun:
    """One script's part of the shared run: the runner's entry for it (status, figures,
    plots), what the script printed, and its own JSON report ({} when it wrote none)."""

    outcome: dict[str, Any]
    stdout: str
    stderr: str
    report: dict[str, Any]

    @property
    def lines(self) -> list[str]:
        return self.stdout.splitlines()

    def assert_ok(self) -> None:
        """The script ended with exit status 0 within its time limit."""
        assert self.outcome["status"] == "ok", (
            f"{self.outcome['script']}: {self.outcome['status']}\n"
            f"stdout:\n{self.stdout}\nstderr:\n{self.stderr}")


@dataclass(frozen=True)
class BenchRun:
    """The runner's run: its exit status and output, its --out folder, its JSON report and
    its Markdown report."""

    returncode: int
    stdout: str
    stderr: str
    out: Path
    report: dict[str, Any]
    markdown: str

    def script(self, name: str, nth: int = 1) -> ScriptRun:
        """The nth run of script `name` in this run (trace_sim runs twice)."""
        runs = [s for s in self.report["scripts"] if s["script"] == name]
        assert len(runs) >= nth, (
            f"{name} was not run {nth} time(s) in the shared bench run: mark the test "
            f"@pytest.mark.bench({name!r})\nrun_all stdout:\n{self.stdout}\n{self.stderr}")
        outcome = runs[nth - 1]

        def text(key: str) -> str:
            return (self.out / outcome[key]).read_text() if outcome[key] else ""

        report = json.loads(text("json_file")) if outcome["json_file"] else {}
        return ScriptRun(outcome, text("stdout_file"), text("stderr_file"), report)


def scripts_named(markers: Iterable[Any]) -> list[str]:
    """The scripts the `bench` markers name, in the suite's order (the order they run in)."""
    named = {name for marker in markers for name in marker.args}
    suite = [s.name for s in run_all_module().SUITE]
    unknown = named - set(suite)
    assert not unknown, f"@pytest.mark.bench names scripts run_all does not have: {unknown}"
    return [name for name in dict.fromkeys(suite) if name in named]


def start(folder: Path, scripts: list[str]) -> subprocess.Popen[bytes] | None:
    """Start the shared run of `scripts` in folder, in the background and in a process group
    of its own (`stop` ends it whole); None when a process of this session already has."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(folder / "claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return None
    with (folder / "background.log").open("w") as log:
        return subprocess.Popen([sys.executable, "-m", "tests.e2e.bench_run", str(folder),
                                 *scripts], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """End a run `start` started: the runner, the bench script it is running and whatever that
    started (daemons, redis-server) are all in its process group."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait(folder: Path, scripts: list[str],
         started: subprocess.Popen[bytes] | None = None) -> BenchRun:
    """The shared run, once it has ended (it may take as long as its scripts' limits, and the
    runner enforces those: waiting longer than they allow means it is gone). `started`, the
    run when this process started it, is watched too: one that dies writes no run.json."""
    done = folder / "run.json"
    limit_s = _limit_s(scripts) + RUNNER_SLACK_S
    deadline = time.monotonic() + limit_s
    while not done.exists():
        gone = started is not None and started.poll() is not None and not done.exists()
        assert not gone and time.monotonic() < deadline, (
            f"the shared bench run ended without a result, or not within {limit_s} s:\n"
            f"{(folder / 'background.log').read_text()}")
        time.sleep(0.5)
    ran = json.loads(done.read_text())
    assert "error" not in ran, ran["error"]
    out = folder / "results"
    [report_path] = out.glob("*.json")
    return BenchRun(ran["returncode"], ran["stdout"], ran["stderr"], out,
                    json.loads(report_path.read_text()),
                    report_path.with_suffix(".md").read_text())


def _limit_s(scripts: list[str]) -> int:
    """The runner's time limit: its scripts' limits, and room for its own start and plots."""
    limits: dict[str, int] = {s.name: s.timeout_s for s in run_all_module().SUITE}
    return sum(limits[name] for name in scripts) + RUNNER_SLACK_S


def _run(folder: Path, scripts: list[str]) -> dict[str, Any]:
    """Run the runner; what it ended with, or why it did not end."""
    only = [arg for name in scripts for arg in ("--only", name)]
    timeout_s = _limit_s(scripts)
    try:
        proc = subprocess.run(
            [sys.executable, str(REPO / "bench" / "run_all.py"), *only, "--quick",
             "--jobs", str(JOBS), "--out", str(folder / "results")],
            cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        return {"error": f"bench/run_all.py ran past {timeout_s} s: {exc.stdout!r}"}
    return {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}


def session_folder(basetemp: Path) -> Path:
    """A folder every process of this test session sees: under xdist each worker's basetemp
    is popen-gwN inside the session's own, so its parent; otherwise basetemp itself."""
    root = basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp
    return root / "bench-run"


def main(argv: list[str]) -> int:
    """Run the runner for FOLDER SCRIPT...; write how it ended (or why it could not run) to
    FOLDER/run.json, whole or not at all, since waiting processes read it once it exists."""
    folder, scripts = Path(argv[0]), argv[1:]
    try:
        result = _run(folder, scripts)
    except Exception:
        result = {"error": traceback.format_exc()}
    partial = folder / "run.json.partial"
    partial.write_text(json.dumps(result))
    partial.rename(folder / "run.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
