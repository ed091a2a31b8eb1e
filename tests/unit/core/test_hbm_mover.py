"""TieredStore with an HBM tier on the CPU device: placement, demotion to
DRAM (and SSD), promotion, readers, resize, faults. Byte-exact throughout."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from tests.conftest import chain, payload_for  # noqa: E402
from kvstore.errors import CapacityError, InvalidArgument, KeyStatus  # noqa: E402
from kvstore.core.hbm_mover import HbmSpec  # noqa: E402
from kvstore.core.store import StoreConfig, TieredStore  # noqa: E402
from tiers.base import TierKind  # noqa: E402

KIB = 1024
B = 4 * KIB  # payload size: one slot
HBM, DRAM, SSD = TierKind.HBM, TierKind.DRAM, TierKind.SSD


def make(hbm_blocks=8, dram_blocks=32, admit="reserve", copy_fn=None, ssd=None, policy="lru"):
    spec = HbmSpec(hbm_blocks * B, "cpu", admit=admit, page_bytes=B, copy_fn=copy_fn)
    return TieredStore(StoreConfig(dram_bytes=dram_blocks * B, dram_page_bytes=B, hbm=spec, ssd=ssd,
                                   policy=policy))


def pl(ns, keys):
    return [payload_for(b"x", k, B) for k in keys]


def check_all(st, ns, keys):
    got = st.get(ns, keys)
    for k, p, s in zip(keys, got.payloads, got.statuses):
        assert s is KeyStatus.OK, s
        assert bytes(p) == payload_for(b"x", k, B)


def tiers_of(st, ns, keys):
    return st.lookup(ns, keys).tiers


def test_put_asking_for_hbm_lands_there_default_goes_to_dram(ns):
    with make() as st:
        a = chain(b"a", 3)
        assert st.put(ns, a, pl(ns, a), tier=HBM).statuses == [KeyStatus.OK] * 3
        b = chain(b"b", 2)
        st.put(ns, b, pl(ns, b))
        assert tiers_of(st, ns, a) == [HBM] * 3 and tiers_of(st, ns, b) == [DRAM] * 2
        check_all(st, ns, a + b)
        s = {t.tier: t for t in st.stats().tiers}
        assert s[HBM].blocks == 3 and s[HBM].used_bytes == 3 * B and s[HBM].hits == 3
        assert s[DRAM].hits == 2
        st.index.check_invariants()


def test_admit_all_puts_everything_in_hbm(ns):
    with make(admit="all") as st:
        a = chain(b"a", 4)
        st.put(ns, a, pl(ns, a))
        assert tiers_of(st, ns, a) == [HBM] * 4
        st.put(ns, chain(b"d", 1), pl(ns, chain(b"d", 1)), tier=DRAM)  # an explicit tier wins
        assert tiers_of(st, ns, chain(b"d", 1)) == [DRAM]


def test_bad_admit_mode():
    with pytest.raises(InvalidArgument, match="reserve, all"):
        make(admit="sometimes")


def test_eviction_demotes_leaf_first_in_policy_order_byte_exact(ns):
    with make(hbm_blocks=4, admit="all") as st:
        a = chain(b"a", 4)
        st.put(ns, a, pl(ns, a))
        b = chain(b"b", 2)
        st.put(ns, b, pl(ns, b))  # needs 2 slots: the chain a loses its two leaves
        assert tiers_of(st, ns, a) == [HBM, HBM, DRAM, DRAM]
        assert tiers_of(st, ns, b) == [HBM, HBM]
        c = chain(b"c", 1)
        st.get(ns, b)  # b is recently used: a's next leaf goes first
        st.put(ns, c, pl(ns, c))
        assert tiers_of(st, ns, a) == [HBM, DRAM, DRAM, DRAM]
        check_all(st, ns, a + b + c)
        s = {t.tier: t for t in st.stats().tiers}
        assert s[HBM].demotions == 3 and st.counters.evictions[(HBM, "demoted")] == 3
        st.index.check_invariants()


def test_demotion_when_dram_is_full_drops_leaf_first_no_orphans(ns):
    with make(hbm_blocks=2, dram_blocks=2, admit="all") as st:
        keys = chain(b"a", 6)
        for i in range(0, 6, 2):
            st.put(ns, keys[i:i + 2], pl(ns, keys[i:i + 2]), parent=keys[i - 1] if i else None)
        look = st.lookup(ns, keys)
        assert look.hit_blocks >= 2
        st.index.check_invariants()
        # whatever stayed is a chain prefix and reads back exactly
        check_all(st, ns, keys[: look.hit_blocks])
        s = {t.tier: t for t in st.stats().tiers}
        assert s[HBM].blocks + s[DRAM].blocks == look.hit_blocks


def test_batch_larger_than_hbm_goes_to_dram_whole(ns):
    with make(hbm_blocks=2) as st:
        a = chain(b"a", 3)
        st.put(ns, a, pl(ns, a), tier=HBM)
        assert tiers_of(st, ns, a) == [DRAM] * 3


def test_readers_promote_and_demote(ns):
    with make(hbm_blocks=4) as st:
        a = chain(b"a", 3)
        st.put(ns, a, pl(ns, a))
        lease = st.acquire(ns, a, owner="engine", tier=HBM)  # maps HBM: promoted
        assert lease.tier_codes.tolist() == [HBM] * 3
        assert {t.tier: t for t in st.stats().tiers}[HBM].promotions == 3
        hb = st.hbm.tier
        for k, off, n in zip(a, lease.offsets.tolist(), lease.lengths.tolist()):
            assert bytes(hb.view(off, n).numpy()) == payload_for(b"x", k, B)
        # a DRAM-only reader meanwhile: the pinned HBM blocks stay, its lease is empty
        other = st.acquire(ns, a, owner="shm-client")
        assert int((other.offsets >= 0).sum()) == 0
        st.release(lease.handle, "engine")
        other = st.acquire(ns, a, owner="shm-client")  # now they move down for it
        assert other.tier_codes.tolist() == [DRAM] * 3
        for k, off in zip(a, other.offsets.tolist()):
            assert bytes(st.dram.view(off, B)) == payload_for(b"x", k, B)
        st.release(other.handle, "shm-client")
        s = {t.tier: t for t in st.stats().tiers}
        assert s[HBM].hits == 3 and s[DRAM].hits == 3 and s[HBM].demotions == 3
        st.index.check_invariants()


def test_reserve_hbm_engine_writes_commit_hashes_device_bytes(ns):
    with make() as st:
        a = chain(b"a", 2)
        r = st.reserve(ns, a, B, owner="e", tier=HBM)
        assert r.tier_codes.tolist() == [HBM, HBM]
        import torch

        for k, off in zip(a, r.offsets.tolist()):  # the engine's device-to-device copy
            st.hbm.tier.view(off, B).copy_(torch.frombuffer(bytearray(payload_for(b"x", k, B)), dtype=torch.uint8))
        assert st.commit(r.handle, "e").statuses == [KeyStatus.OK] * 2
        check_all(st, ns, a)


def test_reserve_hbm_without_hbm_tier_falls_back_to_dram(ns):
    with TieredStore(StoreConfig(dram_bytes=8 * B, dram_page_bytes=B)) as st:
        r = st.reserve(ns, chain(b"a", 1), B, owner="e", tier=HBM)
        assert r.tier_codes.tolist() == [DRAM]


def test_resize_hbm_shrink_moves_blocks_and_cannot_grow(ns):
    with make(hbm_blocks=8, admit="all") as st:
        a = chain(b"a", 8)
        st.put(ns, a, pl(ns, a))
        st.remove(ns, [a[2]])  # frees a[2:] in the low pages
        b = chain(b"b", 2)
        st.put(ns, b, pl(ns, b))
        left = st.resize(HBM, 4 * B)
        s = {t.tier: t for t in st.stats().tiers}
        assert s[HBM].capacity_bytes == 4 * B
        assert left == 0 and s[HBM].blocks == 4  # all four relocated below the new size
        assert all(o < 4 * B for o in st.index.offsets(st.index.used_rows())[
            st.index.tier[st.index.used_rows()] == HBM].tolist())
        left = st.resize(HBM, 2 * B)  # now two must leave: demoted to DRAM
        assert left == 2 and tiers_of(st, ns, a[:2] + b).count(DRAM) == 2
        check_all(st, ns, a[:2] + b)
        with pytest.raises(InvalidArgument, match="cannot grow"):
            st.resize(HBM, 16 * B)
        st.index.check_invariants()


def test_failed_copy_on_put_is_capacity_and_store_keeps_serving(ns):
    n = {"calls": 0}

    def flaky(dst, src, stream):
        n["calls"] += 1
        if n["calls"] == 2:
            raise RuntimeError("CUDA error: unspecified launch failure")
        dst.copy_(src)

    with make(copy_fn=flaky) as st:
        a = chain(b"a", 3)
        res = st.put(ns, a, pl(ns, a), tier=HBM)
        assert res.statuses == [KeyStatus.OK, KeyStatus.CAPACITY, KeyStatus.CAPACITY]
        assert st.lookup(ns, a).hit_blocks == 1
        st.put(ns, a[1:], pl(ns, a[1:]), parent=a[0], tier=HBM)
        check_all(st, ns, a)
        st.index.check_invariants()


def test_failed_copy_on_demotion_is_a_miss_not_wrong_bytes(ns):
    fail = {"on": False}

    def flaky(dst, src, stream):
        if fail["on"] and dst.device.type == "cpu" and src.data_ptr() != dst.data_ptr():
            if fail["on"] == "once":
                fail["on"] = False
            raise RuntimeError("CUDA error: device-side assert")
        dst.copy_(src)

    with make(hbm_blocks=2, admit="all", copy_fn=flaky) as st:
        a = chain(b"a", 2)
        st.put(ns, a, pl(ns, a))
        fail["on"] = "once"
        b = chain(b"b", 1)
        assert st.put(ns, b, pl(ns, b)).statuses == [KeyStatus.OK]
        # a[1] (the leaf) failed its copy down: dropped, counted; a[0] intact
        assert st.lookup(ns, a).hit_blocks == 1
        assert st.counters.checksum_failures == 1
        check_all(st, ns, a[:1] + b)
        st.index.check_invariants()


def test_three_tiers_hbm_dram_ssd_cascade(ns, tmp_path):
    from kvstore.core.ssd_mover import SsdSpec

    ssd = SsdSpec(path=str(tmp_path / "ssd"), capacity_bytes=1 << 20, admit_min_hits=0, sync=False)
    with make(hbm_blocks=2, dram_blocks=2, admit="all", ssd=ssd) as st:
        keys = chain(b"a", 8)
        for i in range(0, 8, 2):
            st.put(ns, keys[i:i + 2], pl(ns, keys[i:i + 2]), parent=keys[i - 1] if i else None)
        t = tiers_of(st, ns, keys)
        assert len(t) == 8 and set(t) == {HBM, DRAM, SSD}
        assert t[:2] == [SSD, SSD]  # the oldest went down two tiers
        check_all(st, ns, keys)
        lease = st.acquire(ns, keys[:2], owner="o")  # a DRAM reader of the SSD prefix: promoted
        hit = int((lease.offsets >= 0).sum())
        assert hit >= 1 and lease.tier_codes[:hit].tolist() == [DRAM] * hit  # only slots it can map
        for k, off in zip(keys, lease.offsets[:hit].tolist()):
            assert bytes(st.dram.view(off, B)) == payload_for(b"x", k, B)
        st.release(lease.handle, "o")
        st.index.check_invariants()


def test_refusal_at_start_names_both_numbers_and_leaks_no_slab():
    import os

    from kvstore.errors import CapacityError

    probe = lambda dev: (2 * B, 1 << 30)  # noqa: E731
    name = f"kvstore-test-refuse-{os.getpid()}"
    spec = HbmSpec(8 * B, "cpu", page_bytes=B, mem_get_info=probe)
    with pytest.raises(CapacityError) as e:
        TieredStore(StoreConfig(dram_bytes=8 * B, dram_page_bytes=B, shm_name=name, hbm=spec))
    assert str(8 * B) in str(e.value) and str(2 * B) in str(e.value)
    assert not os.path.exists(f"/dev/shm/{name}")  # the DRAM slab made first was removed


def test_spec_from_config():
    from kvstore.config import load_config
    from kvstore.core.hbm_mover import spec_from_config

    assert spec_from_config(load_config(None, {}, {})) is None
    s = spec_from_config(load_config(None, {}, {"hbm.capacity": "8MiB", "hbm.on_cpu": True, "hbm.admit": "all"}))
    assert s is not None and s.device == "cpu" and s.capacity_bytes == 8 << 20 and s.admit == "all"


def test_tenant_over_its_share_of_hbm_is_demoted_first():
    from kvstore.keys import Namespace

    a, b = Namespace(tenant="a", model_id="m", block_size=4), Namespace(tenant="b", model_id="m", block_size=4)
    spec = HbmSpec(4 * B, "cpu", admit="all", page_bytes=B)
    with TieredStore(StoreConfig(dram_bytes=32 * B, dram_page_bytes=B, hbm=spec,
                                 tenant_shares=(("a", 0.5), ("b", 0.5)))) as st:
        ka = [chain(b"a%d" % i, 1)[0] for i in range(3)]  # three one-block chains of tenant a
        for k in ka:
            st.put(a, [k], pl(a, [k]))
        kb = chain(b"b", 1)
        st.put(b, kb, pl(b, kb))
        st.get(a, ka)  # a's blocks are the most recently used ...
        kb2 = chain(b"b2", 1)
        st.put(b, kb2, pl(b, kb2))  # ... but a holds 3/4 > its half: a's block goes down
        assert tiers_of(st, b, kb) == [HBM] and tiers_of(st, b, kb2) == [HBM]
        assert sorted(t for k in ka for t in tiers_of(st, a, [k])) == [HBM, HBM, DRAM]


def test_without_ssd_dram_eviction_leaves_a_block_whose_child_is_in_hbm(ns):
    # nowhere to demote: a DRAM block keeping a child in HBM cannot leave (its
    # drop alone would orphan the child; with it, a hot HBM block would go)
    with make(hbm_blocks=4, dram_blocks=2) as st:
        p = chain(b"p", 2)
        assert st.put(ns, p[:1], pl(ns, p[:1])).statuses == [KeyStatus.OK]
        assert st.put(ns, p[1:], pl(ns, p[1:]), parent=p[0], tier=HBM).statuses == [KeyStatus.OK]
        q = [chain(b"q%d" % i, 1)[0] for i in range(3)]
        for k in q:  # DRAM holds 2: each new block evicts the other q, never p[0]
            assert st.put(ns, [k], pl(ns, [k])).statuses == [KeyStatus.OK]
        assert tiers_of(st, ns, p) == [DRAM, HBM]
        check_all(st, ns, p + q[2:])
        st.index.check_invariants()


def test_demotion_dram_cannot_take_never_drops_a_leased_block_below(ns):
    with make(hbm_blocks=1, dram_blocks=2) as st:
        p = chain(b"p", 2)
        assert st.put(ns, p[:1], pl(ns, p[:1]), tier=HBM).statuses == [KeyStatus.OK]
        assert st.put(ns, p[1:], pl(ns, p[1:]), parent=p[0]).statuses == [KeyStatus.OK]
        q = chain(b"q", 1)
        assert st.put(ns, q, pl(ns, q)).statuses == [KeyStatus.OK]
        assert st.acquire(ns, p[1:], owner="r").statuses == [KeyStatus.OK]  # a reader holds p's DRAM child
        assert st.pin(ns, q).statuses == [KeyStatus.OK]
        r = chain(b"r", 1)  # ... and DRAM is all pinned: p[0] cannot be demoted to make HBM room
        assert st.put(ns, r, pl(ns, r), tier=HBM).statuses == [KeyStatus.CAPACITY]
        assert tiers_of(st, ns, p) == [HBM, DRAM]
        check_all(st, ns, p + q)
        st.index.check_invariants()


def test_hbm_shrink_refuses_while_a_block_below_a_retired_one_is_leased(ns):
    with make(hbm_blocks=2, dram_blocks=1) as st:
        a, b = chain(b"a", 1), chain(b"b", 2)
        assert st.put(ns, a, pl(ns, a), tier=HBM).statuses == [KeyStatus.OK]  # hbm page 0
        assert st.put(ns, b[:1], pl(ns, b[:1]), tier=HBM).statuses == [KeyStatus.OK]  # hbm page 1
        assert st.put(ns, b[1:], pl(ns, b[1:]), parent=b[0]).statuses == [KeyStatus.OK]  # DRAM, full
        assert st.pin(ns, b[1:]).statuses == [KeyStatus.OK]
        with pytest.raises(CapacityError):  # b[0] has nowhere to go: it could only leave with b[1]
            st.resize(HBM, B)
        assert st.tiers[HBM].capacity_bytes == 2 * B
        assert tiers_of(st, ns, a + b) == [HBM, HBM, DRAM]
        check_all(st, ns, a + b)
        st.index.check_invariants()


def test_a_batch_hbm_can_never_hold_demotes_nothing(ns):
    from kvstore.keys import Namespace

    b = Namespace(tenant="b", model_id="m", block_size=4)
    with make(hbm_blocks=4, dram_blocks=16) as st:
        a = [chain(b"a%d" % i, 1)[0] for i in range(4)]
        for k in a:  # tenant ns fills HBM
            assert st.put(ns, [k], pl(ns, [k]), tier=HBM).statuses == [KeyStatus.OK]
        big = chain(b"big", 5)  # more than HBM holds: it goes to DRAM whole ...
        assert st.put(b, big, pl(b, big), tier=HBM).statuses == [KeyStatus.OK] * 5
        assert tiers_of(st, b, big) == [DRAM] * 5
        assert [t for k in a for t in tiers_of(st, ns, [k])] == [HBM] * 4  # ... and moved nobody out of HBM
        assert st.hbm is not None and st.hbm.demoted == 0
        st.index.check_invariants()


def test_failed_ssd_demotion_never_drops_a_leased_or_reserved_hbm_block_below(ns, tmp_path):
    """A DRAM block with HBM children must be demoted to SSD to leave DRAM;
    when that write fails it may be dropped only with an unheld subtree: a
    leased HBM child (read in place) and a reserved one (being written) stay,
    and so does their DRAM parent."""
    import errno

    from kvstore.core.ssd_mover import SsdSpec
    from tests.unit.tiers.test_ssd import FaultyFs

    ssd = SsdSpec(path=str(tmp_path / "ssd"), capacity_bytes=1 << 20, admit_min_hits=0, sync=False,
                  low_watermark=0.0)
    with make(hbm_blocks=2, dram_blocks=2, ssd=ssd) as st:
        p = chain(b"p", 3)
        assert st.put(ns, p[:1], pl(ns, p[:1])).statuses == [KeyStatus.OK]  # DRAM
        assert st.put(ns, p[1:2], pl(ns, p[1:2]), parent=p[0], tier=HBM).statuses == [KeyStatus.OK]
        lease = st.acquire(ns, p[1:2], owner="r", tier=HBM)
        assert lease.statuses == [KeyStatus.OK] and lease.tier_codes[0] == HBM
        resv = st.reserve(ns, p[2:3], B, owner="w", parent=p[0], tier=HBM)
        assert resv.statuses == [KeyStatus.OK] and resv.tier_codes[0] == HBM
        held = [int(lease.offsets[0]), int(resv.offsets[0])]
        assert tiers_of(st, ns, p[:2]) == [DRAM, HBM]
        fs = FaultyFs()
        st.ssd.tier.fs = fs
        fs.fail_write = errno.EIO
        q = chain(b"q", 2)  # DRAM holds 2: p[0] must leave, and its SSD write fails
        st.put(ns, q, pl(ns, q))
        assert st.ssd.write_errors >= 1
        assert tiers_of(st, ns, p[:2]) == [DRAM, HBM]  # nothing under the holders moved or went
        # the held slots were not handed to anyone else
        z = chain(b"z", 2)
        st.put(ns, z, pl(ns, z), tier=HBM)
        rows = st.index.used_rows()
        on_hbm = rows[st.index.tier[rows] == HBM]
        assert sorted(st.index.offsets(on_hbm).tolist()) == sorted(held)
        import torch

        st.hbm.tier.view(held[1], B).copy_(torch.frombuffer(bytearray(pl(ns, p[2:3])[0]), dtype=torch.uint8))
        assert st.commit(resv.handle, "w").statuses == [KeyStatus.OK]
        st.release(lease.handle, "r")
        fs.fail_write = None
        check_all(st, ns, p)
        st.index.check_invariants()


def test_an_hbm_victim_leased_while_dram_makes_room_is_not_moved_from_under_the_reader(ns, tmp_path):
    """Demoting an HBM victim may first demote a DRAM block to SSD, and the
    daemon's disk worker releases the store lock around that write: an HBM
    reader may lease the victim meanwhile. It then stays in HBM (its slot is
    the reader's)."""
    from kvstore.core.ssd_mover import SsdSpec

    ssd = SsdSpec(path=str(tmp_path / "ssd"), capacity_bytes=1 << 20, admit_min_hits=0, sync=False,
                  low_watermark=0.0)
    with make(hbm_blocks=1, dram_blocks=1, ssd=ssd) as st:
        h, d = chain(b"h", 1), chain(b"d", 1)
        assert st.put(ns, h, pl(ns, h), tier=HBM).statuses == [KeyStatus.OK]
        assert st.put(ns, d, pl(ns, d)).statuses == [KeyStatus.OK]
        real = st.ssd.tier.write
        leases = []

        def write_while_an_hbm_reader_leases(*args):  # the loop, while the store lock is released
            if not leases:
                leases.append(st.acquire(ns, h, owner="r", tier=HBM))
            return real(*args)

        st.ssd.tier.write = write_while_an_hbm_reader_leases
        n = chain(b"n", 1)
        assert st.put(ns, n, pl(ns, n), tier=HBM).statuses == [KeyStatus.OK]
        lease = leases[0]
        assert lease.statuses == [KeyStatus.OK] and lease.tier_codes[0] == HBM
        assert tiers_of(st, ns, h) == [HBM]
        got = st.hbm.tier.view(int(lease.offsets[0]), B).cpu()
        assert bytes(got.numpy()) == payload_for(b"x", h[0], B)
        st.release(lease.handle, "r")
        check_all(st, ns, h + n)
        st.index.check_invariants()


def test_a_dram_block_leased_while_hbm_makes_room_for_its_promotion_stays_in_dram(ns, tmp_path):
    """Promoting a DRAM block into HBM may demote an HBM block, which may
    demote a DRAM block to SSD with the store lock released: a DRAM reader
    may lease the block being promoted meanwhile. It then stays in DRAM (its
    slot is that reader's)."""
    from kvstore.core.ssd_mover import SsdSpec

    ssd = SsdSpec(path=str(tmp_path / "ssd"), capacity_bytes=1 << 20, admit_min_hits=0, sync=False,
                  low_watermark=0.0)
    with make(hbm_blocks=1, dram_blocks=2, ssd=ssd) as st:
        v, c, x = chain(b"v", 1), chain(b"c", 1), chain(b"x", 1)
        assert st.put(ns, v, pl(ns, v), tier=HBM).statuses == [KeyStatus.OK]
        assert st.put(ns, x, pl(ns, x)).statuses == [KeyStatus.OK]
        assert st.put(ns, c, pl(ns, c)).statuses == [KeyStatus.OK]
        real = st.ssd.tier.write
        leases = []

        def write_while_a_dram_reader_leases(*args):  # the loop, while the store lock is released
            if not leases:
                leases.append(st.acquire(ns, c, owner="d"))
            return real(*args)

        st.ssd.tier.write = write_while_a_dram_reader_leases
        outer = st.acquire(ns, c, owner="e", tier=HBM)
        assert outer.statuses == [KeyStatus.OK]
        lease = leases[0]
        assert lease.statuses == [KeyStatus.OK] and lease.tier_codes[0] == DRAM
        assert tiers_of(st, ns, c) == [DRAM]
        assert bytes(st.dram.view(int(lease.offsets[0]), B)) == payload_for(b"x", c[0], B)
        st.release(lease.handle, "d")
        st.release(outer.handle, "e")
        check_all(st, ns, c + v)
        st.index.check_invariants()


@pytest.mark.parametrize("leased", [False, True])
def test_dram_shrink_evicts_a_block_with_its_hbm_children_never_a_leased_one(ns, tmp_path, leased):
    """A DRAM shrink that finds no slot for a retired block evicts other DRAM
    blocks; one with a child in HBM goes with its subtree (never leaving an
    orphan), and not at all when a reader leases that child."""
    from kvstore.core.ssd_mover import SsdSpec

    ssd = SsdSpec(path=str(tmp_path / "ssd"), capacity_bytes=1 << 20, admit_min_hits=0, sync=False,
                  low_watermark=0.0)
    with make(hbm_blocks=2, dram_blocks=2, ssd=ssd) as st:
        p, x = chain(b"p", 2), chain(b"x", 1)
        assert st.put(ns, p[:1], pl(ns, p[:1])).statuses == [KeyStatus.OK]  # dram page 0
        assert st.put(ns, p[1:], pl(ns, p[1:]), parent=p[0], tier=HBM).statuses == [KeyStatus.OK]
        assert st.put(ns, x, pl(ns, x)).statuses == [KeyStatus.OK]  # dram page 1, retired below
        check_all(st, ns, x)  # p[0] is the coldest
        lease = st.acquire(ns, p[1:], owner="r", tier=HBM) if leased else None
        st.resize(DRAM, B)
        st.index.check_invariants()
        if leased:
            assert tiers_of(st, ns, p) == [DRAM, HBM]
            check_all(st, ns, p)
            st.release(lease.handle, "r")
        else:
            assert tiers_of(st, ns, p) == [] and tiers_of(st, ns, x) == [DRAM]
            check_all(st, ns, x)
        st.index.check_invariants()
