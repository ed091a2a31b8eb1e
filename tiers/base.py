"""The protocol every tier implements, and the tier enum.

A tier stores payload bytes at *locations* it hands out (a slot number for the
DRAM and HBM slabs, an id for SSD). It knows nothing about keys, chains or
eviction: the index (``kvstore.core.index``) maps keys to ``(tier, location)`` and
the store decides what moves. All calls take arrays of locations: batch first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol, runtime_checkable

import numpy as np

from kvstore.errors import InvalidArgument

Buffer = bytes | bytearray | memoryview | np.ndarray


@dataclass(slots=True, frozen=True)
class BlockMeta:
    """Who a payload belongs to: what a persistent tier keeps beside the bytes
    so that a read can prove identity and a restart can rebuild the index."""

    ns_digest: bytes
    """16-byte namespace digest (``Namespace.digest``)."""
    key: bytes
    """16-byte block key."""
    parent: bytes = b""
    """Parent block key, empty for the first block of a chain."""


class TierKind(IntEnum):
    """Tiers, hottest first. The value orders them (smaller is hotter)."""

    HBM = 0
    DRAM = 1
    SSD = 2
    REMOTE = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, name: str) -> TierKind:
        try:
            return cls[name.strip().upper()]
        except KeyError:
            allowed = ", ".join(t.label for t in cls)
            raise InvalidArgument(f"unknown tier {name!r}; allowed: {allowed}") from None


T_HBM, T_DRAM, T_SSD = int(TierKind.HBM), int(TierKind.DRAM), int(TierKind.SSD)
"""``TierKind`` values as plain ints, for numpy expressions on tier codes
(an ``IntEnum`` operand costs numpy ~2 µs more per operation; see
``kvstore.core.index.S_COMMITTED``)."""


@runtime_checkable
class Tier(Protocol):
    """Storage for fixed payloads at tier-chosen locations."""

    kind: TierKind

    @property
    def capacity_bytes(self) -> int:
        """Bytes this tier may hold (the slab or disk budget)."""

    @property
    def used_bytes(self) -> int:
        """Bytes held by allocated locations (slot sizes, not payload sizes)."""

    def footprint(self, nbytes: int) -> int:
        """Bytes one payload of ``nbytes`` occupies here; raises InvalidArgument
        when such a payload can never fit (bigger than the tier or any slot)."""

    def allocate(self, nbytes: int, count: int) -> np.ndarray:
        """Up to ``count`` locations for payloads of ``nbytes``; returns fewer
        (possibly none) when there is no free room. Never evicts."""

    def free(self, locs: np.ndarray) -> None:
        """Give locations back. Their bytes are no longer readable."""

    def write(self, locs: np.ndarray, payloads: Sequence[Buffer],
              owners: Sequence[BlockMeta] | None = None) -> np.ndarray:
        """Store payloads at locations; returns their xxh3_64 checksums (uint64).
        A persistent tier stores ``owners`` (identity) beside each payload."""

    def read_into(self, locs: np.ndarray, sizes: np.ndarray, checksums: np.ndarray,
                  outs: Sequence[Buffer], owners: Sequence[BlockMeta] | None = None) -> np.ndarray:
        """Copy payloads into ``outs``; returns a bool mask, False where the
        stored bytes no longer match their checksum, or a persistent tier's
        stored identity differs from ``owners`` (the caller drops them)."""

    def resize(self, capacity_bytes: int) -> None:
        """Change the byte budget. Shrinking below ``used_bytes`` raises
        CapacityError: the store evicts first, then shrinks."""

    def close(self) -> None:
        """Release resources (unlink shared memory, close files)."""
