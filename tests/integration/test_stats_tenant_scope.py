"""``Stats`` with auth on (issue r20, item 1): a tenant's credential gets its
own tenant's figures (lookups, hits, misses, puts, gets, bytes, tier
occupancy, tier hits, evictions, promotions, demotions, checksum failures,
expired reservations and leases, sessions), never another tenant's; the
per-tier capacity stays the daemon's. An admin credential gets the whole
daemon, which is the sum of its tenants. The answer says which scope it is,
and ``kvstore stats`` prints it."""

from __future__ import annotations

import re
from pathlib import Path

import grpc

from kvstore.client import Client, ns_pb
from kvstore.keys import Namespace
from kvstore.results import DaemonStats
from kvstore.tools.format import format_stats
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc
from tests.conftest import payload_for
from tests.support.keys import chain_keys
from tests.support.tenants import ACME, BETA, TENANTS
from tests.support.waits import wait_until
from tiers.base import TierKind

BS = 4096
COUNTERS = ("lookups", "hit_blocks", "miss_blocks", "hit_tokens", "miss_tokens", "puts", "gets",
            "bytes_written", "bytes_read")


def _client(d, token: str) -> Client:
    return Client(d.target, token=token, session=False, use_shm=False)


def _stats(d, token: str) -> DaemonStats:
    with _client(d, token) as c:
        return c.stats()


def _activity(d, ns: Namespace, token: str, seed: int, stored: int, asked: int, read: int, lookups: int) -> None:
    keys = chain_keys(seed, asked, ns)
    with _client(d, token) as c:
        c.put(ns, keys[:stored], [payload_for(ns.tenant.encode(), k, BS) for k in keys[:stored]])
        for _ in range(lookups):
            assert c.lookup(ns, keys).hit_blocks == stored
        assert all(g is not None for g in c.get(ns, keys[:read]))


def test_a_tenant_sees_only_its_own_figures(make_daemon, tmp_path: Path) -> None:
    tf = tmp_path / "tenants.toml"
    tf.write_text(TENANTS)
    d = make_daemon(server__tenants_file=str(tf), dram__capacity="1MiB", dram__page_size="1MiB")
    _activity(d, ACME, "tok-acme", 1, stored=4, asked=6, read=2, lookups=1)
    _activity(d, BETA, "tok-beta", 2, stored=3, asked=3, read=3, lookups=2)
    acme, beta, ops = _stats(d, "tok-acme"), _stats(d, "tok-beta"), _stats(d, "tok-admin")

    want = {"acme": dict(lookups=1, hit_blocks=4, miss_blocks=2, hit_tokens=64, miss_tokens=32, puts=4, gets=2,
                         bytes_written=4 * BS, bytes_read=2 * BS),
            "beta": dict(lookups=2, hit_blocks=6, miss_blocks=0, hit_tokens=96, miss_tokens=0, puts=3, gets=3,
                         bytes_written=3 * BS, bytes_read=3 * BS)}
    for name, st, blocks, hits in (("acme", acme, 4, 2), ("beta", beta, 3, 3)):
        assert {k: getattr(st, k) for k in COUNTERS} == want[name], name
        dram = st.tier(TierKind.DRAM)
        assert dram is not None
        assert (dram.blocks, dram.used_bytes, dram.hits, dram.evictions) == (blocks, blocks * BS, hits, 0), name
        assert dram.capacity_bytes == ops.tier(TierKind.DRAM).capacity_bytes  # the operator's sizing stays
        assert {n.label.split("/")[0] for n in st.namespaces} == {name}
        assert st.tenant == name
        assert "tenant " + name in format_stats(st.to_dict())
    # the admin sees the whole daemon: the sum of the two tenants
    assert ops.tenant == "" and "all tenants" in format_stats(ops.to_dict())
    for k in COUNTERS:
        assert getattr(ops, k) == getattr(acme, k) + getattr(beta, k), k
    assert ops.tier(TierKind.DRAM).blocks == 7 and ops.tier(TierKind.DRAM).hits == 5

    # evictions: acme fills DRAM (256 slots) past full; each tenant sees its own blocks go
    more = chain_keys(3, 300, ACME)
    with _client(d, "tok-acme") as c:
        for i in range(0, 300, 50):
            c.put(ACME, more[i:i + 50], [payload_for(b"acme", k, BS) for k in more[i:i + 50]])
    acme, beta, ops = _stats(d, "tok-acme"), _stats(d, "tok-beta"), _stats(d, "tok-admin")
    a, b, o = (s.tier(TierKind.DRAM) for s in (acme, beta, ops))
    assert a.evictions == 304 - a.blocks and b.evictions == 3 - b.blocks, (a, b)
    assert o.evictions == a.evictions + b.evictions > 0 and o.blocks == a.blocks + b.blocks
    assert a.used_bytes == a.blocks * BS and b.used_bytes == b.blocks * BS


