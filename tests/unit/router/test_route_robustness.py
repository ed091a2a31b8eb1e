"""The router under hostile input and misbehaving backends: every bad body is a
clear 4xx (never a 500), in-flight counts and upstream connections are released
on every path, and a backend's malformed ``/metrics`` cannot break routing."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import numpy as np
import pytest

from router.config import BackendSpec, RouterConfig
from tests.unit.router.test_route_unit import BS, Rig, model_dir, prompt  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def mrig(model_dir: str) -> Any:  # noqa: F811
    r = Rig(model_dir)
    yield r
    r.close()


def _post_raw(rig: Rig, raw: bytes, path: str = "/v1/completions") -> httpx.Response:
    # a fresh connection per request: a 500 would otherwise also break the next one
    return httpx.post(rig.router.url + path, content=raw, timeout=30,
                      headers={"authorization": "Bearer ka", "content-type": "application/json"})


CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "w3 w4"}]


@pytest.mark.parametrize("path,body,status", [
    (CHAT, {"model": "tiny", "messages": MSGS, "chat_template_kwargs": "x"}, 400),
    (CHAT, {"model": "tiny", "messages": MSGS, "chat_template_kwargs": [1]}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": [2 ** 70]}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": [[3, 2 ** 64]]}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w3 \ud800 w4"}, 400),
])
def test_bad_fields_are_400_not_500(mrig: Rig, path: str, body: dict[str, Any], status: int) -> None:
    r = _post_raw(mrig, json.dumps(body).encode(), path)
    assert r.status_code == status, r.text
    assert r.json()["error"]["type"] == "BadRequestError"


def test_a_chat_template_sent_by_the_client_is_refused_not_run(mrig: Rig) -> None:
    """A Jinja template from the request would run on the router's event loop
    (two nested ``range(100000)`` loops stop every request for hours); vLLM
    refuses request templates unless started with --trust-request-chat-template."""
    sent = len(mrig.fakes["a"].requests) + len(mrig.fakes["b"].requests)
    body = {"model": "tiny", "messages": MSGS, "chat_template_kwargs": {"chat_template": "{{ 'w5 w6' }}"}}
    r = _post_raw(mrig, json.dumps(body).encode(), CHAT)
    assert r.status_code == 400, r.text
    assert "chat_template" in r.json()["error"]["message"]
    assert len(mrig.fakes["a"].requests) + len(mrig.fakes["b"].requests) == sent


def test_deeply_nested_json_is_400(mrig: Rig) -> None:
    r = _post_raw(mrig, b"[" * 20_000 + b"]" * 20_000)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_oversized_body_is_413_before_it_is_read_whole(model_dir: str) -> None:  # noqa: F811
    mrig = Rig(model_dir, max_body_bytes=64 << 10)
    try:
        _oversized(mrig)
    finally:
        mrig.close()


def _oversized(mrig: Rig) -> None:
    big = json.dumps({"model": "tiny", "prompt": "w3 " * (40 << 10)}).encode()
    r = _post_raw(mrig, big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunks() -> Any:  # no content-length: refused while it streams in
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]

    r = httpx.post(mrig.router.url + "/v1/completions", content=chunks(), timeout=30,
                   headers={"authorization": "Bearer ka", "content-type": "application/json"})
    assert r.status_code == 413
    assert not mrig.fakes["a"].requests and not mrig.fakes["b"].requests
    assert mrig.post({"model": "tiny", "prompt": prompt(10)}).status_code == 200


# ---------------------------------------------------------------- a backend's malformed /metrics
@pytest.mark.parametrize("text", [
    'vllm:num_requests_waiting{model_name="m"}\n',  # a sample without a value
    'vllm:num_requests_waiting{model_name="m"} NaN\nvllm:num_requests_running{model_name="m"} 1\n',
    'vllm:num_requests_running +Inf\n',
    'vllm:num_requests_waiting{model_name="m"} -3\n',
])
def test_malformed_engine_metrics_neither_crash_the_check_nor_poison_routing(text: str) -> None:
    from router.backends import Pool
    from router.decision import Decider, Plan

    cfg = RouterConfig(backends=(BackendSpec("a", "http://a.invalid"),), admission=True)

    def answer(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=text if req.url.path == "/metrics" else "ok")

    async def main() -> None:
        http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        pool = Pool(cfg, http, follow_events=False)
        b = pool.backends[0]
        await pool.check(b)  # at start-up this runs un-guarded: an exception stops the router
        assert b.healthy
        plan = Decider(cfg).decide("t", "default", [b], [np.zeros(0, np.int64)], 100, BS, 1024)
        assert isinstance(plan, Plan) and np.isfinite(plan.candidates[0].predicted_s)
        await http.aclose()

    asyncio.run(main())


# ---------------------------------------------------------------- the router's own connection limit
def test_router_connection_pool_exhausted_is_503_and_blames_no_backend(model_dir: str) -> None:  # noqa: F811
    """Every upstream connection is held by a slow request: a new request waits
    for the router's own pool and times out there. No backend failed: none
    may leave the pool (else a burst of long streams empties it), and the
    client gets a 503, not a 502."""
    import threading

    rig = Rig(model_dir, health_interval=5.0)  # checks with a 5 s timeout: none fails on a busy machine
    try:
        fa, fb = rig.fakes["a"], rig.fakes["b"]
        fa.gate, fb.gate = asyncio.Event(), asyncio.Event()
        svc = rig.svc
        loop = _router_loop(rig)
        old = svc.http

        async def swap() -> None:  # on the router's loop, where its client lives
            svc.http = httpx.AsyncClient(limits=httpx.Limits(max_connections=1),
                                         timeout=httpx.Timeout(30.0, pool=0.2))

        asyncio.run_coroutine_threadsafe(swap(), loop).result(10)
        first: list[httpx.Response] = []
        slow = threading.Thread(target=lambda: first.append(rig.post({"model": "tiny", "prompt": prompt(20)})))
        slow.start()
        rig.wait(lambda: len(fa.requests) + len(fb.requests) == 1, "the first request to reach a backend")
        r = rig.post({"model": "tiny", "prompt": prompt(20)})
        assert r.status_code == 503, r.text
        assert rig.backend("a").healthy and rig.backend("b").healthy
        assert len(fa.requests) + len(fb.requests) == 1
        fa.open_gate()
        fb.open_gate()
        slow.join(30)
        assert first[0].status_code == 200
        assert not rig.backend("a").inflight and not rig.backend("b").inflight
        asyncio.run_coroutine_threadsafe(old.aclose(), loop).result(10)
    finally:
        rig.close()


def _router_loop(rig: Rig) -> Any:
    """The event loop of the router's uvicorn thread."""
    got: list[Any] = []

    @rig.app.get("/_loop")
    async def loop_of() -> dict[str, int]:
        got.append(asyncio.get_running_loop())
        return {}

    rig.http.get("/_loop")
    return got[0]


