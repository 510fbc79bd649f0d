"""Discovery against a real daemon: server reflection under grpc.reflection.v1 and v1alpha,
kvstore.proto's descriptor served with its comments, and proto/grpc/health/v1/health.proto
being the health service the daemon serves. Raw gRPC throughout, no client library."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2 as rpb

from kvstore.proto.kvstore.v1 import kvstore_pb2
from kvstore.tools.testing import Daemon
from tests.conftest import REPO

PROTO_ROOT = REPO / "proto"
KVSTORE_PROTO = PROTO_ROOT / "kvstore" / "v1" / "kvstore.proto"
COMMITTED_SET = PROTO_ROOT / "kvstore" / "v1" / "kvstore_descriptor.binpb"
HEALTH_PROTO = PROTO_ROOT / "grpc" / "health" / "v1" / "health.proto"
V1 = "grpc.reflection.v1.ServerReflection"
V1ALPHA = "grpc.reflection.v1alpha.ServerReflection"
SERVICES = {"kvstore.v1.KVStore", "grpc.health.v1.Health", V1, V1ALPHA}


@pytest.fixture
def channel(daemon: Daemon) -> Iterator[grpc.Channel]:
    """A channel to the session's shared default daemon: what it serves is what any serves."""
    with grpc.insecure_channel(daemon.target) as ch:
        yield ch


def ask(channel: grpc.Channel, service: str,
        *requests: rpb.ServerReflectionRequest) -> list[rpb.ServerReflectionResponse]:
    """ServerReflectionInfo under `service`'s path. v1 and v1alpha have the same messages
    (field for field), so v1alpha's classes encode and decode both."""
    call = channel.stream_stream(f"/{service}/ServerReflectionInfo",
                                 request_serializer=rpb.ServerReflectionRequest.SerializeToString,
                                 response_deserializer=rpb.ServerReflectionResponse.FromString)
    return list(call(iter(requests), timeout=5))


def files_of(
    response: rpb.ServerReflectionResponse,
) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    assert response.HasField("file_descriptor_response"), response
    protos = [descriptor_pb2.FileDescriptorProto.FromString(raw)
              for raw in response.file_descriptor_response.file_descriptor_proto]
    return {p.name: p for p in protos}


def leading_comment(proto: descriptor_pb2.FileDescriptorProto, path: list[int]) -> str:
    for location in proto.source_code_info.location:
        if list(location.path) == path:
            return str(location.leading_comments)
    return ""


def comment_above(pattern: str) -> str:
    """The `//` lines right above the line matching pattern in kvstore.proto, as protoc
    renders a leading comment (the text after `//`, one line each)."""
    lines = KVSTORE_PROTO.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if re.search(pattern, line))
    above: list[str] = []
    for line in reversed(lines[:at]):
        if not line.strip().startswith("//"):
            break
        above.insert(0, line.strip()[2:] + "\n")
    return "".join(above)


@pytest.mark.parametrize("service", [V1, V1ALPHA])
def test_both_reflection_versions_list_every_service(channel: grpc.Channel, service: str) -> None:
    (listed,) = ask(channel, service, rpb.ServerReflectionRequest(list_services=""))
    assert {s.name for s in listed.list_services_response.service} == SERVICES


@pytest.mark.parametrize("service", [V1, V1ALPHA])
def test_the_contract_comes_with_its_comments(channel: grpc.Channel, service: str) -> None:
    (described,) = ask(channel, service,
                       rpb.ServerReflectionRequest(file_containing_symbol="kvstore.v1.KVStore"))
    kvstore = files_of(described)["kvstore/v1/kvstore.proto"]
    (svc,) = kvstore.service
    want = [m.name for m in kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].methods]
    assert [m.name for m in svc.method] == want

    limits = [m.name for m in svc.method].index("Limits")
    expected = comment_above(r"^\s*rpc Limits\(")
    assert expected, "kvstore.proto has no leading comment above rpc Limits"
    # path: FileDescriptorProto.service (6), the service, ServiceDescriptorProto.method (2)
    assert leading_comment(kvstore, [6, 0, 2, limits]) == expected
    message = [m.name for m in kvstore.message_type].index("LimitsResponse")
    assert leading_comment(kvstore, [4, message]) == comment_above(r"^message LimitsResponse\b")


