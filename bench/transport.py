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

Rounds alternate (a), (b); the first round of each shape is a warm-up; each
figure is the median of the rest (3 with ``--quick``, 9 otherwise).

Target (issue 6): peer fetch GB/s >= 0.7x bare ucxx GB/s, per shape.

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


def keys_for(size: int, n: int, salt: int = 0) -> np.ndarray:
    from kvstore.keys import block_keys

    tokens = (np.arange(n * 16, dtype=np.uint32) + salt * 7_919) % 50_000
    return block_keys(namespace(size), tokens)


def make_store(nbytes: int) -> Any:
    from kvstore.store import StoreConfig, TieredStore

    store = TieredStore(StoreConfig(dram_bytes=nbytes, dram_page_bytes=16 * MIB, verify_reads=False))
    store.dram.buf[:] = 0  # fault the slab's pages in once, as in a daemon that has run a while
    return store


# ------------------------------------------------------------------ peer
async def peer_main() -> int:
    import ucxx

    from transport.ucx import BlockServer, Served, _ucx, shutdown

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
    _ucx("127.0.0.1", None)

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


async def ucx_side(quick: bool) -> tuple[dict[str, float], list[str]]:
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
            bare, fetch = [], []
            for r in range(reps + 1):
                tb = await f.bare(size, n)
                tf, err = await f.fetch(size, n)
                if err:
                    raise RuntimeError(f"fetch {label(size, n)}: {err}")
                if r:  # round 0 warms up
                    bare.append(tb)
                    fetch.append(tf)
            gb = size * n / 1e9
            lab = label(size, n)
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


# ------------------------------------------------------------------ main
def daemons_note() -> str:
    try:
        from kvstore.config import load_config

        cfg = load_config(None, {}, {})
    except Exception as e:  # noqa: BLE001
        return f"daemon config not loadable: {e}"
    if getattr(cfg, "cluster", None) is None:
        return "the daemon has no cluster section yet"
    return ("two-daemon fetch not measured here: run the cluster integration tests; "
            "this run measures the transport the daemon uses, into a real TieredStore slab")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds per shape instead of 9")
    ap.add_argument("--json", metavar="PATH", help="write figures and targets as JSON")
    ap.add_argument("--mooncake-venv", default=None, help="virtual env with mooncake installed")
    ap.add_argument("--no-mooncake", action="store_true", help="skip Mooncake")
    ap.add_argument("--role", choices=("peer", "mooncake"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    pm = _bench_module("peer_mooncake")

    venv = a.mooncake_venv or pm.default_venv()
    if a.role == "peer":
        return asyncio.run(peer_main())
    if a.role == "mooncake":
        return mooncake_child(a.quick, venv)
    rep = Report("transport")
    figures, notes = asyncio.run(ucx_side(a.quick))
    if not a.no_mooncake:
        mf, mn = mooncake_side(a.quick, venv)
        figures.update(mf)
        notes += mn
    notes.append(f"(c) {daemons_note()}")
    for k, v in figures.items():
        rep.figure(k, v, "GB/s" if k.endswith("GBps") else ("ms" if k.endswith("_ms") else ""))
    for size, n in SHAPES:
        lab = label(size, n)
        ratio = figures[f"peer_fetch_{lab}_GBps"] / figures[f"bare_ucxx_{lab}_GBps"]
        rep.figure(f"peer_fetch_vs_bare_{lab}", ratio, "x")
        rep.target(f"peer fetch {lab} / bare ucxx", ratio, 0.7)
    rep.emit(a.json)
    for note in notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
