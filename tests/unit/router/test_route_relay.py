"""The relay between client and backend: bounds on how long a backend may
hold an answer, how a stream that breaks ends for the client, and what the
backend sees of the client's request."""

from __future__ import annotations

import json
from typing import Any

from tests.unit.router.test_route_unit import Rig, model_dir, prompt  # noqa: F401  (fixture)


def _count(rig: Rig, metric: str, backend: str) -> float:
    text = rig.http.get("/metrics").text
    line = f'{metric}{{backend="{backend}"}} '
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(line))


def _events(raw: bytes) -> list[Any]:
    """The ``data:`` payloads of an SSE body (JSON decoded; ``[DONE]`` as the string)."""
    out: list[Any] = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---------------------------------------------------------------- 1. a backend that trickles its answer
def test_a_trickling_backend_is_cut_at_request_timeout(model_dir: str) -> None:  # noqa: F811
    """Every read of a trickling answer (an event every 50 ms) came under
    ``read_timeout``: the router held the request as long as the backend
    liked. ``request_timeout`` bounds a backend's whole answer: a
    non-streamed one gets 504 ``backend_timeout``, a stream ends with an
    error event (no ``[DONE]``); both are counted, the upstream request is
    closed and the backend stays in the pool (a long answer is no outage).
    The client's own timeout (30 s) only fails the test on a hang."""
    rig = Rig(model_dir, request_timeout=3.0, read_timeout=10.0, first_byte_timeout=10.0)
    try:
        for f in rig.fakes.values():
            f.trickle_s = 0.05
        r = rig.post({"model": "tiny", "prompt": prompt(20), "max_tokens": 3})
        assert r.status_code == 504, r.text
        err = r.json()["error"]
        assert err["code"] == "backend_timeout" and "request_timeout" in err["message"]
        name = r.headers["x-kvstore-backend"]
        assert len(rig.fakes[name].requests) == 1  # not retried
        body = {"model": "tiny", "prompt": prompt(20), "max_tokens": 3, "stream": True}
        with rig.http.stream("POST", "/v1/completions", json=body, headers={"authorization": "Bearer ka"}) as s:
            assert s.status_code == 200
            events = _events(b"".join(s.iter_raw()))
        assert "[DONE]" not in events
        last = events[-1]
        assert last["error"]["code"] == 504 and last["error"]["type"] == "timeout_error", last
        assert events[0]["choices"][0]["text"] == "t"  # what came before the deadline was relayed
        rig.wait(lambda: sum(f.cancelled for f in rig.fakes.values()) == 2, "both upstream answers to be closed")
        total = sum(_count(rig, "kvstore_route_backend_timeouts_total", n) for n in ("a", "b"))
        assert total == 2
        assert not rig.backend("a").inflight and not rig.backend("b").inflight
        assert rig.backend("a").healthy and rig.backend("b").healthy
    finally:
        rig.close()


