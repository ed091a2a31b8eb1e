"""Load and leaks: many concurrent asyncio clients (200 by default) mixing
lookups, puts and gets against a real ``kvstore serve`` for a while (15 s of
warm-up + 45 s measured by default; ``KVSTORE_FAULT_SOAK_S`` for longer). Reports throughput, p99 and
the daemon's RSS at start and end; after warm-up its RSS grows by at most
5%; every block read is exact; after shutdown no file descriptor of the
clients and no shared-memory segment is left behind."""

from __future__ import annotations

import asyncio
import os
import random
import time

import numpy as np

from kvstore.client import AsyncClient, Client
from kvstore.errors import KeyStatus, KVStoreError
from kvstore.keys import Namespace, block_keys
from tests.conftest import payload_for
from tests.faults.faultlib import Serve, anon_bytes, isetting, mib, num_fds, record, rss_bytes, setting, slabs_of

NS = Namespace(tenant="acme", model_id="llama", block_size=16)
BS = 16 * 1024
N_CHAINS = 1500  # 6,000 blocks of 16 KiB: 94 MiB through a 48 MiB DRAM tier
CHAIN = 4
PAYLOADS: dict[bytes, bytes] = {}


def _chains() -> list[list[bytes]]:
    rng = np.random.default_rng(3)
    return [block_keys(NS, rng.integers(0, 50000, size=CHAIN * 16)) for _ in range(N_CHAINS)]


def P(k: bytes) -> bytes:
    p = PAYLOADS.get(k)
    if p is None:
        p = PAYLOADS[k] = payload_for(b"soak", k, BS)
    return p


class Stats:
    def __init__(self) -> None:
        self.lat: dict[str, list[float]] = {"lookup": [], "put": [], "get": []}
        self.wrong = 0
        self.errors = 0
        self.hits = 0
        self.measuring = False

    def add(self, op: str, dt: float) -> None:
        if self.measuring:
            self.lat[op].append(dt)


