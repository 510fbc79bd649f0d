"""KVStoreClient and AsyncKVStoreClient are twins: the same public methods and properties, the
same parameters (names, kinds, defaults, annotations as strings) and returns, a docstring on
every one, and the same public attributes once built. Only control flow may differ: every
public method of the async twin is a coroutine function, and none of the blocking one's is.
Both decide the shared-memory path through one `ShmState`: one Stats call however many first
calls race, blocking or awaited, and no lock of their own. That the same calls take the same
path and give the same results against a real daemon is tests/integration/test_client_parity.py.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any

import pytest

from kvstore.client import AsyncKVStoreClient, FailedPrecondition, KVStoreClient, Unavailable
from kvstore.client._shm import ShmState
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb

# Public members only one twin has, each with the reason. None today: the context-manager
# protocols differ (__enter__ / __aenter__), but those are dunders and not public.
ONLY_SYNC: dict[str, str] = {}
ONLY_ASYNC: dict[str, str] = {}

# Parameters whose annotations differ on purpose, (method, parameter) -> (sync, async). The
# async client awaits what on_progress returns when it is a coroutine, so it takes any
# callable; the blocking one types the return as None, so that a coroutine function (whose
# body it would never run) is a type error there.
ANNOTATION_EXCEPTIONS: dict[tuple[str, str], tuple[str, str]] = {
    ("prefetch", "on_progress"): (
        "Callable[[res.PrefetchResult], None] | None",
        "Callable[[res.PrefetchResult], object] | None",
    ),
    ("prewarm", "on_progress"): (
        "Callable[[res.PrewarmResult], None] | None",
        "Callable[[res.PrewarmResult], object] | None",
    ),
}


# Streams whose answers come as they happen (WatchEvents): the blocking twin is a generator,
# the async one an async generator (not a coroutine), and each types its iterator so.
STREAMS: dict[str, tuple[str, str]] = {
    "watch_events": ("Iterator[pb.WatchEventsResponse]",
                     "AsyncIterator[pb.WatchEventsResponse]"),
}


def public(cls: type) -> dict[str, Any]:
    """Public name -> the raw class attribute (function, property, ...), inherited included."""
    return {n: inspect.getattr_static(cls, n) for n in dir(cls) if not n.startswith("_")}


def function_of(member: Any) -> Any:
    """The function that carries a member's signature and docstring."""
    return member.fget if isinstance(member, property) else member


def signature_differences(name: str, sync_fn: Any, async_fn: Any) -> list[str]:
    """How two methods' signatures differ, one line per difference; [] when they match."""
    sync_sig, async_sig = inspect.signature(sync_fn), inspect.signature(async_fn)
    found = []
    sync_params, async_params = list(sync_sig.parameters.values()), list(
        async_sig.parameters.values()
    )
    if [p.name for p in sync_params] != [p.name for p in async_params]:
        return [f"{name}: parameters {[p.name for p in sync_params]} vs "
                f"{[p.name for p in async_params]}"]
    for s, a in zip(sync_params, async_params, strict=True):
        if s.kind != a.kind:
            found.append(f"{name}({s.name}): kind {s.kind.description} vs {a.kind.description}")
        if s.default != a.default:
            found.append(f"{name}({s.name}): default {s.default!r} vs {a.default!r}")
        annotations = (str(s.annotation), str(a.annotation))
        expected = ANNOTATION_EXCEPTIONS.get((name, s.name), (annotations[0],) * 2)
        if annotations != expected:
            found.append(f"{name}({s.name}): annotation {annotations[0]} vs {annotations[1]}")
    returns = (str(sync_sig.return_annotation), str(async_sig.return_annotation))
    if returns != STREAMS.get(name, (returns[0],) * 2):
        found.append(f"{name}: returns {sync_sig.return_annotation} vs "
                     f"{async_sig.return_annotation}")
    return found


SYNC, ASYNC = public(KVStoreClient), public(AsyncKVStoreClient)
SHARED = sorted(set(SYNC) & set(ASYNC))


