"""The hot verbs' request -> reply logic, written once for both ways in: gRPC
(`kvstore.daemon.servicer`) and the local socket (`kvstore.daemon.localpath`).

    Lookup                      longest cached prefix and each key's tier
    Get (SHARED_MEMORY)         extents in shared memory, leased or not
    Reserve                     pages for the client to write itself
    Put with reservation_id     the commit of a Reserve, with the writer's checksums
    Release                     end leases, abandon reservations (and grants)
    Grant (local path only)     free pages held ahead for a client's puts
    CommitGranted (local only)  blocks written into a grant's pages made entries

Each takes the authenticated Caller and the decoded request message and returns the reply
message, raising the daemon's errors (kvstore.core.errors); mapping them to a status is the
transport's part (`kvstore.daemon.faults.status_for`). Lookup is answered by the store itself,
Get and Release by its reader (`store.reader`), Reserve and its commit by its writer
(`store.writer`).
"""

from __future__ import annotations

import numpy as np

from kvstore.core.errors import FailedPrecondition, InvalidArgument
from kvstore.core.prefixhits import MAX_BLOCK_TOKENS
from kvstore.core.records import ReadResult
from kvstore.daemon.auth import Caller
from kvstore.daemon.store import Store
from kvstore.daemon.writer import GrantedBlock
from kvstore.keys import KEY_BYTES, MAX_NAMESPACE_BYTES
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.localframe import grant_reply

MAX_LEASE_S = 600  # a client asking for longer and then dying would pin pages that long

Extents = list[list[tuple[int, int]]]
#: A COMMIT_GRANTED request as decoded: grant id, namespace, parent key, independent, blocks.
GrantedCommit = tuple[bytes, str, bytes, bool, list[GrantedBlock], np.ndarray]




def locations(extents: Extents) -> list[pb.BlockLocation]:
    """Each block's extents, (offset, length) pairs, as the reply messages carry them."""
    return [
        pb.BlockLocation(extents=[pb.Extent(offset=o, length=n) for o, n in block])
        for block in extents
    ]


