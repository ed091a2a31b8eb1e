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
