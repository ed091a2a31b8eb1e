"""Restart of the SSD tier, in arrays (tiers/ssd.py calls these).

- ``newest_per_name``: one index entry per (namespace, key), the newest.
- ``entries_to_keep``: the index entries open keeps, and new ids for far ones.
- ``recovery_order``: every live block with its parent's position, parents
  before children (by depth, then write sequence), as ``RecoveredBlocks``.
- The index snapshot: on a clean close the tier writes its live entries
  (locations and ``VALUE`` records, exactly what RocksDB holds) to one file,
  stamped with the RocksDB identity and sequence number. The next open reads
  that file instead of iterating RocksDB entry by entry (~3 µs an entry), if
  the stamp still matches (any later write to the index moves the sequence
  number; a fresh index has a new identity). It is removed once read; a
  crash simply means the slower path.

Names are matched by a 64-bit hash of their 32 bytes, checked byte for byte;
should two different names share a hash, these fall back to exact dicts.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiers.base import BlockMeta
from tiers.ssd_format import (CLOEXEC, HEADER_BYTES, INDEX_DIR, RECORD_MAGIC, RECORD_VERSION, VALUE, as_void,
                              record_checksum)
from tiers.ssd_table import U32_LIMIT

log = logging.getLogger("kvstore.ssd")

SNAPSHOT_FILE = "index.snapshot"
_SNAP_MAGIC = b"KVSNAP01"
_SNAP_HEAD = struct.Struct("<8sQQQ64s")  # magic, db sequence, entries, checksum, db identity
_C = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93], dtype=np.uint64)


def name_hash(names: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each row of an (n, 32) uint8 array."""
    w = np.ascontiguousarray(names).view("<u8")
    h = w[:, 0] * _C[0]
    for j in (1, 2, 3):
        h ^= w[:, j] * _C[j]
        h = (h ^ (h >> np.uint64(29))) * _C[0]
    return h


