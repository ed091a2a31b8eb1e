"""The SSD tier's per-location table: one ``ROW`` per block id, grown as ids
are handed out.

A row holds the location's state and footprint, where its record is
(segment, offset) and the record's identity as the header on disk has it,
compactly: 70 bytes, against the 105 of a row that kept the 80 header bytes
as they are (``ident`` expands a row back into them). The header's magic and
version are the same in every record, the parent's length is one byte, size
and places fit 32 bits (``tiers/ssd.py`` bounds them), and the namespace
digest, the same for every block of a namespace, is a small id into the
digests this table has seen (``Digests``).

It grows in place within a reserved address range (kvstore/reserve.py):
the kernel backs the rows used, not the doubling capacity, and growing
copies nothing. Where no range can be reserved it is a plain array, copied
into one twice as large.
"""

from __future__ import annotations

import numpy as np

from kvstore.reserve import Reserved, grow_in, resident
from tiers.ssd_format import IDENT, RECORD_MAGIC, RECORD_VERSION, VALUE

ID_LIMIT = 1 << 31
"""Locations (block ids) stay below this: the block index keeps the id of a
DRAM block's SSD copy in 32 bits. A tier that would need more is full, and
a recovered entry at or past it gets a free id below it (dropped, a miss,
only where none is left)."""
DENSE_IDS = 1 << 20
"""Open keeps an index entry at its id only if that id is below
max(4 x entries, DENSE_IDS): ids are handed out reusing free ones first, so
live ids stay below the most blocks the tier ever held; one past the bound
is damaged or a survivor of a far larger past, and its entry is moved to the
lowest free id below the bound (tiers/ssd_recover.py ``entries_to_keep``),
so such an id never sizes the table or the free list and its block is not
lost (docs/ssd.md, "Restart")."""
U32_LIMIT = 1 << 32
"""Footprints, sizes, segment ids and offsets are kept in 32 bits: the tier
refuses larger blocks and segments, and drops a recovered entry past it."""

ROW = np.dtype([("state", "i1"), ("plen", "u1"), ("fp", "<u4"), ("seg", "<u4"), ("off", "<u4"),
                ("size", "<u4"), ("nsid", "<u4"), ("seq", "<u8"), ("csum", "<u8"),
                ("key", "u1", (16,)), ("parent", "u1", (16,))])
assert ROW.itemsize == 70


class Digests:
    """Namespace digests (16 bytes) <-> dense small ids, never reused: a
    tier holds blocks of few namespaces, each digest once here."""

    def __init__(self) -> None:
        self.ids: dict[bytes, int] = {}
        self.table = np.zeros((16, 16), dtype=np.uint8)
        """Digest of each id; past the ids given, zeros (what a row never
        written expands to)."""

    def intern(self, ns: np.ndarray) -> np.ndarray:
        """Ids of ``ns`` ((n, 16) uint8), new digests added: one dict probe
        per distinct digest, not per block."""
        if not ns.shape[0]:
            return np.zeros(0, dtype=np.uint32)
        half = np.ascontiguousarray(ns).view("<u8")
        lo, hi = half[:, 0], half[:, 1]
        if (lo == lo[0]).all() and (hi == hi[0]).all():  # one namespace: the common case
            return np.full(ns.shape[0], self._id(bytes(ns[0])), dtype=np.uint32)
        order = np.lexsort((lo, hi))
        sl, sh = lo[order], hi[order]
        starts = np.flatnonzero(np.r_[True, (sl[1:] != sl[:-1]) | (sh[1:] != sh[:-1])])
        first = np.zeros(order.size, dtype=bool)
        first[starts] = True
        group = np.cumsum(first) - 1  # each sorted position's distinct digest
        ids = np.array([self._id(bytes(ns[order[s]])) for s in starts.tolist()], dtype=np.uint32)
        out = np.empty(ns.shape[0], dtype=np.uint32)
        out[order] = ids[group]
        return out

    def _id(self, digest: bytes) -> int:
        i = self.ids.get(digest)
        if i is None:
            i = self.ids[digest] = len(self.ids)
            if i >= self.table.shape[0]:
                grown = np.zeros((max(16, 2 * i), 16), dtype=np.uint8)
                grown[:i] = self.table[:i]
                self.table = grown
            self.table[i] = np.frombuffer(digest, dtype=np.uint8)
        return i


class LocationTable:
    """``rows``: the table (a ``ROW`` array of at least the ids handed out)."""

    def __init__(self, rows: int = 1024) -> None:
        self.range: Reserved | None = None
        self.rows = np.zeros(0, dtype=ROW)
        self.digests = Digests()
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

    def set_ident(self, locs: np.ndarray, idn: np.ndarray) -> None:
        """Keep identities ``idn`` (``IDENT`` records, as on disk) at ``locs``;
        their sizes below ``U32_LIMIT``."""
        rows = self.rows
        rows["plen"][locs] = idn["plen"]
        rows["size"][locs] = idn["size"]
        rows["nsid"][locs] = self.digests.intern(idn["ns"])
        rows["seq"][locs], rows["csum"][locs] = idn["seq"], idn["csum"]
        rows["key"][locs], rows["parent"][locs] = idn["key"], idn["parent"]

    def fields(self, locs: np.ndarray) -> dict[str, np.ndarray]:
        """The identity fields at ``locs`` (``IDENT``'s names but magic and
        version), each gathered on its own: what a restart's ordering reads."""
        rows = self.rows
        out = {f: rows[f][locs] for f in ("plen", "size", "seq", "csum", "key", "parent")}
        out["ns"] = self.digests.table[rows["nsid"][locs]]
        return out

    def ident(self, locs: np.ndarray) -> np.ndarray:
        """The identities at ``locs`` as the headers on disk hold them (``IDENT``)."""
        out = np.zeros(np.size(locs), dtype=IDENT)
        out["magic"], out["version"] = RECORD_MAGIC, RECORD_VERSION
        for f, col in self.fields(locs).items():
            out[f] = col
        return out

    def values(self, locs: np.ndarray) -> np.ndarray:
        """The index entries (``VALUE``: place and identity) of ``locs``."""
        out = np.zeros(locs.size, dtype=VALUE)
        out["seg"], out["off"], out["ident"] = self.rows["seg"][locs], self.rows["off"][locs], self.ident(locs)
        return out

    @property
    def nbytes(self) -> int:
        """Its memory: the pages backed in its range (``mincore``), or the
        whole array where it is copied on growth; and the digests."""
        held = resident([self.range]) if self.range is not None else int(self.rows.nbytes)
        return held + int(self.digests.table.nbytes)
