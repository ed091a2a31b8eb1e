"""Tenant shares under eviction (kvstore/core/placement.py ``select``): one
request that needs several victims at once takes each over-share tenant's
blocks only down to its share, never a tenant below its share while
another (the requester included) is still over it."""

from __future__ import annotations

from kvstore.core.store import StoreConfig, TieredStore
from kvstore.errors import KeyStatus
from kvstore.keys import Namespace
from tests.conftest import chain, payload_for

BS = 4096


def test_a_batched_eviction_stops_at_each_tenants_share():
    a = Namespace(tenant="a", model_id="m", block_size=4)
    b = Namespace(tenant="b", model_id="m", block_size=4)
    cfg = StoreConfig(dram_bytes=10 * BS, dram_page_bytes=10 * BS, tenant_shares=(("a", 0.5), ("b", 0.5)))
    with TieredStore(cfg) as st:
        ka = [chain(b"a%d" % i, 1)[0] for i in range(6)]  # a: 6 of 10 (one over its half), the oldest
        for k in ka:
            assert st.put(a, [k], [payload_for(b"a", k, BS)]).statuses == [KeyStatus.OK]
        kb = [chain(b"b%d" % i, 1)[0] for i in range(4)]
        for k in kb:
            assert st.put(b, [k], [payload_for(b"b", k, BS)]).statuses == [KeyStatus.OK]
        # b asks for 5 slots at once (within its share): 4 + 5 puts b 4 over, a is 1 over
        burst = chain(b"burst", 5)
        assert st.put(b, burst, [payload_for(b"b", k, BS) for k in burst]).statuses == [KeyStatus.OK] * 5
        kept_a = sum(st.lookup(a, [k]).hit_blocks for k in ka)
        kept_b = sum(st.lookup(b, [k]).hit_blocks for k in kb) + st.lookup(b, burst).hit_blocks
        assert (kept_a, kept_b) == (5, 5)  # a lost only its overage; b made the rest of the room
        st.index.check_invariants()
