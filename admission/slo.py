"""SLO-aware early admission (issue 7).

Pure decision code: no I/O, no threads, no gRPC. Every answer is computed from
in-memory state, so a storm of ``Admit`` calls costs only arithmetic. The TTFT
model lives in :mod:`admission.predictor` (its names are re-exported here).

:class:`AdmissionController` turns a prediction into a :class:`Decision`:
``ADMIT`` when the request meets its TTFT target using every cached block,
``ADMIT_DEGRADED`` when it misses it that way but meets it when the blocks of
slow tiers (SSD, remote) are recomputed instead of waited for, ``REJECT``
otherwise, before any prefill work is spent on a request that cannot make it
(Mooncake's prediction-based early rejection). Each decision carries a
:class:`ReasonCode` (a ``StrEnum``: its values are the labels on the wire and
in metrics). Optional collaborators from :mod:`admission.quota`: a per-tenant
rate limiter and Preble-style class fairness.
"""

from __future__ import annotations

import collections
import itertools
import math
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Collection, Hashable, Sequence

import numpy as np

from admission.predictor import (DEFAULT_TIER_LOADS, N_TIERS, Clock, ErrorStats, HitCounts, PredictorConfig,
                                 TierLoad, TTFTBreakdown, TTFTPredictor, check_positive, hit_counts)
from admission.quota import ClassFairness, TenantRateLimiter, hit_class
from kvstore.errors import InvalidArgument
from tiers.base import TierKind

__all__ = [
    "AdmissionConfig", "AdmissionController", "AdmissionStats", "Decision", "DecisionKind", "ReasonCode",
    # re-exported from admission.predictor
    "Clock", "DEFAULT_TIER_LOADS", "ErrorStats", "HitCounts", "PredictorConfig", "TTFTBreakdown",
    "TTFTPredictor", "TierLoad", "hit_counts",
]


# ----------------------------------------------------------------- decisions
class DecisionKind(IntEnum):
    """What :meth:`AdmissionController.decide` answers."""

    ADMIT = 0
    """Meets the target using every cached block."""
    ADMIT_DEGRADED = 1
    """Meets the target only by recomputing the blocks of slow tiers
    (``Decision.use_blocks`` leading blocks are used, the rest recomputed)."""
    REJECT = 2
    """Cannot meet the target (or the tenant is over its rate): do no work."""

    @property
    def label(self) -> str:
        return self.name.lower()



class ReasonCode(StrEnum):
    """Why :meth:`AdmissionController.decide` answered what it did: a
    low-cardinality label (its value goes on the wire as ``reason_code`` and
    into the ``reason`` metric label)."""

    OK = "ok"
    """Admitted using every cached block."""
    SKIP_HBM = "skip_hbm"
    """Admitted degraded: recomputing from the first HBM block (a configured degrade plan)."""
    SKIP_DRAM = "skip_dram"
    """Admitted degraded: recomputing from the first DRAM block (a configured degrade plan)."""
    SKIP_SSD = "skip_ssd"
    """Admitted degraded: the SSD (and remote) blocks are recomputed."""
    SKIP_REMOTE = "skip_remote"
    """Admitted degraded: the remote blocks are recomputed."""
    SLO = "slo"
    """Rejected: no plan meets the target."""
    FAIRNESS = "fairness"
    """Rejected: a plan met the target, but not the one tightened while another class is starved."""
    RATE_LIMITED = "rate_limited"
    """Rejected: the tenant is over its request rate."""

    @classmethod
    def skip(cls, tier: TierKind) -> ReasonCode:
        """The code of a degraded plan that recomputes from the first block in ``tier``."""
        return cls(f"skip_{tier.label}")

