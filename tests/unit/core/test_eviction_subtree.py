"""Subtree-rank victim selection and the DRAM admission filter (issue 9)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvstore.errors import KeyStatus
from kvstore.core.eviction import FrequencySketch, admitted, select_victims, subtree_max
from kvstore.core.index import BlockState, keys_to_array
from kvstore.core.store import StoreConfig, TieredStore
from tests.conftest import chain, payload_for
from tiers.base import TierKind

BS = 4096


def store(slots: int, policy: str, **kw) -> TieredStore:
    return TieredStore(StoreConfig(dram_bytes=slots * BS, dram_page_bytes=slots * BS, policy=policy, **kw))


def put(st, ns, keys, parent=None):
    return st.put(ns, keys, [payload_for(b"t", k, BS) for k in keys], parent=parent).statuses


def held(st, ns, keys) -> int:
    return st.lookup(ns, keys).hit_blocks


@pytest.mark.parametrize("policy", ["lru", "lfu", "cost"])
def test_cold_chains_are_drained_before_a_hot_chain_loses_its_tail(ns, policy):
    """Three chains of 4 fill the tier; the hot one is read often. A new chain
    of 4 needs 4 victims while the tier has only 3 leaves: the old rounds took
    every leaf (the hot tail included); the subtree order takes one whole
    cold chain and leaves the hot chain and the other cold chain alone."""
    with store(12, policy) as st:
        cold1, hot, cold2 = chain(b"c1", 4), chain(b"hot", 4), chain(b"c2", 4)
        for c in (cold1, hot, cold2):
            assert put(st, ns, c) == [KeyStatus.OK] * 4
        for _ in range(3):
            assert st.get(ns, hot).statuses == [KeyStatus.OK] * 4
        assert put(st, ns, chain(b"new", 4)) == [KeyStatus.OK] * 4
        assert held(st, ns, hot) == 4
        assert held(st, ns, cold1) == 0  # the older cold chain went whole
        assert held(st, ns, cold2) == 4
        st.index.check_invariants()


def test_a_cold_branch_goes_before_the_hot_trunk_it_hangs_from(ns):
    with store(10, "lru") as st:
        trunk = chain(b"trunk", 4)
        branch = chain(b"branch", 3, parent=trunk[1])
        put(st, ns, trunk)
        put(st, ns, branch, parent=trunk[1])
        other = chain(b"other", 3)
        put(st, ns, other)
        st.get(ns, trunk)  # the trunk is hot; the branch (under trunk[1]) is not
        assert put(st, ns, chain(b"new", 3)) == [KeyStatus.OK] * 3
        assert held(st, ns, trunk) == 4
        assert held(st, ns, trunk[:2] + branch) == 2  # the branch was cut whole
        assert held(st, ns, other) == 3  # newer than the branch
        st.index.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "lfu", "cost"])
def test_pinned_and_reserved_blocks_are_never_victims(ns, policy):
    with store(8, policy) as st:
        pinned, reserved, free = chain(b"p", 3), chain(b"r", 2), chain(b"f", 3)
        put(st, ns, pinned)
        st.pin(ns, pinned[-1:])  # the tail is pinned: its ancestors stay too
        h = st.reserve(ns, reserved, BS, owner="w")
        put(st, ns, free)
        res = put(st, ns, chain(b"new", 4))
        assert res.count(KeyStatus.OK) == 3  # only the free chain could go
        assert held(st, ns, pinned) == 3
        assert all(st.index.state[st.index.find(st.namespace_id(ns), keys_to_array(reserved))] == BlockState.RESERVED)
        assert held(st, ns, free) == 0
        st.abort(h.handle, "w")
        st.index.check_invariants()


def _reference(st, k: int) -> list[int]:
    """'Evict the lowest-ranked leaf, k times', one block at a time."""
    idx = st.index
    rows = idx.used_rows()
    rows = rows[(idx.tier[rows] == TierKind.DRAM)]
    alive = set(rows.tolist())
    blocked = {int(r) for r in rows if idx.pins[r] > 0 or idx.state[r] != BlockState.COMMITTED}
    out: list[int] = []
    for _ in range(k):
        leaves = [r for r in alive if r not in blocked and not any(int(c) in alive for c in idx.children(r))]
        if not leaves:
            break
        v = int(select_victims(idx, st.policy, np.asarray(leaves, dtype=np.int64), 1)[0])
        out.append(v)
        alive.remove(v)
    return out


@pytest.mark.parametrize("policy", ["lru", "lfu", "cost"])
@pytest.mark.parametrize("seed", range(4))
def test_selection_equals_one_leaf_at_a_time(ns, policy, seed):
    rnd = random.Random(seed)
    with store(64, policy) as st:
        heads: list[bytes] = []
        for i in range(14):
            parent = rnd.choice(heads) if heads and rnd.random() < 0.6 else None
            keys = chain(b"s%d" % i, rnd.randint(1, 4))
            assert put(st, ns, keys, parent=parent) == [KeyStatus.OK] * len(keys)
            heads += keys
        for _ in range(10):
            k = rnd.choice(heads)
            st.get(ns, [k]) if st.lookup(ns, [k]).hit_blocks else None
        for k in range(1, 20, 3):
            got = st.place.victims(TierKind.DRAM, None, k).tolist()
            assert set(got) == set(_reference(st, k)), k
            # closed under descendants, children listed first
            pos = {r: i for i, r in enumerate(got)}
            for r in got:
                for c in st.index.children(r):
                    assert c in pos and pos[c] < pos[r]


def test_subtree_max_follows_parent_links_within_the_set(ns):
    with store(16, "lru") as st:
        a = chain(b"a", 4)
        put(st, ns, a)
        rows = st.index.find(st.namespace_id(ns), keys_to_array(a))
        vals = np.array([5.0, 1.0, 7.0, 2.0])
        assert subtree_max(st.index, rows, vals).tolist() == [7.0, 7.0, 7.0, 2.0]
        # without the middle block, the root no longer sees below it
        sub = rows[[0, 2, 3]]
        assert subtree_max(st.index, sub, vals[[0, 2, 3]]).tolist() == [5.0, 7.0, 2.0]


def test_admission_rule_is_a_chain_prefix():
    assert admitted(np.array([5, 4, 1, 9]), np.array([2, 3, 3, 0])) == 2
    assert admitted(np.array([3, 3]), np.array([3, 3, 3])) == 2
    assert admitted(np.array([0]), np.array([1])) == 0
    sk = FrequencySketch(1 << 12, age=2.0)
    keys = keys_to_array(chain(b"x", 3))
    sk.record(keys[:2], stored_blocks=64)
    sk.record(keys[:1], stored_blocks=64)
    assert sk.estimate(keys).tolist()[:2] == [2, 1]


def test_dram_admission_keeps_popular_blocks_and_refuses_one_offs(ns):
    with store(8, "lru", dram_admission=True) as st:
        hot = chain(b"hot", 8)
        assert put(st, ns, hot) == [KeyStatus.OK] * 8
        for _ in range(3):
            assert held(st, ns, hot) == 8
        once = chain(b"once", 2)
        assert held(st, ns, once) == 0  # asked for once
        assert put(st, ns, once) == [KeyStatus.CAPACITY] * 2
        assert held(st, ns, hot) == 8
        popular = chain(b"pop", 2)
        for _ in range(6):
            st.lookup(ns, popular)  # asked for more often than the hot tail
        assert put(st, ns, popular) == [KeyStatus.OK] * 2
        assert held(st, ns, hot) == 6  # the hot chain lost its tail to it, nothing else
        st.index.check_invariants()


def test_without_admission_every_put_is_stored(ns):
    with store(8, "lru") as st:
        hot = chain(b"hot", 8)
        put(st, ns, hot)
        for _ in range(3):
            held(st, ns, hot)
        assert put(st, ns, chain(b"once", 2)) == [KeyStatus.OK] * 2
