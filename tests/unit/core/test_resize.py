"""Run-time changes (kvstore/core/resize.py): growing and shrinking DRAM and
SSD without losing blocks that still fit, and switching the eviction policy
with every block kept. Real stores at a few 4 KiB blocks."""

from __future__ import annotations

import pytest

from kvstore.core.eviction import PolicyName
from kvstore.core.index import keys_to_array
from kvstore.core.ssd_mover import SsdSpec
from kvstore.core.store import StoreConfig, TieredStore
from kvstore.errors import CapacityError, InvalidArgument, KeyStatus, NotFound
from tests.conftest import chain, payload_for
from tiers.base import TierKind

BS = 4096


def P(k: bytes) -> bytes:
    return payload_for(b"t", k, BS)


def make(slots: int = 8, page_slots: int = 1, **kw) -> TieredStore:
    return TieredStore(StoreConfig(dram_bytes=slots * BS, dram_page_bytes=page_slots * BS, **kw))


def put_each(st: TieredStore, ns, keys: list[bytes]) -> None:
    """Each key a chain of its own (so any of them may be evicted alone)."""
    for k in keys:
        assert st.put(ns, [k], [P(k)]).statuses == [KeyStatus.OK]


def readable(st: TieredStore, ns, keys: list[bytes]) -> list[bytes]:
    got = st.get(ns, keys)
    return [k for k, p in zip(keys, got.payloads) if p is not None and p.tobytes() == P(k)]


def test_grow_dram_keeps_blocks_and_makes_room(ns):
    with make(slots=2) as st:
        keys = [chain(b"k%d" % i, 1)[0] for i in range(4)]
        put_each(st, ns, keys[:2])
        assert st.resize(TierKind.DRAM, 4 * BS) == 0
        assert st.dram.capacity_bytes == 4 * BS
        put_each(st, ns, keys[2:])
        assert readable(st, ns, keys) == keys  # nothing was evicted to store the new two


def test_shrink_dram_moves_blocks_down_and_evicts_only_what_no_longer_fits(ns):
    with make(slots=8) as st:
        keys = [chain(b"k%d" % i, 1)[0] for i in range(6)]
        put_each(st, ns, keys)
        for k in keys[3:]:
            st.get(ns, [k])  # the last three are the most recently used
        evicted = st.resize(TierKind.DRAM, 4 * BS)
        assert evicted == 2 and st.dram.capacity_bytes == 4 * BS
        kept = readable(st, ns, keys)
        assert len(kept) == 4 and set(keys[3:]) <= set(kept)  # LRU order: the cold ones left
        assert all(int(loc) < 4 * BS for loc in st.index.offsets(st.index.used_rows()))
        st.index.check_invariants()


def test_shrink_refuses_while_a_retired_block_is_leased(ns):
    with make(slots=4) as st:
        keys = [chain(b"k%d" % i, 1)[0] for i in range(4)]
        put_each(st, ns, keys)
        top = max(range(4), key=lambda i: int(st.index.offsets(st.index.used_rows())[i]))
        row = st.index.used_rows()[top]
        key = st.index.key_of(int(row))
        lease = st.acquire(ns, [key], owner="r")
        with pytest.raises(CapacityError):
            st.resize(TierKind.DRAM, 2 * BS)
        assert st.dram.capacity_bytes == 4 * BS and len(readable(st, ns, keys)) == 4
        st.release(lease.handle, "r")
        assert st.resize(TierKind.DRAM, 2 * BS) == 2


