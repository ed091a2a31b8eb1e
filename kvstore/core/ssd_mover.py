"""Movement between the DRAM and SSD tiers: demote, promote, prefetch,
write-through copies, and recovery of the SSD tier at start.

The index keeps one *read place* per block (``tier``/``loc``) and, for a
block read from DRAM, optionally the location of an intact SSD copy
(``ssd_loc``): a promoted block keeps its SSD copy, and a write-through copy
is made in the background, so evicting such a block from DRAM only drops the
DRAM slot. The index never names two places to read from.

- Evicting a DRAM block (policy order, leaf-first within DRAM): with an SSD
  copy, the read place moves to SSD; else, if the SSD write admission admits
  it (seen ``admit_min_hits`` times, within the write budget) or it has cached
  children (a chain is never cut in the middle), it is written to SSD (data
  first, index second) and moved; else it is dropped (and counted).
- Evicting from SSD: SSD-resident blocks with no cached child anywhere,
  policy order; then SSD copies of DRAM-resident blocks.
- Promotion (``Acquire``/``Get``/``Prefetch``): SSD blocks are read into new
  DRAM slots (checksum, namespace and key verified by the SSD tier), keep
  their SSD copy, and become DRAM blocks. A block failing verification is a
  miss and is dropped with its subtree.
- Background work (``TieredStore.background``): prefetches first, then
  write-through copies, then write-back demotion down to the low watermark,
  then SSD space reclaim; each call does a bounded amount so foreground calls
  interleave and never queue behind demotions.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np

from kvstore.core.eviction import close_upward, select_victims
from kvstore.core.index import NO_LOC, S_COMMITTED, BlockIndex
from kvstore.core.namespaces import BYTES_DEMOTED, BYTES_PROMOTED
from kvstore.core.placement import Placement
from kvstore.core.ssd_io import GuardedSsdTier, IoGate
from kvstore.core.ssd_restore import Recovery, restore_index
from kvstore.errors import CapacityError, InvalidArgument, KVStoreError
from kvstore.results import DropReason
from tiers.base import T_DRAM, T_SSD, BlockMeta, Buffer, TierKind
from tiers.ssd_admit import SsdAdmission

log = logging.getLogger("kvstore.core.ssd_mover")


class WriteMode(str, Enum):
    """When DRAM blocks are written to the SSD tier."""

    BACK = "back"
    """Demote on eviction (and in the background below the low watermark)."""
    THROUGH = "through"
    """Copy to SSD in the background soon after a put, so eviction only drops the DRAM copy."""

    @classmethod
    def parse(cls, value: str | WriteMode) -> WriteMode:
        if isinstance(value, WriteMode):
            return value
        try:
            return cls(str(value))
        except ValueError:
            raise InvalidArgument(f"ssd.write_mode {value!r}; allowed: {', '.join(m.value for m in cls)}") from None


WRITE_MODES = tuple(m.value for m in WriteMode)


@dataclass(slots=True, frozen=True)
class SsdSpec:
    path: str
    capacity_bytes: int
    admit_min_hits: int = 2
    write_budget_mbps: float = 0.0
    write_mode: WriteMode = WriteMode.BACK
    """``WriteMode.BACK``: demote on eviction; ``THROUGH``: copy to SSD in the
    background soon after a put, so eviction only drops the DRAM copy. A str
    ("back", "through") is accepted and converted."""
    low_watermark: float = 0.05
    """Write-back keeps at least this share of DRAM free in the background."""
    sync: bool = True
    segment_bytes: int = 64 << 20
    step_bytes: int = 8 << 20
    """Most bytes one background step moves."""
    prefetch_queue: int = 65536
    """Bounded prefetch queue (blocks); beyond it Prefetch queues nothing more."""
    shutdown_flush_seconds: float = 5.0
    """``flush`` at a clean shutdown stops after this long (write-back mode)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "write_mode", WriteMode.parse(self.write_mode))


