"""The daemon with an HBM tier on the cpu device (hbm.on_cpu): descriptors
over the wire, readers, stats, an engine that dies holding HBM leases, a
failing device copy, and the tier's absence without CUDA."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")

from kvstore.client import Client, ns_pb  # noqa: E402
from kvstore.errors import KeyStatus, Unavailable  # noqa: E402
from kvstore.core.hbm_mover import cuda_device_count  # noqa: E402
from kvstore.keys import Namespace, block_keys  # noqa: E402
from tiers.base import TierKind  # noqa: E402
from proto import kvstore_pb2 as pb  # noqa: E402
from tests.conftest import payload_for  # noqa: E402
from tests.integration.conftest import wait_until  # noqa: E402

NS = Namespace(tenant="t", model_id="m", block_size=16)
BS = 16 * 1024
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def keys_of(seed: int, n: int) -> list[bytes]:
    return block_keys(NS, np.random.default_rng(seed).integers(0, 50000, size=n * 16))


def hbm_daemon(make_daemon, **kw):
    return make_daemon(hbm__capacity="1MiB", hbm__on_cpu=True, hbm__page_size="64KiB", **kw)


def pack(keys: list[bytes]) -> bytes:
    return b"".join(keys)


def put_hbm(d, c: Client, keys: list[bytes]) -> None:
    """Reserve HBM slots over gRPC, write them as an engine would (here: in
    the daemon's process, since a cpu tier cannot be mapped), commit."""
    r = c._call(c.stub.Reserve, pb.ReserveRequest(ns=ns_pb(NS), keys_packed=pack(keys), block_bytes=BS,
                                                  tier=pb.TIER_HBM))
    assert list(r.slots.status) == [pb.STATUS_OK] * len(keys)
    assert list(r.slots.tier) == [pb.TIER_HBM] * len(keys) and r.slots.device == 0

    def write() -> None:
        import torch

        for k, off in zip(keys, r.slots.offset):
            src = torch.frombuffer(bytearray(payload_for(b"h", k, BS)), dtype=torch.uint8)
            d.store.hbm.tier.view(off, BS).copy_(src)

    d.call(write)
    c._call(c.stub.Commit, pb.CommitRequest(reservation_id=r.reservation_id))


def test_handshake_descriptors_readers_and_stats(make_daemon):
    d = hbm_daemon(make_daemon)
    with Client(d.target) as c:
        assert len(c.hbm_regions) == 1
        reg = c.hbm_regions[0]
        assert reg.ipc is False and reg.device_name == "cpu" and reg.size_bytes == 1 << 20 and not reg.ipc_handle
        with pytest.raises(Unavailable, match="hbm.on_cpu"):
            c.map_hbm()
        keys = keys_of(1, 4)
        put_hbm(d, c, keys)
        assert c.lookup(NS, keys).tiers == [TierKind.HBM] * 4
        # an engine that maps HBM gets HBM slots (device id included)
        a = c._call(c.stub.Acquire, pb.AcquireRequest(ns=ns_pb(NS), keys_packed=pack(keys), tier=pb.TIER_HBM))
        assert a.hit_blocks == 4 and list(a.slots.tier) == [pb.TIER_HBM] * 4 and a.slots.device == 0
        c._call(c.stub.Release, pb.ReleaseRequest(lease_id=a.lease_id))
        # inline Get (a remote or simple client) reads HBM blocks in place, byte-exact
        with Client(d.target, use_shm=False) as inline:
            got = inline.get(NS, keys)
        assert [bytes(g) for g in got] == [payload_for(b"h", k, BS) for k in keys]
        assert c.lookup(NS, keys).tiers == [TierKind.HBM] * 4
        # a shared-memory reader gets DRAM slots: the blocks move down for it
        with c.acquire(NS, keys) as lease:
            assert lease.hit_blocks == 4 and lease.tiers == [pb.TIER_DRAM - 1] * 4
            assert [bytes(v) for v in lease.views] == [payload_for(b"h", k, BS) for k in keys]
        st = c.stats()
        tiers = {t.tier: t for t in st.tiers}
        assert TierKind.HBM in tiers
        hb = tiers[TierKind.HBM]
        dr = tiers[TierKind.DRAM]
        assert hb.demotions == 4 and hb.hits == 12 and dr.hits == 0  # found in HBM: HBM's hits, though moved down
        # asking for hbm promotes them back
        a = c._call(c.stub.Acquire, pb.AcquireRequest(ns=ns_pb(NS), keys_packed=pack(keys), tier=pb.TIER_HBM))
        assert list(a.slots.tier) == [pb.TIER_HBM] * 4
        c._call(c.stub.Release, pb.ReleaseRequest(lease_id=a.lease_id))


def test_bad_tier_in_a_request_is_invalid_argument(make_daemon):
    import grpc

    d = hbm_daemon(make_daemon)
    with Client(d.target) as c:
        with pytest.raises(Exception) as e:
            c.stub.Reserve(pb.ReserveRequest(ns=ns_pb(NS), keys_packed=pack(keys_of(2, 1)), block_bytes=BS,
                                             tier=pb.TIER_SSD), metadata=c._md())
        assert isinstance(e.value, grpc.RpcError) and e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_no_cuda_means_no_hbm_tier_said_once(make_daemon, caplog):
    if cuda_device_count() > 0:
        pytest.skip("this machine has CUDA")
    with caplog.at_level(logging.WARNING, logger="kvstore.hbm"):
        d = make_daemon(hbm__capacity="1MiB")
    msgs = [r.getMessage() for r in caplog.records if r.name == "kvstore.hbm"]
    assert len(msgs) == 1 and "hbm tier off" in msgs[0] and "no CUDA device" in msgs[0]
    assert d.store.hbm is None
    with Client(d.target) as c:
        assert c.hbm_regions == []
        k = keys_of(3, 2)
        r = c._call(c.stub.Reserve, pb.ReserveRequest(ns=ns_pb(NS), keys_packed=pack(k), block_bytes=BS,
                                                      tier=pb.TIER_HBM))
        assert list(r.slots.tier) == [pb.TIER_DRAM] * 2  # served from DRAM instead


CHILD = r"""
import sys, time
from kvstore.client import Client, ns_pb
from kvstore.keys import Namespace
from proto import kvstore_pb2 as pb
target, keys_hex, fresh_hex = sys.argv[1], sys.argv[2], sys.argv[3]
ns = Namespace(tenant="t", model_id="m", block_size=16)
keys = bytes.fromhex(keys_hex)
c = Client(target, timeout=30)
a = c._call(c.stub.Acquire, pb.AcquireRequest(ns=ns_pb(ns), keys_packed=keys, tier=pb.TIER_HBM))
r = c._call(c.stub.Reserve, pb.ReserveRequest(ns=ns_pb(ns), keys_packed=bytes.fromhex(fresh_hex),
                                              block_bytes=BS, tier=pb.TIER_HBM))
print("READY", a.hit_blocks, list(a.slots.tier), list(r.slots.tier), flush=True)
time.sleep(600)
""".replace("BS", str(BS))


def test_engine_dying_with_hbm_leases_releases_them_slab_intact(make_daemon):
    d = hbm_daemon(make_daemon, server__lease_check_interval=0.05)
    keys = keys_of(4, 6)
    fresh = keys_of(5, 3)
    with Client(d.target) as c:
        put_hbm(d, c, keys)
        used0 = d.call(lambda: d.store.hbm.tier.used_bytes)
        env = dict(os.environ, PYTHONPATH=ROOT)
        p = subprocess.Popen([sys.executable, "-c", CHILD, d.target, pack(keys).hex(), pack(fresh).hex()],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        try:
            line = p.stdout.readline()
            assert line.startswith("READY 6"), line
            assert f"[{pb.TIER_HBM}, {pb.TIER_HBM}, {pb.TIER_HBM}]" in line  # reserved HBM slots too
            assert d.call(lambda: d.store.hold_counts()) == (1, 1)
            assert d.call(lambda: d.store.hbm.tier.used_bytes) > used0
        finally:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
        wait_until(lambda: d.call(lambda: d.store.hold_counts()) == (0, 0),
                   what="the dead engine's lease and reservation to be reclaimed")
        idx = d.store.index

        def state():
            rows = idx.used_rows()
            return int((idx.pins[rows] > 0).sum()), d.store.hbm.tier.used_bytes

        pinned, used = d.call(state)
        assert pinned == 0 and used == used0  # the aborted reservation's HBM slots came back
        got = c.get(NS, keys)
        assert [bytes(g) for g in got] == [payload_for(b"h", k, BS) for k in keys]
        d.call(idx.check_invariants)


def test_failing_device_copy_is_a_miss_logged_and_daemon_keeps_serving(make_daemon, caplog):
    d = hbm_daemon(make_daemon)
    keys = keys_of(6, 4)
    with Client(d.target) as c:
        put_hbm(d, c, keys)
        calls = {"n": 0}
        orig = d.store.hbm.tier.copy_fn

        def flaky(dst, src, stream):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            orig(dst, src, stream)

        def inject() -> None:
            d.store.hbm.tier.copy_fn = flaky

        d.call(inject)
        with caplog.at_level(logging.ERROR, logger="kvstore.tiers.hbm"):
            with Client(d.target, use_shm=False) as inline:  # the daemon copies out of HBM itself
                statuses = inline.get_into(NS, keys, [np.zeros(BS, np.uint8) for _ in keys])
        assert statuses[:2] == [KeyStatus.OK, KeyStatus.OK]
        assert statuses[2] in (KeyStatus.CORRUPT, KeyStatus.MISS)  # a miss, never wrong bytes
        logged = [r.getMessage() for r in caplog.records if r.name == "kvstore.tiers.hbm"]
        assert any("device cpu" in m and "store stream" in m for m in logged), logged
        assert c.lookup(NS, keys).hit_blocks == 2  # the block (and its descendants) dropped
        # still serving: the same keys can be stored again and read back
        c.put(NS, keys[2:], [payload_for(b"h", k, BS) for k in keys[2:]], parent=keys[1])
        got = c.get(NS, keys)
        assert [bytes(g) for g in got] == [payload_for(b"h", k, BS) for k in keys]
        assert d.call(lambda: d.store.hbm.tier.copy_errors) == 1


def test_client_api_tiers_on_a_cpu_tier(make_daemon):
    from kvstore.errors import InvalidArgument
    from tiers.base import TierKind

    d = hbm_daemon(make_daemon)
    with Client(d.target) as c:
        keys = keys_of(7, 3)
        r = c.reserve(NS, keys, BS, tier="hbm")
        assert r.tiers == [TierKind.HBM] * 3 and r.device == 0
        c.abort(r)
        assert d.call(lambda: d.store.hbm.tier.used_bytes) == 0  # aborted: slots back
        r = c.reserve(NS, keys, BS)  # no tier: DRAM, as before
        assert r.tiers == [TierKind.DRAM] * 3
        c.abort(r)
        with pytest.raises(InvalidArgument, match="hbm, dram"):
            c.reserve(NS, keys, BS, tier="ssd")
        with pytest.raises(Unavailable, match="hbm.on_cpu"):
            c.acquire(NS, keys, tier="hbm")  # cannot map a host tier: a clear error, no call made
