"""What the store's batch calls return, the events it emits, and its stats.

Batch calls answer one ``KeyStatus`` per key (``BatchResult``); slot-returning
calls (reserve, acquire) carry parallel arrays of locations (``SlotResult``:
no object per block). ``Event`` is what ``WatchEvents`` and the tier movement
publish; ``StoreStats`` is the snapshot behind ``Stats`` and the Prometheus
collector.

The client answers with the same types (``LookupResult``, ``Event``) and with
``DaemonStats``, ``ClusterLookup``, ``ResizeResult``, ``PolicyChange``: typed
results at the boundary, never a ``dict`` or a protobuf message.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping

import numpy as np

from kvstore.errors import KeyStatus
from tiers.base import TierKind


class EventKind(str, Enum):
    """What an ``Event`` reports. A ``str`` enum: equal to (and formatted
    as) its value, so code and tests comparing with "stored" keep working."""

    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"
    GAP = "gap"
    """WatchEvents only: events before ``first_available_seq`` were lost."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class DropReason(str, Enum):
    """Why blocks left a tier: the ``reason`` of a "removed" ``Event`` and
    the second half of a ``Counters.evictions`` key. A ``str`` enum with the
    wire's strings as values."""

    NONE = ""
    """Not a removal (events of other kinds)."""
    EVICTED = "evicted"
    """Made room for other blocks (and had nowhere lower to go)."""
    REMOVED = "removed"
    """An explicit Remove."""
    CLEARED = "cleared"
    """An explicit Clear."""
    CORRUPT = "corrupt"
    """Failed its checksum (or an ancestor did)."""
    ABORTED = "aborted"
    """A reservation ended without commit (abort, expiry, a failed copy)."""
    RESIZED = "resized"
    """Did not fit when its tier shrank."""
    MOVED = "moved"
    """Left one tier for another (a "stored" event names the new one)."""
    DEMOTED = "demoted"
    """Counted in ``Counters.evictions``: moved down a tier on eviction."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


ROOM_REASONS = frozenset({DropReason.EVICTED, DropReason.RESIZED})
"""The reasons ``TierStats.evictions`` sums: blocks that left a tier for lack of room (a
demotion is counted in ``TierStats.demotions``; a remove, clear, abort or corrupt block is none)."""


@dataclass(slots=True)
class BatchResult:
    """One status per key, plus a message for keys that failed for a reason
    worth naming (index -> text)."""

    statuses: list[KeyStatus]
    messages: dict[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(s in (KeyStatus.OK, KeyStatus.EXISTS) for s in self.statuses)


@dataclass(slots=True)
class GetResult(BatchResult):
    payloads: list[np.ndarray | None] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class SlotRef:
    """Where a block's bytes are in a tier: what a zero-copy client needs."""

    tier: TierKind
    offset: int
    length: int
    checksum: int = 0


@dataclass(slots=True)
class SlotResult(BatchResult):
    """Reserve/acquire result: where each OK key's bytes are, as parallel
    arrays (no object per block); offset -1 where the key has no slot."""

    handle: str = ""
    tier_codes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    offsets: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    checksums: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))

    @classmethod
    def empty(cls, n: int, status: KeyStatus) -> SlotResult:
        return cls([status] * n, tier_codes=np.zeros(n, np.uint8), offsets=np.full(n, -1, np.int64),
                   lengths=np.zeros(n, np.int64), checksums=np.zeros(n, np.uint64))

    @property
    def slots(self) -> list[SlotRef | None]:
        return [SlotRef(TierKind(int(t)), int(o), int(n), int(c)) if o >= 0 else None
                for t, o, n, c in zip(self.tier_codes, self.offsets, self.lengths, self.checksums)]


@dataclass(slots=True, frozen=True)
class LookupResult:
    """The leading present blocks of a chain and the tier of each (the store's
    and the client's answer alike)."""

    hit_blocks: int
    tier_codes: np.ndarray
    """TierKind value of each hit block (uint8), ``hit_blocks`` long."""

    @property
    def tiers(self) -> list[TierKind]:
        return [TierKind(t) for t in self.tier_codes.tolist()]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LookupResult):
            return NotImplemented
        return self.hit_blocks == other.hit_blocks and bool(np.array_equal(self.tier_codes, other.tier_codes))

    __hash__ = None  # type: ignore[assignment]


