"""Fetch from a peer or recompute: the transfer-vs-recompute cost model.

Pure code: no I/O, no threads; time comes from an injected clock. The daemon
feeds it measured transfers and asks it per chain.

Transfer of ``B`` bytes from peer ``p``::

    transfer_s = latency[p] + B / bandwidth[p]            (+ B / h2d_bandwidth + h2d_latency  when the target is HBM)

``latency`` and ``bandwidth`` start from the configured link (or a probe at
start). A link whose transport timed out or failed is *suspect*
(:meth:`CostModel.mark_suspect`): its blocks are recomputed at once, without
waiting on it again, until a probe, due ``backoff_s`` later, answers.
:meth:`CostModel.observe` follows wire-level transfers as
exponentially weighted averages: a small transfer (below ``small_bytes``)
updates the latency, a large one the bandwidth (its seconds less the current
latency; averaged as seconds per byte, so one slow transfer corrects an
optimistic seed at once). :meth:`CostModel.observe_fetch` takes whole fetches
measured end to end (directory lookup, reservation, wire, commit: what the
daemon's ``peers.py`` times) and fits ``latency + bytes / bandwidth`` to them
by an exponentially weighted least-squares line, so ``latency`` becomes the
fetch path's real fixed cost (tens of ms on a loaded host) instead of the empty
probe's round trip (issue 17): with one size seen the slope stays the current
bandwidth and the intercept takes the rest.

Recompute of ``n`` tokens after ``c`` tokens already present::

    recompute_s = overhead_s + flops(n, c) / flops_per_s          (model shape known)
    flops(n, c) = n * 2 * linear_params                           (every linear layer: one MAC per weight)
                + layers * 4 * heads * head_dim * n * (c + (n + 1) / 2)   (QK^T and AV over the causal context)

or, when a table of measured prefill times is configured, linear
interpolation in it (extrapolated proportionally past its ends). With a
:class:`PrefillSource` attached (the daemon's :class:`admission.TTFTPredictor`,
which learns its prefill speed from the TTFTs engines ``Report``), its
``prefill_s`` is used once it has calibrated (and, before that, when no shape
with FLOP/s is configured): Admit's prediction and the fetch decision then
share one learned prefill speed (issue 15). Otherwise, without a shape,
``tokens / tokens_per_s``. The decision fetches when
``transfer_s * (1 + margin) <= recompute_s``.

Worked numbers of ``shared/seeds/003`` section 3 (``tests/unit/transport/test_cost.py``):
250 MB per rank over 400 Gb/s is 5 ms on the wire, 8-12 ms end to end with
3-7 ms of queueing and handshakes, plus ~3 ms PCIe into HBM: 11 ms against a
14 ms local prefill of 4000 tokens -> fetch. Over 100 Gb/s the wire alone is
20 ms -> recompute.
"""

from __future__ import annotations

import bisect
import enum
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Protocol, Sequence

from kvstore.errors import InvalidArgument

Clock = Callable[[], float]

GBIT = 1e9 / 8
"""Bytes per second of one Gb/s."""


