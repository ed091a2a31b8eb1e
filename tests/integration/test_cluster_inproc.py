"""Cluster behaviour with real daemons in one process (each on its own loop)
and the in-process block transport of ``cluster_fake`` standing in for UCX:
directory publication and lookup, fetch-or-recompute decisions, Acquire that
fetches, faults (dead, paused, corrupt, refused) and membership changes."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvstore.buffers import pack_keys
from kvstore.daemon import peers
from kvstore.client import ns_pb
from kvstore.keys import Namespace, block_keys
from kvstore.results import Counters
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc
from tiers.base import TierKind
from transport.cluster import owners
from tests.faults.faultlib import free_port
from tests.integration import cluster_fake
from tests.integration.conftest import wait_until

NS = Namespace(tenant="acme", model_id="llama", block_size=16)
BLOCK = 64 * 1024


@pytest.fixture(autouse=True)
def fake_transport(monkeypatch):
    monkeypatch.setattr(peers, "transport_factory", cluster_fake.fake_transport)


def chain(n: int, seed: int = 1) -> list[bytes]:
    return block_keys(NS, np.arange(seed * 100000, seed * 100000 + n * NS.block_size) % 30000)


def payloads(keys: list[bytes]) -> list[bytes]:
    return [(k * (BLOCK // 16))[:BLOCK] for k in keys]


class Node:
    def __init__(self, d, md: list[tuple[str, str]] | None = None) -> None:
        self.d = d
        self.md = md or []
        self.ch = grpc.insecure_channel(d.target)
        self.stub = pb_grpc.KVStoreStub(self.ch)

    def put(self, keys: list[bytes]) -> None:
        r = self.stub.Put(pb.PutRequest(ns=ns_pb(NS), keys=keys, payloads=payloads(keys)), timeout=10)
        assert all(x.status == pb.STATUS_OK for x in r.results)

    def lookup(self, keys: list[bytes], **kw) -> pb.LookupResponse:
        return self.stub.Lookup(pb.LookupRequest(ns=ns_pb(NS), keys=keys, cluster=True, **kw), timeout=10)

    def acquire(self, keys: list[bytes]) -> pb.AcquireResponse:
        return self.stub.Acquire(pb.AcquireRequest(ns=ns_pb(NS), keys=keys, promote=True, cluster=True), timeout=10)

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        out: dict[int, bytearray] = {}
        for c in self.stub.Get(pb.GetRequest(ns=ns_pb(NS), keys=keys), timeout=10):
            if c.status == pb.STATUS_OK:
                out.setdefault(c.index, bytearray()).extend(c.data)
        return [bytes(out[i]) if i in out else None for i in range(len(keys))]

    def members(self) -> int:
        return self.stub.Stats(pb.StatsRequest(), metadata=self.md, timeout=10).cluster_members


def static_pair(make_daemon, n: int = 2, md: list[tuple[str, str]] | None = None, **kw):
    ports = [free_port() for _ in range(n)]
    addrs = [f"127.0.0.1:{p}" for p in ports]
    nodes = []
    for i, p in enumerate(ports):
        opts = {"server__port": p, "cluster__mode": "static", "cluster__peers": ",".join(addrs),
                "cluster__allow_insecure_unauthenticated": "true",  # tests on loopback; auth tested apart
                "cluster__probe_interval": "100ms", "cluster__publish_interval": "10ms",
                "cluster__fetch_timeout": "1s", "dram__capacity": "32MiB", "cluster__prefill_tokens_per_s": 10}
        opts.update({k: v for k, v in kw.items() if not k.startswith("n")})
        opts.update(kw.get(f"n{i}", {}))
        nodes.append(Node(make_daemon(**opts), md))
    for nd in nodes:
        wait_until(lambda nd=nd: nd.members() == n, 20, "every peer is live")
    return nodes


def test_block_put_on_one_is_found_and_fetched_by_another(make_daemon):
    a, b = static_pair(make_daemon)
    keys = chain(6)
    a.put(keys)
    wait_until(lambda: b.lookup(keys).remote_blocks == 6, 10, "b's lookup sees a's blocks")
    r = b.lookup(keys)
    assert r.hit_blocks == 0 and r.local_blocks == 0
    assert [loc.tier for loc in r.locations] == [pb.TIER_REMOTE] * 6
    assert {loc.peer for loc in r.locations} == {a.d.daemon.cluster.node_id}
    assert r.decision == pb.CHAIN_DECISION_FETCH and 0 < r.fetch_s < r.recompute_s
    acq = b.acquire(keys)
    assert acq.fetched_blocks == 6 and acq.hit_blocks == 6 and acq.decision == pb.CHAIN_DECISION_FETCH
    # one model: Admit's predictor holds the cluster's cost model, which fitted the fetch end to end
    cost = b.d.daemon.cluster.cost
    assert b.d.daemon.admission.predictor.cost is cost
    assert cost.link(a.d.daemon.cluster.node_id).fetches == 1
    b.stub.Release(pb.ReleaseRequest(lease_id=acq.lease_id), timeout=10)
    assert b.get(keys) == payloads(keys)  # byte-exact
    assert b.lookup(keys).decision == pb.CHAIN_DECISION_LOCAL
    text = b.d.daemon.metrics.render().decode()
    assert f'kvstore_peer_fetch_blocks_total{{peer="{a.d.daemon.cluster.node_id}"}} 6.0' in text
    assert 'kvstore_cluster_decisions_total{kind="fetch"}' in text
    # a's leases for the send were released
    assert a.d.call(lambda: a.d.store.stats().leases) == 0


def test_blocks_served_stay_pinned_past_the_longest_time_a_request_is_served(make_daemon):
    """A peer's request names its own deadline; the block server serves it
    for at most ``serve_s`` (+ under 1 s of slack), and the lease pinning the
    blocks served must outlast that: otherwise a peer that delays its GO past
    the lease gets a reaped, reused slot (another block's bytes) sent."""
    import asyncio

    a, _ = static_pair(make_daemon)
    keys = chain(2, seed=11)
    a.put(keys)
    node = a.d.daemon.cluster
    assert node.block_server.max_wait_s == node.serve_s
    assert node.block_server.max_requests == node.cfg.peer_max_requests == 64
    assert node.block_server.max_connections == node.cfg.peer_max_connections == 256
    hdr = pb.BlockFetchHeader(ns=ns_pb(NS), keys_packed=b"".join(keys), node_id="x").SerializeToString()
    served = asyncio.run_coroutine_threadsafe(node.provide(hdr), a.d.loop).result(10)
    try:
        holds = a.d.store.holds
        left = a.d.call(lambda: [h.deadline - holds.clock() for h in holds.leases.values()])
        assert len(left) == 1 and left[0] > node.serve_s + 1.0
    finally:
        a.d.call(served.release)
    assert a.d.call(lambda: a.d.store.stats().leases) == 0


def test_partial_local_prefix_fetches_only_the_rest(make_daemon):
    a, b = static_pair(make_daemon)
    keys = chain(5, seed=2)
    a.put(keys)
    b.put(keys[:2])
    wait_until(lambda: b.lookup(keys).remote_blocks == 3, 10, "remote tail visible")
    r = b.lookup(keys)
    assert r.local_blocks == 2 and [x.tier for x in r.locations][:2] == [pb.TIER_DRAM] * 2
    acq = b.acquire(keys)
    assert acq.fetched_blocks == 3 and acq.hit_blocks == 5
    b.stub.Release(pb.ReleaseRequest(lease_id=acq.lease_id), timeout=10)
    assert b.get(keys) == payloads(keys)


def test_decision_flips_with_bandwidth_and_prefill_speed(make_daemon):
    # same blocks, same peer: b believes in a 0.001 Gb/s link (recompute), c in
    # the default link and a slow prefill (fetch), d in the same link and a
    # prefill fast enough to beat it (recompute)
    a, b, c, d = static_pair(make_daemon, 4, cluster__probe_links="false",
                             n1={"cluster__peer_bandwidth_gbps": 0.001, "cluster__prefill_tokens_per_s": 20000},
                             n2={"cluster__prefill_tokens_per_s": 10},
                             n3={"cluster__prefill_tokens_per_s": 1e12})
    keys = chain(3, seed=3)
    a.put(keys)
    for n in (b, c, d):
        wait_until(lambda n=n: n.lookup(keys).remote_blocks == 3, 10, "remote blocks visible")
    rb, rc, rd = b.lookup(keys), c.lookup(keys), d.lookup(keys)
    assert rb.decision == pb.CHAIN_DECISION_RECOMPUTE and rb.fetch_s > rb.recompute_s
    assert rc.decision == pb.CHAIN_DECISION_FETCH and rc.fetch_s < rc.recompute_s
    assert rd.decision == pb.CHAIN_DECISION_RECOMPUTE and rd.recompute_s < rd.fetch_s
    assert rc.fetch_s == pytest.approx(rd.fetch_s)  # same link: only the prefill side moved
    # 3 blocks of 64 KiB over 0.001 Gb/s: 1.57 s; 48 tokens at 20000/s: 2.4 ms
    assert rb.fetch_s == pytest.approx(50e-6 + 3 * BLOCK / (0.001e9 / 8), rel=1e-6)
    assert rb.recompute_s == pytest.approx(48 / 20000)
    acq = b.acquire(keys)
    assert acq.fetched_blocks == 0 and acq.hit_blocks == 0 and acq.decision == pb.CHAIN_DECISION_RECOMPUTE
    acq = c.acquire(keys)
    assert acq.fetched_blocks == 3 and acq.decision == pb.CHAIN_DECISION_FETCH
    assert a.lookup(keys).decision == pb.CHAIN_DECISION_LOCAL  # a itself: everything local


def test_corrupt_transfer_is_a_counted_miss(make_daemon):
    a, b = static_pair(make_daemon)
    keys = chain(4, seed=4)
    a.put(keys)
    wait_until(lambda: b.lookup(keys).remote_blocks == 4, 10, "remote blocks visible")
    srv = a.d.daemon.cluster.block_server
    before = b.d.call(lambda: b.d.store.stats().counters.checksum_failures)
    lock, counted = b.d.daemon.disk.lock, []

    class Watched(Counters):  # the disk worker counts failures too, under the store lock
        __slots__ = ()

        def __setattr__(self, name: str, value: object) -> None:
            if name == "checksum_failures":
                counted.append(lock.held())
            super().__setattr__(name, value)

    b.d.daemon.disk.raw.counters.__class__ = Watched
    srv.corrupt = 4  # every block of this fetch is damaged
    acq = b.acquire(keys)  # committed with a's checksums, not hashed on arrival (tests/integration/test_cluster_verify.py)
    assert acq.fetched_blocks == 4
    b.stub.Release(pb.ReleaseRequest(lease_id=acq.lease_id), timeout=10)
    assert b.d.call(lambda: b.d.store.stats().counters.checksum_failures) == before
    assert b.get(keys) == [None] * 4  # the first read finds them: never a damaged block's bytes
    assert b.d.call(lambda: b.d.store.stats().counters.checksum_failures) == before + 4
    assert counted and all(counted)
    srv.corrupt = 0
    acq = b.acquire(keys)  # the next transfer is clean: fetched after all
    assert acq.fetched_blocks == 4


def test_dead_and_paused_peers_are_misses_within_the_deadline(make_daemon):
    import time

    a, b = static_pair(make_daemon)
    keys = chain(3, seed=5)
    a.put(keys)
    wait_until(lambda: b.lookup(keys).remote_blocks == 3, 10, "remote blocks visible")
    srv = a.d.daemon.cluster.block_server
    srv.paused = True
    t0 = time.monotonic()
    acq = b.acquire(keys)
    assert acq.hit_blocks == 0 and acq.fetched_blocks == 0
    assert time.monotonic() - t0 < 1.0 + 2.0  # fetch_timeout 1s, plus slack
    srv.paused = False
    assert b.d.call(lambda: b.d.store.stats().reservations) == 0  # the fetch's slots were aborted
    a_id = a.d.daemon.cluster.node_id
    a.d.stop()  # the peer dies
    acq = b.acquire(keys)
    assert acq.hit_blocks == 0
    wait_until(lambda: b.members() == 1, 10, "the dead peer leaves the static membership")
    assert a_id not in b.d.call(lambda: b.d.daemon.cluster.table.nodes())
    r = b.lookup(keys)
    assert r.remote_blocks == 0 and r.decision == pb.CHAIN_DECISION_LOCAL


def test_fetch_is_sized_once_the_namespace_has_a_size_here(make_daemon):
    """A namespace this node has never stored: the fetch asks the peer's
    lengths first (a first reservation fixes the namespace's block size, so
    it must be the real one). Once it has a size here, the fetch asks in one
    round trip, its slots reserved before the peer answers."""
    a, b = static_pair(make_daemon)
    keys = chain(4, seed=8)
    a.put(keys)
    wait_until(lambda: b.lookup(keys).remote_blocks == 4, 10, "remote blocks visible")
    transport = b.d.daemon.cluster.block_client
    acq = b.acquire(keys[:2])
    assert acq.fetched_blocks == 2 and transport.sized == 0
    b.stub.Release(pb.ReleaseRequest(lease_id=acq.lease_id), timeout=10)
    acq = b.acquire(keys)
    assert acq.fetched_blocks == 2 and acq.hit_blocks == 4 and transport.sized == 1
    b.stub.Release(pb.ReleaseRequest(lease_id=acq.lease_id), timeout=10)
    assert b.get(keys) == payloads(keys)
    assert b.d.call(lambda: b.d.store.stats().reservations) == 0


def test_stale_directory_entry_is_a_clean_miss(make_daemon):
    a, b = static_pair(make_daemon)
    keys = chain(3, seed=6)
    a.put(keys)
    wait_until(lambda: b.lookup(keys).remote_blocks == 3, 10, "remote blocks visible")
    a.stub.Remove(pb.RemoveRequest(ns=ns_pb(NS), keys=keys), timeout=10)
    wait_until(lambda: b.lookup(keys).remote_blocks == 0, 10, "the removal reaches the directory")
    # a lost update: the owners still say a holds them
    a_id = a.d.daemon.cluster.node_id
    for n in (a, b):
        n.d.call(lambda n=n: n.d.daemon.cluster.table.add(a_id, NS.digest, keys, BLOCK))
    assert b.lookup(keys).remote_blocks == 3
    acq = b.acquire(keys)
    assert acq.hit_blocks == 0 and acq.fetched_blocks == 0
    assert b.d.call(lambda: b.d.store.stats().reservations) == 0
    assert 'reason="absent"' in b.d.daemon.metrics.render().decode()


def test_namespace_the_caller_may_not_read_is_refused(make_daemon, tmp_path, monkeypatch):
    import asyncio

    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "acme"\ntoken = "t-acme"\n\n'
                       '[[tenant]]\nname = "other"\ntoken = "t-other"\n\n'
                       '[[tenant]]\nname = "cluster"\ntoken = "t-peer"\nadmin = true\n')
    monkeypatch.setenv("KV_TEST_PEER_TOKEN", "t-peer")
    md_acme = [("authorization", "Bearer t-acme")]
    a, b = static_pair(make_daemon, md=md_acme, server__tenants_file=str(tenants),
                       cluster__peer_token_env="KV_TEST_PEER_TOKEN")
    keys = chain(3, seed=7)
    r = a.stub.Put(pb.PutRequest(ns=ns_pb(NS), keys=keys, payloads=payloads(keys)), metadata=md_acme, timeout=10)
    assert all(x.status == pb.STATUS_OK for x in r.results)
    lk = lambda: b.stub.Lookup(pb.LookupRequest(ns=ns_pb(NS), keys=keys, cluster=True),  # noqa: E731
                               metadata=md_acme, timeout=10)
    wait_until(lambda: lk().remote_blocks == 3, 10, "remote blocks visible")
    # the cluster RPCs need the admin (peer) token
    with pytest.raises(grpc.RpcError) as ei:
        pb_grpc.ClusterStub(b.ch).Locate(pb.LocateRequest(ns_digest=NS.digest, keys_packed=b"".join(keys)),
                                         metadata=md_acme, timeout=5)
    assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # another tenant's credential asking a's transport for acme's blocks: refused
    client = cluster_fake.FakeBlockClient()
    blk = a.d.daemon.cluster.block_address
    got: list = []

    def alloc(lengths):
        got.append(lengths)
        return [None] * len(lengths)

    for cred in ("t-other", "bogus", ""):
        hdr = pb.BlockFetchHeader(ns=ns_pb(NS), credential=cred, keys_packed=b"".join(keys), node_id="x")
        res = asyncio.run(client.fetch(blk, hdr.SerializeToString(), 3, alloc, 2.0))
        assert res.error is not None and "PermissionError" in res.error and not res.ok.any(), cred
    assert got == []  # nothing was offered
    hdr = pb.BlockFetchHeader(ns=ns_pb(NS), credential="t-acme", keys_packed=b"".join(keys), node_id="x")
    res = asyncio.run(client.fetch(blk, b"\xff\xff garbage", 3, alloc, 2.0))
    assert res.error is not None and "ValueError" in res.error
    assert a.d.call(lambda: a.d.store.stats().leases) == 0
    # the owner's own credential through b: fetched
    acq = b.stub.Acquire(pb.AcquireRequest(ns=ns_pb(NS), keys=keys, promote=True, cluster=True),
                         metadata=md_acme, timeout=10)
    assert acq.fetched_blocks == 3


