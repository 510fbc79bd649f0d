"""The store's write side: two-phase puts (plan -> write -> commit, or abort), Reserve for
clients that write shared memory themselves, and imports of blocks fetched from L4.

    begin_put -> write ... -> commit | abort     inline bytes, checksummed as they arrive
    reserve -> (client writes the pages) -> commit_reservation
                                                  the writer's checksums, sampled (or whole)
    import_blocks                                 L4 hits into L2, not offered back to L4
    grant -> (client writes) -> commit_granted ... -> Release or expiry
                                                  free pages held ahead for one client; each
                                                  commit names its keys and which pages

A grant is a plan in the index whose blocks are placeholders (one a run of its pages), held until
its deadline like a reservation: its pages are planned (eviction, demotion) when it is taken,
it counts in the client's holdings (clients.max_reservations, reserved bytes), and the
sweeper or a Release abandons what is left of it. A commit from a grant turns the pages it
names into blocks under the store's lock at once (index.commit_part, as any put: quotas are
the arena's pages, the chain rules and the read tables are the index's), and the grant's plan
holds on to placeholders of the pages left, same id and deadline.

Every put lands in L2. When L2 is full a put waits (at most movers.put_wait_s) for the mover
to demote to L3, then evicts instead. The Store builds one Writer over its StoreState
(`kvstore.daemon.storestate`: the index, the lock, the tiering and the counters it shares with
the store and the Reader) and exposes it as `store.writer`; the servicer and the hot verbs
call it directly.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstore.core import checks
from kvstore.core.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    Reason,
    ResourceExhausted,
)
from kvstore.core.placement import RoomStep
from kvstore.core.records import CommitResult, PlannedBlock, PutSession, Reservation, StorePlan
from kvstore.daemon.blockframe import Verified
from kvstore.daemon.grantpages import PLACEHOLDER_PAGES, GrantPages
from kvstore.daemon.storestate import StoreState
from kvstore.extents import Extent
from kvstore.keys import KEY_BYTES, BlockKey, check_namespace
from kvstore.tier import Tier
from kvstore.tiers.dram import DramTier
from kvstore.units import format_size


def commits_to_verify(blocks: int, policy: str) -> range | list[int]:
    """Which blocks of a commit with the writer's checksums are re-read (dram.verify_commits):
    all, none, or one at random: a writer whose checksums lie (or whose copies are broken) is
    caught within a few commits at 1/blocks of the cost of reading everything."""
    if policy == "all":
        return range(blocks)
    if policy == "none" or blocks == 0:
        return []
    return [secrets.randbelow(blocks)]


#: What one grant may hold of its arena at most: a client holding more would keep that much of
#: the tenant's cache empty (and evict that much more to make it), for a head start of one or
#: two batches.
MAX_GRANT_SHARE = 0.25

#: A block to commit from a grant: key, size in bytes, the writer's xxh3-64, pages it takes.
GrantedBlock = tuple[bytes, int, int, int]


@dataclass(frozen=True, slots=True)
class Grant:
    """A grant as its client gets it: id (32 hex digits, also its Release id), how long it
    is held, the page size, and the tier's page numbers in the grant's order (what a
    commit's page numbers count)."""

    grant_id: str
    expires_in_s: float
    page_size: int
    pages: np.ndarray


class Writer:
    """Puts, reservations and imports from L4, all into L2. Thread-safe: every change to the
    index is made with the store's lock held."""

    def __init__(self, state: StoreState) -> None:
        """state: the store's, shared with its Reader; L2 and L4 are read from it at each
        call, since the store drops them when it closes."""
        self._state = state
        # Each grant's pages by their number in it (None once committed), for grants whose
        # plan is in the index; entries of grants gone are dropped at the next grant.
        self._grants: dict[str, GrantPages] = {}

    def _l2(self) -> DramTier:
        """L2, the tier every put lands in. Raises FailedPrecondition when L2 is off (or
        the store has closed)."""
        dram = self._state.dram
        if dram is None:
            raise FailedPrecondition("no slot tier is enabled (dram.enabled is false)",
                                     setting="dram.enabled")
        return dram

    # --- planning --------------------------------------------------------------------------

    def _plan(
        self, namespace: str, keys: Sequence[bytes], sizes: Sequence[int], parent: bytes,
        independent: bool, timeout_s: float, client: str,
    ) -> tuple[str, list[BlockKey], list[int], list[list[Extent] | None]]:
        server = self._state.config.server
        checked = checks.keys(namespace, keys, server.max_batch_keys)
        sizes = checks.sizes(checked, sizes, server.max_object_bytes)
        parents = checks.chain_parents(namespace, checked, parent, independent)
        tier = self._l2()
        plan_id = secrets.token_hex(12)
        with self._state.lock:
            plan = self._held(tier, plan_id, namespace, checked, sizes, parents, timeout_s,
                              client)
            targets: list[list[Extent] | None] = [None] * len(checked)
            for block in plan.blocks:
                targets[block.index] = tier.extents(block.pages, block.size_bytes)
        return plan_id, checked, sizes, targets

    def _held(self, tier: DramTier, plan_id: str, namespace: str, keys: list[BlockKey],
              sizes: list[int], parents: list[BlockKey | None], timeout_s: float,
              client: str) -> StorePlan:
        """A plan of L2 pages for keys, held for client (checked against its caps as one
        reservation of sum(sizes) bytes): ResourceExhausted when its caps or the arena
        cannot take it. Called under the lock."""
        self._state.index.holdings.check(client, self._state.caps, reservations=1,
                                         reserved_bytes=sum(sizes))
        plan = self._prepare(plan_id, namespace, keys, sizes, parents, timeout_s, client)
        if plan is None:
            raise self._no_room(namespace, sizes, tier.page_size_bytes, tier.capacity_bytes)
        return plan

    def _no_room(self, namespace: str, sizes: list[int], page_size: int,
                 capacity_bytes: int) -> ResourceExhausted:
        index = self._state.index
        need = sum(index.pages_per_object(Tier.DRAM, s) for s in sizes)
        wanted = f"sizes need {need} pages ({format_size(need * page_size)})"
        arena = index.arena_of(namespace)
        if arena is None:
            return ResourceExhausted(f"namespace {namespace!r}: no tenant owns it, so it has "
                                     "no pages to store in", field="namespace")
        if arena and arena not in index.arena_names(Tier.DRAM):
            return ResourceExhausted(f"tenant {arena!r} has no arena yet: tenants added since "
                                     "the daemon started get theirs at its next restart",
                                     setting="auth.tenants_file")
        if arena:  # a tenant's arena: its quota, not the tier, is what is short
            pages = index.arena_usage(Tier.DRAM, arena)[3]
            return ResourceExhausted(
                f"{wanted}; tenant {arena!r} cannot free that many in its dram arena "
                f"({format_size(pages * page_size)}, its quota.dram; pinned and leased blocks "
                "stay)", Reason.QUOTA_EXCEEDED, field="sizes", limit=pages * page_size,
                setting="quota.dram")
        return ResourceExhausted(
            f"{wanted}; the dram tier cannot free that many (capacity "
            f"{format_size(capacity_bytes)}, dram.capacity_bytes; pinned and leased blocks stay)",
            Reason.NO_ROOM, field="sizes", limit=capacity_bytes, setting="dram.capacity_bytes")

    def _prepare(
        self, plan_id: str, namespace: str, keys: list[BlockKey], sizes: list[int],
        parents: list[BlockKey | None], timeout_s: float, client: str,
    ) -> StorePlan | None:
        """Plan L2 pages for a put; the caller holds the lock. The pages are free ones when
        there are enough. Else, when the placement planner says to demote, they are the pages
        the mover frees, waited for at most movers.put_wait_s; else they are freed by
        eviction. None when no tenant owns the namespace or nothing can be freed."""
        index, tiering = self._state.index, self._state.tiering
        movers = self._state.config.movers
        deadline = self._state.clock() + timeout_s
        args = (plan_id, namespace, keys, sizes, parents, Tier.DRAM, deadline)
        arena = index.arena_of(namespace)  # the tenant's (None: nobody owns it)
        if arena is None:
            return None
        plan = index.prepare_store(*args, evict=False, client=client)
        if plan is None:
            need = sum(index.pages_per_object(Tier.DRAM, s) for s in sizes)
            room = tiering.placement.room(Tier.DRAM, need, arena=arena)
            if room.step is RoomStep.DEMOTE and tiering.wait_for_room(
                    Tier.DRAM, need, movers.put_wait_s, arena):
                plan = index.prepare_store(*args, evict=False, client=client)
        if plan is None:
            plan = index.prepare_store(*args, evict=True, client=client)
        if tiering.fullness(Tier.DRAM, arena) >= movers.high_watermark:
            tiering.wake.set()
        return plan

    # --- inline puts -----------------------------------------------------------------------

    def begin_put(
        self, namespace: str, keys: Sequence[bytes], sizes: Sequence[int],
        parent: bytes = b"", independent: bool = False, client: str = "",
        checksums: Sequence[int] | None = None,
    ) -> PutSession:
        """Plan an inline put: L2 pages for each key not stored yet, held until
        leases.reservation_timeout_s. Its bytes then come with write(), and commit() makes
        them entries (or abort() gives the pages back). checksums: the blocks' checksums, one
        per key, when the caller has verified the bytes against them already (an L4 import);
        then nothing is hashed as it is written. Without them each block is hashed as its
        bytes arrive."""
        plan_id, _, sizes, targets = self._plan(
            namespace, keys, sizes, parent, independent,
            self._state.config.leases.reservation_timeout_s, client,
        )
        if checksums is not None:
            known = [c for c, t in zip(checksums, targets, strict=True) if t is not None]
            return PutSession(plan_id, namespace, sizes, targets, [None] * len(targets),
                              sum(sizes), checksums=known)
        hashers = [xxhash.xxh3_64() if t is not None else None for t in targets]
        return PutSession(plan_id, namespace, sizes, targets, hashers, sum(sizes))

    def write(self, session: PutSession, data: memoryview) -> None:
        """Write the next piece of the put's bytes (its values concatenated in key order)
        into the planned pages, hashing each block's bytes as they arrive. The bytes of keys
        already stored are skipped."""
        if session.received_bytes + len(data) > session.total_bytes:
            raise InvalidArgument(
                f"data: more than the {session.total_bytes} bytes that sizes add up to",
                field="data")
        tier = self._l2()
        with self._state.lock:
            if self._state.index.plan(session.plan_id) is None:
                raise Aborted("the put outlived leases.reservation_timeout_s and was abandoned",
                              Reason.ENTRY_VANISHED, setting="leases.reservation_timeout_s")
            self._write_locked(tier, session, data)

    @staticmethod
    def _write_locked(tier: DramTier, session: PutSession, data: memoryview) -> None:
        done = 0
        while done < len(data):
            i = session.block
            n = min(session.sizes[i] - session.block_offset, len(data) - done)
            targets, hasher = session.targets[i], session.hashers[i]
            if targets is not None:
                chunk = data[done : done + n]
                tier.write_at(targets, session.block_offset, chunk)
                if hasher is not None:
                    hasher.update(chunk)
            done += n
            session.block_offset += n
            if session.block_offset == session.sizes[i]:
                session.block += 1
                session.block_offset = 0
        session.received_bytes += len(data)

    def commit(self, session: PutSession, to_remote: bool = True) -> CommitResult:
        """Make the put's blocks entries, with the checksums hashed as they were written
        (or those begin_put was given); with to_remote they are also offered to L4. A put
        short of its bytes is aborted."""
        if session.received_bytes != session.total_bytes:
            self.abort(session.plan_id)
            raise InvalidArgument(
                f"data: received {session.received_bytes} bytes; sizes add up to "
                f"{session.total_bytes}", field="data")
        sums = session.checksums if session.checksums is not None else [
            h.intdigest() for h in session.hashers if h is not None]
        written = sum(s for s, t in zip(session.sizes, session.targets, strict=True) if t)
        return self._complete(session.plan_id, sums, written, to_remote)

    def abort(self, plan_id: str) -> None:
        """Give back a plan's pages; a no-op for a plan already committed, aborted or expired."""
        with self._state.lock:
            if self._state.index.plan(plan_id) is not None:
                self._state.index.complete_store(plan_id, None, success=False)

    def _complete(self, plan_id: str, checksums: list[int], size_bytes: int,
                  to_remote: bool = True) -> CommitResult:
        with self._state.lock:
            plan = self._state.index.plan(plan_id)
            if plan is None:  # the sweeper expired it after the last write
                raise Aborted("the put outlived leases.reservation_timeout_s and was abandoned",
                              Reason.ENTRY_VANISHED, setting="leases.reservation_timeout_s")
            result = self._state.index.complete_store(plan_id, checksums, success=True)
            self._state.stats[Tier.DRAM].bytes_in += size_bytes
        remote = self._state.remote
        if to_remote and remote is not None and plan.blocks:
            remote.offer(plan.namespace, [(b.key, b.size_bytes) for b in plan.blocks])
        return result

    def import_blocks(self, namespace: str, keys: Sequence[BlockKey],
                      blocks: Sequence[Verified]) -> int:
        """Store blocks fetched from L4 in L2 (as unrelated blocks: L4 keeps no chains), not
        offered back to L4; returns how many were new here. Their bytes were checked against
        their checksums when their frames were decoded, so they are copied, not hashed
        again."""
        if not keys:
            return 0
        session = self.begin_put(namespace, keys, [len(b) for b in blocks], independent=True,
                                 checksums=[b.checksum for b in blocks])
        try:
            for block in blocks:
                self.write(session, memoryview(block.data))
            stored = self.commit(session, to_remote=False).stored
        finally:
            self.abort(session.plan_id)  # a no-op once committed
        self._state.stats[Tier.DRAM].promotions += stored
        return stored

    # --- reservations ----------------------------------------------------------------------

    def reserve(
        self, namespace: str, keys: Sequence[bytes], sizes: Sequence[int], parent: bytes = b"",
        independent: bool = False, timeout_s: float | None = None, client: str = "",
    ) -> Reservation:
        """Reserve L2 pages for the client to write itself, held for timeout_s (default
        leases.reservation_timeout_s); keys already stored are marked as existing and get
        none. commit_reservation() then makes the pages entries."""
        timeout_s = timeout_s or self._state.config.leases.reservation_timeout_s
        plan_id, _, _, targets = self._plan(namespace, keys, sizes, parent, independent,
                                            timeout_s, client)
        return Reservation(
            plan_id, [t is None for t in targets], [t or [] for t in targets], timeout_s
        )

    def commit_reservation(self, namespace: str, reservation_id: str,
                           checksums: Sequence[int] = ()) -> CommitResult:
        """Make a reservation's pages entries. checksums are the ones the client computed
        while writing, one per reserved key; dram.verify_commits says how many blocks are
        re-read to check them, and a mismatch frees the whole reservation. Without
        checksums, the pages are checksummed here, as the client wrote them."""
        tier = self._l2()
        with self._state.lock:
            plan = self._state.index.plan(reservation_id)
            if plan is None or plan.namespace != namespace:
                raise InvalidArgument(
                    f"reservation_id {reservation_id!r} is unknown or expired in namespace "
                    f"{namespace!r}", Reason.RESERVATION_EXPIRED, field="reservation_id")
            extents = [tier.extents(b.pages, b.size_bytes) for b in plan.blocks]
        # What the client actually wrote is read without the lock: the pages are the plan's
        # alone, and _complete refuses the commit if the plan expired meanwhile.
        if not checksums:
            sums = [tier.checksum(e) for e in extents]
        else:
            if len(checksums) != plan.num_keys:
                self.abort(reservation_id)
                raise InvalidArgument(
                    f"checksums: {len(checksums)} values for the {plan.num_keys} keys "
                    f"reservation {reservation_id!r} was made for (one per key)",
                    field="checksums")
            sums = [checksums[b.index] for b in plan.blocks]
            for j in commits_to_verify(len(plan.blocks), self._state.config.dram.verify_commits):
                if tier.checksum(extents[j]) != sums[j]:
                    self.abort(reservation_id)
                    raise InvalidArgument(
                        f"checksums[{plan.blocks[j].index}] does not match the bytes written "
                        f"to reservation {reservation_id!r}; the reservation is freed",
                        Reason.CHECKSUM_MISMATCH, field=f"checksums[{plan.blocks[j].index}]")
        return self._complete(reservation_id, sums, sum(b.size_bytes for b in plan.blocks))

    # --- grants ----------------------------------------------------------------------------

    def grant(self, namespace: str, pages: int, timeout_s: float | None = None,
              client: str = "", run_pages: int = 0) -> Grant:
        """Free L2 pages of namespace's arena held for client until timeout_s (default
        leases.reservation_timeout_s): made room for now as a put's would be (demotion,
        eviction), checked against client's caps as a reservation of that many bytes. A
        grant holds at most MAX_GRANT_SHARE of the arena (and server.max_batch_keys pages):
        more asked gets that many. run_pages: the pages one of the client's blocks takes;
        the grant is planned in runs that long (PLACEHOLDER_PAGES when 0), so that it takes
        the pages its blocks' Reserve would have taken (the pages just freed are reused
        first), not only longer free runs."""
        check_namespace(namespace)
        tier = self._l2()
        timeout_s = timeout_s or self._state.config.leases.reservation_timeout_s
        index = self._state.index
        page = tier.page_size_bytes
        if pages < 1:
            raise InvalidArgument(f"pages: {pages} asked; a grant holds at least one",
                                  field="pages")
        with self._state.lock:
            arena = index.arena_of(namespace)
            most = max(1, int(index.arena_usage(Tier.DRAM, arena)[3] * MAX_GRANT_SHARE)) \
                if arena is not None else 1
            pages = min(pages, most, self._state.config.server.max_batch_keys)
            self._grants = {g: s for g, s in self._grants.items() if index.plan(g) is not None}
            grant_id = secrets.token_hex(16)
            run = min(run_pages, pages) if run_pages > 0 else PLACEHOLDER_PAGES
            sizes = [run * page] * (pages // run)
            if pages % run:
                sizes.append(pages % run * page)
            keys = [BlockKey(secrets.token_bytes(KEY_BYTES)) for _ in sizes]
            plan = self._held(tier, grant_id, namespace, keys, sizes, [None] * len(sizes),
                              timeout_s, client)
            held = self._grants[grant_id] = GrantPages(plan.blocks)
            plan.blocks = held.placeholders(page)
        return Grant(grant_id, timeout_s, page, held.pages.copy())

    def commit_granted(self, namespace: str, grant_id: str, parent: bytes, independent: bool,
                       blocks: Sequence[GrantedBlock], numbers: np.ndarray,
                       client: str = "") -> CommitResult:
        """Make blocks the client wrote into pages of its grant entries: each names its key,
        size, checksum as written and how many pages it took, and numbers the grant's pages
        they took, block after block. The pages leave the grant whatever the outcome: a
        block whose key is cached already frees its pages, and a commit refused (a checksum
        that dram.verify_commits finds wrong) frees them all."""
        server = self._state.config.server
        keys = checks.keys(namespace, [b[0] for b in blocks], server.max_batch_keys)
        sizes = checks.sizes(keys, [b[1] for b in blocks], server.max_object_bytes)
        parents = checks.chain_parents(namespace, keys, parent, independent)
        tier = self._l2()
        index = self._state.index
        with self._state.lock:
            plan, held = self._granted(namespace, grant_id, client)
            for i, (size, block) in enumerate(zip(sizes, blocks, strict=True)):
                if block[3] != index.pages_per_object(Tier.DRAM, size):
                    raise InvalidArgument(
                        f"blocks[{i}].pages: {block[3]} pages for {size} bytes, which take "
                        f"{index.pages_per_object(Tier.DRAM, size)}", field=f"blocks[{i}].pages")
            runs = held.take([b[3] for b in blocks], numbers, grant_id)
            planned = [PlannedBlock(i, key, size, r, p) for i, (key, size, r, p)
                       in enumerate(zip(keys, sizes, runs, parents, strict=True))]
            result = self._commit_pages(tier, plan, held, planned, [b[2] for b in blocks])
        remote = self._state.remote
        if remote is not None and result.stored:
            remote.offer(namespace, [(b.key, b.size_bytes) for b in planned])
        return result

    def _granted(self, namespace: str, grant_id: str,
                 client: str) -> tuple[StorePlan, GrantPages]:
        """The plan and pages of client's grant, for a commit in namespace. Called under the
        lock."""
        plan = self._state.index.plan(grant_id)
        held = self._grants.get(grant_id)
        if plan is None or held is None or plan.client != client:
            raise InvalidArgument(f"grant_id {grant_id!r} is unknown or expired (or another "
                                  "client's)", Reason.RESERVATION_EXPIRED, field="grant_id")
        if self._state.index.arena_of(namespace) != plan.arena:
            raise InvalidArgument(f"namespace {namespace!r} is not stored in the arena of "
                                  f"grant {grant_id!r}", field="namespace")
        return plan, held

    def _commit_pages(self, tier: DramTier, plan: StorePlan, held: GrantPages,
                      planned: list[PlannedBlock], checksums: list[int]) -> CommitResult:
        """Commit planned (on pages just taken from plan's grant) as entries, the rest of the
        grant held on under the same id and deadline. Called under the lock."""
        wrong = next((j for j in commits_to_verify(len(planned),
                                                    self._state.config.dram.verify_commits)
                      if tier.checksum(tier.extents(planned[j].pages, planned[j].size_bytes))
                      != checksums[j]), None)
        result = self._state.index.commit_part(
            plan.plan_id, planned, checksums if wrong is None else None,
            held.placeholders(tier.page_size_bytes))
        if not held.left:
            del self._grants[plan.plan_id]
        if wrong is not None:
            raise InvalidArgument(
                f"blocks[{wrong}]: its checksum does not match the bytes written to its pages "
                f"of grant {plan.plan_id!r}; the commit's pages are freed",
                Reason.CHECKSUM_MISMATCH, field=f"blocks[{wrong}].checksum")
        self._state.stats[Tier.DRAM].bytes_in += sum(b.size_bytes for b in planned)
        return result
