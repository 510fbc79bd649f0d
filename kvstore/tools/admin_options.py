"""`kvstore-admin`'s global options and argument types: one place for what every command takes.

The global options (`--target`, `--namespace`, `--timeout`, `--json` and the credentials) are
one parent parser shared by the top level and every command, with SUPPRESS defaults, so they
work before or after the command (`kvstore-admin --json stats` = `kvstore-admin stats
--json`); their defaults (the KVSTORE_* variables included) are filled in once parsing is
done. One given twice with two values (before and after the command, say) is refused, not
silently resolved. `kvstore-admin --help` describes them; a command's own --help lists its
options only and points there (GLOBAL_OPTIONS_POINTER), rather than repeating all of them.
Options of one command only are defined with that command (kvstore.tools.admin). A
command-line mistake is one line and exit code 2 (with --json, one JSON object:
kvstore.tools.admin_errors).
"""

from __future__ import annotations

import argparse
import os
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from kvstore.client import credentials as cred
from kvstore.keys import KEY_BYTES, BlockKey
from kvstore.tools.admin_errors import EXIT_USAGE, usage_error
from kvstore.units import parse_size

DEFAULT_TARGET = "127.0.0.1:50051"
ENV_TARGET = "KVSTORE_TARGET"
ENV_NAMESPACE = "KVSTORE_NAMESPACE"


class UsageError(Exception):
    """A command-line mistake found after parsing (exit 2 with the usage)."""


# --- argument types -------------------------------------------------------------------------


def key(text: str) -> BlockKey:
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"key {text!r} is not hex") from None
    if len(raw) != KEY_BYTES:
        raise argparse.ArgumentTypeError(
            f"key {text!r} is {len(raw)} bytes; keys are {KEY_BYTES} bytes ({2 * KEY_BYTES} hex)"
        )
    return BlockKey(raw)


def size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def tokens(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--tokens {text!r} is not a comma-separated list of ints"
        ) from None


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


# --- the global options ---------------------------------------------------------------------


class CommandParser(argparse.ArgumentParser):
    """A parser whose mistakes are one line, as every kvstore-admin error is (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, usage_error(self.prog, message) + "\n")


class HelpFormatter(argparse.HelpFormatter):
    """argparse's wrapping, except that a line never breaks inside a hyphenated word: an
    option such as --tls-server-name stays whole, so it can be copied from the help."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)


class TopHelpFormatter(HelpFormatter):
    """The top level's: its epilog keeps the lines it is written in (a JSON example)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


class _Once(argparse.Action):
    """Store the value, and remember it: the parser refuses a second, different one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.given: list[Any] = []

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        self.given.append(values)
        setattr(namespace, self.dest, values)


class _OnceTrue(_Once):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        super().__call__(parser, namespace, True, option_string)


GLOBAL_OPTIONS_POINTER = (
    "Global options, before or after the command: --target, --namespace, --timeout, --json, "
    "--token, --token-file, --tls-ca, --tls-cert, --tls-key, --tls-server-name; "
    "`kvstore-admin --help` describes each.")


def global_options(described: bool = True) -> CommandParser:
    """A parent parser with the global options: described (the top level's --help lists each
    with what it does) or not (each command's: its --help shows GLOBAL_OPTIONS_POINTER
    instead). Both parse the same options the same way."""

    def shown(text: str) -> str:
        return text if described else argparse.SUPPRESS

    common = CommandParser(add_help=False, argument_default=argparse.SUPPRESS)
    g = common.add_argument_group("global options (before or after the command)")
    g.add_argument("--target", action=_Once, metavar="HOST[:PORT]",
                   help=shown(f"the daemon (env {ENV_TARGET}, default {DEFAULT_TARGET}; no "
                              "port: 50051)"))
    g.add_argument("--namespace", action=_Once, metavar="NS",
                   help=shown(f"the namespace of lookup, pin, unpin, hot and stats' hits; "
                              f"evict's and prewarm's (default: every namespace) (env "
                              f"{ENV_NAMESPACE})"))
    g.add_argument("--timeout", action=_Once, type=positive_float, metavar="SECONDS",
                   help=shown("seconds per call (10)"))
    g.add_argument("--json", action=_OnceTrue,
                   help=shown("machine-readable output on stdout; an error is one JSON object "
                              "on stderr (code, reason, message, exit_code)"))
    auth = common.add_argument_group("credentials (auth.mode token or mtls; global options)")
    add_credential_flags(auth, shown, action=_Once)
    return common


