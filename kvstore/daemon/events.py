"""The daemon's event log: numbered ``BlockStored``/``BlockRemoved``/``Cleared``
events in a bounded ring buffer, replayable from a sequence number
(``WatchEvents``); a watcher whose replay point fell out of the buffer is told
so with a ``Gap``, and so is one that falls behind the buffer while it follows
(a slow reader): events are never lost without a ``Gap``."""

from __future__ import annotations

import asyncio
import collections
import itertools
import secrets
import time
from typing import Any, AsyncIterator, Callable, cast

from kvstore.results import Event, EventKind, DropReason
from kvstore.wire.convert import REASON_PB
from proto import kvstore_pb2 as pb


class EventLog:
    """Numbered events in a ring buffer; watchers replay from a sequence."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.buf: collections.deque[pb.Event] = collections.deque(maxlen=self.capacity)
        self.seq = 0
        self.run_id = secrets.randbits(63) | 1
        """Random per daemon start (never 0), on every event: a watcher tells a restart by it."""
        self._wake = asyncio.Event()

    def append(self, ev: Event) -> None:
        self.seq += 1
        msg = pb.Event(seq=self.seq, time_unix_ns=time.time_ns(), run_id=self.run_id)
        if ev.kind is EventKind.STORED:
            msg.stored.ns_digest = ev.ns_digest
            msg.stored.keys.extend(ev.keys)
            msg.stored.tier = cast(Any, int(ev.tier) + 1) if ev.tier is not None else pb.TIER_UNSPECIFIED
            msg.stored.parent = ev.parent or b""
        elif ev.kind is EventKind.REMOVED:
            msg.removed.ns_digest = ev.ns_digest
            msg.removed.keys.extend(ev.keys)
            msg.removed.tier = cast(Any, int(ev.tier) + 1) if ev.tier is not None else pb.TIER_UNSPECIFIED
            msg.removed.reason = (REASON_PB.get(ev.reason, pb.REMOVE_REASON_EVICTED)
                                  if isinstance(ev.reason, DropReason) else pb.REMOVE_REASON_EVICTED)
        else:
            msg.cleared.ns_digest = ev.ns_digest
            msg.cleared.all_namespaces = not ev.ns_digest
        self.buf.append(msg)
        self._wake.set()
        self._wake = asyncio.Event()

    def since(self, after: int) -> tuple[int | None, list[pb.Event]]:
        """(first available seq if events after ``after`` were lost, events)."""
        if not self.buf:
            return None, []
        first = self.buf[0].seq
        gap = first if after + 1 < first else None
        n = len(self.buf) - max(0, after + 1 - first)
        if n <= 0:
            return gap, []
        # only the tail: a follower that is up to date does not copy the whole ring
        return gap, list(itertools.islice(reversed(self.buf), n))[::-1]

    async def wait(self, timeout: float, wake: asyncio.Event | None = None) -> None:
        """Until the next append (or the one after ``wake`` was taken), at most ``timeout``."""
        try:
            await asyncio.wait_for((wake or self._wake).wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def stream(self, after: int, keep: Callable[[pb.Event], bool],
                     run_id: int = 0) -> AsyncIterator[pb.Event]:
        """The events after ``after`` that ``keep`` accepts, then each new one, for ever.

        A ``Gap`` (seq 0) comes first when ``after`` is from a previous daemon
        run (``run_id`` given and not this run's, or ``after`` past this run's
        last event; then everything buffered follows) or fell out of the buffer, and
        again whenever the reader fell so far behind while following that
        events it had not read yet left the buffer. ``after`` 0 starts from the
        oldest buffered event."""
        if after > self.seq or (run_id and run_id != self.run_id):
            # numbered by a previous daemon run: everything since is unknown
            yield pb.Event(seq=0, run_id=self.run_id,
                           gap=pb.Gap(first_available_seq=self.buf[0].seq if self.buf else self.seq + 1))
            after = 0
        if not after and self.buf:
            after = self.buf[0].seq - 1
        while True:
            wake = self._wake
            gap, evs = self.since(after)
            if gap is not None:
                yield pb.Event(seq=0, run_id=self.run_id, gap=pb.Gap(first_available_seq=gap))
            for ev in evs:
                after = ev.seq
                if keep(ev):
                    yield ev
            if after >= self.seq:
                await self.wait(1.0, wake)
