"""Clear errors on the wire (issue 19, items 10 and 11): a malformed field is
named (a 5-byte ``parent`` is the parent, not "key 0"; a short ns_digest is
the digest), and every non-OK key of Reserve, Put, Commit and Remove carries
its reason, as the proto promises ("key index -> reason, for non-OK keys")."""

from __future__ import annotations

import grpc
import pytest

from kvstore.client import ns_pb
from kvstore.keys import Namespace
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc
from tests.support.keys import chain

NS = Namespace(tenant="acme", model_id="m", block_size=16)
BIG = Namespace(tenant="acme", model_id="big", block_size=16)


def _code(fn, *a, **kw) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as ei:
        fn(*a, **kw)
    return ei.value.code(), ei.value.details()


def _nonok(statuses) -> list[int]:
    return [i for i, s in enumerate(statuses) if s != pb.STATUS_OK]


def test_malformed_fields_are_named(make_daemon) -> None:
    d = make_daemon(cluster__mode="off")
    with grpc.insecure_channel(d.target) as ch:
        kv = pb_grpc.KVStoreStub(ch)
        keys = chain(b"p", 3)
        for parent in (b"x" * 5, b"x" * 17):
            code, msg = _code(kv.Put, pb.PutRequest(ns=ns_pb(NS), keys=keys, payloads=[b"x"] * 3, parent=parent),
                              timeout=10)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("parent must be 16 bytes"), msg
            assert f"got {len(parent)} bytes" in msg
            code, msg = _code(kv.Reserve, pb.ReserveRequest(ns=ns_pb(NS), keys=keys, block_bytes=64, parent=parent),
                              timeout=10)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("parent must be 16 bytes"), msg
        # a bad key is named by its field and index
        code, msg = _code(kv.Put, pb.PutRequest(ns=ns_pb(NS), keys=[keys[0], b"k" * 5], payloads=[b"x"] * 2),
                          timeout=10)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("keys[1] must be 16 bytes"), msg
        code, msg = _code(kv.Remove, pb.RemoveRequest(ns=ns_pb(NS), keys=[b"k" * 15]), timeout=10)
        assert msg.startswith("keys[0] must be 16 bytes"), msg
        code, msg = _code(kv.Lookup, pb.LookupRequest(ns=ns_pb(NS), keys_packed=b"k" * 17), timeout=10)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("keys_packed is 17 bytes"), msg


def test_every_refused_key_gets_its_reason(make_daemon) -> None:
    d = make_daemon(dram__capacity="16MiB", dram__page_size="4MiB")
    with grpc.insecure_channel(d.target) as ch:
        kv = pb_grpc.KVStoreStub(ch)
        keys = chain(b"r", 8)
        put = kv.Put(pb.PutRequest(ns=ns_pb(NS), keys=keys[:2], payloads=[b"x" * 4096] * 2), timeout=10)
        assert [r.status for r in put.results] == [pb.STATUS_OK] * 2
        # EXISTS (stored) and OK (reserved here)
        r1 = kv.Reserve(pb.ReserveRequest(ns=ns_pb(NS), keys=keys[:4], block_bytes=4096), timeout=10)
        assert list(r1.slots.status) == [pb.STATUS_EXISTS] * 2 + [pb.STATUS_OK] * 2
        assert sorted(r1.details) == [0, 1] and all(r1.details[i] for i in (0, 1))
        # BUSY: another reservation holds keys 2 and 3
        r2 = kv.Reserve(pb.ReserveRequest(ns=ns_pb(NS), keys=keys[:4], block_bytes=4096), timeout=10)
        assert list(r2.slots.status) == [pb.STATUS_EXISTS] * 2 + [pb.STATUS_BUSY] * 2
        assert sorted(r2.details) == [0, 1, 2, 3] and "reservation" in r2.details[2]
        # PARENT_MISSING: every one of them is explained, not just the first
        r3 = kv.Reserve(pb.ReserveRequest(ns=ns_pb(NS), keys=keys[4:], parent=b"z" * 16, block_bytes=4096),
                        timeout=10)
        assert list(r3.slots.status) == [pb.STATUS_PARENT_MISSING] * 4
        assert sorted(r3.details) == [0, 1, 2, 3]
        assert "keys[2]" in r3.details[3]
        # CAPACITY: far more than the tier holds
        many = chain(b"c", 40)
        r4 = kv.Reserve(pb.ReserveRequest(ns=ns_pb(BIG), keys_packed=b"".join(many), block_bytes=1 << 20),
                        timeout=10)
        refused = _nonok(r4.slots.status)
        assert refused and any(r4.slots.status[i] == pb.STATUS_CAPACITY for i in refused)
        assert sorted(r4.details) == refused and all(r4.details[i] for i in refused)
        # Put: PARENT_MISSING along the whole chain, each with its reason
        put = kv.Put(pb.PutRequest(ns=ns_pb(NS), keys=keys[4:7], payloads=[b"x" * 4096] * 3, parent=b"q" * 16),
                     timeout=10)
        assert [r.status for r in put.results] == [pb.STATUS_PARENT_MISSING] * 3
        assert all(r.detail for r in put.results)
        # Remove: a key that is not there says so
        rm = kv.Remove(pb.RemoveRequest(ns=ns_pb(NS), keys=[b"n" * 16]), timeout=10)
        assert rm.results[0].status != pb.STATUS_OK and rm.results[0].detail
        # Commit: a reservation's non-OK keys are explained too
        c = kv.Commit(pb.CommitRequest(reservation_id=r1.reservation_id), timeout=10)
        assert all(r.detail for r in c.results if r.status != pb.STATUS_OK)
