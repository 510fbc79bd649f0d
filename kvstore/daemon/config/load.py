"""Loading the config: defaults < YAML file < KVSTORE_* environment < flags, later wins.

Owns the layers (the YAML file, named by a path, --config or $KVSTORE_CONFIG; the environment;
--set section.field=value, then the named flags), converting each raw value to its field's
type once (sizes such as "64GiB" parsed here), and the command-line flags. Every bad value, and
every rule of rules.py a value breaks, becomes one line of one ConfigError naming the setting
as `section.field`, where the value came from (a file's name and line, an environment
variable, a flag), and what to change; a file that is not valid YAML names its line and
column. Reads only the YAML file.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from kvstore.daemon.config.rules import problems
from kvstore.daemon.config.schema import (
    DEFAULTS,
    KINDS,
    LOG_LEVELS,
    SECTIONS,
    Config,
    ConfigError,
)
from kvstore.units import AmbiguousSize, parse_size

ENV_PREFIX = "KVSTORE_"
ENV_CONFIG_FILE = "KVSTORE_CONFIG"
#: KVSTORE_* names that belong to clients and tools, not to the daemon's config.
ENV_CLIENT_NAMES = frozenset({
    "KVSTORE_TARGET", "KVSTORE_NAMESPACE", "KVSTORE_TOKEN", "KVSTORE_TOKEN_FILE",
    "KVSTORE_TLS_CA_FILE", "KVSTORE_TLS_CERT_FILE", "KVSTORE_TLS_KEY_FILE",
    "KVSTORE_TLS_SERVER_NAME", "KVSTORE_UNIX_SOCKET",
})
#: KVSTORE_SECTION_FIELD -> "section.field", for every setting.
ENV_NAMES = {ENV_PREFIX + path.replace(".", "_").upper(): path for path in KINDS}

# --- converting raw values ---------------------------------------------------------------

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _convert(path: str, raw: object) -> object:
    """raw (YAML scalar or env/flag string) as the field's type; ValueError says what to use."""
    kind = KINDS[path]
    if path.endswith("_bytes"):
        try:
            return parse_size(raw)  # type: ignore[arg-type]
        except AmbiguousSize as exc:
            raise ValueError(str(exc)) from None
        except (ValueError, TypeError):
            raise ValueError("not a size; use e.g. 64GiB, 512MiB or 4096") from None
    convert = _CONVERTERS.get(kind)
    if convert is not None:
        return convert(path, raw)
    if not isinstance(raw, str):
        raise ValueError("not a string; quote it")
    return raw.strip().upper() if path == "log_level" else raw


def _to_bool(path: str, raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
        return raw.strip().lower() in _TRUE
    raise ValueError("not a boolean; use true or false")


def _to_int(path: str, raw: object) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and re.fullmatch(r"\s*[-+]?\d+\s*", raw):
        return int(raw)
    raise ValueError(f"not an integer; use e.g. {DEFAULTS[path]}")


def _to_float(path: str, raw: object) -> float:
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return float(raw)
    try:
        return float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"not a number of seconds; use e.g. {DEFAULTS[path]}") from None


#: A setting's kind (KINDS) -> how its raw value becomes that kind; strings stay strings.
_CONVERTERS: dict[str, Callable[[str, object], object]] = {
    "bool": _to_bool, "int": _to_int, "float": _to_float}


# --- layers ------------------------------------------------------------------------------

_Raw = dict[str, tuple[object, str]]  # path -> (raw value, where it came from)


def _unknown(key: str, known: Sequence[str], source: str) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(sorted(known))}"
    return f"unknown setting {key!r} (from {source}); {hint}"


def _read_yaml(path: Path, named_by: str, raw: _Raw, errors: list[str]) -> None:
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(
            f"config file {path} (from {named_by}): cannot read it ({exc.strerror}); "
            f"fix the path or drop {named_by}"
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path}: not UTF-8 text (byte {exc.start}); save it "
                          "as UTF-8") from None
    data, lines = _parse_yaml(path, text, errors)
    if data is None:
        return
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: must be a mapping of sections, not {data!r}")

    def source(key: str) -> str:
        return f"{path} line {lines[key]}" if key in lines else str(path)

    top = [*SECTIONS, *(k for k in KINDS if "." not in k)]
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            for name, item in value.items():
                full = f"{key}.{name}"
                if full in KINDS:
                    raw[full] = (item, source(full))
                else:
                    known = [k for k in KINDS if k.startswith(key + ".")]
                    errors.append(_unknown(full, known, source(full)))
        elif key in SECTIONS:
            errors.append(f"{key} (from {source(key)}): must be a mapping of settings, "
                          f"not {value!r}")
        elif key in KINDS:
            raw[key] = (value, source(key))
        else:
            errors.append(_unknown(str(key), top, source(str(key))))


def _parse_yaml(path: Path, text: str, errors: list[str]) -> tuple[object, dict[str, int]]:
    """The YAML document in text, and the line of each key in it ("section.field" or a
    top-level key): the line a value came from is named beside it. A syntax error is a
    ConfigError naming the file, the line and the column; a key given twice in one mapping
    (YAML would keep the last silently) is one of the errors."""
    lines: dict[str, int] = {}
    loader: yaml.SafeLoader | None = None
    try:
        loader = yaml.SafeLoader(text)
        node = loader.get_single_node()
        if node is None:
            return None, lines
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(_yaml_syntax(path, exc)) from None
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        raise ConfigError(f"config file {path} line {line} column {column}: not valid YAML: "
                          f"{exc.reason} (character #x{exc.character:04x})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML: {exc}") from None
    finally:
        if loader is not None:
            loader.dispose()
    if isinstance(node, yaml.MappingNode):
        _key_lines(node, "", lines, path, errors)
        for key_node, value_node in node.value:
            if isinstance(value_node, yaml.MappingNode) and key_node.value in SECTIONS:
                _key_lines(value_node, f"{key_node.value}.", lines, path, errors)
    return data, lines