def test_python_client_cluster_lookup_and_acquire(make_daemon):
    from kvstore.client import Client

    a, b = static_pair(make_daemon)
    keys = chain(4, seed=8)
    a.put(keys)
    with Client(b.d.target) as c:
        wait_until(lambda: c.cluster_lookup(NS, keys).remote_blocks == 4, 10, "remote blocks visible")
        cl = c.cluster_lookup(NS, keys)
        assert cl.decision == "fetch" and cl.local_blocks == 0 and cl.fetch_s < cl.recompute_s
        assert [loc.tier for loc in cl.locations] == [TierKind.REMOTE] * 4
        with c.acquire(NS, keys) as lease:  # without cluster: nothing moves
            assert lease.hit_blocks == 0
        with c.acquire(NS, keys, cluster=True) as lease:
            assert lease.hit_blocks == 4
            assert [bytes(v) for v in lease.views] == payloads(keys)
        assert c.cluster_lookup(NS, keys).decision == "local"


@pytest.mark.parametrize("b_owns", ["some", "none"])
def test_an_acquire_with_its_lookups_hint_fetches_without_locating_again(make_daemon, b_owns):
    """The vLLM connector passes its scheduler's cluster Lookup (peer, run)
    to the worker's Acquire: b then fetches without asking the keys' owners
    where they are. A hint that no longer fits (the local prefix moved, a
    peer that is not live) is ignored: b locates as before. A live peer that
    does not hold the run is a miss, as a stale directory entry is. When b
    owns none of the keys (its directory has no entry for the namespace), it
    knows their size from its Lookup's Locate answers."""
    a, b = static_pair(make_daemon)
    ids = b.d.daemon.cluster.live_ids()
    a_at = ids.index(a.d.daemon.cluster.node_id)

    def keys_of(seed: int) -> list[bytes]:
        return block_keys(NS, np.random.default_rng(seed).integers(0, 30000, 4 * NS.block_size))

    def fits(seed: int) -> bool:
        mine = int((owners(pack_keys(keys_of(seed)), ids) != a_at).sum())
        return (mine == 0) == (b_owns == "none")

    keys = keys_of(next(s for s in range(1000) if fits(s)))
    a.put(keys)
    wait_until(lambda: b.lookup(keys).remote_blocks == 4, 10, "remote blocks visible")
    node = b.d.daemon.cluster  # (its cluster Lookups above located the keys)
    a_id = a.d.daemon.cluster.node_id

    def acquire(peer: str, first: int, run: int) -> pb.AcquireResponse:
        acq = b.stub.Acquire(pb.AcquireRequest(ns=ns_pb(NS), keys=keys, promote=True, cluster=True, peer=peer,
                                               peer_from=first, peer_blocks=run), timeout=10)
        b.stub.Release(pb.ReleaseRequest(lease_id=acq.lease_id), timeout=10)
        return acq

    def drop() -> None:
        b.stub.Remove(pb.RemoveRequest(ns=ns_pb(NS), keys=keys), timeout=10)

    n = node.locates
    acq = acquire(a_id, 0, 4)
    assert acq.fetched_blocks == 4 and acq.hit_blocks == 4 and acq.decision == pb.CHAIN_DECISION_FETCH
    assert node.locates == n  # no Locate
    assert b.get(keys) == payloads(keys)
    drop()
    for stale in ((a_id, 1, 3), ("no-such-node", 0, 4), (a_id, 0, 5), (b.d.daemon.cluster.node_id, 0, 4)):
        n = node.locates
        acq = acquire(*stale)
        assert acq.fetched_blocks == 4 and node.locates == n + 1, stale  # ignored: located as before
        drop()
    b.put(keys[:1])  # the local prefix moved since the lookup: the hint says 0
    n = node.locates
    acq = acquire(a_id, 0, 4)
    assert acq.hit_blocks == 4 and acq.fetched_blocks == 3 and node.locates == n + 1
    drop()
    a.stub.Remove(pb.RemoveRequest(ns=ns_pb(NS), keys=keys[2:]), timeout=10)
    n = node.locates
    acq = acquire(a_id, 0, 4)  # a live peer that holds only the first two: those, then a miss
    assert acq.fetched_blocks == 2 and acq.hit_blocks == 2 and node.locates == n


