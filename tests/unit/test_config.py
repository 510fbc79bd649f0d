"""Config layering, size parsing and the messages a bad setting produces."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from kvstore.daemon.config import (
    Config,
    ConfigError,
    add_arguments,
    config_from_args,
    config_to_dict,
    format_size,
    load_config,
    parse_size,
    redact_url,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64GiB", 64 << 30),
        ("512MiB", 512 << 20),
        ("4KiB", 4096),
        ("1.5GiB", 3 << 29),
        ("4096", 4096),
        ("1TiB", 1 << 40),
        ("2GB", 2_000_000_000),
        ("10kb", 10_000),
        (" 8 MiB ", 8 << 20),
        ("0", 0),
        (123, 123),
    ],
)
def test_parse_size_accepts_binary_decimal_and_bare_bytes(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["4XB", "", "GiB", "-1", "1.5", "1,5GiB", "1e9", "64 GiBs"])
def test_parse_size_rejects_what_is_not_a_size(text: str) -> None:
    with pytest.raises(ValueError, match="not a"):
        parse_size(text)


def test_parse_size_rejects_negative_ints_and_bools() -> None:
    with pytest.raises(ValueError, match="negative"):
        parse_size(-5)
    with pytest.raises(ValueError):
        parse_size(True)


@pytest.mark.parametrize(
    ("n", "text"),
    [(512, "512 B"), (0, "0 B"), (64 << 10, "64.0 KiB"), (1 << 30, "1.0 GiB"), (3 << 29, "1.5 GiB"),
     (2 << 40, "2.0 TiB")],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text


def test_defaults_when_nothing_is_set() -> None:
    cfg = load_config(env={})
    assert cfg == Config()
    assert cfg.server.port == 50051
    assert cfg.server.max_message_bytes == 8 << 20
    assert cfg.server.max_response_bytes == 1 << 30
    assert cfg.dram.capacity_bytes == 1 << 30
    assert cfg.dram.page_size_bytes == 64 << 10
    assert cfg.leases.sweep_interval_s == 0.5
    assert cfg.metrics.port == 9400
    assert cfg.log_level == "INFO"


def test_config_is_frozen() -> None:
    cfg = load_config(env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.server.port = 1  # type: ignore[misc]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvstore.yaml"
    path.write_text(text)
    return path


def test_layers_yaml_then_env_then_flags(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "server:\n  port: 6000\n  workers: 3\ndram:\n  capacity_bytes: 2GiB\n"
        "  enabled: false\nlog_level: warning\n",
    )
    env = {"KVSTORE_SERVER_PORT": "7000", "KVSTORE_LEASES_LEASE_TIMEOUT_S": "2.5",
           "HOME": "/root", "KVSTOREX": "ignored: no underscore prefix"}
    cfg = load_config(path, env=env, overrides=["server.port=8000", "dram.enabled=yes"])
    assert cfg.server.port == 8000  # flag beats env beats file
    assert cfg.server.workers == 3  # file only
    assert cfg.dram.capacity_bytes == 2 << 30
    assert cfg.dram.enabled is True
    assert cfg.leases.lease_timeout_s == 2.5
    assert cfg.log_level == "WARNING"


def test_kvstore_config_env_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "metrics:\n  port: 9999\n")
    assert load_config(env={"KVSTORE_CONFIG": str(path)}).metrics.port == 9999


def test_explicit_path_wins_over_kvstore_config(tmp_path: Path) -> None:
    path = _write(tmp_path, "metrics:\n  port: 9999\n")
    cfg = load_config(path, env={"KVSTORE_CONFIG": str(tmp_path / "missing.yaml")})
    assert cfg.metrics.port == 9999


def test_empty_yaml_file_means_defaults(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, ""), env={}) == Config()


@pytest.mark.parametrize(
    ("text", "expected"),
    [("true", True), ("1", True), ("YES", True), ("on", True),
     ("false", False), ("0", False), ("no", False), ("Off", False)],
)
def test_bool_strings(text: str, expected: bool) -> None:
    assert load_config(env={"KVSTORE_DRAM_PIN_MEMORY": text}).dram.pin_memory is expected


def test_bad_size_from_env_names_field_source_and_fix() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(env={"KVSTORE_DRAM_CAPACITY_BYTES": "4XB"})
    assert str(err.value).startswith(
        "dram.capacity_bytes = '4XB' (from KVSTORE_DRAM_CAPACITY_BYTES): not a size; use e.g. 64GiB"
    )


def test_bad_value_in_yaml_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "server:\n  workers: many\n")
    with pytest.raises(ConfigError, match=rf"server\.workers = 'many' \(from {path}\): not an int"):
        load_config(path, env={})


def test_every_bad_value_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(env={}, overrides=["server.port=x", "dram.enabled=maybe", "leases.grace=1"])
    lines = str(err.value).splitlines()
    assert len(lines) == 3
    assert any(line.startswith("server.port = 'x' (from --set)") for line in lines)
    assert any("dram.enabled = 'maybe'" in line and "true or false" in line for line in lines)
    assert any("unknown setting 'leases.grace'" in line for line in lines)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("server.port=70000", "server.port"),
        ("metrics.port=-1", "metrics.port"),
        ("dram.page_size_bytes=5000", "dram.page_size_bytes"),
        ("dram.page_size_bytes=2KiB", "dram.page_size_bytes"),
        ("dram.capacity_bytes=32KiB", "dram.capacity_bytes"),
        ("server.chunk_bytes=32KiB", "server.chunk_bytes"),
        ("server.max_message_bytes=4MiB", "server.max_message_bytes"),
        ("server.max_object_bytes=0", "server.max_object_bytes"),
        ("server.max_response_bytes=32MiB", "server.max_response_bytes"),
        ("server.max_batch_keys=0", "server.max_batch_keys"),
        ("server.workers=0", "server.workers"),
        ("server.max_streams=8", "server.max_streams"),
        ("server.max_streams_per_connection=-1", "server.max_streams_per_connection"),
        ("server.drain_notice_s=9", "server.drain_notice_s"),
        ("server.grace_s=-1", "server.grace_s"),
        ("leases.lease_timeout_s=0", "leases.lease_timeout_s"),
        ("leases.reservation_timeout_s=nan", "leases.reservation_timeout_s"),
        ("leases.sweep_interval_s=inf", "leases.sweep_interval_s"),
        ("log_level=LOUD", "log_level"),
        ("dram.shm_name=../etc/passwd", "dram.shm_name"),
        ("server.host=", "server.host"),
    ],
)
def test_validation_names_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(env={}, overrides=[override])
    assert str(err.value).startswith(f"{field} = ")
    assert "(from --set)" in str(err.value)


def test_capacity_below_page_is_fine_when_dram_is_off() -> None:
    cfg = load_config(env={}, overrides=["dram.enabled=false", "dram.capacity_bytes=0"])
    assert cfg.dram.capacity_bytes == 0


def test_cross_field_rule_blames_the_default_it_conflicts_with() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(env={"KVSTORE_SERVER_CHUNK_BYTES": "8MiB"})
    message = str(err.value)
    assert message.startswith("server.max_message_bytes = 8388608 (from default)")
    assert "server.chunk_bytes" in message


def test_unknown_env_var_suggests_the_closest_name() -> None:
    with pytest.raises(ConfigError, match="did you mean KVSTORE_DRAM_CAPACITY_BYTES"):
        load_config(env={"KVSTORE_DRAM_CAPACITY": "4GiB"})


def test_unknown_yaml_keys_are_errors_with_suggestions(tmp_path: Path) -> None:
    path = _write(tmp_path, "sever:\n  port: 1\ndram:\n  capacity: 1GiB\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    message = str(err.value)
    assert "unknown setting 'sever'" in message and "did you mean server?" in message
    assert "unknown setting 'dram.capacity'" in message
    assert "did you mean dram.capacity_bytes?" in message
    assert str(path) in message


def test_yaml_section_that_is_not_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="server .* must be a mapping"):
        load_config(_write(tmp_path, "server: 5\n"), env={})


def test_yaml_that_is_not_a_mapping_or_not_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must be a mapping of sections"):
        load_config(_write(tmp_path, "- a\n- b\n"), env={})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "server: [\n"), env={})


def test_missing_config_file_says_who_named_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=r"nope\.yaml \(from KVSTORE_CONFIG\): cannot read it"):
        load_config(env={"KVSTORE_CONFIG": str(missing)})


def test_override_without_equals_sign() -> None:
    with pytest.raises(ConfigError, match="expected section.field=value"):
        load_config(env={}, overrides=["server.port"])


def test_yaml_string_for_int_field_is_rejected_but_quoted_sizes_work(tmp_path: Path) -> None:
    path = _write(tmp_path, "server:\n  chunk_bytes: '1MiB'\n  max_message_bytes: 2MiB\n")
    cfg = load_config(path, env={})
    assert (cfg.server.chunk_bytes, cfg.server.max_message_bytes) == (1 << 20, 2 << 20)
    with pytest.raises(ConfigError, match="not a string; quote it"):
        load_config(_write(tmp_path, "dram:\n  shm_name: 123\n"), env={})


def test_config_to_dict_is_json_ready_with_int_sizes() -> None:
    data = config_to_dict(load_config(env={}, overrides=["dram.capacity_bytes=2GiB"]))
    assert data["dram"]["capacity_bytes"] == 2 << 30
    assert data["log_level"] == "INFO"
    assert json.loads(json.dumps(data)) == data


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_named_flags_and_set(tmp_path: Path) -> None:
    path = _write(tmp_path, "server:\n  port: 6000\n")
    args = _parse([
        "--config", str(path), "--host", "0.0.0.0", "--metrics-port", "0",
        "--dram-capacity", "256MiB", "--log-level", "debug", "--set", "server.workers=2",
        "--set", "leases.sweep_interval_s=0.25",
    ])
    cfg = config_from_args(args, env={})
    assert cfg.server.port == 6000
    assert cfg.server.host == "0.0.0.0"
    assert cfg.metrics.port == 0
    assert cfg.dram.capacity_bytes == 256 << 20
    assert cfg.log_level == "DEBUG"
    assert cfg.server.workers == 2
    assert cfg.leases.sweep_interval_s == 0.25


def test_named_flag_beats_set_and_env() -> None:
    args = _parse(["--set", "server.port=1111", "--port", "2222"])
    assert config_from_args(args, env={"KVSTORE_SERVER_PORT": "3333"}).server.port == 2222


def test_bad_named_flag_names_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"dram.capacity_bytes = 'lots' \(from --dram-capacity\)"):
        config_from_args(_parse(["--dram-capacity", "lots"]), env={})


def test_missing_config_flag_file_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\(from --config\)"):
        config_from_args(_parse(["--config", str(tmp_path / "x.yaml")]), env={})


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_SERVER_PORT", "6123")
    assert load_config().server.port == 6123


def test_config_to_dict_hides_the_redis_password() -> None:
    data = config_to_dict(load_config(env={}, overrides=[
        "remote.url=redis://ops:s3cret@redis.example:6380/2", "remote.password=other-pw"]))
    assert data["remote"]["url"] == "redis://ops:***@redis.example:6380/2"
    assert data["remote"]["password"] == "***"
    assert "s3cret" not in str(data) and "other-pw" not in str(data)
    plain = config_to_dict(load_config(env={}, overrides=["remote.url=redis://r:6379/0"]))
    assert plain["remote"]["url"] == "redis://r:6379/0" and plain["remote"]["password"] == ""


def test_max_response_bytes_below_max_object_bytes_says_what_to_use() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(env={}, overrides=["server.max_object_bytes=256MiB",
                                       "server.max_response_bytes=128MiB"])
    assert str(err.value) == (
        "server.max_response_bytes = '128MiB' (from --set): must be >= server.max_object_bytes "
        "(256.0 MiB): a Get returns at least one block; raise it (e.g. 1GiB) or lower "
        "server.max_object_bytes")
    cfg = load_config(env={}, overrides=["server.max_response_bytes=64MiB"])
    assert cfg.server.max_response_bytes == cfg.server.max_object_bytes == 64 << 20


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://ops:s3cret@redis.example:6380/2", "redis://ops:***@redis.example:6380/2"),
        ("redis://:s3cret@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("rediss://ops:p%40ss@[::1]:6379/0", "rediss://ops:***@[::1]:6379/0"),
        ("redis://ops:p@ss@r:6379", "redis://ops:***@r:6379"),  # an unencoded @ is the password's
        ("redis://r:6379/0?password=s3cret", "redis://r:6379/0?password=***"),
        ("redis://r:6379/0?socket_timeout=5&PassWord=a&db=1&TOKEN=b&auth=c&pass=d&x=%2F",
         "redis://r:6379/0?socket_timeout=5&PassWord=***&db=1&TOKEN=***&auth=***&pass=***&x=%2F"),
        ("redis://r/0?pass%77ord=s3cret&password=again", "redis://r/0?pass%77ord=***&password=***"),
        ("redis://ops:a@r:6379/0?password=b", "redis://ops:***@r:6379/0?password=***"),
    ],
)
def test_redact_url_hides_every_secret(url: str, expected: str) -> None:
    assert redact_url(url) == expected


@pytest.mark.parametrize("url", [
    "",
    "redis://r:6379/0",
    "rediss://ops@r:6379/0",  # a user name alone is no secret
    "redis://ops:@r:6379/0",  # nor an empty password
    "redis://r:6379/0?passwords=x&authority=y&tokens=z&password=",  # other names; no value
    "redis://r:6379/0?socket_timeout=5&&health_check_interval=2",
])
def test_redact_url_keeps_a_url_without_secrets_as_written(url: str) -> None:
    assert redact_url(url) == url


def test_config_to_dict_hides_a_password_in_the_query_string() -> None:
    data = config_to_dict(load_config(env={"KVSTORE_REMOTE_PASSWORD": "env-pw"}, overrides=[
        "remote.url=redis://r:6379/0?socket_timeout=1&password=q-secret&db=0"]))
    assert data["remote"]["url"] == "redis://r:6379/0?socket_timeout=1&password=***&db=0"
    assert data["remote"]["password"] == "***"
    assert "q-secret" not in json.dumps(data) and "env-pw" not in json.dumps(data)
