"""What the two-phase zero-copy calls of ``kvstore.client.sync.Client``
hand back: a ``Reservation`` (``reserve`` -> write the slots -> ``commit``;
``reserve_later`` gives a ``PendingReservation`` first) and a ``Lease``
(``acquire`` -> read the slots -> ``release``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Protocol

import numpy as np

from kvstore.errors import KeyStatus
from tiers.base import TierKind

__all__ = ["Lease", "LeaseOwner", "PendingReservation", "Reservation"]


class LeaseOwner(Protocol):
    """What a ``Lease`` needs of its client."""

    def release_lease(self, lease_id: str, wait: bool = True) -> None: ...


@dataclass(slots=True)
class Reservation:
    """Slots reserved for new blocks: write ``length`` bytes at ``offset`` of
    each OK key, then ``Client.commit``."""

    reservation_id: str
    statuses: list[KeyStatus]
    offsets: list[int]
    lengths: list[int]
    tiers: list[TierKind | None] = field(default_factory=list)
    """Tier of each slot (HBM: write through Client.hbm_view)."""
    device: int = 0
    """CUDA device of the HBM slots."""


class PendingReservation:
    """A ``Client.reserve_later`` whose answer may not be read yet."""

    __slots__ = ("_answer", "_done")

    def __init__(self, answer: Callable[[], Reservation] | None, done: Reservation | None = None) -> None:
        self._answer = answer
        self._done = done

    def result(self) -> Reservation:
        """The reservation (its answer read at the first call); raises what
        ``reserve`` would have."""
        if self._done is None:
            if self._answer is None:
                raise ValueError("a PendingReservation needs an answer or a reservation")
            self._done, self._answer = self._answer(), None
        return self._done


class Lease:
    """Pinned blocks a shared-memory client reads in place: the first
    ``hit_blocks`` keys, at ``offsets``/``lengths`` in the slab."""

    def __init__(self, client: LeaseOwner, lease_id: str, hit_blocks: int, views: list[np.ndarray | None],
                 checksums: list[int], offsets: list[int] | None = None, lengths: list[int] | None = None) -> None:
        self.client = client
        self.lease_id = lease_id
        self.hit_blocks = hit_blocks
        self.views = views
        self.checksums = checksums
        self.offsets = offsets or []
        self.lengths = lengths or []
        self.tiers: list[TierKind] = [TierKind.DRAM] * hit_blocks
        self.fetched_blocks = 0
        """Cluster acquire: blocks this call fetched from a peer first (docs/cluster.md)."""
        self.decision = 0
        """Cluster acquire: the wire ``ChainDecision`` taken (0 unspecified, 1 local, 2 fetch, 3 recompute)."""
        self._released = not lease_id

    def release(self, wait: bool = True) -> None:
        """Unpin the blocks; the views must not be read after this.
        ``wait=False`` does not wait for the daemon's answer (see
        ``Client.release_lease``)."""
        if not self._released:
            self._released = True
            self.views = [None] * len(self.views)
            self.client.release_lease(self.lease_id, wait)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
