"""P/D mode of the router (router/pd.py) against fake vLLM servers: the
prefill request (non-streaming, one token), then the client's request on a
decode backend; a failed prefill still answers; the ``[pd]`` config."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvstore.errors import InvalidArgument
from router.config import BackendSpec, PDSpec, RouterConfig, load_router_config
from router.pd import prefill_body
from router.prompts import Endpoint
from tests.unit.router.test_route_unit import Rig, model_dir, prompt  # noqa: F401  (fixture)


@pytest.fixture
def pd_rig(model_dir: str) -> Iterator[Rig]:  # noqa: F811
    r = Rig(model_dir, pd=PDSpec(prefill=("a",), decode=("b",), visible_timeout=0.5))
    yield r
    r.close()


def test_prefill_then_decode(pd_rig: Rig) -> None:
    body = {"model": "tiny", "prompt": prompt(40), "max_tokens": 7, "min_tokens": 3, "temperature": 0}
    r = pd_rig.post(body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "b-answer"
    h = r.headers
    assert (h["x-kvstore-backend"], h["x-kvstore-prefill"], h["x-kvstore-pd-decision"]) == ("b", "a", "unseen")
    (pre,) = pd_rig.fakes["a"].requests
    assert pre["max_tokens"] == 1 and pre["stream"] is False and pre["n"] == 1 and "min_tokens" not in pre
    assert pre["prompt"] == body["prompt"]
    assert pd_rig.fakes["b"].requests == [body]
    assert pd_rig.backend("a").inflight == {} and pd_rig.backend("b").inflight == {}


def test_streamed_decode_and_chat_prefill(pd_rig: Rig) -> None:
    body = {"model": "tiny", "prompt": prompt(20), "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    with pd_rig.http.stream("POST", "/v1/completions", json=body, headers={"authorization": "Bearer ka"}) as s:
        assert s.status_code == 200 and s.headers["x-kvstore-prefill"] == "a"
        text = b"".join(s.iter_raw())
    assert b"b-answer" in text and text.endswith(b"data: [DONE]\n\n")
    assert "stream_options" not in pd_rig.fakes["a"].requests[0]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": prompt(10)}], "max_completion_tokens": 9}
    r = pd_rig.post(chat, path="/v1/chat/completions")
    assert r.status_code == 200, r.text
    pre = pd_rig.fakes["a"].requests[-1]
    assert pre["max_tokens"] == 1 and pre["max_completion_tokens"] == 1
    assert pd_rig.fakes["b"].requests[-1] == chat


def test_failed_prefill_still_answers_from_the_decode_backend(pd_rig: Rig) -> None:
    pd_rig.fakes["a"].fail_status = 500
    r = pd_rig.post({"model": "tiny", "prompt": prompt(30), "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "b-answer"
    assert r.headers["x-kvstore-prefill"] == "-"
    # the prefill backend left the pool: the next request goes straight to decode
    pd_rig.fakes["a"].requests.clear()
    r = pd_rig.post({"model": "tiny", "prompt": prompt(30), "max_tokens": 3})
    assert r.status_code == 200 and r.headers["x-kvstore-prefill"] == "-"


def test_no_prefill_backend_does_not_lift_admission_or_quotas(pd_rig: Rig) -> None:
    """With the prefill pool down, the decode backend computes the prompt; the
    tenant's rate limit and its class's SLO still apply (not the first class's)."""
    pd_rig.fakes["a"].healthy = False
    pd_rig.wait(lambda: not pd_rig.backend("a").healthy, "a to leave the pool")
    body = {"model": "tiny", "prompt": prompt(30), "max_tokens": 3}
    r = pd_rig.post(body, key="kq")  # tenant tq: one request, then 0.001/s
    assert r.status_code == 200 and r.headers["x-kvstore-prefill"] == "-"
    r = pd_rig.post(body, key="kq")
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
    r = pd_rig.post(body, key="kt")  # class tight: 0.1 ms target
    assert r.status_code == 429 and r.json()["error"]["code"] == "slo"
    assert len(pd_rig.fakes["b"].requests) == 1 and not pd_rig.fakes["a"].requests


def test_prefill_body_keeps_the_request_but_one_token() -> None:
    body = {"model": "m", "prompt": "x", "max_tokens": 50, "stream": True, "n": 2, "cache_salt": "s",
            "stream_options": {"include_usage": True}}
    out = prefill_body(body, Endpoint.COMPLETIONS)
    assert out == {"model": "m", "prompt": "x", "max_tokens": 1, "stream": False, "n": 1, "cache_salt": "s"}
    assert body["max_tokens"] == 50  # the client's body is not changed


def test_pd_config(tmp_path: Any) -> None:
    path = tmp_path / "r.toml"
    path.write_text('[[backend]]\nname = "p"\nurl = "http://127.0.0.1:1"\n'
                    '[[backend]]\nname = "d"\nurl = "http://127.0.0.1:2"\n'
                    '[pd]\nprefill = ["p"]\ndecode = "d"\nvisible_timeout = 0.25\n')
    cfg = load_router_config(str(path))
    assert cfg.pd == PDSpec(prefill=("p",), decode=("d",), visible_timeout=0.25)
    with pytest.raises(InvalidArgument, match="unknown backend names"):
        RouterConfig(backends=(BackendSpec("p", "http://127.0.0.1:1"),), pd=PDSpec(prefill=("p",), decode=("x",)))
    with pytest.raises(InvalidArgument, match="pd.decode"):
        PDSpec(prefill=("p",), decode=())
    with pytest.raises(InvalidArgument, match="pd.visible_timeout"):
        PDSpec(prefill=("p",), decode=("d",), visible_timeout=-1)