# ---------------------------------------------------------------- a daemon's garbage cluster answer
@pytest.mark.parametrize("local,remote", [(0, 2 ** 64 - 1), (1, 1000), (500, 0)])
def test_a_cluster_lookup_claiming_more_blocks_than_asked_is_bounded(monkeypatch: Any, local: int,
                                                                      remote: int) -> None:
    """A daemon's cluster Lookup answering more blocks than the request has
    keys (a uint64 from the wire) made the router allocate that many tier
    entries (2^64: a crash of the request) or credit blocks past the prompt
    (the admission controller then refused the request's own token count: a
    500). The peer's run counts at most up to the prompt's last key."""
    from kvstore.results import ChainDecisionKind, ClusterLookup
    from router import cache_view
    from router.backends import Pool
    from router.decision import Decider, Plan

    class Garbage:
        def __init__(self, *a: Any, **k: Any) -> None:
            pass

        def cluster_lookup(self, ns: Any, keys: Any) -> ClusterLookup:
            return ClusterLookup(local, remote, ChainDecisionKind.FETCH, 0.001, 0.1, [], "ok")

        def close(self) -> None:
            pass

    monkeypatch.setattr(cache_view, "Client", Garbage)
    view = cache_view.CacheView("a", "127.0.0.1:1")
    keys = [bytes([i]) * 16 for i in range(3)]
    tiers = view.cluster_tiers(None, keys, np.zeros(0, np.int64))  # type: ignore[arg-type]
    assert len(tiers) <= len(keys)
    cfg = RouterConfig(backends=(BackendSpec("a", "http://a.invalid"),))
    b = Pool(cfg, None, follow_events=False).backends[0]  # type: ignore[arg-type]
    plan = Decider(cfg).decide("t", "default", [b], [tiers], 3 * BS + 1, BS, 1024)
    assert isinstance(plan, Plan)


