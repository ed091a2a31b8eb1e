"""Clients that reserve or acquire and then die (SIGKILL): the daemon
reclaims their reservations and leases when their KeepAlive streams end;
after 1,000 such deaths no slot, pin, lease, reservation or session is left.

Each child process opens many client sessions at once (each its own
session, reservation and lease) and is SIGKILLed while holding them all."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np

from kvstore.client import Client
from kvstore.errors import KeyStatus
from kvstore.core.index import BlockState
from kvstore.keys import Namespace, block_keys
from tests.conftest import payload_for
from tests.faults.faultlib import ROOT, isetting, record
from tests.integration.conftest import wait_until

NS = Namespace(tenant="acme", model_id="llama", block_size=16)
BS = 16 * 1024

CHILD = r"""
import os, sys, time
import numpy as np
from kvstore.client import Client
from kvstore.keys import Namespace, block_keys
target, n, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ns = Namespace(tenant="acme", model_id="llama", block_size=16)
shared = block_keys(ns, np.arange(8 * 16, dtype=np.int64))
held = []
for i in range(n):
    c = Client(target, timeout=30)
    own = block_keys(ns, np.random.default_rng(seed * 100000 + i).integers(0, 50000, size=2 * 16))
    r = c.reserve(ns, own, BS)              # reserved, half written, never committed
    if r.offsets:
        c.view(r.offsets[0], r.lengths[0])[:100] = 1
    lease = c.acquire(ns, shared[: 1 + i % 8])  # pinned, never released
    held.append((c, r, lease))
print("READY", len(held), flush=True)
time.sleep(600)
""".replace("BS", str(BS))


def _snapshot(d) -> dict[str, int]:
    def go() -> dict[str, int]:
        st = d.store
        idx = st.index
        rows = idx.used_rows()
        committed = rows[idx.state[rows] == BlockState.COMMITTED]
        slot = st.dram.footprint(BS)
        return {"sessions": len(d.daemon.sessions), "leases": st.hold_counts()[0], "reservations": st.hold_counts()[1],
                "pinned_rows": int((idx.pins[rows] > 0).sum()), "reserved_rows": int((idx.state[rows] == 1).sum()),
                "leaked_slots": (st.dram.used_bytes - int(committed.size) * slot) // slot}

    return d.call(go)


def test_a_thousand_client_deaths_leak_nothing(make_daemon) -> None:
    deaths = isetting("client_deaths", 1000)
    per_proc = isetting("clients_per_process", 50)
    d = make_daemon(dram__capacity="64MiB", dram__page_size="4MiB", server__lease_check_interval=0.2)
    shared = block_keys(NS, np.arange(8 * 16, dtype=np.int64))
    with Client(d.target) as c:
        assert c.put(NS, shared, [payload_for(b"d", k, BS) for k in shared]) == [KeyStatus.OK] * 8
    # the closed client's session ends when the daemon sees its KeepAlive go;
    # a baseline taken before that would count it
    wait_until(lambda: _snapshot(d)["sessions"] == 0, timeout=30, what="the closed client's session to end")
    baseline = _snapshot(d)
    killed = procs = peak_sessions = peak_leases = 0
    reclaim_s: list[float] = []
    while killed < deaths:
        n = min(per_proc, deaths - killed)
        p = subprocess.Popen([sys.executable, "-c", CHILD, d.target, str(n), str(procs)], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
        try:
            line = p.stdout.readline()  # type: ignore[union-attr]
            assert line.startswith("READY"), line
            snap = _snapshot(d)
            peak_sessions = max(peak_sessions, snap["sessions"])
            peak_leases = max(peak_leases, snap["leases"])
            assert snap["leases"] >= n and snap["reservations"] >= 1
        finally:
            p.kill()  # SIGKILL: no chance to release anything
            p.wait(30)
        t0 = time.monotonic()
        last: list[dict[str, int]] = []

        def reclaimed() -> bool:
            last[:] = [_snapshot(d)]
            return last[0] == baseline

        try:
            wait_until(reclaimed, timeout=60, what="reclaim after SIGKILL")
        except TimeoutError:
            raise AssertionError(f"not reclaimed after 60 s: {last[0]} (baseline {baseline})") from None
        reclaim_s.append(time.monotonic() - t0)
        killed += n
        procs += 1
    final = _snapshot(d)
    with Client(d.target) as c:  # and the daemon is fine: the shared chain is intact and unpinned
        got = c.get(NS, shared)
        assert [g.tobytes() for g in got] == [payload_for(b"d", k, BS) for k in shared]
    record("client_death", sigkilled_clients=killed, processes=procs, peak_sessions=peak_sessions,
           peak_leases=peak_leases, leaked_slots=final["leaked_slots"], leaked_leases=final["leases"],
           leaked_reservations=final["reservations"], leaked_pins=final["pinned_rows"],
           leaked_sessions=final["sessions"], reclaim_max_s=round(max(reclaim_s), 3))
    assert final == baseline and final["leaked_slots"] == 0


def test_a_client_dead_before_its_keepalive_opens_is_reclaimed(make_daemon) -> None:
    """Killed between Handshake and KeepAlive (or never opening one): the
    session's lease and reservation are reclaimed after
    server.reservation_timeout, and the session entry goes."""
    import grpc

    from kvstore.client import ns_pb
    from proto import kvstore_pb2 as pb
    from proto import kvstore_pb2_grpc as pb_grpc

    d = make_daemon(server__reservation_timeout="2s", server__lease_check_interval=0.1)
    shared = block_keys(NS, np.arange(4 * 16, dtype=np.int64))
    with Client(d.target) as c:
        assert c.put(NS, shared, [payload_for(b"d", k, BS) for k in shared]) == [KeyStatus.OK] * 4
    # the closed client's session ends when the daemon sees its KeepAlive go
    wait_until(lambda: _snapshot(d)["sessions"] == 0, timeout=30, what="the closed client's session to end")
    base = _snapshot(d)
    ch = grpc.insecure_channel(d.target)
    stub = pb_grpc.KVStoreStub(ch)
    sid = stub.Handshake(pb.HandshakeRequest(client_name="dies-early"), timeout=10).session_id
    md = [("x-kvstore-session", sid)]
    lease = stub.Acquire(pb.AcquireRequest(ns=ns_pb(NS), keys=shared), metadata=md, timeout=10)
    resv = stub.Reserve(pb.ReserveRequest(ns=ns_pb(NS), keys=block_keys(NS, np.arange(16, 48)), block_bytes=BS),
                        metadata=md, timeout=10)
    assert lease.hit_blocks == 4 and resv.reservation_id
    flood = [stub.Handshake(pb.HandshakeRequest(client_name="flood"), timeout=10).session_id
             for _ in range(500)]  # a Handshake flood that never opens a KeepAlive
    # the newest flood session exists (it is younger than the timeout on any
    # machine); older ones may already be gone on a slow one, which is the point
    assert len(set(flood)) == 500
    assert d.call(lambda: flood[-1] in d.daemon.sessions)
    wait_until(lambda: _snapshot(d) == base, timeout=30, what="unbound session reclaimed")
    ch.close()
