"""Where a block fetched from a peer is checked: a cluster fetch into this
daemon's DRAM commits each block with the peer's checksum and does not hash
it on arrival; the block's first reader checks it (docs/architecture.md,
"Where a block's checksum is checked"). A block that arrived damaged must
still never reach an engine as a hit: the same-host read finds it, reports
it, and the daemon drops it (counted); a demotion to SSD does not write it.
Real daemons in one process, the in-process transport of ``cluster_fake``."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client import Client, ns_pb
from kvstore.daemon import peers
from kvstore.errors import KeyStatus
from kvstore.keys import block_keys
from proto import kvstore_pb2 as pb
from tests.integration import cluster_fake
from tests.integration.conftest import wait_until
from tests.integration.test_cluster_inproc import BLOCK, NS, chain, payloads, static_pair
from tiers.base import TierKind


@pytest.fixture(autouse=True)
def fake_transport(monkeypatch):
    monkeypatch.setattr(peers, "transport_factory", cluster_fake.fake_transport)


def failures(node) -> int:
    return node.d.call(lambda: node.d.store.stats().counters.checksum_failures)


def fetch_damaged(a, b, keys: list[bytes]):
    """a holds ``keys``; b fetches them with block 0 damaged on the way."""
    a.put(keys)
    wait_until(lambda: b.lookup(keys).remote_blocks == len(keys), 10, "b sees a's blocks")
    a.d.daemon.cluster.block_server.corrupt = 1  # the first block of the next transfer is damaged
    acq = b.acquire(keys)
    if acq.lease_id:
        b.stub.Release(pb.ReleaseRequest(lease_id=acq.lease_id), timeout=10)
    return acq


def test_a_damaged_fetched_block_is_a_miss_for_its_first_reader_reported_and_dropped(make_daemon):
    a, b = static_pair(make_daemon)
    keys = chain(4, seed=31)
    before = failures(b)
    acq = fetch_damaged(a, b, keys)
    # not hashed on arrival: committed with the peer's checksum, checked at its first use
    assert acq.fetched_blocks == 4 and failures(b) == before
    with Client(b.d.target) as c:
        assert c.slab is not None  # the same-host path
        outs = [np.zeros(BLOCK, np.uint8) for _ in keys]
        statuses = c.get_into(NS, keys, outs)
        assert statuses[0] is KeyStatus.CORRUPT  # a miss, never handed over as good
        for st, out, p in zip(statuses, outs, payloads(keys)):  # the others: a miss or their own bytes
            assert st is not KeyStatus.OK or out.tobytes() == p
        assert failures(b) == before + 1  # found, reported and counted where it was found
        assert c.lookup(NS, keys).hit_blocks == 0  # dropped with what hangs below it
        assert c.get_into(NS, keys, outs) == [KeyStatus.MISS] * 4
    # the next transfer is clean: fetched and read byte-exact
    acq = b.acquire(keys)
    assert acq.fetched_blocks == 4
    b.stub.Release(pb.ReleaseRequest(lease_id=acq.lease_id), timeout=10)
    assert b.get(keys) == payloads(keys)


def test_a_damaged_fetched_block_read_through_a_lease_is_never_returned(make_daemon):
    a, b = static_pair(make_daemon)
    keys = chain(3, seed=32)
    before = failures(b)
    assert fetch_damaged(a, b, keys).fetched_blocks == 3
    with Client(b.d.target) as c:
        got = c.get(NS, keys)  # Acquire, copy out verified, release
        assert got[0] is None
        assert all(g is None or bytes(g) == p for g, p in zip(got, payloads(keys)))  # never wrong bytes
    assert failures(b) == before + 1
    assert b.lookup(keys).local_blocks == 0


def test_a_damaged_fetched_block_is_not_written_to_ssd_when_demoted(make_daemon, tmp_path):
    a, b = static_pair(make_daemon, n1={
        "dram__capacity": "4MiB", "dram__page_size": "1MiB", "ssd__capacity": "64MiB",
        "ssd__path": str(tmp_path / "ssd"), "ssd__admit_min_hits": 0, "ssd__write_mode": "back"})
    keys = chain(4, seed=33)
    before = failures(b)
    assert fetch_damaged(a, b, keys).fetched_blocks == 4
    for s in range(16):  # 8 MiB of new blocks through b's 4 MiB of DRAM: the fetched chain is demoted
        k = block_keys(NS, np.arange(40000 + 1000 * s, 40000 + 1000 * s + 8 * NS.block_size))
        r = b.stub.Put(pb.PutRequest(ns=ns_pb(NS), keys=k, payloads=payloads(k)), timeout=10)
        assert [x.status for x in r.results] == [pb.STATUS_OK] * 8, r

    def fetched_left_dram() -> bool:
        return TierKind.DRAM not in b.d.call(lambda: list(b.d.store.peek(NS, keys).tiers))

    wait_until(fetched_left_dram, 30, "b's fetched chain evicted from DRAM")
    # never written: not on SSD, not readable, and the damaged block was counted where it was found
    assert b.lookup(keys).local_blocks == 0
    assert b.get(keys) == [None] * 4
    assert failures(b) == before + 1
