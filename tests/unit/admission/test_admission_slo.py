"""TTFT predictor and admission decisions (issue 7), with a fake clock."""

from __future__ import annotations

import math

import numpy as np
import pytest

from admission import (AdmissionConfig, AdmissionController, ClassFairness, DecisionKind, PredictorConfig,
                       RateLimit, ReasonCode, TenantRateLimiter, TierLoad, TTFTPredictor, hit_counts)
from kvstore.errors import InvalidArgument
from tiers.base import TierKind

MIB = 1 << 20


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


LOADS = (TierLoad(1e12, 0.0), TierLoad(10e9, 0.0), TierLoad(1e9, 100e-6), TierLoad(5e9, 20e-6))


def cfg(**kw: object) -> PredictorConfig:
    base: dict[str, object] = dict(prefill_tokens_per_s=10_000.0, prefill_overhead_s=0.005, tier_loads=LOADS,
                                   remote_fetch_s=0.001)
    base.update(kw)
    return PredictorConfig(**base)  # type: ignore[arg-type]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(100.0)


# ------------------------------------------------------------------ predictor
def test_breakdown_adds_queue_load_by_tier_and_prefill(clock: FakeClock) -> None:
    p = TTFTPredictor(cfg(attention_s_per_token2=1e-9), clock)
    counts = hit_counts({TierKind.HBM: 2, TierKind.DRAM: 10, TierKind.SSD: 5, TierKind.REMOTE: 3})
    bd = p.predict(1000, counts, 16, 2 * MIB, queue_wait_s=0.05)
    assert bd.cached_tokens == 20 * 16 and bd.uncached_tokens == 1000 - 320
    assert bd.queue_s == 0.05
    assert bd.load(TierKind.HBM) == pytest.approx(2 * 2 * MIB / 1e12)
    assert bd.load(TierKind.DRAM) == pytest.approx(10 * 2 * MIB / 10e9)
    assert bd.load(TierKind.SSD) == pytest.approx(5 * 2 * MIB / 1e9 + 5 * 100e-6)
    assert bd.load(TierKind.REMOTE) == pytest.approx(3 * 2 * MIB / 5e9 + 3 * 20e-6)
    assert bd.remote_fetch_s == 0.001
    u, c = 680, 320
    assert bd.prefill_s == pytest.approx(0.005 + u / 10_000 + 1e-9 * u * (c + u / 2))
    assert bd.total_s == pytest.approx(bd.queue_s + bd.load_total_s + bd.prefill_s)
    parts = bd.parts()
    assert parts["load_ssd"] == bd.load(TierKind.SSD) and parts["total"] == bd.total_s


def test_overlap_load_takes_the_larger_part(clock: FakeClock) -> None:
    p = TTFTPredictor(cfg(overlap_load=True), clock)
    bd = p.predict(1000, hit_counts([0, 10, 0, 0]), 16, 2 * MIB, queue_wait_s=0.0)
    assert bd.total_s == pytest.approx(max(bd.load_total_s, bd.prefill_s))


def test_full_hit_still_computes_min_prefill_tokens(clock: FakeClock) -> None:
    p = TTFTPredictor(cfg(min_prefill_tokens=1, prefill_overhead_s=0.0), clock)
    bd = p.predict(160, hit_counts([10, 0, 0, 0]), 16, MIB, queue_wait_s=0.0)
    assert bd.uncached_tokens == 0 and bd.prefill_s == pytest.approx(1 / 10_000)


def test_hit_counts_forms_agree_and_validate() -> None:
    a = hit_counts({TierKind.DRAM: 3, TierKind.SSD: 2})
    b = hit_counts([0, 3, 2, 0])
    c = hit_counts(None, block_tiers=[1, 2, 1, 2, 1])
    assert a.tolist() == b.tolist() == c.tolist() == [0, 3, 2, 0]
    with pytest.raises(InvalidArgument, match="exactly one"):
        hit_counts(None, None)
    with pytest.raises(InvalidArgument, match="exactly one"):
        hit_counts([0, 0, 0, 0], [1])
    with pytest.raises(InvalidArgument, match="unknown tier"):
        hit_counts({7: 1})
    with pytest.raises(InvalidArgument, match="unknown tier"):
        hit_counts(None, block_tiers=[0, 9])
    with pytest.raises(InvalidArgument, match=">= 0"):
        hit_counts([0, -1, 0, 0])
    with pytest.raises(InvalidArgument, match="4 counts"):
        hit_counts([1, 2])


