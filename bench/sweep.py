"""Eviction policy sweep (issue 9). Not a test: it reports numbers.

For every trace kind of ``bench/workloads.py`` (chat, shared_prompt, agent,
docqa, mix) x three DRAM capacities (``--fractions`` of the trace's live
peak: the capacity at which Bélády reaches an unbounded cache's hit ratio) x
the policies ``lru``, ``lfu``, ``cost``, it replays the trace through an
in-process ``TieredStore`` (``kvstore.tools.replay``) and computes, for the same
trace and capacity, Bélády's hit ratio (``belady``: store every missing
block, evict the block used furthest ahead) and MIN's (``belady_min``: also
decline to store blocks used furthest ahead: optimal admission). With an SSD
tier in this build, each policy also runs with an SSD of ``--ssd-multiple``
x the DRAM capacity, SSD write admission on (the store's default rule) and
off (every demoted block written); those compare with Bélády at DRAM + SSD
blocks. A build without SSD support reports those rows as skipped.

Each policy also runs with the store's DRAM admission filter
(``lru+adm``, ``lfu+adm``, ``cost+adm``: ``StoreConfig.dram_admission``, a
new block is stored only if it was looked up at least as often as the block
it would evict). Analysis (``--analyze``, on by default): at the middle
capacity of the shared_prompt and agent traces it also runs an oracle that
ranks blocks by how often the *whole trace* uses them (no online policy
knows this: a bound for frequency-based ranking), and prints the hits of
each run split by how often the hit block is used in the trace.

Output: the table (benchlib.Report; every hit ratio is a figure), the
targets, a plot of hit ratio against capacity per policy and trace
(``--plot``, PNG, needs matplotlib: ``pip install -e .[bench]``; skipped
with a note otherwise) and the raw numbers (``--raw``, JSON).

Bounds: each run is compared with the optimum for what it is allowed to do
(``over_bound`` figures, the table's brackets). A run that stores every
missing block (no admission) is compared with Bélády; a run that may decline
to store blocks (DRAM admission ``+adm``; with an SSD, SSD write admission
``admit-on``) with ``belady_min`` (MIN: Bélády allowed to bypass, the
optimum for a cache that may decline), at the same total capacity. Plain
Bélády is beaten by admission (it must store everything), so it is no bound
for those runs. (``over_belady`` figures keep the ratio to plain Bélády of
every run, for reference.)

Targets (issue 9), computed from this run: ``cost`` with DRAM admission /
MIN (``belady_min``) >= 0.9 on shared_prompt and agent at the middle
capacity (``cost`` without admission / Bélády as a figure); for every trace
and capacity, every other policy reaches at least 0.99 x lru's hit ratio
(cases below are listed with the hit breakdown that explains them).

``--from-raw PATH`` redoes the table and plot from the raw file of an
earlier run, replaying nothing: its output says so, with the time that run
wrote the file; the JSON's name says so too and its figures include
``from_raw`` = 1 and ``raw_written_unix``.

Sizes: by default the traces run at ``scale`` 0.25 of the generators'
defaults with 16-token blocks, SSD rows for ``cost`` at every capacity
(about 6 minutes on 2 cores). ``--quick``: scale 0.15 (agent 0.25), 64-token
blocks (4x fewer blocks), SSD rows at the middle capacity only (under a minute). Replays run in
``--jobs`` processes; hit ratios do not depend on timing.

Usage: python bench/sweep.py [--quick] [--json PATH] [--raw PATH] [--plot PATH]
       [--jobs N] [--kinds chat,agent] [--fractions 0.1,0.25,0.5] [--seed N]
       [--scale X] [--block-size N] [--ssd-multiple 4] [--ssd-policies cost,lru]
       [--from-raw PATH]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import signal
import sys
import time
from functools import lru_cache
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from benchlib import Report  # noqa: E402

from kvstore.tools import replay as R  # noqa: E402
from kvstore.core.eviction import PolicyName  # noqa: E402
from kvstore.core.index import BlockIndex  # noqa: E402

KINDS = ("chat", "shared_prompt", "agent", "docqa", "mix")
POLICIES = ("lru", "lfu", "cost")
ADMIT = "+adm"
"""Suffix of a policy run with the store's DRAM admission filter."""
STORE_LABELS = POLICIES + tuple(p + ADMIT for p in POLICIES)
FRACTIONS = (0.1, 0.25, 0.5)
TARGET_KINDS = ("shared_prompt", "agent")
FULL_SCALE = 0.25
QUICK_SCALE = 0.15
QUICK_SCALE_OF = {"agent": 0.25}
"""--quick trace scales that differ from QUICK_SCALE (agent needs enough tasks)."""
QUICK_BLOCK_SIZE = 64
REUSE_CLASSES = ((1, 1, "used once"), (2, 3, "2-3 uses"), (4, 15, "4-15 uses"), (16, 1 << 62, "16+ uses"))
WORSE_TOLERANCE = 0.99


