"""HBM tier benchmark (issue 8). Not a test: it reports numbers.

With CUDA (all in one run, same bytes, medians of ``--repeats``):

- raw torch copies: pinned host -> device, device -> pinned host, device ->
  device (``Tensor.copy_`` of one buffer, synchronised);
- through the tier: ``HbmTier.write_masked`` (DRAM slab -> HBM, load stream,
  xxh3 of the source overlapped with the DMA) and ``HbmTier.read_into`` (HBM
  -> DRAM slab, store stream, xxh3 verified on the host) with the DRAM slab
  registered pinned (``cudaHostRegister``), in blocks of ``--block``;
- IPC between two processes, through kvstore's own data path: a daemon with
  an HBM tier runs in this process; a child process (the engine) connects
  with ``kvstore.client.Client``, maps the HBM slab (``Client.map_hbm``, CUDA
  IPC) and times, per round of fresh keys:
  - put = ``reserve(tier="hbm")`` + a device -> device ``copy_`` of each
    block from its own buffer into its slot + synchronize + ``commit``
    (without checksums: the daemon hashes the device bytes, as for an engine
    that cannot hash);
  - get = ``acquire(tier="hbm")`` + a ``copy_`` of each leased device view
    into its own buffer + synchronize + ``release``;
  each phase also timed on its own (figures), the bytes checked after the
  timing, beside a raw device -> device copy of the same blocks between two
  of the child's own buffers.

Targets: HBM<->DRAM through the tier >= 0.8x the raw pinned copy (each
direction); IPC through kvstore (put, get) >= 0.8x raw device-to-device.

Without CUDA the GPU rows are printed as SKIPPED and every GPU target is
written with value null, met false; ``--cpu`` adds rows that
run the tier on the host (``device="cpu"``): the logic overhead of the tier
(slot bookkeeping, checksums) against a plain ``numpy`` copy of the same
bytes, clearly labelled ``cpu_logic``. No GPU figure comes from them.

Usage: python bench/hbm.py [--quick] [--json PATH] [--cpu] [--repeats N] [--block BYTES]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from benchlib import Report  # noqa: E402

MIB = 1 << 20


def cuda_ok() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def med(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _setup(device: str, total: int, block: int) -> tuple[Any, Any, np.ndarray, list[np.ndarray]]:
    from tiers.dram import DramTier
    from tiers.hbm import HbmTier

    hbm = HbmTier(total, device=device, page_bytes=max(block, 16 * MIB))
    dram = DramTier(total, page_bytes=max(block, 16 * MIB))
    hbm.register_host(dram.buf)
    n = total // block
    hlocs = hbm.allocate(block, n)
    dlocs = dram.allocate(block, n)
    assert hlocs.size == n and dlocs.size == n, (hlocs.size, dlocs.size, n)
    rng = np.random.default_rng(0)
    dram.buf[: n * block] = rng.integers(0, 256, n * block, dtype=np.uint8)
    views = [dram.view(int(o), block) for o in dlocs.tolist()]
    return hbm, dram, hlocs, views


def bench_tier(rep: Report, device: str, total: int, block: int, repeats: int, prefix: str) -> dict[str, float]:
    """HBM<->DRAM through the tier on ``device``; returns GB/s by name."""
    hbm, dram, hlocs, views = _setup(device, total, block)
    try:
        n = hlocs.size
        nbytes = n * block
        csums = {}

        def put() -> None:
            c, ok = hbm.write_masked(hlocs, views)
            assert ok.all()
            csums["c"] = c

        t_put = med(put, repeats)
        sizes = np.full(n, block)

        def get() -> None:
            assert hbm.read_into(hlocs, sizes, csums["c"], views).all()

        t_get = med(get, repeats)
        out = {"h2d": nbytes / t_put / 1e9, "d2h": nbytes / t_get / 1e9}
        rep.figure(f"{prefix}_dram_to_hbm_GBps", out["h2d"], "GB/s")
        rep.figure(f"{prefix}_hbm_to_dram_GBps", out["d2h"], "GB/s")
        return out
    finally:
        hbm.close()
        dram.close()


def bench_raw_cuda(rep: Report, total: int, repeats: int) -> dict[str, float]:
    import torch

    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(total, dtype=torch.uint8, device="cuda")

    def run(dst: Any, src: Any) -> Callable[[], None]:
        def go() -> None:
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
        return go

    out = {"h2d": total / med(run(dev, host), repeats) / 1e9,
           "d2h": total / med(run(host, dev), repeats) / 1e9,
           "d2d": total / med(run(dev2, dev), repeats) / 1e9}
    rep.figure("raw_pinned_h2d_GBps", out["h2d"], "GB/s")
    rep.figure("raw_pinned_d2h_GBps", out["d2h"], "GB/s")
    rep.figure("raw_d2d_GBps", out["d2d"], "GB/s")
    return out


IPC_CHILD = r"""
import json, os, statistics, sys, time
import numpy as np
import torch
sys.path.insert(0, sys.argv[1])
from kvstore.client import Client
from kvstore.keys import Namespace, block_keys
from tiers.base import TierKind

