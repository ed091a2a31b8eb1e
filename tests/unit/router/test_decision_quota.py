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


def test_a_long_prompt_spends_all_its_tokens_so_the_token_rate_holds() -> None:
    """A prompt longer than the bucket's burst was charged only the burst: a
    tenant at 100 tokens/s sending a 400-token prompt every second got 400
    tokens/s through. The default burst is the longest prompt a model takes
    (docs/router.md), each prompt spends all its tokens, and a prompt longer
    than an explicit burst can never fit: 400 at once, not a 429 to retry."""
    now = [0.0]
    cfg = RouterConfig(backends=(BackendSpec("a", "http://a.invalid"),), admission=False,
                       tenants=(TenantQuota("t", tokens_per_s=100), TenantQuota("s", tokens_per_s=100,
                                                                                token_burst=300)))
    pool = Pool(cfg, None, follow_events=False)  # type: ignore[arg-type]
    d = Decider(cfg, clock=lambda: now[0], max_prompt_tokens=600)
    b, tiers = pool.backends, [np.zeros(0, np.int64)]
    admitted = 0
    for t in range(10):
        now[0] = float(t)
        admitted += isinstance(d.decide("t", "default", b, tiers, 400, BS, 1024), Plan)
    assert admitted * 400 <= 100 * 10 + 600  # the rate over 10 s plus one burst
    assert admitted >= 1
    r = d.decide("s", "default", b, tiers, 400, BS, 1024)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TOKEN_BURST
    assert isinstance(d.decide("s", "default", b, tiers, 300, BS, 1024), Plan)
