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
blocks. Before it waits, a read looks in ``OwnWrites``: blocks of this
client's puts still in flight are read from where it wrote them (the
slots it reserved, checked against the checksums it computed while writing
them; or its staging ring, copied as they are while the put stays in
flight: ``SharedPath.read``), so a get right after a put does not wait for
that put (issue 18).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from kvstore.checksum import checksum_many, copy_run
from kvstore.client.sinks import BlockSink, BufferSink, read_slots, sizes_of, write_with
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


@dataclass(slots=True)
class _Written:
    """One put whose ``Commit`` was sent without waiting."""

    wire: bytes
    """The namespace's serialized message."""
    packed: bytes
    """Its keys, 16 bytes each."""
    offsets: Sequence[int] | np.ndarray
    """Each block's offset in ``buf``."""
    sizes: list[int] | int
    """Each block's size (one int: all the same)."""
    csums: list[int] | np.ndarray | None
    """Each block's checksum (uint64 values); None: not taken (a staged put, ``PUT_UNHASHED``)."""
    buf: np.ndarray
    """Where the blocks are: the slab (reserved slots) or the staging ring (a write-behind put)."""
    seq: int
    """The Commit's number on the same-host socket (``LookupSocketClient.sent``)."""
    private: bool = False
    """``buf`` is this client's staging ring (no other process writes it)."""


class OwnRun(NamedTuple):
    """A run of consecutive blocks of one put in flight (``OwnWrites.find``)."""

    offsets: list[int]
    """Each block's offset in ``buf``."""
    sizes: list[int]
    sums: list[int] | None
    """Each block's checksum (uint64 values), or None (not taken)."""
    buf: np.ndarray
    quiet: bool = False
    """The put's frame is still corked: the daemon is not copying its blocks now."""
    held: Callable[[], bool] | None = None
    """For a put in this client's staging ring: whether it is still in
    flight (asked after a copy: if so, its bytes stayed as this client wrote
    them throughout, and need no checksum)."""


class OwnWrites:
    """Where the blocks of this client's puts in flight are (their
    ``Commit``, or write-behind ``put`` frame, not yet answered; at most
    ``limit`` puts, newest kept), so that its own reads need not wait for
    them.

    Why reading them is safe: a write-behind put's bytes sit in the
    client's staging ring, which it reuses only after the put is answered
    (so a read that finds the put still in flight after its copy copied
    them as written, with no checksum: ``SharedPath.read``). A reserved
    slot belongs to the client's reservation, and nobody else writes it,
    until the daemon has run the ``Commit``; after that the block
    may be evicted and its slot reused, but the reader checks every block
    against the checksum this client computed while writing it, so a slot
    that changed is a mismatch and the read then goes the ordinary way
    (waiting for the commits). Only puts whose every block got a DRAM slot
    are kept."""

    def __init__(self, limit: int = 64) -> None:
        self.recent: deque[_Written] = deque(maxlen=limit)

    def add(self, wire: bytes, packed: bytes, offsets: Sequence[int] | np.ndarray, sizes: list[int] | int,
            csums: list[int] | np.ndarray | None, buf: np.ndarray, seq: int, private: bool = False) -> None:
        """Record a put in flight (nothing is copied: the caller leaves
        ``offsets`` and ``csums`` as they are); ``private``: in the staging
        ring (``csums`` may then be None: none were taken)."""
        self.recent.append(_Written(wire, packed, offsets, sizes, csums, buf, seq, private))

    def find(self, wire: bytes, keys: bytes, in_flight: Callable[[int], bool],
             corked: Callable[[int], bool] | None = None) -> OwnRun | None:
        """Where ``keys`` are, a run of consecutive keys of one put in flight
        in namespace ``wire`` (``OwnRun``: lists, no array built); None when
        they are not (the put was answered, or the keys span puts).
        ``corked``: whether a frame is still corked (``OwnRun.quiet``)."""
        got = self._locate(wire, keys, in_flight)
        if got is None:
            return None
        w, a, b = got
        offsets = w.offsets[a:b]
        sums = w.csums[a:b] if w.csums is not None else None
        return OwnRun(offsets.tolist() if isinstance(offsets, np.ndarray) else list(offsets),
                      [w.sizes] * (b - a) if isinstance(w.sizes, int) else list(w.sizes[a:b]),
                      sums.tolist() if isinstance(sums, np.ndarray) else None if sums is None else list(sums), w.buf,
                      corked is not None and corked(w.seq), partial(in_flight, w.seq) if w.private else None)

    def staged(self, wire: bytes, keys: bytes,
               in_flight: Callable[[int], bool]) -> tuple[np.ndarray, int, int, int] | None:
        """For ``keys`` that all lie in one write-behind put in flight in
        the staging ring (``private``): (the ring, the first block's offset
        in it, the block size, the put's frame number); else None."""
        got = self._locate(wire, keys, in_flight)
        if got is None or not got[0].private:
            return None
        w, a, _ = got
        if not isinstance(w.offsets, range) or not isinstance(w.sizes, int):
            return None
        return w.buf, w.offsets[a], w.sizes, w.seq

    def _locate(self, wire: bytes, keys: bytes,
                in_flight: Callable[[int], bool]) -> tuple[_Written, int, int] | None:
        """The put in flight holding ``keys`` as a run, and the run's block range in it."""
        for w in reversed(self.recent):
            if not in_flight(w.seq):
                break  # this put's commit and every older one were answered
            if w.wire != wire:
                continue
            pos = w.packed.find(keys)
            while pos > 0 and pos % 16:
                pos = w.packed.find(keys, pos + 1)
            if pos >= 0:
                return w, pos // 16, pos // 16 + len(keys) // 16
        return None

    def clear(self) -> None:
        self.recent.clear()


