"""The block server against raw requests over real ucxx (a peer process,
``transport.ucx_peer``): what it does with requests no BlockClient sends
(a message shorter than it claims, more requests at once than it allows)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

pytest.importorskip("ucxx")

from transport import ucx_wire as wire  # noqa: E402
from tests.support.ucx_peer import KIB, PeerProc, poll  # noqa: E402
from transport.ucx import shutdown, ucx_module  # noqa: E402


@pytest.fixture
async def ucx():
    """UCX set up on this test's loop, shut down after it."""
    yield ucx_module("127.0.0.1", None)
    shutdown()


def request(seq: int, header: bytes, count: int, *, claim: int | None = None, cut: int = 0) -> bytearray:
    """An unsized request as a BlockClient writes it; ``claim``: the header
    length the preamble states, ``cut``: bytes left off the end."""
    msg = wire.request(wire.MAGIC, seq, count, header, 5.0)
    if claim is not None:
        wire.PRE.pack_into(msg, 0, wire.MAGIC, 0, seq, count, claim, 5.0)
    return msg[:len(msg) - cut] if cut else msg


async def connect(peer: PeerProc):
    host, port = peer.address.rsplit(":", 1)
    ep = await ucx_module(host).create_endpoint(host, int(port))
    await poll(lambda: peer.stats()["endpoints"] == 1)
    return ep


async def test_a_request_shorter_than_it_claims_is_refused_never_parsed_with_stale_bytes(peer, ucx):
    """The server receives every request of a connection into one buffer:
    a message shorter than the one before it used to be parsed together with
    the earlier message's bytes left there (here: the whole header of the
    first request, served a second time from a request that sent none)."""
    ep = await connect(peer)
    h = json.dumps({"n": 1, "size": KIB, "absent": [0]}).encode()  # nothing present: no GO round trip
    await ep.send(request(1, h, 1), tag=wire.TAG_REQ)
    head = np.zeros(wire.HEAD.size + 16, np.uint8)
    await asyncio.wait_for(ep.recv(head, tag=wire.tag_tab(1)), 30)
    assert wire.HEAD.unpack_from(head.data, 0)[1] == wire.ST_OK
    assert peer.stats()["served"] == 1
    # the same claim, none of the header sent; then a header cut short by one byte
    for seq, msg in ((2, request(2, b"", 1, claim=len(h))), (3, request(3, h, 1, cut=1))):
        if seq == 3:
            ep.abort()
            ep = await connect(peer)
            await ep.send(request(1, h, 1), tag=wire.TAG_REQ)
            await asyncio.wait_for(ep.recv(head, tag=wire.tag_tab(1)), 30)
        await ep.send(msg, tag=wire.TAG_REQ)
        await poll(lambda: peer.stats()["endpoints"] == 0)  # refused: the server closed the endpoint
        st = peer.stats()
        assert st["served"] == seq - 1 and st["requests"] == seq - 1, st
    ep.abort()


async def test_requests_over_the_per_connection_limit_are_refused_head_only(ucx):
    """A connection may have at most ``max_requests`` requests in the
    server at once (each bounded in time, but a peer could otherwise keep
    any number of provider calls and pins going): the next one gets the
    head-only refused answer, at once, with nothing provided for it, and
    once one ends the connection is served again."""
    from transport.ucx import BlockClient

    p = PeerProc(max_requests=2)
    c = BlockClient()
    try:
        slow = [asyncio.ensure_future(c.fetch(p.address, json.dumps({"n": 1, "size": KIB, "delay": 60}).encode(),
                                              1, lambda ls: [None], 120.0)) for _ in range(2)]
        await poll(lambda: p.stats()["asked"] == 2)  # both in the server, in their provider calls
        plain = json.dumps({"n": 1, "size": KIB}).encode()
        for sizes in (None, np.array([KIB], np.int64)):
            buf = np.zeros(KIB, np.uint8)
            r = await asyncio.wait_for(c.fetch(p.address, plain, 1, lambda ls: [memoryview(buf)], 60.0,
                                               sizes=sizes), 60)
            assert r.error is not None and "refused" in r.error and "2 requests" in r.error, r.error
            assert not r.ok.any() and not buf.any()
        st = p.stats()
        assert st["asked"] == 2 and st["served"] == 0 and c.connects == 1, st  # nothing provided; endpoint kept
    finally:
        for t in slow:
            t.cancel()
        await c.close()
        p.close()


