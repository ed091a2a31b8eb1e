"""Cluster fetch faults between real in-process daemons (the block transport
is ``tests/integration/cluster_fake``): a peer's fetch of blocks on SSD does
not stall the serving daemon's loop; a peer whose transport hangs is a miss
at once for a back-off, then probed again; a peer that comes back with a new
block address is probed again. No timing: events and bounded waits only."""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

import grpc
import pytest

from kvstore.client import Client, ns_pb
from kvstore.daemon import peers
from proto import kvstore_pb2 as pb
from tests.faults.test_fault_disk_worker import StalledReads
from tests.integration import cluster_fake
from tests.integration.test_cluster_inproc import NS, chain, payloads, static_pair
from tests.support.keys import chain_keys
from tests.support.waits import wait_until
from tiers.base import TierKind


@pytest.fixture(autouse=True)
def fake_transport(monkeypatch):
    monkeypatch.setattr(peers, "transport_factory", cluster_fake.fake_transport)


def test_a_peer_fetching_blocks_on_ssd_does_not_stall_the_holders_other_calls(make_daemon, tmp_path) -> None:
    """The holder's provide reads SSD blocks on the disk worker: while that
    read is stalled, the holder still answers a Lookup (before: the read ran
    on its event loop and every other call waited for the disk)."""
    a, b = static_pair(make_daemon, cluster__fetch_timeout="60s", n0={
        "dram__capacity": "4MiB", "dram__page_size": "1MiB", "ssd__capacity": "64MiB",
        "ssd__path": str(tmp_path / "ssd"), "ssd__admit_min_hits": 0, "ssd__write_mode": "back"})
    fs = StalledReads()
    a.d.call(lambda: setattr(a.d.store.ssd.tier, "fs", fs))
    chains = [chain_keys(4000 + i, 8, NS) for i in range(16)]  # 8 MiB through 4 MiB of DRAM
    for keys in chains:
        a.put(keys)
    with Client(a.d.target) as c:
        c.flush()

        def on_ssd() -> list[bytes] | None:
            return next((k for k in chains if set(c.lookup(NS, k).tiers[:8]) == {TierKind.SSD}), None)

        wait_until(lambda: on_ssd() is not None, 30, "a chain wholly on SSD at the holder")
        keys = on_ssd()
        assert keys is not None
        wait_until(lambda: b.lookup(keys).remote_blocks == 8, 10, "b sees the holder's blocks")
        fs.hold = True
        got: list[Any] = []
        fetcher = threading.Thread(target=lambda: got.append(b.acquire(keys)), daemon=True)
        fetcher.start()
        try:
            wait_until(fs.waiting.is_set, 30, "the holder's provide waits on the disk")
            other = c._call(c.stub.Lookup, pb.LookupRequest(ns=ns_pb(NS), keys_packed=b"".join(chains[-1])),
                            timeout=10)
            still_reading = fetcher.is_alive()
        finally:
            fs.hold = False
            fs.go.set()
        fetcher.join(60)
    assert other.hit_blocks == 8 and still_reading
    assert got and got[0].fetched_blocks == 8  # and the stalled fetch completes once the disk answers
    b.stub.Release(pb.ReleaseRequest(lease_id=got[0].lease_id), timeout=10)
    assert b.get(keys) == payloads(keys)
    wait_until(lambda: a.d.call(lambda: a.d.store.stats().leases) == 0, 10, "the holder's send lease released")


class CountingFetches:
    """Wraps a daemon's block client: counts fetches of blocks and empty probes."""

    def __init__(self, client: Any) -> None:
        self.real = client.fetch
        self.fetches = 0
        self.probes = 0
        client.fetch = self.fetch

    async def fetch(self, address: str, header: bytes, count: int, *a: Any, **kw: Any) -> Any:
        if count:
            self.fetches += 1
        else:
            self.probes += 1
        return await self.real(address, header, count, *a, **kw)


