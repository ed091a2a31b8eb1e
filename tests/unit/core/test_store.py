from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from kvstore.errors import InvalidArgument, KeyStatus, NotFound, PermissionDenied
from kvstore.core.index import keys_to_array
from kvstore.core.store import StoreConfig, TieredStore
from tests.conftest import chain, payload_for
from tiers.base import TierKind

BS = 4096  # payload bytes per block in these tests


def small_store(slots: int = 4, policy: str = "lru", **kw) -> TieredStore:
    return TieredStore(StoreConfig(dram_bytes=slots * BS, dram_page_bytes=slots * BS, policy=policy, **kw))


def P(key: bytes, tag: bytes = b"t") -> bytes:
    return payload_for(tag, key, BS)


def put_chain(st, ns, keys, parent=None, tag=b"t"):
    res = st.put(ns, keys, [P(k, tag) for k in keys], parent=parent)
    return res.statuses


def present(st, ns, keys):
    return [st.lookup(ns, [k]).hit_blocks == 1 for k in keys]


def test_put_get_roundtrip_and_lookup(ns):
    with small_store(8) as st:
        keys = chain(b"a", 5)
        assert put_chain(st, ns, keys) == [KeyStatus.OK] * 5
        look = st.lookup(ns, keys + chain(b"zz", 2))
        assert look.hit_blocks == 5 and look.tiers == [TierKind.DRAM] * 5
        got = st.get(ns, keys)
        assert got.statuses == [KeyStatus.OK] * 5
        assert [p.tobytes() for p in got.payloads] == [P(k) for k in keys]
        # put again: nothing to write
        assert put_chain(st, ns, keys) == [KeyStatus.EXISTS] * 5


def test_namespaces_are_isolated_for_equal_key_bytes(ns, ns2):
    with small_store(8) as st:
        keys = chain(b"a", 2)
        put_chain(st, ns, keys, tag=b"A")
        assert st.lookup(ns2, keys).hit_blocks == 0
        assert st.get(ns2, keys).statuses == [KeyStatus.MISS] * 2
        put_chain(st, ns2, keys, tag=b"B")
        assert st.get(ns, keys).payloads[0].tobytes() == P(keys[0], b"A")
        assert st.get(ns2, keys).payloads[0].tobytes() == P(keys[0], b"B")


def test_parent_must_be_stored(ns):
    with small_store(8) as st:
        keys = chain(b"a", 4)
        res = st.put(ns, keys[2:], [P(k) for k in keys[2:]], parent=keys[1])
        assert res.statuses == [KeyStatus.PARENT_MISSING] * 2
        assert "parent" in res.messages[0]
        put_chain(st, ns, keys[:2])
        assert put_chain(st, ns, keys[2:], parent=keys[1]) == [KeyStatus.OK] * 2
        assert st.lookup(ns, keys).hit_blocks == 4


def test_bad_input_keeps_batch_consistent(ns):
    with small_store(8) as st:
        keys = chain(b"a", 4)
        payloads = [P(k) for k in keys]
        payloads[2] = payloads[2][:100]  # wrong size
        res = st.put(ns, keys, payloads)
        assert res.statuses[:2] == [KeyStatus.OK, KeyStatus.OK]
        assert res.statuses[2] == KeyStatus.INVALID and "4096 bytes" in res.messages[2]
        assert res.statuses[3] == KeyStatus.PARENT_MISSING
        assert st.lookup(ns, keys).hit_blocks == 2
        with pytest.raises(InvalidArgument, match="key 0 must be 16 bytes"):
            st.put(ns, [b"short"], [b"x" * BS])
        with pytest.raises(InvalidArgument, match="2 keys but 1 payloads"):
            st.put(ns, keys[:2], [b"x"])
        # larger than the whole tier
        big = st.put(ns.with_tenant("other"), chain(b"big", 1), [b"x" * (BS * 9)])
        assert big.statuses == [KeyStatus.INVALID] and "larger than" in big.messages[0]
        # wrong-size output buffer on get_into
        r = st.get_into(ns, keys[:1], [bytearray(10)])
        assert r.statuses == [KeyStatus.INVALID]
        st.index.check_invariants()
        assert st.get(ns, keys[:2]).statuses == [KeyStatus.OK] * 2


def test_lru_eviction_order(ns):
    with small_store(4, "lru") as st:
        roots = [chain(bytes([c]), 1)[0] for c in b"ABCD"]
        for k in roots:
            put_chain(st, ns, [k])
        st.get(ns, [roots[0]])  # A is now most recent
        order = []
        for c in b"EFG":
            before = present(st, ns, roots)
            put_chain(st, ns, [chain(bytes([c]), 1)[0]])
            after = present(st, ns, roots)
            order += [i for i in range(4) if before[i] and not after[i]]
        assert order == [1, 2, 3]  # B, C, D; A survives


