"""DRAM <-> SSD movement in the store: demotion, admission, promotion,
prefetch, write-through, restart recovery, corruption on disk."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from kvstore.errors import InvalidArgument, KeyStatus
from kvstore.core.index import keys_to_array
from kvstore.core.store import StoreConfig, TieredStore
from kvstore.core.ssd_mover import SsdSpec
from tests.conftest import chain, payload_for
from tiers.base import TierKind

BS = 4096


def P(k: bytes) -> bytes:
    return payload_for(b"t", k, BS)


def make(tmp_path, dram_slots=4, ssd_blocks=64, **spec) -> TieredStore:
    kw = dict(path=str(tmp_path / "ssd"), capacity_bytes=ssd_blocks * (BS + 88), admit_min_hits=0,
              sync=False, segment_bytes=1 << 20)
    kw.update(spec)
    return TieredStore(StoreConfig(dram_bytes=dram_slots * BS, dram_page_bytes=dram_slots * BS,
                                   ssd=SsdSpec(**kw)))


def drain(st: TieredStore) -> None:
    for _ in range(10_000):
        if not st.background():
            return
    raise AssertionError("background work never settles")


def test_eviction_demotes_to_ssd_and_get_reads_it(tmp_path, ns):
    with make(tmp_path, low_watermark=0.0) as st:
        keys = chain(b"a", 6)
        # a chain longer than DRAM: each put demotes what the next one needs
        for i in range(6):
            res = st.put(ns, keys[i : i + 1], [P(keys[i])], parent=keys[i - 1] if i else None)
            assert res.statuses == [KeyStatus.OK]
        look = st.lookup(ns, keys)
        assert look.hit_blocks == 6
        assert look.tiers.count(TierKind.SSD) == 2 and look.tiers.count(TierKind.DRAM) == 4
        got = st.get(ns, keys)
        assert [g.tobytes() for g in got.payloads] == [P(k) for k in keys]
        st.index.check_invariants()


def test_admission_drops_cold_blocks(tmp_path, ns):
    with make(tmp_path, admit_min_hits=2, low_watermark=0.0) as st:
        cold = [chain(bytes([c]), 1)[0] for c in b"ABCD"]
        for k in cold:
            st.put(ns, [k], [P(k)])
        st.get(ns, cold[:1])  # A is seen twice (put + get)
        st.get(ns, cold[:1])
        for c in b"EFGH":  # push A..D out of DRAM
            k = chain(bytes([c]) * 2, 1)[0]
            st.put(ns, [k], [P(k)])
        tiers = [st.lookup(ns, [k]).tiers for k in cold]
        assert tiers[0] == [TierKind.SSD]
        assert tiers[1:] == [[], [], []]
        assert st.ssd.dropped_cold == 3


def test_acquire_promotes_and_keeps_the_ssd_copy(tmp_path, ns):
    with make(tmp_path, low_watermark=0.0) as st:
        keys = chain(b"p", 4)
        st.put(ns, keys, [P(k) for k in keys])
        other = chain(b"q", 4)
        st.put(ns, other, [P(k) for k in other])  # keys now on SSD
        assert st.lookup(ns, keys).tiers == [TierKind.SSD] * 4
        res = st.acquire(ns, keys, owner="o")
        assert res.statuses == [KeyStatus.OK] * 4
        for off, n, k in zip(res.offsets, res.lengths, keys):
            assert st.dram.buf[off : off + n].tobytes() == P(k)
        assert st.lookup(ns, keys).tiers == [TierKind.DRAM] * 4
        # the hits are the SSD tier's, which held the blocks when asked (they were counted as DRAM's,
        # the tier the promotion had just put them in: SSD's part in serving was invisible)
        hits = {t.tier: t.hits for t in st.stats().tiers}
        assert (hits[TierKind.SSD], hits[TierKind.DRAM]) == (4, 0)
        assert np.all(st.index.ssd_loc[st.index.lookup(0, keys_to_array(keys)).rows] >= 0)
        st.release(res.handle, "o")
        written = st.ssd.bytes_demoted
        st.put(ns, chain(b"r", 4), [P(k) for k in chain(b"r", 4)])  # evicts keys again: no rewrite
        assert st.lookup(ns, keys).tiers == [TierKind.SSD] * 4
        assert st.ssd.bytes_demoted == written  # the kept SSD copies made this eviction free
        st.index.check_invariants()


def test_write_through_restart_recovers_every_block(tmp_path, ns):
    keys = chain(b"w", 5)
    with make(tmp_path, dram_slots=8, write_mode="through") as st:
        st.put(ns, keys, [P(k) for k in keys])
        drain(st)
        assert np.all(st.index.ssd_loc[st.index.used_rows()] >= 0)
    with make(tmp_path, dram_slots=8, write_mode="through") as st:
        assert st.recovery.blocks == 5
        look = st.lookup(ns, keys)
        assert look.hit_blocks == 5 and look.tiers == [TierKind.SSD] * 5
        got = st.get(ns, keys)
        assert [g.tobytes() for g in got.payloads] == [P(k) for k in keys]
        hit, in_dram, queued = st.prefetch(ns, keys)
        assert (hit, in_dram, queued) == (5, 0, 5)
        drain(st)
        assert st.lookup(ns, keys).tiers == [TierKind.DRAM] * 5
        st.index.check_invariants()


def test_bytes_flipped_on_disk_become_misses(tmp_path, ns):
    keys = chain(b"f", 6)
    with make(tmp_path, dram_slots=8, write_mode="through") as st:
        st.put(ns, keys, [P(k) for k in keys])
        drain(st)
    seg = sorted(glob.glob(str(tmp_path / "ssd" / "seg-*.kvs")))[0]
    data = bytearray(open(seg, "rb").read())
    rng = np.random.default_rng(3)
    for off in rng.integers(0, len(data), size=40).tolist():
        data[off] ^= 0xFF
    open(seg, "wb").write(bytes(data))
    with make(tmp_path, dram_slots=8, write_mode="through") as st:
        got = st.get(ns, keys)
        for k, s, p in zip(keys, got.statuses, got.payloads):
            assert (s is KeyStatus.OK and p.tobytes() == P(k)) or (s is not KeyStatus.OK and p is None)
        res = st.acquire(ns, keys, owner="o")
        for i in range(int((res.offsets >= 0).sum())):
            off, n = int(res.offsets[i]), int(res.lengths[i])
            assert st.dram.buf[off : off + n].tobytes() == P(keys[i])
        st.index.check_invariants()


def test_unknown_schema_is_refused(tmp_path, ns):
    with make(tmp_path) as st:
        st.put(ns, chain(b"s", 1), [P(chain(b"s", 1)[0])])
    schema = tmp_path / "ssd" / "SCHEMA"
    schema.write_text(schema.read_text().replace("1", "99"))
    mine = f"kvstore-{os.getuid()}-{os.getpid()}-"  # (other processes' slabs come and go meanwhile)
    before = {n for n in os.listdir("/dev/shm") if n.startswith(mine)}
    with pytest.raises(InvalidArgument, match="schema"):
        make(tmp_path)
    assert {n for n in os.listdir("/dev/shm") if n.startswith(mine)} == before  # the failed start left no slab behind


def test_ssd_capacity_evicts_ssd_leaves(tmp_path, ns):
    with make(tmp_path, dram_slots=2, ssd_blocks=4, low_watermark=0.0) as st:
        for c in range(10):
            k = chain(bytes([c]), 1)
            st.put(ns, k, [P(k[0])])
        assert st.ssd.tier.used_bytes <= 4 * (BS + 88)
        stats = {t.tier: t for t in st.stats().tiers}
        assert stats[TierKind.SSD].blocks <= 4 and stats[TierKind.DRAM].blocks == 2
        st.index.check_invariants()


def test_resize_ssd_shrinks(tmp_path, ns):
    with make(tmp_path, dram_slots=2, ssd_blocks=8, low_watermark=0.0) as st:
        for c in range(10):
            k = chain(bytes([c]), 1)
            st.put(ns, k, [P(k[0])])
        st.resize(TierKind.SSD, 3 * (BS + 88))
        assert st.ssd.tier.used_bytes <= 3 * (BS + 88)
        st.index.check_invariants()


def test_disk_full_drops_demotions_reads_keep_working_and_writes_resume(tmp_path, ns):
    import errno

    from tests.unit.tiers.test_ssd import FaultyFs

    with make(tmp_path, dram_slots=2, low_watermark=0.0) as st:
        fs = FaultyFs()
        st.ssd.tier.fs = fs
        a = chain(b"a", 2)
        st.put(ns, a, [P(k) for k in a])
        fs.fail_write = errno.ENOSPC
        b = chain(b"b", 2)
        assert st.put(ns, b, [P(k) for k in b]).statuses == [KeyStatus.OK] * 2  # DRAM keeps serving
        assert st.ssd.write_errors >= 1
        assert st.lookup(ns, a).hit_blocks == 0  # its demotion failed: dropped, never half-written
        assert [g.tobytes() for g in st.get(ns, b).payloads] == [P(k) for k in b]
        fs.fail_write = None  # space is back
        c = chain(b"c", 2)
        st.put(ns, c, [P(k) for k in c])
        assert st.lookup(ns, b).tiers == [TierKind.SSD] * 2
        assert [g.tobytes() for g in st.get(ns, b).payloads] == [P(k) for k in b]
        st.index.check_invariants()


def test_write_back_of_two_block_sizes_demotes_both(tmp_path, ns, ns2):
    """Background write-back picks DRAM victims of any namespace: blocks of
    two sizes demote in one call, none dropped for the other's size."""
    with TieredStore(StoreConfig(dram_bytes=64 * BS, dram_page_bytes=16 * BS, ssd=SsdSpec(
            path=str(tmp_path / "ssd"), capacity_bytes=256 * (BS + 88), admit_min_hits=0, sync=False,
            segment_bytes=1 << 20, low_watermark=0.99))) as st:
        a, b = chain(b"a", 8), chain(b"b", 8)
        st.put(ns, a, [P(k) for k in a])
        st.put(ns2, b, [payload_for(b"t", k, 2 * BS) for k in b])
        drain(st)
        assert st.ssd.write_errors == 0 and st.ssd.dropped_cold == 0
        assert st.lookup(ns, a).hit_blocks == 8 and st.lookup(ns2, b).hit_blocks == 8
        assert TierKind.SSD in st.lookup(ns, a).tiers + st.lookup(ns2, b).tiers
        assert [g.tobytes() for g in st.get(ns, a).payloads] == [P(k) for k in a]
        assert [g.tobytes() for g in st.get(ns2, b).payloads] == [payload_for(b"t", k, 2 * BS) for k in b]
        st.index.check_invariants()


