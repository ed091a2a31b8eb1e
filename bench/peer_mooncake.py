"""Side by side with Mooncake Store (issue 9). Not a test: it reports numbers.

The same operations, in the same run, on this project's daemon (local
client, shared-memory data path) and on Mooncake Store (its Python client,
``MooncakeDistributedStore``, with a local ``mooncake_master``):

- batched put, then get, of 64 KiB, 1 MiB and 4 MiB values in batches of 8
  and 64 (fresh keys every round, removed afterwards, untimed; the first
  round of each shape warms up and is not counted). Ours: ``Client.put``
  (Reserve -> copy into the slab -> Commit) and ``Client.get_into`` (Acquire
  -> copy out -> Release). Mooncake, both of its APIs: ``put_batch`` /
  ``get_batch`` (values copied through its local buffer, gets returned as
  ``bytes``) and ``batch_put_from`` / ``batch_get_into`` (from/into buffers
  registered with ``register_buffer``: its zero-copy path). The ratio is
  taken against the *faster* Mooncake API.
- existence checks of 1, 64 and 1,024 present keys: our ``Lookup`` (the
  prefix lookup of a chain of 4 KiB blocks) against Mooncake's
  ``batch_is_exist``. Ours is ``Client.lookup`` as an engine calls it: on
  the daemon's host it reads the daemon's shared index
  (kvstore/wire/shared_index.py; ``kvstore_lookup_N_asked_daemon`` counts
  the timed lookups that raced a change in the daemon and asked it
  instead, and the run fails if that is over half of them). The same lookup answered by the daemon over its
  same-host socket (kvstore/daemon/socket_server.py) and over gRPC is
  reported beside it.

Each round runs ours, Mooncake copy and Mooncake zero-copy once, back to
back, after the copy baseline in even rounds and in the reverse order,
copy last, in odd ones (no side always goes first); each GB/s figure is the
median of the rounds. A ``ratio_*`` against Mooncake is the median of the
per-round ratios against its faster API (the one with the shorter median
time), and a ``copy_ratio_*`` the same against the faster copy: each
round's sides ran next to each other, so a load swing on this shared
machine hits both alike. Both clients run on this host, one at a time.

Install (once; commands as run on Debian 12)::

    apt-get update && apt-get install -y libibverbs1 iproute2
    python3 -m venv /tmp/kvstore-mooncake-venv
    /tmp/kvstore-mooncake-venv/bin/pip install mooncake-transfer-engine-non-cuda numpy

Run::

    python bench/peer_mooncake.py [--quick] [--json PATH] [--mooncake-venv DIR]

(``--mooncake-venv`` defaults to $MOONCAKE_VENV, else ./.venv-mooncake, else
/tmp/kvstore-mooncake-venv.) What it starts, all inside one new network
namespace, because some of Mooncake's listeners bind every interface whatever
they are told: the script re-runs itself as::

    unshare -rn --pid --fork --kill-child python bench/peer_mooncake.py --in-netns ...

then, in there::

    ip link set lo up
    python -m kvstore serve --port PORT --metrics-port 0 --dram 2GiB --log-level warning
    VENV/bin/mooncake_master --rpc_address=127.0.0.1 --rpc_port=50151 --metrics_host=127.0.0.1 \\
        --metrics_port=50152 --http_metadata_server_host=127.0.0.1 --enable_http_metadata_server=false
    VENV/bin/python bench/peer_mooncake.py --worker     # the Mooncake client:
        # store.setup("127.0.0.1", "P2PHANDSHAKE", 1 GiB segment, 512 MiB buffer, "tcp", "", "127.0.0.1:50151")

Cleanup: every process it starts is terminated (SIGTERM, then SIGKILL after
10 s) on exit, on an error and on SIGINT/SIGTERM; and the namespace has its
own PID namespace (``--pid --fork --kill-child``), so if the script dies
anyway, the kernel kills everything left in it. The temporary directory
(socket, logs) is removed.

If Mooncake cannot run (no venv, ``unshare`` refused, the master or the
client failing), the reason is printed and our side is still measured.

Targets (issue 18): at every shape our put and get GB/s >= 1.2x the faster
Mooncake API; at 4 MiB x 64 >= 0.8x the machine's best copy (the faster of a
single-threaded ``numpy.copyto`` and a two-thread copy of the same bytes,
measured every round); our Lookup of 1 and 64 keys <= 1.0x the time of
Mooncake's ``batch_is_exist``, of 1,024 keys <= 0.5x.

``copy_ceiling_{put,get}_*`` (no target): the best copy's GB/s over the
faster Mooncake API's, in the same run: the ratio a store would reach if its
put or get were nothing but one copy at the machine's best rate. Where it is
under 1.2, the 1.2x target asks for more than copying the bytes once can
give on this machine.

A put of ours of at most 8 MiB is write-behind (docs/daemon.md): it returns
once its bytes are in the client's staging ring and its frame is sent, and
the daemon stores it meanwhile. ``kvstore_put_landed_*`` times the same put
on fresh keys until the daemon has stored it (``put`` then ``flush``, in the
same round after the timed get; no target), so what write-behind moves off
the caller's path is in the report too.

Our daemon runs with embedded defaults (gRPC on 127.0.0.1, no
``--unix-socket``): the same-host socket is on by default since issue 18.
``--unix-socket`` runs it as older code needed; ``--sizes``, ``--batches``,
``--rounds`` and ``--no-lookup`` run a part.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KIB, MIB = 1 << 10, 1 << 20
SIZES = (64 * KIB, 1 * MIB, 4 * MIB)
BATCHES = (8, 64)
EXIST_N = (1, 64, 1024)
MASTER_PORT, METRICS_PORT = 50151, 50152
SEGMENT, LOCAL_BUFFER = 1 << 30, 512 << 20


def label(size: int) -> str:
    return f"{size // KIB}KiB" if size < MIB else f"{size // MIB}MiB"


# ----------------------------------------------------------------- worker
def worker_main() -> int:
    """The Mooncake client, run by the Mooncake venv's python. Reads one JSON
    command per line on stdin, answers one JSON line on stdout. Imports only
    numpy and mooncake."""
    out = sys.stdout
    sys.stdout = sys.stderr  # anything else printed goes to the log

    def reply(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    try:
        from mooncake.store import MooncakeDistributedStore
    except Exception as e:  # noqa: BLE001 - reported to the controller
        reply({"ok": False, "error": f"import mooncake.store: {e!r}"})
        return 1
    cfg = json.loads(sys.stdin.readline())
    store = MooncakeDistributedStore()
    rc = store.setup(cfg["host"], "P2PHANDSHAKE", cfg["segment"], cfg["buffer"], "tcp", "", cfg["master"])
    if rc != 0:
        reply({"ok": False, "error": f"MooncakeDistributedStore.setup returned {rc}"})
        return 1
    cap = max(BATCHES) * max(SIZES)
    src = np.random.default_rng(1).integers(0, 255, cap, dtype=np.uint8)
    dst = np.zeros(cap, dtype=np.uint8)
    reg = [store.register_buffer(src.ctypes.data, cap), store.register_buffer(dst.ctypes.data, cap)]
    reply({"ok": all(r == 0 for r in reg), "error": "" if all(r == 0 for r in reg) else f"register_buffer: {reg}"})
    exist_keys: list[str] = []
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "round":
            size, batch, api, tag = cmd["size"], cmd["batch"], cmd["api"], cmd["tag"]
            keys = [f"{tag}-{i}" for i in range(batch)]
            sizes = [size] * batch
            sptr = [src.ctypes.data + i * size for i in range(batch)]
            dptr = [dst.ctypes.data + i * size for i in range(batch)]
            err = ""
            if api == "zero":
                t0 = time.perf_counter()
                r = store.batch_put_from(keys, sptr, sizes)
                t1 = time.perf_counter()
                g = store.batch_get_into(keys, dptr, sizes)
                t2 = time.perf_counter()
                if any(x != 0 for x in r) or any(x != size for x in g):
                    err = f"batch_put_from {sorted(set(r))} batch_get_into {sorted(set(g))}"
                elif cmd.get("verify") and not np.array_equal(src[: batch * size], dst[: batch * size]):
                    err = "batch_get_into returned other bytes"
                dst[: batch * size] = 0
            else:
                values = [src[i * size : (i + 1) * size] for i in range(batch)]
                t0 = time.perf_counter()
                rc = store.put_batch(keys, values)
                t1 = time.perf_counter()
                got = store.get_batch(keys)
                t2 = time.perf_counter()
                if rc != 0 or len(got) != batch or any(len(v) != size for v in got):
                    err = f"put_batch {rc}, get_batch {[len(v) for v in got][:3]}"
                elif cmd.get("verify") and not all(
                        np.array_equal(np.frombuffer(v, np.uint8), x) for v, x in zip(got, values)):
                    err = "get_batch returned other bytes"
                del got
            store.batch_remove(keys, True)
            reply({"put": t1 - t0, "get": t2 - t1, "error": err})
        elif op == "exist_setup":
            exist_keys = [f"exist-{i}" for i in range(cmd["n"])]
            v = src[: 4 * KIB]
            rc = 0
            for a in range(0, len(exist_keys), 256):
                rc = rc or store.put_batch(exist_keys[a : a + 256], [v] * len(exist_keys[a : a + 256]))
            reply({"error": "" if rc == 0 else f"put_batch {rc}"})
        elif op == "exist":
            keys = exist_keys[: cmd["n"]]
            res = store.batch_is_exist(keys)
            times = []
            for _ in range(cmd["calls"]):
                t0 = time.perf_counter()
                store.batch_is_exist(keys)
                times.append(time.perf_counter() - t0)
            reply({"seconds": statistics.median(times), "present": int(sum(1 for x in res if x == 1))})
        elif op == "close":
            store.batch_remove(exist_keys, True) if exist_keys else None
            for p in (src, dst):
                store.unregister_buffer(p.ctypes.data)
            store.close()
            reply({"ok": True})
            return 0
    return 0


# ------------------------------------------------------------ processes
class Procs:
    """Every process this run starts; ``stop`` ends them all."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen[Any]]] = []

    def start(self, name: str, argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
        p = subprocess.Popen(argv, **kw)
        self.procs.append((name, p))
        return p

    def stop(self) -> None:
        for _, p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 10
        for _, p in reversed(self.procs):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()


def copy_baseline(src: np.ndarray, dst: np.ndarray, size: int, batch: int) -> dict[str, float]:
    """Seconds to copy the same bytes as one round (``batch`` blocks of
    ``size``) with a single-threaded ``numpy.copyto`` and with two threads
    (each copying half the blocks, or half of one block), into a buffer
    copied into before (no first-touch faults: the slab's pages are warm
    too after the first round)."""
    n = size * batch
    s, d = src[:n], dst[:n]
    t0 = time.perf_counter()
    np.copyto(d, s)
    t1 = time.perf_counter()
    pool = _copy_pool()
    h = n // 2
    fut = pool.submit(np.copyto, d[h:], s[h:])
    np.copyto(d[:h], s[:h])
    fut.result()
    t2 = time.perf_counter()
    return {"copy1": t1 - t0, "copy2": t2 - t1}


@functools.lru_cache(maxsize=1)
def _copy_pool() -> Any:
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(1, thread_name_prefix="bench-copy")


def wait_port(host: str, port: int, timeout: float) -> bool:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((host, port)) == 0:
                return True
        time.sleep(0.05)
    return False


class Mooncake:
    """Controller side of the worker: master + client, one command at a time."""

    def __init__(self, venv: str, tmp: str, procs: Procs) -> None:
        self.venv, self.tmp, self.procs = venv, tmp, procs
        self.worker: subprocess.Popen[str] | None = None

    def start(self) -> None:
        master = os.path.join(self.venv, "bin", "mooncake_master")
        py = os.path.join(self.venv, "bin", "python")
        for f in (master, py):
            if not os.path.exists(f):
                raise RuntimeError(f"{f} not found (see the install commands in this script's docstring)")
        env = dict(os.environ, GLOG_minloglevel="1")
        log = open(os.path.join(self.tmp, "mooncake_master.log"), "w")
        argv = [master, "--rpc_address=127.0.0.1", f"--rpc_port={MASTER_PORT}", "--metrics_host=127.0.0.1",
                f"--metrics_port={METRICS_PORT}", "--http_metadata_server_host=127.0.0.1",
                "--enable_http_metadata_server=false"]
        m = self.procs.start("mooncake_master", argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        if not wait_port("127.0.0.1", MASTER_PORT, 30):
            raise RuntimeError(f"mooncake_master did not listen on 127.0.0.1:{MASTER_PORT} "
                               f"(exit {m.poll()}): {self._tail('mooncake_master.log')}")
        wlog = open(os.path.join(self.tmp, "mooncake_client.log"), "w")
        self.worker = self.procs.start("mooncake client", [py, os.path.abspath(__file__), "--worker"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=wlog, text=True,
                                       env=env, cwd=self.tmp)
        r = self.call({"host": "127.0.0.1", "segment": SEGMENT, "buffer": LOCAL_BUFFER,
                       "master": f"127.0.0.1:{MASTER_PORT}"})
        if not r.get("ok"):
            raise RuntimeError(f"{r.get('error')}: {self._tail('mooncake_client.log')}")

    def _tail(self, name: str) -> str:
        try:
            with open(os.path.join(self.tmp, name)) as f:
                lines = [x.rstrip() for x in f if x.strip()]
            return " | ".join(lines[-5:])
        except OSError:
            return ""

    def call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.worker is not None and self.worker.stdin is not None and self.worker.stdout is not None
        self.worker.stdin.write(json.dumps(cmd) + "\n")
        self.worker.stdin.flush()
        line = self.worker.stdout.readline()
        if not line:
            raise RuntimeError(f"the Mooncake client exited ({self.worker.poll()}): "
                               f"{self._tail('mooncake_client.log')}")
        out: dict[str, Any] = json.loads(line)
        return out

    def close(self) -> None:
        if self.worker is not None and self.worker.poll() is None:
            try:
                self.call({"op": "close"})
            except (RuntimeError, OSError, ValueError):
                pass


# ---------------------------------------------------------------- ours
class Ours:
    """This project's daemon and its local client (shared-memory path)."""

    def __init__(self, tmp: str, procs: Procs, unix_socket: bool = False) -> None:
        self.tmp, self.procs = tmp, procs
        self.unix_socket = unix_socket
        self.client: Any = None
        self.fallbacks = 0
        """Timed lookups of the last ``exist`` that the daemon answered instead of the shared index."""

    def start(self) -> None:
        sys.path.insert(0, ROOT)
        sys.path.insert(1, HERE)
        from benchlib import free_port, wait_serving

        from kvstore.client import Client

        # embedded defaults, as `make serve` runs it: gRPC on 127.0.0.1 (a free
        # port), no --unix-socket; the same-host socket is on by default
        # (--unix-socket: the way older daemons had to run for a same-host socket)
        log = open(os.path.join(self.tmp, "kvstore.log"), "w")
        port = free_port()
        where = ["--host", "", "--unix-socket", os.path.join(self.tmp, "kv.sock")] if self.unix_socket else \
            ["--port", str(port)]
        self.procs.start("kvstore serve", [sys.executable, "-m", "kvstore", "serve", *where,
                                           "--metrics-port", "0", "--dram", "2GiB", "--log-level", "warning"],
                         cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        target = f"unix:{where[3]}" if self.unix_socket else f"127.0.0.1:{port}"
        wait_serving(target, 60)
        self.client = Client(target, use_shm=True, write_behind=WRITE_BEHIND,
                             **({} if WRITE_BEHIND_DELAY is None else {"write_behind_delay": WRITE_BEHIND_DELAY}))
        if self.client.slab is None:
            raise RuntimeError("the client did not map the daemon's slab (no shared-memory path)")
        if self.client._fast is None:
            raise RuntimeError("the client did not connect to the daemon's same-host socket")
        if not self.client.reads_without_lease:
            raise RuntimeError("the client did not map the daemon's shared index (lookups would be round trips)")
        self.grpc_client = Client(target, use_shm=True, fast_lookup=False)  # Lookup over gRPC, for reference
        # Lookup answered by the daemon over the same-host socket (a round trip), for reference
        self.socket_client = Client(target, use_shm=True, shared_index=False)

    def ns(self, tag: str) -> Any:
        from kvstore.keys import Namespace

        return Namespace(tenant="bench", model_id=tag, block_size=16)

    def round(self, size: int, batch: int, tag: str, src: np.ndarray, dst: np.ndarray, verify: bool) -> dict[str, Any]:
        from kvstore.errors import KeyStatus
        from kvstore.keys import block_keys

        # one namespace per block size, as an engine has one per model; each
        # round's keys are new (its tag salts the tokens), as Mooncake's are
        # (tag-prefixed keys): the timed put and get never register a namespace
        ns = self.ns(f"s{size}")
        salt = int.from_bytes(hashlib.blake2b(tag.encode(), digest_size=3).digest(), "little") << 8
        keys = block_keys(ns, np.arange(batch * 16, dtype=np.uint32) + np.uint32(salt))
        srcs = [src[i * size : (i + 1) * size] for i in range(batch)]
        outs = [dst[i * size : (i + 1) * size] for i in range(batch)]
        c = self.client
        t0 = time.perf_counter()
        st = c.put(ns, keys, srcs)
        t1 = time.perf_counter()
        got = c.get_into(ns, keys, outs)
        t2 = time.perf_counter()
        err = ""
        if st != [KeyStatus.OK] * batch or got != [KeyStatus.OK] * batch:
            err = f"put {st[:2]} get {got[:2]}"
        elif verify and not np.array_equal(src[: batch * size], dst[: batch * size]):
            err = "get_into returned other bytes"
        dst[: batch * size] = 0
        c.remove(ns, keys)  # untimed, like Mooncake's batch_remove after its round
        # the same put again on fresh keys, timed until the daemon has stored it (a write-behind
        # put returns before that): reported beside the put, for what it costs the daemon
        more = block_keys(ns, np.arange(batch * 16, dtype=np.uint32) + np.uint32(salt + 128))
        t3 = time.perf_counter()
        c.put(ns, more, srcs)
        c.flush()
        t4 = time.perf_counter()
        c.remove(ns, more)
        return {"put": t1 - t0, "get": t2 - t1, "landed": t4 - t3, "error": err}

    def exist_setup(self, n: int) -> list[bytes]:
        from kvstore.keys import block_keys

        ns = self.ns("exist")
        keys = block_keys(ns, np.arange(n * 16, dtype=np.uint32) % 50021)
        v = np.zeros(4 * KIB, np.uint8)
        for a in range(0, n, 256):
            self.client.put(ns, keys[a : a + 256], [v] * len(keys[a : a + 256]), parent=keys[a - 1] if a else None)
        return keys

    def empty_call(self, calls: int) -> float:
        """Median seconds of an empty unary call on the same channel (the
        standard health ``Check``): the floor under every ``Lookup``."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self.client.channel)
        req = health_pb2.HealthCheckRequest()
        stub.Check(req)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            stub.Check(req)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def exist(self, keys: list[bytes], n: int, calls: int, via: str = "shared") -> tuple[float, int]:
        """Median seconds of ``Client.lookup`` of ``n`` stored keys: ``via``
        "shared" (the engine's client: the daemon's shared index), "socket"
        (the daemon answers over the same-host socket) or "grpc"."""
        ns = self.ns("exist")
        c = {"shared": self.client, "socket": self.socket_client, "grpc": self.grpc_client}[via]
        hit = c.lookup(ns, keys[:n]).hit_blocks
        probes = c.shared_lookups
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            c.lookup(ns, keys[:n])
            times.append(time.perf_counter() - t0)
        self.fallbacks = calls - (c.shared_lookups - probes) if via == "shared" else 0
        if 2 * self.fallbacks > calls:
            raise RuntimeError(f"{self.fallbacks} of {calls} lookups of {n} keys were not answered from the "
                               "shared index: the median would not be its figure")
        return statistics.median(times), int(hit)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if getattr(self, "grpc_client", None) is not None:
            self.grpc_client.close()
        if getattr(self, "socket_client", None) is not None:
            self.socket_client.close()


# ------------------------------------------------------------ measuring
def _mc_round(mc: Mooncake | None, cmd: dict[str, Any]) -> dict[str, Any]:
    return mc.call(cmd) if mc is not None else {"error": "stopped"}


def measure(quick: bool, venv: str, mooncake_note: str, sizes: tuple[int, ...] = SIZES,
            batches: tuple[int, ...] = BATCHES, rounds: int = 0,
            lookups: bool = True, unix_socket: bool = False) -> tuple[dict[str, float], dict[str, str], list[str]]:
    """Run both sides; returns (figures, units, notes)."""
    figures: dict[str, float] = {}
    units: dict[str, str] = {}
    notes: list[str] = []
    tmp = tempfile.mkdtemp(prefix="kvpeer-")
    procs = Procs()
    ours = Ours(tmp, procs, unix_socket)
    mc: Mooncake | None = None
    try:
        ours.start()
        notes.append(f"kvstore client: write_behind_delay {ours.client.write_behind_delay * 1e3:g} ms (a write-behind "
                     "put's frames wait that long for the client's next frame)")
        notes.append("kvstore client: a put of at most 8 MiB is copied into the connection's staging ring unhashed "
                     "(the daemon hashes it as it lands it), and a get of those blocks while the put is in flight "
                     "copies them from there unhashed (docs/daemon.md, 'Unhashed staged puts'); larger puts and "
                     "every other read are hashed and verified")
        if mooncake_note:
            notes.append(f"Mooncake not measured: {mooncake_note}")
        else:
            try:
                mc = Mooncake(venv, tmp, procs)
                mc.start()
            except (RuntimeError, OSError, ValueError) as e:
                notes.append(f"Mooncake not measured: {e}")
                mc = None
        repeats = rounds or (3 if quick else 7)
        cap = max(batches) * max(sizes)
        src = np.random.default_rng(0).integers(0, 255, cap, dtype=np.uint8)
        dst = np.zeros(cap, dtype=np.uint8)
        apis = ("copy", "zero") if mc is not None else ()
        for size in sizes:
            for batch in batches:
                gb = size * batch / 1e9
                samples: dict[str, dict[str, list[float]]] = {k: {"put": [], "get": []} for k in ("ours", *apis)}
                copies: dict[str, list[float]] = {"copy1": [], "copy2": []}
                landed: list[float] = []
                for r in range(repeats + 1):
                    if r % 2 == 0:  # the copy first in even rounds, last in odd ones (below)
                        cb = copy_baseline(src, dst, size, batch)
                    runs: list[tuple[str, Callable[[], dict[str, Any]]]] = [
                        ("ours", lambda: ours.round(size, batch, f"b{size}-{batch}-{r}", src, dst, r < 2))]
                    for api in apis:
                        cmd = {"op": "round", "size": size, "batch": batch, "api": api,
                               "tag": f"{api}-{size}-{batch}-{r}", "verify": r < 2}
                        runs.append((api, functools.partial(_mc_round, mc, cmd)))
                    if r % 2:  # every other round in the reverse order: no side always goes first
                        runs.reverse()
                    for name, fn in runs:
                        try:
                            res = fn()
                        except RuntimeError as e:  # the Mooncake client died: go on with ours
                            res = {"error": str(e)}
                        if res.get("error"):
                            if name == "ours":
                                raise RuntimeError(f"kvstore {label(size)} x{batch}: {res['error']}")
                            notes.append(f"Mooncake stopped at {name} {label(size)} x{batch}: {res['error']}")
                            if mc is not None:
                                mc.close()
                            mc, apis = None, ()
                            break
                        if r:  # round 0 warms up
                            samples[name]["put"].append(res["put"])
                            samples[name]["get"].append(res["get"])
                            if "landed" in res:
                                landed.append(res["landed"])
                    if r % 2:
                        cb = copy_baseline(src, dst, size, batch)
                    if r:
                        for k, v in cb.items():
                            copies[k].append(v)
                key = f"{label(size)}_b{batch}"
                for k, v in copies.items():
                    figures[f"{k}_{key}_GBps"] = gb / statistics.median(v)
                    units[f"{k}_{key}_GBps"] = "GB/s"
                best_copy = max(figures[f"copy1_{key}_GBps"], figures[f"copy2_{key}_GBps"])
                figures[f"best_copy_{key}_GBps"] = best_copy
                units[f"best_copy_{key}_GBps"] = "GB/s (faster of 1- and 2-thread copy)"
                for name, s in samples.items():
                    who = "kvstore" if name == "ours" else f"mooncake_{name}"
                    for op in ("put", "get"):
                        if s[op]:
                            figures[f"{who}_{op}_{key}_GBps"] = gb / statistics.median(s[op])
                            units[f"{who}_{op}_{key}_GBps"] = "GB/s"
                if landed:
                    figures[f"kvstore_put_landed_{key}_GBps"] = gb / statistics.median(landed)
                    units[f"kvstore_put_landed_{key}_GBps"] = "GB/s (put, then flush: until the daemon has stored it)"
                faster = min(copies, key=lambda k: statistics.median(copies[k]))
                for op in ("put", "get"):  # per-round ratios against the faster copy, as against Mooncake
                    figures[f"copy_ratio_{op}_{key}"] = statistics.median(
                        c / o for c, o in zip(copies[faster], samples["ours"][op]))
                    units[f"copy_ratio_{op}_{key}"] = "x best copy"
                if mc is not None and apis:
                    for op in ("put", "get"):
                        best = max(figures[f"mooncake_{api}_{op}_{key}_GBps"] for api in apis)
                        # the faster API by its median; the ratio is the median of the rounds'
                        # ratios against it (each round's two ran next to each other)
                        fast = min(apis, key=lambda api: statistics.median(samples[api][op]))
                        figures[f"ratio_{op}_{key}"] = statistics.median(
                            m / o for m, o in zip(samples[fast][op], samples["ours"][op]))
                        units[f"ratio_{op}_{key}"] = "x best mooncake"
                        # the ratio a store whose op were one copy at the best copy's rate would
                        # reach: below the 1.2 target, the target asks more than a copy can give
                        figures[f"copy_ceiling_{op}_{key}"] = best_copy / best
                        units[f"copy_ceiling_{op}_{key}"] = "x best mooncake, for a store at the best copy's rate"
                    if landed:
                        best = max(figures[f"mooncake_{api}_put_{key}_GBps"] for api in apis)
                        figures[f"ratio_put_landed_{key}"] = figures[f"kvstore_put_landed_{key}_GBps"] / best
                        units[f"ratio_put_landed_{key}"] = "x best mooncake put (no target)"
        # existence checks ---------------------------------------------
        if not lookups:
            return figures, units, notes
        n_max = max(EXIST_N)
        keys = ours.exist_setup(n_max)
        if mc is not None:
            setup = mc.call({"op": "exist_setup", "n": n_max})
            if setup.get("error"):
                raise RuntimeError(f"mooncake exist setup: {setup['error']}")
        figures["kvstore_empty_call_us"] = ours.empty_call(100 if quick else 400) * 1e6
        units["kvstore_empty_call_us"] = "us"
        for n in EXIST_N:
            calls = (100 if quick else 400) if n < 1024 else (50 if quick else 200)
            t, hit = ours.exist(keys, n, calls)
            if hit != n:
                raise RuntimeError(f"Lookup of {n} stored keys found {hit}")
            # timed lookups that raced the daemon's changes and asked it instead (over the socket)
            figures[f"kvstore_lookup_{n}_asked_daemon"] = float(ours.fallbacks)
            units[f"kvstore_lookup_{n}_asked_daemon"] = f"of {calls} lookups"
            figures[f"kvstore_lookup_{n}_us"] = t * 1e6
            units[f"kvstore_lookup_{n}_us"] = "us"
            for via in ("socket", "grpc"):
                tv, _ = ours.exist(keys, n, calls, via=via)
                figures[f"kvstore_lookup_{via}_{n}_us"] = tv * 1e6
                units[f"kvstore_lookup_{via}_{n}_us"] = "us"
            if mc is not None:
                ex = mc.call({"op": "exist", "n": n, "calls": calls})
                if ex["present"] != n:
                    raise RuntimeError(f"batch_is_exist of {n} stored keys found {ex['present']}")
                figures[f"mooncake_is_exist_{n}_us"] = ex["seconds"] * 1e6
                units[f"mooncake_is_exist_{n}_us"] = "us"
                figures[f"ratio_lookup_{n}"] = t / ex["seconds"]
                units[f"ratio_lookup_{n}"] = "x mooncake time"
    finally:
        if mc is not None:
            mc.close()
        ours.close()
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return figures, units, notes


def report(figures: dict[str, float], units: dict[str, str], notes: list[str], json_path: str | None) -> None:
    sys.path.insert(0, HERE)
    from benchlib import Report

    rep = Report("peer_mooncake")
    for k, v in figures.items():
        rep.figure(k, v, units.get(k, ""))
    # issue 18: every shape >= 1.2x the faster Mooncake API; 4 MiB x 64 >= 0.8x
    # the machine's best copy; Lookup <= 1.0x batch_is_exist (1 and 64 keys),
    # <= 0.5x (1,024 keys)
    for size in SIZES:
        for batch in BATCHES:
            for op in ("put", "get"):
                k = f"ratio_{op}_{label(size)}_b{batch}"
                if k in figures:
                    rep.target(f"kvstore {op} {label(size)} x{batch} / best Mooncake", figures[k], 1.2)
    for op in ("put", "get"):
        k = f"copy_ratio_{op}_4MiB_b64"
        if k in figures:
            rep.target(f"kvstore {op} 4MiB x64 / best copy", figures[k], 0.8)
    for n, goal in ((1, 1.0), (64, 1.0), (1024, 0.5)):
        if f"ratio_lookup_{n}" in figures:
            rep.target(f"kvstore Lookup {n} time / Mooncake batch_is_exist {n} time", figures[f"ratio_lookup_{n}"],
                       goal, lower_is_better=True)
    print(side_by_side(figures))
    print()
    rep.emit(json_path)
    for n in notes:
        print(n)


def side_by_side(f: dict[str, float]) -> str:
    """The readable table: one row per operation, both systems and the ratio."""
    rows = [["operation", "kvstore", "mooncake copy", "mooncake zero-copy", "kvstore / best", "best copy",
             "kvstore / copy", "copy / best"]]
    for size in SIZES:
        for batch in BATCHES:
            k = f"{label(size)}_b{batch}"
            for op in ("put", "get"):
                if f"kvstore_{op}_{k}_GBps" not in f:
                    continue
                rows.append([f"{op} {label(size)} x{batch} (GB/s)", _fmt(f.get(f"kvstore_{op}_{k}_GBps")),
                             _fmt(f.get(f"mooncake_copy_{op}_{k}_GBps")), _fmt(f.get(f"mooncake_zero_{op}_{k}_GBps")),
                             _fmt(f.get(f"ratio_{op}_{k}"), "x"), _fmt(f.get(f"best_copy_{k}_GBps")),
                             _fmt(f.get(f"copy_ratio_{op}_{k}"), "x"), _fmt(f.get(f"copy_ceiling_{op}_{k}"), "x")])
    rows.append(["empty unary call (us; health Check)", _fmt(f.get("kvstore_empty_call_us")), "", "", "", "", "", ""])
    for n in EXIST_N:
        rows.append([f"exists {n} keys (us; Lookup vs batch_is_exist)", _fmt(f.get(f"kvstore_lookup_{n}_us")),
                     _fmt(f.get(f"mooncake_is_exist_{n}_us")), "", _fmt(f.get(f"ratio_lookup_{n}"), "x time"), "", "", ""])
        rows.append([f"  (Lookup of {n} answered by the daemon over its socket, us)",
                     _fmt(f.get(f"kvstore_lookup_socket_{n}_us")), "", "", "", "", "", ""])
        rows.append([f"  (Lookup of {n} over gRPC instead, us)", _fmt(f.get(f"kvstore_lookup_grpc_{n}_us")),
                     "", "", "", "", "", ""])
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)) for r in rows]
    out.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(out)


def _fmt(v: float | None, suffix: str = "") -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" + (f" {suffix}" if suffix else "")


# ----------------------------------------------------------------- main
def default_venv() -> str:
    for cand in (os.environ.get("MOONCAKE_VENV", ""), os.path.join(ROOT, ".venv-mooncake"),
                 "/tmp/kvstore-mooncake-venv"):
        if cand and os.path.exists(os.path.join(cand, "bin", "python")):
            return cand
    return "/tmp/kvstore-mooncake-venv"


WRITE_BEHIND: bool | str = True
"""The bench client's ``write_behind`` (``--staged``: "staged")."""
WRITE_BEHIND_DELAY: float | None = None
"""The bench client's ``write_behind_delay`` (``--write-behind-delay``; None: the client's default)."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds per shape instead of 7; fewer lookups")
    ap.add_argument("--json", metavar="PATH", help="write figures and targets as JSON")
    ap.add_argument("--mooncake-venv", default=default_venv(), help="virtual env with mooncake installed")
    ap.add_argument("--sizes", default=",".join(str(x) for x in SIZES),
                    help="block sizes in bytes, comma-separated (default: all three)")
    ap.add_argument("--batches", default=",".join(str(x) for x in BATCHES), help="batch sizes, comma-separated")
    ap.add_argument("--rounds", type=int, default=0, help="timed rounds per shape (default 7; 3 with --quick)")
    ap.add_argument("--no-lookup", action="store_true", help="skip the existence checks")
    ap.add_argument("--unix-socket", action="store_true",
                    help="run the daemon on a Unix socket (--host '' --unix-socket), as before issue 18")
    ap.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-netns", action="store_true",
                    help="do not create a network namespace (Mooncake is then skipped)")
    ap.add_argument("--staged", action="store_true",
                    help="puts without granted slots: the staging ring or Reserve, as before the tenth round")
    ap.add_argument("--write-behind-delay", type=float, metavar="S",
                    help="the client's write_behind_delay in seconds (default: the client's, 5 ms); 0 sends a "
                         "write-behind put's frame at once, as before the twenty-fourth round")
    a = ap.parse_args(argv)
    global WRITE_BEHIND, WRITE_BEHIND_DELAY
    WRITE_BEHIND = "staged" if a.staged else True
    WRITE_BEHIND_DELAY = a.write_behind_delay
    note = ""
    if a.in_netns:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # PID 1 ignores them otherwise
            signal.signal(sig, lambda *_: sys.exit(128 + 15))
        up = subprocess.run(["ip", "link", "set", "lo", "up"], capture_output=True, text=True)
        if up.returncode != 0:
            note = f"`ip link set lo up` failed: {up.stderr.strip()}"
    elif not a.no_netns:
        ns = ["unshare", "-rn", "--pid", "--fork", "--kill-child"]
        try:
            probe = subprocess.run([*ns, "true"], capture_output=True, text=True)
            if probe.returncode == 0:
                return subprocess.run([*ns, sys.executable, os.path.abspath(__file__), "--in-netns", *argv]).returncode
            note = f"`{' '.join(ns)} true` failed: {probe.stderr.strip()}"
        except OSError as e:
            note = f"unshare could not run: {e}"
        print(f"peer_mooncake: {note}; measuring our side only, outside a namespace", file=sys.stderr)
    else:
        note = "--no-netns: Mooncake runs only inside its own network namespace"
    figures, units, notes = measure(a.quick, a.mooncake_venv, note, tuple(int(x) for x in a.sizes.split(",")),
                                    tuple(int(x) for x in a.batches.split(",")), a.rounds, not a.no_lookup,
                                    a.unix_socket)
    report(figures, units, notes, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
