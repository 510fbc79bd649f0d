"""Puts from a grant: free pages taken ahead, blocks written into them, commits posted.

A co-located client's put used to be two round trips with the daemon's planning (eviction,
demotion) between them: Reserve, then the copy, then the commit. Here the client holds a
GRANT of free pages in its tenant's arena (`kvstore.proto.localframe`), taken before it is
needed and refilled in the background before it runs dry, so a put is the copy into
pages it already holds and one commit (COMMIT_GRANTED) that names the keys, the parent, the
sizes, the checksums as written and the pages each block took. The daemon plans when it
grants, not while a put waits.

Only posted puts take this path (`put(..., wait=False)`: the commit is sent, not waited
for); a put that waits reserves, as before (on a 2-core host a waited put from a grant
measured no faster, since the daemon plans the next grant while the client copies). A
posted commit's answer is read later by whichever call next uses its session, or by
`flush()`; a refusal (checksum, a grant that expired, the chain rules) is raised by the
client's next data call (put, get, get_into, lookup) or by `flush()`. Pages a put takes
leave the grant whatever the answer: the daemon frees those of a refused commit and those of keys
that were cached already.

A grant is used until a third of its lifetime is left (its pages are the daemon's again at
its deadline, and a write into a page after that could land in another block: the margin
keeps every write well inside it). What is left of a grant that is replaced, or held when
the client closes, goes back with a posted Release. A grant holds about PUTS_AHEAD of the
client's largest puts, and the next one is taken in the background once the current one holds
fewer than REFILL_PUTS of them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.localframe import (
    COMMIT_GRANTED,
    GRANT,
    GRANT_REPLY,
    RELEASE,
    commit_granted,
    grant_request,
)

from . import _requests as rq
from ._localpath import LocalPath
from ._segment import SharedSegment, Spans
from .errors import DataLoss, DeadlineExceeded, KVStoreError, ResourceExhausted

logger = logging.getLogger("kvstore.client")

#: The most a client asks one grant to hold: four times its largest put, at least
#: MIN_GRANT_BYTES, at most this (the daemon grants at most a quarter of the arena). Taking
#: a grant makes its room (evicting as a put would), so a client holds ahead about what its
#: next few puts need, not more.
GRANT_BYTES = 64 * 1024 * 1024
MIN_GRANT_BYTES = 4 * 1024 * 1024
PUTS_AHEAD = 4  #: a grant holds this many of the client's largest puts
REFILL_PUTS = 2  #: the next grant is taken once the current one holds fewer of them
ASSUMED_PAGE_BYTES = 64 * 1024  #: the page size a client assumes before its first grant
USABLE_SHARE = 2 / 3  #: of a grant's lifetime during which its pages are written into


@dataclass(slots=True)
class Granted:
    """One grant: its id, where each page lies in the segment or arena it names, how many
    pages have been handed out (in order), and until when pages may be written."""

    grant_id: bytes
    name: str  # the segment (auth off) or arena (auth on) its offsets are in
    arena: str  # the arena (auth on), else "": what a client must hold (ensure_arena)
    page_size: int
    offsets: np.ndarray  # uint64, one per page
    usable_until: float
    handed: int = 0

    @property
    def left(self) -> int:
        return len(self.offsets) - self.handed


def parse_grant(reply: bytes, now: float) -> Granted:
    """A GRANT answer, checked: DataLoss when it is not one."""
    if len(reply) < GRANT_REPLY.size:
        raise DataLoss(f"a Grant answer of {len(reply)} bytes is shorter than its head")
    grant_id, expires_ms, page_size, pages, shm_len, arena_len = GRANT_REPLY.unpack_from(reply)
    at = GRANT_REPLY.size + shm_len + arena_len
    if len(reply) != at + 8 * pages or page_size <= 0 or pages <= 0:
        raise DataLoss(f"a Grant answer of {len(reply)} bytes does not hold {pages} pages")
    names = reply[GRANT_REPLY.size:at].decode("utf-8", "replace")
    offsets = np.frombuffer(reply, dtype="<u8", count=pages, offset=at).astype(np.uint64)
    return Granted(grant_id, names[:shm_len] or names[shm_len:], names[shm_len:], page_size,
                   offsets, now + expires_ms / 1000 * USABLE_SHARE)


class PostedCommits:
    """The answers of posted commits: how many are awaited, what the answered ones stored,
    and the first failure not yet raised. Thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.awaited = 0
        self._failure: KVStoreError | None = None
        self._totals = [0, 0, 0]  # stored, existing, evicted since the last flush

    def sent(self) -> None:
        with self._cond:
            self.awaited += 1

    def unsent(self) -> None:
        """A commit counted by `sent` that did not go after all (its error was raised)."""
        with self._cond:
            self.awaited -= 1
            self._cond.notify_all()

    def answer(self, reply: bytes | KVStoreError) -> None:
        """A posted commit's reply (its receiver: see LocalPath.post_bytes)."""
        response: pb.PutResponse | None = None
        failure: KVStoreError | None = None
        if isinstance(reply, KVStoreError):
            failure = reply
        else:
            try:
                response = pb.PutResponse.FromString(reply)
            except Exception as exc:  # noqa: BLE001 (kept, and raised by the next call)
                failure = DataLoss(f"a posted commit's answer does not parse: {exc}")
        if failure is not None:
            logger.warning("kvstore: a posted put's commit failed: %s", failure)
        with self._cond:
            self.awaited -= 1
            if response is not None:
                self._totals[0] += response.stored
                self._totals[1] += response.existing
                self._totals[2] += response.evicted
            elif self._failure is None:
                self._failure = failure
            self._cond.notify_all()

    def raise_failure(self) -> None:
        """Raise the first failure of a posted commit not raised yet (once)."""
        with self._cond:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def wait(self, settle: Callable[[], None], timeout_s: float) -> tuple[int, int, int]:
        """Wait until every posted commit is answered (settle reads the answers waiting on
        idle sessions); the totals since the last wait. DeadlineExceeded past timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            settle()
            with self._cond:
                if self.awaited == 0:
                    totals = tuple(self._totals)
                    self._totals = [0, 0, 0]
                    return totals[0], totals[1], totals[2]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded(f"{self.awaited} posted commits were not answered "
                                           f"within {timeout_s} s")
                self._cond.wait(min(left, 0.05))  # sessions in use answer on their own


class Grants:
    """A client's grants on one local path, for one namespace. Thread-safe."""

    def __init__(self, local: LocalPath, namespace: str, clock: Callable[[], float] =
                 time.monotonic, grant_bytes: int = GRANT_BYTES, wait_s: float = 30.0) -> None:
        """wait_s: the most a put waits for a grant being taken ahead (the client's
        timeout_s)."""
        self.local = local
        self._wait_s = wait_s
        self._namespace = namespace
        self._clock = clock
        self._grant_bytes = grant_bytes
        self._lock = threading.Lock()
        self._current: Granted | None = None
        self._next: Granted | None = None
        # The worker that takes the next grant ahead: started once, woken when one is wanted
        # (_refilling), told of the end by _closed; the condition shares the lock.
        self._refilling = False
        self._closed = False
        self._changed = threading.Condition(self._lock)
        self._worker: threading.Thread | None = None
        self._page_size = ASSUMED_PAGE_BYTES
        self._known_page = False
        self._largest = 0  # pages of the largest put so far that a grant held
        self._block_pages = 0  # pages of the largest block so far: the grants' runs
        self._most = 1 << 62  # pages the daemon grants at most, once it gave fewer than asked
        self.posted = PostedCommits()

    def pages_for(self, sizes: list[int]) -> list[int]:
        """How many pages each block takes (the page size of the last grant)."""
        page = self._page_size
        return [max(1, -(-s // page)) for s in sizes]

    def take(self, pages: int, first: bool = False) -> tuple[Granted, int] | None:
        """pages consecutive places in a grant usable now: (grant, first place). A new grant
        is asked for (and waited for) only when neither the current one nor the one taken
        ahead holds them; None when a grant could never hold them (too large a put). first:
        only make sure a grant is held (nothing is handed out)."""
        with self._lock:
            got = self._from_held(pages, first)
            if got is None and self._refilling:  # the next grant is on its way: wait for it
                self._changed.wait_for(lambda: not self._refilling, self._wait_s)
                got = self._from_held(pages, first)
        if got is None:
            if pages > self._most:
                return None  # more than the daemon grants at once: no grant can hold it
            asked = max(pages, self._wanted())
            fresh = self._ask(asked)
            if len(fresh.offsets) < asked:
                self._most = len(fresh.offsets)
            with self._lock:
                self._retire(self._current)
                self._current = fresh
                got = self._from_held(pages, first)
            if got is None:
                return None
        with self._lock:
            current = self._current
            if got is not None and not first:
                self._largest = max(self._largest, pages)  # puts that fit a grant only
            # The next grant is wanted once fewer than REFILL_PUTS puts fit (once half is
            # used, when the grant holds fewer than that).
            low = min(REFILL_PUTS * self._largest, len(current.offsets) // 2 + 1) \
                if current is not None else 0
            if (current is not None and current.left < low
                    and self._next is None and not self._refilling):
                self._refilling = True
                if self._worker is None:
                    self._worker = threading.Thread(target=self._refill, name="kvstore-grant",
                                                    daemon=True)
                    self._worker.start()
                self._changed.notify_all()
        return got

    def _from_held(self, pages: int, first: bool = False) -> tuple[Granted, int] | None:
        """From the current grant, else from the one taken ahead (the current one then
        retired). Called under the lock."""
        now = self._clock()
        for _ in range(2):
            current = self._current
            if current is not None and current.left >= pages and now < current.usable_until:
                at = current.handed
                current.handed += 0 if first else pages
                return current, at
            if self._next is None:
                return None
            self._retire(current)
            self._current, self._next = self._next, None
        return None

    def _retire(self, grant: Granted | None) -> None:
        """What is left of grant goes back (a posted Release; the daemon expires it anyway)."""
        if grant is None or not grant.left:
            return
        grant.handed = len(grant.offsets)
        self.local.post(RELEASE, pb.ReleaseRequest(ids=[grant.grant_id.hex()]))

    def _wanted(self) -> int:
        """Pages to ask a grant for: PUTS_AHEAD of the largest put, within the bounds."""
        page = self._page_size
        return max(MIN_GRANT_BYTES // page,
                   min(PUTS_AHEAD * self._largest, self._grant_bytes // page))

    def _ask(self, pages: int) -> Granted:
        reply = self.local.call_bytes(GRANT, grant_request(self._namespace, pages,
                                                           run_pages=self._block_pages))
        granted = parse_grant(reply, self._clock())
        self._page_size = granted.page_size
        self._known_page = True
        return granted

    def _refill(self) -> None:
        """The worker: each time one is wanted, the next grant, taken before the current
        one runs dry; until the grants are closed."""
        while True:
            with self._lock:
                while not self._refilling and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
            try:
                fresh: Granted | None = self._ask(self._wanted())
            except KVStoreError as exc:
                logger.debug("kvstore: a grant was not taken ahead: %s", exc)
                fresh = None
            with self._lock:
                self._refilling = False
                if fresh is not None:
                    self._retire(self._next)
                    self._next = fresh
                self._changed.notify_all()

    def _settled(self, timeout_s: float | None = None) -> None:
        """Wait for a grant being taken ahead, if any (it is then held)."""
        with self._lock:
            self._changed.wait_for(lambda: not self._refilling, timeout_s)

    def place(self, plan: rq.PutPlan) -> tuple[Granted, int, list[int]] | None:
        """Granted pages for plan's blocks: (grant, first place, pages each block takes);
        the first grant is taken here (it tells the page size). None when no grant can hold
        the put now (too large, or the arena cannot make a grant's room: the caller reserves
        instead, and gets the daemon's exact answer)."""
        if not self._known_page:
            self._block_pages = max(self.pages_for(plan.sizes))  # at the page size assumed
            try:
                self.take(1, first=True)
            except ResourceExhausted:
                return None
        needs = self.pages_for(plan.sizes)
        self._block_pages = max(self._block_pages, max(needs))
        try:
            taken = self.take(sum(needs))
        except ResourceExhausted:
            taken = None
        if taken is None:  # the Reserve that follows must not find the client's room held
            self.give_back()
            return None
        return taken[0], taken[1], needs

    def give_back(self) -> None:
        """Give back what is left of the grants held, and wait for the daemon to take them
        (a put that reserves next is then charged against the client's caps without them)."""
        self._settled()
        with self._lock:
            held = [g for g in (self._current, self._next) if g is not None and g.left]
            self._current = self._next = None
        for grant in held:
            grant.handed = len(grant.offsets)
        if not held:
            return
        try:
            self.local.call(RELEASE, pb.ReleaseRequest(ids=[g.grant_id.hex() for g in held]),
                            pb.ReleaseResponse)
        except KVStoreError as exc:  # expired meanwhile: the daemon has them back already
            logger.debug("kvstore: giving back grants: %s", exc)

    def write(self, plan: rq.PutPlan, placed: tuple[Granted, int, list[int]],
              segment_of: Callable[[str], SharedSegment]) -> bytes:
        """Copy plan's blocks into their granted pages of the segment or arena the grant
        names (segment_of(name): attached if need be), each checksummed as it is written;
        the COMMIT_GRANTED body that makes them entries."""
        grant, first, needs = placed
        segment = segment_of(grant.name)
        spanned = []
        at = first
        for payload, pages in zip(plan.payloads, needs, strict=True):
            spanned.append((_spans(grant, at, pages, payload.nbytes, segment.size_bytes),
                            payload))
            at += pages
        sums = segment.write_many(spanned)  # every block in one native call
        blocks = [(key, payload.nbytes, checksum, pages) for key, payload, checksum, pages
                  in zip(plan.keys, plan.payloads, sums, needs, strict=True)]
        numbers = np.arange(first, at, dtype="<u4").tobytes()  # the places taken, in order
        body: bytes = commit_granted(grant.grant_id, plan.namespace, plan.parent_key,
                                     plan.independent, blocks, numbers)
        return body

    def commit(self, body: bytes) -> None:
        """Post a commit: its answer is read later (`PostedCommits`)."""
        self.posted.sent()
        try:
            self.local.post_bytes(COMMIT_GRANTED, body, self.posted.answer)
        except BaseException:
            self.posted.unsent()
            raise

    def flush(self, timeout_s: float) -> tuple[int, int, int]:
        """Wait for every posted commit's answer; raise the first failure not raised yet,
        else (stored, existing, evicted) of the commits answered since the last flush."""
        totals = self.posted.wait(self.local.settle, timeout_s)
        self.posted.raise_failure()
        return totals

    def close(self, timeout_s: float) -> None:
        """Wait (up to timeout_s) for posted answers, logging a failure; give back what is
        left of the grants."""
        try:
            self.posted.wait(self.local.settle, timeout_s)
        except KVStoreError as exc:
            logger.warning("kvstore: closing with posted commits unanswered: %s", exc)
        self._settled(timeout_s)  # a grant it takes is given back below
        with self._lock:
            self._closed = True
            self._changed.notify_all()
            for grant in (self._current, self._next):
                self._retire(grant)
            self._current = self._next = None


def _spans(grant: Granted, first: int, pages: int, size: int, limit: int) -> Spans:
    """Where a block of size bytes on grant's pages [first, first + pages) lies: one span
    when the pages are consecutive (as a fresh grant's mostly are), else one a page. DataLoss
    when a page lies outside the mapping."""
    offsets = grant.offsets[first:first + pages]
    page = grant.page_size
    start = int(offsets[0])
    if int(offsets.max()) + page > limit:
        raise DataLoss(f"grant pages lie outside the {limit}-byte mapping {grant.name!r}")
    if int(offsets[-1]) - start == (pages - 1) * page:
        return [(start, size)]
    spans: Spans = []
    left = size
    for offset in offsets.tolist():
        n = min(page, left)
        spans.append((offset, n))
        left -= n
    return spans