def test_config_validation_names_the_field() -> None:
    with pytest.raises(InvalidArgument, match="prefill_tokens_per_s"):
        PredictorConfig(prefill_tokens_per_s=0)
    with pytest.raises(InvalidArgument, match="calibrate_alpha"):
        PredictorConfig(calibrate_alpha=1.5)
    with pytest.raises(InvalidArgument, match="bytes_per_s"):
        TierLoad(0.0)
    with pytest.raises(InvalidArgument, match="headroom"):
        AdmissionConfig(headroom=1.0)


# ------------------------------------------------------------------ queue model
def test_queue_model_drains_and_accumulates(clock: FakeClock) -> None:
    p = TTFTPredictor(cfg(), clock)
    assert p.queue_wait_s() == 0.0
    p.report_queue(wait_s=0.5)
    clock.advance(0.2)
    assert p.queue_wait_s() == pytest.approx(0.3)
    p.note_admitted(0.1)
    assert p.queue_wait_s() == pytest.approx(0.4)
    clock.advance(1.0)
    assert p.queue_wait_s() == 0.0
    p.report_queue(queued_tokens=20_000)  # 2 s at 10k tokens/s
    assert p.queue_wait_s() == pytest.approx(2.0)
    with pytest.raises(InvalidArgument, match="exactly one"):
        p.report_queue()
    with pytest.raises(InvalidArgument):
        p.report_queue(queued_tokens=-1)


def test_observed_queue_is_used_before_any_queue_report(clock: FakeClock) -> None:
    p = TTFTPredictor(cfg(error_alpha=1.0), clock)
    p.report(0.1, 0.3, 10, actual_queue_s=0.2)
    assert p.observed_queue_s == pytest.approx(0.2)
    assert p.queue_wait_s() == pytest.approx(0.2)


# ------------------------------------------------------------------ decisions
def test_admit_and_reject_on_the_target(clock: FakeClock) -> None:
    ctl = AdmissionController(TTFTPredictor(cfg(), clock))
    d = ctl.decide("t", 1000, {TierKind.DRAM: 50}, 16, MIB, 0.5, queue_wait_s=0.0)
    assert d.kind is DecisionKind.ADMIT and d.admitted and d.decision_id > 0
    assert d.use_blocks == d.hit_blocks == 50 and d.reason_code == "ok"
    # the same request behind a 1 s queue cannot make 0.5 s: rejected before any work
    r = ctl.decide("t", 1000, {TierKind.DRAM: 50}, 16, MIB, 0.5, queue_wait_s=1.0)
    assert r.kind is DecisionKind.REJECT and not r.admitted and r.decision_id == 0
    assert r.reason_code == "slo" and "queue 1000.0 ms" in r.reason and "> target 500.0 ms" in r.reason
    assert r.predicted_s == pytest.approx(1.0 + d.predicted.total_s)


def test_queue_backlog_from_admissions_leads_to_early_rejection(clock: FakeClock) -> None:
    ctl = AdmissionController(TTFTPredictor(cfg(), clock))
    kinds = [ctl.decide("t", 2000, None, 16, MIB, 0.5, block_tiers=[]).kind for _ in range(5)]  # 0.205 s each
    assert kinds[:2] == [DecisionKind.ADMIT] * 2 and kinds[2:] == [DecisionKind.REJECT] * 3
    clock.advance(0.5)  # the backlog drained
    assert ctl.decide("t", 2000, None, 16, MIB, 0.5, block_tiers=[]).kind is DecisionKind.ADMIT


def test_degraded_when_recomputing_ssd_blocks_beats_waiting(clock: FakeClock) -> None:
    # 200 SSD blocks of 8 MiB at 1 GB/s = 1.7 s to load; recomputing 3,200 tokens = 0.33 s
    ctl = AdmissionController(TTFTPredictor(cfg(), clock))
    d = ctl.decide("t", 5000, {TierKind.DRAM: 100, TierKind.SSD: 200}, 16, 8 * MIB, 0.6, queue_wait_s=0.0)
    assert d.kind is DecisionKind.ADMIT_DEGRADED and d.reason_code == "skip_ssd"
    assert d.reason_code is ReasonCode.SKIP_SSD
    assert d.use_blocks == 100 and d.recompute_blocks == 200
    assert d.predicted.load(TierKind.SSD) == 0.0 and d.full.load(TierKind.SSD) > 1.0
    assert d.predicted.total_s < 0.6 < d.full.total_s
    assert d.predicted.uncached_tokens == 5000 - 1600


