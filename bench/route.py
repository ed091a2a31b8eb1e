"""Routing benchmark (issue 15): seed 002's A/B/C scenario on real processes.

Not a test: it reports numbers. Two vLLM CPU OpenAI servers (the tiny Llama
of tests/vllm, the kvstore connector), each with its own daemon, and in front
of them, one policy at a time, on the same seeded open-loop trace:

- ``round_robin``, ``prefix`` (longest cached prefix), ``cost`` (smallest
  predicted TTFT) and ``cost+adm`` (``cost`` with early rejection): ``kvstore route``;
- ``vllm-router cache_aware`` and ``vllm-router power_of_two``: the Rust router
  (``pip install vllm-router``; give its binary with ``--vllm-router`` or put
  it on PATH; skipped when absent).

The scenario, scaled to two CPU backends: a shared system prompt of
``system_tokens``;

- class A: + a hot tool description + a short question, 4 new tokens, Poisson
  with bursts (``burst_factor`` x for ``burst_s`` of every ``burst_period_s``);
- class B: + one of ``customers`` instructions + a question, ``b_new_tokens``
  new tokens (long generations);
- class C: an unrelated prompt, 8 new tokens.

Every request streams; TTFT is measured by the client (first content chunk).
Targets per class are multiples of the cold TTFT of its prompt measured on an
idle backend before the runs. Between policies both daemons are cleared and
vLLM's own prefix caches reset (``VLLM_SERVER_DEV_MODE``), so every policy
starts cold.

Figures per policy: goodput (requests that met their class target per second,
over **all** arrivals: a rejection is a miss), SLO attainment per class over
all arrivals, TTFT p50/p99 per class, predicted-vs-measured TTFT error
p50/p90 (kvstore policies), the router's added latency p50/p99 (its work
before the upstream call). Beside them, what ``bench/admission.py``'s
simulator predicts for the same scaled scenario.

Targets: ``cost+adm`` goodput >= 1.3x the best vllm-router policy and >= 1.3x
round-robin; predicted TTFT error p50 <= 15%; router added latency p50 <= 2 ms.

Usage: python bench/route.py [--quick] [--json PATH] [--vllm-router PATH]
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
from dataclasses import dataclass, replace

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import httpx
from benchlib import Report, free_port, percentile
from fleet import BenchFleet

from tests.support.vllm_servers import wait_servers

CLASSES = ("A", "B", "C")
BLOCK = 128
CHAT_FREE_VOCAB = (3, 1000)


@dataclass(slots=True, frozen=True)
class Params:
    duration_s: float = 120.0
    system_tokens: int = 1024
    tool_tokens: int = 128
    instr_tokens: int = 256
    customers: int = 6
    question_tokens: tuple[int, int] = (16, 48)
    c_tokens: int = 768
    b_new_tokens: int = 48
    rate_a: float = 1.5
    rate_b: float = 0.25
    rate_c: float = 0.5
    burst_factor: float = 3.0
    burst_s: float = 3.0
    burst_period_s: float = 15.0
    slo_factor: tuple[float, float, float] = (1.5, 3.0, 3.0)
    cold_utilization: float = 1.6
    """Arrival rates are scaled so that the offered work, were every prompt
    computed cold, is this multiple of two backends' capacity (saturated
    unless prefixes are reused)."""
    """Class targets as multiples of the class prompt's cold TTFT on an idle backend."""
    seed: int = 15


@dataclass(slots=True)
class Req:
    t: float
    klass: int
    prompt: str
    max_tokens: int


def _words(rng: random.Random, n: int) -> list[str]:
    return [f"w{rng.randrange(*CHAT_FREE_VOCAB)}" for _ in range(n)]


