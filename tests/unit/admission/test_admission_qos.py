"""QoS gate: priority classes, bounded queues, retry-after (issue 7)."""

from __future__ import annotations

import asyncio

import pytest

from admission import (RETRY_AFTER_MD, QosClass, QosConfig, QosGate, QosRejected, Rejection, Ticket, TicketState,
                       retry_after_metadata)
from kvstore.errors import CapacityError, InvalidArgument

FG, WR, PF, BG = QosClass.FOREGROUND, QosClass.WRITE, QosClass.PREFETCH, QosClass.BACKGROUND


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def ticket(x: Ticket | Rejection) -> Ticket:
    assert isinstance(x, Ticket), x
    return x


def test_slots_then_queue_then_fail_fast() -> None:
    c = FakeClock()
    g = QosGate(QosConfig(max_concurrency=2, queue_limits=(2, 2, 1, 1)), c)
    a, b = ticket(g.try_enter(FG)), ticket(g.try_enter(FG))
    assert a.running and b.running and g.running == 2
    q1, q2 = ticket(g.try_enter(FG)), ticket(g.try_enter(FG))
    assert q1.state is TicketState.QUEUED and q2.state is TicketState.QUEUED
    r = g.try_enter(FG)
    assert isinstance(r, Rejection) and r.cls is FG and r.retry_after_s > 0
    assert "foreground queue full" in r.reason
    c.advance(0.25)
    assert g.release(a) == [q1] and q1.running and q1.waited_s == pytest.approx(0.25)
    st = g.stats()[FG]
    assert (st.admitted, st.rejected, st.enqueued, st.queued, st.running) == (3, 1, 2, 1, 2)
    assert st.wait_s_max == pytest.approx(0.25) and st.service_s_ewma == pytest.approx(0.25)


def test_retry_after_comes_from_observed_service_time() -> None:
    c = FakeClock()
    g = QosGate(QosConfig(max_concurrency=2, queue_limits=(4, 4, 4, 4), ewma_alpha=1.0), c)
    # one write takes 0.1 s
    t = ticket(g.try_enter(WR))
    c.advance(0.1)
    g.release(t)
    running = [ticket(g.try_enter(WR)) for _ in range(2)]
    queued = [ticket(g.try_enter(WR)) for _ in range(4)]
    assert all(x.state is TicketState.QUEUED for x in queued) and all(x.running for x in running)
    r = g.try_enter(WR)
    assert isinstance(r, Rejection)
    # 4 queued + this one, 0.1 s each, over 2 slots
    assert r.retry_after_s == pytest.approx((4 + 1) * 0.1 / 2)
    # foreground waiting ahead of writes counts too (default 1 ms service before any completion)
    fg = ticket(g.try_enter(FG))
    assert fg.state is TicketState.QUEUED
    assert g.retry_after_s(WR) == pytest.approx((4 * 0.1 + 1 * 0.001 + 0.1) / 2)
    assert g.retry_after_s(FG) == pytest.approx(max((0.001 + 0.001) / 2, 0.001))


def test_retry_after_is_bounded() -> None:
    c = FakeClock()
    g = QosGate(QosConfig(max_concurrency=1, queue_limits=(0, 0, 0, 0), max_retry_after_s=2.0, ewma_alpha=1.0), c)
    t = ticket(g.try_enter(BG))
    c.advance(100.0)
    g.release(t)
    ticket(g.try_enter(BG))
    r = g.try_enter(BG)
    assert isinstance(r, Rejection) and r.retry_after_s == 2.0


def test_strict_priority_on_release() -> None:
    g = QosGate(QosConfig(max_concurrency=1), FakeClock())
    hold = ticket(g.try_enter(BG))
    bg, pf, wr, fg = (ticket(g.try_enter(k)) for k in (BG, PF, WR, FG))
    assert all(x.state is TicketState.QUEUED for x in (bg, pf, wr, fg))
    order = []
    cur = hold
    for _ in range(4):
        (nxt,) = g.release(cur)
        order.append(nxt.cls)
        cur = nxt
    assert order == [FG, WR, PF, BG]
    assert g.release(cur) == [] and g.running == 0


