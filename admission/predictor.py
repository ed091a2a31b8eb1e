"""TTFT prediction (issue 7): the model, its calibration and its error figures.

Pure code: no I/O, no threads, no gRPC. Time comes from an injected clock (a
callable returning seconds). The model (``docs/admission.md`` has the long
form)::

    TTFT = queue wait
         + load of the cached blocks, per tier   (blocks * bytes / bandwidth + blocks * per-block latency)
         + remote fetch setup                    (once, when any hit block is remote)
         + prefill of the uncached tokens        (overhead + tokens / tokens_per_s
                                                  + attention_s * tokens * (cached + tokens / 2))

With ``overlap_load`` the load overlaps the prefill (layer-wise pipelining)
and the two parts contribute ``max(load, prefill)`` instead of their sum.

One predictor per daemon (issue 15): with a :class:`transport.cost.CostModel`
attached (:meth:`TTFTPredictor.attach_cost`, done by the daemon's cluster
node), the remote tier's load and the remote fetch setup come from the cost
model's learned links (bytes / bandwidth, and its fitted fixed cost per
fetch), and the cost model's recompute side uses this predictor's learned
prefill speed: a ``Report`` moves both Admit's prediction and the
fetch-versus-recompute decision.

:class:`TTFTPredictor` computes that breakdown, tracks its own error from the
actual TTFTs engines report, and recalibrates the prefill throughput from those
reports (an EWMA in log space on the implied tokens/s, with a bounded step).
:mod:`admission.slo` turns its predictions into admission decisions.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from kvstore.errors import InvalidArgument
from tiers.base import TierKind

if TYPE_CHECKING:
    from transport.cost import CostModel

__all__ = [
    "Clock", "DEFAULT_TIER_LOADS", "ErrorStats", "HitCounts", "N_TIERS", "PredictorConfig", "TTFTBreakdown",
    "TTFTPredictor", "TierLoad", "check_positive", "hit_counts",
]

Clock = Callable[[], float]
"""Seconds, monotonic. Tests pass a fake; the daemon passes ``time.monotonic``."""

N_TIERS = len(TierKind)

HitCounts = Mapping[TierKind, int] | Mapping[int, int] | Sequence[int] | np.ndarray
"""Hit blocks per tier: a mapping ``TierKind -> count`` or a length-4 sequence
indexed by ``TierKind`` value (hbm, dram, ssd, remote)."""


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    """Raise :class:`InvalidArgument` naming ``name`` unless ``value`` is a
    finite number > 0 (>= 0 with ``allow_zero``)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    ok = v >= 0 if allow_zero else v > 0
    if not (math.isfinite(v) and ok):
        rule = ">= 0" if allow_zero else "> 0"
        raise InvalidArgument(f"{name} must be a finite number {rule}, got {value!r}")


# ----------------------------------------------------------------- config
@dataclass(slots=True, frozen=True)
class TierLoad:
    """How long cached blocks of one tier take to become usable by the engine."""

    bytes_per_s: float
    """Sustained bandwidth from this tier into GPU memory (bytes/s)."""
    per_block_s: float = 0.0
    """Fixed cost per block (an SSD read, a transfer descriptor), seconds."""

    def __post_init__(self) -> None:
        check_positive("TierLoad.bytes_per_s", self.bytes_per_s)
        check_positive("TierLoad.per_block_s", self.per_block_s, allow_zero=True)


DEFAULT_TIER_LOADS: tuple[TierLoad, TierLoad, TierLoad, TierLoad] = (
    TierLoad(2.0e12, 0.0),       # hbm: already on the GPU (a device copy at most)
    TierLoad(25.0e9, 2e-6),      # dram: pinned host memory over PCIe 5 x16
    TierLoad(3.0e9, 50e-6),      # ssd: NVMe read, then the PCIe copy
    TierLoad(12.0e9, 10e-6),     # remote: 100 Gb/s RDMA into the local slab
)
"""Defaults per ``TierKind`` value; override from measured figures."""