class PrefillSource(Protocol):
    """A learned prefill model (:class:`admission.TTFTPredictor` is one)."""

    @property
    def calibrations(self) -> int:
        """How many measured prefills moved the model (0: still its seed)."""
        ...

    def prefill_s(self, uncached_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill ``uncached_tokens`` after ``cached_tokens``."""
        ...


class ChainDecision(enum.IntEnum):
    """What to do with the blocks of a chain that peers hold (wire value: + 1)."""

    LOCAL = 0       # nothing to fetch: every usable block is local (or none is anywhere)
    FETCH = 1       # move them from a peer
    RECOMPUTE = 2   # let the engine prefill them again

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(slots=True, frozen=True)
class ModelShape:
    """A model's dimensions, per TP rank when ``tp_size`` > 1 divides the work."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tp_size: int = 1
    linear_params: float = 0.0
    """Weights of the linear layers (per model, all ranks); 0: computed from the
    shape (attention projections + a gated MLP per layer)."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "tp_size"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"model shape: {name} must be > 0, got {getattr(self, name)}")

    @property
    def params(self) -> float:
        if self.linear_params > 0:
            return self.linear_params
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return float(self.layers * (q_o + k_v + mlp))

    def flops(self, new_tokens: float, context_tokens: float = 0.0) -> float:
        """Prefill FLOPs of ``new_tokens`` after ``context_tokens``, per rank."""
        n, c = float(new_tokens), float(context_tokens)
        linear = 2.0 * self.params * n
        attention = self.layers * 4.0 * self.heads * self.head_dim * n * (c + (n + 1) / 2)
        return (linear + attention) / self.tp_size

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV bytes one token adds, per rank."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes // self.tp_size


@dataclass(slots=True, frozen=True)
class PrefillTable:
    """Measured prefill seconds at a few token counts (ascending)."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.seconds):
            raise InvalidArgument("prefill table: give as many token counts as seconds, at least one")
        if list(self.tokens) != sorted(set(self.tokens)) or self.tokens[0] <= 0:
            raise InvalidArgument("prefill table: token counts must be > 0, distinct and ascending")
        if any(s <= 0 for s in self.seconds):
            raise InvalidArgument("prefill table: seconds must be > 0")

    @classmethod
    def of(cls, rows: Mapping[int, float]) -> "PrefillTable":
        items = sorted((int(k), float(v)) for k, v in rows.items())
        return cls(tuple(k for k, _ in items), tuple(v for _, v in items))

    def seconds_for(self, tokens: float) -> float:
        t, s = self.tokens, self.seconds
        if tokens <= 0:
            return 0.0
        if tokens <= t[0]:
            return s[0] * tokens / t[0]
        if tokens >= t[-1]:
            return s[-1] * tokens / t[-1]
        i = bisect.bisect_left(t, tokens)
        f = (tokens - t[i - 1]) / (t[i] - t[i - 1])
        return s[i - 1] + f * (s[i] - s[i - 1])


@dataclass(slots=True, frozen=True)
class CostConfig:
    latency_s: float = 50e-6
    """Seed of a peer's per-transfer latency (handshake, queueing)."""
    bandwidth_Bps: float = 100 * GBIT
    """Seed of a peer's bandwidth, bytes/s."""
    h2d_latency_s: float = 0.0
    """Host-to-device copy setup when the target is HBM."""
    h2d_bandwidth_Bps: float = 25e9
    """Host-to-device copy bandwidth (PCIe), bytes/s."""
    prefill_tokens_per_s: float = 20000.0
    """Recompute speed without a model shape or table."""
    prefill_flops_per_s: float = 0.0
    """Useful FLOP/s of one rank's prefill, for models with a shape; 0: use
    ``prefill_tokens_per_s`` even for known shapes."""
    prefill_overhead_s: float = 0.0
    """Fixed cost of a prefill step (kernel launches, scheduling)."""
    margin: float = 0.1
    """Fetch only when transfer * (1 + margin) <= recompute."""
    alpha: float = 0.2
    """Weight of a new measurement in the EWMAs."""
    small_bytes: int = 64 * 1024
    """Transfers below this size measure latency; above, bandwidth."""
    backoff_s: float = 5.0
    """A link whose transport timed out or failed is suspect (every fetch from
    it a miss) for at least this long, until a probe answers; 0: never suspect."""
    fit_spread: float = 0.05
    """End-to-end fetches fit a slope (bandwidth) only once their sizes spread
    by at least this fraction of their mean (weighted standard deviation)."""

    def __post_init__(self) -> None:
        if self.bandwidth_Bps <= 0 or self.h2d_bandwidth_Bps <= 0:
            raise InvalidArgument("bandwidths must be > 0")
        if self.prefill_tokens_per_s <= 0:
            raise InvalidArgument("prefill_tokens_per_s must be > 0")
        if min(self.latency_s, self.h2d_latency_s, self.prefill_overhead_s, self.margin,
               self.prefill_flops_per_s, self.backoff_s) < 0:
            raise InvalidArgument("latencies, overhead, margin, flops and backoff must be >= 0")
        if not 0 < self.alpha <= 1:
            raise InvalidArgument("alpha must be in (0, 1]")


@dataclass(slots=True)
class Link:
    """What the model believes about one peer."""

    latency_s: float
    bandwidth_Bps: float
    samples: int = 0
    bytes: int = 0
    updated: float = 0.0
    fetches: int = 0
    """End-to-end fetches fitted (:meth:`CostModel.observe_fetch`)."""
    fit: list[float] = field(default_factory=lambda: [0.0] * 5)
    """Exponentially weighted sums of the fetch samples: weight, x, y, x*x, x*y
    (x = MB, y = seconds)."""
    suspect_until: float = 0.0
    """0: sound. Else its transport timed out or failed: fetches from it are
    misses until a probe answers, and the probe is due at this clock time."""

    def transfer_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps


@dataclass(slots=True, frozen=True)
class Estimate:
    """A chain's decision with both estimates (seconds)."""

    decision: ChainDecision
    transfer_s: float
    recompute_s: float
    nbytes: int
    tokens: int


@dataclass
class CostModel:
    """Per-peer link estimates and per-model recompute estimates."""

    config: CostConfig = field(default_factory=CostConfig)
    shapes: dict[str, ModelShape] = field(default_factory=dict)
    tables: dict[str, PrefillTable] = field(default_factory=dict)
    clock: Clock = time.monotonic
    links: dict[str, Link] = field(default_factory=dict)
    prefill: PrefillSource | None = None
    """The learned prefill model the recompute side follows (the daemon's
    TTFT predictor); None: the configured speed alone."""

    # --------------------------------------------------------------- links
    def link(self, peer: str) -> Link:
        ln = self.links.get(peer)
        if ln is None:
            ln = self.links[peer] = Link(self.config.latency_s, self.config.bandwidth_Bps)
        return ln

    def set_link(self, peer: str, *, latency_s: float | None = None, bandwidth_Bps: float | None = None,
                 seed: bool = False) -> None:
        """Set a peer's link (a configured figure). ``seed``: only while no
        end-to-end fetch has been fitted (a probe's round trip must not undo
        what real fetches measured)."""
        ln = self.link(peer)
        if seed and ln.fetches:
            return
        if latency_s is not None and latency_s >= 0:
            ln.latency_s = latency_s
        if bandwidth_Bps is not None and bandwidth_Bps > 0:
            ln.bandwidth_Bps = bandwidth_Bps

    def forget(self, peer: str) -> None:
        self.links.pop(peer, None)

    def mark_suspect(self, peer: str) -> None:
        """A fetch from ``peer`` timed out or failed in its transport (or a
        probe of it did): every fetch from it is a miss until a probe answers
        (:meth:`clear_suspect`), and a probe is due ``backoff_s`` from now."""
        if self.config.backoff_s > 0:
            self.link(peer).suspect_until = max(self.clock() + self.config.backoff_s, 1e-9)

    def clear_suspect(self, peer: str) -> None:
        """A probe of ``peer`` answered: fetches from it may be chosen again."""
        ln = self.links.get(peer)
        if ln is not None:
            ln.suspect_until = 0.0

    def suspect(self, peer: str) -> bool:
        ln = self.links.get(peer)
        return ln is not None and ln.suspect_until > 0

    def probe_due(self, peer: str) -> bool:
        """Suspect, and its back-off has passed: time to probe it again."""
        ln = self.links.get(peer)
        return ln is not None and 0 < ln.suspect_until <= self.clock()

    def observe(self, peer: str, nbytes: int, seconds: float) -> None:
        """A real transfer of ``nbytes`` from ``peer`` took ``seconds``."""
        if seconds <= 0:
            return
        ln = self.link(peer)
        a = self.config.alpha
        if nbytes < self.config.small_bytes:
            ln.latency_s += a * (seconds - ln.latency_s)
        else:
            # averaged as seconds per byte: a slow sample counts at once
            # (an optimistic seed would otherwise take many fetches to unlearn)
            wire = max(seconds - ln.latency_s, seconds * 0.1)
            inv = 1.0 / ln.bandwidth_Bps
            inv += a * (wire / nbytes - inv)
            ln.bandwidth_Bps = 1.0 / inv
        ln.samples += 1
        ln.bytes += nbytes
        ln.updated = self.clock()

    def observe_fetch(self, peer: str, nbytes: int, seconds: float) -> None:
        """A whole fetch of ``nbytes`` from ``peer`` took ``seconds`` end to
        end. Refits the link's ``latency + bytes / bandwidth`` line by
        exponentially weighted least squares (weight ``alpha`` per sample);
        until the sizes spread (``fit_spread``) the slope stays the current
        bandwidth and the intercept (the fixed cost) takes the rest."""
        if seconds <= 0 or nbytes < 0:
            return
        ln = self.link(peer)
        c = self.config
        x, y = nbytes / 1e6, float(seconds)
        f = ln.fit
        keep = 1.0 - c.alpha if ln.fetches else 0.0
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            f[i] = keep * f[i] + v
        w, sx, sy, sxx, sxy = f
        mx, my = sx / w, sy / w
        var = max(sxx / w - mx * mx, 0.0)
        slope = 1e6 / ln.bandwidth_Bps  # seconds per MB
        if mx > 0 and var > (c.fit_spread * mx) ** 2:
            fitted = (sxy / w - mx * my) / var
            if fitted > 0:
                slope = fitted
        intercept = my - slope * mx
        if intercept < 0:  # the line would cross below zero: no fixed cost, the slope through the mean
            intercept, slope = 0.0, (my / mx if mx > 0 else slope)
        ln.latency_s = intercept
        if slope > 0:
            ln.bandwidth_Bps = 1e6 / slope
        ln.fetches += 1
        ln.samples += 1
        ln.bytes += nbytes
        ln.updated = self.clock()

    def transfer_s(self, peer: str, nbytes: float, to_hbm: bool = False) -> float:
        t = self.link(peer).transfer_s(nbytes)
        if to_hbm and nbytes > 0:
            t += self.config.h2d_latency_s + nbytes / self.config.h2d_bandwidth_Bps
        return t

    # ------------------------------------------------------------ recompute
    def remote_terms(self, nbytes: float) -> tuple[float, float]:
        """(fixed seconds, wire seconds) of fetching ``nbytes`` over the
        cheapest known link (the configured seed without one): what a TTFT
        prediction charges for remote blocks."""
        ln = min((v for v in self.links.values() if not v.suspect_until), key=lambda v: v.transfer_s(nbytes),
                 default=None)
        if ln is None:
            return self.config.latency_s, nbytes / self.config.bandwidth_Bps
        return ln.latency_s, nbytes / ln.bandwidth_Bps

    def recompute_s(self, model_id: str, new_tokens: int, context_tokens: int = 0) -> float:
        """Prefill seconds of ``new_tokens`` after ``context_tokens`` present."""
        if new_tokens <= 0:
            return 0.0
        c = self.config
        table = self.tables.get(model_id)
        if table is not None:
            # the table measures whole prompts: the new tokens' share of a
            # prompt of context + new tokens
            total = context_tokens + new_tokens
            return table.seconds_for(total) - table.seconds_for(context_tokens)
        shape = self.shapes.get(model_id)
        src = self.prefill
        has_flops = shape is not None and c.prefill_flops_per_s > 0
        if src is not None and (src.calibrations > 0 or not has_flops):
            return src.prefill_s(new_tokens, context_tokens)
        if shape is not None and has_flops:
            return c.prefill_overhead_s + shape.flops(new_tokens, context_tokens) / c.prefill_flops_per_s
        return c.prefill_overhead_s + new_tokens / c.prefill_tokens_per_s

    def calibrate_flops(self, model_id: str, tokens: int, seconds: float) -> float:
        """Set ``prefill_flops_per_s`` so that ``tokens`` of ``model_id``
        prefill in ``seconds`` (a measured step); returns the FLOP/s."""
        shape = self.shapes[model_id]
        fps = shape.flops(tokens) / max(seconds - self.config.prefill_overhead_s, 1e-9)
        self.config = replace(self.config, prefill_flops_per_s=fps)
        return fps

    # -------------------------------------------------------------- decide
    def decide(self, peer: str | None, nbytes: int, model_id: str, new_tokens: int,
               context_tokens: int = 0, to_hbm: bool = False) -> Estimate:
        """The decision for blocks of ``nbytes`` / ``new_tokens`` a peer holds
        after ``context_tokens`` present locally (``peer`` None: none does).
        A suspect peer's blocks are recomputed whatever the estimates say."""
        if peer is None or new_tokens <= 0:
            return Estimate(ChainDecision.LOCAL, 0.0, 0.0, 0, 0)
        t = self.transfer_s(peer, nbytes, to_hbm)
        r = self.recompute_s(model_id, new_tokens, context_tokens)
        fetch = t * (1 + self.config.margin) <= r and not self.suspect(peer)
        kind = ChainDecision.FETCH if fetch else ChainDecision.RECOMPUTE
        return Estimate(kind, t, r, int(nbytes), int(new_tokens))

    def best_peer(self, peers: Sequence[str], nbytes: float) -> str | None:
        """The holder with the cheapest estimated transfer."""
        if not peers:
            return None
        return min(peers, key=lambda p: self.transfer_s(p, nbytes))


def seed_worked_example() -> list[tuple[str, float, float, float, str]]:
    """The seed's section-3 arithmetic through this model: 250 MB per TP rank
    (4000 tokens of a 70B model over TP8), 3 ms of queueing/handshakes on the
    link, ~3 ms of PCIe into HBM, against a measured 14 ms prefill.
    Rows: (link, wire ms, end-to-end ms incl. PCIe, prefill ms, decision)."""
    rank_bytes, pcie_s = 250e6, 3e-3
    rows = []
    for gbps in (400.0, 200.0, 100.0):
        m = CostModel(CostConfig(latency_s=3e-3, bandwidth_Bps=gbps * GBIT, h2d_bandwidth_Bps=rank_bytes / pcie_s),
                      tables={"llama-70b": PrefillTable.of({4000: 0.014})})
        e = m.decide("peer", int(rank_bytes), "llama-70b", 4000, 0, to_hbm=True)
        rows.append((f"{gbps:.0f} Gb/s", rank_bytes / (gbps * GBIT) * 1e3, e.transfer_s * 1e3,
                     e.recompute_s * 1e3, e.decision.label))
    return rows


def shapes_from_toml(doc: Mapping[str, object]) -> tuple[dict[str, ModelShape], dict[str, PrefillTable]]:
    """``[model."<model_id>"]`` tables of a models file: shape fields
    (layers, hidden, heads, kv_heads, head_dim, intermediate, tp_size,
    linear_params) and/or ``prefill = {"<tokens>" = seconds, ...}``."""
    shapes: dict[str, ModelShape] = {}
    tables: dict[str, PrefillTable] = {}
    models = doc.get("model", {})
    if not isinstance(models, Mapping):
        raise InvalidArgument("models file: [model.<id>] tables expected")
    for mid, spec in models.items():
        if not isinstance(spec, Mapping):
            raise InvalidArgument(f"models file: model {mid!r} must be a table")
        spec = dict(spec)
        pre = spec.pop("prefill", None)
        if pre is not None:
            if not isinstance(pre, Mapping):
                raise InvalidArgument(f"models file: model {mid!r}: prefill must be a table tokens -> seconds")
            tables[str(mid)] = PrefillTable.of({int(k): float(v) for k, v in pre.items()})
        if spec:
            try:
                shapes[str(mid)] = ModelShape(**spec)
            except TypeError as e:
                raise InvalidArgument(f"models file: model {mid!r}: {e}") from None
    return shapes, tables


if __name__ == "__main__":  # python -m transport.cost: the seed's worked numbers
    print(f"{'link':>10} {'wire ms':>8} {'fetch ms':>9} {'prefill ms':>11}  decision")
    for link, wire, total, pre, kind in seed_worked_example():
        print(f"{link:>10} {wire:8.1f} {total:9.1f} {pre:11.1f}  {kind}")


__all__ = ["ChainDecision", "CostConfig", "CostModel", "Estimate", "GBIT", "Link", "ModelShape",
           "PrefillSource", "PrefillTable", "seed_worked_example", "shapes_from_toml"]
