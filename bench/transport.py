"""Peer block transfer (issue 6). Not a test: it reports numbers.

In one run, for batches of 64 x 1 MiB and 16 x 4 MiB blocks, between two
processes on this host (the *peer*, started with ``--role peer``, and this
process, the *fetcher*):

(a) ``bare``: bare ucxx -- the fetcher sends a 16-byte request, the peer
    answers with one tagged ``send`` per block (the same bytes, from its
    slab), the fetcher ``recv``s each into a preallocated buffer. The
    baseline: no table, no checksums, no store.
(b) ``fetch``: ``transport.ucx`` BlockServer/BlockClient. The peer's provider
    pins the blocks in a real ``TieredStore`` DRAM slab (``acquire``) and
    serves views of the slab (``release`` after the send); the fetcher's
    alloc ``reserve``s slots in its own ``TieredStore`` and the blocks land
    straight in its slab, checksum-verified on arrival, then ``commit`` (with
    the peer's checksums). Timed: reserve + fetch + verify + commit.
(c) ``daemons``: the same through two ``kvstore serve`` daemons -- only when
    the daemon has a cluster section (else a note says why it is missing).
(d) ``mooncake``: Mooncake Store ``batch_put_from``/``batch_get_into`` and
    ``put_batch``/``get_batch`` of the same batches (its Python client and a
    local ``mooncake_master``, protocol tcp), reusing ``bench/peer_mooncake.py``'s
    set-up, inside its own network namespace (``unshare -rn``).

Rounds alternate (a), (b), (c); the first round of each shape is a warm-up;
each figure is the median of the rest (3 with ``--quick``, 9 otherwise). The
ratios are medians of per-round ratios (each round's three measurements run
back to back, so a load swing on this shared machine hits them alike).

Target (issue 6): peer fetch >= 0.7x bare ucxx, per shape (for (b), and for
(c) when measured).

Run::

    python bench/transport.py [--quick] [--json PATH] [--mooncake-venv DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# this file is named like the ``transport`` package: keep bench/ off the path
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("UCX_TLS", "tcp,sm,self")


def _bench_module(name: str) -> Any:
    import importlib.util

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


Report = _bench_module("benchlib").Report
wait_serving = _bench_module("benchlib").wait_serving

MIB = 1 << 20
SHAPES = ((1 * MIB, 64), (4 * MIB, 16))
OWNER = "bench-transport"
TAG_REQ = 1 << 50


def label(size: int, n: int) -> str:
    return f"{n}x{size // MIB}MiB"


def namespace(size: int) -> Any:
    """One namespace per block size (a namespace has one block size)."""
    from kvstore.keys import Namespace

    return Namespace(tenant="bench", model_id=f"transport-{size // MIB}MiB", block_size=16)


def keys_for(size: int, n: int, salt: int = 0) -> Any:
    from kvstore.keys import block_keys

    tokens = (np.arange(n * 16, dtype=np.uint32) + salt * 7_919) % 50_000
    return block_keys(namespace(size), tokens)


def make_store(nbytes: int) -> Any:
    from kvstore.core.store import StoreConfig, TieredStore

    store = TieredStore(StoreConfig(dram_bytes=nbytes, dram_page_bytes=16 * MIB, verify_reads=False))
    store.dram.buf[:] = 0  # fault the slab's pages in once, as in a daemon that has run a while
    return store


# ------------------------------------------------------------------ peer
async def peer_main() -> int:
    import ucxx

    from transport.ucx import BlockServer, Served, shutdown, ucx_module

    store = make_store(512 * MIB)
    rng = np.random.default_rng(3)
    views: dict[str, list[np.ndarray]] = {}
    for size, n in SHAPES:
        keys = keys_for(size, n)
        res = store.put(namespace(size), keys, [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)])
        assert res.ok, res.statuses[:3]
        lease = store.acquire(namespace(size), keys, "bare")  # the bare server reads the same slab bytes
        views[label(size, n)] = [store.dram.view(int(o), int(ln)) for o, ln in zip(lease.offsets, lease.lengths)]

    async def provide(header: bytes) -> Served:
        h = json.loads(header)
        keys = keys_for(int(h["size"]), int(h["n"]))
        lease = store.acquire(namespace(int(h["size"])), keys, OWNER)
        if not lease.handle:
            raise ValueError("blocks not present")
        present = lease.offsets >= 0
        regions = [memoryview(store.dram.view(int(o), int(ln))) for o, ln in
                   zip(lease.offsets[present], lease.lengths[present])]
        handle = lease.handle
        return Served(lease.lengths.copy(), lease.checksums.copy(), regions,
                      lambda: store.release(handle, OWNER))

    server = BlockServer(provide)
    block_addr = await server.start()
    ucx_module("127.0.0.1", None)

    async def bare(ep: Any) -> None:
        req = np.zeros(2, dtype=np.int64)
        try:
            while True:
                await ep.recv(req, tag=TAG_REQ)
                size, n = int(req[0]), int(req[1])
                vs = views[label(size, n)]
                await asyncio.gather(*[ep.send(vs[i], tag=TAG_REQ + 1 + i) for i in range(n)])
        except Exception:  # noqa: BLE001 - the fetcher closed its endpoint
            pass

    listener = ucxx.create_listener(bare, port=0)
    print(json.dumps({"block": block_addr, "bare": f"127.0.0.1:{listener.port}"}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until stdin closes
    listener.close()
    await server.stop()
    shutdown()
    store.close()
    return 0


# --------------------------------------------------------------- fetcher
class Fetcher:
    def __init__(self, addrs: dict[str, str]) -> None:
        from transport.ucx import BlockClient

        self.addrs = addrs
        self.client = BlockClient(connect_timeout_s=10.0)
        self.store = make_store(512 * MIB)
        self.bare_ep: Any = None
        self.bare_buf = np.ones(64 * MIB, dtype=np.uint8)  # pages faulted in, like the slab
        self.salt = 0

    async def bare(self, size: int, n: int) -> float:
        import ucxx

        if self.bare_ep is None:
            host, port = self.addrs["bare"].rsplit(":", 1)
            self.bare_ep = await ucxx.create_endpoint(host, int(port))
        ep = self.bare_ep
        buf = self.bare_buf
        t0 = time.perf_counter()
        recvs = [asyncio.ensure_future(ep.recv(buf[i * size:(i + 1) * size], tag=TAG_REQ + 1 + i))
                 for i in range(n)]
        await ep.send(np.array([size, n], dtype=np.int64), tag=TAG_REQ)
        await asyncio.gather(*recvs)
        return time.perf_counter() - t0

    async def fetch(self, size: int, n: int) -> tuple[float, str]:
        ns = namespace(size)
        self.salt += 1
        keys = keys_for(size, n, salt=self.salt)
        store = self.store
        held: dict[str, str] = {}

        def alloc(lengths: np.ndarray) -> list[memoryview | None]:
            res = store.reserve(ns, keys, [int(x) for x in lengths], OWNER)
            held["h"] = res.handle
            return [memoryview(store.dram.view(int(o), int(ln))) if o >= 0 else None
                    for o, ln in zip(res.offsets, res.lengths)]

        t0 = time.perf_counter()
        r = await self.client.fetch(self.addrs["block"], json.dumps({"size": size, "n": n}).encode(),
                                    n, alloc, 30.0)
        err = r.error or ("" if r.ok.all() else f"{int((~r.ok).sum())} blocks not ok")
        if held.get("h"):
            if not err:
                assert r.checksums is not None
                store.commit(held["h"], OWNER, r.checksums.tolist())
            else:
                store.abort(held["h"], OWNER)
        dt = time.perf_counter() - t0
        store.remove(ns, keys)  # untimed
        return dt, err

    async def close(self) -> None:
        await self.client.close()
        if self.bare_ep is not None:
            self.bare_ep.abort()
        self.store.close()


async def ucx_side(quick: bool, daemons: "Daemons | None") -> tuple[dict[str, float], list[str]]:
    from transport.ucx import shutdown

    figures: dict[str, float] = {}
    notes: list[str] = []
    peer = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "peer"], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout is not None
        line = peer.stdout.readline()
        if not line:
            raise RuntimeError(f"the peer exited ({peer.wait(10)})")
        f = Fetcher(json.loads(line))
        reps = 3 if quick else 9
        for size, n in SHAPES:
            bare, fetch, two = [], [], []
            for r in range(reps + 1):
                tb = await f.bare(size, n)
                tf, err = await f.fetch(size, n)
                if err:
                    raise RuntimeError(f"fetch {label(size, n)}: {err}")
                td = daemons.round(size, n) if daemons is not None else 0.0
                if r:  # round 0 warms up
                    bare.append(tb)
                    fetch.append(tf)
                    two.append(td)
            gb = size * n / 1e9
            lab = label(size, n)
            if daemons is not None:
                figures[f"daemons_fetch_{lab}_GBps"] = gb / statistics.median(two)
                figures[f"daemons_fetch_vs_bare_{lab}"] = statistics.median(b / d for b, d in zip(bare, two))
            # paired: each round's bare and fetch ran back to back, so the
            # median of per-round ratios is steadier than a ratio of medians
            figures[f"peer_fetch_vs_bare_{lab}"] = statistics.median(b / t for b, t in zip(bare, fetch))
            figures[f"bare_ucxx_{lab}_GBps"] = gb / statistics.median(bare)
            figures[f"peer_fetch_{lab}_GBps"] = gb / statistics.median(fetch)
            figures[f"peer_fetch_{lab}_ms"] = statistics.median(fetch) * 1e3
        figures["fetch_connects"] = float(f.client.connects)
        await f.close()
    finally:
        if peer.stdin is not None:
            peer.stdin.close()
        try:
            peer.wait(20)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait()
        shutdown()
    return figures, notes


# -------------------------------------------------------------- mooncake
def mooncake_child(quick: bool, venv: str) -> int:
    """Inside the network namespace: Mooncake rounds; prints one JSON line."""
    import shutil
    import tempfile

    pm = _bench_module("peer_mooncake")

    subprocess.run(["ip", "link", "set", "lo", "up"], capture_output=True)
    out: dict[str, Any] = {"figures": {}, "error": ""}
    tmp = tempfile.mkdtemp(prefix="kvtransport-mc-")
    procs = pm.Procs()
    mc = pm.Mooncake(venv, tmp, procs)
    try:
        mc.start()
        reps = 3 if quick else 9
        for size, n in SHAPES:
            for api in ("zero", "copy"):
                puts, gets = [], []
                for r in range(reps + 1):
                    res = mc.call({"op": "round", "size": size, "batch": n, "api": api,
                                   "tag": f"t{size}-{n}-{api}-{r}", "verify": r == 0})
                    if res.get("error"):
                        raise RuntimeError(f"mooncake {api} {label(size, n)}: {res['error']}")
                    if r:
                        puts.append(res["put"])
                        gets.append(res["get"])
                gb = size * n / 1e9
                name = "zero_copy" if api == "zero" else "copy"
                out["figures"][f"mooncake_{name}_get_{label(size, n)}_GBps"] = gb / statistics.median(gets)
                out["figures"][f"mooncake_{name}_put_{label(size, n)}_GBps"] = gb / statistics.median(puts)
    except (RuntimeError, OSError, ValueError) as e:
        out["error"] = str(e)
    finally:
        mc.close()
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print("MOONCAKE " + json.dumps(out), flush=True)
    return 0


def mooncake_side(quick: bool, venv: str) -> tuple[dict[str, float], list[str]]:
    ns = ["unshare", "-rn", "--pid", "--fork", "--kill-child"]
    argv = [*ns, sys.executable, os.path.abspath(__file__), "--role", "mooncake", "--mooncake-venv", venv]
    if quick:
        argv.append("--quick")
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {}, [f"Mooncake not measured: {e}"]
    for line in p.stdout.splitlines():
        if line.startswith("MOONCAKE "):
            res = json.loads(line[len("MOONCAKE "):])
            notes = [f"Mooncake not measured: {res['error']}"] if res["error"] else []
            return {k: float(v) for k, v in res["figures"].items()}, notes
    return {}, [f"Mooncake not measured: exit {p.returncode}: {p.stderr.strip()[-300:]}"]


# --------------------------------------------------------------- daemons
def daemons_missing() -> str:
    """Why (c) cannot run, or "" when the daemon has a cluster section."""
    try:
        from kvstore.config import load_config

        cfg = load_config(None, {}, {})
    except Exception as e:  # noqa: BLE001
        return f"daemon config not loadable: {e}"
    if getattr(cfg, "cluster", None) is None:
        return "the daemon has no cluster section"
    return ""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemons:
    """(c): two ``kvstore serve`` daemons with a static peer list; blocks put on
    A (shared-memory client), then ``Acquire(cluster=True)`` on B fetches them
    from A into B's slab over the transport. Timed: B's Acquire RPC (lookup,
    decision, peer fetch, commit) + Release. B's copies are removed after each
    round (untimed) so that every round fetches."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.channels: list[Any] = []
        self.client: Any = None
        self.keys: dict[int, list[bytes]] = {}

    def start(self) -> None:
        import grpc

        from kvstore.client import Client, ns_pb
        from proto import kvstore_pb2 as pb
        from proto import kvstore_pb2_grpc as pb_grpc

        self.pb, self.ns_pb = pb, ns_pb
        ports = [_free_port(), _free_port()]
        peers = ",".join(f"127.0.0.1:{p}" for p in ports)
        for port in ports:
            env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
            env.update({"KVSTORE_SERVER_PORT": str(port), "KVSTORE_METRICS_PORT": "0",
                        "KVSTORE_DRAM_CAPACITY": "512MiB", "KVSTORE_CLUSTER_MODE": "static",
                        "KVSTORE_CLUSTER_PEERS": peers, "KVSTORE_CLUSTER_PUBLISH_INTERVAL": "10ms",
                        "KVSTORE_CLUSTER_FETCH_TIMEOUT": "30s",
                        # recompute made slow, so the decision is always "fetch"
                        "KVSTORE_CLUSTER_PREFILL_TOKENS_PER_S": "10"})
            self.procs.append(subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--log-level", "warning"],
                                               cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL))
        stubs = []
        for port in ports:
            target = f"127.0.0.1:{port}"
            wait_serving(target, 60, self.procs)
            ch = grpc.insecure_channel(target)
            self.channels.append(ch)
            stubs.append(pb_grpc.KVStoreStub(ch))
        self.b = stubs[1]
        self.client = Client(f"127.0.0.1:{ports[0]}", use_shm=True)
        rng = np.random.default_rng(5)
        for size, n in SHAPES:
            ns = namespace(size)
            keys = [bytes(k) for k in keys_for(size, n)]
            st = self.client.put(ns, keys, [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)])
            if any(x.name != "OK" for x in st):
                raise RuntimeError(f"put on A: {st[:2]}")
            end = time.monotonic() + 30
            while self.b.Lookup(pb.LookupRequest(ns=ns_pb(ns), keys=keys, cluster=True),
                                timeout=10).remote_blocks < n:
                if time.monotonic() > end:
                    raise RuntimeError("B never saw A's blocks in the directory")
                time.sleep(0.02)
            self.keys[size] = keys

    def round(self, size: int, n: int) -> float:
        pb, ns = self.pb, self.ns_pb(namespace(size))
        keys = self.keys[size]
        t0 = time.perf_counter()
        acq = self.b.Acquire(pb.AcquireRequest(ns=ns, keys=keys, promote=True, cluster=True), timeout=60)
        self.b.Release(pb.ReleaseRequest(lease_id=acq.lease_id), timeout=10)
        dt = time.perf_counter() - t0
        if acq.fetched_blocks != n:
            raise RuntimeError(f"B fetched {acq.fetched_blocks} of {n} blocks (hit {acq.hit_blocks})")
        self.b.Remove(pb.RemoveRequest(ns=ns, keys=keys), timeout=10)
        return dt

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        for ch in self.channels:
            ch.close()
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds per shape instead of 9")
    ap.add_argument("--json", metavar="PATH", help="write figures and targets as JSON")
    ap.add_argument("--mooncake-venv", default=None, help="virtual env with mooncake installed")
    ap.add_argument("--no-mooncake", action="store_true", help="skip Mooncake")
    ap.add_argument("--no-daemons", action="store_true", help="skip the two-daemon figure")
    ap.add_argument("--role", choices=("peer", "mooncake"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    pm = _bench_module("peer_mooncake")

    venv = a.mooncake_venv or pm.default_venv()
    if a.role == "peer":
        return asyncio.run(peer_main())
    if a.role == "mooncake":
        return mooncake_child(a.quick, venv)
    rep = Report("transport")
    notes: list[str] = []
    missing = "--no-daemons" if a.no_daemons else daemons_missing()
    daemons: Daemons | None = None
    if missing:
        notes.append(f"(c) two daemons not measured: {missing}")
    else:
        daemons = Daemons()
        try:
            daemons.start()
        except (RuntimeError, OSError) as e:
            notes.append(f"(c) two daemons not measured: {e}")
            daemons.close()
            daemons = None
    try:
        figures, more = asyncio.run(ucx_side(a.quick, daemons))
    finally:
        if daemons is not None:
            daemons.close()
    notes += more
    if not a.no_mooncake:
        mf, mn = mooncake_side(a.quick, venv)
        figures.update(mf)
        notes += mn
    for k, v in figures.items():
        unit = "GB/s" if k.endswith("GBps") else ("ms" if k.endswith("_ms") else ("x" if "_vs_" in k else ""))
        rep.figure(k, v, unit)
    for size, n in SHAPES:
        lab = label(size, n)
        rep.target(f"peer fetch {lab} / bare ucxx", figures[f"peer_fetch_vs_bare_{lab}"], 0.7)
        if f"daemons_fetch_vs_bare_{lab}" in figures:
            rep.target(f"two-daemon fetch {lab} / bare ucxx", figures[f"daemons_fetch_vs_bare_{lab}"], 0.7)
    rep.emit(a.json)
    for note in notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
