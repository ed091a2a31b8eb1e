"""Granted slots (kvstore/core/grants.py): DRAM slots handed to a writer
ahead of its puts, then named by a granted put. Real stores at a few 4 KiB
blocks; a fake clock makes expiry deterministic."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.checksum import checksum
from kvstore.core.store import StoreConfig, TieredStore
from kvstore.errors import CapacityError, InvalidArgument, KeyStatus, PermissionDenied
from tests.conftest import chain, payload_for
from tiers.base import TierKind

BS = 4096
LIMIT = 1 << 30


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(slots: int = 8, clock: Clock | None = None, page_slots: int = 8) -> TieredStore:
    cfg = StoreConfig(dram_bytes=slots * BS, dram_page_bytes=page_slots * BS, reservation_timeout=30.0)
    return TieredStore(cfg, clock=clock or Clock())


def write(st: TieredStore, locs, keys: list[bytes]) -> list[int]:
    """Write each block into its granted slot, as a client does; their checksums."""
    sums = []
    for loc, k in zip(np.asarray(locs).tolist(), keys):
        data = np.frombuffer(payload_for(b"t", k, BS), np.uint8)
        st.dram.buf[loc : loc + BS] = data
        sums.append(checksum(data))
    return sums


def test_a_granted_put_stores_its_blocks_in_the_slots_it_names(ns):
    with make() as st:
        locs = st.grant(ns, BS, 3, owner="c1", limit=LIMIT)
        assert locs.size == 3 and st.dram.used_bytes == 3 * BS
        assert st.lookup(ns, chain(b"a", 3)).hit_blocks == 0  # a grant is no block
        keys = chain(b"a", 3)
        order = locs[::-1]  # any granted slot, in any order
        res = st.put_granted(ns, keys, BS, order.tolist(), write(st, order, keys), owner="c1")
        assert res.statuses == [KeyStatus.OK] * 3
        assert st.lookup(ns, keys).hit_blocks == 3
        assert [p.tobytes() for p in st.get(ns, keys).payloads] == [payload_for(b"t", k, BS) for k in keys]
        assert st.grants.locs().size == 0 and st.grants.bytes["c1"] == 0
        assert st.dram.used_bytes == 3 * BS
        with pytest.raises(PermissionDenied):  # a slot is used once
            st.put_granted(ns, chain(b"b", 1), BS, [int(locs[0])], [0], owner="c1")


def test_a_put_naming_a_slot_not_granted_to_it_is_refused_whole(ns):
    with make() as st:
        mine = st.grant(ns, BS, 2, owner="c1", limit=LIMIT)
        theirs = st.grant(ns, BS, 1, owner="c2", limit=LIMIT)
        keys = chain(b"a", 2)
        for locs, err in (([int(mine[0]), int(theirs[0])], PermissionDenied),  # another owner's
                          ([int(mine[0]), int(mine[0])], InvalidArgument),  # one slot twice
                          ([int(mine[0]), int(mine[1]) + 64], PermissionDenied),  # not a slot at all
                          ([int(mine[0])], InvalidArgument)):  # a slot short
            with pytest.raises(err):
                st.put_granted(ns, keys, BS, locs, [0] * len(locs), owner="c1")
        with pytest.raises(PermissionDenied):  # granted for 4 KiB blocks, not 8 KiB ones
            st.put_granted(ns, chain(b"z", 1), 2 * BS, [int(mine[0])], [0], owner="c1")
        assert st.lookup(ns, keys).hit_blocks == 0
        assert sorted(st.grants.locs().tolist()) == sorted(mine.tolist() + theirs.tolist())  # nothing taken


def test_slots_of_blocks_not_stored_are_freed(ns):
    with make() as st:
        keys = chain(b"a", 3)
        assert st.put(ns, keys[:1], [payload_for(b"t", keys[0], BS)]).ok
        locs = st.grant(ns, BS, 3, owner="c1", limit=LIMIT)
        res = st.put_granted(ns, keys, BS, locs.tolist(), write(st, locs, keys), owner="c1")
        assert res.statuses == [KeyStatus.EXISTS, KeyStatus.OK, KeyStatus.OK]
        assert st.dram.used_bytes == 3 * BS  # the stored one, and two new blocks: the third slot went back
        orphan = st.grant(ns, BS, 2, owner="c1", limit=LIMIT)
        res = st.put_granted(ns, chain(b"q", 2), BS, orphan.tolist(), [0, 0], owner="c1", parent=b"\x01" * 16)
        assert res.statuses == [KeyStatus.PARENT_MISSING] * 2
        assert st.dram.used_bytes == 3 * BS and st.grants.locs().size == 0


def test_grants_are_bounded_per_owner_and_go_back(ns):
    with make(slots=8) as st:
        assert st.grant(ns, BS, 8, owner="c1", limit=3 * BS).size == 3
        assert st.grant(ns, BS, 1, owner="c1", limit=3 * BS).size == 0  # at its limit
        assert st.grant(ns, BS, 2, owner="c2", limit=3 * BS).size == 2  # another owner has its own
        mine = st.grants.locs()[:3]
        st.grant(ns, BS, 1, owner="c2", limit=3 * BS, returned=mine.tolist())  # not c2's: ignored
        assert st.grants.bytes["c1"] == 3 * BS
        again = st.grant(ns, BS, 2, owner="c1", limit=3 * BS, returned=mine[:2].tolist())
        assert again.size == 2 and st.grants.bytes["c1"] == 3 * BS
        assert st.grants.release("c1") == 3 and st.grants.release("c2") == 3
        assert st.dram.used_bytes == 0


def test_a_grant_evicts_as_a_reserve_of_its_slots_would(ns):
    with make(slots=4) as st:
        keys = chain(b"a", 4)
        for k in keys:
            assert st.put(ns, [k], [payload_for(b"t", k, BS)]).ok
        locs = st.grant(ns, BS, 2, owner="c1", limit=2 * BS)  # evicts two, as a Reserve of two would
        assert locs.size == 2 and st.index.live == 2
        assert [st.lookup(ns, [k]).hit_blocks for k in keys] == [0, 0, 1, 1]  # the least recent went


def test_an_expired_grant_is_freed_and_can_no_longer_be_named(ns):
    clock = Clock()
    with make(clock=clock) as st:
        locs = st.grant(ns, BS, 2, owner="c1", limit=LIMIT)
        clock.now += 29.0
        assert st.reap() == 0 and st.grants.locs().size == 2
        clock.now += 2.0
        assert st.reap() == 2 and st.dram.used_bytes == 0 and st.grants.bytes["c1"] == 0
        with pytest.raises(PermissionDenied):
            st.put_granted(ns, chain(b"a", 1), BS, [int(locs[0])], [0], owner="c1")


def test_a_session_end_frees_its_grants(ns):
    with make() as st:
        st.grant(ns, BS, 3, owner="c1", limit=LIMIT)
        st.release_owner("c1")
        assert st.dram.used_bytes == 0 and st.grants.locs().size == 0


def test_a_grant_of_a_size_the_namespace_does_not_hold_is_refused(ns):
    with make() as st:
        k = chain(b"a", 1)
        assert st.put(ns, k, [payload_for(b"t", k[0], BS)]).ok
        with pytest.raises(InvalidArgument, match="4096"):
            st.grant(ns, 2 * BS, 1, owner="c1", limit=LIMIT)
        with pytest.raises(InvalidArgument):
            st.grant(ns, BS, 0, owner="c1", limit=LIMIT)


def test_a_shrink_waits_for_grants_in_the_retired_region(ns):
    with make(slots=4, page_slots=1) as st:
        locs = st.grant(ns, BS, 4, owner="c1", limit=LIMIT)
        with pytest.raises(CapacityError, match="granted"):
            st.resize(TierKind.DRAM, 2 * BS)
        assert st.grants.locs().size == 4  # refused before anything moved
        st.grants.give_back("c1", locs.tolist())
        st.resize(TierKind.DRAM, 2 * BS)
        assert st.dram.capacity_bytes == 2 * BS
