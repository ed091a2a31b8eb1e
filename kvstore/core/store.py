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

Components (each publishes what its neighbours need; none reads another's
underscore names, and imports point one way, facade first):

- ``namespaces.Namespaces``: namespace <-> id, tenants, block sizes, lookup stats.
- ``placement.Placement``: the index, the tier table, planning new blocks
  (``plan``), eviction (policy, tenant shares), drops, corrupt blocks, reads.
- ``holds.Holds``: reservations, leases, pins, their expiry.
- ``resize.Resizer``: run-time resize and policy switch.
- ``ssd_mover.SsdMover`` / ``hbm_mover.HbmMover``: the tiers below and above
  DRAM; placement reaches them through its ``LowerTier``/``UpperTier`` protocols.

Single-threaded by design: the daemon calls it from its event loop; there are
no per-object locks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from admission.quota import TenantShares
from kvstore.buffers import as_u8
from kvstore.core.eviction import FrequencySketch, Policy, PolicyName, ancestor_min, close_upward, make_policy
from kvstore.core.grants import Grants
from kvstore.core.hbm_mover import HbmMover, HbmSpec
from kvstore.core.holds import Holds, KeysLike
from kvstore.core.index import S_COMMITTED, BlockIndex, BlockState, keys_to_array
from kvstore.core.levels import ancestors
from kvstore.core.namespaces import CHECKSUM_FAILURES, NO_NS, QUERY_NAMESPACES, Namespaces, namespace_label
from kvstore.core.placement import Placement
from kvstore.core.resize import Resizer
from kvstore.core.ssd_mover import Recovery, SsdMover, SsdSpec
from kvstore.core.tenant_view import tenant_view
from kvstore.errors import InvalidArgument, KeyStatus, KVStoreError
from kvstore.keys import Namespace
from kvstore.results import (
    ROOM_REASONS,
    BatchResult,
    Counters,
    DropReason,
    Event,
    EventKind,
    GetResult,
    LookupResult,
    NamespaceStats,
    SlotResult,
    StoreStats,
    TierStats,
)
from tiers.base import T_HBM, T_SSD, Buffer, Tier, TierKind
from tiers.dram import DramTier
from tiers.slots import check_slab_size

__all__ = [
    "NO_NS",
    "QUERY_NAMESPACES",
    "KeysLike",
    "SlotResult",
    "StoreConfig",
    "StoreStats",
    "TieredStore",
    "namespace_label",
]


