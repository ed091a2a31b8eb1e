"""Holds on blocks: the two-phase put (``reserve`` -> the client writes into
the returned slots -> ``commit``/``abort``) and leases (``acquire`` -> the
client reads the slots -> ``release``), with their expiry (``reap``,
``release_owner``) and explicit ``pin``/``unpin``.

A component of ``TieredStore`` (kvstore/core/store.py): it owns the two hold
tables and works on the blocks through ``Placement`` and the movers; it runs
on the store's single thread like everything else there.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.checksum import checksum
from kvstore.core.hbm_mover import HbmMover
from kvstore.core.index import S_COMMITTED, S_DOOMED, S_RESERVED, BlockIndex, BlockState, keys_to_array
from kvstore.core.namespaces import LEASES_EXPIRED, RESERVATIONS_EXPIRED
from kvstore.core.placement import Placement
from kvstore.core.ssd_mover import SsdMover
from kvstore.errors import InvalidArgument, KeyStatus, NotFound, PermissionDenied
from kvstore.keys import Namespace
from kvstore.results import BatchResult, DropReason, SlotResult
from tiers.base import T_HBM, T_SSD, TierKind

KeysLike = Sequence[bytes] | bytes | np.ndarray
"""Keys of a batch: 16-byte keys, their concatenation, or an (n, 2) uint64 array."""
PINS_LEASED_MAX = 0xFFFF - 1024
"""The index's ``pins`` is 16 bits: a lease is refused a block pinned this
often (a miss from there on), which leaves the store's own short pins (a
promotion, a write, room being made) their headroom below the wrap."""


@dataclass(slots=True)
class Hold:
    """A reservation (rows RESERVED) or a lease (rows pinned) of one owner."""

    owner: str
    ns: int
    rows: np.ndarray
    deadline: float
    marks: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    """A reservation's rows' keys (k0, k1) and slots when reserved: a row
    dropped meanwhile (a corrupt parent's subtree) may be reused by another
    reservation, which is not this one's to commit or abort."""

    def own(self, idx: BlockIndex) -> np.ndarray:
        """Which of its rows are still this reservation's (reserved, same namespace, key and slot)."""
        r = self.rows
        live = (idx.state[r] == S_RESERVED) & (idx.ns[r] == self.ns)
        if self.marks is not None:
            k0, k1, loc = self.marks
            live &= (idx.k0[r] == k0) & (idx.k1[r] == k1) & (idx.loc[r] == loc)
        return live

    def tail(self, keep: int) -> "Hold":
        """Its rows after the first ``keep``, as a hold of their own."""
        marks = None if self.marks is None else (self.marks[0][keep:], self.marks[1][keep:], self.marks[2][keep:])
        return Hold(self.owner, self.ns, self.rows[keep:], self.deadline, marks)


class Holds:
    """Reservations and leases; see the module docstring."""

    def __init__(self, place: Placement, *, clock: Callable[[], float], reservation_timeout: float,
                 ssd: SsdMover | None = None, hbm: HbmMover | None = None) -> None:
        self.placement = place
        self.index = place.index
        self.counters = place.counters
        self.clock = clock
        self.reservation_timeout = reservation_timeout
        self.ssd = ssd
        self.hbm = hbm
        self.reservations: dict[str, Hold] = {}
        """Open reservations by handle."""
        self.leases: dict[str, Hold] = {}
        """Open leases by handle."""
        self._salt = secrets.token_hex(6)
        self._seq = itertools.count(1)
        """Handles are this store's random salt and a sequence number: unique
        without a system call per hold (``token_hex`` read the OS's random
        source on every Reserve and Acquire). A handle is no credential: every
        use checks its owner."""

    # ------------------------------------------------------ two-phase put
    def reserve(self, ns: Namespace, keys: KeysLike, sizes: Sequence[int] | int,
                owner: str, parent: bytes | None = None, tier: TierKind | None = None) -> SlotResult:
        """Allocate slots for new blocks; they stay invisible until ``commit``.
        ``tier`` HBM asks for device slots (DRAM when there is no HBM tier or
        no room in it: ``tier_codes`` say where)."""
        nid = self.placement.nsid(ns)
        karr = keys_to_array(keys)
        n = karr.shape[0]
        if isinstance(sizes, int):
            sizes = [sizes] * n
        if len(sizes) != n:
            raise InvalidArgument(f"{n} keys but {len(sizes)} sizes")
        res = SlotResult.empty(n, KeyStatus.OK)
        todo, rows, locs = self.placement.store_rows(nid, karr, list(sizes), parent, BlockState.RESERVED, res, tier)
        if todo:
            handle = f"r-{self._salt}{next(self._seq):x}"
            idx = self.index
            self.reservations[handle] = Hold(owner, nid, rows, self.clock() + self.reservation_timeout,
                                             (idx.k0[rows], idx.k1[rows], idx.loc[rows]))
            res.handle = handle
            sel = np.asarray(todo, dtype=np.int64)
            res.tier_codes[sel] = self.index.tier[rows]
            res.offsets[sel] = locs
            res.lengths[sel] = self.index.size[rows]
        return res

    def _hold(self, table: dict[str, Hold], handle: str, owner: str, what: str) -> Hold:
        h = table.get(handle)
        if h is None:
            raise NotFound(f"{what} {handle!r} is not held (never granted, expired or ended already)")
        if h.owner != owner:
            raise PermissionDenied(f"{what} {handle!r} belongs to another client")
        return h

    def commit(self, handle: str, owner: str, checksums: Sequence[int] | None = None) -> BatchResult:
        """Make a reservation's blocks visible. Without ``checksums`` (xxh3_64
        per block, as the writer computed them) the store computes them."""
        h = self._hold(self.reservations, handle, owner, "reservation")
        del self.reservations[handle]
        idx = self.index
        rows = h.rows
        live = h.own(idx)
        rows = rows[live]
        par = idx.parent[rows].astype(np.int64)
        doomed = rows[(par >= 0) & (idx.state[np.maximum(par, 0)] == S_DOOMED)]
        if doomed.size:  # under a block found corrupt meanwhile: never visible (a miss)
            self.placement.drop(idx.subtree(doomed), DropReason.ABORTED)
            self.placement.sweep_doomed()
            live &= h.own(idx)
            rows = h.rows[live]
        res = BatchResult([KeyStatus.OK] * int(h.rows.size))
        for i in np.nonzero(~live)[0].tolist():
            res.statuses[i] = KeyStatus.MISS
        if rows.size == 0:
            return res
        if checksums is not None:
            if len(checksums) != h.rows.size:
                self.placement.drop(idx.subtree(rows), DropReason.ABORTED)
                raise InvalidArgument(f"{len(checksums)} checksums for {h.rows.size} reserved blocks")
            idx.csum[rows] = np.asarray(checksums, dtype=np.uint64)[live]
        else:
            on_hbm = idx.tier[rows] == T_HBM
            for r in rows[~on_hbm].tolist():
                idx.csum[r] = checksum(self.placement.dram.view(idx.offset(r), int(idx.size[r])))
            if self.hbm is not None and on_hbm.any():
                rows = self.hbm.commit_checksums(rows, h.rows, res)
                if rows.size == 0:
                    return res
        self.placement.committed(h.ns, rows)
        self.placement.count_put(h.ns, int(rows.size), int(idx.size[rows].sum()))
        return res

    def abort(self, handle: str, owner: str) -> int:
        h = self._hold(self.reservations, handle, owner, "reservation")
        del self.reservations[handle]
        return self.abort_rows(h)

    def abort_rows(self, h: Hold) -> int:
        """Drop the still-reserved rows of ``h`` (with their descendants)."""
        idx = self.index
        rows = h.rows[h.own(idx)]
        if rows.size == 0:
            return 0
        sub = idx.subtree(rows)
        self.placement.drop(sub, DropReason.ABORTED)
        self.placement.sweep_doomed()  # a corrupt parent kept for them goes now
        return int(rows.size)

    # ---------------------------------------------------------- acquire
    def acquire(self, ns: Namespace, keys: KeysLike, owner: str, ttl: float | None = None,
                promote: bool = True, tier: TierKind | None = None) -> SlotResult:
        """Pin the leading present blocks for a zero-copy read under a lease.
        Stops at the first miss (later blocks are useless without it). SSD
        blocks of the prefix are promoted into DRAM first (``promote``; else
        the lease stops at the first block not in DRAM). With ``ttl`` the
        lease is released by ``reap`` after that many seconds (for holders
        whose death the caller cannot observe). ``tier`` HBM: the caller maps
        the HBM slab (blocks are promoted into it); else every slot is in
        DRAM (HBM blocks are demoted first, see kvstore.core.hbm_mover)."""
        nid = self.placement.nsid(ns, create=False)
        karr = keys_to_array(keys)
        n = karr.shape[0]
        look = self.index.lookup(nid, karr)
        res = SlotResult.empty(n, KeyStatus.MISS)
        rows = look.rows
        found = look.tiers  # where each block was when asked: its hit is that tier's (it may move below)
        if rows.size and self.ssd is not None:
            rows = self._mappable_prefix(rows, promote)
        if rows.size and self.hbm is not None:
            rows = self.hbm.for_reader(rows, tier)
        full = np.flatnonzero(self.index.pins[rows] >= PINS_LEASED_MAX)
        if full.size:  # leased to its limit: a miss from there on (never a wrapped pin count)
            rows = rows[: int(full[0])]
        if rows.size == 0:
            self._count_get(n, rows)
            return res
        idx = self.index
        idx.pins[rows] += 1
        handle = f"l-{self._salt}{next(self._seq):x}"
        deadline = float("inf") if ttl is None else self.clock() + ttl
        self.leases[handle] = Hold(owner, nid, rows.copy(), deadline)
        res.handle = handle
        hit = rows.size
        res.statuses[:hit] = [KeyStatus.OK] * hit
        res.tier_codes[:hit] = idx.tier[rows]
        res.offsets[:hit] = idx.offsets(rows)
        res.lengths[:hit] = idx.size[rows]
        res.checksums[:hit] = idx.csum[rows]
        self._count_get(n, rows, found[:hit])
        return res

    def _count_get(self, asked: int, rows: np.ndarray, found: np.ndarray | None = None) -> None:
        """Count one get of ``asked`` keys that served ``rows`` (touched:
        eviction sees the access; ``found``: their tiers when asked)."""
        self.placement.served(rows, found)  # (with the blocks and bytes served)
        c = self.counters
        c.gets += 1
        c.get_blocks += max(int(asked), int(rows.size))

    def count_reads(self, nid: int, keys: KeysLike, asked: int) -> int:
        """Count a read a client made from the slab without a lease (the
        shared index, kvstore/wire/shared_index.py) as ``acquire`` counts
        one, and its blocks as accessed. Returns the blocks still present."""
        rows = self.index.find_committed(nid, keys_to_array(keys))
        rows = rows[rows >= 0]
        self._count_get(asked, rows)
        return int(rows.size)

    def _mappable_prefix(self, rows: np.ndarray, promote: bool) -> np.ndarray:
        """The leading rows readable from DRAM, promoting SSD ones if asked."""
        assert self.ssd is not None
        idx = self.index
        on_ssd = np.nonzero(idx.tier[rows] == T_SSD)[0]
        if on_ssd.size == 0:
            return rows
        if not promote:
            return rows[: int(on_ssd[0])]
        idx.pins[rows] += 1  # the DRAM part must not be evicted to make room
        try:
            sel = rows[on_ssd]
            done = 0
            for size in dict.fromkeys(idx.size[sel].tolist()):  # one size per namespace, normally
                part = sel[idx.size[sel] == size]
                ok = self.ssd.promote(part)
                done += int(ok.sum())
                if not ok.all():
                    break
        finally:
            idx.pins[rows] -= 1
            self.placement.sweep_doomed()
        live = (idx.state[rows] == S_COMMITTED) & (idx.tier[rows] != T_SSD)
        stop = np.nonzero(~live)[0]
        return rows[: int(stop[0])] if stop.size else rows

    def prefetch(self, ns: Namespace, keys: KeysLike) -> tuple[int, int, int]:
        """Queue the SSD blocks of a chain's hit prefix for promotion.
        Returns (hit blocks, of which in DRAM, queued now)."""
        nid = self.placement.nsid(ns, create=False)
        look = self.index.lookup(nid, keys_to_array(keys))
        rows = look.rows
        on_ssd = rows[self.index.tier[rows] == T_SSD]
        queued = self.ssd.queue_prefetch(on_ssd) if self.ssd is not None and on_ssd.size else 0
        return look.hit, int(rows.size - on_ssd.size), queued

    def release(self, handle: str, owner: str) -> int:
        h = self._hold(self.leases, handle, owner, "lease")
        del self.leases[handle]
        self.index.pins[h.rows] -= 1
        self.placement.sweep_doomed()
        return int(h.rows.size)

    def report_corrupt(self, ns: Namespace, keys: KeysLike) -> int:
        """A reader found bytes that fail their checksum: drop those blocks."""
        nid = self.placement.nsid(ns, create=False)
        rows = self.index.find_committed(nid, keys_to_array(keys))
        rows = rows[rows >= 0]
        if rows.size:
            self.placement.corrupt(rows)
        return int(rows.size)

    def release_owner(self, owner: str) -> tuple[int, int]:
        """Release every lease and abort every reservation of ``owner`` (its
        connection is gone). Returns (leases, reservations) ended."""
        leases = [k for k, h in self.leases.items() if h.owner == owner]
        for k in leases:
            self.release(k, owner)
        resv = [k for k, h in self.reservations.items() if h.owner == owner]
        for k in resv:
            self.abort(k, owner)
        return len(leases), len(resv)

    def reap(self, now: float | None = None) -> int:
        """Abort reservations and release leases past their deadline.
        Returns how many (counted for the store and for each hold's namespace)."""
        now = self.clock() if now is None else now
        counts = self.placement.namespaces.counts
        expired = [k for k, h in self.reservations.items() if h.deadline <= now]
        for k in expired:
            h = self.reservations.pop(k)
            self.abort_rows(h)
            counts[h.ns][RESERVATIONS_EXPIRED] += 1
        self.counters.reservations_expired += len(expired)
        stale = [k for k, h in self.leases.items() if h.deadline <= now]
        for k in stale:
            h = self.leases.pop(k)
            self.index.pins[h.rows] -= 1
            counts[h.ns][LEASES_EXPIRED] += 1
        self.placement.sweep_doomed()
        self.counters.leases_expired += len(stale)
        return len(expired) + len(stale)

    # ---------------------------------------------------------- pin/unpin
    def pin(self, ns: Namespace, keys: KeysLike) -> BatchResult:
        nid = self.placement.nsid(ns, create=False)
        rows = self.index.find_committed(nid, keys_to_array(keys))
        res = BatchResult([KeyStatus.OK if r >= 0 else KeyStatus.MISS for r in rows.tolist()])
        hit = rows[rows >= 0]
        np.add.at(self.index.pins, hit, 1)
        return res

    def unpin(self, ns: Namespace, keys: KeysLike) -> BatchResult:
        nid = self.placement.nsid(ns, create=False)
        idx = self.index
        rows = idx.find(nid, keys_to_array(keys))
        res = BatchResult([KeyStatus.MISS] * rows.size)
        for i, r in enumerate(rows.tolist()):
            if r < 0 or idx.state[r] not in (S_COMMITTED, S_DOOMED):
                continue
            if idx.pins[r] > 0:
                idx.pins[r] -= 1
                res.statuses[i] = KeyStatus.OK
            else:
                res.statuses[i] = KeyStatus.INVALID
                res.messages[i] = "block is not pinned"
        self.placement.sweep_doomed()
        return res

    # ------------------------------------------------- reservation surgery
    def reserved_blocks(self, handle: str) -> int | None:
        """How many blocks a reservation was granted (None: not held)."""
        h = self.reservations.get(handle)
        return None if h is None else int(h.rows.size)

    def truncate(self, handle: str, owner: str, keep: int) -> int:
        """Drop the blocks of a reservation after its first ``keep`` (with
        their descendants); the reservation stays open for the rest, and its
        ``commit`` answers MISS for the dropped ones. Returns blocks dropped."""
        h = self._hold(self.reservations, handle, owner, "reservation")
        if keep >= h.rows.size:
            return 0
        return self.abort_rows(h.tail(keep))

    def commit_prefix(self, handle: str, owner: str, keep: int, checksums: Sequence[int] | None = None) -> int:
        """Commit the first ``keep`` blocks of a reservation and abort the
        rest (with their descendants), in one step. ``checksums``: one per
        block granted (None, or too few: hashed here). Returns the blocks
        committed; 0 when the reservation is not held."""
        n = self.reserved_blocks(handle)
        if n is None:
            return 0
        if keep <= 0:
            self.abort(handle, owner)
            return 0
        self.truncate(handle, owner, keep)
        sums = [int(c) for c in checksums[:n]] if checksums is not None and len(checksums) >= n else None
        res = self.commit(handle, owner, sums)
        return sum(1 for s in res.statuses[:keep] if s is KeyStatus.OK)

    def quarantine(self, handle: str) -> bool:
        """Forget a reservation without freeing its slots: they stay reserved
        for good (a transport could not confirm that no late bytes will land
        in them). True when it was held."""
        return self.reservations.pop(handle, None) is not None

    def counts(self) -> tuple[int, int]:
        """(open leases, open reservations)."""
        return len(self.leases), len(self.reservations)
