"""The data socket's framing: the local path's (`kvstore.proto.localframe`) over TCP, for
engines on other hosts, with two verbs whose payloads travel raw after their frames.

Both sides import this module (the daemon's `kvstore.daemon.datasocket`, the client's
`kvstore.client._datasocket`); docs/protocol.md ("The data socket") is the same
description for a client in another language.

A session opens as a local one does: with TLS first when the daemon's gRPC port has TLS,
the client's line `HOT <ticket>\\n` (a ticket from Attach over gRPC with auth on; `-` with
auth off) and the daemon's JSON line `{"hot": {"version": 1, "max_frame_bytes": N}}` or
`{"error": ..., "reason": ...}`. Frames are localframe's (REQUEST, REPLY), one request
answered before the next is read. The verbs:

    LOOKUP (1)     LookupRequest -> LookupResponse, as on the Unix socket
    RELEASE (5)    ReleaseRequest -> ReleaseResponse, as on the Unix socket
    GET_DATA (16)  GetRequest (INLINE) -> GetResponse (found, sizes, checksums), then, when
                   status is 0, the found payloads concatenated (sum(sizes) bytes), then
                   one trailer byte: TRAILER_OK; TRAILER_VOID would say the bytes are not
                   the blocks' (the client drops them and asks again). This daemon sends
                   the whole reply within the read's lease or ends the session, so it
                   never sends TRAILER_VOID; a client still honours it
    PUT_DATA (17)  PutRequest (namespace, keys, sizes, parent_key, independent; optionally
                   the writer's checksums), then sum(sizes) payload bytes in key order ->
                   PutResponse

A PUT_DATA frame's payload is not counted in its length (max_frame_bytes bounds the header
message); it may be up to server.max_response_bytes and must arrive by the frame's
deadline, extended by one second per PAYLOAD_BYTES_PER_S. A put refused after its header
(a quota, a namespace not the tenant's) is answered once its payload was read and dropped;
one whose header cannot be read (not a PutRequest, or sizes past the cap) is answered with
the closing flag, and the session ends.
"""

from __future__ import annotations

GET_DATA = 16  #: an INLINE Get whose payloads follow the reply raw, then a trailer byte
PUT_DATA = 17  #: a Put whose payloads follow the request frame raw

TRAILER_OK = 0  #: a Get's payloads are the blocks' bytes
TRAILER_VOID = 1  #: a Get's payloads are not the blocks': drop them, ask again

#: A payload's deadline grows by one second per this many bytes over the frame's own
#: (FRAME_TIMEOUT_S, 10 s): a 1 GiB put has 26 s, which a 400 Mbit/s link meets.
PAYLOAD_BYTES_PER_S = 64 * 1024 * 1024
MAX_IOV = 512  #: buffers per sendmsg call, either side (Linux takes up to 1024)


def advanced(views: list[memoryview], sent: int) -> list[memoryview]:
    """What is left of views, sent in order (sendmsg, up to MAX_IOV at a time, either
    side), once sent bytes of them went out: the views not sent whole, the first cut."""
    i = 0
    while i < len(views) and sent >= views[i].nbytes:
        sent -= views[i].nbytes
        i += 1
    rest = views[i:]
    if sent and rest:
        rest[0] = rest[0][sent:]
    return rest
