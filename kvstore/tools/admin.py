"""`kvstore-admin`: the operator's command line for a running daemon, over the client library.

    kvstore-admin [--target HOST:PORT] [--namespace NS] [credentials] COMMAND
      stats [--json] [--watch SECONDS]     per-tier tables and summary (the daemon's auth
                                           mode and your tenant; a warning when auth is off);
                                           --watch refreshes; L4's "on" is up/down/probing
      evict [--tier T] [--bytes SIZE] [--all] [--key HEX ...] [--namespace NS] [--json]
      lookup KEYHEX... | --tokens 1,2,3 [--block-size 16]      prefix length, tier per key
      pin KEYHEX... / unpin KEYHEX...
      hot [--limit N] [--json]             the namespace's hottest L4 blocks: key, score
      prewarm [--bytes SIZE] [--namespace NS ...] [--max-time SECONDS] [--json]
                                           pull the hottest L4 blocks local, with progress
      health                               prints SERVING etc.; exit 0 only when SERVING
      drain [--wait] [--json]              stop the daemon gracefully, as SIGTERM does; --wait
                                           until it has exited
      config [--json]                      the daemon's effective config

Credentials (auth.mode token or mtls; each flag's default is the client's variable):
      --token TOKEN | --token-file PATH    bearer token (KVSTORE_TOKEN, KVSTORE_TOKEN_FILE)
      --tls-ca PATH  --tls-cert PATH  --tls-key PATH  --tls-server-name NAME
                                           TLS, mutual with a cert and key (KVSTORE_TLS_*)

Exit codes: 0 success, 1 a request failed (`error: <message>` on stderr, or health not
SERVING), 2 the daemon could not be reached (or the command line was wrong).

Owns the arguments, the verbs and the talking to the daemon; the tables it prints are built
in kvstore.tools.tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.progress import DownloadColumn, Progress, TransferSpeedColumn

from kvstore.client import (
    DeadlineExceeded,
    KVStoreClient,
    KVStoreError,
    PrewarmResult,
    Retry,
    Unavailable,
    prefix_keys,
)
from kvstore.client import credentials as cred
from kvstore.keys import KEY_BYTES, BlockKey
from kvstore.tier import TIER_LABELS
from kvstore.tools.tables import hot_table, lookup_table, stats_view
from kvstore.units import format_size, parse_size

DEFAULT_TARGET = "127.0.0.1:50051"
ENV_TARGET = "KVSTORE_TARGET"
ENV_NAMESPACE = "KVSTORE_NAMESPACE"
# The client needs a namespace; commands that are not about one never send it.
_NO_NAMESPACE = "kvstore-admin"
EXIT_OK, EXIT_FAILED, EXIT_UNREACHABLE = 0, 1, 2


# --- argument types -------------------------------------------------------------------------


def _key(text: str) -> BlockKey:
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"key {text!r} is not hex") from None
    if len(raw) != KEY_BYTES:
        raise argparse.ArgumentTypeError(
            f"key {text!r} is {len(raw)} bytes; keys are {KEY_BYTES} bytes ({2 * KEY_BYTES} hex)"
        )
    return BlockKey(raw)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _tokens(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--tokens {text!r} is not a comma-separated list of ints"
        ) from None


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstore-admin", description="Inspect and manage a running kvstore daemon."
    )
    parser.add_argument(
        "--target",
        default=os.environ.get(ENV_TARGET, DEFAULT_TARGET),
        help=f"daemon address HOST:PORT (env {ENV_TARGET}, default {DEFAULT_TARGET})",
    )
    parser.add_argument(
        "--namespace",
        default=os.environ.get(ENV_NAMESPACE) or None,
        help=f"namespace for key commands (env {ENV_NAMESPACE})",
    )
    parser.add_argument("--timeout", type=_positive_float, default=10.0, help="seconds per call")
    _add_credentials(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_entry_commands(sub)
    _add_daemon_commands(sub)
    return parser


def _add_credentials(parser: argparse.ArgumentParser) -> None:
    """--token/--token-file and --tls-*: absent, the client's KVSTORE_* variables apply."""
    auth = parser.add_argument_group("credentials (auth.mode token or mtls)")
    token = auth.add_mutually_exclusive_group()
    token.add_argument("--token", help=f"bearer token (env {cred.ENV_TOKEN}); visible in the "
                       "process list: prefer --token-file")
    token.add_argument("--token-file", metavar="PATH",
                       help=f"a file holding the token (env {cred.ENV_TOKEN_FILE})")
    for flag, var, what in (
        ("--tls-ca", cred.ENV_TLS_CA_FILE, "CA bundle of the daemon's certificate; TLS on"),
        ("--tls-cert", cred.ENV_TLS_CERT_FILE, "client certificate (mutual TLS), with --tls-key"),
        ("--tls-key", cred.ENV_TLS_KEY_FILE, "the client certificate's key"),
        ("--tls-server-name", cred.ENV_TLS_SERVER_NAME, "the name the daemon's certificate "
         "carries, when not the target's host"),
    ):
        auth.add_argument(flag, metavar="NAME" if flag.endswith("name") else "PATH",
                          help=f"{what} (env {var})")


