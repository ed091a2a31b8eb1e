"""The block index: metadata only, kept compact and vectorised.

Per block the index holds its key, namespace, tier, location in that tier,
payload size and checksum, parent, cached-children count, pins, last access
and state, and, only under the eviction policies that rank with them, an
access count, the depth in its chain and a policy priority
(``POLICY_COLUMNS``), and, only with an SSD tier, where a DRAM block's SSD
copy is (``FEATURE_COLUMNS``). It never holds payload bytes.

Layout: one numpy array per field (struct of arrays), indexed by *row*. The
key -> row map is an open-addressing hash table of int32 rows with linear
probing, also a numpy array (``kvstore/core/keytable.py``, probed in C when
``kvstore.core.ckeytable`` is built), so the index costs no Python object per block
(a ``dict`` entry alone would cost ~100 bytes). The tree of chains is the
``parent`` column alone, with each row's exact child count (``nchild``):
``subtree`` finds a block's descendants with no Python loop per block (none
to find when the roots' counts say so, else one pass over the rows in C,
``kvstore.core.ckeytable.descend``, or in numpy rounds), and "children in
the block's own tier" is found where a whole tier is scanned anyway
(``has_child_among``).

Invariants (checked by ``check_invariants`` in tests):
- every non-free row's parent is a non-free row of the same namespace, or -1;
- ``nchild[r]`` equals the number of rows whose parent is ``r``;
- where ``depth`` is kept: 0 for a chain's first block, else its parent's plus one;
- a reserved row is invisible to ``find_committed``.

The index is owned by one ``TieredStore``; it has no locks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from kvstore.core.keytable import HASHTAB, KeyTable, key_bytes
from kvstore.core.keytable import keys_to_array as keys_to_array  # (re-exported: its home was here)
from kvstore.core.levels import descend_within, levels_within
from kvstore.reserve import RESERVE_ROWS, Reserved, grow_in, resident
from tiers.base import T_SSD
from tiers.slots import SLOT_ALIGN

NO_ROW = -1
"""No row: a missing key, or the parent of a chain's first block."""
IN_BATCH = -2
"""Parent references given to ``BlockIndex.insert``: ``IN_BATCH - i`` (that
is ``-2 - i``) names "the row of keys[i]", an earlier key of the same batch,
whose row does not exist yet. Any value ``<= IN_BATCH`` is such a reference."""
NO_LOC = -1
"""``loc``/``ssd_loc`` of a row with no slot there (e.g. no SSD copy)."""
LOC_SHIFT = SLOT_ALIGN.bit_length() - 1
"""A slab tier's (HBM, DRAM) slot starts at a multiple of ``SLOT_ALIGN``:
``loc`` keeps its byte offset shifted right by this, in 32 bits (slabs up to
``tiers.slots.SLAB_LIMIT``); ``offsets`` gives it back. An SSD block's
``loc`` is its id, as it is."""

LINK_LOOP_MAX = 4
"""Non-chain inserts of up to this many keys link row by row; longer ones
link in one vectorised pass (``_link_batch``, same result)."""
HITS_MAX = 0xFFFF
"""``hits`` is 16 bits and saturates here (LFU and cost ranks stop counting;
ties fall to recency)."""
TICK_MAX = 0xFFFFFFFF
"""``last`` is a 32-bit access tick; before it would pass this the store
renumbers every row's tick by rank (``Placement.ticks``), keeping the order."""
GROWTH = 1.25
"""Row capacity grows by this factor (at least). A column that is copied on
growth (a shared one, or where no range could be reserved) has that much
slack at most, each row copied only a few times over the index's growth;
one grown in place (``kvstore/reserve.py``) costs only its rows."""


