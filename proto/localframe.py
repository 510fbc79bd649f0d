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

HELLO = "HOT"  #: the handshake line's first word


def hello(ticket: str) -> bytes:
    """The handshake line that opens a session with ticket ("-" with auth off)."""
    return f"{HELLO} {ticket}\n".encode()