def add_credential_flags(group: Any, shown: Callable[[str], str] = str, **kwargs: Any) -> None:
    """The credential flags (--token, --token-file, --tls-*) on an argument group: `shown`
    turns each help text into what --help prints, kwargs go to every flag (an action, a
    default). kvstore-admin and kvstore-events take the same ones; `check_credentials` after
    parsing refuses --token with --token-file."""
    auth = [
        ("--token", "TOKEN", f"bearer token (env {cred.ENV_TOKEN}); visible in the process "
         "list: prefer --token-file"),
        ("--token-file", "PATH", f"a file holding the token (env {cred.ENV_TOKEN_FILE})"),
        ("--tls-ca", "PATH", f"CA bundle of the daemon's certificate; TLS on (env "
         f"{cred.ENV_TLS_CA_FILE})"),
        ("--tls-cert", "PATH", f"client certificate (mutual TLS), with --tls-key (env "
         f"{cred.ENV_TLS_CERT_FILE})"),
        ("--tls-key", "PATH", f"the client certificate's key (env {cred.ENV_TLS_KEY_FILE})"),
        ("--tls-server-name", "NAME", "the name the daemon's certificate carries, when not "
         f"the target's host (env {cred.ENV_TLS_SERVER_NAME})"),
    ]
    for flag, metavar, what in auth:
        group.add_argument(flag, metavar=metavar, help=shown(what), **kwargs)


def check_credentials(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--token and --token-file together: the parser's usage error."""
    if args.token is not None and args.token_file is not None:
        parser.error("argument --token-file: not allowed with argument --token")


def _defaults() -> dict[str, Any]:
    """Each global option's value when it is not given (read when parsing ends)."""
    return {"target": os.environ.get(ENV_TARGET) or DEFAULT_TARGET,
            "namespace": os.environ.get(ENV_NAMESPACE) or None, "timeout": 10.0,
            "json": False, "token": None, "token_file": None, "tls_ca": None,
            "tls_cert": None, "tls_key": None, "tls_server_name": None}


class AdminParser(CommandParser):
    """The top-level parser: after parsing, the global options not given get their
    defaults, and one given twice with different values is an error (before and after the
    command, the top level's and the command's copy of the option record it)."""

    commons: Sequence[CommandParser]

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None,
                         ) -> tuple[argparse.Namespace, list[str]]:
        once = [a for common in self.commons for a in common._actions if isinstance(a, _Once)]
        for action in once:
            action.given = []
        parsed, rest = super().parse_known_args(args, namespace)
        given: dict[str, list[Any]] = {}
        for action in once:
            given.setdefault(action.dest, []).extend(action.given)
        for dest, values in given.items():
            if len(set(map(repr, values))) > 1:
                hint = (" (prewarm takes several: --namespaces A B)"
                        if dest == "namespace" else "")
                self.error(f"argument --{dest.replace('_', '-')}: given twice, "
                           f"{values[0]!r} and {values[-1]!r}: give it once{hint}")
        for dest, value in _defaults().items():
            if not hasattr(parsed, dest):
                setattr(parsed, dest, value)
        check_credentials(self, parsed)
        return parsed, rest


def credentials(args: argparse.Namespace) -> dict[str, Any]:
    """The client's token and tls from the flags (a flag absent: its variable)."""
    token = args.token
    if args.token_file is not None:
        token = cred.read_token_file(args.token_file, "--token-file")
    tls = cred.tls_settings(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    return {"token": token, "tls": tls}
