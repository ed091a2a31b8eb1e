"""SSD tier: append-only segment files for the bytes, RocksDB for the index.

Layout decision (measured against RocksDB values with blob files, which write
each value twice and return new ``bytes``: docs/ssd.md): segment files + a
RocksDB index *is* the plain-file path plus one small RocksDB batch, ``preadv``
landing in the caller's buffers; ``bench/tiers.py`` measures it against the
plain file each run. Directory and file layout: tiers/ssd_dir.py.

Crash ordering. write: one ``pwritev`` per segment run + ``fdatasync`` (a new
segment's name is fsynced into the directory first; its room is
preallocated, and given back when it is sealed), then the batch's index
entries in one synced WriteBatch. free: index entries deleted (synced), bytes
become garbage. reclaim: live records copied + fsynced, index re-pointed
(synced), then the old segment unlinked. Open drops (counts) entries whose
segment is missing or short; an unreadable RocksDB moves to ``index.corrupt``
and is rebuilt from segment headers (a just-freed block may come back: its
bytes are right for its key). A read checks the on-disk header and the
caller's owner/size/checksum against the index and the payload's xxh3_64; a
mismatch is ``False``, the data is forgotten (the id stays allocated until
``free``), ``corrupt_count`` grows.

API (not thread-safe: the store serializes calls)::

    SsdTier(path, capacity_bytes, *, segment_bytes=64 MiB, sync=True, fs=None,
            gc_garbage_ratio=0.25, auto_reclaim=True)
    kind = TierKind.SSD; capacity_bytes; used_bytes (footprints of allocated
    ids); disk_bytes (segments incl. garbage + index + small files: du);
    garbage_bytes; counters corrupt_count, dropped_count, index_rebuilds
    footprint(nbytes) -> 88 + nbytes        # InvalidArgument: < 1 B or > capacity
    allocate(nbytes, count) -> int64 ids    # fewer/none past the budget or ID_LIMIT; never evicts
    free(locs)                              # ids already free are ignored
    write(locs, payloads, owners) -> uint64 xxh3_64s  # ENOSPC: CapacityError,
        # other I/O: Unavailable, nothing of the batch indexed; payload <= allocation
    read_into(locs, sizes, checksums, outs, owners=None) -> bool mask  # outs writable
    resize(capacity_bytes)                  # below used_bytes: CapacityError
    recover() -> [(loc, BlockMeta, size, checksum)]  # every live block, parents
        # before children, then by write sequence; recovered(): the same in arrays
    put_namespace(digest, descriptor); namespaces() -> {digest: descriptor}
    reclaim(max_bytes=None) -> net bytes freed  # segments with garbage >= ratio,
        # emptiest first, <= max_bytes of live data moved (>= 1 segment; None: all);
        # runs after a write (one segment) once garbage > max(segment, capacity/10)
    close(); context manager
    sync=False skips fdatasync and WAL syncs: for tests and setup only, not crash-safe

``fs`` (:class:`FileLayer`) does segment and small-file I/O (tests inject
ENOSPC or slow disks); RocksDB does its own, and after a RocksDB write error
the index is reopened and the batch retried once. A clean close leaves an
index snapshot that the next open reads instead of RocksDB (tiers/ssd_recover.py).
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import cast

import numpy as np
import rocksdict

from kvstore.buffers import as_u8
from kvstore.errors import CapacityError, InvalidArgument, KVStoreError, Unavailable
from tiers.base import BlockMeta, Buffer, TierKind
from tiers.ssd_dir import NamespaceFile, SsdDirectory
from tiers.ssd_format import (ALLOC, CLOEXEC, FREE, HEADER, HEADER_BYTES, IDENT_BYTES, LIVE,
                              LOCK_FILE, MAX_FDS, RECORD_MAGIC, RECORD_VERSION, VALUE, FileLayer,
                              OsFileLayer, ident_bytes, identity_arrays, io_error, loc_keys, record_checksum,
                              read_runs, vec_io, write_all, scan_segment, parse_index, Segment)
from tiers.ssd_table import DENSE_IDS, ID_LIMIT, U32_LIMIT, LocationTable
from tiers.ssd_recover import RecoveredBlocks, entries_to_keep, recovery_order, take_snapshot, write_snapshot

log = logging.getLogger("kvstore.ssd")


class SsdTier:
    """Segment files + RocksDB index. See the module docstring."""

    kind = TierKind.SSD

    def __init__(self, path: str, capacity_bytes: int, *, segment_bytes: int = 64 << 20, sync: bool = True,
                 fs: FileLayer | None = None, gc_garbage_ratio: float = 0.25, auto_reclaim: bool = True) -> None:
        if capacity_bytes <= 0:
            raise InvalidArgument(f"ssd capacity must be > 0 bytes, got {capacity_bytes}")
        if not HEADER_BYTES < segment_bytes < U32_LIMIT:
            raise InvalidArgument(f"segment_bytes must be > {HEADER_BYTES} and < 4 GiB, got {segment_bytes}")
        if not 0.0 < gc_garbage_ratio <= 1.0:
            raise InvalidArgument(f"gc_garbage_ratio must be in (0, 1], got {gc_garbage_ratio}")
        self.path = os.path.abspath(path)
        self.segment_bytes, self.sync, self.auto_reclaim = int(segment_bytes), bool(sync), bool(auto_reclaim)
        self.fs: FileLayer = fs if fs is not None else OsFileLayer()
        self.gc_garbage_ratio = float(gc_garbage_ratio)
        self._capacity, self._used = int(capacity_bytes), 0
        self.corrupt_count = self.dropped_count = self.index_rebuilds = 0
        self._segs: dict[int, Segment] = {}
        self._active: Segment | None = None
        self._active_fd, self._prealloc = -1, 0  # and the bytes preallocated for it
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._next_seg, self._seq, self._next_id = 1, 1, 0
        self._free_ids: list[int] = []
        self.table = LocationTable(0)  # per location: state, place, identity (tiers/ssd_table.py)
        self._alloc_arrays(1024)
        self._gc_buf = np.empty(0, dtype=np.uint8)
        self._closed = False
        self._db_clean = True  # RocksDB holds exactly the LIVE rows (a failed delete clears it)
        self._wo, self._wo_lazy = rocksdict.WriteOptions(), rocksdict.WriteOptions()
        self._wo.sync = self.sync
        self._dir = SsdDirectory(self.path, self.fs, self.sync)
        self._nsfile = NamespaceFile(self._dir)
        self._dir.prepare()
        self._lock_fd = os.open(os.path.join(self.path, LOCK_FILE), os.O_RDWR | os.O_CREAT | CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise Unavailable(f"ssd directory {self.path} is in use by another process") from None
            self._open()
        except BaseException:
            self._closed = True
            self._dir.close_db(getattr(self, "_db", None))  # (else its RocksDB lock outlives the tier)
            os.close(self._lock_fd)
            raise

    # ------------------------------------------------------------ open path
    def _open(self) -> None:
        self._nsfile.load()  # first: one of another version is refused before anything is changed
        self._segs = {sid: Segment(sid, size) for sid, size in self._dir.segments().items()}
        if last := max((sid for sid in self._segs if sid < U32_LIMIT), default=0):  # past 2^32: a damaged name
            self._dir.trim(self._seg_path(last))  # the segment being written when the last run stopped: its room back
        try:
            self._db = self._dir.open_db()
            locs, vals = take_snapshot(self.path, self._db) or self._read_index()
        except Exception as exc:  # noqa: BLE001 - any RocksDB failure: rebuild from segments
            log.warning("ssd index at %s unreadable (%s); rebuilding from segment headers", self.path, exc)
            locs, vals = self._rebuild_index()
        self._load(locs, vals)
        # from the segments left (one a damaged name made, that nothing points into, is gone): see _ensure_active
        self._next_seg = max(self._segs, default=0) + 1

    def _read_index(self) -> tuple[np.ndarray, np.ndarray]:
        """All block entries of the index as (locs, values): one pass over RocksDB."""
        items = cast("list[tuple[bytes, bytes]]", list(self._db.items()))
        locs, vals, bad = parse_index([k for k, _ in items], [v for _, v in items])
        if bad:
            self.dropped_count += len(bad)
            self._delete_keys(bad, sync=False)
        return locs, vals

    def _rebuild_index(self) -> tuple[np.ndarray, np.ndarray]:
        """Scan segment headers into a fresh index (the old one goes to index.corrupt)."""
        self.index_rebuilds += 1
        self._db = self._dir.fresh_index(getattr(self, "_db", None))
        found: dict[bytes, np.ndarray] = {}
        for sid in sorted(self._segs):
            scan_segment(self.fs, self._seg_path(sid), sid, self._segs[sid].size, found)
        vals = np.concatenate(list(found.values())) if found else np.zeros(0, dtype=VALUE)
        vals = vals[np.argsort(vals["ident"]["seq"], kind="stable")]
        locs = np.arange(vals.size, dtype=np.int64)
        self._put_values(locs, vals)
        log.warning("ssd index rebuilt: %d blocks from %d segments", vals.size, len(self._segs))
        return locs, vals

    def _load(self, locs: np.ndarray, vals: np.ndarray) -> None:
        """Check index entries against the segment files; build the in-memory state."""
        sizes, seg_ids = vals["ident"]["size"].astype(np.int64), vals["seg"].astype(np.int64)
        ids = sorted(self._segs)  # the segments' ids as named on disk: looked up sorted, never a dense map
        known = np.array([*ids, np.iinfo(np.int64).max], dtype=np.int64)  # a last one that is no segment
        at = np.searchsorted(known, seg_ids)
        have = np.where(known[at] == seg_ids, np.array([*(self._segs[s].size for s in ids), -1])[at], -1)
        bound = min(ID_LIMIT, max(4 * locs.size, DENSE_IDS))  # ids are dense: a far one is renumbered (DENSE_IDS)
        keep, moved, new, dropped = entries_to_keep(locs, vals, seg_ids, have, bound)
        if not keep.all() or moved.size:  # one synced batch: dropped entries go, far ones move to their new ids
            raw, w = vals[moved].tobytes(), VALUE.itemsize
            try:
                self._db_write([(k, None) for k in loc_keys(locs[~keep]) + loc_keys(locs[moved])]
                               + [(k, raw[i * w:(i + 1) * w]) for i, k in enumerate(loc_keys(new))], sync=True)
                locs = locs.copy()
                locs[moved] = new
            except KVStoreError as exc:  # the entries may survive; open drops them if their segment is gone
                self._db_clean = False
                log.warning("ssd index rewrite at open failed (%s); %d blocks at far ids dropped", exc, moved.size)
                keep[moved], dropped = False, dropped + moved.size
            locs, vals, sizes, seg_ids = locs[keep], vals[keep], sizes[keep], seg_ids[keep]
        self.dropped_count += dropped
        top = int(locs.max()) + 1 if locs.size else 0
        self._alloc_arrays(top)
        self._next_id = top
        self._state[locs], self._fp[locs], self._seg[locs], self._off[locs] = (
            LIVE, HEADER_BYTES + sizes, seg_ids, vals["off"].astype(np.int64))
        self.table.set_ident(locs, vals["ident"])
        self._used = int((HEADER_BYTES + sizes).sum())
        self._free_ids = np.flatnonzero(np.bincount(locs, minlength=top) == 0)[::-1].tolist()
        self._seq = int(vals["ident"]["seq"].max()) + 1 if locs.size else 1
        live = np.bincount(np.searchsorted(known, seg_ids), weights=HEADER_BYTES + sizes, minlength=known.size)
        for i, sid in enumerate(ids):
            self._segs[sid].live = int(live[i])
            try:
                if self._segs[sid].live == 0:
                    self._drop_segment(sid)
            except OSError as exc:  # kept (a later reclaim removes it): the blocks stored stay usable
                log.warning("ssd segment %d not removed at open: %s", sid, exc)

    def _alloc_arrays(self, cap: int) -> None:
        """Room for ``cap`` locations in the table (``tiers/ssd_table.py``)."""
        if self.table.grow(cap):
            self._state, self._fp, self._seg, self._off, self._size = (
                self.table.rows[f] for f in ("state", "fp", "seg", "off", "size"))

    # ------------------------------------------------------------- metadata
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def garbage_bytes(self) -> int:
        """Bytes in segments that no index entry points at (reclaimable).
        Figures like this one are read (stats) while the disk worker writes:
        they take a copy of the segments, never iterate the live dict."""
        return sum(s.size - s.live for s in list(self._segs.values()))

    @property
    def disk_bytes(self) -> int:
        """Bytes on disk: segments (incl. garbage, in 4 KiB blocks, and the
        active one's preallocated room) + index + small files."""
        total = sum(-(-s.size // 4096) * 4096 for s in list(self._segs.values())) + self._dir.small_files_bytes()
        if (act := self._active) is not None:  # the active segment's room, preallocated and not yet written
            total += max(0, self._prealloc - -(-act.size // 4096) * 4096)
        return total

    def footprint(self, nbytes: int) -> int:
        if nbytes <= 0:
            raise InvalidArgument(f"payload must be at least 1 byte, got {nbytes}")
        if HEADER_BYTES + int(nbytes) > min(self._capacity, U32_LIMIT - 1):
            raise InvalidArgument(f"payload of {nbytes} bytes can never fit the ssd tier "
                                  f"(capacity {self._capacity} bytes; blocks < 4 GiB)")
        return HEADER_BYTES + int(nbytes)

    def resize(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise InvalidArgument(f"ssd capacity must be > 0 bytes, got {capacity_bytes}")
        if capacity_bytes < self._used:
            raise CapacityError(f"cannot shrink the ssd tier to {capacity_bytes} bytes: "
                                f"{self._used} bytes are in use (evict first)")
        self._capacity = int(capacity_bytes)

    # ----------------------------------------------------------- allocation
    def allocate(self, nbytes: int, count: int) -> np.ndarray:
        fp = self.footprint(nbytes)
        count = max(0, min(int(count), (self._capacity - self._used) // fp,
                           len(self._free_ids) + ID_LIMIT - self._next_id))
        reuse = self._free_ids[len(self._free_ids) - min(count, len(self._free_ids)):]
        del self._free_ids[len(self._free_ids) - len(reuse):]
        fresh = count - len(reuse)
        ids = np.array(reuse[::-1] + list(range(self._next_id, self._next_id + fresh)), dtype=np.int64)
        self._next_id += fresh
        self._alloc_arrays(self._next_id)
        self._state[ids], self._fp[ids] = ALLOC, fp
        self._used += fp * count
        return ids

    def free(self, locs: np.ndarray) -> None:
        locs = np.unique(np.asarray(locs, dtype=np.int64).reshape(-1))
        locs = locs[(locs >= 0) & (locs < self._next_id)]
        locs = locs[self._state[locs] != FREE]
        if locs.size:
            self._forget(locs[self._state[locs] == LIVE], sync=True)
            self._state[locs] = FREE
            self._used -= int(self._fp[locs].sum())
            self._free_ids.extend(locs[::-1].tolist())

    def _forget(self, rows: np.ndarray, *, sync: bool) -> None:
        """Delete index entries (first), then count their records as garbage.
        The ids stay allocated."""
        if rows.size:
            self._delete_keys(loc_keys(rows), sync=sync)
            self._count_live(self._seg[rows], -(HEADER_BYTES + self._size[rows].astype(np.int64)))
            self._state[rows] = ALLOC

    def _count_live(self, seg_ids: np.ndarray, delta: np.ndarray) -> None:
        for sid, d in zip(seg_ids.tolist(), delta.tolist()):
            seg = self._segs.get(sid)
            if seg is not None:
                seg.live += d

    # --------------------------------------------------------------- index
    def _db_write(self, ops: list[tuple[bytes, bytes | None]], sync: bool) -> None:
        """One RocksDB WriteBatch (put; delete where the value is None); on
        failure the index is reopened and the batch retried once."""
        for attempt in (0, 1):
            wb = rocksdict.WriteBatch(raw_mode=True)
            for k, v in ops:
                if v is None:
                    wb.delete(k)
                else:
                    wb.put(k, v)
            try:
                self._db.write(wb, self._wo if sync else self._wo_lazy)
                return
            except Exception as exc:
                if attempt:
                    raise io_error(exc, "writing the index") from exc
                log.warning("ssd index write failed (%s); reopening the index", exc)
                try:
                    self._db.close()
                    self._db = self._dir.open_db()
                except Exception as exc2:
                    raise io_error(exc2, "reopening the index") from exc2

    def _put_values(self, locs: np.ndarray, vals: np.ndarray) -> None:
        raw, w = vals.tobytes(), VALUE.itemsize
        self._db_write([(k, raw[i * w:(i + 1) * w]) for i, k in enumerate(loc_keys(locs))], sync=True)

    def _delete_keys(self, keys: list[bytes], *, sync: bool) -> None:
        try:
            self._db_write([(k, None) for k in keys], sync=sync and self.sync)
        except KVStoreError as exc:  # the entry may survive; open drops it if its segment is gone
            self._db_clean = False
            log.warning("ssd index delete failed: %s", exc)

    # ------------------------------------------------------------ segments
    def _seg_path(self, sid: int) -> str:
        return os.path.join(self.path, f"seg-{sid:012d}.kvs")

    def _fd(self, sid: int) -> int:
        if self._active is not None and sid == self._active.id:
            return self._active_fd
        fd = self._fds.get(sid)
        if fd is None:
            fd = self._fds[sid] = self.fs.open(self._seg_path(sid), os.O_RDONLY | CLOEXEC)
            if len(self._fds) > MAX_FDS:
                self.fs.close(self._fds.popitem(last=False)[1])
        else:
            self._fds.move_to_end(sid)
        return fd

    def _seal(self) -> None:
        if self._active is not None:
            if self._prealloc > self._active.size:  # give back the room not written
                self._dir.trim_fd(self._active_fd, self._active.size)
            self._active, self._prealloc = None, 0
            self.fs.close(self._active_fd)
            self._active_fd = -1

    def _ensure_active(self, need: int) -> Segment:
        """The segment to append ``need`` bytes to: the active one while it has
        room (or is empty), else a new one (the full one is synced and sealed)."""
        act = self._active
        if act is not None and (act.size == 0 or act.size + need <= self.segment_bytes):
            return act
        if act is not None and self.sync:
            self.fs.fdatasync(self._active_fd)
        self._seal()
        if (sid := self._next_seg) >= U32_LIMIT:  # past the last id (2^32 written, or a damaged name found
            sid = min(set(range(1, len(self._segs) + 2)) - self._segs.keys())  # in a rebuild): the lowest free
        fd = self.fs.open(self._seg_path(sid), os.O_RDWR | os.O_CREAT | os.O_EXCL | CLOEXEC, 0o600)
        self._prealloc = self.segment_bytes if self.fs.preallocate(fd, self.segment_bytes) else 0
        self._next_seg += sid == self._next_seg
        seg = self._segs[sid] = Segment(sid, 0)
        self._active, self._active_fd = seg, fd
        try:
            self._dir.sync_dir()  # the name is durable before anything points at it
        except OSError:
            self._drop_segment(sid)  # nothing points in: the next new segment syncs the directory again
            raise
        return seg

    def _drop_segment(self, sid: int) -> int:
        """Unlink a segment no index entry points at; returns its size."""
        if self._active is not None and sid == self._active.id:
            self._seal()
        fd = self._fds.pop(sid, None)
        if fd is not None:
            self.fs.close(fd)
        try:
            self.fs.unlink(self._seg_path(sid))
        except FileNotFoundError:
            pass
        return self._segs.pop(sid).size

    def _append(self, records: list[list[np.ndarray]], lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Append records durably; returns (segment ids, offsets). On failure
        nothing points at the new bytes and CapacityError/Unavailable is raised."""
        n = len(records)
        segs, offs = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        i = 0
        try:
            while i < n:
                seg = self._ensure_active(int(lens[i]))
                start = pos = seg.size
                j = i
                while j < n and (j == i or pos + int(lens[j]) <= self.segment_bytes):
                    segs[j], offs[j] = seg.id, pos
                    pos += int(lens[j])
                    j += 1
                fd = self._active_fd
                try:
                    write_all(self.fs, fd, [b for r in records[i:j] for b in r], start)
                except OSError:
                    try:
                        self.fs.ftruncate(fd, start)  # give the partial bytes back (and the room)
                        self._prealloc = 0
                    except OSError:
                        seg.size = max(seg.size, pos)  # unknown tail: count it, write elsewhere
                        self._seal()
                    raise
                seg.size, i = pos, j
            if self.sync and self._active is not None:
                try:
                    self.fs.fdatasync(self._active_fd)
                except OSError:
                    self._seal()  # after a failed fsync the page cache cannot be trusted
                    raise
        except OSError as exc:
            raise io_error(exc, "appending to a segment") from exc
        return segs, offs

    # ------------------------------------------------------------ data path
    def write(self, locs: np.ndarray, payloads: Sequence[Buffer],
              owners: Sequence[BlockMeta] | None = None) -> np.ndarray:
        locs = np.asarray(locs, dtype=np.int64).reshape(-1)
        n = locs.size
        if owners is None or len(owners) != n or len(payloads) != n:
            raise InvalidArgument(f"ssd write needs one payload and one owner per location ({n} locations, "
                                  f"{len(payloads)} payloads, {0 if owners is None else len(owners)} owners)")
        if n == 0:
            return np.zeros(0, dtype=np.uint64)
        if (np.unique(locs).size != n or locs.min() < 0 or locs.max() >= self._next_id
                or np.any(self._state[locs] == FREE)):
            raise InvalidArgument("ssd write to locations that are not allocated (or repeated)")
        srcs = [as_u8(p) for p in payloads]
        sizes = np.fromiter((s.size for s in srcs), dtype=np.int64, count=n)
        if np.any(sizes <= 0) or np.any(HEADER_BYTES + sizes > self._fp[locs]):
            raise InvalidArgument("ssd write: a payload is empty or larger than its allocation")
        csums = np.fromiter((record_checksum(s) for s in srcs), dtype=np.uint64, count=n)
        hdr = np.zeros(n, dtype=HEADER)
        idn = hdr["ident"]
        idn["magic"], idn["version"], idn["size"], idn["csum"] = RECORD_MAGIC, RECORD_VERSION, sizes, csums
        idn["seq"] = np.arange(self._seq, self._seq + n, dtype=np.uint64)
        self._seq += n
        idn["ns"], idn["key"], idn["parent"], idn["plen"] = identity_arrays(owners)
        hb = hdr.view(np.uint8).reshape(n, HEADER_BYTES)
        hdr["hcrc"] = np.fromiter((record_checksum(hb[i, :IDENT_BYTES]) for i in range(n)), dtype=np.uint64, count=n)
        lens = HEADER_BYTES + sizes
        segs, offs = self._append([[hb[i], srcs[i]] for i in range(n)], lens)
        vals = np.zeros(n, dtype=VALUE)
        vals["seg"], vals["off"], vals["ident"] = segs, offs, idn
        self._put_values(locs, vals)  # raises with nothing visible on failure
        old = locs[self._state[locs] == LIVE]  # overwritten: the old records become garbage
        self._count_live(self._seg[old], -(HEADER_BYTES + self._size[old].astype(np.int64)))
        self._state[locs], self._seg[locs], self._off[locs] = LIVE, segs, offs
        self.table.set_ident(locs, idn)
        self._count_live(segs, lens)
        if self.auto_reclaim and self.garbage_bytes > max(self.segment_bytes, self._capacity // 10):
            try:
                self.reclaim(self.segment_bytes)
            except KVStoreError as exc:
                log.warning("ssd background reclaim failed: %s", exc)
        return csums

    def read_into(self, locs: np.ndarray, sizes: np.ndarray, checksums: np.ndarray,
                  outs: Sequence[Buffer], owners: Sequence[BlockMeta] | None = None) -> np.ndarray:
        locs = np.asarray(locs, dtype=np.int64).reshape(-1)
        n = locs.size
        ok = np.zeros(n, dtype=bool)
        if n == 0:
            return ok
        sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
        checksums = np.asarray(checksums, dtype=np.uint64).reshape(-1)
        inrange = (locs >= 0) & (locs < self._next_id)
        rows = np.where(inrange, locs, 0)
        idn = self.table.ident(rows)
        dsts = [as_u8(o) for o in outs]
        # a buffer too small is the caller's miss, not the block's fault
        live = inrange & (self._state[rows] == LIVE) & (np.fromiter((d.size for d in dsts), np.int64, n) >= sizes)
        match = (idn["size"].astype(np.int64) == sizes) & (idn["csum"] == checksums)
        if owners is not None:
            ons, okey, _, _ = identity_arrays(owners)
            match &= np.all(idn["ns"] == ons, axis=1) & np.all(idn["key"] == okey, axis=1)
        hbuf = np.empty((n, HEADER_BYTES), dtype=np.uint8)
        todo = np.flatnonzero(live & match).tolist()
        segs, offs, szs = self._seg[rows].tolist(), self._off[rows].tolist(), sizes.tolist()
        got = read_runs(self.fs, self._fd, todo, segs, offs, szs, hbuf, dsts)
        same = np.all(hbuf[:, :IDENT_BYTES] == ident_bytes(idn), axis=1)
        for i in np.flatnonzero(got & same).tolist():
            ok[i] = record_checksum(dsts[i][:szs[i]]) == int(checksums[i])
        bad = np.unique(locs[live & ~ok])
        if bad.size:
            self.corrupt_count += int(bad.size)
            log.warning("ssd tier: %d blocks failed their identity/checksum check; dropped", bad.size)
            self._forget(bad, sync=False)
        return ok

    # -------------------------------------------------------------- reclaim
    def reclaim(self, max_bytes: int | None = None) -> int:
        freed = moved = 0
        while True:
            cands = [s for s in self._segs.values() if s.size - s.live >= self.gc_garbage_ratio * s.size
                     and (s.size > 0 or s is not self._active)]
            if not cands:
                return freed
            seg = min(cands, key=lambda s: s.live / max(s.size, 1))
            if seg.live > 0 and moved > 0 and max_bytes is not None and moved + seg.live > max_bytes:
                return freed
            if seg is self._active:
                self._seal()
            try:
                if seg.live > 0:
                    step = self._evacuate(seg)
                    moved, freed = moved + step, freed - step
                elif self.sync:  # deletes that pointed here are durable before the unlink
                    self._db.flush_wal(True)
                freed += self._drop_segment(seg.id)  # (a failed unlink keeps it for a later pass)
            except Exception as exc:  # noqa: BLE001 - stop this pass; nothing points at new bytes
                log.warning("ssd reclaim stopped: %s", exc)
                return freed

    def _evacuate(self, seg: Segment) -> int:
        """Copy a segment's live records (checked on the way) to the active
        segment and re-point the index at them (synced); returns bytes appended."""
        top = self._next_id
        rows = np.flatnonzero((self._state[:top] == LIVE) & (self._seg[:top] == seg.id))
        rows = rows[np.argsort(self._off[rows], kind="stable")]
        lens = HEADER_BYTES + self._size[rows].astype(np.int64)
        if self._gc_buf.size < int(lens.sum()):
            self._gc_buf = np.empty(int(lens.sum()), dtype=np.uint8)
        starts = (np.cumsum(lens) - lens).tolist()
        recs = [self._gc_buf[a:a + ln] for a, ln in zip(starts, lens.tolist())]
        idn = self.table.ident(rows)
        expect, csums = ident_bytes(idn), idn["csum"].tolist()
        good = np.zeros(rows.size, dtype=bool)
        fd = self._fd(seg.id)
        for k, (rec, off) in enumerate(zip(recs, self._off[rows].tolist())):
            try:
                good[k] = (vec_io(self.fs.preadv, fd, [rec], off) == rec.size
                           and np.array_equal(rec[:IDENT_BYTES], expect[k])
                           and record_checksum(rec[HEADER_BYTES:]) == csums[k])
            except OSError:
                pass
        if not good.all():
            self.corrupt_count += int((~good).sum())
            self._forget(rows[~good], sync=True)
        rows, lens = rows[good], lens[good]
        if not rows.size:
            return 0
        new_segs, new_offs = self._append([[r] for r, g in zip(recs, good) if g], lens)
        vals = np.zeros(rows.size, dtype=VALUE)
        vals["seg"], vals["off"], vals["ident"] = new_segs, new_offs, idn[good]
        self._put_values(rows, vals)
        self._seg[rows], self._off[rows] = new_segs, new_offs
        self._count_live(new_segs, lens)
        seg.live -= int(lens.sum())
        return int(lens.sum())

    # ------------------------------------------------------------- restart
    def recover(self) -> list[tuple[int, BlockMeta, int, int]]:
        """Every live block as (loc, owner, size, checksum), parents before children."""
        return self.recovered().as_list()

    def recovered(self) -> RecoveredBlocks:
        """``recover()`` in arrays (no Python object per block)."""
        rows = np.flatnonzero(self._state[:self._next_id] == LIVE)
        return recovery_order(self.table.fields(rows), rows)

    def put_namespace(self, digest: bytes, descriptor: bytes) -> None:
        """Persist a namespace descriptor (atomic rewrite of the namespaces file)."""
        self._nsfile.put(digest, descriptor)

    def namespaces(self) -> dict[bytes, bytes]:
        """Namespace digest -> descriptor bytes, as persisted."""
        return self._nsfile.all()

    # --------------------------------------------------------------- close
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._seal()
        if self._db_clean:  # the next open reads this instead of RocksDB
            rows = np.flatnonzero(self._state[:self._next_id] == LIVE)
            write_snapshot(self.path, self._db, rows, self.table.values(rows), self.sync)
        for fd in self._fds.values():
            self.fs.close(fd)
        self._fds.clear()
        try:
            self._db.close()
            self._dir.private_index()
        finally:
            os.close(self._lock_fd)

    def __enter__(self) -> SsdTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

