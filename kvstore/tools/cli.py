"""The ``kvstore`` command: ``serve | stats | lookup | diff | capacity | admin | bench | demo | replay``.

Exit codes, for every command: 0 success; 2 bad input (unknown flag, missing
or malformed file, bad size, invalid config) with a one-line message and no
traceback; 1 a runtime failure (daemon unreachable, a call refused). ``diff``
follows diff(1): 0 when no token differs where both sequences have one (one
may extend the other), 1 when they differ, 2 on error.

This module is the parser and ``main``; the commands live in
:mod:`kvstore.tools.commands`, :mod:`kvstore.tools.demo` and
:mod:`kvstore.tools.replay`, their pure formatting in
:mod:`kvstore.tools.format` (testable without a daemon), token files and
namespace flags in :mod:`kvstore.tools.inputs`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, NoReturn, Sequence

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.tools import demo, replay
from kvstore.tools.commands import cmd_admin, cmd_bench, cmd_capacity, cmd_diff, cmd_lookup, cmd_serve, cmd_stats
from kvstore.tools.inputs import DEFAULT_TARGET, CLIError, add_daemon_flags, add_namespace_flags, positive_int

__all__ = ["build_parser", "main", "parse_args"]


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's bad-input contract: one ``kvstore: ...`` line
    on stderr and exit 2 (argparse would print its usage block first).
    Subcommands' parsers are of this class too (``add_subparsers``)."""

    def error(self, message: str) -> NoReturn:
        sub = self.prog.removeprefix("kvstore").strip()
        self.exit(2, f"kvstore: {sub + ': ' if sub else ''}{message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of every subcommand."""
    ap = _Parser(prog="kvstore", description="kvstore: a tiered KV-cache store for LLM inference.",
                                 epilog="exit codes: 0 ok, 1 failure (diff: differ), 2 bad input")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("serve", help="run the daemon in the foreground (logs to stderr)",
                       description="Run the daemon until SIGTERM/SIGINT. Precedence: flags > "
                                   "KVSTORE_* env > config file > defaults.")
    p.add_argument("--config", help="TOML config file (default $KVSTORE_CONFIG)")
    for flag, key, hlp in (
            ("--host", "server.host", "gRPC listen address"),
            ("--port", "server.port", "gRPC port (0 = pick one)"),
            ("--unix-socket", "server.unix_socket", "also listen on this Unix socket"),
            ("--metrics-host", "metrics.host", "/metrics listen address"),
            ("--metrics-port", "metrics.port", "/metrics port (0 = off)"),
            ("--dram", "dram.capacity", "DRAM tier size, e.g. 4GiB"),
            ("--ssd", "ssd.capacity", "SSD tier size (0 = off)"),
            ("--ssd-path", "ssd.path", "SSD tier directory"),
            ("--hbm", "hbm.capacity", "HBM tier size (0 = off)"),
            ("--policy", "eviction.policy", "lru, lfu or cost"),
            ("--log-level", "log.level", "debug, info, warning or error"),
            ("--auth-token-file", "server.auth_token_file", "file of accepted bearer tokens")):
        p.add_argument(flag, help=f"{hlp} [{key}]")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("stats", help="tier occupancy, hit ratio, evictions")
    add_daemon_flags(p)
    p.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("lookup", help="prefix hit length of a token file, per tier")
    p.add_argument("--tokens", required=True, metavar="FILE",
                   help='ints separated by spaces/commas, a JSON list, or {"tokens": [...]}')
    add_namespace_flags(p)
    add_daemon_flags(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_lookup)

    p = sub.add_parser("diff", help="where two prompts stop sharing blocks",
                       description="Exit 0: no token differs where both have one (one may extend "
                                   "the other); 1: they differ; 2: error.")
    p.add_argument("a", metavar="A", help="token file (see lookup --tokens)")
    p.add_argument("b", metavar="B", help="token file")
    p.add_argument("--context", type=int, default=8, help="tokens of context each side (8)")
    add_namespace_flags(p)
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("capacity", help="tokens and blocks per tier for a model shape")
    p.add_argument("--layers", type=positive_int, required=True)
    p.add_argument("--kv-heads", type=positive_int, required=True)
    p.add_argument("--head-dim", type=positive_int, required=True)
    p.add_argument("--dtype", default="bfloat16", help="KV dtype (bfloat16, float16, float8_e4m3fn...)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size")
    p.add_argument("--ranks-per-node", type=positive_int, default=None,
                   help="TP ranks whose shards this node stores (default: all)")
    p.add_argument("--block-size", type=positive_int, default=16)
    for tier in ("dram", "ssd", "hbm"):
        p.add_argument(f"--{tier}", help=f"{tier.upper()} tier size, e.g. 64GiB")
    p.add_argument("--page-size", help="slab page of the DRAM and HBM tiers (dram.page_size; default 16MiB)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_capacity)

    p = sub.add_parser("admin", help="running config, resize a tier, switch policy")
    asub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    a = asub.add_parser("config", help="print the running config (TOML)")
    add_daemon_flags(a)
    a = asub.add_parser("resize", help="resize a tier at run time")
    a.add_argument("tier", choices=["hbm", "dram", "ssd"], type=str.lower, help="hbm, dram or ssd")
    a.add_argument("size", help="new capacity, e.g. 2GiB")
    add_daemon_flags(a)
    a = asub.add_parser("policy", help="switch the eviction policy")
    a.add_argument("name", choices=["lru", "lfu", "cost"])
    add_daemon_flags(a)
    p.set_defaults(func=cmd_admin)

    p = sub.add_parser("bench", help="run bench/core.py and bench/service.py (--quick)")
    p.add_argument("--full", action="store_true", help="full runs instead of --quick")
    p.add_argument("--json-dir", help="write each benchmark's JSON here")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("demo", help="prefix-cache experiment on a small model (starts a daemon)",
                       description=demo.__doc__.split("\n\n")[0] if demo.__doc__ else None)
    demo.add_arguments(p)
    p.set_defaults(func=demo.run)

    p = sub.add_parser("replay", help="replay a workload trace; hit ratio per policy and Bélády's optimum")
    replay.add_arguments(p)
    p.set_defaults(func=replay.run)

    from kvstore.tools import route_cli

    route_cli.register(sub)
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``); argparse exits 2 on bad flags."""
    return build_parser().parse_args(argv)


def _rpc_failure(e: BaseException) -> str | None:
    code = getattr(e, "code", None)
    if callable(code):  # a raw grpc.RpcError
        try:
            return f"{code().name}: {e.details()}"  # type: ignore[attr-defined]
        except Exception:
            return str(e)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code (see the module docstring)."""
    args = parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except CLIError as e:
        print(f"kvstore: {e}", file=sys.stderr)
        return e.code
    except InvalidArgument as e:  # includes ConfigError
        print(f"kvstore: {e}", file=sys.stderr)
        return 2
    except KVStoreError as e:
        target = getattr(args, "target", None) or os.environ.get("KVSTORE_ADDRESS") or DEFAULT_TARGET
        print(f"kvstore: {args.command} failed ({target}): {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvstore stats | head`
        return 0
    except Exception as e:
        msg = _rpc_failure(e)
        if msg is None:
            raise
        print(f"kvstore: {args.command} failed: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
