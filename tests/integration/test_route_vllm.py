"""``kvstore route`` in front of real processes: two vLLM CPU OpenAI servers
(the tiny Llama of tests/vllm, the kvstore connector), each with its own
daemon, and the router (in-process uvicorn). Started once for the module;
few requests (vLLM on two shared cores is slow).

- the router's block keys are the connector's: after a request through the
  router, the chosen daemon holds exactly the keys the router computed, and
  the connector's namespace equals the router's;
- a repeated long prefix goes to the backend that holds it;
- when that backend is loaded past break-even (requests decoding there, seen
  through vLLM's /metrics), the request goes elsewhere;
- a request predicted to miss its SLO gets a 429 and no backend sees it;
- streaming and non-streaming answers equal the backend's direct answers;
- bad input gets clear 4xx and the router keeps serving;
- one backend killed mid-run: requests not yet started still succeed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvstore.client import Client
from kvstore.keys import Namespace, block_keys
from router.config import (
    ApiKey,
    BackendSpec,
    ModelSpec,
    PredictorSpec,
    RouterConfig,
    ServiceClass,
)
from router.prompts import Endpoint, keys_at, request_tokens
from router.server import build_app
from tests.integration.conftest import DaemonThread, wait_healthy, wait_until
from tests.support.procs import group_alive, kill_group, stop_group
from tests.support.vllm_servers import kv_transfer_config, make_tiny_model, start_server, wait_servers
from tests.unit.router.fakes import CHAT_TEMPLATE, ServerThread
from tests.vllm.conftest import require_vllm

pytestmark = pytest.mark.timeout(1800)

BLOCK = 128
rng = random.Random(15)
P = " ".join(f"w{rng.randrange(3, 1000)}" for _ in range(700))  # 5 loadable blocks
R = " ".join(f"w{rng.randrange(3, 1000)}" for _ in range(200))
AUTH = {"authorization": "Bearer k-gold"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Fleet:
    def __init__(self, work: str) -> None:
        self.work = work
        self.model = make_tiny_model(os.path.join(work, "tiny"))
        cfg_path = os.path.join(self.model, "tokenizer_config.json")
        with open(cfg_path) as f:
            tc = json.load(f)
        tc["chat_template"] = CHAT_TEMPLATE  # the tiny tokenizer has none; vLLM and the router read this one
        with open(cfg_path, "w") as f:
            json.dump(tc, f)
        self.daemons = {n: DaemonThread({"dram.capacity": "64MiB"}) for n in ("a", "b")}
        for d in self.daemons.values():
            wait_healthy(d.target)
        self.ports = {n: _free_port() for n in self.daemons}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for n, d in self.daemons.items():
            ktc = kv_transfer_config(target=d.target, stats_path=f"{work}/{n}.jsonl")
            self.procs[n] = start_server(self.model, self.ports[n], ktc, self.log_path(n))
        wait_servers({f"vLLM {n}": (self.url(n), p, self.log_path(n)) for n, p in self.procs.items()}, 900)
        self.cfg = RouterConfig(
            listen="127.0.0.1:0",
            backends=tuple(BackendSpec(n, self.url(n), self.daemons[n].target) for n in ("a", "b")),
            models=(ModelSpec("tiny", self.model, block_size=BLOCK, kv_dtype="float32", dtype="float32",
                              device="cpu", kv_cache_layout="LBHNC"),),
            api_keys=(ApiKey("k-gold", "team", "gold"), ApiKey("k-tight", "team", "tight")),
            classes=(ServiceClass("gold", ttft_slo=600.0), ServiceClass("tight", ttft_slo=0.001)),
            predictor=PredictorSpec(prefill_tokens_per_s=5000.0, prefill_overhead_s=0.02, decode_penalty_s=1.0),
            health_interval=0.2, health_failures=2)
        self.app = build_app(self.cfg)
        self.svc = self.app.state.router
        self.router = ServerThread(self.app).start()
        self.http = httpx.Client(base_url=self.router.url, timeout=300)

    def url(self, n: str) -> str:
        return f"http://127.0.0.1:{self.ports[n]}"

    def log_path(self, n: str) -> str:
        return os.path.join(self.work, f"vllm-{n}.log")

    def post(self, body: dict[str, Any], path: str = "/v1/completions", headers: dict[str, str] = AUTH
             ) -> httpx.Response:
        return self.http.post(path, json=body, headers=headers)

    def engine_counter(self, n: str, name: str) -> float:
        text = httpx.get(f"{self.url(n)}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#"))

    def close(self) -> None:
        self.http.close()
        self.router.stop()
        stop_group(list(self.procs.values()))
        for d in self.daemons.values():
            d.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    require_vllm()
    work = str(tmp_path_factory.mktemp("route-vllm"))
    f = Fleet(work)
    try:
        yield f
    finally:
        f.close()
        shutil.rmtree(work, ignore_errors=True)


def _completion(f: Fleet, prompt: str, n: int = 4, **extra: Any) -> httpx.Response:
    r = f.post({"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r


def test_router_keys_are_the_connectors_keys(fleet: Fleet) -> None:
    r = _completion(fleet, P)
    holder = r.headers["x-kvstore-backend"]
    m = fleet.svc.models["tiny"]
    version = fleet.svc.pool.by_name(holder).engine_version  # the backend's vLLM (its GET /version)
    assert version
    at = keys_at(m, request_tokens(m, Endpoint.COMPLETIONS, {"prompt": P}), version)
    assert at is not None
    ns, keys = at
    assert len(keys) == 5
    with Client(fleet.daemons[holder].target) as c:
        # the connector saved exactly the keys the router computed (same tokens, same namespace)
        assert c.lookup(ns, keys).hit_blocks == 5
        other = Namespace(**{**ns.to_dict(), "block_size": 64})
        assert c.lookup(other, block_keys(other, request_tokens(
            fleet.svc.models["tiny"], Endpoint.COMPLETIONS, {"prompt": P}).tokens[:640])).hit_blocks == 0
    view = fleet.svc.pool.by_name(holder).cache
    wait_until(lambda: len(view.chain_tiers(keys)) == 5, 30, "the router's event view of the holder")


def _settled(f: Fleet) -> None:
    """Wait until the router sees no request running at either backend: vLLM's
    ``/metrics`` (polled every ``health_interval``) can still count a request
    the router saw end, and with this fleet's 1 s decode penalty one such
    stale count outweighs a 5-block hit (seen under a loaded CI machine)."""
    pool = f.svc.pool
    wait_until(lambda: all(pool.by_name(n).running_now() == 0 for n in ("a", "b")), 30,
               "no request running at either backend, as the router sees them")


def test_repeated_prefix_goes_to_the_holder(fleet: Fleet) -> None:
    first = _completion(fleet, P).headers["x-kvstore-backend"]
    for _ in range(2):
        _settled(fleet)
        r = _completion(fleet, P + " w5 w6")
        assert r.headers["x-kvstore-backend"] == first
        assert int(r.headers["x-kvstore-hit-tokens"]) == 5 * BLOCK


def test_loaded_holder_sends_the_request_elsewhere(fleet: Fleet) -> None:
    holder = _completion(fleet, P).headers["x-kvstore-backend"]
    other = "b" if holder == "a" else "a"
    stop = threading.Event()
    streams: list[threading.Thread] = []

    def busy(i: int) -> None:  # a long generation straight at the holder (not through the router)
        body = {"model": "tiny", "prompt": f"w{10 + i} w11 w12", "max_tokens": 1500, "min_tokens": 1500,
                "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=300) as c, c.stream("POST", f"{fleet.url(holder)}/v1/completions", json=body) as s:
            for _ in s.iter_raw():
                if stop.is_set():
                    return

    for i in range(3):
        t = threading.Thread(target=busy, args=(i,), daemon=True)
        t.start()
        streams.append(t)
    try:
        b = fleet.svc.pool.by_name(holder)
        wait_until(lambda: b.engine.running >= 3, 120, "vLLM's /metrics to show 3 running on the holder")
        r = _completion(fleet, P)
        assert r.headers["x-kvstore-backend"] == other, r.headers
        assert r.headers["x-kvstore-runner-up"].startswith(f"{holder}=")
    finally:
        stop.set()
        for t in streams:
            t.join(60)
    wait_until(lambda: fleet.svc.pool.by_name(holder).engine.running == 0, 120, "the holder to drain")


def test_predicted_slo_miss_is_429_and_no_backend_sees_it(fleet: Fleet) -> None:
    before = {n: fleet.engine_counter(n, "vllm:prompt_tokens_total") for n in ("a", "b")}
    r = fleet.post({"model": "tiny", "prompt": R, "max_tokens": 4}, headers={"authorization": "Bearer k-tight"})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "slo"
    assert {n: fleet.engine_counter(n, "vllm:prompt_tokens_total") for n in ("a", "b")} == before


def test_answers_equal_the_backends_direct_answers(fleet: Fleet) -> None:
    body = {"model": "tiny", "prompt": R, "max_tokens": 8, "temperature": 0}
    r = fleet.post(body)
    direct = httpx.post(f"{fleet.url(r.headers['x-kvstore-backend'])}/v1/completions", json=body, timeout=300)
    assert r.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]

    def streamed(url: str, headers: dict[str, str], path: str, b: dict[str, Any]) -> tuple[str, str]:
        out, via = [], ""
        with httpx.Client(timeout=300) as c, c.stream("POST", url + path, json={**b, "stream": True},
                                                      headers=headers) as s:
            via = s.headers.get("x-kvstore-backend", "")
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    ch = json.loads(line[6:])["choices"]
                    if ch:
                        out.append(ch[0].get("text") or ch[0].get("delta", {}).get("content") or "")
        return "".join(out), via

    text, via = streamed(fleet.router.url, AUTH, "/v1/completions", body)
    assert text == streamed(fleet.url(via), {}, "/v1/completions", body)[0] == r.json()["choices"][0]["text"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": R}], "max_tokens": 8, "temperature": 0}
    rc = fleet.post(chat, path="/v1/chat/completions")
    assert rc.status_code == 200, rc.text
    dc = httpx.post(f"{fleet.url(rc.headers['x-kvstore-backend'])}/v1/chat/completions", json=chat, timeout=300)
    assert rc.json()["choices"][0]["message"]["content"] == dc.json()["choices"][0]["message"]["content"]
    ctext, cvia = streamed(fleet.router.url, AUTH, "/v1/chat/completions", chat)
    assert ctext == streamed(fleet.url(cvia), {}, "/v1/chat/completions", chat)[0]


def test_bad_input_gets_4xx_and_the_router_keeps_serving(fleet: Fleet) -> None:
    bad = fleet.http.post("/v1/completions", content=b"{not json", headers={**AUTH, "content-type": "application/json"})
    assert bad.status_code == 400
    assert fleet.post({"model": "other", "prompt": R}).status_code == 404
    huge = " ".join(["w7"] * 2100)
    r = fleet.post({"model": "tiny", "prompt": huge, "max_tokens": 4})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    assert fleet.post({"model": "tiny", "prompt": R}, headers={}).status_code == 401
    assert fleet.post({"model": "tiny", "prompt": R}, headers={"authorization": "Bearer nope"}).status_code == 401
    _completion(fleet, R)


def test_killed_backend_new_requests_still_succeed(fleet: Fleet) -> None:
    first = _completion(fleet, P).headers["x-kvstore-backend"]
    kill_group(fleet.procs[first])  # the API server and its engine core
    wait_until(lambda: not group_alive(fleet.procs[first]), 30, "the killed backend's engine core to exit")
    for i in range(3):  # P's holder is dead: the first may be retried, the rest skip it
        r = _completion(fleet, P + f" w{20 + i}")
        assert r.headers["x-kvstore-backend"] != first
    wait_until(lambda: not fleet.svc.pool.by_name(first).healthy, 30, "the dead backend to leave the pool")
