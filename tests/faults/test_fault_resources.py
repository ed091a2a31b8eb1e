"""Resource faults: a full disk (ENOSPC) and a slow disk under the SSD tier
(through its injectable file layer), and CPU starvation (busy processes on
every core). Puts and reads keep working, every call ends with a status by
its deadline, a call the client gave up on leaves no pin or reservation
behind, and no live session's lease or reservation is expired."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

import grpc
import numpy as np

from kvstore.client import Client, ns_pb
from kvstore.errors import DeadlineExceeded, KeyStatus, KVStoreError
from kvstore.keys import Namespace
from proto import kvstore_pb2 as pb
from tests.conftest import payload_for
from tests.faults.faultlib import record, setting
from tests.integration.conftest import wait_until
from tests.support.keys import chain_keys
from tiers.ssd import OsFileLayer

NS = Namespace(tenant="acme", model_id="llama", block_size=16)
BS = 64 * 1024


def P(k: bytes) -> bytes:
    return payload_for(b"res", k, BS)


class FaultFs(OsFileLayer):
    """The real OS, with switches: ENOSPC on writes (after a partial write,
    as a full disk does) or on syncs, and a delay on every I/O call."""

    def __init__(self) -> None:
        self.enospc = False
        self.sync_error: int | None = None
        self.delay = 0.0
        self.calls = 0

    def _slow(self) -> None:
        self.calls += 1
        if self.delay:
            time.sleep(self.delay)

    def pwritev(self, fd: int, bufs: Sequence[Any], offset: int) -> int:  # type: ignore[override]
        self._slow()
        if self.enospc:
            n = os.pwritev(fd, [memoryview(bufs[0])[:100]], offset)
            if n:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().pwritev(fd, bufs, offset)

    def preadv(self, fd: int, bufs: Sequence[Any], offset: int) -> int:  # type: ignore[override]
        self._slow()
        return super().preadv(fd, bufs, offset)

    def fdatasync(self, fd: int) -> None:  # type: ignore[override]
        self._slow()
        if self.sync_error is not None:
            raise OSError(self.sync_error, os.strerror(self.sync_error))
        super().fdatasync(fd)


def _ssd_daemon(make_daemon, tmp_path, **over: Any):
    d = make_daemon(**{"dram__capacity": "4MiB", "dram__page_size": "1MiB", "ssd__capacity": "64MiB",
                       "ssd__path": str(tmp_path / "ssd"), "ssd__admit_min_hits": 0, "ssd__write_mode": "back",
                       **over})
    fs = FaultFs()
    d.call(lambda: setattr(d.store.ssd.tier, "fs", fs))
    return d, fs


def _verify(c: Client, chains: list[list[bytes]]) -> tuple[int, int]:
    hits = wrong = 0
    for keys in chains:
        for k, g in zip(keys, c.get(NS, keys)):
            hits += g is not None
            wrong += g is not None and g.tobytes() != P(k)
    return hits, wrong


def test_disk_full_then_space_returns(make_daemon, tmp_path) -> None:
    d, fs = _ssd_daemon(make_daemon, tmp_path)
    mover = d.store.ssd
    chains: list[list[bytes]] = []
    with Client(d.target) as c:
        fs.enospc = True
        put_ok = puts = 0
        for i in range(16):  # 8 MiB through a 4 MiB DRAM tier: every demotion hits ENOSPC
            keys = chain_keys(i, 8)
            chains.append(keys)
            put_ok += c.put(NS, keys, [P(k) for k in keys]) == [KeyStatus.OK] * 8
            puts += 1
        c.flush()  # (a write-behind put has landed once its answer is read)
        errors_full = d.call(lambda: mover.write_errors)
        hits_full, wrong_full = _verify(c, chains)
        fs.enospc = False
        fs.sync_error = errno.EIO  # then a failing fsync: the batch fails, the segment is sealed
        for i in range(16, 20):
            keys = chain_keys(i, 8)
            chains.append(keys)
            put_ok += c.put(NS, keys, [P(k) for k in keys]) == [KeyStatus.OK] * 8
            puts += 1
        c.flush()
        errors_sync = d.call(lambda: mover.write_errors) - errors_full
        fs.sync_error = None
        demoted0 = d.call(lambda: mover.demoted)
        for i in range(20, 36):  # space is back: demotions work again
            keys = chain_keys(i, 8)
            chains.append(keys)
            put_ok += c.put(NS, keys, [P(k) for k in keys]) == [KeyStatus.OK] * 8
            puts += 1
        c.flush()
        demoted = d.call(lambda: mover.demoted) - demoted0
        hits, wrong = _verify(c, chains)
        late = c.late_rejected  # blocks of write-behind puts the daemon could not store after all
        on_ssd = d.call(lambda: int((d.store.index.tier[d.store.index.used_rows()] == 2).sum()))
    record("disk_full", puts=puts, puts_ok=put_ok, demotion_write_errors_enospc=errors_full,
           demotion_write_errors_eio_sync=errors_sync, demoted_after_space_returned=demoted,
           blocks_on_ssd_after=on_ssd, corrupt_returns=wrong_full + wrong)
    assert puts == put_ok == 36 and late == 0  # puts into DRAM never fail because the disk is full
    assert errors_full > 0 and errors_sync > 0
    assert wrong_full == 0 and wrong == 0
    assert demoted > 0 and on_ssd > 0 and hits > 0


def _leftovers(d) -> tuple[int, int, int]:
    """(leases, reservations, pinned rows) in the store."""
    def go() -> tuple[int, int, int]:
        st = d.store
        return *st.hold_counts(), int((st.index.pins[st.index.used_rows()] > 0).sum())

    return d.call(go)


class _SlowStore:
    """Makes the store's acquire and reserve take 50 ms (on the daemon's loop)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.calls = 0
        self.orig = {name: getattr(store, name) for name in ("acquire", "reserve")}
        for name, fn in self.orig.items():
            setattr(store, name, self._slow(fn))

    def _slow(self, fn: Any) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            self.calls += 1
            time.sleep(0.05)
            return fn(*a, **kw)

        return run

    def undo(self) -> None:
        for name in self.orig:
            delattr(self.store, name)