@pytest.mark.parametrize("sized", [False, True])
async def test_a_short_ok_table_is_a_miss_never_lengths_from_uninitialised_memory(ucx, sized):
    """A peer answers OK with the head alone (a malformed table: no lengths,
    no checksums). The fetcher's table buffer was uninitialised memory, read
    as the peer's lengths and handed to ``alloc`` (a first reservation fixes
    a namespace's block size). Now the blocks are absent: a miss."""
    from transport.ucx import BlockClient

    async def handle(ep) -> None:
        inbox = np.zeros(wire.INBOX, np.uint8)
        await ep.recv(inbox, tag=wire.TAG_REQ)
        r = wire.parse_request(inbox)
        await ep.send(wire.table(r.seq, wire.ST_OK, "", None, r.count), tag=wire.tag_tab(r.seq))
        if r.posted is not None:
            await asyncio.gather(*wire.sized_sends(ep, r.seq, r.posted, None))
        await done.wait()  # the endpoint stays open until the test ends

    done = asyncio.Event()

    listener = ucx_module("127.0.0.1").create_listener(handle, port=0)  # (bound to this test's loop)
    c = BlockClient()
    seen: list[list[int]] = []
    buf = np.zeros(KIB, np.uint8)

    def alloc(lengths: np.ndarray) -> list[memoryview | None]:
        seen.append(lengths.tolist())
        return [memoryview(buf)]

    try:
        junk = np.full(wire.HEAD.size + 16, 0x41, np.uint8)  # a freed buffer the table's may reuse
        del junk
        r = await c.fetch(f"127.0.0.1:{listener.port}", b"h", 1, alloc, 30.0,
                          sizes=np.array([KIB], np.int64) if sized else None)
        assert r.error is None and not r.ok.any() and r.corrupt == 0
        assert r.lengths.tolist() == [0] and r.nbytes == 0
        assert seen == ([[KIB]] if sized else [])  # (sized: alloc runs before the request)
    finally:
        done.set()
        await c.close()
        listener.close()


async def test_connections_over_the_bound_are_closed_before_their_buffer_is_allocated(ucx, monkeypatch):
    """Each connection the block server accepts gets a receive buffer of
    over 1 MiB, allocated up front; a peer could open any number. Past
    ``max_connections`` a connection is closed at once, with no buffer, and
    the connections within the bound keep being served."""
    from kvstore.checksum import checksum
    from transport import ucx as ucx_mod

    allocated: list[int] = []
    real_inbox = wire.inbox

    def inbox() -> np.ndarray:
        allocated.append(1)
        return real_inbox()

    monkeypatch.setattr(wire, "inbox", inbox)
    data = np.arange(KIB, dtype=np.uint8)

    async def provide(header: bytes) -> wire.Served:
        return wire.Served(np.array([KIB], np.int64), np.array([checksum(data)], np.uint64),
                           [memoryview(data)], lambda: None)

    srv = ucx_mod.BlockServer(provide, max_connections=2)
    address = await srv.start()
    c = ucx_mod.BlockClient()
    raw = []
    try:
        async def fetch_ok() -> None:
            buf = np.zeros(KIB, np.uint8)
            r = await c.fetch(address, b"h", 1, lambda ls: [memoryview(buf)], 30.0)
            assert r.error is None and r.ok.all() and np.array_equal(buf, data), r.error

        await fetch_ok()  # connection 1
        host, port = address.rsplit(":", 1)
        for _ in range(4):  # connection 2 is let in, 3 to 5 are over the bound
            raw.append(await ucx.create_endpoint(host, int(port)))
        await poll(lambda: srv.refused_connections == 3)
        assert srv.endpoints == 2 and len(allocated) == 2
        await fetch_ok()  # the pooled connection within the bound is still served
        assert c.connects == 1
        for ep in raw:
            ep.abort()
        await poll(lambda: srv.endpoints == 1)
        c2 = ucx_mod.BlockClient()  # a place freed: a new connection is let in
        buf = np.zeros(KIB, np.uint8)
        r = await c2.fetch(address, b"h", 1, lambda ls: [memoryview(buf)], 30.0)
        await c2.close()
        assert r.error is None and r.ok.all() and len(allocated) == 3
    finally:
        for ep in raw:
            ep.abort()
        await c.close()
        await srv.stop()
