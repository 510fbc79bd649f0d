"""The KVStore service's method table: which servicer method serves each verb, with which
codecs. The generated add_KVStoreServicer_to_server is not used: Put and Get move their bulk
bytes as raw frames (kvstore.proto.frames), decoded and encoded here without protobuf copies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from kvstore.daemon.faults import Undecodable, decoder
from kvstore.proto.frames import data_of
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    from kvstore.daemon.servicer import KVStoreServicer

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name


def _decode_put(raw: bytes) -> pb.PutRequest | memoryview | Undecodable:
    data = data_of(raw)
    return decoder(pb.PutRequest)(raw) if data is None else data


def _encode_get(message: pb.GetResponse | bytes) -> bytes:
    if isinstance(message, bytes):
        return message
    encoded: bytes = message.SerializeToString()
    return encoded


def handlers(s: KVStoreServicer) -> grpc.GenericRpcHandler:
    """The service's method table: the generated one, except that Put and Get move their
    bulk bytes as raw frames (kvstore.proto.frames)."""
    def unary(fn: Callable[..., Any], req: Any, resp: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=decoder(req), response_serializer=resp.SerializeToString
        )
    table = {
        "Put": grpc.stream_unary_rpc_method_handler(
            s.Put, request_deserializer=_decode_put,
            response_serializer=pb.PutResponse.SerializeToString),
        "Get": grpc.unary_stream_rpc_method_handler(
            s.Get, request_deserializer=decoder(pb.GetRequest), response_serializer=_encode_get),
        "Prefetch": grpc.unary_stream_rpc_method_handler(
            s.Prefetch, request_deserializer=decoder(pb.PrefetchRequest),
            response_serializer=pb.PrefetchProgress.SerializeToString),
        "Lookup": unary(s.Lookup, pb.LookupRequest, pb.LookupResponse),
        "Reserve": unary(s.Reserve, pb.ReserveRequest, pb.ReserveResponse),
        "Release": unary(s.Release, pb.ReleaseRequest, pb.ReleaseResponse),
        "Evict": unary(s.Evict, pb.EvictRequest, pb.EvictResponse),
        "Pin": unary(s.Pin, pb.PinRequest, pb.PinResponse),
        "Unpin": unary(s.Unpin, pb.PinRequest, pb.PinResponse),
        "Stats": unary(s.Stats, pb.StatsRequest, pb.StatsResponse),
        "Hot": unary(s.Hot, pb.HotRequest, pb.HotResponse),
        "Prewarm": grpc.unary_stream_rpc_method_handler(
            s.Prewarm, request_deserializer=decoder(pb.PrewarmRequest),
            response_serializer=pb.PrewarmProgress.SerializeToString),
        "Drain": unary(s.Drain, pb.DrainRequest, pb.DrainResponse),
        "Attach": unary(s.Attach, pb.AttachRequest, pb.AttachResponse),
        "Limits": unary(s.Limits, pb.LimitsRequest, pb.LimitsResponse),
        "WatchEvents": grpc.unary_stream_rpc_method_handler(
            s.WatchEvents, request_deserializer=decoder(pb.WatchEventsRequest),
            response_serializer=pb.WatchEventsResponse.SerializeToString),
    }
    declared = {m.name for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods}
    if set(table) != declared:  # the .proto grew a method this table does not serve
        raise RuntimeError(f"method table {sorted(table)} != kvstore.proto {sorted(declared)}")
    return grpc.method_handlers_generic_handler(SERVICE_NAME, table)
