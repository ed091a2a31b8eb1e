"""The transfer-vs-recompute cost model, on the worked numbers of
shared/seeds/003 section 3 and on its own arithmetic."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgument
from transport.cost import (GBIT, ChainDecision, CostConfig, CostModel, ModelShape, PrefillTable,
                            shapes_from_toml)

RANK_BYTES = 250e6           # 2 GB of KV for 4000 tokens of a 70B model, over TP8
PCIE_S = 3e-3                # "about 3 ms" into HBM
H2D = RANK_BYTES / PCIE_S    # the PCIe bandwidth that makes it so
SEED_PREFILL = {4000: 0.014}  # 14 ms local prefill of 4000 tokens (FlashAttention-3, TP8)


def seed_model(gbps: float, latency_s: float = 3e-3, margin: float = 0.1) -> CostModel:
    m = CostModel(CostConfig(latency_s=latency_s, bandwidth_Bps=gbps * GBIT, h2d_bandwidth_Bps=H2D, margin=margin),
                  tables={"llama-70b": PrefillTable.of(SEED_PREFILL)})
    return m


def test_wire_time_of_250MB_over_400Gbps_is_5ms():
    m = seed_model(400, latency_s=0.0)
    assert m.transfer_s("peer", RANK_BYTES) == pytest.approx(5e-3)


@pytest.mark.parametrize("overhead_s", [3e-3, 5e-3, 7e-3])
def test_end_to_end_8_to_12ms_plus_pcie(overhead_s):
    m = seed_model(400, latency_s=overhead_s)
    net = m.transfer_s("peer", RANK_BYTES)
    assert 8e-3 <= net <= 12e-3
    assert m.transfer_s("peer", RANK_BYTES, to_hbm=True) == pytest.approx(net + PCIE_S)


def test_400Gbps_fetches_against_a_14ms_prefill():
    m = seed_model(400)
    e = m.decide("peer", int(RANK_BYTES), "llama-70b", 4000, 0, to_hbm=True)
    assert e.recompute_s == pytest.approx(0.014)
    assert e.transfer_s == pytest.approx(0.011)  # 3 + 5 + 3 ms
    assert e.decision is ChainDecision.FETCH


def test_100Gbps_recomputes():
    m = seed_model(100)
    e = m.decide("peer", int(RANK_BYTES), "llama-70b", 4000, 0, to_hbm=True)
    assert e.transfer_s == pytest.approx(0.026)  # 3 + 20 + 3 ms
    assert e.decision is ChainDecision.RECOMPUTE


def test_margin_decides_the_close_call():
    # 12 ms of transfer against 14 ms of prefill: fetch at a 10% margin, not at 20%
    assert seed_model(400, latency_s=4e-3, margin=0.1).decide(
        "p", int(RANK_BYTES), "llama-70b", 4000, to_hbm=True).decision is ChainDecision.FETCH
    assert seed_model(400, latency_s=4e-3, margin=0.2).decide(
        "p", int(RANK_BYTES), "llama-70b", 4000, to_hbm=True).decision is ChainDecision.RECOMPUTE


def test_shorter_prefix_tips_toward_recompute():
    # "when the prefix is shorter than 4000 tokens" the fixed overheads dominate
    m = seed_model(400)
    e = m.decide("p", int(RANK_BYTES / 8), "llama-70b", 500, to_hbm=True)
    assert e.decision is ChainDecision.RECOMPUTE


LLAMA70B = ModelShape(layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, intermediate=28672, tp_size=8)


def test_model_shape_flops_and_kv_bytes():
    # ~70B weights in the linear layers (embeddings aside)
    assert LLAMA70B.params == pytest.approx(68.7e9, rel=0.01)
    assert LLAMA70B.kv_bytes_per_token(2) * 8 == 2 * 80 * 8 * 128 * 2
    f0 = LLAMA70B.flops(4000, 0)
    assert f0 == pytest.approx((2 * LLAMA70B.params * 4000 + 80 * 4 * 64 * 128 * 4000 * 2000.5) / 8)  # causal: n(n+1)/2 pairs
    # the same tokens after a long context cost more (attention over it)
    assert LLAMA70B.flops(1000, 3000) > LLAMA70B.flops(1000, 0)


def test_shape_calibrated_to_the_seed_reproduces_14ms_and_scales():
    m = CostModel(CostConfig(), shapes={"llama-70b": LLAMA70B})
    m.calibrate_flops("llama-70b", 4000, 0.014)
    assert m.recompute_s("llama-70b", 4000) == pytest.approx(0.014)
    assert m.recompute_s("llama-70b", 2000) < 0.007  # linear part halves, attention quarters
    # the last 1000 of 4000 tokens cost more than the first 1000
    assert m.recompute_s("llama-70b", 1000, 3000) > m.recompute_s("llama-70b", 1000, 0)


def test_prefill_table_interpolates_and_extrapolates():
    t = PrefillTable.of({1000: 0.004, 4000: 0.014})
    assert t.seconds_for(2500) == pytest.approx(0.009)
    assert t.seconds_for(8000) == pytest.approx(0.028)
    assert t.seconds_for(500) == pytest.approx(0.002)
    m = CostModel(tables={"m": t})
    assert m.recompute_s("m", 3000, 1000) == pytest.approx(0.010)  # 14 ms - 4 ms
    with pytest.raises(ValueError):
        PrefillTable((10, 5), (1.0, 2.0))


def test_tokens_per_second_fallback_for_unknown_models():
    m = CostModel(CostConfig(prefill_tokens_per_s=1000, prefill_overhead_s=0.001))
    assert m.recompute_s("unknown", 500) == pytest.approx(0.501)
    assert m.recompute_s("unknown", 0) == 0.0


def test_ewma_follows_measured_transfers():
    t = [0.0]
    m = CostModel(CostConfig(latency_s=1e-3, bandwidth_Bps=1e9, alpha=0.5), clock=lambda: t[0])
    # a small transfer measures latency
    m.observe("p", 100, 3e-3)
    assert m.link("p").latency_s == pytest.approx(2e-3)
    # large ones: bandwidth from their seconds less the latency
    for _ in range(30):
        m.observe("p", 100_000_000, 2e-3 + 0.025)  # 4 GB/s
    assert m.link("p").bandwidth_Bps == pytest.approx(4e9, rel=1e-3)
    assert m.link("p").samples == 31
    # a slower link flips a decision the old figure made
    m2 = CostModel(CostConfig(latency_s=0, bandwidth_Bps=10e9, prefill_tokens_per_s=1000, margin=0))
    assert m2.decide("p", 10_000_000, "x", 10).decision is ChainDecision.FETCH   # 1 ms vs 10 ms
    for _ in range(40):
        m2.observe("p", 10_000_000, 0.05)  # 200 MB/s measured
    assert m2.decide("p", 10_000_000, "x", 10).decision is ChainDecision.RECOMPUTE


def test_no_peer_or_nothing_missing_is_local():
    m = CostModel()
    assert m.decide(None, 0, "x", 100).decision is ChainDecision.LOCAL
    assert m.decide("p", 0, "x", 0).decision is ChainDecision.LOCAL


def test_best_peer_is_the_cheapest_link():
    m = CostModel()
    m.set_link("slow", bandwidth_Bps=1e8)
    m.set_link("fast", bandwidth_Bps=1e10)
    assert m.best_peer(["slow", "fast"], 1e6) == "fast"
    assert m.best_peer([], 1e6) is None


def test_models_file():
    shapes, tables = shapes_from_toml({"model": {
        "llama-70b": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "head_dim": 128,
                      "intermediate": 28672, "tp_size": 8, "prefill": {"4000": 0.014}},
        "tiny": {"prefill": {"128": 0.001}}}})
    assert shapes["llama-70b"] == LLAMA70B and "tiny" not in shapes
    assert tables["tiny"].seconds_for(256) == pytest.approx(0.002)
    with pytest.raises(ValueError, match="layers"):
        shapes_from_toml({"model": {"bad": {"layers": 0, "hidden": 1, "heads": 1, "kv_heads": 1,
                                            "head_dim": 1, "intermediate": 1}}})
    with pytest.raises(ValueError, match="bogus"):
        shapes_from_toml({"model": {"bad": {"bogus": 1}}})


def test_config_validation():
    with pytest.raises(ValueError):
        CostConfig(bandwidth_Bps=0)
    with pytest.raises(ValueError):
        CostConfig(alpha=0)
    with pytest.raises(ValueError):
        CostConfig(margin=-1)


def test_worked_example_table_matches_the_seed():
    from transport.cost import seed_worked_example

    rows = {r[0]: r for r in seed_worked_example()}
    assert rows["400 Gb/s"][1] == pytest.approx(5.0) and rows["400 Gb/s"][4] == "fetch"
    assert rows["400 Gb/s"][2] == pytest.approx(11.0)
    assert rows["100 Gb/s"][1] == pytest.approx(20.0) and rows["100 Gb/s"][4] == "recompute"
    assert all(r[3] == pytest.approx(14.0) for r in rows.values())


def test_one_slow_transfer_corrects_an_optimistic_seed():
    m = CostModel(CostConfig(latency_s=0.0, bandwidth_Bps=100 * GBIT, alpha=0.2))
    m.observe("p", 8 << 20, 0.040)  # 8 MiB in 40 ms: ~210 MB/s
    # seconds-per-byte average: 0.8 * 1/12.5e9 + 0.2 * 0.04/8MiB -> about 1 GB/s, not 10 GB/s
    assert m.link("p").bandwidth_Bps < 1.1e9


def test_a_suspect_link_is_recomputed_until_cleared_and_its_probe_is_due_after_the_backoff():
    now = [0.0]
    m = CostModel(CostConfig(latency_s=1e-3, bandwidth_Bps=100 * GBIT, prefill_tokens_per_s=1000.0, backoff_s=5.0),
                  clock=lambda: now[0])
    assert m.decide("p", 1 << 20, "x", 1000).decision is ChainDecision.FETCH
    m.mark_suspect("p")
    assert m.suspect("p") and not m.probe_due("p")
    assert m.decide("p", 1 << 20, "x", 1000).decision is ChainDecision.RECOMPUTE
    assert m.remote_terms(1 << 20) == (1e-3, (1 << 20) / (100 * GBIT))  # the configured seed, not the suspect link
    now[0] = 5.0
    assert m.probe_due("p") and m.suspect("p")  # still a miss until a probe answers
    assert m.decide("p", 1 << 20, "x", 1000).decision is ChainDecision.RECOMPUTE
    m.clear_suspect("p")
    assert not m.suspect("p") and not m.probe_due("p")
    assert m.decide("p", 1 << 20, "x", 1000).decision is ChainDecision.FETCH
    off = CostModel(CostConfig(backoff_s=0.0))
    off.mark_suspect("p")
    assert not off.suspect("p")
    with pytest.raises(InvalidArgument):
        CostConfig(backoff_s=-1.0)
