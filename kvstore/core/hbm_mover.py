"""Movement between the HBM and DRAM tiers: placement of new blocks in HBM,
demotion on eviction, promotion for readers that map HBM, and demotion for
readers that do not.

Which puts land in HBM (``hbm.admit``):

- ``reserve`` (default): only a Reserve (or ``TieredStore.reserve``/``put``)
  that asks for tier HBM. Every other put goes to DRAM exactly as without an
  HBM tier.
- ``all``: every put that does not name a tier, while HBM can make room.

A batch is placed in HBM whole or not at all: when HBM cannot make room for
all of it (every HBM block pinned), the batch goes to DRAM instead (the slot
descriptors say which tier each slot is in).

Eviction from HBM (policy order, tenant shares, leaf-first within HBM,
exactly as DRAM) *demotes*: the victims are copied into new DRAM slots (made
with ``TieredStore._make_room``, so DRAM in turn demotes to SSD or drops),
their checksums verified on the DRAM side, then the index moves them. A
victim that DRAM has no room for is dropped with its subtree (unless a block
of it is pinned or being written: then it stays); one whose copy
fails or whose bytes do not match is a miss (dropped, counted as corrupt).

Readers (``Acquire``): one that maps HBM (``tier=HBM``) gets the DRAM blocks
of its prefix promoted into HBM where room can be made (pinned blocks never
move: another reader is copying them); one that does not gets the HBM blocks
of its prefix demoted to DRAM first (the lease stops at a block that stays in
HBM because an HBM reader pins it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from kvstore.config import Config
from kvstore.core.eviction import select_victims
from kvstore.core.index import S_COMMITTED, S_RESERVED
from kvstore.core.placement import Placement
from kvstore.errors import CapacityError, InvalidArgument, KeyStatus
from kvstore.results import BatchResult, DropReason
from tiers.base import Buffer, TierKind
from tiers.hbm import CopyFn, HbmTier, MemInfo
from tiers.slots import check_slab_size

log = logging.getLogger("kvstore.hbm")


class AdmitMode(str, Enum):
    """Which puts land in HBM (module docstring)."""

    RESERVE = "reserve"
    """Only puts that ask for tier HBM."""
    ALL = "all"
    """Every put that does not name a tier, while HBM can make room."""

    @classmethod
    def parse(cls, value: str | AdmitMode) -> AdmitMode:
        if isinstance(value, AdmitMode):
            return value
        try:
            return cls(str(value))
        except ValueError:
            raise InvalidArgument(f"hbm.admit {value!r}; allowed: {', '.join(m.value for m in cls)}") from None


ADMIT_MODES = tuple(m.value for m in AdmitMode)
HBM, DRAM = TierKind.HBM, TierKind.DRAM


@dataclass(slots=True, frozen=True)
class HbmSpec:
    capacity_bytes: int
    device: str = "cpu"
    """torch device: "cuda:N", or "cpu" to run the tier logic on the host."""
    admit: AdmitMode = AdmitMode.RESERVE
    """Which puts land in HBM; a str ("reserve", "all") is accepted and
    checked when the tier starts."""
    page_bytes: int = 16 << 20
    slot_sizes: tuple[int, ...] = ()
    mem_get_info: MemInfo | None = field(default=None, compare=False)
    """Free-memory probe (device -> (free, total)); default torch.cuda.mem_get_info on CUDA."""
    copy_fn: CopyFn | None = field(default=None, compare=False)
    """Copy function (dst, src, stream); tests inject failures."""

    def __post_init__(self) -> None:
        check_slab_size("hbm", self.capacity_bytes)


def spec_from_config(config: Config) -> HbmSpec | None:
    """The HBM tier's spec, or None when it is off. With ``hbm.capacity`` set
    but no CUDA device (and not ``hbm.on_cpu``) it logs once that the tier is
    off and the daemon serves without it."""
    h = config.hbm
    if not h.capacity:
        return None
    admit, slots = AdmitMode(h.admit.value), tuple(config.dram.slot_sizes)
    if h.on_cpu:
        log.info("hbm tier on the host (hbm.on_cpu): %d bytes, no CUDA IPC", h.capacity)
        return HbmSpec(h.capacity, "cpu", admit=admit, page_bytes=h.page_size, slot_sizes=slots)
    count = cuda_device_count()
    if h.device >= count:
        what = "no CUDA device is present" if count == 0 else f"only {count} CUDA devices are present"
        log.warning("hbm tier off: hbm.capacity is %d bytes on device %d, but %s; serving without it",
                    h.capacity, h.device, what)
        return None
    return HbmSpec(h.capacity, f"cuda:{h.device}", admit=admit, page_bytes=h.page_size, slot_sizes=slots)


def cuda_device_count() -> int:
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:  # a broken driver is "no device"
        return 0


class HbmMover:
    """Owns the HBM tier and moves blocks between it and DRAM."""

    def __init__(self, place: Placement, spec: HbmSpec) -> None:
        self.admit = AdmitMode.parse(spec.admit)
        self.placement = place
        self.spec = spec
        self.tier = HbmTier(spec.capacity_bytes, device=spec.device, page_bytes=spec.page_bytes,
                            slot_sizes=spec.slot_sizes, mem_get_info=spec.mem_get_info, copy_fn=spec.copy_fn)
        self.pinned_dram = self.tier.register_host(place.dram.buf)
        log.info("hbm tier on %s: %d bytes, admit=%s, dram slab pinned: %s", self.tier.device,
                 self.tier.capacity_bytes, self.admit.value, self.pinned_dram)
        self.promoted = 0
        self.demoted = 0
        self.dropped = 0

    # ------------------------------------------------------------ placing
    def target(self, tier: TierKind | None) -> TierKind:
        """The tier new blocks go to, given what the caller asked for."""
        if tier is HBM or (tier is None and self.admit is AdmitMode.ALL):
            return HBM
        return DRAM

    def place(self, nbytes: int, count: int, protect: np.ndarray, for_ns: int | None) -> np.ndarray:
        """``count`` HBM slots, or none (the caller then uses DRAM). A batch
        that eviction could never make room for (larger than HBM, than its
        tenant's share of it, or than what is not pinned) and that the free
        slots do not hold demotes nothing."""
        try:
            whole = self.placement.evict_plan(HBM, nbytes, count, for_ns) >= count
            whole = whole or self.tier.free_slots(nbytes) >= count
        except InvalidArgument:  # a payload no HBM slot holds
            whole = False
        if not whole:
            return np.zeros(0, dtype=np.int64)
        locs = self.make_room(nbytes, count, protect, for_ns)
        if locs.size < count:
            self.tier.free(locs)
            return locs[:0]
        return locs

    def make_room(self, nbytes: int, count: int, protect: np.ndarray, for_ns: int | None = None) -> np.ndarray:
        """Up to ``count`` HBM slots, demoting HBM blocks (policy order,
        leaf-first) to DRAM as needed. ``protect`` rows are not moved."""
        t = self.tier
        try:
            cls = t.class_of(nbytes)
        except InvalidArgument:
            return np.zeros(0, dtype=np.int64)
        parts = [t.allocate(nbytes, count)]
        got = parts[0].size
        while got < count:
            victims = self._victims(cls, count - got, protect, for_ns, (count - got) * nbytes, True)
            if victims.size == 0:
                victims = self._victims(cls, 1, protect, None, 0, False)
                if victims.size == 0:
                    break
            moved = self.demote(victims, drop_unplaced=True)
            idx = self.placement.index
            stuck = victims[~moved]
            stuck = stuck[(idx.state[stuck] == S_COMMITTED) & (idx.tier[stuck] == HBM)]
            if stuck.size:  # neither moved nor dropped (a descendant is held): not a victim again
                protect = np.concatenate([protect, stuck])
            more = t.allocate(nbytes, count - got)
            parts.append(more)
            got += more.size
        return np.concatenate(parts)

    def _victims(self, cls: int, k: int, protect: np.ndarray, for_ns: int | None, incoming: int,
                 same_class: bool) -> np.ndarray:
        st = self.placement
        if not same_class:  # one leaf of another size class, to free its page
            cand = st.evictable(HBM)
            if cand.size and protect.size:
                cand = cand[~np.isin(cand, protect)]
            if cand.size:
                cand = cand[self.tier.classes_of_locs(st.index.offsets(cand)) != cls]
            return select_victims(st.index, st.policy, cand, 1)
        idx = st.index
        rows = idx.used_rows()
        rows = rows[idx.tier[rows] == HBM]
        blocked = (idx.state[rows] != S_COMMITTED) | (idx.pins[rows] > 0)
        if protect.size:
            blocked |= np.isin(rows, protect)
        if rows.size:
            blocked |= self.tier.classes_of_locs(idx.offsets(rows)) != cls
        return st.select(HBM, rows, blocked, k, for_ns, incoming)

    # ----------------------------------------------------------- movement
    def demote(self, rows: np.ndarray, drop_unplaced: bool) -> np.ndarray:
        """Copy HBM blocks into new DRAM slots and move them there. Returns the
        mask of rows now in DRAM. Rows DRAM has no room for are dropped with
        their subtrees when ``drop_unplaced`` (eviction) and none of a subtree is
        pinned or being written, else left in HBM."""
        st = self.placement
        idx = st.index
        moved = np.zeros(rows.size, dtype=bool)
        if rows.size == 0:
            return moved
        for size in dict.fromkeys(idx.size[rows].tolist()):
            where = np.nonzero(idx.size[rows] == size)[0]
            sel = rows[where]
            idx.pins[sel] += 1  # the copies read them: not evicted, not dropped meanwhile
            try:
                locs = st.make_room(DRAM, int(size), sel.size, np.zeros(0, np.int64), for_ns=int(idx.ns[sel[0]]))
            finally:
                idx.pins[sel] -= 1
            k = locs.size
            use = sel[:k]
            # (a failed SSD demotion may have dropped a subtree; a reader may have
            # leased a row while the SSD write ran with the store lock released)
            live = (idx.state[use] == S_COMMITTED) & (idx.tier[use] == HBM) & (idx.pins[use] == 0)
            if not live.all():
                st.dram.free(locs[~live])
                use, locs, where = use[live], locs[live], where[:k][live]
            else:
                where = where[:k]
            if use.size:
                views = [st.dram.view(int(o), int(size)) for o in locs.tolist()]
                ok = self.tier.read_into(idx.offsets(use), idx.size[use], idx.csum[use], views)
                good = use[ok]
                if not ok.all():
                    st.dram.free(locs[~ok])
                    log.warning("hbm: %d blocks failed their copy or checksum on demotion; dropped",
                                int((~ok).sum()))
                if good.size:
                    hbm_locs = idx.offsets(good)
                    idx.set_tier(good, int(DRAM), locs[ok])
                    self.tier.free(hbm_locs)
                    moved[where[ok]] = True
                    self.demoted += int(good.size)
                    st.count_eviction(HBM, DropReason.DEMOTED, int(good.size))
                    st.emit_moved(good, HBM, DRAM)
                if not ok.all():
                    st.corrupt(use[~ok])
            rest = sel[k:]
            rest = rest[(idx.state[rest] == S_COMMITTED) & (idx.tier[rest] == HBM)]
            if drop_unplaced and rest.size:
                rest = rest[~st.held_below(rest)]  # a pinned or reserved descendant keeps it in HBM
            if drop_unplaced and rest.size:
                self.dropped += int(rest.size)
                st.drop(idx.subtree(rest), DropReason.EVICTED)
        return moved

    def promote(self, rows: np.ndarray) -> int:
        """Move the unpinned DRAM blocks of ``rows`` (a chain prefix) into HBM
        where room can be made. Returns blocks promoted."""
        st = self.placement
        idx = st.index
        cand = rows[(idx.tier[rows] == DRAM) & (idx.pins[rows] == 0) & (idx.state[rows] == S_COMMITTED)]
        done = 0
        if cand.size == 0:
            return 0
        idx.pins[rows] += 1  # the prefix stays where it is while HBM makes room
        try:
            for size in dict.fromkeys(idx.size[cand].tolist()):
                part = cand[idx.size[cand] == size]
                locs = self.make_room(int(size), part.size, rows, int(idx.ns[part[0]]))
                use = part[: locs.size]
                if use.size == 0:
                    break
                # a reader that leased one while an SSD write ran (store lock released) keeps it in DRAM
                mine = (idx.pins[use] == 1) & (idx.state[use] == S_COMMITTED) & (idx.tier[use] == DRAM)
                if not mine.all():
                    self.tier.free(locs[~mine])
                    use, locs = use[mine], locs[mine]
                    if use.size == 0:
                        continue
                srcs = [st.dram.view(int(o), int(size)) for o in idx.offsets(use).tolist()]
                csums, ok = self.tier.write_masked(locs, srcs)
                bad_bytes = ok & (csums != idx.csum[use])
                ok &= ~bad_bytes
                if not ok.all():
                    self.tier.free(locs[~ok])
                good = use[ok]
                if good.size:
                    old = idx.offsets(good)
                    idx.set_tier(good, int(HBM), locs[ok])
                    st.dram.free(old)
                    self.promoted += int(good.size)
                    done += int(good.size)
                    st.emit_moved(good, DRAM, HBM)
                if bad_bytes.any():
                    idx.pins[rows] -= 1
                    try:
                        st.corrupt(use[bad_bytes])  # the DRAM copy went bad: a miss
                    finally:
                        idx.pins[rows] += 1
        finally:
            idx.pins[rows] -= 1
            st.sweep_doomed()
        return done

    def for_reader(self, rows: np.ndarray, want: TierKind | None) -> np.ndarray:
        """Make a lease's prefix readable by the caller: promote into HBM for
        a reader that maps it, demote out of HBM for one that does not.
        Returns the leading rows it can read."""
        idx = self.placement.index
        if want is HBM:
            self.promote(rows)
        else:
            on = rows[idx.tier[rows] == HBM]
            movable = on[idx.pins[on] == 0]
            if movable.size:
                idx.pins[rows] += 1
                try:
                    idx.pins[movable] -= 1
                    self.demote(movable, drop_unplaced=False)
                    idx.pins[movable] += 1
                finally:
                    idx.pins[rows] -= 1
                    self.placement.sweep_doomed()
        ok = idx.state[rows] == S_COMMITTED
        if want is not HBM:
            ok &= idx.tier[rows] == DRAM
        else:
            ok &= (idx.tier[rows] == DRAM) | (idx.tier[rows] == HBM)
        stop = np.nonzero(~ok)[0]
        return rows[: int(stop[0])] if stop.size else rows

    # ---------------------------------------------------------------- misc
    def read(self, rows: np.ndarray, outs: Sequence[Buffer]) -> np.ndarray:
        """Inline reads of HBM blocks into host buffers (verified)."""
        idx = self.placement.index
        return self.tier.read_into(idx.offsets(rows), idx.size[rows], idx.csum[rows], outs)

    def commit_checksums(self, rows: np.ndarray, all_rows: np.ndarray, res: BatchResult) -> np.ndarray:
        """Checksums of the HBM blocks of ``rows`` (a reservation an engine
        wrote through IPC), copied to the host to hash them. A block whose
        copy fails is dropped with its subtree (MISS in ``res``). Returns the
        rows still reserved."""
        st = self.placement
        idx = st.index
        on = rows[idx.tier[rows] == HBM]
        csums, copied = self.tier.checksums(idx.offsets(on), idx.size[on])
        idx.csum[on] = csums
        if not copied.all():
            st.drop(idx.subtree(on[~copied]), DropReason.ABORTED)
            for i in np.nonzero(idx.state[all_rows] != S_RESERVED)[0].tolist():
                res.statuses[i] = KeyStatus.MISS
            rows = rows[idx.state[rows] == S_RESERVED]
        return rows

    def resize(self, capacity_bytes: int) -> int:
        """Shrink or grow (within the start allocation). Blocks in retired
        pages move to free HBM slots below the new size, else demote to DRAM.
        Returns blocks that left HBM."""
        st = self.placement
        idx = st.index
        t = self.tier
        if capacity_bytes > t.size:
            t.resize(capacity_bytes)  # raises: cannot grow beyond the allocation
        pages = t.pages_above(capacity_bytes)
        left = 0
        if len(pages):
            rows = idx.used_rows()
            rows = rows[idx.tier[rows] == HBM]
            inside = rows[t.locs_in_pages(idx.offsets(rows), pages)]
            # one DRAM has no room for leaves with its subtree: none of it may be held
            if st.held_below(inside).any():
                raise CapacityError("hbm blocks in the region being retired (or blocks stored under them) are "
                                    "pinned or being written; retry after they are released")
            t.retire_pages(pages)
            for size in dict.fromkeys(idx.size[inside].tolist()):
                part = inside[idx.size[inside] == size]
                dst = t.allocate(int(size), part.size)
                k = dst.size
                if k:
                    ok = t.move(dst, idx.offsets(part[:k]), idx.size[part[:k]])
                    t.free(dst[~ok])
                    good = part[:k][ok]
                    old = idx.offsets(good)
                    idx.set_offsets(good, dst[ok])
                    t.free(old)
                    part = np.concatenate([part[k:], part[:k][~ok]])
                if part.size:
                    moved = self.demote(part, drop_unplaced=True)
                    left += int(part.size)
                    del moved
        t.resize(capacity_bytes)
        return left

    def write_put(self, todo: list[int], rows: np.ndarray, locs: np.ndarray,
                  srcs: Sequence[Any], res: BatchResult) -> tuple[list[int], np.ndarray]:
        """Copy a put's payloads into its HBM slots. A block whose copy fails is
        dropped with the rest of the chain after it (CAPACITY, with the reason);
        returns the (batch indices, rows) stored."""
        idx = self.placement.index
        csums, ok = self.tier.write_masked(locs, [srcs[i] for i in todo])
        idx.csum[rows] = csums
        if ok.all():
            return todo, rows
        first = int(np.argmin(ok))  # a chain stops at its first failed block
        self.placement.drop(idx.subtree(rows[first:]), DropReason.ABORTED)
        for j in todo[first:]:
            res.statuses[j] = KeyStatus.CAPACITY
            res.messages[j] = f"copy into {self.tier.device} failed (logged); not stored"
        return todo[:first], rows[:first]

    def close(self) -> None:
        self.tier.close()
