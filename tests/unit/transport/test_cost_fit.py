"""The cost model learns the fetch path's fixed cost from whole fetches
measured end to end (issue 17), not from the empty probe alone."""

from __future__ import annotations

import pytest

from transport.cost import GBIT, ChainDecision, CostConfig, CostModel

MIB = 1 << 20


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_end_to_end_fetches_fit_the_fixed_cost_and_the_bandwidth() -> None:
    clock = FakeClock()
    m = CostModel(CostConfig(latency_s=50e-6, bandwidth_Bps=100 * GBIT, alpha=0.2), clock=clock)
    m.set_link("p", latency_s=300e-6, seed=True)  # the empty probe: a fast round trip
    for i in range(40):
        clock.t = float(i)
        n = (1, 2, 8, 32)[i % 4] * MIB
        m.observe_fetch("p", n, 0.045 + n / 1.5e9)  # 45 ms of lookup/acquire/commit + 1.5 GB/s
    ln = m.link("p")
    assert ln.latency_s == pytest.approx(0.045, rel=1e-6)
    assert ln.bandwidth_Bps == pytest.approx(1.5e9, rel=1e-6)
    assert ln.fetches == 40 and ln.updated == 39.0
    # a later probe does not undo what real fetches measured
    m.set_link("p", latency_s=300e-6, seed=True)
    assert m.link("p").latency_s == pytest.approx(0.045, rel=1e-6)
    # the short prompt of issue 17's benchmark: recompute is now the faster path
    cfg = CostConfig(latency_s=300e-6, bandwidth_Bps=100 * GBIT, prefill_tokens_per_s=20_000.0, margin=0.1)
    fresh = CostModel(cfg)
    short = fresh.decide("p", 2 * MIB, "m", 512)  # 0.5 ms of wire vs 25.6 ms of prefill
    assert short.decision is ChainDecision.FETCH
    learned = CostModel(cfg)
    for n in (1, 4, 16):
        learned.observe_fetch("p", n * MIB, 0.045 + n * MIB / 1.5e9)
    assert learned.decide("p", 2 * MIB, "m", 512).decision is ChainDecision.RECOMPUTE
    assert learned.decide("p", 64 * MIB, "m", 16384).decision is ChainDecision.FETCH  # long prompts still fetch


def test_one_size_keeps_the_slope_and_puts_the_rest_in_the_fixed_cost() -> None:
    m = CostModel(CostConfig(latency_s=0.0, bandwidth_Bps=1e9, alpha=0.5))
    m.observe_fetch("p", 10_000_000, 0.05)  # 10 ms of wire at the seed's 1 GB/s, 40 ms more
    assert m.link("p").bandwidth_Bps == pytest.approx(1e9)
    assert m.link("p").latency_s == pytest.approx(0.04)
    m.observe_fetch("p", 10_000_000, 0.07)  # weighted mean of 50 and 70 ms (alpha 0.5): 63.3 ms
    assert m.link("p").latency_s == pytest.approx((0.5 * 0.05 + 0.07) / 1.5 - 0.01)


def test_faster_than_the_seed_slope_means_no_fixed_cost() -> None:
    m = CostModel(CostConfig(latency_s=0.0, bandwidth_Bps=1e8))
    m.observe_fetch("p", 10_000_000, 0.01)  # faster than 100 MB/s allows: the seed was pessimistic
    assert m.link("p").latency_s == 0.0
    assert m.link("p").bandwidth_Bps == pytest.approx(1e9)


def test_bad_samples_are_ignored() -> None:
    m = CostModel()
    m.observe_fetch("p", MIB, 0.0)
    m.observe_fetch("p", -1, 0.1)
    assert m.link("p").fetches == 0