@dataclass(slots=True, frozen=True)
class Decision:
    """One admission decision and why."""

    kind: DecisionKind
    reason: str
    """Human-readable: the numbers behind the decision."""
    reason_code: ReasonCode
    """Low-cardinality label for metrics (a ``StrEnum``: compares equal to its
    value, ``"ok"``, ``"skip_ssd"``, ``"skip_remote"``, ``"slo"``, ...)."""
    predicted: TTFTBreakdown
    """The chosen plan's prediction (for REJECT: the best plan's)."""
    full: TTFTBreakdown
    """The prediction using every cached block (equal to ``predicted`` unless degraded)."""
    target_s: float
    tenant: str
    klass: Hashable
    """Fairness class of the request (a :class:`admission.quota.HitClass` by default)."""
    hit_blocks: int
    """Leading hit blocks the request came with."""
    use_blocks: int
    """Leading hit blocks the plan loads; ``hit_blocks - use_blocks`` are recomputed."""
    starved: bool = False
    """The class is below its guaranteed share: an engine should serve it first."""
    retry_after_s: float = 0.0
    """For a rate-limited REJECT: when the tenant's bucket has a token again."""
    decision_id: int = 0
    """Pass back with the actual TTFT (:meth:`AdmissionController.report`); 0 for REJECT."""

    @property
    def admitted(self) -> bool:
        return self.kind is not DecisionKind.REJECT

    @property
    def predicted_s(self) -> float:
        return self.predicted.total_s

    @property
    def recompute_blocks(self) -> int:
        return self.hit_blocks - self.use_blocks


@dataclass(slots=True, frozen=True)
class AdmissionConfig:
    """Knobs of :class:`AdmissionController`."""

    headroom: float = 0.0
    """Admit only when predicted TTFT <= target * (1 - headroom), in [0, 1)."""
    degrade_tiers: tuple[tuple[TierKind, ...], ...] = ((TierKind.SSD, TierKind.REMOTE), (TierKind.REMOTE,))
    """Degraded plans to try, each a set of tiers not waited for: the chain is
    used up to its first block in one of them and recomputed from there."""
    fairness_headroom: float = 0.1
    """While another fairness class is starved, a class that is not must meet
    target * (1 - headroom - fairness_headroom): capacity is left for the starved."""
    decision_memory: int = 4096
    """Admitted decisions remembered for :meth:`AdmissionController.report`."""
    tenants: frozenset[str] | None = None
    """Known tenants; None accepts any. An unknown tenant is InvalidArgument."""

    def __post_init__(self) -> None:
        for name in ("headroom", "fairness_headroom"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0.0 <= v < 1.0):
                raise InvalidArgument(f"{name} must be in [0, 1), got {v!r}")
        if self.headroom + self.fairness_headroom >= 1.0:
            raise InvalidArgument("headroom + fairness_headroom must be < 1")
        if self.decision_memory < 1:
            raise InvalidArgument(f"decision_memory must be >= 1, got {self.decision_memory}")
        for plan in self.degrade_tiers:
            if not plan or not all(isinstance(t, TierKind) for t in plan):
                raise InvalidArgument("degrade_tiers must be non-empty tuples of TierKind")


@dataclass(slots=True, frozen=True)
class AdmissionStats:
    """Counters of :class:`AdmissionController` (a snapshot)."""

    decisions: dict[tuple[str, str], int]
    """(tenant, kind label) -> count."""
    reasons: dict[ReasonCode, int]
    """reason_code -> count (the keys compare and hash equal to their string values)."""
    prefill_tokens_per_s: float
    queue_wait_s: float
    errors: ErrorStats
    unknown_reports: int
    """Reports whose decision id was unknown or already forgotten."""