def test_degraded_plan_follows_exact_block_order(clock: FakeClock) -> None:
    ctl = AdmissionController(TTFTPredictor(cfg(), clock))
    tiers = [1] * 10 + [2] * 150 + [1] * 40  # an SSD stretch in the middle of the chain
    d = ctl.decide("t", 4000, None, 16, 8 * MIB, 0.6, block_tiers=tiers, queue_wait_s=0.0)
    assert d.kind is DecisionKind.ADMIT_DEGRADED and d.use_blocks == 10
    assert d.predicted.cached_tokens == 160 and d.predicted.load(TierKind.DRAM) > 0


def test_full_plan_preferred_when_it_meets_the_target(clock: FakeClock) -> None:
    ctl = AdmissionController(TTFTPredictor(cfg(), clock))
    d = ctl.decide("t", 5000, {TierKind.SSD: 10}, 16, MIB, 2.0, queue_wait_s=0.0)
    assert d.kind is DecisionKind.ADMIT and d.use_blocks == 10


def test_reject_reports_the_best_plan(clock: FakeClock) -> None:
    ctl = AdmissionController(TTFTPredictor(cfg(), clock))
    d = ctl.decide("t", 5000, {TierKind.DRAM: 100, TierKind.SSD: 200}, 16, 8 * MIB, 0.1, queue_wait_s=0.0)
    assert d.kind is DecisionKind.REJECT
    assert d.predicted.total_s < d.full.total_s and d.use_blocks == 100


def test_headroom_tightens_the_target(clock: FakeClock) -> None:
    p = TTFTPredictor(cfg(), clock)
    base = p.predict(1000, hit_counts([0, 0, 0, 0]), 16, 0, 0.0).total_s
    loose = AdmissionController(p, AdmissionConfig(headroom=0.0))
    tight = AdmissionController(p, AdmissionConfig(headroom=0.2))
    target = base / 0.9
    assert loose.decide("t", 1000, None, 16, 0, target, block_tiers=[], queue_wait_s=0.0).admitted
    assert not tight.decide("t", 1000, None, 16, 0, target, block_tiers=[], queue_wait_s=0.0).admitted


@pytest.mark.parametrize("target", [0.0, -1.0, math.nan, math.inf])
def test_bad_target_is_invalid_argument(clock: FakeClock, target: float) -> None:
    ctl = AdmissionController(TTFTPredictor(cfg(), clock))
    with pytest.raises(InvalidArgument, match="ttft_target_s must be > 0"):
        ctl.decide("t", 100, {TierKind.DRAM: 1}, 16, MIB, target)


def test_token_count_smaller_than_blocks_is_invalid_argument(clock: FakeClock) -> None:
    ctl = AdmissionController(TTFTPredictor(cfg(), clock))
    with pytest.raises(InvalidArgument, match=r"n_tokens=100 is smaller than the 10 hit blocks x 16 tokens = 160"):
        ctl.decide("t", 100, {TierKind.DRAM: 10}, 16, MIB, 1.0)
    with pytest.raises(InvalidArgument, match="block_tokens"):
        ctl.decide("t", 100, {TierKind.DRAM: 1}, 0, MIB, 1.0)


def test_unknown_tenant_with_a_registry(clock: FakeClock) -> None:
    ctl = AdmissionController(TTFTPredictor(cfg(), clock), AdmissionConfig(tenants=frozenset({"a", "b"})))
    assert ctl.decide("a", 100, None, 16, 0, 1.0, block_tiers=[]).admitted
    with pytest.raises(InvalidArgument, match="unknown tenant 'z'"):
        ctl.decide("z", 100, None, 16, 0, 1.0, block_tiers=[])
    # without a registry any tenant is fine
    assert AdmissionController(TTFTPredictor(cfg(), clock)).decide("z", 100, None, 16, 0, 1.0,
                                                                    block_tiers=[]).admitted


def test_dry_run_changes_nothing(clock: FakeClock) -> None:
    p = TTFTPredictor(cfg(), clock)
    lim = TenantRateLimiter(RateLimit(1.0, 1.0), clock)
    ctl = AdmissionController(p, rate_limiter=lim)
    for _ in range(3):
        d = ctl.decide("t", 2000, None, 16, 0, 1.0, block_tiers=[], dry_run=True)
        assert d.admitted and d.decision_id == 0
    assert ctl.stats().decisions == {} and p.queue_wait_s() == 0.0
    assert ctl.decide("t", 2000, None, 16, 0, 1.0, block_tiers=[]).admitted


