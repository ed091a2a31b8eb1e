"""Priority classes inside the daemon, with bounded queues (issue 7).

Work inside one daemon competes for the same event loop, slab and disk:
foreground reads (``Acquire``/``Get``/``Lookup``) must not wait behind
background demotion. :class:`QosGate` admits calls into a bounded number of
concurrent slots, with one bounded FIFO queue per :class:`QosClass`; a slot
that frees goes to the highest class with a queued call, so a lower class waits
while a higher one is queued. When a class's queue is full the call fails fast
with a :class:`Rejection` carrying a retry-after hint computed from the
observed service times (never an unbounded queue).

Pure bookkeeping: no threads, no locks, time from an injected clock. The
synchronous core (:meth:`QosGate.try_enter` / :meth:`QosGate.release`) is what
tests drive; :meth:`QosGate.acquire` and :meth:`QosGate.slot` wrap it for
asyncio handlers (one event loop; not thread-safe).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import math
import time
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import AsyncIterator, Callable

from kvstore.errors import CapacityError, InvalidArgument

__all__ = [
    "METHOD_CLASSES", "RETRY_AFTER_MD", "ClassCounters", "QosClass", "QosConfig", "QosGate", "QosRejected",
    "Rejection", "Ticket", "TicketState", "retry_after_metadata",
]

Clock = Callable[[], float]

RETRY_AFTER_MD = "retry-after-ms"
"""Trailing-metadata key of the retry-after hint (integer milliseconds)."""


class QosClass(IntEnum):
    """Priority classes, highest first (smaller value = served first)."""

    FOREGROUND = 0
    """An engine waits on it now: Lookup, Acquire, Get."""
    WRITE = 1
    """Stores new blocks: Reserve, Put, Remove, Clear."""
    PREFETCH = 2
    """Stages blocks ahead of need: Prefetch."""
    BACKGROUND = 3
    """Housekeeping: demotion to SSD, scrubbing."""

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def for_method(cls, method: str) -> "QosClass | None":
        """The class of a gRPC method name, or None for calls that must never
        queue (they release resources or are cheap control calls: Release,
        Commit, Abort, Handshake, KeepAlive, Stats, Admit, Report, admin)."""
        return METHOD_CLASSES.get(method)


METHOD_CLASSES: dict[str, QosClass] = {
    "Lookup": QosClass.FOREGROUND, "Acquire": QosClass.FOREGROUND, "Get": QosClass.FOREGROUND,
    "Reserve": QosClass.WRITE, "Grant": QosClass.WRITE, "Put": QosClass.WRITE, "PutGranted": QosClass.WRITE,
    "Remove": QosClass.WRITE, "Clear": QosClass.WRITE,
    "Prefetch": QosClass.PREFETCH,
}
"""RPC name -> class. Calls not listed are not gated."""


@dataclass(slots=True, frozen=True)
class QosConfig:
    """Knobs of :class:`QosGate`."""

    max_concurrency: int = 64
    """Calls running at once, all classes together."""
    queue_limits: tuple[int, int, int, int] = (1024, 512, 256, 128)
    """Queued calls allowed per class (foreground, write, prefetch, background)."""
    class_concurrency: tuple[int, int, int, int] | None = None
    """Optional cap on running calls per class (e.g. background <= 8), so a
    low class never holds every slot when a burst of foreground calls arrives.
    None: every class may use all ``max_concurrency`` slots."""
    default_service_s: float = 0.001
    """Assumed service time of a class before any of its calls completed."""
    min_retry_after_s: float = 0.001
    """Floor of the retry-after hint."""
    max_retry_after_s: float = 10.0
    """Ceiling of the retry-after hint."""
    ewma_alpha: float = 0.1
    """Weight of one completion in the per-class service-time EWMA, in (0, 1]."""

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise InvalidArgument(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if len(self.queue_limits) != len(QosClass) or min(self.queue_limits) < 0:
            raise InvalidArgument(f"queue_limits must be {len(QosClass)} counts >= 0 "
                                  f"({', '.join(c.label for c in QosClass)})")
        if self.class_concurrency is not None and (len(self.class_concurrency) != len(QosClass)
                                                   or min(self.class_concurrency) < 1):
            raise InvalidArgument(f"class_concurrency must be {len(QosClass)} counts >= 1, or None")
        for name in ("default_service_s", "min_retry_after_s", "max_retry_after_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise InvalidArgument(f"{name} must be > 0, got {v!r}")
        if self.max_retry_after_s < self.min_retry_after_s:
            raise InvalidArgument("max_retry_after_s must be >= min_retry_after_s")
        if not (0.0 < self.ewma_alpha <= 1.0):
            raise InvalidArgument(f"ewma_alpha must be in (0, 1], got {self.ewma_alpha!r}")


class TicketState(Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"


@dataclass(slots=True, eq=False)
class Ticket:
    """A call's place in the gate: queued, then running, then done."""

    id: int
    cls: QosClass
    enqueued_at: float
    state: TicketState = TicketState.QUEUED
    granted_at: float | None = None
    future: asyncio.Future[None] | None = field(default=None, repr=False)

    @property
    def running(self) -> bool:
        return self.state is TicketState.RUNNING

    @property
    def waited_s(self) -> float:
        """Seconds between the request and the grant (0 until granted)."""
        return 0.0 if self.granted_at is None else self.granted_at - self.enqueued_at


