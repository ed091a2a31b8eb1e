"""A same-host client's use of the daemon's shared index (layout and reader:
kvstore/wire/shared_index.py; the daemon's side: kvstore/daemon/shared_index.py).

``SharedPath`` answers ``lookup`` and reads DRAM blocks without a round
trip, and keeps what the daemon must still be told: the namespace ids it
was given (an ``nsid`` frame each, where the session's tenant is checked),
the lookups it answered (sent as ``tally`` frames) and the reads it made
(a ``reads`` frame each). It sends nothing itself: ``kvstore.client.sync.Client``
owns the socket and sends the frames this class builds. Read-your-writes:
a probe that comes back short while the client has ``Commit``s in flight
(pipelined, their answers unread) is made again once those have landed
(``again``); a full answer needs no wait, since a commit only ever adds
blocks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from kvstore.client.sinks import BlockSink
from kvstore.client.socket import LookupSocketClient
from kvstore.errors import KeyStatus, KVStoreError
from kvstore.wire.frames import NO_NSID, reads_frame, tally_frame
from kvstore.wire.shared_index import TALLY, SharedIndexReader
from kvstore.wire.shm import SlabMapping

NSID_RETRY_S = 0.5
"""How soon to ask again for the id of a namespace the daemon has none for yet."""
TALLY_EVERY = 256
"""Lookups answered from the shared index before their tally is sent."""
TALLY_SECONDS = 0.1
"""... or seconds since the first of them (the daemon's counters lag by at most this)."""


class SharedPath:
    """Lookups and lease-free reads from the daemon's shared index."""

    def __init__(self, reader: SharedIndexReader) -> None:
        self.reader = reader
        self._nids: dict[bytes, tuple[int, float]] = {}
        """Namespace wire bytes -> (the daemon's id or NO_NSID, when to ask again)."""
        self._tally: dict[int, list[int]] = {}
        self._lock = threading.Lock()
        self.pending = 0
        """Lookups answered here and not yet told the daemon."""
        self._since = 0.0
        self.reads = 0
        """Reads served here without a lease."""
        self.lookups = 0
        """Lookups answered here (a probe made again after the client's own
        commits landed is still one lookup)."""

    def nid(self, fast: LookupSocketClient, wire: bytes) -> int | None:
        """The daemon's id of a namespace (asked once over ``fast``; a
        namespace it has no id for yet is asked again after ``NSID_RETRY_S``),
        or None (also when the socket fails: the caller's socket path reports
        it). The daemon's refusal raises, as its lookup would."""
        ent = self._nids.get(wire)
        if ent is None or (ent[0] == NO_NSID and time.monotonic() >= ent[1]):
            try:
                nid = fast.nsid(wire)
            except KVStoreError:  # the daemon's answer: the same as the lookup's would be
                raise
            except OSError:
                return None
            ent = self._nids[wire] = (nid, time.monotonic() + NSID_RETRY_S)
        return None if ent[0] == NO_NSID else ent[0]

    # ------------------------------------------------------------- lookup
    def lookup(self, nid: int, packed: bytes, again: Callable[[], bool] | None = None) -> tuple[int, bytes] | None:
        """(hit blocks, wire Tier bytes) of the chain, counted for the next
        tally; None: ask the daemon. ``again``: called when the probe comes
        back short; True (it waited for the client's own commits) probes
        once more."""
        got = self.reader.lookup(nid, packed)
        if got is not None and got[0] < len(packed) // 16 and again is not None and again():
            got = self.reader.lookup(nid, packed)
        if got is not None:
            self.lookups += 1
            self._count(nid, len(packed) // 16, got[0], got[1])
        return got

    def _count(self, nid: int, blocks: int, hit: int, tiers: bytes) -> None:
        now = time.monotonic()
        with self._lock:
            t = self._tally.get(nid)
            if t is None:
                t = self._tally[nid] = [0, 0, 0, 0, 0, 0]
            t[0] += 1
            t[1] += blocks
            if hit:
                t[2] += hit
                t[3] += tiers.count(1)  # wire Tier values: TierKind + 1
                t[4] += tiers.count(2)
                t[5] += tiers.count(3)
            self.pending += 1
            if self.pending == 1:
                self._since = now

    def tally_due(self) -> bool:
        """Whether the lookups answered here should be told now
        (``TALLY_EVERY`` of them, or ``TALLY_SECONDS`` since the first)."""
        return self.pending >= TALLY_EVERY or (self.pending > 0 and time.monotonic() - self._since >= TALLY_SECONDS)

    def take_tally(self) -> bytes | None:
        """The tally frame of every lookup answered here since the last one
        (None: none); the counts are the caller's to send from now on."""
        with self._lock:
            tally, self._tally, self.pending = self._tally, {}, 0
        if not tally:
            return None
        return tally_frame(b"".join(TALLY.pack(nid, *t) for nid, t in tally.items()))

    # --------------------------------------------------------------- read
    def read(self, nid: int, packed: bytes, sink: BlockSink, slab: SlabMapping,
             again: Callable[[], bool] | None = None) -> tuple[list[KeyStatus], bytes] | None:
        """``get_into`` without a lease, when every present block of the
        prefix is in DRAM: the slots come from the shared index, the copy out
        (into ``sink``) verifies each block's checksum, and the slots are
        looked up again after it: the bytes are kept only if the index still
        names the same rows, places and checksums (a block evicted, moved or
        replaced meanwhile; a checksum that fails; a size that does not fit:
        None, and the caller takes the lease path, which writes the sink
        again and also reports corruption).
        Returns the statuses and the ``reads`` frame that tells the daemon
        (it counts the get, and the blocks' accesses as an Acquire's).
        ``again`` as for ``lookup``."""
        n = len(packed) // 16
        first = self.reader.slots(nid, packed)
        if first is not None and first[0] < n and again is not None and again():
            first = self.reader.slots(nid, packed)
        if first is None or not first[1]:
            return None
        hit, _, slots = first
        offsets, sizes = slots[:, 1].tolist(), slots[:, 2].tolist()
        if any(sink.size_of(i) != z for i, z in enumerate(sizes)) or not all(map(slab.covers, offsets, sizes)):
            return None  # (the lease path answers INVALID for a size that does not fit)
        if hit:
            srcs = [slab.buf[o : o + z] for o, z in zip(offsets, sizes)]
            if not sink.write(range(hit), srcs, slots[:, 3].view(np.uint64).tolist()).all():
                return None
            after = self.reader.slots(nid, packed[: 16 * hit])
            if after is None or after[0] != hit or not np.array_equal(after[2], slots):
                return None
        self.reads += 1
        return [KeyStatus.OK] * hit + [KeyStatus.MISS] * (n - hit), reads_frame(nid, n, packed[: 16 * hit])

    def close(self) -> None:
        self.reader.close()