# ------------------------------------------------------------ prototypes
class OracleFrequency:
    """Ranks a block by how many requests of the whole trace use it (known
    only offline): the bound for a frequency-based ranking."""

    name = PolicyName.LFU
    columns = frozenset({"prio"})

    def __init__(self, counts: dict[tuple[int, int], int]) -> None:
        self.counts = counts

    def on_insert(self, index: BlockIndex, rows: np.ndarray) -> None:
        c = self.counts
        index.prio[rows] = [c.get((a, b), 0) for a, b in zip(index.k0[rows].tolist(), index.k1[rows].tolist())]

    def on_access(self, index: BlockIndex, rows: np.ndarray) -> None:
        pass

    def rank(self, index: BlockIndex, rows: np.ndarray) -> np.ndarray:
        return index.prio[rows]

    def on_evict(self, index: BlockIndex, rows: np.ndarray) -> None:
        pass


# --------------------------------------------------------------- workers
@lru_cache(maxsize=4)
def _trace(kind: str, seed: int, scale: float, block_size: int) -> R.PreparedTrace:
    from kvstore.tools import workloads as W

    p = W.params_for(kind, W.parse_params(kind, {"scale": scale}))
    return R.prepare(W.make_trace(kind, seed, p), block_size, name=kind)


def _reuse_breakdown(pt: R.PreparedTrace, hits: np.ndarray) -> dict[str, int]:
    """Hit blocks split by how many times the trace uses the block."""
    counts = np.bincount(pt.ids)
    per = np.diff(pt.offsets)
    depth = np.arange(pt.blocks) - np.repeat(pt.offsets[:-1], per)
    hit = depth < np.repeat(hits, per)
    uses = counts[pt.ids[hit]]
    return {name: int(((uses >= lo) & (uses <= hi)).sum()) for lo, hi, name in REUSE_CLASSES}


def run_task(task: dict[str, Any]) -> dict[str, Any]:
    """One replay or optimum (runs in a worker process)."""
    pt = _trace(task["kind"], task["seed"], task["scale"], task["bs"])
    cap, what = task["cap"], task["what"]
    extra: dict[str, Any] = {}
    if what in ("belady", "belady_min"):
        res = R.belady(pt, cap, bypass=what == "belady_min")
    else:
        policy: Any = task["policy"]
        label = None
        adm = policy.endswith(ADMIT)
        if adm:
            policy, label = policy[: -len(ADMIT)], policy
        if what == "oracle":
            counts = np.bincount(pt.ids)[pt.ids]
            k = pt.keys
            table = dict(zip(zip(k[:, 0].tolist(), k[:, 1].tolist()), counts.tolist()))
            policy, label = OracleFrequency(table), "oracle-frequency"
        res = R.replay(pt, policy, cap, ssd_blocks=task.get("ssd", 0), ssd_admission=task.get("admission", "on"),
                       label=label, dram_admission=adm)
    out = res.to_dict()
    out.update(task)
    out.update(extra)
    out["by_reuse"] = _reuse_breakdown(pt, res.request_hits) if res.request_hits is not None else {}
    out["live_peak"] = pt.live_peak()
    return out