def newest_per_name(idn: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """Of the entries ``cand`` (positions into identities ``idn``), one per
    (namespace, key): the one with the highest sequence number."""
    if cand.size < 2:
        return cand
    names = np.concatenate([idn["ns"][cand], idn["key"][cand]], axis=1)  # per field: a structured gather is slow
    h = name_hash(names)
    o = np.argsort(h)
    same = np.flatnonzero(h[o][1:] == h[o][:-1])
    if not same.size:
        return cand
    tied = np.unique(np.concatenate([o[same], o[same + 1]]))  # entries sharing a hash: exact, by name
    best: dict[bytes, tuple[int, int]] = {}
    for j, sq, name in zip(tied.tolist(), idn["seq"][cand[tied]].tolist(), as_void(names[tied]).tolist()):
        if name not in best or sq > best[name][1]:
            best[name] = (j, sq)
    drop = np.setdiff1d(tied, np.asarray([j for j, _ in best.values()], dtype=np.int64))
    keep = np.ones(cand.size, dtype=bool)
    keep[drop] = False
    return cand[keep]


def entries_to_keep(locs: np.ndarray, vals: np.ndarray, seg_ids: np.ndarray, have: np.ndarray,
                    bound: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Which index entries (``locs``, ``VALUE`` records ``vals``) open keeps:
    those whose record fits its segment (``have``: the size of the segment
    ``seg_ids`` names, -1 where there is none) and whose header fields are
    sound, the newest per (namespace, key).

    A kept id that is negative or at or past ``bound`` gets the lowest id
    below it no other kept entry uses. Ids are reused lowest-freed-last, so
    a tier that once held far more blocks than it keeps can hold intact ones
    that far out: they are renumbered, not lost; only where no id is left
    below ``bound`` (``ID_LIMIT``) are they dropped. Returns (keep mask,
    positions of the kept entries to move, their new ids, entries dropped:
    unsound or left without an id; an older entry of a name is not counted)."""
    idn = vals["ident"]
    good = ((have >= 0) & (vals["off"].astype(np.int64) + HEADER_BYTES + idn["size"].astype(np.int64) <= have)
            & (idn["magic"] == RECORD_MAGIC) & (idn["version"] == RECORD_VERSION)
            & ((idn["plen"] == 0) | (idn["plen"] == 16)) & (seg_ids < U32_LIMIT) & (vals["off"] < U32_LIMIT)
            & (idn["size"] > 0) & (idn["size"] < U32_LIMIT - HEADER_BYTES))  # unsigned: not wrapped by the cast
    keep = np.zeros(locs.size, dtype=bool)
    keep[newest_per_name(idn, np.flatnonzero(good))] = True
    far = np.flatnonzero(keep & ((locs < 0) | (locs >= bound)))
    new = far  # (none to move: the usual open, no sort)
    if far.size:
        near = locs[keep & (locs >= 0) & (locs < bound)]
        new = np.setdiff1d(np.arange(min(bound, near.size + far.size), dtype=np.int64), near)[:far.size]
    keep[far[new.size:]] = False
    return keep, far[:new.size], new, int((~good).sum()) + far.size - new.size


@dataclass(slots=True)
class RecoveredBlocks:
    """Live blocks, parents before children. ``parent_pos`` is the position of
    a block's parent in these arrays, or -1 (no parent, or a parent the tier
    does not hold: ``has_parent`` tells which); ``rooted`` is False for blocks
    whose chain does not reach a root within the tier (an ancestor missing)."""

    locs: np.ndarray
    ns: np.ndarray
    keys: np.ndarray
    parents: np.ndarray
    has_parent: np.ndarray
    parent_pos: np.ndarray
    rooted: np.ndarray
    sizes: np.ndarray
    csums: np.ndarray

    def __len__(self) -> int:
        return int(self.locs.size)

    def as_list(self) -> list[tuple[int, BlockMeta, int, int]]:
        """As (loc, owner, size, checksum) tuples (one Python object per block)."""
        ns, keys, parents = (as_void(a).tolist() for a in (self.ns, self.keys, self.parents))
        hp, sizes, csums = self.has_parent.tolist(), self.sizes.tolist(), self.csums.tolist()
        return [(loc, BlockMeta(ns[i], keys[i], parents[i] if hp[i] else b""), sizes[i], csums[i])
                for i, loc in enumerate(self.locs.tolist())]


def _match(names: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Position in ``names`` (unique (n, 32) rows) of each ``wanted`` row, or -1."""
    if names.shape[0] == 0:
        return np.full(wanted.shape[0], -1, dtype=np.int64)
    h, hw = name_hash(names), name_hash(wanted)
    o = np.argsort(h)
    hs = h[o]
    if bool((hs[1:] == hs[:-1]).any()):  # a hash shared by two names: exact dict
        where = dict(zip(as_void(names).tolist(), range(names.shape[0])))
        return np.fromiter((where.get(k, -1) for k in as_void(wanted).tolist()), np.int64, wanted.shape[0])
    i = np.empty(hw.size, dtype=np.int64)
    oq = np.argsort(hw)  # sorted needles: a cache-friendly search (random ones cost ~10x)
    i[oq] = np.minimum(np.searchsorted(hs, hw[oq]), hs.size - 1)
    cand = o[i]
    ok = hs[i] == hw
    ok[ok] = (names[cand[ok]] == wanted[ok]).all(axis=1)
    return np.where(ok, cand, -1).astype(np.int64)


def recovery_order(ident: np.ndarray | Mapping[str, np.ndarray], rows: np.ndarray) -> RecoveredBlocks:
    """Blocks at locations ``rows`` (``ident``: their identities, one per
    row: ``IDENT`` records, or their fields by name), parents before
    children: by depth (hops to the top of the chain the tier holds), then
    write sequence."""
    n = rows.size
    ns, key, parent = ident["ns"], ident["key"], ident["parent"]  # field by field: fast
    seq = ident["seq"]
    has_parent = ident["plen"] != 0
    par = _match(np.concatenate([ns, key], axis=1), np.concatenate([ns, parent], axis=1))
    par[~has_parent] = -1
    # depth by pointer jumping (depth = hops to anc): O(log chain) rounds, capped for corrupt cycles
    depth, anc = (par >= 0).astype(np.int64), par.copy()
    for _ in range(64):
        m = np.flatnonzero(anc >= 0)
        if not m.size:
            break
        up = anc[m]
        depth[m], anc[m] = depth[m] + depth[up], anc[up]
    # the top of each chain (parent pointers jumped to a fixed point): rooted
    # when that top has no parent, not when its parent is missing or in a cycle
    nxt = np.where(par >= 0, par, np.arange(n))
    for _ in range(64):
        nn = nxt[nxt]
        if np.array_equal(nn, nxt):
            break
        nxt = nn
    rooted = ~has_parent[nxt] & (par[nxt] < 0)
    if depth.size and int(depth.max()) < 1 << 16:
        by_seq = np.argsort(seq)
        order = by_seq[np.argsort(depth[by_seq].astype(np.uint16), kind="stable")]
    else:
        order = np.lexsort((seq, depth))
    inv = np.empty(n, dtype=np.int64)
    inv[order] = np.arange(n)
    ppos = np.where(par >= 0, inv[np.maximum(par, 0)], -1)[order]
    return RecoveredBlocks(rows[order].astype(np.int64), ns[order], key[order], parent[order], has_parent[order],
                           ppos, rooted[order], ident["size"][order].astype(np.int64),
                           ident["csum"][order].astype(np.uint64))


# ----------------------------------------------------------------- snapshot
def db_stamp(path: str, db: Any) -> tuple[int, bytes] | None:
    """The sequence number and identity (64 bytes, padded) of the tier's
    RocksDB, or None when either cannot be read (then no snapshot is written
    or trusted)."""
    try:
        with open(os.path.join(path, INDEX_DIR, "IDENTITY"), "rb") as f:
            ident = f.read(64).strip()
        return int(db.latest_sequence_number()), ident.ljust(64, b"\0")
    except Exception:  # noqa: BLE001 - no stamp, no snapshot
        return None


def write_snapshot(path: str, db: Any, locs: np.ndarray, vals: np.ndarray, sync: bool) -> None:
    """Write the index entries (what ``db`` holds) to the tier directory
    ``path``, stamped (tmp + rename); any failure leaves no file."""
    stamp = db_stamp(path, db)
    if stamp is None:
        return
    body = np.ascontiguousarray(locs, dtype="<i8").tobytes() + np.ascontiguousarray(vals, dtype=VALUE).tobytes()
    head = _SNAP_HEAD.pack(_SNAP_MAGIC, stamp[0], int(locs.size), record_checksum(body), stamp[1])
    final = os.path.join(path, SNAPSHOT_FILE)
    tmp = final + ".tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb", closefd=False) as f:
                f.write(head)
                f.write(body)
            if sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)
    except OSError as exc:
        log.warning("ssd index snapshot not written (%s); the next open reads the index entry by entry", exc)
        try:
            os.unlink(tmp)
        except OSError:
            pass


