"""The daemon's wire surface, adversarially (issue r19): one row per method x
bad input against the real daemon (auth on, two tenants), over gRPC and, for
the calls it carries, over the same-host socket. Each row names the status
it must get (never UNKNOWN or INTERNAL) and a word its message must hold
(the bad field); after every row the daemon still serves, and the blocks
both tenants stored before are there with the same bytes.

test_fault_fuzz.py feeds random and mutated messages (any status but
UNKNOWN/INTERNAL passes there); this file asks for the right status."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest

from kvstore.client import Client, ns_pb
from kvstore.client.socket import LookupSocketClient
from kvstore.errors import KeyStatus, KVStoreError
from kvstore.wire.frames import CALLS
from kvstore.wire.shm import host_identity
from kvstore.wire.status import ERROR_FOR_CODE
from proto import kvstore_pb2 as pb
from tests.conftest import payload_for
from tests.support.daemon import DaemonThread
from tests.support.keys import chain_keys
from tests.support.waits import wait_healthy
from tests.support.tenants import ACME, BETA, TENANTS

BS = 4096


def P(tag: bytes, k: bytes, n: int = BS) -> bytes:
    return payload_for(tag, k, n)


class Caller:
    """One tenant's session: gRPC with its token and session id (a KeepAlive
    stream holds the session), and a same-host socket bound to it."""

    def __init__(self, d: DaemonThread, token: str) -> None:
        self.channel = grpc.insecure_channel(d.target)
        self.token = token
        hs = pb.HandshakeResponse.FromString(self.channel.unary_unary("/kvstore.v1.KVStore/Handshake")(
            pb.HandshakeRequest(client_name="wire-test", host_id=host_identity()).SerializeToString(),
            metadata=[("authorization", f"Bearer {token}")], timeout=10))
        self.session = hs.session_id
        self.keepalive = self.channel.unary_stream("/kvstore.v1.KVStore/KeepAlive")(
            pb.KeepAliveRequest(session_id=self.session).SerializeToString(), metadata=self.md())
        self.alive = threading.Thread(target=self._drain, daemon=True)
        self.alive.start()
        assert hs.lookup_socket, "the daemon offers no same-host socket"
        self.sock = LookupSocketClient(hs.lookup_socket, self.session, timeout=30, token=token)

    def _drain(self) -> None:
        try:
            for _ in self.keepalive:
                pass
        except grpc.RpcError:
            pass

    def md(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.token}"), ("x-kvstore-session", self.session)]

    def grpc(self, service: str, method: str, req: Any, md: list[tuple[str, str]] | None = None
             ) -> tuple[grpc.StatusCode, str, bytes]:
        path = f"/kvstore.v1.{service}/{method}"
        try:
            if method in ("Get", "WatchEvents"):
                out = b""
                call = self.channel.unary_stream(path)(req.SerializeToString(), metadata=md or self.md(),
                                                       timeout=2 if method == "WatchEvents" else 30)
                try:
                    for chunk in call:
                        out += chunk
                        if method == "WatchEvents":
                            call.cancel()
                            break
                except grpc.RpcError as e:
                    if e.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                        return grpc.StatusCode.OK, "", out
                    raise
                return grpc.StatusCode.OK, "", out
            resp = self.channel.unary_unary(path)(req.SerializeToString(), metadata=md or self.md(), timeout=30)
            return grpc.StatusCode.OK, "", resp
        except grpc.RpcError as e:
            return e.code(), e.details() or "", b""

    def socket(self, method: str, req: Any) -> tuple[grpc.StatusCode, str, bytes]:
        try:
            return grpc.StatusCode.OK, "", self.sock.call(method, req.SerializeToString())
        except KVStoreError as e:
            code = next(c for c, cls in ERROR_FOR_CODE.items() if type(e) is cls)
            return code, str(e), b""

    def close(self) -> None:
        self.sock.close()
        self.keepalive.cancel()
        self.channel.close()


@pytest.fixture(scope="module")
def wire(tmp_path_factory) -> Iterator[dict[str, Any]]:
    tmp: Path = tmp_path_factory.mktemp("wire")
    (tmp / "tenants.toml").write_text(TENANTS)
    d = DaemonThread({"server.tenants_file": str(tmp / "tenants.toml"), "dram.capacity": "16MiB",
                      "dram.page_size": "1MiB"})
    try:
        wait_healthy(d.target)
        acme, beta, ops = Caller(d, "tok-acme"), Caller(d, "tok-beta"), Caller(d, "tok-admin")
        stored = {ACME: chain_keys(1, 8, ACME), BETA: chain_keys(2, 8, BETA)}
        for ns, tok in ((ACME, "tok-acme"), (BETA, "tok-beta")):
            with Client(d.target, token=tok) as c:
                assert c.put(ns, stored[ns], [P(ns.tenant.encode(), k) for k in stored[ns]]) == [KeyStatus.OK] * 8
        yield {"d": d, "acme": acme, "beta": beta, "ops": ops, "stored": stored}
        for c in (acme, beta, ops):
            c.close()
    finally:
        d.stop()


def intact(w: dict[str, Any]) -> None:
    """The daemon serves, and both tenants' blocks are there with their bytes."""
    for ns, tok in ((ACME, "tok-acme"), (BETA, "tok-beta")):
        keys = w["stored"][ns]
        with Client(w["d"].target, token=tok) as c:
            got = c.get(ns, keys)
        assert [g.tobytes() if g is not None else None for g in got] == [P(ns.tenant.encode(), k) for k in keys]


