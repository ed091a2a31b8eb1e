"""Tenant shares, rate limits and class fairness (issue 7), with a fake clock."""

from __future__ import annotations

import math

import numpy as np
import pytest

from admission import (ClassFairness, HitClass, RateLimit, TenantRateLimiter, TenantShares, TokenBucket, hit_class,
                       over_share_mask, victim_mask, victim_order)
from kvstore.errors import InvalidArgument
from tiers.base import TierKind


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


# ------------------------------------------------------------------ capacity shares
def test_victim_mask_marks_candidates_of_over_share_tenants() -> None:
    usage = np.array([30, 80, 0])
    shares = np.array([0.5, 0.5, 0.0])
    cand = np.array([0, 1, 1, 2, 0])
    assert over_share_mask(usage, 100, shares).tolist() == [False, True, False]
    assert victim_mask(cand, usage, 100, shares).tolist() == [False, True, True, False, False]
    assert victim_mask(np.zeros(0, np.int64), usage, 100, shares).size == 0


def test_victim_mask_validates_its_arrays() -> None:
    with pytest.raises(InvalidArgument, match="one entry per tenant"):
        victim_mask(np.array([0]), np.array([1, 2]), 10, np.array([0.5]))
    with pytest.raises(InvalidArgument, match=r"tenant ids must be in \[0, 2\)"):
        victim_mask(np.array([0, 2]), np.array([1, 2]), 10, np.array([0.5, 0.5]))
    with pytest.raises(InvalidArgument, match="integers"):
        victim_mask(np.array([0.5]), np.array([1, 2]), 10, np.array([0.5, 0.5]))
    with pytest.raises(InvalidArgument, match="capacity"):
        victim_mask(np.array([0]), np.array([1, 2]), -1, np.array([0.5, 0.5]))


def run_store(capacity: int, shares: np.ndarray | None, script: list[tuple[int, int]]) -> np.ndarray:
    """A tier of ``capacity`` one-byte blocks with LRU eviction, as the store
    would drive it: each insert of a full tier evicts one victim, preferring
    candidates that ``victim_mask`` marks. Returns the owner of each block kept."""
    owner: list[int] = []
    last: list[int] = []
    clock = 0
    for tenant, count in script:
        for _ in range(count):
            clock += 1
            if len(owner) == capacity:
                tid = np.array(owner)
                rank = np.array(last)
                cand = np.arange(len(owner))
                if shares is not None:
                    usage = np.bincount(tid, minlength=shares.size)
                    m = victim_mask(tid, usage, capacity, shares)
                    if m.any():
                        cand = cand[m]
                v = int(cand[np.argmin(rank[cand])])
                owner.pop(v)
                last.pop(v)
            owner.append(tenant)
            last.append(clock)
    return np.array(owner)


def test_burst_of_tenant_b_leaves_tenant_a_within_its_share_untouched() -> None:
    # A writes 40 blocks first (the oldest: plain LRU would evict them first),
    # then B bursts 500 blocks into a 100-block tier; shares 50/50
    script = [(0, 40), (1, 500)]
    kept = run_store(100, np.array([0.5, 0.5]), script)
    assert (kept == 0).sum() == 40 and (kept == 1).sum() == 60
    plain = run_store(100, None, script)
    assert (plain == 0).sum() == 0  # without shares B's burst wipes A out


def test_tenant_over_its_share_loses_blocks_to_a_tenant_within_its_share() -> None:
    # B filled the tier while A was idle (shares are not caps); then A writes:
    # A's new blocks evict B's, down to B's share, never A's own
    kept = run_store(100, np.array([0.5, 0.5]), [(1, 100), (0, 50)])
    assert (kept == 0).sum() == 50 and (kept == 1).sum() == 50
    # past its share A is the one over: it recycles its own blocks and B keeps its share
    kept = run_store(100, np.array([0.5, 0.5]), [(1, 100), (0, 70)])
    assert (kept == 0).sum() == 51 and (kept == 1).sum() == 49  # at 50/50 nobody is over: one LRU pick


def test_victim_order_prefers_over_share_blocks_up_to_the_overage() -> None:
    # tenant 1 is 30 bytes over; its three candidates are 20 bytes each:
    # only the two lowest-ranked are needed to cover the overage
    tid = np.array([0, 1, 1, 0, 1])
    rank = np.array([1.0, 5.0, 3.0, 2.0, 4.0])
    sizes = np.array([20, 20, 20, 20, 20])
    usage = np.array([40, 80])
    shares = np.array([0.5, 0.5])
    order = victim_order(tid, rank, usage, 100, shares, sizes)
    assert order.tolist() == [2, 4, 0, 3, 1]
    assert victim_order(tid, rank, usage, 100, shares).tolist() == [2, 4, 1, 0, 3]
    with pytest.raises(InvalidArgument, match="rank"):
        victim_order(tid, rank[:2], usage, 100, shares)


