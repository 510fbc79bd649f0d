"""GPU benchmarks, each figure against its baseline in the same run:

- `l2_pinned_h2d`: host-to-device copy bandwidth from the pinned L2 segment vs the same copy
  from ordinary pageable memory (cupy).
- `l2_to_l1`: `HbmTier.write` of 2 MiB objects, in batches of 32, from a pinned `DramTier`
  (the store's promotion path) vs raw `copy_(non_blocking=True)` of the same 2 MiB pieces from
  the same pinned bytes on one stream, synchronized per batch as the tier does; at least
  1 GiB moved per measurement (target >= 0.9x).
  Both figures fail, rather than time pageable memory, when the segment could not be pinned.
- `kvikio_read`: kvikio `CuFile.read` of a 1 GiB file into device memory vs `os.preadv` of
  the same file into pinned host memory; the file is dropped from the page cache
  (POSIX_FADV_DONTNEED) before every read. Skipped when kvikio is not installed.

Prints one `bench <name>: <ours> GB/s vs <baseline> <b> GB/s = <ratio>x` line per figure, or
`bench <name>: skipped (reason)`; without CUDA every figure is skipped and the exit status is
0; a figure that fails prints `bench <name>: failed (error)`, the others still run, and the
exit status is 1. `--json` adds one JSON line: {"figures": ..., "skipped": ..., "failed": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore.extents import PageRun
from kvstore.tiers.base import Transfer
from kvstore.tiers.dram import DramTier
from kvstore.tiers.hbm import HbmTier, cuda_unavailable_reason
from kvstore.units import MiB

OBJECT_BYTES = 2 * MiB
BATCH_OBJECTS = 32


class Skip(Exception):
    """This figure cannot run here; the message says why."""


def _figure(name: str, ours: float, base_name: str, base: float, target: str = "",
            **extra: Any) -> dict[str, Any]:
    suffix = f" (target {target})" if target else ""
    print(f"bench {name}: {ours:.2f} GB/s vs {base_name} {base:.2f} GB/s = "
          f"{ours / base:.2f}x{suffix}", flush=True)
    return {"ours": ours, "baseline_name": base_name, "baseline": base, "unit": "GB/s",
            "ratio": ours / base, "target": target, **extra}


def _gbps(nbytes: int, run: Callable[[], None], repeats: int) -> float:
    """Bandwidth of the median of `repeats` timed runs (after one warm-up)."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def _fit_shm(size_bytes: int, name: str) -> int:
    """size_bytes, or less (whole 2 MiB objects) when /dev/shm has less room: containers
    often mount a small /dev/shm."""
    room = int(shutil.disk_usage("/dev/shm").free * 0.8) // OBJECT_BYTES * OBJECT_BYTES
    if room >= size_bytes:
        return size_bytes
    if room < 16 * OBJECT_BYTES:
        raise Skip(f"/dev/shm has {room >> 20} MiB free; {name} needs at least 32 MiB")
    print(f"note: {name}: /dev/shm is small; using a {room >> 20} MiB L2 segment",
          file=sys.stderr)
    return room


def _require_pinned(tier: DramTier, name: str) -> None:
    """A figure about pinned memory must not quietly time pageable memory instead."""
    if not tier.pinned:
        raise RuntimeError(f"{name}: the L2 segment is not pinned (cudaHostRegister failed: "
                           "see the warning above), so there is no pinned copy to measure")


# --- l2_pinned_h2d ---------------------------------------------------------------------------


def _h2d_gbps(cupy: Any, host: np.ndarray, repeats: int) -> float:
    device = cupy.empty(host.nbytes, dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)

    def run() -> None:
        device.set(host, stream=stream)
        stream.synchronize()

    return _gbps(host.nbytes, run, repeats)