POLICY_COLUMNS = frozenset({"hits", "depth", "prio"})
"""Columns only some eviction policies rank with (``kvstore/core/eviction.py``:
``lfu`` ranks with ``hits``; ``cost`` with ``hits``, ``depth`` and its
GreedyDual value ``prio``; ``lru`` with none: ``last``, which every policy
keeps). The index keeps the ones in ``BlockIndex.kept`` (set on insert and
access) and leaves the others unwritten, so that, grown in place, they cost
no memory. A column newly kept starts from its empty value (``hits``: every
count 0, so a switch from ``lru`` to ``lfu`` ranks by recency until counts
build up), except ``depth``, computed then for every block (``keep``); a
policy computes its own (``prio``) when installed (``make_policy``)."""
FEATURE_COLUMNS = frozenset({"ssd_loc"})
"""Columns only a tier uses, kept once it is attached (``BlockIndex.track``;
``ssd_loc``: the SSD mover); a policy switch leaves them as they are."""
OPTIONAL_COLUMNS = POLICY_COLUMNS | FEATURE_COLUMNS


SHARED_COLUMNS = ("k0", "k1", "ns", "state", "tier", "loc", "size", "csum")
"""The columns a prefix lookup, and a read of DRAM blocks, need: what
``BlockIndex.share`` places in memory other processes map (with the key
table)."""

Alloc = Callable[[str, int, str], np.ndarray]
"""``alloc(name, length, dtype)``: a new array (contents undefined) for
``share``; ``name`` is a column of ``SHARED_COLUMNS`` or ``"table"``."""


class BlockState(IntEnum):
    FREE = 0
    RESERVED = 1
    COMMITTED = 2
    DOOMED = 3
    """Failed its checksum (or an ancestor did) while a reader still pins part
    of its subtree: invisible like a reserved block, freed when unpinned."""


S_FREE, S_RESERVED, S_COMMITTED, S_DOOMED = (int(s) for s in BlockState)
"""``BlockState`` values as plain ints, for numpy expressions on ``state``:
numpy compares or assigns an ``IntEnum`` member about 2 µs slower than an
int (it probes the enum class for ``__array_ufunc__``, which goes through
``EnumType.__getattr__`` and raises), and the put/get path does dozens."""


@dataclass(slots=True, frozen=True)
class Lookup:
    """Prefix lookup: ``hit`` leading blocks present; rows and tiers of those."""

    hit: int
    rows: np.ndarray
    tiers: np.ndarray


