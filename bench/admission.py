"""Admission-control benchmark (issue 7): a discrete-event simulation.

Not a test: it reports numbers. It reproduces the A/B/C scenario of
../shared/seeds/002 (section 4): three request classes share an 8,000-token
system prompt;

- class A adds a 200-token hot tool description, 100 req/s, with bursts
  (3x for 2 s of every 10 s, random phase per seed);
- class B adds one of 20 rare 400-token customer instructions, 5 req/s;
- class C uses only the common prefix, 20 req/s;

and each request ends with a short unique question (30-120 tokens). Four
simulated prefill workers serve one request at a time; a request's prefill
time is ``overhead + u / tokens_per_s + attention * u * (c + u / 2)`` for
``u`` uncached tokens after ``c`` cached ones (12 ms, 20,000 tokens/s,
1.75e-9 s per token pair: an 8B model on one GPU), times a lognormal jitter
(sigma 0.08). Each worker has a prefix cache of 12,000 tokens (LRU, leaf
first; the common prefix is preloaded everywhere; unique questions are not
cached). The TTFT target is 200 ms.

Policies, on the same seeded trace:

- ``rr``: round-robin with recompute (no prefix reuse);
- ``lpm``: always the longest prefix hit (ties: the least loaded);
- ``cost``: Preble's E2: exploit the longest hit when it covers more than half
  the prompt (least loaded holder), unless the holder's queue exceeds the
  lightest worker's by more than the lightest's miss prefill (Preble's
  rebalancing); else explore: the lowest load + eviction cost + miss prefill;
- ``cost+adm``: ``cost`` placement, then ``admission.AdmissionController``
  decides on the chosen worker (queue wait from that worker's backlog), with
  ``ClassFairness`` over the classes A/B/C: guaranteed shares of admissions,
  and each worker's local queue serves the most starved class first (Preble's
  per-class quota). Rejected requests cost nothing. The predictor starts 50%
  optimistic (30,000 tokens/s) and calibrates from the reported TTFTs.

Load and cost estimates of every policy come from the same TTFTPredictor
model (calibrated from reports in both ``cost`` policies). Figures per policy
and class: TTFT p50/p95/p99 of served requests, SLO attainment among admitted
(served) requests and of all offered requests, rejections, Jain's fairness
index across classes (of each class's offered requests served within the
target), goodput (requests per second that met the target), and the
predictor's error. Attainment is given two ways, side by side: among
admitted requests (served ones only), and over all arrivals, where a
rejected request counts as a miss (rejecting work cannot raise it). Per
policy both also over all classes together. Targets: ``cost+adm`` has the
best goodput (ratio to the best other policy >= 1) and no class below 90%
attainment among admitted; beside it the same 90% over all arrivals.

Usage: python bench/admission.py [--quick] [--json PATH] [--seeds N] [--duration S]
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # first: `admission` is the package, not this file

from benchlib import Report, percentile  # noqa: E402

from admission import (AdmissionConfig, AdmissionController, ClassFairness, PredictorConfig,  # noqa: E402
                       TierLoad, TTFTPredictor)
from admission.slo import DEFAULT_TIER_LOADS  # noqa: E402
from tiers.base import TierKind  # noqa: E402

CLASSES = ("A", "B", "C")
POLICIES = ("rr", "lpm", "cost", "cost+adm", "cost+adm-nofair")
"""The four policies of the issue, then an ablation: admission without class
fairness (FIFO local queues, no guaranteed shares); not part of the targets."""
COMPARED = ("rr", "lpm", "cost")
RATE_TAU_S = 2.0


@dataclass(slots=True, frozen=True)
class Params:
    """Everything the scenario depends on (stated in the table)."""

    duration_s: float = 120.0
    workers: int = 4
    common_tokens: int = 8000
    tool_tokens: int = 200
    instr_tokens: int = 400
    customers: int = 20
    question_tokens: tuple[int, int] = (30, 120)
    rate_a: float = 100.0
    rate_b: float = 5.0
    rate_c: float = 20.0
    burst_factor: float = 3.0
    burst_s: float = 2.0
    burst_period_s: float = 10.0
    tokens_per_s: float = 20_000.0
    overhead_s: float = 0.012
    attention_s: float = 1.75e-9
    jitter_sigma: float = 0.08
    cache_tokens: int = 12_000
    block_tokens: int = 8
    kv_bytes_per_token: int = 128 << 10
    target_s: float = 0.200
    predictor_tps0: float = 30_000.0
    headroom: float = 0.15
    fairness_headroom: float = 0.10
    reuse_horizon_s: float = 10.0


# ------------------------------------------------------------------ trace
@dataclass(slots=True)
class Trace:
    arrival: np.ndarray   # float64 seconds, sorted
    klass: np.ndarray     # 0 A, 1 B, 2 C
    branch: np.ndarray    # segment id of the branch (1 = tool, 2 + k = instruction k), 0 = none
    question: np.ndarray  # unique tail tokens


def make_trace(p: Params, seed: int) -> Trace:
    """Poisson arrivals per class; class A's rate is multiplied by
    ``burst_factor`` during ``burst_s`` of every ``burst_period_s``."""
    rng = np.random.default_rng(seed)
    phase = rng.uniform(0, p.burst_period_s)
    parts = []
    for k, rate in enumerate((p.rate_a, p.rate_b, p.rate_c)):
        peak = rate * (p.burst_factor if k == 0 else 1.0)
        n = rng.poisson(peak * p.duration_s)
        t = np.sort(rng.uniform(0, p.duration_s, n))
        if k == 0:  # thinning: keep base/peak outside the bursts
            in_burst = ((t + phase) % p.burst_period_s) < p.burst_s
            t = t[in_burst | (rng.uniform(0, 1, t.size) < 1.0 / p.burst_factor)]
        parts.append((t, np.full(t.size, k)))
    arrival = np.concatenate([x[0] for x in parts])
    klass = np.concatenate([x[1] for x in parts])
    order = np.argsort(arrival, kind="stable")
    arrival, klass = arrival[order], klass[order]
    branch = np.zeros(arrival.size, dtype=np.int64)
    branch[klass == 0] = 1
    nb = int((klass == 1).sum())
    branch[klass == 1] = 2 + rng.integers(0, p.customers, nb)
    q = rng.integers(p.question_tokens[0], p.question_tokens[1] + 1, arrival.size)
    return Trace(arrival, klass, branch, q)


# ------------------------------------------------------------------ workers
@dataclass(slots=True)
class Job:
    rid: int
    klass: int
    arrival: float
    uncached: int
    cached: int
    pred_s: float
    decision_id: int = 0
    start: float = 0.0


@dataclass(slots=True)
class Worker:
    """One prefill engine: a single-server queue and a prefix cache of
    segments (0 = common prefix, its children = branches)."""

    cap: int
    cache: dict[int, float] = field(default_factory=dict)        # segment -> last use
    used: int = 0
    reuse: dict[int, tuple[float, float]] = field(default_factory=dict)  # segment -> (decayed hits, t)
    queue: list[Job] = field(default_factory=list)
    qwork: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    rate: list[tuple[float, float]] = field(default_factory=lambda: [(0.0, 0.0)] * 3)  # decayed work, t
    current: Job | None = None
    cur_end_pred: float = 0.0
    fair: ClassFairness | None = None


class Sim:
    def __init__(self, p: Params, policy: str, trace: Trace, seed: int) -> None:
        self.p, self.policy, self.tr = p, policy, trace
        self.rng = np.random.default_rng(seed + 7919)
        self.now = 0.0
        self.seg_tokens = {0: p.common_tokens, 1: p.tool_tokens}
        for k in range(p.customers):
            self.seg_tokens[2 + k] = p.instr_tokens
        self.workers = [Worker(p.cache_tokens) for _ in range(p.workers)]
        for w in self.workers:
            w.cache[0] = 0.0
            w.used = p.common_tokens
        loads = list(DEFAULT_TIER_LOADS)
        loads[int(TierKind.HBM)] = TierLoad(1e15, 0.0)  # the worker's own GPU cache: no load
        pcfg = PredictorConfig(prefill_tokens_per_s=p.predictor_tps0, prefill_overhead_s=p.overhead_s,
                               attention_s_per_token2=p.attention_s, tier_loads=tuple(loads),  # type: ignore[arg-type]
                               queue_parallelism=float(p.workers))
        self.pred = TTFTPredictor(pcfg, clock=lambda: self.now)
        self.ctl: AdmissionController | None = None
        if policy == "cost+adm-nofair":
            self.ctl = AdmissionController(self.pred, AdmissionConfig(headroom=p.headroom))
        if policy == "cost+adm":
            shares = {c: 1.0 / 3 for c in range(3)}
            fair = ClassFairness(lambda: self.now, shares, window_s=10.0, min_samples=20)
            self.ctl = AdmissionController(self.pred, AdmissionConfig(headroom=p.headroom,
                                                                      fairness_headroom=p.fairness_headroom),
                                           fairness=fair)
            for w in self.workers:
                w.fair = ClassFairness(lambda: self.now, shares, window_s=10.0, min_samples=10)
        n = trace.arrival.size
        self.ttft = np.full(n, np.nan)
        self.rejected = np.zeros(n, dtype=bool)
        self.pred_err: list[float] = []
        self.rr = 0
        self.events: list[tuple[float, int, int]] = []  # (time, seq, worker) completions
        self.seq = 0
        self.cached_tokens = 0
        self.total_tokens = 0

    # ----------------------------------------------------------- model
    def true_prefill(self, u: int, c: int) -> float:
        p = self.p
        base = p.overhead_s + u / p.tokens_per_s + p.attention_s * u * (c + u / 2.0)
        return base * float(self.rng.lognormal(0.0, p.jitter_sigma))

    def path(self, i: int) -> list[int]:
        b = int(self.tr.branch[i])
        return [0] if b == 0 else [0, b]

    def hit(self, w: Worker, path: list[int]) -> tuple[int, list[int]]:
        """Cached prefix tokens of ``path`` on ``w`` and the segments it lacks."""
        got = 0
        for j, s in enumerate(path):
            if s not in w.cache:
                return got, path[j:]
            got += self.seg_tokens[s]
        return got, []

    def reuse_rate(self, w: Worker, s: int) -> float:
        v, t = w.reuse.get(s, (0.0, self.now))
        return v * math.exp(-(self.now - t) / self.p.reuse_horizon_s) / self.p.reuse_horizon_s

    def victims(self, w: Worker, need: int, keep: list[int]) -> list[int]:
        """LRU leaves to evict to make ``need`` tokens of room (never the
        common prefix while a branch is cached; never a segment in ``keep``)."""
        room = w.cap - w.used
        if room >= need:
            return []
        out = []
        for s, _ in sorted(w.cache.items(), key=lambda x: x[1]):
            if s == 0 or s in keep:
                continue
            out.append(s)
            room += self.seg_tokens[s]
            if room >= need:
                return out
        return out  # not enough: the insert is skipped

    def eviction_cost(self, w: Worker, missing: list[int], keep: list[int]) -> float:
        need = sum(self.seg_tokens[s] for s in missing)
        cost = 0.0
        for s in self.victims(w, need, keep):
            cost += self.seg_tokens[s] / self.pred.prefill_tokens_per_s * min(1.0, self.reuse_rate(w, s))
        return cost

    def insert(self, w: Worker, path: list[int]) -> None:
        for s in path:
            if s in w.cache:
                w.cache[s] = self.now
                v, t = w.reuse.get(s, (0.0, self.now))
                w.reuse[s] = (v * math.exp(-(self.now - t) / self.p.reuse_horizon_s) + 1.0, self.now)
        _, missing = self.hit(w, path)
        need = sum(self.seg_tokens[s] for s in missing)
        vic = self.victims(w, need, path)
        if w.cap - w.used + sum(self.seg_tokens[s] for s in vic) < need:
            return
        for s in vic:
            del w.cache[s]
            w.used -= self.seg_tokens[s]
        for s in missing:
            w.cache[s] = self.now
            w.used += self.seg_tokens[s]

    def load(self, w: Worker) -> float:
        """Predicted seconds of work ahead of a new FIFO arrival."""
        rem = max(w.cur_end_pred - self.now, 0.0) if w.current is not None else 0.0
        return max(rem + sum(w.qwork), 0.0)

    def load_for(self, w: Worker, k: int) -> float:
        """Like :meth:`load`, for class ``k`` under the local fairness queue:
        a class under its quota waits only for work of classes at least as far under theirs."""
        if w.fair is None:
            return self.load(w)
        rem = max(w.cur_end_pred - self.now, 0.0) if w.current is not None else 0.0
        g = w.fair.quota_gap(k)
        ahead = [j for j in range(3) if j == k or w.fair.quota_gap(j) >= max(g, 0.0)]
        backlog = max(rem + sum(w.qwork[j] for j in ahead) if g > 0 else rem + sum(w.qwork), 0.0)
        # work of classes served before k keeps arriving while k waits
        rho = sum(self.work_rate(w, j) for j in range(3) if j != k and w.fair.quota_gap(j) > max(g, 0.0))
        return backlog / (1.0 - min(rho, 0.8))

    def work_rate(self, w: Worker, k: int) -> float:
        """Seconds of predicted work per second arriving at ``w`` for class ``k``."""
        v, t = w.rate[k]
        return v * math.exp(-(self.now - t) / RATE_TAU_S) / RATE_TAU_S

    # ----------------------------------------------------------- placement
    def place(self, i: int, n: int, path: list[int]) -> tuple[int, int]:
        """(worker, cached tokens) for request ``i`` under this policy."""
        ws = self.workers
        if self.policy == "rr":
            self.rr = (self.rr + 1) % len(ws)
            return self.rr, 0
        hits = [self.hit(w, path) for w in ws]
        loads = [self.load(w) for w in ws]
        best = max(h for h, _ in hits)
        holders = [j for j in range(len(ws)) if hits[j][0] == best]
        star = min(holders, key=lambda j: (loads[j], j))
        if self.policy == "lpm":
            return star, best
        pre = [self.pred.prefill_s(n - hits[j][0], hits[j][0]) for j in range(len(ws))]
        if best > n / 2:  # exploit, unless queueing at the holder costs more than recomputing elsewhere
            light = min(range(len(ws)), key=lambda j: (loads[j], j))
            if loads[star] - loads[light] <= pre[light]:
                return star, best
        costs = [loads[j] + pre[j] + self.eviction_cost(ws[j], hits[j][1], path) for j in range(len(ws))]
        j = min(range(len(ws)), key=lambda x: (costs[x], x))
        return j, hits[j][0]

    # ----------------------------------------------------------- events
    def start_next(self, wi: int) -> None:
        w = self.workers[wi]
        if w.current is not None or not w.queue:
            return
        pos = w.fair.pick([j.klass for j in w.queue]) if w.fair is not None else 0
        job = w.queue.pop(pos)
        w.qwork[job.klass] -= job.pred_s
        if w.fair is not None:
            w.fair.note_grant(job.klass)
        job.start = self.now
        dur = self.true_prefill(job.uncached, job.cached)
        w.current = job
        w.cur_end_pred = self.now + job.pred_s
        self.seq += 1
        heapq.heappush(self.events, (self.now + dur, self.seq, wi))

    def complete(self, wi: int) -> None:
        w = self.workers[wi]
        job = w.current
        assert job is not None
        w.current = None
        ttft = self.now - job.arrival
        self.ttft[job.rid] = ttft
        if self.policy.startswith("cost"):
            queue_s = job.start - job.arrival
            if self.ctl is not None and job.decision_id:
                err = self.ctl.report(job.decision_id, ttft, actual_queue_s=queue_s)
                if err is not None:
                    self.pred_err.append(err)
            else:
                self.pred.report(queue_s + job.pred_s, ttft, job.uncached, actual_queue_s=queue_s)
        self.start_next(wi)

    def arrive(self, i: int) -> None:
        p, tr = self.p, self.tr
        path = self.path(i)
        k = int(tr.klass[i])
        n = sum(self.seg_tokens[s] for s in path) + int(tr.question[i])
        wi, cached = self.place(i, n, path)
        w = self.workers[wi]
        did = 0
        if self.ctl is not None:
            d = self.ctl.decide("default", n, {TierKind.HBM: cached // p.block_tokens}, p.block_tokens,
                                p.block_tokens * p.kv_bytes_per_token, p.target_s,
                                queue_wait_s=self.load_for(w, k), klass=k)
            if not d.admitted:
                self.rejected[i] = True
                return
            did = d.decision_id
        self.total_tokens += n
        self.cached_tokens += cached
        if self.policy != "rr":
            self.insert(w, path)
        pred = self.pred.prefill_s(n - cached, cached)
        job = Job(i, k, float(tr.arrival[i]), n - cached, cached, pred, did)
        w.queue.append(job)
        w.qwork[k] += pred
        v, t = w.rate[k]
        w.rate[k] = (v * math.exp(-(self.now - t) / RATE_TAU_S) + pred, self.now)
        if w.fair is not None:
            w.fair.note_arrival(k)
        self.start_next(wi)

    def run(self) -> None:
        arr = self.tr.arrival
        i, n = 0, arr.size
        while i < n or self.events:
            if self.events and (i >= n or self.events[0][0] <= arr[i]):
                t, _, wi = heapq.heappop(self.events)
                self.now = t
                self.complete(wi)
            else:
                self.now = float(arr[i])
                self.arrive(i)
                i += 1


# ------------------------------------------------------------------ figures
def jain(x: list[float]) -> float:
    a = np.asarray(x, dtype=np.float64)
    s = float((a * a).sum())
    return float(a.sum() ** 2 / (a.size * s)) if s > 0 else 1.0


@dataclass(slots=True)
class Result:
    ttft: dict[int, list[float]] = field(default_factory=lambda: {0: [], 1: [], 2: []})
    offered: list[int] = field(default_factory=lambda: [0, 0, 0])
    rejected: list[int] = field(default_factory=lambda: [0, 0, 0])
    met: list[int] = field(default_factory=lambda: [0, 0, 0])
    duration: float = 0.0
    err: list[float] = field(default_factory=list)
    hit_tokens: int = 0
    total_tokens: int = 0
    tps_final: list[float] = field(default_factory=list)


def simulate(p: Params, seeds: list[int]) -> dict[str, Result]:
    out = {pol: Result() for pol in POLICIES}
    for seed in seeds:
        tr = make_trace(p, seed)
        for pol in POLICIES:
            sim = Sim(p, pol, tr, seed)
            sim.run()
            r = out[pol]
            r.duration += p.duration_s
            for k in range(3):
                m = tr.klass == k
                served = m & ~sim.rejected
                t = sim.ttft[served]
                r.ttft[k].extend(t.tolist())
                r.offered[k] += int(m.sum())
                r.rejected[k] += int((m & sim.rejected).sum())
                r.met[k] += int((t <= p.target_s).sum())
            r.err.extend(sim.pred_err)
            r.hit_tokens += sim.cached_tokens
            r.total_tokens += sim.total_tokens
            r.tps_final.append(sim.pred.prefill_tokens_per_s)
    return out


def report(p: Params, res: dict[str, Result], seeds: list[int], wall_s: float) -> Report:
    rep = Report("admission")
    tag = {"rr": "rr", "lpm": "lpm", "cost": "cost", "cost+adm": "cost_adm", "cost+adm-nofair": "cost_adm_nofair"}
    rows = []
    goodput: dict[str, float] = {}
    for pol in POLICIES:
        r = res[pol]
        att_off = []
        for k, c in enumerate(CLASSES):
            t = r.ttft[k]
            served = len(t)
            att_adm = r.met[k] / served if served else 0.0
            att_off.append(r.met[k] / r.offered[k] if r.offered[k] else 0.0)
            p50, p95, p99 = (percentile(t, q) * 1e3 for q in (50, 95, 99))
            rows.append((pol, c, r.offered[k], r.rejected[k], p50, p95, p99, att_adm, att_off[-1]))
            pre = f"{tag[pol]}.{c}"
            rep.figure(f"{pre}.ttft_p50", p50, "ms")
            rep.figure(f"{pre}.ttft_p95", p95, "ms")
            rep.figure(f"{pre}.ttft_p99", p99, "ms")
            rep.figure(f"{pre}.attainment_admitted", att_adm, "")
            rep.figure(f"{pre}.attainment_offered", att_off[-1], "")
            rep.figure(f"{pre}.rejected", r.rejected[k], "req")
        goodput[pol] = sum(r.met) / r.duration
        rep.figure(f"{tag[pol]}.goodput", goodput[pol], "req/s")
        rep.figure(f"{tag[pol]}.jain_fairness", jain(att_off), "")
        rep.figure(f"{tag[pol]}.min_attainment_offered", min(att_off), "")
        rep.figure(f"{tag[pol]}.min_attainment_admitted",
                   min((r.met[k] / len(r.ttft[k])) if r.ttft[k] else 0.0 for k in range(3)), "")
        served_all = sum(len(r.ttft[k]) for k in range(3))
        rep.figure(f"{tag[pol]}.attainment_admitted", sum(r.met) / served_all if served_all else 0.0, "")
        rep.figure(f"{tag[pol]}.attainment_all_arrivals", sum(r.met) / max(sum(r.offered), 1), "")
        rep.figure(f"{tag[pol]}.rejected_fraction", sum(r.rejected) / max(sum(r.offered), 1), "")
        rep.figure(f"{tag[pol]}.cache_hit_tokens", r.hit_tokens / max(r.total_tokens, 1), "")
    adm = res["cost+adm"]
    e = np.abs(np.asarray(adm.err)) * 1e3
    if e.size:
        rep.figure("cost_adm.pred_abs_err_p50", float(np.percentile(e, 50)), "ms")
        rep.figure("cost_adm.pred_abs_err_p95", float(np.percentile(e, 95)), "ms")
    rep.figure("cost_adm.calibrated_tokens_per_s", float(np.median(adm.tps_final)), "tok/s")
    rep.figure("params.ttft_target", p.target_s * 1e3, "ms")
    rep.figure("params.prefill_tokens_per_s", p.tokens_per_s, "tok/s")
    rep.figure("params.workers", p.workers, "")
    rep.figure("params.offered_rate", sum(res["rr"].offered) / res["rr"].duration, "req/s")
    rep.figure("params.seeds", len(seeds), "")
    rep.figure("params.sim_seconds_per_seed", p.duration_s, "s")
    rep.figure("wall_seconds", wall_s, "s")
    others = max(goodput[x] for x in COMPARED)
    rep.target("goodput cost+adm / best other policy", goodput["cost+adm"] / others if others else math.inf, 1.0)
    rep.target("min class attainment among admitted (cost+adm)",
               rep.figures["cost_adm.min_attainment_admitted"], 0.90)
    rep.target("min class attainment over all arrivals, rejections as misses (cost+adm)",
               rep.figures["cost_adm.min_attainment_offered"], 0.90)

    print(f"# admission scenario: {p.workers} workers x {p.tokens_per_s:,.0f} tok/s prefill "
          f"(+{p.overhead_s * 1e3:.0f} ms/request, attention {p.attention_s:g} s/token^2), cache "
          f"{p.cache_tokens:,} tokens/worker, TTFT target {p.target_s * 1e3:.0f} ms; A {p.rate_a:g} req/s "
          f"(x{p.burst_factor:g} for {p.burst_s:g} s every {p.burst_period_s:g} s), B {p.rate_b:g}, "
          f"C {p.rate_c:g}; {len(seeds)} seed(s) x {p.duration_s:g} s")
    print(f"| {'policy':15} | cls | offered | rejected |  p50 ms |  p95 ms |  p99 ms | SLO adm | SLO off |")
    print(f"|{'-' * 17}|-----|---------|----------|---------|---------|---------|---------|---------|")
    for pol, c, off, rj, p50, p95, p99, aa, ao in rows:
        print(f"| {pol:15} | {c:3} | {off:7d} | {rj:8d} | {p50:7.0f} | {p95:7.0f} | {p99:7.0f} | "
              f"{aa:7.1%} | {ao:7.1%} |")
    print()
    print("SLO adm: attainment among admitted (served) requests; SLO off: over all offered requests (arrivals),"
          " a rejection counting as a miss")
    print()
    print(f"| {'policy':15} | goodput req/s | SLO adm (all) | SLO off (all) | rejected | Jain (SLO off) | hit tokens |")
    print(f"|{'-' * 17}|---------------|---------------|---------------|----------|----------------|------------|")
    for pol in POLICIES:
        f = rep.figures
        print(f"| {pol:15} | {goodput[pol]:13.1f} | {f[tag[pol] + '.attainment_admitted']:13.1%} | "
              f"{f[tag[pol] + '.attainment_all_arrivals']:13.1%} | {f[tag[pol] + '.rejected_fraction']:8.1%} | "
              f"{f[tag[pol] + '.jain_fairness']:14.3f} | {f[tag[pol] + '.cache_hit_tokens']:10.1%} |")
    print()
    return rep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller run, a few seconds")
    ap.add_argument("--json", metavar="PATH", help="write figures and targets as JSON")
    ap.add_argument("--seeds", type=int, default=0, help="traces to simulate (default 3, --quick 1)")
    ap.add_argument("--duration", type=float, default=0.0, help="simulated seconds per trace")
    a = ap.parse_args(argv)
    seeds = list(range(a.seeds or (1 if a.quick else 3)))
    p = Params(duration_s=a.duration or (30.0 if a.quick else 120.0))
    t0 = time.perf_counter()
    res = simulate(p, seeds)
    rep = report(p, res, seeds, time.perf_counter() - t0)
    rep.emit(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
