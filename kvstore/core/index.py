"""The block index: metadata only, kept compact and vectorised.

Per block the index holds its key, namespace, tier, location in that tier,
payload size and checksum, parent, cached-children counts, pins, hits, last
access, depth in its chain, state and a policy priority. It never holds
payload bytes.

Layout: one numpy array per field (struct of arrays), indexed by *row*. The
key -> row map is an open-addressing hash table of int32 rows with linear
probing, also a numpy array, so a lookup of a whole chain is a handful of
vectorised probe rounds instead of one dict access per key, and the index
costs no Python object per block (a ``dict[bytes, int]`` alone costs ~130
bytes per entry). Children are threaded through intrusive sibling lists
(first_child / next_sib / prev_sib) so removing a block can take its
descendants with it in O(descendants).

Invariants (checked by ``check_invariants`` in tests):
- every non-free row's parent is a non-free row of the same namespace, or -1;
- ``nchild[r]`` equals the number of rows whose parent is ``r``, and
  ``nchild_tier[r]`` the number of those in the same tier as ``r``;
- a reserved row is invisible to ``find_committed``.

The index is owned by one ``TieredStore``; it has no locks.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from itertools import repeat

import numpy as np

from kvstore.errors import InvalidArgument

NO_ROW = -1
"""No row: a missing key, or the parent of a chain's first block."""
IN_BATCH = -2
"""Parent references given to ``BlockIndex.insert``: ``IN_BATCH - i`` (that
is ``-2 - i``) names "the row of keys[i]", an earlier key of the same batch,
whose row does not exist yet. Any value ``<= IN_BATCH`` is such a reference."""
NO_LOC = -1
"""``loc``/``ssd_loc`` of a row with no slot there (e.g. no SSD copy)."""


_EMPTY = -1
_TOMB = -2
_MIX = np.uint64(0x9E3779B97F4A7C15)


class BlockState(IntEnum):
    FREE = 0
    RESERVED = 1
    COMMITTED = 2
    DOOMED = 3
    """Failed its checksum (or an ancestor did) while a reader still pins part
    of its subtree: invisible like a reserved block, freed when unpinned."""


_SHARED = -2
"""In the key-half map: more than one key starts with these 8 bytes."""
_DICT_LOOKUP_MAX = 2048
"""Chains up to this many keys are looked up through the key-half dict."""


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


@dataclass(slots=True, frozen=True)
class Lookup:
    """Prefix lookup: ``hit`` leading blocks present; rows and tiers of those."""

    hit: int
    rows: np.ndarray
    tiers: np.ndarray


