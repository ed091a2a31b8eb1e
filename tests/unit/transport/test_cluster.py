"""Membership and directory pieces of transport/cluster.py: rendezvous
ownership, the owner's table, member records, static membership liveness."""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest

from transport.cluster import DirectoryTable, Member, StaticMembership, owners


def keys(n: int, seed: bytes = b"k") -> list[bytes]:
    return [hashlib.blake2b(seed + i.to_bytes(4, "little"), digest_size=16).digest() for i in range(n)]


def test_rendezvous_is_deterministic_balanced_and_minimal():
    ks = b"".join(keys(6000))
    nodes = ["a:1", "b:2", "c:3"]
    own = owners(ks, nodes)
    assert own.shape == (6000,) and set(own.tolist()) == {0, 1, 2}
    counts = np.bincount(own, minlength=3)
    assert counts.min() > 1700  # about a third each
    # the same set in another order names the same owners
    perm = ["c:3", "a:1", "b:2"]
    own2 = owners(ks, perm)
    assert [perm[i] for i in own2] == [nodes[i] for i in own]
    # a node leaving moves only its own keys
    left = owners(ks, ["a:1", "c:3"])
    before = [nodes[i] for i in own]
    after = [["a:1", "c:3"][i] for i in left]
    for b, a in zip(before, after):
        if b != "b:2":
            assert a == b
    # a node joining takes keys only for itself
    joined = owners(ks, nodes + ["d:4"])
    after = [(nodes + ["d:4"])[i] for i in joined]
    assert all(a == b or a == "d:4" for a, b in zip(after, before))
    assert owners(ks, ["only"]).tolist() == [0] * 6000
    # a (n, 16) array gives the same answer as packed bytes
    assert (owners(np.frombuffer(ks, np.uint8).reshape(-1, 16), nodes) == own).all()


def test_directory_table_add_remove_clear_drop():
    t = DirectoryTable()
    k = keys(4)
    d1, d2 = b"1" * 16, b"2" * 16
    assert t.add("a", d1, k[:3], 4096) == 3
    t.add("b", d1, k[1:3])
    t.add("a", d2, [k[3]])
    assert t.locate(k) == [{"a"}, {"a", "b"}, {"a", "b"}, {"a"}]
    assert t.block_bytes[d1] == 4096
    assert t.remove("a", d1, [k[1]]) == 1
    assert t.locate(k)[1] == {"b"}
    assert t.remove("a", d1, [k[1]]) == 0  # not there twice
    assert t.clear("a", d2) == 1 and t.locate([k[3]]) == [set()]
    assert t.drop_node("b") == 2
    assert t.locate(k) == [{"a"}, set(), {"a"}, set()]
    assert t.nodes() == {"a"}
    t.drop_node("a")
    assert len(t) == 0


def test_member_record_round_trip_and_bad_records():
    m = Member("n1", "127.0.0.1:5000", "127.0.0.1:6000", (("dram", 1 << 30), ("ssd", 1 << 40)))
    assert Member.from_json(m.to_json()) == m
    with pytest.raises(ValueError):
        Member.from_json(b'{"grpc_address": "x"}')
    # any malformed record is a ValueError: etcd membership skips it (a TypeError or an
    # OverflowError ended its session, and the same record then ended every new one)
    for bad in (b'{"node_id": "x", "capacities": {"dram": [1]}}', b'{"node_id": "x", "capacities": [1, 2]}',
                b'{"node_id": "x", "capacities": {"dram": Infinity}}', b'{"node_id": "x", "capacities": 7}',
                b'{"node_id": "x", "grpc_address": {"a": 1}, "capacities": {"dram": null}}', b"[1]", b"\xff"):
        with pytest.raises(ValueError):
            Member.from_json(bad)


def test_member_records_across_versions():
    """A record names its block wire version; one of a daemon that predates
    the field reads as 0 (unnamed), and a newer daemon's extra fields are ignored."""
    m = Member("n1", "a:1", "a:2", (), wire=3)
    assert Member.from_json(m.to_json()).wire == 3
    assert Member.from_json(b'{"node_id": "n1", "grpc_address": "a:1"}').wire == 0
    assert Member.from_json(b'{"node_id": "n1", "wire": 4, "zone": "b"}').wire == 4
    with pytest.raises(ValueError):
        Member.from_json(b'{"node_id": "n1", "wire": "x"}')


def test_static_membership_follows_probes():
    me = Member("me", "127.0.0.1:1")
    alive = {"127.0.0.1:2": True, "127.0.0.1:3": True}

    async def probe(addr: str) -> Member | None:
        if not alive[addr]:
            raise ConnectionError("refused")
        return Member("n" + addr[-1], addr, "blk" + addr[-1])

    async def run() -> list[list[str]]:
        sm = StaticMembership(me, ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], probe)
        seen: list[list[str]] = []
        sm.subscribe(lambda ms: seen.append(sorted(ms)))
        await sm.refresh()
        alive["127.0.0.1:3"] = False
        await sm.refresh()
        await sm.refresh()  # no change: no event
        alive["127.0.0.1:3"] = True
        await sm.refresh()
        assert sm.peers().keys() == {"n2", "n3"}
        return seen

    seen = asyncio.run(run())
    assert seen == [["me", "n2", "n3"], ["me", "n2"], ["me", "n2", "n3"]]
