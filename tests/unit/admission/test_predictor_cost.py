"""One predictor for Admit and the cluster's fetch decision (issue 15): the
TTFT predictor and the cost model share their remote and recompute terms."""

from __future__ import annotations

import pytest

from admission import AdmissionConfig, AdmissionController, PredictorConfig, TTFTPredictor
from tiers.base import TierKind
from transport.cost import ChainDecision, CostConfig, CostModel, ModelShape

MIB = 1 << 20


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def shared(tps: float = 10_000.0) -> tuple[AdmissionController, CostModel]:
    clock = FakeClock()
    cost = CostModel(CostConfig(latency_s=0.002, bandwidth_Bps=1e9, prefill_tokens_per_s=123.0, margin=0.0),
                     clock=clock)
    pred = TTFTPredictor(PredictorConfig(prefill_tokens_per_s=tps, calibrate_alpha=1.0), clock, cost=cost)
    return AdmissionController(pred, AdmissionConfig()), cost


def test_a_report_moves_both_admit_and_the_fetch_decision() -> None:
    ctl, cost = shared()
    # recompute of 1000 tokens: the predictor's 10k tok/s (not the cost config's 123 tok/s) -> 100 ms
    assert cost.recompute_s("m", 1000) == pytest.approx(0.1)
    # 32 MiB from a 1 GB/s peer: 2 ms + 33.6 ms -> fetch beats 100 ms of prefill
    before_fetch = cost.decide("p", 32 * MIB, "m", 1000)
    assert before_fetch.decision is ChainDecision.FETCH
    d = ctl.decide("t", 2000, [0, 0, 0, 0], 16, MIB, 10.0)
    before_admit = d.predicted.total_s
    # the engine reports that the 2000-token prefill took 4x longer than predicted
    assert ctl.report(d.decision_id, 4 * before_admit) is not None
    assert ctl.predictor.calibrations == 1
    # the same report slowed Admit's prediction ...
    after_admit = ctl.decide("t", 2000, [0, 0, 0, 0], 16, MIB, 10.0, dry_run=True).predicted.total_s
    assert after_admit > before_admit * 1.2
    # ... and the cluster's recompute estimate, one model for both
    after_fetch = cost.decide("p", 32 * MIB, "m", 1000)
    assert after_fetch.recompute_s > before_fetch.recompute_s * 1.2
    assert after_fetch.recompute_s == pytest.approx(ctl.predictor.prefill_s(1000))


def test_a_report_flips_fetch_versus_recompute() -> None:
    ctl, cost = shared(tps=40_000.0)
    # 1000 tokens recomputed in 25 ms vs 2 ms + 33.6 ms fetched: recompute
    assert cost.decide("p", 32 * MIB, "m", 1000).decision is ChainDecision.RECOMPUTE
    for _ in range(10):  # the engines keep reporting slower prefills than predicted
        d = ctl.decide("t", 4000, [0, 0, 0, 0], 16, MIB, 10.0)
        ctl.report(d.decision_id, 4 * d.predicted.total_s)
    assert cost.decide("p", 32 * MIB, "m", 1000).decision is ChainDecision.FETCH


def test_remote_blocks_in_admit_cost_what_the_cost_model_learned() -> None:
    ctl, cost = shared()
    counts = [0, 0, 0, 4]  # 4 remote blocks of 1 MiB
    p0 = ctl.decide("t", 64, counts, 16, MIB, 10.0, dry_run=True).predicted
    assert p0.remote_fetch_s == pytest.approx(0.002)            # the seed link's fixed cost
    assert p0.load(TierKind.REMOTE) == pytest.approx(4 * MIB / 1e9)
    # real fetches from a peer measure a 45 ms fixed cost end to end
    for n in (1, 4, 16, 64):
        cost.observe_fetch("p", n * MIB, 0.045 + n * MIB / 2e9)
    p1 = ctl.decide("t", 64, counts, 16, MIB, 10.0, dry_run=True).predicted
    assert p1.remote_fetch_s == pytest.approx(0.045, rel=1e-3)
    assert p1.load(TierKind.REMOTE) == pytest.approx(4 * MIB / 2e9, rel=1e-3)
    assert p1.total_s > p0.total_s + 0.04


def test_a_configured_shape_rules_until_the_predictor_has_calibrated() -> None:
    shape = ModelShape(layers=2, hidden=64, heads=4, kv_heads=4, head_dim=16, intermediate=128)
    cost = CostModel(CostConfig(prefill_flops_per_s=1e9), shapes={"m": shape})
    pred = TTFTPredictor(PredictorConfig(prefill_tokens_per_s=10_000.0), FakeClock())
    pred.attach_cost(cost)
    assert cost.recompute_s("m", 100) == pytest.approx(shape.flops(100) / 1e9)
    assert cost.recompute_s("other", 100) == pytest.approx(pred.prefill_s(100))
    pred.report(0.5, 1.0, 1000)
    assert cost.recompute_s("m", 100) == pytest.approx(pred.prefill_s(100))


def test_a_cost_model_attached_without_its_prefill_keeps_its_own_speed() -> None:
    cost = CostModel(CostConfig(prefill_tokens_per_s=10.0))
    pred = TTFTPredictor(PredictorConfig(prefill_tokens_per_s=10_000.0), FakeClock())
    pred.attach_cost(cost, share_prefill=False)
    assert cost.recompute_s("m", 100) == pytest.approx(10.0)
    assert pred.cost is cost
