"""P/D through kvstore (issue 17): prefill on one node, decode on another.

Not a test: it reports numbers. Real processes on this host: etcd; two
``kvstore serve`` daemons A and B (own slabs, joined through etcd, UCX block
transport); two vLLM CPU OpenAI servers (the tiny Llama of tests/vllm, the
kvstore connector, ``kv_both``, one core each when there are two), engine
``a`` on daemon A and ``b`` on daemon B; ``kvstore route`` in front.

1. **Fetched load vs cold prefill.** Per prompt length: the cold TTFT of
   ``b`` (``max_tokens`` 1, store off), then a fresh prompt prefilled on
   ``a`` and sent to ``b``, which fetches its blocks from A and loads them:
   its TTFT, and the connector's load time (the ``load`` record: the
   daemon's fetch + the copy into vLLM's blocks). Target: the load of a
   2,000-token prefix <= 0.5x the cold prefill (cold TTFT minus the TTFT of
   a one-block prompt).
2. **The cost model's choice over a sweep of link speeds and lengths.** No
   ``tc`` here (one network namespace, no root for qdiscs on loopback): the
   link is **emulated**. For a link of ``s`` Gb/s, the measured fetch path
   (loopback UCX + load) gets ``bytes / s`` of wire time added in series;
   recompute is the measured cold prefill. The model is the daemons' own
   (``transport.cost.CostModel``) configured as a daemon would be for that
   link (``peer_bandwidth_gbps = s``, the default latency seed) and with its
   recompute speed calibrated from one measured prefill (the 2,000-token
   one). Its choice is right when it picks the faster of the two measured.
   Target: right in >= 90% of the cases; the wrong ones are listed.
3. **Load**: long prompts (2,000 tokens, 4 new tokens) and short prompts
   (96 tokens, 48 new tokens) mixed as in seed 002, Poisson arrivals, every
   request streamed; the same trace through the router in P/D mode
   (``[pd]``: prefill on ``a``, decode on ``b``) and in its normal mode over
   both engines (co-located: each prefills its own prompts). Between runs
   both daemons are cleared and vLLM's prefix caches reset. Figures: TTFT
   and inter-token latency (ITL) p50/p99 per class, goodput (requests per
   second meeting both their TTFT and TPOT targets, DistServe's
   definition; targets are multiples of the idle figures), bytes moved
   between the nodes (the connectors' ``fetch`` records), and the fetch's
   share of the long requests' TTFT.

On two CPU cores the engines' prefill is slow and the link is memory-fast,
so the P/D-vs-co-located comparison says little about GPUs; the fetch-vs-
recompute and load-vs-prefill figures are the point.

Usage: python bench/pd.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import httpx  # noqa: E402
from benchlib import Report, free_port, percentile  # noqa: E402
from fleet import BenchFleet  # noqa: E402

from tests.support.procs import start_group  # noqa: E402

BLOCK = 128
BLOCK_BYTES = 2 * 4 * 2 * 64 * BLOCK * 4  # the tiny Llama: K+V x 4 layers x 2 KV heads x 64 x 128 tokens x fp32
CLASSES = ("long", "short")


@dataclass(slots=True, frozen=True)
class Params:
    duration_s: float = 120.0
    long_tokens: int = 2000
    long_out: int = 4
    short_tokens: int = 96
    short_out: int = 48
    rate_long: float = 0.3
    rate_short: float = 0.6
    lengths: tuple[int, ...] = (256, 512, 1024, 2000)
    speeds_gbps: tuple[float, ...] = (0.01, 0.05, 0.2, 1.0, 5.0, 25.0, 100.0)
    ttft_factor: float = 3.0
    tpot_factor: float = 3.0
    repeats: int = 2
    seed: int = 17


class Words:
    """Prompts of exact token counts (the tiny tokenizer: one word, one token, plus BOS), never repeated."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, n: int) -> str:
        return " ".join(f"w{self.rng.randrange(3, 1000)}" for _ in range(n - 1))


