"""The same-host fast Lookup socket (kvstore.daemon.socket_server, kvstore.client.socket): same answers as
gRPC Lookup, bound to the session's tenant, clean errors, gRPC fallback."""

from __future__ import annotations

import os
import socket
import stat
import struct

import numpy as np
import pytest

from kvstore.client import Client, ns_pb
from kvstore.errors import InvalidArgument, KeyStatus, NotFound, PermissionDenied, Unauthenticated, Unavailable
from kvstore.client.socket import LookupSocketClient
from kvstore.keys import Namespace, block_keys
from tiers.base import TierKind

BS = 4096


@pytest.fixture
def uds_daemon(make_daemon, tmp_path):
    sock = str(tmp_path / "kv.sock")
    return make_daemon(server__host="", server__unix_socket=sock)


def _ns(tenant: str = "t") -> Namespace:
    return Namespace(tenant=tenant, model_id="m", block_size=16)


def _fill(c: Client, ns: Namespace, n: int) -> list[bytes]:
    keys = block_keys(ns, np.arange(n * 16, dtype=np.uint32))
    v = np.zeros(BS, np.uint8)
    c.put(ns, keys, [v] * n)
    return keys


def test_fast_lookup_answers_like_grpc(uds_daemon):
    path = uds_daemon.running.fast.path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with Client(uds_daemon.target) as fast, Client(uds_daemon.target, fast_lookup=False) as slow:
        assert fast._fast is not None and slow._fast is None
        ns = _ns()
        keys = _fill(fast, ns, 40)
        other = block_keys(ns, np.arange(16 * 8, dtype=np.uint32) + 7)
        before = uds_daemon.store.counters.lookups
        for probe in (keys, keys[:1], keys[:17] + other, other, []):
            a, b = fast.lookup(ns, probe), slow.lookup(ns, probe)
            assert a == b
        assert fast.lookup(ns, keys).hit_blocks == 40 and fast.lookup(ns, keys).tiers == [TierKind.DRAM] * 40
        # each fast lookup is counted by the store like a gRPC one
        assert uds_daemon.store.counters.lookups - before == 12
        with pytest.raises(InvalidArgument):
            fast.lookup(ns, [b"short"])


def test_raw_frames_round_trip_and_bad_input(uds_daemon):
    with Client(uds_daemon.target) as c:
        ns = _ns()
        keys = _fill(c, ns, 5)
        wire = ns_pb(ns).SerializeToString(deterministic=True)
        raw = LookupSocketClient(uds_daemon.running.fast.path, c.session)
        try:
            hit, tiers = raw.lookup(wire, b"".join(keys))
            assert hit == 5 and tiers == bytes([2]) * 5  # Tier value of DRAM, one byte per block
            with pytest.raises(InvalidArgument, match="multiple of 16"):
                raw.lookup(wire, b"x" * 17)
            with pytest.raises(InvalidArgument, match="Namespace"):
                raw.lookup(b"\xff\xff\xff", b"".join(keys))
            assert raw.lookup(wire, b"".join(keys[:2]))[0] == 2  # still usable after errors
        finally:
            raw.close()


def test_unknown_session_is_refused(uds_daemon):
    with pytest.raises(NotFound, match="unknown"):
        LookupSocketClient(uds_daemon.running.fast.path, "s-not-a-session")
    # a frame longer than allowed closes the connection with an error
    with Client(uds_daemon.target) as c:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(uds_daemon.running.fast.path)
        sid = c.session.encode()
        s.sendall(struct.pack("<I", len(sid)) + sid)
        assert s.recv(5) == struct.pack("<I", 1) + b"\x00"
        s.sendall(struct.pack("<I", 1 << 30))
        head = s.recv(5)
        assert struct.unpack("<I", head[:4])[0] > 1 and head[4] == 3  # INVALID_ARGUMENT
        s.close()


def test_tenant_comes_from_the_session_and_ends_with_it(uds_daemon):
    with Client(uds_daemon.target) as c:
        ns = _ns("t")
        keys = _fill(c, ns, 3)
        assert c.lookup(ns, keys).hit_blocks == 3
        fast = c._fast
        sid = c.session
        # the daemon forgets the session (its KeepAlive ended): the socket refuses
        uds_daemon.call(uds_daemon.daemon.sessions.pop, sid)
        with pytest.raises(NotFound, match="ended"):
            fast.lookup(c._ns_wire[ns], b"".join(keys))


def test_client_falls_back_to_grpc_when_the_socket_breaks(uds_daemon):
    with Client(uds_daemon.target) as c:
        ns = _ns()
        keys = _fill(c, ns, 4)
        c._fast.sock.close()  # as if the daemon side went away
        assert c.lookup(ns, keys).hit_blocks == 4
        assert c._fast is None
        assert c.lookup(ns, keys).hit_blocks == 4


