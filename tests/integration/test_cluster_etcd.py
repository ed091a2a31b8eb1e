"""Membership on a real etcd: join and leave, a lease that lapses (a daemon
that stops renewing), etcd down (local serving continues, health says so)
and back. Daemons are in-process; the block transport is the in-process
stand-in (``cluster_fake``)."""

from __future__ import annotations

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.daemon import peers
from proto import kvstore_pb2 as pb
from tests.integration import cluster_fake
from tests.integration.conftest import wait_until
from tests.integration.etcd_fixture import etcd  # noqa: F401  (fixture)
from tests.integration.test_cluster_inproc import Node, chain, payloads


@pytest.fixture(autouse=True)
def fake_transport(monkeypatch):
    monkeypatch.setattr(peers, "transport_factory", cluster_fake.fake_transport)


def etcd_node(make_daemon, etcd, **kw) -> Node:  # noqa: F811
    opts = {"cluster__mode": "etcd", "cluster__etcd_endpoint": etcd.endpoint, "cluster__lease_ttl": "2s",
            "cluster__allow_insecure_unauthenticated": "true",
            "cluster__publish_interval": "10ms", "cluster__fetch_timeout": "1s", "dram__capacity": "32MiB",
            "cluster__prefill_tokens_per_s": 10}
    opts.update(kw)
    return Node(make_daemon(**opts))


def cluster_health(n: Node) -> int:
    return health_pb2_grpc.HealthStub(n.ch).Check(
        health_pb2.HealthCheckRequest(service="kvstore.v1.Cluster"), timeout=5).status


def test_join_fetch_and_leave(make_daemon, etcd):  # noqa: F811
    a = etcd_node(make_daemon, etcd)
    b = etcd_node(make_daemon, etcd)
    wait_until(lambda: a.members() == 2 and b.members() == 2, 20, "both registered")
    keys = chain(4, seed=11)
    a.put(keys)
    wait_until(lambda: b.lookup(keys).remote_blocks == 4, 10, "directory entry published")
    acq = b.acquire(keys)
    assert acq.fetched_blocks == 4
    b.stub.Release(pb.ReleaseRequest(lease_id=acq.lease_id), timeout=10)
    assert b.get(keys) == payloads(keys)
    c = etcd_node(make_daemon, etcd)  # a third joins: ownership moves, entries follow
    wait_until(lambda: all(n.members() == 3 for n in (a, b, c)), 20, "three members")
    wait_until(lambda: c.lookup(keys).remote_blocks == 4, 10, "c finds the blocks after the resync")
    b.d.stop()  # leaves (deregisters)
    wait_until(lambda: a.members() == 2 and c.members() == 2, 20, "b left")
    wait_until(lambda: c.lookup(keys).remote_blocks == 4, 10, "a still holds them")


def test_lapsed_lease_drops_the_peer_and_its_entries(make_daemon, etcd):  # noqa: F811
    a = etcd_node(make_daemon, etcd)
    b = etcd_node(make_daemon, etcd)
    wait_until(lambda: a.members() == 2 and b.members() == 2, 20, "both registered")
    keys = chain(3, seed=12)
    b.put(keys)
    wait_until(lambda: a.lookup(keys).remote_blocks == 3, 10, "a sees b's blocks")
    # b stops renewing its lease (as a SIGSTOPped process would): its record lapses
    mb = b.d.daemon.cluster.membership
    b.d.call(lambda: mb._task.cancel())
    wait_until(lambda: a.members() == 1, 20, "b's lease lapsed")
    assert a.lookup(keys).remote_blocks == 0
    bid = b.d.daemon.cluster.node_id
    assert bid not in a.d.call(lambda: a.d.daemon.cluster.table.nodes())


