"""Daemon benchmark (issue 3). Not a test: it reports numbers.

Starts a real ``kvstore serve`` subprocess and measures, in one run:
- ``Lookup`` p50/p99 for chains of 1, 256 and 4,096 blocks with 1 and 8
  concurrent clients (grpc.aio channels), beside an empty unary call on the
  same server (the standard health ``Check``);
- batched put and get GB/s (batches of 64 blocks) through the shared-memory
  path and through the inline path for 64 KiB, 1 MiB and 4 MiB blocks, beside
  ``numpy.copyto`` of the same bytes.

Usage: python bench/service.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from benchlib import Report, median_time, percentile, wait_serving  # noqa: E402

from kvstore.client import Client, ns_pb  # noqa: E402
from kvstore.errors import KeyStatus  # noqa: E402
from kvstore.keys import Namespace, block_keys  # noqa: E402
from proto import kvstore_pb2 as pb  # noqa: E402
from proto import kvstore_pb2_grpc as pb_grpc  # noqa: E402

KIB, MIB = 1 << 10, 1 << 20
NS = Namespace(tenant="bench", model_id="m", block_size=16)


def start_daemon(dram: str) -> tuple[subprocess.Popen[bytes], str, str]:
    d = tempfile.mkdtemp(prefix="kvbench-")
    sock = os.path.join(d, "kv.sock")
    p = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--host", "", "--unix-socket", sock,
                          "--metrics-port", "0", "--dram", dram, "--log-level", "warning"], cwd=ROOT)
    target = f"unix:{sock}"
    try:
        wait_serving(target, 60, [p])
    except RuntimeError:
        p.kill()
        raise
    return p, target, d


async def _latencies(target: str, make_call, clients: int, calls: int) -> list[float]:
    chans = [grpc.aio.insecure_channel(target) for _ in range(clients)]
    lat: list[float] = []

    async def run(ch: grpc.aio.Channel) -> None:
        call = make_call(ch)
        for _ in range(5):
            await call()
        for _ in range(calls):
            t0 = time.perf_counter()
            await call()
            lat.append(time.perf_counter() - t0)

    await asyncio.gather(*(run(ch) for ch in chans))
    for ch in chans:
        await ch.close()
    return lat


def bench_lookup(rep: Report, target: str, quick: bool) -> None:
    calls = 100 if quick else 400
    keys = block_keys(NS, np.arange(4096 * 16) % 50021)
    with Client(target, use_shm=True) as c:
        for a in range(0, 4096, 64):
            c.put(NS, keys[a : a + 64], [np.zeros(4 * KIB, np.uint8)] * 64, parent=keys[a - 1] if a else None)
        assert c.lookup(NS, keys).hit_blocks == 4096
    nsm = ns_pb(NS)

    def empty(ch):
        stub = health_pb2_grpc.HealthStub(ch)
        req = health_pb2.HealthCheckRequest()
        return lambda: stub.Check(req)

    def lookup(n):
        req = pb.LookupRequest(ns=nsm, keys_packed=b"".join(keys[:n]))

        def mk(ch):
            stub = pb_grpc.KVStoreStub(ch)
            return lambda: stub.Lookup(req)
        return mk

    for clients in (1, 8):
        per = max(20, calls // clients)
        lat = asyncio.run(_latencies(target, empty, clients, per))
        rep.figure(f"empty_call_c{clients}_p50_us", percentile(lat, 50) * 1e6, "us")
        rep.figure(f"empty_call_c{clients}_p99_us", percentile(lat, 99) * 1e6, "us")
        for n in (1, 256, 4096):
            lat = asyncio.run(_latencies(target, lookup(n), clients, per))
            rep.figure(f"lookup_{n}_c{clients}_p50_us", percentile(lat, 50) * 1e6, "us")
            rep.figure(f"lookup_{n}_c{clients}_p99_us", percentile(lat, 99) * 1e6, "us")
    ratio = rep.figures["lookup_4096_c1_p99_us"] / rep.figures["empty_call_c1_p99_us"]
    rep.figure("lookup_4096_c1_p99_over_empty", ratio, "x")
    rep.target("Lookup 4096 blocks p99 / empty call p99 (1 client), at most", ratio, 3.0, lower_is_better=True)


def bench_data(rep: Report, target: str, quick: bool) -> None:
    repeats = 3 if quick else 5
    batch = 64
    sizes = (64 * KIB, 1 * MIB) if quick else (64 * KIB, 1 * MIB, 4 * MIB)
    for size in sizes:
        label = f"{size // KIB}KiB" if size < MIB else f"{size // MIB}MiB"
        src = np.random.default_rng(size).integers(0, 255, size=(batch, size), dtype=np.uint8)
        dst = np.zeros_like(src)
        base = median_time(lambda: np.copyto(dst, src), repeats=repeats)
        gb = batch * size / 1e9
        rep.figure(f"memcpy_{label}_GBps", gb / base, "GB/s")
        ns = Namespace(tenant="bench", model_id=f"data-{label}", block_size=16)
        srcs = [src[i] for i in range(batch)]
        outs = [dst[i] for i in range(batch)]
        for path, use_shm in (("shm", True), ("inline", False)):
            with Client(target, use_shm=use_shm) as c:
                puts, gets = [], []
                for r in range(repeats + 1):
                    keys = block_keys(ns, np.random.default_rng(r * 7 + size).integers(0, 50000, batch * 16))
                    t0 = time.perf_counter()
                    st = c.put(ns, keys, srcs)
                    t1 = time.perf_counter()
                    assert st == [KeyStatus.OK] * batch, st[:3]
                    dst[:] = 0
                    t2 = time.perf_counter()
                    got = c.get_into(ns, keys, outs)
                    t3 = time.perf_counter()
                    assert got == [KeyStatus.OK] * batch and np.array_equal(dst, src)
                    c.clear(ns)
                    if r:  # the first round warms up
                        puts.append(t1 - t0)
                        gets.append(t3 - t2)
            tput, tget = statistics.median(puts), statistics.median(gets)
            rep.figure(f"{path}_put_{label}_GBps", gb / tput, "GB/s")
            rep.figure(f"{path}_get_{label}_GBps", gb / tget, "GB/s")
            rep.figure(f"{path}_put_{label}_ratio", base / tput, "x memcpy")
            rep.figure(f"{path}_get_{label}_ratio", base / tget, "x memcpy")
    rep.target("shm get 1MiB / memcpy", rep.figures["shm_get_1MiB_ratio"], 0.6)
    rep.target("shm put 1MiB / memcpy", rep.figures["shm_put_1MiB_ratio"], 0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller run, under a minute")
    ap.add_argument("--json", metavar="PATH", help="write figures and targets as JSON")
    a = ap.parse_args(argv)
    proc, target, tmp = start_daemon("1GiB")
    rep = Report("service")
    try:
        bench_lookup(rep, target, a.quick)
        bench_data(rep, target, a.quick)
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    rep.emit(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
