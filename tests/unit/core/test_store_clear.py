"""``TieredStore.clear`` with pinned and reserved blocks on random forests:
exactly the busy blocks and their ancestors survive (the answer of the old
walk up each busy block's parents, one at a time), in the namespace
cleared only, and the ancestors are found without a Python step per
block (the parent column is read a bounded number of times); the C walk
(``ckeytable.ascend``) and its numpy fallback mark the same rows."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvstore.core.index import BlockState
from kvstore.core.keytable import HASHTAB
from kvstore.core.levels import ancestors
from kvstore.core.store import StoreConfig, TieredStore
from kvstore.errors import KeyStatus
from tests.conftest import chain, payload_for
from tests.unit.core.test_store_remove import forest

BS = 4096


def survivors_the_old_way(st, rows: np.ndarray) -> set[int]:
    """Busy rows (pinned, or not committed) and every ancestor, walked up one parent at a time."""
    idx = st.index
    busy = rows[(idx.pins[rows] > 0) | (idx.state[rows] != BlockState.COMMITTED)]
    keep: set[int] = set()
    for r in busy.tolist():
        while r >= 0 and r not in keep:
            keep.add(r)
            r = int(idx.parent[r])
    return keep


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("scope", ["ns", "all"])
def test_what_survives_a_clear_is_the_busy_blocks_and_their_ancestors(ns, ns2, seed, scope):
    rng = random.Random(seed)
    cfg = StoreConfig(dram_bytes=256 * BS, dram_page_bytes=256 * BS)
    with TieredStore(cfg) as st:
        stored = forest(st, ns, rng)
        other = forest(st, ns2, rng)
        if rng.random() < 0.8:
            st.pin(ns, rng.sample(stored, rng.randint(1, 4)))
        if rng.random() < 0.5:
            st.pin(ns2, rng.sample(other, 1))
        if rng.random() < 0.5:  # a block being written, under a stored one
            keys = chain(b"R%d" % seed, rng.randint(1, 3))
            res = st.reserve(ns, keys, BS, "w", parent=rng.choice(stored))
            assert res.statuses == [KeyStatus.OK] * len(keys)
        idx = st.index
        used = idx.used_rows()
        mine = used if scope == "all" else used[idx.ns[used] == st.namespace_id(ns)]
        keep = survivors_the_old_way(st, mine)
        busy = mine[(idx.pins[mine] > 0) | (idx.state[mine] != BlockState.COMMITTED)]
        for native in (True, False):  # C and numpy mark the same rows
            got = ancestors(idx.parent, busy, native=native)
            assert set(mine[got[mine]].tolist()) == keep
            assert int(got.sum()) == len(keep)
        want = (set(used.tolist()) - set(mine.tolist())) | keep
        gone = st.clear(ns if scope == "ns" else None)
        assert set(st.index.used_rows().tolist()) == want
        assert gone == mine.size - len(keep)
        st.index.check_invariants()


class CountingColumn(np.ndarray):
    reads = 0

    def __getitem__(self, item):
        CountingColumn.reads += 1
        return super().__getitem__(item)


@pytest.mark.skipif(HASHTAB is None, reason="kvstore.core.ckeytable is not built (numpy: a round per level)")
def test_clear_finds_the_ancestors_of_busy_blocks_without_a_step_per_block(ns):
    with TieredStore(StoreConfig(dram_bytes=2048 * BS, dram_page_bytes=2048 * BS)) as st:
        keys = chain(b"deep", 1000)
        st.put(ns, keys, [payload_for(b"t", k, BS) for k in keys])
        tips = [chain(b"tip%d" % i, 1)[0] for i in range(50)]
        for i, k in enumerate(tips):  # 50 leaves hung along the chain, all pinned
            st.put(ns, [k], [payload_for(b"t", k, BS)], parent=keys[20 * i + 19])
        st.pin(ns, tips)
        idx = st.index
        saved = idx.parent
        idx.parent = saved.view(CountingColumn)
        CountingColumn.reads = 0
        try:
            assert st.clear(ns) == 0  # every block of the chain is an ancestor of a pinned tip
        finally:
            idx.parent = saved
        assert CountingColumn.reads < 50, f"{CountingColumn.reads} reads of the parent column"
        assert idx.used_rows().size == 1050
