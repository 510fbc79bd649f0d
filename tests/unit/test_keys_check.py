"""The key list check (kvstore/keys.py check_keys, all_keys) and the client's wrapper of it
(client/_wire.py): a list of 32-byte `bytes` is taken as it is, and every list that is not,
however its lengths add up, is checked key by key, converted or refused naming the key."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvstore.client._wire import check_keys as client_check_keys
from kvstore.client._wire import check_keys_joined
from kvstore.client.errors import InvalidArgument
from kvstore.keys import KEY_BYTES, InvalidKeyError, all_keys, check_keys, joined_keys


class WithDict(bytes):
    """A bytes subclass with an instance dict: a larger fixed size than bytes."""


class NoDict(bytes):
    """A bytes subclass laid out exactly as bytes."""

    __slots__ = ()


def keys(n: int) -> list[bytes]:
    return [hashlib.sha256(str(i).encode()).digest() for i in range(n)]


def test_a_list_of_keys_is_taken_as_it_is() -> None:
    ks = keys(1024)
    assert all_keys(ks) and all_keys([])
    assert check_keys(ks) is ks
    assert client_check_keys(ks) is ks
    assert check_keys([]) == [] and client_check_keys([]) == []
    assert joined_keys(ks) == b"".join(ks) and joined_keys([]) == b""
    checked, joined = check_keys_joined(ks)
    assert checked is ks and joined == b"".join(ks)
    assert check_keys_joined([]) == ([], b"")


def test_keys_joined_after_a_conversion_are_the_converted_ones() -> None:
    ks = keys(3)
    checked, joined = check_keys_joined((bytearray(ks[0]), memoryview(ks[1]), ks[2]))
    assert checked == ks and [type(k) for k in checked] == [bytes] * 3
    assert joined == b"".join(ks)
    with pytest.raises(InvalidArgument, match=r"^prefix\[1\] is 31 bytes"):
        check_keys_joined([ks[0], ks[1][:31]], "prefix")
    assert joined_keys([ks[0], ks[1][:31], ks[1][31:] + ks[2]]) is None
    assert joined_keys([ks[0], bytearray(ks[1])]) is None


@pytest.mark.parametrize(("bad", "name"), [
    (b"\0" * 31, "is 31 bytes"),
    (b"\0" * 33, "is 33 bytes"),
    (b"", "is 0 bytes"),
    ("00" * 16, "must be bytes, got str"),
    (np.zeros(KEY_BYTES, np.uint8), "must be bytes, got ndarray"),
    (None, "must be bytes, got NoneType"),
    (32, "must be bytes, got int"),
])
def test_a_bad_key_is_named_by_its_index(bad: object, name: str) -> None:
    ks: list[object] = [*keys(5), bad, *keys(2)]
    assert not all_keys(ks) and joined_keys(ks) is None
    with pytest.raises(InvalidKeyError, match=rf"^keys\[5\] {name}"):
        check_keys(ks)
    with pytest.raises(InvalidArgument, match=rf"^keys\[5\] {name}"):
        client_check_keys(ks)


def test_lengths_that_add_up_to_whole_keys_are_still_checked_one_by_one() -> None:
    # 31 + 33 bytes join to two keys' worth: the join alone would not tell them apart.
    ks = keys(4)
    split = [ks[0], ks[1][:31], ks[1][31:] + ks[2], ks[3]]
    assert len(b"".join(split)) == KEY_BYTES * len(split)
    assert not all_keys(split)
    with pytest.raises(InvalidKeyError, match=r"^keys\[1\] is 31 bytes"):
        check_keys(split)
    # A subclass with a dict is larger by its dict's pointer: 24 of its bytes take as much
    # room as a 32-byte key; the join is 8 bytes short then, or a longer key makes up for it.
    short = WithDict(b"\1" * 24)
    assert bytes.__sizeof__(short) == bytes.__sizeof__(ks[0])
    for case in ([ks[0], short, ks[1]], [ks[0], short, ks[1] + b"\2" * 8]):
        assert not all_keys(case)
        with pytest.raises(InvalidKeyError, match=r"^keys\[1\] is 24 bytes"):
            check_keys(case)


def test_bytes_likes_are_copied_to_bytes() -> None:
    ks = keys(4)
    given: list[object] = [bytearray(ks[0]), memoryview(ks[1]), WithDict(ks[2]),
                           np.bytes_(ks[3]) if ks[3][-1] else ks[3]]
    assert not all_keys(given)
    checked = check_keys(given)
    assert checked == ks
    assert [type(k) for k in checked] == [bytes] * 4
    assert client_check_keys(tuple(ks)) == ks  # not a list: made one


def test_a_subclass_laid_out_as_bytes_is_taken_as_it_is() -> None:
    ks: list[bytes] = [NoDict(k) for k in keys(3)]
    assert all_keys(ks)
    assert check_keys(ks) is ks  # the same 32 bytes each; nothing to copy


def test_one_key_and_strings_are_not_key_lists() -> None:
    for one in (keys(1)[0], bytearray(32), "k" * 32):
        with pytest.raises(InvalidKeyError, match="not one key"):
            check_keys(one)