def make_trace(p: Params) -> list[Req]:
    rng = random.Random(p.seed)
    system = _words(rng, p.system_tokens)
    tool = _words(rng, p.tool_tokens)
    instr = [_words(rng, p.instr_tokens) for _ in range(p.customers)]
    phase = rng.uniform(0, p.burst_period_s)
    out: list[Req] = []
    for k, rate in enumerate((p.rate_a, p.rate_b, p.rate_c)):
        peak = rate * (p.burst_factor if k == 0 else 1.0)
        t = 0.0
        while True:
            t += rng.expovariate(peak)
            if t >= p.duration_s:
                break
            if k == 0 and ((t + phase) % p.burst_period_s) >= p.burst_s and rng.random() >= 1.0 / p.burst_factor:
                continue
            q = _words(rng, rng.randint(*p.question_tokens))
            if k == 0:
                words, n = system + tool + q, 4
            elif k == 1:
                words, n = system + instr[rng.randrange(p.customers)] + q, p.b_new_tokens
            else:
                words, n = _words(rng, p.c_tokens) + q, 8
            out.append(Req(t, k, " ".join(words), n))
    out.sort(key=lambda r: r.t)
    return out


# ------------------------------------------------------------------ processes

class Fleet(BenchFleet):
    def start(self) -> None:
        self.launch(["--dram", "256MiB"], {}, stats=False)


def start_router(fleet: Fleet, policy: str, slos: list[float], tps: float) -> tuple[subprocess.Popen[bytes], str]:
    kind, _, admission = policy.partition("+")
    settings = [f'policy = "{kind}"', f"admission = {str(bool(admission)).lower()}", "health_interval = 1.0"]
    tables = ["[predictor]", f"prefill_tokens_per_s = {tps}", "prefill_overhead_s = 0.02", "decode_penalty_s = 0.02"]
    for c, s in zip(CLASSES, slos):
        tables += ["[[class]]", f'name = "{c}"', f"ttft_slo = {s}"]
        tables += ["[[api_key]]", f'key = "k{c}"', f'tenant = "t{c}"', f'class = "{c}"']
    return fleet.start_router(policy, settings, tables, BLOCK)


