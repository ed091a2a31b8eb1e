"""The client's side of write-behind puts (issue 18): a staging file the
daemon gave this connection (kvstore.daemon.socket_server: ``stage`` and
``put`` frames), used as a ring.

A small put copies its blocks into the ring, sends one ``put`` frame
without waiting and returns; the daemon reserves, copies (hashing the
blocks on the way: the frame carries no checksums, ``PUT_UNHASHED``) and
commits. No round trip is on the put's path.
The frame is corked (``LookupSocketClient.send_frame``): it goes out with
the client's next frame, or ``write_behind_delay`` later on its own, so a
get that follows the put at once (its own blocks, read from the ring) has
both cores while the daemon waits. Granted puts and their ``grant`` asks
are corked the same way.
Until the frame's answer is read, its bytes stay in the ring untouched, so
this client's own reads of those blocks are served from there
(``OwnWrites``, kvstore/client/shared.py). The ring wraps only after every
put in it has been answered (``flush``).

Which puts go this way: at most half the staging file (8 MiB), blocks of
one size, in a namespace the client has an id for, whose parent it can see
stored. Such a put answers EXISTS for the leading blocks the shared index
already holds and OK for the rest at once; a block the daemon then cannot
store (no room; its parent evicted meanwhile) is logged and counted in
``Client.late_rejected``. Other puts answer from ``Reserve``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

from kvstore.checksum import copy_blocks, copy_many
from kvstore.client.grants import GrantPool
from kvstore.client.shared import OwnWrites, SharedPath
from kvstore.client.socket import LookupSocketClient
from kvstore.errors import InvalidArgument, KeyStatus, KVStoreError
from kvstore.wire.frames import fits_frame, granted_put_frame, put_frame
from kvstore.wire.shm import SlabMapping

log = logging.getLogger("kvstore.client")

WRITE_BEHIND_DELAY = 0.005
"""Seconds a write-behind put's frame waits for the client's next frame
before it is sent on its own (``Client(write_behind_delay=...)``)."""


class StagingRing:
    """A mapped staging file handed out front to back."""

    def __init__(self, path: str, size: int) -> None:
        self.mapping = SlabMapping(path, size)
        self.size = self.mapping.size
        self.head = 0
        self.mapping.buf[::4096] = 0  # map every page now, not one fault per page on the first puts

    @property
    def buf(self) -> np.ndarray:
        return self.mapping.buf

    def fits(self, nbytes: int) -> bool:
        """Whether a put of ``nbytes`` goes through the ring (at most half of it)."""
        return 0 < nbytes <= self.size // 2

    def place(self, nbytes: int, settle: Callable[[], None]) -> int:
        """The offset of ``nbytes`` free bytes. When they do not fit before
        the end, ``settle`` (wait for every put in flight) and start over."""
        if self.head + nbytes > self.size:
            settle()
            self.head = 0
        at = self.head
        self.head += nbytes
        return at

    def close(self) -> None:
        self.mapping.close()


class WriteBehind:
    """One client's write-behind puts: its connection's granted slots
    (kvstore/client/grants.py) and staging ring (asked for on first use),
    and the puts it sends through them."""

    def __init__(self, own: OwnWrites, enabled: bool = True, grants: bool = True,
                 delay: float = WRITE_BEHIND_DELAY) -> None:
        if not delay >= 0:  # (NaN too)
            raise InvalidArgument(f"write_behind_delay must be >= 0 seconds, got {delay}")
        self.own = own
        self.delay = delay
        """How long its frames wait for the client's next frame (``LookupSocketClient.cork_s``)."""
        self.ring: StagingRing | None = None
        self.failed = not enabled
        """Off, or no staging file (the daemon refused one, the socket broke): no staged puts."""
        self.grants = GrantPool(enabled and grants)
        self.lock = threading.Lock()
        """One put at a time places, fills and sends (threads sharing a client)."""

    def put(self, fast: LookupSocketClient, shared: SharedPath, wire: bytes, packed: bytes,
            srcs: list[np.ndarray], parent: bytes | None, threads: int,
            settle: Callable[[], None], slab: np.ndarray | None = None) -> list[KeyStatus] | None:
        """Copy the blocks (keys ``packed``, 16 bytes each) into granted
        slots of ``slab`` (else into the ring) and send one ``gput`` (``put``) frame without waiting; None
        when this put should go through ``Reserve`` instead. The shared
        index says which leading blocks are stored already (EXISTS, as
        Reserve would answer: all of them, and nothing is sent) and whether
        the parent is (else Reserve answers PARENT_MISSING, or finds it
        after all). ``settle`` waits for every put in flight (the ring
        wraps); a socket that fails raises OSError."""
        n = len(srcs)
        size = srcs[0].size if n else 0
        if self.failed or not n or any(s.size != size for s in srcs):
            return None
        with self.lock:
            ring = self.ring if self.ring is not None else self._open(fast)
        if ring is None:
            return None
        granted = slab is not None and not ring.fits(n * size) and self.grants.fits(size, n)
        if not (granted or ring.fits(n * size)):
            return None
        nid = shared.nid(fast, wire)
        if nid is None or not fits_frame(len(wire) + len(packed) + 16 * n + 64):
            return None  # (a namespace the daemon has no id for yet: Reserve makes it)
        got = shared.reader.lookup(nid, packed)
        if got is None:
            return None
        hit = got[0]
        if hit == n:
            return [KeyStatus.EXISTS] * n
        if hit:
            parent, packed, srcs = packed[16 * (hit - 1) : 16 * hit], packed[16 * hit :], srcs[hit:]
        elif parent and not self._stored(fast, shared, nid, wire, parent):
            return None
        m = n - hit
        if granted:
            assert slab is not None
            with self.lock:
                offs = self.grants.take(fast, size, m)
                if offs is not None and max(offs) + size > slab.size:  # (the slab grew: not mapped here yet)
                    self.grants.back += offs
                    offs = None
                if offs is not None:
                    try:
                        csums = copy_many([slab[o : o + size] for o in offs], srcs, threads)
                    except BaseException:
                        self.grants.back += offs  # (named by no put: given back with the next grant frame)
                        raise
                    frame = granted_put_frame(wire, parent, packed, size, csums.astype("<u8").tobytes(),
                                              np.asarray(offs, dtype="<u8").tobytes())
                    seq = fast.send_frame("Put", frame, cork=True)
                    self.own.add(wire, packed, offs, size, csums, slab, seq)
                self.grants.ask(fast, wire, size, m)  # for the next put of this size
            if offs is not None:
                return [KeyStatus.EXISTS] * hit + [KeyStatus.OK] * m
            if not ring.fits(m * size):
                return None
        with self.lock:
            at = ring.place(m * size, settle)
            if self.ring is not ring:  # settling found the socket broken (and closed us)
                return None
            # a plain copy: the daemon hashes the blocks as it lands them (PUT_UNHASHED), and this
            # client reads them back from here unhashed too (``SharedPath.read``)
            copy_blocks([ring.buf[at + i * size : at + (i + 1) * size] for i in range(m)], srcs, threads)
            seq = fast.send_frame("Put", put_frame(wire, parent, packed, size, at, None), cork=True)
            self.own.add(wire, packed, range(at, at + m * size, size), size, None, ring.buf, seq, private=True)
        return [KeyStatus.EXISTS] * hit + [KeyStatus.OK] * m

    def _open(self, fast: LookupSocketClient) -> StagingRing | None:
        """Ask the daemon for this connection's staging file (once) and map it."""
        if self.failed:
            return None
        try:
            try:
                size, path = fast.stage()
            except KVStoreError:
                raise
            except OSError:  # (timed out: its answer is still to come; the next call's use reports it)
                fast.close()
                raise
            self.ring = StagingRing(path, size)
        except (KVStoreError, OSError, ValueError) as e:
            log.info("no write-behind puts (%s): puts go through Reserve", e)
            self.failed = True
        return self.ring

    def _stored(self, fast: LookupSocketClient, shared: SharedPath, nid: int, wire: bytes, key: bytes) -> bool:
        """Whether ``key`` is stored (the shared index) or in one of this client's puts in flight."""
        got = shared.reader.lookup(nid, key)
        return (got is not None and got[0] == 1) or self.own.find(wire, key, fast.in_flight) is not None

    def close(self) -> None:
        """No more write-behind puts (nor reads of puts in flight) on this connection."""
        self.failed = True
        self.grants.clear()
        self.own.clear()
        if self.ring is not None:
            self.ring.close()
            self.ring = None
