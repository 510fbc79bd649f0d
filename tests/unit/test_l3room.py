"""Room for L3 on its filesystem (kvstore/daemon/l3room.py): the reserve, the capacity that
fits (the preflight's arithmetic and its message), and the admission switch's decisions, with
the free space and the clock handed in. The daemon running them against real filesystems is
tests/integration/test_l3_preflight.py."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.core.index import Index
from kvstore.core.pages import PageAllocator
from kvstore.core.placement import Placement
from kvstore.daemon.l3room import (
    CHECK_INTERVAL_S,
    LOW_SPACE,
    MANIFEST_RECORD_BYTES,
    NO_ROOM,
    L3Admission,
    Space,
    capacity_problem,
    fitting_capacity_bytes,
    manifest_bytes,
    reserve_bytes,
    setting_size,
)
from kvstore.tier import Tier
from kvstore.units import GiB, KiB, MiB, TiB, parse_size

PAGE = 64 * KiB
FOLDER = Path("/var/lib/kvstore/l3")

# --- the reserve ----------------------------------------------------------------------------


@pytest.mark.parametrize(("size_bytes", "reserve"), [
    (200 * MiB, 50 * MiB),  # small: a quarter, not the 1 GiB floor
    (4 * GiB, 1 * GiB),  # where the quarter meets the floor
    (8 * GiB, 1 * GiB),  # the floor (10% would be 819 MiB)
    (10 * GiB, 1 * GiB),  # where 10% meets the floor
    (100 * GiB, 10 * GiB),  # 10%
    (4 * TiB, int(0.4 * TiB)),  # 10%, no ceiling
])
def test_the_reserve_is_a_tenth_at_least_1_gib_at_most_a_quarter(size_bytes: int,
                                                                 reserve: int) -> None:
    assert reserve_bytes(size_bytes) == reserve


def test_a_configured_reserve_replaces_the_automatic_one() -> None:
    assert reserve_bytes(252 * GiB, 256 * MiB) == 256 * MiB  # under the automatic 25 GiB
    assert reserve_bytes(200 * MiB, 150 * MiB) == 150 * MiB  # over the automatic quarter
    space = Space(252 * GiB, 25 * GiB)  # a disk 90% full: no L3 fits beside 25.2 GiB
    assert fitting_capacity_bytes(space, 0, PAGE, 0) == 0
    assert 24 * GiB < fitting_capacity_bytes(space, 0, PAGE, 0, 256 * MiB) < 25 * GiB
    problem = capacity_problem(25 * GiB, PAGE, 0, space, 0, FOLDER, 256 * MiB)
    assert "leaves 256.0 MiB of it free (the L3 reserve: nvme.reserve_bytes)" in problem
    assert "nvme.reserve_bytes sets it" in capacity_problem(25 * GiB, PAGE, 0, space, 0, FOLDER)


# --- what fits ------------------------------------------------------------------------------


def test_the_file_and_its_largest_manifest_fit_beside_the_reserve() -> None:
    # 100 GiB filesystem, 50 GiB free, reserve 10 GiB: 40 GiB for the file and its manifest.
    space = Space(100 * GiB, 50 * GiB)
    journal_records = 1000
    fits = fitting_capacity_bytes(space, 0, PAGE, journal_records)
    assert fits % PAGE == 0
    used = fits + manifest_bytes(fits // PAGE, journal_records)
    assert used <= 40 * GiB < used + PAGE + 2 * MANIFEST_RECORD_BYTES  # one page more: over
    assert 39.6 * GiB < fits < 40 * GiB  # the manifest costs 2 records a page: under 1%


def test_an_existing_l3_file_counts_as_room() -> None:
    # 10 GiB filesystem, 1.5 GiB free, reserve 1 GiB, and 4 GiB already in our L3 file.
    # Each page costs PAGE plus two manifest records (a snapshot's, and its next copy's).
    space = Space(10 * GiB, GiB + GiB // 2)
    per_page = PAGE + 2 * MANIFEST_RECORD_BYTES
    assert fitting_capacity_bytes(space, 0, PAGE, 0) == GiB // 2 // per_page * PAGE
    assert fitting_capacity_bytes(space, 4 * GiB, PAGE, 0) == (4 * GiB + GiB // 2) \
        // per_page * PAGE
    # A full disk still takes the file it holds, at the size it has: reusing takes nothing.
    full = Space(10 * GiB, 0)
    assert fitting_capacity_bytes(full, 0, PAGE, 0) == 0
    assert fitting_capacity_bytes(full, 4 * GiB, PAGE, 0) == 4 * GiB
    assert capacity_problem(4 * GiB, PAGE, 100_000, full, 4 * GiB, FOLDER) == ""


def test_a_capacity_that_fits_is_no_problem() -> None:
    space = Space(100 * GiB, 60 * GiB)
    assert capacity_problem(40 * GiB, PAGE, 100_000, space, 0, FOLDER) == ""


def test_a_capacity_too_large_is_refused_naming_the_setting_free_space_and_a_value_that_fits(
) -> None:
    # The case: 1 GiB asked on a 300 MB filesystem.
    space = Space(300 * 10**6, 290 * 10**6)
    problem = capacity_problem(GiB, PAGE, 100_000, space, 0, FOLDER)
    assert problem.startswith("nvme.capacity_bytes (1.0 GiB")
    assert "276.6 MiB free of 286.1 MiB" in problem and str(FOLDER) in problem
    assert "leaves 71.5 MiB of it free" in problem  # a quarter of the filesystem
    fix = problem.split("set nvme.capacity_bytes=")[1].split()[0]
    assert fix == "179MiB"
    assert capacity_problem(parse_size(fix), PAGE, 100_000, space, 0, FOLDER) == ""
    assert capacity_problem(parse_size(fix) + MiB, PAGE, 100_000, space, 0, FOLDER) != ""


def test_when_nothing_fits_the_message_says_so() -> None:
    problem = capacity_problem(GiB, PAGE, 0, Space(10 * GiB, GiB // 2), 0, FOLDER)
    assert "no L3 fits there" in problem and "nvme.enabled=false" in problem
    assert "set nvme.capacity_bytes=" not in problem


@given(size=st.integers(16 * MiB, 64 * TiB), free_share=st.floats(0, 1),
       reusable_share=st.floats(0, 0.5), page_shift=st.integers(12, 22),
       journal_records=st.integers(0, 200_000))
def test_the_value_suggested_always_fits(size: int, free_share: float, reusable_share: float,
                                        page_shift: int, journal_records: int) -> None:
    page = 1 << page_shift
    space = Space(size, int(size * free_share))
    reusable = int(size * reusable_share)
    problem = capacity_problem(size, page, journal_records, space, reusable, FOLDER)
    if "set nvme.capacity_bytes=" in problem:
        fix = parse_size(problem.split("set nvme.capacity_bytes=")[1].split()[0])
        assert fix >= page
        assert capacity_problem(fix, page, journal_records, space, reusable, FOLDER) == ""


@pytest.mark.parametrize(("size_bytes", "text"), [
    (150 * MiB + 12345, "150MiB"), (999 * KiB, "999KiB"), (250 * GiB + 5 * MiB, "250GiB"),
    (99 * GiB + 7 * MiB, "101383MiB"),
])
def test_setting_sizes_round_down_to_a_value_the_config_reads(size_bytes: int,
                                                              text: str) -> None:
    assert setting_size(size_bytes) == text
    assert parse_size(text) <= size_bytes


# --- the admission switch -------------------------------------------------------------------

FS = 100 * GiB  # reserve 10 GiB: off under it, on again from 11 GiB free


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def placement() -> Placement:
    allocators = {Tier.DRAM: PageAllocator(4), Tier.NVME: PageAllocator(4)}
    index = Index(allocators, {t: PAGE for t in allocators})
    return Placement(index, allocators, admit_min_seen=2)


@pytest.fixture
def gate(placement: Placement, clock: Clock) -> L3Admission:
    return L3Admission(FOLDER, placement, clock)


def test_free_space_under_the_reserve_turns_admission_off_once_and_tells_the_planner(
        gate: L3Admission, placement: Placement, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvstore.daemon.l3room"):
        gate.check(Space(FS, 20 * GiB))
        assert gate.enabled and placement.admitting
        gate.check(Space(FS, 9 * GiB))
        gate.check(Space(FS, 8 * GiB))
    assert not gate.enabled and gate.state.reason == LOW_SPACE
    assert gate.state.free_bytes == 8 * GiB and gate.state.reserve_bytes == 10 * GiB
    assert not placement.admitting and placement.admit_min_seen == 2  # the rule stays
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "L3 admission off" in warnings[0].getMessage()


def test_a_configured_reserve_is_what_the_switch_checks(placement: Placement,
                                                        clock: Clock) -> None:
    gate = L3Admission(FOLDER, placement, clock, configured_reserve=GiB)
    gate.check(Space(FS, 2 * GiB))  # under the automatic 10 GiB, over the 1 GiB set
    assert gate.enabled and gate.state.reserve_bytes == GiB
    gate.check(Space(FS, GiB - 1))
    assert not gate.enabled and gate.state.reason == LOW_SPACE


def test_admission_comes_back_only_with_a_tenth_more_than_the_reserve_free(
        gate: L3Admission, placement: Placement) -> None:
    gate.check(Space(FS, 9 * GiB))
    gate.check(Space(FS, 10 * GiB))  # at the reserve: still off (no flapping at the edge)
    assert not gate.enabled
    gate.check(Space(FS, 11 * GiB))
    assert gate.enabled and gate.state.reason == "" and placement.admitting
    gate.check(Space(FS, 10 * GiB))  # on stays on down to the reserve
    assert gate.enabled


def test_a_write_with_no_room_turns_it_off_for_a_hold_off_that_doubles(
        gate: L3Admission, clock: Clock) -> None:
    full = OSError(errno.ENOSPC, "No space left on device")
    assert gate.no_room(full)
    assert not gate.enabled and gate.state.reason == NO_ROOM
    clock.now += 9
    gate.check(Space(FS, 50 * GiB))  # statvfs shows room (a quota, inodes): too soon
    assert not gate.enabled
    clock.now += 1
    gate.check(Space(FS, 50 * GiB))
    assert gate.enabled  # 10 s after the first failure
    assert gate.no_room(full)  # the second in a row: 20 s
    clock.now += 19
    gate.check(Space(FS, 50 * GiB))
    assert not gate.enabled
    clock.now += 1
    gate.check(Space(FS, 50 * GiB))
    assert gate.enabled
    gate.wrote()  # a write went through: the next failure holds 10 s again
    assert gate.no_room(full)
    clock.now += 10
    gate.check(Space(FS, 50 * GiB))
    assert gate.enabled


def test_other_write_errors_leave_admission_on(gate: L3Admission) -> None:
    assert not gate.no_room(OSError(errno.EIO, "Input/output error"))
    assert gate.enabled
    assert gate.no_room(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not gate.enabled


def test_low_space_is_the_reason_while_both_hold(gate: L3Admission, clock: Clock) -> None:
    gate.check(Space(FS, 5 * GiB))
    gate.no_room(OSError(errno.ENOSPC, "No space left on device"))
    assert gate.state.reason == LOW_SPACE
    clock.now += 600
    gate.check(Space(FS, 50 * GiB))
    assert gate.enabled


def test_the_free_space_is_polled_at_most_once_a_second(
        placement: Placement, clock: Clock, tmp_path: Path) -> None:
    folder = tmp_path / "l3"
    folder.mkdir()
    gate = L3Admission(folder, placement, clock)
    gate.poll()
    assert gate.state.free_bytes > 0 and gate.state.reserve_bytes > 0
    folder.rmdir()
    gate.poll()  # not due: no statvfs, so the missing folder goes unnoticed
    clock.now += CHECK_INTERVAL_S
    with pytest.raises(FileNotFoundError):
        gate.poll()  # due: the folder is gone, which the mover reports by failing


def test_without_l3_the_switch_is_inert(placement: Placement) -> None:
    gate = L3Admission(None, placement)
    gate.poll()
    assert gate.enabled and gate.state.free_bytes == -1
