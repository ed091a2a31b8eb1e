"""Placement: the block index and the tiers under one owner. Where new
blocks go, what is evicted to make room (policy order, tenant shares,
leaf-first), dropping blocks (with events and counters), corrupt blocks and
verified reads.

``TieredStore`` (kvstore/core/store.py) is a facade over this component and
its neighbours (holds, resize, the SSD and HBM movers). The movers sit
*beside* placement, not under it: placement reaches them only through the two
small protocols below (``LowerTier`` for the SSD mover, ``UpperTier`` for
the HBM mover), which they satisfy, so no module of core imports its caller.

Single-threaded by design, like the store: no per-object locks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np

from admission.quota import TenantShares, victim_mask
from kvstore.buffers import as_u8
from kvstore.core.eviction import (
    FrequencySketch,
    Policy,
    admitted,
    close_upward,
    select_subtrees,
    select_victims,
)
from kvstore.core.index import HITS_MAX, S_COMMITTED, S_DOOMED, S_RESERVED, TICK_MAX, BlockIndex, BlockState
from kvstore.core.namespaces import (CHECKSUM_FAILURES, DEMOTIONS, EVICTIONS, GET_BLOCKS, GET_BYTES, HITS, PROMOTIONS,
                                     PUT_BLOCKS, PUT_BYTES, Namespaces)
from kvstore.core.plan import fix_tail_statuses, parent_row, plan
from kvstore.errors import InvalidArgument, KeyStatus
from kvstore.keys import Namespace
from kvstore.results import ROOM_REASONS, BatchResult, Counters, DropReason, Event, EventKind
from tiers.base import T_HBM, T_SSD, Buffer, Tier, TierKind
from tiers.dram import DramTier


class LowerTier(Protocol):
    """What placement needs from the tier below DRAM (``SsdMover``)."""

    def evict_dram(self, victims: np.ndarray, keep: np.ndarray | None = None) -> np.ndarray: ...

    def free_copies(self, rows: np.ndarray) -> None: ...

    def on_stored(self, rows: np.ndarray) -> None: ...

    def on_read(self, rows: np.ndarray) -> None: ...

    def read(self, rows: np.ndarray, outs: Sequence[Buffer]) -> np.ndarray: ...

    def register_namespace(self, digest: bytes, ns_dict: Mapping[str, object], block_bytes: int | None) -> None: ...


class UpperTier(Protocol):
    """What placement needs from the tier above DRAM (``HbmMover``)."""

    def target(self, tier: TierKind | None) -> TierKind: ...

    def place(self, nbytes: int, count: int, protect: np.ndarray, for_ns: int | None) -> np.ndarray: ...

    def read(self, rows: np.ndarray, outs: Sequence[Buffer]) -> np.ndarray: ...


class Placement:
    """Owns the index, the DRAM tier and the tier table; see the module docstring."""

    def __init__(self, dram: DramTier, policy: Policy, namespaces: Namespaces, counters: Counters, *,
                 verify_reads: bool = True, freq: FrequencySketch | None = None,
                 shares: TenantShares | None = None) -> None:
        self.index = BlockIndex()
        self.dram = dram
        self.policy = policy  # (the setter: the index keeps the columns it ranks with)
        self.namespaces = namespaces
        self.counters = counters
        self.verify_reads = verify_reads
        self.freq = freq
        self.shares = shares
        """Tenant shares of each tier (None: no quotas)."""
        self.tiers: dict[TierKind, Tier] = {TierKind.DRAM: dram}
        self.lower: LowerTier | None = None
        self.upper: UpperTier | None = None
        self.tier_hits = np.zeros(len(TierKind), dtype=np.int64)
        """Blocks served (Acquire, Get) from each tier, by TierKind value."""
        self._listeners: list[Callable[[Event], None]] = []
        self._tick = 1
        self._doomed = 0

    def attach_lower(self, mover: LowerTier, tier: Tier) -> None:
        """Add the SSD tier below DRAM."""
        self.lower = mover
        self.tiers[TierKind.SSD] = tier

    def attach_upper(self, mover: UpperTier, tier: Tier) -> None:
        """Add the HBM tier above DRAM (closed first: it unpins the DRAM slab)."""
        self.upper = mover
        self.tiers = {TierKind.HBM: tier, **self.tiers}

    def close(self) -> None:
        for t in self.tiers.values():
            t.close()
        self.tiers = {}

    # ------------------------------------------------------------- events
    def subscribe(self, listener: Callable[[Event], None]) -> None:
        self._listeners.append(listener)

    def emit(self, ev: Event) -> None:
        for fn in self._listeners:
            fn(ev)

    def emit_moved(self, rows: np.ndarray, src: TierKind, dst: TierKind) -> None:
        """Tell listeners that ``rows`` moved from ``src`` to ``dst``, and count
        the move per namespace (a tenant's Stats): a promotion (``dst``
        hotter) in ``dst``'s column, a demotion in ``src``'s, as the whole
        daemon's figures are shown on the hotter tier of the two."""
        idx = self.index
        self.namespaces.count_blocks(idx.ns[rows], PROMOTIONS + int(dst) if dst < src else DEMOTIONS + int(src))
        for nid in np.unique(idx.ns[rows]).tolist():
            mine = rows[idx.ns[rows] == nid]
            keys = idx.keys_of(mine)
            digest = self.namespaces.digest(nid)
            self.emit(Event(EventKind.REMOVED, digest, keys, src, DropReason.MOVED))
            self.emit(Event(EventKind.STORED, digest, keys, dst))

    def count_eviction(self, tier: TierKind, reason: DropReason, n: int) -> None:
        key = (tier, reason)
        self.counters.evictions[key] = self.counters.evictions.get(key, 0) + n

    # ---------------------------------------------------------- namespaces
    def nsid(self, ns: Namespace, persist: bool = True, create: bool = True) -> int:
        """The namespace's id (``Namespaces.id_of``); a new one is persisted
        on the SSD tier unless ``persist`` is False."""
        nid, new = self.namespaces.id_of(ns, create)
        if new and persist and self.lower is not None:
            self.lower.register_namespace(ns.digest, ns.to_dict(), None)
        return nid

    # -------------------------------------------------------------- ticks
    def ticks(self, n: int) -> int:
        """Reserve ``n`` consecutive access ticks; returns the first."""
        if self._tick + n > TICK_MAX:  # the 32-bit ``last`` would wrap: renumber, order kept
            self._tick = self.index.renumber_last()
            if self._tick + n > TICK_MAX:
                raise InvalidArgument(f"{n} ticks at once do not fit a 32-bit clock")
        t = self._tick
        self._tick += n
        return t

    @property
    def policy(self) -> Policy:
        return self._policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        """Install ``policy``; the index keeps the columns it ranks with."""
        self.index.keep(policy.columns)
        self._policy = policy

    def touch(self, rows: np.ndarray) -> None:
        """Count an access of ``rows`` (hits, recency, the policy)."""
        if rows.size == 0:
            return
        t = self.ticks(rows.size)
        idx = self.index
        if "hits" in idx.kept:  # (only a policy that ranks with it keeps it)
            h = idx.hits[rows]
            idx.hits[rows] = h + (h < HITS_MAX)  # 16 bits, saturating
        idx.last[rows] = np.arange(t, t + rows.size, dtype=np.uint32)
        self.policy.on_access(idx, rows)

    # ------------------------------------------------------ new blocks
    def store_rows(self, nid: int, karr: np.ndarray, sizes: Sequence[int], parent: bytes | None,
                   state: BlockState, res: BatchResult, tier: TierKind | None = None,
                   given: np.ndarray | None = None) -> tuple[list[int], np.ndarray, np.ndarray]:
        """Plan, allocate (evicting) and insert rows in ``tier`` (None: the
        default, DRAM unless hbm.admit is "all"). Returns (batch indices,
        rows, locs) of the blocks that got a slot; ``index.tier`` of the rows
        says where. ``given``: one DRAM slot per key, allocated already (a
        granted put, kvstore/core/grants.py): the blocks stored take theirs;
        the caller frees the rest."""
        todo, prefs = plan(self.index, nid, karr, sizes, parent_row(self.index, nid, parent),
                           self.namespaces.size_of(nid), self.dram.footprint, res)
        empty = np.zeros(0, dtype=np.int64)
        if not todo:
            return [], empty, empty
        nbytes = int(sizes[todo[0]])
        protect = np.asarray([p for p in prefs if p >= 0], dtype=np.int64)
        where = self.upper.target(tier) if self.upper is not None and given is None else TierKind.DRAM
        if where is TierKind.HBM:
            assert self.upper is not None
            locs = self.upper.place(nbytes, len(todo), protect, nid)
            if locs.size == 0:
                where = TierKind.DRAM  # no room in hbm for the whole batch
        if where is TierKind.DRAM:
            n = len(todo) if self.freq is None else self._admitted(karr[todo], nbytes, nid)
            if given is None:
                locs = self.make_room(TierKind.DRAM, nbytes, n, protect, for_ns=nid)
            else:
                locs = given[np.asarray(todo[:n], dtype=np.int64)]
        # a parent that had to leave (its demotion failed) stops the chain there
        parr = np.asarray(prefs[: locs.size], dtype=np.int64)
        outer = np.nonzero(parr >= 0)[0]
        gone = outer[self.index.state[parr[outer]] != S_COMMITTED]
        stop = int(gone[0]) if gone.size else None
        if stop is not None:
            if given is None:
                self.tiers[where].free(locs[stop:])
            for j in todo[stop:]:
                res.statuses[j] = KeyStatus.PARENT_MISSING
            locs, todo = locs[:stop], todo[:stop]
        got = locs.size
        short = got < len(todo)
        for j in todo[got:]:
            res.statuses[j] = KeyStatus.CAPACITY
            self.counters.capacity_rejects += 1
        todo = todo[:got]
        if not todo:
            res.messages[0] = res.messages.get(0, "no room in the dram tier after eviction")
            return [], empty, empty
        sel = np.asarray(todo, dtype=np.int64)
        rows = self.index.insert(nid, karr[sel], np.asarray(prefs[:got], dtype=np.int64),
                                 int(where), locs, np.full(got, nbytes, dtype=np.int64),
                                 state, self.ticks(got))
        if self.namespaces.size_of(nid) is None:
            self.namespaces.set_size(nid, nbytes)
            if self.lower is not None:
                ns = self.namespaces.get(nid)
                self.lower.register_namespace(ns.digest, ns.to_dict(), nbytes)
        if short:  # only CAPACITY keys (set just above) change tail statuses
            fix_tail_statuses(res)
        return todo, rows, locs

    def committed(self, nid: int, rows: np.ndarray) -> None:
        """Make reserved ``rows`` (one chain segment of ``nid``) visible."""
        idx = self.index
        idx.state[rows] = S_COMMITTED
        self.policy.on_insert(idx, rows)
        if self.lower is not None:
            self.lower.on_stored(rows)
        par = idx.parent[rows[0]]
        self.emit(Event(EventKind.STORED, self.namespaces.digest(nid), idx.keys_of(rows),
                        TierKind(int(idx.tier[rows[0]])), parent=idx.key_of(int(par)) if par >= 0 else None))

    def count_put(self, nid: int, blocks: int, nbytes: int) -> None:
        """Count one put call of ``nid`` that stored ``blocks`` blocks of
        ``nbytes`` payload bytes in all (the store's counters and the namespace's)."""
        c = self.counters
        c.puts += 1
        c.put_blocks += blocks
        c.put_bytes += nbytes
        counts = self.namespaces.counts[nid]
        counts[PUT_BLOCKS] += blocks
        counts[PUT_BYTES] += nbytes

    # ---------------------------------------------------------- eviction
    def make_room(self, tier: TierKind, nbytes: int, count: int, protect: np.ndarray,
                  for_ns: int | None = None) -> np.ndarray:
        """Allocate ``count`` slots for ``nbytes`` payloads in ``tier``, evicting
        leaf-first as needed. ``protect`` rows must stay stored (they are the
        parents of what is being placed): without an SSD tier they are not
        evicted; with one they may only be demoted. May return fewer."""
        t = self.dram
        first = t.allocate(nbytes, count)
        if first.size == count:
            return first
        count = max(first.size, self.evict_plan(tier, nbytes, count, for_ns))
        if first.size == count:
            return first
        parts = [first]
        got = first.size
        protect = np.unique(protect)
        pin = protect if self.lower is None else protect[:0]
        self.index.pins[pin] += 1
        stuck: list[np.ndarray] = []  # victims that stayed (a held block below): pinned, not picked again
        try:
            cls = t.class_of(nbytes)
            while got < count:
                victims = self.victims(tier, cls, count - got, for_ns, (count - got) * nbytes)
                if victims.size == 0:
                    victims = self._victims_other_class(tier, cls, for_ns, (count - got) * nbytes)
                    if victims.size == 0:
                        break
                if self.lower is not None:
                    stay = self.lower.evict_dram(victims, keep=protect)
                    if stay.size:
                        self.index.pins[stay] += 1
                        stuck.append(stay)
                else:
                    self.drop(victims, DropReason.EVICTED)
                more = t.allocate(nbytes, count - got)
                parts.append(more)
                got += more.size
        finally:
            self.index.pins[pin] -= 1
            for stay in stuck:
                self.index.pins[stay] -= 1
        return np.concatenate(parts)

    def evict_plan(self, tier: TierKind, nbytes: int, count: int, for_ns: int | None) -> int:
        """Plan before evicting: how many of ``count`` new payloads of
        ``nbytes`` one request may be given by evicting. None (0) when the
        whole request can never fit: it is larger than the tier, or than its
        tenant's share of the tier; such a request gets the free slots only,
        so one oversized call can neither flush the cache nor push another
        tenant below its share. Otherwise at most what eviction could ever
        free (the tier less its pinned and reserved blocks): nothing is
        evicted for keys that would be refused anyway."""
        slot = self.tiers[tier].footprint(nbytes)
        cap = self.tiers[tier].capacity_bytes
        limit = cap
        if self.shares is not None and for_ns is not None:
            limit = int(self.shares.share(self.namespaces.get(for_ns).tenant, tier) * cap)
        if count * slot > limit:
            return 0
        idx = self.index
        rows = idx.used_rows()
        rows = rows[idx.tier[rows] == tier]
        held = rows[(idx.pins[rows] > 0) | (idx.state[rows] != S_COMMITTED)]
        return min(count, max(0, cap - int(idx.size[held].sum())) // slot)

    def _admitted(self, karr: np.ndarray, nbytes: int, nid: int) -> int:
        """DRAM admission: how many of these new blocks (a chain) get a slot."""
        assert self.freq is not None
        need = karr.shape[0] - self.dram.free_slots(nbytes)
        if need <= 0:
            return karr.shape[0]
        v = self.victims(TierKind.DRAM, self.dram.class_of(nbytes), need, nid, need * nbytes)
        idx = self.index
        vkeys = np.stack([idx.k0[v], idx.k1[v]], axis=1)
        return karr.shape[0] - need + admitted(self.freq.estimate(karr[-need:]), self.freq.estimate(vkeys))

    def held(self, rows: np.ndarray) -> np.ndarray:
        """Mask of ``rows`` a reader pins or that are not committed (being
        written, doomed): blocks that may not be dropped or moved."""
        idx = self.index
        return (idx.pins[rows] > 0) | (idx.state[rows] != S_COMMITTED)

    def held_below(self, rows: np.ndarray) -> np.ndarray:
        """Mask of ``rows`` whose subtree (in any tier, the row included)
        holds a ``held`` block: rows that may not be dropped."""
        idx = self.index
        used = idx.used_rows()
        held = self.held(used)
        below = np.zeros(idx.parent.size, dtype=bool)
        if held.any():
            below[used] = close_upward(idx, used, held)
        return below[rows]

    def evictable(self, tier: TierKind) -> np.ndarray:
        """Committed, unpinned blocks of ``tier`` with no child in it."""
        idx = self.index
        rows = idx.used_rows()
        mine = idx.tier[rows] == tier
        m = (idx.state[rows] == S_COMMITTED) & mine & (idx.pins[rows] == 0)
        leaf = idx.nchild[rows] == 0
        if tier is TierKind.DRAM and self.lower is None:
            m &= leaf  # nowhere to demote: only blocks without children (e.g. in hbm) go
        else:  # no child in the tier (one elsewhere moves or goes with it)
            m &= leaf | ~idx.has_child_among(rows, rows[mine])
        return rows[m]

    def victims(self, tier: TierKind, cls: int | None, k: int, for_ns: int | None = None,
                incoming: int = 0) -> np.ndarray:
        """Up to ``k`` DRAM victims of size class ``cls`` (None: any), whole
        cold subtrees first (``eviction.select_subtrees``)."""
        idx = self.index
        used = idx.used_rows()
        mine = idx.tier[used] == tier
        rows = used[mine]
        blocked = (idx.state[rows] != S_COMMITTED) | (idx.pins[rows] > 0)
        if tier is TierKind.DRAM and self.lower is None:  # dropped, not demoted: children elsewhere (hbm) stay
            blocked |= idx.has_child_among(rows, used[~mine])
        if cls is not None and rows.size:
            blocked |= self.dram.classes_of_locs(idx.offsets(rows)) != cls
        return self.select(tier, rows, blocked, k, for_ns, incoming)

    def select(self, tier: TierKind, rows: np.ndarray, blocked: np.ndarray, k: int,
               for_ns: int | None = None, incoming: int = 0) -> np.ndarray:
        """Policy order over ``rows`` (all of ``tier``'s blocks), but blocks of
        tenants over their share of ``tier`` first; the requester's usage
        counts the ``incoming`` bytes it asks for, so a tenant at its share
        makes room from its own blocks. A tenant's blocks go first only
        until its overage is covered (as ``admission.quota.victim_order``
        with sizes): a batch of ``k`` victims never takes a tenant below
        its share while another is still over it."""
        idx = self.index
        if self.shares is None or not rows.size:
            return select_subtrees(idx, self.policy, rows, blocked, k)
        ns_tenant, tid, usage, shares = self._usage(tier, rows, for_ns, incoming)
        over = victim_mask(tid, usage, self.tiers[tier].capacity_bytes, shares)
        # every block of over-share tenants, in eviction order (a subtree is one tenant's) ...
        first = select_subtrees(idx, self.policy, rows, blocked | ~over, rows.size)
        if first.size:
            # ... each tenant's only until its overage is covered: a prefix of
            # its eviction order, so still closed under descendants
            ft = ns_tenant[idx.ns[first]]
            by = np.argsort(ft, kind="stable")
            sz = idx.size[first[by]].astype(np.float64)
            cs = np.cumsum(sz)
            starts = np.flatnonzero(np.r_[True, ft[by][1:] != ft[by][:-1]])
            before = cs - sz - np.repeat(cs[starts] - sz[starts], np.diff(np.r_[starts, by.size]))
            keep = np.empty(by.size, dtype=bool)
            keep[by] = before < usage[ft[by]] - shares[ft[by]] * self.tiers[tier].capacity_bytes
            first = first[keep][:k]
        if first.size >= k:
            return first
        # then the rest (the trimmed ones included) in policy order; a requester over its share
        # (with what it asks for) only from its own blocks: never another tenant's below its share
        rest = ~np.isin(rows, first)
        if for_ns is not None:
            me = ns_tenant[for_ns]
            if usage[me] > shares[me] * self.tiers[tier].capacity_bytes:
                rest &= tid == me
        second = select_subtrees(idx, self.policy, rows[rest], blocked[rest], k - first.size)
        return np.concatenate([first, second]) if first.size else second

    def _usage(self, tier: TierKind, rows: np.ndarray, for_ns: int | None,
               incoming: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Tenant shares in use (``self.shares`` set): each namespace's tenant
        id, each of ``rows``' (``tier``'s blocks) tenant id, the bytes each
        tenant holds there (the requester's with the ``incoming`` bytes it
        asks for) and each tenant's share of ``tier``."""
        assert self.shares is not None
        ns_tenant = np.asarray(self.namespaces.tenant_ids(), dtype=np.int64)
        names = self.namespaces.tenant_names()
        tid = ns_tenant[self.index.ns[rows]]
        usage = np.bincount(tid, weights=self.index.size[rows].astype(np.float64), minlength=len(names))
        if for_ns is not None:
            usage[ns_tenant[for_ns]] += incoming
        return ns_tenant, tid, usage, self.shares.array(names, tier)

    def _victims_other_class(self, tier: TierKind, cls: int, for_ns: int | None = None,
                             incoming: int = 0) -> np.ndarray:
        """To give a page to class ``cls``: the lowest-ranked candidate of
        another class, so pages drain in policy order (of the requester's
        own blocks only when it is over its share, as ``select``)."""
        cand = self.evictable(tier)
        if cand.size:
            cand = cand[self.dram.classes_of_locs(self.index.offsets(cand)) != cls]
        if cand.size and self.shares is not None and for_ns is not None:
            idx = self.index
            rows = idx.used_rows()
            ns_tenant, _, usage, shares = self._usage(tier, rows[idx.tier[rows] == tier], for_ns, incoming)
            me = ns_tenant[for_ns]
            if usage[me] > shares[me] * self.tiers[tier].capacity_bytes:
                cand = cand[ns_tenant[idx.ns[cand]] == me]
        return select_victims(self.index, self.policy, cand, 1)

    # ----------------------------------------------------------- dropping
    def drop(self, rows: np.ndarray, reason: DropReason) -> None:
        """Remove rows (which must include their descendants) and free slots."""
        if rows.size == 0:
            return
        idx = self.index
        if reason is DropReason.EVICTED:
            self.policy.on_evict(idx, rows)
        rns = idx.ns[rows]
        first = rns[0]
        if bool((rns == first).all()):
            by_ns = [(int(first), rows)]
        else:  # namespaces in order of first appearance, rows in order within each
            uniq, at = np.unique(rns, return_index=True)
            by_ns = [(int(nid), rows[rns == nid]) for nid in uniq[np.argsort(at)].tolist()]
        events = []
        for nid, arr in by_ns:
            arr = np.asarray(arr, dtype=np.int64)
            committed = arr[idx.state[arr] == S_COMMITTED]
            if committed.size:
                events.append(Event(EventKind.REMOVED, self.namespaces.digest(nid), idx.keys_of(committed),
                                    TierKind(int(idx.tier[committed[0]])), reason))
        tiers = idx.tier[rows]
        room = reason in ROOM_REASONS
        for tk in np.unique(tiers).tolist():
            sel = rows[tiers == tk]
            self.count_eviction(TierKind(tk), reason, int(sel.size))
            if room:  # per namespace too (a tenant's Stats)
                self.namespaces.count_blocks(idx.ns[sel], EVICTIONS + tk)
            self.tiers[TierKind(tk)].free(idx.loc[sel] if tk == T_SSD else idx.offsets(sel))  # (SSD: ids)
        if self.lower is not None:
            self.lower.free_copies(rows)
        idx.delete(rows)
        for ev in events:
            self.emit(ev)

    def corrupt(self, rows: np.ndarray) -> None:
        """Drop blocks whose bytes failed their checksum, with their subtrees.
        Where a reader still pins part of a subtree, or a writer still fills
        a reserved block of it, the subtree becomes DOOMED (invisible at
        once) and is freed when the pins go; reserved blocks stay the
        writer's (their slots are not handed to anyone else) until its
        Commit (a miss), Abort or expiry drops them."""
        self.count_corrupt(rows)
        idx = self.index
        sub = idx.subtree(rows)
        reserved = idx.state[sub] == S_RESERVED
        if not np.any(idx.pins[sub] > 0) and not reserved.any():
            self.drop(sub, DropReason.CORRUPT)
            return
        sub = sub[~reserved]
        visible = sub[idx.state[sub] == S_COMMITTED]
        for nid in np.unique(idx.ns[visible]).tolist():
            mine = visible[idx.ns[visible] == nid]
            self.emit(Event(EventKind.REMOVED, self.namespaces.digest(nid), idx.keys_of(mine),
                            TierKind(int(idx.tier[mine[0]])), DropReason.CORRUPT))
        idx.state[sub] = S_DOOMED
        self._doomed += int(sub.size)
        self.sweep_doomed()

    def count_corrupt(self, rows: np.ndarray) -> None:
        """Count ``rows`` as checksum failures (the daemon's and their
        namespaces'); dropping them is the caller's."""
        self.counters.checksum_failures += int(rows.size)
        self.namespaces.count_blocks(self.index.ns[rows], CHECKSUM_FAILURES)

    def sweep_doomed(self) -> None:
        """Free DOOMED blocks nobody pins any more (leaves first)."""
        idx = self.index
        while self._doomed:
            rows = idx.used_rows()
            free = rows[(idx.state[rows] == S_DOOMED) & (idx.pins[rows] == 0) & (idx.nchild[rows] == 0)]
            if free.size == 0:
                return
            self._doomed -= int(free.size)
            self.drop(free, DropReason.CORRUPT)

    # ------------------------------------------------------------ reading
    def read(self, rows: np.ndarray, outs: Sequence[Buffer]) -> np.ndarray:
        """Copy ``rows`` into ``outs`` from whichever tier holds each, verified
        (DRAM: unless ``verify_reads`` is off). Returns the mask of good reads."""
        idx = self.index
        if self.upper is not None and np.any(idx.tier[rows] == T_HBM):
            on_hbm = idx.tier[rows] == T_HBM
            ok = np.zeros(rows.size, dtype=bool)
            for mask, read in ((on_hbm, self.upper.read), (~on_hbm, self.read)):
                at = np.nonzero(mask)[0]
                if at.size:
                    ok[at] = read(rows[at], [outs[i] for i in at.tolist()])
            return ok
        on_ssd = idx.tier[rows] == T_SSD
        if self.lower is not None and np.any(on_ssd):
            ok = np.zeros(rows.size, dtype=bool)
            sidx = np.nonzero(on_ssd)[0]
            ok[sidx] = self.lower.read(rows[sidx], [outs[i] for i in sidx.tolist()])
            didx = np.nonzero(~on_ssd)[0]
            if didx.size:
                ok[didx] = self.read(rows[didx], [outs[i] for i in didx.tolist()])
            return ok
        if self.verify_reads:
            ok = self.dram.read_into(idx.offsets(rows), idx.size[rows], idx.csum[rows], outs)
        else:
            for off, n, dst in zip(idx.offsets(rows).tolist(), idx.size[rows].tolist(), outs):
                np.copyto(as_u8(dst), self.dram.buf[off : off + n])
            ok = np.ones(rows.size, dtype=bool)
        return ok

    def served(self, rows: np.ndarray, found: np.ndarray | None = None) -> None:
        """Count ``rows`` (of one namespace) as served to a reader: touch,
        per-tier hits, the blocks and bytes served (the store's counters and
        the namespace's). ``found``: the tier each row was in when the reader
        asked (a lease promotes SSD blocks and demotes HBM ones first): the
        hit is the tier's that held it; default, where they are now."""
        if rows.size == 0:
            return
        self.touch(rows)
        idx = self.index
        hits = np.bincount(idx.tier[rows] if found is None else found, minlength=len(TierKind))
        self.tier_hits += hits
        nbytes = int(idx.size[rows].sum())
        c = self.counters
        c.get_hit_blocks += int(rows.size)
        c.get_bytes += nbytes
        counts = self.namespaces.counts[int(idx.ns[rows[0]])]
        counts[GET_BLOCKS] += int(rows.size)
        counts[GET_BYTES] += nbytes
        for k, n in enumerate(hits.tolist()):
            counts[HITS + k] += n
