"""`kvstore-admin` on a terminal (a pseudo-terminal from python's pty module, 200x100): `stats
--watch` redraws one table in place as the daemon's figures change, and a prewarm the daemon
refuses prints its one error line and no progress bar."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable

import pytest

from kvstore.client import KVStoreClient
from kvstore.tools.testing import Daemon
from tests.conftest import REPO

NS = "admin-watch"
PAGE = 64 << 10
_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r")


class Terminal:
    """A kvstore-admin whose stdin, stdout and stderr are one pseudo-terminal; `screen` is
    all it wrote, `text` the same without terminal control sequences."""

    def __init__(self, *args: str) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 100, 200, 0, 0))
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        env.update(TERM="xterm-256color", COLUMNS="200", LINES="100")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstore.tools.admin", *args],
                                     stdin=slave, stdout=slave, stderr=slave, cwd=REPO,
                                     env=env, close_fds=True)
        os.close(slave)
        self._master = master
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self._master, 65536)
            except OSError:  # EIO: the last writer closed the terminal
                return
            if not chunk:
                return
            self._chunks.append(chunk)

    @property
    def screen(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")

    @property
    def text(self) -> str:
        return _ESCAPE.sub("", self.screen)

    def wait_for(self, check: Callable[[str], bool], what: str, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not check(self.text):
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{self.text}"
            time.sleep(0.05)

    def finish(self, timeout_s: float = 20.0) -> int:
        code = self.proc.wait(timeout_s)
        self._reader.join(5)
        os.close(self._master)
        return code


@pytest.fixture
def daemon(whole_daemon: Daemon) -> Daemon:
    """The table shows the whole daemon: the shared one for such tests (an 8 MiB L2,
    tests/conftest.py), emptied before each test."""
    return whole_daemon


def dram_objects(text: str) -> list[int]:
    """The dram row's objects in every frame drawn so far, in order."""
    rows = re.findall(r"│ dram +│ yes +│ shm +│(?:[^│]*│){3} *([\d,]+) │", text)
    return [int(n.replace(",", "")) for n in rows]


def test_stats_watch_redraws_the_table_in_place(daemon: Daemon) -> None:
    term = Terminal("--target", daemon.target, "stats", "--watch", "0.2")
    try:
        term.wait_for(lambda t: dram_objects(t)[-1:] == [0], "the first frame")
        with KVStoreClient(daemon.target, NS, shared_memory=False) as kv:
            for i, total in ((0, 2), (2, 4)):  # two changes, each seen in a later frame
                keys = [bytes([i + j + 1]) * 32 for j in range(2)]
                kv.put(keys, [b"v" * PAGE] * 2, independent=True)
                term.wait_for(lambda t, n=total: dram_objects(t)[-1:] == [n], f"{total} objects")
            kv.evict(all=True, namespace="")
    finally:
        term.proc.send_signal(signal.SIGINT)
        code = term.finish()
    seen = dram_objects(term.text)
    assert seen == sorted(seen) and {0, 2, 4} <= set(seen), seen
    # One table redrawn where it stands (cursor up, erase line), not frames printed in turn.
    assert "\x1b[1A" in term.screen and "\x1b[2K" in term.screen
    assert code == 0, term.text


def test_a_refused_prewarm_draws_no_progress_bar(daemon: Daemon) -> None:
    term = Terminal("--target", daemon.target, "prewarm", "--bytes", "1MiB")
    code = term.finish()
    assert code == 1
    assert term.text.strip() == "error: FAILED_PRECONDITION: L4 is off: set remote.url"
