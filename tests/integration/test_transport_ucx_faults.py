"""What kind of failure a fetch reports (``FetchResult.fault``), over real
ucxx against a peer process (``transport.ucx_peer``): the cluster decides
whether a peer's link is suspect on this kind, never on the error's words,
so a change of wording cannot stop a hung peer being marked suspect, nor
make a refusal look like a broken link."""

from __future__ import annotations

import asyncio
import json
import signal

import numpy as np
import pytest

pytest.importorskip("ucxx")

from tests.faults.faultlib import free_port  # noqa: E402
from tests.integration.test_transport_ucx import Dest, client, hdr  # noqa: E402,F401
from tests.support.ucx_peer import KIB, PeerProc, poll  # noqa: E402
from transport.ucx import BlockClient, FetchFault  # noqa: E402


async def test_each_failure_is_reported_with_its_kind(peer, client):  # noqa: F811
    c = client
    ok = await c.fetch(peer.address, hdr(n=1, size=KIB), 1, Dest(1, KIB).alloc, 10.0)
    assert ok.error is None and ok.fault is None and ok.ok.all()
    for sizes in (None, np.full(2, KIB, np.int64)):
        r = await c.fetch(peer.address, hdr(n=2, size=KIB, refuse=True), 2, Dest(2, KIB).alloc, 10.0, sizes=sizes)
        assert r.fault is FetchFault.REFUSED and not r.fault.link, r.error
        r = await c.fetch(peer.address, hdr(n=2, size=KIB, invalid=True), 2, Dest(2, KIB).alloc, 10.0, sizes=sizes)
        assert r.fault is FetchFault.INVALID and not r.fault.link, r.error

        def boom(lengths: np.ndarray) -> list[memoryview | None]:
            raise RuntimeError("no room")

        r = await c.fetch(peer.address, hdr(n=2, size=KIB), 2, boom, 10.0, sizes=sizes)
        assert r.fault is FetchFault.ALLOC and not r.fault.link, r.error
    # nothing listens there: the connect fails
    r = await c.fetch(f"127.0.0.1:{free_port()}", hdr(n=1, size=KIB), 1, Dest(1, KIB).alloc, 5.0)
    assert r.fault is FetchFault.LINK and r.fault.link and r.unconfirmed == 0, r.error
    # a peer that does not answer: the deadline passes
    peer.signal(signal.SIGSTOP)
    try:
        for sizes in (None, np.full(1, KIB, np.int64)):
            r = await c.fetch(peer.address, hdr(n=1, size=KIB), 1, Dest(1, KIB).alloc, 0.5, sizes=sizes)
            assert r.fault is FetchFault.LINK and r.fault.link, r.error
    finally:
        peer.signal(signal.SIGCONT)


async def test_a_provider_that_times_out_at_the_peer_is_a_slow_link(client):  # noqa: F811
    """The peer bounds its provider (``max_wait_s``); when that passes it
    answers timed out (``SLOW``) or, its own time spent, drops the
    connection (``LINK``: seen here): either way the fetch cost the wait,
    a link fault."""
    p = PeerProc(max_wait=0.2)
    try:
        r = await client.fetch(p.address, hdr(n=1, size=KIB, delay=2.0), 1, Dest(1, KIB).alloc, 30.0)
        assert r.fault in (FetchFault.SLOW, FetchFault.LINK) and r.fault.link, r.error
        await poll(lambda: p.stats()["released"] == 1)  # (the late batch is released)
    finally:
        p.close()


async def test_a_refusal_at_the_per_connection_limit_is_not_a_link_fault(client):  # noqa: F811
    """The peer's request limit answers refused (its text says "... on this
    connection"): the peer is busy, its link is fine."""
    p = PeerProc(max_requests=1)
    c = BlockClient()
    try:
        slow = asyncio.ensure_future(c.fetch(p.address, json.dumps({"n": 1, "size": KIB, "delay": 60}).encode(),
                                             1, lambda ls: [None], 120.0))
        await poll(lambda: p.stats()["asked"] == 1)
        r = await c.fetch(p.address, hdr(n=1, size=KIB), 1, Dest(1, KIB).alloc, 30.0)
        assert r.fault is FetchFault.REFUSED and not r.fault.link and "connection" in (r.error or ""), r.error
        slow.cancel()
    finally:
        await c.close()
        p.close()