def _moved(st: DaemonStats) -> tuple[int, int, int]:
    dram = st.tier(TierKind.DRAM)
    return st.bytes_promoted, st.bytes_demoted, dram.demotions if dram is not None else 0


def _settled(d) -> tuple[DaemonStats, DaemonStats, DaemonStats]:
    """(acme's, beta's, the admin's) stats with no move in between: the daemon
    demotes in the background, and its counters only grow, so an admin figure
    read before and after the tenants' unchanged means none moved meanwhile."""
    for _ in range(200):  # bounded: fails only if the daemon never settles
        before = _stats(d, "tok-admin")
        acme, beta, ops = _stats(d, "tok-acme"), _stats(d, "tok-beta"), _stats(d, "tok-admin")
        if _moved(before) == _moved(ops):
            return acme, beta, ops
    raise AssertionError("the daemon kept moving blocks")


def test_a_tenant_sees_its_own_promotions_demotions_and_checksum_failures(make_daemon, tmp_path: Path) -> None:
    """The figures the store once kept only for the whole daemon: blocks
    demoted from DRAM to SSD, promoted back, and failed checksums are
    counted per namespace, so each tenant sees its own and the admin the sum
    (read with no move in between: ``_settled``)."""
    tf = tmp_path / "tenants.toml"
    tf.write_text(TENANTS)
    d = make_daemon(server__tenants_file=str(tf), dram__capacity="1MiB", dram__page_size="1MiB",
                    ssd__capacity="64MiB", ssd__path=str(tmp_path / "ssd"), ssd__write_mode="through",
                    ssd__admit_min_hits=0)
    bkeys = chain_keys(2, 3, BETA)
    with _client(d, "tok-beta") as c:
        c.put(BETA, bkeys, [payload_for(b"beta", k, BS) for k in bkeys])
    more = chain_keys(3, 400, ACME)  # acme fills DRAM (256 slots): the coldest blocks go down to SSD
    with _client(d, "tok-acme") as c:
        for i in range(0, 400, 50):
            c.put(ACME, more[i:i + 50], [payload_for(b"acme", k, BS) for k in more[i:i + 50]])
    acme, beta, ops = _settled(d)  # the daemon demotes in the background
    a, b, o = (s.tier(TierKind.DRAM) for s in (acme, beta, ops))
    assert o.demotions > 0 and o.demotions == a.demotions + b.demotions, (a, b, o)
    assert a.demotions > 0 and a.promotions == b.promotions == 0

    # each leases its own chain: what went to SSD is promoted into DRAM, counted for its tenant
    with Client(d.target, token="tok-beta") as c:
        down_b = c.lookup(BETA, bkeys).tiers.count(TierKind.SSD)
        with c.acquire(BETA, bkeys) as lease:
            assert lease.tiers == [TierKind.DRAM] * 3
    with Client(d.target, token="tok-acme") as c:
        down_a = c.lookup(ACME, more[:40]).tiers.count(TierKind.SSD)
        assert down_a > 0
        with c.acquire(ACME, more[:40]) as lease:
            assert lease.tiers == [TierKind.DRAM] * 40
        assert c.report_corrupt(ACME, more[39:40]) == 1  # a block its reader found bad
    acme, beta, ops = _settled(d)  # the daemon demotes in the background
    a, b, o = (s.tier(TierKind.DRAM) for s in (acme, beta, ops))
    assert (a.promotions, b.promotions) == (down_a, down_b), (a, b, o)
    assert o.promotions == a.promotions + b.promotions and o.demotions == a.demotions + b.demotions
    assert (acme.checksum_failures, beta.checksum_failures, ops.checksum_failures) == (1, 0, 1)
    assert "tenant acme" in format_stats(acme.to_dict())


