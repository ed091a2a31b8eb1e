"""What the store's batch calls return, the events it emits, and its stats.

Batch calls answer one ``KeyStatus`` per key (``BatchResult``); slot-returning
calls (reserve, acquire) carry parallel arrays of locations (``SlotResult``:
no object per block). ``Event`` is what ``WatchEvents`` and the tier movement
publish; ``StoreStats`` is the snapshot behind ``Stats`` and the Prometheus
collector.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from kvstore.errors import KeyStatus
from tiers.base import TierKind


class EventKind(str, Enum):
    """What an ``Event`` reports. A ``str`` enum: equal to (and formatted
    as) its value, so code and tests comparing with "stored" keep working."""

    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"

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
    hit_blocks: int
    tier_codes: np.ndarray
    """TierKind value of each hit block (uint8), ``hit_blocks`` long."""

    @property
    def tiers(self) -> list[TierKind]:
        return [TierKind(t) for t in self.tier_codes.tolist()]


@dataclass(slots=True, frozen=True)
class Event:
    """A change other components may follow (WatchEvents, the cluster directory)."""

    kind: EventKind
    ns_digest: bytes
    keys: list[bytes]
    tier: TierKind | None = None
    reason: DropReason = DropReason.NONE
    parent: bytes | None = None


@dataclass(slots=True)
class TierStats:
    tier: TierKind
    capacity_bytes: int
    used_bytes: int
    blocks: int
    pinned_bytes: int
    evictions: int
    promotions: int = 0
    demotions: int = 0
    disk_bytes: int = 0
    """Bytes on disk (SSD: segments incl. garbage not yet reclaimed, index)."""
    hits: int = 0
    """Blocks served from this tier (Acquire, Get)."""


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
