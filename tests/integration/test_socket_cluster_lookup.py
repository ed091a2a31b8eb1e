"""A cluster-mode Lookup over the same-host socket (``frames.CALLS``'s
``Lookup``): the gRPC Lookup's answer and checks, through the same servicer
method; a daemon that does not know it there (one from before) makes the
client fall back to gRPC, keeping the socket for everything else."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.daemon import socket_server
from kvstore.errors import InvalidArgument, KeyStatus, PermissionDenied
from kvstore.keys import Namespace, block_keys
from kvstore.wire.frames import CALLS

BS = 4096


@pytest.fixture
def uds_daemon(make_daemon, tmp_path):
    return make_daemon(server__host="", server__unix_socket=str(tmp_path / "kv.sock"))


class _NoGrpc:
    """Stands in for the gRPC stub: any call through it fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"{name} went over gRPC, not the same-host socket")


def _ns(tenant: str = "t") -> Namespace:
    return Namespace(tenant=tenant, model_id="m", block_size=16)


def _fill(c: Client, ns: Namespace, n: int) -> list[bytes]:
    keys = block_keys(ns, np.arange(n * 16, dtype=np.uint32))
    assert c.put(ns, keys[:n - 2], [np.zeros(BS, np.uint8)] * (n - 2)) == [KeyStatus.OK] * (n - 2)
    c.flush()
    return keys


def test_cluster_lookup_goes_over_the_socket_and_answers_as_grpc(uds_daemon):
    with Client(uds_daemon.target) as fast, Client(uds_daemon.target, fast_lookup=False) as slow:
        assert fast._fast is not None and slow._fast is None
        ns = _ns()
        keys = _fill(fast, ns, 8)
        want = [slow.cluster_lookup(ns, k) for k in (keys, keys[:3], [])]
        stub, fast.stub = fast.stub, _NoGrpc()
        try:
            got = [fast.cluster_lookup(ns, k) for k in (keys, b"".join(keys[:3]), [])]
            with pytest.raises(InvalidArgument):  # refused by the daemon over the socket, as over gRPC
                fast.cluster_lookup(Namespace(tenant="t", model_id="", block_size=16), keys)
        finally:
            fast.stub = stub
        assert got == want
        assert got[0].local_blocks == 6 and got[0].status == "cluster off" and len(got[0].locations) == 6
        assert fast._fast is not None and fast.lookup_over_socket  # the refusal kept the socket


def test_socket_cluster_lookup_keeps_the_tenant_check(make_daemon, tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "acme"\ntoken = "tok-acme"\n')
    d = make_daemon(server__host="", server__unix_socket=str(tmp_path / "kv.sock"),
                    server__tenants_file=str(tenants))
    with Client(d.target, token="tok-acme") as c, Client(d.target, token="tok-acme", fast_lookup=False) as g:
        keys = _fill(c, _ns("acme"), 4)
        stub, c.stub = c.stub, _NoGrpc()
        try:
            assert c.cluster_lookup(_ns("acme"), keys).local_blocks == 2
            with pytest.raises(PermissionDenied):  # another tenant's namespace, as over gRPC
                c.cluster_lookup(_ns("beta"), keys)
        finally:
            c.stub = stub
        with pytest.raises(PermissionDenied):
            g.cluster_lookup(_ns("beta"), keys)
        assert c._fast is not None


def test_a_daemon_without_socket_lookup_is_asked_over_grpc(uds_daemon, monkeypatch):
    """A daemon from before ``Lookup`` joined ``CALLS`` answers 'unknown
    method id 6': the client asks over gRPC, from then on, and keeps the
    socket for the shared-memory path's calls."""
    assert CALLS.index("Lookup") == 5 and CALLS[:5] == ("Reserve", "Commit", "Abort", "Acquire", "Release")
    monkeypatch.setattr(socket_server, "CALLS", CALLS[:5])
    with Client(uds_daemon.target) as c:
        ns = _ns()
        keys = _fill(c, ns, 6)
        assert c.lookup_over_socket
        assert [c.cluster_lookup(ns, keys).local_blocks for _ in range(2)] == [4, 4]
        assert not c.lookup_over_socket and c._fast is not None
        stub, c.stub = c.stub, _NoGrpc()
        try:  # the socket still carries the shm path's calls
            outs = [np.ones(BS, np.uint8) for _ in keys[:4]]
            assert c.get_into(ns, keys[:4], outs) == [KeyStatus.OK] * 4
            with c.acquire(ns, keys) as lease:
                assert lease.hit_blocks == 4
        finally:
            c.stub = stub