@dataclass(slots=True, frozen=True)
class Event:
    """A change other components may follow (WatchEvents, the cluster directory).

    ``kind`` and ``reason`` are normalised to their enums (a plain string of
    the same value is accepted and converted)."""

    kind: EventKind
    ns_digest: bytes
    keys: list[bytes]
    tier: TierKind | None = None
    reason: DropReason = DropReason.NONE
    parent: bytes | None = None
    seq: int = 0
    """WatchEvents: the daemon's sequence number (0 on a GAP)."""
    time_unix_ns: int = 0
    first_available_seq: int = 0
    """GAP only: the oldest event still buffered."""
    all_namespaces: bool = False
    """CLEARED only: every namespace the caller may see was cleared."""
    run_id: int = 0
    """WatchEvents: the daemon run that sent it (random per start; 0 from an
    older daemon). A change means the daemon restarted: forget what it held."""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, EventKind):
            object.__setattr__(self, "kind", EventKind(self.kind))
        if not isinstance(self.reason, DropReason):
            object.__setattr__(self, "reason", DropReason(self.reason or ""))


@dataclass(slots=True)
class TierStats:
    tier: TierKind
    capacity_bytes: int
    used_bytes: int
    blocks: int
    pinned_bytes: int
    evictions: int
    """Blocks that left the tier for room (``ROOM_REASONS``: evicted, resized)."""
    promotions: int = 0
    demotions: int = 0
    disk_bytes: int = 0
    """Bytes on disk (SSD: segments incl. garbage not yet reclaimed, index)."""
    hits: int = 0
    """Blocks served (Acquire, Get) that were in this tier when asked: an
    Acquire that promotes an SSD block first counts its hit as SSD's."""


@dataclass(slots=True)
class Counters:
    lookups: int = 0
    lookup_blocks: int = 0
    lookup_hit_blocks: int = 0
    lookup_tokens: int = 0
    lookup_hit_tokens: int = 0
    puts: int = 0
    put_blocks: int = 0
    put_bytes: int = 0
    gets: int = 0
    get_blocks: int = 0
    get_hit_blocks: int = 0
    get_bytes: int = 0
    checksum_failures: int = 0
    capacity_rejects: int = 0
    reservations_expired: int = 0
    leases_expired: int = 0
    evictions: dict[tuple[TierKind, DropReason], int] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class NamespaceStats:
    label: str
    tenant: str
    digest: bytes
    lookups: int
    queried_blocks: int
    hit_blocks: int
    blocks: int


@dataclass(slots=True)
class StoreStats:
    tiers: list[TierStats]
    counters: Counters
    namespaces: list[NamespaceStats]
    policy: str
    reservations: int
    leases: int
    granted_bytes: int = 0
    """DRAM slots granted to same-host writers ahead of their puts (in the
    DRAM tier's used bytes, not blocks yet; kvstore/core/grants.py)."""
    bytes_promoted: int = 0
    """Payload bytes read from SSD into DRAM (kvstore/core/ssd_mover.py)."""
    bytes_demoted: int = 0
    """Payload bytes written from DRAM to SSD (demotions, write-through copies)."""


# ------------------------------------------------------------ client side
_TIER_WIRE: dict[TierKind | None, str] = {None: "TIER_UNSPECIFIED", **{t: f"TIER_{t.name}" for t in TierKind}}
_U64_FIELDS = ("lookups", "hit_blocks", "miss_blocks", "hit_tokens", "miss_tokens", "puts", "gets",
               "bytes_written", "bytes_read", "bytes_promoted", "bytes_demoted", "checksum_failures",
               "active_reservations", "active_leases", "reservations_expired", "leases_expired", "sessions",
               "admitted", "admitted_degraded", "rejected")
_TIER_U64 = ("capacity_bytes", "used_bytes", "blocks", "pinned_bytes", "evictions", "promotions", "demotions",
             "hits", "disk_bytes")