def test_slow_disk_deadlines_and_abandoned_calls(make_daemon, tmp_path) -> None:
    """With every SSD call taking 30 ms: foreground calls keep a status by
    their deadline, and an Acquire or Reserve whose caller gave up (its
    deadline passed while the daemon worked) leaves no lease, pin or
    reservation behind.

    Also measured (issue 19), not asserted: Lookup p99 under the same
    background load with a normal disk and with the 30 ms disk, in slices
    that alternate between the two, and their ratio (target <= 2 in
    bench/faults.py)."""
    d, fs = _ssd_daemon(make_daemon, tmp_path)
    chains = [chain_keys(100 + i, 8) for i in range(16)]
    delay = float(setting("slow_disk_delay", 0.03))
    slices = 4
    with Client(d.target) as c:
        for keys in chains:
            assert c.put(NS, keys, [P(k) for k in keys]) == [KeyStatus.OK] * 8
        wait_until(lambda: d.call(lambda: d.store.ssd.demoted) > 0, what="demotions")
        lat: dict[bool, list[float]] = {False: [], True: []}  # slow disk? -> Lookup seconds
        deadline_hit = 0
        stop = threading.Event()

        def load() -> None:  # puts that demote, gets that promote: SSD work on the loop
            with Client(d.target) as w:
                i = 0
                while not stop.is_set():
                    try:
                        w.get(NS, chains[i % len(chains)])
                        keys = chain_keys(1000 + i, 4)
                        w.put(NS, keys, [P(k) for k in keys])
                    except KVStoreError:
                        pass
                    i += 1

        t = threading.Thread(target=load, daemon=True)
        t.start()
        span = setting("slow_disk_s", 4.0) / slices
        for part in range(2 * slices):  # normal, slow, normal, slow, ...
            slow_now = part % 2 == 1
            fs.delay = delay if slow_now else 0.0
            t_end = time.monotonic() + span
            while time.monotonic() < t_end:
                t0 = time.perf_counter()
                try:
                    c._call(c.stub.Lookup, pb.LookupRequest(ns=ns_pb(NS), keys_packed=b"".join(chains[0])),
                            timeout=5.0)
                except DeadlineExceeded:
                    deadline_hit += 1
                lat[slow_now].append(time.perf_counter() - t0)
        fs.delay = delay
        stop.set()
        t.join(60)
        slow_ms, normal_ms = np.asarray(lat[True]) * 1000, np.asarray(lat[False]) * 1000
        slow_p99, normal_p99 = float(np.percentile(slow_ms, 99)), float(np.percentile(normal_ms, 99))
        record("slow_disk", io_delay_ms=delay * 1000, lookups=int(slow_ms.size),
               lookup_p50_ms=float(np.percentile(slow_ms, 50)), lookup_p99_ms=slow_p99,
               lookup_max_ms=float(slow_ms.max()), normal_lookups=int(normal_ms.size),
               normal_lookup_p50_ms=float(np.percentile(normal_ms, 50)), normal_lookup_p99_ms=normal_p99,
               normal_lookup_max_ms=float(normal_ms.max()),
               lookup_p99_ratio=slow_p99 / normal_p99 if normal_p99 > 0 else float("inf"),
               lookup_deadline_exceeded=deadline_hit)
        # calls whose deadline is shorter than the work they start: the store
        # calls take 50 ms here (as a promotion from a slow disk does), the
        # deadline is 20 ms, so the caller has always gone when they finish
        slow = _SlowStore(d.store)
        abandoned = 0
        other_codes: list[Any] = []
        for keys in chains:
            for call, req in ((c.stub.Acquire, pb.AcquireRequest(ns=ns_pb(NS), keys_packed=b"".join(keys),
                                                                  promote=True)),
                              (c.stub.Reserve, pb.ReserveRequest(ns=ns_pb(NS), keys_packed=b"".join(
                                  chain_keys(5000 + abandoned, 8)), block_bytes=BS))):
                for _attempt in range(20):  # a call the daemon refused before it began (deadline) is sent again
                    try:
                        r = call(req, metadata=c._md(), timeout=0.02)
                    except grpc.RpcError as e:
                        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
                    else:  # cannot happen (50 ms of work, 20 ms deadline); give it back if it does
                        if isinstance(r, pb.AcquireResponse) and r.lease_id:
                            c._call(c.stub.Release, pb.ReleaseRequest(lease_id=r.lease_id))
                        elif isinstance(r, pb.ReserveResponse) and r.reservation_id:
                            c._call(c.stub.Abort, pb.AbortRequest(reservation_id=r.reservation_id))
                    # disk-bound calls run on the disk worker (a lookup no longer
                    # queues behind them): wait until this one reached the store
                    try:
                        wait_until(lambda: slow.calls > abandoned, timeout=2.0, what="the call reached the store")
                    except TimeoutError:
                        continue
                    abandoned += 1
                    break
        wait_until(lambda: _leftovers(d) == (0, 0, 0), timeout=30,
                   what="no lease, reservation or pin left by abandoned calls")
        slow.undo()
        fs.delay = 0.0
        # the session is still open, so nothing is reclaimed by its end: what
        # an abandoned call took must have been given back at once
        left = [(-1, -1, -1)]

        def nothing_left() -> bool:
            left[0] = _leftovers(d)
            return left[0] == (0, 0, 0)

        try:
            wait_until(nothing_left, timeout=30, what="no lease, reservation or pin left by abandoned calls")
        except TimeoutError:
            pass
        hits, wrong = _verify(c, chains)
    record("slow_disk", abandoned_calls=abandoned, abandoned_calls_reaching_store=slow.calls,
           abandoned_left_behind=sum(left[0]), corrupt_returns=wrong)
    assert not other_codes, other_codes
    assert abandoned == slow.calls == 2 * len(chains)  # each one reached the store, then was undone
    assert left[0] == (0, 0, 0), left[0]
    assert max(lat[True] + lat[False]) < 5.0 + 2.0  # every call ended (with a status) by its deadline
    assert wrong == 0


