"""The local path's framing: the hot verbs' kvstore.v1 messages over the daemon's Unix socket.

Both sides import this module (the daemon's `kvstore.daemon.localpath`, the client's
`kvstore.client._localpath`); docs/local-path.md is the same description for a client in
another language.

Handshake: the client's first line on the socket is `HOT <ticket>\\n` (a ticket from an
Attach call with auth on; `-` with auth off). The daemon answers one JSON line,
`{"hot": {"version": 1, "max_frame_bytes": N}}`, or `{"error": "...", "reason": "..."}`
(an ErrorInfo reason) and closes.

Frames, little-endian, one request answered before the next is read:

    request   u32 length | u8 verb   | length bytes: the verb's request message
    reply     u32 length | u8 status | u8 flags | length bytes

status 0: the bytes are the verb's response message. Else status is the gRPC status code
the same request gets over gRPC, and the bytes are a serialized google.rpc.Status (code,
message, one ErrorInfo: the same reason and metadata as over gRPC); flags bit 1 says so.
flags bit 0: the daemon closes the session after this reply.
"""

from __future__ import annotations

import struct
from typing import Any

VERSION = 1  #: of the framing, in the handshake's answer

# The verbs, by their number in a request frame.
LOOKUP = 1  #: LookupRequest -> LookupResponse
GET = 2  #: GetRequest (GET_MODE_SHARED_MEMORY only) -> GetResponse
RESERVE = 3  #: ReserveRequest -> ReserveResponse
COMMIT = 4  #: PutRequest with reservation_id -> PutResponse
RELEASE = 5  #: ReleaseRequest -> ReleaseResponse
VERB_NAMES = {LOOKUP: "Lookup", GET: "Get", RESERVE: "Reserve", COMMIT: "Put",
              RELEASE: "Release"}

REQUEST = struct.Struct("<IB")  #: length, verb
REPLY = struct.Struct("<IBB")  #: length, status, flags
CLOSING = 1  #: flags bit 0: the daemon ends the session after this reply
STATUS_BODY = 2  #: flags bit 1: the error reply's bytes are a serialized google.rpc.Status

# The read table's reports (docs/local-path.md, "Reads through the table"): the daemon sends
# no reply, so a client posts them and never waits.
READS = 6  #: a LookupRequest of keys read through the table: touched, counted as hits
LOOKUPS_READ = 7  #: how many keys Lookups found through the table: prefix hits (LOOKED)
NO_REPLY = frozenset({READS, LOOKUPS_READ})
#: Verb 7's body, not a protobuf: the keys found (u64) and the tokens each covers (u32),
#: then the namespace in UTF-8. Only counts: a lookup's keys are not needed to count it.
LOOKED = struct.Struct("<QI")

HELLO = "HOT"  #: the handshake line's first word
TABLES_OPTION = "tables"  #: `HOT <ticket> tables`: the handshake's answer carries the tables


def hello(ticket: str, *options: str) -> bytes:
    """The handshake line that opens a session with ticket ("-" with auth off), asking for
    options (TABLES_OPTION: the read tables with the answer)."""
    return " ".join((HELLO, ticket, *options)).encode() + b"\n"

# --- grants: puts that never wait (docs/local-path.md, "Puts from a grant") ----------------
#
# A client takes a grant of free pages in its tenant's arena (GRANT), writes blocks into
# them, and commits them (COMMIT_GRANTED) naming the pages by their place in the grant. It may
# post the commit (send it and read the answer later) or wait for it. What it has not used
# goes back with RELEASE (ids=[the grant id as 32 hex digits]) or when the grant expires.
# Bodies are struct-packed, little-endian; strings are UTF-8.
# (8 and 9 stay unassigned: clients and tests use 9 as a verb no daemon knows.)
GRANT = 10  #: GRANT_REQUEST + namespace -> GRANT_REPLY + names + u64 offset per page
COMMIT_GRANTED = 11  #: COMMITTED head + namespace + [parent] + blocks + pages -> PutResponse

#: Pages wanted, timeout in ms (0: leases.reservation_timeout_s), pages a block of the
#: client's takes (0: any; the daemon plans the grant in runs of that many pages, as it
#: would plan those blocks), then the namespace.
GRANT_REQUEST = struct.Struct("<III")
#: Grant id, expires in ms, page size, pages, length of shm_name, length of arena; then
#: shm_name, arena (one of them empty, as in a ReserveResponse) and one u64 per page: its
#: offset in that segment or arena, in the order the commit's page numbers count.
GRANT_REPLY = struct.Struct("<16sIIIHH")
#: Grant id, blocks, flags (INDEPENDENT, HAS_PARENT), length of the namespace; then the
#: namespace, the 32-byte parent key when HAS_PARENT, one BLOCK per block, and the blocks'
#: page numbers (u32 each, places in the grant), block after block.
COMMITTED = struct.Struct("<16sIBH")
INDEPENDENT = 1  #: COMMITTED flags bit 0: the blocks are unrelated (no chain)
HAS_PARENT = 2  #: COMMITTED flags bit 1: a parent key follows the namespace
BLOCK = struct.Struct("<32sQQI")  #: key, size in bytes, xxh3-64 as written, pages it takes
PAGE_NUMBER = struct.Struct("<I")
VERB_NAMES.update({GRANT: "Grant", COMMIT_GRANTED: "CommitGranted"})


def grant_request(namespace: str, pages: int, timeout_ms: int = 0, run_pages: int = 0) -> bytes:
    """A GRANT body: pages wanted in namespace's arena, held for timeout_ms, planned in runs
    of run_pages (the client's blocks' size in pages; 0: the daemon's choice)."""
    return GRANT_REQUEST.pack(pages, timeout_ms, run_pages) + namespace.encode()


def grant_reply(grant_id: bytes, expires_in_ms: int, page_size: int, shm_name: str,
                arena: str, offsets: Any) -> bytes:
    """A GRANT answer: the grant and where each of its pages lies (offsets: a numpy array,
    or any sequence of ints)."""
    shm, name = shm_name.encode(), arena.encode()
    packed = offsets.astype("<u8").tobytes() if hasattr(offsets, "astype") else struct.pack(
        f"<{len(offsets)}Q", *offsets)
    return (GRANT_REPLY.pack(grant_id, expires_in_ms, page_size, len(offsets), len(shm),
                             len(name)) + shm + name + packed)


def commit_granted(grant_id: bytes, namespace: str, parent: bytes, independent: bool,
                   blocks: list[tuple[bytes, int, int, int]], pages: bytes) -> bytes:
    """A COMMIT_GRANTED body: blocks as (key, size, checksum, pages it takes), and pages:
    the page numbers (u32 little-endian each, places in the grant), block after block."""
    ns = namespace.encode()
    flags = (INDEPENDENT if independent else 0) | (HAS_PARENT if parent else 0)
    parts = [COMMITTED.pack(grant_id, len(blocks), flags, len(ns)), ns, parent]
    parts.extend(BLOCK.pack(*block) for block in blocks)
    parts.append(pages)
    return b"".join(parts)