def test_an_acquire_cancelled_mid_fetch_ends_its_reservation_when_the_transfer_ends(make_daemon):
    """The caller's deadline passes while its Acquire waits on a peer (gRPC
    cancels the handler): the fetch's slots must be ended once the transport
    is done with them (aborted), not left reserved until the reaper frees
    them under receives the transport may still have posted."""
    a, b = static_pair(make_daemon, server__reservation_timeout="120s", cluster__fetch_timeout="4s")
    keys = chain(3, seed=12)
    b.put(chain(1, seed=13))  # b knows the namespace's block size: a sized fetch reserves before it asks
    a.put(keys)
    wait_until(lambda: b.lookup(keys).remote_blocks == 3, 10, "remote blocks visible")
    a.d.daemon.cluster.block_server.paused = True
    with pytest.raises(grpc.RpcError) as e:
        b.stub.Acquire(pb.AcquireRequest(ns=ns_pb(NS), keys=keys, promote=True, cluster=True), timeout=1.0)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert b.d.daemon.cluster.block_client.sized == 1  # it gave up mid-fetch
    # the transport gives up at fetch_timeout (4 s); the reaper would take 120 s
    wait_until(lambda: b.d.call(lambda: b.d.store.stats().reservations) == 0, 30, "the fetch's slots are aborted")
    a.d.daemon.cluster.block_server.paused = False