# --------------------------------------------------------------- the sweep
def plan(kinds: list[str], fractions: list[float], seed: int, scale: float | dict[str, float], bs: int,
         ssd_multiple: float,
         ssd_policies: list[str], ssd_middle_only: bool, analyze: bool) -> list[dict[str, Any]]:
    """Every replay and optimum of the sweep, as task dicts for run_task."""
    tasks: list[dict[str, Any]] = []
    ssd_ok = R.ssd_supported() is not None
    for kind in kinds:
        ks = scale if isinstance(scale, float) else scale[kind]
        pt = _trace(kind, seed, ks, bs)
        caps = R.capacity_levels(pt, fractions)
        for level, cap in enumerate(caps):
            common = dict(kind=kind, seed=seed, scale=ks, bs=bs, cap=cap, level=level, fraction=fractions[level])
            tasks.append(dict(common, what="belady", policy="belady"))
            tasks.append(dict(common, what="belady_min", policy="belady_min"))
            ssd_here = ssd_ok and ssd_multiple > 0 and (not ssd_middle_only or level == len(caps) // 2)
            for pol in POLICIES:
                tasks.append(dict(common, what="store", policy=pol))
                tasks.append(dict(common, what="store", policy=pol + ADMIT))
                if ssd_here and pol in ssd_policies:
                    ssd = int(round(cap * ssd_multiple))
                    for adm in ("on", "off"):
                        tasks.append(dict(common, what="store", policy=pol, ssd=ssd, admission=adm))
                        tasks.append(dict(common, what="belady", policy="belady", cap=cap + ssd, dram_cap=cap))
                    # SSD write admission declines blocks too: its bound is MIN at DRAM + SSD
                    tasks.append(dict(common, what="belady_min", policy="belady_min", cap=cap + ssd, dram_cap=cap))
            if analyze and kind in TARGET_KINDS and level == len(caps) // 2:
                tasks.append(dict(common, what="oracle", policy="cost"))
    # one Bélády per distinct (kind, capacity)
    seen: set[tuple[str, int, str]] = set()
    out = []
    for t in tasks:
        key = (t["kind"], t["cap"], t["what"])
        if t["what"].startswith("belady"):
            if key in seen:
                continue
            seen.add(key)
        out.append(t)
    # the slowest first, so two workers finish together
    out.sort(key=lambda t: (t["what"].startswith("belady"), t.get("ssd", 0) == 0, t["level"],
                            -_trace(t["kind"], seed, t["scale"], bs).blocks))
    return out


def _worker_init() -> None:
    """SIGTERM ends a worker through SystemExit, so each store's ``close``
    runs and its shared-memory slab is unlinked."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def run_all(tasks: list[dict[str, Any]], jobs: int) -> list[dict[str, Any]]:
    """Every task, ``jobs`` processes at a time; progress on stderr."""
    t0 = time.perf_counter()

    def done(i: int, r: dict[str, Any]) -> None:
        print(f"[{i}/{len(tasks)} {time.perf_counter() - t0:.0f}s] {r['kind']} {_key(r)} @{r['capacity_blocks']}: "
              f"{r['block_hit_ratio']:.4f} ({r['seconds']:.1f}s)", file=sys.stderr, flush=True)

    if jobs <= 1:
        out = []
        for i, t in enumerate(tasks, 1):
            out.append(run_task(t))
            done(i, out[-1])
        return out
    ctx = multiprocessing.get_context("spawn")
    ex = cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_worker_init)
    futs = [ex.submit(run_task, t) for t in tasks]
    try:
        for i, f in enumerate(cf.as_completed(futs), 1):
            done(i, f.result())
        return [f.result() for f in futs]
    except BaseException:
        # stop the workers: SIGTERM makes the running replay close its store
        for f in futs:
            f.cancel()
        for p in list(getattr(ex, "_processes", {}).values()):
            p.terminate()
        raise
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def _key(r: dict[str, Any]) -> str:
    if r["what"] == "store":
        return r["policy"] + (f"+ssd/admit-{r['admission']}" if r.get("ssd") and r.get("ssd_blocks") else "")
    if r["what"] == "oracle":
        return "oracle-freq"
    return r["what"]


Cells = dict[tuple[str, int], dict[str, dict[str, Any]]]
"""(trace kind, capacity level) -> result label -> result."""


def declines(r: dict[str, Any]) -> bool:
    """Whether a run may decline to store a block: DRAM admission on, or an
    SSD tier with write admission on. Its bound is MIN, not Bélády."""
    return bool(r.get("dram_admission") or str(r.get("policy", "")).endswith(ADMIT)
                or (r.get("ssd_blocks") and r.get("admission", "on") == "on"))


def bound_of(r: dict[str, Any], opt: dict[tuple[str, int, str], dict[str, Any]]) -> tuple[str, float | None]:
    """(bound name, its block hit ratio) for a run at its total capacity
    (DRAM + SSD): ``belady_min`` for a run that may decline to store, else
    ``belady``; None when this run's results lack it (an old raw file)."""
    total = r["capacity_blocks"] + (r.get("ssd_blocks") or 0)
    what = "belady_min" if declines(r) else "belady"
    o = opt.get((r["kind"], total, what))
    return what, (o["block_hit_ratio"] if o else None)


def analyse(results: list[dict[str, Any]], rep: Report, kinds: list[str]) -> tuple[Cells, list[str]]:
    """Figures, targets and the explanation lines."""
    notes: list[str] = []
    cells: Cells = {}
    opt: dict[tuple[str, int], dict[str, Any]] = {}
    for r in results:
        if r["what"] in ("belady", "belady_min"):
            opt[(r["kind"], r["cap"])] = opt.get((r["kind"], r["cap"]), {})
            opt[(r["kind"], r["cap"])][r["what"]] = r
            continue
        cells.setdefault((r["kind"], r["level"]), {})[_key(r)] = r
    for (kind, level), row in sorted(cells.items(), key=lambda kv: (kinds.index(kv[0][0]), kv[0][1])):
        any_r = next(iter(row.values()))
        cap = any_r["cap"]
        b = opt[(kind, cap)]["belady"]
        m = opt[(kind, cap)].get("belady_min")
        tag = f"{kind}.c{level}"
        rep.figure(f"{tag}.capacity_blocks", cap, "blocks")
        rep.figure(f"{tag}.belady.block_hit", b["block_hit_ratio"], "ratio")
        if m:
            rep.figure(f"{tag}.belady_min.block_hit", m["block_hit_ratio"], "ratio")
        flat_opt = {(k, c, w): x for (k, c), ws in opt.items() for w, x in ws.items()}
        for name, r in row.items():
            total = r["capacity_blocks"] + (r.get("ssd_blocks") or 0)
            ref = opt.get((kind, total), {}).get("belady", b)
            rep.figure(f"{tag}.{name}.block_hit", r["block_hit_ratio"], "ratio")
            rep.figure(f"{tag}.{name}.over_belady", r["block_hit_ratio"] / max(ref["block_hit_ratio"], 1e-12), "x")
            bname, bval = bound_of(r, flat_opt)
            if bval is not None:
                rep.figure(f"{tag}.{name}.over_bound", r["block_hit_ratio"] / max(bval, 1e-12), f"x {bname}")
            else:
                notes.append(f"{kind} c{level} {name}: no {bname} at {total} blocks in these results")
            if r.get("ssd_blocks"):
                rep.figure(f"{tag}.{name}.ssd_hits", r["tier_hits"].get("ssd", 0), "blocks")
                rep.figure(f"{tag}.{name}.ssd_written", r["ssd_bytes_written"] or 0, "bytes")
            if r.get("skipped"):
                notes.append(f"{kind} c{level} {name}: {r['skipped']}")
        for n in sorted({n for r in row.values() for n in r.get("notes", [])}):
            notes.append(f"{kind} c{level}: {n}")
    # targets ---------------------------------------------------------
    for kind in TARGET_KINDS:
        levels = sorted(lv for k, lv in cells if k == kind)
        if not levels:
            continue
        mid = levels[len(levels) // 2]
        row = cells[(kind, mid)]
        if "cost" in row:
            rep.figure(f"{kind}.c{mid}.cost_no_admission.over_belady", rep.figures[f"{kind}.c{mid}.cost.over_belady"], "x")
        if "cost" + ADMIT in row:
            rep.target(f"cost (DRAM admission on) / belady_min (MIN), {kind}, middle capacity",
                       rep.figures.get(f"{kind}.c{mid}.cost{ADMIT}.over_bound"), 0.9)
    worst = (float("inf"), "")
    for (kind, level), row in cells.items():
        lru = row.get("lru")
        if not lru:
            continue
        for pol in STORE_LABELS[1:]:
            other = row.get(pol)
            if not other or lru["block_hit_ratio"] <= 0:
                continue
            ratio = other["block_hit_ratio"] / lru["block_hit_ratio"]
            if ratio < worst[0]:
                worst = (ratio, f"{pol} on {kind} c{level}")
            if ratio < WORSE_TOLERANCE:
                d = {k: other["by_reuse"].get(k, 0) - lru["by_reuse"].get(k, 0) for _, _, k in REUSE_CLASSES}
                notes.append(f"{pol} < lru on {kind} c{level}: {other['block_hit_ratio']:.4f} vs "
                             f"{lru['block_hit_ratio']:.4f} ({ratio:.3f}x); hit blocks {pol} - lru by how often the "
                             "trace uses the block: " + ", ".join(f"{k} {v:+d}" for k, v in d.items()))
    if worst[1]:
        rep.target(f"min over traces x capacities of any policy / lru hit ratio (worst: {worst[1]})", worst[0],
                   WORSE_TOLERANCE)
    # analysis --------------------------------------------------------
    for (kind, level), row in sorted(cells.items()):
        if "oracle-freq" not in row or "cost" not in row:
            continue
        b = opt[(kind, row["cost"]["cap"])]
        lines = [f"hits by how often the trace uses the block, {kind} c{level} ({row['cost']['cap']} blocks):"]
        for name in STORE_LABELS + ("oracle-freq",):
            x = row.get(name)
            if x:
                bname = "belady_min" if declines(x) and "belady_min" in b else "belady"
                ref = b[bname]["block_hit_ratio"]
                lines.append(f"  {name:<26} hit {x['block_hit_ratio']:.4f} = {x['block_hit_ratio'] / ref:.3f}"
                             f" x {bname}; hits by use count: " + ", ".join(f"{k} {v}" for k, v in x["by_reuse"].items()))
        for what in ("belady", "belady_min"):
            y = b.get(what)
            if y:
                lines.append(f"  {what:<26} hit {y['block_hit_ratio']:.4f}; hits by use count: "
                             + ", ".join(f"{k} {v}" for k, v in y["by_reuse"].items()))
        notes += lines
    return cells, notes


def plot(cells: Cells, results: list[dict[str, Any]], kinds: list[str],
         path: str, bs: int = 16, ssd_multiple: float = 4.0) -> str | None:
    """Hit ratio against capacity per policy, one panel per trace. Returns a
    note if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install -e .[bench])"
    opt = {(r["kind"], r["cap"], r["what"]): r for r in results if r["what"].startswith("belady")}
    ncols = 3
    nrows = -(-(len(kinds) + 1) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.0 * ncols, 3.8 * nrows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    styles = {"lru": ("tab:blue", "-o"), "lfu": ("tab:orange", "-s"), "cost": ("tab:green", "-^"),
              "lru+adm": ("tab:blue", "--o"), "lfu+adm": ("tab:orange", "--s"), "cost+adm": ("tab:green", "--^")}
    extra = {"cost+ssd/admit-on": ("tab:purple", "x", "cost + SSD (admission on)"),
             "cost+ssd/admit-off": ("tab:brown", "+", "cost + SSD (admission off)")}

    def series(kind: str, name: str) -> tuple[list[int], list[float]]:
        pts = sorted((row[name]["cap"], row[name]["block_hit_ratio"]) for (k, _), row in cells.items()
                     if k == kind and name in row)
        return [p[0] for p in pts], [p[1] for p in pts]

    for ax, kind in zip(flat, kinds):
        for name, (color, fmt) in styles.items():
            xs, ys = series(kind, name)
            if ys:
                ax.plot(xs, ys, fmt, color=color, label=name + (" (DRAM admission)" if name.endswith(ADMIT) else ""),
                        alpha=0.75 if name.endswith(ADMIT) else 1.0)
        for name, (color, marker, label) in extra.items():
            xs, ys = series(kind, name)
            if ys:
                ax.plot(xs, ys, marker, color=color, markersize=10 if marker == "*" else 8, linestyle="none",
                        label=label)
        caps = sorted({c for (k, c, _) in opt if k == kind and any(
            row.get("lru", {}).get("cap") == c for (kk, _), row in cells.items() if kk == kind)})
        for what, fmt, color, label in (("belady", "-", "black", "Bélády"), ("belady_min", ":", "gray", "MIN (bypass)")):
            pts = [(c, opt[(kind, c, what)]["block_hit_ratio"]) for c in caps if (kind, c, what) in opt]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], fmt, color=color, label=label)
        ax.set_xscale("log")
        ax.set_title(kind)
        ax.set_xlabel(f"DRAM capacity (blocks of {bs} tokens)")
        ax.set_ylabel("prefix hit ratio (blocks)")
        ax.set_ylim(0, 1)
        ax.grid(True, alpha=0.3)
    handles, labels = [], []
    for ax in flat[: len(kinds)]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    for ax in flat[len(kinds):]:
        ax.axis("off")
    flat[len(kinds)].legend(handles, labels, loc="center", fontsize=9,
                            title=f"SSD points: at DRAM capacity, SSD = {ssd_multiple:g}x DRAM")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"traces at scale {QUICK_SCALE} (agent 0.25), {QUICK_BLOCK_SIZE}-token blocks: under a minute")
    ap.add_argument("--json", metavar="PATH", help="figures and targets (benchlib format)")
    ap.add_argument("--raw", metavar="PATH", default=os.path.join(HERE, "out", "sweep.json"),
                    help="every result in full (default bench/out/sweep.json)")
    ap.add_argument("--plot", metavar="PATH", default=os.path.join(HERE, "out", "sweep.png"),
                    help="the PNG (default bench/out/sweep.png)")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--fractions", default=",".join(map(str, FRACTIONS)),
                    help="DRAM capacities as fractions of each trace's live peak")
    ap.add_argument("--scale", type=float, default=None,
                    help=f"trace scale (default {FULL_SCALE}, --quick {QUICK_SCALE}; 1 = the generators' defaults)")
    ap.add_argument("--block-size", type=int, default=None,
                    help=f"tokens per block (default 16, --quick {QUICK_BLOCK_SIZE})")
    ap.add_argument("--ssd-multiple", type=float, default=4.0, help="SSD size / DRAM size (0: no SSD rows)")
    ap.add_argument("--ssd-policies", default=None,
                    help="policies run with the SSD tier (default cost; --quick: cost at the middle capacity)")
    ap.add_argument("--no-analyze", action="store_true", help="skip the oracle runs")
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--from-raw", metavar="PATH", help="redo the table and plot from a --raw file, no replays")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # workers are stopped by the pool's shutdown
    kinds = [k for k in a.kinds.split(",") if k]
    fractions = [float(f) for f in a.fractions.split(",") if f]
    scale: float | dict[str, float] = a.scale if a.scale is not None else FULL_SCALE
    if a.quick and a.scale is None:
        scale = {k: QUICK_SCALE_OF.get(k, QUICK_SCALE) for k in kinds}
    bs = a.block_size or (QUICK_BLOCK_SIZE if a.quick else 16)
    ssd_pols = (a.ssd_policies or "cost").split(",")
    t0 = time.perf_counter()
    stale = ""
    raw_written = 0.0
    if a.from_raw:
        with open(a.from_raw) as f:
            raw = json.load(f)
        results, scale, bs = raw["results"], raw["scale"], raw["block_size"]
        kinds = [k for k in kinds if any(r["kind"] == k for r in results)]
        a.raw = None
        raw_written = float(raw.get("written_unix") or os.path.getmtime(a.from_raw))
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(raw_written))
        how = "" if raw.get("written_unix") else " (the file's modification time)"
        stale = (f"OLD FIGURES: redone from {a.from_raw}, written by an earlier run at {when}{how}, "
                 f"{(time.time() - raw_written) / 3600:.1f} h ago; nothing was replayed now")
        print(stale)
    else:
        tasks = plan(kinds, fractions, a.seed, scale, bs, a.ssd_multiple, ssd_pols,
                     a.quick and a.ssd_policies is None, not a.no_analyze)
        results = run_all(tasks, a.jobs)
    rep = Report("sweep" + (f" (from raw: figures of an earlier run, "
                            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(raw_written))})" if stale else ""))
    if stale:
        rep.figure("from_raw", 1, "bool")
        rep.figure("raw_written_unix", raw_written, "s")
    for k in kinds:
        rep.figure(f"{k}.scale", scale if isinstance(scale, float) else scale[k])
    rep.figure("block_size", bs, "tokens")
    if R.ssd_supported() is None and a.ssd_multiple > 0:
        rep.figure("ssd_rows_skipped", 1)
    cells, notes = analyse(results, rep, kinds)
    note = plot(cells, results, kinds, a.plot, bs, a.ssd_multiple)
    if note:
        notes.append(note)
    rep.figure("seconds", time.perf_counter() - t0, "s")
    print(summary(cells, results, kinds))
    print()
    rep.emit(a.json)
    print()
    for n in notes:
        print(n)
    if not note:
        print(f"plot: {a.plot}")
    if stale:
        print(stale)
    if a.raw:
        os.makedirs(os.path.dirname(os.path.abspath(a.raw)), exist_ok=True)
        with open(a.raw, "w") as f:
            json.dump({"scale": scale, "block_size": bs, "seed": a.seed, "fractions": fractions, "results": results,
                       "notes": notes, "written_unix": time.time(),
                       "written_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f, indent=1, default=float)
        print(f"raw: {a.raw}")
    return 0


def summary(cells: Cells, results: list[dict[str, Any]],
            kinds: list[str]) -> str:
    """The readable table: one row per trace x capacity, one column per policy
    (block hit ratio, and its ratio to the bound that fits it at the same
    total capacity: Bélády, or MIN for a run that may decline to store)."""
    opt = {(r["kind"], r["cap"], r["what"]): r for r in results if r["what"].startswith("belady")}
    cols = list(STORE_LABELS) + ["cost+ssd/admit-on", "cost+ssd/admit-off"]
    head = ["trace", "cap", "belady", "min"] + cols
    rows = [head]
    for (kind, level), row in sorted(cells.items(), key=lambda kv: (kinds.index(kv[0][0]), kv[0][1])):
        cap = next(iter(row.values()))["cap"]
        b = opt[(kind, cap, "belady")]["block_hit_ratio"]
        m = opt.get((kind, cap, "belady_min"), {}).get("block_hit_ratio", float("nan"))
        cells_txt = []
        for c in cols:
            r = row.get(c)
            if r is None:
                cells_txt.append("-")
                continue
            _, ref = bound_of(r, opt)
            cells_txt.append(f"{r['block_hit_ratio']:.3f} ({r['block_hit_ratio'] / ref:.2f})" if ref
                             else f"{r['block_hit_ratio']:.3f} (-)")
        rows.append([kind, str(cap), f"{b:.3f}", f"{m:.3f}"] + cells_txt)
    w = [max(len(r[i]) for r in rows) for i in range(len(head))]
    out = ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in rows]
    out.insert(1, "  ".join("-" * x for x in w))
    out.append("block hit ratio (in brackets: ratio to the bound that fits the run, at the same capacity: "
               "Bélády for a run that stores every block, MIN (belady_min) for one that may decline to store, "
               "i.e. +adm (DRAM admission on) and SSD admit-on; SSD columns: at DRAM + SSD blocks)")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
