"""Holds (kvstore/core/holds.py): the two-phase put (reserve -> commit /
abort), leases (acquire -> release), their expiry and owner checks, explicit
pins, and the reservation surgery the cluster fetch path uses. Real stores at
a few 4 KiB blocks; a fake clock makes expiry deterministic."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.checksum import checksum
from kvstore.core.index import keys_to_array
from kvstore.core.store import StoreConfig, TieredStore
from kvstore.errors import InvalidArgument, KeyStatus, NotFound, PermissionDenied
from tests.conftest import chain, payload_for
from tiers.base import TierKind

BS = 4096


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(slots: int = 4, clock: Clock | None = None, timeout: float = 30.0) -> TieredStore:
    cfg = StoreConfig(dram_bytes=slots * BS, dram_page_bytes=slots * BS, reservation_timeout=timeout)
    return TieredStore(cfg, clock=clock or Clock())


def P(k: bytes) -> bytes:
    return payload_for(b"t", k, BS)


def fill(st: TieredStore, res, keys: list[bytes]) -> None:
    """Write each reserved slot as a client would."""
    for i, k in enumerate(keys):
        off = int(res.offsets[i])
        st.dram.buf[off : off + BS] = np.frombuffer(P(k), np.uint8)


def test_reserved_blocks_are_invisible_until_commit(ns):
    with make() as st:
        keys = chain(b"a", 2)
        res = st.reserve(ns, keys, BS, owner="c1")
        assert res.statuses == [KeyStatus.OK] * 2 and res.handle.startswith("r-")
        assert list(res.tier_codes) == [TierKind.DRAM] * 2 and (res.lengths == BS).all()
        assert st.lookup(ns, keys).hit_blocks == 0
        assert st.reserve(ns, keys, BS, owner="c2").statuses[0] is KeyStatus.BUSY
        fill(st, res, keys)
        assert st.commit(res.handle, "c1").statuses == [KeyStatus.OK] * 2
        assert st.lookup(ns, keys).hit_blocks == 2
        assert [p.tobytes() for p in st.get(ns, keys).payloads] == [P(k) for k in keys]
        with pytest.raises(NotFound):
            st.commit(res.handle, "c1")  # a reservation ends once


def test_commit_with_checksums_and_a_wrong_count(ns):
    with make() as st:
        keys = chain(b"a", 2)
        res = st.reserve(ns, keys, BS, owner="c")
        fill(st, res, keys)
        sums = [checksum(P(k)) for k in keys]
        assert st.commit(res.handle, "c", sums).ok
        assert st.get(ns, keys).statuses == [KeyStatus.OK] * 2
        other = chain(b"b", 2)
        res = st.reserve(ns, other, BS, owner="c")
        with pytest.raises(InvalidArgument):
            st.commit(res.handle, "c", [1])
        # the blocks were dropped with the failed commit: their slots are free again
        assert st.lookup(ns, other).hit_blocks == 0 and st.dram.used_bytes == 2 * BS


def test_a_wrong_checksum_is_a_corrupt_read(ns):
    with make() as st:
        keys = chain(b"a", 1)
        res = st.reserve(ns, keys, BS, owner="c")
        fill(st, res, keys)
        st.commit(res.handle, "c", [checksum(P(keys[0])) ^ 1])
        assert st.get(ns, keys).statuses == [KeyStatus.CORRUPT]
        assert st.lookup(ns, keys).hit_blocks == 0 and st.counters.checksum_failures == 1


def test_abort_frees_the_slots_and_only_the_owner_may_end_a_hold(ns):
    with make() as st:
        keys = chain(b"a", 3)
        res = st.reserve(ns, keys, BS, owner="c1")
        with pytest.raises(PermissionDenied):
            st.commit(res.handle, "c2")
        with pytest.raises(PermissionDenied):
            st.abort(res.handle, "c2")
        assert st.abort(res.handle, "c1") == 3
        assert st.dram.used_bytes == 0 and st.hold_counts() == (0, 0)
        with pytest.raises(NotFound):
            st.abort(res.handle, "c1")


def test_a_lease_pins_its_blocks_against_eviction_and_remove(ns):
    with make(slots=2) as st:
        a = chain(b"a", 1)
        st.put(ns, a, [P(a[0])])
        lease = st.acquire(ns, a + chain(b"x", 1), owner="r")
        assert lease.statuses == [KeyStatus.OK, KeyStatus.MISS]
        assert int(lease.checksums[0]) == checksum(P(a[0]))
        assert st.remove(ns, a).statuses == [KeyStatus.BUSY]
        b, c = chain(b"b", 1), chain(b"c", 1)
        st.put(ns, b, [P(b[0])])
        assert st.put(ns, c, [P(c[0])]).statuses == [KeyStatus.OK]  # evicts b, never the leased a
        assert st.lookup(ns, a).hit_blocks == 1 and st.lookup(ns, b).hit_blocks == 0
        with pytest.raises(PermissionDenied):
            st.release(lease.handle, "other")
        assert st.release(lease.handle, "r") == 1
        assert st.remove(ns, a).statuses == [KeyStatus.OK]


def test_a_block_leased_to_its_limit_is_a_miss_and_its_pin_count_never_wraps(ns, monkeypatch):
    """``pins`` is 16 bits: past ``PINS_LEASED_MAX`` leases a block is a
    miss for the next reader (and every block after it in the chain), its
    count stays below the wrap, and releasing brings it back to 0."""
    import kvstore.core.holds as holds_mod

    monkeypatch.setattr(holds_mod, "PINS_LEASED_MAX", 3)
    with make(slots=4) as st:
        keys = chain(b"p", 2)
        st.put(ns, keys, [P(k) for k in keys])
        leases = [st.acquire(ns, keys, owner="r") for _ in range(3)]
        assert all(le.statuses == [KeyStatus.OK] * 2 for le in leases)
        row = int(st.index.find_committed(st.place.nsid(ns, create=False), keys_to_array(keys[:1]))[0])
        full = st.acquire(ns, keys, owner="r")
        assert full.statuses == [KeyStatus.MISS] * 2 and full.handle == ""
        assert int(st.index.pins[row]) == 3
        for le in leases:
            st.release(le.handle, "r")
        assert int(st.index.pins[row]) == 0
    monkeypatch.undo()
    assert holds_mod.PINS_LEASED_MAX + 1024 == np.iinfo(st.index.pins.dtype).max  # the store's own headroom


def test_acquire_stops_at_the_first_miss(ns):
    with make() as st:
        keys = chain(b"a", 3)
        st.put(ns, keys[:1], [P(keys[0])])
        res = st.acquire(ns, keys, owner="r")
        assert res.statuses == [KeyStatus.OK, KeyStatus.MISS, KeyStatus.MISS]
        assert st.acquire(ns, chain(b"none", 2), owner="r").handle == ""  # nothing held: no lease


def test_reap_expires_reservations_and_ttl_leases_only_after_their_deadline(ns):
    clock = Clock()
    with make(clock=clock, timeout=5.0) as st:
        a, b = chain(b"a", 1), chain(b"b", 1)
        st.put(ns, a, [P(a[0])])
        lease = st.acquire(ns, a, owner="r", ttl=10.0)
        forever = st.acquire(ns, a, owner="r2")
        resv = st.reserve(ns, b, BS, owner="w")
        assert st.hold_counts() == (2, 1)
        clock.now += 4.9
        assert st.reap() == 0
        clock.now += 0.2  # the reservation's deadline passed, not the lease's
        assert st.reap() == 1 and st.hold_counts() == (2, 0)
        assert st.counters.reservations_expired == 1
        with pytest.raises(NotFound):
            st.commit(resv.handle, "w")
        clock.now += 10.0
        assert st.reap() == 1 and st.counters.leases_expired == 1
        with pytest.raises(NotFound):
            st.release(lease.handle, "r")
        assert st.hold_counts() == (1, 0)  # a lease without ttl never expires
        assert st.release(forever.handle, "r2") == 1
        assert int(st.index.pins[st.index.used_rows()].sum()) == 0


def test_release_owner_ends_everything_the_owner_holds(ns):
    with make() as st:
        a = chain(b"a", 1)
        st.put(ns, a, [P(a[0])])
        st.acquire(ns, a, owner="gone")
        st.acquire(ns, a, owner="stays")
        st.reserve(ns, chain(b"b", 1), BS, owner="gone")
        assert st.release_owner("gone") == (1, 1)
        assert st.hold_counts() == (1, 0)
        assert st.release_owner("gone") == (0, 0)


def test_pin_and_unpin(ns):
    with make(slots=1) as st:
        a, b = chain(b"a", 1), chain(b"b", 1)
        st.put(ns, a, [P(a[0])])
        assert st.pin(ns, a + b).statuses == [KeyStatus.OK, KeyStatus.MISS]
        assert st.put(ns, b, [P(b[0])]).statuses == [KeyStatus.CAPACITY]  # the only slot is pinned
        assert st.unpin(ns, a).statuses == [KeyStatus.OK]
        res = st.unpin(ns, a)
        assert res.statuses == [KeyStatus.INVALID] and "not pinned" in res.messages[0]
        assert st.put(ns, b, [P(b[0])]).statuses == [KeyStatus.OK]


def test_truncate_keeps_the_head_of_a_reservation_and_quarantine_keeps_its_slots(ns):
    with make() as st:
        keys = chain(b"a", 3)
        res = st.reserve(ns, keys, BS, owner="f")
        holds = st.holds
        assert holds.reserved_blocks(res.handle) == 3 and holds.reserved_blocks("r-nope") is None
        with pytest.raises(PermissionDenied):
            holds.truncate(res.handle, "other", 1)
        assert holds.truncate(res.handle, "f", 1) == 2
        fill(st, res, keys[:1])
        assert st.commit(res.handle, "f").statuses == [KeyStatus.OK, KeyStatus.MISS, KeyStatus.MISS]
        assert st.lookup(ns, keys).hit_blocks == 1
        other = st.reserve(ns, chain(b"q", 1), BS, owner="f")
        used = st.dram.used_bytes
        assert holds.quarantine(other.handle) and not holds.quarantine(other.handle)
        assert st.dram.used_bytes == used and st.hold_counts() == (0, 0)  # leaked for good, never reused


def test_commit_prefix_commits_the_head_with_given_checksums_and_aborts_the_rest(ns):
    """The fetch path's last step: the blocks that arrived are committed
    with the sender's checksums (not hashed again), the rest dropped."""
    with make() as st:
        keys = chain(b"c", 3)
        res = st.reserve(ns, keys, BS, owner="f")
        fill(st, res, keys[:2])
        sums = [checksum(P(k)) for k in keys]
        assert st.commit_prefix(res.handle, "f", 2, sums) == 2
        assert st.lookup(ns, keys).hit_blocks == 2 and st.hold_counts() == (0, 0)
        assert [bytes(p) for p in st.get(ns, keys[:2]).payloads] == [P(k) for k in keys[:2]]
        # the checksums given are the ones kept: a wrong one makes that block a miss when read
        more = chain(b"d", 2)
        res = st.reserve(ns, more, BS, owner="f")
        fill(st, res, more)
        assert st.commit_prefix(res.handle, "f", 2, [checksum(P(more[0])), 12345]) == 2
        got = st.get(ns, more)
        assert got.statuses[0] is KeyStatus.OK and got.statuses[1] is not KeyStatus.OK
        # keep 0 aborts; an unknown or finished reservation commits nothing
        res = st.reserve(ns, chain(b"e", 1), BS, owner="f")
        assert st.commit_prefix(res.handle, "f", 0) == 0 and st.hold_counts() == (0, 0)
        assert st.commit_prefix(res.handle, "f", 1) == 0 and st.commit_prefix("r-nope", "f", 1) == 0