def test_an_owner_whose_view_flapped_gets_the_entries_it_dropped_back(make_daemon):
    """b answers slowly once: a's probe fails, a drops b and with it every
    directory entry b published to a; b's next probe answer brings b back.
    b saw nothing change (its probes of a kept answering), so nothing made
    it publish its blocks to a again: the blocks of b that a owns stayed
    invisible for good. a's resync after its view changed must get them
    back (the same holds for an owner restarted under the same identity)."""
    a, b = static_pair(make_daemon)
    ids = a.d.daemon.cluster.live_ids()
    a_at = ids.index(a.d.daemon.cluster.node_id)
    chains = (block_keys(NS, np.random.default_rng(s).integers(0, 30000, 3 * NS.block_size)) for s in range(1000))
    keys = next(k for k in chains if (owners(pack_keys(k), ids) == a_at).all())  # a owns every one of them
    b.put(keys)
    wait_until(lambda: a.lookup(keys).remote_blocks == 3, 10, "a's directory has b's blocks")
    b_id = b.d.daemon.cluster.node_id
    node = a.d.daemon.cluster
    # one failed probe round: b left a's view (and its entries with it); the next probe brings b back
    assert b_id not in a.d.call(lambda: (node.membership._set({}), node.table.nodes())[1])
    wait_until(lambda: a.members() == 2, 10, "b is back in a's view")
    wait_until(lambda: a.lookup(keys).remote_blocks == 3, 10, "b's entries are back in a's directory")