def test_eviction_is_leaf_first(ns):
    with small_store(4, "lru") as st:
        a = chain(b"A", 3)  # A0 -> A1 -> A2, oldest
        d = chain(b"D", 1)
        put_chain(st, ns, a)
        put_chain(st, ns, d)
        gone = []
        for c in b"EFG":
            before = present(st, ns, a + d)
            put_chain(st, ns, chain(bytes([c]) * 2, 1))
            after = present(st, ns, a + d)
            gone += [i for i in range(4) if before[i] and not after[i]]
            # the chain is only ever cut from its tail
            hit = st.lookup(ns, a).hit_blocks
            assert present(st, ns, a) == [True] * hit + [False] * (3 - hit)
        assert gone == [2, 1, 0]
        st.index.check_invariants()


def test_lfu_eviction_order(ns):
    with small_store(4, "lfu") as st:
        roots = [chain(bytes([c]), 1)[0] for c in b"ABCD"]
        for k in roots:
            put_chain(st, ns, [k])
        for k, n in zip(roots, [3, 1, 2, 0]):
            for _ in range(n):
                st.get(ns, [k])
        e = chain(b"E", 1)
        put_chain(st, ns, e)
        assert present(st, ns, roots) == [True, True, True, False]  # D: 0 hits
        put_chain(st, ns, chain(b"F", 1))
        assert present(st, ns, e) == [False]  # E: 0 hits, older than F
        put_chain(st, ns, chain(b"G", 1))
        # F (0 hits) goes before B (1 hit)
        assert present(st, ns, roots) == [True, True, True, False]
        assert present(st, ns, chain(b"F", 1)) == [False]


def test_cost_policy_keeps_deep_blocks(ns):
    with small_store(4, "cost") as st:
        x = chain(b"X", 3)  # depths 0, 1, 2; older
        y = chain(b"Y", 1)  # depth 0; newer
        put_chain(st, ns, x)
        put_chain(st, ns, y)
        put_chain(st, ns, chain(b"Z", 1))
        # LRU would evict X2 (oldest leaf); cost evicts the shallow Y
        assert present(st, ns, x) == [True, True, True]
        assert present(st, ns, y) == [False]
    with small_store(4, "lru") as st:
        put_chain(st, ns, chain(b"X", 3))
        put_chain(st, ns, chain(b"Y", 1))
        put_chain(st, ns, chain(b"Z", 1))
        assert present(st, ns, chain(b"X", 3)) == [True, True, False]


def test_pinned_blocks_survive_pressure(ns):
    with small_store(4) as st:
        keys = chain(b"P", 4)
        put_chain(st, ns, keys)
        assert st.pin(ns, keys).statuses == [KeyStatus.OK] * 4
        res = st.put(ns, chain(b"Q", 2), [b"x" * BS] * 2)
        assert res.statuses == [KeyStatus.CAPACITY] * 2
        assert st.lookup(ns, keys).hit_blocks == 4
        st.unpin(ns, keys[3:])
        res = st.put(ns, chain(b"Q", 2), [b"x" * BS] * 2)
        assert res.statuses == [KeyStatus.OK, KeyStatus.CAPACITY]
        assert st.lookup(ns, keys).hit_blocks == 3
        assert st.unpin(ns, keys[3:]).statuses == [KeyStatus.MISS]


def test_put_does_not_evict_its_own_parent(ns):
    with small_store(2) as st:
        a = chain(b"A", 2)
        put_chain(st, ns, a[:1])
        put_chain(st, ns, chain(b"B", 1))
        # room for one more: B must go, never A0 (the new block's parent)
        assert put_chain(st, ns, a[1:], parent=a[0]) == [KeyStatus.OK]
        assert st.lookup(ns, a).hit_blocks == 2


def test_checksum_mismatch_is_a_counted_miss(ns):
    with small_store(8) as st:
        keys = chain(b"C", 3)
        put_chain(st, ns, keys)
        row = st.index.find_committed(0, keys_to_array(keys[1:2]))[0]
        st.dram.corrupt_for_test(st.index.offset(row), bit=77)
        got = st.get(ns, keys)
        assert got.statuses[:2] == [KeyStatus.OK, KeyStatus.CORRUPT]
        assert got.payloads[1] is None
        # the child was read before its parent failed: its bytes are still exact
        assert got.payloads[2].tobytes() == P(keys[2])
        assert st.counters.checksum_failures == 1
        # the corrupt block and its subtree are gone; the prefix stays
        assert st.lookup(ns, keys).hit_blocks == 1
        st.index.check_invariants()


