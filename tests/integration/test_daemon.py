"""The daemon through the real client: shared-memory and inline paths, auth,
sessions, leases, events, admin, bad input."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import grpc
import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import (InvalidArgument, KeyStatus, NotFound, PermissionDenied, Unauthenticated)
from kvstore.keys import Namespace
from kvstore.results import EventKind
from tiers.base import TierKind
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc
from tests.conftest import payload_for
from tests.integration.conftest import wait_until
from tests.support.keys import chain_keys

BS = 64 * 1024
NS = Namespace(tenant="acme", model_id="llama", block_size=16)


def P(k: bytes, size: int = BS) -> bytes:
    return payload_for(b"p", k, size)


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "inline"])
def test_put_lookup_get_roundtrip(daemon, use_shm):
    keys = chain_keys(1, 8)
    with Client(daemon.target, use_shm=use_shm) as c:
        assert (c.slab is not None) == use_shm
        assert c.put(NS, keys[:5], [P(k) for k in keys[:5]]) == [KeyStatus.OK] * 5
        assert c.put(NS, keys[5:], [P(k) for k in keys[5:]], parent=keys[4]) == [KeyStatus.OK] * 3
        look = c.lookup(NS, keys + chain_keys(2, 2))
        assert look.hit_blocks == 8 and look.tiers == [TierKind.DRAM] * 8
        got = c.get(NS, keys + chain_keys(3, 1))
        assert [g.tobytes() for g in got[:8]] == [P(k) for k in keys] and got[8] is None
        outs = [np.empty(BS, np.uint8) for _ in keys]
        assert c.get_into(NS, keys, outs) == [KeyStatus.OK] * 8
        assert all(o.tobytes() == P(k) for o, k in zip(outs, keys))
        assert c.put(NS, keys[:2], [P(k) for k in keys[:2]]) == [KeyStatus.EXISTS] * 2
        assert c.remove(NS, keys[6:7]) == [KeyStatus.OK]
        assert c.lookup(NS, keys).hit_blocks == 6
        assert c.clear(NS) == 6


def test_inline_put_splits_under_the_message_limit(make_daemon):
    d = make_daemon(server__max_message_bytes="256KiB")
    keys = chain_keys(4, 12)
    with Client(d.target, use_shm=False) as c:
        assert c.put(NS, keys, [P(k) for k in keys]) == [KeyStatus.OK] * 12
        got = c.get(NS, keys)
        assert [g.tobytes() for g in got] == [P(k) for k in keys]


def test_zero_copy_lease_views(daemon):
    keys = chain_keys(5, 3)
    with Client(daemon.target) as c:
        c.put(NS, keys, [P(k) for k in keys])
        with c.acquire(NS, keys) as lease:
            assert lease.hit_blocks == 3
            assert [v.tobytes() for v in lease.views] == [P(k) for k in keys]
            assert daemon.call(lambda: daemon.store.stats().leases) == 1
        assert daemon.call(lambda: daemon.store.stats().leases) == 0


def test_client_exit_leaves_the_slab_intact(daemon, repo_root):
    keys = chain_keys(6, 2)
    with Client(daemon.target) as c:
        c.put(NS, keys, [P(k) for k in keys])
    code = textwrap.dedent(f"""
        from kvstore.client import Client
        from kvstore.keys import Namespace
        c = Client({daemon.target!r})
        assert c.slab is not None
        print(len(c.get(Namespace(tenant="acme", model_id="llama", block_size=16), {keys!r})))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert os.path.exists(daemon.store.dram.path)
    with Client(daemon.target) as c:
        assert [g.tobytes() for g in c.get(NS, keys)] == [P(k) for k in keys]


