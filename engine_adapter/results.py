"""What the engine-side connector answers: per-call results and per-rank counters.

Plain frozen dataclasses (:class:`LookupInfo`, :class:`LoadResult`,
:class:`SaveResult`) with one :class:`~kvstore.errors.KeyStatus` per block,
and :class:`ConnectorStats`, the counters of one connector (one rank).
:mod:`engine_adapter.connector` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import KeyStatus

__all__ = ["ConnectorStats", "LoadResult", "LookupInfo", "SaveResult"]


@dataclass(slots=True)
class ConnectorStats:
    """Counters of one connector (one rank)."""

    lookups: int = 0
    loads: int = 0
    hit_blocks: int = 0
    """Leading blocks the daemon reported present, over all loads."""
    loaded_blocks: int = 0
    """Blocks written into the engine's pages."""
    failed_blocks: int = 0
    """Hit blocks that did not load (checksum, a rank's shard, or an earlier failure)."""
    saves: int = 0
    saved_blocks: int = 0
    existing_blocks: int = 0
    faults: int = 0
    """Calls degraded to a miss because the daemon was unusable."""
    last_fault: str = ""


@dataclass(slots=True, frozen=True)
class LookupInfo:
    hit_blocks: int
    block_size: int
    tiers: tuple[str, ...] = ()
    """Tier of each hit block (rank 0 only; empty on other ranks)."""
    fault: str | None = None

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block_size


@dataclass(slots=True, frozen=True)
class LoadResult:
    """What a load did. Blocks ``[0, loaded_blocks)`` are in the pages;
    every other requested block must be recomputed."""

    requested_blocks: int
    hit_blocks: int
    """Leading blocks the daemon had (pinned for the copy)."""
    loaded_blocks: int
    block_size: int
    statuses: tuple[KeyStatus, ...]
    """Per requested block: OK (loaded), MISS (not cached, or a rank could not
    read its shard), CORRUPT (checksum), INVALID (wrong size),
    PARENT_MISSING (present, but an earlier block failed, so unusable)."""
    fault: str | None = None
    """Why the store could not be used at all (None when it could)."""

    @property
    def loaded_tokens(self) -> int:
        return self.loaded_blocks * self.block_size

    @property
    def failed_blocks(self) -> tuple[int, ...]:
        """Requested blocks that did not load (the engine recomputes them)."""
        return tuple(range(self.loaded_blocks, self.requested_blocks))


@dataclass(slots=True, frozen=True)
class SaveResult:
    """Per block of ``[start_block, start_block + len(statuses))``: OK (stored
    now), EXISTS (already stored), CAPACITY, BUSY, PARENT_MISSING, INVALID,
    or MISS (not stored: the daemon or a rank failed)."""

    start_block: int
    statuses: tuple[KeyStatus, ...]
    fault: str | None = None

    @property
    def stored_blocks(self) -> int:
        return sum(1 for s in self.statuses if s is KeyStatus.OK)

    @property
    def existing_blocks(self) -> int:
        return sum(1 for s in self.statuses if s is KeyStatus.EXISTS)