def pages_of(st: TieredStore, ns, keys: list[bytes]) -> list[int]:
    rows = st.index.find(st.namespace_id(ns), keys_to_array(keys))
    return [st.index.offset(r) // BS for r in rows]


def test_shrink_never_drops_a_leased_block_stored_under_a_retired_one(ns):
    with make(slots=4) as st:
        w = [chain(b"w%d" % i, 1)[0] for i in range(2)]
        put_each(st, ns, w)  # pages 0 and 1, freed below
        c = chain(b"c", 4)
        assert st.put(ns, c[:2], [P(k) for k in c[:2]]).statuses == [KeyStatus.OK] * 2
        assert st.remove(ns, w).statuses == [KeyStatus.OK] * 2
        assert st.put(ns, c[2:], [P(k) for k in c[2:]], parent=c[1]).statuses == [KeyStatus.OK] * 2
        assert pages_of(st, ns, c) == [2, 3, 1, 0]  # the chain's head is in the pages a shrink to 2 retires
        assert st.pin(ns, c[3:]).statuses == [KeyStatus.OK]  # a reader holds the tail (page 0, kept)
        with pytest.raises(CapacityError):  # no room to move the head: it could only leave with the tail
            st.resize(TierKind.DRAM, 2 * BS)
        assert st.dram.capacity_bytes == 4 * BS and readable(st, ns, c) == c
        assert st.unpin(ns, c[3:]).statuses == [KeyStatus.OK]
        assert st.resize(TierKind.DRAM, 2 * BS) == 2  # unheld: the tail leaves, the head moves down
        assert readable(st, ns, c) == c[:2]
        st.index.check_invariants()


def test_shrink_evicts_in_policy_order_when_the_coldest_block_is_being_retired(ns):
    with make(slots=4) as st:
        w0, y, x = (chain(t, 1)[0] for t in (b"w0", b"y", b"x"))
        head, tail = chain(b"hot", 2)
        put_each(st, ns, [w0, y, head, x])  # pages 0..3
        assert st.remove(ns, [w0]).statuses == [KeyStatus.OK]
        assert st.put(ns, [tail], [P(tail)], parent=head).statuses == [KeyStatus.OK]
        assert pages_of(st, ns, [y, head, x, tail]) == [1, 2, 3, 0]
        st.get(ns, [y])
        st.get(ns, [head, tail])  # LRU order, coldest first: x, y, then the hot chain
        assert st.resize(TierKind.DRAM, 2 * BS) == 2
        assert readable(st, ns, [y, head, x, tail]) == [head, tail]  # x and y left, not the hot chain
        st.index.check_invariants()


def test_resize_of_a_tier_that_is_not_configured(ns):
    with make() as st:
        with pytest.raises(NotFound):
            st.resize(TierKind.SSD, 1 << 20)
        with pytest.raises(NotFound):
            st.resize(TierKind.HBM, 1 << 20)


def test_shrink_ssd_evicts_ssd_blocks_down_to_the_new_size(tmp_path, ns):
    rec = BS + 88  # one block on disk: header + payload
    spec = SsdSpec(path=str(tmp_path / "ssd"), capacity_bytes=16 * rec, admit_min_hits=0, sync=False,
                   segment_bytes=1 << 20, low_watermark=0.0)
    with TieredStore(StoreConfig(dram_bytes=2 * BS, dram_page_bytes=2 * BS, ssd=spec)) as st:
        keys = [chain(b"k%d" % i, 1)[0] for i in range(8)]
        put_each(st, ns, keys)  # six of them were demoted to SSD
        assert st.lookup(ns, keys).hit_blocks >= 1
        on_ssd = sum(st.lookup(ns, [k]).tiers == [TierKind.SSD] for k in keys)
        assert on_ssd == 6
        evicted = st.resize(TierKind.SSD, 3 * rec)
        assert st.ssd is not None and st.ssd.tier.used_bytes <= 3 * rec
        assert st.ssd.tier.capacity_bytes <= 3 * rec
        # at least three had to go (victims are taken in batches, so it may be more)
        assert 3 <= evicted <= 6
        assert len(readable(st, ns, keys)) == 8 - evicted  # the two DRAM blocks stay
        st.index.check_invariants()


def _hot_then_cold(st: TieredStore, ns, switch: str = "") -> bool:
    """k0 read often but long ago, k1/k2 read once since; then one new
    block. ``switch`` to lfu "before" or "after" the reads. Returns whether
    k0 survived."""
    keys = [chain(b"k%d" % i, 1)[0] for i in range(3)]
    put_each(st, ns, keys)
    if switch == "before":
        assert st.set_policy("lfu") == "lru"
    for _ in range(5):
        st.get(ns, keys[:1])
    st.get(ns, keys[1:2])
    st.get(ns, keys[2:3])
    if switch == "after":
        assert st.set_policy("lfu") == "lru"
    if switch:
        assert st.policy.name is PolicyName.LFU and st.stats().policy == "lfu"
        assert st.lookup(ns, keys).hit_blocks == 3  # the switch keeps every block
    put_each(st, ns, chain(b"new", 1))
    return st.lookup(ns, keys[:1]).hit_blocks == 1


def test_policy_switch_keeps_blocks_and_changes_the_order(ns):
    with make(slots=3, page_slots=3) as st:
        assert st.policy.name is PolicyName.LRU
        assert not _hot_then_cold(st, ns)  # LRU: the least recent k0 goes
    with make(slots=3, page_slots=3) as st:
        assert _hot_then_cold(st, ns, switch="before")  # LFU: the often-read k0 stays
        with pytest.raises(InvalidArgument):
            st.set_policy("random")
        assert st.policy.name is PolicyName.LFU


def test_a_switch_from_lru_to_lfu_starts_every_count_at_zero(ns):
    """``hits`` is kept only under lfu and cost: reads under lru are not
    counted, so right after a switch lfu ranks by last access (as lru)
    until counts build up; the blocks stay."""
    with make(slots=3, page_slots=3) as st:
        assert not _hot_then_cold(st, ns, switch="after")  # k0's five reads under lru: not counted
        rows = st.index.used_rows()
        assert st.index.kept == frozenset({"hits"})
        assert not st.index.hits[rows].any()
    with make(slots=3, page_slots=3) as st:
        keys = [chain(b"z%d" % i, 1)[0] for i in range(3)]
        put_each(st, ns, keys)
        st.set_policy("lfu")
        st.get(ns, keys[:1])
        row = st.index.find(st.place.nsid(ns), keys_to_array(keys[:1]))
        assert st.index.hits[row].tolist() == [1]  # counted from the switch on
        st.set_policy("lru")
        st.get(ns, keys[:1])
        st.set_policy("lfu")
        assert st.index.hits[row].tolist() == [0]  # a count not kept starts again


def test_the_index_keeps_the_cost_policys_column_only_while_it_runs(ns):
    """``prio`` (cost's GreedyDual value), ``depth`` and ``hits`` are kept
    only under the policies that rank with them: a switch to cost computes
    prio and depth for every block, a switch away stops writing them."""
    with make(slots=3, page_slots=3) as st:
        keys = chain(b"c", 1) + chain(b"d", 2)
        put_each(st, ns, keys[:1])
        assert st.put(ns, keys[1:], [P(k) for k in keys[1:]]).ok
        rows = st.index.find(st.place.nsid(ns), keys_to_array(keys))
        assert st.index.kept == frozenset()  # lru, the default
        st.set_policy("cost")
        assert st.index.kept == frozenset({"hits", "depth", "prio"})
        assert (st.index.prio[rows] > 0).all()  # every block ranked at once
        assert st.index.depth[rows].tolist() == [0, 0, 1]  # depths computed at the switch
        st.index.check_invariants()
        st.set_policy("lfu")
        assert st.index.kept == frozenset({"hits"})
    with make(slots=3, page_slots=3, policy="cost") as st:
        assert st.index.kept == frozenset({"hits", "depth", "prio"})


def test_store_config_accepts_a_policy_name_and_rejects_an_unknown_one():
    assert StoreConfig(policy="cost").policy is PolicyName.COST  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        StoreConfig(policy="fifo")  # type: ignore[arg-type]


def test_a_slab_beyond_what_the_index_can_locate_is_refused_before_anything_is_allocated(ns):
    """The index keeps a slab location in 32 bits of 4 KiB slots: a DRAM or
    HBM tier over 8 TiB is refused at config time (and by a resize), naming
    the limit, and no slab is made."""
    from kvstore.core.hbm_mover import HbmSpec
    from tiers.slots import SLAB_LIMIT

    with pytest.raises(InvalidArgument, match="8 TiB"):
        StoreConfig(dram_bytes=SLAB_LIMIT + (16 << 20))
    with pytest.raises(InvalidArgument, match="8 TiB"):
        HbmSpec(capacity_bytes=SLAB_LIMIT + (16 << 20), device="cpu")
    StoreConfig(dram_bytes=SLAB_LIMIT)  # the largest is allowed
    with make(slots=2) as st:
        with pytest.raises(InvalidArgument, match="8 TiB"):
            st.resize(TierKind.DRAM, SLAB_LIMIT + (16 << 20))
        assert st.dram.capacity_bytes == 2 * BS
