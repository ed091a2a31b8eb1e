"""``BlockIndex.subtree`` from the parent column alone: the descendants of a
root set, marked in C (``ckeytable.descend``) or in numpy rounds
(``descend_np``), against a brute-force walk down the children, on random
forests with deep chains, wide fans, roots inside one another's subtrees and
rows freed and reused (so a child's row may come before its parent's)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from kvstore.core.index import IN_BATCH, BlockIndex, BlockState
from kvstore.core.keytable import HASHTAB

NATIVE = HASHTAB is not None and hasattr(HASHTAB, "descend")


class Forest:
    def __init__(self, native: bool, seed: int, kept: frozenset[str] = frozenset()) -> None:
        self.idx = BlockIndex(initial_rows=16, native=native)
        self.idx.keep(kept)
        self.rng = np.random.default_rng(seed)
        self.tick = 1

    def insert(self, parents: list[int] | np.ndarray) -> np.ndarray:
        n = len(parents)
        keys = self.rng.integers(0, 2**63, size=(n, 2), dtype=np.int64).astype(np.uint64)
        rows = self.idx.insert(0, keys, np.asarray(parents, dtype=np.int64), 1, np.arange(n), np.full(n, 8),
                               BlockState.COMMITTED, self.tick)
        self.tick += n
        return rows

    def chain(self, head: int, n: int) -> np.ndarray:
        return self.insert([head] + [IN_BATCH - i for i in range(n - 1)])

    def brute(self, roots: np.ndarray) -> set[int]:
        """Walk down from the roots over children found from ``parent``."""
        idx = self.idx
        used = idx.used_rows()
        kids: dict[int, list[int]] = defaultdict(list)
        for c, p in zip(used.tolist(), idx.parent[used].tolist()):
            if p >= 0:
                kids[p].append(c)
        seen, stack = set(), [int(r) for r in roots]
        while stack:
            r = stack.pop()
            if r not in seen:
                seen.add(r)
                stack.extend(kids[r])
        return seen


def build(native: bool, seed: int, kept: frozenset[str] = frozenset()) -> Forest:
    """A deep chain (12,000), a wide fan (12,000 children, some with chains
    below), random small trees, then subtrees freed and rows reused."""
    f = Forest(native, seed, kept)
    deep = f.chain(-1, 12_000)
    fan_root = f.insert([-1])
    fan = f.insert(np.full(12_000, int(fan_root[0])))
    for r in f.rng.choice(fan, 50, replace=False).tolist():
        f.chain(int(r), int(f.rng.integers(1, 30)))
    for _ in range(200):  # small random trees, some hung under existing rows
        used = f.idx.used_rows()
        head = int(f.rng.choice(used)) if f.rng.random() < 0.5 else -1
        n = int(f.rng.integers(1, 20))
        f.insert([head] + [int(f.rng.choice([head, IN_BATCH - int(f.rng.integers(0, i))])) for i in range(1, n)])
    f.idx.delete(f.idx.subtree(deep[6000:6001]))  # half the deep chain goes
    f.chain(int(deep[5999]), 9_000)  # and comes back, partly in rows the fan's chains freed
    for _ in range(30):  # free subtrees, then reuse their rows (children at lower rows than parents)
        used = f.idx.used_rows()
        f.idx.delete(f.idx.subtree(np.asarray([int(f.rng.choice(used))])))
        used = f.idx.used_rows()
        f.chain(int(f.rng.choice(used)), int(f.rng.integers(2, 60)))
    f.idx.check_invariants()
    used = f.idx.used_rows()
    assert np.any(f.idx.parent[used] > used), "no child at a lower row than its parent"
    return f


def root_sets(f: Forest) -> list[np.ndarray]:
    used = f.idx.used_rows()
    rng = f.rng
    deep_top = used[(f.idx.parent[used] < 0) & (f.idx.nchild[used] > 0)]
    leaves = used[f.idx.nchild[used] == 0]
    nested = rng.choice(used, 40, replace=False)
    nested = np.concatenate([nested, [int(f.idx.parent[r]) for r in nested.tolist() if f.idx.parent[r] >= 0]])
    return [
        deep_top,                                   # every tree whole
        rng.choice(used, 1),                        # one row
        rng.choice(leaves, 25, replace=False),      # leaves only (the early exit)
        np.repeat(rng.choice(leaves, 5), 2),        # leaves, repeated
        nested,                                     # roots inside one another's subtrees
        rng.choice(used, 300, replace=False),       # many, anywhere
        np.zeros(0, dtype=np.int64),
    ]


def check_subtree(f: Forest, roots: np.ndarray) -> None:
    idx = f.idx
    want = f.brute(roots)
    got = idx.subtree(roots)
    assert got.size == len(want) and set(got.tolist()) == want  # each once
    pos = np.full(idx.parent.size, -1, dtype=np.int64)
    pos[got] = np.arange(got.size)
    par = idx.parent[got].astype(np.int64)
    inside = (par >= 0) & (pos[np.maximum(par, 0)] >= 0)
    assert np.all(pos[par[inside]] < pos[got[inside]]), "a child before its parent"
    mark = idx.descend(roots)
    assert set(np.flatnonzero(mark == 1).tolist()) == want
    assert set(np.flatnonzero(idx.descend_np(np.asarray(roots, dtype=np.int64)) == 1).tolist()) == want


@pytest.mark.parametrize("native", [True, False], ids=["c", "numpy"])
@pytest.mark.parametrize("seed", [1, 2])
def test_descendants_equal_a_brute_force_walk(native: bool, seed: int) -> None:
    if native and not NATIVE:
        pytest.skip("kvstore.core.ckeytable is not built")
    f = build(native, seed)
    for roots in root_sets(f):
        check_subtree(f, roots)


def test_c_and_numpy_mark_the_same_rows() -> None:
    if not NATIVE:
        pytest.skip("kvstore.core.ckeytable is not built")
    f = build(True, 3)
    for roots in root_sets(f):
        roots = np.asarray(roots, dtype=np.int64)
        c, npy = f.idx.descend(roots), f.idx.descend_np(roots)
        assert np.array_equal(c == 1, npy == 1)


def test_the_early_exits_find_what_the_scan_finds() -> None:
    """Leaves, and a chain given whole (a reservation aborted): the answer
    without a scan is the scan's, parents first, whatever the given order."""
    f = Forest(NATIVE, 5)
    head = f.chain(-1, 10)
    c = f.chain(int(head[-1]), 64)
    for roots in (c[::-1], c[f.rng.permutation(c.size)], c[-1:], np.concatenate([c[-1:], c[-1:]])):
        got = f.idx.subtree(roots)
        assert got.tolist() == [r for r in c.tolist() if r in set(roots.tolist())]
        assert set(np.flatnonzero(f.idx.descend(roots) == 1).tolist()) == set(got.tolist())
    # a fan's children given whole but not their own child: the scan takes it
    kid = f.chain(int(c[3]), 2)
    got = f.idx.subtree(c)
    assert set(got.tolist()) == set(c.tolist()) | set(kid.tolist())


def test_descend_refuses_a_bad_root_or_a_cycle() -> None:
    if not NATIVE:
        pytest.skip("kvstore.core.ckeytable is not built")
    idx = BlockIndex(native=True)
    with pytest.raises(ValueError):
        HASHTAB.descend(idx.parent, 0, np.asarray([0], dtype=np.int64), np.zeros(1, np.uint8))
    par = np.asarray([1, 0, -1], dtype=np.int32)  # rows 0 and 1 each other's parent
    with pytest.raises(ValueError, match="cycle"):
        HASHTAB.descend(par, 3, np.asarray([2], dtype=np.int64), np.zeros(3, np.uint8))