def test_a_peer_whose_transport_hangs_is_a_miss_at_once_until_a_probe_answers(make_daemon) -> None:
    """gRPC answers, the block transport hangs: the first fetch waits its
    deadline and marks the link suspect; within the back-off the next
    Acquire is a miss (recompute) without calling the transport; once the
    back-off has passed (a fake clock) the link is probed again, and when the
    probe answers, fetches resume."""
    a, b = static_pair(make_daemon, cluster__peer_backoff="30s")
    keys = chain(3, seed=21)
    a.put(keys)
    wait_until(lambda: b.lookup(keys).remote_blocks == 3, 10, "b sees a's blocks")
    node = b.d.daemon.cluster
    now = [1000.0]
    node.cost.clock = lambda: now[0]
    a_id = a.d.daemon.cluster.node_id
    count = CountingFetches(node.block_client)
    a.d.daemon.cluster.block_server.paused = True
    try:
        first = b.acquire(keys)
        assert first.fetched_blocks == 0 and first.hit_blocks == 0 and count.fetches == 1
        again = b.acquire(keys)
        assert again.fetched_blocks == 0 and again.hit_blocks == 0
        assert again.decision == pb.CHAIN_DECISION_RECOMPUTE
        assert count.fetches == 1  # the transport was not asked again
        assert b.lookup(keys).decision == pb.CHAIN_DECISION_RECOMPUTE
        probes = count.probes
    finally:
        a.d.daemon.cluster.block_server.paused = False
    now[0] += 31.0  # the back-off has passed: the next decision has the link probed again
    assert b.acquire(keys).fetched_blocks == 0
    wait_until(lambda: count.probes > probes, 10, "the link is probed again")
    wait_until(lambda: b.lookup(keys).decision == pb.CHAIN_DECISION_FETCH, 10, "the answered probe clears the link")
    acq = b.acquire(keys)
    assert acq.fetched_blocks == 3 and count.fetches == 2
    assert b.d.call(lambda: node.cost.link(a_id).fetches) == 1


def test_a_peer_back_with_a_new_block_address_has_its_link_forgotten_and_probed_again(make_daemon) -> None:
    """A peer restarted under the same node id with a new block address (an
    etcd record put again, a static probe's answer): its old link figures
    and endpoint belong to the old process. Its link is forgotten and probed
    again at the new address (before: the old figures stayed for good)."""
    a, b = static_pair(make_daemon)
    keys = chain(3, seed=22)
    a.put(keys)
    wait_until(lambda: b.lookup(keys).remote_blocks == 3, 10, "b sees a's blocks")
    node, a_id = b.d.daemon.cluster, a.d.daemon.cluster.node_id
    node.cost.clock = lambda: 1000.0  # (frozen: no back-off ends during the test)
    b.d.call(lambda: node.cost.set_link(a_id, latency_s=100.0))  # what the old process's link had come to
    b.d.call(lambda: node.cost.mark_suspect(a_id))
    assert b.lookup(keys).decision == pb.CHAIN_DECISION_RECOMPUTE
    srv = a.d.daemon.cluster.block_server
    old, new = srv.address, "fake-restarted:0"
    cluster_fake.REGISTRY[new] = cluster_fake.REGISTRY.pop(old)  # a's block transport now answers at `new`
    real = node.membership.probe

    async def restarted(address: str) -> Any:  # NodeInfo now tells the new block address
        m = await real(address)
        return replace(m, block_address=new) if m is not None and m.block_address == old else m

    b.d.call(lambda: setattr(node.membership, "probe", restarted))
    wait_until(lambda: b.d.call(lambda: node.membership.members[a_id].block_address) == new, 10,
               "b's membership has a's new block address")
    wait_until(lambda: b.lookup(keys).decision == pb.CHAIN_DECISION_FETCH, 10, "a's link is probed again")
    acq = b.acquire(keys)
    assert acq.fetched_blocks == 3
    assert old not in node.block_client.pooled and new in node.block_client.pooled