# ---------------------------------------------------------------- the table
A = ns_pb(ACME)
K = chain_keys(1, 8, ACME)
NEW = chain_keys(77, 4, ACME)
OK_, INV, NF, PD = (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                    grpc.StatusCode.PERMISSION_DENIED)
B_NS = pb.Namespace(tenant="beta", model_id="llama", block_size=16)
NOBODY = pb.Namespace(tenant="nobody", model_id="llama", block_size=16)
BAD_NS = pb.Namespace(model_id="llama", block_size=0)

Row = tuple[str, str, str, Callable[[], Any], grpc.StatusCode, str]
ROWS: list[Row] = [
    # (case, service, method, request, status, a word the message names)
    ("lookup-packed-17", "KVStore", "Lookup", lambda: pb.LookupRequest(ns=A, keys_packed=b"k" * 17), INV,
     "keys_packed"),
    ("lookup-key-15", "KVStore", "Lookup", lambda: pb.LookupRequest(ns=A, keys=[b"k" * 15]), INV, "keys[0]"),
    ("lookup-both", "KVStore", "Lookup", lambda: pb.LookupRequest(ns=A, keys=[K[0]], keys_packed=K[0]), INV,
     "keys_packed"),
    ("lookup-no-keys", "KVStore", "Lookup", lambda: pb.LookupRequest(ns=A), OK_, ""),
    ("lookup-other-tenant", "KVStore", "Lookup", lambda: pb.LookupRequest(ns=B_NS, keys=K[:1]), PD, "tenant"),
    ("lookup-unknown-tenant", "KVStore", "Lookup", lambda: pb.LookupRequest(ns=NOBODY, keys=K[:1]), PD, "tenant"),
    ("lookup-block-size-0", "KVStore", "Lookup", lambda: pb.LookupRequest(ns=BAD_NS, keys=K[:1]), INV,
     "block_size"),
    ("lookup-unseen-ns", "KVStore", "Lookup",
     lambda: pb.LookupRequest(ns=pb.Namespace(model_id="never", block_size=16), keys=K[:1]), OK_, ""),
    ("reserve-packed-17", "KVStore", "Reserve",
     lambda: pb.ReserveRequest(ns=A, keys_packed=b"k" * 17, block_bytes=BS), INV, "keys_packed"),
    ("reserve-no-size", "KVStore", "Reserve", lambda: pb.ReserveRequest(ns=A, keys=NEW[:1]), INV, "block_bytes"),
    ("reserve-both-sizes", "KVStore", "Reserve",
     lambda: pb.ReserveRequest(ns=A, keys=NEW[:1], sizes=[BS], block_bytes=BS), INV, "block_bytes"),
    ("reserve-sizes-short", "KVStore", "Reserve", lambda: pb.ReserveRequest(ns=A, keys=NEW[:2], sizes=[BS]),
     INV, "sizes"),
    ("reserve-parent-15", "KVStore", "Reserve",
     lambda: pb.ReserveRequest(ns=A, keys=NEW[:1], block_bytes=BS, parent=b"p" * 15), INV, "parent"),
    ("reserve-tier-ssd", "KVStore", "Reserve",
     lambda: pb.ReserveRequest(ns=A, keys=NEW[:1], block_bytes=BS, tier=3), INV, "tier"),
    ("reserve-tier-99", "KVStore", "Reserve",
     lambda: pb.ReserveRequest(ns=A, keys=NEW[:1], block_bytes=BS, tier=99), INV, "tier"),
    ("reserve-other-tenant", "KVStore", "Reserve",
     lambda: pb.ReserveRequest(ns=B_NS, keys=NEW[:1], block_bytes=BS), PD, "tenant"),
    ("reserve-bad-ns", "KVStore", "Reserve", lambda: pb.ReserveRequest(ns=BAD_NS, keys=NEW[:1], block_bytes=BS),
     INV, "block_size"),
    ("commit-unknown", "KVStore", "Commit", lambda: pb.CommitRequest(reservation_id="r-nope"), NF, "reservation"),
    ("commit-empty-id", "KVStore", "Commit", lambda: pb.CommitRequest(), NF, "reservation"),
    ("commit-partial", "KVStore", "Commit", lambda: pb.CommitRequest(reservation_id="r-nope", keys=[K[0]]), INV,
     "keys"),
    ("abort-unknown", "KVStore", "Abort", lambda: pb.AbortRequest(reservation_id="r-nope"), NF, "reservation"),
    ("acquire-packed-17", "KVStore", "Acquire", lambda: pb.AcquireRequest(ns=A, keys_packed=b"k" * 17), INV,
     "keys_packed"),
    ("acquire-key-15", "KVStore", "Acquire", lambda: pb.AcquireRequest(ns=A, keys=[b"k" * 15]), INV, "keys[0]"),
    ("acquire-tier-ssd", "KVStore", "Acquire", lambda: pb.AcquireRequest(ns=A, keys=K[:1], tier=3), INV, "tier"),
    ("acquire-other-tenant", "KVStore", "Acquire", lambda: pb.AcquireRequest(ns=B_NS, keys=K[:1]), PD, "tenant"),
    ("acquire-no-keys", "KVStore", "Acquire", lambda: pb.AcquireRequest(ns=A), OK_, ""),
    ("release-unknown", "KVStore", "Release", lambda: pb.ReleaseRequest(lease_id="l-nope"), NF, "lease"),
    ("release-empty-id", "KVStore", "Release", lambda: pb.ReleaseRequest(), NF, "lease"),
    ("put-key-15", "KVStore", "Put", lambda: pb.PutRequest(ns=A, keys=[b"k" * 15], payloads=[b"x"]), INV,
     "keys[0]"),
    ("put-payloads-short", "KVStore", "Put", lambda: pb.PutRequest(ns=A, keys=NEW[:2], payloads=[b"x"]), INV,
     "payloads"),
    ("put-checksums-short", "KVStore", "Put",
     lambda: pb.PutRequest(ns=A, keys=NEW[:2], payloads=[b"x"] * 2, checksums=[1]), INV, "checksums"),
    ("put-parent-15", "KVStore", "Put",
     lambda: pb.PutRequest(ns=A, keys=NEW[:1], payloads=[b"x"], parent=b"p" * 15), INV, "parent"),
    ("put-other-tenant", "KVStore", "Put", lambda: pb.PutRequest(ns=B_NS, keys=NEW[:1], payloads=[b"x"]), PD,
     "tenant"),
    ("get-key-15", "KVStore", "Get", lambda: pb.GetRequest(ns=A, keys=[b"k" * 15]), INV, "keys[0]"),
    ("get-other-tenant", "KVStore", "Get", lambda: pb.GetRequest(ns=B_NS, keys=K[:1]), PD, "tenant"),
    ("prefetch-packed-17", "KVStore", "Prefetch", lambda: pb.PrefetchRequest(ns=A, keys_packed=b"k" * 17), INV,
     "keys_packed"),
    ("prefetch-other-tenant", "KVStore", "Prefetch", lambda: pb.PrefetchRequest(ns=B_NS, keys=K[:1]), PD,
     "tenant"),
    ("corrupt-key-15", "KVStore", "ReportCorrupt", lambda: pb.ReportCorruptRequest(ns=A, keys=[b"k" * 15]), INV,
     "keys[0]"),
    ("corrupt-other-tenant", "KVStore", "ReportCorrupt", lambda: pb.ReportCorruptRequest(ns=B_NS, keys=K[:1]), PD,
     "tenant"),
    ("remove-key-15", "KVStore", "Remove", lambda: pb.RemoveRequest(ns=A, keys=[b"k" * 15]), INV, "keys[0]"),
    ("remove-other-tenant", "KVStore", "Remove", lambda: pb.RemoveRequest(ns=B_NS, keys=K[:1]), PD, "tenant"),
    ("clear-neither", "KVStore", "Clear", lambda: pb.ClearRequest(), INV, "all_namespaces"),
    ("clear-both", "KVStore", "Clear", lambda: pb.ClearRequest(ns=A, all_namespaces=True), INV, "all_namespaces"),
    ("clear-other-tenant", "KVStore", "Clear", lambda: pb.ClearRequest(ns=B_NS), PD, "tenant"),
    ("watch-other-tenant", "KVStore", "WatchEvents", lambda: pb.WatchRequest(ns=B_NS), PD, "tenant"),
    ("admit-ttft-0", "KVStore", "Admit", lambda: pb.AdmitRequest(ns=A, keys=K[:1], n_tokens=16), INV,
     "ttft_target_s"),
    ("admit-ttft-inf", "KVStore", "Admit",
     lambda: pb.AdmitRequest(ns=A, keys=K[:1], n_tokens=16, ttft_target_s=float("inf")), INV, "ttft_target_s"),
    ("admit-queue-nan", "KVStore", "Admit",
     lambda: pb.AdmitRequest(ns=A, keys=K[:1], n_tokens=16, ttft_target_s=1.0, queue_wait_s=float("nan")), INV,
     "queue_wait_s"),
    ("admit-queue-negative", "KVStore", "Admit",
     lambda: pb.AdmitRequest(ns=A, keys=K[:1], n_tokens=16, ttft_target_s=1.0, queue_wait_s=-1.0), INV,
     "queue_wait_s"),
    ("admit-tokens-short", "KVStore", "Admit",
     lambda: pb.AdmitRequest(ns=A, keys=K[:4], n_tokens=16, ttft_target_s=1.0), INV, "n_tokens"),
    ("admit-packed-17", "KVStore", "Admit",
     lambda: pb.AdmitRequest(ns=A, keys_packed=b"k" * 17, n_tokens=16, ttft_target_s=1.0), INV, "keys_packed"),
    ("admit-other-tenant", "KVStore", "Admit",
     lambda: pb.AdmitRequest(ns=B_NS, keys=K[:1], n_tokens=16, ttft_target_s=1.0), PD, "tenant"),
    ("report-nan", "KVStore", "Report", lambda: pb.ReportRequest(decision_id=1, actual_ttft_s=float("nan")), INV,
     "actual_ttft_s"),
    ("report-inf", "KVStore", "Report", lambda: pb.ReportRequest(decision_id=1, actual_ttft_s=float("inf")), INV,
     "actual_ttft_s"),
    ("report-queue-nan", "KVStore", "Report",
     lambda: pb.ReportRequest(decision_id=1, actual_ttft_s=1.0, queue_s=float("nan")), INV, "queue_s"),
    ("resize-not-admin", "Admin", "ResizeTier", lambda: pb.ResizeTierRequest(tier=2, capacity_bytes=1), PD,
     "admin"),
    ("config-not-admin", "Admin", "GetConfig", lambda: pb.GetConfigRequest(), PD, "admin"),
    ("policy-not-admin", "Admin", "SetEvictionPolicy", lambda: pb.SetEvictionPolicyRequest(policy="lru"), PD,
     "admin"),
    ("nodeinfo-not-admin", "Cluster", "NodeInfo", lambda: pb.NodeInfoRequest(), PD, "admin"),
    ("locate-not-admin", "Cluster", "Locate", lambda: pb.LocateRequest(ns_digest=b"d" * 16), PD, "admin"),
    ("publish-not-admin", "Cluster", "Publish", lambda: pb.PublishRequest(node_id="n"), PD, "admin"),
]
ADMIN_ROWS: list[Row] = [
    ("resize-tier-0", "Admin", "ResizeTier", lambda: pb.ResizeTierRequest(capacity_bytes=1 << 20), INV, "tier"),
    ("resize-tier-99", "Admin", "ResizeTier", lambda: pb.ResizeTierRequest(tier=99, capacity_bytes=1 << 20), INV,
     "tier"),
    ("resize-ssd-absent", "Admin", "ResizeTier", lambda: pb.ResizeTierRequest(tier=3, capacity_bytes=1 << 20), NF,
     "ssd"),
    ("resize-huge", "Admin", "ResizeTier", lambda: pb.ResizeTierRequest(tier=2, capacity_bytes=2**64 - 1), INV,
     "capacity"),
    ("policy-unknown", "Admin", "SetEvictionPolicy", lambda: pb.SetEvictionPolicyRequest(policy="nope"), INV,
     "policy"),
    ("policy-empty", "Admin", "SetEvictionPolicy", lambda: pb.SetEvictionPolicyRequest(), INV, "policy"),
    ("locate-digest-15", "Cluster", "Locate", lambda: pb.LocateRequest(ns_digest=b"d" * 15), INV, "ns_digest"),
    ("locate-packed-17", "Cluster", "Locate",
     lambda: pb.LocateRequest(ns_digest=b"d" * 16, keys_packed=b"k" * 17), INV, "keys_packed"),
    ("publish-digest-15", "Cluster", "Publish",
     lambda: pb.PublishRequest(node_id="n", updates=[pb.DirectoryUpdate(ns_digest=b"d" * 15)]), INV,
     "ns_digest"),
    ("publish-packed-17", "Cluster", "Publish",
     lambda: pb.PublishRequest(node_id="n", updates=[pb.DirectoryUpdate(ns_digest=b"d" * 16,
                                                                        keys_packed=b"k" * 17)]), INV,
     "keys_packed"),
]


