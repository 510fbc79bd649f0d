"""GPU benchmark: host-to-device copy bandwidth from the pinned L2 segment against the same
copy from ordinary pageable memory, in one run (needs cupy and a CUDA device).

Prints `bench l2_pinned_h2d: <ours> GB/s vs pageable <baseline> GB/s = <ratio>x`.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time

import numpy as np

from kvstore.tiers.dram import DramTier


def _h2d_gbps(cupy, host: np.ndarray, repeats: int) -> float:  # type: ignore[no-untyped-def]
    device = cupy.empty(host.nbytes, dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    device.set(host, stream=stream)
    stream.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        device.set(host, stream=stream)
    stream.synchronize()
    return host.nbytes * repeats / (time.perf_counter() - start) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=256 << 20, help="bytes per copy")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        import cupy  # type: ignore[import-not-found]

        if not cupy.cuda.runtime.getDeviceCount():
            raise RuntimeError("no CUDA device")
    except Exception as exc:
        print(f"bench l2_pinned_h2d: skipped ({exc})")
        return 0
    tier = DramTier(args.size, 64 << 10, f"kvstore-gpubench-{secrets.token_hex(4)}", True)
    try:
        pinned = np.frombuffer(next(tier.views([(0, args.size)])), dtype=np.uint8)
        pageable = np.ones(args.size, dtype=np.uint8)
        ours = _h2d_gbps(cupy, pinned, args.repeats)
        base = _h2d_gbps(cupy, pageable, args.repeats)
        del pinned
    finally:
        tier.close()
    print(f"bench l2_pinned_h2d: {ours:.1f} GB/s vs pageable {base:.1f} GB/s = {ours / base:.2f}x")
    if args.json:
        print(json.dumps({"l2_pinned_h2d": {"ours_gbps": ours, "baseline_gbps": base}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
