"""Checksums guard every read: bytes damaged in shared memory come back as a miss (never as
data) on every path, and the damaged block is evicted so the engine's re-put can store it
again. Shared-memory reads by verifying clients take no lease; non-verifying ones do."""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest

from kvstore.client import KVStoreClient
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.shm import attach_segment
from kvstore.tools.testing import Daemon

SIZE = 100_000


def damage(target: str, ns: str, key: bytes) -> None:
    """Flip one byte of key's block inside the daemon's segment (found with a leased read)."""
    with grpc.insecure_channel(target) as channel:
        stub = rpc.KVStoreStub(channel)
        head = list(stub.Get(pb.GetRequest(namespace=ns, keys=[key],
                                           mode=pb.GET_MODE_SHARED_MEMORY)))[0]
        offset = head.locations[0].extents[0].offset + 12_345
        with attach_segment(head.shm_name) as segment:
            segment.buf[offset] ^= 0xFF
        stub.Release(pb.ReleaseRequest(ids=[head.lease_id]))


@pytest.mark.parametrize("shared_memory", [False, True], ids=["inline", "shm"])
def test_damaged_block_reads_as_a_miss_and_is_evicted(daemon: Daemon, ns: str,
                                                      shared_memory: bool) -> None:
    keys = [os.urandom(32) for _ in range(3)]
    values = [os.urandom(SIZE) for _ in keys]
    with KVStoreClient(daemon.target, ns, shared_memory=shared_memory) as kv:
        kv.put(keys, values, independent=True)
        damage(daemon.target, ns, keys[1])
        buffers = [np.zeros(SIZE, np.uint8) for _ in keys]
        assert kv.get_into(keys, buffers) == [SIZE, None, SIZE]
        assert bytes(buffers[0]) == values[0] and bytes(buffers[2]) == values[2]
        assert kv.lookup(keys).tiers == ["dram", None, "dram"]  # evicted, so...
        assert kv.put([keys[1]], [values[1]]).stored == 1  # ...a re-put stores it again
        assert kv.get(keys) == values


def test_verifying_shm_reads_take_no_lease_and_others_do(daemon: Daemon, ns: str) -> None:
    """The daemon is shared: its lease count is read as a change from what it was."""
    key, value = os.urandom(32), os.urandom(SIZE)
    with KVStoreClient(daemon.target, ns, shared_memory=True) as kv:
        kv.put([key], [value])
    with grpc.insecure_channel(daemon.target) as channel:
        stub = rpc.KVStoreStub(channel)

        def leases() -> int:
            return int(stub.Stats(pb.StatsRequest()).leases)

        before = leases()
        unleased = list(stub.Get(pb.GetRequest(namespace=ns, keys=[key], no_lease=True,
                                               mode=pb.GET_MODE_SHARED_MEMORY)))[0]
        assert unleased.lease_id == "" and unleased.found == [True]
        assert leases() == before
        leased = list(stub.Get(pb.GetRequest(namespace=ns, keys=[key],
                                             mode=pb.GET_MODE_SHARED_MEMORY)))[0]
        assert leased.lease_id
        assert leases() == before + 1
        stub.Release(pb.ReleaseRequest(ids=[leased.lease_id]))
        assert leases() == before
    for verify in (True, False):
        with KVStoreClient(daemon.target, ns, shared_memory=True, verify_checksums=verify) as kv:
            assert kv.get([key]) == [value]
            assert kv.stats().leases == before  # released (or never taken)
