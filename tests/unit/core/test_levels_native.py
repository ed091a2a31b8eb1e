"""``levels`` in C (``ckeytable.levels``: one walk up the parent links with
a memo) against the numpy pointer jumping it replaces where built
(``levels_within(..., native=False)``) and a brute-force walk, on the random
forests of test_index_subtree.py (a 12,000-deep chain, a 12,000-wide fan,
freed and reused rows), on every used row and on subsets with gaps; and its
refusals (a row past the column, a cycle)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core import levels as L
from kvstore.core.keytable import HASHTAB
from tests.unit.core.test_index_subtree import build

C_LEVELS = getattr(HASHTAB, "levels", None)
needs_c = pytest.mark.skipif(HASHTAB is None, reason="kvstore.core.ckeytable is not built")


def brute_levels(parent: np.ndarray, rows: np.ndarray) -> np.ndarray:
    inside = {int(r) for r in rows.tolist()}
    out = []
    for r in rows.tolist():
        n, p = 0, int(parent[r])
        while p in inside:
            n, p = n + 1, int(parent[p])
        out.append(n)
    return np.asarray(out, dtype=np.int64)


@pytest.fixture(scope="module", params=[1, 2])
def forest(request):
    return build(False, request.param)


@needs_c
def test_the_c_pass_is_built_and_used() -> None:
    assert C_LEVELS is not None, "ckeytable has no levels"
    assert L.LEVELS is C_LEVELS


@needs_c
def test_c_and_numpy_levels_agree_on_random_forests(forest) -> None:
    idx, rng = forest.idx, np.random.default_rng(11)
    par = idx.parent
    used = idx.used_rows()
    sets = [used, used[::-1], rng.permutation(used)]
    for frac in (0.5, 0.05, 0.002):  # gaps: a parent between two rows not among them
        sets.append(used[rng.random(used.size) < frac])
    sets += [rng.choice(used, 1), used[:0], rng.choice(used, 256, replace=False)]
    sets.append(idx.subtree(used[(par[used] < 0) & (idx.nchild[used] > 0)][:3]))
    for rows in sets:
        want = L.levels_within(par, rows, native=False)
        got = L.levels_within(par, rows)
        assert np.array_equal(got, want)
    for rows in sets[3:]:  # the small ones: against the brute walk too
        assert np.array_equal(L.levels_within(par, rows), brute_levels(par, rows))


@needs_c
def test_c_levels_refuse_a_bad_row_or_a_cycle() -> None:
    par = np.asarray([-1, 0, 1, 4, 3], dtype=np.int32)  # rows 3 and 4 each other's parent
    out = np.empty(2, dtype=np.int64)
    with pytest.raises(ValueError, match="out of range"):
        C_LEVELS(par, np.asarray([0, 5], dtype=np.int64), out)
    with pytest.raises(ValueError, match="cycle"):
        C_LEVELS(par, np.asarray([3, 4], dtype=np.int64), out)
    with pytest.raises(ValueError):
        C_LEVELS(par, np.asarray([0, 1, 2], dtype=np.int64), out)  # out too short
    got = np.empty(3, dtype=np.int64)
    C_LEVELS(par, np.asarray([2, 0, 1], dtype=np.int64), got)
    assert got.tolist() == [2, 0, 1]
    C_LEVELS(par, np.asarray([2, 3], dtype=np.int64), out[:2])  # the cycle's rows not in the set walked
    assert out.tolist() == [0, 0]