def test_a_tenant_sees_its_own_bytes_promoted_and_demoted(make_daemon, tmp_path: Path) -> None:
    """Bytes promoted (read from SSD into DRAM) and bytes demoted (written
    from DRAM to SSD) are counted per namespace: each tenant sees its own
    blocks' bytes, never another's, and the admin's figure is their sum."""
    tf = tmp_path / "tenants.toml"
    tf.write_text(TENANTS)
    d = make_daemon(server__tenants_file=str(tf), dram__capacity="1MiB", dram__page_size="1MiB",
                    ssd__capacity="64MiB", ssd__path=str(tmp_path / "ssd"), ssd__admit_min_hits=0)
    bkeys = chain_keys(2, 3, BETA)
    with _client(d, "tok-beta") as c:
        c.put(BETA, bkeys, [payload_for(b"beta", k, BS) for k in bkeys])
    more = chain_keys(3, 400, ACME)  # acme fills DRAM (256 slots): the coldest blocks, beta's too, go to SSD
    with _client(d, "tok-acme") as c:
        for i in range(0, 400, 50):
            c.put(ACME, more[i:i + 50], [payload_for(b"acme", k, BS) for k in more[i:i + 50]])
    acme, beta, ops = _settled(d)
    a, b = acme.tier(TierKind.DRAM), beta.tier(TierKind.DRAM)
    assert ops.bytes_demoted > 0 and ops.bytes_promoted == 0
    assert (acme.bytes_demoted, beta.bytes_demoted) == (a.demotions * BS, b.demotions * BS), (acme, beta)
    assert beta.bytes_demoted == 3 * BS and acme.bytes_demoted > 0
    assert ops.bytes_demoted == acme.bytes_demoted + beta.bytes_demoted
    assert acme.bytes_promoted == beta.bytes_promoted == 0

    with Client(d.target, token="tok-beta") as c:
        with c.acquire(BETA, bkeys) as lease:
            assert lease.tiers == [TierKind.DRAM] * 3
    acme, beta, ops = _settled(d)
    assert (acme.bytes_promoted, beta.bytes_promoted) == (0, 3 * BS), (acme, beta)
    with Client(d.target, token="tok-acme") as c:
        down_a = c.lookup(ACME, more[:40]).tiers.count(TierKind.SSD)
        assert down_a > 0
        with c.acquire(ACME, more[:40]) as lease:
            assert lease.tiers == [TierKind.DRAM] * 40
    acme, beta, ops = _settled(d)
    assert (acme.bytes_promoted, beta.bytes_promoted) == (down_a * BS, 3 * BS), (acme, beta)
    assert ops.bytes_promoted == acme.bytes_promoted + beta.bytes_promoted
    assert ops.bytes_demoted == acme.bytes_demoted + beta.bytes_demoted


def _expired(st: DaemonStats) -> tuple[int, int]:
    return st.reservations_expired, st.leases_expired


def test_a_tenant_sees_its_own_expired_reservations_and_leases(make_daemon, tmp_path: Path) -> None:
    """Reservations never committed and leases taken without a session expire
    after ``server.reservation_timeout``; each is counted for its tenant, and
    ``Stats`` says so: the tenant sees its own, another tenant none, the admin
    the sum, and ``kvstore stats`` prints them."""
    tf = tmp_path / "tenants.toml"
    tf.write_text(TENANTS)
    d = make_daemon(server__tenants_file=str(tf), dram__capacity="1MiB", dram__page_size="1MiB",
                    server__reservation_timeout=0.2, server__lease_check_interval=0.05)
    _activity(d, BETA, "tok-beta", 2, stored=3, asked=3, read=3, lookups=1)  # inline: nothing to expire
    keys = chain_keys(1, 4, ACME)
    with _client(d, "tok-acme") as c:
        c.put(ACME, keys[:2], [payload_for(b"acme", k, BS) for k in keys[:2]])
        resv = c.reserve(ACME, keys[2:], BS, parent=keys[1])  # never committed
        assert resv.reservation_id
    # a lease taken without a session (this channel never handshakes): expires too
    with grpc.insecure_channel(d.target) as ch:
        lease = pb_grpc.KVStoreStub(ch).Acquire(pb.AcquireRequest(ns=ns_pb(ACME), keys=keys[:2]),
                                                metadata=[("authorization", "Bearer tok-acme")])
    assert lease.lease_id and lease.hit_blocks == 2
    wait_until(lambda: _expired(_stats(d, "tok-acme")) == (1, 1), what="acme's hold to expire")
    acme, beta, ops = _stats(d, "tok-acme"), _stats(d, "tok-beta"), _stats(d, "tok-admin")
    assert _expired(acme) == (1, 1) and _expired(beta) == (0, 0)
    assert _expired(ops) == (1, 1)  # the sum of the tenants
    assert (acme.active_reservations, acme.active_leases) == (0, 0)
    for st in (acme, ops):
        d2 = st.to_dict()
        assert (d2["reservations_expired"], d2["leases_expired"]) == ("1", "1")
        assert DaemonStats.from_dict(d2) == st
        assert re.search(r"^expired reservations / leases +1 / 1$", format_stats(d2), re.M)
    assert re.search(r"^expired reservations / leases +0 / 0$", format_stats(beta.to_dict()), re.M)
