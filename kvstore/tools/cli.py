"""The ``kvstore`` command: ``serve | stats | lookup | diff | capacity | admin | bench``.

Exit codes, for every command: 0 success; 2 bad input (unknown flag, missing
or malformed file, bad size, invalid config) with a one-line message and no
traceback; 1 a runtime failure (daemon unreachable, a call refused). ``diff``
follows diff(1): 0 when no token differs where both sequences have one (one
may extend the other), 1 when they differ, 2 on error.

The table formatting is pure (``format_stats``, ``capacity_table``,
``format_capacity``, ``format_diff``) so it is testable without a daemon.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, NoReturn, Sequence

import numpy as np

from kvstore.errors import InvalidArgument, KVStoreError

__all__ = ["CLIError", "capacity_table", "diff_report", "format_capacity", "format_diff",
           "format_lookup", "format_stats", "human_bytes", "load_request", "load_tokens",
           "main", "make_namespace", "parse_args", "serve_overrides"]

log = logging.getLogger("kvstore")

DEFAULT_TARGET = "127.0.0.1:50051"


class CLIError(Exception):
    """Bad input: printed as ``kvstore: <message>``; exit code ``code`` (2)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def _fail(message: str) -> NoReturn:
    raise CLIError(message)


# ---------------------------------------------------------------------------
# Number formatting
# ---------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; exact bytes below 1 KiB."""
    n = float(n)
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024.0
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}"
    return f"{n:.1f} PiB"  # pragma: no cover


def _int(d: Mapping[str, Any], key: str) -> int:
    """A uint64 field of a MessageToDict dict (JSON strings) as int; 0 when absent."""
    value = d.get(key, 0)
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _pct(num: float, den: float) -> str:
    return f"{100.0 * num / den:.1f}%" if den else "-"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned first column, right-aligned others, two spaces apart."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    out = []
    for r in [header, *rows]:
        cells = [str(c).ljust(widths[0]) if i == 0 else str(c).rjust(widths[i])
                 for i, c in enumerate(r)]
        out.append("  ".join(cells).rstrip())
    return out


def _tier_name(value: Any) -> str:
    """"TIER_DRAM" / 2 / TierKind.DRAM / "dram" -> "dram"."""
    if isinstance(value, str):
        return value.lower().removeprefix("tier_")
    label = getattr(value, "label", None)
    if isinstance(label, str):
        return label
    if isinstance(value, int):  # proto wire value: TierKind + 1
        return {1: "hbm", 2: "dram", 3: "ssd", 4: "remote"}.get(value, str(value))
    return str(value)


# ---------------------------------------------------------------------------
# stats
# ---------------------------------------------------------------------------


