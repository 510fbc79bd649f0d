"""Server reflection, v1 and v1alpha, serving kvstore.proto's descriptor with its comments.

grpcio-reflection speaks only grpc.reflection.v1alpha; v1 is the same messages under another
service path, so one servicer is registered under both names. Its descriptors come from a
DescriptorPool, whose upb CopyToProto drops source_code_info: a file the committed descriptor
set (proto/generate.py, --include_source_info) has is served from that set instead.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from importlib import resources

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, text_format
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from kvstore.daemon.methods import SERVICE_NAME
from kvstore.proto.kvstore.v1 import kvstore_pb2

log = logging.getLogger(__name__)

REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
REFLECTED = (SERVICE_NAME, health.SERVICE_NAME, REFLECTION_V1, reflection.SERVICE_NAME)
COMMENTED_SET = "kvstore_descriptor.binpb"  # by proto/generate.py, with --include_source_info


def reflection_pool() -> descriptor_pool.DescriptorPool:
    """kvstore.proto, health.proto and reflection.proto twice: v1 is v1alpha's messages in
    package grpc.reflection.v1, the same bytes on the wire. (None of them imports a file.)"""
    files = [descriptor_pb2.FileDescriptorProto() for _ in range(3)]
    for proto, module in zip(files, (kvstore_pb2, health_pb2, reflection_pb2), strict=True):
        module.DESCRIPTOR.CopyToProto(proto)
    v1 = text_format.Parse(text_format.MessageToString(files[-1]).replace(
        "grpc.reflection.v1alpha", "grpc.reflection.v1"), descriptor_pb2.FileDescriptorProto())
    v1.name, v1.options.deprecated = "grpc/reflection/v1/reflection.proto", False
    pool = descriptor_pool.DescriptorPool()
    for proto in (*files, v1):
        pool.Add(proto)
    return pool


def commented_files() -> dict[str, bytes]:
    """{file name: FileDescriptorProto with source_code_info} from the committed descriptor
    set; empty, with a warning, if it was not installed."""
    try:
        raw = resources.files("kvstore.proto.kvstore.v1").joinpath(COMMENTED_SET).read_bytes()
    except FileNotFoundError:
        log.warning("%s is not installed: reflection serves kvstore.proto without comments",
                    COMMENTED_SET)
        return {}
    files = descriptor_pb2.FileDescriptorSet.FromString(raw).file
    return {f.name: f.SerializeToString() for f in files if f.HasField("source_code_info")}


class Reflection(reflection.ReflectionServicer):  # type: ignore[misc]  # untyped library
    """grpc-reflection's servicer over reflection_pool(), whose descriptors lose their comments
    (upb's CopyToProto drops source_code_info): a file the committed set has comes from it."""

    def __init__(self, commented: dict[str, bytes]) -> None:
        super().__init__(REFLECTED, pool=reflection_pool())
        self._commented = commented

    def ServerReflectionInfo(self, requests: Iterable[reflection_pb2.ServerReflectionRequest],
                             context: grpc.ServicerContext,
                             ) -> Iterator[reflection_pb2.ServerReflectionResponse]:
        for response in super().ServerReflectionInfo(requests, context):
            files = response.file_descriptor_response.file_descriptor_proto
            for i, raw in enumerate(files):
                name = descriptor_pb2.FileDescriptorProto.FromString(raw).name
                files[i] = self._commented.get(name, raw)
            yield response

    def handlers(self) -> tuple[grpc.GenericRpcHandler, ...]:
        """This servicer under both service names (v1alpha's (de)serializers serve v1)."""
        methods = {"ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            self.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)}
        return tuple(grpc.method_handlers_generic_handler(name, methods)
                     for name in (REFLECTION_V1, reflection.SERVICE_NAME))
