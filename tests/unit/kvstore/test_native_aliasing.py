"""kvstore._native's batch scatters and gathers check their int64 tables
(pieces, indices, slots) once, then copy with the GIL released: what they
use must be what they checked, even when a destination the call writes
aliases a table (or another thread rewrites it meanwhile).

Each case makes block 0's copy rewrite block 1's engine index to 2**40
(checked as 1): reading the table again after the checks sent block 1 past
every buffer (SIGSEGV). The calls run in a subprocess so a crash fails the
test instead of killing pytest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore import checksum as cks

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(not cks.HAVE_NATIVE, reason="kvstore._native is not built")

PRELUDE = """
import numpy as np
from kvstore import _native as N
HUGE = np.frombuffer(np.int64(1 << 40).tobytes(), np.uint8)
def signed(x):
    return x - (1 << 64) if x >= 1 << 63 else x
"""

CASES = {
    "verify_scatter_many_direct": """
dst = np.zeros(4096, np.uint8)
idx = dst[:16].view(np.int64); idx[:] = [0, 1]        # the indices live in the destination
src0 = np.zeros(512, np.uint8); src0[8:16] = HUGE
src1 = np.zeros(512, np.uint8)
ok = np.zeros(2, np.uint8)
exp = np.array([N.checksum(src0), N.checksum(src1)], np.uint64)
N.verify_scatter_many([src0, src1], exp, None, np.array([[0, 16, 0, 0, 16]], np.int64), (dst,), idx, ok)
assert ok.tolist() == [1, 1], ok
assert dst[16:32].tolist() == [0] * 16                 # block 1 went to index 1, as checked
""",
    "verify_scatter_many_scratch": """
dst = np.zeros(4096, np.uint8)
idx = dst[:16].view(np.int64); idx[:] = [0, 1]
src0 = np.zeros(512, np.uint8); src0[8:16] = HUGE
src1 = np.full(512, 7, np.uint8)
ok = np.zeros(2, np.uint8)
exp = np.array([N.checksum(src0), N.checksum(src1)], np.uint64)
N.verify_scatter_many([src0, src1], exp, np.zeros(512, np.uint8), np.array([[0, 16, 0, 0, 16]], np.int64),
                      (dst,), idx, ok)
assert ok.tolist() == [1, 1], ok
assert dst[16:32].tolist() == [7] * 16
""",
    "verify_scatter_many_pieces": """
dst = np.zeros(4096, np.uint8)
pieces = dst[:80].view(np.int64).reshape(2, 5)         # the pieces live in the destination
pieces[:] = [[0, 8, 0, 64, 0],                         # piece 0 lands on piece 1's base (bytes 64..72) ...
             [8, 8, 0, 200, 0]]
src = np.full(512, 7, np.uint8); src[:8] = HUGE        # ... and makes it 2**40
ok = np.zeros(1, np.uint8)
N.verify_scatter_many([src], np.array([N.checksum(src)], np.uint64), np.zeros(512, np.uint8), pieces,
                      (dst,), np.zeros(1, np.int64), ok)
assert ok.tolist() == [1]
assert dst[200:208].tolist() == [7] * 8                # piece 1 went to its checked base
""",
    "gather_many": """
src = np.zeros(4096, np.uint8); src[8:16] = HUGE
blk0 = np.zeros(512, np.uint8); blk1 = np.zeros(512, np.uint8)
idx = blk0[:16].view(np.int64); idx[:] = [0, 1]        # the indices live in block 0
out = np.zeros(2, np.uint64)
N.gather_many([blk0, blk1], np.array([[0, 512, 0, 0, 16]], np.int64), (src,), idx, out)
assert blk1.tobytes() == src[16:528].tobytes()         # block 1 came from index 1, as checked
assert out[1] == N.checksum(blk1)
""",
    "scatter_slots": """
slab = np.zeros(8192, np.uint8); slab[8:16] = HUGE
dst = np.zeros(4096, np.uint8)
idx = dst[:16].view(np.int64); idx[:] = [0, 1]
slots = np.array([[0, 0, 512, signed(N.checksum(slab[:512]))],
                  [0, 512, 512, signed(N.checksum(slab[512:1024]))]], np.int64)
assert N.scatter_slots(slab, slots, 512, np.array([[0, 16, 0, 0, 16]], np.int64), (dst,), idx) == 2
assert dst[16:32].tolist() == [0] * 16
""",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tables_are_used_as_checked_when_a_destination_aliases_them(case: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("NO_KVSTORE_NATIVE", None)
    out = subprocess.run([sys.executable, "-c", PRELUDE + CASES[case]], env=env, capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, f"{case}: exit {out.returncode}\n{out.stderr[-2000:]}"
