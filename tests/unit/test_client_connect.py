"""The client's connect to the daemon's Unix socket waits for room in a full accept queue
(a reconnect flood) up to its timeout, instead of failing at once with EAGAIN."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from kvstore.client._attach import connect
from kvstore.client._pause import TryLater


def _full_queue(path: Path) -> tuple[socket.socket, list[socket.socket]]:
    """A listening socket that accepts nothing, its queue filled by connections of ours."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(0)
    queued = []
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(str(path))
        except BlockingIOError:
            sock.close()
            return server, queued
        queued.append(sock)


def test_connect_waits_for_a_full_queue_to_drain(tmp_path: Path) -> None:
    path = tmp_path / "s"
    server, queued = _full_queue(path)
    try:
        def drain() -> None:
            time.sleep(0.3)
            server.accept()[0].close()

        threading.Thread(target=drain, daemon=True).start()
        started = time.monotonic()
        sock = connect(str(path), 5.0, "test")
        waited = time.monotonic() - started
        sock.close()
        assert 0.2 < waited < 4.0  # it waited for the accept, not for its whole timeout
    finally:
        for s in queued:
            s.close()
        server.close()


def test_connect_to_a_queue_that_stays_full_passes_after_its_timeout(tmp_path: Path) -> None:
    path = tmp_path / "s"
    server, queued = _full_queue(path)
    try:
        started = time.monotonic()
        with pytest.raises(TryLater) as caught:
            connect(str(path), 0.3, "test")
        assert time.monotonic() - started >= 0.25
        assert caught.value.ticket_unused
    finally:
        for s in queued:
            s.close()
        server.close()
