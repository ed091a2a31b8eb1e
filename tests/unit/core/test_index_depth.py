"""Orders derived without the ``depth`` column (kept only under ``cost``)
against that column's answer, on the random forests of
test_index_subtree.py (a 12,000-deep chain, a 12,000-wide fan, freed and
reused rows): ``BlockIndex.levels``, ``subtree``'s order, the eviction's
"deeper first" tie-break, the SSD mover's flush and promotion orders."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core.eviction import LRU, make_policy, select_subtrees, subtree_max
from kvstore.core.ssd_mover import flush_order
from tests.unit.core.test_index_subtree import NATIVE, build, root_sets

DEPTH = frozenset({"depth"})


def brute_depths(idx, rows) -> np.ndarray:
    """Hops to the top of each row's chain, walked up one parent at a time."""
    memo: dict[int, int] = {-1: -1}
    par = idx.parent
    out = []
    for r in rows.tolist():
        path = []
        while r not in memo:
            path.append(r)
            r = int(par[r])
        d = memo[r]
        for q in reversed(path):
            d += 1
            memo[q] = d
        out.append(memo[path[0]] if path else d)
    return np.asarray(out, dtype=np.int64)


@pytest.fixture(scope="module", params=[1, 2])
def forest(request):
    return build(NATIVE, request.param, DEPTH)


def test_levels_over_every_row_are_the_depths_insert_keeps(forest) -> None:
    idx = forest.idx
    idx.check_invariants()  # the kept column follows parent
    used = idx.used_rows()
    assert np.array_equal(idx.levels(used), idx.depth[used].astype(np.int64))
    assert np.array_equal(brute_depths(idx, used), idx.depth[used].astype(np.int64))
    # a policy that starts keeping depth computes the same for every row
    fresh = build(False, 7)
    assert "depth" not in fresh.idx.kept
    make_policy("cost", fresh.idx)
    fresh.idx.check_invariants()
    u = fresh.idx.used_rows()
    assert np.array_equal(fresh.idx.depth[u].astype(np.int64), brute_depths(fresh.idx, u))


def test_subtree_order_is_the_depth_order_within_the_set(forest) -> None:
    idx = forest.idx
    for roots in root_sets(forest):
        got = idx.subtree(roots)
        if not got.size:
            continue
        # each row's level within the set: its depth less its top root's
        top = np.zeros(got.size, dtype=np.int64)
        pos = {r: i for i, r in enumerate(got.tolist())}
        for i, r in enumerate(got.tolist()):  # parents come first: the top is known
            p = int(idx.parent[r])
            top[i] = top[pos[p]] if p in pos else int(idx.depth[r])
        lev = idx.depth[got].astype(np.int64) - top
        assert np.all(np.diff(lev) >= 0), "not by level"
        if not idx.nchild[np.asarray(roots, dtype=np.int64)].any():
            continue  # leaves only: the given order kept (as before)
        same = lev[1:] == lev[:-1]
        assert np.all(got[1:][same] > got[:-1][same]), "ties not by row"
        if np.unique(idx.depth[np.asarray(roots, dtype=np.int64)]).size == 1:  # the old answer exactly
            assert np.array_equal(got, got[np.lexsort((got, idx.depth[got]))])


def old_select_subtrees(idx, policy, rows, blocked, k):
    """select_subtrees as it was, with the depth column's tie-break."""
    n = rows.size
    rank = policy.rank(idx, rows).astype(np.float64)
    order = np.lexsort((rows, idx.last[rows], rank))
    pos = np.empty(n, dtype=np.float64)
    pos[order] = np.arange(n, dtype=np.float64)
    eff = subtree_max(idx, rows, np.where(blocked, np.inf, pos))
    cand = np.flatnonzero(np.isfinite(eff))
    e = eff[cand]
    if k < cand.size:
        keep = e <= np.partition(e, k - 1)[k - 1]
        cand, e = cand[keep], e[keep]
    return rows[cand[np.lexsort((-idx.depth[rows[cand]].astype(np.int64), e))[:k]]]


def test_eviction_deeper_first_equals_the_depth_columns(forest) -> None:
    idx, rng = forest.idx, np.random.default_rng(5)
    used = idx.used_rows()
    saved = idx.last[used].copy()
    try:
        for trial in range(6):
            tier = used[rng.random(used.size) < (1.0 if trial < 2 else 0.7)]  # gaps: another tier's rows
            idx.last[used] = rng.integers(1, 50, size=used.size)  # many ties on rank
            blocked = rng.random(tier.size) < 0.02
            for k in (1, 64, 5000, tier.size):
                want = old_select_subtrees(idx, LRU(), tier, blocked, k)
                assert np.array_equal(select_subtrees(idx, LRU(), tier, blocked, k), want), (trial, k)
    finally:
        idx.last[used] = saved


def test_ssd_orders_equal_the_depth_columns(forest) -> None:
    idx, rng = forest.idx, np.random.default_rng(6)
    used = idx.used_rows()
    saved = idx.size[used].copy()
    try:
        idx.size[used] = rng.choice([8, 16], size=used.size)
        for frac in (1.0, 0.5, 0.05):  # with gaps: a parent between two rows not among them
            rows = used[rng.random(used.size) < frac]
            want = rows[np.lexsort((idx.size[rows], idx.depth[rows]))]
            assert np.array_equal(flush_order(idx, rows), want)  # from the column (kept here)
            kept, idx.kept = idx.kept, frozenset()
            try:
                assert np.array_equal(flush_order(idx, rows), want)  # derived, as under lru and lfu
            finally:
                idx.kept = kept
            batch = rng.permutation(rows)[:4000]  # promotion: parents first within the batch
            got = batch[np.argsort(idx.levels(batch), kind="stable")]
            at = {r: i for i, r in enumerate(got.tolist())}
            for i, r in enumerate(got.tolist()):
                p = int(idx.parent[r])
                assert at.get(p, -1) < i
    finally:
        idx.size[used] = saved