def test_a_fetch_header_names_no_metric_series_of_its_own(make_daemon):
    """The node id in a block fetch header is whatever the requester wrote
    (no credential binds it): a label per distinct id would grow the
    metrics registry without bound. Only live members get their own series."""
    import asyncio

    a, b = static_pair(make_daemon)
    keys = chain(2, seed=16)
    a.put(keys)
    node = a.d.daemon.cluster
    for who in [f"made-up-{i}" for i in range(5)] + [b.d.daemon.cluster.node_id]:
        hdr = pb.BlockFetchHeader(ns=ns_pb(NS), keys_packed=b"".join(keys), node_id=who).SerializeToString()
        served = asyncio.run_coroutine_threadsafe(node.provide(hdr), a.d.loop).result(10)
        a.d.call(served.release)
    text = a.d.daemon.metrics.render().decode()
    assert "made-up" not in text
    assert f'kvstore_peer_served_bytes_total{{peer="{b.d.daemon.cluster.node_id}"}}' in text


def test_a_link_probe_needs_the_peers_token(make_daemon, tmp_path, monkeypatch):
    """A link probe (a fetch header with no keys) is a cluster call: it is
    answered only for the cluster's peer (admin) token, as NodeInfo, Locate
    and Publish are; the daemons' own probes carry it and still measure."""
    import asyncio

    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "acme"\ntoken = "t-acme"\n\n'
                       '[[tenant]]\nname = "cluster"\ntoken = "t-peer"\nadmin = true\n')
    monkeypatch.setenv("KV_TEST_PEER_TOKEN", "t-peer")
    a, b = static_pair(make_daemon, md=[("authorization", "Bearer t-peer")], server__tenants_file=str(tenants),
                       cluster__peer_token_env="KV_TEST_PEER_TOKEN", cluster__peer_latency="10s")
    a_id, node = a.d.daemon.cluster.node_id, a.d.daemon.cluster
    wait_until(lambda: b.d.call(lambda: b.d.daemon.cluster.cost.link(a_id).latency_s) < 10, 10,
               "b's probe of a was answered and measured")

    def probe(cred: str):
        hdr = pb.BlockFetchHeader(credential=cred, node_id="x").SerializeToString()
        return asyncio.run_coroutine_threadsafe(node.provide(hdr), a.d.loop).result(10)

    for cred in ("", "bogus", "t-acme"):
        with pytest.raises(PermissionError):
            probe(cred)
    served = probe("t-peer")
    assert served.lengths.size == 0 and served.regions == []


