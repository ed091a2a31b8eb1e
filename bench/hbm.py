"""HBM tier benchmark (issue 8). Not a test: it reports numbers.

With CUDA (all in one run, same bytes, medians of ``--repeats``):

- raw torch copies: pinned host -> device, device -> pinned host, device ->
  device (``Tensor.copy_`` of one buffer, synchronised);
- through the tier: ``HbmTier.write_masked`` (DRAM slab -> HBM, load stream,
  xxh3 of the source overlapped with the DMA) and ``HbmTier.read_into`` (HBM
  -> DRAM slab, store stream, xxh3 verified on the host) with the DRAM slab
  registered pinned (``cudaHostRegister``), in blocks of ``--block``;
- IPC between two processes: a child process maps this process's slab
  through CUDA IPC (``kvstore.wire.hbm_ipc``) and times device -> device put
  (its buffer -> slab) and get (slab -> its buffer), beside a raw device ->
  device copy between two of its own buffers of the same size.

Targets: HBM<->DRAM through the tier >= 0.8x the raw pinned copy (each
direction); IPC device-to-device >= 0.8x raw device-to-device (put and get).

Without CUDA the GPU rows are printed as skipped; ``--cpu`` adds rows that
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
import json, statistics, sys, time
import torch
sys.path.insert(0, sys.argv[1])
from kvstore.wire.hbm_ipc import open_region
dev, handle, off, size, block, repeats = (int(sys.argv[2]), bytes.fromhex(sys.argv[3]), int(sys.argv[4]),
                                          int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]))
m = open_region(dev, handle, off, size)
n = size // block
mine = torch.empty(n * block, dtype=torch.uint8, device=f"cuda:{dev}")
mine2 = torch.empty_like(mine)
mine.random_(0, 255)
def med(fn):
    fn(); out = []
    for _ in range(repeats):
        t0 = time.perf_counter(); fn(); out.append(time.perf_counter() - t0)
    return statistics.median(out)
def blocks(dst_of, src_of):
    def go():
        for i in range(n):
            dst_of(i).copy_(src_of(i), non_blocking=True)
        torch.cuda.synchronize()
    return go
sl = lambda t, i: t[i * block:(i + 1) * block]
put = med(blocks(lambda i: m.view(i * block, block), lambda i: sl(mine, i)))
get = med(blocks(lambda i: sl(mine2, i), lambda i: m.view(i * block, block)))
raw = med(blocks(lambda i: sl(mine2, i), lambda i: sl(mine, i)))
ok = bool(torch.equal(mine, mine2))
nb = n * block
print(json.dumps({"put": nb / put / 1e9, "get": nb / get / 1e9, "raw_d2d_blocks": nb / raw / 1e9, "roundtrip_equal": ok}))
"""


def bench_ipc(rep: Report, total: int, block: int, repeats: int) -> dict[str, float]:
    """A second process maps our slab through CUDA IPC and copies by offset."""
    from tiers.hbm import HbmTier

    hbm = HbmTier(total, device="cuda:0", page_bytes=max(block, 16 * MIB))
    try:
        exp = hbm.ipc_export()
        r = subprocess.run([sys.executable, "-c", IPC_CHILD, ROOT, str(exp.device), exp.handle.hex(),
                            str(exp.offset), str(exp.size), str(block), str(repeats)],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"ipc child failed: {r.stderr[-2000:]}")
        res = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        hbm.close()
    rep.figure("ipc_put_d2d_GBps", res["put"], "GB/s")
    rep.figure("ipc_get_d2d_GBps", res["get"], "GB/s")
    rep.figure("ipc_child_raw_d2d_GBps", res["raw_d2d_blocks"], "GB/s")
    rep.figure("ipc_roundtrip_equal", 1.0 if res["roundtrip_equal"] else 0.0, "bool")
    return res


def run(rep: Report, quick: bool, repeats: int, block: int, cpu: bool) -> None:
    total = (256 if quick else 1024) * MIB
    if cuda_ok():
        rep.figure("cuda_available", 1, "bool")
        raw = bench_raw_cuda(rep, total, repeats)
        tier = bench_tier(rep, "cuda:0", total, block, repeats, "tier")
        rep.target("tier DRAM->HBM / raw pinned h2d", tier["h2d"] / raw["h2d"], 0.8)
        rep.target("tier HBM->DRAM / raw pinned d2h", tier["d2h"] / raw["d2h"], 0.8)
        ipc = bench_ipc(rep, total, block, repeats)
        rep.target("IPC put d2d / raw d2d (blocks)", ipc["put"] / ipc["raw_d2d_blocks"], 0.8)
        rep.target("IPC get d2d / raw d2d (blocks)", ipc["get"] / ipc["raw_d2d_blocks"], 0.8)
    else:
        rep.figure("cuda_available", 0, "bool")
        print("hbm (cuda) rows: SKIPPED - no CUDA device here; GPU figures and their targets stay open",
              file=sys.stderr)
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
