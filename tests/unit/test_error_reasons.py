"""Error reasons, both ends, without a daemon: the daemon's typed errors become a
google.rpc.Status with one ErrorInfo (`kvstore.daemon.faults.described`), the Python client
turns a status (a failed call's trailers, or the local path's Status bytes) into the class of
its tree for the reason, and both lists are the ones the contract's header names. The same
over a real daemon is tests/integration/test_error_reasons.py."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

import kvstore.client as client
from kvstore.client import errors
from kvstore.core import checks
from kvstore.core import errors as core
from kvstore.daemon.faults import described, error_status

PROTO = Path(__file__).resolve().parents[2] / "proto/kvstore/v1/kvstore.proto"
Code = grpc.StatusCode


class FailedCall(grpc.RpcError):
    """What a failed call gives: code(), details() and trailing_metadata(), as grpc's own."""

    def __init__(self, status: status_pb2.Status | None, code: Code, details: str) -> None:
        self._code, self._details = code, details
        self._trailers = rpc_status.to_status(status).trailing_metadata if status else ()

    def code(self) -> Code:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return tuple(self._trailers)


def contract_reasons() -> dict[str, set[str]]:
    """The reasons per status code, as the .proto's header lists them."""
    text = PROTO.read_text()
    table = text[text.index("Reasons:"):text.index("New reasons may be added")]
    out: dict[str, set[str]] = {}
    code = ""
    for line in table.splitlines()[1:]:
        body = line.lstrip("/ ")
        head, sep, rest = body.partition(":")
        if sep and re.fullmatch(r"[A-Z_]+", head.strip()):
            code, body = head.strip(), rest
        # Reasons are the all-caps words, not those inside a parenthesised note.
        out.setdefault(code, set()).update(re.findall(r"\b[A-Z][A-Z_]{2,}\b",
                                                      re.sub(r"\([^)]*\)?", "", body)))
    return out


def test_the_daemon_and_the_client_know_every_reason_the_contract_lists() -> None:
    listed = contract_reasons()
    assert listed["RESOURCE_EXHAUSTED"] >= {"NO_ROOM", "MESSAGE_TOO_LARGE", "QUOTA_EXCEEDED"}
    every = set().union(*listed.values())
    daemon = {v for k, v in vars(core.Reason).items() if not k.startswith("_")}
    assert daemon == every
    for code_name, reasons in listed.items():
        code = Code[code_name]
        for reason in reasons:
            error = errors.error_for(code, "x", reason)
            assert (error.code, error.reason) == (code, reason)
            assert isinstance(error, errors._BY_CODE.get(code, errors.KVStoreError)), reason