def test_a_file_is_found_by_name_and_an_unknown_symbol_is_not_found(channel: grpc.Channel) -> None:
    by_name, unknown = ask(
        channel, V1,
        rpb.ServerReflectionRequest(file_by_filename="kvstore/v1/kvstore.proto"),
        rpb.ServerReflectionRequest(file_containing_symbol="kvstore.v1.NoSuchThing"))
    assert files_of(by_name)["kvstore/v1/kvstore.proto"].HasField("source_code_info")
    assert unknown.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


@pytest.mark.parametrize("service", [V1, V1ALPHA])
def test_reflection_describes_itself(channel: grpc.Channel, service: str) -> None:
    """grpcurl and friends resolve the reflection service through reflection too."""
    (described,) = ask(channel, V1, rpb.ServerReflectionRequest(file_containing_symbol=service))
    (file,) = files_of(described).values()
    package, _, name = service.rpartition(".")
    assert file.package == package
    (svc,) = file.service
    assert svc.name == name
    (method,) = svc.method
    assert (method.name, method.input_type, method.output_type) == (
        "ServerReflectionInfo", f".{package}.ServerReflectionRequest",
        f".{package}.ServerReflectionResponse")
    assert method.client_streaming and method.server_streaming


def compile_proto(path: Path, tmp_path: Path) -> descriptor_pb2.FileDescriptorProto:
    protoc = pytest.importorskip("grpc_tools.protoc", reason="grpcio-tools is a test extra")
    out = tmp_path / "set.binpb"
    relative = path.relative_to(PROTO_ROOT)
    assert protoc.main(["protoc", f"-I{PROTO_ROOT}", f"--descriptor_set_out={out}",
                        str(relative)]) == 0
    (file,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    return file


def shape(file: descriptor_pb2.FileDescriptorProto) -> dict[str, object]:
    """What a generated client depends on: package, services and methods, messages, fields."""
    return {
        "package": file.package,
        "services": {s.name: sorted((m.name, m.input_type, m.output_type, m.client_streaming,
                                     m.server_streaming) for m in s.method)
                     for s in file.service},
        "messages": {m.name: [(f.name, f.number, f.type, f.type_name) for f in m.field]
                     for m in file.message_type},
    }


def test_health_proto_in_the_repo_is_what_the_daemon_serves(channel: grpc.Channel,
                                                             tmp_path: Path) -> None:
    ours = compile_proto(HEALTH_PROTO, tmp_path)
    (described,) = ask(channel, V1,
                       rpb.ServerReflectionRequest(file_containing_symbol="grpc.health.v1.Health"))
    (served,) = files_of(described).values()
    assert shape(ours) == shape(served)
    assert shape(ours)["services"] == {"Health": [
        ("Check", ".grpc.health.v1.HealthCheckRequest", ".grpc.health.v1.HealthCheckResponse",
         False, False),
        ("List", ".grpc.health.v1.HealthListRequest", ".grpc.health.v1.HealthListResponse",
         False, False),
        ("Watch", ".grpc.health.v1.HealthCheckRequest", ".grpc.health.v1.HealthCheckResponse",
         False, True),
    ]}


def test_health_answers_as_proto_readme_says(channel: grpc.Channel) -> None:
    """Check and Watch for "" and kvstore.v1.KVStore; List is UNIMPLEMENTED (proto/README.md)."""
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", "kvstore.v1.KVStore"):
        request = health_pb2.HealthCheckRequest(service=name)
        assert stub.Check(request, timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        watch = stub.Watch(request, timeout=5)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
    with pytest.raises(grpc.RpcError) as info:
        stub.List(health_pb2.HealthListRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    readme = (PROTO_ROOT / "README.md").read_text()
    assert "`List`" in readme and "`UNIMPLEMENTED`" in readme


def test_the_committed_descriptor_set_is_current(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a test extra: pip install -e .[test]")
    from kvstore.proto.generate import DESCRIPTOR_SET, generate_descriptor_set

    assert generate_descriptor_set(tmp_path) == COMMITTED_SET.read_bytes(), (
        f"{COMMITTED_SET} differs from what kvstore.proto gives; run `make proto`")
    assert COMMITTED_SET.name == DESCRIPTOR_SET


def test_the_descriptor_set_is_installed_with_the_package() -> None:
    """A non-editable install (the Docker image) must carry it, or reflection loses the
    comments: pyproject's package-data for the stubs' package has to match it."""
    tomllib = pytest.importorskip("tomllib")  # 3.11+
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["kvstore.proto.kvstore.v1"]
    assert any(fnmatch.fnmatch(COMMITTED_SET.name, p) for p in patterns), patterns
