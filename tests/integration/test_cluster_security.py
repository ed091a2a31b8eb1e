"""Cluster security (issue 19, items 7 and 8): two daemons with TLS on (mutual
TLS, certificates from a CA made in the test) and auth on reach each other,
publish and find each other's blocks; a client without a certificate is
refused; the cluster with auth off does not start unless
``cluster.allow_insecure_unauthenticated`` says so (in-process and through
``kvstore serve``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from kvstore.client import ns_pb
from kvstore.config import ConfigError, load_config
from kvstore.daemon import peers
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc
from tests.faults.faultlib import free_port
from tests.integration import cluster_fake
from tests.integration.test_cluster_inproc import NS, chain, payloads
from tests.support.daemon import DaemonThread
from tests.support.tls import make_ca
from tests.support.waits import wait_healthy, wait_until

ROOT = Path(__file__).resolve().parents[2]
TENANTS = ('[[tenant]]\nname = "acme"\ntoken = "tok-acme"\n\n'
           '[[tenant]]\nname = "ops"\ntoken = "tok-peer"\nadmin = true\n')


@pytest.fixture(autouse=True)
def fake_transport(monkeypatch):
    monkeypatch.setattr(peers, "transport_factory", cluster_fake.fake_transport)


@pytest.fixture
def tls_daemons():
    made: list[DaemonThread] = []

    def make(creds: grpc.ChannelCredentials, **overrides: object) -> DaemonThread:
        d = DaemonThread({k.replace("__", "."): v for k, v in overrides.items()})
        made.append(d)
        wait_healthy(d.target, 20, creds)
        return d

    yield make
    for d in made:
        d.stop()


def test_two_daemons_with_mutual_tls_reach_each_other(tls_daemons, tmp_path: Path, monkeypatch) -> None:
    ca = make_ca(tmp_path / "ca")
    tf = tmp_path / "tenants.toml"
    tf.write_text(TENANTS)
    monkeypatch.setenv("KVSTORE_TEST_PEER_TOKEN", "tok-peer")
    ports = [free_port(), free_port()]
    addrs = ",".join(f"127.0.0.1:{p}" for p in ports)
    creds = grpc.ssl_channel_credentials(ca.read("ca"), ca.read("key"), ca.read("cert"))
    nodes = [tls_daemons(creds, server__port=p, server__tls_cert_file=ca.cert, server__tls_key_file=ca.key,
                         server__tls_client_ca_file=ca.ca, server__tenants_file=str(tf),
                         cluster__mode="static", cluster__peers=addrs, cluster__peer_token_env="KVSTORE_TEST_PEER_TOKEN",
                         cluster__probe_interval="100ms", cluster__publish_interval="10ms",
                         cluster__fetch_timeout="1s", cluster__prefill_tokens_per_s=10)
             for p in ports]
    md = [("authorization", "Bearer tok-acme")]
    chans = [grpc.secure_channel(f"127.0.0.1:{p}", creds) for p in ports]
    try:
        a, b = (pb_grpc.KVStoreStub(ch) for ch in chans)
        for stub in (a, b):  # each daemon's probe of the other went over mutual TLS with the peer token
            wait_until(lambda s=stub: s.Stats(pb.StatsRequest(), metadata=md, timeout=10).cluster_members == 2, 30,
                       "the peers reach each other over TLS")
        keys = chain(4)
        r = a.Put(pb.PutRequest(ns=ns_pb(NS), keys=keys, payloads=payloads(keys)), metadata=md, timeout=10)
        assert all(x.status == pb.STATUS_OK for x in r.results)
        # the directory update (Publish) went to its owner over TLS; b finds a's blocks
        wait_until(lambda: b.Lookup(pb.LookupRequest(ns=ns_pb(NS), keys=keys, cluster=True), metadata=md,
                                    timeout=10).remote_blocks == 4, 30, "b sees a's blocks")
        assert all(n.daemon.cluster.creds is not None for n in nodes)
        # a client without a certificate (or without TLS) is refused by the servers
        for ch in (grpc.secure_channel(f"127.0.0.1:{ports[0]}", grpc.ssl_channel_credentials(ca.read("ca"))),
                   grpc.insecure_channel(f"127.0.0.1:{ports[0]}")):
            with pytest.raises(grpc.RpcError) as ei:
                pb_grpc.KVStoreStub(ch).Stats(pb.StatsRequest(), metadata=md, timeout=5)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
            ch.close()
    finally:
        for ch in chans:
            ch.close()


def test_cluster_without_auth_needs_the_loud_flag(tmp_path: Path) -> None:
    base = {"cluster.mode": "static", "cluster.peers": "127.0.0.1:1"}
    with pytest.raises(ConfigError) as ei:
        load_config(None, {}, base)
    assert "cluster.allow_insecure_unauthenticated" in str(ei.value) and "auth is off" in str(ei.value)
    tf = tmp_path / "tenants.toml"
    tf.write_text(TENANTS)
    assert load_config(None, {}, {**base, "server.tenants_file": str(tf)}).cluster.mode.value == "static"
    cfg = load_config(None, {}, {**base, "cluster.allow_insecure_unauthenticated": True})
    assert cfg.cluster.allow_insecure_unauthenticated
    # the process refuses to start, naming the flag
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update({"KVSTORE_CLUSTER_MODE": "static", "KVSTORE_CLUSTER_PEERS": "127.0.0.1:1",
                "KVSTORE_SERVER_PORT": "0", "KVSTORE_METRICS_PORT": "0"})
    p = subprocess.run([sys.executable, "-m", "kvstore", "serve"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0
    assert "cluster.allow_insecure_unauthenticated" in p.stderr, p.stderr[-2000:]