def test_lower_class_waits_while_a_higher_one_is_queued() -> None:
    g = QosGate(QosConfig(max_concurrency=2, class_concurrency=(2, 2, 2, 1)), FakeClock())
    b1 = ticket(g.try_enter(BG))
    b2 = ticket(g.try_enter(BG))  # background is capped at one running
    assert b1.running and b2.state is TicketState.QUEUED
    f1 = ticket(g.try_enter(FG))
    assert f1.running  # the cap left a slot for foreground
    f2 = ticket(g.try_enter(FG))
    assert f2.state is TicketState.QUEUED
    assert g.release(b1) == [f2]  # the freed slot goes to the queued foreground call
    assert g.release(f1) == [b2]


def test_withdraw_and_double_release() -> None:
    g = QosGate(QosConfig(max_concurrency=1), FakeClock())
    a = ticket(g.try_enter(FG))
    q = ticket(g.try_enter(WR))
    g.cancel(q)
    assert q.state is TicketState.CANCELLED and g.stats()[WR].cancelled == 1 and g.queued(WR) == 0
    assert g.release(a) == [] and g.release(a) == []
    assert g.running == 0


def test_method_classes_and_metadata() -> None:
    assert QosClass.for_method("Acquire") is FG and QosClass.for_method("Get") is FG
    assert QosClass.for_method("Reserve") is WR and QosClass.for_method("Put") is WR
    assert QosClass.for_method("Prefetch") is PF
    assert QosClass.for_method("Release") is None and QosClass.for_method("Commit") is None
    assert retry_after_metadata(0.0123) == ((RETRY_AFTER_MD, "13"),)
    assert retry_after_metadata(0.0) == ((RETRY_AFTER_MD, "1"),)
    with pytest.raises(InvalidArgument, match="unknown QoS class"):
        QosGate().try_enter(9)
    with pytest.raises(InvalidArgument, match="queue_limits"):
        QosConfig(queue_limits=(1, 2))  # type: ignore[arg-type]


async def test_async_acquire_waits_in_priority_order() -> None:
    c = FakeClock()
    g = QosGate(QosConfig(max_concurrency=1, queue_limits=(4, 4, 4, 4)), c)
    hold = await g.acquire(FG)
    done: list[str] = []

    async def worker(name: str, cls: QosClass) -> None:
        async with g.slot(cls):
            done.append(name)

    tasks = [asyncio.create_task(worker(n, k)) for n, k in (("bg", BG), ("pf", PF), ("wr", WR), ("fg", FG))]
    await asyncio.sleep(0)
    assert done == [] and g.queued(BG) == 1 and g.queued(FG) == 1
    g.release(hold)
    await asyncio.gather(*tasks)
    assert done == ["fg", "wr", "pf", "bg"]
    assert g.running == 0 and g.stats()[BG].completed == 1


async def test_async_full_queue_raises_resource_exhausted_with_hint() -> None:
    g = QosGate(QosConfig(max_concurrency=1, queue_limits=(0, 0, 0, 0)), FakeClock())
    hold = await g.acquire(WR)
    with pytest.raises(QosRejected) as ei:
        await g.acquire(WR)
    assert isinstance(ei.value, CapacityError) and ei.value.retry_after_s > 0
    assert ei.value.rejection.metadata()[0][0] == RETRY_AFTER_MD
    g.release(hold)


async def test_async_cancel_while_queued_withdraws() -> None:
    g = QosGate(QosConfig(max_concurrency=1), FakeClock())
    hold = await g.acquire(FG)
    t = asyncio.create_task(g.acquire(WR))
    await asyncio.sleep(0)
    assert g.queued(WR) == 1
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert g.queued(WR) == 0 and g.stats()[WR].cancelled == 1
    assert g.release(hold) == [] and g.running == 0


async def test_async_timeout_after_grant_hands_the_slot_on() -> None:
    g = QosGate(QosConfig(max_concurrency=1), FakeClock())
    hold = await g.acquire(FG)
    waiter = asyncio.create_task(g.acquire(WR))
    other = asyncio.create_task(g.acquire(PF))
    await asyncio.sleep(0)
    (granted,) = g.release(hold)  # the write is granted ...
    assert granted.cls is WR
    waiter.cancel()  # ... but its caller gave up before running
    with pytest.raises(asyncio.CancelledError):
        await waiter
    t = await asyncio.wait_for(other, 1.0)  # so the slot went on to the prefetch
    assert t.running and g.running == 1
    g.release(t)
