"""`kvstore-admin`: the operator's command line for a running daemon, over the client library.

    kvstore-admin [global options] COMMAND [options]    (global options also after COMMAND)
      stats [--watch SECONDS]              per-tier tables and summary (the daemon's auth
                                           mode and your tenant; a warning when auth is off);
                                           --watch refreshes on a terminal, and prints one
                                           frame (with --json: one line) per period on a pipe
      evict [--tier T] [--bytes SIZE] [--all] [--key HEX [HEX ...]]
                                           in --namespace, else every namespace
      lookup KEYHEX... | --tokens 1,2,3 [--block-size 16]      prefix length, tier per key
      pin KEYHEX... / unpin KEYHEX...
      hot [--limit N]                      the namespace's hottest L4 blocks: whole key, score
      prewarm [--bytes SIZE] [--namespaces NS [NS ...]] [--max-time SECONDS]
                                           pull the hottest L4 blocks local (from --namespaces,
                                           else --namespace, else every namespace)
      health [--service NAME]              prints SERVING etc.; exit 0 only when SERVING
      drain [--wait]                       stop the daemon gracefully, as SIGTERM does; --wait
                                           until it has exited
      config                               the daemon's configuration in effect
      limits                               what a client must respect (the Limits verb)

Global options (kvstore.tools.admin_options): --target HOST[:PORT] (KVSTORE_TARGET, else
127.0.0.1:50051; no port means 50051), --namespace NS (KVSTORE_NAMESPACE), --timeout SECONDS,
--json, and the credentials (auth.mode token or mtls; each flag's default is the client's
variable):
      --token TOKEN | --token-file PATH    bearer token (KVSTORE_TOKEN, KVSTORE_TOKEN_FILE)
      --tls-ca PATH  --tls-cert PATH  --tls-key PATH  --tls-server-name NAME
                                           TLS, mutual with a cert and key (KVSTORE_TLS_*)

Exit codes: 0 success, 1 a request failed or the daemon could not do it (one line on stderr,
`error: <STATUS_NAME>: <the daemon's message>`), or health not SERVING, 2 the daemon could not
be reached (or the command line was wrong); kvstore.tools.admin_errors.

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

from kvstore.client import KVStoreClient, KVStoreError, PrewarmResult, Retry, Stats, prefix_keys
from kvstore.keys import BlockKey
from kvstore.tier import TIER_LABELS
from kvstore.tools import admin_options as opt
from kvstore.tools.admin_errors import EXIT_FAILED, EXIT_OK, print_error, report
from kvstore.tools.admin_options import ENV_NAMESPACE, UsageError
from kvstore.tools.tables import hot_table, lookup_table, prewarm_columns, stats_view
from kvstore.units import format_size

# The client needs a namespace; commands that are not about one never send it.
_NO_NAMESPACE = "kvstore-admin"
_credentials = opt.credentials  # the name tests and older callers know


def build_parser() -> argparse.ArgumentParser:
    common = opt.global_options()
    parser = opt.AdminParser(prog="kvstore-admin", parents=[common],
                             description="Inspect and manage a running kvstore daemon.")
    parser.common = common
    # Commands parse with the plain class: the top level fills in the global defaults once.
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=opt.CommandParser)
    _add_entry_commands(sub, common)
    _add_daemon_commands(sub, common)
    return parser


def _add_entry_commands(sub: argparse._SubParsersAction[opt.CommandParser],
                        common: opt.CommandParser) -> None:
    """stats, evict, lookup, pin and unpin: the daemon's entries and tiers."""
    stats = sub.add_parser("stats", parents=[common], help="per-tier capacity, use and counters")
    stats.add_argument("--watch", type=opt.positive_float, metavar="SECONDS",
                       help="refresh period")

    evict = sub.add_parser("evict", parents=[common],
                           help="evict named keys, a number of bytes, or everything (in "
                           "--namespace, else every namespace)")
    evict.add_argument("--tier", choices=TIER_LABELS, help="default: all")
    evict.add_argument("--bytes", type=opt.size, default=0, metavar="SIZE", help='e.g. "64MiB"')
    evict.add_argument("--all", action="store_true", help="everything evictable")
    evict.add_argument("--key", type=opt.key, nargs="+", action="extend", default=[],
                       metavar="HEX", help="these keys (needs --namespace)")

    lookup = sub.add_parser("lookup", parents=[common],
                            help="cached prefix length and the tier of each key")
    lookup.add_argument("keys", nargs="*", type=opt.key, metavar="KEYHEX")
    lookup.add_argument("--tokens", type=opt.tokens, help="derive keys from token ids: 1,2,3")
    lookup.add_argument("--block-size", type=opt.positive_int, default=16,
                        help="tokens per block")

    for name, verb in (("pin", "never evict"), ("unpin", "allow evicting again")):
        cmd = sub.add_parser(name, parents=[common], help=f"{verb}: these keys")
        cmd.add_argument("keys", nargs="+", type=opt.key, metavar="KEYHEX")


def _add_daemon_commands(sub: argparse._SubParsersAction[opt.CommandParser],
                         common: opt.CommandParser) -> None:
    """hot and prewarm (L4), health, drain and config."""
    hot = sub.add_parser("hot", parents=[common],
                         help="the namespace's most used L4 blocks, hottest first")
    hot.add_argument("--limit", type=opt.positive_int, default=100,
                     help="how many keys (default 100)")

    prewarm = sub.add_parser("prewarm", parents=[common],
                             help="pull the hottest L4 blocks into the local tiers")
    prewarm.add_argument(
        "--bytes", type=opt.size, default=0, metavar="SIZE", help="default: remote.prewarm_bytes"
    )
    prewarm.add_argument("--namespaces", nargs="+", action="extend", default=[], metavar="NS",
                         help="pull from these; default: --namespace, else every namespace")
    prewarm.add_argument("--max-time", type=opt.positive_float, default=600.0,
                         metavar="SECONDS", help="the whole prewarm's deadline (600)")

    health = sub.add_parser("health", parents=[common],
                            help="grpc.health.v1 status; exit 0 only when SERVING")
    health.add_argument("--service", default="", help='health service name (default "")')

    drain = sub.add_parser("drain", parents=[common],
                           help="stop the daemon gracefully (NOT_SERVING, then exit)")
    drain.add_argument("--wait", action="store_true", help="until the daemon has exited")

    sub.add_parser("config", parents=[common], help="the daemon's configuration in effect")
    sub.add_parser("limits", parents=[common],
                   help="what a client must respect: message, chunk and batch sizes, leases")


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
