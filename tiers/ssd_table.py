"""The SSD tier's per-location table: one ``ROW`` per block id (state,
footprint, segment, offset, identity: 105 bytes), grown as ids are handed
out.

It grows in place within a reserved address range (kvstore/reserve.py):
the kernel backs the rows used, not the doubling capacity, and growing
copies nothing. Where no range can be reserved it is a plain array, copied
into one twice as large.
"""

from __future__ import annotations

import numpy as np

from kvstore.reserve import Reserved, grow_in, resident
from tiers.ssd_format import ROW

ID_LIMIT = 1 << 31
"""Locations (block ids) stay below this: the block index keeps the id of a
DRAM block's SSD copy in 32 bits. A tier that would need more is full, and
a recovered entry at or past it is dropped (a miss)."""


class LocationTable:
    """``rows``: the table (a ``ROW`` array of at least the ids handed out)."""

    def __init__(self, rows: int = 1024) -> None:
        self.range: Reserved | None = None
        self.rows = np.zeros(0, dtype=ROW)
        self.grow(rows)

    def grow(self, cap: int) -> bool:
        """Room for ``cap`` rows (at least doubling), keeping the rows there
        and zero past them. True when ``rows`` is a new array."""
        old = self.rows
        if cap <= old.size:
            return False
        size = max(cap, 2 * old.size)
        got = grow_in(self.range, old, old.size, size)
        if got is None:
            self.range, self.rows = None, np.zeros(size, dtype=ROW)
            self.rows[:old.size] = old
        else:
            self.rows, self.range = got
        return True

    @property
    def nbytes(self) -> int:
        """Its memory: the pages backed in its range (``mincore``), or the
        whole array where it is copied on growth."""
        if self.range is not None:
            return resident([self.range])
        return int(self.rows.nbytes)