def _check(got: tuple[grpc.StatusCode, str, bytes], want: grpc.StatusCode, word: str, what: str) -> None:
    code, msg, _ = got
    assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (what, code, msg)
    assert code == want, (what, code, msg)
    assert word in msg, (what, f"the message does not name {word!r}", msg)


@pytest.mark.parametrize("row", ROWS + ADMIN_ROWS, ids=[r[0] for r in ROWS + ADMIN_ROWS])
def test_each_method_answers_each_bad_input_with_its_status(wire, row: Row) -> None:
    case, service, method, build, want, word = row
    who = wire["ops"] if row in ADMIN_ROWS else wire["acme"]
    got = who.grpc(service, method, build())
    _check(got, want, word, f"{case} over gRPC")
    if method in CALLS:  # the same-host socket answers the same
        sgot = who.socket(method, build())
        _check(sgot, want, word, f"{case} over the same-host socket")
    intact(wire)


# ------------------------------------------------------ protocol out of order
def _reserve(c: Caller, keys: list[bytes], over: str = "grpc") -> pb.ReserveResponse:
    req = pb.ReserveRequest(ns=A, keys=keys, block_bytes=BS)
    code, msg, raw = c.grpc("KVStore", "Reserve", req) if over == "grpc" else c.socket("Reserve", req)
    assert code == OK_, msg
    r = pb.ReserveResponse.FromString(raw)
    assert r.reservation_id and list(r.slots.status) == [0] * len(keys)
    return r


