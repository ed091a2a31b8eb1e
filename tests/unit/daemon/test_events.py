"""The daemon's event log (kvstore.daemon.events): numbering, the wire form
of each kind and reason, replay and gaps; and its round trip back to the
typed ``kvstore.results.Event`` a client sees (kvstore.wire.answers)."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.daemon.events import EventLog
from kvstore.results import Event, EventKind, DropReason
from kvstore.wire.answers import event_from_pb
from proto import kvstore_pb2 as pb
from tiers.base import TierKind

K = [bytes([i]) * 16 for i in range(4)]
D = b"d" * 16


def _log(capacity: int = 16) -> EventLog:
    async def make() -> EventLog:
        return EventLog(capacity)

    return asyncio.run(make())


def test_kinds_and_reasons_are_enums_with_todays_strings() -> None:
    assert [k.value for k in EventKind] == ["stored", "removed", "cleared", "gap"]
    assert {r.value for r in DropReason} >= {"evicted", "removed", "corrupt", "aborted", "moved"}
    ev = Event("removed", D, K[:1], TierKind.DRAM, "moved")  # strings are normalised
    assert ev.kind is EventKind.REMOVED and ev.reason is DropReason.MOVED
    assert ev.kind == "removed"
    assert Event(EventKind.STORED, D, K, TierKind.DRAM).reason is DropReason.NONE
    with pytest.raises(ValueError):
        Event("bogus", D, [])


def test_append_numbers_and_encodes() -> None:
    log = _log()
    log.append(Event(EventKind.STORED, D, K[:2], TierKind.DRAM, parent=K[3]))
    log.append(Event(EventKind.REMOVED, D, K[:1], TierKind.SSD, DropReason.CORRUPT))
    log.append(Event(EventKind.CLEARED, b"", []))
    assert log.seq == 3
    gap, evs = log.since(0)
    assert gap is None and [e.seq for e in evs] == [1, 2, 3]
    s, r, c = evs
    assert s.WhichOneof("kind") == "stored" and s.stored.tier == pb.TIER_DRAM and s.stored.parent == K[3]
    assert r.removed.reason == pb.REMOVE_REASON_CORRUPT and r.removed.tier == pb.TIER_SSD
    assert c.cleared.all_namespaces


@pytest.mark.parametrize("reason,wire", [
    (DropReason.EVICTED, pb.REMOVE_REASON_EVICTED), (DropReason.REMOVED, pb.REMOVE_REASON_REMOVED),
    (DropReason.CORRUPT, pb.REMOVE_REASON_CORRUPT), (DropReason.ABORTED, pb.REMOVE_REASON_ABORTED),
    (DropReason.MOVED, pb.REMOVE_REASON_MOVED), (DropReason.RESIZED, pb.REMOVE_REASON_EVICTED),
    (DropReason.CLEARED, pb.REMOVE_REASON_EVICTED), (None, pb.REMOVE_REASON_EVICTED)])
def test_reasons_on_the_wire(reason: DropReason | None, wire: int) -> None:
    log = _log()
    log.append(Event(EventKind.REMOVED, D, K[:1], TierKind.DRAM, reason))
    assert log.since(0)[1][0].removed.reason == wire


def test_replay_and_gap() -> None:
    log = _log(capacity=2)
    for k in K[:3]:
        log.append(Event(EventKind.STORED, D, [k], TierKind.DRAM))
    gap, evs = log.since(0)
    assert gap == 2 and [e.seq for e in evs] == [2, 3]
    assert log.since(2) == (None, [evs[1]])
    assert log.since(3) == (None, [])


def test_round_trip_to_the_typed_event() -> None:
    log = _log()
    log.append(Event(EventKind.STORED, D, K[:2], TierKind.HBM, parent=K[3]))
    log.append(Event(EventKind.REMOVED, D, K[:2], TierKind.DRAM, DropReason.MOVED))
    log.append(Event(EventKind.CLEARED, D, []))
    s, r, c = (event_from_pb(e) for e in log.since(0)[1])
    assert (s.kind, s.seq, s.keys, s.tier, s.parent, s.ns_digest) == (EventKind.STORED, 1, K[:2], TierKind.HBM, K[3], D)
    assert s.time_unix_ns > 0
    assert (r.kind, r.reason, r.tier) == (EventKind.REMOVED, DropReason.MOVED, TierKind.DRAM)
    assert (c.kind, c.ns_digest, c.all_namespaces) == (EventKind.CLEARED, D, False)
    g = event_from_pb(pb.Event(seq=0, gap=pb.Gap(first_available_seq=7)))
    assert (g.kind, g.first_available_seq, g.seq) == (EventKind.GAP, 7, 0)


def test_wait_wakes_on_append() -> None:
    async def run() -> int:
        log = EventLog(4)
        waiter = asyncio.create_task(log.wait(30.0))
        await asyncio.sleep(0)
        log.append(Event(EventKind.CLEARED, b"", []))
        await asyncio.wait_for(waiter, 30.0)
        return log.seq

    assert asyncio.run(run()) == 1


class _Ctx:
    def invocation_metadata(self) -> tuple[()]:
        return ()

    async def abort(self, code: object, msg: str) -> None:
        raise AssertionError(f"aborted: {code} {msg}")


def _watch(log: EventLog, after: int):  # type: ignore[no-untyped-def]
    """``KVStoreService.WatchEvents`` on ``log``, without a server (auth off, every event visible)."""
    from types import SimpleNamespace

    from kvstore.daemon.auth import Principal
    from kvstore.daemon.kv_service import KVStoreService

    svc = SimpleNamespace(auth=SimpleNamespace(principal=lambda md: Principal(None, True)), events=log,
                          _visible=lambda ev, who, only: True)
    return KVStoreService.WatchEvents(svc, pb.WatchRequest(after_seq=after), _Ctx())  # type: ignore[arg-type]


def test_a_reader_that_falls_behind_while_following_gets_a_gap() -> None:
    """A slow watcher whose unread events left the ring is told so (Gap), not
    silently handed the events after the hole."""
    async def run() -> list[tuple[int, int]]:
        log = EventLog(2)
        log.append(Event(EventKind.STORED, D, K[:1], TierKind.DRAM))
        stream = _watch(log, 0)
        got = [await asyncio.wait_for(stream.__anext__(), 30.0)]  # seq 1: now following
        for k in K:  # seq 2..5 while the reader is slow: 2 and 3 fall out of the ring
            log.append(Event(EventKind.STORED, D, [k], TierKind.DRAM))
        for _ in range(3):
            got.append(await asyncio.wait_for(stream.__anext__(), 30.0))
        await stream.aclose()
        return [(e.seq, e.gap.first_available_seq if e.WhichOneof("kind") == "gap" else 0) for e in got]

    assert asyncio.run(run()) == [(1, 0), (0, 4), (4, 0), (5, 0)]


def test_watch_replays_from_after_seq_and_says_gap_when_it_fell_out() -> None:
    async def run(after: int, n: int) -> list[int]:
        log = EventLog(2)
        for k in K:  # seq 1..4; 3 and 4 buffered
            log.append(Event(EventKind.STORED, D, [k], TierKind.DRAM))
        stream = _watch(log, after)
        got = [await asyncio.wait_for(stream.__anext__(), 30.0) for _ in range(n)]
        await stream.aclose()
        return [e.seq if e.WhichOneof("kind") != "gap" else -e.gap.first_available_seq for e in got]

    assert asyncio.run(run(0, 2)) == [3, 4]  # from the oldest buffered
    assert asyncio.run(run(1, 3)) == [-3, 3, 4]  # seq 2 is gone
    assert asyncio.run(run(2, 2)) == [3, 4]
    assert asyncio.run(run(3, 1)) == [4]
    assert asyncio.run(run(9, 3)) == [-3, 3, 4]  # from a previous daemon run


def test_a_watcher_resuming_from_another_daemon_run_gets_a_gap_and_the_whole_buffer() -> None:
    """The restarted daemon's sequence has passed the one the watcher saw in
    the previous run: ``after_seq`` alone looks current. The run id it sends
    says otherwise: a Gap, then everything buffered (from seq 1)."""
    async def run() -> list[tuple[int, int, int]]:
        log = EventLog(16)
        for k in K:
            log.append(Event(EventKind.STORED, D, [k], TierKind.DRAM))
        req = pb.WatchRequest(after_seq=2, run_id=log.run_id ^ 1)
        from types import SimpleNamespace

        from kvstore.daemon.auth import Principal
        from kvstore.daemon.kv_service import KVStoreService

        svc = SimpleNamespace(auth=SimpleNamespace(principal=lambda md: Principal(None, True)), events=log,
                              _visible=lambda ev, who, only: True)
        stream = KVStoreService.WatchEvents(svc, req, _Ctx())  # type: ignore[arg-type]
        got = [await asyncio.wait_for(stream.__anext__(), 30.0) for _ in range(1 + len(K))]
        await stream.aclose()
        return [(e.seq, e.gap.first_available_seq if e.WhichOneof("kind") == "gap" else 0, e.run_id) for e in got]

    got = asyncio.run(run())
    assert [(s, g) for s, g, _ in got] == [(0, 1)] + [(i + 1, 0) for i in range(len(K))]
    assert len({r for _, _, r in got}) == 1 and got[0][2] != 0  # every event, the Gap too, names the run
