"""SSD write admission (tiers/ssd_admit.py): frequency rule, write budget, aging."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from tiers.ssd_admit import SsdAdmission


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}{i}".encode(), digest_size=16).digest() for i in range(n)]


def test_min_hits_rule() -> None:
    adm = SsdAdmission(min_hits=2)
    hot, cold, never = keys("hot", 50), keys("cold", 50), keys("never", 50)
    adm.seen(hot)
    adm.seen(hot + cold)
    assert adm.admit(hot, [4096] * 50).all()
    assert not adm.admit(cold, [4096] * 50).any()
    assert not adm.admit(never, [4096] * 50).any()
    assert (adm.admitted, adm.refused_cold, adm.refused_budget) == (50, 100, 0)
    assert (adm.estimate(hot) >= 2).all() and (adm.estimate(cold) >= 1).all()


def test_duplicates_in_one_call_count_each_time() -> None:
    adm = SsdAdmission(min_hits=3)
    k = keys("dup", 1)
    adm.seen(k * 3)
    assert adm.admit(k, [1]).all()


def test_min_hits_zero_and_one() -> None:
    zero = SsdAdmission(min_hits=0)
    assert zero.admit(keys("x", 10), [1] * 10).all()  # even never seen
    one = SsdAdmission(min_hits=1)
    seen = keys("s", 10)
    one.seen(seen)
    assert one.admit(seen, [1] * 10).all()
    assert not one.admit(keys("unseen", 10), [1] * 10).any()


def test_write_budget_with_fake_clock() -> None:
    clock = FakeClock()
    adm = SsdAdmission(min_hits=0, write_budget_mbps=1.0, clock=clock)  # 1e6 bytes/s, burst 1 s
    size = 100_000
    ok = adm.admit(keys("a", 20), [size] * 20)
    assert ok.sum() == 10 and ok[:10].all()  # the full bucket: 1e6 bytes, in order
    assert adm.refused_budget == 10
    assert not adm.admit(keys("b", 5), [size] * 5).any()  # spent
    clock.t += 0.35  # 350,000 bytes of refill: blocks start while tokens remain
    assert adm.admit(keys("c", 10), [size] * 10).sum() == 4
    clock.t += 100.0  # refill caps at the burst
    assert adm.admit(keys("d", 30), [size] * 30).sum() == 10
    # a block larger than the burst is still admitted when the bucket is full (it goes into debt)
    clock.t += 100.0
    assert adm.admit(keys("big", 2), [5_000_000, 1]).tolist() == [True, False]
    clock.t += 3.0  # debt of 4e6 not repaid yet
    assert not adm.admit(keys("e", 1), [1]).any()
    clock.t += 2.0
    assert adm.admit(keys("e", 1), [1]).all()


def test_budget_only_spent_on_warm_blocks() -> None:
    clock = FakeClock()
    adm = SsdAdmission(min_hits=1, write_budget_mbps=1.0, clock=clock)
    warm = keys("w", 5)
    adm.seen(warm)
    cold = keys("c", 5)
    mixed = [k for pair in zip(cold, warm) for k in pair]
    ok = adm.admit(mixed, [300_000] * 10)
    assert ok.tolist() == [False, True] * 4 + [False, False]
    assert (adm.refused_cold, adm.refused_budget, adm.admitted) == (5, 1, 4)


def test_aging_halves_counts() -> None:
    adm = SsdAdmission(min_hits=2, width=1024, age_every=2048)
    old = keys("old", 4)
    for _ in range(3):
        adm.seen(old)
    assert adm.admit(old, [1] * 4).all()
    filler = keys("filler", 2048)  # enough increments to trigger one aging
    adm.seen(filler)
    assert adm.agings == 1
    assert (adm.estimate(old) <= 3 // 2 + 2).all()  # halved (plus a little collision noise)
    for _ in range(3):
        adm.seen(keys("more", 2048))
    assert adm.agings == 4
    assert not adm.admit(old, [1] * 4).any()  # popularity faded


def test_counters_saturate() -> None:
    adm = SsdAdmission(min_hits=2, width=16, age_every=10**9)
    k = keys("sat", 1)
    for _ in range(300):
        adm.seen(k)
    assert int(adm.estimate(k)[0]) == 255


def test_sketch_is_compact_and_deterministic() -> None:
    a, b = SsdAdmission(), SsdAdmission()
    ks = keys("det", 1000)
    a.seen(ks)
    b.seen(ks)
    assert np.array_equal(a.estimate(ks), b.estimate(ks))
    assert a._table.nbytes <= 256 * 1024
    # false positives stay rare at this load
    assert (a.estimate(keys("other", 1000)) >= 1).mean() < 0.01


def test_bad_config() -> None:
    with pytest.raises(InvalidArgument):
        SsdAdmission(min_hits=-1)
    with pytest.raises(InvalidArgument):
        SsdAdmission(write_budget_mbps=-1)
    with pytest.raises(InvalidArgument):
        SsdAdmission(width=1000)
    with pytest.raises(InvalidArgument):
        SsdAdmission().admit(keys("k", 2), [1])
