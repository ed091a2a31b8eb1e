"""Where a request goes, or why it goes nowhere.

For every healthy backend the router predicts the request's TTFT with that
backend's :class:`admission.TTFTPredictor` (the project's one predictor)::

    TTFT(b) = queue wait at b (its in-flight prefills + vLLM's waiting and running requests)
            + load of the blocks b's daemon holds, by tier (bytes / bandwidth + per-block cost)
            + prefill of the tokens b would compute

and ranks the backends by it: the first is used, the next ones are the
retry order. With admission on, a request whose *best* prediction misses its
class's TTFT target is refused at once (429) before any backend sees it
(Mooncake's early rejection), as are requests over their tenant's request or
token rate, and, while another class is below its guaranteed share, requests
of a hit class that is not starved get the tighter target (Preble's
fairness between hit classes: requests grouped by the cached share of their
prompt on the chosen backend).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np

from admission import (ClassFairness, Decision, DecisionKind, HitClass, RateLimit, TenantRateLimiter, TokenBucket,
                       hit_class)
from router.backends import Backend
from router.config import RouterConfig, RoutingPolicy, TenantQuota

__all__ = ["Candidate", "Decider", "Plan", "RejectReason", "Rejection"]

FAIRNESS_HEADROOM = 0.1
"""How much tighter a non-starved class's target gets while another class is starved."""


class RejectReason(Enum):
    """Why a request was refused (metric label)."""

    SLO = "slo"
    FAIRNESS = "fairness"
    RATE_LIMITED = "rate_limited"
    TOKEN_QUOTA = "token_quota"
    TOKEN_BURST = "token_burst"
    """The prompt is longer than its tenant's token burst: it can never be admitted (HTTP 400)."""
    NO_BACKEND = "no_backend"


@dataclass(slots=True, frozen=True)
class Candidate:
    """One backend's prediction for the request."""

    backend: Backend
    decision: Decision
    """The predictor's dry-run decision (its ``predicted`` breakdown)."""
    block_tiers: np.ndarray
    """Tier of each leading block that backend holds."""
    running: float = 0.0
    """Requests decoding there when the prediction was made."""

    @property
    def predicted_s(self) -> float:
        return self.decision.predicted_s

    def hit_tokens_by_tier(self, block_size: int) -> np.ndarray:
        return np.bincount(self.block_tiers, minlength=4)[:4] * block_size


@dataclass(slots=True, frozen=True)
class Plan:
    """Backends in the order to try them."""

    candidates: tuple[Candidate, ...]
    target_s: float
    extra_headers: tuple[tuple[str, str], ...] = ()
    """Response headers to add (the P/D step's, router/pd.py)."""


@dataclass(slots=True, frozen=True)
class Rejection:
    reason: RejectReason
    message: str
    retry_after_s: float
    predicted_s: float = math.nan


Clock = Callable[[], float]


