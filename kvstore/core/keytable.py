"""The block index's key table: 16-byte key (and namespace) -> row.

An open-addressing hash table of int32 rows with linear probing (-1 empty,
-2 tombstone), one numpy array. The key of a row lives in the index's own
columns (``k0``, ``k1``, ``ns``), so the table costs 4 bytes a slot, load
0.35-0.7: about 6-11 bytes per block, and no Python object per block.

Probing runs in the optional C helper ``kvstore.core.ckeytable`` (one pass per
key, ~tens of ns); without it (not built, or ``NO_KVSTORE_NATIVE=1``) the
same table is probed in vectorised numpy rounds. Both place a key in the
first free slot from its home position, so either finds what the other put.

The table does not own the columns: every call is given the current ones
(the index reallocates them when it grows).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType

import numpy as np

from kvstore.errors import InvalidArgument

EMPTY = -1
TOMB = -2
MIX = np.uint64(0x9E3779B97F4A7C15)
MAX_LOAD = 0.7
"""Live plus tombstone slots over table size before a rehash."""


def keys_to_array(keys: object) -> np.ndarray:
    """Keys as an ``(n, 2)`` uint64 array (the two little-endian halves).

    Accepts a list/tuple of 16-byte ``bytes``, one blob of ``n*16`` bytes, or
    an ``(n, 16)`` uint8 / ``(n, 2)`` uint64 array. Raises InvalidArgument
    naming the first bad key.
    """
    if isinstance(keys, np.ndarray):
        if keys.dtype == np.uint64 and keys.ndim == 2 and keys.shape[1] == 2:
            return keys
        if keys.dtype == np.uint8 and keys.ndim == 2 and keys.shape[1] == 16:
            return np.ascontiguousarray(keys).view("<u8")
        raise InvalidArgument(f"key array must be (n, 16) uint8, got {keys.dtype} {keys.shape}")
    if isinstance(keys, (bytes, bytearray, memoryview)):
        blob = bytes(keys)
        if len(blob) % 16:
            raise InvalidArgument(f"key blob length {len(blob)} is not a multiple of 16")
        return np.frombuffer(blob, dtype="<u8").reshape(-1, 2)
    try:
        seq = list(keys)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidArgument(f"keys must be a sequence of 16-byte strings, got {type(keys).__name__}") from None
    if not seq:
        return np.zeros((0, 2), dtype=np.uint64)
    try:
        ok = set(map(len, seq)) == {16}
        blob = b"".join(seq) if ok else b""
    except TypeError:
        ok = False
    if not ok:
        for i, k in enumerate(seq):
            if not isinstance(k, (bytes, bytearray)) or len(k) != 16:
                got = f"{len(k)} bytes" if isinstance(k, (bytes, bytearray)) else type(k).__name__
                raise InvalidArgument(f"key {i} must be 16 bytes, got {got}")
    return np.frombuffer(blob, dtype="<u8").reshape(-1, 2)


def key_bytes(k0: int, k1: int) -> bytes:
    return np.array([k0, k1], dtype="<u8").tobytes()


def load_hashtab() -> ModuleType | None:
    """``kvstore.core.ckeytable`` if built and not disabled by ``NO_KVSTORE_NATIVE=1``."""
    if os.environ.get("NO_KVSTORE_NATIVE", "") not in ("", "0"):
        return None
    try:
        from kvstore.core import ckeytable
    except ImportError:
        return None
    return ckeytable


HASHTAB = load_hashtab()


def table_size(live: int) -> int:
    """Slots for ``live`` keys right after a rehash: a power of two, load ≤ 0.5."""
    return 1 << max(5, (max(live, 1) * 2 - 1).bit_length())


class KeyTable:
    """Key -> row, for a ``BlockIndex``. See the module docstring."""

    def __init__(self, live: int = 0, *, native: bool = True) -> None:
        self.table = np.full(table_size(live), EMPTY, dtype=np.int32)
        self.used = 0
        """Slots not empty: live rows plus tombstones."""
        self.native = HASHTAB if native else None
        self.alloc: Callable[[str, int, str], np.ndarray] | None = None
        """Where new tables come from once ``share``d (else numpy)."""

    def share(self, alloc: Callable[[str, int, str], np.ndarray]) -> None:
        """Keep the table in arrays from ``alloc`` (``BlockIndex.share``)."""
        self.alloc = alloc
        new = alloc("table", self.table.size, "i4")
        new[:] = self.table
        self.table = new

    @property
    def nbytes(self) -> int:
        return int(self.table.nbytes)

    def home(self, k0: np.ndarray, ns: np.ndarray | int) -> np.ndarray:
        mask = np.uint64(self.table.size - 1)
        h = (k0 ^ (np.asarray(ns, dtype=np.uint64) * MIX)) * MIX
        return ((h >> np.uint64(29)) & mask).astype(np.int64)

    # ---------------------------------------------------------------- find
    def find(self, k0: np.ndarray, k1: np.ndarray, nscol: np.ndarray, state: np.ndarray,
             keys: np.ndarray, ns: int, want_state: int = -1, stop: bool = False) -> np.ndarray:
        """Rows of ``keys`` ((n, 2) uint64) in namespace ``ns``, -1 where absent
        (or, with ``want_state >= 0``, where the row is in another state).
        With ``stop``, only the leading found rows are returned."""
        n = keys.shape[0]
        out = np.empty(n, dtype=np.int64)
        if n == 0:
            return out
        if self.native is not None:
            q = np.ascontiguousarray(keys, dtype=np.uint64)
            done = self.native.find(self.table, k0, k1, nscol, state, q, int(ns), int(want_state), stop, out)
            return out[:done] if stop else out
        rows = self.probe(k0, k1, nscol, keys[:, 0], keys[:, 1], ns)
        if want_state >= 0:
            ok = rows >= 0
            ok[ok] = state[rows[ok]] == want_state
            rows = np.where(ok, rows, -1)
        if stop:
            miss = np.flatnonzero(rows < 0)
            return rows[: int(miss[0])] if miss.size else rows
        return rows

    def probe(self, k0: np.ndarray, k1: np.ndarray, nscol: np.ndarray,
              qk0: np.ndarray, qk1: np.ndarray, ns: int) -> np.ndarray:
        """The numpy path: vectorised probe rounds over the whole batch."""
        n = qk0.shape[0]
        rows = np.full(n, -1, dtype=np.int64)
        if n == 0 or self.used == 0:
            return rows
        table = self.table
        mask = table.size - 1
        pos = self.home(qk0, ns)
        active = np.arange(n)
        for _ in range(table.size):
            p = pos[active]
            s = table[p]
            occupied = s >= 0
            sr = np.where(occupied, s, 0)
            match = occupied & (k0[sr] == qk0[active]) & (k1[sr] == qk1[active]) & (nscol[sr] == ns)
            rows[active[match]] = s[match]
            active = active[~(match | (s == EMPTY))]
            if active.size == 0:
                break
            pos[active] = (pos[active] + 1) & mask
        return rows

    # ------------------------------------------------------------ mutation
    def insert(self, k0: np.ndarray, nscol: np.ndarray, rows: np.ndarray,
               live_rows: Callable[[], np.ndarray]) -> None:
        """Add rows whose keys are known absent and distinct. ``live_rows()``
        gives every live row, these included; it is called only to rehash
        (when live plus tombstone slots would pass ``MAX_LOAD``)."""
        if rows.size == 0:
            return
        if (self.used + rows.size) > self.table.size * MAX_LOAD:
            self.rehash(k0, nscol, live_rows())
        else:
            self.used += self.place(k0, nscol, rows)

    def rehash(self, k0: np.ndarray, nscol: np.ndarray, live_rows: np.ndarray) -> None:
        size = table_size(live_rows.size)
        if size == self.table.size:  # tombstones cleared in place: no new array (nor, shared, a new file)
            table = self.table
        elif self.alloc is None:
            table = np.empty(size, dtype=np.int32)
        else:
            table = self.alloc("table", size, "i4")
        table.fill(EMPTY)
        self.table = table
        self.used = 0
        self.used = self.place(k0, nscol, live_rows)

    def place(self, k0: np.ndarray, nscol: np.ndarray, rows: np.ndarray) -> int:
        """Put rows into free slots; returns how many empty (not tombstone) slots were taken."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if self.native is not None:
            return int(self.native.place(self.table, k0, nscol, rows))
        table = self.table
        mask = table.size - 1
        pos = self.home(k0[rows], nscol[rows])
        active = np.arange(rows.size)
        taken_empty = 0
        while active.size:
            pa = pos[active]
            fi = np.flatnonzero(table[pa] < 0)
            if fi.size:
                upos = pa[fi]
                if fi.size > 1:  # the first claimant of each slot wins (stable sort)
                    order = np.argsort(upos, kind="stable")
                    upos = upos[order]
                    first = np.empty(upos.size, dtype=bool)
                    first[0] = True
                    np.not_equal(upos[1:], upos[:-1], out=first[1:])
                    fi, upos = fi[order[first]], upos[first]
                taken_empty += int(np.count_nonzero(table[upos] == EMPTY))
                table[upos] = rows[active[fi]]
                keep = np.ones(active.size, dtype=bool)
                keep[fi] = False
                active = active[keep]
            if active.size:
                pos[active] = (pos[active] + 1) & mask
        return taken_empty

    def remove(self, k0: np.ndarray, nscol: np.ndarray, rows: np.ndarray) -> None:
        """Tombstone the slots of these live rows (found by row identity)."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if self.native is not None:
            self.native.remove(self.table, k0, nscol, rows)
            return
        self.table[self.positions(k0, nscol, rows)] = TOMB

    def positions(self, k0: np.ndarray, nscol: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Table positions of live rows (numpy probing by row identity)."""
        table = self.table
        mask = table.size - 1
        pos = self.home(k0[rows], nscol[rows])
        out = np.full(rows.size, -1, dtype=np.int64)
        active = np.arange(rows.size)
        for _ in range(table.size):
            p = pos[active]
            s = table[p]
            match = s == rows[active]
            out[active[match]] = p[match]
            keep = ~match
            if np.any(s[keep] == EMPTY):
                raise AssertionError("row missing from the key table")
            active = active[keep]
            if active.size == 0:
                break
            pos[active] = (pos[active] + 1) & mask
        return out


__all__ = ["EMPTY", "HASHTAB", "MAX_LOAD", "TOMB", "KeyTable", "load_hashtab", "table_size"]