@dataclass(slots=True)
class DaemonStats:
    """What ``Client.stats()`` answers: the daemon's counters, its tiers and
    (when asked) its namespaces. ``NamespaceStats.tenant`` is "" here (the
    wire carries the label, which names the tenant)."""

    tiers: list[TierStats] = field(default_factory=list)
    namespaces: list[NamespaceStats] = field(default_factory=list)
    lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    puts: int = 0
    gets: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    bytes_promoted: int = 0
    bytes_demoted: int = 0
    checksum_failures: int = 0
    active_reservations: int = 0
    active_leases: int = 0
    reservations_expired: int = 0
    """Reservations aborted uncommitted after ``server.reservation_timeout``, since start."""
    leases_expired: int = 0
    """Leases (taken without a session) released after ``server.reservation_timeout``, since start."""
    sessions: int = 0
    uptime_seconds: float = 0.0
    admitted: int = 0
    admitted_degraded: int = 0
    rejected: int = 0
    prefill_tokens_per_s: float = 0.0
    ttft_error_ewma_s: float = 0.0
    cluster_members: int = 0
    cluster_status: str = ""
    tenant: str = ""
    """The scope of the figures: "" for the whole daemon (auth off, or an
    admin credential); else the caller's tenant, whose own activity and
    blocks they are (tier capacities stay the daemon's)."""

    def tier(self, kind: TierKind) -> TierStats | None:
        """The stats of one tier (None when it is not configured)."""
        return next((t for t in self.tiers if t.tier is kind), None)

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of the wire message (proto field names; uint64 as
        strings, tiers as "TIER_DRAM", digests base64), e.g. for ``--json``."""
        out: dict[str, Any] = {k: str(getattr(self, k)) for k in _U64_FIELDS}
        out["uptime_seconds"] = float(self.uptime_seconds)
        out["prefill_tokens_per_s"] = float(self.prefill_tokens_per_s)
        out["ttft_error_ewma_s"] = float(self.ttft_error_ewma_s)
        out["cluster_members"] = int(self.cluster_members)
        out["cluster_status"] = self.cluster_status
        out["tenant"] = self.tenant
        out["tiers"] = [{"tier": _TIER_WIRE[t.tier], **{k: str(getattr(t, k)) for k in _TIER_U64}}
                        for t in self.tiers]
        out["namespaces"] = [{"namespace_label": n.label, "ns_digest": base64.b64encode(n.digest).decode(),
                              "lookups": str(n.lookups), "hit_blocks": str(n.hit_blocks),
                              "queried_blocks": str(n.queried_blocks), "blocks": str(n.blocks)}
                             for n in self.namespaces]
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DaemonStats":
        """``to_dict`` undone (absent fields are 0)."""
        names = {n: TierKind[n[5:]] for n in _TIER_WIRE.values() if n != "TIER_UNSPECIFIED"}
        tiers = [TierStats(tier=names[str(t.get("tier"))], **{k: int(t.get(k, 0) or 0) for k in _TIER_U64})
                 for t in d.get("tiers", []) or []]
        nss = [NamespaceStats(label=str(n.get("namespace_label", "")), tenant="",
                              digest=base64.b64decode(n.get("ns_digest", "") or ""),
                              lookups=int(n.get("lookups", 0) or 0), queried_blocks=int(n.get("queried_blocks", 0) or 0),
                              hit_blocks=int(n.get("hit_blocks", 0) or 0), blocks=int(n.get("blocks", 0) or 0))
               for n in d.get("namespaces", []) or []]
        return cls(tiers=tiers, namespaces=nss, **{k: int(d.get(k, 0) or 0) for k in _U64_FIELDS},
                   uptime_seconds=float(d.get("uptime_seconds", 0) or 0),
                   prefill_tokens_per_s=float(d.get("prefill_tokens_per_s", 0) or 0),
                   ttft_error_ewma_s=float(d.get("ttft_error_ewma_s", 0) or 0),
                   cluster_members=int(d.get("cluster_members", 0) or 0),
                   cluster_status=str(d.get("cluster_status", "") or ""),
                   tenant=str(d.get("tenant", "") or ""))


@dataclass(slots=True, frozen=True)
class HbmRegion:
    """The daemon's HBM tier as a same-host client may map it
    (``Client.hbm_regions``): raw CUDA IPC handle bytes, never a pickled
    object."""

    device: int
    ipc_handle: bytes
    size_bytes: int
    base_offset: int
    ipc: bool
    """False: the tier runs on the host (hbm.on_cpu) and cannot be mapped."""
    slab_id: str
    device_name: str


class ChainDecisionKind(str, Enum):
    """What to do with the blocks of a chain that peers hold."""

    LOCAL = "local"
    FETCH = "fetch"
    RECOMPUTE = "recompute"


@dataclass(slots=True, frozen=True)
class BlockLocation:
    """Where one block of a cluster lookup is: a local tier, or REMOTE at ``peer``."""

    tier: TierKind | None
    peer: str
    load_s: float


@dataclass(slots=True, frozen=True)
class ClusterLookup:
    """``Client.cluster_lookup``: the local prefix, the run peers hold after
    it, and the decision for that run with both estimates (seconds)."""

    local_blocks: int
    remote_blocks: int
    decision: ChainDecisionKind
    fetch_s: float
    recompute_s: float
    locations: list[BlockLocation]
    status: str

    def hint(self, a: int = 0, b: int | None = None) -> tuple[str, int, int]:
        """``Client.acquire``'s ``peer`` for the keys [a, b) of the chain
        looked up: (peer, first, blocks) of the run peers hold, counted in
        those keys, so the daemon does not locate it again; ("", 0, 0) when
        those keys hold none of it."""
        peer = next((x.peer for x in self.locations if x.peer), "")
        start = self.local_blocks
        lo, hi = max(a, start), start + self.remote_blocks if b is None else min(b, start + self.remote_blocks)
        return (peer, lo - a, hi - lo) if peer and hi > lo else ("", 0, 0)


@dataclass(slots=True, frozen=True)
class ResizeResult:
    """``Client.admin_resize``."""

    old_capacity_bytes: int
    new_capacity_bytes: int
    evicted_blocks: int


@dataclass(slots=True, frozen=True)
class PolicyChange:
    """``Client.admin_set_policy``."""

    old_policy: str
    new_policy: str