def format_stats(d: Mapping[str, Any]) -> str:
    """A readable report of a StatsResponse dict (``Client.stats()``, i.e.
    MessageToDict with proto field names; uint64 values may be strings and
    absent fields mean 0)."""
    lines: list[str] = []
    uptime = float(d.get("uptime_seconds", 0) or 0)
    head = "kvstore stats"
    if uptime:
        h, rem = divmod(int(uptime), 3600)
        head += f" (up {h}h{rem // 60:02d}m{rem % 60:02d}s)"
    lines += [head, ""]
    rows = []
    for t in d.get("tiers", []) or []:
        used, cap = _int(t, "used_bytes"), _int(t, "capacity_bytes")
        rows.append([_tier_name(t.get("tier", "?")), human_bytes(used), human_bytes(cap),
                     _pct(used, cap), f"{_int(t, 'blocks'):,}", human_bytes(_int(t, "pinned_bytes")),
                     f"{_int(t, 'evictions'):,}", f"{_int(t, 'promotions'):,}",
                     f"{_int(t, 'demotions'):,}"])
    if rows:
        lines += _table(["TIER", "USED", "CAPACITY", "USED%", "BLOCKS", "PINNED", "EVICTIONS",
                         "PROMOTED", "DEMOTED"], rows)
    else:
        lines.append("(no tiers reported)")
    hit, miss = _int(d, "hit_blocks"), _int(d, "miss_blocks")
    hit_tok, miss_tok = _int(d, "hit_tokens"), _int(d, "miss_tokens")
    ratio = _pct(hit, hit + miss)
    summary = [
        ("lookups", f"{_int(d, 'lookups'):,}"),
        ("prefix hit ratio", f"{ratio}  ({hit:,} of {hit + miss:,} blocks queried"
                             + (f"; {hit_tok:,} of {hit_tok + miss_tok:,} tokens" if hit_tok + miss_tok
                                else "") + ")"),
        ("puts / gets", f"{_int(d, 'puts'):,} / {_int(d, 'gets'):,} blocks"),
        ("bytes written / read", f"{human_bytes(_int(d, 'bytes_written'))} / "
                                 f"{human_bytes(_int(d, 'bytes_read'))}"),
        ("bytes promoted / demoted", f"{human_bytes(_int(d, 'bytes_promoted'))} / "
                                     f"{human_bytes(_int(d, 'bytes_demoted'))}"),
        ("checksum failures", f"{_int(d, 'checksum_failures'):,}"),
        ("reservations / leases / sessions",
         f"{_int(d, 'active_reservations'):,} / {_int(d, 'active_leases'):,} / "
         f"{_int(d, 'sessions'):,}"),
        ("admitted / degraded / rejected",
         f"{_int(d, 'admitted'):,} / {_int(d, 'admitted_degraded'):,} / {_int(d, 'rejected'):,}"),
        ("prefill model / TTFT error", f"{float(d.get('prefill_tokens_per_s') or 0):,.0f} tokens/s / "
                                       f"{float(d.get('ttft_error_ewma_s') or 0) * 1e3:.1f} ms"),
    ]
    width = max(len(k) for k, _ in summary)
    lines.append("")
    lines += [f"{k.ljust(width)}  {v}" for k, v in summary]
    nss = d.get("namespaces", []) or []
    if nss:
        ns_rows = []
        for n in sorted(nss, key=lambda n: -_int(n, "queried_blocks")):
            q, h = _int(n, "queried_blocks"), _int(n, "hit_blocks")
            ns_rows.append([str(n.get("namespace_label", "?")), f"{_int(n, 'lookups'):,}",
                            f"{q:,}", f"{h:,}", _pct(h, q), f"{_int(n, 'blocks'):,}"])
        lines.append("")
        lines += _table(["NAMESPACE", "LOOKUPS", "QUERIED", "HIT", "HIT%", "BLOCKS"], ns_rows)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# capacity
# ---------------------------------------------------------------------------