def take_snapshot(path: str, db: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """The index entries of the snapshot in the tier directory ``path`` if it
    is intact and its stamp is ``db``'s; the file is removed either way.
    Never raises: any doubt means None (read RocksDB instead)."""
    final = os.path.join(path, SNAPSHOT_FILE)
    try:
        with open(final, "rb") as f:
            data = f.read()
        os.unlink(final)
    except OSError:
        return None
    try:
        stamp = db_stamp(path, db)
        if stamp is None or len(data) < _SNAP_HEAD.size:
            return None
        magic, seq, n, csum, ident = _SNAP_HEAD.unpack_from(data)
        body = memoryview(data)[_SNAP_HEAD.size:]
        if (magic != _SNAP_MAGIC or (seq, ident) != stamp or len(body) != n * (8 + VALUE.itemsize)
                or record_checksum(body) != csum):
            return None
        locs = np.frombuffer(body, dtype="<i8", count=n).astype(np.int64)
        return locs, np.frombuffer(body, dtype=VALUE, offset=8 * n, count=n).copy()
    except Exception as exc:  # noqa: BLE001 - a bad snapshot is only a slower open
        log.warning("ssd index snapshot unusable (%s); reading the index entry by entry", exc)
        return None


__all__ = ["SNAPSHOT_FILE", "RecoveredBlocks", "db_stamp", "name_hash", "newest_per_name", "recovery_order",
           "take_snapshot", "write_snapshot"]
