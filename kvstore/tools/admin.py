"""`kvstore-admin`: the operator's command line for a running daemon, over the client library.

    kvstore-admin [global options] COMMAND [options]    (global options also after COMMAND)
      stats [--watch SECONDS]              per-tier tables and summary (the daemon's auth
                                           mode and your tenant; a warning when auth is off);
                                           --watch refreshes on a terminal, and prints one
                                           frame (with --json: one line) per period on a pipe
      evict [--tier T] [--bytes SIZE] [--all] [--key HEX [HEX ...]]
                                           in --namespace, else every namespace
      lookup KEYHEX... | --tokens 1,2,3 [--block-size 16]      prefix length, tier per key
      pin KEYHEX... / unpin KEYHEX...     exit 1 naming the keys not stored, if any
      hot [--limit N]                      the namespace's hottest L4 blocks: whole key, score
      prewarm [--bytes SIZE] [--namespaces NS [NS ...]] [--max-time SECONDS]
                                           pull the hottest L4 blocks local (from --namespaces,
                                           else --namespace, else every namespace)
      health [--service NAME]              prints SERVING etc.; exit 0 only when SERVING
      drain [--wait]                       stop the daemon gracefully, as SIGTERM does; --wait
                                           until it has exited
      config                               the daemon's configuration in effect
      limits                               what a client must respect (the Limits verb)

      --version                            kvstore-admin's version (kvstore.__version__, as
                                           `kvstore-server --version` and Stats say)

Global options (kvstore.tools.admin_options): --target HOST[:PORT] (KVSTORE_TARGET, else
127.0.0.1:50051; no port means 50051), --namespace NS (KVSTORE_NAMESPACE), --timeout SECONDS,
--json, and the credentials (auth.mode token or mtls; each flag's default is the client's
variable). `kvstore-admin --help` describes each; a command's --help shows its own options
and points there:
      --token TOKEN | --token-file PATH    bearer token (KVSTORE_TOKEN, KVSTORE_TOKEN_FILE)
      --tls-ca PATH  --tls-cert PATH  --tls-key PATH  --tls-server-name NAME
                                           TLS, mutual with a cert and key (KVSTORE_TLS_*)

Exit codes: 0 success, 1 a request failed or the daemon could not do it (one line on stderr,
`error: <STATUS_NAME>: <the daemon's message>`), health not SERVING, or pin/unpin of a key not
stored, 2 the daemon could not be reached (or the command line was wrong). With --json an
error is one JSON object on stderr, `{"code", "reason", "message", "exit_code"}`, and the exit
code is the same; kvstore.tools.admin_errors.

Owns the commands and the talking to the daemon; the tables it prints are built in
kvstore.tools.tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.progress import Progress, TaskID

from kvstore import __version__
from kvstore.client import (
    KVStoreClient,
    KVStoreError,
    PinResult,
    PrewarmResult,
    Retry,
    Stats,
    prefix_keys,
)
from kvstore.keys import BlockKey
from kvstore.tier import TIER_LABELS
from kvstore.tools import admin_errors
from kvstore.tools import admin_options as opt
from kvstore.tools.admin_errors import (
    EXIT_FAILED,
    EXIT_OK,
    REASON_KEYS_MISSING,
    print_error,
    report,
)
from kvstore.tools.admin_options import ENV_NAMESPACE, UsageError
from kvstore.tools.tables import hot_table, lookup_table, prewarm_columns, stats_view
from kvstore.units import format_size

# The client needs a namespace; commands that are not about one never send it.
_NO_NAMESPACE = "kvstore-admin"
_credentials = opt.credentials  # the name tests and older callers know


_EPILOG = """\
Exit codes: 0 success; 1 a request failed or the daemon could not do it, health is not
SERVING, or pin/unpin named a key that is not stored; 2 the daemon could not be reached, or
the command line was wrong.

