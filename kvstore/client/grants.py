"""The client's side of granted puts (issue 18; the daemon's side is
kvstore/daemon/granted.py, the store's kvstore/core/grants.py).

The connection holds a pool of DRAM slots the daemon granted it, by block
size. A put that finds enough slots of its size copies its blocks straight
into them (fused with their checksums) and names them in one ``gput``
frame sent without waiting: no round trip and no second copy. After each
put the client asks for as many slots as that put used (a ``grant`` frame,
also sent without waiting); its answer is read at the next put of that
size. The pool holds slots of one size at a time: asking for another size
gives the others back in the same frame. A slot is used once: the put that
names it takes it whatever its outcome. A grant is used for half its
lifetime only; the daemon frees it at the end of its life, or when the
session ends.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from kvstore.client.socket import LookupSocketClient
from kvstore.errors import KVStoreError, Unavailable
from kvstore.wire import frames

log = logging.getLogger("kvstore.client")

GRANT_BYTES = 64 << 20
"""The most this client asks to hold granted (the daemon may give less)."""


class GrantPool:
    """Slots granted to one connection, of one block size at a time."""

    def __init__(self, enabled: bool = True) -> None:
        self.off = not enabled
        """Off (or the daemon has no grants): puts go through the staging ring or Reserve."""
        self.free: dict[int, list[int]] = {}
        """Block size -> granted slot offsets not used yet."""
        self.until: dict[int, float] = {}
        """Block size -> when its slots stop being used (half their lifetime)."""
        self.asked: dict[int, tuple[int, float]] = {}
        """Block size -> the grant frame sent for it whose answer is unread,
        and when it was sent (the grant's life starts no earlier)."""
        self.back: list[int] = []
        """Granted slots this client will not use, given back with its next grant frame."""
        self.limit = GRANT_BYTES
        """The most this connection may hold granted (the daemon says, with each grant)."""

    def fits(self, size: int, n: int) -> bool:
        """Whether a put of ``n`` blocks of ``size`` bytes may go through grants."""
        return not self.off and 0 < n * size <= self.limit

    def take(self, fast: LookupSocketClient, size: int, n: int) -> list[int] | None:
        """``n`` granted slots for blocks of ``size``, or None (too few)."""
        if size in self.asked:
            self._collect(fast, size)
        free = self.free.get(size)
        if not free:
            return None
        if time.monotonic() >= self.until[size]:
            self.back += free  # (past half their lifetime: the daemon would free them while in use)
            free.clear()
            return None
        if len(free) < n:
            return None
        out = free[:n]
        del free[:n]
        return out

    def ask(self, fast: LookupSocketClient, wire: bytes, size: int, n: int) -> None:
        """Ask for slots of ``size`` up to ``n`` in the pool (answered at
        the next ``take``). The pool holds one size at a time (an engine
        writes blocks of one size): slots of any other go back with this ask."""
        if self.off or size in self.asked:
            return
        have = len(self.free.get(size, ()))
        n = min(n, self.limit // size) - have
        if n <= 0:
            return
        for k in [k for k in self.asked if k != size]:
            self._collect(fast, k)
        for k in [k for k in self.free if k != size]:
            self.back += self.free.pop(k)
            self.until.pop(k, None)
        back = np.asarray(self.back, dtype="<u8").tobytes()
        sent = time.monotonic()
        self.asked[size] = (fast.send_frame("Grant", frames.grant_frame(wire, n, size, back), keep=True, cork=True),
                            sent)
        self.back.clear()

    def _collect(self, fast: LookupSocketClient, size: int) -> None:
        seq, sent = self.asked.pop(size)
        try:
            body = fast.answer(seq)
        except KVStoreError as e:  # (a size the namespace does not hold; no grants on this daemon)
            self.off = isinstance(e, Unavailable)
            log.info("no grant for %d-byte blocks (%s): the put goes through staging or Reserve", size, e)
            return
        if len(body) < 12 or (len(body) - 12) % 8:  # (body: the answer after its status)
            fast.close()  # (a malformed answer: the socket is failed over as a broken one)
            raise ConnectionError(f"malformed grant answer of {len(body)} bytes on the same-host socket")
        _, life_ms, most = frames.GRANT_OK.unpack_from(b"\0" + body[:12])
        self.limit = min(GRANT_BYTES, int(most))
        got = np.frombuffer(body, dtype="<u8", offset=12).tolist()
        if not got:
            return
        now = time.monotonic()
        free = self.free.setdefault(size, [])
        if free and now >= self.until[size]:
            self.back += free
            free.clear()
        fresh = sent + life_ms / 2000.0  # (its life began when the daemon granted, after the ask, maybe long before now)
        self.until[size] = min(self.until[size], fresh) if free else fresh
        free += got

    def clear(self) -> None:
        self.free.clear()
        self.until.clear()
        self.asked.clear()
        self.back.clear()