class Verbs:
    """The hot verbs over one store. It keeps nothing of its own beyond the store, so it is
    as thread-safe as the store is."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.config = store.config

    def limits(self) -> pb.LimitsResponse:
        """What a client must respect and what the daemon offers (the Limits verb)."""
        c = self.config
        l2_on = self.store.state.dram is not None
        return pb.LimitsResponse(
            contract="kvstore.v1",
            max_message_bytes=c.server.max_message_bytes,
            chunk_bytes=c.server.chunk_bytes,
            max_batch_keys=c.server.max_batch_keys,
            max_object_bytes=c.server.max_object_bytes,
            max_response_bytes=c.server.max_response_bytes,
            key_bytes=KEY_BYTES,
            max_namespace_bytes=MAX_NAMESPACE_BYTES,
            default_lease_ms=_ms(c.leases.lease_timeout_s),
            max_lease_ms=MAX_LEASE_S * 1000,
            reservation_timeout_ms=_ms(c.leases.reservation_timeout_s),
            max_pin_ms=_ms(c.clients.max_pin_s),
            stream_idle_ms=_ms(c.server.stream_idle_s),
            max_block_tokens=MAX_BLOCK_TOKENS,
            shared_memory=l2_on,
            unix_socket=c.server.unix_socket if l2_on else "",
            auth_mode=c.auth.mode,
        )

    def lookup(self, caller: Caller, request: pb.LookupRequest) -> pb.LookupResponse:
        """The longest cached prefix of the keys and each key's tier (the Lookup verb)."""
        caller.data(request.namespace)
        if request.block_tokens > MAX_BLOCK_TOKENS:
            raise InvalidArgument(f"block_tokens {request.block_tokens} exceeds "
                                  f"{MAX_BLOCK_TOKENS} (tokens per key, the engine's block size)",
                                  field="block_tokens", limit=MAX_BLOCK_TOKENS)
        prefix, tiers = self.store.lookup(request.namespace, request.keys, request.block_tokens)
        return pb.LookupResponse(prefix_length=prefix, tiers=[t or 0 for t in tiers])

    def get_options(self, request: pb.GetRequest) -> tuple[bool, float, bool]:
        """(shared, lease timeout in s, leased) of a Get, its fields checked."""
        if request.mode not in (pb.GET_MODE_INLINE, pb.GET_MODE_SHARED_MEMORY):
            raise InvalidArgument(f"mode {request.mode} is not a GetMode", field="mode")
        shared = request.mode == pb.GET_MODE_SHARED_MEMORY
        if shared and self.store.state.dram is None:
            raise FailedPrecondition("mode SHARED_MEMORY needs the dram tier (dram.enabled)",
                                     field="mode", setting="dram.enabled")
        timeout_s = held_s(request.lease_timeout_ms, "lease_timeout_ms") or (
            self.config.leases.lease_timeout_s)
        leased = not (shared and request.no_lease)  # inline reads lease while streaming
        return shared, timeout_s, leased

    def get_shared(self, caller: Caller, request: pb.GetRequest) -> pb.GetResponse:
        """A whole SHARED_MEMORY Get (the local socket's; gRPC streams its header itself)."""
        caller.data(request.namespace)
        shared, timeout_s, leased = self.get_options(request)
        if not shared:
            raise InvalidArgument("mode: the local socket serves SHARED_MEMORY Gets only; "
                                  "read inline over gRPC", field="mode")
        result = self.store.reader.read(request.namespace, request.keys, timeout_s, leased,
                                        caller.client)
        return self.shared_reply(result, timeout_s, leased)

    def header(self, result: ReadResult) -> pb.GetResponse:
        """The first GetResponse of either mode: which keys were found, and the size and
        checksum of each found block."""
        hits = [e for e in result.entries if e is not None]
        return pb.GetResponse(
            found=[e is not None for e in result.entries],
            sizes=[e.size_bytes for e in hits],
            checksums=[e.checksum for e in hits],
        )

    def shared_reply(self, result: ReadResult, timeout_s: float,
                     leased: bool) -> pb.GetResponse:
        """The whole reply to a SHARED_MEMORY Get: the header, where each found block lies
        in the client's mapping of shared memory, and the lease that holds them."""
        head = self.header(result)
        head.lease_id = result.lease_id if head.sizes and leased else ""
        head.shm_name, head.arena, extents = self.shared(result.extents)
        head.locations.extend(locations(extents))
        head.lease_expires_in_ms = int(timeout_s * 1000)
        return head

    def shared(self, extents: Extents) -> tuple[str, str, Extents]:
        """Where the client finds the blocks: the name of the shared-memory segment (auth
        off) or of the tenant's arena (auth on), the other one "", and the blocks' extents
        as offsets in that segment or arena. Without L2, the extents as they are."""
        dram = self.store.state.dram
        return dram.client_extents(extents) if dram is not None else ("", "", extents)

    def reserve(self, caller: Caller, request: pb.ReserveRequest) -> pb.ReserveResponse:
        """L2 pages for the client to write itself, as extents of its shared memory (the
        Reserve verb)."""
        caller.data(request.namespace)
        r = self.store.writer.reserve(request.namespace, request.keys, request.sizes,
                                      request.parent_key, request.independent,
                                      held_s(request.timeout_ms, "timeout_ms"), caller.client)
        shm_name, arena, extents = self.shared(r.extents)
        return pb.ReserveResponse(
            reservation_id=r.reservation_id, exists=r.exists, locations=locations(extents),
            shm_name=shm_name, arena=arena, expires_in_ms=int(r.expires_in_s * 1000),
        )

    def commit(self, caller: Caller, request: pb.PutRequest) -> pb.PutResponse:
        """A Put whose first message names a reservation: the client wrote the pages."""
        caller.data(request.namespace)
        if not request.reservation_id:
            raise InvalidArgument("reservation_id: the local socket commits reservations "
                                  "only; send bytes inline over gRPC", field="reservation_id")
        if request.keys or request.sizes or request.data or request.parent_key:
            raise InvalidArgument(
                "reservation_id: a commit carries no keys, sizes, data or parent_key "
                "(they were given to Reserve)", field="reservation_id")
        result = self.store.writer.commit_reservation(request.namespace,
                                                      request.reservation_id,
                                                      request.checksums)
        return pb.PutResponse(stored=result.stored, existing=result.existing,
                              evicted=result.evicted)

    def grant(self, caller: Caller, request: tuple[int, int, int, str]) -> bytes:
        """Free pages of the caller's namespace's arena, held for its puts (the local path's
        GRANT): the grant id, and where each page lies in the client's mapping."""
        pages, timeout_ms, run_pages, namespace = request
        caller.data(namespace)
        g = self.store.writer.grant(namespace, pages, held_s(timeout_ms, "timeout_ms"),
                                    caller.client, run_pages)
        offsets = g.pages * g.page_size
        first = int(offsets[0])
        # Every page lies in one arena (the tenant's): its offsets there are the tier's
        # less what the first one's is.
        shm_name, arena, where = self.shared([[(first, g.page_size)]])
        offsets += where[0][0][0] - first
        reply: bytes = grant_reply(bytes.fromhex(g.grant_id), int(g.expires_in_s * 1000),
                                   g.page_size, shm_name, arena, offsets)
        return reply

    def commit_granted(self, caller: Caller, request: GrantedCommit) -> pb.PutResponse:
        """Blocks written into pages of the caller's grant, made entries (the local path's
        COMMIT_GRANTED): answered as a Put."""
        grant_id, namespace, parent, independent, blocks, numbers = request
        caller.data(namespace)
        result = self.store.writer.commit_granted(namespace, grant_id.hex(), parent,
                                                  independent, blocks, numbers, caller.client)
        return pb.PutResponse(stored=result.stored, existing=result.existing,
                              evicted=result.evicted)

    def release(self, caller: Caller, request: pb.ReleaseRequest) -> pb.ReleaseResponse:
        """End leases and abandon reservations (the Release verb). With auth on, a client
        may release only its own."""
        owner = caller.client if self.store.auth.on else None
        return pb.ReleaseResponse(released=self.store.reader.release(request.ids, owner))


def held_s(timeout_ms: int, field: str) -> float | None:
    """A lease's or reservation's asked length in seconds (None: 0 asked, the setting's
    default); InvalidArgument naming field past MAX_LEASE_S."""
    if timeout_ms > MAX_LEASE_S * 1000:
        raise InvalidArgument(f"{field} {timeout_ms} exceeds {MAX_LEASE_S * 1000}",
                              field=field, limit=MAX_LEASE_S * 1000)
    return timeout_ms / 1000 if timeout_ms else None


def _ms(seconds: float) -> int:
    return min(int(seconds * 1000), (1 << 32) - 1)
