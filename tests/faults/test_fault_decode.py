"""Request bytes that do not decode (issue 19, item 9): every unary and
server-streaming method of KVStore, Admin and Cluster answers them with
INVALID_ARGUMENT and a short message naming the request type (grpc's own
answer was ``UNKNOWN: Unexpected DecodeError`` with a traceback in the log
per call); a caller without a valid token still gets UNAUTHENTICATED; the
log gets one line per peer however many garbage calls arrive, and no
traceback."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
import pytest

from proto import kvstore_pb2 as pb
from tests.faults.faultlib import record

TENANTS = ('[[tenant]]\nname = "acme"\ntoken = "tok-acme"\n\n'
           '[[tenant]]\nname = "ops"\ntoken = "tok-admin"\nadmin = true\n')
GARBAGE = (b"\xff\xff\xff", b"\x0a\x05\xff", b"\x80" * 11, b"\x12\x02\xc3\x28")
"""Corrupt wire format, a truncated length-delimited field, a varint over 10 bytes, and
(for requests whose field 2 is a string) bad UTF-8."""


def _methods() -> list[tuple[str, bool, type]]:
    out = []
    for svc in ("KVStore", "Admin", "Cluster"):
        sd = pb.DESCRIPTOR.services_by_name[svc]
        for m in sd.methods:
            if not m.client_streaming:
                out.append((f"/{sd.full_name}/{m.name}", m.server_streaming, getattr(pb, m.input_type.name)))
    return out


def _undecodable(cls: type, data: bytes) -> bool:
    try:
        cls.FromString(data)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - DecodeError or a bad UTF-8 string
        return True
    return False


async def _codes(target: str, token: str) -> list[tuple[str, bytes, grpc.StatusCode, str]]:
    md = (("authorization", f"Bearer {token}"),) if token else ()
    out = []
    async with grpc.aio.insecure_channel(target) as ch:
        for path, streaming, cls in _methods():
            for data in GARBAGE:
                if not _undecodable(cls, data):
                    continue
                try:
                    if streaming:
                        async for _ in ch.unary_stream(path, request_serializer=None)(data, metadata=md, timeout=10):
                            pass
                    else:
                        await ch.unary_unary(path, request_serializer=None)(data, metadata=md, timeout=10)
                    out.append((path, data, grpc.StatusCode.OK, ""))
                except grpc.aio.AioRpcError as e:
                    out.append((path, data, e.code(), e.details() or ""))
    return out


def test_undecodable_requests_get_invalid_argument(make_daemon, tmp_path: Path, caplog) -> None:
    tf = tmp_path / "tenants.toml"
    tf.write_text(TENANTS)
    d = make_daemon(server__tenants_file=str(tf))
    caplog.set_level(logging.INFO)
    got = asyncio.run(_codes(d.target, "tok-admin"))
    methods = {path for path, *_ in got}
    assert methods == {path for path, _, _ in _methods()} and len(methods) >= 20  # every one of them
    bad = [(p, data, c) for p, data, c, _ in got if c != grpc.StatusCode.INVALID_ARGUMENT]
    record("security", undecodable_wrong_code=len(bad))
    assert not bad, bad
    for path, _, _, msg in got:
        assert msg.startswith("request is not a valid kvstore.v1.") and len(msg) < 200, (path, msg)
    # the tenant's token is checked before the bytes: without one, UNAUTHENTICATED
    anon = asyncio.run(_codes(d.target, ""))
    assert {c for _, _, c, _ in anon} == {grpc.StatusCode.UNAUTHENTICATED}
    # logged once for this peer, never with a traceback
    lines = [r for r in caplog.records if r.name == "kvstore.daemon.decode"]
    tracebacks = [r for r in caplog.records if r.exc_info or "Unexpected" in r.getMessage()]
    record("security", undecodable_log_lines=len(lines), undecodable_tracebacks=len(tracebacks))
    assert len(lines) == 1 and "127.0.0.1" in lines[0].getMessage(), [r.getMessage() for r in lines]
    assert not [r for r in caplog.records if r.exc_info or "Unexpected" in r.getMessage()]
    guard = d.daemon.decode_guard
    assert guard.rejected == len(got) and guard.logged == 1
    assert b'code="INVALID_ARGUMENT"' in d.daemon.metrics.render()
    record("security", undecodable_calls=len(got) + len(anon), undecodable_methods=len(methods))


def test_decode_log_is_rate_limited_per_peer() -> None:
    from kvstore.daemon.decode import MAX_LINES_PER_MIN, PER_PEER_S, DecodeGuard, Undecodable

    now = [0.0]
    g = DecodeGuard(clock=lambda: now[0])
    bad = Undecodable("kvstore.v1.LookupRequest", "Wire format was corrupt")
    for _ in range(1000):
        g.note("Lookup", "ipv4:10.0.0.1:5000", bad)
    assert g.logged == 1
    now[0] += PER_PEER_S
    g.note("Lookup", "ipv4:10.0.0.1:6000", bad)  # another connection of the same host
    assert g.logged == 2
    for i in range(100):  # many hosts at once: at most MAX_LINES_PER_MIN lines a minute
        g.note("Lookup", f"ipv4:10.0.1.{i}:1", bad)
    assert g.logged == 2 + MAX_LINES_PER_MIN - 1
    assert g.rejected == 1101


@pytest.mark.parametrize("peer,host", [("ipv4:127.0.0.1:5431", "ipv4:127.0.0.1"),
                                       ("ipv6:[::1]:80", "ipv6:[::1]"), ("unix:/tmp/x.sock", "unix")])
def test_peer_host(peer: str, host: str) -> None:
    from kvstore.daemon import decode

    assert decode.peer_host(peer) == host
