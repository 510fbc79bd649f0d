"""The vLLM connector's options and namespace (kvstore.integrations.settings): checked without
vLLM, so a bad value is named at start and two incompatible engines never share a namespace."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvstore.client import TLS
from kvstore.integrations.settings import (
    DEFAULT_TARGET,
    ModelShape,
    Settings,
    SettingsError,
    namespace_for,
    parse_settings,
)
from kvstore.keys import MAX_NAMESPACE_BYTES, check_namespace

SHAPE = ModelShape(model="meta-llama/Llama-3.1-8B", revision=None, kv_dtype="bfloat16",
                   num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                   kv_layout="LBHNC")


def test_defaults_and_the_target_from_the_environment() -> None:
    assert parse_settings(None, env={}) == Settings(target=DEFAULT_TARGET)
    assert parse_settings({}, env={"KVSTORE_TARGET": "kv:7"}).target == "kv:7"
    assert parse_settings({"target": "a:1"}, env={"KVSTORE_TARGET": "kv:7"}).target == "a:1"


def test_every_option_is_read() -> None:
    got = parse_settings({"target": "h:1", "namespace_prefix": "team-a/",
                          "namespace_salt": "ft-3", "token": "s3cret-token",
                          "tls_ca_file": "/ca.pem", "tls_server_name": "kv",
                          "unix_socket": "/run/kv.sock", "shared_memory": False,
                          "load": False, "offload": True, "timeout_s": 0.25,
                          "reconnect_s": 2, "max_pending_batches": 8,
                          "load_policy": "never"}, env={})
    assert got == Settings(target="h:1", namespace_prefix="team-a/", namespace_salt="ft-3",
                           token="s3cret-token", tls=TLS(ca_file="/ca.pem", server_name="kv"),
                           unix_socket="/run/kv.sock", shared_memory=False, load=False,
                           offload=True, timeout_s=0.25, reconnect_s=2.0,
                           max_pending_batches=8, load_policy="never")
    assert parse_settings({"shared_memory": "auto"}).shared_memory is None
    assert parse_settings({"shared_memory": True}).shared_memory is True
    assert parse_settings({}).load_policy == "auto"
    assert parse_settings({"load_policy": "always"}).load_policy == "always"


def test_a_token_file_is_read_at_start(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("file-token-123\n")
    assert parse_settings({"token_file": str(path)}).token == "file-token-123"
    with pytest.raises(SettingsError, match=r"kv_connector_extra_config\.token_file"):
        parse_settings({"token_file": str(tmp_path / "missing")})
    with pytest.raises(SettingsError, match="not both"):
        parse_settings({"token": "abc", "token_file": str(path)})


@pytest.mark.parametrize(("extra", "key"), [
    ({"target": ""}, "target"), ({"target": 5}, "target"),
    ({"timeout_s": 0}, "timeout_s"), ({"timeout_s": "1"}, "timeout_s"),
    ({"timeout_s": True}, "timeout_s"), ({"reconnect_s": -1}, "reconnect_s"),
    ({"load": "yes"}, "load"), ({"offload": 1}, "offload"),
    ({"shared_memory": "sometimes"}, "shared_memory"),
    ({"max_pending_batches": 0}, "max_pending_batches"),
    ({"max_pending_batches": 2.5}, "max_pending_batches"),
    ({"namespace_prefix": 3}, "namespace_prefix"), ({"tls_ca_file": ""}, "tls_ca_file"),
    ({"tagret": "h:1"}, "tagret"),
    ({"load_policy": "sometimes"}, "load_policy"), ({"load_policy": None}, "load_policy"),
    ({"load_policy": ["auto"]}, "load_policy"),
])
def test_a_bad_value_is_refused_naming_its_key(extra: dict[str, object], key: str) -> None:
    with pytest.raises(SettingsError, match=rf"^kv_connector_extra_config\.{key}\b"):
        parse_settings(extra, env={})


def test_the_namespace_names_everything_a_block_depends_on() -> None:
    settings = Settings(namespace_prefix="team-a/", namespace_salt="ft-3")
    ns = namespace_for(settings, SHAPE)
    assert ns == ("team-a/vllm/meta-llama/Llama-3.1-8B@main/bfloat16/32x8x128/bs16/LBHNC/"
                  "tp0of1/ft-3")
    check_namespace(ns)
    variants = [replace(SHAPE, revision="v2"), replace(SHAPE, kv_dtype="fp8"),
                replace(SHAPE, num_layers=16), replace(SHAPE, num_kv_heads=4),
                replace(SHAPE, head_dim=64), replace(SHAPE, block_size=32),
                replace(SHAPE, kv_layout="LBNHC"), replace(SHAPE, tp_rank=1, tp_size=2),
                replace(SHAPE, model="meta-llama/Llama-3.1-70B")]
    names = {namespace_for(settings, v) for v in variants}
    assert ns not in names and len(names) == len(variants)
    assert namespace_for(replace(settings, namespace_salt="other"), SHAPE) != ns


def test_a_long_model_name_is_hashed_and_a_long_prefix_refused() -> None:
    long_model = replace(SHAPE, model="/models/" + "x" * 300)
    ns = namespace_for(Settings(), long_model)
    assert len(ns.encode()) <= MAX_NAMESPACE_BYTES and "xxxx" not in ns
    assert ns != namespace_for(Settings(), replace(long_model, model=long_model.model + "y"))
    with pytest.raises(SettingsError, match="namespace_prefix"):
        namespace_for(Settings(namespace_prefix="p" * 300), SHAPE)
