"""TieredStore: the single owner of the index and the tiers.

Batch-first, in-process API used by the daemon (and by tests and benchmarks):

- ``lookup(ns, keys)``: how many leading blocks are present, and their tiers.
- ``put(ns, keys, payloads, parent=)`` / ``get(ns, keys)`` / ``get_into``:
  copy in and out, one status per key.
- ``reserve`` -> (client writes into the returned slots) -> ``commit`` /
  ``abort``: the two-phase put of the shared-memory path.
- ``acquire`` -> (client reads the slots) -> ``release``: pinned zero-copy
  reads under a lease.
- ``pin``/``unpin``, ``remove``, ``clear``, ``resize``, ``set_policy``,
  ``stats``, and events for ``WatchEvents``.

Chains: ``keys[i]``'s parent is ``keys[i-1]`` and ``keys[0]``'s parent is
``parent`` (None for the first block of a prompt). A block is only stored
when its parent is stored, eviction is leaf-first and removal takes
descendants along, so every stored block's parent is stored: a lookup can
never report a block whose prefix is gone.

Namespaces: blocks are keyed by (namespace id, key), so two namespaces never
see each other's blocks even for equal key bytes. All blocks of a namespace
have one payload size, fixed by its first block, so a wrong-size payload is
rejected.

Single-threaded by design: the daemon calls it from its event loop; there are
no per-object locks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np

from kvstore.errors import InvalidArgument, KeyStatus
from kvstore.core.eviction import FrequencySketch, Policy, admitted, make_policy, select_subtrees, select_victims
from kvstore.core.holds import Holds, _Hold
from kvstore.core.index import NO_ROW, BlockIndex, BlockState, keys_to_array
from kvstore.keys import Namespace
from kvstore.core.resize import Resizing
from kvstore.results import (BatchResult, Counters, Event, GetResult, LookupResult, NamespaceStats,
                             SlotResult, StoreStats, TierStats)  # SlotResult: re-exported
from tiers.base import Buffer, Tier, TierKind
from tiers.dram import DramTier

if TYPE_CHECKING:
    from kvstore.core.hbm_mover import HbmMover, HbmSpec
    from kvstore.core.ssd_mover import Recovery, SsdMover, SsdSpec

KeysLike = Sequence[bytes] | bytes | np.ndarray
NO_NS = 0xFFFFFFFF
"""Namespace id of calls that only read, for a namespace never stored into (no block has it)."""
QUERY_NAMESPACES = 1024
"""Lookups register an unknown namespace (for its stats) only while fewer
namespaces than this are known; stores always do."""


@dataclass(slots=True, frozen=True)
class StoreConfig:
    dram_bytes: int = 1 << 30
    """Bytes of the shared-memory DRAM slab."""
    dram_page_bytes: int = 16 << 20
    """Slab page size: the unit that moves between slot size classes."""
    dram_slot_sizes: tuple[int, ...] = ()
    """Slot size classes; empty: one class per payload size (4 KiB aligned)."""
    shm_name: str | None = None
    """Name of the slab in /dev/shm (default: kvstore-<uid>-<pid>-<random>)."""
    policy: str = "lru"
    """Eviction policy: lru, lfu or cost."""
    reservation_timeout: float = 30.0
    """Seconds after which an uncommitted reservation is reclaimed."""
    verify_reads: bool = True
    """Check each block's xxh3_64 on every read out of DRAM."""
    ssd: "SsdSpec | None" = None
    """The SSD tier (None: no SSD tier)."""
    copy_threads: int = 2
    """Threads that copy (and checksum) one large batch in parallel."""
    tenant_shares: tuple[tuple[str, float], ...] = ()
    """(tenant, share of each tier): a tenant holding more than its share of a
    tier has its blocks evicted first, so another tenant's burst cannot push a
    tenant below its share."""
    default_tenant_share: float = 1.0
    """Share of tenants not named in ``tenant_shares`` (1.0: no limit)."""
    hbm: "HbmSpec | None" = None
    """The HBM tier (None: no HBM tier; see kvstore.core.hbm_mover)."""
    dram_admission: bool = False
    """When DRAM is full, store a new block only if it was looked up at least
    as often as the block it would evict (``eviction.FrequencySketch``;
    TinyLFU). Otherwise its put answers CAPACITY (docs/replay.md)."""