Errors go to stderr as one line, `error: STATUS: message`. With --json, an error is one JSON
object on one line of stderr instead (stdout keeps only results), and the exit code is the
same:
  {"code": "NOT_FOUND", "reason": "KEYS_MISSING", "message": "...", "exit_code": 1}
code: the gRPC status name (INVALID_ARGUMENT for a command-line mistake); reason: the
daemon's ErrorInfo reason, or UNREACHABLE, USAGE or KEYS_MISSING, or "" when none.

`kvstore-admin COMMAND --help` shows a command's own options."""

def build_parser() -> argparse.ArgumentParser:
    # The top level describes the global options; each command parses the same options
    # through an undescribed copy, and its --help points to the top level's.
    described, pointed = opt.global_options(), opt.global_options(described=False)
    parser = opt.AdminParser(prog="kvstore-admin", parents=[described],
                             description="Inspect and manage a running kvstore daemon.",
                             epilog=_EPILOG, formatter_class=opt.TopHelpFormatter)
    parser.commons = (described, pointed)
    parser.add_argument("--version", action="version", version=f"kvstore-admin {__version__}")
    # Commands parse with the plain class: the top level fills in the global defaults once.
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=opt.CommandParser)

    def command(name: str, summary: str, more: str = "") -> opt.CommandParser:
        """A command: its one-line summary in the top level's list, and its own --help."""
        description = f"{summary[0].upper()}{summary[1:]}.{' ' + more if more else ''}"
        parser: opt.CommandParser = sub.add_parser(
            name, parents=[pointed], help=summary, description=description,
            epilog=opt.GLOBAL_OPTIONS_POINTER, formatter_class=opt.HelpFormatter)
        return parser

    _add_entry_commands(command)
    _add_daemon_commands(command)
    return parser


NewCommand = Callable[..., opt.CommandParser]
_KEYHEX = "a block key: 64 hex digits, as lookup, hot and the client print them"


def _add_entry_commands(command: NewCommand) -> None:
    """stats, evict, lookup, pin and unpin: the daemon's entries and tiers."""
    stats = command("stats", "per-tier capacity, use and counters",
                    "With --namespace, objects and used bytes are that namespace's.")
    stats.add_argument("--watch", type=opt.positive_float, metavar="SECONDS",
                       help="refresh every SECONDS until Ctrl-C (on a pipe: one frame, or "
                       "with --json one line, per period)")

    evict = command("evict", "evict named keys, a number of bytes, or everything (in "
                    "--namespace, else every namespace)",
                    "What it cannot remove (pinned, leased, loading, or a block with "
                    "cached children) it skips, counted by reason.")
    evict.add_argument("--tier", choices=TIER_LABELS, help="default: all")
    evict.add_argument("--bytes", type=opt.size, default=0, metavar="SIZE",
                       help='at least this much, least recently used leaves first, e.g. "64MiB"')
    evict.add_argument("--all", action="store_true", help="everything evictable")
    evict.add_argument("--key", type=opt.key, nargs="+", action="extend", default=[],
                       metavar="HEX", help="these keys (needs --namespace)")

    lookup = command("lookup", "cached prefix length and the tier of each key",
                     "Needs --namespace.")
    lookup.add_argument("keys", nargs="*", type=opt.key, metavar="KEYHEX",
                        help=f"{_KEYHEX}; a chain, in prefix order")
    lookup.add_argument("--tokens", type=opt.tokens, help="derive keys from token ids: 1,2,3")
    lookup.add_argument("--block-size", type=opt.positive_int, default=16,
                        help="tokens per block (16)")

    for name, verb in (("pin", "never evict"), ("unpin", "allow evicting again")):
        cmd = command(name, f"{verb}: these keys",
                      "Needs --namespace. Exits 1, naming them, when any key is not stored.")
        cmd.add_argument("keys", nargs="+", type=opt.key, metavar="KEYHEX", help=_KEYHEX)