def _credentials(args: argparse.Namespace) -> dict[str, Any]:
    """The client's token and tls from the flags (a flag absent: its variable)."""
    token = args.token
    if args.token_file is not None:
        token = cred.read_token_file(args.token_file, "--token-file")
    tls = cred.tls_settings(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    return {"token": token, "tls": tls}


def _add_entry_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """stats, evict, lookup, pin and unpin: the daemon's entries and tiers."""
    stats = sub.add_parser("stats", help="per-tier capacity, use and counters")
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    stats.add_argument("--watch", type=_positive_float, metavar="SECONDS", help="refresh period")

    evict = sub.add_parser("evict", help="evict named keys, a number of bytes, or everything")
    evict.add_argument("--tier", choices=TIER_LABELS, help="default: all")
    evict.add_argument("--bytes", type=_size, default=0, metavar="SIZE", help='e.g. "64MiB"')
    evict.add_argument("--all", action="store_true", help="everything evictable")
    evict.add_argument("--key", type=_key, action="append", default=[], metavar="HEX")
    evict.add_argument(
        "--namespace",
        dest="evict_namespace",
        default=None,
        help='default: the global --namespace, else every namespace ("")',
    )
    evict.add_argument("--json", action="store_true")

    lookup = sub.add_parser("lookup", help="cached prefix length and the tier of each key")
    lookup.add_argument("keys", nargs="*", type=_key, metavar="KEYHEX")
    lookup.add_argument("--tokens", type=_tokens, help="derive keys from token ids: 1,2,3")
    lookup.add_argument("--block-size", type=int, default=16, help="tokens per block")
    lookup.add_argument("--json", action="store_true")

    for name, verb in (("pin", "never evict"), ("unpin", "allow evicting again")):
        cmd = sub.add_parser(name, help=f"{verb}: these keys")
        cmd.add_argument("keys", nargs="+", type=_key, metavar="KEYHEX")
        cmd.add_argument("--json", action="store_true")


def _add_daemon_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """hot and prewarm (L4), health and config."""
    hot = sub.add_parser("hot", help="the namespace's most used L4 blocks, hottest first")
    hot.add_argument("--limit", type=int, default=100, help="how many keys (default 100)")
    hot.add_argument("--json", action="store_true")

    prewarm = sub.add_parser("prewarm", help="pull the hottest L4 blocks into the local tiers")
    prewarm.add_argument(
        "--bytes", type=_size, default=0, metavar="SIZE", help="default: remote.prewarm_bytes"
    )
    prewarm.add_argument(
        "--namespace",
        dest="prewarm_namespaces",
        action="append",
        default=[],
        metavar="NS",
        help="repeatable; default: the global --namespace, else every namespace",
    )
    prewarm.add_argument("--max-time", type=_positive_float, default=600.0, help="seconds (600)")
    prewarm.add_argument("--json", action="store_true", help="no progress bar; final JSON")

    health = sub.add_parser("health", help="grpc.health.v1 status; exit 0 only when SERVING")
    health.add_argument("--service", default="", help='health service name (default "")')

    drain = sub.add_parser("drain", help="stop the daemon gracefully (NOT_SERVING, then exit)")
    drain.add_argument("--wait", action="store_true", help="until the daemon has exited")
    drain.add_argument("--json", action="store_true")

    config = sub.add_parser("config", help="the daemon's effective configuration")
    config.add_argument("--json", action="store_true", help="raw JSON")


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


# --- commands -------------------------------------------------------------------------------


def cmd_stats(client: KVStoreClient, args: argparse.Namespace, console: Console) -> int:
    namespace = args.namespace
    if args.json and not args.watch:
        _print_json(client.stats(namespace=namespace).to_dict())
        return EXIT_OK
    if not args.watch:
        console.print(stats_view(client.stats(namespace=namespace), client.target))
        return EXIT_OK
    try:
        if args.json:
            while True:
                print(json.dumps(client.stats(namespace=namespace).to_dict()), flush=True)
                time.sleep(args.watch)
        view = stats_view(client.stats(namespace=namespace), client.target)
        with Live(view, console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(args.watch)
                live.update(stats_view(client.stats(namespace=namespace), client.target))
    except KeyboardInterrupt:
        return EXIT_OK


def cmd_evict(client: KVStoreClient, args: argparse.Namespace, console: Console) -> int:
    if not (args.bytes or args.all or args.key):
        raise UsageError("evict needs --bytes, --all or --key")
    namespace = args.evict_namespace
    if namespace is None:
        namespace = args.namespace if args.namespace is not None else ""
    if args.key and not namespace:
        raise UsageError("evict --key needs --namespace")
    result = client.evict(
        args.key or None, bytes=args.bytes, all=args.all, tier=args.tier, namespace=namespace
    )
    if args.json:
        _print_json(asdict(result))
    else:
        where = f"namespace {namespace!r}" if namespace else "every namespace"
        tier = f"tier {args.tier}" if args.tier else "every tier"
        why = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in result.reasons.items())
        print(
            f"evicted {result.evicted} entries ({format_size(result.evicted_bytes)}) from {where}, "
            f"{tier}; skipped {result.skipped}" + (f" ({why})" if why else "")
        )
    return EXIT_OK


def cmd_lookup(client: KVStoreClient, args: argparse.Namespace, console: Console) -> int:
    keys: list[BlockKey] = list(args.keys)
    if args.tokens is not None:
        if keys:
            raise UsageError("lookup takes KEYHEX arguments or --tokens, not both")
        keys = prefix_keys(args.tokens, args.block_size, client.namespace)
    if not keys:
        raise UsageError("lookup needs KEYHEX arguments or --tokens")
    result = client.lookup(keys)
    tiers = (list(result.tiers) + [None] * len(keys))[: len(keys)]
    if args.json:
        rows = [{"key": k.hex(), "tier": t} for k, t in zip(keys, tiers, strict=True)]
        _print_json({"prefix_length": result.prefix_length, "keys": rows})
        return EXIT_OK
    print(f"prefix length: {result.prefix_length} of {len(keys)}")
    console.print(lookup_table(keys, tiers))
    return EXIT_OK


def cmd_pin(client: KVStoreClient, args: argparse.Namespace, console: Console) -> int:
    pinning = args.command == "pin"
    result = client.pin(args.keys) if pinning else client.unpin(args.keys)
    if args.json:
        _print_json(asdict(result))
    else:
        print(f"{'pinned' if pinning else 'unpinned'} {result.changed}; missing {result.missing}")
    return EXIT_OK


def cmd_hot(client: KVStoreClient, args: argparse.Namespace, console: Console) -> int:
    result = client.hot(args.limit)
    pairs = list(zip(result.keys, result.scores, strict=True))
    if args.json:
        _print_json({"keys": [{"key": k.hex(), "score": s} for k, s in pairs]})
        return EXIT_OK
    console.print(hot_table(client.namespace, pairs))
    return EXIT_OK


def cmd_prewarm(client: KVStoreClient, args: argparse.Namespace, console: Console) -> int:
    namespaces = args.prewarm_namespaces or ([args.namespace] if args.namespace else [])
    columns = (*Progress.get_default_columns(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=console, disable=args.json) as progress:
        task = progress.add_task("prewarm", total=args.bytes or None)

        def show(p: PrewarmResult) -> None:
            progress.update(task, completed=p.bytes, total=p.target_bytes or None)

        result = client.prewarm(args.bytes, namespaces, show, timeout_s=args.max_time)
    if args.json:
        _print_json(asdict(result))
        return EXIT_OK
    where = ", ".join(repr(n) for n in namespaces) if namespaces else "every namespace"
    print(
        f"prewarmed {result.blocks:,} blocks ({format_size(result.bytes)} of a "
        f"{format_size(result.target_bytes)} target) from {where}"
    )
    return EXIT_OK


def cmd_health(client: KVStoreClient, args: argparse.Namespace, console: Console) -> int:
    status = client.health(args.service)
    print(status)
    return EXIT_OK if status == "SERVING" else EXIT_FAILED


def cmd_drain(client: KVStoreClient, args: argparse.Namespace, console: Console) -> int:
    result = client.drain()
    stopped = _wait_stopped(client, result.grace_s + 5) if args.wait else None
    if args.json:
        _print_json({**asdict(result), **({"stopped": stopped} if args.wait else {})})
    else:
        state = "was already draining" if result.already_draining else "is draining"
        print(f"the daemon at {client.target} {state}: health NOT_SERVING, new data calls "
              f"refused, {result.streams_in_flight} streams in flight finishing; it exits "
              f"within {result.grace_s:g} s")
        if stopped is not None:
            print("it has stopped" if stopped else "error: it is still running", flush=True)
    return EXIT_FAILED if stopped is False else EXIT_OK


def _wait_stopped(client: KVStoreClient, timeout_s: float) -> bool:
    """Whether the daemon stops answering (it exited) within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            client.health()
        except KVStoreError:
            return True
        time.sleep(0.1)
    return False


def cmd_config(client: KVStoreClient, args: argparse.Namespace, console: Console) -> int:
    stats = client.stats(include_config=True)
    if not stats.config_json:
        print("error: the daemon returned no config", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(stats.config_json)
    else:
        console.print_json(stats.config_json)
    return EXIT_OK


Command = Callable[[KVStoreClient, argparse.Namespace, Console], int]
COMMANDS: dict[str, Command] = {
    "stats": cmd_stats,
    "evict": cmd_evict,
    "lookup": cmd_lookup,
    "pin": cmd_pin,
    "unpin": cmd_pin,
    "hot": cmd_hot,
    "prewarm": cmd_prewarm,
    "health": cmd_health,
    "drain": cmd_drain,
    "config": cmd_config,
}
_NEEDS_NAMESPACE = frozenset({"lookup", "pin", "unpin", "hot"})


class UsageError(Exception):
    """A command-line mistake found after parsing."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in _NEEDS_NAMESPACE and not args.namespace:
        parser.error(f"{args.command} needs --namespace (or {ENV_NAMESPACE})")
    # Piped output keeps whole tables instead of squeezing them into 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    try:
        client = KVStoreClient(
            args.target,
            args.namespace or _NO_NAMESPACE,
            shared_memory=False,
            timeout_s=args.timeout,
            retry=Retry(attempts=2),
            **_credentials(args),
        )
    except KVStoreError as exc:
        parser.error(str(exc))
    try:
        with client:
            return COMMANDS[args.command](client, args, console)
    except UsageError as exc:
        parser.error(str(exc))
    except (Unavailable, DeadlineExceeded) as exc:
        print(f"error: kvstore daemon at {args.target} is unreachable: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KVStoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError:  # `kvstore-admin stats --json | head`
        return EXIT_OK
    except KeyboardInterrupt:
        # Ctrl-C is how --watch ends; it may land in a call or while the channel closes.
        return EXIT_OK if getattr(args, "watch", None) else 130


if __name__ == "__main__":
    sys.exit(main())
