"""Hand-made frames for the bulk bytes of Put and Get.

A PutRequest or GetResponse that carries only `data` (field 4, length-delimited) is exactly
`0x22 varint(len) bytes`. Writing those frames directly, and reading them back as a memoryview
into the received buffer, skips the copies protobuf would make (into a message, then out to
the wire, then into a fresh bytes on the other side). Serialized messages concatenate as a
merge, so a header message followed by a data frame is one message with both. Everything
else goes through the generated classes. Used by the daemon and the client alike.
"""

from __future__ import annotations

from collections.abc import Sequence

DATA_TAG = b"\x22"  # field 4, wire type 2 (length-delimited)


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def data_frame(head: bytes, pieces: Sequence[memoryview | bytes], size_bytes: int) -> bytes:
    """`head` (a serialized message, or b"") merged with `data` = the pieces concatenated,
    as one buffer: the only copy of the pieces' bytes."""
    if not size_bytes:
        return head
    return b"".join([head, DATA_TAG, varint(size_bytes), *pieces])


def data_of(raw: bytes) -> memoryview | None:
    """The data of a data-only frame as a view into raw (no copy); None for any other
    message, which the caller parses with the generated class."""
    if raw[:1] != DATA_TAG:
        return None
    length = shift = 0
    pos = 1
    end = min(len(raw), 11)
    while pos < end:
        byte = raw[pos]
        pos += 1
        length |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return memoryview(raw)[pos:] if pos + length == len(raw) else None
    return None
