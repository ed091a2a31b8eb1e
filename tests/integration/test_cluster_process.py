"""Two and three real daemons as subprocesses (``python -m kvstore serve``)
on 127.0.0.1 with the real UCX block transport: a block put on one is found
and fetched by another byte for byte; the decision follows the configured
link; a peer SIGKILLed or SIGSTOPped is a miss within the fetch deadline and
leaves the directory when its etcd lease lapses; bytes damaged in the
holder's memory arrive as a counted miss."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import tempfile
import time

import grpc
import pytest

pytest.importorskip("ucxx")
pytest.importorskip("transport.ucx")

from kvstore.client import ns_pb  # noqa: E402
from kvstore.wire.shm import host_identity  # noqa: E402
from proto import kvstore_pb2 as pb  # noqa: E402
from proto import kvstore_pb2_grpc as pb_grpc  # noqa: E402
from tests.faults.faultlib import free_port  # noqa: E402
from tests.integration.conftest import wait_healthy, wait_until  # noqa: E402
from tests.integration.etcd_fixture import etcd  # noqa: E402,F401  (fixture)
from tests.integration.test_cluster_inproc import NS, chain, payloads  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FETCH_TIMEOUT = 1.0


class Proc:
    def __init__(self, port: int = 0, **cfg: object) -> None:
        self.port = port or free_port()
        self.target = f"127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        env.update({"UCX_WARN_UNUSED_ENV_VARS": "n", "KVSTORE_SERVER_PORT": str(self.port),
                    "KVSTORE_METRICS_PORT": "0", "KVSTORE_DRAM_CAPACITY": "32MiB",
                    "KVSTORE_CLUSTER_PUBLISH_INTERVAL": "10ms", "KVSTORE_CLUSTER_PROBE_INTERVAL": "200ms",
                    "KVSTORE_CLUSTER_FETCH_TIMEOUT": f"{FETCH_TIMEOUT}s",
                    "KVSTORE_CLUSTER_PREFILL_TOKENS_PER_S": "10",
                    "KVSTORE_CLUSTER_ALLOW_INSECURE_UNAUTHENTICATED": "true"})
        env.update({f"KVSTORE_CLUSTER_{k.upper()}": str(v) for k, v in cfg.items()})
        self.log = tempfile.NamedTemporaryFile(prefix="kvstore-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve"], cwd=ROOT, env=env,
                                     stdout=subprocess.DEVNULL, stderr=self.log)
        self.ch = grpc.insecure_channel(self.target)
        self.stub = pb_grpc.KVStoreStub(self.ch)

    def healthy(self) -> "Proc":
        wait_healthy(self.target, 60)
        return self

    def put(self, keys):
        r = self.stub.Put(pb.PutRequest(ns=ns_pb(NS), keys=keys, payloads=payloads(keys)), timeout=10)
        assert all(x.status == pb.STATUS_OK for x in r.results)

    def lookup(self, keys):
        return self.stub.Lookup(pb.LookupRequest(ns=ns_pb(NS), keys=keys, cluster=True), timeout=10)

    def acquire(self, keys, cluster=True):
        return self.stub.Acquire(pb.AcquireRequest(ns=ns_pb(NS), keys=keys, promote=True, cluster=cluster),
                                 timeout=30)

    def release(self, lease):
        self.stub.Release(pb.ReleaseRequest(lease_id=lease), timeout=10)

    def get(self, keys):
        out: dict[int, bytearray] = {}
        for c in self.stub.Get(pb.GetRequest(ns=ns_pb(NS), keys=keys), timeout=10):
            if c.status == pb.STATUS_OK:
                out.setdefault(c.index, bytearray()).extend(c.data)
        return [bytes(out[i]) if i in out else None for i in range(len(keys))]

    def stats(self):
        return self.stub.Stats(pb.StatsRequest(), timeout=10)

    def logs(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        self.ch.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)


@pytest.fixture
def procs():
    made: list[Proc] = []

    def make(port: int = 0, **cfg) -> Proc:
        p = Proc(port, **cfg)
        made.append(p)
        return p

    yield make
    for i, p in enumerate(made):
        if os.environ.get("KVSTORE_TEST_SHOW_LOGS"):
            print(f"----- daemon {i} ({p.target}) -----\n{p.logs()}")
        p.stop()


def static(procs, n, extra=None):
    ports = [free_port() for _ in range(n)]
    addrs = ",".join(f"127.0.0.1:{p}" for p in ports)
    out = []
    for i, port in enumerate(ports):
        cfg = {"mode": "static", "peers": addrs}
        cfg.update((extra or {}).get(i, {}))
        p = procs(port, **cfg)
        out.append(p)
    for p in out:
        p.healthy()
    for p in out:
        wait_until(lambda p=p: p.stats().cluster_members == n, 60, "all members live")
    return out


def test_three_daemons_fetch_byte_exact_and_follow_the_link(procs):
    a, b, c = static(procs, 3, {2: {"peer_bandwidth_gbps": "0.001", "prefill_tokens_per_s": "20000",
                                    "probe_links": "false"}})
    keys = chain(8, seed=21)
    a.put(keys)
    wait_until(lambda: b.lookup(keys).remote_blocks == 8 and c.lookup(keys).remote_blocks == 8, 20,
               "directory entries published")
    rb, rc = b.lookup(keys), c.lookup(keys)
    assert rb.decision == pb.CHAIN_DECISION_FETCH and rc.decision == pb.CHAIN_DECISION_RECOMPUTE
    assert {x.peer for x in rb.locations} == {a.target}
    acq = b.acquire(keys)
    assert acq.fetched_blocks == 8 and acq.hit_blocks == 8
    b.release(acq.lease_id)
    assert b.get(keys) == payloads(keys)
    assert c.acquire(keys).hit_blocks == 0  # recompute: nothing moved
    assert c.get(keys) == [None] * 8
    # b now holds them too: the directory names both holders
    r = c.lookup(keys)
    assert r.remote_blocks == 8 and {x.peer for x in r.locations} <= {a.target, b.target}
    # the namespace has a block size on b now: its next fetch is the sized one (one round trip)
    more = chain(5, seed=31)
    a.put(more)
    wait_until(lambda: b.lookup(more).remote_blocks == 5, 20, "the second chain published")
    acq = b.acquire(more)
    assert acq.fetched_blocks == 5 and acq.hit_blocks == 5
    b.release(acq.lease_id)
    assert b.get(more) == payloads(more)


def test_sigkill_peer_is_a_miss_within_the_deadline(procs, etcd):  # noqa: F811
    cfg = {"mode": "etcd", "etcd_endpoint": etcd.endpoint, "lease_ttl": "2s"}
    a, b = (procs(**cfg).healthy() for _ in range(2))
    for p in (a, b):
        wait_until(lambda p=p: p.stats().cluster_members == 2, 60, "two members")
    keys = chain(4, seed=22)
    a.put(keys)
    wait_until(lambda: b.lookup(keys).remote_blocks == 4, 20, "visible")
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(10)
    t0 = time.monotonic()
    acq = b.acquire(keys)
    assert acq.hit_blocks == 0 and acq.fetched_blocks == 0
    assert time.monotonic() - t0 < FETCH_TIMEOUT + 3
    assert b.stats().active_reservations == 0
    wait_until(lambda: b.stats().cluster_members == 1, 20, "the dead peer's lease lapsed")
    assert b.lookup(keys).remote_blocks == 0
    assert b.stats().cluster_status == "ok"


def test_sigstop_peer_misses_then_its_etcd_lease_lapses(procs, etcd):  # noqa: F811
    cfg = {"mode": "etcd", "etcd_endpoint": etcd.endpoint, "lease_ttl": "2s"}
    a, b, c = (procs(**cfg).healthy() for _ in range(3))
    for p in (a, b, c):
        wait_until(lambda p=p: p.stats().cluster_members == 3, 60, "three members")
    keys = chain(4, seed=23)
    a.put(keys)
    wait_until(lambda: b.lookup(keys).remote_blocks == 4, 20, "visible")
    a.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        acq = b.acquire(keys)
        assert acq.hit_blocks == 0 and acq.fetched_blocks == 0
        assert time.monotonic() - t0 < FETCH_TIMEOUT + 3
        wait_until(lambda: b.stats().cluster_members == 2 and c.stats().cluster_members == 2, 30,
                   "the paused peer's lease lapsed")
        assert b.lookup(keys).remote_blocks == 0
    finally:
        a.proc.send_signal(signal.SIGCONT)
    # back: it registers again and its blocks are found again
    wait_until(lambda: b.stats().cluster_members == 3, 90, "the peer re-registered")
    wait_until(lambda: b.lookup(keys).remote_blocks == 4, 20, "its blocks are back in the directory")
    acq = b.acquire(keys)
    assert acq.fetched_blocks == 4
    b.release(acq.lease_id)
    assert b.get(keys) == payloads(keys)


def test_bytes_damaged_at_the_holder_arrive_as_a_counted_miss(procs):
    a, b = static(procs, 2)
    keys = chain(3, seed=24)
    a.put(keys)
    wait_until(lambda: b.lookup(keys).remote_blocks == 3, 20, "visible")
    # damage block 1 in a's DRAM slab (as a bit flip would); a's index keeps the old checksum
    hs = a.stub.Handshake(pb.HandshakeRequest(client_name="t", pid=os.getpid(), host_id=host_identity(),
                                              protocol_version=1), timeout=10)
    assert hs.same_host
    acq = a.acquire(keys, cluster=False)
    off = acq.slots.offset[1]
    fd = os.open(hs.shm.path, os.O_RDWR)
    try:
        with mmap.mmap(fd, hs.shm.size_bytes) as m:
            m[off] ^= 0xFF
    finally:
        os.close(fd)
    a.release(acq.lease_id)
    before = b.stats().checksum_failures
    acq = b.acquire(keys)  # committed with a's checksums: not hashed on arrival, checked by the first reader
    assert acq.fetched_blocks == 3
    b.release(acq.lease_id)
    got = b.get(keys)
    assert got[0] == payloads(keys)[0] and got[1] is None and got[2] in (None, payloads(keys)[2])
    assert b.stats().checksum_failures == before + 1
    assert b.get(keys)[1:] == [None, None]  # dropped with what hangs below it