def test_every_public_member_has_a_twin() -> None:
    assert set(SYNC) - set(ONLY_SYNC) == set(ASYNC) - set(ONLY_ASYNC)
    # the exceptions stay true: each names a member its own side has and the other lacks
    assert all(n in SYNC and n not in ASYNC for n in ONLY_SYNC)
    assert all(n in ASYNC and n not in SYNC for n in ONLY_ASYNC)
    for verb in ("put", "get", "get_into", "lookup", "prefetch", "evict", "pin", "unpin",
                 "stats", "hot", "prewarm", "health", "release", "close"):
        assert verb in SHARED


@pytest.mark.parametrize("name", SHARED)
def test_twins_are_the_same_kind_and_only_the_async_one_awaits(name: str) -> None:
    sync_member, async_member = SYNC[name], ASYNC[name]
    assert isinstance(sync_member, property) == isinstance(async_member, property), name
    if name in STREAMS:
        assert inspect.isgeneratorfunction(sync_member), name
        assert inspect.isasyncgenfunction(async_member), name
    elif not isinstance(sync_member, property):
        assert not inspect.iscoroutinefunction(sync_member), name
        assert inspect.iscoroutinefunction(async_member), name


@pytest.mark.parametrize("name", [*SHARED, "__init__"])
def test_twins_take_the_same_parameters_and_return_the_same(name: str) -> None:
    sync_fn = function_of(inspect.getattr_static(KVStoreClient, name))
    async_fn = function_of(inspect.getattr_static(AsyncKVStoreClient, name))
    assert signature_differences(name, sync_fn, async_fn) == []


def test_the_deliberate_annotation_differences_are_exactly_as_listed() -> None:
    for (name, param), expected in ANNOTATION_EXCEPTIONS.items():
        actual = tuple(
            str(inspect.signature(function_of(side[name])).parameters[param].annotation)
            for side in (SYNC, ASYNC)
        )
        assert actual == expected, (name, param)


@pytest.mark.parametrize("cls", [KVStoreClient, AsyncKVStoreClient], ids=lambda c: c.__name__)
def test_every_public_member_has_a_docstring(cls: type) -> None:
    undocumented = [n for n, m in public(cls).items()
                    if not (function_of(m).__doc__ or "").strip()]
    assert undocumented == []
    init = inspect.getattr_static(cls, "__init__")
    assert (cls.__doc__ or "").strip() and (init.__doc__ or "").strip()


def test_built_twins_carry_the_same_public_attributes() -> None:
    # Building a client opens no connection (grpc channels connect on first use).
    sync_client = KVStoreClient("127.0.0.1:1", "parity", timeout_s=5.0)
    try:
        sync_attrs = {k: v for k, v in vars(sync_client).items() if not k.startswith("_")}
    finally:
        sync_client.close()

    async def build() -> dict[str, Any]:
        async_client = AsyncKVStoreClient("127.0.0.1:1", "parity", timeout_s=5.0)
        try:
            return {k: v for k, v in vars(async_client).items() if not k.startswith("_")}
        finally:
            await async_client.close()

    async_attrs = asyncio.run(build())
    assert sync_attrs == async_attrs  # retry too: the same default policy, compared by value
    assert sync_attrs["namespace"] == "parity" and sync_attrs["timeout_s"] == 5.0


def test_the_check_names_a_drift() -> None:
    class Blocking:
        def verb(self, keys: list[bytes], *, tier: str | None = None) -> int:
            return 0

    class Awaited:
        async def verb(self, keys: list[bytes], tier: str = "dram") -> int:
            return 0

    found = signature_differences("verb", Blocking.verb, Awaited.verb)
    assert found == [
        "verb(tier): kind keyword-only vs positional or keyword",
        "verb(tier): default None vs 'dram'",
        "verb(tier): annotation str | None vs str",
    ]


# --- the shared-memory decision -------------------------------------------------------------

ELSEWHERE = pb.StatsResponse(shm_name="kvstore-x", host_id="some-other-host")


def test_neither_twin_keeps_a_lock_of_its_own() -> None:
    lock_types = (type(threading.Lock()), type(threading.RLock()), asyncio.Lock)
    sync_client = KVStoreClient("127.0.0.1:1", "parity")
    sync_client.close()

    async def build() -> AsyncKVStoreClient:
        client = AsyncKVStoreClient("127.0.0.1:1", "parity")
        await client.close()
        return client

    for client in (sync_client, asyncio.run(build())):
        assert isinstance(vars(client)["_shm"], ShmState)
        assert [k for k, v in vars(client).items() if isinstance(v, lock_types)] == []