class BlockIndex:
    """Key -> block metadata, struct-of-arrays. See the module docstring."""

    _COLUMNS: tuple[tuple[str, str, float], ...] = (
        ("k0", "u8", 0),
        ("k1", "u8", 0),
        ("ns", "u4", 0),
        ("state", "u1", 0),
        ("tier", "u1", 0),
        ("loc", "i8", NO_LOC),
        ("size", "u4", 0),
        ("csum", "u8", 0),
        ("parent", "i4", NO_ROW),
        ("first_child", "i4", NO_ROW),
        ("next_sib", "i4", NO_ROW),
        ("prev_sib", "i4", NO_ROW),
        ("nchild", "u4", 0),
        ("nchild_tier", "u4", 0),
        ("pins", "u4", 0),
        ("hits", "u4", 0),
        ("last", "u8", 0),
        ("depth", "u4", 0),
        ("prio", "f8", 0.0),
        ("ssd_loc", "i8", NO_LOC),
    )

    k0: np.ndarray
    k1: np.ndarray
    ns: np.ndarray
    state: np.ndarray
    tier: np.ndarray
    loc: np.ndarray
    size: np.ndarray
    csum: np.ndarray
    parent: np.ndarray
    first_child: np.ndarray
    next_sib: np.ndarray
    prev_sib: np.ndarray
    nchild: np.ndarray
    nchild_tier: np.ndarray
    pins: np.ndarray
    hits: np.ndarray
    last: np.ndarray
    depth: np.ndarray
    prio: np.ndarray
    ssd_loc: np.ndarray
    """SSD id of an intact copy of a block read from DRAM, or -1."""

    def __init__(self, initial_rows: int = 1024) -> None:
        cap = max(16, int(initial_rows))
        for name, dt, fill in self._COLUMNS:
            setattr(self, name, np.full(cap, fill, dtype=dt))
        self._cap = cap
        # Free rows as a stack; rows [_high, cap) were never used.
        self._free = np.empty(cap, dtype=np.int32)
        self._nfree = 0
        self._high = 0
        self.live = 0
        # Hash table of rows.
        tsize = 1 << max(5, (cap * 2 - 1).bit_length())
        self._table = np.full(tsize, _EMPTY, dtype=np.int32)
        self._tused = 0  # live + tombstones
        self._tpos = np.full(cap, -1, dtype=np.int32)  # row -> its table position (kept by _place)
        # namespace -> {first key half: row, or _SHARED when two keys share
        # it}: for ``lookup``, one dict probe per key (the second half is
        # checked against the row; _SHARED keys go through the table)
        self._bykey: dict[int, dict[int, int]] = {}

    # ------------------------------------------------------------------ sizing
    @property
    def nbytes(self) -> int:
        cols = sum(getattr(self, n).nbytes for n, _, _ in self._COLUMNS)
        return cols + self._free.nbytes + self._table.nbytes + self._tpos.nbytes

    def _grow_rows(self, need: int) -> None:
        cap = self._cap
        while cap < need:
            cap *= 2
        if cap == self._cap:
            return
        for name, dt, fill in self._COLUMNS:
            old = getattr(self, name)
            new = np.full(cap, fill, dtype=dt)
            new[: self._cap] = old
            setattr(self, name, new)
        free = np.empty(cap, dtype=np.int32)
        free[: self._nfree] = self._free[: self._nfree]
        self._free = free
        tpos = np.full(cap, -1, dtype=np.int32)
        tpos[: self._cap] = self._tpos
        self._tpos = tpos
        self._cap = cap

    # ------------------------------------------------------------ hash table
    def _home(self, k0: np.ndarray, ns: np.ndarray | int) -> np.ndarray:
        mask = np.uint64(self._table.size - 1)
        h = (k0 ^ (np.asarray(ns, dtype=np.uint64) * _MIX)) * _MIX
        return ((h >> np.uint64(29)) & mask).astype(np.int64)

    def _probe(self, k0: np.ndarray, k1: np.ndarray, ns: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows (or -1) and table positions (or -1) of the given keys."""
        n = k0.shape[0]
        rows = np.full(n, NO_ROW, dtype=np.int64)
        where = np.full(n, -1, dtype=np.int64)
        if n == 0 or self.live == 0:
            return rows, where
        table = self._table
        mask = table.size - 1
        pos = self._home(k0, ns)
        active = np.arange(n)
        for _ in range(table.size):
            p = pos[active]
            s = table[p]
            occupied = s >= 0
            sr = np.where(occupied, s, 0)
            match = occupied & (self.k0[sr] == k0[active]) & (self.k1[sr] == k1[active]) & (self.ns[sr] == ns)
            hit = active[match]
            rows[hit] = s[match]
            where[hit] = p[match]
            keep = ~(match | (s == _EMPTY))
            active = active[keep]
            if active.size == 0:
                break
            pos[active] = (pos[active] + 1) & mask
        return rows, where

    def _table_insert(self, rows: np.ndarray) -> None:
        """Insert rows whose keys are known absent and distinct. The rows must
        already be marked live (a rehash re-places every live row)."""
        if rows.size == 0:
            return
        if (self._tused + rows.size) * 10 > self._table.size * 7:
            self._rehash(self.live + rows.size)
        else:
            self._tused += self._place(rows)

    def _place(self, rows: np.ndarray) -> int:
        """Put rows into free table slots by linear probing, vectorised over
        the batch (one winner per contended slot per round). Returns how many
        empty (not tombstone) slots were taken."""
        table = self._table
        mask = table.size - 1
        pos = self._home(self.k0[rows], self.ns[rows])
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
                winners = rows[active[fi]]
                taken_empty += int(np.count_nonzero(table[upos] == _EMPTY))
                table[upos] = winners
                self._tpos[winners] = upos
                keep = np.ones(active.size, dtype=bool)
                keep[fi] = False
                active = active[keep]
            if active.size:
                pos[active] = (pos[active] + 1) & mask
        return taken_empty

    def _rehash(self, want_live: int) -> None:
        size = 1 << max(5, (max(want_live, 1) * 2 - 1).bit_length())
        live_rows = np.nonzero(self.state[: self._high] != BlockState.FREE)[0]
        self._table = np.full(size, _EMPTY, dtype=np.int32)
        self._tused = self._place(live_rows)

    # ---------------------------------------------------------------- queries
    def find(self, ns: int, keys: np.ndarray) -> np.ndarray:
        """Rows of ``keys`` (n, 2) in namespace ``ns``, -1 where absent (any state)."""
        n = keys.shape[0]
        if n > _DICT_LOOKUP_MAX:  # long batches: vectorised probing amortises better
            rows, _ = self._probe(keys[:, 0], keys[:, 1], ns)
            return rows
        # the key-half map holds every row: one dict probe per key instead of
        # probe rounds through tombstones; shared halves go through the table
        m = self._bykey.get(ns)
        if not m:
            return np.full(n, NO_ROW, dtype=np.int64)
        rows = np.fromiter(map(m.get, keys[:, 0].tolist(), repeat(NO_ROW, n)), dtype=np.int64, count=n)
        shared = rows == _SHARED
        if shared.any():
            rows[shared], _ = self._probe(keys[shared, 0], keys[shared, 1], ns)
        has = np.nonzero(rows >= 0)[0]
        if has.size:
            rows[has[self.k1[rows[has]] != keys[has, 1]]] = NO_ROW
        return rows

    def find_committed(self, ns: int, keys: np.ndarray) -> np.ndarray:
        rows = self.find(ns, keys)
        ok = rows >= 0
        ok[ok] = self.state[rows[ok]] == BlockState.COMMITTED
        return np.where(ok, rows, NO_ROW)

    def lookup(self, ns: int, keys: np.ndarray) -> Lookup:
        """The leading committed keys of a chain: rows and tiers."""
        if keys.shape[0] > _DICT_LOOKUP_MAX:  # long chains: vectorised probing amortises better
            rows = self.find_committed(ns, keys)
            bad = np.nonzero(rows < 0)[0]
        else:
            m = self._bykey.get(ns)
            got: list[int | None] = list(map(m.get, keys[:, 0].tolist())) if m else []
            if None in got:
                got = got[: got.index(None)]
            rows = np.asarray(got, dtype=np.int64)
            shared = rows == _SHARED
            if shared.any():
                rows[shared] = self.find(ns, keys[: rows.size][shared])
            ok = rows >= 0
            ok[ok] = (self.state[rows[ok]] == BlockState.COMMITTED) & (self.k1[rows[ok]] == keys[: rows.size, 1][ok])
            bad = np.nonzero(~ok)[0]
        hit = int(bad[0]) if bad.size else int(rows.size)
        hrows = rows[:hit]
        return Lookup(hit, hrows, self.tier[hrows])

    def key_of(self, row: int) -> bytes:
        return key_bytes(int(self.k0[row]), int(self.k1[row]))

    def keys_of(self, rows: np.ndarray) -> list[bytes]:
        arr = np.empty((rows.size, 2), dtype="<u8")
        arr[:, 0] = self.k0[rows]
        arr[:, 1] = self.k1[rows]
        blob = arr.tobytes()
        return [blob[i : i + 16] for i in range(0, len(blob), 16)]

    def used_rows(self) -> np.ndarray:
        return np.nonzero(self.state[: self._high] != BlockState.FREE)[0]

    # -------------------------------------------------------------- mutation
    def insert(self, ns: int, keys: np.ndarray, parents: np.ndarray, tier: int,
               locs: np.ndarray, sizes: np.ndarray, state: BlockState, tick: int) -> np.ndarray:
        """Add absent, distinct keys; ``parents`` are rows (or -1).

        A parent may be one of the rows being inserted (given as
        ``plan.in_batch(i)``, that is ``IN_BATCH - i``, meaning "the row of
        keys[i]" with i earlier in this batch).
        Returns the new rows.
        """
        n = keys.shape[0]
        if n == 0:
            return np.zeros(0, dtype=np.int64)
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
        parents[inbatch] = rows[IN_BATCH - parents[inbatch]]
        self.k0[rows] = keys[:, 0]
        self.k1[rows] = keys[:, 1]
        self.ns[rows] = ns
        self.state[rows] = state
        self.tier[rows] = tier
        self.loc[rows] = locs
        self.size[rows] = sizes
        self.csum[rows] = 0
        self.parent[rows] = parents
        self.first_child[rows] = NO_ROW
        self.next_sib[rows] = NO_ROW
        self.prev_sib[rows] = NO_ROW
        self.nchild[rows] = 0
        self.nchild_tier[rows] = 0
        self.pins[rows] = 0
        self.hits[rows] = 0
        self.last[rows] = np.arange(tick, tick + n, dtype=np.uint64)
        self.prio[rows] = 0.0
        self.ssd_loc[rows] = NO_LOC
        # depth and child links, in order (a parent may precede in the batch)
        if chain:  # each key the only child of the one before: link the head, thread the rest
            self._link_rows(rows[:1], parents[:1])
            self.depth[rows[1:]] = np.arange(1, n, dtype=np.int64) + int(self.depth[rows[0]])
            head = rows[:-1]
            self.first_child[head] = rows[1:]
            self.nchild[head] = 1
            self.nchild_tier[head] = 1  # one tier for the whole batch
        else:
            self._link_rows(rows, parents)
        self.live += n
        self._table_insert(rows)
        m = self._bykey.setdefault(ns, {})
        ks = keys[:, 0].tolist()
        if m.keys().isdisjoint(ks) and len(set(ks)) == n:
            m.update(zip(ks, rows.tolist()))
        else:
            for k, r in zip(ks, rows.tolist()):
                m[k] = _SHARED if k in m else r
        return rows

    def _link_rows(self, rows: np.ndarray, parents: np.ndarray) -> None:
        for r, p in zip(rows.tolist(), parents.tolist()):
            if p >= 0:
                self.depth[r] = self.depth[p] + 1
                self._link(p, r)
            else:
                self.depth[r] = 0

    def _link(self, p: int, r: int) -> None:
        head = int(self.first_child[p])
        self.next_sib[r] = head
        self.prev_sib[r] = NO_ROW
        if head >= 0:
            self.prev_sib[head] = r
        self.first_child[p] = r
        self.nchild[p] += 1
        if self.tier[p] == self.tier[r]:
            self.nchild_tier[p] += 1

    def _unlink(self, r: int) -> None:
        p = int(self.parent[r])
        if p < 0:
            return
        nxt = int(self.next_sib[r])
        prv = int(self.prev_sib[r])
        if prv >= 0:
            self.next_sib[prv] = nxt
        else:
            self.first_child[p] = nxt
        if nxt >= 0:
            self.prev_sib[nxt] = prv
        self.nchild[p] -= 1
        if self.tier[p] == self.tier[r]:
            self.nchild_tier[p] -= 1
        self.parent[r] = NO_ROW

    def children(self, r: int) -> list[int]:
        out = []
        c = int(self.first_child[r])
        while c >= 0:
            out.append(c)
            c = int(self.next_sib[c])
        return out

    def subtree(self, roots: np.ndarray) -> np.ndarray:
        """The given rows and all their descendants, parents before children."""
        out: list[int] = []
        stack = [int(r) for r in roots[::-1]]
        seen: set[int] = set()
        while stack:
            r = stack.pop()
            if r in seen:
                continue
            seen.add(r)
            out.append(r)
            c = int(self.first_child[r])
            kids = []
            while c >= 0:
                kids.append(c)
                c = int(self.next_sib[c])
            stack.extend(reversed(kids))
        return np.asarray(out, dtype=np.int64)

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
        where = self._positions(rows)
        for r in rows[~inner & (par >= 0)].tolist():
            self._unlink(r)
        self.parent[rows] = NO_ROW
        rns = self.ns[rows]
        groups = [rows] if bool((rns == rns[0]).all()) else [rows[rns == nid] for nid in np.unique(rns).tolist()]
        for part in groups:
            m = self._bykey[int(self.ns[part[0]])]
            for r, k in zip(part.tolist(), self.k0[part].tolist()):
                if m.get(k) == r:
                    del m[k]
        self._table[where] = _TOMB
        self._tpos[rows] = -1
        self.state[rows] = BlockState.FREE
        self.loc[rows] = NO_LOC
        self.ssd_loc[rows] = NO_LOC
        self.pins[rows] = 0
        self.first_child[rows] = NO_ROW
        self.nchild[rows] = 0
        self.nchild_tier[rows] = 0
        self._free[self._nfree : self._nfree + rows.size] = rows
        self._nfree += rows.size
        self.live -= rows.size

    def _positions(self, rows: np.ndarray) -> np.ndarray:
        """Table positions of live rows (rows are compared by identity)."""
        where = self._tpos[rows].astype(np.int64)
        if bool((where >= 0).all()) and bool((self._table[where] == rows).all()):
            return where
        return self._probe_positions(rows)

    def _probe_positions(self, rows: np.ndarray) -> np.ndarray:
        table = self._table
        mask = table.size - 1
        pos = self._home(self.k0[rows], self.ns[rows])
        out = np.full(rows.size, -1, dtype=np.int64)
        active = np.arange(rows.size)
        for _ in range(table.size):
            p = pos[active]
            s = table[p]
            match = s == rows[active]
            out[active[match]] = p[match]
            keep = ~match
            if np.any(s[keep] == _EMPTY):
                raise AssertionError("row missing from table")
            active = active[keep]
            if active.size == 0:
                break
            pos[active] = (pos[active] + 1) & mask
        return out

    def set_tier(self, rows: np.ndarray, tier: int, locs: np.ndarray) -> None:
        """Move rows to another tier (new locations), keeping child counts right."""
        for r, loc in zip(rows.tolist(), locs.tolist()):
            old = int(self.tier[r])
            if old == tier:
                self.loc[r] = loc
                continue
            p = int(self.parent[r])
            if p >= 0:
                pt = int(self.tier[p])
                if pt == old:
                    self.nchild_tier[p] -= 1
                if pt == tier:
                    self.nchild_tier[p] += 1
            self.tier[r] = tier
            self.loc[r] = loc
            same = 0
            c = int(self.first_child[r])
            while c >= 0:
                same += int(self.tier[c]) == tier
                c = int(self.next_sib[c])
            self.nchild_tier[r] = same

    # ------------------------------------------------------------- checking
    def check_invariants(self) -> None:
        rows = self.used_rows()
        assert rows.size == self.live, (rows.size, self.live)
        nchild = np.zeros(self._cap, dtype=np.int64)
        same = np.zeros(self._cap, dtype=np.int64)
        par = self.parent[rows]
        has = par >= 0
        assert np.all(self.state[par[has]] != BlockState.FREE), "parent is free"
        assert np.all(self.ns[par[has]] == self.ns[rows[has]]), "parent in another namespace"
        np.add.at(nchild, par[has], 1)
        np.add.at(same, par[has], (self.tier[par[has]] == self.tier[rows[has]]).astype(np.int64))
        assert np.array_equal(nchild[rows], self.nchild[rows].astype(np.int64)), "nchild"
        assert np.array_equal(same[rows], self.nchild_tier[rows].astype(np.int64)), "nchild_tier"
        found = self.find_any(rows)
        assert np.array_equal(found, rows), "table does not map keys to their rows"
        for r, k in zip(rows.tolist(), self.k0[rows].tolist()):
            assert self._bykey[int(self.ns[r])].get(k) in (r, _SHARED), "key map"

    def find_any(self, rows: np.ndarray) -> np.ndarray:
        out = np.empty(rows.size, dtype=np.int64)
        for ns in np.unique(self.ns[rows]).tolist():
            sel = self.ns[rows] == ns
            r, _ = self._probe(self.k0[rows[sel]], self.k1[rows[sel]], ns)
            out[sel] = r
        return out