target, size, block, repeats = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
ns = Namespace(tenant="bench", model_id="hbm-ipc", block_size=16)
n = size // block
c = Client(target, timeout=120)
c.map_hbm()
dev = c.hbm_regions[0].device
mine = torch.empty(n * block, dtype=torch.uint8, device=f"cuda:{dev}")
mine2 = torch.empty_like(mine)
mine.random_(0, 255)
sl = lambda t, i: t[i * block:(i + 1) * block]
rng = np.random.default_rng(0)
phase = {k: [] for k in ("reserve", "copy_in", "commit", "acquire", "copy_out", "release")}
put_s, get_s, raw_s = [], [], []
in_hbm = hit = equal = rounds = 0

def dst_of(off, ln, tier):  # a slot the daemon gave: HBM (device) or DRAM (shared memory)
    return c.hbm_view(off, ln) if tier is TierKind.HBM else torch.from_numpy(c.view(off, ln))

for r in range(repeats + 1):  # the first round warms up
    keys = block_keys(ns, rng.integers(0, 50000, size=n * 16))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = c.reserve(ns, keys, block, tier="hbm")
    t1 = time.perf_counter()
    for i, (off, ln, tier) in enumerate(zip(res.offsets, res.lengths, res.tiers)):
        dst_of(off, ln, tier).copy_(sl(mine, i), non_blocking=True)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    st = c.commit(res)
    t3 = time.perf_counter()
    lease = c.acquire(ns, keys, tier="hbm")
    t4 = time.perf_counter()
    for i, v in enumerate(lease.views[:lease.hit_blocks]):
        sl(mine2, i).copy_(v if isinstance(v, torch.Tensor) else torch.from_numpy(v), non_blocking=True)
    torch.cuda.synchronize()
    t5 = time.perf_counter()
    tiers = list(lease.tiers)
    lease.release()
    t6 = time.perf_counter()
    if r:
        for k, v in zip(phase, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
            phase[k].append(v)
        put_s.append(t3 - t0)
        get_s.append(t6 - t3)
        rounds += 1
        in_hbm += sum(t is TierKind.HBM for t in res.tiers) + sum(t is TierKind.HBM for t in tiers)
        hit += lease.hit_blocks
        equal += bool(torch.equal(mine, mine2)) and all(x.name == "OK" for x in st)
    mine2.zero_()
    c.remove(ns, keys)  # room for the next round (untimed)

def raw_round():
    for i in range(n):
        sl(mine2, i).copy_(sl(mine, i), non_blocking=True)
    torch.cuda.synchronize()
raw_round()
for _ in range(repeats):
    t0 = time.perf_counter(); raw_round(); raw_s.append(time.perf_counter() - t0)
nb = n * block
med = statistics.median
print("IPC_JSON " + json.dumps({
    "put": nb / med(put_s) / 1e9, "get": nb / med(get_s) / 1e9, "raw_d2d_blocks": nb / med(raw_s) / 1e9,
    "phase_ms": {k: 1e3 * med(v) for k, v in phase.items()}, "blocks": n, "rounds": rounds,
    "slots_in_hbm_fraction": in_hbm / max(1, 2 * n * rounds), "hit_fraction": hit / max(1, n * rounds),
    "rounds_byte_exact": equal}))
"""


def bench_ipc(rep: Report, total: int, block: int, repeats: int) -> dict[str, float]:
    """A second process (the engine) puts and gets through the kvstore daemon
    running here, HBM slots mapped through CUDA IPC."""
    from kvstore.tools.demo import InProcessDaemon

    # twice the rounds' bytes: a removed block's slot may wait on its copy's event before reuse
    over = {"dram.capacity": "256MiB", "hbm.capacity": str(2 * total + 64 * MIB), "hbm.admit": "reserve"}
    with InProcessDaemon(over) as d:
        r = subprocess.run([sys.executable, "-c", IPC_CHILD, ROOT, d.target, str(total), str(block), str(repeats)],
                           capture_output=True, text=True, timeout=400, cwd=ROOT, check=False)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("IPC_JSON ")), None)
    if r.returncode != 0 or line is None:
        raise RuntimeError(f"ipc child failed (rc {r.returncode}): {r.stderr[-2000:]}")
    res: dict[str, Any] = json.loads(line.split(" ", 1)[1])
    rep.figure("ipc_kvstore_put_GBps", res["put"], "GB/s")
    rep.figure("ipc_kvstore_get_GBps", res["get"], "GB/s")
    rep.figure("ipc_child_raw_d2d_GBps", res["raw_d2d_blocks"], "GB/s")
    for k, v in res["phase_ms"].items():
        rep.figure(f"ipc_{k}_ms", v, "ms")
    rep.figure("ipc_blocks_per_round", res["blocks"])
    rep.figure("ipc_slots_in_hbm_fraction", res["slots_in_hbm_fraction"])
    rep.figure("ipc_hit_fraction", res["hit_fraction"])
    rep.figure("ipc_rounds_byte_exact", res["rounds_byte_exact"])
    rep.figure("ipc_rounds", res["rounds"])
    return res


GPU_TARGETS = ("tier DRAM->HBM / raw pinned h2d", "tier HBM->DRAM / raw pinned d2h",
               "IPC put through kvstore (reserve+copy+commit) / raw d2d (blocks)",
               "IPC get through kvstore (acquire+copy+release) / raw d2d (blocks)")


def run(rep: Report, quick: bool, repeats: int, block: int, cpu: bool) -> None:
    total = (256 if quick else 1024) * MIB
    if cuda_ok():
        rep.figure("cuda_available", 1, "bool")
        raw = bench_raw_cuda(rep, total, repeats)
        tier = bench_tier(rep, "cuda:0", total, block, repeats, "tier")
        rep.target(GPU_TARGETS[0], tier["h2d"] / raw["h2d"], 0.8)
        rep.target(GPU_TARGETS[1], tier["d2h"] / raw["d2h"], 0.8)
        try:
            ipc = bench_ipc(rep, total, block, repeats)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            print(f"hbm IPC rows: FAILED - {e}", file=sys.stderr)
            for name in GPU_TARGETS[2:]:
                rep.unmeasured(name, 0.8, why=f"the IPC run failed: {str(e)[:200]}")
        else:
            # a round whose bytes came back wrong, or that missed HBM, counts for nothing
            whole = ipc["rounds_byte_exact"] == ipc["rounds"] and ipc["slots_in_hbm_fraction"] == 1.0
            for name, key in zip(GPU_TARGETS[2:], ("put", "get")):
                if whole:
                    rep.target(name, ipc[key] / ipc["raw_d2d_blocks"], 0.8)
                else:
                    rep.unmeasured(name, 0.8, why="not every round was byte-exact with every slot in HBM")
    else:
        rep.figure("cuda_available", 0, "bool")
        print("hbm (cuda) rows: SKIPPED - no CUDA device here; GPU figures and their targets stay open",
              file=sys.stderr)
        for name in GPU_TARGETS:
            rep.unmeasured(name, 0.8, why="SKIPPED: no CUDA device")
    if cpu:
        ctotal = (64 if quick else 256) * MIB
        logic = bench_tier(rep, "cpu", ctotal, block, repeats, "cpu_logic_tier")
        a = np.random.default_rng(1).integers(0, 256, ctotal, dtype=np.uint8)
        b = np.empty_like(a)
        t = med(lambda: np.copyto(b, a), repeats)
        rep.figure("cpu_logic_plain_numpy_copy_GBps", ctotal / t / 1e9, "GB/s")
        rep.figure("cpu_logic_tier_put_vs_plain_copy", logic["h2d"] / (ctotal / t / 1e9), "x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller run, under a minute")
    ap.add_argument("--json", metavar="PATH", help="write figures and targets as JSON")
    ap.add_argument("--cpu", action="store_true", help="also time the tier logic on the host (labelled cpu_logic)")
    ap.add_argument("--repeats", type=int, default=0, help="samples per figure (default 3 quick, 5 full)")
    ap.add_argument("--block", type=int, default=2 * MIB, help="block bytes (default 2 MiB)")
    a = ap.parse_args(argv)
    rep = Report("hbm")
    run(rep, a.quick, a.repeats or (3 if a.quick else 5), a.block, a.cpu)
    rep.emit(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
