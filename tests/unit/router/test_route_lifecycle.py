"""The router's edges: a salted request in cluster mode, clients that leave
during a P/D prefill or before a stream's relay, a daemon that restarted
under a cache view."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from starlette.requests import ClientDisconnect

from kvstore.keys import Namespace, block_keys
from kvstore.results import Event, EventKind
from router.cache_view import CacheView
from router.config import PDSpec
from router.prompts import Endpoint, request_tokens
from router.server import build_app
from tests.unit.router.test_route_unit import BS, Rig, model_dir, ns_fn, prompt  # noqa: F401  (fixture)
from tiers.base import TierKind


@pytest.fixture
def rig(model_dir: str) -> Iterator[Rig]:  # noqa: F811
    r = Rig(model_dir)
    yield r
    r.close()


class PeerView(CacheView):
    """A cache view whose cluster lookup answers as a daemon's directory
    does: a peer holds blocks per (namespace digest, key); it credits the
    leading run of ``keys`` held under ``ns``."""

    def __init__(self, name: str) -> None:
        super().__init__(name, "127.0.0.1:1")
        self.peer: set[tuple[bytes, bytes]] = set()
        self.asked: list[Namespace] = []

    def cluster_tiers(self, ns: Namespace, keys: Sequence[bytes], local: np.ndarray) -> np.ndarray:
        self.asked.append(ns)
        run = len(local)
        while run < len(keys) and (ns.digest, keys[run]) in self.peer:
            run += 1
        return np.concatenate([local, np.full(run - len(local), int(TierKind.REMOTE), dtype=np.int64)])


# ---------------------------------------------------------------- 1. cache_salt in cluster mode
def test_a_salted_request_is_scored_against_its_own_namespace_on_peers(rig: Rig) -> None:
    a = rig.backend("a")
    a.spec = dataclasses.replace(a.spec, cluster=True)
    view = PeerView("a")
    a.cache = view
    m = rig.svc.models["tiny"]
    text = prompt(41)
    plain = request_tokens(m, Endpoint.COMPLETIONS, {"prompt": text})
    salted = request_tokens(m, Endpoint.COMPLETIONS, {"prompt": text, "cache_salt": "u1"})
    salted_ns = Namespace(**{**m.namespace.to_dict(), "salt": "u1"})  # type: ignore[arg-type]
    # a peer holds the unsalted blocks only: a salted request is not credited with them
    view.peer = {(m.namespace.digest, k) for k in plain.keys}
    r = rig.post({"model": "tiny", "prompt": text, "cache_salt": "u1", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvstore-hit-tokens"] == "0"
    assert view.asked[-1].salt == "u1"
    # a peer holds the salted blocks: the salted request is credited with them on a
    view.peer = {(salted_ns.digest, k) for k in salted.keys}
    r = rig.post({"model": "tiny", "prompt": text, "cache_salt": "u1", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvstore-backend"] == "a"
    assert r.headers["x-kvstore-hit-tokens"] == str(len(salted.keys) * BS)
    # and an unsalted request is not credited with the salted blocks
    r = rig.post({"model": "tiny", "prompt": text, "max_tokens": 2})
    assert r.headers["x-kvstore-hit-tokens"] == "0" and view.asked[-1].salt == ""


# ---------------------------------------------------------------- 2. clients that leave early
@pytest.fixture
def pd_rig(model_dir: str) -> Iterator[Rig]:  # noqa: F811
    # a prefill that outlives its client is never ended by a timeout here
    r = Rig(model_dir, pd=PDSpec(prefill=("a",), decode=("b",), visible_timeout=0.5), first_byte_timeout=600.0)
    yield r
    r.close()


def _raw_request(body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer ka\r\n"
            f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n").encode() + data


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_during_the_prefill_cancels_it_and_no_decode_runs(pd_rig: Rig, stream: bool) -> None:
    fa, fb = pd_rig.fakes["a"], pd_rig.fakes["b"]
    fa.gate = asyncio.Event()  # the prefill does not finish until the client has gone
    with socket.create_connection(("127.0.0.1", pd_rig.router.port)) as s:
        s.sendall(_raw_request({"model": "tiny", "prompt": prompt(40), "max_tokens": 5, "stream": stream}))
        pd_rig.wait(lambda: len(fa.requests) == 1, "the prefill to reach a")
        assert pd_rig.backend("a").inflight
    # the client went away: the router cancels the prefill and releases its count
    pd_rig.wait(lambda: fa.cancelled == 1 and not pd_rig.backend("a").inflight, "the prefill to be cancelled")
    fa.open_gate()
    assert not fb.requests and not pd_rig.backend("b").inflight
    assert pd_rig.svc.pd.outcomes == []  # no decode was planned for nobody
    # and the router still serves
    fa.gate = None
    r = pd_rig.post({"model": "tiny", "prompt": prompt(40), "max_tokens": 5})
    assert r.status_code == 200 and r.headers["x-kvstore-prefill"] == "a"


def _scope(path: str, body: bytes) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
            "headers": [(b"host", b"x"), (b"authorization", b"Bearer ka"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())]}


async def test_a_stream_whose_client_left_before_the_relay_closes_upstream_and_ends_in_flight(rig: Rig) -> None:
    """The first upstream byte has come, the client is gone before the relay's
    first step (an ASGI 2.4 server's ``send`` raises OSError then): the
    upstream stream is closed and the in-flight entry ends."""
    fa = rig.fakes["a"]
    fa.gate_after_first = asyncio.Event()  # the backend keeps its stream open after the first event
    app = build_app(rig.cfg, namespace_fn=ns_fn, follow_events=False)
    svc = app.state.router
    body = json.dumps({"model": "tiny", "prompt": prompt(40), "stream": True}).encode()
    calls = 0
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()  # the router's watch while it waits for the first byte
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        raise OSError("the client has gone")

    async with app.router.lifespan_context(app):
        svc.pool.by_name("b").healthy = False
        with pytest.raises(ClientDisconnect):
            await asyncio.wait_for(app(_scope("/v1/completions", body), receive, send), 30)
        assert fa.requests and not svc.pool.by_name("a").inflight
        for _ in range(3000):  # bounded: fails only on a hang
            if fa.cancelled:
                break
            await asyncio.sleep(0.01)
        assert fa.cancelled == 1
    fa.open_gate()


# ---------------------------------------------------------------- 3. a daemon that restarted
def test_a_cache_view_forgets_a_restarted_daemon_even_without_a_gap() -> None:
    """The new daemon run numbers its events from 1 again; once it has logged
    more events than the view had seen, a resumed stream brings no Gap. The
    run id on its events says it is another run: what the old one held is gone."""
    old, new = [bytes([i]) * 16 for i in range(1, 4)], [bytes([i]) * 16 for i in range(7, 9)]
    view = CacheView("a", "127.0.0.1:1")
    view.apply(Event(EventKind.STORED, b"d" * 16, old, TierKind.DRAM, seq=3, run_id=11))
    assert view.chain_tiers(old).size == 3 and view.run_id == 11
    view.apply(Event(EventKind.STORED, b"d" * 16, new, TierKind.DRAM, seq=4, run_id=12))
    assert view.chain_tiers(old).size == 0 and view.chain_tiers(new).size == 2
    assert view.run_id == 12 and view.gaps == 1
    # a daemon from before run ids (0) changes nothing
    view.apply(Event(EventKind.STORED, b"d" * 16, old, TierKind.DRAM, seq=5))
    assert view.chain_tiers(new).size == 2 and view.run_id == 12


def test_the_prefix_router_forgets_a_restarted_daemon_even_without_a_gap() -> None:
    from engine_adapter.router import PrefixRouter

    ns = Namespace(tenant="t", model_id="m", block_size=BS)
    toks = np.arange(3, 3 + 4 * BS)
    keys = block_keys(ns, toks)
    r = PrefixRouter()
    r.apply("e", Event(EventKind.STORED, ns.digest, keys, TierKind.DRAM, seq=9, run_id=5))
    assert [h.blocks for h in r.rank(ns, toks)] == [4]
    r.apply("e", Event(EventKind.STORED, ns.digest, keys[:1], TierKind.DRAM, seq=10, run_id=6))
    assert [h.blocks for h in r.rank(ns, toks)] == [1] and r.known_blocks("e") == 1 and r.gaps["e"] == 1

