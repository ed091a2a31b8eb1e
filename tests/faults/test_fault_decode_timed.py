"""Undecodable and refused requests are timed like any other call (issue
r20, item 2): each one that reaches a handler, over gRPC or the same-host
socket, adds exactly one sample to ``kvstore_op_seconds{op=METHOD}`` and one
to ``kvstore_rpc_rejected_total{method=METHOD, code=...}``, whether its bytes
decoded or not and whether its caller's token was good or not."""

from __future__ import annotations

from pathlib import Path

import grpc

from kvstore.client.socket import LookupSocketClient
from kvstore.errors import InvalidArgument
from kvstore.wire.shm import host_identity
from proto import kvstore_pb2 as pb
from tests.support.daemon import DaemonThread

TENANTS = ('[[tenant]]\nname = "acme"\ntoken = "tok-acme"\n\n'
           '[[tenant]]\nname = "ops"\ntoken = "tok-admin"\nadmin = true\n')
GARBAGE = b"\xff\xff\xff"
"""Corrupt wire format: no request type decodes it."""


def _count(d: DaemonThread, name: str, labels: dict[str, str]) -> float:
    return d.daemon.metrics.registry.get_sample_value(name, labels) or 0.0


def _grpc_garbage(d: DaemonThread, method: str, token: str, n: int) -> set[grpc.StatusCode]:
    codes = set()
    md = [("authorization", f"Bearer {token}")] if token else []
    with grpc.insecure_channel(d.target) as ch:
        for _ in range(n):
            try:
                ch.unary_unary(f"/kvstore.v1.KVStore/{method}")(GARBAGE, metadata=md, timeout=10)
                codes.add(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.add(e.code())
    return codes


def test_undecodable_calls_are_timed_once_over_grpc_and_socket(make_daemon, tmp_path: Path) -> None:
    tf = tmp_path / "tenants.toml"
    tf.write_text(TENANTS)
    d = make_daemon(server__tenants_file=str(tf))

    def seconds(op: str) -> float:
        return _count(d, "kvstore_op_seconds_count", {"op": op})

    def rejected(op: str, code: str) -> float:
        return _count(d, "kvstore_rpc_rejected_total", {"method": op, "code": code})

    # gRPC, a good token: INVALID_ARGUMENT, timed and counted once per call
    before = seconds("Stats"), rejected("Stats", "INVALID_ARGUMENT")
    assert _grpc_garbage(d, "Stats", "tok-acme", 3) == {grpc.StatusCode.INVALID_ARGUMENT}
    assert (seconds("Stats"), rejected("Stats", "INVALID_ARGUMENT")) == (before[0] + 3, before[1] + 3)

    # gRPC, no token: UNAUTHENTICATED, still timed and counted once per call
    before = seconds("Lookup"), rejected("Lookup", "UNAUTHENTICATED")
    assert _grpc_garbage(d, "Lookup", "", 2) == {grpc.StatusCode.UNAUTHENTICATED}
    assert (seconds("Lookup"), rejected("Lookup", "UNAUTHENTICATED")) == (before[0] + 2, before[1] + 2)

    # the same-host socket: a call frame whose message does not decode
    with grpc.insecure_channel(d.target) as ch:
        hs = pb.HandshakeResponse.FromString(ch.unary_unary("/kvstore.v1.KVStore/Handshake")(
            pb.HandshakeRequest(client_name="t", host_id=host_identity()).SerializeToString(),
            metadata=[("authorization", "Bearer tok-acme")], timeout=10))
        assert hs.lookup_socket
        sock = LookupSocketClient(hs.lookup_socket, hs.session_id, timeout=30, token="tok-acme")
        try:
            before = seconds("Reserve"), rejected("Reserve", "INVALID_ARGUMENT")
            for _ in range(4):
                try:
                    sock.call("Reserve", GARBAGE)
                    raise AssertionError("an undecodable Reserve was answered OK")
                except InvalidArgument:
                    pass
            assert (seconds("Reserve"), rejected("Reserve", "INVALID_ARGUMENT")) == (before[0] + 4, before[1] + 4)
            # a decodable but invalid one goes through the RPC wrapper: counted once too
            before = seconds("Reserve"), rejected("Reserve", "INVALID_ARGUMENT")
            try:
                sock.call("Reserve", pb.ReserveRequest().SerializeToString())
                raise AssertionError("a Reserve without a namespace was answered OK")
            except InvalidArgument:
                pass
            assert (seconds("Reserve"), rejected("Reserve", "INVALID_ARGUMENT")) == (before[0] + 1, before[1] + 1)
        finally:
            sock.close()