@dataclass
class Fleet(BenchFleet):
    """The two backends' daemons form a cluster (etcd) and fetch from each other."""

    etcd: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = shutil.which("etcd")
        if exe is None:
            raise SystemExit("bench/pd.py needs etcd (Debian's etcd-server)")
        cport, pport = free_port(), free_port()
        c, p = f"http://127.0.0.1:{cport}", f"http://127.0.0.1:{pport}"
        self.etcd = start_group([exe, "--name", "b", "--data-dir", os.path.join(self.work, "etcd"),
                                 "--listen-client-urls", c, "--advertise-client-urls", c,
                                 "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
                                 "--initial-cluster", f"b={p}", "--log-level", "error"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(self.etcd)
        env = {k: v for k, v in self.env().items() if not k.startswith("KVSTORE_")}
        env.update({"KVSTORE_DRAM_CAPACITY": "512MiB", "KVSTORE_CLUSTER_MODE": "etcd",
                    "KVSTORE_CLUSTER_ALLOW_INSECURE_UNAUTHENTICATED": "true",
                    "KVSTORE_CLUSTER_ETCD_ENDPOINT": f"127.0.0.1:{cport}", "KVSTORE_CLUSTER_PUBLISH_INTERVAL": "10ms"})
        self.launch([], {"cluster": True}, env)


def ttft_of(url: str, prompt: str, *, store: bool = True, n: int = 1) -> float:
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0}
    if not store:
        body["kv_transfer_params"] = {"kvstore_load": False, "kvstore_save": False}
    t = time.perf_counter()
    httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()
    return time.perf_counter() - t


# ------------------------------------------------------------------ 1 + 2
@dataclass(slots=True)
class Point:
    tokens: int
    blocks: int
    cold_s: float
    fetched_ttft_s: float
    load_s: float
    fetched_bytes: int
    daemon_fetch_s: float
    daemon_recompute_s: float


def measure_points(fleet: Fleet, p: Params, words: Words) -> tuple[list[Point], float]:
    from kvstore.client import Client
    from router.config import ModelSpec
    from router.prompts import Endpoint, load_model, request_tokens

    a, b = fleet.urls["a"], fleet.urls["b"]
    version = str(httpx.get(f"{b}/version", timeout=30).json()["version"])  # the namespace names vLLM's version
    entry = load_model(ModelSpec("tiny", fleet.model, block_size=BLOCK, kv_dtype="float32", dtype="float32",
                                 device="cpu", kv_cache_layout="LBHNC", engine_version=version))
    for url in (a, b):  # the first requests of a process are slow
        for _ in range(2):
            ttft_of(url, words(300), store=False, n=4)
    small = sorted(ttft_of(b, words(BLOCK), store=False) for _ in range(3))[1]
    out = []
    with Client(fleet.daemons["b"], use_shm=False, session=False) as cb:
        for n in p.lengths:
            cold = sorted(ttft_of(b, words(n), store=False) for _ in range(p.repeats))[p.repeats // 2]
            samples = []
            for _ in range(p.repeats):
                prompt = words(n)
                keys = request_tokens(entry, Endpoint.COMPLETIONS, {"prompt": prompt}).keys
                ttft_of(a, prompt)  # prefill on a: the blocks go into A
                deadline = time.monotonic() + 10
                cl = cb.cluster_lookup(entry.namespace, keys)
                while cl.remote_blocks < len(keys) and time.monotonic() < deadline:
                    time.sleep(0.005)
                    cl = cb.cluster_lookup(entry.namespace, keys)
                mark = len(fleet.records("b"))
                t = ttft_of(b, prompt)
                recs = fleet.records("b")[mark:]
                load = sum(r["ms"] for r in recs if r.get("event") == "load") / 1e3
                moved = sum(r.get("fetched_bytes", 0) for r in recs if r.get("event") == "fetch")
                samples.append(Point(n, len(keys), cold, t, load, moved, cl.fetch_s, cl.recompute_s))
            samples.sort(key=lambda x: x.fetched_ttft_s)
            out.append(samples[len(samples) // 2])
            pt = out[-1]
            print(f"{n} tokens: cold {pt.cold_s * 1e3:.1f} ms, fetched TTFT {pt.fetched_ttft_s * 1e3:.1f} ms, "
                  f"load {pt.load_s * 1e3:.1f} ms, {pt.fetched_bytes} bytes fetched", flush=True)
    return out, small


def sweep(points: list[Point], small_s: float, p: Params) -> tuple[float, list[str]]:
    """The cost model's choice vs the faster measured path, per (emulated link speed, length)."""
    from transport.cost import ChainDecision, CostConfig, CostModel

    ref = max(points, key=lambda x: x.tokens)
    tps = ref.blocks * BLOCK / max(ref.cold_s - small_s, 1e-6)  # one measured prefill calibrates recompute
    right, wrong = 0, []
    for s in p.speeds_gbps:
        model = CostModel(CostConfig(bandwidth_Bps=s * 1e9 / 8, prefill_tokens_per_s=tps))
        for pt in points:
            nbytes = pt.blocks * BLOCK_BYTES
            wire = nbytes * 8 / (s * 1e9)
            fetch_meas = pt.fetched_ttft_s + wire
            est = model.decide("peer", nbytes, "tiny", pt.blocks * BLOCK)
            chose_fetch = est.decision is ChainDecision.FETCH
            ok = chose_fetch == (fetch_meas < pt.cold_s)
            right += ok
            if not ok:
                wrong.append(f"{s:g} Gb/s, {pt.tokens} tokens: chose {est.decision.label} (est fetch "
                             f"{est.transfer_s * 1e3:.1f} ms vs recompute {est.recompute_s * 1e3:.1f} ms); measured "
                             f"fetch path {fetch_meas * 1e3:.1f} ms vs cold {pt.cold_s * 1e3:.1f} ms")
    return right / max(len(points) * len(p.speeds_gbps), 1), wrong


# ------------------------------------------------------------------ 3: load
@dataclass(slots=True)
class Req:
    t: float
    klass: int
    prompt: str
    max_tokens: int


@dataclass(slots=True)
class Result:
    klass: int
    status: int
    ttft_s: float
    itl_s: list[float]


def make_trace(p: Params, words: Words) -> list[Req]:
    rng = random.Random(p.seed)
    out = []
    for k, (rate, n, new) in enumerate(((p.rate_long, p.long_tokens, p.long_out),
                                        (p.rate_short, p.short_tokens, p.short_out))):
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= p.duration_s:
                break
            out.append(Req(t, k, words(n), new))
    out.sort(key=lambda r: r.t)
    return out


async def one(c: httpx.AsyncClient, url: str, r: Req, t0: float) -> Result:
    await asyncio.sleep(max(t0 + r.t - time.perf_counter(), 0.0))
    start = time.perf_counter()
    body = {"model": "tiny", "prompt": r.prompt, "max_tokens": r.max_tokens, "min_tokens": r.max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    stamps: list[float] = []
    try:
        async with c.stream("POST", f"{url}/v1/completions", json=body) as s:
            if s.status_code != 200:
                await s.aread()
                return Result(r.klass, s.status_code, float("nan"), [])
            async for line in s.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    stamps.append(time.perf_counter())
    except httpx.HTTPError:
        return Result(r.klass, 599, float("nan"), [])
    if not stamps:
        return Result(r.klass, 598, float("nan"), [])
    return Result(r.klass, 200, stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])])


async def drive(url: str, trace: list[Req]) -> list[Result]:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as c:
        t0 = time.perf_counter() + 0.5
        return await asyncio.gather(*(one(c, url, r, t0) for r in trace))


def start_router(fleet: Fleet, mode: str) -> tuple[subprocess.Popen[bytes], str]:
    pd = ["[pd]", 'prefill = ["a"]', 'decode = ["b"]', "visible_timeout = 1.0"] if mode == "pd" else []
    return fleet.start_router(mode, ["admission = false", "health_interval = 0.5"], pd, BLOCK)


def summarize(res: list[Result], slo_ttft: list[float], slo_tpot: float, duration: float) -> dict[str, float]:
    f: dict[str, float] = {}
    good = 0
    for k, c in enumerate(CLASSES):
        mine = [x for x in res if x.klass == k and x.status == 200]
        ttfts = [x.ttft_s for x in mine]
        itls = [g for x in mine for g in x.itl_s]
        f[f"ttft_p50_{c}_ms"] = percentile(ttfts, 50) * 1e3
        f[f"ttft_p99_{c}_ms"] = percentile(ttfts, 99) * 1e3
        f[f"itl_p50_{c}_ms"] = percentile(itls, 50) * 1e3
        f[f"itl_p99_{c}_ms"] = percentile(itls, 99) * 1e3
        for x in mine:
            tpot = sum(x.itl_s) / len(x.itl_s) if x.itl_s else 0.0
            good += x.ttft_s <= slo_ttft[k] and tpot <= slo_tpot
    f["failed"] = float(sum(1 for x in res if x.status != 200))
    f["goodput_rps"] = good / duration
    f["attain"] = good / max(len(res), 1)
    return f


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 30 s trace, two lengths, one sample each")
    ap.add_argument("--json", help="write figures and targets here")
    args = ap.parse_args()
    p = Params(duration_s=30.0, lengths=(512, 2000), repeats=1) if args.quick else Params()
    words = Words(p.seed)
    work = tempfile.mkdtemp(prefix="kvstore-pd-bench-")
    fleet = Fleet(work)
    rep = Report("pd")
    try:
        fleet.start()
        points, small = measure_points(fleet, p, words)
        for pt in points:
            rep.figure(f"cold_ttft_{pt.tokens}_ms", pt.cold_s * 1e3, "ms")
            rep.figure(f"fetched_ttft_{pt.tokens}_ms", pt.fetched_ttft_s * 1e3, "ms")
            rep.figure(f"fetched_load_{pt.tokens}_ms", pt.load_s * 1e3, "ms")
            rep.figure(f"daemon_est_fetch_{pt.tokens}_ms", pt.daemon_fetch_s * 1e3, "ms")
        rep.figure("one_block_ttft_ms", small * 1e3, "ms")
        top = max(points, key=lambda x: x.tokens)
        rep.target(f"fetched load / cold prefill ({top.tokens} tokens)",
                   top.load_s / max(top.cold_s - small, 1e-9), 0.5, lower_is_better=True)
        share, wrong = sweep(points, small, p)
        rep.figure("cost_model_cases", float(len(points) * len(p.speeds_gbps)))
        rep.target("cost model picks the faster (emulated links)", share, 0.9)
        for w in wrong:
            print("cost model chose wrong:", w)
        # 3: the same trace, P/D vs co-located
        trace = make_trace(p, words)
        slo_ttft = [p.ttft_factor * top.cold_s, p.ttft_factor * max(small, 1e-3)]
        idle = asyncio.run(drive(fleet.urls["b"], [Req(0.0, 1, words(p.short_tokens), p.short_out)]))[0]
        slo_tpot = p.tpot_factor * (sum(idle.itl_s) / max(len(idle.itl_s), 1))
        rep.figure("slo_ttft_long_ms", slo_ttft[0] * 1e3, "ms")
        rep.figure("slo_ttft_short_ms", slo_ttft[1] * 1e3, "ms")
        rep.figure("slo_tpot_ms", slo_tpot * 1e3, "ms")
        rep.figure("arrivals", float(len(trace)))
        for mode in ("colocated", "pd"):
            fleet.reset()
            marks = {n: len(fleet.records(n)) for n in ("a", "b")}
            proc, url = start_router(fleet, mode)
            try:
                res = asyncio.run(drive(url, trace))
            finally:
                proc.terminate()
                proc.wait(30)
            f = summarize(res, slo_ttft, slo_tpot, p.duration_s)
            recs = [r for n in ("a", "b") for r in fleet.records(n)[marks[n]:]]
            f["bytes_between_nodes"] = float(sum(r.get("fetched_bytes", 0) for r in recs if r.get("event") == "fetch"))
            fetch_reqs = {r["req"] for r in recs if r.get("event") == "fetch"}
            load_s = sum(r["ms"] for r in recs if r.get("event") == "load" and r["req"] in fetch_reqs) / 1e3
            ttft_long = sum(x.ttft_s for x in res if x.klass == 0 and x.status == 200)
            f["fetch_share_of_long_ttft"] = load_s / ttft_long if ttft_long else float("nan")
            for k, v in f.items():
                rep.figure(f"{mode}.{k}", v)
            print(mode, json.dumps({k: round(v, 4) for k, v in f.items()}), flush=True)
    finally:
        fleet.stop()
        shutil.rmtree(work, ignore_errors=True)
    rep.emit(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
