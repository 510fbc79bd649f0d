"""Config layering, size parsing and the messages a bad setting produces."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
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
from kvstore.units import AmbiguousSize


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
        ("10kB", 10_000),
        ("10KB", 10_000),
        ("256MB", 256_000_000),
        ("64gib", 64 << 30),
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


@pytest.mark.parametrize(("text", "fix"), [
    ("256mb", "write 256MB (decimal, 10^6 bytes a MB) or 256MiB (binary, 2^20: what Redis "
              "reads 'mb' as)"),
    ("1Gb", "write 1GB (decimal, 10^9 bytes a GB) or 1GiB (binary, 2^30"),
    ("10kb", "write 10KB"),
    ("2tB", "write 2TB (decimal, 10^12 bytes a TB) or 2TiB (binary, 2^40"),
])
def test_parse_size_refuses_a_decimal_unit_spelled_as_other_tools_read_it_otherwise(
        text: str, fix: str) -> None:
    """Redis reads "256mb" as 256 MiB; kvstore would have read it as 256,000,000 bytes,
    silently 4.6% less. It is refused, naming both spellings."""
    with pytest.raises(AmbiguousSize, match=re.escape(f"{text!r} is ambiguous: {fix}")):
        parse_size(text)


def test_an_ambiguous_size_in_the_config_names_the_setting_and_both_spellings() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(env={"KVSTORE_DRAM_CAPACITY_BYTES": "256mb"})
    assert str(err.value) == (
        "dram.capacity_bytes = '256mb' (from KVSTORE_DRAM_CAPACITY_BYTES): '256mb' is "
        "ambiguous: write 256MB (decimal, 10^6 bytes a MB) or 256MiB (binary, 2^20: what "
        "Redis reads 'mb' as)")


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


def test_bad_value_in_yaml_names_the_file_and_its_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "# kvstore\nserver:\n  port: 6000\n  workers: many\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert str(err.value) == (
        f"server.workers = 'many' (from {path} line 4): not an integer; use e.g. 8")


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


def test_a_rule_between_two_settings_blames_the_one_the_operator_chose() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(env={"KVSTORE_SERVER_CHUNK_BYTES": "8MiB"})
    assert str(err.value) == (
        "server.chunk_bytes = '8MiB' (from KVSTORE_SERVER_CHUNK_BYTES): must be <= "
        "server.max_message_bytes (8.0 MiB) - 64KiB = 7.9 MiB (8128KiB): a chunk and its "
        "message header must fit in one message; lower it or raise server.max_message_bytes")
    with pytest.raises(ConfigError) as err:
        load_config(env={}, overrides=["server.max_message_bytes=4MiB"])
    assert str(err.value) == (
        "server.max_message_bytes = '4MiB' (from --set): must be >= server.chunk_bytes (4.0 MiB)"
        " + 64KiB = 4.1 MiB (4160KiB); raise it or lower server.chunk_bytes")
    # Both chosen: the rule's own setting (the first of the pair) is blamed, once.
    with pytest.raises(ConfigError) as err:
        load_config(env={"KVSTORE_SERVER_CHUNK_BYTES": "8MiB"},
                    overrides=["server.max_message_bytes=8MiB"])
    assert str(err.value).startswith("server.max_message_bytes = '8MiB' (from --set): must be >=")
    assert len(str(err.value).splitlines()) == 1


@pytest.mark.parametrize(
    ("overrides", "blamed", "says"),
    [
        # A value out of its own range is blamed on itself (not on the other), with the range.
        (["movers.high_watermark=1.5"], "movers.high_watermark = '1.5'", "must be in (0, 1]"),
        (["movers.low_watermark=1"], "movers.low_watermark = '1'", "must be in (0, 1)"),
        (["movers.high_watermark=nan"], "movers.high_watermark = 'nan'", "must be in (0, 1]"),
        # In range, but in the wrong order: the one that was set is blamed.
        (["movers.high_watermark=0.5"], "movers.high_watermark = '0.5'",
         "must be above movers.low_watermark (0.75)"),
        (["movers.low_watermark=0.95"], "movers.low_watermark = '0.95'",
         "must be below movers.high_watermark (0.9)"),
        (["movers.low_watermark=0.5", "movers.high_watermark=0.4"],
         "movers.low_watermark = '0.5'", "must be below movers.high_watermark (0.4)"),
        (["server.grace_s=0.5"], "server.grace_s = '0.5'",
         "must be at least server.drain_notice_s (1)"),
        (["server.drain_notice_s=-1"], "server.drain_notice_s = '-1'", "must be >= 0"),
        (["server.workers=4", "server.max_streams=6"], "server.max_streams = '6'",
         "must be 0 or less than server.workers (4)"),
        (["server.max_streams=-1"], "server.max_streams = '-1'", "must be >= 0"),
        (["dram.page_size_bytes=2GiB"], "dram.page_size_bytes = '2GiB'",
         "must be <= dram.capacity_bytes (1.0 GiB)"),
        (["nvme.capacity_bytes=32KiB"], "nvme.capacity_bytes = '32KiB'",
         "must be >= nvme.page_size_bytes (64.0 KiB)"),
        (["server.max_object_bytes=2GiB"], "server.max_object_bytes = '2GiB'",
         "must be <= server.max_response_bytes (1.0 GiB)"),
        (["movers.interval_s=0"], "movers.interval_s = '0'", "must be > 0"),
    ],
)
def test_each_error_names_the_setting_that_is_wrong(overrides: list[str], blamed: str,
                                                    says: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(env={}, overrides=overrides)
    (line,) = str(err.value).splitlines()  # one problem, one line
    assert line.startswith(f"{blamed} (from --set): {says}"), line


def test_a_bad_page_size_is_one_problem_and_watermarks_in_order_are_fine() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(env={}, overrides=["dram.page_size_bytes=5000", "dram.capacity_bytes=4KiB"])
    (line,) = str(err.value).splitlines()  # not also "capacity below the page size"
    assert line.startswith("dram.page_size_bytes = '5000' (from --set): must be a power of two")
    cfg = load_config(env={}, overrides=["movers.high_watermark=1", "movers.low_watermark=0.5"])
    assert (cfg.movers.high_watermark, cfg.movers.low_watermark) == (1.0, 0.5)


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


def test_a_file_that_is_not_a_mapping_or_not_utf8(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must be a mapping of sections"):
        load_config(_write(tmp_path, "- a\n- b\n"), env={})
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"# caf\xe9\nserver:\n  port: 1\n")
    with pytest.raises(ConfigError, match=rf"config file {path}: not UTF-8 text \(byte 5\)"):
        load_config(path, env={})


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        ("server:\n  port: [1, 2\n  workers: 3\n", "line 3 column 10",
         "expected ',' or ']', but got ':' (while parsing a flow sequence at line 2 column 9)"),
        ("server:\n\tport: 1\n", "line 2 column 1", "found character '\\t' that cannot start"),
        ("dram:\n  shm_name: 'open\n", "line 3 column 1", "found unexpected end of stream"),
        ("log_level: *loud\n", "line 1 column 12", "found undefined alias 'loud'"),
        ("server: {}\n---\ndram: {}\n", "line 2 column 1", "but found another document"),
        ("server:\n  port: 1\x00\n", "line 2 column 10", "special characters are not allowed"),
    ],
)
def test_broken_yaml_names_the_file_line_and_column(tmp_path: Path, text: str, where: str,
                                                    what: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    message = str(err.value)
    assert message.startswith(f"config file {path} {where}: not valid YAML: "), message
    assert what in message
    assert "<unicode string>" not in message and "\n" not in message


def test_a_setting_given_twice_in_one_file_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "server:\n  port: 6000\n  workers: 2\n  port: 7000\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert str(err.value) == (f"server.port (from {path} line 4): set twice in the file "
                              "(first at line 2); keep one")


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


@pytest.mark.parametrize("overrides", [
    ["server.max_message_bytes=4MiB"],
    ["server.chunk_bytes=8MiB"],
    ["server.chunk_bytes=100000", "server.max_message_bytes=100000"],
    ["server.max_object_bytes=2GiB"],
    ["dram.page_size_bytes=2GiB"],
    ["nvme.page_size_bytes=8GiB"],
])
def test_size_errors_print_sizes_not_byte_counts(overrides: list[str]) -> None:
    """A limit an operator must meet reads as a size ("7.9 MiB (8128KiB)"), never a raw
    byte count such as 8323072 that they would have to convert before typing it."""
    with pytest.raises(ConfigError) as err:
        load_config(env={}, overrides=overrides)
    message = str(err.value)
    assert not re.search(r"(?<![\w'.])\d{5,}(?![\w'])", message), message


def test_the_rounded_limit_in_a_size_error_is_one_the_rules_accept() -> None:
    """The exact value in parentheses, set as written, satisfies the rule it came from."""
    with pytest.raises(ConfigError) as err:
        load_config(env={}, overrides=["server.chunk_bytes=100000",
                                        "server.max_message_bytes=100000"])
    floor = re.search(r"\((\d+KiB)\)", str(err.value))
    assert floor, str(err.value)
    cfg = load_config(env={}, overrides=["server.chunk_bytes=100000",
                                          f"server.max_message_bytes={floor.group(1)}"])
    assert cfg.server.max_message_bytes >= 100000 + 64 * 1024