def bench_l2_pinned_h2d(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import cupy  # type: ignore[import-not-found]

        if not cupy.cuda.runtime.getDeviceCount():
            raise Skip("no CUDA: cupy sees no device")
    except ImportError as exc:
        raise Skip(f"cupy is not installed: {exc}") from exc
    size = _fit_shm(args.size, "l2_pinned_h2d")
    tier = DramTier(size, 64 << 10, f"kvstore-gpubench-{secrets.token_hex(4)}", True)
    try:
        _require_pinned(tier, "l2_pinned_h2d")
        pinned = tier._buf[:size]
        pageable = np.ones(size, dtype=np.uint8)
        ours = _h2d_gbps(cupy, pinned, args.repeats)
        base = _h2d_gbps(cupy, pageable, args.repeats)
        del pinned
    finally:
        tier.close()
    return _figure("l2_pinned_h2d", ours, "pageable", base, size_bytes=size)


# --- l2_to_l1 --------------------------------------------------------------------------------


def bench_l2_to_l1(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    page = 64 << 10
    l2_bytes = _fit_shm(args.l2_bytes // OBJECT_BYTES * OBJECT_BYTES, "l2_to_l1")
    num_objects = l2_bytes // OBJECT_BYTES
    passes = -(-args.moved_bytes // l2_bytes)
    moved = passes * l2_bytes
    l2 = DramTier(l2_bytes, page, f"kvstore-gpubench-{secrets.token_hex(4)}", True)
    try:
        _require_pinned(l2, "l2_to_l1")
    except RuntimeError:
        l2.close()
        raise
    hbm = HbmTier(l2_bytes, 0.0, page)
    raw_device = torch.empty(l2_bytes, dtype=torch.uint8, device="cuda")
    views: list[memoryview] = []
    try:
        pages_per_object = OBJECT_BYTES // page
        runs = [(PageRun(i * pages_per_object, pages_per_object),) for i in range(num_objects)]
        segment = l2._buf  # the pinned segment as a numpy array
        segment[:] = np.random.default_rng(0).integers(0, 256, l2_bytes, dtype=np.uint8)
        views.extend(segment.data[i * OBJECT_BYTES : (i + 1) * OBJECT_BYTES]
                     for i in range(num_objects))
        transfers = [Transfer(r, OBJECT_BYTES, [v]) for r, v in zip(runs, views, strict=True)]
        batches = [transfers[i : i + BATCH_OBJECTS] for i in range(0, num_objects, BATCH_OBJECTS)]
        raw_host = torch.frombuffer(segment.data, dtype=torch.uint8)  # the same pinned bytes
        stream: Any = torch.cuda.Stream()

        def ours() -> None:
            for _ in range(passes):
                for batch in batches:
                    if any(hbm.write(batch)):
                        raise RuntimeError("HbmTier.write failed")

        def raw() -> None:
            with torch.cuda.stream(stream):
                for _ in range(passes):
                    for first in range(0, num_objects, BATCH_OBJECTS):
                        for i in range(first, min(first + BATCH_OBJECTS, num_objects)):
                            at = i * OBJECT_BYTES
                            raw_device[at : at + OBJECT_BYTES].copy_(
                                raw_host[at : at + OBJECT_BYTES], non_blocking=True)
                        stream.synchronize()

        def one_copy() -> None:
            with torch.cuda.stream(stream):
                raw_device.copy_(raw_host, non_blocking=True)
            stream.synchronize()

        ours_gbps = _gbps(moved, ours, args.repeats)
        raw_gbps = _gbps(moved, raw, args.repeats)
        single_gbps = _gbps(l2_bytes, one_copy, args.repeats)
        check = np.empty(OBJECT_BYTES, dtype=np.uint8)
        hbm.read([Transfer(runs[-1], OBJECT_BYTES, [memoryview(check)])])
        if not np.array_equal(check, np.frombuffer(views[num_objects - 1], dtype=np.uint8)):
            raise RuntimeError("l2_to_l1: bytes read back from HBM differ from L2")
        return _figure("l2_to_l1", ours_gbps, "raw pinned copy_", raw_gbps, ">= 0.9x",
                       moved_bytes=moved, object_bytes=OBJECT_BYTES,
                       batch_objects=BATCH_OBJECTS,
                       raw_single_copy_gbps=single_gbps)
    finally:
        views.clear()
        hbm.close()
        l2.close()


# --- kvikio_read -----------------------------------------------------------------------------


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _device_buffer(size: int) -> Any:
    """Device memory for kvikio: a cupy array when cupy is installed, else a torch tensor
    (both expose __cuda_array_interface__)."""
    try:
        import cupy

        return cupy.empty(size, dtype=cupy.uint8)
    except ImportError:
        import torch

        return torch.empty(size, dtype=torch.uint8, device="cuda")


def _first_bytes(device: Any, n: int) -> bytes:
    if hasattr(device, "get"):  # cupy
        return bytes(device[:n].get().tobytes())
    return bytes(device[:n].cpu().numpy().tobytes())


def _compat_mode(kvikio: Any) -> str:
    """kvikio's compatibility-mode setting: `defaults.get("compat_mode")` since kvikio 25.x,
    `defaults.compat_mode()` before."""
    defaults = kvikio.defaults
    if hasattr(defaults, "get"):
        return str(defaults.get("compat_mode"))
    return str(defaults.compat_mode())


def bench_kvikio_read(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import kvikio  # type: ignore[import-not-found]
    except ImportError as exc:
        raise Skip(f"kvikio is not installed: {exc}") from exc
    import torch

    size = args.file_bytes
    fd, path = tempfile.mkstemp(prefix="kvstore-gpubench-", dir=args.dir)
    try:
        block = np.random.default_rng(1).integers(0, 256, 64 * MiB, dtype=np.uint8)
        with os.fdopen(fd, "wb") as f:
            for _ in range(-(-size // block.nbytes)):
                f.write(block.data)
            f.truncate(size)
        device = _device_buffer(size)
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        host_view = memoryview(host.numpy())

        def gds() -> None:
            _drop_cache(path)
            with kvikio.CuFile(path, "r") as cf:
                if cf.read(device) != size:
                    raise RuntimeError("kvikio read was short")

        def posix() -> None:
            _drop_cache(path)
            rfd = os.open(path, os.O_RDONLY)
            try:
                done = 0
                while done < size:
                    n = os.preadv(rfd, [host_view[done:]], done)
                    if n <= 0:
                        raise RuntimeError("preadv hit end of file early")
                    done += n
            finally:
                os.close(rfd)

        ours = _gbps(size, gds, args.repeats_io)
        base = _gbps(size, posix, args.repeats_io)
        head = _first_bytes(device, MiB)
        if head != bytes(host_view[:MiB]) or head != block[:MiB].tobytes():
            raise RuntimeError("kvikio_read: device bytes differ from the file")
        return _figure("kvikio_read", ours, "os.preadv pinned", base, file_bytes=size,
                       compat_mode=_compat_mode(kvikio))
    finally:
        os.unlink(path)


FIGURES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "l2_pinned_h2d": bench_l2_pinned_h2d,
    "l2_to_l1": bench_l2_to_l1,
    "kvikio_read": bench_kvikio_read,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=256 * MiB, help="l2_pinned_h2d bytes per copy")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per copy figure")
    parser.add_argument("--l2-bytes", type=int, default=256 * MiB,
                        help="l2_to_l1: pinned L2 segment and HBM tier size")
    parser.add_argument("--moved-bytes", type=int, default=2 << 30,
                        help="l2_to_l1: bytes moved per timed run (>= 1 GiB)")
    parser.add_argument("--file-bytes", type=int, default=1 << 30, help="kvikio_read file size")
    parser.add_argument("--repeats-io", type=int, default=3, help="timed runs per file read")
    parser.add_argument("--dir", default=None, help="kvikio_read: where the file goes")
    parser.add_argument("--only", choices=sorted(FIGURES), action="append")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    no_cuda = cuda_unavailable_reason(0)
    figures: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    for name, bench in FIGURES.items():
        if args.only and name not in args.only:
            continue
        try:
            if no_cuda is not None:
                raise Skip(f"no CUDA: {no_cuda}")
            figures[name] = bench(args)
        except Skip as exc:
            skipped[name] = str(exc)
            print(f"bench {name}: skipped ({exc})", flush=True)
        except Exception as exc:  # report it and go on: one GPU run should show every figure
            failed[name] = f"{type(exc).__name__}: {exc}"
            print(f"bench {name}: failed ({failed[name]})", flush=True)
            traceback.print_exc()
    if args.json:
        print(json.dumps({"figures": figures, "skipped": skipped, "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