BUSY = "import time\nt = time.monotonic() + {s}\nwhile time.monotonic() < t:\n    pass\n"


def test_cpu_starvation_expires_nothing_live(make_daemon) -> None:
    secs = setting("starve_s", 6.0)
    d = make_daemon(dram__capacity="16MiB", server__lease_check_interval=0.05)
    keys = chain_keys(1, 8)
    with Client(d.target) as c:
        assert c.put(NS, keys, [P(k) for k in keys]) == [KeyStatus.OK] * 8
        lease = c.acquire(NS, keys)  # held by a live session: must never expire
        resv = c.reserve(NS, chain_keys(2, 4), BS)
        busy = [subprocess.Popen([sys.executable, "-c", BUSY.format(s=secs + 5)])
                for _ in range(os.cpu_count() or 2)]
        lat: list[float] = []
        errors = short = 0
        try:
            t_end = time.monotonic() + secs
            while time.monotonic() < t_end:
                t0 = time.perf_counter()
                try:
                    short += c.lookup(NS, keys).hit_blocks != 8
                except DeadlineExceeded:
                    errors += 1
                lat.append(time.perf_counter() - t0)
        finally:
            for p in busy:
                p.kill()
                p.wait()
        sessions = d.call(lambda: len(d.daemon.sessions))
        leases, resvs, _ = _leftovers(d)
        expired = d.call(lambda: (d.store.counters.leases_expired, d.store.counters.reservations_expired))
        overwritten = sum(v is None or v.tobytes() != P(k) for v, k in zip(lease.views, keys))
        lat_ms = np.asarray(lat) * 1000
        record("cpu_starvation", busy_processes=len(busy), seconds=secs, lookups=len(lat),
               lookup_p99_ms=float(np.percentile(lat_ms, 99)), lookup_max_ms=float(lat_ms.max()),
               deadline_exceeded=errors, lookups_short_of_the_chain=short,
               leases_falsely_expired=expired[0], reservations_falsely_expired=expired[1],
               pinned_blocks_overwritten=overwritten, sessions_alive=sessions)
        assert overwritten == 0  # still pinned, never overwritten
        lease.release()  # NOT_FOUND here would mean it had been expired
        for off, n in zip(resv.offsets, resv.lengths):
            c.view(off, n)[:] = 7
        assert c.commit(resv) == [KeyStatus.OK] * 4
    assert sessions >= 1 and leases >= 1 and resvs >= 1
    assert expired == (0, 0)
    assert short == 0
    assert errors == 0  # 30 s deadlines are honoured, even on a starved machine