class SharedPath:
    """Lookups and lease-free reads from the daemon's shared index."""

    def __init__(self, reader: SharedIndexReader, held: bool = False) -> None:
        self.reader = reader
        self.held = held
        """Never due (``tally_due``): the owner sends the counts when it chooses."""
        self._nids: dict[bytes, tuple[int, float]] = {}
        """Namespace wire bytes -> (the daemon's id or NO_NSID, when to ask again)."""
        self._tally: dict[int, list[int]] = {}
        self._lock = threading.Lock()
        self.pending = 0
        """Lookups answered here and not yet told the daemon."""
        self._since = 0.0
        self.reads = 0
        """Reads served here without a lease."""
        self.own_blocks = 0
        """Blocks of those reads that came from the client's own puts in flight (``OwnWrites``)."""
        self._reads: list[bytes] = []
        self.lookups = 0
        """Lookups answered here (a probe made again after the client's own
        commits landed is still one lookup)."""

    def nid(self, fast: LookupSocketClient, wire: bytes) -> int | None:
        """The daemon's id of a namespace (asked once over ``fast``; a
        namespace it has no id for yet is asked again after ``NSID_RETRY_S``),
        or None (also when the socket fails: it is closed then, since a read
        that timed out leaves its answer to come, out of step with the next
        call's; the caller's next use of the socket reports it). The
        daemon's refusal raises, as its lookup would."""
        ent = self._nids.get(wire)
        if ent is None or (ent[0] == NO_NSID and time.monotonic() >= ent[1]):
            try:
                nid = fast.nsid(wire)
            except KVStoreError:  # the daemon's answer: the same as the lookup's would be
                raise
            except OSError:
                fast.close()
                return None
            ent = self._nids[wire] = (nid, time.monotonic() + NSID_RETRY_S)
        return None if ent[0] == NO_NSID else ent[0]

    def prepare(self, fast: LookupSocketClient, wire: bytes) -> bool:
        """The namespace's id asked (``nid``) and the index mapped now, not
        at the first read; whether reads of it can be served here."""
        return self.nid(fast, wire) is not None and self.reader.map()

    def known(self, wire: bytes) -> None:
        """The namespace exists in the daemon now (this client's Reserve made
        it): forget that it had no id, so the next use asks again."""
        ent = self._nids.get(wire)
        if ent is not None and ent[0] == NO_NSID:
            del self._nids[wire]

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
            if self.pending + len(self._reads) == 1:
                self._since = now

    def tally_due(self) -> bool:
        """Whether the lookups answered and the reads made here should be
        told now (``TALLY_EVERY`` of them together, or ``TALLY_SECONDS``
        since the first; never when ``held``)."""
        if self.held:
            return False
        n = self.pending + len(self._reads)
        return n >= TALLY_EVERY or (n > 0 and time.monotonic() - self._since >= TALLY_SECONDS)

    def queue_reads(self, frame: bytes) -> None:
        """Keep a read's ``reads`` frame to send with the next ones (a
        system call and a daemon wake-up per get saved; the daemon's counts
        and the blocks' accesses lag by at most ``TALLY_EVERY`` reads or
        ``TALLY_SECONDS``, as lookups' do)."""
        with self._lock:
            self._reads.append(frame)
            if self.pending + len(self._reads) == 1:
                self._since = time.monotonic()

    @property
    def reads_pending(self) -> int:
        """Reads whose ``reads`` frames are not sent yet."""
        return len(self._reads)

    def take_reads(self) -> list[bytes]:
        """The queued ``reads`` frames (the caller's to send from now on)."""
        with self._lock:
            out, self._reads = self._reads, []
        return out

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
             again: Callable[[], bool] | None = None,
             own: Callable[[bytes], OwnRun | None] | None = None
             ) -> list[KeyStatus] | None:
        """``get_into`` without a lease, when every present block of the
        prefix is in DRAM: the slots come from the shared index, the copy out
        (into ``sink``) verifies each block's checksum, and the slots are
        looked up again after it: the bytes are kept only if the index still
        names the same rows, places and checksums (a block evicted, moved or
        replaced meanwhile; a checksum that fails; a size that does not fit:
        None, and the caller takes the lease path, which writes the sink
        again and also reports corruption).
        Returns the statuses; the ``reads`` frame that tells the daemon (it
        counts the get, and the blocks' accesses as an Acquire's) is queued
        (``queue_reads``).
        ``again`` as for ``lookup``; before it, ``own`` (``OwnWrites.find``
        for this namespace) may give the slots of the keys after the hit:
        blocks of this client's own puts in flight, read the same way.
        Except one case: blocks of its own write-behind put in flight, in its
        staging ring (``OwnRun.held``), are copied into caller buffers (a
        ``BufferSink``) with no checksum (the put carried none either:
        ``PUT_UNHASHED``). The ring is this client's (mode 0600; the daemon
        only reads it) and the put's part of it is written again only after
        the put is answered (``StagingRing.place`` settles first), so if the
        put is still in flight after the copy, the bytes copied are the ones
        this client wrote; else None (the lease path). Another sink gets them
        verified, against checksums taken from the ring then (same check after)."""
        n = len(packed) // 16
        first = self.reader.raw_slots(nid, packed)
        mine = None
        if first is not None and first[1] and first[0] < n and own is not None:
            mine = own(packed[16 * first[0] :])
        if mine is None and first is not None and first[0] < n and again is not None and again():
            first = self.reader.raw_slots(nid, packed)
        if first is None or not first[1]:
            return None
        hit, _, raw = first
        if mine is None and hit:
            placed = read_slots(sink, slab.buf, raw)  # an engine's sink: one native call, no object per block
            if placed is not None:
                return self.read_done(nid, packed, n, hit, raw, hit) if placed == hit else None
        if hit:
            slots = np.frombuffer(raw, dtype=np.int64).reshape(-1, 4)
            offsets, sizes = slots[:, 1].tolist(), slots[:, 2].tolist()
            sums = slots[:, 3].view(np.uint64).tolist()
        else:
            offsets, sizes, sums = [], [], []
        if mine is not None:  # (lists throughout: a get right after a put builds no array)
            offsets += mine.offsets
            sizes += mine.sizes
        done = len(offsets)
        in_slab = done if mine is None or mine.buf is slab.buf else hit  # (ring offsets are the client's own)
        if sizes_of(sink, done) != sizes or not all(map(slab.covers, offsets[:in_slab], sizes[:in_slab])):
            return None  # (the lease path answers INVALID for a size that does not fit)
        if not done:
            return self.read_done(nid, packed, n, hit, raw, done)
        bufs = [slab.buf] * hit + ([mine.buf] * (done - hit) if mine is not None else [])
        srcs = [b[o : o + z] for b, o, z in zip(bufs, offsets, sizes)]
        # a write-behind put in flight whose frame went out: the daemon is copying these very
        # blocks on the other core now, so a second thread here would only wait for a core (a
        # corked one it has not seen: both cores are the reader's)
        one = mine is not None and mine.buf is not slab.buf and not mine.quiet
        # blocks [plain, done): this client's staged put, copied into caller buffers unhashed
        plain = hit if mine is not None and mine.held is not None and isinstance(sink, BufferSink) else done
        if mine is not None and plain == done:
            sums += mine.sums if mine.sums is not None else checksum_many(srcs[hit:]).tolist()
        if plain:
            good = write_with(sink, 1, range(plain), srcs[:plain], sums) if one else \
                sink.write(range(plain), srcs[:plain], sums)
            if not good.all():
                return None
        if plain < done:
            assert isinstance(sink, BufferSink)
            sink.copy(plain, done, srcs[plain:], 1 if one else None)
        if mine is not None and mine.held is not None and not mine.held():
            return None  # answered under the copy: its part of the ring may have been written again
        return self.read_done(nid, packed, n, hit, raw, done)

    def read_staged(self, fast: LookupSocketClient, own: OwnWrites, wire: bytes, packed: bytes,
                    outs: Sequence[Any], threads: int) -> list[KeyStatus] | None:
        """``read``'s case of a get whose every key lies in this client's own
        write-behind put in flight (``OwnWrites.staged``), into plain buffers
        ``outs``, with nothing more around the copy than it needs (a get right
        after a put; issue 18). The blocks are copied from the staging ring
        unhashed (``copy_run``, on one thread once the put's frame went out:
        the daemon is landing them on the other core) and kept if the put is
        still in flight after the copy (why that suffices: ``read``); the read
        is counted as ``read_done`` counts it. No index probe: these are the
        bytes this client wrote under those keys. None (the caller takes
        ``read``, which writes ``outs`` again): not such a get, a buffer the
        copy refuses, or the put was answered under the copy."""
        run = own.staged(wire, packed, fast.in_flight)
        nid = self.nid(fast, wire) if run is not None else None  # (known: the put went out under it)
        if run is None or nid is None:
            return None
        buf, at, size, seq = run
        if not copy_run(outs, buf, at, size, threads if fast.is_corked(seq) else 1) or not fast.in_flight(seq):
            return None
        return self.read_done(nid, packed, len(outs), 0, b"", len(outs))

    def read_done(self, nid: int, packed: bytes, n: int, hit: int, raw: bytes,
                  done: int) -> list[KeyStatus] | None:
        """The end of ``read`` once ``done`` blocks (``hit``, the first
        ``hit`` from the slab at the slots of ``raw``, the first probe's
        rows as it wrote them) were copied and verified: the slots looked up
        again (None unless the answer is the same), the read counted and its
        ``reads`` frame queued; the statuses."""
        if hit:
            after = self.reader.raw_slots(nid, packed[: 16 * hit])
            if after is None or after[0] != hit or after[2] != raw:
                return None
        self.reads += 1
        self.own_blocks += done - hit
        self.queue_reads(reads_frame(nid, n, packed[: 16 * done]))
        return [KeyStatus.OK] * done + [KeyStatus.MISS] * (n - done)

    def close(self) -> None:
        self.reader.close()