@dataclass(slots=True, frozen=True)
class PredictorConfig:
    """Knobs of :class:`TTFTPredictor`; every field is validated."""

    prefill_tokens_per_s: float = 20_000.0
    """Initial prefill throughput of one engine (tokens/s); calibrated from reports."""
    prefill_overhead_s: float = 0.0
    """Fixed per-request prefill cost (scheduling, the first decode step)."""
    attention_s_per_token2: float = 0.0
    """Attention term: seconds per (new token x context token) pair. A prefill of
    ``u`` new tokens after ``c`` cached ones adds ``a * u * (c + u / 2)``."""
    min_prefill_tokens: int = 1
    """An engine computes at least this many tokens even on a full hit (the
    last token's logits)."""
    tier_loads: tuple[TierLoad, TierLoad, TierLoad, TierLoad] = DEFAULT_TIER_LOADS
    """Load model per tier, indexed by ``TierKind`` value (hbm, dram, ssd, remote)."""
    remote_fetch_s: float = 0.0005
    """Setup of a remote fetch (directory lookup, connection), once per request
    that has any remote hit block."""
    overlap_load: bool = False
    """True: loading overlaps the prefill (layer-wise), total uses max(load, prefill)."""
    queue_parallelism: float = 1.0
    """Seconds of queued work drained per second (engines behind this daemon)."""
    calibrate: bool = True
    """Adjust ``prefill_tokens_per_s`` from reported TTFTs."""
    calibrate_alpha: float = 0.05
    """EWMA weight of one report in the (log) throughput estimate, in (0, 1]."""
    calibrate_max_step: float = 0.25
    """Bound of one report's influence: the implied throughput is clipped to
    ``[tps / (1 + step), tps * (1 + step)]`` before it enters the EWMA."""
    calibrate_min_tokens: int = 32
    """Reports with fewer uncached tokens carry too little prefill to calibrate."""
    min_tokens_per_s: float = 100.0
    """Lower bound of the calibrated throughput."""
    max_tokens_per_s: float = 1.0e8
    """Upper bound of the calibrated throughput."""
    error_alpha: float = 0.05
    """EWMA weight of one report in the error figures, in (0, 1]."""
    error_window: int = 1024
    """How many recent signed errors are kept (for a histogram / percentiles)."""

    def __post_init__(self) -> None:
        check_positive("prefill_tokens_per_s", self.prefill_tokens_per_s)
        check_positive("prefill_overhead_s", self.prefill_overhead_s, allow_zero=True)
        check_positive("attention_s_per_token2", self.attention_s_per_token2, allow_zero=True)
        check_positive("remote_fetch_s", self.remote_fetch_s, allow_zero=True)
        check_positive("queue_parallelism", self.queue_parallelism)
        check_positive("min_tokens_per_s", self.min_tokens_per_s)
        check_positive("calibrate_max_step", self.calibrate_max_step)
        if self.max_tokens_per_s < self.min_tokens_per_s:
            raise InvalidArgument("max_tokens_per_s must be >= min_tokens_per_s")
        if self.min_prefill_tokens < 0:
            raise InvalidArgument(f"min_prefill_tokens must be >= 0, got {self.min_prefill_tokens}")
        if self.calibrate_min_tokens < 1:
            raise InvalidArgument(f"calibrate_min_tokens must be >= 1, got {self.calibrate_min_tokens}")
        for name in ("calibrate_alpha", "error_alpha"):
            v = getattr(self, name)
            if not (0.0 < v <= 1.0):
                raise InvalidArgument(f"{name} must be in (0, 1], got {v!r}")
        if self.error_window < 1:
            raise InvalidArgument(f"error_window must be >= 1, got {self.error_window}")
        if len(self.tier_loads) != N_TIERS or not all(isinstance(t, TierLoad) for t in self.tier_loads):
            raise InvalidArgument(f"tier_loads must be {N_TIERS} TierLoad values (hbm, dram, ssd, remote)")


# ----------------------------------------------------------------- results
@dataclass(slots=True, frozen=True)
class TTFTBreakdown:
    """A predicted TTFT and its parts (seconds)."""

    queue_s: float
    """Wait before the engine starts on the request."""
    prefill_s: float
    """Compute of the uncached tokens."""
    load_s: tuple[float, float, float, float]
    """Load of the cached blocks used, per ``TierKind`` value."""
    remote_fetch_s: float
    """Remote fetch setup (0 without remote blocks)."""
    cached_tokens: int
    """Tokens served from cache in this plan."""
    uncached_tokens: int
    """Tokens the engine computes in this plan."""
    total_s: float
    """The predicted TTFT."""

    def load(self, tier: TierKind) -> float:
        """Load seconds of one tier."""
        return self.load_s[int(tier)]

    @property
    def load_total_s(self) -> float:
        """Load seconds over all tiers plus the remote setup."""
        return float(sum(self.load_s)) + self.remote_fetch_s

    def parts(self) -> dict[str, float]:
        """Flat ``name -> seconds`` (for a proto map or metric labels):
        ``queue``, ``prefill``, ``load_hbm`` .. ``load_remote``, ``remote_fetch``, ``total``."""
        out = {"queue": self.queue_s, "prefill": self.prefill_s}
        for t in TierKind:
            out[f"load_{t.label}"] = self.load_s[int(t)]
        out["remote_fetch"] = self.remote_fetch_s
        out["total"] = self.total_s
        return out


