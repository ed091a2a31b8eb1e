"""Mixed versions over gRPC (docs/operations.md, Upgrades): a client newer
than its daemon is refused where the daemon would otherwise ignore what it
sent and answer wrongly; what a daemon can safely ignore it still serves."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from kvstore.daemon.state import PROTOCOL_VERSION
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc
from tests.support.daemon import DaemonThread


@pytest.fixture
def stub() -> Iterator[pb_grpc.KVStoreStub]:
    d = DaemonThread({})
    try:
        with grpc.insecure_channel(d.target) as ch:
            yield pb_grpc.KVStoreStub(ch)
    finally:
        d.stop()


def test_a_handshake_of_a_newer_protocol_is_refused(stub: pb_grpc.KVStoreStub) -> None:
    ok = stub.Handshake(pb.HandshakeRequest(client_name="t", protocol_version=PROTOCOL_VERSION), timeout=30)
    assert ok.protocol_version == PROTOCOL_VERSION and ok.session_id
    with pytest.raises(grpc.RpcError) as e:
        stub.Handshake(pb.HandshakeRequest(client_name="t", protocol_version=PROTOCOL_VERSION + 1), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"protocol {PROTOCOL_VERSION + 1}" in e.value.details()


def test_a_namespace_field_this_daemon_does_not_know_is_refused_not_ignored(stub: pb_grpc.KVStoreStub) -> None:
    """A Namespace field names what makes KV interchangeable: dropping one a
    newer client set would merge two namespaces that must stay apart."""
    ns = pb.Namespace(model_id="m", block_size=16)
    key = bytes(16)
    assert stub.Lookup(pb.LookupRequest(ns=ns, keys=[key]), timeout=30).hit_blocks == 0
    newer = pb.Namespace.FromString(ns.SerializeToString() + bytes([13 << 3 | 2, 2]) + b"q8")  # field 13
    with pytest.raises(grpc.RpcError) as e:
        stub.Lookup(pb.LookupRequest(ns=newer, keys=[key]), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "field 13" in e.value.details()
