"""Narrow index columns (issue 18 goal 5): 32-bit access ticks renumbered
before they wrap, 16-bit hits that saturate, 32-bit priorities."""

from __future__ import annotations

import numpy as np

from kvstore.core.index import HITS_MAX, TICK_MAX, BlockIndex, keys_to_array
from kvstore.core.store import StoreConfig, TieredStore
from kvstore.errors import KeyStatus
from tests.conftest import chain, payload_for

BS = 4096


def store(slots: int, policy: str) -> TieredStore:
    return TieredStore(StoreConfig(dram_bytes=slots * BS, dram_page_bytes=slots * BS, policy=policy))


def put(st, ns, keys):
    return st.put(ns, keys, [payload_for(b"t", k, BS) for k in keys]).statuses


def test_columns_are_narrow():
    idx = BlockIndex(16)
    assert idx.last.dtype == np.uint32 and idx.hits.dtype == np.uint16 and idx.prio.dtype == np.float32


def test_lru_order_survives_the_tick_wrapping(ns):
    """Four one-block chains fill the tier; k0 is read again, so k1 is the
    least recent. The clock is then run up to its 32-bit end and k2, k3 read
    across it: the ticks are renumbered, not wrapped, so k1 is still the
    victim of the next put (with wrapped ticks k2 and k3 would look oldest)."""
    with store(4, "lru") as st:
        ks = [chain(bytes([65 + i]), 1)[0] for i in range(5)]
        for k in ks[:4]:
            assert put(st, ns, [k]) == [KeyStatus.OK]
        assert st.get(ns, [ks[0]]).statuses == [KeyStatus.OK]
        now = st.place.ticks(0)
        st.place.ticks(TICK_MAX - now - 1)  # burn the clock to one short of its end
        for k in ks[2:4]:
            assert st.get(ns, [k]).statuses == [KeyStatus.OK]
        rows = st.index.find(st.place.nsid(ns), keys_to_array(ks[:4]))
        last = st.index.last[rows].astype(np.int64)
        assert last.max() < 1000  # renumbered by rank
        assert list(np.argsort(last)) == [1, 0, 2, 3]  # the access order kept
        assert put(st, ns, [ks[4]]) == [KeyStatus.OK]
        assert [st.lookup(ns, [k]).hit_blocks for k in ks] == [1, 0, 1, 1, 1]


def test_hits_saturate_instead_of_wrapping(ns):
    with store(4, "lfu") as st:
        k = chain(b"h", 1)
        assert put(st, ns, k) == [KeyStatus.OK]
        row = st.index.find(st.place.nsid(ns), keys_to_array(k))
        st.index.hits[row] = HITS_MAX - 1
        for _ in range(3):
            assert st.get(ns, k).statuses == [KeyStatus.OK]
        assert int(st.index.hits[row][0]) == HITS_MAX