class SsdMover:
    """Owns the SSD tier, its write admission and the movement queues."""

    def __init__(self, place: Placement, spec: SsdSpec, clock: Callable[[], float]) -> None:
        self.placement = place
        place.index.track("ssd_loc")  # a DRAM block's intact SSD copy (unwritten without this tier)
        self.spec = spec
        self.gate = IoGate()
        """Runs the slow file I/O (off the store lock on the daemon's disk worker)."""
        self.tier = GuardedSsdTier(spec.path, spec.capacity_bytes, sync=spec.sync, segment_bytes=spec.segment_bytes)
        self.admission = SsdAdmission(min_hits=spec.admit_min_hits, write_budget_mbps=spec.write_budget_mbps,
                                      clock=clock)
        self.prefetch_q: collections.deque[tuple[int, int, int]] = collections.deque()
        self.copy_q: collections.deque[tuple[int, int, int]] = collections.deque()
        self.demoted = 0
        self.promoted = 0
        self.dropped_cold = 0
        self.bytes_demoted = 0
        self.bytes_promoted = 0
        self.write_errors = 0
        self.refused: set[str] = set()
        """Namespaces (as sorted JSON) whose digest another namespace holds on SSD."""
        self.pending: dict[bytes, tuple[dict[str, object], int | None]] = {}
        """Namespaces whose descriptor could not be written yet (digest -> its registration)."""

    # ------------------------------------------------------------ helpers
    def meta(self, rows: np.ndarray) -> list[BlockMeta]:
        """What the SSD tier records beside each block (namespace, key, parent)."""
        place = self.placement
        idx = place.index
        keys = idx.keys_of(rows)
        out = []
        for r, k in zip(rows.tolist(), keys):
            p = int(idx.parent[r])
            out.append(BlockMeta(place.namespaces.digest(int(idx.ns[r])), k, idx.key_of(p) if p >= 0 else b""))
        return out

    def read(self, rows: np.ndarray, outs: Sequence[Buffer]) -> np.ndarray:
        """Verified reads of SSD blocks into host buffers."""
        idx = self.placement.index
        args = (idx.loc[rows].astype(np.int64), idx.size[rows].copy(), idx.csum[rows].copy(), outs, self.meta(rows))
        idx.pins[rows] += 1  # nothing takes them away while the read runs
        try:
            return self.gate.run(self.tier.read_into, *args)
        finally:
            idx.pins[rows] -= 1

    def free_copies(self, rows: np.ndarray) -> None:
        """Free the SSD copies of ``rows`` (blocks being dropped)."""
        idx = self.placement.index
        copies = rows[idx.ssd_loc[rows] >= 0]
        if copies.size:
            self.tier.free(idx.ssd_loc[copies])

    def on_stored(self, rows: np.ndarray) -> None:
        """New blocks were committed: count them for admission, queue write-through copies."""
        self.admission.seen(self.placement.index.keys_of(rows))
        self.queue_copy(rows)

    def on_read(self, rows: np.ndarray) -> None:
        """Blocks were read: count them for admission."""
        self.admission.seen(self.placement.index.keys_of(rows))

    def register_namespace(self, digest: bytes, ns_dict: Mapping[str, object], block_bytes: int | None) -> None:
        """Persist a namespace (and its payload size once known) for restarts.

        SSD records name their namespace by digest only. Should two different
        namespaces' digests collide, the one persisted first keeps the
        digest and the other's blocks are never written to SSD (evicting
        them drops them), so a restart cannot hand one's blocks to the other."""
        old = self.tier.namespaces().get(bytes(digest))
        if old is not None:
            try:
                theirs = json.loads(old)["namespace"]
            except (ValueError, KeyError, TypeError):
                theirs = None  # unreadable: recovery skipped it too; replace it
            if theirs is not None and theirs != dict(ns_dict):
                self.refused.add(json.dumps(dict(ns_dict), sort_keys=True))
                log.warning("ssd: namespace digest %s already names another namespace; blocks of %s stay "
                            "out of the ssd tier", bytes(digest).hex(), ns_dict)
                return
        doc = {"namespace": ns_dict, "block_bytes": block_bytes}
        try:
            self.tier.put_namespace(digest, json.dumps(doc, sort_keys=True).encode())
        except KVStoreError as e:
            # disk full or failing: puts into DRAM go on; until its descriptor
            # is written (retried before each SSD write), a namespace never
            # persisted keeps its blocks out of the SSD tier
            self.write_errors += 1
            if old is None:
                self.pending[bytes(digest)] = (dict(ns_dict), block_bytes)
            log.warning("ssd: namespace descriptor not written (%s)", e)
            return
        self.pending.pop(bytes(digest), None)

    def _ssd_room(self, nbytes: int, count: int, protect: np.ndarray) -> np.ndarray:
        """Up to ``count`` SSD ids, evicting SSD blocks (no cached children),
        then dropping the SSD copies of DRAM blocks. ``protect`` rows keep
        theirs: blocks being written, and DRAM blocks about to leave DRAM for
        their copy (a copy taken from under them would leave an SSD row with
        no SSD id)."""
        st = self.placement
        idx = st.index
        got = [self.tier.allocate(nbytes, count)]
        n = got[0].size
        while n < count:
            rows = idx.used_rows()
            on_ssd = idx.tier[rows] == T_SSD
            ssd = rows[on_ssd]
            # a block with a child in DRAM stays (the child needs its parent)
            blocked = ((idx.state[ssd] != S_COMMITTED) | (idx.pins[ssd] > 0)
                       | idx.has_child_among(ssd, rows[~on_ssd]))
            if protect.size:
                blocked |= np.isin(ssd, protect)
            victims = st.select(TierKind.SSD, ssd, blocked, count - n)
            if victims.size:
                st.drop(victims, DropReason.EVICTED)
            else:
                copies = rows[(idx.tier[rows] == T_DRAM) & (idx.ssd_loc[rows] >= 0)]
                if protect.size:
                    copies = copies[~np.isin(copies, protect)]
                if copies.size == 0:
                    break
                victims = select_victims(idx, st.policy, copies, count - n)
                self.tier.free(idx.ssd_loc[victims])
                idx.ssd_loc[victims] = NO_LOC
            more = self.tier.allocate(nbytes, count - n)
            got.append(more)
            n += more.size
        return np.concatenate(got)

    def _write(self, rows: np.ndarray, evict: bool = True, keep_copies: np.ndarray | None = None,
               demoting: bool = False) -> np.ndarray:
        """Write DRAM blocks ``rows`` to SSD (one call per size); returns the SSD ids
        (-1 where there was no room, the write failed or the DRAM bytes do
        not match their checksum: never written). ``evict`` False:
        into free SSD space only. ``keep_copies``: rows whose SSD copies must
        not be dropped to make room (``_ssd_room``). ``demoting``: the caller
        drops what is not written, so a mismatch is counted here."""
        st = self.placement
        idx = st.index
        out = np.full(rows.size, NO_LOC, dtype=np.int64)
        if rows.size == 0:
            return out
        for digest, (ns_dict, block_bytes) in list(self.pending.items()):
            self.register_namespace(digest, ns_dict, block_bytes)
        if self.refused or self.pending:
            blocked = self.refused | {json.dumps(d, sort_keys=True) for d, _ in self.pending.values()}
            names = {int(n): json.dumps(st.namespaces.get(int(n)).to_dict(), sort_keys=True) for n in np.unique(idx.ns[rows])}
            keep = np.fromiter((names[int(n)] not in blocked for n in idx.ns[rows]), bool, rows.size)
            if not keep.all():
                out[keep] = self._write(rows[keep], evict, keep_copies, demoting)
                return out
        sizes = idx.size[rows]
        if (sizes != sizes[0]).any():  # victims of several block sizes: SSD ids are sized one size a call
            for size in np.unique(sizes).tolist():
                sel = np.flatnonzero(sizes == size)
                out[sel] = self._write(rows[sel], evict, keep_copies, demoting)
            return out
        nbytes = int(sizes[0])
        idx.pins[rows] += 1  # in flight: not evicted, not reused
        try:
            protect = rows if keep_copies is None else np.concatenate([rows, keep_copies])
            locs = self._ssd_room(nbytes, rows.size, protect) if evict else self.tier.allocate(nbytes, rows.size)
            k = locs.size
            if k == 0:
                return out
            views = [st.dram.view(idx.offset(r), int(idx.size[r])) for r in rows[:k].tolist()]
            try:
                csums = self.gate.run(self.tier.write, locs, views, self.meta(rows[:k]))
            except KVStoreError as e:
                self.write_errors += 1
                self.tier.free(locs)
                log.warning("ssd write of %d blocks failed: %s", k, e)
                return out
            ok = csums == idx.csum[rows[:k]]
            if not np.all(ok):  # the DRAM copy no longer matches its checksum: never written
                self.tier.free(locs[~ok])
                if demoting:  # dropped by the caller (a copy keeps it in DRAM for its reader to find)
                    st.count_corrupt(rows[:k][~ok])
                    log.warning("ssd: %d blocks failed their checksum on demotion; dropped", int((~ok).sum()))
            out[:k] = np.where(ok, locs, NO_LOC)
            self.bytes_demoted += int(nbytes * int(ok.sum()))
            st.namespaces.count_blocks(idx.ns[rows[:k][ok]], BYTES_DEMOTED, nbytes)  # rows pinned: ns unchanged
            return out
        finally:
            idx.pins[rows] -= 1

    # ----------------------------------------------------------- eviction
    def evict_dram(self, victims: np.ndarray, keep: np.ndarray | None = None) -> np.ndarray:
        """Make DRAM room from ``victims`` (DRAM blocks, unpinned, closed under
        their DRAM descendants). ``keep``
        rows must stay stored: they are demoted even when not admitted.
        A victim that is not written to SSD is dropped with its subtree,
        unless a block of that subtree (in any tier) is pinned or being
        written; such a victim stays in DRAM, and so do its ancestors among
        ``victims`` and any victim a reader pinned while the write ran.
        Returns the victims left in DRAM."""
        st = self.placement
        idx = st.index
        stuck = victims[:0]
        st.policy.on_evict(idx, victims)
        copied = idx.ssd_loc[victims] >= 0
        has_copy = victims[copied]
        rest = victims[~copied]
        if rest.size:
            keys = idx.keys_of(rest)
            # a block keeping a child (one not leaving with it) must be demoted
            inset = np.zeros(idx.parent.size, dtype=np.int64)
            par = idx.parent[victims].astype(np.int64)
            np.add.at(inset, par[par >= 0], 1)
            must = idx.nchild[rest] > inset[rest]
            if keep is not None and keep.size:
                must |= np.isin(rest, keep)
            admit = self.admission.admit(keys, idx.size[rest].astype(np.int64)) | must
            # the parent of a demoted block is demoted too (chains stay whole)
            full = copied.copy()
            full[~copied] = admit
            admit = close_upward(idx, victims, full)[~copied]
            to_write = rest[admit]
            cold = rest[~admit]
            if to_write.size:
                ids = self._write(to_write, keep_copies=has_copy, demoting=True)
                written = to_write[ids >= 0]
                idx.ssd_loc[written] = ids[ids >= 0]
                has_copy = np.concatenate([has_copy, written])
                failed = to_write[ids < 0]
                cold = np.concatenate([cold, failed])
            sub = idx.subtree(cold)
            if st.held(sub).any():
                # a holder's block below (e.g. in hbm) is never dropped: which victims hold one
                # (over every stored block, so only when the subtrees to drop hold any)
                held = st.held_below(cold)
                stuck, cold = cold[held], cold[~held]
                sub = idx.subtree(cold)
            if cold.size:
                self.dropped_cold += int(cold.size)
                st.drop(sub, DropReason.EVICTED)
                has_copy = has_copy[idx.state[has_copy] == S_COMMITTED]  # not dropped with a parent
        # a victim pinned while the write ran (the store lock is released
        # around it) is not moved; it and the stuck ones keep their ancestors
        pinned = has_copy[idx.pins[has_copy] > 0]
        if stuck.size or pinned.size:
            stay = victims[close_upward(idx, victims, np.isin(victims, np.concatenate([stuck, pinned])))]
            has_copy = has_copy[~np.isin(has_copy, stay)]
            stuck = stay[(idx.state[stay] == S_COMMITTED) & (idx.tier[stay] == T_DRAM)]
        if has_copy.size:
            self._move_to_ssd(has_copy)
        return stuck

    def _move_to_ssd(self, rows: np.ndarray) -> None:
        st = self.placement
        idx = st.index
        dram_locs = idx.offsets(rows)
        idx.set_tier(rows, int(TierKind.SSD), idx.ssd_loc[rows].copy())
        idx.ssd_loc[rows] = NO_LOC
        st.dram.free(dram_locs)
        self.demoted += int(rows.size)
        st.count_eviction(TierKind.DRAM, DropReason.DEMOTED, int(rows.size))
        st.emit_moved(rows, TierKind.DRAM, TierKind.SSD)

    # ---------------------------------------------------------- promotion
    def promote(self, rows: np.ndarray) -> np.ndarray:
        """Bring SSD blocks (a chain prefix, parents first) into DRAM.
        Returns a mask of rows now readable from DRAM; rows failing
        verification are dropped with their subtrees."""
        st = self.placement
        idx = st.index
        ok = np.zeros(rows.size, dtype=bool)
        if rows.size == 0:
            return ok
        nbytes = int(idx.size[rows[0]])
        idx.pins[rows] += 1
        try:
            locs = st.make_room(TierKind.DRAM, nbytes, rows.size, np.zeros(0, np.int64),
                                 for_ns=int(idx.ns[rows[0]]))
        finally:
            idx.pins[rows] -= 1
        k = locs.size
        if k == 0:
            return ok
        sel = rows[:k]
        outs = [st.dram.view(int(o), nbytes) for o in locs.tolist()]
        args = (idx.loc[sel].astype(np.int64), idx.size[sel].copy(), idx.csum[sel].copy(), outs, self.meta(sel))
        idx.pins[sel] += 1
        try:
            good = self.gate.run(self.tier.read_into, *args)
        finally:
            idx.pins[sel] -= 1
        if not np.all(good):
            first_bad = int(np.argmin(good))  # a chain stops at its first bad block
            st.dram.free(locs[first_bad:])
            st.corrupt(sel[first_bad:first_bad + 1])
            sel, locs = sel[:first_bad], locs[:first_bad]
        if sel.size:
            ssd_locs = idx.loc[sel].copy()
            idx.set_tier(sel, int(TierKind.DRAM), locs)
            idx.ssd_loc[sel] = ssd_locs  # keep the SSD copy: a later eviction is free
            self.promoted += int(sel.size)
            self.bytes_promoted += nbytes * int(sel.size)
            st.namespaces.count_blocks(idx.ns[sel], BYTES_PROMOTED, nbytes)
            st.emit_moved(sel, TierKind.SSD, TierKind.DRAM)
        ok[: sel.size] = True
        return ok

    def queue_prefetch(self, rows: np.ndarray) -> int:
        idx = self.placement.index
        n = 0
        for r in rows.tolist():
            if len(self.prefetch_q) >= self.spec.prefetch_queue:
                break
            self.prefetch_q.append((r, int(idx.k0[r]), int(idx.k1[r])))
            n += 1
        return n

    def queue_copy(self, rows: np.ndarray) -> None:
        if self.spec.write_mode is not WriteMode.THROUGH:
            return
        idx = self.placement.index
        for r in rows.tolist():
            self.copy_q.append((r, int(idx.k0[r]), int(idx.k1[r])))

    def _take(self, q: collections.deque[tuple[int, int, int]], tier: TierKind, budget: int) -> np.ndarray:
        """Still-valid rows from a queue (same key, committed, in ``tier``)."""
        idx = self.placement.index
        out: list[int] = []
        seen: set[int] = set()
        size = -1
        while q and budget > 0:
            r, k0, k1 = q[0]
            live = (idx.state[r] == S_COMMITTED and int(idx.k0[r]) == k0 and int(idx.k1[r]) == k1
                    and idx.tier[r] == tier)
            if not live or r in seen or (tier == TierKind.DRAM and idx.ssd_loc[r] >= 0):
                q.popleft()
                continue
            if size >= 0 and int(idx.size[r]) != size:
                break  # one size per batch
            size = int(idx.size[r])
            out.append(r)
            seen.add(r)
            budget -= size
            q.popleft()
        return np.asarray(out, dtype=np.int64)

    # --------------------------------------------------------- background
    def step(self) -> bool:
        """One bounded unit of background work. True when more is pending."""
        st = self.placement
        idx = st.index
        budget = self.spec.step_bytes
        rows = self._take(self.prefetch_q, TierKind.SSD, budget)
        if rows.size:
            # promote in chain order (parents first): by levels within the batch
            self.promote(rows[np.argsort(idx.levels(rows), kind="stable")])
            return True
        rows = self._take(self.copy_q, TierKind.DRAM, budget)
        if rows.size:
            admit = self.admission.admit(idx.keys_of(rows), idx.size[rows].astype(np.int64))
            rows = rows[admit]
            ids = self._write(rows)
            idx.ssd_loc[rows[ids >= 0]] = ids[ids >= 0]
            return True
        if self.spec.write_mode is WriteMode.BACK:
            t = st.dram
            low = int(t.capacity_bytes * self.spec.low_watermark)
            free = t.capacity_bytes - t.used_bytes
            if free < low:
                cand = st.evictable(TierKind.DRAM)
                if cand.size:
                    size = max(1, int(np.median(idx.size[cand])))
                    k = max(1, min(budget // size, (low - free) // size + 1))
                    victims = st.victims(TierKind.DRAM, None, k)
                    if victims.size:
                        # more only while it makes progress (a held block below may keep them all)
                        return self.evict_dram(victims).size < victims.size
        if self.tier.garbage_bytes > self.spec.segment_bytes:
            # more only while reclaim makes progress: garbage spread thinly over
            # segments may stay above the threshold with nothing worth compacting
            return self.gate.run(self.tier.reclaim, budget) > 0 and self.tier.garbage_bytes > self.spec.segment_bytes
        return bool(self.prefetch_q or self.copy_q)

    # ------------------------------------------------------------ shutdown
    def flush(self, seconds: float | None = None) -> tuple[int, int]:
        """At a clean shutdown: write every DRAM block without an SSD copy
        to SSD, parents first (by depth), in bounded batches, for at most
        ``seconds`` (``spec.shutdown_flush_seconds``), into free SSD space
        only (nothing on SSD is evicted for it); it stops at a batch of which
        nothing could be written (disk full or failing). Parents go first, so
        a restart finds whole chains (a block whose parent could not be
        written is an orphan there and is dropped). Returns (blocks written,
        blocks left DRAM-only)."""
        limit = self.spec.shutdown_flush_seconds if seconds is None else seconds
        place = self.placement
        idx = place.index
        rows = idx.used_rows()
        rows = rows[(idx.state[rows] == S_COMMITTED) & (idx.tier[rows] == T_DRAM)
                    & (idx.ssd_loc[rows] < 0)]
        if rows.size == 0 or limit <= 0:
            return 0, int(rows.size)
        rows = flush_order(idx, rows)
        end = time.monotonic() + limit
        at = written = 0
        step = max(1, self.spec.step_bytes)
        while at < rows.size and time.monotonic() < end:
            size = int(idx.size[rows[at]])
            batch = rows[at : at + max(1, step // max(1, size))]
            batch = batch[idx.size[batch] == size]
            at += batch.size
            ids = self._write(batch, evict=False)
            ok = ids >= 0
            idx.ssd_loc[batch[ok]] = ids[ok]
            written += int(ok.sum())
            if not ok.any():
                break  # the disk is full or failing
        return written, int(rows.size) - written

    # ----------------------------------------------------------- recovery
    def recover(self) -> Recovery:
        """Rebuild index rows for every block the SSD tier holds (kvstore/core/ssd_restore.py)."""
        return restore_index(self.placement, self.tier)

    def close(self) -> None:
        self.tier.close()


def flush_order(idx: BlockIndex, rows: np.ndarray) -> np.ndarray:
    """``rows`` (committed) by depth in their chains, then size: every
    ancestor among them before its descendants, even with a block between
    them not among them, and one size per run. Depths over every used row
    (a set closed under parents: ``BlockIndex.levels``, no loop per block),
    or the ``depth`` column where the policy keeps it."""
    if "depth" in idx.kept:
        depth = idx.depth[rows]
    else:
        used = idx.used_rows()
        depth = idx.levels(used)[np.searchsorted(used, rows)]
    return rows[np.lexsort((idx.size[rows], depth))]


__all__ = ["WRITE_MODES", "CapacityError", "Recovery", "SsdMover", "SsdSpec", "WriteMode", "flush_order"]
