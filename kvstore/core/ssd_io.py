"""SSD file I/O without holding the store: the locks that let the daemon run
disk work on one worker thread while its event loop keeps serving lookups
and DRAM hits (docs/architecture.md, "SSD tier and movement").

The store stays single-writer: every store call, on the loop or on the
worker, holds ``StoreLock``. Only the slow part of an SSD call (the
``pwritev``/``fdatasync``/``preadv`` of ``SsdTier.write``, ``read_into``,
``reclaim``) runs with the store lock *released*, and only on the worker
(``IoGate.run``): the rows it works on are pinned first, so nothing the
loop does meanwhile (lookups, DRAM hits, puts into free slots) can take
them away, and the results are applied once the lock is held again. The
SSD tier itself is guarded by its own lock (``GuardedSsdTier``): a loop-side
call that reaches it waits for at most the one I/O in flight. Lock order is
always store lock, then tier lock; ``IoGate.run`` lets go of the store lock
before it takes the tier lock.

Without a daemon (tests, tools, benchmarks) nobody is the worker and
``IoGate.run`` is a plain call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from tiers.base import BlockMeta, Buffer
from tiers.ssd import SsdTier

T = TypeVar("T")


class StoreLock:
    """A re-entrant lock that its owner can let go of entirely around a
    blocking call (``suspend``/``resume``), whatever its depth."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owner: int | None = None
        self.depth = 0
        self.on_take: Callable[[], None] | None = None
        """Called each time a thread comes to hold the lock (not on re-entry)."""
        self.on_give: Callable[[], None] | None = None
        """Called each time the holder is about to let go entirely: the
        daemon's shared index publishes there (kvstore/daemon/shared_index.py)."""

    def __enter__(self) -> StoreLock:
        me = threading.get_ident()
        if self.owner == me:
            self.depth += 1
            return self
        self.lock.acquire()
        self.owner, self.depth = me, 1
        if self.on_take is not None:
            self.on_take()
        return self

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        if self.depth == 0:
            if self.on_give is not None:
                self.on_give()
            self.owner = None
            self.lock.release()

    def held(self) -> bool:
        """True when the calling thread holds it."""
        return self.owner == threading.get_ident()

    def suspend(self) -> int:
        """Let go entirely (the caller holds it); returns the depth to resume."""
        if self.on_give is not None:
            self.on_give()
        depth, self.depth, self.owner = self.depth, 0, None
        self.lock.release()
        return depth

    def resume(self, depth: int) -> None:
        self.lock.acquire()
        self.owner, self.depth = threading.get_ident(), depth
        if self.on_take is not None:
            self.on_take()


class IoGate:
    """Where the SSD mover's slow calls go. ``worker`` is the thread that
    may release the store lock around them (the daemon's disk worker)."""

    def __init__(self) -> None:
        self.store_lock = StoreLock()
        self.worker: int | None = None

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``: with the store lock released when called on the
        worker thread while holding it; a plain call everywhere else."""
        lock = self.store_lock
        if self.worker is None or threading.get_ident() != self.worker or not lock.held():
            return fn(*args)
        depth = lock.suspend()
        try:
            return fn(*args)
        finally:
            lock.resume(depth)


class GuardedSsdTier(SsdTier):
    """``SsdTier`` whose calls are serialised by one lock (``io_lock``), so the
    worker's I/O and a loop-side call never interleave inside the tier."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.io_lock = threading.RLock()
        super().__init__(*args, **kwargs)

    def allocate(self, nbytes: int, count: int) -> np.ndarray:
        with self.io_lock:
            return super().allocate(nbytes, count)

    def free(self, locs: np.ndarray) -> None:
        with self.io_lock:
            super().free(locs)

    def write(self, locs: np.ndarray, payloads: Sequence[Buffer],
              owners: Sequence[BlockMeta] | None = None) -> np.ndarray:
        with self.io_lock:
            return super().write(locs, payloads, owners)

    def read_into(self, locs: np.ndarray, sizes: np.ndarray, checksums: np.ndarray,
                  outs: Sequence[Buffer], owners: Sequence[BlockMeta] | None = None) -> np.ndarray:
        with self.io_lock:
            return super().read_into(locs, sizes, checksums, outs, owners)

    def reclaim(self, max_bytes: int | None = None) -> int:
        with self.io_lock:
            return super().reclaim(max_bytes)

    def resize(self, capacity_bytes: int) -> None:
        with self.io_lock:
            super().resize(capacity_bytes)

    def put_namespace(self, digest: bytes, descriptor: bytes) -> None:
        with self.io_lock:
            super().put_namespace(digest, descriptor)

    def namespaces(self) -> dict[bytes, bytes]:
        with self.io_lock:
            return super().namespaces()

    def close(self) -> None:
        with self.io_lock:
            super().close()
