"""GPU: the L2 segment is registered as pinned memory, and a device copy from it is
bit-exact. Skips without CUDA (see conftest)."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from kvstore.tiers.dram import DramTier

pytestmark = pytest.mark.gpu


def test_l2_segment_is_pinned_and_round_trips_through_hbm() -> None:
    cupy = pytest.importorskip("cupy", reason="pinning the L2 segment takes cupy")

    tier = DramTier(8 << 20, 64 << 10, f"kvstore-gputest-{secrets.token_hex(4)}", pin_memory=True)
    try:
        assert tier.pinned
        payload = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
        extents = [(0, 1 << 20), (4 << 20, 2 << 20)]
        tier.write_at(extents, 0, memoryview(payload))
        views = list(tier.views(extents))
        on_device = cupy.concatenate([cupy.asarray(np.frombuffer(v, np.uint8)) for v in views])
        back = cupy.asnumpy(on_device)
        assert np.array_equal(back, payload)
        del views
    finally:
        tier.close()
