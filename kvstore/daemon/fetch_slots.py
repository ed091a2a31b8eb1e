"""The DRAM slots one cluster fetch writes into (``peers.ClusterNode.fetch``):
reserved when the transport asks for destinations, then committed up to the
first block that did not arrive intact, aborted, or -- when the transport
could not confirm that no late bytes will land in them -- quarantined.

A reservation is ended only once the transport is done with its slots: a
caller that stops waiting (its RPC cancelled, the transport overrunning its
own bound) hands the ending to ``settle``, called when the transfer ends.
Runs on the daemon's event loop; every change to the store is a store
method (the daemon's ``LockedStore`` runs each under the store lock, which
the disk worker thread also holds while it works on the store)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Sequence

import numpy as np

from kvstore.errors import KVStoreError, KeyStatus
from kvstore.keys import Namespace

log = logging.getLogger("kvstore.cluster")

FETCH_OWNER = "cluster-fetch"
"""Owner of the reservations a fetch writes into."""


class FetchSlots:
    """One fetch's reservation (none until ``alloc`` is called)."""

    def __init__(self, store: Any, ns: Namespace, want: Sequence[bytes], parent: bytes | None) -> None:
        self.store, self.ns, self.want, self.parent = store, ns, list(want), parent
        self.handle = ""
        self.res: Any = None

    def alloc(self, lengths: np.ndarray) -> list[memoryview | None]:
        """The transport's ``alloc``: a slot per block up to the first
        absent one (length <= 0) or the first the store refuses."""
        store = self.store
        lengths = np.asarray(lengths, dtype=np.int64)
        k = int(np.argmin(lengths > 0)) if (lengths <= 0).any() else int(lengths.size)
        dests: list[memoryview | None] = [None] * int(lengths.size)
        if k == 0:
            return dests
        res = store.reserve(self.ns, self.want[:k], lengths[:k].tolist(), owner=FETCH_OWNER, parent=self.parent)
        self.handle, self.res = res.handle, res
        for i in range(k):
            if res.statuses[i] is not KeyStatus.OK:
                break
            dests[i] = memoryview(store.dram.view(int(res.offsets[i]), int(res.lengths[i])))
        return dests

    def commit(self, ok: np.ndarray, checksums: Any, verified: bool = True) -> int:
        """Commit the blocks before the first one not ``ok`` (abort the
        rest) with the peer's ``checksums``; returns the blocks committed.
        ``verified=False`` (the transport did not hash them on arrival): the
        blocks are kept only with a checksum each from the peer, which their
        first reader checks; without (the store would hash the bytes as they
        landed, damage included) none is."""
        if not self.handle:
            return 0
        got = int(np.argmin(ok)) if (~ok).any() else int(ok.size)
        statuses = self.res.statuses
        reserved = 0
        while reserved < len(statuses) and statuses[reserved] is KeyStatus.OK:
            reserved += 1
        sums = None if checksums is None else np.asarray(checksums, dtype=np.uint64)[: len(statuses)]
        if not verified and (sums is None or sums.size < len(statuses)):
            log.error("an unverified fetch came without the peer's checksums: nothing of it is kept")
            got = 0
        return int(self.store.commit_prefix(self.handle, FETCH_OWNER, min(got, reserved), sums))

    def failed(self, res: Any) -> None:
        """End the reservation of a fetch that failed (its ``FetchResult``):
        quarantined when the transport could not confirm every receive ended."""
        if res.unconfirmed:
            self.quarantine()
        else:
            self.abort()

    def settle(self, transfer: asyncio.Future[Any]) -> None:
        """Done-callback of a transfer nobody waits for any more: end the
        reservation now that the transport is done with its slots."""
        if transfer.cancelled():
            self.abort()
        elif transfer.exception() is not None:
            log.warning("a fetch abandoned by its caller failed: %r", transfer.exception())
            self.abort()
        else:
            res = transfer.result()
            if res.error is not None:
                self.failed(res)
            else:
                self.abort()

    def quarantine(self) -> None:
        """The transport could not confirm that no late bytes will land in
        the slots: keep them reserved for good (leaked, never reused) rather
        than hand them to another block."""
        h, self.handle = self.handle, ""
        if h and self.store.quarantine(h):
            log.error("fetch slots of reservation %s quarantined: the transport could not confirm "
                      "its receives ended", h)

    def abort(self) -> None:
        h, self.handle = self.handle, ""
        if h:
            try:
                self.store.abort(h, FETCH_OWNER)
            except KVStoreError:
                pass


__all__ = ["FETCH_OWNER", "FetchSlots"]
