"""Shared-memory segments under /dev/shm: create, attach, share bytes, close, unlink; host id."""

from __future__ import annotations

import logging
import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.shm import SHM_DIR, Segment, attach_segment, check_shm_name, create_segment, host_id

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")


@pytest.fixture
def name() -> Iterator[str]:
    name = f"kvstore-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    path = SHM_DIR / name
    if path.exists():
        path.unlink()


def test_create_write_attach_read(name: str) -> None:
    with create_segment(name, 1 << 20) as owner:
        assert owner.size_bytes == 1 << 20 and owner.name == name
        owner.buf[4096:4101] = b"hello"
        with attach_segment(name) as reader:
            assert reader.size_bytes == 1 << 20
            assert reader.buf[4096:4101] == b"hello"
            reader.view()[0:3] = b"abc"  # writes go both ways
        assert bytes(owner.buf[0:3]) == b"abc"
        owner.unlink()


def test_segment_file_is_private(name: str) -> None:
    old_umask = os.umask(0)  # a permissive umask must not widen the mode
    try:
        seg = create_segment(name, 4096)
    finally:
        os.umask(old_umask)
    try:
        assert stat.S_IMODE(os.stat(SHM_DIR / name).st_mode) == 0o600
    finally:
        seg.close()
        seg.unlink()


def test_unlink_removes_the_file_and_tolerates_a_second_call(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    seg = create_segment(name, 4096)
    seg.unlink()
    assert not (SHM_DIR / name).exists()
    seg.buf[0] = 7  # an unlinked segment stays mapped
    assert seg.buf[0] == 7
    with caplog.at_level(logging.INFO, logger="kvstore.shm"):
        seg.unlink()
    assert "already unlinked" in caplog.text
    seg.close()


def test_create_refuses_an_existing_name(name: str) -> None:
    with create_segment(name, 4096):
        with pytest.raises(FileExistsError, match="already exists"):
            create_segment(name, 4096)


def test_attach_missing_segment(name: str) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        attach_segment(name)


def test_create_rejects_bad_sizes_and_leaves_no_file(name: str) -> None:
    for size in (0, -1):
        with pytest.raises(ValueError, match="size_bytes"):
            create_segment(name, size)
    assert not (SHM_DIR / name).exists()


def test_create_refuses_more_than_dev_shm_holds(name: str) -> None:
    st = os.statvfs(SHM_DIR)
    with pytest.raises(OSError, match="does not fit"):
        create_segment(name, st.f_blocks * st.f_frsize * 2 + (1 << 30))
    assert not (SHM_DIR / name).exists()


@pytest.mark.parametrize(
    "bad", ["", "a/b", "../x", ".", "..", "x" * 201, "sp ace", "ünï", "a\x00b"]
)
def test_name_validation(bad: str) -> None:
    with pytest.raises(ValueError, match="shm_name"):
        check_shm_name(bad)
    with pytest.raises(ValueError, match="shm_name"):
        create_segment(bad, 4096)
    with pytest.raises(ValueError, match="shm_name"):
        attach_segment(bad)


def test_good_names() -> None:
    for good in ("kvstore-50051-123", "a.b_c-d", "x" * 200):
        assert check_shm_name(good) == good


def test_close_with_live_views_keeps_mapping_and_logs(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    seg = create_segment(name, 4096)
    view = seg.view()
    with caplog.at_level(logging.DEBUG, logger="kvstore.shm"):
        seg.close()
    assert "exported views" in caplog.text
    assert not seg.closed
    view[0] = 9  # still valid memory
    assert seg.buf[0] == 9
    view.release()
    seg.close()
    assert seg.closed
    seg.close()  # idempotent
    seg.unlink()


def test_segment_repr_and_path(name: str) -> None:
    with create_segment(name, 4096) as seg:
        assert isinstance(seg, Segment)
        assert seg.path == Path("/dev/shm") / name
        assert "open" in repr(seg)
    assert "closed" in repr(seg)


def test_host_id_is_the_boot_and_the_ipc_namespace() -> None:
    hid = host_id()
    assert hid == host_id()
    # The node's boot and this process's IPC namespace (what decides the /dev/shm it sees).
    assert hid.endswith(os.readlink("/proc/self/ns/ipc")) and hid.count(":") >= 2
    if Path("/proc/sys/kernel/random/boot_id").exists():
        boot_id, _, _ = hid.partition(":")
        assert len(boot_id) == 36


def test_stale_segment_of_a_dead_creator_is_removed_and_a_live_one_kept(name: str) -> None:
    """A segment whose creator died without unlinking (crash, SIGKILL) is reclaimed; one
    whose creator is alive keeps its flock and is left alone."""
    import subprocess
    import sys

    from kvstore.shm import remove_stale_segments

    dead = name
    code = (
        "import os; from kvstore.shm import create_segment; "
        f"create_segment({dead!r}, 65536); os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert (SHM_DIR / dead).exists()
    live = create_segment(f"{name}-live", 65536)
    try:
        removed = remove_stale_segments([dead, live.name, "kvstore-no-such"], min_age_s=0)
        assert removed == [dead]
        assert not (SHM_DIR / dead).exists()
        assert live.path.exists()
    finally:
        live.close()
        live.unlink()
