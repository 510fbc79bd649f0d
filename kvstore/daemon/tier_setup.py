"""Opening the tiers a config asks for: L1 HBM, L2 DRAM, L3 NVMe and its manifest, L4 Redis.

Each failure that an operator can fix is a StartupError naming the setting: L1 demanded on
a host without CUDA, an L3 folder another daemon holds, an L3 file larger than its
filesystem can hold beside the reserve (`kvstore.daemon.l3room`, checked before it is
preallocated), an L3 file that cannot be created.

L3 in a folder the operator chose (nvme.dir) persists: a restarted daemon re-adopts what it
holds. With nvme.dir unset, L3 is scratch in a per-port folder under $XDG_CACHE_HOME
(`default_l3_dir`): the daemon removes it when it stops, and a daemon starting with the
default removes the scratch folders that daemons killed before their stop left behind (those
whose lock nobody holds), so a bare `kvstore-server` leaves nothing on disk however many
ports it ran on.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.core.errors import StartupError
from kvstore.core.tenants import Tenant, TenantsError, split_tier
from kvstore.daemon.config import Config
from kvstore.daemon.l3room import allocated_bytes, capacity_problem, space_of
from kvstore.daemon.manifest import Manifest
from kvstore.extents import Arena
from kvstore.tier import Tier
from kvstore.tiers.base import SlotTier
from kvstore.tiers.dram import DramTier
from kvstore.tiers.redis_pool import RedisPool
from kvstore.units import format_size

log = logging.getLogger(__name__)

L3_FILE = "l3.data"
LOCK_FILE = "lock"
NVIDIA_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl")


@dataclass
class OpenTiers:
    """The tiers a daemon opened, with the L3 manifest and folder; close() closes them all."""

    tiers: dict[Tier, SlotTier] = field(default_factory=dict)
    manifest: Manifest | None = None
    remote: RedisPool | None = None  # L4
    l3_dir: Path | None = None
    #: The L3 folder is the default scratch one (nvme.dir unset): removed at close.
    l3_scratch: bool = False
    _stack: ExitStack = field(default_factory=ExitStack)

    def close(self) -> None:
        """Close what was opened (the tiers and the lock on the L3 folder), in reverse order."""
        self._stack.close()


def l3_dir(config: Config) -> Path:
    """nvme.dir, or the default scratch folder (default_l3_dir)."""
    if config.nvme.dir:
        return Path(config.nvme.dir).expanduser()
    return default_l3_dir(config.server.port)


def default_l3_dir(port: int) -> Path:
    """$XDG_CACHE_HOME/kvstore/<port> (~/.cache/kvstore/<port>): one folder per port, so
    daemons on other ports (each holding its folder's lock) start beside it with no
    settings. Scratch: removed when its daemon stops (see the module docstring)."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "kvstore" / str(port)


def open_tiers(config: Config, dram_arenas: Sequence[Arena] | None = None) -> OpenTiers:
    """Every enabled tier, opened; on failure whatever was opened is closed again. With
    dram_arenas, L2 is one memfd per tenant's arena instead of one named segment."""
    opened = OpenTiers()
    with ExitStack() as undo:
        undo.callback(opened.close)
        if config.dram.enabled:
            dram = DramTier(
                config.dram.capacity_bytes, config.dram.page_size_bytes,
                config.dram.shm_name or f"kvstore-{config.server.port}-{secrets.token_hex(4)}",
                config.dram.pin_memory, dram_arenas,
            )
            opened._stack.callback(dram.close)
            opened.tiers[Tier.DRAM] = dram
        _open_hbm(config, opened)
        if config.nvme.enabled:
            if not config.dram.enabled:
                raise StartupError("nvme.enabled needs the L2 tier (dram.enabled=true): blocks "
                                   "reach L3 through L2; set nvme.enabled=false")
            _open_nvme(config, opened)
        if config.remote.url:
            _open_remote(config, opened)
        undo.pop_all()
    return opened


def _open_hbm(config: Config, opened: OpenTiers) -> None:
    h = config.hbm
    if h.mode == "off":
        return
    if h.mode == "auto" and not any(Path(p).exists() for p in NVIDIA_DRIVER_FILES):
        # No driver: say so without importing torch, which costs a CPU host seconds a start.
        log.info("L1 HBM tier off: no NVIDIA driver")
        return
    from kvstore.tiers.hbm import HbmTier, HbmUnavailable, cuda_unavailable_reason

    reason = cuda_unavailable_reason(h.device)
    if reason is not None:
        if h.mode == "on":
            raise StartupError(f"hbm.mode=on but the L1 tier cannot start: {reason}; "
                               "set hbm.mode=auto or off")
        log.info("L1 HBM tier off: %s", reason)
        return
    if Tier.DRAM not in opened.tiers:
        raise StartupError("the L1 tier copies through L2: set dram.enabled=true or hbm.mode=off")
    try:
        hbm = HbmTier(h.capacity_bytes, h.fraction_of_free, h.page_size_bytes, h.device)
    except (HbmUnavailable, ValueError) as exc:
        raise StartupError(f"cannot start the L1 tier: {exc}") from exc
    opened._stack.callback(hbm.close)
    opened.tiers[Tier.HBM] = hbm


def _open_nvme(config: Config, opened: OpenTiers) -> None:
    from kvstore.tiers.nvme import NvmeTier

    n = config.nvme
    folder = l3_dir(config)
    lock_fd = _lock_folder(folder)
    opened._stack.callback(os.close, lock_fd)
    if not n.dir:
        # Runs before the lock is released (callbacks run last-in first-out), after the
        # tier and the manifest registered below are closed.
        opened._stack.callback(_remove_scratch, folder)
        opened.l3_scratch = True
        _remove_stale_scratch(folder)
    _check_room(config, folder)
    try:
        nvme = NvmeTier(folder / L3_FILE, n.capacity_bytes, n.page_size_bytes, n.backend,
                        n.io_threads)
    except (OSError, RuntimeError, ValueError) as exc:
        raise StartupError(f"cannot open the L3 file in {folder}: {exc} "
                           "(nvme.dir, nvme.capacity_bytes, nvme.backend)") from exc
    opened._stack.callback(nvme.close)
    opened.tiers[Tier.NVME] = nvme
    manifest = Manifest(folder, nvme.page_size_bytes, nvme.num_pages, sync=n.sync)
    opened._stack.callback(manifest.close)
    opened.manifest = manifest
    opened.l3_dir = folder


#: How often a start retries taking a folder whose lock file was removed under it.
LOCK_ATTEMPTS = 3


def _lock_folder(folder: Path) -> int:
    """Make folder and hold its lock file (flock, exclusive): the descriptor. A daemon
    sweeping stale scratch folders may remove the folder between our open and our flock;
    a lock on a file no longer at its path holds nothing, so the start tries again."""
    for _ in range(LOCK_ATTEMPTS):
        try:
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            lock_fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StartupError(f"cannot use the L3 folder {folder}: {exc.strerror} "
                               "(nvme.dir)") from exc
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise StartupError(f"the L3 folder {folder} is in use by another kvstore-server; "
                               "give each daemon its own nvme.dir") from None
        if _still_at(lock_fd, folder / LOCK_FILE):
            return lock_fd
        os.close(lock_fd)
    raise StartupError(f"cannot use the L3 folder {folder}: it was removed {LOCK_ATTEMPTS} "
                       "times while this daemon started (nvme.dir)")


def _still_at(fd: int, path: Path) -> bool:
    """The file open as fd is the one at path."""
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _remove_scratch(folder: Path) -> None:
    """Remove the default L3 folder of this daemon (it holds the folder's lock), and the
    kvstore folder above it once it is empty. A failure is logged: the stop goes on."""
    try:
        shutil.rmtree(folder)
    except OSError as exc:
        log.warning("cannot remove the scratch L3 folder %s: %s", folder, exc)
        return
    log.info("removed the scratch L3 folder %s (set nvme.dir to keep L3 across restarts)",
             folder)
    try:
        folder.parent.rmdir()
    except OSError as exc:  # another daemon's folder is beside it (or something else): keep it
        log.debug("kept %s: %s", folder.parent, exc)


def _remove_stale_scratch(folder: Path) -> None:
    """Remove the default L3 folders beside folder that a daemon killed before its stop
    left: those with a lock file nobody holds. Each is removed while this daemon holds its
    lock, so a daemon starting on that port meanwhile is refused ("in use") rather than
    having its folder removed under it. A folder without a lock file is not one a daemon
    made, and is left alone."""
    try:
        candidates = [d for d in folder.parent.iterdir()
                      if d != folder and d.name.isdigit() and d.is_dir()]
    except OSError:
        return
    for stale in candidates:
        try:
            fd = os.open(stale / LOCK_FILE, os.O_RDWR)
        except OSError:
            continue  # no lock file: not a daemon's folder, or one just being made
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            size_bytes = allocated_bytes(stale / L3_FILE)
            shutil.rmtree(stale)
            log.info("removed the scratch L3 folder %s (%s) that a killed daemon left",
                     stale, format_size(size_bytes))
        except BlockingIOError:
            log.debug("scratch L3 folder %s belongs to a running daemon: kept", stale)
        except OSError as exc:
            log.warning("cannot remove the stale scratch L3 folder %s: %s", stale, exc)
        finally:
            os.close(fd)


def _check_room(config: Config, folder: Path) -> None:
    """Refuse an L3 file that would take its filesystem into the reserve, before any of it
    is allocated; an L3 file already there (ours: we hold the folder's lock) is reused in
    place, so what it holds counts as room."""
    n = config.nvme
    try:
        space = space_of(folder)
        reusable_bytes = allocated_bytes(folder / L3_FILE)
    except OSError as exc:
        raise StartupError(f"cannot check the free space of the L3 folder {folder}: "
                           f"{exc.strerror} (nvme.dir)") from exc
    if not space.size_bytes:  # some FUSE and network filesystems report no sizes at all
        log.warning("L3 folder %s: its filesystem reports no size; the free space for "
                    "nvme.capacity_bytes is not checked", folder)
        return
    problem = capacity_problem(n.capacity_bytes, n.page_size_bytes, n.compact_after_records,
                               space, reusable_bytes, folder, n.reserve_bytes)
    if problem:
        raise StartupError(problem + ("" if n.dir else _other_default_folders(folder)))


def _other_default_folders(folder: Path) -> str:
    """A hint naming what the other per-port default L3 folders beside folder hold, on the
    same filesystem (daemons that ran on other ports left them), or ""."""
    try:
        device = folder.stat().st_dev
        others = [(d, allocated_bytes(d / L3_FILE)) for d in folder.parent.iterdir()
                  if d != folder and d.name.isdigit() and d.is_dir()
                  and d.stat().st_dev == device]
    except OSError:
        return ""
    others = [(d, size_bytes) for d, size_bytes in others if size_bytes]
    if not others:
        return ""
    return (f"; {len(others)} other L3 folders in {folder.parent} hold "
            f"{format_size(sum(s for _, s in others))} (left by daemons on other ports: "
            "remove those no daemon uses)")


def _open_remote(config: Config, opened: OpenTiers) -> None:
    """The L4 pool. Redis itself may be down now: that is L4's degraded mode, not a failed
    start (kvstore.daemon.remote retries with backoff)."""
    if Tier.DRAM not in opened.tiers:
        raise StartupError("remote.url needs the L2 tier (dram.enabled=true): blocks fetched "
                           "from L4 land in L2")
    r = config.remote
    try:
        pool = RedisPool(r.url, cluster=r.cluster, username=r.username, password=r.password,
                         tls_ca_file=r.tls_ca_file, timeout_s=r.timeout_s)
    except (ValueError, OSError) as exc:
        raise StartupError(f"cannot use remote.url: {exc} (remote.url, remote.cluster, "
                           "remote.tls_ca_file)") from exc
    opened._stack.callback(pool.close)
    opened.remote = pool


def split_arenas(tier: str, num_pages: int, page_size: int,
                 holders: list[Tenant]) -> list[Arena]:
    """A tier's pages split into the tenants' arenas; a split that cannot be made stops
    the start, naming the tenants file."""
    try:
        return split_tier(tier, num_pages, page_size, holders)
    except TenantsError as exc:
        raise StartupError(f"auth.tenants_file: {exc}") from None