@dataclass(slots=True, frozen=True)
class Rejection:
    """The class's queue is full: come back after ``retry_after_s``."""

    cls: QosClass
    retry_after_s: float
    reason: str

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Trailing metadata carrying the hint (``retry-after-ms``)."""
        return retry_after_metadata(self.retry_after_s)


def retry_after_metadata(retry_after_s: float) -> tuple[tuple[str, str], ...]:
    """``(("retry-after-ms", "<int ms>"),)`` for ``context.set_trailing_metadata``."""
    return ((RETRY_AFTER_MD, str(max(1, int(math.ceil(retry_after_s * 1000.0))))),)


class QosRejected(CapacityError):
    """A call refused by the gate (RESOURCE_EXHAUSTED); carries the hint."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(rejection.reason)
        self.rejection = rejection
        self.retry_after_s = rejection.retry_after_s


@dataclass(slots=True)
class ClassCounters:
    """Per-class counters (cumulative, except ``queued`` and ``running``)."""

    admitted: int = 0
    """Calls granted a slot (at once or after queueing)."""
    rejected: int = 0
    """Calls refused because the class's queue was full."""
    enqueued: int = 0
    """Calls that had to queue."""
    cancelled: int = 0
    """Queued calls abandoned (cancelled, deadline) before their grant."""
    completed: int = 0
    """Granted calls released."""
    queued: int = 0
    """Queued now."""
    running: int = 0
    """Running now."""
    wait_s_total: float = 0.0
    """Sum of waits of granted calls (mean = wait_s_total / admitted)."""
    wait_s_max: float = 0.0
    service_s_ewma: float = 0.0
    """EWMA of grant-to-release seconds (0 before the first completion)."""


