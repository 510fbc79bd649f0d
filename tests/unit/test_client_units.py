"""The client's pure pieces, no daemon: error mapping, retry and backoff, buffer conversion,
Put/Get framing and reassembly, shared-memory extents, argument validation and result
conversion."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import random
import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest
import xxhash

from kvstore import shm
from kvstore.client import (
    AsyncKVStoreClient,
    DataLoss,
    ExponentialBackoff,
    FailedPrecondition,
    FeatureOff,
    InvalidArgument,
    KVStoreClient,
    KVStoreError,
    NoBackoff,
    NotFound,
    QuotaExceeded,
    Retry,
    Unavailable,
    _attach,
    from_rpc_error,
)
from kvstore.client import _requests as rq
from kvstore.client import results as res
from kvstore.client._attach import TicketKeeper
from kvstore.client._buffers import copy_bytes, readable_view, writable_array
from kvstore.client._localpath import LocalPath, NoSessionNow
from kvstore.client._pause import MAX_PAUSE_S, Pause, TicketRefused, TryLater, passes
from kvstore.client._shm import SharedSegment, ShmState, read_shm_get, write_reserved
from kvstore.client._target import with_default_port
from kvstore.client._wire import (
    Fetched,
    InlineAssembler,
    check_keys,
    decode_get_response,
    finish_get,
    finish_get_into,
    merge_reread,
    parse_get_header,
    put_frames,
    reread_indexes,
    tier_value,
)
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.localframe import LOOKUP

K = [bytes([i]) * 32 for i in range(8)]


# --- errors ---------------------------------------------------------------------------------


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_status_codes_map_to_their_exception_with_code_and_details() -> None:
    err = from_rpc_error(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "keys[2] is 31 bytes"))
    assert isinstance(err, InvalidArgument) and isinstance(err, ValueError)
    assert err.code is grpc.StatusCode.INVALID_ARGUMENT
    assert err.details == "keys[2] is 31 bytes" and str(err) == "keys[2] is 31 bytes"
    assert isinstance(from_rpc_error(FakeRpcError(grpc.StatusCode.NOT_FOUND, "x")), NotFound)
    assert isinstance(from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "x")), Unavailable)


def test_unmapped_code_gives_the_base_class() -> None:
    err = from_rpc_error(FakeRpcError(grpc.StatusCode.INTERNAL, "boom"))
    assert type(err) is KVStoreError and err.code is grpc.StatusCode.INTERNAL


# --- retry ----------------------------------------------------------------------------------


def test_exponential_backoff_doubles_up_to_the_cap_without_jitter() -> None:
    backoff = ExponentialBackoff(base_s=0.05, cap_s=0.3, jitter=False)
    assert [backoff.compute(n) for n in (1, 2, 3, 4, 5)] == [0.05, 0.1, 0.2, 0.3, 0.3]
    assert backoff.compute(10_000) == 0.3


def test_jitter_stays_within_zero_and_the_ceiling() -> None:
    backoff = ExponentialBackoff(base_s=0.1, cap_s=1.0, rng=random.Random(7))
    for n in range(1, 8):
        assert 0.0 <= backoff.compute(n) <= backoff.ceiling(n)


def test_retry_retries_unavailable_then_gives_up_after_attempts() -> None:
    calls: list[int] = []
    sleeps: list[float] = []

    def flaky() -> str:
        calls.append(1)
        raise Unavailable("draining")

    retry = Retry(ExponentialBackoff(jitter=False), attempts=3)
    with pytest.raises(Unavailable):
        retry.call(flaky, sleep=sleeps.append)
    assert len(calls) == 3 and sleeps == [0.05, 0.1]


def test_retry_returns_first_success_and_never_retries_other_errors() -> None:
    outcomes: list[Any] = [Unavailable("x"), "ok"]

    def once() -> str:
        item = outcomes.pop(0)
        if isinstance(item, Exception):
            raise item
        return str(item)

    assert Retry(NoBackoff(), attempts=3).call(once, sleep=lambda s: None) == "ok"
    calls: list[int] = []

    def bad() -> None:
        calls.append(1)
        raise InvalidArgument("keys")

    with pytest.raises(InvalidArgument):
        Retry(NoBackoff(), attempts=5).call(bad)
    assert calls == [1]


def test_retry_async_and_validation() -> None:
    attempts: list[int] = []

    async def flaky() -> int:
        attempts.append(1)
        if len(attempts) < 2:
            raise Unavailable("x")
        return 42

    async def no_sleep(_: float) -> None:
        return None

    assert asyncio.run(Retry(NoBackoff()).call_async(flaky, sleep=no_sleep)) == 42
    with pytest.raises(ValueError, match="attempts"):
        Retry(NoBackoff(), attempts=0)


# --- buffers --------------------------------------------------------------------------------


def test_readable_view_is_a_flat_zero_copy_byte_view() -> None:
    array = np.arange(12, dtype=np.float16).reshape(3, 4)
    view = readable_view(array, "values[0]")
    assert view.format == "B" and view.nbytes == 24 and bytes(view) == array.tobytes()
    array[0, 0] = 99  # same memory, no copy
    assert bytes(view) == array.tobytes()
    assert bytes(readable_view(bytearray(b"abc"), "v")) == b"abc"
    assert bytes(readable_view(memoryview(b"xyz"), "v")) == b"xyz"


def test_non_contiguous_or_non_buffer_values_are_rejected_by_name() -> None:
    with pytest.raises(ValueError, match=r"values\[3\].*contiguous"):
        readable_view(np.zeros((4, 4), np.uint8)[:, ::2], "values[3]")
    with pytest.raises(ValueError, match=r"values\[1\]"):
        readable_view(object(), "values[1]")
    with pytest.raises(ValueError, match=r"values\[0\]"):
        readable_view(np.array([object()]), "values[0]")


def test_writable_array_refuses_read_only_buffers() -> None:
    with pytest.raises(ValueError, match=r"buffers\[0\].*read-only"):
        writable_array(b"abc", "buffers[0]")
    frozen = np.zeros(4, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match=r"buffers\[2\]"):
        writable_array(frozen, "buffers[2]")
    target = bytearray(4)
    writable_array(target, "b")[:] = 7
    assert target == bytearray(b"\x07" * 4)


def test_dlpack_objects_on_a_device_are_rejected() -> None:
    class OnGpu:
        def __dlpack_device__(self) -> tuple[int, int]:
            return (2, 0)  # kDLCUDA

    with pytest.raises(ValueError, match=r"buffers\[5\].*device"):
        writable_array(OnGpu(), "buffers[5]")


def test_torch_cpu_tensors_convert_without_copy() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.arange(8, dtype=torch.bfloat16)
    view = readable_view(tensor, "values[0]")
    assert view.nbytes == 16
    out = torch.zeros(8, dtype=torch.bfloat16)
    writable_array(out, "buffers[0]")[:] = np.frombuffer(view, np.uint8)
    assert torch.equal(out, tensor)


@pytest.mark.parametrize("skew", [0, 8, 16, 63, 64, 4000])
def test_copy_bytes_copies_exactly_whatever_the_path(skew: int) -> None:
    src = np.frombuffer(os.urandom(10_000), np.uint8)
    dst = np.zeros(10_000, np.uint8)
    copy_bytes(dst, src, skew)
    assert np.array_equal(dst, src)


# --- Put framing ----------------------------------------------------------------------------


def _parse_frames(frames: list[bytes]) -> list[pb.PutRequest]:
    return [pb.PutRequest.FromString(f) for f in frames]


def test_put_frames_split_payloads_into_bounded_chunks_in_key_order() -> None:
    payloads = [os.urandom(n) for n in (5, 17, 1, 40)]
    header = pb.PutRequest(namespace="ns", keys=K[:4], sizes=[len(p) for p in payloads])
    frames = list(put_frames(header, [memoryview(p) for p in payloads], chunk_bytes=16))
    messages = _parse_frames(frames)
    assert messages[0].namespace == "ns" and list(messages[0].keys) == K[:4]
    assert all(not m.keys and not m.namespace for m in messages[1:])
    assert all(0 < len(m.data) <= 16 for m in messages)
    assert b"".join(m.data for m in messages) == b"".join(payloads)


def test_put_frames_send_one_header_message_when_payloads_fit() -> None:
    header = pb.PutRequest(namespace="ns", keys=K[:2], sizes=[3, 4], independent=True)
    messages = _parse_frames(
        list(put_frames(header, [memoryview(b"abc"), memoryview(b"defg")], 1024))
    )
    assert len(messages) == 1 and messages[0].data == b"abcdefg" and messages[0].independent


def test_put_frames_large_chunk_lengths_use_multi_byte_varints() -> None:
    payload = os.urandom(300_000)
    header = pb.PutRequest(namespace="n", keys=K[:1], sizes=[len(payload)])
    messages = _parse_frames(list(put_frames(header, [memoryview(payload)], 200_000)))
    assert [len(m.data) for m in messages] == [200_000, 100_000]
    assert b"".join(m.data for m in messages) == payload


# --- Get framing and reassembly -------------------------------------------------------------


def test_data_only_get_messages_decode_to_a_view_others_parse() -> None:
    data = os.urandom(70_000)
    decoded = decode_get_response(pb.GetResponse(data=data).SerializeToString())
    assert isinstance(decoded, memoryview) and bytes(decoded) == data
    head = pb.GetResponse(found=[True], sizes=[3], checksums=[1], data=b"abc")
    parsed = decode_get_response(head.SerializeToString())
    assert isinstance(parsed, pb.GetResponse) and parsed.data == b"abc"
    assert isinstance(decode_get_response(b""), pb.GetResponse)


def _header(payloads: list[bytes | None]) -> pb.GetResponse:
    found = [p for p in payloads if p is not None]
    return pb.GetResponse(
        found=[p is not None for p in payloads],
        sizes=[len(p) for p in found],
        checksums=[xxhash.xxh3_64_intdigest(p) for p in found],
    )


def test_assembler_rebuilds_blocks_across_chunk_boundaries() -> None:
    payloads: list[bytes | None] = [os.urandom(10), None, os.urandom(25), os.urandom(3)]
    header = parse_get_header(_header(payloads), 4)
    stream = b"".join(p for p in payloads if p is not None)
    assembler = InlineAssembler(header)
    for start in range(0, len(stream), 7):
        assembler.feed(memoryview(stream)[start : start + 7])
    assembler.finish()
    out, bad = finish_get(K[:4], Fetched(header, assembler.payloads()), True)
    assert out == payloads and bad == []


def test_assembler_copies_straight_into_targets() -> None:
    payloads = [os.urandom(9), os.urandom(12)]
    header = parse_get_header(_header(list(payloads)), 2, [16, 12])
    arrays = [np.zeros(16, np.uint8), np.zeros(12, np.uint8)]
    assembler = InlineAssembler(header, arrays)
    stream = b"".join(payloads)
    assembler.feed(memoryview(stream)[:5])
    assembler.feed(memoryview(stream)[5:])
    assembler.finish()
    out, bad = finish_get_into(K[:2], Fetched(header, []), arrays, True)
    assert out == [9, 12] and bad == []
    assert arrays[0][:9].tobytes() == payloads[0] and arrays[1].tobytes() == payloads[1]


def test_short_or_long_streams_are_data_loss() -> None:
    header = parse_get_header(_header([b"abcd"]), 1)
    short = InlineAssembler(header)
    short.feed(memoryview(b"ab"))
    with pytest.raises(DataLoss, match="2 of 4"):
        short.finish()
    with pytest.raises(DataLoss, match="more data"):
        InlineAssembler(header).feed(memoryview(b"abcdef"))


def test_header_inconsistencies_are_data_loss_and_small_buffers_value_errors() -> None:
    with pytest.raises(DataLoss, match="found flags"):
        parse_get_header(_header([b"a"]), 2)
    bad = pb.GetResponse(found=[True, True], sizes=[1], checksums=[0])
    with pytest.raises(DataLoss, match="sizes"):
        parse_get_header(bad, 2)
    with pytest.raises(DataLoss, match="header"):
        parse_get_header(memoryview(b"x"), 1)
    with pytest.raises(ValueError, match=r"buffers\[1\] holds 2 bytes; the block is 3"):
        parse_get_header(_header([None, b"abc"]), 2, [10, 2])


def test_checksum_mismatch_is_a_miss_reported_for_eviction() -> None:
    header = parse_get_header(_header([b"good", b"evil"]), 2)
    out, bad = finish_get(K[:2], Fetched(header, [b"good", b"EVIL"]), True)
    assert out == [b"good", None] and bad == [K[1]]
    out, bad = finish_get(K[:2], Fetched(header, [b"good", b"EVIL"]), False)
    assert out == [b"good", b"EVIL"] and bad == []


def test_blocks_that_fail_unleased_are_read_again_and_only_held_failures_evicted() -> None:
    # K[0] good, K[1] not found, K[2] moved under the copy, K[3] good, K[2] again (moved).
    keys = [K[0], K[1], K[2], K[3], K[2]]
    header = parse_get_header(_header([b"a", None, b"c", b"d", b"c"]), 5)
    copied = [b"a", b"X", b"d", b"X"]  # what the client copied of the 4 found blocks
    unleased = Fetched(header, copied, held=False)
    out, bad = finish_get(keys, unleased, True)
    assert out == [b"a", None, None, b"d", None] and bad == [K[2], K[2]]
    # Only the found blocks that failed, each at its own place (a miss is no mismatch).
    again = reread_indexes(unleased, out)
    assert again == [2, 4]
    # Under the lease one comes back and one fails again: a hit, and a block to evict.
    header_again = parse_get_header(_header([b"c", b"c"]), 2)
    out_again, bad_again = finish_get([K[2], K[2]], Fetched(header_again, [b"c", b"Y"]), True)
    assert bad_again == [K[2]]
    merge_reread(out, again, out_again)
    assert out == [b"a", None, b"c", b"d", None]
    # A held read (inline, or leased) is not read again: a mismatch there is damage.
    assert reread_indexes(dataclasses.replace(unleased, held=True), out) == []
    assert Fetched(header, copied).held
    # Nothing failed: nothing to read again.
    assert reread_indexes(Fetched(header, [b"a", b"c", b"d", b"c"], held=False),
                          [b"a", None, b"c", b"d", b"c"]) == []


def test_verifying_shm_reads_go_unleased_and_their_rereads_leased() -> None:
    def no_lease(shared_memory: bool, verify: bool, again: bool) -> bool:
        request = rq.get_request("ns", K[:1], shared_memory, verify, again)
        return request.no_lease

    assert no_lease(True, True, False)  # the first read of a verifying client
    assert not no_lease(True, True, True)  # its re-read of what failed
    assert not no_lease(True, False, False)  # a client that does not verify always leases
    assert not no_lease(False, True, False)  # inline reads stream under the daemon's lease


# --- shared memory --------------------------------------------------------------------------


class FakeSegment:
    def __init__(self, size: int, name: str = "seg") -> None:
        self.name, self.size_bytes = name, size
        self.buf = bytearray(size)
        self.closed = False

    def view(self) -> memoryview:
        return memoryview(self.buf)

    def close(self) -> None:
        self.closed = True


def _location(*extents: tuple[int, int]) -> pb.BlockLocation:
    return pb.BlockLocation(extents=[pb.Extent(offset=o, length=n) for o, n in extents])


def test_reserved_writes_and_shm_reads_follow_extents_in_order() -> None:
    segment = SharedSegment(FakeSegment(4096))
    payloads = [os.urandom(100), os.urandom(10)]
    reserve = pb.ReserveResponse(
        reservation_id="r1",
        exists=[False, True],
        locations=[_location((1000, 64), (64, 64)), _location()],
    )
    # The writer's checksum of each payload it wrote, for the commit; 0 for one that exists.
    checksums = write_reserved(segment, reserve, [memoryview(p) for p in payloads])
    assert checksums == [xxhash.xxh3_64_intdigest(payloads[0]), 0]
    get = _header([payloads[0]])
    get.locations.append(_location((1000, 64), (64, 64)))
    header = parse_get_header(get, 1)
    assert read_shm_get(segment, get, header, None, True).payloads == [payloads[0]]
    target = [np.zeros(128, np.uint8)]
    fetched = read_shm_get(segment, get, header, target, True)
    assert target[0][:100].tobytes() == payloads[0]
    assert finish_get_into(K[:1], fetched, target, True) == ([100], [])


def test_extents_outside_the_segment_or_too_short_are_data_loss() -> None:
    segment = SharedSegment(FakeSegment(1024))
    with pytest.raises(DataLoss, match="outside"):
        segment.spans(_location((1000, 100)), 100, "locations[0]")
    with pytest.raises(DataLoss, match="50 of 100"):
        segment.spans(_location((0, 50)), 100, "locations[0]")


def test_shm_is_off_when_the_daemon_is_elsewhere_and_an_error_when_required() -> None:
    stats = pb.StatsResponse(shm_name="kvstore-x", host_id="some-other-host")
    auto = ShmState(None)
    auto.decide(stats)
    assert auto.decided and auto.segment is None
    with pytest.raises(FailedPrecondition, match="another host"):
        ShmState(True).decide(stats)
    never = ShmState(False)
    assert never.decided and never.segment is None


# --- trying again later: pauses, kept tickets, off for now ----------------------------------


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_pauses_double_from_a_quarter_second_up_to_three_with_equal_jitter() -> None:
    clock = Clock()
    pause = Pause(clock, random.Random(3))
    assert not pause.off() and not pause.due() and pause.clear() is None
    ceilings = [0.25, 0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    for ceiling_s in ceilings:
        pause_s = pause.fail()
        assert ceiling_s / 2 <= pause_s <= ceiling_s  # never 0: no client comes back at once
        assert pause.off() and not pause.due()
        clock.now_s += pause_s
        assert pause.due() and not pause.off()
    assert pause.failures == len(ceilings)
    off_s = pause.clear()
    assert off_s is not None and 6.0 < off_s <= sum(ceilings)
    assert (pause.failures, pause.until_s) == (0, None)


def test_what_passes_is_a_cap_a_closed_connection_or_an_unknown_ticket() -> None:
    path = "/run/kv.sock"
    for data, unused in ((b"", True), (b'{"arenas": [', False)):
        with pytest.raises(TryLater) as later:  # closed before, or inside, its answer
            _attach._parse(path, data, 0)
        assert later.value.ticket_unused is unused
    refusals = {"TOO_MANY_SESSIONS": TryLater, "TOO_MANY_EXCHANGES": TryLater,
                "DRAINING": TryLater, "UNAUTHENTICATED": TicketRefused,
                "FEATURE_OFF": FailedPrecondition, "": FailedPrecondition}
    for reason, expected in refusals.items():
        line = json.dumps({"error": "no", "reason": reason}).encode() + b"\n"
        with pytest.raises(FailedPrecondition) as refused:
            _attach._parse(path, line, 0)
        assert type(refused.value) is expected, reason
    assert passes(Unavailable("x")) and passes(QuotaExceeded("64 tickets"))
    assert not passes(FailedPrecondition("another host")) and not passes(DataLoss("x"))


class Attaches:
    """An Attach function handing out numbered tickets good for 30 s."""

    def __init__(self) -> None:
        self.issued = 0

    def __call__(self) -> pb.AttachResponse:
        self.issued += 1
        return pb.AttachResponse(ticket=f"t{self.issued}", expires_in_ms=30_000)


def test_a_ticket_not_redeemed_is_sent_again_while_young() -> None:
    clock, fetch = Clock(), Attaches()
    keeper = TicketKeeper(fetch, clock)
    sent: list[str] = []

    def refused_at_a_cap(ticket: str) -> None:
        sent.append(ticket)
        raise TryLater("at the cap", ticket_unused=True)

    for _ in range(3):
        with pytest.raises(TryLater):
            keeper.use(refused_at_a_cap)
        clock.now_s += 3.0
    assert sent == ["t1"] * 3 and fetch.issued == 1  # one ticket for three tries
    clock.now_s += 12.0  # 21 s old: too old to trust with 30 s of life
    assert keeper.use(lambda ticket: ticket) == "t2"
    assert keeper.use(lambda ticket: ticket) == "t3"  # redeemed ones are not kept


def raising(exc: Exception) -> Any:
    """An attempt that sends its ticket and meets exc."""
    def attempt(ticket: str) -> None:
        raise exc
    return attempt


def test_a_kept_ticket_used_up_after_all_is_replaced_at_once() -> None:
    keeper = TicketKeeper(Attaches(), Clock())
    with pytest.raises(TryLater):
        keeper.use(raising(TryLater("closed before answering", ticket_unused=True)))
    sent: list[str] = []

    def only_fresh(ticket: str) -> str:
        sent.append(ticket)
        if ticket == "t1":
            raise TicketRefused("unknown, used or expired ticket")
        return ticket

    assert keeper.use(only_fresh) == "t2" and sent == ["t1", "t2"]
    with pytest.raises(TicketRefused):  # a fresh ticket refused: no second try now
        keeper.use(raising(TicketRefused("unknown, used or expired ticket")))
    assert TicketKeeper().use(lambda ticket: ticket) == "-"  # auth off: nothing to fetch


def arena_stats(socket_path: str) -> pb.StatsResponse:
    """What a daemon with auth on says: no segment, a Unix socket, this kernel."""
    return pb.StatsResponse(host_id=shm.host_id(), unix_socket=socket_path)


def test_a_refusal_that_passes_goes_inline_until_the_pause_then_tries_again(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    clock, fetch_attach, stats_calls = Clock(), Attaches(), []
    state = ShmState(None, clock=clock)

    def fetch_stats() -> pb.StatsResponse:  # the socket is not there yet (a restart)
        stats_calls.append(1)
        return arena_stats(str(tmp_path / "kv.sock"))

    with caplog.at_level(logging.DEBUG, "kvstore.client"):
        for _ in range(3):
            assert state.segment_for(fetch_stats, fetch_attach) is None
            assert state.in_use is False and not state.needs_decision()
            assert len(stats_calls) == 1  # inline meanwhile, without asking again
            clock.now_s += 0.04  # the first pause is 0.125 to 0.25 s
        clock.now_s += 0.2
        assert state.needs_decision()  # the pause has passed: the next data call tries
        assert state.segment_for(fetch_stats, fetch_attach) is None
        assert len(stats_calls) == 2 and fetch_attach.issued == 1  # the same ticket
    logged = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in logged] == [logging.INFO, logging.DEBUG]
    assert "off for now" in logged[0][1] and "still off" in logged[1][1]
    assert "kv.sock" in logged[0][1]


def test_a_try_after_a_pause_never_holds_up_other_callers(tmp_path: Any) -> None:
    clock = Clock()
    state = ShmState(None, clock=clock)
    stats = arena_stats(str(tmp_path / "kv.sock"))
    state.segment_for(lambda: stats, Attaches())
    clock.now_s += 5.0
    entered, release = threading.Event(), threading.Event()

    def slow_stats() -> pb.StatsResponse:
        entered.set()
        release.wait(5.0)
        return stats

    trying = threading.Thread(target=state.segment_for, args=(slow_stats, Attaches()))
    trying.start()
    assert entered.wait(5.0)
    started = time.monotonic()
    assert state.segment_for(lambda: pytest.fail("a second try"), Attaches()) is None
    assert time.monotonic() - started < 1.0  # inline at once, not after the other's try
    release.set()
    trying.join(5.0)


def test_a_data_call_finding_the_path_broken_pauses_or_ends_it() -> None:
    clock = Clock()
    for_now = ShmState(None, clock=clock)
    for_now.fall_back(TryLater("re-Attach refused at a cap"))
    assert for_now.in_use is False and not for_now.needs_decision()
    clock.now_s += MAX_PAUSE_S
    assert for_now.needs_decision()
    for_good = ShmState(None, clock=clock)
    for_good.fall_back(FeatureOff("mode SHARED_MEMORY needs the dram tier"))
    clock.now_s += 3600.0
    assert for_good.in_use is False and not for_good.needs_decision()
    required = ShmState(True, clock=clock)
    with pytest.raises(TryLater):
        required.fall_back(TryLater("x"))


def test_a_required_path_raises_a_refusal_that_passes_and_stays_undecided(
        tmp_path: Any) -> None:
    state = ShmState(True, clock=Clock())
    stats = arena_stats(str(tmp_path / "kv.sock"))
    for _ in range(2):
        with pytest.raises(FailedPrecondition, match="nothing serves"):
            state.segment_for(lambda: stats, Attaches())
    assert state.in_use is None


def test_a_local_path_refused_for_now_opens_no_session_until_its_pause_passes(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    local = LocalPath(str(tmp_path / "kv.sock"), TicketKeeper(), 1.0, clock)
    with caplog.at_level(logging.DEBUG, "kvstore.client"):
        with pytest.raises(NoSessionNow, match="nothing serves"):
            local.probe()
        assert not local.ready()
        with pytest.raises(NoSessionNow, match="until the pause"):
            local.call(LOOKUP, pb.LookupRequest(), pb.LookupResponse)
        clock.now_s += MAX_PAUSE_S
        assert local.ready()
        with pytest.raises(NoSessionNow, match="nothing serves"):  # tried, refused again
            local.probe()
    logged = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in logged] == [logging.INFO, logging.DEBUG]
    assert "local path off for now" in logged[0][1]
    local.close()


# --- argument validation --------------------------------------------------------------------


def test_keys_are_checked_before_the_wire() -> None:
    assert check_keys([bytearray(32)]) == [bytes(32)]
    with pytest.raises(InvalidArgument, match=r"keys\[1\] is 31 bytes"):
        check_keys([bytes(32), bytes(31)])
    with pytest.raises(InvalidArgument, match="not one key"):
        check_keys(bytes(32))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"keys\[0\] must be bytes"):
        check_keys(["a" * 32])  # type: ignore[list-item]


def test_put_plan_checks_counts_sizes_and_parent() -> None:
    with pytest.raises(InvalidArgument, match="values has 1 entries for 2 keys"):
        rq.put_plan("ns", K[:2], [b"a"], None, False)
    with pytest.raises(InvalidArgument, match=r"sizes\[0\] is 0"):
        rq.put_plan("ns", K[:1], [b""], None, False)
    with pytest.raises(InvalidArgument, match="parent_key"):
        rq.put_plan("ns", K[:1], [b"a"], b"short", False)
    plan = rq.put_plan("ns", K[:2], [b"ab", np.zeros(3, np.uint8)], K[7], True)
    assert plan.sizes == [2, 3] and plan.parent_key == K[7] and plan.independent


def test_evict_and_tier_arguments() -> None:
    assert tier_value(None) == pb.TIER_UNSPECIFIED and tier_value("NVMe") == pb.TIER_NVME
    with pytest.raises(InvalidArgument, match="tier must be one of"):
        tier_value("l2")
    with pytest.raises(InvalidArgument, match="keys, bytes or all"):
        rq.evict_request("ns", None, 0, False, None, None)
    with pytest.raises(InvalidArgument, match="namespace"):
        rq.evict_request("ns", K[:1], 0, False, None, "")
    every = rq.evict_request("ns", None, 1 << 20, False, "dram", "")
    assert every.namespace == "" and every.bytes == 1 << 20 and every.tier == pb.TIER_DRAM
    mine = rq.evict_request("ns", K[:1], 0, False, None, None)
    assert mine.namespace == "ns" and list(mine.keys) == K[:1]


def test_prefetch_deadline_becomes_milliseconds_and_extends_the_rpc_timeout() -> None:
    request = rq.prefetch_request("ns", K[:1], "dram", 0.25)
    assert request.deadline_ms == 250 and request.target_tier == pb.TIER_DRAM
    assert rq.prefetch_timeout_s(30.0, None) == 30.0
    assert rq.prefetch_timeout_s(1.0, 5.0) == 6.0
    with pytest.raises(InvalidArgument, match="deadline_s"):
        rq.prefetch_request("ns", K[:1], None, 0)


def test_hot_limit_must_be_a_positive_integer() -> None:
    request = rq.hot_request("ns", 7)
    assert (request.namespace, request.limit) == ("ns", 7)
    for bad in (0, -1, 2**32, 1.5, True, "10"):
        with pytest.raises(InvalidArgument, match="limit must be a positive integer"):
            rq.hot_request("ns", bad)  # type: ignore[arg-type]


def test_prewarm_bytes_must_be_a_non_negative_integer() -> None:
    assert rq.prewarm_request(0, ()).bytes == 0  # the daemon's remote.prewarm_bytes
    assert rq.prewarm_request(1 << 40, ()).bytes == 1 << 40
    for bad in (-1, 2**64, 1.0, True, "1GiB"):
        with pytest.raises(InvalidArgument, match="bytes must be a non-negative integer"):
            rq.prewarm_request(bad, ())  # type: ignore[arg-type]


def test_prewarm_namespaces_are_named_strings_each_checked() -> None:
    request = rq.prewarm_request(0, ("a", "b/tp0"))
    assert list(request.namespaces) == ["a", "b/tp0"]
    with pytest.raises(InvalidArgument, match=r"namespaces\[1\] must be a string, got int"):
        rq.prewarm_request(0, ["a", 7])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match=r"namespaces\[0\]: namespace must not be empty"):
        rq.prewarm_request(0, [""])
    with pytest.raises(InvalidArgument, match=r"namespaces\[0\]: .*limit"):
        rq.prewarm_request(0, ["x" * 10_000])
    with pytest.raises(InvalidArgument, match="not one namespace"):
        rq.prewarm_request(0, "llama")


def test_call_timeout_override_defaults_to_the_clients_and_must_be_positive() -> None:
    assert rq.call_timeout_s(30.0, None) == 30.0
    assert rq.call_timeout_s(30.0, 600) == 600.0
    with pytest.raises(InvalidArgument, match="timeout_s"):
        rq.call_timeout_s(30.0, 0)


# --- targets: a missing port is the daemon's 50051, not gRPC's 443 ---------------------------


@pytest.mark.parametrize(("given", "dialled"), [
    ("127.0.0.1", "127.0.0.1:50051"), ("localhost", "localhost:50051"),
    ("kv.example.svc:6000", "kv.example.svc:6000"), (" host:7 ", "host:7"),
    ("[::1]", "[::1]:50051"), ("[::1]:6000", "[::1]:6000"), ("::1", "[::1]:50051"),
    ("dns:///kv.local", "dns:///kv.local:50051"), ("dns:///kv.local:6000", "dns:///kv.local:6000"),
    ("dns://8.8.8.8/kv.local", "dns://8.8.8.8/kv.local:50051"), ("dns:kv", "dns:kv:50051"),
    ("ipv4:10.0.0.1,10.0.0.2:7000", "ipv4:10.0.0.1:50051,10.0.0.2:7000"),
    ("ipv6:[::1]", "ipv6:[::1]:50051"),
    ("unix:/run/kvstore/kv.sock", "unix:/run/kvstore/kv.sock"), ("unix:///tmp/a", "unix:///tmp/a"),
    ("unix-abstract:kv", "unix-abstract:kv"), ("xds:///kvstore", "xds:///kvstore"),
])
def test_a_target_without_a_port_gets_50051(given: str, dialled: str) -> None:
    assert with_default_port(given) == dialled


@pytest.mark.parametrize(("given", "says"), [
    ("", "must be a daemon address"), ("host:", "port '' is not a number"),
    ("host:http", "port 'http' is not a number"), ("host:70000", "from 1 to 65535"),
    ("[::1", "without its ']'"), ("[::1]x", "expected ':port'"), ("fe80::1::2", "in brackets"),
    (":50051", "names no host"), ("dns://8.8.8.8", "needs a host"),
])
def test_a_malformed_target_is_refused_naming_it(given: str, says: str) -> None:
    with pytest.raises(InvalidArgument, match=r"^target .*" + says.replace("[", r"\[")):
        with_default_port(given)


def test_both_clients_dial_the_default_port_and_say_so() -> None:
    with KVStoreClient("127.0.0.1", "ns", shared_memory=False) as kv:
        assert kv.target == "127.0.0.1:50051" and "127.0.0.1:50051" in repr(kv)

    async def target() -> str:
        async with AsyncKVStoreClient("[::1]", "ns", shared_memory=False) as akv:
            return akv.target
    assert asyncio.run(target()) == "[::1]:50051"
    with pytest.raises(InvalidArgument, match="port 'x'"):
        KVStoreClient("h:x", "ns")


# --- results --------------------------------------------------------------------------------


def test_every_tier_stats_field_converts_and_bandwidth_is_bytes_over_seconds() -> None:
    wire = pb.TierStats(
        tier=pb.TIER_NVME, enabled=True, capacity_bytes=1 << 40, used_bytes=1 << 30, objects=9,
        hits=5, misses=3, bytes_in=3_000_000, bytes_out=8_000_000_000, evictions=2,
        page_size_bytes=1 << 20, free_pages=7, largest_free_run_pages=4, backend="gds",
        promotions=11, demotions=12, admissions_refused=13, checksum_failures=14, io_errors=15,
        queue_depth=16, read_seconds=2.0, write_seconds=0.5, state="half-open",
    )
    (tier,) = res.stats_result(pb.StatsResponse(tiers=[wire])).tiers
    expected = {f.name: getattr(wire, f.name) for f in pb.TierStats.DESCRIPTOR.fields}
    assert {**dataclasses.asdict(tier), "tier": pb.TIER_NVME} == expected  # no field missed
    assert tier.tier == "nvme" and tier.backend == "gds" and tier.state == "half-open"
    assert tier.read_bandwidth_bytes_s == 4e9 and tier.write_bandwidth_bytes_s == 6e6


def test_bandwidth_is_zero_before_any_time_is_recorded() -> None:
    (tier,) = res.stats_result(pb.StatsResponse(tiers=[pb.TierStats(
        tier=pb.TIER_DRAM, bytes_in=1 << 20, bytes_out=1 << 20)])).tiers
    assert (tier.backend, tier.read_seconds, tier.write_seconds) == ("", 0.0, 0.0)
    assert tier.read_bandwidth_bytes_s == 0.0 and tier.write_bandwidth_bytes_s == 0.0


def test_prefetch_progress_carries_the_prefix_and_the_deadline() -> None:
    result = res.prefetch_result(pb.PrefetchProgress(
        done=2, missing=1, failed=1, total=5, prefix_length=2, deadline_exceeded=True))
    assert result == res.PrefetchResult(done=2, missing=1, failed=1, total=5, prefix_length=2,
                                        deadline_exceeded=True)
    empty = res.PrefetchResult(done=0, missing=0, failed=0, total=3)  # as sync/aio start one
    assert (empty.prefix_length, empty.deadline_exceeded) == (0, False)


def test_tier_state_is_the_breaker_for_l4_and_empty_for_local_tiers() -> None:
    stats = res.stats_result(pb.StatsResponse(tiers=[
        pb.TierStats(tier=pb.TIER_DRAM, enabled=True),
        pb.TierStats(tier=pb.TIER_REMOTE, enabled=True, state="open"),
    ]))
    assert [(t.tier, t.state) for t in stats.tiers] == [("dram", ""), ("remote", "open")]
    assert stats.to_dict()["tiers"][1]["state"] == "open"


def test_hot_response_keeps_the_order_and_pairs_keys_with_scores() -> None:
    result = res.hot_result(pb.HotResponse(keys=[K[3], K[1], K[2]], scores=[9.5, 4.0, 0.25]))
    assert result == res.HotResult(keys=[K[3], K[1], K[2]], scores=[9.5, 4.0, 0.25])
    assert res.hot_result(pb.HotResponse()) == res.HotResult(keys=[], scores=[])
    with pytest.raises(DataLoss, match="2 keys with 1 scores"):
        res.hot_result(pb.HotResponse(keys=K[:2], scores=[1.0]))


def test_prewarm_progress_converts_every_field() -> None:
    wire = pb.PrewarmProgress(blocks=3, bytes=3 << 20, target_bytes=1 << 30, done=True)
    result = res.prewarm_result(wire)
    assert result == res.PrewarmResult(blocks=3, bytes=3 << 20, target_bytes=1 << 30, done=True)
    expected = {f.name: getattr(wire, f.name) for f in pb.PrewarmProgress.DESCRIPTOR.fields}
    assert dataclasses.asdict(result) == expected  # no field missed
