"""Client faults are logged on one line each, at most a few a second, and the lines left out
are counted in the next one (kvstore.daemon.faults.FaultLog, with a hand-moved clock)."""

from __future__ import annotations

import logging

import grpc
import pytest

from kvstore.daemon.faults import FaultLog


def test_a_barrage_of_faults_logs_a_few_lines_and_counts_the_rest(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    faults = FaultLog(per_s=5, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="kvstore.daemon.server"):
        for _ in range(1000):
            faults.fault("Lookup", "ipv4:10.0.0.9:5000", grpc.StatusCode.INVALID_ARGUMENT,
                         "keys[0]: 3 bytes,\nnot 32")
        now[0] += 0.2
        faults.fault("Put", "ipv4:10.0.0.9:5000", grpc.StatusCode.RESOURCE_EXHAUSTED, "cap")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "client fault: Lookup from ipv4:10.0.0.9:5000: INVALID_ARGUMENT keys[0]: 3 bytes, "
        "not 32",
        "client fault: Put from ipv4:10.0.0.9:5000: RESOURCE_EXHAUSTED cap "
        "(999 more client faults not logged)",
    ]
    assert all(r.levelno == logging.INFO and not r.exc_info for r in caplog.records)
