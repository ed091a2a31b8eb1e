"""What a replay measured (:class:`ReplayResult`) and the table that
compares policies with Bélády's optimum (:func:`format_table`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from kvstore.tools.trace import PreparedTrace

__all__ = ["ReplayResult", "base_result", "format_table"]


@dataclass(slots=True)
class ReplayResult:
    """What one replay measured. Ratios are properties."""

    policy: str
    capacity_blocks: int
    requests: int
    prompt_tokens: int
    blocks: int
    """Full blocks the requests asked for (sum of chain lengths)."""
    hit_blocks: int
    block_size: int
    tier_hits: dict[str, int] = field(default_factory=dict)
    """Hit blocks by the tier they were found in."""
    evictions: dict[str, int] = field(default_factory=dict)
    """Blocks leaving a tier, by ``tier/reason`` (``dram/evicted``...)."""
    put_blocks: int = 0
    rejected_blocks: int = 0
    """Suffix blocks the store could not place (no room even after eviction)."""
    bypassed_blocks: int = 0
    """Bélády only: blocks not admitted (their next use was the furthest)."""
    ssd_blocks: int = 0
    ssd_admission: str = ""
    """"on" (the SSD write admission's default rule), "off" (admit all) or ""."""
    ssd_bytes_written: int | None = None
    demoted_blocks: int = 0
    """Blocks moved from DRAM to SSD."""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    request_hits: np.ndarray | None = field(default=None, repr=False)
    """Hit blocks of each request (int64), for analysis; not in ``to_dict``."""

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block_size

    @property
    def prefill_tokens_saved(self) -> int:
        return self.hit_tokens

    @property
    def block_hit_ratio(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def label(self) -> str:
        if self.ssd_blocks:
            return f"{self.policy}+ssd(admit {self.ssd_admission or 'default'})"
        return self.policy

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "request_hits"}
        d["tier_hits"], d["evictions"], d["notes"] = dict(self.tier_hits), dict(self.evictions), list(self.notes)
        d.update(label=self.label, hit_tokens=self.hit_tokens, block_hit_ratio=self.block_hit_ratio,
                 token_hit_ratio=self.token_hit_ratio, prefill_tokens_saved=self.prefill_tokens_saved)
        return d


def base_result(pt: PreparedTrace, policy: str, capacity: int) -> ReplayResult:
    return ReplayResult(policy, int(capacity), pt.requests, pt.tokens, pt.blocks, 0, pt.block_size)



def format_table(results: Sequence[ReplayResult], optimum: dict[int, ReplayResult] | None = None) -> str:
    """One row per result, and per capacity the Bélády row from ``optimum``
    (capacity -> Bélády result); each row's ``/ belady`` is its hit ratio over
    Bélády's at the same capacity (for runs with an SSD tier: at DRAM + SSD
    blocks). ``belady_min`` results may be among ``results``."""
    optimum = optimum or {}
    rows = [["policy", "capacity", "block hit", "token hit", "/ belady", "hits by tier", "evicted",
             "demoted", "ssd written", "tokens saved"]]
    items: list[ReplayResult] = list(results)
    for total in sorted({r.capacity_blocks + r.ssd_blocks for r in results}):
        if total in optimum and optimum[total] not in items:
            items.append(optimum[total])
    order = {"belady": 1, "belady_min": 2}
    items.sort(key=lambda r: (r.capacity_blocks + r.ssd_blocks, order.get(r.policy, 0), r.label))
    for r in items:
        opt = optimum.get(r.capacity_blocks + r.ssd_blocks)
        ratio = f"{r.block_hit_ratio / opt.block_hit_ratio:.3f}" if opt and opt.block_hit_ratio else "-"
        capacity = f"{r.capacity_blocks}" + (f"+{r.ssd_blocks}" if r.ssd_blocks else "")
        rows.append([r.label, capacity, f"{r.block_hit_ratio:.4f}", f"{r.token_hit_ratio:.4f}", ratio,
                     " ".join(f"{k}={v}" for k, v in r.tier_hits.items()) or "-",
                     str(sum(v for k, v in r.evictions.items() if k.endswith("/evicted"))),
                     str(r.demoted_blocks) if r.ssd_blocks else "-",
                     "-" if r.ssd_bytes_written is None else _human(r.ssd_bytes_written),
                     str(r.prefill_tokens_saved)])
    w = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w[i]) if i in (0, 5) else c.rjust(w[i]) for i, c in enumerate(row)) for row in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    notes = sorted({n for r in results for n in r.notes})
    return "\n".join(lines + [f"note: {n}" for n in notes])


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)