def _record_requests(node: Node) -> list[int]:
    """The bytes each block request of ``node``'s fetches carries (header,
    and 8 per block when sized: what must fit the server's buffer)."""
    client = node.d.daemon.cluster.block_client
    real, sent = client.fetch, []

    async def fetch(address, header, count, alloc, deadline_s, *, sizes=None, **kw):
        sent.append(len(header) + (8 * count if sizes is not None else 0))
        return await real(address, header, count, alloc, deadline_s, sizes=sizes, **kw)

    client.fetch = fetch
    return sent


def test_a_run_longer_than_one_request_carries_is_fetched_in_pieces_in_order(make_daemon, monkeypatch):
    """A remote run whose request would be over the block server's buffer
    (MAX_HEADER, 1 MiB: past ~43,000 blocks sized) was always a miss: the
    transport refused the header. Now the fetch asks in pieces that each fit
    (the limit lowered here: ``fetch_plan.REQUEST_BYTES``) and commits them
    in order, byte for byte."""
    from kvstore.daemon import fetch_plan

    monkeypatch.setattr(fetch_plan, "REQUEST_BYTES", 700)
    a, b = static_pair(make_daemon)
    keys = chain(100, seed=21)
    a.put(keys)
    wait_until(lambda: b.lookup(keys).remote_blocks == 100, 10, "b's lookup sees a's blocks")
    sent = _record_requests(b)
    acq = b.acquire(keys)
    assert acq.fetched_blocks == 100 and acq.hit_blocks == 100, acq
    assert len(sent) >= 3 and max(sent) <= 700, sent
    b.stub.Release(pb.ReleaseRequest(lease_id=acq.lease_id), timeout=10)
    assert b.get(keys) == payloads(keys)
    assert b.d.call(lambda: b.d.store.stats().reservations) == 0
    assert a.d.call(lambda: a.d.store.stats().leases) == 0
    text = b.d.daemon.metrics.render().decode()
    assert f'kvstore_peer_fetch_blocks_total{{peer="{a.d.daemon.cluster.node_id}"}} 100.0' in text