def test_a_victim_leased_while_its_demotion_writes_is_not_moved_from_under_the_reader(tmp_path, ns):
    """The daemon's disk worker releases the store lock around the SSD
    write; a DRAM hit on the loop may lease a victim meanwhile. The victim
    then stays in DRAM (its slot is the reader's) and keeps its SSD copy."""
    with make(tmp_path, dram_slots=2, low_watermark=0.0) as st:
        a, b = chain(b"a", 1), chain(b"b", 1)
        st.put(ns, a, [P(a[0])])
        st.put(ns, b, [P(b[0])])
        st.get(ns, b)  # a is the coldest: the next put demotes it
        real = st.ssd.tier.write
        leases = []

        def write_while_a_reader_leases(*args):  # what the loop may do while the lock is released
            if not leases:
                leases.append(st.acquire(ns, a, owner="r"))
            return real(*args)

        st.ssd.tier.write = write_while_a_reader_leases
        c = chain(b"c", 1)
        st.put(ns, c, [P(c[0])])
        lease = leases[0]
        assert lease.statuses == [KeyStatus.OK] and lease.tier_codes[0] == TierKind.DRAM
        assert st.lookup(ns, a).tiers == [TierKind.DRAM]
        d = chain(b"d", 1)
        st.put(ns, d, [P(d[0])])  # DRAM is full: whatever it evicts, not the leased slot
        assert bytes(st.dram.view(int(lease.offsets[0]), BS)) == P(a[0])
        st.release(lease.handle, "r")
        for k in a + b + c + d:
            got = st.get(ns, [k])
            assert got.statuses in ([KeyStatus.OK], [KeyStatus.MISS])
            if got.statuses == [KeyStatus.OK]:
                assert got.payloads[0].tobytes() == P(k)
        st.index.check_invariants()
