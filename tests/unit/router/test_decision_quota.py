"""The router's Decider (router/decision.py) with a fake clock: quotas."""

from __future__ import annotations

import numpy as np

from router.backends import Pool
from router.config import BackendSpec, RouterConfig, TenantQuota
from router.decision import Decider, Plan, Rejection, RejectReason

BS = 16


def test_a_request_refused_for_tokens_does_not_spend_a_request_token() -> None:
    """Refused over its prompt-token rate, a request has not been served: it
    must not also eat one of the tenant's request-rate tokens (else the
    tenant's request budget drains by refusals and a later request, within
    both rates, is refused as rate limited)."""
    now = [0.0]
    cfg = RouterConfig(backends=(BackendSpec("a", "http://a.invalid"),), admission=False,
                       tenants=(TenantQuota("t", requests_per_s=0.001, request_burst=2,
                                            tokens_per_s=100, token_burst=100),))
    pool = Pool(cfg, None, follow_events=False)  # type: ignore[arg-type]  (no health checks here)
    d = Decider(cfg, clock=lambda: now[0])
    b, tiers = pool.backends, [np.zeros(0, np.int64)]

    def ask() -> Plan | Rejection:
        return d.decide("t", "default", b, tiers, 100, BS, 1024)

    assert isinstance(ask(), Plan)  # request tokens 2 -> 1, prompt tokens 100 -> 0
    r = ask()
    assert isinstance(r, Rejection) and r.reason is RejectReason.TOKEN_QUOTA
    now[0] = 10.0  # prompt tokens are back; request tokens barely move (0.001/s)
    assert isinstance(ask(), Plan), "the token-quota refusal spent the tenant's last request token"
    r = ask()
    assert isinstance(r, Rejection) and r.reason is RejectReason.RATE_LIMITED
