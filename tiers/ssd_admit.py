"""Write admission for the SSD tier: which evicted blocks are worth a write.

SSD endurance and bandwidth are limited, so a block demoted from DRAM is
written only when

1. it is *warm*: its estimated access count is at least ``min_hits``
   (``min_hits`` 0 admits every block, 1 every block seen at least once), and
2. the *write budget* has room: a token bucket refilled at
   ``write_budget_mbps`` MB/s (10**6 bytes/s; 0 = unlimited) holding at most
   ``burst_seconds`` worth of bytes. A block is admitted while the bucket is
   positive and its bytes are taken even if that drives the bucket below zero
   (so a block larger than the burst is not starved; the long-run rate still
   holds).

Counts live in a Count-Min sketch: ``depth`` rows of ``width`` saturating
uint8 counters, indexed by 32-bit slices of the key's xxh3_128 (never Python's
``hash()``, which is salted per process). After ``age_every`` increments
(default 10 x width) every counter is halved, so old popularity fades.
``seen`` is called on puts and gets; ``admit`` when a block is about to be
written to SSD. Pure logic: no I/O, the clock is injected. Not thread-safe.

API::

    adm = SsdAdmission(min_hits=2, write_budget_mbps=0.0, clock=time.monotonic)
    adm.seen(keys)                      # count one access per key
    adm.estimate(keys) -> uint8 array   # estimated counts
    adm.admit(keys, sizes) -> bool array  # consumes budget for admitted ones
    adm.admitted, adm.refused_cold, adm.refused_budget  # counters (blocks)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument


class SsdAdmission:
    """Frequency (Count-Min) + token-bucket write admission. See the module docstring."""

    def __init__(self, min_hits: int = 2, write_budget_mbps: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, *, width: int = 1 << 16,
                 depth: int = 4, age_every: int | None = None, burst_seconds: float = 1.0) -> None:
        if min_hits < 0:
            raise InvalidArgument(f"min_hits must be >= 0, got {min_hits}")
        if write_budget_mbps < 0:
            raise InvalidArgument(f"write_budget_mbps must be >= 0 (0 = unlimited), got {write_budget_mbps}")
        if width < 16 or width & (width - 1):
            raise InvalidArgument(f"width must be a power of two >= 16, got {width}")
        if not 1 <= depth <= 4:
            raise InvalidArgument(f"depth must be 1..4 (one 32-bit slice of xxh3_128 each), got {depth}")
        if burst_seconds <= 0:
            raise InvalidArgument(f"burst_seconds must be > 0, got {burst_seconds}")
        self.min_hits = int(min_hits)
        self.rate = float(write_budget_mbps) * 1e6
        """Bytes per second; 0 means unlimited."""
        self.burst = self.rate * float(burst_seconds)
        self.clock = clock
        self.width = int(width)
        self.depth = int(depth)
        self.age_every = int(age_every) if age_every is not None else 10 * self.width
        self._table = np.zeros((self.depth, self.width), dtype=np.uint8)
        self._rows = np.arange(self.depth)[:, None]
        self._increments = 0
        self._tokens = self.burst
        self._last = clock()
        self.admitted = 0
        """Blocks admitted."""
        self.refused_cold = 0
        """Blocks refused: estimated count below ``min_hits``."""
        self.refused_budget = 0
        """Blocks refused: warm, but the write budget was spent."""
        self.agings = 0
        """How many times the counters were halved."""

    def _slots(self, keys: Sequence[bytes]) -> np.ndarray:
        """(depth, n) counter indices: 32-bit slices of each key's xxh3_128."""
        digests = b"".join(xxhash.xxh3_128_digest(k) for k in keys)
        words = np.frombuffer(digests, dtype="<u4").reshape(len(keys), 4)[:, :self.depth]
        return (words & np.uint32(self.width - 1)).T.astype(np.intp)

    def seen(self, keys: Sequence[bytes]) -> None:
        """Count one access for each key (duplicates in one call count each time)."""
        if not len(keys):
            return
        slots = self._slots(keys)
        for r in range(self.depth):  # touch only the counters hit (no full-table pass)
            u, c = np.unique(slots[r], return_counts=True)
            self._table[r, u] = np.minimum(self._table[r, u].astype(np.int64) + c, 255)
        self._increments += len(keys)
        while self._increments >= self.age_every:
            self._table >>= 1
            self._increments -= self.age_every
            self.agings += 1

    def estimate(self, keys: Sequence[bytes]) -> np.ndarray:
        """Estimated access count per key (never below the true count since
        the last aging, saturating at 255)."""
        if not len(keys):
            return np.zeros(0, dtype=np.uint8)
        return self._table[self._rows, self._slots(keys)].min(axis=0)

    def admit(self, keys: Sequence[bytes], sizes: Sequence[int] | np.ndarray) -> np.ndarray:
        """True for each block to write to SSD; budget is taken for those."""
        n = len(keys)
        sz = np.asarray(sizes, dtype=np.float64).reshape(-1)
        if sz.size != n:
            raise InvalidArgument(f"{n} keys but {sz.size} sizes")
        warm = np.ones(n, dtype=bool) if self.min_hits == 0 else self.estimate(keys) >= self.min_hits
        self.refused_cold += int(n - warm.sum())
        if self.rate <= 0:
            self.admitted += int(warm.sum())
            return warm
        now = self.clock()
        self._tokens = min(self.burst, self._tokens + max(0.0, now - self._last) * self.rate)
        self._last = now
        before = np.cumsum(np.where(warm, sz, 0.0)) - np.where(warm, sz, 0.0)  # bytes ahead of each
        ok = warm & (before < self._tokens)
        self._tokens -= float(sz[ok].sum())
        self.admitted += int(ok.sum())
        self.refused_budget += int((warm & ~ok).sum())
        return ok