def _key_lines(node: yaml.MappingNode, prefix: str, lines: dict[str, int], path: Path,
               errors: list[str]) -> None:
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            continue
        key, line = prefix + str(key_node.value), value_node.start_mark.line + 1
        if key in lines:
            errors.append(f"{key} (from {path} line {line}): set twice in the file (first at "
                          f"line {lines[key]}); keep one")
        lines[key] = line


def _yaml_syntax(path: Path, exc: yaml.MarkedYAMLError) -> str:
    """'config file P line L column C: not valid YAML: what (while parsing ... at line ...)'."""
    mark = exc.problem_mark or exc.context_mark
    where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
    problem = exc.problem or exc.context or "unreadable"
    context = ""
    if exc.problem and exc.context:
        at = exc.context_mark
        context = f" ({exc.context}" + (f" at line {at.line + 1} column {at.column + 1})"
                                        if at is not None else ")")
    return f"config file {path}{where}: not valid YAML: {problem}{context}"


def _apply_flag(text: str, source: str, raw: _Raw, errors: list[str]) -> None:
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep:
        errors.append(f"{text!r} (from {source}): expected section.field=value")
    elif key not in KINDS:
        errors.append(_unknown(key, list(KINDS), source))
    else:
        raw[key] = (value, source)


def _load(path: str | Path | None, env: Mapping[str, str] | None,
          flags: Sequence[tuple[str, str]], path_flag: str = "path") -> Config:
    """Collect raw values layer by layer (later wins), then convert and validate them."""
    env = os.environ if env is None else env
    raw: _Raw = {}
    errors: list[str] = []
    if path is None and env.get(ENV_CONFIG_FILE):
        path, path_flag = env[ENV_CONFIG_FILE], ENV_CONFIG_FILE
    if path is not None:
        _read_yaml(Path(path), path_flag, raw, errors)
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name == ENV_CONFIG_FILE or name in ENV_CLIENT_NAMES:
            continue
        if name in ENV_NAMES:
            raw[ENV_NAMES[name]] = (value, name)
        else:
            errors.append(_unknown(name, [*ENV_NAMES, ENV_CONFIG_FILE], "the environment"))
    for text, source in flags:
        _apply_flag(text, source, raw, errors)
    return _build(raw, errors)


def _build(raw: _Raw, errors: list[str]) -> Config:
    """Convert and validate raw values; raise one ConfigError for these and earlier problems."""
    values: dict[str, Any] = {}
    for key, (value, source) in raw.items():
        try:
            values[key] = _convert(key, value)
        except ValueError as exc:
            errors.append(f"{key} = {value!r} (from {source}): {exc}")
    if errors:
        raise ConfigError("\n".join(errors))
    sections = {
        name: cls(**{k.split(".", 1)[1]: v for k, v in values.items() if k.startswith(name + ".")})
        for name, cls in SECTIONS.items()
    }
    cfg = Config(**sections, **{k: v for k, v in values.items() if "." not in k})
    for key, msg in problems(cfg, chosen=raw.keys()):
        value, source = raw.get(key, (DEFAULTS[key], "default"))
        errors.append(f"{key} = {value!r} (from {source}): {msg}")
    if errors:
        raise ConfigError("\n".join(errors))
    return cfg


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None,
                overrides: Sequence[str] = ()) -> Config:
    """Defaults < YAML file (path, else $KVSTORE_CONFIG) < env (default os.environ) < overrides.

    overrides are "section.field=value" strings, as given to --set.
    """
    return _load(path, env, [(text, "--set") for text in overrides])


# --- command line ------------------------------------------------------------------------

_NAMED_FLAGS = {  # argparse dest -> (setting, flag as typed)
    "host": ("server.host", "--host"),
    "port": ("server.port", "--port"),
    "metrics_port": ("metrics.port", "--metrics-port"),
    "dram_capacity": ("dram.capacity_bytes", "--dram-capacity"),
    "log_level": ("log_level", "--log-level"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --config, the common named flags and repeatable --set section.field=value."""
    group = parser.add_argument_group("configuration")
    group.add_argument("--config", metavar="PATH", help="YAML config file (else $KVSTORE_CONFIG)")
    group.add_argument("--host", help="gRPC listen address (server.host)")
    group.add_argument("--port", help="gRPC listen port, 0 = any free (server.port)")
    group.add_argument("--metrics-port", help="Prometheus port, 0 = any free (metrics.port)")
    group.add_argument("--dram-capacity", metavar="SIZE",
                       help="L2 shared-memory size, e.g. 64GiB (dram.capacity_bytes)")
    group.add_argument("--log-level", help=f"one of {', '.join(LOG_LEVELS)} (log_level)")
    group.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                       dest="set_overrides", help="any setting; repeatable")


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Config:
    """Load the config for parsed args: --set overrides first, then the named flags."""
    flags = [(text, "--set") for text in args.set_overrides or ()]
    for dest, (key, flag) in _NAMED_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            flags.append((f"{key}={value}", flag))
    return _load(args.config, env, flags, "--config")
