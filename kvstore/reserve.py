"""Arrays that grow in place, for the block index's columns.

A ``Reserved`` holds an address range mapped up front (anonymous, private,
``MAP_NORESERVE``) and hands out numpy views of its first ``n`` items. The
kernel backs a page only when it is first written, so a column costs the
rows written into it, not its capacity: growing it is a new view of the
same memory (no copy, no slack, nothing stalls while a large index grows),
and an array taken before the growth still sees the same rows.

``tracemalloc`` does not see these pages; ``resident`` asks the kernel
which of them it backs (``mincore``: the pages RSS counts), and that is
what the index's ``nbytes`` and ``bench/core.py`` count for them.

Where the range cannot be mapped (a strict overcommit policy, an address
space limit, no ``mmap``), ``Reserved.make`` answers ``None`` and the index
grows its columns by copying, as plain numpy arrays.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable
from typing import Any, cast

import numpy as np

RESERVE_ROWS = 1 << 24
"""Rows a column's first range holds (16.8 M; 128 MiB of address space for
an 8-byte column). A column that outgrows its range is copied once into
one four times larger."""
PAGE = mmap.PAGESIZE
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
"""Python 3.11's ``mmap`` does not export it; 0x4000 is its Linux value."""


class Reserved:
    """One column's address range. See the module docstring."""

    __slots__ = ("dtype", "rows", "addr", "_map")

    def __init__(self, dtype: str | np.dtype, rows: int) -> None:
        self.dtype = np.dtype(dtype)
        self.rows = int(rows)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
        self._map = mmap.mmap(-1, max(PAGE, self.rows * self.dtype.itemsize), flags=flags,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.addr = int(np.frombuffer(self._map, dtype=np.uint8, count=1).__array_interface__["data"][0])

    @classmethod
    def make(cls, dtype: str | np.dtype, rows: int) -> Reserved | None:
        """A range of ``rows`` items, or ``None`` where it cannot be mapped."""
        if not hasattr(mmap, "MAP_ANONYMOUS"):
            return None
        try:
            return cls(dtype, rows)
        except (OSError, ValueError, OverflowError):
            return None

    def view(self, n: int) -> np.ndarray:
        """The first ``n`` items (``n <= rows``), writable, on the same memory."""
        return np.frombuffer(self._map, dtype=self.dtype, count=int(n))

    def release(self) -> None:
        """Give every page back to the kernel (``MADV_DONTNEED``): the range
        reads as zeros and costs nothing until written again."""
        self._map.madvise(mmap.MADV_DONTNEED)


def grow_in(res: Reserved | None, old: np.ndarray, keep: int, cap: int) -> tuple[np.ndarray, Reserved] | None:
    """``old``'s first ``keep`` items in an array of ``cap`` in reserved
    memory: a longer view of ``res`` when ``old`` is a view of it (or empty)
    and it holds ``cap`` (the same memory, nothing copied); else a copy into
    a new range (four times ``res``, or ``RESERVE_ROWS``, at least ``cap``).
    Items past ``keep`` in a new range are zero. None where no range can be
    mapped (the caller copies into a plain array)."""
    if res is not None and cap <= res.rows and (not old.size or old.ctypes.data == res.addr):
        return res.view(cap), res
    new = Reserved.make(old.dtype, max(cap, 4 * res.rows if res is not None else RESERVE_ROWS))
    if new is None:
        return None
    arr = new.view(cap)
    arr[:keep] = old[:keep]
    return arr, new


def resident(ranges: list[Reserved]) -> int:
    """Bytes of these ranges the kernel backs now (``mincore``: the pages
    RSS counts for them, and any only read, which map the zero page: never
    fewer than RSS), or, where that cannot be asked, every page of them."""
    total = 0
    for r in ranges:
        size = -(-max(PAGE, r.rows * r.dtype.itemsize) // PAGE) * PAGE
        vec = np.zeros(size // PAGE, dtype=np.uint8)
        if MINCORE is None or MINCORE(ctypes.c_void_p(r.addr), ctypes.c_size_t(size), vec.ctypes.data) != 0:
            total += size
            continue
        total += int(np.count_nonzero(vec & 1)) * PAGE
    return total


def libc_function(name: str, *argtypes: Any) -> Callable[..., int] | None:
    """The C library's function ``name`` (returning ``int``, taking
    ``argtypes``; ``errno`` kept), or None where it has none."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return cast(Callable[..., int], fn)


MINCORE = libc_function("mincore", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