def test_etcd_down_keeps_local_serving_and_says_so(make_daemon, etcd):  # noqa: F811
    a = etcd_node(make_daemon, etcd)
    b = etcd_node(make_daemon, etcd)
    wait_until(lambda: a.members() == 2, 20, "registered")
    assert cluster_health(a) == health_pb2.HealthCheckResponse.SERVING
    keys = chain(3, seed=13)
    a.put(keys)
    etcd.stop()
    wait_until(lambda: cluster_health(a) == health_pb2.HealthCheckResponse.NOT_SERVING, 20, "cluster health down")
    st = a.stub.Stats(pb.StatsRequest(), timeout=5)
    assert "etcd unreachable" in st.cluster_status
    # the daemon itself stays SERVING and serves its local blocks
    assert health_pb2_grpc.HealthStub(a.ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status \
        == health_pb2.HealthCheckResponse.SERVING
    r = a.lookup(keys)
    assert r.hit_blocks == 3 and r.decision == pb.CHAIN_DECISION_LOCAL and "etcd" in r.cluster_status
    assert a.get(keys) == payloads(keys)
    more = chain(2, seed=14)
    a.put(more)
    assert a.get(more) == payloads(more)
    etcd.start()  # back: it registers again
    wait_until(lambda: cluster_health(a) == health_pb2.HealthCheckResponse.SERVING, 30, "cluster health back")
    wait_until(lambda: a.members() == 2 and b.members() == 2, 30, "membership restored")
    wait_until(lambda: b.lookup(more).remote_blocks == 2, 10, "b finds a's blocks again")


def test_a_peer_that_left_leaves_no_channel_or_pooled_endpoint_behind(make_daemon, etcd):  # noqa: F811
    """Peers come and go (new addresses each time: pods, ephemeral ports):
    the gRPC channel and the block transport's pooled endpoint to one that
    left are closed, or they pile up for as long as the daemon runs."""
    a = etcd_node(make_daemon, etcd)
    b = etcd_node(make_daemon, etcd)
    wait_until(lambda: a.members() == 2 and b.members() == 2, 20, "both registered")
    keys = chain(3, seed=15)
    b.put(keys)
    wait_until(lambda: a.lookup(keys).remote_blocks == 3, 10, "a sees b's blocks")
    assert a.acquire(keys).fetched_blocks == 3
    node = a.d.daemon.cluster
    me = node.membership.me
    b_member = node.membership.members[b.d.daemon.cluster.node_id]
    assert b_member.grpc_address in a.d.call(lambda: set(node._channels))
    # (the pool and the channels are the daemon loop's: read them on it, never from this thread)
    assert b_member.block_address in a.d.call(lambda: node.block_client.pooled)
    b.d.stop()
    wait_until(lambda: a.members() == 1, 20, "b left")
    wait_until(lambda: a.d.call(lambda: set(node._channels)) <= {me.grpc_address}, 10, "b's channel is closed")
    wait_until(lambda: b_member.block_address not in a.d.call(lambda: node.block_client.pooled), 10,
               "b's pooled endpoint is closed")


def test_a_member_is_the_record_at_its_own_key(make_daemon, etcd):  # noqa: F811
    """A record whose node id is not its key's name (a foreign or corrupted
    writer) would join under the id and never leave: deleting its key
    removes a different name. Such a record is ignored."""
    import asyncio

    import aetcd

    from transport.cluster import Member

    a = etcd_node(make_daemon, etcd)
    wait_until(lambda: a.members() == 1, 20, "registered")
    host, port = etcd.endpoint.rsplit(":", 1)

    async def put(key: str, m: Member) -> None:
        async with aetcd.Client(host=host, port=int(port)) as c:
            await c.put(f"/kvstore/members/{key}".encode(), m.to_json())

    asyncio.run(put("ghost", Member("phantom", "127.0.0.1:1")))
    asyncio.run(put("witness", Member("witness", "127.0.0.1:2")))  # after the ghost in the watch's order
    wait_until(lambda: "witness" in a.d.call(a.d.daemon.cluster.live_ids), 20, "the witness joined")
    assert "phantom" not in a.d.call(a.d.daemon.cluster.live_ids)
