"""The bodies of the ``kvstore`` subcommands except ``demo`` and ``replay``
(``cli.build_parser`` wires them): ``serve``, ``stats``, ``lookup``, ``diff``,
``capacity``, ``admin`` and ``bench``. Each takes the parsed arguments and
returns the exit code."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from kvstore.config import load_config, parse_size
from kvstore.errors import InvalidArgument
from kvstore.keys import block_keys
from kvstore.tools.format import capacity_table, diff_report, format_capacity, format_lookup, format_stats, \
    human_bytes, tier_name
from kvstore.tools.inputs import CLIError, fail, load_request, make_namespace
from tiers.base import TierKind

__all__ = ["SERVE_FLAGS", "cmd_admin", "cmd_bench", "cmd_capacity", "cmd_diff", "cmd_lookup", "cmd_serve",
           "cmd_stats", "serve_overrides"]

log = logging.getLogger("kvstore")


SERVE_FLAGS: dict[str, str] = {
    "host": "server.host", "port": "server.port", "unix_socket": "server.unix_socket",
    "metrics_host": "metrics.host", "metrics_port": "metrics.port",
    "dram": "dram.capacity", "ssd": "ssd.capacity", "ssd_path": "ssd.path",
    "hbm": "hbm.capacity", "policy": "eviction.policy", "log_level": "log.level",
    "auth_token_file": "server.auth_token_file",
}
"""``kvstore serve`` flag (argparse dest) -> dotted config key."""


def serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The dotted config overrides of the flags that were given."""
    return {key: getattr(args, dest) for dest, key in SERVE_FLAGS.items()
            if getattr(args, dest, None) is not None}


def cmd_serve(args: argparse.Namespace) -> int:
    config = load_config(args.config, os.environ, serve_overrides(args))
    logging.basicConfig(stream=sys.stderr, level=config.log.level.logging_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    from kvstore.daemon import server  # deferred: the daemon's stack loads only for `serve`

    try:
        return int(server.serve(config))
    except (OSError, RuntimeError) as e:  # e.g. the port is taken
        log.debug("serve failed", exc_info=True)
        raise CLIError(f"serve failed: {e}", code=1) from None


def _client(args: argparse.Namespace) -> Any:
    from kvstore.client import Client  # deferred: grpc loads only for commands that reach a daemon

    token: str | None = None
    if args.token_file:
        try:
            token = Path(args.token_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            fail(f"cannot read token file {args.token_file!r}: {e.strerror or e}")
        if not token:
            fail(f"token file {args.token_file!r} is empty")
    return Client(args.target, token=token, session=False, use_shm=False)


def cmd_stats(args: argparse.Namespace) -> int:
    with _client(args) as c:
        d = c.stats().to_dict()
    print(json.dumps(d, indent=2, sort_keys=True) if args.json else format_stats(d), end="\n"
          if args.json else "")
    return 0


def cmd_lookup(args: argparse.Namespace) -> int:
    req = load_request(args.tokens)
    ns = make_namespace(args, req.namespace)
    keys = block_keys(ns, req.tokens)
    with _client(args) as c:
        res = c.lookup(ns, keys)
    tiers = [tier_name(t) for t in res.tiers]
    if args.json:
        print(json.dumps({"tokens": len(req.tokens), "block_size": ns.block_size,
                          "full_blocks": len(keys), "hit_blocks": res.hit_blocks,
                          "hit_tokens": res.hit_blocks * ns.block_size, "tiers": tiers}))
    else:
        print(format_lookup(len(req.tokens), ns.block_size, res.hit_blocks, tiers), end="")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    ra, rb = load_request(args.a), load_request(args.b)
    ns = make_namespace(args, ra.namespace or rb.namespace)
    if args.context < 0:
        fail("--context must be >= 0")
    rep = diff_report(ns, ra.tokens, rb.tokens, args.a, args.b, args.context)
    print(rep.text, end="")
    return rep.exit_code


def _sizes(args: argparse.Namespace, names: Sequence[str]) -> dict[str, int]:
    out = {}
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            try:
                out[name] = parse_size(value)
            except InvalidArgument as e:
                fail(f"--{name}: {e}")
    return out


def cmd_capacity(args: argparse.Namespace) -> int:
    tiers = _sizes(args, ("hbm", "dram", "ssd"))
    if not tiers:
        tiers = {"dram": 1 << 30}
    page = _sizes(args, ("page_size",)).get("page_size", 16 << 20)
    t = capacity_table(args.layers, args.kv_heads, args.head_dim, args.dtype, args.tp,
                       args.block_size, tiers, args.ranks_per_node, page)
    print(json.dumps(t, indent=2) if args.json else format_capacity(t), end="\n" if args.json else "")
    return 0


def cmd_admin(args: argparse.Namespace) -> int:
    if args.action == "resize":
        size = _sizes(args, ("size",))["size"]
        TierKind.parse(args.tier)  # a clear error before connecting
        with _client(args) as c:
            r = c.admin_resize(args.tier, size)
        print(f"{args.tier}: {human_bytes(r.old_capacity_bytes)} -> "
              f"{human_bytes(r.new_capacity_bytes)}, "
              f"{r.evicted_blocks:,} block(s) evicted to fit")
        return 0
    with _client(args) as c:
        if args.action == "config":
            print(c.admin_get_config(), end="")
        else:
            p = c.admin_set_policy(args.name)
            print(f"eviction policy: {p.old_policy or '?'} -> "
                  f"{p.new_policy or args.name}")
    return 0

def cmd_bench(args: argparse.Namespace) -> int:
    root = Path(__file__).resolve().parents[2]
    scripts = [root / "bench" / name for name in ("core.py", "service.py")]
    found = [s for s in scripts if s.is_file()]
    if not found:
        print(f"kvstore: no benchmarks here: {root / 'bench'} is missing (benchmarks ship "
              "with the source checkout, not the installed package)", file=sys.stderr)
        return 2
    if args.json_dir:
        try:
            os.makedirs(args.json_dir, exist_ok=True)
        except OSError as e:
            fail(f"--json-dir {args.json_dir!r} cannot be made: {e.strerror or e}")
    rc = 0
    for script in found:
        cmd = [sys.executable, str(script)] + ([] if args.full else ["--quick"])
        if args.json_dir:
            cmd += ["--json", os.path.join(args.json_dir, script.stem + ".json")]
        print(f"$ {' '.join(cmd)}", flush=True)
        rc = subprocess.call(cmd, cwd=root) or rc
    return rc