@pytest.mark.parametrize(("code", "reason", "cls", "base"), [
    (Code.INVALID_ARGUMENT, "LEASE_EXPIRED", client.LeaseExpired, client.InvalidArgument),
    (Code.INVALID_ARGUMENT, "RESERVATION_EXPIRED", client.ReservationExpired,
     client.InvalidArgument),
    (Code.INVALID_ARGUMENT, "CHECKSUM_MISMATCH", client.ChecksumMismatch,
     client.InvalidArgument),
    (Code.INVALID_ARGUMENT, "INVALID_FIELD", client.InvalidArgument, client.KVStoreError),
    (Code.RESOURCE_EXHAUSTED, "NO_ROOM", client.NoRoom, client.ResourceExhausted),
    (Code.RESOURCE_EXHAUSTED, "MESSAGE_TOO_LARGE", client.MessageTooLarge,
     client.ResourceExhausted),
    (Code.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED", client.QuotaExceeded, client.ResourceExhausted),
    (Code.RESOURCE_EXHAUSTED, "TOO_MANY_STREAMS", client.TooManyStreams,
     client.ResourceExhausted),
    (Code.RESOURCE_EXHAUSTED, "TOO_MANY_SESSIONS", client.TooManySessions,
     client.ResourceExhausted),
    (Code.FAILED_PRECONDITION, "FEATURE_OFF", client.FeatureOff, client.FailedPrecondition),
    (Code.ABORTED, "ENTRY_VANISHED", client.EntryVanished, client.Aborted),
    (Code.ABORTED, "STREAM_IDLE", client.StreamIdle, client.Aborted),
    (Code.UNAVAILABLE, "DRAINING", client.Draining, client.Unavailable),
    (Code.UNAVAILABLE, "REMOTE_DOWN", client.RemoteDown, client.Unavailable),
    (Code.UNAUTHENTICATED, "UNAUTHENTICATED", client.Unauthenticated, client.KVStoreError),
    (Code.PERMISSION_DENIED, "NOT_OWNER", client.NotOwner, client.PermissionDenied),
    (Code.PERMISSION_DENIED, "ROLE_DENIED", client.RoleDenied, client.PermissionDenied),
])
def test_each_reason_maps_to_its_class_under_the_codes(
        code: Code, reason: str, cls: type[client.KVStoreError],
        base: type[client.KVStoreError]) -> None:
    status = error_status(code, "keys[3]: why", reason, {"field": "keys[3]", "limit": "8",
                                                         "setting": "server.max_batch_keys"})
    error = client.from_rpc_error(FailedCall(status, code, "keys[3]: why"))
    assert type(error) is cls and isinstance(error, base)
    assert (error.code, error.details, error.reason) == (code, "keys[3]: why", reason)
    assert (error.field, error.limit, error.setting) == ("keys[3]", "8", "server.max_batch_keys")
    local = errors.from_status_proto(status)  # the local path's Status bytes, parsed
    assert type(local) is cls and local.metadata == error.metadata


def test_statuses_without_a_known_reason() -> None:
    unknown = error_status(Code.RESOURCE_EXHAUSTED, "new", "SOMETHING_NEW")
    error = client.from_rpc_error(FailedCall(unknown, Code.RESOURCE_EXHAUSTED, "new"))
    assert type(error) is client.ResourceExhausted and error.reason == "SOMETHING_NEW"
    # gRPC's own refusal of an oversize message carries no details: MESSAGE_TOO_LARGE.
    plain = client.from_rpc_error(FailedCall(
        None, Code.RESOURCE_EXHAUSTED, "Received message larger than max (9 vs. 8)"))
    assert type(plain) is client.MessageTooLarge and plain.reason == "MESSAGE_TOO_LARGE"
    # The idle reaper's cancel carries no trailers either; its message names the setting.
    idle = client.from_rpc_error(FailedCall(None, Code.ABORTED, "... (server.stream_idle_s)"))
    assert type(idle) is client.StreamIdle
    # Any other status without details keeps its code's class and no reason.
    for code, cls in ((Code.INVALID_ARGUMENT, client.InvalidArgument),
                      (Code.UNAVAILABLE, client.Unavailable), (Code.ABORTED, client.Aborted),
                      (Code.DEADLINE_EXCEEDED, client.DeadlineExceeded)):
        bare = client.from_rpc_error(FailedCall(None, code, "text"))
        assert type(bare) is cls and bare.reason == "" and bare.metadata == {}
    assert type(client.from_status(3, "bad")) is client.InvalidArgument


def test_the_kvstore_domain_wins_over_other_error_infos() -> None:
    status = error_status(Code.INVALID_ARGUMENT, "m", "LEASE_EXPIRED")
    other = any_pb2.Any()
    other.Pack(error_details_pb2.ErrorInfo(reason="NO_ROOM", domain="example.com"))
    status.details.insert(0, other)
    error = client.from_rpc_error(FailedCall(status, Code.INVALID_ARGUMENT, "m"))
    assert type(error) is client.LeaseExpired


def test_client_side_validation_reads_as_invalid_field() -> None:
    error = client.InvalidArgument("values has 2 entries for 3 keys")
    assert error.reason == "INVALID_FIELD" and error.field is None and error.metadata == {}
    assert isinstance(error, ValueError)
    assert "reason=INVALID_FIELD" in repr(error)


def test_the_new_names_are_exported() -> None:
    for name in ("NoRoom", "MessageTooLarge", "QuotaExceeded", "LeaseExpired",
                 "ReservationExpired", "ChecksumMismatch", "TooManyStreams", "TooManySessions",
                 "FeatureOff", "EntryVanished", "StreamIdle", "Draining", "RemoteDown",
                 "NotOwner", "RoleDenied", "from_status"):
        assert name in client.__all__ and getattr(client, name) is getattr(errors, name)


def info(status: status_pb2.Status) -> tuple[str, dict[str, str]]:
    assert len(status.details) == 1
    unpacked = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(unpacked) and unpacked.domain == "kvstore.v1"
    return unpacked.reason, dict(unpacked.metadata)


def test_the_daemon_describes_each_error_with_its_reason() -> None:
    with pytest.raises(core.InvalidArgument) as bad_key:
        checks.keys("ns", [b"\x00" * 32, b"short"], 8)
    status = described(bad_key.value)
    assert status.code == Code.INVALID_ARGUMENT.value[0]
    assert status.message == "keys[1] is 5 bytes; keys are 32-byte digests"
    assert info(status) == ("INVALID_FIELD", {"field": "keys[1]"})
    with pytest.raises(core.InvalidArgument) as too_many:
        checks.keys("ns", [b"\x00" * 32] * 9, 8)
    assert info(described(too_many.value)) == (
        "INVALID_FIELD", {"field": "keys", "limit": "8", "setting": "server.max_batch_keys"})
    with pytest.raises(core.InvalidArgument) as long_ns:
        checks.namespace("n" * 1000)
    assert info(described(long_ns.value))[1]["field"] == "namespace"
    exhausted = core.ResourceExhausted("over", core.Reason.QUOTA_EXCEEDED, limit=3,
                                       setting="clients.max_leases")
    assert described(exhausted).code == Code.RESOURCE_EXHAUSTED.value[0]
    assert info(described(exhausted)) == ("QUOTA_EXCEEDED", {"limit": "3",
                                                             "setting": "clients.max_leases"})
    for exc, reason in ((core.FailedPrecondition("off"), "FEATURE_OFF"),
                        (core.Aborted("gone"), "ENTRY_VANISHED"),
                        (core.Unavailable("draining"), "DRAINING"),
                        (core.Unauthenticated("who"), "UNAUTHENTICATED"),
                        (core.PermissionDenied("not yours"), "NOT_OWNER"),
                        (core.ResourceExhausted("full"), "NO_ROOM")):
        assert info(described(exc)) == (reason, {})
    bug = described(KeyError("oops"))  # a bug: INTERNAL, and its reason says so
    assert bug.code == Code.INTERNAL.value[0] and info(bug) == ("INTERNAL", {})
    with pytest.raises(core.FailedPrecondition) as nvme_off:
        checks.evict_modes(False, 0, True, checks.Tier.NVME, enabled=False)
    assert info(described(nvme_off.value)) == (
        "FEATURE_OFF", {"field": "tier", "setting": "nvme.enabled"})
