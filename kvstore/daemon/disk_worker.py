"""SSD work off the daemon's event loop (issue 19, item 3).

The store is single-writer: every call holds its store lock
(``kvstore.core.ssd_io``). Calls that may read or write the SSD tier (a Get or
Acquire of blocks on SSD, a Put or Reserve that must evict, background tier
work, resizes) run on one worker thread, the *disk worker*, which lets go of
the store lock while its file I/O runs; every other call (lookups, DRAM
hits, puts into free slots) runs on the loop as before. So a slow disk
delays only the calls that need it, never a Lookup or a DRAM hit.

``LockedStore`` is the store as the servicers see it: each method call takes
the store lock; attributes are the store's own.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from kvstore.core.ssd_io import StoreLock
from kvstore.core.store import TieredStore

T = TypeVar("T")


class LockedStore:
    """The store, with each method call under its store lock."""

    def __init__(self, store: TieredStore, lock: StoreLock) -> None:
        object.__setattr__(self, "raw", store)
        object.__setattr__(self, "store_lock", lock)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.raw, name)
        if not callable(value) or name.startswith("__"):
            return value
        lock = self.store_lock

        @functools.wraps(value)
        def locked(*a: Any, **kw: Any) -> Any:
            with lock:
                return value(*a, **kw)

        # a method's wrapper is made once (a Lookup on the same-host socket
        # paid for a new closure and functools.wraps on every call); only
        # methods are kept: data attributes always come from the store
        object.__setattr__(self, name, locked)
        return locked

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # a test's stand-in method shadows the store's


class DiskWorker:
    """Runs disk-bound store calls on one thread (none without an SSD tier)."""

    def __init__(self, store: TieredStore) -> None:
        self.raw = store
        gate = store.ssd.gate if store.ssd is not None else None
        self.lock = gate.store_lock if gate is not None else StoreLock()
        self.store = cast(TieredStore, LockedStore(store, self.lock))
        self.pool: ThreadPoolExecutor | None = None
        if gate is not None:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-disk",
                                           initializer=self._mark, initargs=(gate,))

    @staticmethod
    def _mark(gate: Any) -> None:
        gate.worker = threading.get_ident()

    async def run(self, disk: Callable[[], bool], fn: Callable[..., T], *args: Any,
                  undo: Callable[[T], Any] | None = None, **kw: Any) -> T:
        """``fn(*args, **kw)`` (a ``self.store`` method): on the loop when
        ``disk()`` says it needs no SSD I/O (checked under the store lock,
        and the call made under the same hold), else on the disk worker.
        A call whose caller goes away (the handler is cancelled) still runs
        to its end; ``undo(result)`` then gives back what it took (a lease,
        a reservation)."""
        if self.pool is None:
            return fn(*args, **kw)
        with self.lock:
            if not disk():
                return fn(*args, **kw)
        fut = asyncio.get_running_loop().run_in_executor(self.pool, self._locked, fn, args, kw)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if undo is not None:
                fut.add_done_callback(functools.partial(_undo_when_done, undo))
            raise

    async def always(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """``fn`` on the disk worker (background work, resizes)."""
        return await self.run(lambda: True, fn, *args, **kw)

    def _locked(self, fn: Callable[..., T], args: tuple[Any, ...], kw: dict[str, Any]) -> T:
        with self.lock:
            return fn(*args, **kw)

    def close(self) -> None:
        """Wait for the call in flight (a bounded step) and stop the thread."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _undo_when_done(undo: Callable[[Any], Any], fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        undo(fut.result())