class AdmissionController:
    """Decides ADMIT / ADMIT_DEGRADED / REJECT from a :class:`TTFTPredictor`.

    Not thread-safe: use it from one thread (the daemon's event loop).
    """

    def __init__(self, predictor: TTFTPredictor | None = None, config: AdmissionConfig | None = None, *,
                 rate_limiter: TenantRateLimiter | None = None, fairness: ClassFairness | None = None) -> None:
        self.predictor = predictor or TTFTPredictor()
        self.config = config or AdmissionConfig()
        self.rate_limiter = rate_limiter
        self.fairness = fairness
        self._ids = itertools.count(1)
        self._recent: collections.OrderedDict[int, TTFTBreakdown] = collections.OrderedDict()
        self._decisions: collections.Counter[tuple[str, str]] = collections.Counter()
        self._reasons: collections.Counter[ReasonCode] = collections.Counter()
        self._unknown_reports = 0

    # ------------------------------------------------------------- validation
    def _validate(self, tenant: str, n_tokens: int, counts: np.ndarray, block_tokens: int, block_bytes: int,
                  ttft_target_s: float, queue_wait_s: float | None) -> None:
        tenants: Collection[str] | None = self.config.tenants
        if tenants is not None and tenant not in tenants:
            raise InvalidArgument(f"unknown tenant {tenant!r}: not in the admission tenant registry")
        try:
            target = float(ttft_target_s)
        except (TypeError, ValueError):
            target = math.nan
        if not (math.isfinite(target) and target > 0):
            raise InvalidArgument(f"ttft_target_s must be > 0 seconds, got {ttft_target_s!r}")
        if block_tokens <= 0:
            raise InvalidArgument(f"block_tokens must be > 0, got {block_tokens}")
        if block_bytes < 0:
            raise InvalidArgument(f"block_bytes must be >= 0, got {block_bytes}")
        if n_tokens < 0:
            raise InvalidArgument(f"n_tokens must be >= 0, got {n_tokens}")
        hit = int(counts.sum())
        if hit * block_tokens > n_tokens:
            raise InvalidArgument(f"n_tokens={n_tokens} is smaller than the {hit} hit blocks x {block_tokens} "
                                  f"tokens = {hit * block_tokens} they imply")
        if queue_wait_s is not None:
            check_positive("queue_wait_s", queue_wait_s, allow_zero=True)

    # ------------------------------------------------------------- decide
    def decide(self, tenant: str, n_tokens: int, hit_blocks_by_tier: HitCounts | None, block_tokens: int,
               block_bytes: int, ttft_target_s: float, *, block_tiers: Sequence[int] | np.ndarray | None = None,
               queue_wait_s: float | None = None, klass: Hashable | None = None,
               dry_run: bool = False) -> Decision:
        """Decide whether a request can meet ``ttft_target_s``.

        ``hit_blocks_by_tier``: hit blocks per tier (see :func:`hit_counts`),
        assumed hottest tier first along the chain; or pass ``None`` and
        ``block_tiers``, the tier of each hit block in chain order (exact).
        ``queue_wait_s`` overrides the predictor's queue model. ``klass`` is the
        fairness class (default: the hit-ratio class). ``dry_run`` computes the
        decision without counting it, taking rate tokens or updating fairness
        (a router comparing placements).

        Raises :class:`InvalidArgument` for a target <= 0, an unknown tenant
        (with a registry), or ``n_tokens`` smaller than the hit blocks imply.
        """
        counts = hit_counts(hit_blocks_by_tier, block_tiers)
        self._validate(tenant, n_tokens, counts, block_tokens, block_bytes, ttft_target_s, queue_wait_s)
        p = self.predictor
        hit = int(counts.sum())
        full = p.predict(n_tokens, counts, block_tokens, block_bytes, queue_wait_s)
        if klass is None:
            klass = hit_class(full.cached_tokens / n_tokens if n_tokens else 0.0)
        fair = self.fairness
        starved = False
        tight = self.config.headroom
        if fair is not None:
            if not dry_run:
                fair.note_arrival(klass)
            starved = fair.is_starved(klass)
            if not starved and fair.any_starved(exclude=klass):
                tight += self.config.fairness_headroom
        limit = ttft_target_s * (1.0 - tight)

        # candidate plans: (breakdown, use_blocks, code)
        plans: list[tuple[TTFTBreakdown, int, ReasonCode]] = [(full, hit, ReasonCode.OK)]
        order = None if block_tiers is None else np.asarray(block_tiers, dtype=np.int64).reshape(-1)
        for skip in self.config.degrade_tiers:
            skip_vals = np.array([int(t) for t in skip], dtype=np.int64)
            if not counts[skip_vals].any():
                continue
            if order is not None:
                bad = np.flatnonzero(np.isin(order, skip_vals))
                use = int(bad[0]) if bad.size else hit
                c2 = np.bincount(order[:use], minlength=N_TIERS).astype(np.int64)
            else:  # counts only: assume the chain runs hottest tier first
                first_bad = min(int(t) for t in skip)
                c2 = counts.copy()
                c2[first_bad:] = 0
                use = int(c2.sum())
            if use == hit:
                continue
            code = ReasonCode.skip(min(skip))
            plans.append((p.predict(n_tokens, c2, block_tokens, block_bytes, full.queue_s), use, code))

        best = min(plans, key=lambda x: x[0].total_s)
        kind: DecisionKind
        if full.total_s <= limit:
            kind, chosen, use, code = DecisionKind.ADMIT, full, hit, ReasonCode.OK
            reason = f"predicted {_ms(full.total_s)} <= target {_ms(limit)}"
        elif best[0].total_s <= limit:
            kind, (chosen, use, code) = DecisionKind.ADMIT_DEGRADED, best
            reason = (f"predicted {_ms(full.total_s)} using all {hit} hit blocks misses {_ms(limit)}; "
                      f"{_ms(chosen.total_s)} when the last {hit - use} are recomputed ({code})")
        else:
            kind, chosen, use = DecisionKind.REJECT, best[0], best[1]
            code = ReasonCode.SLO
            reason = (f"predicted {_ms(chosen.total_s)} (queue {_ms(chosen.queue_s)}, load "
                      f"{_ms(chosen.load_total_s)}, prefill {_ms(chosen.prefill_s)} of {chosen.uncached_tokens} "
                      f"tokens) > target {_ms(limit)}")
            if best[0].total_s <= ttft_target_s * (1.0 - self.config.headroom) and tight > self.config.headroom:
                code = ReasonCode.FAIRNESS
                reason += " (tightened while another class is starved)"
        retry = 0.0
        if kind is not DecisionKind.REJECT and self.rate_limiter is not None:
            retry = self.rate_limiter.peek(tenant) if dry_run else self.rate_limiter.acquire(tenant)
            if retry > 0.0:
                kind, code = DecisionKind.REJECT, ReasonCode.RATE_LIMITED
                reason = f"tenant {tenant!r} is over its request rate; retry in {_ms(retry)}"
        did = 0
        if not dry_run:
            self._decisions[(tenant, kind.label)] += 1
            self._reasons[code] += 1
            if kind is not DecisionKind.REJECT:
                did = next(self._ids)
                self._recent[did] = chosen
                while len(self._recent) > self.config.decision_memory:
                    self._recent.popitem(last=False)
                p.note_admitted(chosen.total_s - chosen.queue_s)
                if fair is not None:
                    fair.note_grant(klass)
        return Decision(kind=kind, reason=reason, reason_code=code, predicted=chosen, full=full,
                        target_s=float(ttft_target_s), tenant=tenant, klass=klass, hit_blocks=hit,
                        use_blocks=use, starved=starved, retry_after_s=retry, decision_id=did)

    # ------------------------------------------------------------- feedback
    def report(self, decision_id: int, actual_s: float, *, actual_queue_s: float | None = None) -> float | None:
        """The actual TTFT of an admitted request. Returns the signed error
        ``actual - predicted`` (for an error histogram), or None (counted in
        ``unknown_reports``) when the decision id is unknown or was forgotten
        (only ``decision_memory`` are kept); :meth:`report_raw` can then still
        carry the prediction the engine kept."""
        bd = self._recent.pop(decision_id, None)
        if bd is None:
            self._unknown_reports += 1
            return None
        self.predictor.report(bd.total_s, actual_s, bd.uncached_tokens, breakdown=bd,
                              actual_queue_s=actual_queue_s)
        return float(actual_s) - bd.total_s

    def report_raw(self, predicted_s: float, actual_s: float, uncached_tokens: int, *,
                   actual_queue_s: float | None = None) -> float:
        """A report without a decision id (the engine kept the prediction);
        returns the signed error."""
        self.predictor.report(predicted_s, actual_s, uncached_tokens, actual_queue_s=actual_queue_s)
        return float(actual_s) - float(predicted_s)

    def predicted_of(self, decision_id: int) -> TTFTBreakdown | None:
        """The breakdown of a remembered admitted decision (not consumed)."""
        return self._recent.get(decision_id)

    def stats(self) -> AdmissionStats:
        """Counters for metrics and ``kvstore stats``."""
        return AdmissionStats(decisions=dict(self._decisions), reasons=dict(self._reasons),
                              prefill_tokens_per_s=self.predictor.prefill_tokens_per_s,
                              queue_wait_s=self.predictor.queue_wait_s(), errors=self.predictor.error_stats(),
                              unknown_reports=self._unknown_reports)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