def test_a_hung_transfer_its_caller_gave_up_on_still_marks_the_link_suspect(make_daemon) -> None:
    """A caller whose deadline is shorter than fetch_timeout gives up first
    (its handler is cancelled); the transfer still ends in a timeout, and
    that must mark the link suspect too, or every such caller waits on the
    hung peer again."""
    a, b = static_pair(make_daemon, cluster__fetch_timeout="2s", cluster__peer_backoff="30s")
    keys = chain(3, seed=23)
    a.put(keys)
    wait_until(lambda: b.lookup(keys).remote_blocks == 3, 10, "b sees a's blocks")
    node, a_id = b.d.daemon.cluster, a.d.daemon.cluster.node_id
    node.cost.clock = lambda: 1000.0  # (frozen: the back-off does not end during the test)
    count = CountingFetches(node.block_client)
    a.d.daemon.cluster.block_server.paused = True
    try:
        with pytest.raises(grpc.RpcError) as e:
            b.stub.Acquire(pb.AcquireRequest(ns=ns_pb(NS), keys=keys, promote=True, cluster=True), timeout=0.5)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and count.fetches == 1
        wait_until(lambda: b.d.call(lambda: node.cost.suspect(a_id)), 10, "the transfer ends: the link is suspect")
        assert b.d.call(lambda: b.d.store.stats().reservations) == 0
        again = b.acquire(keys)
        assert again.fetched_blocks == 0 and again.decision == pb.CHAIN_DECISION_RECOMPUTE and count.fetches == 1
    finally:
        a.d.daemon.cluster.block_server.paused = False


def test_a_refused_fetch_leaves_the_link_alone_and_a_dead_peer_makes_it_suspect(make_daemon, tmp_path,
                                                                               monkeypatch) -> None:
    """Whether a failed fetch makes the peer suspect follows the transport's
    ``FetchFault``, never the error's words: the holder refuses the caller's
    credential (a tenant named "connector": the refusal's text says
    "connect", which the old word match took for a link fault), and the
    link stays trusted, the failure counted as refused; a holder whose
    transport is gone (the connect fails) makes the link suspect."""
    monkeypatch.setenv("KV_TEST_PEER_TOKEN", "t-peer")
    admin = '[[tenant]]\nname = "cluster"\ntoken = "t-peer"\nadmin = true\n'
    files = []
    for i, other in enumerate(('acme', 'connector')):  # b's token for acme is tenant "connector" at a
        f = tmp_path / f"tenants{i}.toml"
        f.write_text(f'[[tenant]]\nname = "acme"\ntoken = "t-acme"\n\n[[tenant]]\nname = "{other}"\n'
                     f'token = "t-b"\n\n{admin}')
        files.append(str(f))
    a, b = static_pair(make_daemon, md=[("authorization", "Bearer t-peer")], cluster__peer_token_env="KV_TEST_PEER_TOKEN",
                       cluster__peer_backoff="30s", n0={"server__tenants_file": files[1]},
                       n1={"server__tenants_file": files[0]})
    keys = chain(3, seed=24)
    a.stub.Put(pb.PutRequest(ns=ns_pb(NS), keys=keys, payloads=payloads(keys)),
               metadata=[("authorization", "Bearer t-acme")], timeout=10)
    as_b = [("authorization", "Bearer t-b")]  # acme at b, "connector" at a
    lookup = lambda: b.stub.Lookup(pb.LookupRequest(ns=ns_pb(NS), keys=keys, cluster=True),  # noqa: E731
                                   metadata=as_b, timeout=10)
    wait_until(lambda: lookup().remote_blocks == 3, 10, "b sees a's blocks")
    node, a_id = b.d.daemon.cluster, a.d.daemon.cluster.node_id
    node.cost.clock = lambda: 1000.0  # (frozen: no back-off ends during the test)
    count = CountingFetches(node.block_client)
    acq = b.stub.Acquire(pb.AcquireRequest(ns=ns_pb(NS), keys=keys, promote=True, cluster=True), metadata=as_b,
                         timeout=10)
    assert acq.fetched_blocks == 0 and count.fetches == 1
    assert not b.d.call(lambda: node.cost.suspect(a_id))
    text = b.d.daemon.metrics.render().decode()
    assert f'kvstore_peer_fetch_failures_total{{peer="{a_id}",reason="refused"}} 1.0' in text, text
    assert lookup().decision == pb.CHAIN_DECISION_FETCH  # still trusted
    a.d.daemon.cluster.block_server.dead = True  # its block transport gone: the connect fails
    acq = b.stub.Acquire(pb.AcquireRequest(ns=ns_pb(NS), keys=keys, promote=True, cluster=True), metadata=as_b,
                         timeout=10)
    assert acq.fetched_blocks == 0 and count.fetches == 2
    assert b.d.call(lambda: node.cost.suspect(a_id))
    assert lookup().decision == pb.CHAIN_DECISION_RECOMPUTE
