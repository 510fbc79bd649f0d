"""The committed gRPC stubs match what `make proto` generates from kvstore.proto."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.proto.generate import OUTPUTS, PROTO_ROOT, generate
from kvstore.proto.kvstore.v1 import kvstore_pb2

COMMITTED = PROTO_ROOT / "kvstore" / "v1"


def test_stubs_match_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a test extra: pip install -e .[test]")
    generated = generate(tmp_path)
    assert sorted(generated) == sorted(OUTPUTS)
    for name in OUTPUTS:
        committed = (COMMITTED / name).read_text()
        assert (tmp_path / name).read_text() == committed, (
            f"{COMMITTED / name} differs from what kvstore.proto generates; run `make proto`"
        )


def test_service_has_every_rpc() -> None:
    service = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"]
    assert service.full_name == "kvstore.v1.KVStore"
    names = {method.name for method in service.methods}
    expected = {"Put", "Get", "Lookup", "Prefetch", "Reserve", "Release", "Evict", "Pin", "Unpin",
                "Stats"}
    assert expected <= names, f"missing RPCs: {sorted(expected - names)}"


def test_streaming_shapes() -> None:
    methods = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].methods_by_name
    assert methods["Put"].client_streaming and not methods["Put"].server_streaming
    assert methods["Get"].server_streaming and not methods["Get"].client_streaming
    assert methods["Prefetch"].server_streaming
    assert not methods["Lookup"].client_streaming and not methods["Lookup"].server_streaming