@dataclass(slots=True, frozen=True)
class StoreConfig:
    dram_bytes: int = 1 << 30
    """Bytes of the shared-memory DRAM slab."""
    dram_page_bytes: int = 16 << 20
    """Slab page size: the unit that moves between slot size classes."""
    dram_slot_sizes: tuple[int, ...] = ()
    """Slot size classes; empty: one class per payload size (4 KiB aligned)."""
    dram_populate: bool = False
    """Back the whole slab with memory when it is created (``DramTier``'s
    ``populate``), not page by page as blocks first land."""
    shm_name: str | None = None
    """Name of the slab in /dev/shm (default: kvstore-<uid>-<pid>-<random>)."""
    policy: PolicyName = PolicyName.LRU
    """Eviction policy; a str ("lru", "lfu" or "cost") is accepted and converted."""
    reservation_timeout: float = 30.0
    """Seconds after which an uncommitted reservation is reclaimed."""
    verify_reads: bool = True
    """Check each block's xxh3_64 on every read out of DRAM."""
    ssd: SsdSpec | None = None
    """The SSD tier (None: no SSD tier)."""
    copy_threads: int = 2
    """Threads that copy (and checksum) one large batch in parallel."""
    tenant_shares: tuple[tuple[str, float], ...] = ()
    """(tenant, share of each tier): a tenant holding more than its share of a
    tier has its blocks evicted first, so another tenant's burst cannot push a
    tenant below its share."""
    default_tenant_share: float = 1.0
    """Share of tenants not named in ``tenant_shares`` (1.0: no limit)."""
    hbm: HbmSpec | None = None
    """The HBM tier (None: no HBM tier; see kvstore.core.hbm_mover)."""
    dram_admission: bool = False
    """When DRAM is full, store a new block only if it was looked up at least
    as often as the block it would evict (``eviction.FrequencySketch``;
    TinyLFU). Otherwise its put answers CAPACITY (docs/replay.md)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", PolicyName.parse(self.policy))
        check_slab_size("dram", self.dram_bytes)


class TieredStore:
    """See the module docstring. A facade: the work is done by the
    components it owns, ``ns_registry`` (``Namespaces``), ``place``
    (``Placement``: index, tiers, eviction), ``holds`` (``Holds``),
    ``resizer`` (``Resizer``), ``ssd`` (``SsdMover``) and ``hbm``
    (``HbmMover``)."""

    def __init__(self, config: StoreConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or StoreConfig()
        self.clock = clock
        cfg = self.config
        policy = make_policy(cfg.policy)  # validated before the slab exists
        quotas = bool(cfg.tenant_shares) or cfg.default_tenant_share < 1.0
        shares = TenantShares(dict(cfg.tenant_shares), cfg.default_tenant_share) if quotas else None
        self.ns_registry = Namespaces()
        self.counters = Counters()
        dram = DramTier(cfg.dram_bytes, name=cfg.shm_name, page_bytes=cfg.dram_page_bytes,
                        slot_sizes=cfg.dram_slot_sizes, copy_threads=cfg.copy_threads,
                        populate=cfg.dram_populate)
        self.place = Placement(dram, policy, self.ns_registry, self.counters, verify_reads=cfg.verify_reads,
                               freq=FrequencySketch(cfg.dram_bytes >> 10) if cfg.dram_admission else None,
                               shares=shares)
        self.ssd: SsdMover | None = None
        self.recovery: Recovery | None = None
        if cfg.ssd is not None:
            try:
                self.ssd = SsdMover(self.place, cfg.ssd, clock)
                self.place.attach_lower(self.ssd, self.ssd.tier)
                self.recovery = self.ssd.recover()
            except BaseException:
                dram.close()
                if self.ssd is not None:
                    self.ssd.close()
                raise
        self.hbm: HbmMover | None = None
        if cfg.hbm is not None:
            try:
                self.hbm = HbmMover(self.place, cfg.hbm)
            except BaseException:
                self.close()
                raise
            self.place.attach_upper(self.hbm, self.hbm.tier)
        self.holds = Holds(self.place, clock=clock, reservation_timeout=cfg.reservation_timeout,
                           ssd=self.ssd, hbm=self.hbm)
        self.grants = Grants(self.place, cfg.reservation_timeout)
        self.resizer = Resizer(self.place, self.ssd, self.hbm, self.grants)

    # ------------------------------------------------------------ plumbing
    @property
    def index(self) -> BlockIndex:
        return self.place.index

    @property
    def dram(self) -> DramTier:
        return self.place.dram

    @property
    def tiers(self) -> dict[TierKind, Tier]:
        return self.place.tiers

    @property
    def policy(self) -> Policy:
        return self.place.policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        """Install a policy object (a custom one, e.g. the sweep's); names go through set_policy."""
        self.place.policy = policy

    @property
    def freq(self) -> FrequencySketch | None:
        return self.place.freq

    @property
    def tier_hits(self) -> np.ndarray:
        """Blocks served (Acquire, Get) from each tier, by TierKind value."""
        return self.place.tier_hits

    def close(self) -> None:
        self.place.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def subscribe(self, listener: Callable[[Event], None]) -> None:
        self.place.subscribe(listener)

    def tenant_of(self, digest: bytes) -> str | None:
        """The tenant of the namespace with this digest; None when unknown or
        when namespaces of two tenants share the digest."""
        return self.ns_registry.tenant_of(digest)

    def background(self) -> bool:
        """One bounded step of background tier work (prefetch, write-through,
        write-back demotion, SSD reclaim). True when more is pending."""
        return self.ssd.step() if self.ssd is not None else False

    # --------------------------------------- what a call needs (the daemon)
    def needs_disk_read(self, ns: Namespace, keys: KeysLike) -> bool:
        """Would a Get or Acquire of these keys read the SSD tier?"""
        if self.ssd is None:
            return False
        try:
            rows = self.index.find_committed(self.place.nsid(ns, create=False), keys_to_array(keys))
        except KVStoreError:
            return False  # the call itself answers the bad input
        rows = rows[rows >= 0]
        return bool(np.any(self.index.tier[rows] == T_SSD))

    def needs_disk_write(self, count: int, nbytes: int) -> bool:
        """Would storing ``count`` new blocks of ``nbytes`` evict (and so
        write to the SSD tier)?"""
        if self.ssd is None:
            return False
        if self.hbm is not None:
            return True
        try:
            return self.dram.free_slots(nbytes) < count
        except KVStoreError:
            return False

    def flush(self, seconds: float | None = None) -> tuple[int, int]:
        """At a clean shutdown: write DRAM-only blocks to SSD, parents first,
        for at most ``seconds`` (default ``ssd.shutdown_flush_seconds``).
        Returns (blocks written, blocks left DRAM-only); (0, 0) without SSD."""
        return self.ssd.flush(seconds) if self.ssd is not None else (0, 0)

    def namespace_id(self, ns: Namespace, create: bool = True) -> int:
        """The namespace's id in the index (``NO_NS`` for an unknown one when
        ``create`` is False)."""
        return self.place.nsid(ns, create=create)

    # -------------------------------------------------------------- lookup
    def lookup(self, ns: Namespace, keys: KeysLike) -> LookupResult:
        # a queried namespace is counted in the per-namespace stats, but
        # queries alone register at most QUERY_NAMESPACES namespaces
        nid = self.place.nsid(ns, create=len(self.ns_registry) < QUERY_NAMESPACES)
        karr = keys_to_array(keys)
        res = self.index.lookup(nid, karr)
        if self.place.freq is not None:
            self.place.freq.record(karr, self.index.live)
        c = self.counters
        c.lookups += 1
        c.lookup_blocks += karr.shape[0]
        c.lookup_hit_blocks += res.hit
        c.lookup_tokens += karr.shape[0] * ns.block_size
        c.lookup_hit_tokens += res.hit * ns.block_size
        if nid != NO_NS:
            self.ns_registry.count_lookup(nid, karr.shape[0], res.hit)
        return LookupResult(res.hit, res.tiers)

    def count_lookups(self, nid: int, lookups: int, blocks: int, hit_blocks: int) -> bool:
        """Count lookups answered outside the store, in namespace id ``nid``
        (same-host clients reading the shared index, kvstore/wire/shared_index.py)
        as ``lookup`` counts its own. False (nothing counted) for an id no
        namespace has or counts that cannot be (negative, more hits than blocks)."""
        ns = self.ns_registry.get(nid) if 0 <= nid < len(self.ns_registry) else None
        if ns is None or min(lookups, blocks, hit_blocks) < 0 or hit_blocks > blocks:
            return False
        c = self.counters
        c.lookups += lookups
        c.lookup_blocks += blocks
        c.lookup_hit_blocks += hit_blocks
        c.lookup_tokens += blocks * ns.block_size
        c.lookup_hit_tokens += hit_blocks * ns.block_size
        self.ns_registry.count_lookup(nid, blocks, hit_blocks, lookups)
        return True

    def count_reads(self, nid: int, keys: KeysLike, asked: int) -> int:
        """Count a read a same-host client made from the slab itself
        (``Holds.count_reads``); 0 for a namespace id that does not exist."""
        if not 0 <= nid < len(self.ns_registry):
            return 0
        return self.holds.count_reads(nid, keys, asked)

    def peek(self, ns: Namespace, keys: KeysLike) -> LookupResult:
        """Like ``lookup``, without counting it (for admission decisions)."""
        res = self.index.lookup(self.place.nsid(ns, create=False), keys_to_array(keys))
        return LookupResult(res.hit, res.tiers)

    def block_bytes(self, ns: Namespace) -> int | None:
        """Payload bytes of this namespace's blocks, once known."""
        nid = self.ns_registry.find(ns)
        return None if nid is None else self.ns_registry.size_of(nid)

    # ----------------------------------------------------------------- put
    def put(self, ns: Namespace, keys: KeysLike, payloads: Sequence[Buffer],
            parent: bytes | None = None, tier: TierKind | None = None) -> BatchResult:
        """Store a chain segment. ``keys[0]``'s parent is ``parent``; ``tier``
        asks for HBM (see kvstore.core.hbm_mover)."""
        nid = self.place.nsid(ns)
        karr = keys_to_array(keys)
        n = karr.shape[0]
        if len(payloads) != n:
            raise InvalidArgument(f"{n} keys but {len(payloads)} payloads")
        res = BatchResult([KeyStatus.OK] * n)
        srcs: list[np.ndarray | None] = []
        sizes: list[int] = []
        for i, p in enumerate(payloads):
            try:
                a = as_u8(p)
            except (TypeError, ValueError) as e:
                a = None
                res.messages[i] = f"payload {i} is not a buffer: {e}"
            srcs.append(a)
            sizes.append(a.size if a is not None else 0)
        todo, rows, locs = self.place.store_rows(nid, karr, sizes, parent, BlockState.RESERVED, res, tier)
        if todo and self.hbm is not None and self.index.tier[rows[0]] == T_HBM:
            todo, rows = self.hbm.write_put(todo, rows, locs, srcs, res)
        elif todo:
            csums = self.dram.write(locs, [srcs[i] for i in todo])  # type: ignore[misc]
            self.index.csum[rows] = csums
        if todo:
            self.place.committed(nid, rows)
        self.place.count_put(nid, len(todo), int(sum(sizes[i] for i in todo)))
        return res

    # ----------------------------------------------------------------- get
    def get_into(self, ns: Namespace, keys: KeysLike, outs: Sequence[Buffer]) -> BatchResult:
        """Copy each present block into ``outs[i]`` (exactly its size)."""
        nid = self.place.nsid(ns, create=False)
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
            have = as_u8(outs[i]).size
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
        ok = self.place.read(sel, outs)
        bad = sel[~ok]
        if bad.size:
            for i in which[~ok].tolist():
                res.statuses[i] = KeyStatus.CORRUPT
            self.place.corrupt(bad)
        good_rows = sel[ok]
        for i in which[ok].tolist():
            res.statuses[i] = KeyStatus.OK
        self.place.served(good_rows)  # (with the blocks and bytes served)
        if self.ssd is not None and good_rows.size:
            self.ssd.on_read(good_rows)
        return which[ok]

    def get(self, ns: Namespace, keys: KeysLike) -> GetResult:
        """Copies of the present blocks (None where missing)."""
        nid = self.place.nsid(ns, create=False)
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
        pinned or reserved block stays (BUSY); a key removed with an earlier
        key's subtree (or given twice) is a MISS, as if the keys were removed
        one after another. One pass for the whole batch: one ``subtree`` of
        all the keys' blocks (one scan of the index at most), then the held
        blocks' ancestors and each block's earliest removed ancestor by
        pointer doubling within that set."""
        nid = self.place.nsid(ns, create=False)
        idx = self.index
        rows = idx.find_committed(nid, keys_to_array(keys))
        res = BatchResult([KeyStatus.MISS] * rows.size)
        live = rows >= 0
        live[live] = idx.state[rows[live]] == S_COMMITTED
        if not live.any():
            return res
        which = np.flatnonzero(live)
        roots, first = np.unique(rows[which], return_index=True)
        sub = idx.subtree(roots)
        held = self.place.held(sub)
        busy = close_upward(idx, sub, held) if held.any() else np.zeros(sub.size, dtype=bool)
        sorter = np.argsort(sub, kind="stable")
        at = sorter[np.searchsorted(sub, roots, sorter=sorter)]  # each root's position in ``sub``
        order = np.full(sub.size, np.inf)
        order[at] = np.where(busy[at], np.inf, which[first].astype(np.float64))
        earliest = ancestor_min(idx, sub, order)  # the first key (in order) whose removal takes each row
        mine = at[np.searchsorted(roots, rows[which])]  # each live key's block's position in ``sub``
        for i, b, ok in zip(which.tolist(), busy[mine].tolist(), (earliest[mine] == which).tolist()):
            if b:
                res.statuses[i] = KeyStatus.BUSY
                res.messages[i] = "block or a descendant is pinned or being written"
            elif ok:
                res.statuses[i] = KeyStatus.OK
        gone = sub[np.isfinite(earliest)]
        if gone.size:
            self.place.drop(gone, DropReason.REMOVED)
        return res

    def clear(self, ns: Namespace | None = None) -> int:
        """Remove every block (of ``ns``, or of all namespaces) that is not
        pinned or being written, nor an ancestor of one. Returns how many."""
        idx = self.index
        rows = idx.used_rows()
        nid: int | None = None
        if ns is not None:
            nid = self.ns_registry.find(ns)
            if nid is None:
                return 0
            rows = rows[idx.ns[rows] == nid]
        busy = rows[(idx.pins[rows] > 0) | (idx.state[rows] != S_COMMITTED)]
        if busy.size:  # a busy block keeps its ancestors (one walk up in C, else numpy rounds)
            rows = rows[~ancestors(idx.parent, busy)[rows]]
        # drop leaves-first is not needed: the set is closed under descendants
        self.place.drop(rows, DropReason.CLEARED)
        digest = ns.digest if ns is not None else b""
        self.place.emit(Event(EventKind.CLEARED, digest, []))
        if nid is not None and not busy.size:
            self.ns_registry.forget_size(nid)
        return int(rows.size)

    # ------------------------------------------------------------- stats
    def stats(self, tenant: str | None = None) -> StoreStats:
        """The whole store's stats; with ``tenant``, that tenant's alone
        (its namespaces, its blocks, its activity: kvstore/core/tenant_view.py)."""
        if tenant is not None:
            tiers, counters, (up, down) = tenant_view(self.index, self.tiers, self.ns_registry, tenant)
            nss = [n for n in self.stats().namespaces if n.tenant == tenant]
            return StoreStats(tiers, counters, nss, self.policy.name.value, 0, 0, 0, up, down)
        idx = self.index
        rows = idx.used_rows()
        out = []
        for kind, t in self.tiers.items():
            sel = rows[idx.tier[rows] == kind]
            pinned = sel[idx.pins[sel] > 0]
            # evictions: left for room (demotions apart; other reasons in kvstore_evictions_total)
            ev = sum(v for (tk, r), v in self.counters.evictions.items() if tk == kind and r in ROOM_REASONS)
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
        per_ns = np.bincount(idx.ns[rows[idx.state[rows] == S_COMMITTED]].astype(np.int64),
                             minlength=len(self.ns_registry))
        ns_stats = []
        for nid, ns in self.ns_registry.items():
            n_l, q, h = self.ns_registry.lookups(nid)
            ns_stats.append(NamespaceStats(namespace_label(ns), ns.tenant, ns.digest, n_l, q, h, int(per_ns[nid])))
        leases, reservations = self.holds.counts()
        moved = (self.ssd.bytes_promoted, self.ssd.bytes_demoted) if self.ssd is not None else (0, 0)
        return StoreStats(out, self.counters, ns_stats, self.policy.name.value, reservations, leases,
                          sum(self.grants.bytes.values()), *moved)

    def namespaces(self) -> Iterable[Namespace]:
        return self.ns_registry.all()

    def committed_blocks(self) -> list[tuple[bytes, list[bytes]]]:
        """Every committed block, as (namespace digest, keys) per namespace."""
        idx = self.index
        rows = idx.used_rows()
        rows = rows[idx.state[rows] == S_COMMITTED]
        nss = idx.ns[rows]
        return [(self.ns_registry.digest(nid), idx.keys_of(rows[nss == nid])) for nid in np.unique(nss).tolist()]

    # ------------------------------------------------ holds (see Holds)
    def reserve(self, ns: Namespace, keys: KeysLike, sizes: Sequence[int] | int,
                owner: str, parent: bytes | None = None, tier: TierKind | None = None) -> SlotResult:
        return self.holds.reserve(ns, keys, sizes, owner, parent, tier)

    def commit(self, handle: str, owner: str, checksums: Sequence[int] | None = None) -> BatchResult:
        return self.holds.commit(handle, owner, checksums)

    def abort(self, handle: str, owner: str) -> int:
        return self.holds.abort(handle, owner)

    def commit_prefix(self, handle: str, owner: str, keep: int, checksums: Sequence[int] | None = None) -> int:
        return self.holds.commit_prefix(handle, owner, keep, checksums)

    def acquire(self, ns: Namespace, keys: KeysLike, owner: str, ttl: float | None = None,
                promote: bool = True, tier: TierKind | None = None) -> SlotResult:
        return self.holds.acquire(ns, keys, owner, ttl, promote, tier)

    def release(self, handle: str, owner: str) -> int:
        return self.holds.release(handle, owner)

    def prefetch(self, ns: Namespace, keys: KeysLike) -> tuple[int, int, int]:
        return self.holds.prefetch(ns, keys)

    def report_corrupt(self, ns: Namespace, keys: KeysLike) -> int:
        return self.holds.report_corrupt(ns, keys)

    def quarantine(self, handle: str) -> bool:
        """Forget a reservation but keep its slots reserved for good (see
        ``Holds.quarantine``). True when it was held."""
        return self.holds.quarantine(handle)

    def count_checksum_failures(self, blocks: int, ns: Namespace | None = None) -> None:
        """Count blocks that failed their checksum outside the store (a
        cluster fetch's damaged transfers), for ``ns``'s tenant too."""
        self.counters.checksum_failures += int(blocks)
        nid = self.ns_registry.find(ns) if ns is not None else None
        if nid is not None:
            self.ns_registry.counts[nid][CHECKSUM_FAILURES] += int(blocks)

    def release_owner(self, owner: str) -> tuple[int, int]:
        self.grants.release(owner)
        return self.holds.release_owner(owner)

    def reap(self, now: float | None = None) -> int:
        now = self.clock() if now is None else now
        return self.holds.reap(now) + self.grants.reap(now)

    # ------------------------------------------ granted slots (see Grants)
    def grant(self, ns: Namespace, nbytes: int, count: int, owner: str, limit: int,
              returned: Sequence[int] = ()) -> np.ndarray:
        self.grants.give_back(owner, returned)
        return self.grants.grant(ns, nbytes, count, owner, limit, self.clock())

    def put_granted(self, ns: Namespace, keys: KeysLike, nbytes: int, locs: Sequence[int],
                    checksums: Sequence[int], owner: str, parent: bytes | None = None) -> BatchResult:
        return self.grants.put(ns, keys, nbytes, locs, checksums, owner, parent)

    def pin(self, ns: Namespace, keys: KeysLike) -> BatchResult:
        return self.holds.pin(ns, keys)

    def unpin(self, ns: Namespace, keys: KeysLike) -> BatchResult:
        return self.holds.unpin(ns, keys)

    def hold_counts(self) -> tuple[int, int]:
        """(open leases, open reservations)."""
        return self.holds.counts()

    # --------------------------------------------- run time (see Resizer)
    def set_policy(self, name: str | PolicyName) -> str:
        return self.resizer.set_policy(name)

    def resize(self, tier: TierKind, capacity_bytes: int) -> int:
        return self.resizer.resize(tier, capacity_bytes)