def _acquire(c: Caller, keys: list[bytes], over: str = "grpc") -> pb.AcquireResponse:
    req = pb.AcquireRequest(ns=A, keys=keys, promote=True)
    code, msg, raw = c.grpc("KVStore", "Acquire", req) if over == "grpc" else c.socket("Acquire", req)
    assert code == OK_, msg
    return pb.AcquireResponse.FromString(raw)


@pytest.mark.parametrize("over", ["grpc", "socket"])
def test_protocol_steps_out_of_order(wire, over: str) -> None:
    acme, beta, d = wire["acme"], wire["beta"], wire["d"]

    def call(c: Caller, method: str, req: Any) -> tuple[grpc.StatusCode, str, bytes]:
        return c.grpc("KVStore", method, req) if over == "grpc" else c.socket(method, req)

    fresh = chain_keys(300 if over == "grpc" else 400, 3, ACME)
    # Commit (and Abort) of a reservation never made, of another tenant's, twice
    r = _reserve(acme, fresh, over)
    _check(call(beta, "Commit", pb.CommitRequest(reservation_id=r.reservation_id)), PD, "reservation", "foreign")
    _check(call(beta, "Abort", pb.AbortRequest(reservation_id=r.reservation_id)), PD, "reservation", "foreign")
    _check(call(acme, "Commit", pb.CommitRequest(reservation_id=r.reservation_id, checksums=[1])), INV,
           "checksums", "checksums of the wrong count")
    _check(call(acme, "Commit", pb.CommitRequest(reservation_id=r.reservation_id)), NF, "reservation",
           "commit after a failed commit")
    r = _reserve(acme, fresh, over)
    assert call(acme, "Commit", pb.CommitRequest(reservation_id=r.reservation_id))[0] == OK_
    _check(call(acme, "Commit", pb.CommitRequest(reservation_id=r.reservation_id)), NF, "reservation", "twice")
    _check(call(acme, "Abort", pb.AbortRequest(reservation_id=r.reservation_id)), NF, "reservation",
           "abort after commit")
    # Release twice, another tenant's lease, an expired one
    lease = _acquire(acme, fresh, over)
    assert lease.hit_blocks == 3
    _check(call(beta, "Release", pb.ReleaseRequest(lease_id=lease.lease_id)), PD, "lease", "foreign lease")
    assert call(acme, "Release", pb.ReleaseRequest(lease_id=lease.lease_id))[0] == OK_
    _check(call(acme, "Release", pb.ReleaseRequest(lease_id=lease.lease_id)), NF, "lease", "release twice")
    # Commit after the reservation expired (the reaper runs with a clock far ahead)
    late = chain_keys(500 if over == "grpc" else 600, 2, ACME)
    r = _reserve(acme, late, over)
    assert d.call(d.store.reap, time.monotonic() + 1e6) >= 1
    _check(call(acme, "Commit", pb.CommitRequest(reservation_id=r.reservation_id)), NF, "reservation",
           "commit after expiry")
    lk = pb.LookupRequest(ns=A, keys=late)
    assert pb.LookupResponse.FromString(call(acme, "Lookup", lk)[2]).hit_blocks == 0
    # duplicate keys and a parent that is not stored: per-key statuses, nothing else disturbed
    dup = chain_keys(700 if over == "grpc" else 800, 1, ACME)
    r = pb.ReserveResponse.FromString(call(acme, "Reserve", pb.ReserveRequest(ns=A, keys=dup * 3,
                                                                             block_bytes=BS))[2])
    assert list(r.slots.status) == [KeyStatus.OK, KeyStatus.INVALID, KeyStatus.INVALID]
    assert "repeats" in r.details[1]
    call(acme, "Abort", pb.AbortRequest(reservation_id=r.reservation_id))
    r = pb.ReserveResponse.FromString(call(acme, "Reserve", pb.ReserveRequest(ns=A, keys=dup, parent=b"\x01" * 16,
                                                                             block_bytes=BS))[2])
    assert list(r.slots.status) == [KeyStatus.PARENT_MISSING] and "parent" in r.details[0]
    intact(wire)


