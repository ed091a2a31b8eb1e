"""The index's batch fast paths (chain insert, the key table probed in C,
delete by child counts) against the slow paths they replace, on random
forests with shared key halves: the C table and the numpy one must place and
find alike."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core.index import BlockIndex, BlockState
from kvstore.core.keytable import HASHTAB


def _check(idx: BlockIndex, ns_of: dict[int, int]) -> None:
    idx.check_invariants()
    rows = idx.used_rows()
    # children are exactly the parent links
    for r in rows.tolist():
        assert idx.children(r).tolist() == sorted(rows[idx.parent[rows] == r].tolist())
    # find (C or numpy) agrees with the numpy probe, present and absent keys
    for ns in set(ns_of.values()) | {99}:
        keys = np.stack([idx.k0[rows], idx.k1[rows]], axis=1)
        absent = keys.copy()
        absent[:, 1] ^= np.uint64(1)  # same first half, other key
        for q in (keys, absent):
            want = np.where(idx.ns[rows] == ns, rows, -1) if q is keys else np.full(rows.size, -1)
            assert np.array_equal(idx.find(ns, q), want)
            committed = np.where((want >= 0) & (idx.state[np.maximum(want, 0)] == BlockState.COMMITTED), want, -1)
            assert np.array_equal(idx.find_committed(ns, q), committed)


@pytest.mark.parametrize("native", [True, False], ids=["c-table", "numpy-table"])
def test_random_forests_keep_counts_table_and_map_exact(native: bool):
    if native and HASHTAB is None:
        pytest.skip("kvstore.core.ckeytable is not built")
    rng = np.random.default_rng(7)
    idx = BlockIndex(initial_rows=16, native=native)
    halves = rng.integers(0, 2**63, size=8, dtype=np.int64).astype(np.uint64)  # few: shared first halves
    ns_of: dict[int, int] = {}
    tick = 1
    for step in range(60):
        n = int(rng.integers(1, 12))
        ns = int(rng.integers(0, 2))
        keys = np.stack([halves[rng.integers(0, halves.size, n)],
                         rng.integers(0, 2**63, size=n, dtype=np.int64).astype(np.uint64)], axis=1)
        live = idx.used_rows()
        live = live[idx.ns[live] == ns]
        head = int(rng.choice(live)) if live.size and rng.random() < 0.6 else -1
        if rng.random() < 0.5:  # a chain (the fast path)
            parents = np.asarray([head] + [-2 - i for i in range(n - 1)], dtype=np.int64)
        else:  # a fan: every key a child of the head or of an earlier key
            parents = np.asarray([head] + [int(rng.choice([head, -2 - int(rng.integers(0, i))]))
                                           for i in range(1, n)], dtype=np.int64)
        state = BlockState.COMMITTED if rng.random() < 0.8 else BlockState.RESERVED
        rows = idx.insert(ns, keys, parents, int(rng.integers(0, 2)), np.arange(n), np.full(n, 10), state, tick)
        tick += n
        lk = idx.lookup(ns, keys)  # the leading committed keys
        assert lk.hit == (n if state is BlockState.COMMITTED else 0) and np.array_equal(lk.rows, rows[: lk.hit])
        for r in rows.tolist():
            ns_of[r] = ns
        assert np.array_equal(idx.find(ns, keys), rows)
        if step % 3 == 2:  # drop a random subtree (its root's parent may stay)
            live = idx.used_rows()
            sub = idx.subtree(np.asarray([int(rng.choice(live))]))
            idx.delete(sub[rng.permutation(sub.size)])
            for r in sub.tolist():
                ns_of.pop(r)
        _check(idx, ns_of)


def test_chain_insert_matches_the_linked_one():
    keys = np.arange(40, dtype=np.uint64).reshape(20, 2) + np.uint64(1)
    a, b = BlockIndex(), BlockIndex()
    a.keep(frozenset({"depth"}))  # (kept only under cost: compared where kept)
    b.keep(frozenset({"depth"}))
    ra = a.insert(0, keys, np.asarray([-1] + [-2 - i for i in range(19)]), 1, np.arange(20), np.full(20, 10),
                  BlockState.RESERVED, 5)
    # the same chain one key at a time (the per-row path)
    rb = np.concatenate([b.insert(0, keys[i:i + 1], np.asarray([-1 if i == 0 else int(i - 1)]), 1,
                                  np.asarray([i]), np.asarray([10]), BlockState.RESERVED, 5 + i)
                         for i in range(20)])
    assert np.array_equal(ra, rb)
    for col in ("parent", "nchild", "depth", "last"):
        assert np.array_equal(getattr(a, col)[ra], getattr(b, col)[rb]), col


def test_batch_linking_matches_the_row_loop():
    """Wide, deep forests inserted in one batch (``_link_batch``) against the
    same rows linked one at a time, onto existing parents with children."""
    rng = np.random.default_rng(11)
    for trial in range(20):
        a, b = BlockIndex(), BlockIndex()
        a.keep(frozenset({"depth"}))
        b.keep(frozenset({"depth"}))
        base = np.arange(1, 13, dtype=np.uint64).reshape(6, 2) * np.uint64(1000 + trial)
        pre = np.asarray([-1, -2, -2, -3, -1, -5], dtype=np.int64)  # a small existing forest
        ra = a.insert(0, base, pre, 1, np.arange(6), np.full(6, 10), BlockState.COMMITTED, 1)
        b.insert(0, base, pre, 1, np.arange(6), np.full(6, 10), BlockState.COMMITTED, 1)
        n = int(rng.integers(5, 200))
        keys = rng.integers(0, 2**63, size=(n, 2), dtype=np.int64).astype(np.uint64)
        parents = np.empty(n, dtype=np.int64)
        for i in range(n):
            pick = rng.random()
            if pick < 0.15 or i == 0:
                parents[i] = -1 if rng.random() < 0.5 else int(rng.choice(ra))
            elif pick < 0.3:
                parents[i] = int(rng.choice(ra))
            else:
                parents[i] = -2 - int(rng.integers(max(0, i - 5) if pick < 0.8 else 0, i))
        tier = int(rng.integers(0, 3))
        rows_a = a.insert(0, keys, parents, tier, np.arange(n), np.full(n, 10), BlockState.COMMITTED, 9)
        rows_b = np.empty(n, dtype=np.int64)
        for i in range(n):  # one key at a time: the per-row loop
            p = int(parents[i]) if parents[i] >= -1 else int(rows_b[-2 - parents[i]])
            rows_b[i] = b.insert(0, keys[i:i + 1], np.asarray([p]), tier, np.asarray([i]), np.asarray([10]),
                                 BlockState.COMMITTED, 9 + i)[0]
        assert np.array_equal(rows_a, rows_b)
        for col in ("parent", "nchild", "depth"):
            assert np.array_equal(getattr(a, col)[: a.live], getattr(b, col)[: b.live]), (trial, col)
        a.check_invariants()