def test_a_later_piece_that_fails_leaves_the_leading_pieces_a_hit(make_daemon, monkeypatch):
    """Prefix semantics across pieces: the pieces before the one that failed
    are committed (a hit), nothing after it is, and no block is wrong."""
    from kvstore.daemon import fetch_plan

    monkeypatch.setattr(fetch_plan, "REQUEST_BYTES", 700)
    a, b = static_pair(make_daemon)
    keys = chain(100, seed=22)
    a.put(keys)
    wait_until(lambda: b.lookup(keys).remote_blocks == 100, 10, "b's lookup sees a's blocks")
    srv, calls = a.d.daemon.cluster.block_server, []
    real = srv.serve

    async def serve(header: bytes):
        calls.append(header)
        if len(calls) == 2:
            raise PermissionError("the second piece is refused")
        return await real(header)

    srv.serve = serve
    sent = _record_requests(b)
    acq = b.acquire(keys)
    first = len(pb.BlockFetchHeader.FromString(calls[0]).keys_packed) // 16
    assert len(sent) == 2 and 0 < first < 100
    assert acq.fetched_blocks == first and acq.hit_blocks == first, acq
    b.stub.Release(pb.ReleaseRequest(lease_id=acq.lease_id), timeout=10)
    assert b.get(keys) == payloads(keys[:first]) + [None] * (100 - first)
    assert b.d.call(lambda: b.d.store.stats().reservations) == 0