def test_rate_limited_tenant_is_rejected_with_retry_after(clock: FakeClock) -> None:
    lim = TenantRateLimiter(RateLimit(rate_per_s=2.0, burst=2.0), clock)
    ctl = AdmissionController(TTFTPredictor(cfg(), clock), rate_limiter=lim)
    args = dict(block_tiers=[], queue_wait_s=0.0)
    assert ctl.decide("t", 100, None, 16, 0, 1.0, **args).admitted  # type: ignore[arg-type]
    assert ctl.decide("t", 100, None, 16, 0, 1.0, **args).admitted  # type: ignore[arg-type]
    # an SLO rejection does not spend a token
    assert ctl.decide("t", 100, None, 16, 0, 1e-6, **args).reason_code == "slo"  # type: ignore[arg-type]
    d = ctl.decide("t", 100, None, 16, 0, 1.0, **args)  # type: ignore[arg-type]
    assert d.kind is DecisionKind.REJECT and d.reason_code == "rate_limited"
    assert d.retry_after_s == pytest.approx(0.5)
    assert ctl.decide("u", 100, None, 16, 0, 1.0, **args).admitted  # type: ignore[arg-type]
    clock.advance(0.5)
    assert ctl.decide("t", 100, None, 16, 0, 1.0, **args).admitted  # type: ignore[arg-type]
    s = ctl.stats()
    assert s.decisions[("t", "reject")] == 2 and s.decisions[("t", "admit")] == 3
    assert s.reasons["rate_limited"] == 1 and s.reasons["slo"] == 1
    assert s.reasons[ReasonCode.RATE_LIMITED] == 1 and s.reasons[ReasonCode.SLO] == 1


def test_reason_codes_keep_their_wire_values() -> None:
    # the values are what the Admit RPC carries as reason_code and metrics use as a label
    assert {c.value for c in ReasonCode} == {"ok", "skip_hbm", "skip_dram", "skip_ssd", "skip_remote", "slo",
                                             "fairness", "rate_limited"}
    assert all(c == c.value and str(c) == c.value and f"{c}" == c.value for c in ReasonCode)
    assert ReasonCode.skip(TierKind.SSD) is ReasonCode.SKIP_SSD
    assert ReasonCode.skip(TierKind.REMOTE) is ReasonCode.SKIP_REMOTE
    assert {ReasonCode.skip(t) for t in TierKind} <= set(ReasonCode)


def test_a_configured_degrade_plan_for_dram_has_its_code(clock: FakeClock) -> None:
    # a plan that recomputes from the first DRAM block (not in the default plans)
    config = AdmissionConfig(degrade_tiers=((TierKind.DRAM, TierKind.SSD, TierKind.REMOTE),))
    ctl = AdmissionController(TTFTPredictor(cfg(), clock), config)
    d = ctl.decide("t", 5000, {TierKind.DRAM: 100, TierKind.SSD: 200}, 16, 8 * MIB, 0.6, queue_wait_s=0.0)
    assert d.kind is DecisionKind.ADMIT_DEGRADED and d.reason_code is ReasonCode.SKIP_DRAM
    assert d.use_blocks == 0 and d.recompute_blocks == 300


def test_fairness_tightens_classes_over_share_while_another_is_starved(clock: FakeClock) -> None:
    fair = ClassFairness(clock, {"hot": 0.5, "rare": 0.5}, window_s=10.0, min_samples=5)
    ctl = AdmissionController(TTFTPredictor(cfg(), clock), AdmissionConfig(fairness_headroom=0.3), fairness=fair)
    # "rare" asks but is never granted (its requests miss), "hot" is admitted
    for _ in range(10):
        ctl.decide("t", 100, None, 16, 0, 1.0, block_tiers=[], queue_wait_s=0.0, klass="hot")
        ctl.decide("t", 100, None, 16, 0, 1e-4, block_tiers=[], queue_wait_s=0.0, klass="rare")
    assert fair.is_starved("rare") and not fair.is_starved("hot")
    # a hot request predicted at 80% of its target: admitted normally, rejected while "rare" starves
    pre = ctl.predictor.prefill_s(100, 0)
    d = ctl.decide("t", 100, None, 16, 0, pre / 0.8, block_tiers=[], queue_wait_s=0.0, klass="hot")
    assert d.kind is DecisionKind.REJECT and d.reason_code == "fairness"
    r = ctl.decide("t", 100, None, 16, 0, pre / 0.8, block_tiers=[], queue_wait_s=0.0, klass="rare")
    assert r.admitted and r.starved


def test_default_class_is_the_hit_class(clock: FakeClock) -> None:
    from admission import HitClass

    ctl = AdmissionController(TTFTPredictor(cfg(), clock))
    assert ctl.decide("t", 1600, {TierKind.DRAM: 95}, 16, 0, 9.0).klass is HitClass.HIGH
    assert ctl.decide("t", 1600, {TierKind.DRAM: 10}, 16, 0, 9.0).klass is HitClass.LOW
    assert ctl.decide("t", 1600, None, 16, 0, 9.0, block_tiers=[]).klass is HitClass.NONE