def test_tenant_shares_per_tier_and_hints() -> None:
    s = TenantShares({"a": 0.6, "b": 0.3}, default=0.1, per_tier={TierKind.SSD: {"a": 0.2, "b": 0.8}})
    assert s.share("a") == 0.6 and s.share("zz") == 0.1 and s.share("a", TierKind.SSD) == 0.2
    assert s.share("a", TierKind.DRAM) == 0.6
    assert s.array(["a", "b", "c"]).tolist() == [0.6, 0.3, 0.1]
    usage = {"a": 50, "b": 40, "c": 20}
    assert s.over_share(usage, 100) == {"b", "c"}
    assert s.eviction_order_hint(usage, 100) == ["b", "c"]  # both 10 over: the name breaks the tie
    assert s.eviction_order_hint({"a": 50, "b": 45, "c": 11}, 100) == ["b", "c"]
    assert s.over_share(usage, 100, TierKind.SSD) == {"a", "c"}
    r = s.usage_ratio(usage, 100)
    assert r["a"] == pytest.approx(50 / 60) and r["b"] == pytest.approx(40 / 30)
    assert TenantShares({}, default=0.0).usage_ratio({"x": 1, "y": 0}, 10) == {"x": math.inf, "y": 0.0}
    assert TenantShares({}, default=1.0).over_share({"x": 100}, 100) == set()


def test_tenant_shares_validation() -> None:
    with pytest.raises(InvalidArgument, match="sum to 1.100"):
        TenantShares({"a": 0.6, "b": 0.5})
    with pytest.raises(InvalidArgument, match="share of tenant 'a'"):
        TenantShares({"a": 1.5})
    with pytest.raises(InvalidArgument, match="default share"):
        TenantShares({}, default=-0.1)
    with pytest.raises(InvalidArgument, match="TierKind"):
        TenantShares({}, per_tier={"ssd": {"a": 0.1}})  # type: ignore[dict-item]


# ------------------------------------------------------------------ rate limits
def test_token_bucket_burst_refill_and_wait() -> None:
    c = FakeClock()
    b = TokenBucket(rate_per_s=10.0, burst=3.0, clock=c)
    assert [b.try_take() for _ in range(4)] == [True, True, True, False]
    assert b.peek() == pytest.approx(0.1)
    assert b.acquire(2) == pytest.approx(0.2)  # nothing taken
    c.advance(0.1)
    assert b.try_take() and not b.try_take()
    c.advance(10.0)
    assert b.tokens == 3.0  # capped at burst
    c.t -= 5.0  # a clock that steps back never mints tokens
    assert b.tokens == 3.0
    with pytest.raises(InvalidArgument, match="burst"):
        b.peek(4)
    with pytest.raises(InvalidArgument, match="rate_per_s"):
        TokenBucket(0.0, 1.0, c)
    empty = TokenBucket(1.0, 1.0, c, start_full=False)
    assert empty.peek() == pytest.approx(1.0)


def test_tenant_rate_limiter_defaults_overrides_and_bound() -> None:
    c = FakeClock()
    lim = TenantRateLimiter(RateLimit(1.0, 1.0), c, per_tenant={"vip": RateLimit(100.0, 50.0), "free": None},
                            max_tenants=2)
    assert lim.acquire("x") == 0.0 and lim.acquire("x") == pytest.approx(1.0)
    assert all(lim.acquire("vip") == 0.0 for _ in range(50))
    assert all(lim.acquire("free") == 0.0 for _ in range(1000))
    assert lim.limited["x"] == 1 and lim.peek("x") == pytest.approx(1.0)
    lim.acquire("y")  # a third bucket: the least recently used one is dropped
    assert len(lim._buckets) == 2
    with pytest.raises(InvalidArgument):
        RateLimit(1.0, 0.5)