def start_vllm_router(fleet: Fleet, binary: str, policy: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    log_path = os.path.join(fleet.work, f"vllm-router-{policy}.log")
    with open(log_path, "wb") as log:
        p = subprocess.Popen([binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                              *fleet.urls.values(), "--policy", policy, "--log-level", "warning"],
                             stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_servers({f"vllm-router {policy}": (url, p, log_path)}, 120)
    return p, url


# ------------------------------------------------------------------ load
@dataclass(slots=True)
class Result:
    klass: int
    status: int
    ttft_s: float
    predicted_s: float


async def one(c: httpx.AsyncClient, url: str, r: Req, t0: float, key: str) -> Result:
    await asyncio.sleep(max(t0 + r.t - time.perf_counter(), 0.0))
    start = time.perf_counter()
    body = {"model": "tiny", "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    try:
        async with c.stream("POST", f"{url}/v1/completions", json=body,
                            headers={"authorization": f"Bearer {key}"}) as s:
            pred = float(s.headers.get("x-kvstore-predicted-ttft-ms", "nan")) / 1e3
            if s.status_code != 200:
                await s.aread()
                return Result(r.klass, s.status_code, float("nan"), pred)
            ttft = float("nan")
            async for chunk in s.aiter_raw():
                if chunk and ttft != ttft:
                    ttft = time.perf_counter() - start
            return Result(r.klass, 200, ttft, pred)
    except httpx.HTTPError:
        return Result(r.klass, 599, float("nan"), float("nan"))


async def drive(url: str, trace: list[Req]) -> list[Result]:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=600, limits=limits) as c:
        t0 = time.perf_counter() + 0.5
        return await asyncio.gather(*(one(c, url, r, t0, f"k{CLASSES[r.klass]}") for r in trace))


def cold_ttfts(fleet: Fleet, trace: list[Req]) -> list[float]:
    """Cold TTFT of one prompt per class on an idle backend (median of 3, each with a distinct tail)."""
    out = []
    for n, url in fleet.urls.items():  # warm both engines up (the first requests of a process are slow)
        for i in range(2):
            body = {"model": "tiny", "prompt": f"w{990 - i} w{5 + i} " + trace[0].prompt, "max_tokens": 4,
                    "kv_transfer_params": {"kvstore_load": False, "kvstore_save": False}}
            httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()
    url = fleet.urls["a"]
    for k in range(3):
        r = next(x for x in trace if x.klass == k)
        times = []
        for i in range(3):  # a distinct first token per measurement: no prefix cache anywhere
            body = {"model": "tiny", "prompt": f"w{900 + 3 * k + i} {r.prompt}", "max_tokens": 1,
                    "temperature": 0, "kv_transfer_params": {"kvstore_load": False, "kvstore_save": False}}
            t = time.perf_counter()
            httpx.post(f"{url}/v1/completions", json=body, timeout=300).raise_for_status()
            times.append(time.perf_counter() - t)
        out.append(float(np.median(times)))
    return out


def summarize(res: list[Result], slos: list[float], duration: float) -> dict[str, float]:
    f: dict[str, float] = {}
    met_all = 0
    for k, c in enumerate(CLASSES):
        mine = [x for x in res if x.klass == k]
        ok = [x for x in mine if x.status == 200 and x.ttft_s <= slos[k]]
        met_all += len(ok)
        ttfts = [x.ttft_s for x in mine if x.status == 200 and x.ttft_s == x.ttft_s]
        f[f"attain_{c}"] = len(ok) / max(len(mine), 1)
        f[f"ttft_p50_{c}_ms"] = percentile(ttfts, 50) * 1e3 if ttfts else float("nan")
        f[f"ttft_p99_{c}_ms"] = percentile(ttfts, 99) * 1e3 if ttfts else float("nan")
        f[f"rejected_{c}"] = float(sum(1 for x in mine if x.status == 429))
    f["goodput_rps"] = met_all / duration
    f["attain_all"] = met_all / max(len(res), 1)
    errs = [abs(x.ttft_s - x.predicted_s) / x.ttft_s for x in res
            if x.status == 200 and x.ttft_s == x.ttft_s and x.predicted_s == x.predicted_s and x.ttft_s > 0]
    f["pred_err_p50"] = percentile(errs, 50) if errs else float("nan")
    f["pred_err_p90"] = percentile(errs, 90) if errs else float("nan")
    return f


def simulated(p: Params, slos: list[float], tps: float) -> dict[str, float]:
    """bench/admission.py's simulator on the same scaled scenario (2 workers)."""
    import importlib.util

    import admission as _adm_pkg  # noqa: F401  (the package, before bench/admission.py is loaded by path)

    spec = importlib.util.spec_from_file_location("bench_admission_sim", os.path.join(HERE, "admission.py"))
    assert spec and spec.loader
    sim = importlib.util.module_from_spec(spec)
    sys.modules["bench_admission_sim"] = sim
    spec.loader.exec_module(sim)
    sp = sim.Params(duration_s=p.duration_s, workers=2, common_tokens=p.system_tokens, tool_tokens=p.tool_tokens,
                    instr_tokens=p.instr_tokens, customers=p.customers, question_tokens=p.question_tokens,
                    rate_a=p.rate_a, rate_b=p.rate_b, rate_c=p.rate_c, burst_factor=p.burst_factor,
                    burst_s=p.burst_s, burst_period_s=p.burst_period_s, tokens_per_s=tps, overhead_s=0.02,
                    attention_s=0.0, cache_tokens=4 * p.system_tokens, block_tokens=BLOCK,
                    target_s=float(np.mean(slos)), predictor_tps0=tps * 1.5)
    res = sim.simulate(sp, [p.seed])
    return {f"sim.{pol}.goodput_rps": sum(r.met) / r.duration for pol, r in res.items()
            if pol in ("rr", "lpm", "cost", "cost+adm")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 40 s trace instead of 120 s")
    ap.add_argument("--json", help="write figures and targets here")
    ap.add_argument("--vllm-router", default=shutil.which("vllm-router"), help="the vllm-router binary")
    ap.add_argument("--policies", default="round_robin,prefix,cost,cost+adm,vr:cache_aware,vr:power_of_two")
    args = ap.parse_args()
    p = Params(duration_s=40.0) if args.quick else Params()
    trace = make_trace(p)
    work = tempfile.mkdtemp(prefix="kvstore-route-bench-")
    fleet = Fleet(work)
    rep = Report("route")
    try:
        fleet.start()
        cold = cold_ttfts(fleet, trace)
        slos = [f * c for f, c in zip(p.slo_factor, cold)]
        # scale the arrival rates so that, were every prompt computed cold, the
        # offered prefill work would be `cold_utilization` x what two backends do
        counts = np.bincount([r.klass for r in trace], minlength=3) / p.duration_s
        u0 = float(np.dot(counts, cold)) / 2.0
        scale = p.cold_utilization / max(u0, 1e-9)
        trace = [Req(r.t / scale, r.klass, r.prompt, r.max_tokens)
                 for r in make_trace(replace(p, duration_s=p.duration_s * scale)) if r.t / scale < p.duration_s]
        rep.figures["rate_scale"] = scale
        mean_tokens = (p.system_tokens + p.tool_tokens + 32)
        tps = mean_tokens / max(cold[0] - 0.02, 1e-3)
        for c, s, t in zip(CLASSES, slos, cold):
            rep.figures[f"cold_ttft_{c}_ms"] = t * 1e3
            rep.figures[f"slo_{c}_ms"] = s * 1e3
        rep.figures["arrivals"] = float(len(trace))
        results: dict[str, dict[str, float]] = {}
        for pol in args.policies.split(","):
            if pol.startswith("vr:") and not args.vllm_router:
                print(f"skipping {pol}: no vllm-router binary (pip install vllm-router)")
                continue
            fleet.reset()
            if pol.startswith("vr:"):
                proc, url = start_vllm_router(fleet, args.vllm_router, pol[3:])
            else:
                proc, url = start_router(fleet, pol, slos, tps)
            try:
                res = asyncio.run(drive(url, trace))
                f = summarize(res, slos, p.duration_s)
                if not pol.startswith("vr:"):
                    st = httpx.get(f"{url}/router/backends", headers={"authorization": "Bearer kA"}, timeout=10)
                    ov = st.json()["overhead_ms"]
                    f.update({"overhead_p50_ms": ov["p50"], "overhead_p99_ms": ov["p99"]})
                results[pol] = f
            finally:
                proc.terminate()
                proc.wait(30)
            print(pol, json.dumps({k: round(v, 4) for k, v in results[pol].items()}), flush=True)
        for pol, f in results.items():
            for k, v in f.items():
                rep.figures[f"{pol}.{k}"] = v
        try:
            scaled = replace(p, rate_a=p.rate_a * scale, rate_b=p.rate_b * scale, rate_c=p.rate_c * scale)
            rep.figures.update(simulated(scaled, slos, tps))
        except Exception as e:  # the simulator's interface is its own
            print(f"simulator comparison skipped: {e}")
        ca = results.get("cost+adm", {}).get("goodput_rps", float("nan"))
        vr = [f["goodput_rps"] for k, f in results.items() if k.startswith("vr:")]
        if vr:
            rep.target("cost+adm goodput / best vllm-router", ca / max(max(vr), 1e-9), 1.3)
        if "round_robin" in results:
            rep.target("cost+adm goodput / round-robin", ca / max(results["round_robin"]["goodput_rps"], 1e-9), 1.3)
        if "cost+adm" in results:
            rep.target("predicted TTFT error p50", results["cost+adm"]["pred_err_p50"], 0.15, lower_is_better=True)
            rep.target("router added latency p50 (ms)", results["cost+adm"]["overhead_p50_ms"], 2.0,
                       lower_is_better=True)
    finally:
        fleet.stop()
        shutil.rmtree(work, ignore_errors=True)
    rep.emit(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