async def _client_loop(target: str, chains: list[list[bytes]], seed: int, stats: Stats, stop: asyncio.Event,
                       ready: asyncio.Event, started: list[int]) -> None:
    rng = random.Random(seed)
    c = AsyncClient(target, timeout=60)
    await c.connect()
    started[0] += 1
    if started[0] == started[1]:
        ready.set()
    outs = [np.empty(BS, np.uint8) for _ in range(CHAIN)]
    try:
        while not stop.is_set():
            # a skewed mix: a hot fifth of the chains gets most of the traffic
            i = rng.randrange(N_CHAINS // 5) if rng.random() < 0.8 else rng.randrange(N_CHAINS)
            keys = chains[i]
            try:
                t0 = time.perf_counter()
                look = await c.lookup(NS, keys)
                t1 = time.perf_counter()
                stats.add("lookup", t1 - t0)
                if look.hit_blocks < CHAIN:
                    await c.put(NS, keys, [P(k) for k in keys])
                    stats.add("put", time.perf_counter() - t1)
                else:
                    sts = await c.get_into(NS, keys, outs)
                    stats.add("get", time.perf_counter() - t1)
                    for k, s, o in zip(keys, sts, outs):
                        if s is KeyStatus.OK:
                            stats.hits += 1
                            stats.wrong += o.tobytes() != P(k)
            except KVStoreError:
                stats.errors += 1
    finally:
        await c.close()


async def _soak(target: str, pid: int, n_clients: int, secs: float, warm: float) -> dict[str, float]:
    chains = _chains()
    for keys in chains:
        for k in keys:
            P(k)
    stats = Stats()
    stop, ready = asyncio.Event(), asyncio.Event()
    started = [0, n_clients]
    tasks = [asyncio.create_task(_client_loop(target, chains, s, stats, stop, ready, started))
             for s in range(n_clients)]
    await asyncio.wait_for(ready.wait(), 120)
    rss_start, fds_start = rss_bytes(pid), num_fds(pid)
    await asyncio.sleep(warm)
    rss_warm, fds_warm, anon_warm = rss_bytes(pid), num_fds(pid), anon_bytes(pid)
    samples = [rss_warm]
    stats.measuring = True
    t0 = time.perf_counter()
    t_end = time.monotonic() + secs
    while time.monotonic() < t_end:
        await asyncio.sleep(min(1.0, max(0.0, t_end - time.monotonic())))
        samples.append(rss_bytes(pid))
    elapsed = time.perf_counter() - t0
    stats.measuring = False
    rss_end, fds_end, anon_end = rss_bytes(pid), num_fds(pid), anon_bytes(pid)
    stop.set()
    await asyncio.gather(*tasks)
    lat = {op: np.asarray(v) * 1000 for op, v in stats.lat.items()}
    all_ms = np.concatenate([v for v in lat.values() if v.size])
    ops = int(all_ms.size)
    return {"clients": n_clients, "seconds": round(elapsed, 1), "warmup_s": warm, "ops": ops,
            "ops_per_s": round(ops / elapsed, 1), "p50_ms": round(float(np.percentile(all_ms, 50)), 2),
            "p99_ms": round(float(np.percentile(all_ms, 99)), 2),
            **{f"{op}_p99_ms": round(float(np.percentile(v, 99)), 2) for op, v in lat.items() if v.size},
            **{f"{op}_ops": int(v.size) for op, v in lat.items()},
            "blocks_read": stats.hits, "wrong_bytes": stats.wrong, "errors": stats.errors,
            "rss_start_mib": mib(rss_start), "rss_after_warmup_mib": mib(rss_warm), "rss_end_mib": mib(rss_end),
            "rss_max_after_warmup_mib": mib(max(samples)),
            "rss_growth_after_warmup_pct": round(100.0 * (rss_end - rss_warm) / rss_warm, 2),
            "anon_rss_after_warmup_mib": mib(anon_warm), "anon_rss_end_mib": mib(anon_end),
            "anon_rss_growth_after_warmup_pct": round(100.0 * (anon_end - anon_warm) / anon_warm, 2),
            "daemon_fds_after_warmup": fds_warm, "daemon_fds_end": fds_end, "daemon_fds_start": fds_start}


def test_soak_many_async_clients(tmp_path) -> None:
    n_clients = isetting("soak_clients", 200)
    secs = setting("soak_s", 45.0)  # measured, after a warm-up of 15 s (a quarter of longer runs)
    warm = setting("soak_warmup_s", max(15.0, secs / 4))
    # the client side's own descriptors, once gRPC's process-wide ones exist
    # a small WatchEvents replay ring, so that it is full by the end of warm-up
    # (the default, 65,536 events, would still be filling: growth by design)
    s = Serve(str(tmp_path / "kv.sock"), "--dram", "48MiB",
              env={"KVSTORE_DRAM_PAGE_SIZE": "4MiB", "KVSTORE_SERVER_EVENT_BUFFER": "1024"}, metrics=True)
    try:
        s.wait_healthy()
        with Client(s.target) as c:
            # fill the slab once: the measured run starts in its steady state (evicting)
            for keys in _chains():
                c.put(NS, keys, [P(k) for k in keys])
        asyncio.run(asyncio.sleep(0))
        fds_client_before = num_fds(os.getpid())
        out = asyncio.run(_soak(s.target, s.pid, n_clients, secs, warm))
        fds_client_after = num_fds(os.getpid())
        for op, (n, secs_) in s.op_seconds().items():  # the daemon's own mean service time per RPC
            if op in ("Lookup", "Acquire", "Release", "Reserve", "Commit") and n:
                out[f"daemon_{op.lower()}_mean_ms"] = round(1000 * secs_ / n, 3)
        slabs_while_running = len(slabs_of(s.pid))
        rc = s.terminate(60)
    finally:
        s.kill()
    left = slabs_of(s.pid)
    out.update(daemon_exit_code=rc, shm_segments_left=len(left), shm_segments_while_running=slabs_while_running,
               client_fds_before=fds_client_before, client_fds_after=fds_client_after)
    record("soak", **out)
    assert slabs_while_running == 1  # the daemon's slab while it ran
    assert rc == 0
    assert out["wrong_bytes"] == 0 and out["errors"] == 0
    assert out["blocks_read"] > 0 and out["put_ops"] > 0
    assert out["rss_growth_after_warmup_pct"] <= 5.0, out
    assert out["daemon_fds_end"] <= out["daemon_fds_after_warmup"] + 4
    assert not left, left
    assert fds_client_after <= fds_client_before + 4, (fds_client_before, fds_client_after)