# ------------------------------------------------------------------ class fairness
def test_hit_class_buckets() -> None:
    assert hit_class(0.0) is HitClass.NONE and hit_class(0.049) is HitClass.NONE
    assert hit_class(0.05) is HitClass.LOW and hit_class(0.5) is HitClass.MEDIUM
    assert hit_class(0.95) is HitClass.HIGH and hit_class(1.0) is HitClass.HIGH
    assert hit_class(0.3, edges=(0.1, 0.2, 0.3)) is HitClass.HIGH
    with pytest.raises(InvalidArgument):
        hit_class(1.5)


def test_hot_class_cannot_starve_a_low_hit_class() -> None:
    """A queue where HIGH-hit requests arrive 9x as often as NONE-hit ones.
    FIFO-with-longest-prefix-first (the hot prefix first) would never serve
    NONE while HIGH keeps arriving; ``pick`` gives NONE its guaranteed share."""
    c = FakeClock()
    fair = ClassFairness(c, {HitClass.HIGH: 0.5, HitClass.NONE: 0.3}, window_s=10.0, min_samples=0)
    queue: list[HitClass] = []
    served: list[HitClass] = []
    for step in range(2000):
        for _ in range(9):
            queue.append(HitClass.HIGH)
            fair.note_arrival(HitClass.HIGH)
        queue.append(HitClass.NONE)
        fair.note_arrival(HitClass.NONE)
        for _ in range(2):  # capacity: 2 of the 10 arrivals per step
            i = fair.pick(queue)
            served.append(queue.pop(i))
            fair.note_grant(served[-1])
        if len(queue) > 100:  # bounded queue: drop the oldest (rejected)
            del queue[:len(queue) - 100]
        c.advance(0.01)
    tail = served[-1000:]
    # NONE is 10% of the arrivals and gets its 30% quota of an overloaded queue
    assert tail.count(HitClass.NONE) / len(tail) == pytest.approx(0.3, abs=0.03)
    assert not fair.is_starved(HitClass.NONE)


def test_guarantee_is_capped_by_demand_and_pick_prefers_under_quota() -> None:
    c = FakeClock()
    fair = ClassFairness(c, {"a": 0.5, "b": 0.5}, window_s=10.0, min_samples=4)
    for _ in range(9):
        fair.note_arrival("a")
        fair.note_grant("a")
    fair.note_arrival("b")
    # b asked for 10% of the requests and got none: starved; a is over its quota
    assert fair.deficit("b") == pytest.approx(0.1) and fair.is_starved("b")
    assert fair.quota_gap("a") < 0 < fair.quota_gap("b")
    assert fair.any_starved() and not fair.any_starved(exclude="b")
    assert fair.pick(["a", "a", "b", "a"]) == 2
    fair.note_grant("b")
    assert not fair.is_starved("b")  # 1 of 10 grants = its demand
    assert fair.pick(["a", "b"]) == 1  # still under its 50% quota: served first
    assert fair.pick(["a", "a"]) == 0
    snap = fair.snapshot()
    assert snap["a"][:2] == (9, 9) and snap["b"][:2] == (1, 1)


def test_fairness_window_slides() -> None:
    c = FakeClock()
    fair = ClassFairness(c, {"a": 0.5, "b": 0.5}, window_s=10.0, buckets=10, min_samples=1)
    fair.note_arrival("b")
    fair.note_arrival("a")
    fair.note_grant("a")
    assert fair.is_starved("b")
    c.advance(5.0)
    assert fair.is_starved("b")
    c.advance(6.0)  # the old events left the window
    assert fair.snapshot() == {"a": (0, 0, 0.0), "b": (0, 0, 0.0)}
    assert not fair.is_starved("b") and fair.quota_gap("b") == -1.0
    c.advance(1000.0)
    fair.note_arrival("a")
    assert fair.snapshot()["a"][0] == 1


def test_fairness_min_samples_and_validation() -> None:
    c = FakeClock()
    fair = ClassFairness(c, {"a": 0.5, "b": 0.5}, min_samples=10)
    fair.note_arrival("b")
    fair.note_arrival("a")
    fair.note_grant("a")
    assert not fair.is_starved("b")  # too few grants to judge
    with pytest.raises(InvalidArgument, match="sum to"):
        ClassFairness(c, {"a": 0.7, "b": 0.7})
    with pytest.raises(InvalidArgument, match="window_s"):
        ClassFairness(c, window_s=0)
    with pytest.raises(InvalidArgument, match="non-empty"):
        fair.pick([])
    small = ClassFairness(c, {}, max_classes=1)
    small.note_arrival("x")
    with pytest.raises(InvalidArgument, match="more than 1 fairness classes"):
        small.note_arrival("y")