class BlockIndex:
    """Key -> block metadata, struct-of-arrays. See the module docstring."""

    COLUMNS: tuple[tuple[str, str, float], ...] = (
        ("k0", "u8", 0),
        ("k1", "u8", 0),
        ("ns", "u4", 0),
        ("state", "u1", 0),
        ("tier", "u1", 0),
        ("loc", "i4", NO_LOC),
        ("size", "u4", 0),
        ("csum", "u8", 0),
        ("parent", "i4", NO_ROW),
        ("nchild", "u4", 0),
        ("pins", "u2", 0),
        ("hits", "u2", 0),
        ("last", "u4", 0),
        ("depth", "u4", 0),
        ("prio", "f4", 0.0),
        ("ssd_loc", "i4", NO_LOC),
    )
    """Each column's name, dtype and the value of a row not in use: 66 bytes
    a row; 52 written under ``lru`` without an SSD tier (none of
    ``OPTIONAL_COLUMNS`` kept), 56 with one, 54 under ``lfu``."""

    k0: np.ndarray
    k1: np.ndarray
    ns: np.ndarray
    state: np.ndarray
    tier: np.ndarray
    loc: np.ndarray
    size: np.ndarray
    csum: np.ndarray
    parent: np.ndarray
    nchild: np.ndarray
    pins: np.ndarray
    hits: np.ndarray
    last: np.ndarray
    depth: np.ndarray
    prio: np.ndarray
    ssd_loc: np.ndarray
    """SSD id of an intact copy of a block read from DRAM, or -1 (32 bits:
    the SSD tier's ids stay below ``tiers.ssd_table.ID_LIMIT``)."""

    def __init__(self, initial_rows: int = 1024, *, native: bool = True, reserve: bool = True) -> None:
        """``native=False`` probes the key table in numpy even when the C
        helper is built (tests compare the two). ``reserve=False`` keeps
        the columns in plain numpy arrays grown by copying, as where no
        address range can be reserved (``kvstore/reserve.py``)."""
        cap = max(16, int(initial_rows))
        self._res: dict[str, Reserved] = {}
        """The columns that grow in place: their address ranges."""
        for name, dt, fill in self.COLUMNS:
            res = Reserved.make(dt, max(cap, RESERVE_ROWS)) if reserve else None
            if res is None:
                setattr(self, name, np.full(cap, fill, dtype=dt))
                continue
            self._res[name] = res
            col = res.view(cap)
            if fill:
                col[:] = fill
            setattr(self, name, col)
        self._cap = cap
        # Free rows as a stack (grown as rows are freed); rows [_high, cap) were never used.
        self._free = np.empty(0, dtype=np.int32)
        self._nfree = 0
        self._high = 0
        self.live = 0
        self._keys = KeyTable(0, native=native)
        self._descend = getattr(HASHTAB, "descend", None) if native else None
        """``ckeytable.descend`` (C), or None: ``descend_np``."""
        self._alloc: Alloc | None = None
        self.kept: frozenset[str] = frozenset()
        """The ``OPTIONAL_COLUMNS`` kept up to date (``keep``, ``track``): none
        until a policy that ranks with them is installed (the default, ``lru``,
        needs none) or a tier that uses one is attached."""

    def keep(self, columns: frozenset[str]) -> None:
        """Keep exactly ``columns`` of ``POLICY_COLUMNS`` (and the
        ``FEATURE_COLUMNS`` tracked) up to date from now on. A column newly kept starts from its empty value in every row (a
        row reused while it was not kept holds a stale value); one no longer
        kept gives its pages back where it grows in place. ``depth`` newly
        kept is computed for every row (``levels``: no loop per block)."""
        self._keep((frozenset(columns) & POLICY_COLUMNS) | (self.kept & FEATURE_COLUMNS))

    def _keep(self, columns: frozenset[str]) -> None:
        for name, _, fill in self.COLUMNS:
            if name == "depth" and name in columns and name not in self.kept:
                rows = self.used_rows()  # closed under parents: levels within it are depths
                self.depth[: self._high] = fill
                self.depth[rows] = self.levels(rows)
            elif name in columns and name not in self.kept:
                getattr(self, name)[: self._high] = fill
            elif name in self.kept and name not in columns and name in self._res:
                self._res[name].release()
        self.kept = columns

    def track(self, column: str) -> None:
        """Keep ``column`` of ``FEATURE_COLUMNS`` up to date from now on."""
        if column not in FEATURE_COLUMNS:
            raise ValueError(f"{column!r} is not one of {sorted(FEATURE_COLUMNS)}")
        self._keep(self.kept | {column})

    def share(self, alloc: Alloc) -> None:
        """From now on keep the ``SHARED_COLUMNS`` and the key table in
        arrays from ``alloc`` (the daemon's shared index,
        kvstore/daemon/shared_index.py): copied there now, and grown there.
        The caller holds whatever lock guards the index."""
        self._alloc = alloc
        for name, dt, _ in self.COLUMNS:
            if name in SHARED_COLUMNS:
                old = getattr(self, name)
                new = alloc(name, self._cap, dt)
                new[: self._high] = old[: self._high]  # rows past it are never read (``_grow_rows``)
                setattr(self, name, new)
                self._res.pop(name, None)  # its range is unmapped once the last view goes
        self._keys.share(alloc)

    # ------------------------------------------------------------------ sizing
    @property
    def nbytes(self) -> int:
        """Every byte the index holds: its columns (those grown in place as
        the pages the kernel backs for them), free-row stack and key table."""
        cols = sum(getattr(self, n).nbytes for n, _, _ in self.COLUMNS if n not in self._res)
        return int(cols + self.reserved_nbytes + self._free.nbytes + self._keys.nbytes)

    @property
    def reserved_nbytes(self) -> int:
        """What the kernel backs of the columns grown in place: memory
        ``tracemalloc`` does not see (``kvstore/reserve.py``)."""
        return resident(list(self._res.values()))

    def _grow_rows(self, need: int) -> None:
        """Room for ``need`` rows. A column in a reserved range grows as a
        longer view of it (no copy); the others are copied into arrays
        ``GROWTH`` times larger. Only rows below ``_high`` are copied, and
        nothing past them is filled: every column of a row is written when
        ``insert`` first uses it, and no reader looks past ``_high``. So a
        fresh mapping's pages past them (a reserved range, a file of the
        shared index, a large ``numpy.empty``) stay unbacked."""
        if need <= self._cap:
            return
        cap = max(need, int(self._cap * GROWTH))
        alloc, high = self._alloc, self._high
        for name, dt, _ in self.COLUMNS:
            old = getattr(self, name)
            res = self._res.get(name)  # (a column outside a range, shared or copied, stays outside)
            upto = high if name in self.kept or name not in OPTIONAL_COLUMNS else 0  # (one not kept: unread)
            got = grow_in(res, old, upto, cap) if res is not None else None
            if got is not None:
                new, self._res[name] = got
            else:
                self._res.pop(name, None)
                new = alloc(name, cap, dt) if alloc is not None and name in SHARED_COLUMNS else np.empty(cap, dt)
                new[:upto] = old[:upto]
            setattr(self, name, new)
        self._cap = cap

    @property
    def key_table(self) -> np.ndarray:
        """The key table's slots (int32 rows, -1 empty, -2 tombstone;
        kvstore/core/keytable.py): what a reader of the shared index probes."""
        return self._keys.table

    # ---------------------------------------------------------------- queries
    def find(self, ns: int, keys: np.ndarray) -> np.ndarray:
        """Rows of ``keys`` (n, 2) in namespace ``ns``, -1 where absent (any state)."""
        return self._keys.find(self.k0, self.k1, self.ns, self.state, keys, ns)

    def find_committed(self, ns: int, keys: np.ndarray) -> np.ndarray:
        return self._keys.find(self.k0, self.k1, self.ns, self.state, keys, ns, int(BlockState.COMMITTED))

    def lookup(self, ns: int, keys: np.ndarray) -> Lookup:
        """The leading committed keys of a chain: rows and tiers."""
        rows = self._keys.find(self.k0, self.k1, self.ns, self.state, keys, ns, int(BlockState.COMMITTED),
                               stop=True)
        return Lookup(int(rows.size), rows, self.tier[rows])

    def key_of(self, row: int) -> bytes:
        return key_bytes(int(self.k0[row]), int(self.k1[row]))

    def keys_of(self, rows: np.ndarray) -> list[bytes]:
        arr = np.empty((rows.size, 2), dtype="<u8")
        arr[:, 0] = self.k0[rows]
        arr[:, 1] = self.k1[rows]
        blob = arr.tobytes()
        return [blob[i : i + 16] for i in range(0, len(blob), 16)]

    def renumber_last(self) -> int:
        """Replace every used row's ``last`` by its rank (1, 2, ...) in
        access order, the order kept (ties by row); returns the next free
        tick. Called when the 32-bit tick would wrap."""
        rows = self.used_rows()
        order = np.lexsort((rows, self.last[rows]))
        self.last[rows[order]] = np.arange(1, rows.size + 1, dtype=np.uint32)
        return int(rows.size) + 1

    def used_rows(self) -> np.ndarray:
        return np.nonzero(self.state[: self._high] != S_FREE)[0]

    # -------------------------------------------------------------- mutation
    def insert(self, ns: int, keys: np.ndarray, parents: np.ndarray, tier: int,
               locs: np.ndarray, sizes: np.ndarray, state: BlockState, tick: int) -> np.ndarray:
        """Add absent, distinct keys; ``parents`` are rows (or -1); ``locs``
        as ``set_tier``'s.

        A parent may be one of the rows being inserted (given as
        ``plan.in_batch(i)``, that is ``IN_BATCH - i``, meaning "the row of
        keys[i]" with i earlier in this batch).
        Returns the new rows.
        """
        n = keys.shape[0]
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        st = int(state)  # a plain int: numpy assigns an IntEnum member ~2 µs slower
        take = min(n, self._nfree)
        rows = np.empty(n, dtype=np.int64)
        if take:
            rows[:take] = self._free[self._nfree - take : self._nfree][::-1]
            self._nfree -= take
        rest = n - take
        if rest:
            self._grow_rows(self._high + rest)
            rows[take:] = np.arange(self._high, self._high + rest)
            self._high += rest
        parents = np.asarray(parents, dtype=np.int64).copy()
        chain = n > 1 and bool((parents[1:] == np.arange(IN_BATCH, IN_BATCH + 1 - n, -1)).all())
        inbatch = parents <= IN_BATCH
        bpar = np.where(inbatch, IN_BATCH - parents, -1)  # the parent's position in the batch, or -1
        parents[inbatch] = rows[bpar[inbatch]]
        self.k0[rows] = keys[:, 0]
        self.k1[rows] = keys[:, 1]
        self.ns[rows] = ns
        self.state[rows] = st
        self.tier[rows] = tier
        self.loc[rows] = locs if tier == T_SSD else np.right_shift(locs, LOC_SHIFT)
        self.size[rows] = sizes
        self.csum[rows] = 0
        self.parent[rows] = parents
        self.nchild[rows] = 0
        self.pins[rows] = 0
        kept = self.kept
        if "hits" in kept:
            self.hits[rows] = 0
        if "prio" in kept:
            self.prio[rows] = 0.0
        self.last[rows] = np.arange(tick, tick + n, dtype=np.uint32)
        if "ssd_loc" in kept:
            self.ssd_loc[rows] = NO_LOC
        # child counts and (where kept) depths, in order (a parent may precede in the batch)
        if chain:  # each key the only child of the one before: link the head, count the rest
            self._link_rows(rows[:1], parents[:1])
            if "depth" in kept:
                self.depth[rows[1:]] = np.arange(1, n, dtype=np.int64) + int(self.depth[rows[0]])
            self.nchild[rows[:-1]] = 1
        elif n <= LINK_LOOP_MAX:
            self._link_rows(rows, parents)
        else:
            self._link_batch(rows, parents, bpar)
        self.live += n
        self._keys.insert(self.k0, self.ns, rows, self.used_rows)
        return rows

    def _link_rows(self, rows: np.ndarray, parents: np.ndarray) -> None:
        depth = self.depth if "depth" in self.kept else None
        for r, p in zip(rows.tolist(), parents.tolist()):
            if p >= 0:
                self.nchild[p] += 1
            if depth is not None:
                depth[r] = depth[p] + 1 if p >= 0 else 0

    def _link_batch(self, rows: np.ndarray, parents: np.ndarray, bpar: np.ndarray) -> None:
        """``_link_rows`` vectorised, with the same result: depths by pointer
        jumping over the in-batch parents (a parent precedes its children),
        where kept, and each parent's new children counted."""
        has = parents[parents >= 0]
        if has.size:
            pu, counts = np.unique(has, return_counts=True)
            self.nchild[pu] += counts.astype(np.uint32)
        if "depth" not in self.kept:
            return
        ext = (parents >= 0) & (bpar < 0)
        val = np.where(bpar >= 0, 1, 0).astype(np.int64)
        val[ext] = self.depth[parents[ext]].astype(np.int64) + 1
        anc = bpar.copy()
        for _ in range(64):  # depth sums along the in-batch path: O(log depth) rounds
            m = np.flatnonzero(anc >= 0)
            if not m.size:
                break
            up = anc[m]
            val[m], anc[m] = val[m] + val[up], anc[up]
        else:  # a batch deeper than 2**64 cannot exist; guard against a cycle
            raise AssertionError("insert: in-batch parents form a cycle")
        self.depth[rows] = val

    def children(self, r: int) -> np.ndarray:
        """The rows whose parent is ``r``, ascending (one vectorised pass
        over the rows: for tests and tools, not a hot path)."""
        return np.flatnonzero(self.parent[: self._high] == r)

    def has_child_among(self, rows: np.ndarray, among: np.ndarray) -> np.ndarray:
        """Mask of ``rows`` with a child among the rows ``among``: with
        ``among`` every block of one tier, the blocks with a child in that
        tier (one that may not leave it yet); with ``among`` every block of
        the other tiers, those with a child elsewhere. One scatter of
        ``among``'s parents, for callers that scan the tier anyway."""
        par = self.parent[among]
        mark = np.zeros(self._high, dtype=bool)
        mark[par[par >= 0].astype(np.int64)] = True  # (an int32 index scatters ~6x slower)
        return mark[rows]

    def subtree(self, roots: np.ndarray) -> np.ndarray:
        """The given rows (distinct or not) and all their descendants, once
        each, parents before children.

        No Python loop per block: where the roots' child counts show there
        is nothing below them to find (every root a leaf: the given order
        is kept; or every child of a root is itself a root: a reservation's
        chain aborted whole) no row is scanned; otherwise one pass over the
        rows finds the rest (``descend``). The rows found are returned by
        their ``levels`` within the set (ties by row): every parent before
        its children (the set has no gaps: a row's parent is in it unless
        the row is a root)."""
        roots = np.asarray(roots, dtype=np.int64).reshape(-1)
        if roots.size <= 1:
            if roots.size and self.nchild[roots[0]] == 0:
                return roots.copy()
        else:
            uniq, first = np.unique(roots, return_index=True)
            kids = self.nchild[uniq]
            if not kids.any():  # leaves only: none is another's parent
                return roots[np.sort(first)] if uniq.size < roots.size else roots.copy()
            par = self.parent[uniq].astype(np.int64)
            at = np.minimum(np.searchsorted(uniq, par), uniq.size - 1)
            if int(kids.sum()) == int(np.count_nonzero(uniq[at] == par)):  # closed under children
                return uniq[np.argsort(self.levels(uniq), kind="stable")]
        if not roots.size:
            return np.zeros(0, dtype=np.int64)
        found = np.flatnonzero(self.descend(roots) == 1)
        return found[np.argsort(self.levels(found), kind="stable")]

    def levels(self, rows: np.ndarray) -> np.ndarray:
        """For each of ``rows`` (distinct), how many of its ancestors are
        reached going up parent links within ``rows``: sorted by it, every
        parent among them precedes its children; over every used row (a set
        closed under parents) it is the depth. ``kvstore/core/levels.py``."""
        return levels_within(self.parent, rows)

    def descend(self, roots: np.ndarray) -> np.ndarray:
        """A mark per row below the high-water row: 1 for ``roots`` and every
        row below one of them, 2 (or, in numpy, 0) for the others. In C
        where built, else ``descend_np`` (the same rows)."""
        roots = np.ascontiguousarray(roots, dtype=np.int64)
        if self._descend is None:
            return self.descend_np(roots)
        mark = np.zeros(self._high, dtype=np.uint8)
        self._descend(self.parent, self._high, roots, mark)
        return mark

    def descend_np(self, roots: np.ndarray) -> np.ndarray:
        """``descend`` in numpy (``kvstore/core/levels.py`` ``descend_within``)."""
        return descend_within(self.parent, self._high, roots)

    def delete(self, rows: np.ndarray) -> None:
        """Remove rows that have no children outside ``rows`` (leaves first is
        not required: the whole set goes). Frees their table slots and rows."""
        if rows.size == 0:
            return
        rows = np.asarray(rows, dtype=np.int64)
        par = self.parent[rows]
        srt = np.sort(rows)
        inner = srt[np.minimum(np.searchsorted(srt, par), srt.size - 1)] == par  # parent goes too
        # children must be inside the set (rows are distinct; child counts match the lists)
        if int(self.nchild[rows].sum()) != int(np.count_nonzero(inner)):
            raise AssertionError("delete would orphan a child")
        self._keys.remove(self.k0, self.ns, rows)
        outer = par[~inner & (par >= 0)]  # parents that stay lose these children
        if outer.size == 1:
            self.nchild[outer[0]] -= 1
        elif outer.size:
            np.subtract.at(self.nchild, outer.astype(np.int64), 1)
        self.parent[rows] = NO_ROW
        self.state[rows] = S_FREE
        self.loc[rows] = NO_LOC
        if "ssd_loc" in self.kept:
            self.ssd_loc[rows] = NO_LOC
        self.pins[rows] = 0
        self.nchild[rows] = 0
        if self._nfree + rows.size > self._free.size:
            free = np.empty(max(self._nfree + rows.size, 2 * self._free.size), dtype=np.int32)
            free[: self._nfree] = self._free[: self._nfree]
            self._free = free
        self._free[self._nfree : self._nfree + rows.size] = rows
        self._nfree += rows.size
        self.live -= rows.size

    def set_tier(self, rows: np.ndarray, tier: int, locs: np.ndarray) -> None:
        """Move rows to another tier (new locations: byte offsets in a slab
        tier, SSD ids). Nothing else follows a tier: children in a block's
        own tier are found where needed (``has_child_among``)."""
        self.tier[rows] = tier
        self.loc[rows] = locs if tier == T_SSD else np.right_shift(locs, LOC_SHIFT)

    def set_offsets(self, rows: np.ndarray, offsets: np.ndarray) -> None:
        """New slots for ``rows`` in the slab tier they are in (byte offsets)."""
        self.loc[rows] = np.right_shift(offsets, LOC_SHIFT)

    def offsets(self, rows: np.ndarray) -> np.ndarray:
        """Byte offsets (int64) of ``rows``' slots in the slab tier they are in."""
        return np.left_shift(self.loc[rows], LOC_SHIFT, dtype=np.int64)  # (dtype: numpy 1.x would keep int32)

    def offset(self, row: int) -> int:
        return int(self.loc[row]) << LOC_SHIFT

    # ------------------------------------------------------------- checking
    def check_invariants(self) -> None:
        rows = self.used_rows()
        assert rows.size == self.live, (rows.size, self.live)
        nchild = np.zeros(self._cap, dtype=np.int64)
        par = self.parent[rows]
        has = par >= 0
        assert np.all(par < self._high), "parent past the rows in use"
        assert np.all(self.state[par[has]] != S_FREE), "parent is free"
        assert np.all(self.ns[par[has]] == self.ns[rows[has]]), "parent in another namespace"
        np.add.at(nchild, par[has], 1)
        assert np.array_equal(nchild[rows], self.nchild[rows].astype(np.int64)), "nchild"
        if "depth" in self.kept:
            dep = self.depth[rows].astype(np.int64)
            assert np.all(dep[~has] == 0), "a chain's first block has a depth"
            assert np.array_equal(dep[has], self.depth[par[has]].astype(np.int64) + 1), "depth"
        found = self.find_any(rows)
        assert np.array_equal(found, rows), "table does not map keys to their rows"
        assert self._keys.used <= self._keys.table.size * 0.7 + 1, "key table over its load"

    def find_any(self, rows: np.ndarray) -> np.ndarray:
        out = np.empty(rows.size, dtype=np.int64)
        for ns in np.unique(self.ns[rows]).tolist():
            sel = self.ns[rows] == ns
            # the numpy probe, whichever path placed the keys: the two must agree
            out[sel] = self._keys.probe(self.k0, self.k1, self.ns, self.k0[rows[sel]], self.k1[rows[sel]], ns)
        return out
