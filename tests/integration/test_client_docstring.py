"""The example in `kvstore.client`'s module docstring (what `help(kvstore.client)` shows a
newcomer) runs as written against a real daemon, its address the only change."""

from __future__ import annotations

import textwrap

import kvstore.client
from kvstore.tools.testing import Daemon


def test_the_module_docstring_example_runs(daemon: Daemon) -> None:
    doc = kvstore.client.__doc__ or ""
    indented = [line for line in doc.split("\n\n")[1:3] if line.startswith("    ")]
    source = textwrap.dedent("\n\n".join(indented))
    assert "KVStoreClient(" in source and "get_into" in source
    namespace: dict[str, object] = {}
    try:
        exec(compile(source.replace("127.0.0.1:50051", daemon.target), "<docstring>", "exec"),
             namespace)
    finally:  # the example's namespace is its own, not the test's: leave the shared daemon clean
        with kvstore.client.KVStoreClient(daemon.target, "llama3-8b/tp0") as kv:
            kv.evict(all=True, namespace="llama3-8b/tp0")
    assert namespace["sizes"] == [4096] * 4
    buffers = namespace["buffers"]
    assert [int(b[0]) for b in buffers] == [0, 1, 2, 3]  # type: ignore[attr-defined]