def test_a_cluster_daemons_stop_leaves_no_task_pending() -> None:
    """A stop ends the cluster node's own tasks (the publisher, the health
    watch) as it ends the daemon's: it used to cancel them without waiting,
    so a loop closed right after destroyed them pending."""
    import asyncio

    from kvstore.config import load_config
    from kvstore.daemon import server

    port = free_port()
    config = load_config(None, {}, {
        "server.port": port, "metrics.port": 0, "dram.capacity": "16MiB", "cluster.mode": "static",
        "cluster.peers": f"127.0.0.1:{port},127.0.0.1:{free_port()}", "cluster.allow_insecure_unauthenticated": True,
        "cluster.probe_interval": "100ms", "cluster.publish_interval": "10ms"})

    async def run() -> list[str]:
        before = asyncio.all_tasks()
        running = await server.start(config)
        try:
            names = {getattr(t.get_coro(), "__qualname__", "") for t in asyncio.all_tasks() - before}
            assert {"ClusterNode._publisher", "ClusterNode._health_watch"} <= names, names
        finally:
            await running.stop(0)
            running.daemon.store.close()
        return [repr(t) for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()]

    assert asyncio.run(run()) == []


def test_a_peer_of_another_block_wire_version_is_refused_and_its_blocks_are_a_counted_miss(make_daemon):
    """A daemon whose NodeInfo names another block-transport wire version (a
    newer one, mid-upgrade) is not fetched from: the fetch is a miss, counted."""
    import dataclasses

    a, b = static_pair(make_daemon)
    keys = chain(3, seed=9)
    a.put(keys)
    wait_until(lambda: b.lookup(keys).remote_blocks == 3, 10, "remote blocks visible")
    a_id = a.d.daemon.cluster.node_id
    ms = a.d.daemon.cluster.membership
    ms.me = dataclasses.replace(ms.me, wire=99)  # what a daemon of the next wire version reports
    wait_until(lambda: b.d.daemon.cluster.membership.members[a_id].wire == 99, 10, "b probed a again")
    acq = b.acquire(keys)
    assert acq.hit_blocks == 0 and acq.fetched_blocks == 0
    text = b.d.daemon.metrics.render().decode()
    assert f'kvstore_peer_fetch_failures_total{{peer="{a_id}",reason="wire_version"}} 1.0' in text
    r = b.lookup(keys)  # nor is a lookup told to fetch from it
    assert r.remote_blocks == 0 and r.decision != pb.CHAIN_DECISION_FETCH