def capacity_table(layers: int, kv_heads: int, head_dim: int, dtype: str = "bfloat16",
                   tp: int = 1, block_size: int = 16,
                   tiers: Mapping[str, int] | None = None,
                   ranks_per_node: int | None = None) -> dict[str, Any]:
    """How many tokens and blocks fit in each tier.

    bytes/token of one TP rank = 2 (K and V) x layers x ceil(kv_heads / tp) x
    head_dim x dtype bytes (with tp > kv_heads each rank holds one replicated
    head). A node's daemon stores the shards of ``ranks_per_node`` ranks
    (default: all ``tp``: mirrored shards live together), so tier capacity is
    divided by per-rank bytes x ranks_per_node. Raises InvalidArgument."""
    from kvstore.keys import KVDtype

    for name, v in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                    ("tp", tp), ("block_size", block_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidArgument(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
    dt = KVDtype.parse(dtype, "--dtype")
    ranks = tp if ranks_per_node is None else ranks_per_node
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= tp:
        raise InvalidArgument(f"--ranks-per-node must be in 1..{tp} (the TP size), got {ranks!r}")
    heads_per_rank = math.ceil(kv_heads / tp)
    per_rank = 2 * layers * heads_per_rank * head_dim * dt.itemsize
    whole = 2 * layers * kv_heads * head_dim * dt.itemsize
    per_node = per_rank * ranks
    block_bytes = per_node * block_size
    rows = []
    for tier, cap in (tiers or {}).items():
        blocks = cap // block_bytes
        rows.append({"tier": tier, "capacity_bytes": cap, "blocks": blocks,
                     "tokens": blocks * block_size})
    return {
        "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": dt.value,
        "dtype_bytes": dt.itemsize, "tp": tp, "ranks_per_node": ranks,
        "kv_heads_per_rank": heads_per_rank, "block_size": block_size,
        "bytes_per_token_per_rank": per_rank, "bytes_per_token_model": whole,
        "bytes_per_token_node": per_node, "bytes_per_block_per_rank": per_rank * block_size,
        "bytes_per_block_node": block_bytes, "tiers": rows,
    }


def format_capacity(t: Mapping[str, Any]) -> str:
    """The report of a :func:`capacity_table` result."""
    lines = [
        f"model: {t['layers']} layers x {t['kv_heads']} KV heads x head_dim {t['head_dim']}, "
        f"{t['dtype']} ({t['dtype_bytes']} B), TP {t['tp']} "
        f"({t['kv_heads_per_rank']} KV head(s) per rank), block {t['block_size']} tokens",
        f"KV bytes per token: {t['bytes_per_token_per_rank']:,} per rank, "
        f"{t['bytes_per_token_model']:,} whole model"
        + ("" if t["bytes_per_token_node"] == t["bytes_per_token_model"]
           else f", {t['bytes_per_token_node']:,} stored per node ({t['ranks_per_node']} ranks)"),
        f"bytes per block: {t['bytes_per_block_per_rank']:,} per rank "
        f"({human_bytes(t['bytes_per_block_per_rank'])}), {t['bytes_per_block_node']:,} per node "
        f"({human_bytes(t['bytes_per_block_node'])})",
    ]
    if t["tiers"]:
        rows = [[r["tier"], human_bytes(r["capacity_bytes"]), f"{r['blocks']:,}", f"{r['tokens']:,}"]
                for r in t["tiers"]]
        lines.append("")
        lines += _table(["TIER", "CAPACITY", "BLOCKS", "TOKENS"], rows)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# Token files and namespaces
# ---------------------------------------------------------------------------


@dataclass(slots=True)
class Request:
    """Tokens from a file, and the namespace fields a JSON request file names."""

    path: str
    tokens: np.ndarray
    namespace: dict[str, Any]


def load_request(path: str) -> Request:
    """Read a token file: whitespace/comma separated ints, a JSON list of
    ints, or a JSON object with "tokens" (and optionally "namespace"). "-"
    reads stdin. Raises CLIError with the path and the problem."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        _fail(f"token file {path!r} not found")
    except (OSError, UnicodeDecodeError) as e:
        _fail(f"cannot read token file {path!r}: {e}")
    body = text.strip()
    ns: dict[str, Any] = {}
    raw: Any
    if body[:1] in ("[", "{"):
        try:
            raw = json.loads(body)
        except json.JSONDecodeError as e:
            _fail(f"token file {path!r} is not valid JSON: {e}")
        if isinstance(raw, dict):
            if "tokens" not in raw:
                _fail(f"token file {path!r}: a JSON object needs a \"tokens\" list "
                      f"(keys found: {', '.join(map(str, raw)) or 'none'})")
            got_ns = raw.get("namespace", {})
            if not isinstance(got_ns, dict):
                _fail(f"token file {path!r}: \"namespace\" must be an object")
            ns, raw = dict(got_ns), raw["tokens"]
        if not isinstance(raw, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                for x in raw):
            _fail(f"token file {path!r}: \"tokens\" must be a list of integers")
        try:
            arr = np.asarray(raw, dtype=np.int64) if raw else np.zeros(0, np.int64)
        except OverflowError:
            _fail(f"token file {path!r}: token ids must be in [0, 2**32)")
    else:
        parts = body.replace(",", " ").split()
        try:
            arr = np.asarray([int(p) for p in parts], dtype=np.int64)
        except ValueError:
            bad = next(i for i, p in enumerate(parts) if not p.lstrip("+-").isdigit())
            _fail(f"token file {path!r}: item {bad} ({parts[bad][:20]!r}) is not an integer "
                  "token id; expected integers separated by spaces or commas, a JSON list, "
                  'or a JSON object with "tokens"')
        except OverflowError:
            _fail(f"token file {path!r}: token ids must be in [0, 2**32)")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 32):
        i = int(np.flatnonzero((arr < 0) | (arr >= 1 << 32))[0])
        _fail(f"token file {path!r}: token {i} = {int(arr[i])} is out of range [0, 2**32)")
    return Request(path, arr.astype(np.uint32), ns)


def load_tokens(path: str) -> np.ndarray:
    """Only the tokens of :func:`load_request` (uint32 array)."""
    return load_request(path).tokens


_NS_FLAGS = {"tenant": "tenant", "model": "model_id", "weights_digest": "weights_digest",
             "adapter": "adapter_id", "kv_dtype": "kv_dtype", "layout": "layout",
             "block_size": "block_size", "tp": "tp_size", "pp_stage": "pp_stage",
             "schema_version": "schema_version", "hash_algo": "hash_algo"}


def _add_ns_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("namespace (flags override --namespace-json and the request file)")
    g.add_argument("--namespace-json", metavar="JSON|FILE",
                   help="namespace as a JSON object, or a file holding one")
    g.add_argument("--tenant", help='default "default"')
    g.add_argument("--model", help='model id; default "default"')
    g.add_argument("--weights-digest")
    g.add_argument("--adapter", help="LoRA adapter id")
    g.add_argument("--kv-dtype")
    g.add_argument("--layout")
    g.add_argument("--block-size", type=int, help="tokens per block (default 16)")
    g.add_argument("--tp", type=int, help="TP size of the namespace")
    g.add_argument("--pp-stage", type=int)
    g.add_argument("--schema-version", type=int)
    g.add_argument("--hash-algo", help="xxh3_128 (default) or sha256")


def make_namespace(args: argparse.Namespace, base: Mapping[str, Any] | None = None) -> Any:
    """A ``kvstore.keys.Namespace`` from ``base`` (a request file's
    "namespace"), then ``--namespace-json``, then the individual flags."""
    from kvstore.keys import Namespace

    fields: dict[str, Any] = {"tenant": "default", "model_id": "default"}
    fields.update(base or {})
    src = getattr(args, "namespace_json", None)
    if src:
        text = src
        if not src.lstrip().startswith("{"):
            try:
                text = Path(src).read_text(encoding="utf-8")
            except OSError as e:
                _fail(f"--namespace-json: {src!r} is neither a JSON object nor a readable file: {e}")
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            _fail(f"--namespace-json: not valid JSON: {e}")
        if not isinstance(obj, dict):
            _fail("--namespace-json: expected a JSON object")
        fields.update(obj)
    for flag, name in _NS_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            fields[name] = value
    return Namespace.from_dict(fields)


# ---------------------------------------------------------------------------
# diff
# ---------------------------------------------------------------------------


@dataclass(slots=True)
class DiffReport:
    """What ``kvstore diff`` found; ``exit_code`` 0 (no differing token where
    both have one) or 1 (they differ)."""

    text: str
    exit_code: int
    shared_blocks: int
    shared_tokens: int
    position: int | None


def _window(tokens: np.ndarray, pos: int, context: int) -> str:
    lo, hi = max(0, pos - context), min(len(tokens), pos + context + 1)
    cells = [f"[{int(t)}]" if lo + i == pos else str(int(t))
             for i, t in enumerate(tokens[lo:hi].tolist())]
    if pos >= len(tokens):
        cells.append("<end>")
    return ("... " if lo > 0 else "") + " ".join(cells) + (" ..." if hi < len(tokens) else "")


def diff_report(ns: Any, a: np.ndarray, b: np.ndarray, name_a: str = "A", name_b: str = "B",
                context: int = 8) -> DiffReport:
    """Compare two token sequences block by block (``first_divergence``)."""
    from kvstore.keys import first_divergence

    bs = int(ns.block_size)
    la, lb = len(a), len(b)
    w = max(len(name_a), len(name_b))
    lines = [f"{name_a.ljust(w)}: {la:,} tokens, {la // bs:,} full blocks",
             f"{name_b.ljust(w)}: {lb:,} tokens, {lb // bs:,} full blocks",
             f"block size {bs} tokens; namespace {ns.tenant}/{ns.model_id}"]
    d = first_divergence(ns, a, b)
    if d is None:
        lines.append(f"identical: all {la // bs:,} full blocks ({la // bs * bs:,} tokens) shared")
        return DiffReport("\n".join(lines) + "\n", 0, la // bs, la // bs * bs, None)
    shared_tokens = d.block * bs
    common = min(la, lb)
    lines.append(f"shared prefix: {d.block:,} blocks = {shared_tokens:,} tokens reusable "
                 f"(first {d.position:,} tokens equal)")
    if d.position >= common:  # one is a prefix of the other
        short, long_ = (name_a, name_b) if la < lb else (name_b, name_a)
        lines.append(f"no difference: {short} is a prefix of {long_} ({long_} has "
                     f"{abs(la - lb):,} more tokens)")
        if common % bs:
            lines.append(f"note: {short}'s last {common % bs} token(s) fill no full block: "
                         "not keyed, not cached")
        return DiffReport("\n".join(lines) + "\n", 0, d.block, shared_tokens, d.position)
    lines.append(f"first divergent block: #{d.block} (tokens {d.token_start:,}..{d.token_end - 1:,})")
    lines.append(f"first differing token: position {d.position:,}: "
                 f"{name_a} has {int(a[d.position])}, {name_b} has {int(b[d.position])}")
    lines.append(f"  {name_a.ljust(w)} [{max(0, d.position - context)}:]: "
                 f"{_window(a, d.position, context)}")
    lines.append(f"  {name_b.ljust(w)} [{max(0, d.position - context)}:]: "
                 f"{_window(b, d.position, context)}")
    if d.key_a is None or d.key_b is None:
        lines.append("the difference is in a trailing partial block (not keyed): "
                     "every full block is shared")
    else:
        lost_a, lost_b = la // bs - d.block, lb // bs - d.block
        lines.append(f"not reusable from there on: {lost_a:,} block(s) of {name_a}, "
                     f"{lost_b:,} of {name_b}")
        diff_pos = np.flatnonzero(a[:common] != b[:common])
        n_diff, last = int(diff_pos.size), int(diff_pos[-1])
        lines.append(f"tokens differing at the same position: {n_diff:,} of {common:,} "
                     f"(positions {d.position:,}..{last:,})")
        if n_diff <= 2 * bs and last + 1 < common:
            lines.append(f"hint: only {n_diff} token(s) differ and the rest match again: a "
                         "per-request value (timestamp, request id, user name) inside the "
                         "prompt; move it after the shared part to reuse "
                         f"{max(lost_a, lost_b):,} more block(s)")
    return DiffReport("\n".join(lines) + "\n", 1, d.block, shared_tokens, d.position)


def format_diff(ns: Any, a: np.ndarray, b: np.ndarray, name_a: str = "A", name_b: str = "B",
                context: int = 8) -> str:
    """The text of :func:`diff_report`."""
    return diff_report(ns, a, b, name_a, name_b, context).text


# ---------------------------------------------------------------------------
# lookup
# ---------------------------------------------------------------------------


def format_lookup(n_tokens: int, block_size: int, hit_blocks: int, tiers: Sequence[Any]) -> str:
    """The report of one lookup: hit length in blocks and tokens, per tier."""
    full = n_tokens // block_size
    counts: dict[str, int] = {}
    for t in tiers:
        name = _tier_name(t)
        counts[name] = counts.get(name, 0) + 1
    lines = [f"prompt: {n_tokens:,} tokens, {full:,} full blocks of {block_size}",
             f"prefix hit: {hit_blocks:,} blocks = {hit_blocks * block_size:,} tokens "
             f"({_pct(hit_blocks, full)} of full blocks); "
             f"{n_tokens - hit_blocks * block_size:,} tokens to compute"]
    if counts:
        lines += _table(["TIER", "BLOCKS", "TOKENS"],
                        [[k, f"{v:,}", f"{v * block_size:,}"] for k, v in counts.items()])
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# serve
# ---------------------------------------------------------------------------

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


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvstore.config import load_config

    config = load_config(args.config, os.environ, serve_overrides(args))
    logging.basicConfig(stream=sys.stderr, level=config.log.level.logging_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    from kvstore.daemon import server
    try:
        return int(server.serve(config))
    except (OSError, RuntimeError) as e:  # e.g. the port is taken
        log.debug("serve failed", exc_info=True)
        raise CLIError(f"serve failed: {e}", code=1) from None


# ---------------------------------------------------------------------------
# Commands that talk to the daemon
# ---------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> Any:
    from kvstore.client import Client

    token: str | None = None
    if args.token_file:
        try:
            token = Path(args.token_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            _fail(f"cannot read token file {args.token_file!r}: {e.strerror or e}")
        if not token:
            _fail(f"token file {args.token_file!r} is empty")
    return Client(args.target, token=token, session=False, use_shm=False)


def _cmd_stats(args: argparse.Namespace) -> int:
    with _client(args) as c:
        d = c.stats()
    print(json.dumps(d, indent=2, sort_keys=True) if args.json else format_stats(d), end="\n"
          if args.json else "")
    return 0


def _cmd_lookup(args: argparse.Namespace) -> int:
    from kvstore.keys import block_keys

    req = load_request(args.tokens)
    ns = make_namespace(args, req.namespace)
    keys = block_keys(ns, req.tokens)
    with _client(args) as c:
        res = c.lookup(ns, keys)
    tiers = [_tier_name(t) for t in res.tiers]
    if args.json:
        print(json.dumps({"tokens": len(req.tokens), "block_size": ns.block_size,
                          "full_blocks": len(keys), "hit_blocks": res.hit_blocks,
                          "hit_tokens": res.hit_blocks * ns.block_size, "tiers": tiers}))
    else:
        print(format_lookup(len(req.tokens), ns.block_size, res.hit_blocks, tiers), end="")
    return 0


def _cmd_diff(args: argparse.Namespace) -> int:
    ra, rb = load_request(args.a), load_request(args.b)
    ns = make_namespace(args, ra.namespace or rb.namespace)
    if args.context < 0:
        _fail("--context must be >= 0")
    rep = diff_report(ns, ra.tokens, rb.tokens, args.a, args.b, args.context)
    print(rep.text, end="")
    return rep.exit_code


def _sizes(args: argparse.Namespace, names: Sequence[str]) -> dict[str, int]:
    from kvstore.config import parse_size

    out = {}
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            try:
                out[name] = parse_size(value)
            except InvalidArgument as e:
                _fail(f"--{name}: {e}")
    return out


def _cmd_capacity(args: argparse.Namespace) -> int:
    tiers = _sizes(args, ("hbm", "dram", "ssd"))
    if not tiers:
        tiers = {"dram": 1 << 30}
    t = capacity_table(args.layers, args.kv_heads, args.head_dim, args.dtype, args.tp,
                       args.block_size, tiers, args.ranks_per_node)
    print(json.dumps(t, indent=2) if args.json else format_capacity(t), end="\n" if args.json else "")
    return 0


def _cmd_admin(args: argparse.Namespace) -> int:
    if args.action == "resize":
        size = _sizes(args, ("size",))["size"]
        from tiers.base import TierKind

        TierKind.parse(args.tier)  # a clear error before connecting
        with _client(args) as c:
            r = c.admin_resize(args.tier, size)
        print(f"{args.tier}: {human_bytes(_int(r, 'old_capacity_bytes'))} -> "
              f"{human_bytes(_int(r, 'new_capacity_bytes'))}, "
              f"{_int(r, 'evicted_blocks'):,} block(s) evicted to fit")
        return 0
    with _client(args) as c:
        if args.action == "config":
            print(c.admin_get_config(), end="")
        else:
            r = c.admin_set_policy(args.name)
            print(f"eviction policy: {r.get('old_policy') or '?'} -> "
                  f"{r.get('new_policy') or args.name}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    root = Path(__file__).resolve().parents[2]
    scripts = [root / "bench" / name for name in ("core.py", "service.py")]
    found = [s for s in scripts if s.is_file()]
    if not found:
        print(f"kvstore: no benchmarks here: {root / 'bench'} is missing (benchmarks ship "
              "with the source checkout, not the installed package)", file=sys.stderr)
        return 2
    rc = 0
    for script in found:
        cmd = [sys.executable, str(script)] + ([] if args.full else ["--quick"])
        if args.json_dir:
            os.makedirs(args.json_dir, exist_ok=True)
            cmd += ["--json", os.path.join(args.json_dir, script.stem + ".json")]
        print(f"$ {' '.join(cmd)}", flush=True)
        rc = subprocess.call(cmd, cwd=root) or rc
    return rc


# ---------------------------------------------------------------------------
# Parser and main
# ---------------------------------------------------------------------------


def _daemon_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None,
                   help=f"daemon address HOST:PORT or unix:PATH (default $KVSTORE_ADDRESS or "
                        f"{DEFAULT_TARGET})")
    p.add_argument("--token-file", help="file holding the bearer token (default $KVSTORE_TOKEN)")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of every subcommand."""
    ap = argparse.ArgumentParser(prog="kvstore", description="kvstore: a tiered KV-cache store for LLM inference.",
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
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("stats", help="tier occupancy, hit ratio, evictions")
    _daemon_flags(p)
    p.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    p.set_defaults(func=_cmd_stats)

    p = sub.add_parser("lookup", help="prefix hit length of a token file, per tier")
    p.add_argument("--tokens", required=True, metavar="FILE",
                   help='ints separated by spaces/commas, a JSON list, or {"tokens": [...]}')
    _add_ns_flags(p)
    _daemon_flags(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_lookup)

    p = sub.add_parser("diff", help="where two prompts stop sharing blocks",
                       description="Exit 0: no token differs where both have one (one may extend "
                                   "the other); 1: they differ; 2: error.")
    p.add_argument("a", metavar="A", help="token file (see lookup --tokens)")
    p.add_argument("b", metavar="B", help="token file")
    p.add_argument("--context", type=int, default=8, help="tokens of context each side (8)")
    _add_ns_flags(p)
    p.set_defaults(func=_cmd_diff)

    p = sub.add_parser("capacity", help="tokens and blocks per tier for a model shape")
    p.add_argument("--layers", type=_positive_int, required=True)
    p.add_argument("--kv-heads", type=_positive_int, required=True)
    p.add_argument("--head-dim", type=_positive_int, required=True)
    p.add_argument("--dtype", default="bfloat16", help="KV dtype (bfloat16, float16, float8_e4m3fn...)")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size")
    p.add_argument("--ranks-per-node", type=_positive_int, default=None,
                   help="TP ranks whose shards this node stores (default: all)")
    p.add_argument("--block-size", type=_positive_int, default=16)
    for tier in ("dram", "ssd", "hbm"):
        p.add_argument(f"--{tier}", help=f"{tier.upper()} tier size, e.g. 64GiB")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_capacity)

    p = sub.add_parser("admin", help="running config, resize a tier, switch policy")
    asub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    a = asub.add_parser("config", help="print the running config (TOML)")
    _daemon_flags(a)
    a = asub.add_parser("resize", help="resize a tier at run time")
    a.add_argument("tier", help="hbm, dram or ssd")
    a.add_argument("size", help="new capacity, e.g. 2GiB")
    _daemon_flags(a)
    a = asub.add_parser("policy", help="switch the eviction policy")
    a.add_argument("name", choices=["lru", "lfu", "cost"])
    _daemon_flags(a)
    p.set_defaults(func=_cmd_admin)

    p = sub.add_parser("bench", help="run bench/core.py and bench/service.py (--quick)")
    p.add_argument("--full", action="store_true", help="full runs instead of --quick")
    p.add_argument("--json-dir", help="write each benchmark's JSON here")
    p.set_defaults(func=_cmd_bench)

    from kvstore.tools import demo# light: the model stack is imported when it runs

    p = sub.add_parser("demo", help="prefix-cache experiment on a small model (starts a daemon)",
                       description=demo.__doc__.split("\n\n")[0] if demo.__doc__ else None)
    demo.add_arguments(p)
    p.set_defaults(func=demo.run)

    from kvstore.tools import replay# light: the store is imported when it runs

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