def test_a_trickling_prefill_is_cut_at_request_timeout_and_the_decode_answers(model_dir: str) -> None:  # noqa: F811
    """P/D's prefill answer was read with only the per-read timeout: a prefill
    backend that trickles held the request before its decode ever started.
    It is cut at ``request_timeout`` and counted; the decode backend computes
    the prompt and answers."""
    from router.config import PDSpec

    rig = Rig(model_dir, request_timeout=1.0, read_timeout=10.0, first_byte_timeout=10.0,
              pd=PDSpec(prefill=("a",), decode=("b",), visible_timeout=0.0))
    try:
        rig.fakes["a"].trickle_s = 0.05
        r = rig.post({"model": "tiny", "prompt": prompt(20), "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "b-answer" and r.headers["x-kvstore-prefill"] == "-"
        assert _count(rig, "kvstore_route_backend_timeouts_total", "a") == 1
        rig.wait(lambda: rig.fakes["a"].cancelled == 1, "the prefill's upstream answer to be closed")
        assert not rig.backend("a").inflight and not rig.backend("b").inflight and rig.backend("a").healthy
    finally:
        rig.close()


# ---------------------------------------------------------------- 3. how a broken stream ends
def test_a_stream_that_ends_without_done_ends_with_an_error_event(model_dir: str) -> None:  # noqa: F811
    """A backend that closed its stream cleanly but early (no ``data: [DONE]``)
    was relayed as it came: a 200 whose truncated body an OpenAI client
    takes as complete. The router now ends such a stream with an error
    event in the OpenAI shape and counts it; a whole stream is untouched."""
    rig = Rig(model_dir)
    try:
        for f in rig.fakes.values():
            f.no_done = True
        body = {"model": "tiny", "prompt": prompt(20), "max_tokens": 3, "stream": True}
        with rig.http.stream("POST", "/v1/completions", json=body, headers={"authorization": "Bearer ka"}) as s:
            assert s.status_code == 200
            name = s.headers["x-kvstore-backend"]
            events = _events(b"".join(s.iter_raw()))
        assert events[0]["choices"][0]["text"] == f"{name}-answer"
        assert events[-1]["error"]["type"] == "backend_error" and "[DONE]" in events[-1]["error"]["message"]
        assert _count(rig, "kvstore_route_stream_errors_total", name) == 1
        for f in rig.fakes.values():
            f.no_done = False
        with rig.http.stream("POST", "/v1/completions", json=body, headers={"authorization": "Bearer ka"}) as s:
            events = _events(b"".join(s.iter_raw()))
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
        assert not rig.backend("a").inflight and not rig.backend("b").inflight
    finally:
        rig.close()


# ---------------------------------------------------------------- 2. a poll that straddles the end of a burst
def test_a_poll_answered_after_a_burst_ended_does_not_count_the_burst_as_foreign_load() -> None:
    """vLLM measured its running requests before the router's burst on ``a``
    ended, and its answer arrived after: the router subtracted only what it
    had in flight when the answer came (none), so the whole burst counted
    as load from elsewhere until the next poll, and a request whose prefix
    ``a`` holds went to idle ``b``. The router's own count now covers every
    request it had there while the poll was out."""
    import asyncio

    import httpx
    import numpy as np

    from router.backends import Pool
    from router.config import BackendSpec, PredictorSpec, RouterConfig
    from router.decision import Decider, Plan
    from tests.unit.router.test_route_unit import BS

    cfg = RouterConfig(backends=(BackendSpec("a", "http://a.invalid"), BackendSpec("b", "http://b.invalid")),
                       predictor=PredictorSpec(prefill_tokens_per_s=1e4, prefill_overhead_s=0.001,
                                               decode_penalty_s=0.05), admission=False)
    burst: list[int] = []

    async def main() -> None:
        during: dict[str, Any] = {}

        async def answer(req: httpx.Request) -> httpx.Response:
            if req.url.path == "/metrics":
                running = 5 if req.url.host == "a.invalid" and during.get("burst") else 0
                if req.url.host == "a.invalid" and during.get("end"):  # measured, then the burst ends, then the answer
                    during.pop("end")()
                return httpx.Response(200, text=f"vllm:num_requests_running {running}\n")
            return httpx.Response(200, text="ok")

        http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        pool = Pool(cfg, http, follow_events=False)
        a, b = pool.backends
        now = 0.0
        for _ in range(5):  # a's burst: five streams decoding
            rid = pool.next_id()
            a.begin(rid, 40, 0.004, now)
            a.inflight[rid].first_byte = 1.0
            burst.append(rid)
        during["burst"] = True
        await pool.check(a)  # vLLM counts the burst, the router has it in flight: nothing foreign
        assert a.engine.foreign() == (0.0, 0.0)
        during["end"] = lambda: [a.end(r) for r in burst]
        await pool.check(a)
        assert not a.inflight
        assert a.engine.foreign() == (0.0, 0.0)
        assert a.running_now() == 0.0
        tiers = [np.full(5, 1, np.int64), np.zeros(0, np.int64)]  # a holds the prompt's 5 blocks in DRAM
        plan = Decider(cfg).decide("t", "default", [a, b], tiers, 5 * BS + 4, BS, 1024)
        assert isinstance(plan, Plan) and plan.candidates[0].backend is a
        await http.aclose()

    asyncio.run(main())


# ---------------------------------------------------------------- 3. what a backend sees of the client
def test_backends_see_the_routers_credential_never_the_clients(model_dir: str) -> None:  # noqa: F811
    """A vLLM started with ``--api-key`` could not be put behind the router:
    it had no credential of its own to send. ``[[backend]] api_key`` is sent
    as ``Authorization: Bearer`` on everything the router asks that backend;
    the client's key never reaches a backend, nor do hop-by-hop headers."""
    from router.config import BackendSpec

    rig = Rig(model_dir)
    try:
        rig.svc.pool.by_name("a").spec = BackendSpec("a", rig.servers["a"].url, api_key="sk-backend-a")
        for name in ("a", "b"):
            rig.fakes[name].healthy = name == "a"  # every request goes to a
        rig.wait(lambda: not rig.backend("b").healthy, "b to leave the pool")
        r = rig.http.post("/v1/completions", json={"model": "tiny", "prompt": prompt(20), "max_tokens": 3},
                          headers={"authorization": "Bearer ka", "connection": "keep-alive", "keep-alive": "timeout=5"})
        assert r.status_code == 200 and r.headers["x-kvstore-backend"] == "a"
        seen = rig.fakes["a"].headers[-1]
        assert seen["authorization"] == "Bearer sk-backend-a"
        assert "Bearer ka" not in seen.values() and "keep-alive" not in seen
        assert "sk-backend-a" not in repr(rig.cfg) + repr(rig.backend("a").spec)
    finally:
        rig.close()
