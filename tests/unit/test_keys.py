"""Block keys: the published vectors reproduce, the scheme is pinned, and misuse is named."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from kvstore.keys import (
    KEY_BYTES,
    InvalidKeyError,
    check_key,
    check_namespace,
    namespace_root,
    prefix_keys,
)

VECTORS_PATH = Path(__file__).resolve().parents[2] / "proto" / "kvstore" / "v1" / "key_vectors.json"
VECTORS: list[dict[str, Any]] = json.loads(VECTORS_PATH.read_text(encoding="utf-8"))["vectors"]


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_published_vector_reproduces(vector: dict[str, Any]) -> None:
    keys = prefix_keys(vector["tokens"], vector["block_size"], vector["namespace"])
    assert [k.hex() for k in keys] == vector["keys"]
    assert namespace_root(vector["namespace"]).hex() == vector["root"]
    assert len(keys) == len(vector["tokens"]) // vector["block_size"]


def test_vectors_cover_the_promised_cases() -> None:
    assert len(VECTORS) >= 6
    assert any(v["tokens"] == [] for v in VECTORS)
    assert any(v["keys"] == [] and v["tokens"] for v in VECTORS)  # partial block only
    assert any(v["block_size"] == 1 for v in VECTORS)
    assert any(2**32 - 1 in v["tokens"] for v in VECTORS)
    assert any(not v["namespace"].isascii() for v in VECTORS)
    assert any(len(v["tokens"]) % v["block_size"] and len(v["keys"]) >= 3 for v in VECTORS)


def test_scheme_recomputed_from_scratch() -> None:
    # Independent of keys.py: if this fails, the scheme changed and every stored key with it.
    vector = next(v for v in VECTORS if v["name"] == "three blocks and a partial")
    ns, size, tokens = vector["namespace"], vector["block_size"], vector["tokens"]
    digest = hashlib.sha256(b"kvstore/v1" + ns.encode("utf-8")).digest()
    expected = []
    for start in range(0, len(tokens) - size + 1, size):
        block = tokens[start : start + size]
        digest = hashlib.sha256(digest + struct.pack(f"<{size}I", *block)).digest()
        expected.append(digest.hex())
    assert expected == vector["keys"]
    assert prefix_keys(tokens, size, ns) == [bytes.fromhex(h) for h in expected]


def test_keys_chain_over_the_whole_prefix() -> None:
    a = prefix_keys([1, 2, 3, 4], 2, "ns")
    b = prefix_keys([9, 9, 3, 4], 2, "ns")
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix
    assert prefix_keys([1, 2, 3, 4, 5], 2, "ns") == a  # trailing partial block has no key


def test_keys_differ_across_namespaces() -> None:
    tokens = list(range(32))
    first = prefix_keys(tokens, 16, "model-a/tp0")
    second = prefix_keys(tokens, 16, "model-a/tp1")
    assert not set(first) & set(second)
    assert all(len(k) == KEY_BYTES for k in first + second)


def test_check_key_wrong_length_names_the_field() -> None:
    with pytest.raises(InvalidKeyError, match="parent_key is 31 bytes"):
        check_key(b"\0" * 31, field="parent_key")
    with pytest.raises(InvalidKeyError, match="^key is 33 bytes"):
        check_key(b"\0" * 33)
    with pytest.raises(InvalidKeyError, match="key must be bytes"):
        check_key("00" * 32)  # type: ignore[arg-type]
    assert check_key(bytearray(32)) == bytes(32)  # type: ignore[arg-type]


def test_check_namespace_errors() -> None:
    with pytest.raises(InvalidKeyError, match="namespace must not be empty"):
        check_namespace("")
    with pytest.raises(InvalidKeyError, match="namespace is 257 bytes"):
        check_namespace("x" * 257)
    with pytest.raises(InvalidKeyError, match="namespace is 258 bytes"):
        check_namespace("é" * 129)  # the limit is bytes, not characters
    assert check_namespace("x" * 256) == "x" * 256


@pytest.mark.parametrize("token", [-1, 2**32])
def test_token_out_of_range(token: int) -> None:
    with pytest.raises(InvalidKeyError, match=f"token id {token} is outside uint32"):
        prefix_keys([0, token], 2, "ns")


@pytest.mark.parametrize("block_size", [0, -4])
def test_block_size_must_be_positive(block_size: int) -> None:
    with pytest.raises(InvalidKeyError, match="block_size must be positive"):
        prefix_keys([1, 2, 3], block_size, "ns")


def test_prefix_keys_checks_the_namespace() -> None:
    with pytest.raises(InvalidKeyError, match="namespace must not be empty"):
        prefix_keys([1, 2], 2, "")