def _add_daemon_commands(command: NewCommand) -> None:
    """hot and prewarm (L4), health, drain and config."""
    hot = command("hot", "the namespace's most used L4 blocks, hottest first",
                  "Needs --namespace and L4 (remote.url).")
    hot.add_argument("--limit", type=opt.positive_int, default=100,
                     help="how many keys (default 100)")

    prewarm = command("prewarm", "pull the hottest L4 blocks into the local tiers",
                      "A progress bar on a terminal; needs L4 (remote.url).")
    prewarm.add_argument(
        "--bytes", type=opt.size, default=0, metavar="SIZE", help="default: remote.prewarm_bytes"
    )
    prewarm.add_argument("--namespaces", nargs="+", action="extend", default=[], metavar="NS",
                         help="pull from these; default: --namespace, else every namespace")
    prewarm.add_argument("--max-time", type=opt.positive_float, default=600.0,
                         metavar="SECONDS", help="the whole prewarm's deadline (600)")

    health = command("health", "grpc.health.v1 status; exit 0 only when SERVING")
    health.add_argument("--service", default="", help='health service name (default "")')

    drain = command("drain", "stop the daemon gracefully (NOT_SERVING, then exit)",
                    "As SIGTERM does: calls in flight finish within server.grace_s.")
    drain.add_argument("--wait", action="store_true", help="until the daemon has exited")

    command("config", "the daemon's configuration in effect", "Needs an admin's credentials "
            "when auth is on; secrets are shown as ***.")
    command("limits", "what a client must respect: message, chunk and batch sizes, leases")


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


# --- commands -------------------------------------------------------------------------------


def _stats_json(stats: Stats) -> dict[str, Any]:
    """Stats as JSON, without config_json: stats never asks for the config (only an admin
    may see it, and `config` shows it), so the field would always be empty."""
    data: dict[str, Any] = stats.to_dict()
    data.pop("config_json", None)
    return data


def cmd_stats(client: KVStoreClient, args: argparse.Namespace, console: Console) -> int:
    def fetch() -> Stats:
        return client.stats(namespace=args.namespace)

    if not args.watch:
        if args.json:
            _print_json(_stats_json(fetch()))
        else:
            console.print(stats_view(fetch(), client.target))
        return EXIT_OK
    try:
        if sys.stdout.isatty() and not args.json:  # one table, redrawn in place
            with Live(stats_view(fetch(), client.target), console=console,
                      refresh_per_second=4) as live:
                while True:
                    time.sleep(args.watch)
                    live.update(stats_view(fetch(), client.target))
        while True:  # a pipe or a file: one frame per period, each flushed as it is made
            if args.json:
                print(json.dumps(_stats_json(fetch()), sort_keys=True))
            else:
                console.print(stats_view(fetch(), client.target))
                console.print()
            sys.stdout.flush()
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return EXIT_OK


def cmd_evict(client: KVStoreClient, args: argparse.Namespace, console: Console) -> int:
    if not (args.bytes or args.all or args.key):
        raise UsageError("evict needs --bytes, --all or --key")
    namespace = args.namespace or ""
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
    verb = client.pin if pinning else client.unpin
    result = verb(args.keys)
    missing = _missing_keys(verb, args.keys) if result.missing else []
    done = "pinned" if pinning else "unpinned"
    if args.json:
        _print_json({**asdict(result), "missing_keys": [k.hex() for k in missing]})
    else:
        print(f"{done} {result.changed}; missing {result.missing}")
    if not result.missing:
        return EXIT_OK
    named = ", ".join(k.hex() for k in missing) or "gone since (they were evicted meanwhile)"
    print_error("NOT_FOUND", f"{result.missing} of {len(args.keys)} keys are not stored in "
                f"namespace {client.namespace!r}, so not {done}: {named}",
                REASON_KEYS_MISSING)
    return EXIT_FAILED