def test_tcp_daemon_offers_no_fast_socket(make_daemon):
    d = make_daemon()
    assert d.running.fast is None
    with Client(d.target) as c:
        assert c._fast is None
        ns = _ns()
        keys = _fill(c, ns, 2)
        assert c.lookup(ns, keys).hit_blocks == 2


def test_lookup_socket_off(make_daemon, tmp_path):
    d = make_daemon(server__host="", server__unix_socket=str(tmp_path / "kv.sock"), server__lookup_socket="off")
    assert d.running.fast is None
    with Client(d.target) as c:
        assert c._fast is None


# ---------------------------------------------- control calls of the shm path
class _NoGrpc:
    """Stands in for the gRPC stub: any data-path call through it fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"{name} went over gRPC, not the fast socket")


def test_put_get_and_two_phase_calls_go_over_the_socket(uds_daemon):
    with Client(uds_daemon.target) as c:
        ns = _ns()
        keys = block_keys(ns, np.arange(16 * 6, dtype=np.uint32))
        data = [np.full(BS, i, np.uint8) for i in range(6)]
        stub, c.stub = c.stub, _NoGrpc()
        try:
            assert c.put(ns, keys, data) == [KeyStatus.OK] * 6
            outs = [np.zeros(BS, np.uint8) for _ in keys]
            assert c.get_into(ns, keys, outs) == [KeyStatus.OK] * 6
            assert all(np.array_equal(o, d) for o, d in zip(outs, data))
            more = block_keys(ns, np.arange(16 * 8, dtype=np.uint32))[6:]
            res = c.reserve(ns, more, BS, parent=keys[-1])
            for off, ln in zip(res.offsets, res.lengths):
                c._view(off, ln)[:] = 7
            assert c.commit(res) == [KeyStatus.OK] * 2
            with c.acquire(ns, keys + more) as lease:
                assert lease.hit_blocks == 8 and int(lease.views[7][0]) == 7
                assert uds_daemon.call(uds_daemon.store.stats).tiers[0].pinned_bytes == 8 * BS
            r2 = c.reserve(ns, block_keys(ns, np.arange(16 * 9, dtype=np.uint32))[8:], BS, parent=more[-1])
            assert c.abort(r2) == 1
        finally:
            c.stub = stub
        assert uds_daemon.call(uds_daemon.store.stats).tiers[0].pinned_bytes == 0  # the lease was released
        assert c.lookup(ns, keys + more).hit_blocks == 8


def test_socket_calls_keep_the_handlers_checks(make_daemon, tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "acme"\ntoken = "tok-acme"\n')
    d = make_daemon(server__host="", server__unix_socket=str(tmp_path / "kv.sock"),
                    server__tenants_file=str(tenants))
    from proto import kvstore_pb2 as pb

    with Client(d.target, token="tok-acme") as c:
        ns = _ns("acme")
        keys = _fill(c, ns, 3)
        assert c.lookup(ns, keys).hit_blocks == 3
        with pytest.raises(PermissionDenied):  # another tenant's namespace: refused, socket kept
            c.lookup(_ns("beta"), keys)
        assert c._fast is not None
        # without the token the same session gets UNAUTHENTICATED for a call
        raw = LookupSocketClient(d.running.fast.path, c.session)
        try:
            with pytest.raises(Unauthenticated):
                raw.call("Release", pb.ReleaseRequest(lease_id="x").SerializeToString())
        finally:
            raw.close()
        raw = LookupSocketClient(d.running.fast.path, c.session, token="tok-acme")
        try:
            with pytest.raises(NotFound):  # a lease this session does not hold
                raw.call("Release", pb.ReleaseRequest(lease_id="nope").SerializeToString())
            with pytest.raises(InvalidArgument):
                raw.call("Acquire", b"\xff\xff\xff")
            raw.sock.sendall(struct.pack("<I", 3) + b"\xff\xff\x09")  # method 9 does not exist
            with pytest.raises(InvalidArgument, match="unknown method"):
                raw._answer()
        finally:
            raw.close()


def test_a_broken_socket_fails_the_call_then_grpc_takes_over(uds_daemon):
    with Client(uds_daemon.target) as c:
        ns = _ns()
        keys = block_keys(ns, np.arange(16 * 2, dtype=np.uint32))
        c._fast.sock.close()
        with pytest.raises(Unavailable):
            c.put(ns, keys, [np.zeros(BS, np.uint8)] * 2)
        assert c._fast is None
        assert c.put(ns, keys, [np.zeros(BS, np.uint8)] * 2) == [KeyStatus.OK] * 2
        assert c.get(ns, keys)[1] is not None
