"""Levels within a set of index rows: how far up parent links a row's
ancestors are reached through the set (``BlockIndex.levels``), the
parents-first order that callers need without a ``depth`` column (kept
only under the ``cost`` policy); and the ancestors of a set of rows
(``ancestors``, what ``TieredStore.clear`` keeps above a busy block).

``levels_within`` runs in C where ``kvstore.core.ckeytable`` is built (one
walk up the links with a memo: 1,000,000 rows in tens of ms, against
~0.8 s of pointer jumping), else in numpy rounds; both give the same
answer (tests/unit/core/test_levels_native.py)."""

from __future__ import annotations

import numpy as np

from kvstore.core.keytable import HASHTAB

LEVELS = getattr(HASHTAB, "levels", None)
"""``ckeytable.levels`` (C), or None (not built, or ``NO_KVSTORE_NATIVE=1``)."""
ASCEND = getattr(HASHTAB, "ascend", None)
"""``ckeytable.ascend`` (C), or None: ``ancestors`` in numpy rounds."""


def ancestors(parent: np.ndarray, roots: np.ndarray, *, native: bool = True) -> np.ndarray:
    """A mark per row of ``parent`` (bool): ``roots`` and every ancestor of
    one (what a busy block keeps through a clear). In C where built
    (``ASCEND``: each chain walked up to the first row already marked, every
    row once); in numpy, one round per level of the deepest chain (a
    frontier of the rows not marked yet, each row in it once)."""
    roots = np.ascontiguousarray(roots, dtype=np.int64).reshape(-1)
    mark = np.zeros(parent.size, dtype=np.uint8)
    if roots.size and native and ASCEND is not None and parent.dtype == np.int32 and parent.flags.c_contiguous:
        ASCEND(parent, roots, mark)
        return mark.view(bool)
    front = np.unique(roots)
    while front.size:
        mark[front] = 1
        up = parent[front].astype(np.int64)
        up = up[up >= 0]
        front = np.unique(up[mark[up] == 0])
    return mark.view(bool)


def levels_within(parent: np.ndarray, rows: np.ndarray, *, native: bool = True) -> np.ndarray:
    """For each of ``rows`` (distinct), how many of its ancestors are
    reached going up parent links *within* ``rows`` (0 where its parent
    is not one of them). Sorting by it puts every parent in ``rows``
    before its children; over a set closed under parents (every used
    row) it is the depth in the chain. In C where built (``LEVELS``;
    ``native=False`` forces numpy); in numpy, pointer jumping over the
    set (``searchsorted`` into it, no row outside it read), one
    vectorised round per power of two of the levels."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    n = rows.size
    lev = np.zeros(n, dtype=np.int64)
    if n == 0:
        return lev
    if native and LEVELS is not None and parent.dtype == np.int32 and parent.flags.c_contiguous:
        LEVELS(parent, np.ascontiguousarray(rows), lev)
        return lev
    par = parent[rows].astype(np.int64)
    if n == 1 or bool((rows[1:] > rows[:-1]).all()):  # ascending already (used_rows, a chain)
        at = np.minimum(np.searchsorted(rows, par), n - 1)
        anc = np.where((par >= 0) & (rows[at] == par), at, -1)  # the parent's position, or -1
        if anc[0] < 0 and bool((anc[1:] == np.arange(n - 1)).all()):
            return np.arange(n, dtype=np.int64)  # one chain, in row order
    else:
        srt = np.argsort(rows, kind="stable")
        sr = rows[srt]
        at = np.minimum(np.searchsorted(sr, par), n - 1)
        anc = np.where((par >= 0) & (sr[at] == par), srt[at], -1)
    m = np.flatnonzero(anc >= 0)
    lev[m] = 1
    for _ in range(64):  # invariant: lev[i] hops from i up to anc[i] (or to the top)
        if not m.size:
            return lev
        up = anc[m]
        lev[m], anc[m] = lev[m] + lev[up], anc[up]
        m = m[anc[m] >= 0]
    raise AssertionError("levels: parent links form a cycle")


def descend_within(parent: np.ndarray, high: int, roots: np.ndarray) -> np.ndarray:
    """``BlockIndex.descend`` in numpy: a mark per row below ``high``, 1 for
    ``roots`` and every row below one of them, else 0. Pointer jumping over
    the parent column, one vectorised round per power of two of the depth.
    Invariant: a row is marked when a root lies on its path up to (not
    including) ``up``."""
    mark = np.zeros(high + 1, dtype=np.uint8)  # [high]: the sentinel above every chain
    mark[roots] = 1
    up = np.empty(high + 1, dtype=np.int64)
    up[:high] = parent[:high]
    up[up < 0] = high
    up[high] = high
    act = np.flatnonzero((mark[:high] == 0) & (up[:high] != high))
    while act.size:
        hit = mark[up[act]] == 1
        mark[act[hit]] = 1
        act = act[~hit]
        up[act] = up[up[act]]
        act = act[up[act] != high]
    return mark[:high]
