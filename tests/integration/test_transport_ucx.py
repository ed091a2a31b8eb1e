"""transport.ucx between two real processes over real ucxx on 127.0.0.1.

The peer is ``python -m transport.ucx_peer`` (a BlockServer whose provider
serves views of a deterministic slab; the JSON header says what to serve and
how to misbehave); the client is a BlockClient in the test process."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ucxx")

from transport.ucx import BlockClient, shutdown  # noqa: E402
from transport.ucx_peer import block, pattern  # noqa: E402
from tests.support.ucx_peer import ENV, KIB, ROOT, SLAB, PeerProc, poll  # noqa: E402


@pytest.fixture
async def client():
    """A BlockClient on this test's loop, UCX warmed up (its one-time set-up
    is synchronous and would eat the first deadline); UCX is shut down after
    the test so no UCX thread outlives the loop."""
    from transport.ucx import ucx_module

    ucx_module("127.0.0.1", None)
    c = BlockClient()
    yield c
    await c.close()
    shutdown()


@pytest.fixture(scope="module")
def slab() -> np.ndarray:
    return pattern(SLAB)


class Dest:
    """Destination slots with a sentinel fill, like reserved DRAM slots."""

    def __init__(self, n: int, size: int, skip: tuple[int, ...] = ()) -> None:
        self.buf = np.full(n * size, 0xAB, dtype=np.uint8)
        self.n, self.size, self.skip = n, size, set(skip)
        self.calls = 0

    def view(self, i: int) -> np.ndarray:
        return self.buf[i * self.size:(i + 1) * self.size]

    def alloc(self, lengths: np.ndarray) -> list[memoryview | None]:
        self.calls += 1
        assert lengths.dtype == np.int64 and len(lengths) == self.n
        return [memoryview(self.view(i)) if lengths[i] and i not in self.skip else None
                for i in range(self.n)]

    def untouched(self, i: int) -> bool:
        return bool((self.view(i) == 0xAB).all())


def hdr(**kw: Any) -> bytes:
    return json.dumps(kw).encode()


async def test_bytes_exact_and_one_endpoint_for_many_fetches(peer, slab, client):
    c = client
    try:
        for n, size, off in ((4, 64 * KIB, 0), (8, 1 << 20, 12345), (3, 100_003, 7)):
            d = Dest(n, size)
            r = await c.fetch(peer.address, hdr(n=n, size=size, off=off), n, d.alloc, 10.0)
            assert r.error is None and r.corrupt == 0
            assert r.ok.all() and (r.lengths == size).all() and r.nbytes == n * size
            for i in range(n):
                assert np.array_equal(d.view(i), block(slab, i, size, off)), i
        # concurrent fetches share the pooled endpoint
        ds = [Dest(4, 256 * KIB) for _ in range(4)]
        rs = await asyncio.gather(*[c.fetch(peer.address, hdr(n=4, size=256 * KIB, off=k), 4, d.alloc, 10.0)
                                    for k, d in enumerate(ds)])
        for k, (r, d) in enumerate(zip(rs, ds)):
            assert r.ok.all(), r.error
            assert all(np.array_equal(d.view(i), block(slab, i, 256 * KIB, k)) for i in range(4))
        assert c.connects == 1 and c.pooled == [peer.address]
        await poll(lambda: peer.stats()["released"] == 7)
        st = peer.stats()
        assert st["endpoints"] == 1 and st["served"] == 7 and st["pinned"] == 0
    finally:
        pass


async def test_absent_skipped_and_lying_checksum(peer, slab, client):
    c = client
    try:
        n, size = 6, 128 * KIB
        d = Dest(n, size, skip=(4,))
        r = await c.fetch(peer.address, hdr(n=n, size=size, absent=[1], lie=[3]), n, d.alloc, 10.0)
        assert r.error is None
        assert r.lengths.tolist() == [size, 0, size, size, size, size]
        assert r.ok.tolist() == [True, False, True, False, False, True]
        assert r.corrupt == 1 and r.nbytes == 3 * size
        assert d.untouched(1) and d.untouched(4)  # absent / skipped: never written
        for i in (0, 2, 5):
            assert np.array_equal(d.view(i), block(slab, i, size))
        await poll(lambda: peer.stats()["released"] == 1)
    finally:
        pass


@pytest.mark.parametrize("sized", [False, True])
async def test_verify_is_per_call_and_a_lying_checksum_is_caught_when_asked(peer, slab, client, sized):
    """``verify=True`` (the default, and what a fetch whose bytes go straight
    to a consumer uses) hashes each block on arrival: the lie is corrupt.
    ``verify=False`` (the daemon's fetch into its DRAM tier, whose readers
    check the peer's checksum) does not hash: the block is ok and the peer's
    checksums come back to be committed with it."""
    c = client
    n, size = 4, 128 * KIB
    sizes = full(n, size) if sized else None
    for verify in (True, False):
        d = Dest(n, size)
        r = await c.fetch(peer.address, hdr(n=n, size=size, lie=[2]), n, d.alloc, 10.0, sizes=sizes, verify=verify)
        assert r.error is None
        assert r.ok.tolist() == [True, True, not verify, True]
        assert r.corrupt == (1 if verify else 0)
        assert r.checksums is not None and len(r.checksums) == n
        for i in range(n):  # (the bytes are right: only the checksum lies)
            assert np.array_equal(d.view(i), block(slab, i, size))
        if not verify:  # the lie is what the receiver would commit: its first reader finds the mismatch
            from kvstore.checksum import checksum
            assert int(r.checksums[2]) != checksum(d.view(2))
            assert int(r.checksums[1]) == checksum(d.view(1))


@pytest.mark.parametrize("flag,word", [("refuse", "refused"), ("invalid", "invalid")])
async def test_provider_errors_reach_the_caller_and_nothing_is_written(peer, flag, word, client):
    c = client
    try:
        d = Dest(4, 64 * KIB)
        r = await c.fetch(peer.address, hdr(n=4, size=64 * KIB, **{flag: True}), 4, d.alloc, 10.0)
        assert r.error is not None and word in r.error
        if flag == "refuse":
            assert "namespace not readable" in r.error
        assert not r.ok.any() and r.nbytes == 0 and d.calls == 0
        assert all(d.untouched(i) for i in range(4))
        # the endpoint survives a refused request
        r2 = await c.fetch(peer.address, hdr(n=2, size=64 * KIB), 2, Dest(2, 64 * KIB).alloc, 10.0)
        assert r2.ok.all() and c.connects == 1
        await poll(lambda: peer.stats()["released"] == 1)
        assert peer.stats()["served"] == 1  # the raising call pinned nothing
    finally:
        pass


async def test_alloc_failure_releases_once_and_keeps_the_endpoint(peer, client):
    c = client
    try:
        def boom(lengths: np.ndarray) -> list[memoryview | None]:
            raise RuntimeError("no room")

        r = await c.fetch(peer.address, hdr(n=3, size=64 * KIB), 3, boom, 10.0)
        assert r.error is not None and "no room" in r.error and not r.ok.any()
        await poll(lambda: peer.stats()["released"] == 1)
        r2 = await c.fetch(peer.address, hdr(n=3, size=64 * KIB), 3, Dest(3, 64 * KIB).alloc, 10.0)
        assert r2.ok.all() and c.connects == 1
        await poll(lambda: peer.stats()["released"] == 2)
    finally:
        pass


async def test_paused_peer_fails_within_deadline_and_late_data_never_lands(peer, client):
    """SIGSTOP after the table arrived (from inside alloc): the blocks cannot
    come; the fetch ends within its deadline; after SIGCONT the peer's sends
    fail, it releases the pin, and the destinations stay untouched."""
    c = client
    try:
        assert (await c.fetch(peer.address, hdr(n=1, size=KIB), 1, Dest(1, KIB).alloc, 10.0)).ok.all()
        n, size = 16, 1 << 20
        d = Dest(n, size)

        def alloc_then_pause(lengths: np.ndarray) -> list[memoryview | None]:
            peer.signal(signal.SIGSTOP)
            return d.alloc(lengths)

        deadline = 1.0
        t0 = time.monotonic()
        r = await c.fetch(peer.address, hdr(n=n, size=size), n, alloc_then_pause, deadline)
        took = time.monotonic() - t0
        assert r.error is not None and "deadline" in r.error, r.error
        assert took < deadline + 1.5 and not r.ok.any()
        assert c.pooled == []  # the endpoint was dropped
        snapshot = d.buf.copy()
        peer.signal(signal.SIGCONT)
        await poll(lambda: peer.stats()["released"] == 2)
        assert np.array_equal(d.buf, snapshot)
        # the next fetch reconnects and works
        r2 = await c.fetch(peer.address, hdr(n=2, size=size), 2, Dest(2, size).alloc, 10.0)
        assert r2.ok.all() and c.connects == 2
        await poll(lambda: peer.stats()["released"] == 3)
        assert peer.stats()["served"] == 3
    finally:
        peer.signal(signal.SIGCONT)


async def test_paused_before_answering_fails_within_deadline(peer, client):
    c = client
    try:
        assert (await c.fetch(peer.address, hdr(n=1, size=KIB), 1, Dest(1, KIB).alloc, 10.0)).ok.all()
        peer.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        d = Dest(4, KIB)
        r = await c.fetch(peer.address, hdr(n=4, size=KIB), 4, d.alloc, 0.5)
        assert r.error is not None and time.monotonic() - t0 < 0.5 + 1.5
        assert d.calls == 0
        peer.signal(signal.SIGCONT)
        r2 = await c.fetch(peer.address, hdr(n=4, size=KIB), 4, Dest(4, KIB).alloc, 10.0)
        assert r2.ok.all(), r2.error
    finally:
        peer.signal(signal.SIGCONT)


async def test_killed_peer_mid_transfer_then_restarted_peer_works(slab, client):
    p = PeerProc()
    c = client
    try:
        assert (await c.fetch(p.address, hdr(n=1, size=KIB), 1, Dest(1, KIB).alloc, 10.0)).ok.all()
        n, size = 64, 1 << 20
        d = Dest(n, size)

        def alloc_then_kill(lengths: np.ndarray) -> list[memoryview | None]:
            p.signal(signal.SIGKILL)
            return d.alloc(lengths)

        deadline = 5.0
        t0 = time.monotonic()
        r = await c.fetch(p.address, hdr(n=n, size=size), n, alloc_then_kill, deadline)
        assert r.error is not None and not r.ok.any()
        assert time.monotonic() - t0 < deadline + 1.5
        p.p.wait(10)
        # a dead address: a clean error, no hang
        r1 = await c.fetch(p.address, hdr(n=1, size=KIB), 1, Dest(1, KIB).alloc, 3.0)
        assert r1.error is not None and not r1.ok.any()
        # restarted (on a new port: the old one may sit in TIME_WAIT, and UCX's
        # listener does not set SO_REUSEADDR): the next fetch connects afresh
        p2 = PeerProc()
        try:
            d2 = Dest(4, size)
            r2 = await c.fetch(p2.address, hdr(n=4, size=size), 4, d2.alloc, 10.0)
            assert r2.ok.all(), r2.error
            assert all(np.array_equal(d2.view(i), block(slab, i, size)) for i in range(4))
        finally:
            p2.close()
    finally:
        pass
        p.close()


async def test_client_deadline_while_provider_is_slow_releases_once(peer, client):
    c = client
    try:
        assert (await c.fetch(peer.address, hdr(n=1, size=KIB), 1, Dest(1, KIB).alloc, 10.0)).ok.all()
        d = Dest(2, KIB)
        t0 = time.monotonic()
        r = await c.fetch(peer.address, hdr(n=2, size=KIB, delay=1.0), 2, d.alloc, 0.3)
        assert r.error is not None and "deadline" in r.error and time.monotonic() - t0 < 0.3 + 1.0
        assert d.calls == 0
        # the provider answers after the server gave up: its batch is released at once, exactly once
        await poll(lambda: peer.stats()["released"] == 2)
        st = peer.stats()
        assert st["served"] == 2 and st["pinned"] == 0  # a double release would show as +1000
    finally:
        pass


# ------------------------------------------------------------ sized fetch
def full(n: int, size: int) -> np.ndarray:
    return np.full(n, size, dtype=np.int64)


async def test_sized_fetch_allocates_first_and_receives_only_blocks_of_the_posted_size(peer, slab, client):
    """One round trip: alloc runs before the peer is asked (its provider has
    not run yet), with the sizes given. A block of another length than its
    slot, an absent one and a skipped one are never written; a lying
    checksum is caught; the endpoint stays."""
    c = client
    n, size = 6, 128 * KIB
    d = Dest(n, size, skip=(4,))
    sizes = full(n, size)
    sizes[2] = size // 2
    seen: list[tuple[list[int], int]] = []

    def alloc(lengths: np.ndarray) -> list[memoryview | None]:
        seen.append((lengths.tolist(), peer.stats()["served"]))
        out = d.alloc(full(n, size))
        out[2] = memoryview(d.view(2)[: size // 2])
        return out

    r = await c.fetch(peer.address, hdr(n=n, size=size, absent=[1], lie=[3]), n, alloc, 10.0, sizes=sizes)
    assert seen == [(sizes.tolist(), 0)]
    assert r.error is None
    assert r.lengths.tolist() == [size, 0, size, size, size, size]  # the peer's own lengths
    assert r.ok.tolist() == [True, False, False, False, False, True]
    assert r.corrupt == 1 and r.nbytes == 2 * size
    assert d.untouched(1) and d.untouched(2) and d.untouched(4)
    for i in (0, 5):
        assert np.array_equal(d.view(i), block(slab, i, size))
    await poll(lambda: peer.stats()["released"] == 1)
    d2 = Dest(3, 1 << 20)
    r2 = await c.fetch(peer.address, hdr(n=3, size=1 << 20, off=99), 3, d2.alloc, 10.0, sizes=full(3, 1 << 20))
    assert r2.ok.all() and c.connects == 1
    assert all(np.array_equal(d2.view(i), block(slab, i, 1 << 20, 99)) for i in range(3))


@pytest.mark.parametrize("flag,word", [("refuse", "refused"), ("invalid", "invalid")])
async def test_sized_fetch_refused_ends_at_once_and_keeps_the_endpoint(peer, flag, word, client):
    """The receives were posted before the answer: the peer completes each
    with an empty message, so a refusal ends the fetch at once (not at its
    deadline), writes nothing, and the endpoint stays."""
    c = client
    d = Dest(4, 64 * KIB)
    t0 = time.monotonic()
    r = await c.fetch(peer.address, hdr(n=4, size=64 * KIB, **{flag: True}), 4, d.alloc, 10.0,
                      sizes=full(4, 64 * KIB))
    assert time.monotonic() - t0 < 5.0
    assert r.error is not None and word in r.error and not r.ok.any() and d.calls == 1
    assert all(d.untouched(i) for i in range(4))
    r2 = await c.fetch(peer.address, hdr(n=2, size=64 * KIB), 2, Dest(2, 64 * KIB).alloc, 10.0,
                       sizes=full(2, 64 * KIB))
    assert r2.ok.all() and c.connects == 1


async def test_sized_fetch_paused_peer_fails_within_deadline_and_late_data_never_lands(peer, client):
    """SIGSTOP before the request goes out (from inside alloc): the fetch
    ends within its deadline and drops the endpoint; after SIGCONT the peer
    answers into an aborted endpoint, releases its pin once, and the
    destinations stay untouched."""
    c = client
    assert (await c.fetch(peer.address, hdr(n=1, size=KIB), 1, Dest(1, KIB).alloc, 10.0,
                          sizes=full(1, KIB))).ok.all()
    n, size = 16, 1 << 20
    d = Dest(n, size)

    def alloc_then_pause(lengths: np.ndarray) -> list[memoryview | None]:
        peer.signal(signal.SIGSTOP)
        return d.alloc(lengths)

    try:
        t0 = time.monotonic()
        r = await c.fetch(peer.address, hdr(n=n, size=size), n, alloc_then_pause, 1.0, sizes=full(n, size))
        assert r.error is not None and "deadline" in r.error, r.error
        assert time.monotonic() - t0 < 1.0 + 1.5 and not r.ok.any()
        assert c.pooled == []
        snapshot = d.buf.copy()
        peer.signal(signal.SIGCONT)
        await poll(lambda: peer.stats()["released"] == 2)
        assert np.array_equal(d.buf, snapshot)
        r2 = await c.fetch(peer.address, hdr(n=2, size=size), 2, Dest(2, size).alloc, 10.0, sizes=full(2, size))
        assert r2.ok.all() and c.connects == 2
    finally:
        peer.signal(signal.SIGCONT)


async def test_sized_fetch_too_large_for_one_request_takes_two_steps(peer, slab, client, monkeypatch):
    """Sizes that would not fit in the peer's request buffer: the two-step
    protocol, so alloc runs after the peer answered, with its lengths."""
    from transport import ucx

    monkeypatch.setattr(ucx, "MAX_HEADER", 64)  # this process only: the peer keeps the real bound
    c = client
    n, size = 8, 64 * KIB
    seen: list[int] = []
    d = Dest(n, size)

    def alloc(lengths: np.ndarray) -> list[memoryview | None]:
        seen.append(peer.stats()["served"])
        return d.alloc(lengths)

    r = await c.fetch(peer.address, hdr(n=n, size=size), n, alloc, 10.0, sizes=full(n, size))
    assert r.ok.all() and seen == [1]
    assert all(np.array_equal(d.view(i), block(slab, i, size)) for i in range(n))
    with pytest.raises(ValueError, match="shape"):
        await c.fetch(peer.address, hdr(n=2, size=size), 2, alloc, 10.0, sizes=full(3, size))


async def test_malformed_sized_requests_close_the_endpoint(peer, client):
    """A negative posted length, or more posted lengths than the request
    buffer holds: the peer closes that endpoint and serves nothing."""
    import ucxx

    from transport import ucx_wire as wire

    host, port = peer.address.rsplit(":", 1)
    for count, posted in ((2, [-1, 64]), (wire.MAX_HEADER // 8 + 1, [64, 64])):
        ep = await ucxx.create_endpoint(host, int(port))
        await poll(lambda: peer.stats()["endpoints"] == 1)
        await ep.send(wire.request(wire.MAGIC_SIZED, 1, count, b"", 1.0, np.asarray(posted)), tag=wire.TAG_REQ)
        await poll(lambda: peer.stats()["endpoints"] == 0)
        ep.abort()
    assert peer.stats()["served"] == 0


def test_a_peer_that_cannot_listen_exits_instead_of_hanging(peer):
    """UCX's notifier thread is not a daemon thread: a process whose start
    fails must still end (transport.ucx.shutdown in a finally)."""
    p = subprocess.run([sys.executable, "-m", "transport.ucx_peer", "--port", str(peer.port)], cwd=ROOT,
                       env=ENV, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "Busy" in p.stderr