def test_killed_client_releases_its_leases_and_reservations(daemon, repo_root):
    keys = chain_keys(7, 4)
    with Client(daemon.target) as c:
        c.put(NS, keys[:2], [P(k) for k in keys[:2]])
    code = textwrap.dedent(f"""
        import os, signal, sys
        from kvstore.client import Client
        from kvstore.keys import Namespace
        from proto import kvstore_pb2 as pb
        ns = Namespace(tenant="acme", model_id="llama", block_size=16)
        c = Client({daemon.target!r})
        c.acquire(ns, {keys[:2]!r})
        r = c._call(c.stub.Reserve, pb.ReserveRequest(ns=__import__("kvstore.client").client.ns_pb(ns),
                    keys={keys[2:]!r}, block_bytes={BS}, parent={keys[1]!r}))
        assert r.reservation_id
        print("held", flush=True)
        sys.stdin.readline()
    """)
    p = subprocess.Popen([sys.executable, "-c", code], cwd=repo_root, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held", p.stderr.read()
        st = daemon.call(daemon.store.stats)
        assert st.leases == 1 and st.reservations == 1
        p.kill()
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
    wait_until(lambda: daemon.call(lambda: (daemon.store.stats().leases, daemon.store.stats().reservations)) == (0, 0),
               what="the dead client's holds to be reclaimed")
    assert daemon.call(lambda: int(daemon.store.index.pins.sum())) == 0
    with Client(daemon.target) as c:  # the reserved keys are free again
        assert c.put(NS, keys[2:], [P(k) for k in keys[2:]], parent=keys[1]) == [KeyStatus.OK] * 2


def test_uncommitted_reservation_expires(make_daemon):
    d = make_daemon(server__reservation_timeout="200ms", server__lease_check_interval="50ms")
    keys = chain_keys(8, 2)
    with Client(d.target, session=False) as c:
        r = c._call(c.stub.Reserve, pb.ReserveRequest(ns=__import__("kvstore.client").client.ns_pb(NS), keys=keys,
                                                       block_bytes=BS))
        assert r.reservation_id
        wait_until(lambda: d.call(lambda: d.store.stats().reservations) == 0, what="reservation expiry")
        with pytest.raises(NotFound):
            c._call(c.stub.Commit, pb.CommitRequest(reservation_id=r.reservation_id))


def test_leases_and_reservations_belong_to_their_session(daemon):
    keys = chain_keys(9, 2)
    with Client(daemon.target) as a, Client(daemon.target) as b:
        a.put(NS, keys, [P(k) for k in keys])
        r = a._call(a.stub.Acquire, pb.AcquireRequest(ns=__import__("kvstore.client").client.ns_pb(NS), keys=keys))
        with pytest.raises(PermissionDenied):
            b._call(b.stub.Release, pb.ReleaseRequest(lease_id=r.lease_id))
        a._call(a.stub.Release, pb.ReleaseRequest(lease_id=r.lease_id))
        with pytest.raises(NotFound, match="not held"):
            a._call(a.stub.Release, pb.ReleaseRequest(lease_id=r.lease_id))
        with pytest.raises(NotFound):
            b._call(b.stub.Commit, pb.CommitRequest(reservation_id="r-0000"))


def test_bad_input_gets_clear_status(make_daemon):
    daemon = make_daemon(server__max_message_bytes="1MiB")
    stub = pb_grpc.KVStoreStub(grpc.insecure_channel(daemon.target))
    good = __import__("kvstore.client").client.ns_pb(NS)

    def code_of(fn, req):
        with pytest.raises(grpc.RpcError) as ei:
            fn(req, timeout=10)
        return ei.value.code(), ei.value.details()

    code, msg = code_of(stub.Lookup, pb.LookupRequest(ns=good, keys=[b"x" * 15]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "16 bytes" in msg
    bad = pb.Namespace(); bad.CopyFrom(good); bad.block_size = 0
    code, msg = code_of(stub.Lookup, pb.LookupRequest(ns=bad, keys=[]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "block_size" in msg
    bad.block_size = 16; bad.kv_dtype = "float7"
    code, msg = code_of(stub.Lookup, pb.LookupRequest(ns=bad, keys=[]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "float7" in msg
    code, _ = code_of(stub.Put, pb.PutRequest(ns=good, keys=[b"k" * 16], payloads=[b"x" * (2 << 20)]))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED  # over the message limit
    code, msg = code_of(stub.Put, pb.PutRequest(ns=good, keys=[b"k" * 16] * 2, payloads=[b"x"]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    # a payload larger than the whole tier is that key's INVALID, not a crash
    r = stub.Put(pb.PutRequest(ns=good, keys=[b"k" * 16], payloads=[b"x" * (900 << 10)]), timeout=10)
    assert r.results[0].status in (pb.STATUS_OK, pb.STATUS_INVALID)
    code, _ = code_of(stub.Reserve, pb.ReserveRequest(ns=good, keys=[b"k" * 16]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    # a wrong checksum on an inline put stores nothing from that block on
    r = stub.Put(pb.PutRequest(ns=good, keys=[b"a" * 16, b"b" * 16], payloads=[b"x" * 10, b"y" * 10],
                               checksums=[0, 0]), timeout=10)
    assert [x.status for x in r.results] == [pb.STATUS_CORRUPT, pb.STATUS_PARENT_MISSING]
    # the daemon still serves
    assert stub.Lookup(pb.LookupRequest(ns=good, keys=[b"a" * 16]), timeout=10).hit_blocks == 0


def test_auth_and_tenant_isolation(make_daemon, tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "acme"\ntoken = "tok-acme"\n\n'
                       '[[tenant]]\nname = "beta"\ntoken = "tok-beta"\n\n'
                       '[[tenant]]\nname = "ops"\ntoken = "tok-admin"\nadmin = true\n')
    d = make_daemon(server__tenants_file=str(tenants))
    keys = chain_keys(10, 2)
    with pytest.raises(Unauthenticated):
        Client(d.target)
    with pytest.raises(Unauthenticated):
        Client(d.target, token="nope")
    with Client(d.target, token="tok-acme") as a, Client(d.target, token="tok-beta") as b:
        assert a.server_tenant == "acme"
        assert a.put(NS, keys, [P(k) for k in keys]) == [KeyStatus.OK] * 2
        # beta asks for the very same namespace fields: its tenant comes from its token
        with pytest.raises(PermissionDenied):
            b.lookup(NS, keys)
        ns_b = Namespace(tenant="beta", model_id="llama", block_size=16)
        assert b.lookup(ns_b, keys).hit_blocks == 0
        with pytest.raises(PermissionDenied):
            b.admin_set_policy("lfu")
    with Client(d.target, token="tok-admin") as ops:
        assert ops.admin_set_policy("lfu").old_policy == "lru"


def test_watch_events_replay_and_gap(make_daemon):
    d = make_daemon(server__event_buffer=4)
    keys = chain_keys(11, 3)
    with Client(d.target) as c:
        c.put(NS, keys[:1], [P(keys[0])])
        evs = list(c.watch_events(after_seq=0, timeout=1.0))
        assert [e.kind for e in evs] == [EventKind.STORED]
        last = evs[-1].seq
        c.put(NS, keys[1:2], [P(keys[1])], parent=keys[0])
        more = list(c.watch_events(after_seq=last, timeout=1.0))
        assert [e.seq for e in more] == [last + 1] and list(more[0].keys) == keys[1:2]
        for i in range(6):
            c.remove(NS, keys[1:2])
            c.put(NS, keys[1:2], [P(keys[1])], parent=keys[0])
        lost = list(c.watch_events(after_seq=last, timeout=1.0))
        assert lost[0].kind is EventKind.GAP and lost[0].first_available_seq > last + 1


def test_admin_config_policy_and_resize_under_load(make_daemon):
    d = make_daemon(dram__capacity="8MiB", dram__page_size="1MiB")
    keys = chain_keys(12, 60)
    stop = threading.Event()
    errors: list[BaseException] = []

    def load() -> None:
        try:
            with Client(d.target) as c:
                i = 0
                while not stop.is_set():
                    k = chain_keys(1000 + i, 4)
                    c.put(NS, k, [P(x) for x in k])
                    for g, x in zip(c.get(NS, k), k):
                        assert g is None or g.tobytes() == P(x)
                    i += 1
        except BaseException as e:  # surfaced below
            errors.append(e)

    with Client(d.target) as c:
        assert "capacity" in c.admin_get_config()
        c.put(NS, keys[:8], [P(k) for k in keys[:8]])
        t = threading.Thread(target=load)
        t.start()
        try:
            out = c.admin_resize("dram", 4 << 20)
            assert out.new_capacity_bytes == 4 << 20
            out = c.admin_resize("dram", 12 << 20)
            assert out.new_capacity_bytes == 12 << 20
            assert c.admin_set_policy("cost").new_policy == "cost"
            with pytest.raises(InvalidArgument):
                c.admin_set_policy("random")
        finally:
            stop.set()
            t.join(60)
        assert not errors, errors
        got = c.get(NS, keys[:8])
        assert all(g is None or g.tobytes() == P(k) for g, k in zip(got, keys[:8]))
        st = c.stats()
        assert st.tiers[0].capacity_bytes == 12582912


def test_concurrent_clients_get_their_own_bytes(daemon):
    errors: list[BaseException] = []

    def worker(seed: int, use_shm: bool) -> None:
        try:
            with Client(daemon.target, use_shm=use_shm) as c:
                for r in range(5):
                    k = chain_keys(seed * 100 + r, 3)
                    c.put(NS, k, [P(x) for x in k])
                    for g, x in zip(c.get(NS, k), k):
                        assert g is None or g.tobytes() == P(x)
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(i, i % 2 == 0)) for i in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors, errors


def test_report_corrupt_drops_and_counts(daemon):
    keys = chain_keys(13, 3)
    with Client(daemon.target) as c:
        c.put(NS, keys, [P(k) for k in keys])
        assert c.report_corrupt(NS, keys[1:2]) == 1
        assert c.lookup(NS, keys).hit_blocks == 1  # the block and its descendant are gone
        assert c.stats().checksum_failures == 1