# ---------------------------------------------------------------- a backend that keeps sending
PAD = 32 << 20
"""Padding a misbehaving backend sends: more than loopback's socket buffers hold, so a cut shows at the sender."""


def _oversized_count(rig: Rig, backend: str) -> float:
    text = rig.http.get("/metrics").text
    line = f'kvstore_route_oversized_responses_total{{backend="{backend}"}} '
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(line))


def test_a_non_streamed_answer_over_max_response_bytes_is_cut_with_502(model_dir: str) -> None:  # noqa: F811
    """A non-streamed answer was buffered whole: a backend that keeps sending
    held router memory until ``read_timeout``. Past ``max_response_bytes``
    the router stops reading, closes the upstream response, releases the
    backend's in-flight entry, counts it and answers 502 naming the limit."""
    rig = Rig(model_dir, max_response_bytes=256 << 10)
    try:
        for f in rig.fakes.values():
            f.body_bytes = PAD
        r = rig.post({"model": "tiny", "prompt": prompt(20), "max_tokens": 3})
        assert r.status_code == 502, r.status_code
        err = r.json()["error"]
        assert err["code"] == "response_too_large" and "max_response_bytes" in err["message"]
        assert str(256 << 10) in err["message"]
        name = r.headers.get("x-kvstore-backend") or next(n for n, f in rig.fakes.items() if f.requests)
        fake = rig.fakes[name]
        assert len(fake.requests) == 1  # not retried on the other backend
        rig.wait(lambda: len(fake.body_sent) == 1, "the backend's answer to end")
        assert fake.body_sent[0] < PAD  # the router closed the upstream response
        assert not rig.backend("a").inflight and not rig.backend("b").inflight
        assert _oversized_count(rig, name) == 1
        assert rig.backend(name).healthy  # a long answer is no outage
        for f in rig.fakes.values():
            f.body_bytes = 0
        ok = rig.post({"model": "tiny", "prompt": prompt(20), "max_tokens": 3})
        assert ok.status_code == 200, ok.text
    finally:
        rig.close()


def test_a_streamed_answer_is_relayed_past_max_response_bytes(model_dir: str) -> None:  # noqa: F811
    """Streams are relayed chunk by chunk (nothing buffered): the limit does not apply."""
    rig = Rig(model_dir, max_response_bytes=64 << 10)
    try:
        for f in rig.fakes.values():
            f.body_bytes = 1 << 20
        body = {"model": "tiny", "prompt": prompt(20), "max_tokens": 3, "stream": True}
        with rig.http.stream("POST", "/v1/completions", json=body, headers={"authorization": "Bearer ka"}) as s:
            assert s.status_code == 200
            text = b"".join(s.iter_raw())
        assert len(text) > 1 << 20 and text.endswith(b"data: [DONE]\n\n")
        assert not rig.backend("a").inflight and not rig.backend("b").inflight
    finally:
        rig.close()


def test_an_oversized_prefill_answer_is_cut_and_the_decode_still_answers(model_dir: str) -> None:  # noqa: F811
    """P/D's prefill answer (a one-token completion the router does not use)
    was read whole with ``http.post``: a prefill backend that keeps sending
    held router memory. It is read up to ``min(max_response_bytes, 1 MiB)``,
    then closed and counted; its 200 came after the prompt was computed, so
    the decode goes on as after any prefill."""
    from router.config import PDSpec

    rig = Rig(model_dir, max_response_bytes=256 << 10, pd=PDSpec(prefill=("a",), decode=("b",),
                                                                 visible_timeout=0.0))
    try:
        rig.fakes["a"].body_bytes = PAD
        r = rig.post({"model": "tiny", "prompt": prompt(20), "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "b-answer" and r.headers["x-kvstore-prefill"] == "a"
        rig.wait(lambda: len(rig.fakes["a"].body_sent) == 1, "the prefill answer to end")
        assert rig.fakes["a"].body_sent[0] < PAD
        assert not rig.backend("a").inflight and not rig.backend("b").inflight
        assert _oversized_count(rig, "a") == 1 and rig.backend("a").healthy
    finally:
        rig.close()
