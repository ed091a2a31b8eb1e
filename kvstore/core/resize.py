"""Run-time changes to a ``TieredStore`` (the Admin service): switching the
eviction policy and resizing a tier without a restart and without losing
blocks that still fit. A component of ``TieredStore`` (kvstore/core/store.py)
working through ``Placement`` and the movers; it runs on the store's single
thread."""

from __future__ import annotations

import numpy as np

from kvstore.core.eviction import PolicyName, make_policy, select_victims
from kvstore.core.grants import Grants
from kvstore.core.hbm_mover import HbmMover
from kvstore.core.index import NO_LOC, S_COMMITTED, S_FREE
from kvstore.core.placement import Placement
from kvstore.core.ssd_mover import SsdMover
from kvstore.errors import CapacityError, InvalidArgument, NotFound
from kvstore.fs_room import free_bytes
from kvstore.results import DropReason
from tiers.base import T_DRAM, T_SSD, TierKind
from tiers.slots import check_slab_size

MAX_CAPACITY = 1 << 56
"""No tier is ever sized beyond 64 PiB (a bound on what the wire may ask for,
before the host's own limits are asked)."""


def check_host_room(r: Resizer, tier: TierKind, capacity_bytes: int) -> None:
    """Refuse a size the host cannot back, before anything is allocated or
    moved: DRAM beyond the slab plus the free space of ``/dev/shm``; SSD
    beyond what its directory holds plus the file system's free space; HBM
    beyond the device allocation made at start (``HbmTier.resize``). Raises
    InvalidArgument (not a size) or CapacityError (RESOURCE_EXHAUSTED),
    naming both numbers."""
    cap = int(capacity_bytes)
    if cap <= 0:
        raise InvalidArgument(f"{tier.label} capacity must be > 0 bytes, got {cap}")
    if cap > MAX_CAPACITY:
        raise InvalidArgument(f"{tier.label} capacity {cap} bytes is beyond the largest allowed "
                              f"({MAX_CAPACITY} bytes)")
    if tier in (TierKind.DRAM, TierKind.HBM):
        check_slab_size(tier.label, cap)
    if tier is TierKind.DRAM:
        held = r.placement.dram.capacity_bytes
        now, free = r.placement.dram.host_room()
        where = "free in the dram slab's file system (/dev/shm)"
    elif tier is TierKind.SSD and r.ssd is not None:
        t = r.ssd.tier
        held, now, free = t.capacity_bytes, t.disk_bytes, free_bytes(t.path)
        where = f"free on the ssd file system ({t.path})"
    else:
        return
    if cap > held and cap > now + free:
        raise CapacityError(f"{tier.label} capacity {cap} bytes is more than the host can back: "
                            f"{now + free} bytes ({now} in use now + {free} {where})")


class Resizer:
    """``set_policy`` and ``resize``."""

    def __init__(self, place: Placement, ssd: SsdMover | None = None, hbm: HbmMover | None = None,
                 grants: Grants | None = None) -> None:
        self.placement = place
        self.ssd = ssd
        self.hbm = hbm
        self.grants = grants

    def set_policy(self, name: str | PolicyName) -> str:
        """Switch the eviction policy, keeping every block. Returns the old name."""
        place = self.placement
        old = place.policy.name.value
        place.policy = make_policy(name, place.index)
        return old

    def resize(self, tier: TierKind, capacity_bytes: int) -> int:
        """Change a tier's capacity at run time. Shrinking moves blocks out of
        the retired region into free slots, evicting (policy order, leaf
        first) only what no longer fits. Returns blocks evicted.

        Checked before anything moves: the new size must be one the host can
        back (``check_host_room``); a refused or failed resize leaves the tier
        as it was."""
        if tier in self.placement.tiers:
            check_host_room(self, tier, capacity_bytes)
        if tier is TierKind.SSD and self.ssd is not None:
            return self._resize_ssd(capacity_bytes)
        if tier is TierKind.HBM and self.hbm is not None:
            return self.hbm.resize(capacity_bytes)
        if tier is not TierKind.DRAM:
            raise NotFound(f"tier {tier.label} is not configured")
        place = self.placement
        t = place.dram
        pages = t.pages_above(capacity_bytes)
        evicted = 0
        idx = place.index
        if len(pages):
            rows = idx.used_rows()
            rows = rows[idx.tier[rows] == T_DRAM]
            inside = rows[t.locs_in_pages(idx.offsets(rows), pages)]
            granted = self.grants.locs() if self.grants is not None else inside[:0]
            # a retired block that finds no slot leaves with its subtree: none of it may be held
            sub = idx.subtree(inside)
            if place.held(sub).any() or \
                    t.locs_in_pages(granted, pages).any():
                raise CapacityError("blocks in the region being retired (or blocks stored under them) are "
                                    "pinned or being written (or its slots are granted to a writer); "
                                    "retry after they are released")
            # stop handing out retired pages, then relocate what is there
            t.retire_pages(pages)
            for r in inside.tolist():
                if idx.state[r] == S_FREE:
                    continue
                n = int(idx.size[r])
                dst = t.allocate(n, 1)
                while dst.size == 0 and idx.state[r] != S_FREE:
                    # policy order, leaf first: a victim in the retired region frees no
                    # slot but is one block fewer to move; r itself may be the one
                    victims = place.victims(TierKind.DRAM, t.class_of(n), 1)
                    # (with an SSD tier a victim may have children in other tiers: they go
                    # with it, unless one is held; then r itself goes below)
                    victims = victims[~place.held_below(victims)]
                    if victims.size == 0:
                        break
                    victims = idx.subtree(victims)
                    place.drop(victims, DropReason.RESIZED)
                    evicted += int(victims.size)
                    dst = t.allocate(n, 1)
                if idx.state[r] == S_FREE:
                    t.free(dst)
                    continue
                if dst.size == 0:
                    if idx.nchild[r] == 0:
                        place.drop(np.asarray([r]), DropReason.RESIZED)
                        evicted += 1
                        continue
                    sub = idx.subtree(np.asarray([r]))
                    place.drop(sub, DropReason.RESIZED)
                    evicted += int(sub.size)
                    continue
                src = idx.offset(r)
                np.copyto(t.buf[int(dst[0]) : int(dst[0]) + n], t.buf[src : src + n])
                t.free(np.asarray([src]))
                idx.set_offsets(np.asarray([r]), dst[:1])
        t.resize(capacity_bytes)
        return evicted

    def _resize_ssd(self, capacity_bytes: int) -> int:
        assert self.ssd is not None
        t = self.ssd.tier
        place = self.placement
        idx = place.index
        evicted = 0
        while t.used_bytes > capacity_bytes:
            rows = idx.used_rows()
            cand = rows[(idx.state[rows] == S_COMMITTED) & (idx.tier[rows] == T_SSD)
                        & (idx.pins[rows] == 0) & (idx.nchild[rows] == 0)]
            victims = select_victims(idx, place.policy, cand, 64)
            if victims.size == 0:
                copies = rows[(idx.tier[rows] == T_DRAM) & (idx.ssd_loc[rows] >= 0)]
                if copies.size == 0:
                    raise CapacityError("ssd blocks are pinned; retry after they are released")
                t.free(idx.ssd_loc[copies[:64]])
                idx.ssd_loc[copies[:64]] = NO_LOC
                continue
            place.drop(victims, DropReason.RESIZED)
            evicted += int(victims.size)
        t.resize(capacity_bytes)
        return evicted