def _missing_keys(verb: Callable[[list[BlockKey]], PinResult],
                  keys: list[BlockKey]) -> list[BlockKey]:
    """Which of keys verb (pin or unpin) finds missing: the daemon answers a count only, so
    each key is asked again on its own. Pinning or unpinning a key twice changes nothing, and
    this runs only when some key was missing."""
    return [k for k in keys if verb([k]).missing]


def cmd_hot(client: KVStoreClient, args: argparse.Namespace, console: Console) -> int:
    result = client.hot(args.limit)
    pairs = list(zip(result.keys, result.scores, strict=True))
    if args.json:
        _print_json({"keys": [{"key": k.hex(), "score": s} for k, s in pairs]})
        return EXIT_OK
    console.print(hot_table(client.namespace, pairs))
    return EXIT_OK


class _PrewarmBar:
    """prewarm's progress bar, on stderr when it is a terminal, drawn from the first progress
    the daemon sends: a prewarm refused at once (L4 off or down) draws none."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def show(self, p: PrewarmResult) -> None:
        if not self.enabled:
            return
        if self._progress is None:
            self._progress = Progress(*prewarm_columns(), console=Console(stderr=True),
                                      transient=True)
            self._progress.start()
            self._task = self._progress.add_task("prewarm", total=p.target_bytes or None)
        assert self._task is not None
        self._progress.update(self._task, completed=p.bytes, total=p.target_bytes or None)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def cmd_prewarm(client: KVStoreClient, args: argparse.Namespace, console: Console) -> int:
    namespaces = args.namespaces or ([args.namespace] if args.namespace else [])
    bar = _PrewarmBar(not args.json and sys.stderr.isatty())
    try:
        result = client.prewarm(args.bytes, namespaces, bar.show, timeout_s=args.max_time)
    finally:
        bar.close()
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
    if args.json:
        _print_json({"service": args.service, "status": status})
    else:
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
        if stopped:
            print("it has stopped", flush=True)
    if stopped is False:
        print_error("DEADLINE_EXCEEDED", f"the daemon at {client.target} is still running "
                    f"{result.grace_s + 5:g} s after the drain began")
        return EXIT_FAILED
    return EXIT_OK


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
        print_error("UNKNOWN", "the daemon returned no config")
        return EXIT_FAILED
    if args.json:
        print(stats.config_json)
    else:
        console.print_json(stats.config_json)
    return EXIT_OK


def cmd_limits(client: KVStoreClient, args: argparse.Namespace, console: Console) -> int:
    limits = asdict(client.limits())
    if args.json:
        _print_json(limits)
        return EXIT_OK
    for name, value in limits.items():
        shown = format_size(value) if name.endswith("_bytes") and name != "key_bytes" else value
        console.print(f"{name:<24} {shown}")
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
    "limits": cmd_limits,
}
_NEEDS_NAMESPACE = frozenset({"lookup", "pin", "unpin", "hot"})


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    # Known before parsing ends, so that a command-line mistake is JSON too.
    admin_errors.use_json("--json" in words[: words.index("--")] if "--" in words else
                          "--json" in words)
    parser = build_parser()
    args = parser.parse_args(words)
    admin_errors.use_json(args.json)
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
            **opt.credentials(args),
        )
    except KVStoreError as exc:
        parser.error(str(exc))
    try:
        with client:
            try:
                return COMMANDS[args.command](client, args, console)
            except KVStoreError as exc:
                return report(exc, client, args.command, getattr(args, "service", ""))
    except UsageError as exc:
        parser.error(str(exc))
    except BrokenPipeError:  # `kvstore-admin stats --json | head`
        return EXIT_OK
    except KeyboardInterrupt:
        # Ctrl-C is how --watch ends; it may land in a call or while the channel closes.
        return EXIT_OK if getattr(args, "watch", None) else 130


if __name__ == "__main__":
    sys.exit(main())