def test_a_report_with_a_bad_value_is_refused_before_it_counts(wire) -> None:
    """A Report whose numbers are not finite, non-negative seconds is
    refused whole: the decision stays for a good report, and the predictor's
    figures are untouched."""
    acme = wire["acme"]
    code, msg, raw = acme.grpc("KVStore", "Admit", pb.AdmitRequest(ns=A, keys=K[:1], n_tokens=4096,
                                                                   ttft_target_s=10.0))
    assert code == OK_, msg
    did = pb.AdmitResponse.FromString(raw).decision_id
    assert did
    before = pb.StatsResponse.FromString(acme.grpc("KVStore", "Stats", pb.StatsRequest())[2])
    for bad in (pb.ReportRequest(decision_id=did, actual_ttft_s=1.0, queue_s=float("nan")),
                pb.ReportRequest(decision_id=did, actual_ttft_s=1.0, queue_s=-1.0),
                pb.ReportRequest(decision_id=did, actual_ttft_s=float("inf"))):
        _check(acme.grpc("KVStore", "Report", bad), INV, "queue_s" if bad.queue_s else "actual_ttft_s", str(bad))
    after = pb.StatsResponse.FromString(acme.grpc("KVStore", "Stats", pb.StatsRequest())[2])
    assert after.ttft_error_ewma_s == before.ttft_error_ewma_s
    assert after.prefill_tokens_per_s == before.prefill_tokens_per_s
    code, msg, raw = acme.grpc("KVStore", "Report", pb.ReportRequest(decision_id=did, actual_ttft_s=0.5))
    assert code == OK_ and pb.ReportResponse.FromString(raw).matched, msg