class Decider:
    """Ranks backends and applies admission, quotas and fairness."""

    def __init__(self, cfg: RouterConfig, clock: Clock = time.monotonic, *, max_prompt_tokens: int = 0) -> None:
        self.cfg = cfg
        self.clock = clock
        self.max_prompt_tokens = max_prompt_tokens
        """The longest prompt a model takes: the least default token burst (a prompt spends all its tokens)."""
        per_req: dict[str, RateLimit | None] = {}
        self._token_quota: dict[str, TenantQuota] = {}
        for t in cfg.tenants:
            per_req[t.name] = self._rate(t)
            self._token_quota[t.name] = t
        self.rate = TenantRateLimiter(self._rate(cfg.default_tenant_quota), clock, per_req)
        self._tokens: dict[str, TokenBucket | None] = {}
        share = cfg.hit_class_share
        self.fairness = (ClassFairness(clock, dict.fromkeys(HitClass, share), window_s=10.0, min_samples=10)
                         if share > 0 else None)
        self._targets = {c.name: c.ttft_slo for c in cfg.classes}
        self._turn = 0

    @staticmethod
    def _rate(q: TenantQuota) -> RateLimit | None:
        if q.requests_per_s <= 0:
            return None
        return RateLimit(q.requests_per_s, max(q.request_burst or q.requests_per_s, 1.0))

    def _token_bucket(self, tenant: str) -> TokenBucket | None:
        if tenant in self._tokens:
            return self._tokens[tenant]
        q = self._token_quota.get(tenant, self.cfg.default_tenant_quota)
        b = None
        if q.tokens_per_s > 0:
            burst = q.token_burst or max(q.tokens_per_s, float(self.max_prompt_tokens))
            b = TokenBucket(q.tokens_per_s, max(burst, 1.0), self.clock)
        self._tokens[tenant] = b
        return b

    # ------------------------------------------------------------ predict
    def candidates(self, backends: Sequence[Backend], tiers: Sequence[np.ndarray], n_tokens: int,
                   block_size: int, block_bytes: int, target_s: float, tenant: str) -> list[Candidate]:
        """Every backend's prediction, best first."""
        now = self.clock()
        out = []
        for b, bt in zip(backends, tiers):
            q = b.queue_wait_s(now)
            d = b.controller.decide(tenant, n_tokens, None, block_size, block_bytes, target_s, block_tiers=bt,
                                    queue_wait_s=q, dry_run=True)
            out.append(Candidate(b, d, bt, b.running_now()))
        policy = self.cfg.policy
        if policy is RoutingPolicy.COST:
            out.sort(key=lambda c: (c.predicted_s, -len(c.block_tiers), c.backend.name))
        elif policy is RoutingPolicy.PREFIX:
            out.sort(key=lambda c: (-len(c.block_tiers), len(c.backend.inflight), c.backend.name))
        else:
            out.sort(key=lambda c: c.backend.name)
            self._turn += 1
            k = self._turn % len(out)
            out = out[k:] + out[:k]
        return out

    def decide(self, tenant: str, klass: str, backends: Sequence[Backend], tiers: Sequence[np.ndarray],
               n_tokens: int, block_size: int, block_bytes: int) -> Plan | Rejection:
        """The plan for a request, or why it is refused."""
        target = self._targets.get(klass, self.cfg.classes[0].ttft_slo)
        if not backends:
            return Rejection(RejectReason.NO_BACKEND, "no backend is available", self.cfg.health_interval)
        cands = self.candidates(backends, tiers, n_tokens, block_size, block_bytes, target, tenant)
        best = min(c.predicted_s for c in cands) if self.cfg.policy is RoutingPolicy.COST else cands[0].predicted_s
        fair = self.fairness
        limit = target * (1.0 - self.cfg.headroom)
        tightened = False
        hc = hit_class(min(len(cands[0].block_tiers) * block_size / n_tokens, 1.0) if n_tokens else 0.0)
        if fair is not None:
            fair.note_arrival(hc)
            if not fair.is_starved(hc) and fair.any_starved(exclude=hc):
                limit = target * max(1.0 - self.cfg.headroom - FAIRNESS_HEADROOM, 0.0)
                tightened = True
        if self.cfg.admission and best > limit:
            reason = RejectReason.FAIRNESS if tightened and best <= target * (1.0 - self.cfg.headroom) \
                else RejectReason.SLO
            bd = cands[0].decision.predicted
            msg = (f"predicted time to first token {best * 1e3:.0f} ms on the best backend "
                   f"({cands[0].backend.name}: queue {bd.queue_s * 1e3:.0f} ms, load {bd.load_total_s * 1e3:.0f} ms, "
                   f"prefill {bd.prefill_s * 1e3:.0f} ms of {bd.uncached_tokens} tokens) misses the "
                   f"{klass!r} target of {limit * 1e3:.0f} ms")
            return Rejection(reason, msg, max(best - limit, bd.queue_s, 0.1), best)
        wait = self.rate.peek(tenant)
        if wait > 0:
            self.rate.limited[tenant] += 1
            return Rejection(RejectReason.RATE_LIMITED, f"tenant {tenant!r} is over its request rate", wait, best)
        tb = self._token_bucket(tenant)
        if tb is not None:
            if n_tokens > tb.burst:  # never fits: charging only the burst would let long prompts past the rate
                return Rejection(RejectReason.TOKEN_BURST, f"the prompt's {n_tokens} tokens exceed tenant "
                                 f"{tenant!r}'s prompt-token burst of {tb.burst:.0f}", 0.0, best)
            tw = tb.acquire(float(n_tokens))
            if tw > 0:  # refused: no request token is spent either
                return Rejection(RejectReason.TOKEN_QUOTA, f"tenant {tenant!r} is over its prompt-token rate",
                                 tw, best)
        self.rate.acquire(tenant)  # there since the peek (time only adds tokens)
        if fair is not None:
            fair.note_grant(hc)
        return Plan(tuple(cands), target)

    def admitted(self, c: Candidate, tenant: str, n_tokens: int, block_size: int, block_bytes: int,
                 ) -> int:
        """Record the chosen backend's decision (already admitted here: the
        target is not checked again); the id to report the measured TTFT with."""
        d = c.backend.controller.decide(tenant, n_tokens, None, block_size, block_bytes, 1e9,
                                        block_tiers=c.block_tiers, queue_wait_s=c.decision.predicted.queue_s)
        return d.decision_id if d.kind is not DecisionKind.REJECT else 0