def test_disk_full_when_a_namespace_stores_its_first_block(tmp_path) -> None:
    """The namespace is known (its descriptor written) but the disk is full
    when its first block is stored: the put still succeeds in DRAM and no
    row is left half-made."""
    from kvstore.core.index import BlockState
    from kvstore.core.store import StoreConfig, TieredStore
    from kvstore.core.ssd_mover import SsdSpec

    cfg = StoreConfig(dram_bytes=4 << 20, dram_page_bytes=1 << 20,
                      ssd=SsdSpec(path=str(tmp_path / "ssd"), capacity_bytes=16 << 20, admit_min_hits=0, sync=False))
    keys = chain_keys(7, 4)
    with TieredStore(cfg) as s:
        fs = FaultFs()
        s.ssd.tier.fs = fs
        assert s.put(NS, keys[:1], [b""]).statuses == [KeyStatus.INVALID]  # registers the namespace
        fs.enospc = True
        assert s.put(NS, keys, [P(k) for k in keys]).statuses == [KeyStatus.OK] * 4
        rows = s.index.used_rows()
        assert (s.index.state[rows] == BlockState.COMMITTED).all() and rows.size == 4
        got = s.get(NS, keys).payloads
        assert [g.tobytes() for g in got] == [P(k) for k in keys]
        fs.enospc = False