def namespace_label(ns: Namespace) -> str:
    """Readable, unique-enough label: tenant/model[@adapter]/dtype/bsN[/tpN][/ppN]."""
    parts = [ns.tenant, ns.model_id + (f"@{ns.adapter_id}" if ns.adapter_id else ""),
             ns.kv_dtype.value, f"bs{ns.block_size}"]
    if ns.tp_size > 1:
        parts.append(f"tp{ns.tp_size}")
    if ns.pp_stage:
        parts.append(f"pp{ns.pp_stage}")
    return "/".join(parts)


def _as_u8(buf: Buffer) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def _plan_all_new(rows: np.ndarray, karr: np.ndarray, sizes: Sequence[int], expected: int | None,
                  footprint: Callable[[int], object]) -> bool:
    """Whether ``_plan`` would store every key of the batch (vectorised test)."""
    n = rows.shape[0]
    if n == 0 or bool((rows >= 0).any()):
        return False
    size = sizes[0]
    if size <= 0 or (expected is not None and size != expected) or sizes.count(size) != n:
        return False
    try:
        footprint(int(size))
    except InvalidArgument:
        return False
    return n == 1 or np.unique(np.ascontiguousarray(karr).view("V16")).size == n


class TieredStore(Holds, Resizing):
    """See the module docstring."""

    def __init__(self, config: StoreConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or StoreConfig()
        self.clock = clock
        self.index = BlockIndex()
        self.policy: Policy = make_policy(self.config.policy)  # validated before the slab exists
        self.freq = FrequencySketch(self.config.dram_bytes >> 10) if self.config.dram_admission else None
        self.dram = DramTier(self.config.dram_bytes, name=self.config.shm_name,
                             page_bytes=self.config.dram_page_bytes, slot_sizes=self.config.dram_slot_sizes,
                             copy_threads=self.config.copy_threads)
        self.tiers: dict[TierKind, Tier] = {TierKind.DRAM: self.dram}
        self._ns_ids: dict[bytes, int] = {}  # namespace frame -> id
        self._digest_tenant: dict[bytes, str | None] = {}
        self._ns: list[Namespace] = []
        self._ns_size: dict[int, int] = {}
        from admission.quota import TenantShares

        self._shares = TenantShares(dict(self.config.tenant_shares), self.config.default_tenant_share)
        self._quotas = bool(self.config.tenant_shares) or self.config.default_tenant_share < 1.0
        self._tenant_ids: dict[str, int] = {}
        self._ns_tenant: list[int] = []
        self._ns_hits: dict[int, list[int]] = {}
        self._tick = 1
        self.counters = Counters()
        self._reservations: dict[str, _Hold] = {}
        self._leases: dict[str, _Hold] = {}
        self._listeners: list[Callable[[Event], None]] = []
        self._doomed = 0
        self.ssd: SsdMover | None = None
        self.recovery: Recovery | None = None
        if self.config.ssd is not None:
            from kvstore.core.ssd_mover import SsdMover

            try:
                self.ssd = SsdMover(self, self.config.ssd)
                self.tiers[TierKind.SSD] = self.ssd.tier
                self.recovery = self.ssd.recover()
            except BaseException:
                self.dram.close()
                if self.ssd is not None:
                    self.ssd.close()
                raise
        self.hbm: HbmMover | None = None
        self.tier_hits = np.zeros(len(TierKind), dtype=np.int64)
        """Blocks served (Acquire, Get) from each tier, by TierKind value."""
        if self.config.hbm is not None:
            from kvstore.core.hbm_mover import HbmMover

            try:
                self.hbm = HbmMover(self, self.config.hbm)
            except BaseException:
                self.close()
                raise
            self.tiers = {TierKind.HBM: self.hbm.tier, **self.tiers}  # closed first: unpins the DRAM slab

    # ------------------------------------------------------------ plumbing
    def close(self) -> None:
        for t in self.tiers.values():
            t.close()
        self.tiers = {}

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def subscribe(self, listener: Callable[[Event], None]) -> None:
        self._listeners.append(listener)

    def _emit(self, ev: Event) -> None:
        for fn in self._listeners:
            fn(ev)

    def _nsid(self, ns: Namespace, persist: bool = True, create: bool = True) -> int:
        """The namespace's id. Namespaces are told apart by their full frame,
        not by their digest, so two whose digests collide never share blocks.
        ``create=False`` (calls that only read) answers ``NO_NS``, an id no
        block has, for a namespace never stored into: queries with made-up
        namespaces cost the daemon no memory."""
        if not isinstance(ns, Namespace):
            raise InvalidArgument(f"namespace must be a kvstore.keys.Namespace, got {type(ns).__name__}")
        frame = ns.framed()
        nid = self._ns_ids.get(frame)
        if nid is None:
            if not create:
                return NO_NS
            d = ns.digest
            nid = len(self._ns)
            self._ns_ids[frame] = nid
            self._ns.append(ns)
            self._ns_tenant.append(self._tenant_ids.setdefault(ns.tenant, len(self._tenant_ids)))
            if self._digest_tenant.setdefault(d, ns.tenant) != ns.tenant:
                self._digest_tenant[d] = None  # two tenants' digests collide: their events go to neither
            if persist and self.ssd is not None:
                self.ssd.register_namespace(d, ns.to_dict(), None)
        return nid

    def tenant_of(self, digest: bytes) -> str | None:
        """The tenant of the namespace with this digest; None when unknown or
        when namespaces of two tenants share the digest."""
        return self._digest_tenant.get(digest)

    def _emit_moved(self, rows: np.ndarray, src: TierKind, dst: TierKind) -> None:
        idx = self.index
        for nid in np.unique(idx.ns[rows]).tolist():
            mine = rows[idx.ns[rows] == nid]
            keys = idx.keys_of(mine)
            digest = self._ns[nid].digest
            self._emit(Event("removed", digest, keys, src, "moved"))
            self._emit(Event("stored", digest, keys, dst))

    def background(self) -> bool:
        """One bounded step of background tier work (prefetch, write-through,
        write-back demotion, SSD reclaim). True when more is pending."""
        return self.ssd.step() if self.ssd is not None else False

    def _ticks(self, n: int) -> int:
        t = self._tick
        self._tick += n
        return t

    def _touch(self, rows: np.ndarray) -> None:
        if rows.size == 0:
            return
        t = self._ticks(rows.size)
        idx = self.index
        idx.hits[rows] += 1
        idx.last[rows] = np.arange(t, t + rows.size, dtype=np.uint64)
        self.policy.on_access(idx, rows)

    def _parent_row(self, nid: int, parent: bytes | None) -> int:
        if parent is None or len(parent) == 0:
            return NO_ROW
        rows = self.index.find_committed(nid, keys_to_array([bytes(parent)]))
        return int(rows[0]) if rows[0] >= 0 else -3  # -3: named but absent

    # -------------------------------------------------------------- lookup
    def lookup(self, ns: Namespace, keys: KeysLike) -> LookupResult:
        # a queried namespace is counted in the per-namespace stats, but
        # queries alone register at most QUERY_NAMESPACES namespaces
        nid = self._nsid(ns, create=len(self._ns) < QUERY_NAMESPACES)
        karr = keys_to_array(keys)
        res = self.index.lookup(nid, karr)
        if self.freq is not None:
            self.freq.record(karr, self.index.live)
        c = self.counters
        c.lookups += 1
        c.lookup_blocks += karr.shape[0]
        c.lookup_hit_blocks += res.hit
        c.lookup_tokens += karr.shape[0] * ns.block_size
        c.lookup_hit_tokens += res.hit * ns.block_size
        if nid != NO_NS:
            h = self._ns_hits.setdefault(nid, [0, 0, 0])
            h[0] += 1
            h[1] += karr.shape[0]
            h[2] += res.hit
        return LookupResult(res.hit, res.tiers)

    # ----------------------------------------------------- placing new blocks
    def _plan(self, nid: int, karr: np.ndarray, sizes: Sequence[int], parent: bytes | None,
              res: BatchResult) -> tuple[list[int], list[int]]:
        """Decide which keys get new rows. Returns (batch indices to store,
        parent refs for insert). Fills statuses for the rest."""
        n = karr.shape[0]
        st = res.statuses
        expected = self._ns_size.get(nid)
        rows = self.index.find(nid, karr)
        prow = self._parent_row(nid, parent)
        todo: list[int] = []
        prefs: list[int] = []
        seen: dict[tuple[int, int], int] = {}
        prev_ok: int | None = prow if prow != -3 else None  # parent ref for the next key
        prev_reason = KeyStatus.PARENT_MISSING
        if prow == -3:
            res.messages[0] = "parent block is not stored"
        elif _plan_all_new(rows, karr, sizes, expected, self.dram.footprint):
            # the usual batch (all keys new and distinct, one valid size): the
            # loop below would store every key, each the parent of the next
            return list(range(n)), [prow] + list(range(-2, -1 - n, -1))
        for i in range(n):
            k = (int(karr[i, 0]), int(karr[i, 1]))
            size = int(sizes[i])
            if k in seen:
                st[i] = KeyStatus.INVALID
                res.messages[i] = f"key {i} repeats key {seen[k]} of this batch"
                prev_ok, prev_reason = None, KeyStatus.PARENT_MISSING
                continue
            seen[k] = i
            r = int(rows[i])
            if r >= 0:
                if self.index.state[r] == BlockState.COMMITTED:
                    st[i] = KeyStatus.EXISTS
                    prev_ok = r
                else:
                    st[i] = KeyStatus.BUSY
                    prev_ok, prev_reason = None, KeyStatus.PARENT_MISSING
                continue
            if prev_ok is None:
                st[i] = prev_reason
                continue
            if size <= 0:
                st[i] = KeyStatus.INVALID
                res.messages[i] = f"payload {i} is empty"
                prev_ok, prev_reason = None, KeyStatus.PARENT_MISSING
                continue
            want = expected if expected is not None else (int(sizes[todo[0]]) if todo else size)
            if size != want:
                st[i] = KeyStatus.INVALID
                res.messages[i] = (f"payload {i} is {size} bytes; blocks of this namespace are "
                                   f"{want} bytes")
                prev_ok, prev_reason = None, KeyStatus.PARENT_MISSING
                continue
            try:
                self.dram.footprint(size)
            except InvalidArgument as e:
                st[i] = KeyStatus.INVALID
                res.messages[i] = str(e)
                prev_ok, prev_reason = None, KeyStatus.PARENT_MISSING
                continue
            todo.append(i)
            prefs.append(prev_ok)
            prev_ok = -2 - (len(todo) - 1)  # "the row of the j-th new block"
        return todo, prefs

    def _make_room(self, tier: TierKind, nbytes: int, count: int, protect: np.ndarray,
                   for_ns: int | None = None) -> np.ndarray:
        """Allocate ``count`` slots for ``nbytes`` payloads in ``tier``, evicting
        leaf-first as needed. ``protect`` rows must stay stored (they are the
        parents of what is being placed): without an SSD tier they are not
        evicted; with one they may only be demoted. May return fewer."""
        t = self.dram
        first = t.allocate(nbytes, count)
        if first.size == count:
            return first
        parts = [first]
        got = first.size
        protect = np.unique(protect)
        pin = protect if self.ssd is None else protect[:0]
        self.index.pins[pin] += 1
        try:
            cls = t.class_of(nbytes)
            while got < count:
                victims = self._victims(tier, cls, count - got, for_ns, (count - got) * nbytes)
                if victims.size == 0:
                    victims = self._victims_other_class(tier, cls)
                    if victims.size == 0:
                        break
                if self.ssd is not None:
                    self.ssd.evict_dram(victims, keep=protect)
                else:
                    self._drop(victims, reason="evicted")
                more = t.allocate(nbytes, count - got)
                parts.append(more)
                got += more.size
        finally:
            self.index.pins[pin] -= 1
        return np.concatenate(parts)

    def _admitted(self, karr: np.ndarray, nbytes: int, nid: int) -> int:
        """DRAM admission: how many of these new blocks (a chain) get a slot."""
        assert self.freq is not None
        need = karr.shape[0] - self.dram.free_slots(nbytes)
        if need <= 0:
            return karr.shape[0]
        v = self._victims(TierKind.DRAM, self.dram.class_of(nbytes), need, nid, need * nbytes)
        idx = self.index
        vkeys = np.stack([idx.k0[v], idx.k1[v]], axis=1)
        return karr.shape[0] - need + admitted(self.freq.estimate(karr[-need:]), self.freq.estimate(vkeys))

    def _evictable(self, tier: TierKind) -> np.ndarray:
        idx = self.index
        rows = idx.used_rows()
        m = ((idx.state[rows] == BlockState.COMMITTED) & (idx.tier[rows] == tier)
             & (idx.pins[rows] == 0) & (idx.nchild_tier[rows] == 0))
        if tier is TierKind.DRAM and self.ssd is None:
            m &= idx.nchild[rows] == 0  # nowhere to demote: only blocks without children (e.g. in hbm) go
        return rows[m]

    def _victims(self, tier: TierKind, cls: int | None, k: int, for_ns: int | None = None,
                 incoming: int = 0) -> np.ndarray:
        """Up to ``k`` DRAM victims of size class ``cls`` (None: any), whole
        cold subtrees first (``eviction.select_subtrees``)."""
        idx = self.index
        rows = idx.used_rows()
        rows = rows[idx.tier[rows] == tier]
        blocked = (idx.state[rows] != BlockState.COMMITTED) | (idx.pins[rows] > 0)
        if cls is not None and rows.size:
            blocked |= self.dram.classes_of_locs(idx.loc[rows]) != cls
        return self._select(tier, rows, blocked, k, for_ns, incoming)

    def _select(self, tier: TierKind, rows: np.ndarray, blocked: np.ndarray, k: int,
                for_ns: int | None = None, incoming: int = 0) -> np.ndarray:
        """Policy order over ``rows`` (all of ``tier``'s blocks), but blocks of
        tenants over their share of ``tier`` first; the requester's usage
        counts the ``incoming`` bytes it asks for, so a tenant at its share
        makes room from its own blocks."""
        over = None
        if self._quotas and rows.size:
            from admission.quota import victim_mask

            idx = self.index
            ns_tenant = np.asarray(self._ns_tenant, dtype=np.int64)
            usage = np.bincount(ns_tenant[idx.ns[rows]], weights=idx.size[rows].astype(np.float64),
                                minlength=len(self._tenant_ids))
            if for_ns is not None:
                usage[ns_tenant[for_ns]] += incoming
            names = sorted(self._tenant_ids, key=self._tenant_ids.__getitem__)
            shares = self._shares.array(names, tier)
            over = victim_mask(ns_tenant[idx.ns[rows]], usage, self.tiers[tier].capacity_bytes, shares)
        return select_subtrees(self.index, self.policy, rows, blocked, k, over)

    def peek(self, ns: Namespace, keys: KeysLike) -> LookupResult:
        """Like ``lookup``, without counting it (for admission decisions)."""
        res = self.index.lookup(self._nsid(ns, create=False), keys_to_array(keys))
        return LookupResult(res.hit, res.tiers)

    def block_bytes(self, ns: Namespace) -> int | None:
        """Payload bytes of this namespace's blocks, once known."""
        nid = self._ns_ids.get(ns.framed())
        return None if nid is None else self._ns_size.get(nid)

    def _victims_other_class(self, tier: TierKind, cls: int) -> np.ndarray:
        """To give a page to class ``cls``: the lowest-ranked candidate of
        another class, so pages drain in policy order."""
        cand = self._evictable(tier)
        if cand.size:
            cand = cand[self.dram.classes_of_locs(self.index.loc[cand]) != cls]
        return select_victims(self.index, self.policy, cand, 1)

    def _drop(self, rows: np.ndarray, reason: str) -> None:
        """Remove rows (which must include their descendants) and free slots."""
        if rows.size == 0:
            return
        idx = self.index
        if reason == "evicted":
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
            committed = arr[idx.state[arr] == BlockState.COMMITTED]
            if committed.size:
                events.append(Event("removed", self._ns[nid].digest, idx.keys_of(committed),
                                    TierKind(int(idx.tier[committed[0]])), reason))
        tiers = idx.tier[rows]
        for tk in np.unique(tiers).tolist():
            sel = rows[tiers == tk]
            key = (TierKind(tk), reason)
            self.counters.evictions[key] = self.counters.evictions.get(key, 0) + int(sel.size)
            self.tiers[TierKind(tk)].free(idx.loc[sel])
        if self.ssd is not None:
            copies = rows[idx.ssd_loc[rows] >= 0]
            if copies.size:
                self.ssd.tier.free(idx.ssd_loc[copies])
        idx.delete(rows)
        for ev in events:
            self._emit(ev)

    def _store_rows(self, nid: int, karr: np.ndarray, sizes: Sequence[int], parent: bytes | None,
                    state: BlockState, res: BatchResult,
                    tier: TierKind | None = None) -> tuple[list[int], np.ndarray, np.ndarray]:
        """Plan, allocate (evicting) and insert rows in ``tier`` (None: the
        default, DRAM unless hbm.admit is "all"). Returns (batch indices,
        rows, locs) of the blocks that got a slot; ``index.tier`` of the rows
        says where."""
        todo, prefs = self._plan(nid, karr, sizes, parent, res)
        empty = np.zeros(0, dtype=np.int64)
        if not todo:
            return [], empty, empty
        nbytes = int(sizes[todo[0]])
        protect = np.asarray([p for p in prefs if p >= 0], dtype=np.int64)
        where = self.hbm.target(tier) if self.hbm is not None else TierKind.DRAM
        if where is TierKind.HBM:
            assert self.hbm is not None
            locs = self.hbm.place(nbytes, len(todo), protect, nid)
            if locs.size == 0:
                where = TierKind.DRAM  # no room in hbm for the whole batch
        if where is TierKind.DRAM:
            n = len(todo) if self.freq is None else self._admitted(karr[todo], nbytes, nid)
            locs = self._make_room(TierKind.DRAM, nbytes, n, protect, for_ns=nid)
        # a parent that had to leave (its demotion failed) stops the chain there
        parr = np.asarray(prefs[: locs.size], dtype=np.int64)
        outer = np.nonzero(parr >= 0)[0]
        gone = outer[self.index.state[parr[outer]] != BlockState.COMMITTED]
        stop = int(gone[0]) if gone.size else None
        if stop is not None:
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
        # a later key whose parent failed has been marked already in _plan; keys
        # after a CAPACITY one inherit it (their parent will not be stored)
        sel = np.asarray(todo, dtype=np.int64)
        rows = self.index.insert(nid, karr[sel], np.asarray(prefs[:got], dtype=np.int64),
                                 int(where), locs, np.full(got, nbytes, dtype=np.int64),
                                 state, self._ticks(got))
        if nid not in self._ns_size:
            self._ns_size[nid] = nbytes
            if self.ssd is not None:
                self.ssd.register_namespace(self._ns[nid].digest, self._ns[nid].to_dict(), nbytes)
        if short:  # only CAPACITY keys (set just above) change tail statuses
            self._fix_tail_statuses(res)
        return todo, rows, locs

    @staticmethod
    def _fix_tail_statuses(res: BatchResult) -> None:
        # keys after a CAPACITY key in the chain could not be placed either
        st = res.statuses
        for i in range(1, len(st)):
            if st[i] is KeyStatus.PARENT_MISSING and st[i - 1] is KeyStatus.CAPACITY:
                st[i] = KeyStatus.CAPACITY

    def _committed(self, nid: int, rows: np.ndarray) -> None:
        idx = self.index
        idx.state[rows] = BlockState.COMMITTED
        self.policy.on_insert(idx, rows)
        if self.ssd is not None:
            self.ssd.admission.seen(idx.keys_of(rows))
            self.ssd.queue_copy(rows)
        par = idx.parent[rows[0]]
        self._emit(Event("stored", self._ns[nid].digest, idx.keys_of(rows), TierKind(int(idx.tier[rows[0]])),
                         parent=idx.key_of(int(par)) if par >= 0 else None))

    # ----------------------------------------------------------------- put
    def put(self, ns: Namespace, keys: KeysLike, payloads: Sequence[Buffer],
            parent: bytes | None = None, tier: TierKind | None = None) -> BatchResult:
        """Store a chain segment. ``keys[0]``'s parent is ``parent``; ``tier``
        asks for HBM (see kvstore.core.hbm_mover)."""
        nid = self._nsid(ns)
        karr = keys_to_array(keys)
        n = karr.shape[0]
        if len(payloads) != n:
            raise InvalidArgument(f"{n} keys but {len(payloads)} payloads")
        res = BatchResult([KeyStatus.OK] * n)
        srcs: list[np.ndarray | None] = []
        sizes: list[int] = []
        for i, p in enumerate(payloads):
            try:
                a = _as_u8(p)
            except (TypeError, ValueError) as e:
                a = None
                res.messages[i] = f"payload {i} is not a buffer: {e}"
            srcs.append(a)
            sizes.append(a.size if a is not None else 0)
        todo, rows, locs = self._store_rows(nid, karr, sizes, parent, BlockState.RESERVED, res, tier)
        if todo and self.hbm is not None and self.index.tier[rows[0]] == TierKind.HBM:
            from kvstore.core.hbm_mover import write_put

            todo, rows = write_put(self, todo, rows, locs, srcs, res)
        elif todo:
            csums = self.dram.write(locs, [srcs[i] for i in todo])  # type: ignore[misc]
            self.index.csum[rows] = csums
        if todo:
            self._committed(nid, rows)
            self.counters.put_bytes += int(sum(sizes[i] for i in todo))
        self.counters.puts += 1
        self.counters.put_blocks += len(todo)
        return res

    # ----------------------------------------------------------------- get
    def _read(self, rows: np.ndarray, outs: Sequence[Buffer]) -> np.ndarray:
        idx = self.index
        if self.hbm is not None and np.any(idx.tier[rows] == TierKind.HBM):
            on_hbm = idx.tier[rows] == TierKind.HBM
            ok = np.zeros(rows.size, dtype=bool)
            for mask, read in ((on_hbm, self.hbm.read), (~on_hbm, self._read)):
                at = np.nonzero(mask)[0]
                if at.size:
                    ok[at] = read(rows[at], [outs[i] for i in at.tolist()])
            return ok
        on_ssd = idx.tier[rows] == TierKind.SSD
        if self.ssd is not None and np.any(on_ssd):
            ok = np.zeros(rows.size, dtype=bool)
            sidx = np.nonzero(on_ssd)[0]
            ssd_rows = rows[sidx]
            ok[sidx] = self.ssd.tier.read_into(idx.loc[ssd_rows], idx.size[ssd_rows], idx.csum[ssd_rows],
                                               [outs[i] for i in sidx.tolist()], self.ssd._meta(ssd_rows))
            didx = np.nonzero(~on_ssd)[0]
            if didx.size:
                ok[didx] = self._read(rows[didx], [outs[i] for i in didx.tolist()])
            return ok
        if self.config.verify_reads:
            ok = self.dram.read_into(idx.loc[rows], idx.size[rows], idx.csum[rows], outs)
        else:
            for off, n, dst in zip(idx.loc[rows].tolist(), idx.size[rows].tolist(), outs):
                np.copyto(_as_u8(dst), self.dram.buf[off : off + n])
            ok = np.ones(rows.size, dtype=bool)
        return ok

    def _corrupt(self, rows: np.ndarray) -> None:
        """Drop blocks whose bytes failed their checksum, with their subtrees.
        Where a reader still pins part of a subtree, the subtree becomes
        DOOMED (invisible at once) and is freed when the pins go."""
        self.counters.checksum_failures += int(rows.size)
        idx = self.index
        sub = idx.subtree(rows)
        if not np.any(idx.pins[sub] > 0):
            self._drop(sub, reason="corrupt")
            return
        visible = sub[idx.state[sub] == BlockState.COMMITTED]
        for nid in np.unique(idx.ns[visible]).tolist():
            mine = visible[idx.ns[visible] == nid]
            self._emit(Event("removed", self._ns[nid].digest, idx.keys_of(mine),
                             TierKind(int(idx.tier[mine[0]])), "corrupt"))
        idx.state[sub] = BlockState.DOOMED
        self._doomed += int(sub.size)
        self._sweep_doomed()

    def _sweep_doomed(self) -> None:
        """Free DOOMED blocks nobody pins any more (leaves first)."""
        idx = self.index
        while self._doomed:
            rows = idx.used_rows()
            free = rows[(idx.state[rows] == BlockState.DOOMED) & (idx.pins[rows] == 0) & (idx.nchild[rows] == 0)]
            if free.size == 0:
                return
            self._doomed -= int(free.size)
            self._drop(free, reason="corrupt")

    def get_into(self, ns: Namespace, keys: KeysLike, outs: Sequence[Buffer]) -> BatchResult:
        """Copy each present block into ``outs[i]`` (exactly its size)."""
        nid = self._nsid(ns, create=False)
        karr = keys_to_array(keys)
        n = karr.shape[0]
        if len(outs) != n:
            raise InvalidArgument(f"{n} keys but {len(outs)} output buffers")
        rows = self.index.find_committed(nid, karr)
        res = BatchResult([KeyStatus.MISS] * n)
        present = np.nonzero(rows >= 0)[0]
        good = []
        for i in present.tolist():
            want = int(self.index.size[rows[i]])
            have = _as_u8(outs[i]).size
            if have != want:
                res.statuses[i] = KeyStatus.INVALID
                res.messages[i] = f"output buffer {i} is {have} bytes; the block is {want} bytes"
            else:
                good.append(i)
        self._get_rows(rows, np.asarray(good, dtype=np.int64), [outs[i] for i in good], res)
        return res

    def _get_rows(self, rows: np.ndarray, which: np.ndarray, outs: Sequence[Buffer],
                  res: BatchResult) -> np.ndarray:
        c = self.counters
        c.gets += 1
        c.get_blocks += rows.size
        if which.size == 0:
            return which
        sel = rows[which]
        ok = self._read(sel, outs)
        bad = sel[~ok]
        if bad.size:
            for i in which[~ok].tolist():
                res.statuses[i] = KeyStatus.CORRUPT
            self._corrupt(bad)
        good_rows = sel[ok]
        for i in which[ok].tolist():
            res.statuses[i] = KeyStatus.OK
        self._touch(good_rows)
        self.tier_hits += np.bincount(self.index.tier[good_rows], minlength=len(TierKind))
        if self.ssd is not None and good_rows.size:
            self.ssd.admission.seen(self.index.keys_of(good_rows))
        c.get_hit_blocks += int(good_rows.size)
        c.get_bytes += int(self.index.size[good_rows].sum()) if good_rows.size else 0
        return which[ok]

    def get(self, ns: Namespace, keys: KeysLike) -> GetResult:
        """Copies of the present blocks (None where missing)."""
        nid = self._nsid(ns, create=False)
        karr = keys_to_array(keys)
        n = karr.shape[0]
        rows = self.index.find_committed(nid, karr)
        present = np.nonzero(rows >= 0)[0]
        outs = [np.empty(int(self.index.size[rows[i]]), dtype=np.uint8) for i in present.tolist()]
        res = GetResult([KeyStatus.MISS] * n, payloads=[None] * n)
        ok = set(self._get_rows(rows, present, outs, res).tolist())
        for i, buf in zip(present.tolist(), outs):
            if i in ok:
                res.payloads[i] = buf
        return res

    # ------------------------------------------------------ remove/clear
    def remove(self, ns: Namespace, keys: KeysLike) -> BatchResult:
        """Remove blocks and their descendants. A block whose subtree holds a
        pinned or reserved block stays (BUSY)."""
        nid = self._nsid(ns, create=False)
        idx = self.index
        rows = idx.find_committed(nid, keys_to_array(keys))
        res = BatchResult([KeyStatus.MISS] * rows.size)
        for i, r in enumerate(rows.tolist()):
            if r < 0 or idx.state[r] != BlockState.COMMITTED:
                continue  # gone already (e.g. descendant of an earlier key)
            sub = idx.subtree(np.asarray([r]))
            if np.any(idx.pins[sub] > 0) or np.any(idx.state[sub] != BlockState.COMMITTED):
                res.statuses[i] = KeyStatus.BUSY
                res.messages[i] = "block or a descendant is pinned or being written"
                continue
            self._drop(sub, reason="removed")
            res.statuses[i] = KeyStatus.OK
        return res

    def clear(self, ns: Namespace | None = None) -> int:
        """Remove every block (of ``ns``, or of all namespaces) that is not
        pinned or being written, nor an ancestor of one. Returns how many."""
        idx = self.index
        rows = idx.used_rows()
        if ns is not None:
            nid = self._ns_ids.get(ns.framed())
            if nid is None:
                return 0
            rows = rows[idx.ns[rows] == nid]
        busy = rows[(idx.pins[rows] > 0) | (idx.state[rows] != BlockState.COMMITTED)]
        keep: set[int] = set()
        for r in busy.tolist():  # a busy block keeps its ancestors
            while r >= 0 and r not in keep:
                keep.add(r)
                r = int(idx.parent[r])
        if keep:
            rows = rows[~np.isin(rows, np.fromiter(keep, dtype=np.int64))]
        # drop leaves-first is not needed: the set is closed under descendants
        self._drop(rows, reason="cleared")
        digest = ns.digest if ns is not None else b""
        self._emit(Event("cleared", digest, []))
        if ns is not None and not keep:
            self._ns_size.pop(self._ns_ids[ns.framed()], None)
        return int(rows.size)

    # ------------------------------------------------------------- stats
    def stats(self) -> StoreStats:
        idx = self.index
        rows = idx.used_rows()
        out = []
        for kind, t in self.tiers.items():
            sel = rows[idx.tier[rows] == kind]
            pinned = sel[idx.pins[sel] > 0]
            ev = sum(v for (tk, _), v in self.counters.evictions.items() if tk == kind)
            ts = TierStats(kind, t.capacity_bytes, t.used_bytes, int(sel.size),
                           int(idx.size[pinned].sum()) if pinned.size else 0, ev, disk_bytes=t.used_bytes)
            if self.ssd is not None:
                if kind is TierKind.DRAM:
                    ts.promotions, ts.demotions = self.ssd.promoted, self.ssd.demoted
                elif kind is TierKind.SSD:
                    ts.disk_bytes = self.ssd.tier.disk_bytes
            if kind is TierKind.HBM and self.hbm is not None:
                ts.promotions, ts.demotions = self.hbm.promoted, self.hbm.demoted
            ts.hits = int(self.tier_hits[int(kind)])
            out.append(ts)
        per_ns = np.bincount(idx.ns[rows[idx.state[rows] == BlockState.COMMITTED]].astype(np.int64),
                             minlength=len(self._ns))
        ns_stats = []
        for nid, ns in enumerate(self._ns):
            n_l, q, h = self._ns_hits.get(nid, (0, 0, 0))
            ns_stats.append(NamespaceStats(namespace_label(ns), ns.tenant, ns.digest, n_l, q, h,
                                           int(per_ns[nid])))
        return StoreStats(out, self.counters, ns_stats, self.policy.name.value,
                          len(self._reservations), len(self._leases))

    def namespaces(self) -> Iterable[Namespace]:
        return list(self._ns)