def test_racing_blocking_first_calls_make_one_stats_call() -> None:
    state = ShmState(None)
    calls: list[int] = []
    entered, release = threading.Event(), threading.Event()

    def fetch() -> pb.StatsResponse:
        calls.append(1)
        entered.set()
        release.wait(5.0)
        return ELSEWHERE

    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(state.segment_for(fetch)))
               for _ in range(8)]
    for t in threads:
        t.start()
    assert entered.wait(5.0)
    release.set()
    for t in threads:
        t.join(5.0)
    assert (len(calls), results) == (1, [None] * 8)
    assert state.in_use is False


def test_a_failed_stats_leaves_it_undecided_for_the_next_caller() -> None:
    state = ShmState(None)
    outcomes: list[Exception | pb.StatsResponse] = [Unavailable("draining"), ELSEWHERE]

    def fetch() -> pb.StatsResponse:
        item = outcomes.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    with pytest.raises(Unavailable):
        state.segment_for(fetch)
    assert state.in_use is None
    assert state.segment_for(fetch) is None and state.in_use is False and outcomes == []


def test_required_elsewhere_refuses_every_call_and_stays_undecided() -> None:
    state = ShmState(True)
    for _ in range(2):
        with pytest.raises(FailedPrecondition, match="another host"):
            state.segment_for(lambda: ELSEWHERE)
    assert state.in_use is None


class HeldStats:
    """The asyncio client's stub, as far as the decision goes: each Stats call is counted and
    answers ELSEWHERE once `answer` is set."""

    def __init__(self) -> None:
        self.calls = 0
        self.answer = asyncio.Event()

    async def Stats(self, request: pb.StatsRequest, timeout: float) -> pb.StatsResponse:
        self.calls += 1
        await self.answer.wait()
        return ELSEWHERE


async def deciding(stub: HeldStats) -> None:
    """Until the decider's Stats call is in flight."""
    while not stub.calls:
        await asyncio.sleep(0.01)


def test_racing_awaited_first_calls_make_one_stats_call_and_survive_a_cancel() -> None:
    async def scenario() -> tuple[int, list[object], bool | None]:
        client, stub = AsyncKVStoreClient("127.0.0.1:1", "parity"), HeldStats()
        client._stub = stub
        try:
            tasks = [asyncio.create_task(client._run(client._segment())) for _ in range(8)]
            await deciding(stub)
            tasks[-1].cancel()  # a cancelled caller must not cancel the others' decision
            stub.answer.set()
            results = await asyncio.wait_for(asyncio.gather(*tasks[:-1]), 5.0)
            return stub.calls, list(results), client.uses_shared_memory
        finally:
            await client.close()

    assert asyncio.run(scenario()) == (1, [None] * 7, False)


def test_a_cancelled_awaited_decider_still_decides_for_the_others() -> None:
    # The decision runs in a worker thread, which a cancelled task does not stop: the
    # callers waiting for it get its outcome, and no second Stats call is made.
    async def scenario() -> tuple[int, object, bool, bool | None]:
        client, stub = AsyncKVStoreClient("127.0.0.1:1", "parity"), HeldStats()
        client._stub = stub
        try:
            first = asyncio.create_task(client._run(client._segment()))
            await deciding(stub)
            second = asyncio.create_task(client._run(client._segment()))
            await asyncio.sleep(0.05)
            first.cancel()
            stub.answer.set()
            segment = await asyncio.wait_for(second, 5.0)
            await asyncio.gather(first, return_exceptions=True)
            return stub.calls, segment, first.cancelled(), client.uses_shared_memory
        finally:
            await client.close()

    assert asyncio.run(scenario()) == (1, None, True, False)


def test_the_asyncio_client_never_waits_on_its_own_loop() -> None:
    # What the decision is handed runs the client's calls on its loop and waits for them:
    # called on that loop, it would wait forever, so it refuses.
    async def scenario() -> None:
        async with AsyncKVStoreClient("127.0.0.1:1", "parity") as client:
            fetch_stats = client._blocking(client._fetch_stats)
            with pytest.raises(RuntimeError, match="its own loop"):
                fetch_stats()

    asyncio.run(scenario())