def test_a_tenant_holding_its_share_cannot_evict_another_tenants_blocks(tmp_path) -> None:
    """Shares acme 0.5, beta 0.5 of an 8 MiB DRAM tier. beta holds 4 MiB
    (its share); acme holds its 4 MiB where eviction cannot take them (an
    open reservation, then a lease), and asks for 4 MiB more: that request
    is over acme's share, so it gets the free slots (none) and evicts
    nothing of beta's (the old daemon, finding acme's own blocks held, went
    on to evict beta's in policy order: beta lost every block)."""
    (tmp_path / "tenants.toml").write_text(TENANTS.replace('name = "acme"', 'name = "acme"\nshare = 0.5')
                                           .replace('name = "beta"', 'name = "beta"\nshare = 0.5'))
    d = DaemonThread({"server.tenants_file": str(tmp_path / "tenants.toml"), "dram.capacity": "8MiB",
                      "dram.page_size": "1MiB", "admission.default_tenant_share": 0.0})
    big = 64 * 1024
    try:
        wait_healthy(d.target)
        with Client(d.target, token="tok-beta") as b, Client(d.target, token="tok-acme") as a:
            bk = chain_keys(11, 64, BETA)
            assert b.put(BETA, bk, [P(b"b", k, big) for k in bk]) == [KeyStatus.OK] * 64
            for hold in ("reservation", "lease"):
                mine = chain_keys(20 if hold == "reservation" else 21, 64, ACME)
                if hold == "reservation":
                    held = a.reserve(ACME, mine, big)
                    assert held.statuses == [KeyStatus.OK] * 64
                else:
                    assert a.put(ACME, mine, [P(b"a", k, big) for k in mine]) == [KeyStatus.OK] * 64
                    lease = a.acquire(ACME, mine)
                    assert lease.hit_blocks == 64
                more = a.reserve(ACME, chain_keys(30, 64, ACME), big)
                granted = sum(s == KeyStatus.OK for s in more.statuses)
                if more.reservation_id:
                    a.abort(more)
                assert b.lookup(BETA, bk).hit_blocks == 64, hold
                assert granted == 0, hold
                if hold == "reservation":
                    a.abort(held)
                else:
                    lease.release()
                    a.remove(ACME, mine)
            assert [g.tobytes() for g in b.get(BETA, bk)] == [P(b"b", k, big) for k in bk]
    finally:
        d.stop()
