"""Granted slots: DRAM slots handed to a same-host writer ahead of its puts
(issue 18, goal 1).

A put through ``Reserve`` waits one round trip for its slots before it can
copy. A writer that puts again and again (an engine saving its steps, the
Mooncake-style ``put`` API) instead holds a small *grant*: slots of one
size it may write at once. A granted put copies its blocks straight into
granted slots, hashing them on the way, and names the slots in one frame
sent without waiting; the daemon then inserts the rows (``put``). The
slots the put named leave the grant whatever happens: those of the blocks
stored become those blocks; the others (a key stored already, a parent
missing, a block DRAM admission refused) are freed. No byte is copied
twice and no round trip is on the put's path: the writer asks for more
slots (``grant``) after a put, and reads the answer at its next put.

Safety, as for a reservation:
- a block is visible only once the put that names it has run, and only
  the owner's own granted slots can be named (else the put is refused
  whole, nothing stored);
- a grant is bounded per owner (``limit`` bytes, the daemon's choice) and
  lives ``lifetime`` seconds: ``reap`` frees what its owner did not use by
  then (the writer stops using a grant at half its life), and
  ``release`` frees an owner's grants when its session ends;
- granting evicts as a ``Reserve`` of the same slots would, within the
  namespace's tenant share (``Placement.make_room``).

Granted slots are DRAM slots with no row: the store's ``used_bytes``
counts them. A DRAM shrink is refused while a grant holds a slot in the
region being retired (retry: grants expire), as it is for a reservation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kvstore.core.index import BlockState, keys_to_array
from kvstore.core.placement import Placement
from kvstore.errors import InvalidArgument, KeyStatus, PermissionDenied, Unavailable
from kvstore.keys import Namespace
from kvstore.results import BatchResult
from tiers.base import TierKind


class Grants:
    """Granted DRAM slots by owner; see the module docstring."""

    def __init__(self, place: Placement, lifetime: float) -> None:
        self.place = place
        self.lifetime = float(lifetime)
        self.slots: dict[int, tuple[str, int, float]] = {}
        """Granted slot offset -> (owner, slot bytes, deadline)."""
        self.bytes: dict[str, int] = {}
        """Bytes of slots each owner holds."""
        self.first_deadline = math.inf
        """No grant expires before this (``reap`` scans only after it)."""

    def grant(self, ns: Namespace, nbytes: int, count: int, owner: str, limit: int,
              now: float) -> np.ndarray:
        """Up to ``count`` free slots for blocks of ``nbytes`` in ``ns``
        (evicting as a Reserve would), as long as ``owner`` then holds at
        most ``limit`` bytes of grants; fewer (none) past that or when DRAM
        has no room."""
        place = self.place
        if place.upper is not None and place.upper.target(None) is TierKind.HBM:
            raise Unavailable("new blocks go to the hbm tier on this daemon: put through Reserve")
        slot = place.dram.footprint(nbytes)  # InvalidArgument for a size DRAM cannot hold
        if count <= 0:
            raise InvalidArgument(f"a grant of {count} slots")
        nid = place.nsid(ns)
        size = place.namespaces.size_of(nid)
        if size is not None and size != nbytes:
            raise InvalidArgument(f"namespace {ns.model_id!r} holds blocks of {size} bytes, not {nbytes}")
        count = min(count, max(0, limit - self.bytes.get(owner, 0)) // slot)
        if count <= 0:
            return np.zeros(0, dtype=np.int64)
        locs = place.make_room(TierKind.DRAM, nbytes, count, np.zeros(0, dtype=np.int64), for_ns=nid)
        deadline = now + self.lifetime
        entry = (owner, slot, deadline)
        self.slots.update(dict.fromkeys(locs.tolist(), entry))
        self.bytes[owner] = self.bytes.get(owner, 0) + slot * int(locs.size)
        self.first_deadline = min(self.first_deadline, deadline)
        return locs

    def put(self, ns: Namespace, keys: object, nbytes: int, locs: Sequence[int], checksums: Sequence[int],
            owner: str, parent: bytes | None) -> BatchResult:
        """Store the blocks the owner wrote into its granted ``locs`` (one
        per key, with its xxh3_64): the statuses of a Reserve and Commit of
        the same keys. Refused whole (nothing stored, the grant unchanged)
        when a slot is not this owner's for blocks of this size."""
        place = self.place
        karr = keys_to_array(keys)
        n = karr.shape[0]
        if len(locs) != n or len(checksums) != n:
            raise InvalidArgument(f"{n} keys, {len(locs)} slots and {len(checksums)} checksums")
        slot = place.dram.footprint(nbytes)
        named = [int(x) for x in locs]
        if len(set(named)) != n:
            raise InvalidArgument("a granted put names one slot twice")
        for loc in named:
            held = self.slots.get(loc)
            if held is None or held[0] != owner or held[1] != slot:
                raise PermissionDenied(f"slot {loc} is not granted to this connection for {nbytes}-byte blocks "
                                       "(never granted, expired or used)")
        for loc in named:  # every named slot leaves the grant: a block now, or freed below
            del self.slots[loc]
        self.bytes[owner] -= slot * n
        given = np.asarray(named, dtype=np.int64)
        nid = place.nsid(ns)
        res = BatchResult([KeyStatus.OK] * n)
        try:
            todo, rows, used = place.store_rows(nid, karr, [nbytes] * n, parent, BlockState.RESERVED, res,
                                                given=given)
        except BaseException:
            place.dram.free(given)  # (nothing was inserted)
            raise
        if used.size < n:
            place.dram.free(given[~np.isin(given, used)])
        if rows.size:
            idx = place.index
            idx.csum[rows] = np.asarray(checksums, dtype=np.uint64)[np.asarray(todo, dtype=np.int64)]
            place.committed(nid, rows)
            place.count_put(nid, int(rows.size), int(rows.size) * nbytes)
        return res

    def give_back(self, owner: str, locs: Sequence[int]) -> int:
        """Free the slots of ``locs`` granted to ``owner`` (its writer will
        not use them: another size is wanted, or their time is up); others
        are ignored."""
        mine = [int(x) for x in dict.fromkeys(locs) if self.slots.get(int(x), ("",))[0] == owner]
        for loc in mine:
            self.bytes[owner] -= self.slots[loc][1]
        self._free(mine)
        return len(mine)

    def release(self, owner: str) -> int:
        """Free every slot granted to ``owner`` (its session ended)."""
        mine = [loc for loc, held in self.slots.items() if held[0] == owner]
        self._free(mine)
        self.bytes.pop(owner, None)
        return len(mine)

    def reap(self, now: float) -> int:
        """Free the slots whose grant expired."""
        if now < self.first_deadline:
            return 0
        old = [loc for loc, held in self.slots.items() if held[2] <= now]
        for loc in old:
            owner = self.slots[loc][0]
            self.bytes[owner] -= self.slots[loc][1]
        self._free(old)
        self.first_deadline = min((held[2] for held in self.slots.values()), default=math.inf)
        return len(old)

    def _free(self, locs: list[int]) -> None:
        for loc in locs:
            del self.slots[loc]
        if locs:
            self.place.dram.free(np.asarray(locs, dtype=np.int64))

    def locs(self) -> np.ndarray:
        """Every granted slot's offset."""
        return np.fromiter(self.slots, dtype=np.int64, count=len(self.slots))