class QosGate:
    """Bounded concurrency with strict-priority, bounded per-class queues."""

    def __init__(self, config: QosConfig | None = None, clock: Clock | None = None) -> None:
        self.config = config or QosConfig()
        if clock is None:
            clock = time.monotonic
        self.clock: Clock = clock
        n = len(QosClass)
        self._caps = list(self.config.class_concurrency or (self.config.max_concurrency,) * n)
        self._queues: list[collections.deque[Ticket]] = [collections.deque() for _ in range(n)]
        self._running_by = [0] * n
        self.running = 0
        self._ids = itertools.count(1)
        self._c = [ClassCounters() for _ in range(n)]
        self._seen_service = [False] * n

    # ------------------------------------------------------------- core
    def _eligible(self, c: int) -> bool:
        return self.running < self.config.max_concurrency and self._running_by[c] < self._caps[c]

    def _grant(self, t: Ticket, now: float) -> None:
        c = int(t.cls)
        t.state = TicketState.RUNNING
        t.granted_at = now
        self.running += 1
        self._running_by[c] += 1
        k = self._c[c]
        k.admitted += 1
        k.running += 1
        w = now - t.enqueued_at
        k.wait_s_total += w
        k.wait_s_max = max(k.wait_s_max, w)
        if t.future is not None and not t.future.done():
            t.future.set_result(None)

    def try_enter(self, cls: QosClass | int) -> Ticket | Rejection:
        """Ask for a slot without blocking. Answers a running :class:`Ticket`
        (go ahead), a queued one (granted later by a :meth:`release`; asyncio
        callers use :meth:`acquire`), or a :class:`Rejection` when the class's
        queue is full."""
        try:
            q = QosClass(int(cls))
        except ValueError:
            raise InvalidArgument(f"unknown QoS class {cls!r}; allowed: "
                                  f"{', '.join(c.label for c in QosClass)}") from None
        c = int(q)
        now = self.clock()
        t = Ticket(id=next(self._ids), cls=q, enqueued_at=now)
        ahead = any(self._queues[k] and self._running_by[k] < self._caps[k] for k in range(c + 1))
        if self._eligible(c) and not ahead:
            self._grant(t, now)
            return t
        if len(self._queues[c]) >= self.config.queue_limits[c]:
            self._c[c].rejected += 1
            wait = self.retry_after_s(q)
            return Rejection(q, wait, f"{q.label} queue full ({self.config.queue_limits[c]} waiting, "
                                      f"{self.running} running); retry in {wait * 1e3:.0f} ms")
        self._queues[c].append(t)
        self._c[c].enqueued += 1
        self._c[c].queued += 1
        return t

    def release(self, ticket: Ticket) -> list[Ticket]:
        """Give back a running ticket's slot (or withdraw a queued one). Returns
        the tickets granted as a result, highest class first. Releasing a
        ticket twice is a no-op."""
        now = self.clock()
        c = int(ticket.cls)
        if ticket.state is TicketState.QUEUED:
            self._withdraw(ticket)
            return self._dispatch(now)
        if ticket.state is not TicketState.RUNNING:
            return []
        ticket.state = TicketState.DONE
        self.running -= 1
        self._running_by[c] -= 1
        k = self._c[c]
        k.running -= 1
        k.completed += 1
        svc = now - (ticket.granted_at if ticket.granted_at is not None else now)
        if self._seen_service[c]:
            k.service_s_ewma += self.config.ewma_alpha * (svc - k.service_s_ewma)
        else:
            k.service_s_ewma, self._seen_service[c] = svc, True
        return self._dispatch(now)

    def cancel(self, ticket: Ticket) -> None:
        """Withdraw a queued ticket (or release a running one)."""
        self.release(ticket)

    def _withdraw(self, ticket: Ticket) -> None:
        c = int(ticket.cls)
        try:
            self._queues[c].remove(ticket)
        except ValueError:
            return
        ticket.state = TicketState.CANCELLED
        self._c[c].queued -= 1
        self._c[c].cancelled += 1

    def _dispatch(self, now: float) -> list[Ticket]:
        granted: list[Ticket] = []
        while self.running < self.config.max_concurrency:
            for c, q in enumerate(self._queues):
                if q and self._running_by[c] < self._caps[c]:
                    t = q.popleft()
                    self._c[c].queued -= 1
                    self._grant(t, now)
                    granted.append(t)
                    break
            else:
                break
        return granted

    # ------------------------------------------------------------- hints
    def _service_s(self, c: int) -> float:
        return self._c[c].service_s_ewma if self._seen_service[c] else self.config.default_service_s

    def retry_after_s(self, cls: QosClass | int) -> float:
        """When a call of ``cls`` would likely find room: the queued work of its
        own and higher classes (count x observed service time), plus one
        service time, over the slots the class may use; clipped to the bounds."""
        c = int(cls)
        work = sum(len(self._queues[k]) * self._service_s(k) for k in range(c + 1)) + self._service_s(c)
        slots = min(self.config.max_concurrency, self._caps[c])
        cfg = self.config
        return min(max(work / slots, cfg.min_retry_after_s), cfg.max_retry_after_s)

    # ------------------------------------------------------------- asyncio
    async def acquire(self, cls: QosClass | int) -> Ticket:
        """Wait for a slot in priority order; raises :class:`QosRejected`
        (RESOURCE_EXHAUSTED, with ``retry_after_s``) when the queue is full.
        Cancellation while queued withdraws the ticket."""
        r = self.try_enter(cls)
        if isinstance(r, Rejection):
            raise QosRejected(r)
        if r.state is TicketState.RUNNING:
            return r
        r.future = asyncio.get_running_loop().create_future()
        try:
            await r.future
        except BaseException:
            if r.running:  # (the state changed while we waited)
                self.release(r)  # granted just as we gave up: hand the slot on
            else:
                self._withdraw(r)
                self._dispatch(self.clock())
            raise
        return r

    @contextlib.asynccontextmanager
    async def slot(self, cls: QosClass | int) -> AsyncIterator[Ticket]:
        """``async with gate.slot(cls): ...`` acquires and always releases."""
        t = await self.acquire(cls)
        try:
            yield t
        finally:
            self.release(t)

    # ------------------------------------------------------------- stats
    def queued(self, cls: QosClass | int) -> int:
        """Calls of ``cls`` waiting now."""
        return len(self._queues[int(cls)])

    def stats(self) -> dict[QosClass, ClassCounters]:
        """A copy of the counters per class."""
        out = {}
        for q in QosClass:
            k = self._c[int(q)]
            out[q] = ClassCounters(k.admitted, k.rejected, k.enqueued, k.cancelled, k.completed, k.queued,
                                   k.running, k.wait_s_total, k.wait_s_max, k.service_s_ewma)
        return out