def test_a_reservation_whose_rows_were_dropped_does_not_end_a_later_one_on_the_same_rows(ns):
    """A corrupt parent drops the reserved child of another writer's
    reservation; the freed row (and slot) go to the next Reserve. The first
    writer's Commit (or Abort, or expiry) must not touch that new
    reservation: its block would show before its bytes are written."""
    with make(slots=4) as st:
        p = chain(b"p", 1)
        r0 = st.reserve(ns, p, BS, owner="c0")
        fill(st, r0, p)
        st.commit(r0.handle, owner="c0")
        a_keys = chain(b"a", 1)
        ra = st.reserve(ns, a_keys, BS, owner="a", parent=p[0])
        assert ra.statuses == [KeyStatus.OK]
        assert st.report_corrupt(ns, p) == 1  # drops p and a's reserved child
        b_keys = chain(b"b", 1)
        rb = st.reserve(ns, b_keys, BS, owner="b")
        assert rb.statuses == [KeyStatus.OK]
        assert st.commit(ra.handle, owner="a").statuses == [KeyStatus.MISS]  # a's block is gone
        assert st.lookup(ns, b_keys).hit_blocks == 0  # b has not committed: not visible
        rb2 = st.reserve(ns, chain(b"c", 1), BS, owner="b")
        assert st.abort(rb2.handle, owner="b") == 1
        fill(st, rb, b_keys)
        assert st.commit(rb.handle, owner="b").statuses == [KeyStatus.OK]
        assert [x.tobytes() for x in st.get(ns, b_keys).payloads] == [P(b_keys[0])]


def test_an_ended_reservation_whose_rows_were_reused_leaves_the_new_one_alone(ns):
    with make(slots=4) as st:
        p = chain(b"p", 1)
        r0 = st.reserve(ns, p, BS, owner="c0")
        fill(st, r0, p)
        st.commit(r0.handle, owner="c0")
        ra = st.reserve(ns, chain(b"a", 1), BS, owner="a", parent=p[0])
        st.report_corrupt(ns, p)
        b_keys = chain(b"b", 1)
        rb = st.reserve(ns, b_keys, BS, owner="b")
        assert st.abort(ra.handle, owner="a") == 1  # its row under the corrupt parent stayed a's
        fill(st, rb, b_keys)
        assert st.commit(rb.handle, owner="b").statuses == [KeyStatus.OK]
        assert st.lookup(ns, b_keys).hit_blocks == 1


def test_a_corrupt_parent_never_hands_a_reserved_slot_to_another_writer(ns):
    """A parent reported corrupt while a writer still fills a reserved child:
    the child's slot must stay that writer's. Were it handed to the next
    Reserve, the first writer's late bytes land in it, and a Commit without
    checksums (the store hashes the slot) makes the other key visible with a
    valid checksum over the wrong bytes."""
    with make(slots=4) as st:
        p = chain(b"p", 1)
        r0 = st.reserve(ns, p, BS, owner="c0")
        fill(st, r0, p)
        st.commit(r0.handle, owner="c0")
        a = chain(b"a", 1)
        ra = st.reserve(ns, a, BS, owner="a", parent=p[0])
        assert st.report_corrupt(ns, p) == 1
        assert st.lookup(ns, p).hit_blocks == 0  # the corrupt block is gone at once
        b = chain(b"b", 2)  # the rest of DRAM: p's and a's slots are held until a ends
        rb = st.reserve(ns, b, BS, owner="b")
        assert rb.statuses == [KeyStatus.OK] * 2
        taken = set(rb.offsets[rb.offsets >= 0].tolist())
        assert int(ra.offsets[0]) not in taken  # a is still writing there
        fill(st, rb, b)
        fill(st, ra, a)  # a's bytes land (late) in its slot
        st.commit(rb.handle, owner="b")  # no checksums: the store hashes the slots
        got = st.get(ns, b)
        for k, s, x in zip(b, got.statuses, got.payloads):
            assert s is not KeyStatus.OK or x.tobytes() == P(k)
        assert st.commit(ra.handle, owner="a").statuses == [KeyStatus.MISS]  # under a corrupt parent
        assert st.lookup(ns, a).hit_blocks == 0
        st.index.check_invariants()
        assert st.stats().tiers[0].used_bytes == sum(1 for s in got.statuses if s is KeyStatus.OK) * BS


def test_expiries_are_counted_for_the_tenant_whose_hold_expired():
    """A tenant's stats count its own expired reservations and leases, never
    another tenant's; the whole store's figures are the sums."""
    from tests.support.tenants import ACME, BETA

    clock = Clock()
    with make(slots=8, clock=clock, timeout=5.0) as st:
        a, b = chain(b"a", 2), chain(b"b", 1)
        st.put(BETA, b, [P(b[0])])
        st.acquire(BETA, b, owner="r", ttl=1.0)
        st.acquire(BETA, b, owner="r2", ttl=1.0)
        st.reserve(ACME, a[:1], BS, owner="w")
        st.reserve(ACME, a[1:], BS, owner="w2")
        st.reserve(BETA, chain(b"c", 1), BS, owner="w3")
        clock.now += 6.0
        assert st.reap() == 5
        acme, beta, whole = (st.stats(t).counters for t in ("acme", "beta", None))
        assert (acme.reservations_expired, acme.leases_expired) == (2, 0)
        assert (beta.reservations_expired, beta.leases_expired) == (1, 2)
        assert whole.reservations_expired == acme.reservations_expired + beta.reservations_expired == 3
        assert whole.leases_expired == acme.leases_expired + beta.leases_expired == 2