# ------------------------------------------------------------------ feedback
def true_ttft(tokens: int, tps: float, overhead: float = 0.005) -> float:
    return overhead + tokens / tps


def test_calibration_converges_on_reported_ttfts(clock: FakeClock) -> None:
    """The predictor starts 2.5x optimistic; engines report actual TTFTs with
    5% noise; the throughput estimate converges to the truth and the error
    shrinks."""
    rng = np.random.default_rng(1)
    p = TTFTPredictor(cfg(prefill_tokens_per_s=20_000.0, calibrate_alpha=0.05, error_alpha=0.05), clock)
    ctl = AdmissionController(p)
    truth = 8_000.0
    first_errs = []
    for i in range(600):
        n = int(rng.integers(200, 4000))
        d = ctl.decide("t", n, None, 16, 0, 100.0, block_tiers=[], queue_wait_s=0.0)
        actual = true_ttft(n, truth) * float(rng.lognormal(0, 0.05))
        if i < 20:
            first_errs.append(abs(actual - d.predicted_s) / actual)
        assert ctl.report(d.decision_id, actual, actual_queue_s=0.0) is not None
        clock.advance(0.01)
    assert p.prefill_tokens_per_s == pytest.approx(truth, rel=0.05)
    st = p.error_stats()
    assert st.reports == 600 and st.ewma_rel < 0.08 < float(np.mean(first_errs))
    assert abs(st.ewma_signed_s) < 0.02
    assert st.recent_s.size == 600 and st.abs_percentile(50) < 0.05


def test_calibration_step_is_bounded_and_small_requests_are_ignored(clock: FakeClock) -> None:
    p = TTFTPredictor(cfg(calibrate_alpha=0.1, calibrate_max_step=0.25, calibrate_min_tokens=32), clock)
    tps0 = p.prefill_tokens_per_s
    p.report(0.1, 100.0, 1000)  # a wild outlier: 1000x slower
    assert p.prefill_tokens_per_s == pytest.approx(tps0 * math.exp(-0.1 * math.log(1.25)))
    tps1 = p.prefill_tokens_per_s
    p.report(0.006, 5.0, 10)  # too few tokens to say anything about throughput
    assert p.prefill_tokens_per_s == tps1
    p.report(0.1, 0.0, 1000)  # faster than the fixed parts: one bounded step up
    assert p.prefill_tokens_per_s == pytest.approx(tps1 * math.exp(0.1 * math.log(1.25)))
    assert p.calibrations == 2


def test_calibration_uses_the_measured_queue(clock: FakeClock) -> None:
    p = TTFTPredictor(cfg(calibrate_alpha=1.0, calibrate_max_step=10.0), clock)
    bd = p.predict(2000, hit_counts([0, 0, 0, 0]), 16, 0, queue_wait_s=0.1)
    # actual: a 0.3 s queue (not the predicted 0.1) and 2000 tokens at 5k tokens/s
    p.report(bd.total_s, 0.3 + 0.005 + 2000 / 5000, 2000, breakdown=bd, actual_queue_s=0.3)
    assert p.prefill_tokens_per_s == pytest.approx(5000.0)


def test_report_of_unknown_decision(clock: FakeClock) -> None:
    ctl = AdmissionController(TTFTPredictor(cfg(), clock), AdmissionConfig(decision_memory=2))
    ids = [ctl.decide("t", 100, None, 16, 0, 9.0, block_tiers=[]).decision_id for _ in range(3)]
    assert ctl.report(ids[0], 0.1) is None  # forgotten: only 2 kept
    pred = ctl.predicted_of(ids[2])
    assert pred is not None and ctl.report(ids[2], 0.1) == pytest.approx(0.1 - pred.total_s)
    assert ctl.report(ids[2], 0.1) is None  # reported once
    assert ctl.report(12345, 0.1) is None
    assert ctl.stats().unknown_reports == 3
    assert ctl.report_raw(0.1, 0.25, 100) == pytest.approx(0.15)
    assert ctl.stats().errors.reports == 2


def test_error_window_keeps_recent_errors_in_order(clock: FakeClock) -> None:
    p = TTFTPredictor(cfg(error_window=4, calibrate=False), clock)
    for i in range(6):
        p.report(1.0, 1.0 + i, 100)
    assert p.error_stats().recent_s.tolist() == [2.0, 3.0, 4.0, 5.0]
    with pytest.raises(InvalidArgument):
        p.report(1.0, -1.0, 100)
