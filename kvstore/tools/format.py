"""Pure formatting of the ``kvstore`` command's reports: byte sizes, tables,
``stats``, ``capacity``, ``lookup`` and ``diff``; testable without a daemon."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.keys import KVDtype, first_divergence
from tiers.slots import SLOT_ALIGN
from tiers.ssd_format import HEADER_BYTES

__all__ = ["DiffReport", "capacity_table", "diff_report", "format_capacity", "format_diff",
           "format_lookup", "format_stats", "human_bytes", "int_field", "percent", "table",
           "tier_name"]


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


def int_field(d: Mapping[str, Any], key: str) -> int:
    """A uint64 field of a MessageToDict dict (JSON strings) as int; 0 when absent."""
    value = d.get(key, 0)
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def percent(num: float, den: float) -> str:
    return f"{100.0 * num / den:.1f}%" if den else "-"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned first column, right-aligned others, two spaces apart."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    out = []
    for r in [header, *rows]:
        cells = [str(c).ljust(widths[0]) if i == 0 else str(c).rjust(widths[i])
                 for i, c in enumerate(r)]
        out.append("  ".join(cells).rstrip())
    return out


def tier_name(value: Any) -> str:
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
    tenant = str(d.get("tenant", "") or "")
    lines += [head, f"tenant {tenant}" if tenant else "all tenants", ""]
    rows = []
    for t in d.get("tiers", []) or []:
        used, cap = int_field(t, "used_bytes"), int_field(t, "capacity_bytes")
        rows.append([tier_name(t.get("tier", "?")), human_bytes(used), human_bytes(cap),
                     percent(used, cap), f"{int_field(t, 'blocks'):,}", human_bytes(int_field(t, "pinned_bytes")),
                     f"{int_field(t, 'evictions'):,}", f"{int_field(t, 'promotions'):,}",
                     f"{int_field(t, 'demotions'):,}", human_bytes(int_field(t, "disk_bytes"))])
    if rows:
        lines += table(["TIER", "USED", "CAPACITY", "USED%", "BLOCKS", "PINNED", "EVICTIONS",
                        "PROMOTED", "DEMOTED", "ON DISK"], rows)
    else:
        lines.append("(no tiers reported)")
    hit, miss = int_field(d, "hit_blocks"), int_field(d, "miss_blocks")
    hit_tok, miss_tok = int_field(d, "hit_tokens"), int_field(d, "miss_tokens")
    ratio = percent(hit, hit + miss)
    summary = [
        ("lookups", f"{int_field(d, 'lookups'):,}"),
        ("prefix hit ratio", f"{ratio}  ({hit:,} of {hit + miss:,} blocks queried"
                             + (f"; {hit_tok:,} of {hit_tok + miss_tok:,} tokens" if hit_tok + miss_tok
                                else "") + ")"),
        ("puts / gets", f"{int_field(d, 'puts'):,} / {int_field(d, 'gets'):,} blocks"),
        ("bytes written / read", f"{human_bytes(int_field(d, 'bytes_written'))} / "
                                 f"{human_bytes(int_field(d, 'bytes_read'))}"),
        ("bytes promoted / demoted", f"{human_bytes(int_field(d, 'bytes_promoted'))} / "
                                     f"{human_bytes(int_field(d, 'bytes_demoted'))}"),
        ("checksum failures", f"{int_field(d, 'checksum_failures'):,}"),
        ("reservations / leases / sessions",
         f"{int_field(d, 'active_reservations'):,} / {int_field(d, 'active_leases'):,} / "
         f"{int_field(d, 'sessions'):,}"),
        ("expired reservations / leases",
         f"{int_field(d, 'reservations_expired'):,} / {int_field(d, 'leases_expired'):,}"),
        ("admitted / degraded / rejected",
         f"{int_field(d, 'admitted'):,} / {int_field(d, 'admitted_degraded'):,} / {int_field(d, 'rejected'):,}"),
        ("prefill model / TTFT error", f"{float(d.get('prefill_tokens_per_s') or 0):,.0f} tokens/s / "
                                       f"{float(d.get('ttft_error_ewma_s') or 0) * 1e3:.1f} ms"),
    ]
    width = max(len(k) for k, _ in summary)
    lines.append("")
    lines += [f"{k.ljust(width)}  {v}" for k, v in summary]
    nss = d.get("namespaces", []) or []
    if nss:
        ns_rows = []
        for n in sorted(nss, key=lambda n: -int_field(n, "queried_blocks")):
            q, h = int_field(n, "queried_blocks"), int_field(n, "hit_blocks")
            ns_rows.append([str(n.get("namespace_label", "?")), f"{int_field(n, 'lookups'):,}",
                            f"{q:,}", f"{h:,}", percent(h, q), f"{int_field(n, 'blocks'):,}"])
        lines.append("")
        lines += table(["NAMESPACE", "LOOKUPS", "QUERIED", "HIT", "HIT%", "BLOCKS"], ns_rows)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# capacity
# ---------------------------------------------------------------------------


def capacity_table(layers: int, kv_heads: int, head_dim: int, dtype: str = "bfloat16",
                   tp: int = 1, block_size: int = 16,
                   tiers: Mapping[str, int] | None = None,
                   ranks_per_node: int | None = None, page_size: int = 16 << 20) -> dict[str, Any]:
    """How many tokens and blocks fit in each tier.

    bytes/token of one TP rank = 2 (K and V) x layers x ceil(kv_heads / tp) x
    head_dim x dtype bytes (with tp > kv_heads each rank holds one replicated
    head). A node's daemon stores the shards of ``ranks_per_node`` ranks
    (default: all ``tp``: mirrored shards live together), so tier capacity is
    divided by per-rank bytes x ranks_per_node. A tier holds what its
    allocator can place: the DRAM and HBM slabs put each block in a slot
    rounded up to 4 KiB and whole slots in pages of ``page_size``
    (``dram.page_size``, ``hbm.page_size``), whole pages in the capacity;
    an SSD record is the block plus an 88-byte header. Raises InvalidArgument."""
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
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < SLOT_ALIGN:
        raise InvalidArgument(f"--page-size must be at least {SLOT_ALIGN} bytes, got {page_size!r}")
    rows = []
    for tier, cap in (tiers or {}).items():
        if tier == "ssd":
            blocks = cap // (block_bytes + HEADER_BYTES)
        else:  # the slab tiers (tiers.slots.PagedSlots with the default slot sizes)
            page = min(page_size, cap) // SLOT_ALIGN * SLOT_ALIGN
            slot = -(-block_bytes // SLOT_ALIGN) * SLOT_ALIGN
            blocks = (cap // page) * (page // slot) if page else 0
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
        lines += table(["TIER", "CAPACITY", "BLOCKS", "TOKENS"], rows)
    return "\n".join(lines) + "\n"




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
        name = tier_name(t)
        counts[name] = counts.get(name, 0) + 1
    lines = [f"prompt: {n_tokens:,} tokens, {full:,} full blocks of {block_size}",
             f"prefix hit: {hit_blocks:,} blocks = {hit_blocks * block_size:,} tokens "
             f"({percent(hit_blocks, full)} of full blocks); "
             f"{n_tokens - hit_blocks * block_size:,} tokens to compute"]
    if counts:
        lines += table(["TIER", "BLOCKS", "TOKENS"],
                       [[k, f"{v:,}", f"{v * block_size:,}"] for k, v in counts.items()])
    return "\n".join(lines) + "\n"
