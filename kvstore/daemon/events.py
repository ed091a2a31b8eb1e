"""The daemon's event log: numbered ``BlockStored``/``BlockRemoved``/``Cleared``
events in a bounded ring buffer, replayable from a sequence number
(``WatchEvents``); a watcher whose replay point fell out of the buffer is told
so with a ``Gap``."""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, cast

from kvstore.results import Event, EventKind, DropReason
from kvstore.wire.convert import REASON_PB
from proto import kvstore_pb2 as pb


class EventLog:
    """Numbered events in a ring buffer; watchers replay from a sequence."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.buf: collections.deque[pb.Event] = collections.deque(maxlen=self.capacity)
        self.seq = 0
        self._wake = asyncio.Event()

    def append(self, ev: Event) -> None:
        self.seq += 1
        msg = pb.Event(seq=self.seq, time_unix_ns=time.time_ns())
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
        start = max(0, after + 1 - first)
        return gap, list(self.buf)[start:] if start < len(self.buf) else []

    async def wait(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass

