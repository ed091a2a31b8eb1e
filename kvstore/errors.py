"""One exception tree for the whole project, and the per-key status enum.

Whole-call failures raise a subclass of :class:`KVStoreError`; batch calls
return one :class:`KeyStatus` per key instead of raising for a single bad key.
The gRPC layer maps each class to a status code in one table
(``kvstore.wire.status.STATUS_TABLE``, both directions); nothing below the
wire and daemon layers imports grpc.
"""

from __future__ import annotations

from enum import IntEnum


class KeyStatus(IntEnum):
    """Outcome for one key of a batch call."""

    OK = 0
    """Done: stored, found, pinned, removed."""
    MISS = 1
    """Not present (or present but unusable, e.g. still reserved by a writer)."""
    EXISTS = 2
    """Put/reserve of a key that is already stored: nothing to write."""
    CAPACITY = 3
    """No room after eviction; nothing else was disturbed."""
    INVALID = 4
    """This key's input is malformed (wrong size, bad key length)."""
    PARENT_MISSING = 5
    """The block's parent is not stored, so the block could never be reached."""
    CORRUPT = 6
    """Checksum mismatch on read: the block was dropped; treat as a miss."""
    BUSY = 7
    """Another writer holds a reservation on this key."""
    NOT_OWNER = 8
    """The caller does not own the reservation or lease it names."""


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose."""


class InvalidArgument(KVStoreError, ValueError):
    """Malformed input: names the field and what is allowed."""


class NotFound(KVStoreError, KeyError):
    """A named object (lease, namespace, tier) does not exist."""

    def __str__(self) -> str:  # KeyError quotes its message; we do not want that
        return str(self.args[0]) if self.args else ""


class CapacityError(KVStoreError):
    """Not enough room (or a queue is full): RESOURCE_EXHAUSTED."""


class Unavailable(KVStoreError):
    """A tier, peer or the daemon cannot serve right now."""


class DeadlineExceeded(KVStoreError, TimeoutError):
    """The call's deadline passed before it could complete."""


class DataLoss(KVStoreError):
    """A checksum or identity check failed on data that had to be intact."""


class PermissionDenied(KVStoreError, PermissionError):
    """Authenticated, but not allowed (e.g. another client's lease)."""


class Unauthenticated(KVStoreError):
    """Missing or wrong credentials."""