def test_two_phase_put_and_leases(ns):
    with small_store(8) as st:
        keys = chain(b"R", 3)
        r = st.reserve(ns, keys, BS, owner="c1")
        assert r.statuses == [KeyStatus.OK] * 3 and r.handle
        assert st.lookup(ns, keys).hit_blocks == 0  # invisible until commit
        for k, s in zip(keys, r.slots):
            st.dram.buf[s.offset : s.offset + s.length] = np.frombuffer(P(k), np.uint8)
        with pytest.raises(PermissionDenied):
            st.commit(r.handle, owner="c2")
        st.commit(r.handle, owner="c1")
        with pytest.raises(NotFound):
            st.commit(r.handle, owner="c1")
        assert st.lookup(ns, keys).hit_blocks == 3
        a = st.acquire(ns, keys + chain(b"nope", 1), owner="c1")
        assert a.statuses == [KeyStatus.OK] * 3 + [KeyStatus.MISS]
        for k, s in zip(keys, a.slots[:3]):
            assert st.dram.buf[s.offset : s.offset + s.length].tobytes() == P(k)
        assert np.all(st.index.pins[st.index.lookup(0, keys_to_array(keys)).rows] == 1)
        with pytest.raises(PermissionDenied):
            st.release(a.handle, owner="c2")
        assert st.release(a.handle, owner="c1") == 3
        with pytest.raises(NotFound):
            st.release(a.handle, owner="c1")


def test_reservations_expire_and_owner_death_is_reclaimed(ns):
    now = [0.0]
    st = TieredStore(StoreConfig(dram_bytes=8 * BS, dram_page_bytes=8 * BS, reservation_timeout=5),
                     clock=lambda: now[0])
    with st:
        r = st.reserve(ns, chain(b"x", 4), BS, owner="dead")
        assert st.dram.used_bytes == 4 * BS
        now[0] = 4.0
        assert st.reap() == 0
        now[0] = 5.0
        assert st.reap() == 1
        assert st.dram.used_bytes == 0
        put_chain(st, ns, chain(b"y", 2))
        st.reserve(ns, chain(b"z", 2), BS, owner="gone")
        st.acquire(ns, chain(b"y", 2), owner="gone")
        assert st.release_owner("gone") == (1, 1)
        assert st.index.pins.sum() == 0 and st.dram.used_bytes == 2 * BS
        with pytest.raises(NotFound):
            st.commit(r.handle, owner="dead")


def test_remove_takes_descendants_and_respects_pins(ns):
    with small_store(8) as st:
        keys = chain(b"M", 4)
        put_chain(st, ns, keys)
        st.pin(ns, keys[3:])
        assert st.remove(ns, keys[1:2]).statuses == [KeyStatus.BUSY]
        st.unpin(ns, keys[3:])
        assert st.remove(ns, keys[1:2]).statuses == [KeyStatus.OK]
        assert st.lookup(ns, keys).hit_blocks == 1
        assert st.dram.used_bytes == BS
        assert st.clear(ns) == 1 and st.dram.used_bytes == 0


def test_events_are_emitted(ns):
    with small_store(2) as st:
        seen = []
        st.subscribe(seen.append)
        keys = chain(b"E", 2)
        put_chain(st, ns, keys)
        put_chain(st, ns, chain(b"F", 1))
        kinds = [(e.kind, len(e.keys), e.reason) for e in seen]
        assert kinds == [("stored", 2, ""), ("removed", 1, "evicted"), ("stored", 1, "")]
        assert seen[0].ns_digest == ns.digest


def test_resize_shrink_keeps_blocks_that_fit(ns):
    st = TieredStore(StoreConfig(dram_bytes=8 * BS, dram_page_bytes=2 * BS))
    with st:
        keys = chain(b"S", 6)
        put_chain(st, ns, keys)
        evicted = st.resize(TierKind.DRAM, 4 * BS)
        assert evicted == 2
        assert st.lookup(ns, keys).hit_blocks == 4
        got = st.get(ns, keys[:4])
        assert [p.tobytes() for p in got.payloads] == [P(k) for k in keys[:4]]
        assert st.dram.capacity_bytes == 4 * BS
        st.resize(TierKind.DRAM, 16 * BS)
        assert put_chain(st, ns, chain(b"T", 10)) == [KeyStatus.OK] * 10
        st.index.check_invariants()


def test_set_policy_keeps_blocks(ns):
    with small_store(4) as st:
        keys = chain(b"K", 4)
        put_chain(st, ns, keys)
        assert st.set_policy("cost") == "lru"
        assert st.lookup(ns, keys).hit_blocks == 4
        with pytest.raises(InvalidArgument, match="allowed: lru, lfu, cost"):
            st.set_policy("fifo")


def test_slab_is_private_and_size_classes_share_pages(ns, ns2):
    st = TieredStore(StoreConfig(dram_bytes=4 * BS, dram_page_bytes=2 * BS))
    with st:
        mode = stat.S_IMODE(os.stat(st.dram.path).st_mode)
        assert mode == 0o600
        # fill with 1-slot blocks, then a 2-slot namespace takes a page over
        put_chain(st, ns, chain(b"a", 4))
        res = st.put(ns2, chain(b"b", 1), [b"y" * (2 * BS)])
        assert res.statuses == [KeyStatus.OK]
        assert st.lookup(ns, chain(b"a", 4)).hit_blocks == 2
        path = st.dram.path
    assert not os.path.exists(path)
