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
    the peer's checksums). A sized fetch (one round trip), as a daemon asks
    for a namespace it stores. Timed: reserve + fetch + verify + commit.
(c) ``daemons``: the same through two ``kvstore serve`` daemons -- only when
    the daemon has a cluster section (else a note says why it is missing).
    Timed as an engine on B's host runs it (the vLLM connector's cluster
    load): ``Client.acquire(..., cluster=True)`` over B's same-host socket,
    then ``Lease.release(wait=False)``. Beside it, ``daemons_fetch_grpc_*``:
    the same ``Acquire`` and ``Release`` as plain gRPC calls (no target; the
    figure of the first seven rounds). The two alternate which goes first.
(d) ``mooncake_te``: Mooncake's transfer engine in remote mode -- a holder
    process registers a buffer, a client process (its own TransferEngine,
    protocol tcp, P2P handshake) reads each batch from it with
    ``batch_transfer_sync_read`` (its zero-copy batch API; the bytes are
    checked against the holder's). Both inside one network namespace
    (``unshare -rn``: its listeners bind every interface). Needs
    ``mooncake.engine`` in this Python or in ``--mooncake-venv``.
(e) ``iperf3``: one TCP stream over loopback (``iperf3 -c 127.0.0.1 -n``
    4x the batch's bytes): the wire's limit on this host.
(f) small fetches (1 and 4 blocks of 256 KiB) through (b), sized (one round
    trip) and two-step alternating: the latency a round trip costs (a
    figure, no target).
(g) an engine's whole cluster load through (c)'s daemons, as the vLLM
    connector runs it: its scheduler's cluster ``Lookup``, then its worker's
    ``Acquire(cluster=True)`` and release, timed together. With the hint
    (``Client.acquire(..., peer=...)``: the peer and run the ``Lookup``
    found, so B does not locate them again) and without, alternating; at
    (c)'s shapes and 4 x 256 KiB (figures, no target).

Each round runs (a), (b), (c), (d), (e) once, back to back, in that order
in even rounds and in the reverse order in odd ones (so no side always runs
first, or always right after the peer's own work); the first round of each
shape is a warm-up; each figure is the median of the rest (3 with
``--quick``, 9 otherwise). The ratios are medians of per-round ratios: each
round's subject and baseline ran next to each other, so a load swing on
this shared machine hits both sides of a ratio alike.

Targets: peer fetch >= 0.7x bare ucxx, per shape (issue 6; for (b), and for
(c) when measured). Issue 18 goal 3: two-daemon fetch (c) >= 1.2x Mooncake's
transfer engine (d) and >= 0.6x iperf3 (e), per shape; a baseline that could
not run (Mooncake or iperf3 missing) leaves its target ``met: false``.
``bare_ucxx_vs_mooncake_te_*`` and ``bare_ucxx_vs_iperf3_*`` (no target,
paired per round as the others): what a fetch moving its bytes at bare
ucxx's rate, with no control path at all, would reach against each baseline.

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
# UCX_TLS: transport.ucx picks tcp,self for loopback (and put rendezvous with it)


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
free_port = _bench_module("benchlib").free_port

MIB = 1 << 20
SHAPES = ((1 * MIB, 64), (4 * MIB, 16))
SMALL = ((256 << 10, 1), (256 << 10, 4))
"""Small fetches (f): the latency of a sized fetch (one round trip) against
the two-step one, through (b)'s client and peer."""
HINTED = SHAPES + ((256 << 10, 4),)
"""Shapes of (g), the engine's Lookup then Acquire, with and without the hint."""
STEPS = ("bare", "fetch", "daemons", "others")  # one round's order; odd rounds run it reversed
OWNER = "bench-transport"
TAG_REQ = 1 << 50


def label(size: int, n: int) -> str:
    return f"{n}x{size // MIB}MiB" if size % MIB == 0 else f"{n}x{size >> 10}KiB"


def namespace(size: int) -> Any:
    """One namespace per block size (a namespace has one block size)."""
    from kvstore.keys import Namespace

    return Namespace(tenant="bench", model_id=f"transport-{size >> 10}KiB", block_size=16)


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
    for size, n in SHAPES + SMALL:
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

    async def fetch(self, size: int, n: int, sized: bool = True) -> tuple[float, str]:
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
                                    n, alloc, 30.0, sizes=np.full(n, size, dtype=np.int64) if sized else None)
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


async def ucx_side(quick: bool, daemons: "Daemons | None", others: dict[str, Any]
                   ) -> tuple[dict[str, float], list[str]]:
    """Rounds of (a), (b), (c) and every baseline in ``others`` (name -> object
    with ``round(size, n) -> seconds``: Mooncake, iperf3), back to back."""
    from transport.ucx import shutdown, ucx_module

    figures: dict[str, float] = {}
    notes: list[str] = []
    peer = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "peer"], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout is not None
        line = peer.stdout.readline()
        if not line:
            raise RuntimeError(f"the peer exited ({peer.wait(10)})")
        ucx_module("127.0.0.1")  # UCX set up by the transport (its tuning) before bare ucxx uses it
        f = Fetcher(json.loads(line))
        reps = 3 if quick else 9
        for size, n in SHAPES:
            bare, fetch, two, two_grpc = [], [], [], []
            base: dict[str, list[float]] = {k: [] for k in others}
            for r in range(reps + 1):
                # each round runs every subject and baseline once, the order
                # reversed every other round: a drift on this shared machine
                # falls on both sides of each per-round ratio alike
                tb = tf = td = tg = 0.0
                tos: dict[str, float] = {}
                for step in (STEPS if r % 2 == 0 else STEPS[::-1]):
                    if step == "bare":
                        tb = await f.bare(size, n)
                    elif step == "fetch":
                        tf, err = await f.fetch(size, n)
                        if err:
                            raise RuntimeError(f"fetch {label(size, n)}: {err}")
                    elif step == "daemons" and daemons is not None:
                        td, tg = daemons.round(size, n, r % 4 in (1, 2))
                    elif step == "others":
                        ks = list(others) if r % 2 == 0 else list(others)[::-1]
                        tos = {k: others[k].round(size, n) for k in ks}
                if r:  # round 0 warms up
                    bare.append(tb)
                    fetch.append(tf)
                    two.append(td)
                    two_grpc.append(tg)
                    for k, t in tos.items():
                        base[k].append(t)
            gb = size * n / 1e9
            lab = label(size, n)
            for k, ts in base.items():
                figures[f"{k}_{lab}_GBps"] = gb / statistics.median(ts)
            if daemons is not None:
                figures[f"daemons_fetch_{lab}_GBps"] = gb / statistics.median(two)
                figures[f"daemons_fetch_vs_bare_{lab}"] = statistics.median(b / d for b, d in zip(bare, two))
                for k, ts in base.items():  # paired per round, like the others
                    figures[f"daemons_fetch_vs_{k}_{lab}"] = statistics.median(o / d for o, d in zip(ts, two))
                figures[f"daemons_fetch_grpc_{lab}_GBps"] = gb / statistics.median(two_grpc)
                for k, ts in base.items():
                    figures[f"daemons_fetch_grpc_vs_{k}_{lab}"] = statistics.median(o / d for o, d in zip(ts, two_grpc))
            for k, ts in base.items():  # what a fetch at bare ucxx's rate would reach (no target)
                figures[f"bare_ucxx_vs_{k}_{lab}"] = statistics.median(o / b for o, b in zip(ts, bare))
            # paired: each round's bare and fetch ran back to back, so the
            # median of per-round ratios is steadier than a ratio of medians
            figures[f"peer_fetch_vs_bare_{lab}"] = statistics.median(b / t for b, t in zip(bare, fetch))
            figures[f"bare_ucxx_{lab}_GBps"] = gb / statistics.median(bare)
            figures[f"peer_fetch_{lab}_GBps"] = gb / statistics.median(fetch)
            figures[f"peer_fetch_{lab}_ms"] = statistics.median(fetch) * 1e3
        for size, n in SMALL:  # (f): small fetches, sized and two-step alternating
            lab = f"{n}x{size >> 10}KiB"
            one, two = [], []
            for r in range(3 * reps + 1):
                t1, err1 = await f.fetch(size, n, sized=True)
                t2, err2 = await f.fetch(size, n, sized=False)
                if err1 or err2:
                    raise RuntimeError(f"small fetch {lab}: {err1 or err2}")
                if r:
                    one.append(t1)
                    two.append(t2)
            figures[f"small_fetch_{lab}_ms"] = statistics.median(one) * 1e3
            figures[f"small_fetch_{lab}_two_step_ms"] = statistics.median(two) * 1e3
            figures[f"small_fetch_{lab}_time_vs_two_step"] = statistics.median(a / b for a, b in zip(one, two))
        for size, n in HINTED if daemons is not None else ():  # (g)
            lab = label(size, n)
            hinted, plain = [], []
            for r in range(reps + 1):
                order = (True, False) if r % 2 else (False, True)
                got = {h: daemons.engine_load(size, n, h) for h in order}
                if r:
                    hinted.append(got[True])
                    plain.append(got[False])
            figures[f"engine_load_{lab}_ms"] = statistics.median(plain) * 1e3
            figures[f"engine_load_hinted_{lab}_ms"] = statistics.median(hinted) * 1e3
            figures[f"engine_load_hinted_time_vs_not_{lab}"] = statistics.median(a / b for a, b in zip(hinted, plain))
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
MC_BUF = 64 * MIB  # the largest batch (64 x 1 MiB = 16 x 4 MiB)


def mooncake_python(venv: str) -> str | None:
    """A Python that imports Mooncake's transfer engine: this one, else the venv's."""
    for py in (sys.executable, os.path.join(venv, "bin", "python")):
        if os.path.exists(py) and subprocess.run(
                [py, "-c", "import mooncake.engine"], capture_output=True).returncode == 0:
            return py
    return None


def _mc_engine() -> tuple[Any, np.ndarray]:
    """A Mooncake TransferEngine over TCP on 127.0.0.1 (P2P handshake, no
    metadata server) with one registered buffer of MC_BUF bytes."""
    from mooncake.engine import TransferEngine

    eng = TransferEngine()
    if eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("TransferEngine.initialize failed")
    buf = np.zeros(MC_BUF, dtype=np.uint8)
    if eng.register_memory(buf.ctypes.data, MC_BUF) != 0:
        raise RuntimeError("TransferEngine.register_memory failed")
    return eng, buf


def mcte_holder() -> int:
    """The Mooncake holder process: registers a buffer of known bytes and
    waits (until stdin closes) while the client reads from it."""
    eng, buf = _mc_engine()
    buf[:] = np.random.default_rng(11).integers(0, 256, MC_BUF, dtype=np.uint8)
    print(json.dumps({"session": f"127.0.0.1:{eng.get_rpc_port()}", "addr": buf.ctypes.data}), flush=True)
    sys.stdin.read()
    return 0


def mcte_client() -> int:
    """The Mooncake client process (inside the namespace, started by
    :class:`MooncakeTE`): starts the holder, then answers ``size n`` lines
    with the seconds of one ``batch_transfer_sync_read`` of n blocks of size
    bytes from the holder's buffer into its own (its zero-copy batch API)."""
    subprocess.run(["ip", "link", "set", "lo", "up"], capture_output=True)
    holder = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "mcte-holder"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()
        if not line:
            print("ERR the Mooncake holder exited", flush=True)
            return 1
        info = json.loads(line)
        eng, buf = _mc_engine()
        expect = np.random.default_rng(11).integers(0, 256, MC_BUF, dtype=np.uint8)
        base = buf.ctypes.data
        print("READY", flush=True)
        for cmd in sys.stdin:
            size, n = (int(x) for x in cmd.split())
            buf[:] = 0
            t0 = time.perf_counter()
            rc = eng.batch_transfer_sync_read(info["session"], [base + i * size for i in range(n)],
                                              [info["addr"] + i * size for i in range(n)], [size] * n)
            dt = time.perf_counter() - t0
            if rc != 0 or not np.array_equal(buf[:size * n], expect[:size * n]):
                print(f"ERR transfer rc={rc} or bytes differ", flush=True)
            else:
                print(f"{dt!r}", flush=True)
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        holder.wait(10)
    return 0


class MooncakeTE:
    """Mooncake's transfer engine between two processes over TCP: a holder
    and a client, both inside one new network namespace (``unshare -rn``;
    its listeners bind every interface), driven round by round from here
    so that its rounds interleave with ours."""

    def __init__(self, py: str) -> None:
        self.tmp = open(os.devnull, "w")  # its glog chatter
        argv = ["unshare", "-rn", "--pid", "--fork", "--kill-child", py, os.path.abspath(__file__),
                "--role", "mcte"]
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.tmp, text=True, cwd=ROOT)
        assert self.p.stdout is not None
        line = self.p.stdout.readline().strip()
        if line != "READY":
            self.close()
            raise RuntimeError(f"Mooncake transfer engine did not start: {line or self.p.poll()}")

    def round(self, size: int, n: int) -> float:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(f"{size} {n}\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline().strip()
        if not line or line.startswith("ERR"):
            raise RuntimeError(f"Mooncake transfer {label(size, n)}: {line or 'client exited'}")
        return float(line)

    def close(self) -> None:
        if self.p.stdin is not None:
            self.p.stdin.close()
        try:
            self.p.wait(20)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.tmp.close()


# ----------------------------------------------------------------- iperf3
class Iperf:
    """``iperf3`` over loopback (one TCP stream, 127.0.0.1): the wire's limit
    measured beside ours; each round sends 4x a batch's bytes."""

    def __init__(self) -> None:
        import shutil

        exe = shutil.which("iperf3")
        if exe is None:
            raise RuntimeError("iperf3 is not installed (apt-get install -y iperf3)")
        self.exe, self.port = exe, free_port()
        self.p = subprocess.Popen([exe, "-s", "-B", "127.0.0.1", "-p", str(self.port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def round(self, size: int, n: int) -> float:
        """Seconds for size*n bytes at the rate iperf3 measured."""
        end = time.monotonic() + 10
        while True:
            p = subprocess.run([self.exe, "-c", "127.0.0.1", "-p", str(self.port), "-n", str(4 * size * n), "-J"],
                               capture_output=True, text=True)
            try:
                bps = float(json.loads(p.stdout)["end"]["sum_received"]["bits_per_second"])
                return size * n * 8 / bps
            except (ValueError, KeyError, TypeError):
                if time.monotonic() > end:  # the server may still be starting
                    raise RuntimeError(f"iperf3 failed: {p.stdout[-200:]} {p.stderr[-200:]}") from None

    def close(self) -> None:
        self.p.terminate()
        self.p.wait(10)


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


class Daemons:
    """(c): two ``kvstore serve`` daemons with a static peer list; blocks put on
    A (shared-memory client), then ``Acquire(cluster=True)`` on B fetches them
    from A into B's slab over the transport. Timed: B's Acquire (lookup,
    decision, peer fetch, commit) + Release, twice a round: through an
    engine's client on B's host (its same-host socket, the Release not waited
    for, as the vLLM connector releases) and as plain gRPC calls. B's copies
    are removed after each (untimed) so that every one fetches."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.channels: list[Any] = []
        self.client: Any = None
        self.engine: Any = None
        self.keys: dict[int, list[bytes]] = {}

    def start(self) -> None:
        import grpc

        from kvstore.client import Client, ns_pb
        from proto import kvstore_pb2 as pb
        from proto import kvstore_pb2_grpc as pb_grpc

        self.pb, self.ns_pb = pb, ns_pb
        ports = [free_port(), free_port()]
        peers = ",".join(f"127.0.0.1:{p}" for p in ports)
        for port in ports:
            env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
            env.update({"KVSTORE_SERVER_PORT": str(port), "KVSTORE_METRICS_PORT": "0",
                        "KVSTORE_DRAM_CAPACITY": "512MiB", "KVSTORE_CLUSTER_MODE": "static",
                        "KVSTORE_CLUSTER_PEERS": peers, "KVSTORE_CLUSTER_PUBLISH_INTERVAL": "10ms",
                        "KVSTORE_CLUSTER_FETCH_TIMEOUT": "30s",
                        # recompute made slow, so the decision is always "fetch"
                        "KVSTORE_CLUSTER_PREFILL_TOKENS_PER_S": "10",
                        "KVSTORE_CLUSTER_ALLOW_INSECURE_UNAUTHENTICATED": "true"})  # loopback only
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
        self.engine = Client(f"127.0.0.1:{ports[1]}", use_shm=True)  # an engine on B's host
        if not self.engine.reads_without_lease:
            raise RuntimeError("the client on B's host did not get B's same-host socket")
        rng = np.random.default_rng(5)
        for size, n in HINTED:
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

    def round(self, size: int, n: int, grpc_first: bool) -> tuple[float, float]:
        """Seconds of (the engine client's fetch, the gRPC one)."""
        if grpc_first:
            tg = self.fetch_grpc(size, n)
            return self.fetch_client(size, n), tg
        tc = self.fetch_client(size, n)
        return tc, self.fetch_grpc(size, n)

    def fetch_client(self, size: int, n: int) -> float:
        keys = self.keys[size]
        t0 = time.perf_counter()
        lease = self.engine.acquire(namespace(size), keys, cluster=True)
        lease.release(wait=False)
        dt = time.perf_counter() - t0
        self.engine.flush()  # (untimed) the Release's answer
        self.removed(size, n, lease.fetched_blocks, lease.hit_blocks)
        return dt

    def engine_load(self, size: int, n: int, hinted: bool) -> float:
        """(g): the engine's cluster Lookup, then its Acquire (with the
        Lookup's peer and run as the hint, or without) and release."""
        keys, ns = self.keys[size], namespace(size)
        t0 = time.perf_counter()
        cl = self.engine.cluster_lookup(ns, keys)
        lease = self.engine.acquire(ns, keys, cluster=True, peer=cl.hint() if hinted else ("", 0, 0))
        lease.release(wait=False)
        dt = time.perf_counter() - t0
        self.engine.flush()
        self.removed(size, n, lease.fetched_blocks, lease.hit_blocks)
        return dt

    def fetch_grpc(self, size: int, n: int) -> float:
        pb, ns = self.pb, self.ns_pb(namespace(size))
        t0 = time.perf_counter()
        acq = self.b.Acquire(pb.AcquireRequest(ns=ns, keys=self.keys[size], promote=True, cluster=True), timeout=60)
        self.b.Release(pb.ReleaseRequest(lease_id=acq.lease_id), timeout=10)
        dt = time.perf_counter() - t0
        self.removed(size, n, acq.fetched_blocks, acq.hit_blocks)
        return dt

    def removed(self, size: int, n: int, fetched: int, hit: int) -> None:
        """Check that B fetched every block, then drop B's copies (untimed)."""
        if fetched != n:
            raise RuntimeError(f"B fetched {fetched} of {n} blocks (hit {hit})")
        self.b.Remove(self.pb.RemoveRequest(ns=self.ns_pb(namespace(size)), keys=self.keys[size]), timeout=10)

    def close(self) -> None:
        for c in (self.client, self.engine):
            if c is not None:
                c.close()
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
    ap.add_argument("--mooncake-venv", default=None,
                    help="virtual env with mooncake installed (when this Python lacks it)")
    ap.add_argument("--no-mooncake", action="store_true", help="skip Mooncake")
    ap.add_argument("--no-daemons", action="store_true", help="skip the two-daemon figure")
    ap.add_argument("--role", choices=("peer", "mcte", "mcte-holder"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.role == "peer":
        return asyncio.run(peer_main())
    if a.role == "mcte":
        return mcte_client()
    if a.role == "mcte-holder":
        return mcte_holder()
    rep = Report("transport")
    notes: list[str] = []
    missing = "--no-daemons" if a.no_daemons else daemons_missing()
    daemons: Daemons | None = None
    others: dict[str, Any] = {}
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
        if not a.no_mooncake:
            venv = a.mooncake_venv or _bench_module("peer_mooncake").default_venv()
            py = mooncake_python(venv)
            if py is None:
                notes.append("Mooncake not measured: mooncake.engine not importable "
                             "(pip install mooncake-transfer-engine-non-cuda)")
            else:
                try:
                    others["mooncake_te"] = MooncakeTE(py)
                except (RuntimeError, OSError) as e:
                    notes.append(f"Mooncake not measured: {e}")
        try:
            others["iperf3"] = Iperf()
        except (RuntimeError, OSError) as e:
            notes.append(f"iperf3 not measured: {e}")
        figures, more = asyncio.run(ucx_side(a.quick, daemons, others))
    finally:
        if daemons is not None:
            daemons.close()
        for o in others.values():
            o.close()
    notes += more
    for k, v in figures.items():
        unit = "GB/s" if k.endswith("GBps") else ("ms" if k.endswith("_ms") else ("x" if "_vs_" in k else ""))
        rep.figure(k, v, unit)
    nan = float("nan")  # a baseline or figure not measured: the target shows met: false
    for size, n in SHAPES:
        lab = label(size, n)
        rep.target(f"peer fetch {lab} / bare ucxx", figures[f"peer_fetch_vs_bare_{lab}"], 0.7)
        if f"daemons_fetch_vs_bare_{lab}" in figures:
            rep.target(f"two-daemon fetch {lab} / bare ucxx", figures[f"daemons_fetch_vs_bare_{lab}"], 0.7)
        # issue 18 goal 3: against Mooncake's transfer engine and iperf3, same run
        rep.target(f"two-daemon fetch {lab} / Mooncake TE over TCP",
                   figures.get(f"daemons_fetch_vs_mooncake_te_{lab}", nan), 1.2)
        rep.target(f"two-daemon fetch {lab} / iperf3 loopback",
                   figures.get(f"daemons_fetch_vs_iperf3_{lab}", nan), 0.6)
    rep.emit(a.json)
    for note in notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
