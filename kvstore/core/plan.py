"""Which keys of a put (or reserve) get new rows: the planning step before
slots are allocated.

A batch is a chain segment: ``keys[i]``'s parent is ``keys[i-1]`` and
``keys[0]``'s parent is the named parent (``PARENT_ABSENT`` when it is named
but not stored). A key is stored only when its parent is stored or is stored
by this batch; a key that is refused (repeated, busy, empty, of the wrong
size) refuses the rest of the chain after it (PARENT_MISSING).

``plan`` answers the batch indices to store and the parent reference of each
(a row, ``NO_ROW``, or ``in_batch(j)`` for the j-th stored key of this
batch), and fills the statuses of the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvstore.core.index import IN_BATCH, NO_ROW, S_COMMITTED, BlockIndex, keys_to_array
from kvstore.errors import InvalidArgument, KeyStatus
from kvstore.results import BatchResult

PARENT_ABSENT = -3
"""``parent_row``'s answer for a parent that is named but not stored (a
value no row and no in-batch reference has)."""


def in_batch(i: int) -> int:
    """The parent reference for "the row of the i-th key of this batch"
    (``index.IN_BATCH - i``), as ``BlockIndex.insert`` takes it."""
    return IN_BATCH - i


def in_batch_chain(n: int) -> list[int]:
    """Parent references of keys 1..n-1 of a one-chain batch:
    ``[in_batch(0), ..., in_batch(n - 2)]``."""
    return list(range(IN_BATCH, IN_BATCH - (n - 1), -1))


Footprint = Callable[[int], object]
"""A tier's ``footprint(nbytes)``: raises InvalidArgument for a size it cannot hold."""


def parent_row(index: BlockIndex, nid: int, parent: bytes | None) -> int:
    """The row of a batch's named parent: ``NO_ROW`` for none (the first
    block of a prompt), ``PARENT_ABSENT`` when named but not stored."""
    if parent is None or len(parent) == 0:
        return NO_ROW
    rows = index.find_committed(nid, keys_to_array([bytes(parent)]))
    return int(rows[0]) if rows[0] >= 0 else PARENT_ABSENT


def all_new(rows: np.ndarray, karr: np.ndarray, sizes: Sequence[int], expected: int | None,
            footprint: Footprint) -> bool:
    """Whether ``plan`` would store every key of the batch (vectorised test)."""
    n = rows.shape[0]
    if n == 0 or bool((rows >= 0).any()):
        return False
    size = sizes[0]
    if size <= 0 or (expected is not None and size != expected) or list(sizes).count(size) != n:
        return False
    try:
        footprint(int(size))
    except InvalidArgument:
        return False
    if n == 1:
        return True
    # distinct keys: their first 64 bits almost always differ already (a set
    # of n ints, far cheaper than np.unique over 16-byte voids); only a batch
    # with a repeated first half is checked on whole keys
    first = karr[:, 0]
    if (len(set(first.tolist())) if n <= 256 else int(np.unique(first).size)) == n:
        return True
    return np.unique(np.ascontiguousarray(karr).view("V16")).size == n


def plan(index: BlockIndex, nid: int, karr: np.ndarray, sizes: Sequence[int], prow: int,
         expected: int | None, footprint: Footprint, res: BatchResult) -> tuple[list[int], list[int]]:
    """Decide which keys get new rows (module docstring). ``prow`` is
    ``parent_row``'s answer; ``expected`` the namespace's block size, if
    fixed. Returns (batch indices to store, parent refs for insert)."""
    n = karr.shape[0]
    st = res.statuses
    rows = index.find(nid, karr)
    todo: list[int] = []
    prefs: list[int] = []
    seen: dict[tuple[int, int], int] = {}
    prev_ok: int | None = prow if prow != PARENT_ABSENT else None  # parent ref for the next key
    prev_reason = KeyStatus.PARENT_MISSING
    if prow == PARENT_ABSENT:
        res.messages[0] = "parent block is not stored"
    elif all_new(rows, karr, sizes, expected, footprint):
        # the usual batch (all keys new and distinct, one valid size): the
        # loop below would store every key, each the parent of the next
        return list(range(n)), [prow] + in_batch_chain(n)
    for i in range(n):
        k = (int(karr[i, 0]), int(karr[i, 1]))
        size = int(sizes[i])
        if k in seen:
            st[i] = KeyStatus.INVALID
            res.messages[i] = f"key {i} repeats key {seen[k]} of this batch"
            prev_ok, prev_reason = None, KeyStatus.PARENT_MISSING
            continue
        seen[k] = i
        r = int(rows[i])
        if r >= 0:
            if index.state[r] == S_COMMITTED:
                st[i] = KeyStatus.EXISTS
                prev_ok = r
            else:
                st[i] = KeyStatus.BUSY
                prev_ok, prev_reason = None, KeyStatus.PARENT_MISSING
            continue
        if prev_ok is None:
            st[i] = prev_reason
            continue
        if size <= 0:
            st[i] = KeyStatus.INVALID
            res.messages[i] = f"payload {i} is empty"
            prev_ok, prev_reason = None, KeyStatus.PARENT_MISSING
            continue
        want = expected if expected is not None else (int(sizes[todo[0]]) if todo else size)
        if size != want:
            st[i] = KeyStatus.INVALID
            res.messages[i] = (f"payload {i} is {size} bytes; blocks of this namespace are "
                               f"{want} bytes")
            prev_ok, prev_reason = None, KeyStatus.PARENT_MISSING
            continue
        try:
            footprint(size)
        except InvalidArgument as e:
            st[i] = KeyStatus.INVALID
            res.messages[i] = str(e)
            prev_ok, prev_reason = None, KeyStatus.PARENT_MISSING
            continue
        todo.append(i)
        prefs.append(prev_ok)
        prev_ok = in_batch(len(todo) - 1)  # "the row of the j-th new block"
    return todo, prefs


def fix_tail_statuses(res: BatchResult) -> None:
    """Keys after a CAPACITY key in the chain could not be placed either."""
    st = res.statuses
    for i in range(1, len(st)):
        if st[i] is KeyStatus.PARENT_MISSING and st[i - 1] is KeyStatus.CAPACITY:
            st[i] = KeyStatus.CAPACITY