@dataclass(slots=True, frozen=True)
class ErrorStats:
    """Predicted-vs-actual error of the TTFT predictor."""

    reports: int
    """Reports received."""
    ewma_abs_s: float
    """EWMA of |actual - predicted| (seconds)."""
    ewma_rel: float
    """EWMA of |actual - predicted| / actual."""
    ewma_signed_s: float
    """EWMA of actual - predicted: positive = the predictor is optimistic."""
    recent_s: np.ndarray = field(repr=False)
    """The most recent signed errors (actual - predicted), oldest first."""

    def abs_percentile(self, q: float) -> float:
        """``q``-th percentile of recent |error| (nan without reports)."""
        if self.recent_s.size == 0:
            return float("nan")
        return float(np.percentile(np.abs(self.recent_s), q))


def hit_counts(hit_blocks_by_tier: HitCounts | None = None,
               block_tiers: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """Normalize hit blocks to an int64 array of 4 counts indexed by ``TierKind``.

    Give either counts (a ``TierKind -> int`` mapping or a length-4 sequence) or
    ``block_tiers``, one ``TierKind`` value per hit block in chain order (what a
    lookup answers). Raises :class:`InvalidArgument` on negative counts or
    unknown tiers.
    """
    if (hit_blocks_by_tier is None) == (block_tiers is None):
        raise InvalidArgument("give exactly one of hit_blocks_by_tier (counts per tier) and block_tiers")
    if block_tiers is not None:
        arr = np.asarray(block_tiers, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= N_TIERS):
            raise InvalidArgument(f"block_tiers holds an unknown tier value; allowed 0..{N_TIERS - 1} "
                                  f"({', '.join(t.label for t in TierKind)})")
        return np.bincount(arr, minlength=N_TIERS).astype(np.int64)
    out = np.zeros(N_TIERS, dtype=np.int64)
    if isinstance(hit_blocks_by_tier, Mapping):
        for k, v in hit_blocks_by_tier.items():
            try:
                t = TierKind(int(k))
            except (ValueError, TypeError):
                raise InvalidArgument(f"unknown tier {k!r} in hit_blocks_by_tier; allowed: "
                                      f"{', '.join(t.label for t in TierKind)}") from None
            out[int(t)] += int(v)
    else:
        arr = np.asarray(hit_blocks_by_tier, dtype=np.int64).reshape(-1)
        if arr.size != N_TIERS:
            raise InvalidArgument(f"hit_blocks_by_tier must hold {N_TIERS} counts (hbm, dram, ssd, remote), "
                                  f"got {arr.size}")
        out[:] = arr
    if (out < 0).any():
        raise InvalidArgument(f"hit block counts must be >= 0, got {out.tolist()}")
    return out


# ----------------------------------------------------------------- predictor
class TTFTPredictor:
    """Predicts TTFT from queue, load by tier and prefill; learns from reports.

    Not thread-safe: use it from one thread (the daemon's event loop).
    """

    def __init__(self, config: PredictorConfig | None = None, clock: Clock | None = None, *,
                 cost: CostModel | None = None) -> None:
        self.config = config or PredictorConfig()
        self.cost: CostModel | None = None
        """The cluster's cost model: remote terms come from it, and it takes
        its recompute estimate from this predictor (:meth:`attach_cost`)."""
        if clock is None:
            clock = time.monotonic
        self.clock: Clock = clock
        c = self.config
        self._log_tps = math.log(c.prefill_tokens_per_s)
        self._bw = np.array([t.bytes_per_s for t in c.tier_loads], dtype=np.float64)
        self._lat = np.array([t.per_block_s for t in c.tier_loads], dtype=np.float64)
        # queue model: backlog seconds at time _q_t, drained at queue_parallelism s/s
        self._q_backlog = 0.0
        self._q_t = self.clock()
        self._q_reported = False
        self._observed_queue_s = 0.0
        self._observed_queue_n = 0
        # error tracking
        self._err = np.zeros(c.error_window, dtype=np.float64)
        self._err_n = 0
        self._ewma_abs = 0.0
        self._ewma_rel = 0.0
        self._ewma_signed = 0.0
        self.calibrations = 0
        """Reports that moved the throughput estimate."""
        if cost is not None:
            self.attach_cost(cost)

    def attach_cost(self, cost: CostModel, *, share_prefill: bool = True) -> None:
        """Share one model with the cluster's fetch decision: remote loads
        come from ``cost``'s links, and (``share_prefill``) ``cost``'s
        recompute estimate from this predictor's (calibrated) prefill."""
        self.cost = cost
        if share_prefill:
            cost.prefill = self

    # ------------------------------------------------------------- model
    @property
    def prefill_tokens_per_s(self) -> float:
        """The current (calibrated) prefill throughput."""
        return math.exp(self._log_tps)

    def prefill_s(self, uncached_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill ``uncached_tokens`` after ``cached_tokens`` of context."""
        c = self.config
        u = max(int(uncached_tokens), c.min_prefill_tokens)
        return (c.prefill_overhead_s + u / self.prefill_tokens_per_s
                + c.attention_s_per_token2 * u * (cached_tokens + u / 2.0))

    def load_s(self, counts: np.ndarray, block_bytes: int) -> tuple[float, float, float, float]:
        """Seconds to load ``counts[t]`` blocks of ``block_bytes`` from each tier."""
        sec = counts * (block_bytes / self._bw) + counts * self._lat
        return (float(sec[0]), float(sec[1]), float(sec[2]), float(sec[3]))

    def predict(self, n_tokens: int, counts: np.ndarray, block_tokens: int, block_bytes: int,
                queue_wait_s: float | None = None) -> TTFTBreakdown:
        """The breakdown for a request of ``n_tokens`` whose leading hit blocks
        are ``counts`` (4 counts by ``TierKind``; see :func:`hit_counts`).
        ``queue_wait_s`` overrides the queue model. Inputs are trusted here:
        :meth:`AdmissionController.decide` validates them."""
        cached = int(counts.sum()) * block_tokens
        uncached = max(n_tokens - cached, 0)
        q = self.queue_wait_s() if queue_wait_s is None else max(float(queue_wait_s), 0.0)
        pre = self.prefill_s(uncached, cached)
        load = self.load_s(counts, block_bytes)
        n_remote = int(counts[int(TierKind.REMOTE)])
        remote = self.config.remote_fetch_s if n_remote > 0 else 0.0
        if n_remote > 0 and self.cost is not None:
            remote, wire = self.cost.remote_terms(n_remote * block_bytes)
            r = int(TierKind.REMOTE)
            load = tuple(wire if i == r else v for i, v in enumerate(load))  # type: ignore[assignment]
        lsum = float(sum(load)) + remote
        body = max(lsum, pre) if self.config.overlap_load else lsum + pre
        return TTFTBreakdown(queue_s=q, prefill_s=pre, load_s=load, remote_fetch_s=remote,
                             cached_tokens=cached, uncached_tokens=uncached, total_s=q + body)

    # ------------------------------------------------------------- queue
    def report_queue(self, *, queued_tokens: int | None = None, wait_s: float | None = None) -> None:
        """The engine's queue now: tokens waiting for prefill (converted with the
        current throughput) or a wait estimate in seconds. Replaces the backlog;
        later admissions add to it and time drains it."""
        if (queued_tokens is None) == (wait_s is None):
            raise InvalidArgument("report_queue takes exactly one of queued_tokens and wait_s")
        if queued_tokens is not None:
            if queued_tokens < 0:
                raise InvalidArgument(f"queued_tokens must be >= 0, got {queued_tokens}")
            backlog = queued_tokens / self.prefill_tokens_per_s / self.config.queue_parallelism
        else:
            assert wait_s is not None
            check_positive("wait_s", wait_s, allow_zero=True)
            backlog = float(wait_s)
        self._q_t = self.clock()
        self._q_backlog = backlog
        self._q_reported = True

    def note_admitted(self, work_s: float) -> None:
        """Add an admitted request's predicted work to the queue backlog."""
        self._drain()
        self._q_backlog += max(float(work_s), 0.0) / self.config.queue_parallelism

    def _drain(self) -> None:
        now = self.clock()
        dt = max(now - self._q_t, 0.0)
        self._q_backlog = max(self._q_backlog - dt, 0.0)
        self._q_t = now

    def queue_wait_s(self) -> float:
        """The modelled queue wait now: the reported/admitted backlog minus what
        has drained since; before any report or admission, the EWMA of the
        queue waits engines reported with their TTFTs."""
        self._drain()
        if not self._q_reported and self._q_backlog == 0.0 and self._observed_queue_n:
            return self._observed_queue_s
        return self._q_backlog

    @property
    def observed_queue_s(self) -> float:
        """EWMA of the actual queue waits reported with TTFTs."""
        return self._observed_queue_s

    # ------------------------------------------------------------- feedback
    def report(self, predicted_s: float, actual_s: float, uncached_tokens: int, *,
               breakdown: TTFTBreakdown | None = None, actual_queue_s: float | None = None) -> None:
        """An engine's actual TTFT for a request predicted at ``predicted_s``.

        Updates the error figures and, when calibration is on and the request
        computed at least ``calibrate_min_tokens`` tokens, the throughput: the
        implied prefill time is ``actual - (queue + load)``, where the queue is
        ``actual_queue_s`` when the engine measured it and the load comes from
        ``breakdown`` (else the predicted non-prefill part). The implied
        tokens/s is clipped to a bounded step and folded in with an EWMA in
        log space.
        """
        check_positive("actual_s", actual_s, allow_zero=True)
        check_positive("predicted_s", predicted_s, allow_zero=True)
        if uncached_tokens < 0:
            raise InvalidArgument(f"uncached_tokens must be >= 0, got {uncached_tokens}")
        c = self.config
        err = float(actual_s) - float(predicted_s)
        self._err[self._err_n % c.error_window] = err
        a = c.error_alpha if self._err_n else 1.0
        self._err_n += 1
        self._ewma_abs += a * (abs(err) - self._ewma_abs)
        self._ewma_signed += a * (err - self._ewma_signed)
        self._ewma_rel += a * (abs(err) / max(float(actual_s), 1e-9) - self._ewma_rel)
        if actual_queue_s is not None:
            check_positive("actual_queue_s", actual_queue_s, allow_zero=True)
            b = c.error_alpha if self._observed_queue_n else 1.0
            self._observed_queue_s += b * (float(actual_queue_s) - self._observed_queue_s)
            self._observed_queue_n += 1
        if not c.calibrate or uncached_tokens < c.calibrate_min_tokens:
            return
        cached = breakdown.cached_tokens if breakdown is not None else 0
        if breakdown is not None:
            load = breakdown.load_total_s
            queue = breakdown.queue_s if actual_queue_s is None else float(actual_queue_s)
        elif actual_queue_s is not None:  # no breakdown: the load is unknown, taken as 0
            load, queue = 0.0, float(actual_queue_s)
        else:  # no breakdown: everything predicted beyond the prefill is queue + load
            load, queue = 0.0, max(float(predicted_s) - self.prefill_s(uncached_tokens, 0), 0.0)
        if c.overlap_load and breakdown is not None and load >= breakdown.prefill_s:
            return  # the prefill was hidden behind the load: nothing to learn
        implied_pre = float(actual_s) - queue - (0.0 if c.overlap_load else load)
        fixed = c.prefill_overhead_s + c.attention_s_per_token2 * uncached_tokens * (cached + uncached_tokens / 2.0)
        linear = implied_pre - fixed
        step = math.log1p(c.calibrate_max_step)
        if linear <= 0:
            delta = step  # faster than even the fixed parts: move up by the bound
        else:
            delta = min(max(math.log(uncached_tokens / linear) - self._log_tps, -step), step)
        lo, hi = math.log(c.min_tokens_per_s), math.log(c.max_tokens_per_s)
        self._log_tps = min(max(self._log_tps + c.calibrate_alpha * delta, lo), hi)
        self.calibrations += 1

    def error_stats(self) -> ErrorStats:
        """A snapshot of the error figures."""
        n, w = self._err_n, self.config.error_window
        if n <= w:
            recent = self._err[:n].copy()
        else:
            i = n % w
            recent = np.concatenate([self._err[i:], self._err[:i]])
        return ErrorStats(reports=n, ewma_abs_s=self._ewma_abs, ewma_rel=self._ewma_rel,
                          ewma_signed_s=self._ewma_signed, recent_s=recent)
